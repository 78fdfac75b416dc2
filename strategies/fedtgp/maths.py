"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive margin.

FedProto (``strategies.fedproto``) with a server that *learns* the global prototypes. A client
trains with FedProto's ``CE(h(z), y) + lambda * MSE(z, P[y])`` and uploads its class prototypes
(eval-mode mean of ``z = g_k(x)`` per local class, computed after training) with their labels:
K_k * (d + 1) numbers. The server keeps a small network, the TGP, mapping a class id to a
prototype: ``Embedding(C, d) -> Linear(d, d) + ReLU -> Linear(d, d)``. Each round it

1. averages each class's uploads over the clients that sent it (``Q_c``, each client once);
2. takes the class gaps ``gap_c = min_{c' != c} ||Q_c - Q_c'||`` (a class without a neighbour
   this round takes the smallest gap) and the margin ``delta = min(max_c gap_c, tau)``;
3. trains the TGP with a new SGD for ``server-epochs`` epochs over the shuffled (prototype,
   label) pairs in batches of ``server-batch-size``, on ``CE(-(D + delta * onehot(y)), y)``
   with ``D_bc = ||p_b - TGP(c)||``: each prototype must be nearer its own class's global
   prototype than any other's by the margin;
4. sends ``P[c] = TGP(c)`` for every class: C * d numbers, the same to everyone.

The paper's inference is the nearest global prototype to ``z`` (FedProto's nearest-prototype
rule: ``fedtgp.eval-rule = "nearest-prototype"``); the default headline is the model's own
head, chosen by measurement (docs/recipes.md), and both are reported.

Deviations from the reference code, each a setting where it changes numbers:
- The code's clients upload the prototypes of the model *before* the round's training
  (``collect_protos`` reloads the saved model before the trained one is saved); we compute them
  after training, as the paper. ``fedtgp.pre-training-prototypes = true`` is the code's.
- The code's distance is an unclamped square root, whose gradient is NaN at distance 0; ours is
  clamped (no setting: it only differs where the code breaks).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import TrainStats, one_thread
from fedapp.seeding import derive_seed, isolated_rng
from strategies.fedproto.maths import FedProtoClient
from strategies.fedtgp import FedTGPSettings


class TrainableGlobalPrototypes(torch.nn.Module):
    """Class id -> prototype: ``Embedding(C, d) -> Linear(d, h) + ReLU -> Linear(h, d)``."""

    def __init__(self, num_classes: int, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or dim
        self.embedding = torch.nn.Embedding(num_classes, dim)
        self.middle = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU())
        self.out = torch.nn.Linear(hidden, dim)

    def forward(self, class_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.middle(self.embedding(class_ids)))


def adaptive_margin(prototypes: np.ndarray, labels: np.ndarray, num_classes: int,
                    tau: float) -> tuple[float, np.ndarray]:
    """(delta, gaps [C]): ``gap_c`` is the distance from class c's mean upload ``Q_c`` to the
    nearest other class's; a class without one (absent, or alone) takes the smallest gap; with
    no pair at all every gap is infinite and delta is tau. ``delta = min(max gap, tau)``."""
    present = np.unique(labels)
    means = np.stack([prototypes[labels == c].astype(np.float64).mean(0) for c in present])
    gaps = np.full(num_classes, np.inf)
    if len(present) > 1:
        dist = np.linalg.norm(means[:, None] - means[None], axis=-1)
        np.fill_diagonal(dist, np.inf)
        gaps[present] = dist.min(1)
        gaps[np.isinf(gaps)] = gaps.min()
    return float(min(gaps.max(), tau)), gaps


def margin_loss(prototypes: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor,
                delta: float) -> torch.Tensor:
    """``CE(-(D + delta * onehot(y)), y)`` with ``D_bc = ||p_b - centers_c||`` (the square root
    clamped away from 0, where its gradient is infinite)."""
    dist = (prototypes[:, None] - centers[None]).pow(2).sum(-1).clamp_min(1e-12).sqrt()
    onehot = F.one_hot(labels, centers.shape[0]).to(dist.dtype)
    return F.cross_entropy(-(dist + delta * onehot), labels)


def train_tgp(tgp: TrainableGlobalPrototypes, prototypes: np.ndarray, labels: np.ndarray,
              delta: float, settings: FedTGPSettings, seed: int) -> None:
    """``server-epochs`` epochs of SGD (a new optimizer, as the code) with :func:`margin_loss`
    over the shuffled pairs, in a seeded order."""
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.from_numpy(prototypes), torch.from_numpy(labels.astype(np.int64))
    classes = torch.arange(tgp.embedding.num_embeddings)
    optimizer = torch.optim.SGD(tgp.parameters(), lr=settings.server_lr)
    tgp.train()
    with one_thread():  # a tiny network: far faster on one thread than on a busy CPU
        for _ in range(settings.server_epochs):
            order = torch.randperm(len(y), generator=generator)
            for start in range(0, len(y), settings.server_batch_size):
                batch = order[start:start + settings.server_batch_size]
                loss = margin_loss(x[batch], y[batch], tgp(classes), delta)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()


class FedTGPClient(FedProtoClient):
    """FedProto's client (its loss and nearest-prototype evaluation) with every class's global
    prototype from the server and prototypes uploaded with plain labels."""

    def receive(self, payload: Payload, server_round: int) -> None:
        c, d = self.num_classes, self.model.feature_dim
        self.global_prototypes = torch.zeros(c, d, device=self.device)
        self.has_prototype = torch.zeros(c, dtype=torch.bool, device=self.device)
        if payload:  # nothing before the first server step: plain cross-entropy
            self.global_prototypes = torch.from_numpy(payload["prototypes"]).to(self.device)
            self.has_prototype[:] = True

    def during_training(self) -> bool:
        return False  # exact class means, after training or (code parity) before it

    def train(self, server_round: int) -> TrainStats:
        if self.cfg.settings.pre_training_prototypes:
            self.before_training = self.prototypes()
        return super().train(server_round)

    def upload(self) -> Payload:
        protos = getattr(self, "before_training", None)
        protos = protos if protos is not None else self.prototypes()
        return {"prototypes": protos.means, "labels": protos.labels}


class FedTGP(FedStrategy):
    """Trains the global prototypes on the round's uploads; sends every class's to everyone."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedTGPSettings = self.cfg.settings
        self.feature_dim = self.new_model(self.architectures[0]).feature_dim
        with isolated_rng(derive_seed(self.server_seed, "fedtgp-init")):
            self.tgp = TrainableGlobalPrototypes(self.num_classes, self.feature_dim)
        self.margin = None  # delta of the last round (a diagnostic)
        self._payload: Payload = {}

    @property
    def server_seed(self) -> int:
        """The key of the TGP's start and shuffles. HtFLlib's server draws both from torch's
        global stream, which its last client re-seeds with 0 (clienttgp.py:13) and nothing
        else draws from differently: the same in every run of it, whatever the seed."""
        return self.cfg.seed if self.settings.server_seed < 0 else self.settings.server_seed

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload  # empty before the first server step

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"prototypes": ArraySpec((None, self.feature_dim)), "labels": self.label_spec()}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        labels = payload["labels"]
        if len(labels) != len(payload["prototypes"]) or len(labels) == 0:
            raise PayloadError(f"{len(payload['prototypes'])} prototypes for {len(labels)} "
                               "labels")
        if len(np.unique(labels)) != len(labels):
            raise PayloadError("a class appears twice among the labels")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        prototypes = np.concatenate([u.payload["prototypes"] for u in uploads])
        labels = np.concatenate([u.payload["labels"] for u in uploads])
        owners = np.concatenate([np.full(len(u.payload["labels"]), u.client.partition_id)
                                 for u in uploads])
        # A robust rule drops outlying prototypes per class: the margin's class means and the
        # TGP's training set are then both over the kept ones.
        prototypes, keep = self.training_pairs(prototypes, labels, owners)
        prototypes, labels = prototypes[keep], labels[keep]
        self.margin, _ = adaptive_margin(prototypes, labels, self.num_classes,
                                         self.settings.margin)
        train_tgp(self.tgp, prototypes, labels, self.margin, self.settings,
                  derive_seed(self.server_seed, "fedtgp-server", server_round))
        self.tgp.eval()
        with torch.no_grad():
            self._payload = {"prototypes": self.tgp(torch.arange(self.num_classes)).numpy()
                             .astype(np.float32)}
