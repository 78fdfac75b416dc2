"""FML, Federated Mutual Learning (Shen et al., 2020): a private model and a shared "meme"
model teach each other on every client; only the meme model is averaged.

Client i holds its private model theta_i (its own architecture) and a copy of the meme model
phi (one architecture for everyone, ``fedapp.runtime.two_models``). With p = softmax(o_theta)
and q = softmax(o_phi), both in train mode, each batch trains

    L_theta = alpha * CE(o_theta, y) + (1 - alpha) * KL(q || p)
    L_phi   = beta  * CE(o_phi, y)   + (1 - beta)  * KL(p || q)

as in deep mutual learning, each model's KL holding its partner's prediction constant; their sum
is stepped once, each model by its own optimizer. phi restarts every round from the server's
copy; the server averages the uploaded phi weighted by training-set size. The private model
alone predicts. The whole meme model travels each way every round.

Named departures to reproduce HtFLlib's ``clientfml``: ``fml.detach-partner = false`` (both KL
terms reach both models), ``fml.kl = "mean"`` (KLDivLoss's default, 1/C of the batch-mean KL),
``fml.average = "uniform"``, and ``alpha = beta = 1`` (its defaults, which switch mutual
learning off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedapp.runtime.two_models import SharedModelStrategy, TwoModelClient, kl_to
from strategies.fml import FMLSettings


def mutual_losses(o_private: torch.Tensor, o_meme: torch.Tensor, y: torch.Tensor,
                  settings: FMLSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_theta, L_phi) on one batch of the two models' logits."""
    s = settings
    private_target = o_private.detach() if s.detach_partner else o_private
    meme_target = o_meme.detach() if s.detach_partner else o_meme
    l_private = (s.alpha * F.cross_entropy(o_private, y)
                 + (1 - s.alpha) * kl_to(meme_target, o_private, s.kl))
    l_meme = (s.beta * F.cross_entropy(o_meme, y)
              + (1 - s.beta) * kl_to(private_target, o_meme, s.kl))
    return l_private, l_meme


class FMLClient(TwoModelClient):
    """Installs the meme model, trains both models mutually, uploads the meme model."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        l_private, l_meme = mutual_losses(self.model(x), self.shared(x), y, self.cfg.settings)
        return l_private + l_meme


class FML(SharedModelStrategy):
    """Sends the meme model; averages the uploaded ones."""
