"""FedRE (arXiv 2511.22265, CVPR 2026): one entangled representation per client and round.

FedGH's server-side head training (``strategies.fedgh``) with one difference on each side.
A client installs the server's head, trains its whole model with plain cross-entropy, computes
its class prototypes ``p_c`` (eval-mode mean of ``g_k(x)`` per local class, after training, as
FedGH's LARs) and uploads a single random convex mix of them, ``r = sum_c w_c p_c`` with
``w ~ U(0, 1)^{K}`` normalised to sum 1, redrawn every round, together with the soft label
``(w_c, c)``: d + 2K numbers instead of FedGH's K (d + 1). The server keeps one head
``Linear(d, C)`` and trains it, with a new SGD each round, for one epoch over the round's
shuffled mixes in batches of ``server-batch-size`` on the soft-label cross-entropy
``sum_b sum_c w_bc CE(h(r_b), c)`` — summed over the batch, as the authors' code — then sends it
to every client, which overwrites its own head with it at the start of its next round.

Evaluation reports both heads. The headline is the client's model after local training, its
own head (``fedre.eval-head = "own"``); ``accuracy-global-header`` is the local extractor with
the server's head, the method's inference (the release never evaluates), the headline with
``fedre.eval-head = "global"``. The own head is the default by measurement: with the server's
head the clients lose to local training at the same recipe (docs/htfl-methods-1.md).

Asynchronous: the loss is a sum over mixes, so one SGD step per arriving mix is, to first
order, the round's step over the batch of mixes; the server can fold in one upload at a time
(``server-loop = "async"``).

``fedre.send-head = false`` reproduces the HtFLlib variant of the release, whose server trains
the head but never sends it: every client then trains alone.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, Upload
from fedapp.runtime.training import one_thread
from fedapp.seeding import derive_seed
from strategies.fedgh.maths import FedGH, FedGHClient
from strategies.fedre import FedRESettings

# Honest weights sum to 1 up to float rounding (float16 on the wire included); a client may not
# scale its soft label, hence its weight in the head's loss, beyond that.
WEIGHT_SUM_TOLERANCE = 1e-2


def entangle(prototypes: np.ndarray, generator: torch.Generator) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """(``r = sum_c w_c p_c``, ``w``) for ``w ~ U(0, 1)^K`` normalised to sum 1."""
    weights = torch.rand(len(prototypes), generator=generator, dtype=torch.float64)
    weights = (weights / weights.sum()).numpy()
    return (weights @ prototypes.astype(np.float64)).astype(np.float32), \
        weights.astype(np.float32)


def soft_label_loss(logits: torch.Tensor, soft_labels: torch.Tensor) -> torch.Tensor:
    """``sum_b sum_c w_bc CE(logits_b, c)``: summed over the batch, as the authors' code."""
    return -(soft_labels * F.log_softmax(logits, 1)).sum()


class FedREClient(FedGHClient):
    """FedGH's client (installs the head, trains with CE, keeps the global head for
    evaluation) uploading one entangled representation instead of every prototype."""

    def receive(self, payload: Payload, server_round: int) -> None:
        super().receive(payload, server_round)
        self.server_round = server_round

    def upload(self) -> Payload:
        protos = self.class_means()
        mix, weights = entangle(protos.means, self.batch_generator(self.server_round,
                                                                   "fedre-weights"))
        return {"representation": mix, "weights": weights, "labels": protos.labels}

    def headline_variant(self) -> str | None:
        return "global-header" if self.cfg.settings.eval_head == "global" else None


class FedRE(FedGH):
    """Trains the persistent head on the round's entangled representations; sends it."""

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # From the first round on: every client starts from the server's head.
        return self._payload if self.settings.send_head else {}

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload if self.settings.send_head else {}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"representation": ArraySpec((self.feature_dim,)),
                "weights": ArraySpec((None,)), "labels": self.label_spec()}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        labels, weights = payload["labels"], payload["weights"]
        if len(labels) != len(weights) or len(labels) == 0:
            raise PayloadError(f"{len(weights)} weights for {len(labels)} labels")
        if len(np.unique(labels)) != len(labels):
            raise PayloadError("a class appears twice among the labels")
        if weights.min() < 0 or abs(float(weights.sum(dtype=np.float64)) - 1) \
                > WEIGHT_SUM_TOLERANCE:
            raise PayloadError(f"the weights must be non-negative and sum to 1 (they sum to "
                               f"{float(weights.sum(dtype=np.float64)):.6g})")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        mixes = np.stack([u.payload["representation"] for u in uploads])
        soft = np.zeros((len(uploads), self.num_classes), np.float64)
        for row, u in zip(soft, uploads):
            weights = u.payload["weights"].astype(np.float64)
            row[u.payload["labels"]] = weights / weights.sum()  # within the tolerance above
        # A mix has no class of its own (its soft label spreads over the sender's classes):
        # a robust rule filters the round's mixes together, as pairs of one label.
        mixes, keep = self.training_pairs(mixes, np.zeros(len(uploads), np.int64),
                                          owners=[u.client.partition_id for u in uploads])
        train_head_soft(self.global_header, mixes[keep], soft[keep].astype(np.float32),
                        self.settings,
                        derive_seed(self.cfg.seed, "fedre-server", server_round))
        self._payload = self._header_payload()


def train_head_soft(head: torch.nn.Linear, mixes: np.ndarray, soft_labels: np.ndarray,
                    settings: FedRESettings, seed: int) -> None:
    """One epoch of SGD over the shuffled (mix, soft label) pairs with :func:`soft_label_loss`.
    A new optimizer each round, as the code (plain SGD keeps no state, so it is the same)."""
    generator = torch.Generator().manual_seed(seed)
    x, w = torch.from_numpy(mixes), torch.from_numpy(soft_labels)
    optimizer = torch.optim.SGD(head.parameters(), lr=settings.server_lr)
    head.train()
    order = torch.randperm(len(x), generator=generator)
    with one_thread():  # a tiny model: far faster on one thread than on a busy CPU
        for start in range(0, len(x), settings.server_batch_size):
            batch = order[start:start + settings.server_batch_size]
            loss = soft_label_loss(head(x[batch]), w[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
