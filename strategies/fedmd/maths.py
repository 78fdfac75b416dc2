"""FedMD (Li & Wang, NeurIPS 2019 workshop): heterogeneous models that agree on a public set.

Every party holds the same public set P (``public-source``); nothing of a model travels, so any
architecture with the same C outputs takes part. The authors' round t:

1. *communicate*: each party scores the alignment set A_t (``fedmd.alignment-size`` public
   samples, redrawn every round) with its model in inference mode, pre-softmax: o_k(x) in R^C;
2. *aggregate*: the server's consensus is the unweighted mean over the parties,
   õ(x) = (1/K) sum_k o_k(x) (here over the round's accepted uploads: sums only);
3. *digest*: each party fits õ on A_t, one epoch in batches of 256, MAE (Adam 1e-3, its own
   optimizer kept across rounds);
4. *revisit*: each party trains on its private data (cross-entropy; Adam 1e-3, kept), as the
   method's recipe says (``batch-size`` 5, ``local-epochs`` 2: the FEMNIST conf). The code's
   revisit continues the Adam of the private pre-training (one ``compile()`` before it);
   here it starts at the first revisit unless ``fedmd.revisit-optimizer =
   "private-pretraining"``.

A Flower round is one message each way, so the steps are laid across rounds: round t's message
carries the consensus of round t-1 with the indices of A_{t-1}; the client digests it, revisits,
then scores A_t and uploads the logits. The server and the client both draw A_t from the
generator keyed by ``(seed, "fedmd-alignment", t)`` (:func:`alignment_set`), so it need not be
sent: down m indices + m*C floats, up m*C floats. The authors' sequence, transfer learning ->
(communicate, aggregate, digest, revisit) x R, is then exactly: round 1 = transfer learning and
scores on A_1; round t >= 2 = digest of A_{t-1}, revisit, scores on A_t (the last round's scores
are aggregated and not digested). A round-1 message has no consensus; without private
pre-training (``fedmd.pretrain`` other than "public+private") the client revisits there too, so
that its first scores come from a model trained on its own data.

Before a client's first digest it runs the transfer-learning phase (``fedmd.pretrain``): on
the labelled public set (up to 20 epochs, batch 128, patience 3), then on its private data (up
to 25 epochs, batch 32, patience 10), a fresh Adam each, with early stopping on a held-out share
of that same training data (the code monitors the test set: never here). As Keras'
``EarlyStopping`` without ``restore_best_weights``, training stops and keeps its last weights.

``fedmd.digest-epochs = 0`` skips the digest: a client then has FedMD's transfer learning and
revisits and nothing of the others, the control that tells what the consensus adds from what
the transfer learning adds (Private has neither).
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord

from fedapp.data import setup
from fedapp.data.public import round_subset
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import (EVAL_BATCH, TrainStats, evaluate, recipe_optimizer,
                                     train_epochs, train_recipe)
from fedapp.seeding import derive_seed
from strategies import public_labels
from strategies.fedmd import FedMDSettings

PRETRAINED_KEY = "fedmd.pretrained"  # in context.state once the transfer learning is done
MIN_DELTA = 0.001  # the code's EarlyStopping(min_delta=0.001)


def alignment_set(seed: int, server_round: int, public_size: int, size: int) -> np.ndarray:
    """The round's subset, keyed by ``(seed, "fedmd-alignment", round)``."""
    return round_subset(seed, "fedmd-alignment", server_round, public_size, size)


def digest_loss(logits: torch.Tensor, consensus: torch.Tensor, kind: str) -> torch.Tensor:
    """The digest's distance of ``logits`` [B, C] to the consensus [B, C]: Keras' MAE (the
    mean of |o - õ| over classes and batch), MSE, or KL(softmax(õ) || softmax(o)) per sample,
    averaged over the batch."""
    if kind == "mae":
        return F.l1_loss(logits, consensus)
    if kind == "mse":
        return F.mse_loss(logits, consensus)
    return F.kl_div(F.log_softmax(logits, 1), F.log_softmax(consensus, 1), log_target=True,
                    reduction="batchmean")


@torch.no_grad()
def scores(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    """Pre-softmax outputs of ``model`` in inference mode, float32 [N, C]."""
    model.eval()
    return torch.cat([model(x[i:i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)]
                     ).float().cpu().numpy()


class FedMDClient(FedClient):
    """Transfer learning once; then digest the consensus, revisit, score A_t."""

    @property
    def settings(self) -> FedMDSettings:
        return self.cfg.settings

    def public(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return setup.public_on(self.cfg, str(self.device), public_labels(self.cfg))

    def receive(self, payload: Payload, server_round: int) -> None:
        self.consensus_at = self.consensus = None
        if payload:
            self.consensus_at = torch.from_numpy(payload["indices"].astype(np.int64))
            self.consensus = torch.from_numpy(payload["consensus"]).float().to(self.device)

    def train(self, server_round: int) -> TrainStats:
        s, x_pub = self.settings, self.public()[0]
        pretrained = False
        if s.pretrain != "none" and PRETRAINED_KEY not in self.context.state:
            self.pretrain()
            self.context.state[PRETRAINED_KEY] = ConfigRecord({"done": True})
            pretrained = True
        stats = TrainStats(0.0, 0, 0)
        self.digest = None
        if self.consensus is not None and s.digest_epochs > 0:
            x = x_pub[self.consensus_at.to(self.device)]
            self.digest = train_epochs(
                self.model, x, self.consensus,
                loss_fn=lambda xb, tb: digest_loss(self.model(xb), tb, s.digest_loss),
                optimizer=self.optimizer(name="digest"), epochs=s.digest_epochs,
                batch_size=s.digest_batch_size, grad_clip=self.cfg.grad_clip,
                generator=self.batch_generator(server_round, "fedmd-digest"))
            stats = self.digest
        if self.consensus is not None or not (pretrained and s.pretrain == "public+private"):
            stats = train_recipe(self.model, self.data.train_x, self.data.train_y,
                                 loss_fn=lambda xb, yb: F.cross_entropy(self.model(xb), yb),
                                 optimizer=self.optimizer(name="revisit"), cfg=self.cfg,
                                 generator=self.batch_generator(server_round))
        alignment = alignment_set(self.cfg.seed, server_round, len(x_pub), s.alignment_size)
        self.logits = scores(self.model, x_pub[torch.from_numpy(alignment.astype(np.int64))
                                                .to(self.device)])
        return stats

    def pretrain(self) -> None:
        """The transfer-learning phase: the labelled public set, then (public+private) the
        private training data, each with early stopping on a held-out share of itself."""
        s = self.settings
        x_pub, y_pub = self.public()
        self._fit_with_early_stopping("public", x_pub, y_pub, s.pretrain_public_epochs,
                                      s.pretrain_public_batch_size, s.pretrain_public_patience)
        if s.pretrain == "public+private":
            self._fit_with_early_stopping(
                "private", self.data.train_x, self.data.train_y, s.pretrain_private_epochs,
                s.pretrain_private_batch_size, s.pretrain_private_patience)

    def _fit_with_early_stopping(self, phase: str, x: torch.Tensor, y: torch.Tensor,
                                 epochs: int, batch_size: int, patience: int) -> None:
        s = self.settings
        fraction = s.early_stopping_fraction
        # The held-out share: the public one is the same for every client, a shard's its own.
        owner = "all" if phase == "public" else self.partition_id
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, "fedmd-early-stopping", phase, owner))).to(x.device)
        held = int(round(fraction * len(y)))
        if held >= len(y):
            held = 0  # never hold out everything
        val, fit = order[:held], order[held:]
        if phase == "private" and s.revisit_optimizer == "private-pretraining":
            # The authors' code: one compile() before this phase, so the revisits continue it.
            optimizer = self.optimizer(name="revisit")
        else:
            optimizer = recipe_optimizer(self.model.parameters(), self.cfg)  # fresh: compile()
        generator = torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, "fedmd-pretrain", phase, self.partition_id))
        best, waited = -1.0, 0
        for _ in range(epochs):
            train_epochs(self.model, x[fit], y[fit],
                         loss_fn=lambda xb, yb: F.cross_entropy(self.model(xb), yb),
                         optimizer=optimizer, epochs=1, batch_size=batch_size,
                         grad_clip=self.cfg.grad_clip, generator=generator)
            if not held:
                continue
            accuracy = evaluate(self.model, x[val], y[val])[1]
            if accuracy > best + MIN_DELTA:
                best, waited = accuracy, 0
            else:
                waited += 1
                if waited >= patience:
                    break

    def upload(self) -> Payload:
        return {"logits": self.logits}

    def secure_weight(self) -> float:
        return 1.0  # every party counts once in the consensus (FedMD.aggregate)

    def fit_metrics(self) -> dict:
        return {} if self.digest is None else {"term-digest": self.digest.loss}


class FedMD(FedStrategy):
    """Averages the round's logits on A_t; sends the consensus with A_t's indices."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedMDSettings = self.cfg.settings
        self.public_size = len(setup.public_set(self.cfg, labels=False))
        self.payload: Payload = {}  # {indices [m] int32, consensus [m, C]}; empty in round 1

    def alignment(self, server_round: int) -> np.ndarray:
        return alignment_set(self.cfg.seed, server_round, self.public_size,
                             self.settings.alignment_size)

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.payload  # one object for everyone: encoded once

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"logits": ArraySpec((self.settings.alignment_size, self.num_classes))}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        self.payload = {"indices": self.alignment(server_round),
                        # õ: every party counts once (the code's mean over parties), so
                        # unit weights; a robust-aggregation rule replaces the mean.
                        "consensus": self.average([u.payload for u in uploads],
                                                  [1.0] * len(uploads),
                                                  what="the parties' logits")["logits"]}
