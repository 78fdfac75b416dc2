"""Velo (Chan & Ngai, Computer Networks): Felo whose server learns the features with a
conditional VAE and sends a synthetic feature per class instead of the plain mean.

Clients are Felo's, unchanged (same loss, same upload). The server keeps Felo's per-class store
and logit means; every ``retrain-every`` rounds (the paper's Table 4 interval, 1..10) it trains
a CVAE (Sohn et al., 2015) on the stored (feature, label) pairs, minimising the negative ELBO
of the paper's Eq. 2 with one reparameterised sample:
``MSE(dec(z, y), s) + kl-weight * KL(N(mu, sigma^2) || N(0, I))``, ``z = mu + sigma * eps``.
Then, every round, it decodes one feature per class from a fresh ``z ~ N(0, I)`` and sends it
as ``s[c]`` (logits stay Felo's per-class means). Until the CVAE has trained once (it needs at
least two stored features) the server sends Felo's means.

The CVAE has the paper's four dense layers, laid out as the authors' code: a label embedding
``Embedding(C, e)``; encoder ``Linear(d + e, h) -> BatchNorm1d -> ReLU -> Linear(h, 2 * latent)``
split into (mu, log sigma^2); decoder ``Linear(latent + e, h) -> Linear(h, d)`` with no
activation in between (``cvae-decoder-relu`` adds one). The reconstruction is the mean squared
error over the batch's entries and the KL is summed over the batch and the latent dimensions,
unweighted, as in the code. Sizes: the code ties hidden and latent size to d (``0`` = d here)
and embeds labels in 512 dimensions, which is absurd for the small d a CPU run uses, so the
embedding defaults to 32. Adam (lr 1e-3, fresh at each retraining as in the code), 10 epochs,
batches of 50, as the code. All of it is seeded: the initialisation by (seed), the training's
batch order and noise by (seed, round), the decoded z by (seed, round).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedapp.seeding import derive_seed, isolated_rng
from strategies.felo.maths import Felo, FeloClient
from strategies.velo import VeloSettings


class CVAE(nn.Module):
    """Conditional VAE on (mid-level feature s, label y): q(z | s, y) and p(s | z, y)."""

    def __init__(self, feature_dim: int, num_classes: int, hidden: int, latent: int,
                 embedding: int, decoder_relu: bool = False) -> None:
        super().__init__()
        self.latent = latent
        self.label_embedding = nn.Embedding(num_classes, embedding)
        self.encoder = nn.Sequential(nn.Linear(feature_dim + embedding, hidden),
                                     nn.BatchNorm1d(hidden), nn.ReLU(),
                                     nn.Linear(hidden, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent + embedding, hidden),
                                     *([nn.ReLU()] if decoder_relu else []),
                                     nn.Linear(hidden, feature_dim))

    def encode(self, s: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, log sigma^2) of q(z | s, y)."""
        out = self.encoder(torch.cat([s, self.label_embedding(y)], 1))
        return out[:, :self.latent], out[:, self.latent:]

    def decode(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The feature the decoder makes of latent ``z`` for labels ``y``."""
        return self.decoder(torch.cat([z, self.label_embedding(y)], 1))

    def forward(self, s: torch.Tensor, y: torch.Tensor, eps: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstruction of ``s`` through ``z = mu + sigma * eps``, with mu and log sigma^2."""
        mu, logvar = self.encode(s, y)
        return self.decode(mu + torch.exp(0.5 * logvar) * eps, y), mu, logvar


def cvae_loss(recon: torch.Tensor, s: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
              kl_weight: float) -> torch.Tensor:
    """Negative ELBO as the code computes it: mean squared error + kl_weight * KL, the KL in
    closed form and summed over the batch and latent dimensions."""
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, s) + kl_weight * kl


def train_cvae(cvae: CVAE, features: np.ndarray, labels: np.ndarray, settings: VeloSettings,
               seed: int) -> bool:
    """``cvae-epochs`` passes of Adam over the (feature, label) pairs in shuffled batches, the
    batch order and the reparameterisation noise from ``seed``. A batch of one is skipped
    (BatchNorm needs two). Returns whether any step was taken."""
    generator = torch.Generator().manual_seed(seed)
    s_all, y_all = torch.from_numpy(features), torch.from_numpy(labels)
    optimizer = torch.optim.Adam(cvae.parameters(), lr=settings.cvae_lr)
    cvae.train()
    stepped = False
    for _ in range(settings.cvae_epochs):
        order = torch.randperm(len(y_all), generator=generator)
        for start in range(0, len(order), settings.cvae_batch_size):
            idx = order[start:start + settings.cvae_batch_size]
            if len(idx) < 2:
                continue
            eps = torch.randn(len(idx), cvae.latent, generator=generator)
            recon, mu, logvar = cvae(s_all[idx], y_all[idx], eps)
            loss = cvae_loss(recon, s_all[idx], mu, logvar, settings.cvae_kl_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stepped = True
    return stepped


@torch.no_grad()
def generate(cvae: CVAE, labels: np.ndarray, seed: int, samples: int = 1) -> np.ndarray:
    """``samples`` decoded features per label, each from a fresh ``z ~ N(0, I)`` drawn from
    ``seed``: shape ``[len(labels) * samples, d]``, label-major."""
    cvae.eval()
    y = torch.from_numpy(np.repeat(labels.astype(np.int64), samples))
    z = torch.randn(len(y), cvae.latent, generator=torch.Generator().manual_seed(seed))
    return cvae.decode(z, y).numpy().astype(np.float32)


class VeloClient(FeloClient):
    """Velo's client is Felo's: the difference is only on the server."""


class Velo(Felo):
    """Felo's server with a CVAE that turns the stored features into one synthetic feature per
    class and round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s, d = self.settings, self.feature_dim
        with isolated_rng(derive_seed(self.cfg.seed, "velo-cvae")):
            self.cvae = CVAE(d, self.num_classes, s.cvae_hidden or d, s.cvae_latent or d,
                             s.cvae_embedding, s.cvae_decoder_relu)
        self.cvae_trained = False

    def class_features(self, server_round: int, labels: np.ndarray,
                       means: np.ndarray) -> np.ndarray:
        if (server_round - 1) % self.settings.retrain_every == 0:
            features, feature_labels = self.store.feature_dataset()
            # A robust rule drops outlying stored features per class (whose they are, the
            # store does not keep) before the CVAE learns from them.
            features, keep = self.training_pairs(features, feature_labels)
            features, feature_labels = features[keep], feature_labels[keep]
            self.cvae_trained |= train_cvae(self.cvae, features, feature_labels, self.settings,
                                            derive_seed(self.cfg.seed, "velo-cvae-train",
                                                        server_round))
        if not self.cvae_trained:
            return means
        return generate(self.cvae, labels, derive_seed(self.cfg.seed, "velo-z", server_round))
