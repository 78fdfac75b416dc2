"""DS-FL (Itahara, Nishio, Koda, Morikura, Yamamoto, IEEE TMC 2021): distillation-based
semi-supervised federated learning with entropy-reduction averaging.

Every party holds the same unlabelled open set (``public-source``, read without its labels);
nothing of a model travels, so any architecture with the same C outputs takes part. The round
of SCARLET's DS-FL (``algorithm/dsfl.py``, the DS-FL group's code), which this follows:

1. the server sends the global soft labels q of the last round with their open indices, and
   the round's ``next_indices`` A_t (``dsfl.open-size`` open samples, redrawn every round);
2. *distil*: each client fits q on its open samples, ``kd_epochs`` passes in batches of
   ``kd_batch_size`` in the samples' order, loss KL(q || softmax(o)) averaged over the batch
   (its own optimizer at ``kd_lr``, kept across rounds);
3. *local update*: cross-entropy on its private data (the recipe: 5 epochs of 100, SGD 0.1);
4. *predict*: softmax(o) of its model in eval mode on A_t, uploaded;
5. *aggregate*: per open sample the mean over the senders, p̄ = (1/K) sum_k p_k, then ERA,
   q = softmax(p̄ / T) with T = 0.1 (``dsfl.aggregation = "sa"``: q = p̄, the paper's simple
   averaging);
6. the server model distils on (A_t, q) as the clients do (plain SGD at ``kd_lr``), and is
   scored on the global test set (``server_predict``).

A Flower round is one message each way, so round t's message carries q of round t-1 with the
indices of A_{t-1} (the server names them: after a round without uploads they are older), and
the client distils, updates and predicts on A_t, which it draws itself from the generator keyed
by ``(seed, "dsfl-open", t)`` (:func:`open_set`) as the server does: A_t is never sent. Round t
costs a client down m int32 indices + m*C float32 soft labels (nothing in round 1), up m*C
float32 probabilities, with m = ``dsfl.open-size``.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from fedapp.data import setup
from fedapp.data.public import round_subset
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import EVAL_BATCH, TrainStats, train_epochs, train_recipe
from fedapp.seeding import derive_seed, isolated_rng
from strategies.dsfl import DSFLSettings

# How far a row of uploaded probabilities may sum from 1: float32 softmax is within 1e-6, a
# sender's half-precision copy within 5e-4 (the wire converts it; the values stay the same).
SUM_TOLERANCE = 1e-3


def open_set(seed: int, server_round: int, public_size: int, size: int) -> np.ndarray:
    """The round's subset, keyed by ``(seed, "dsfl-open", round)``."""
    return round_subset(seed, "dsfl-open", server_round, public_size, size)


def entropy_reduction(mean: np.ndarray, temperature: float) -> np.ndarray:
    """ERA: q = softmax(p̄ / T) per row, applied to the averaged *probabilities*; T < 1
    sharpens them (lower entropy), T = 1 would flatten them."""
    return torch.softmax(torch.from_numpy(np.asarray(mean, np.float64)) / temperature,
                         dim=1).numpy().astype(np.float32)


def distillation_loss(logits: torch.Tensor, soft_labels: torch.Tensor) -> torch.Tensor:
    """KL(q || softmax(o)), summed over classes and averaged over the batch (PyTorch's
    ``batchmean``, as SCARLET's ``distill``)."""
    return F.kl_div(F.log_softmax(logits, 1), soft_labels, reduction="batchmean")


def distil(model: torch.nn.Module, x: torch.Tensor, soft_labels: torch.Tensor,
           optimizer: torch.optim.Optimizer, settings: DSFLSettings,
           grad_clip: float = 0.0) -> TrainStats:
    """``kd_epochs`` passes over (x, q) in batches of ``kd_batch_size``, in the open samples'
    order every pass (SCARLET's unshuffled loaders), so that no generator is drawn from."""
    return train_epochs(model, x, soft_labels,
                        loss_fn=lambda xb, qb: distillation_loss(model(xb), qb),
                        optimizer=optimizer, epochs=settings.kd_epochs,
                        batch_size=settings.kd_batch_size, grad_clip=grad_clip,
                        generator=torch.Generator(), shuffle=False)


@torch.no_grad()
def probabilities(model: torch.nn.Module, x: torch.Tensor,
                  temperature: float = 1.0) -> np.ndarray:
    """softmax(o / T) of ``model`` in eval mode, float32 [N, C]: what a client uploads
    (DS-FL: T = 1; KT-pFL's soft predictions: its temperature)."""
    model.eval()
    return torch.cat([torch.softmax(model(x[i:i + EVAL_BATCH]).float() / temperature, 1)
                      for i in range(0, len(x), EVAL_BATCH)]).cpu().numpy()


def check_probabilities(p: np.ndarray) -> None:
    """Refuse (PayloadError) rows that are not probability vectors: every value in [0, 1],
    each row summing to 1 within SUM_TOLERANCE. A sender then moves each entry of a convex
    combination of the uploads by at most its own weight."""
    p = np.asarray(p, np.float64)
    if p.size and (p.min() < 0.0 or p.max() > 1.0 + SUM_TOLERANCE):
        raise PayloadError("probabilities outside [0, 1]")
    sums = p.sum(axis=-1)
    if p.size and np.abs(sums - 1.0).max() > SUM_TOLERANCE:
        row = int(np.argmax(np.abs(sums - 1.0)))
        raise PayloadError(f"row {row} of the probabilities sums to {sums.flat[row]:.6g}, "
                           "not 1")


class DSFLClient(FedClient):
    """Distil the last global soft labels, update on private data, predict on A_t."""

    @property
    def settings(self) -> DSFLSettings:
        return self.cfg.settings

    def receive(self, payload: Payload, server_round: int) -> None:
        self.labels_at = self.soft_labels = None
        if payload:
            self.labels_at = torch.from_numpy(payload["indices"].astype(np.int64))
            self.soft_labels = torch.from_numpy(payload["soft-labels"]).float().to(self.device)

    def train(self, server_round: int) -> TrainStats:
        s, x_open = self.settings, setup.public_on(self.cfg, str(self.device))[0]
        self.distilled = None
        if self.soft_labels is not None:
            self.distilled = distil(self.model, x_open[self.labels_at.to(self.device)],
                                    self.soft_labels,
                                    self.optimizer(name="distil", lr=s.kd_lr), s,
                                    self.cfg.grad_clip)
        stats = train_recipe(self.model, self.data.train_x, self.data.train_y,
                             loss_fn=lambda xb, yb: F.cross_entropy(self.model(xb), yb),
                             optimizer=self.optimizer(), cfg=self.cfg,
                             generator=self.batch_generator(server_round))
        now = open_set(self.cfg.seed, server_round, len(x_open), s.open_size)
        self.probabilities = probabilities(
            self.model, x_open[torch.from_numpy(now.astype(np.int64)).to(self.device)])
        return stats

    def upload(self) -> Payload:
        return {"probabilities": self.probabilities}

    def secure_weight(self) -> float:
        return 1.0  # p̄ is the senders' plain mean (DSFL.aggregate)

    def fit_metrics(self) -> dict:
        return {} if self.distilled is None else {"term-distil": self.distilled.loss}


def largest_architecture(strategy: FedStrategy) -> str:
    """The run's architecture with the most parameters (the first of ``arch-mix`` on a tie)."""
    names = list(dict.fromkeys(strategy.cfg.architectures))
    if len(names) == 1:
        return names[0]
    sizes = [sum(p.numel() for p in strategy.new_model(name).parameters()) for name in names]
    return names[int(np.argmax(sizes))]


class DSFL(FedStrategy):
    """Averages the round's probabilities on A_t, sharpens them (ERA), sends them with A_t's
    indices and distils its own server model on them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: DSFLSettings = self.cfg.settings
        self.public_size = len(setup.public_set(self.cfg, labels=False))
        self.server_arch = self.settings.server_arch or largest_architecture(self)
        self.server_model = self.new_model(self.server_arch)
        # {indices [m] int32, soft-labels [m, C]}: one round's q, all the server keeps of the
        # uploads (empty in round 1).
        self.payload: Payload = {}

    def open_indices(self, server_round: int) -> np.ndarray:
        return open_set(self.cfg.seed, server_round, self.public_size, self.settings.open_size)

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.payload  # one object for everyone: encoded once

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"probabilities": ArraySpec((self.settings.open_size, self.num_classes))}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        # Probability vectors only: a client then moves each p̄ entry by at most 1/K.
        check_probabilities(payload["probabilities"])

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        # p̄: each sender counts once (SCARLET's mean over the senders of each index; every
        # sender scored all of A_t); a robust-aggregation rule replaces the mean.
        mean = self.average([u.payload for u in uploads], [1.0] * len(uploads),
                            what="the clients' probabilities")["probabilities"]
        soft_labels = (entropy_reduction(mean, self.settings.temperature)
                       if self.settings.aggregation == "era" else mean.astype(np.float32))
        indices = self.open_indices(server_round)
        self.payload = {"indices": indices, "soft-labels": soft_labels}
        self.distil_server_model(server_round, indices, soft_labels)

    def distil_server_model(self, server_round: int, indices: np.ndarray,
                            soft_labels: np.ndarray) -> TrainStats:
        """The server model's step on (open[A_t], q): the clients' distillation, plain SGD at
        ``kd_lr`` (stateless: a fresh optimizer per round is SCARLET's kept one)."""
        x = setup.public_set(self.cfg, labels=False).x[torch.from_numpy(indices.astype(np.int64))]
        optimizer = torch.optim.SGD(self.server_model.parameters(), lr=self.settings.kd_lr)
        # Dropout, if the architecture has any, draws from torch's global generator: keyed.
        with isolated_rng(derive_seed(self.cfg.seed, "dsfl-server", server_round)):
            return distil(self.server_model, x, torch.from_numpy(soft_labels), optimizer,
                          self.settings)

    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.server_model.eval()
        return {"server": self.server_model(x)}
