"""FD, Federated Distillation (Jeong et al., 2018): clients share only per-class average logits.

Nothing of a model travels, so any architecture with the same C classes takes part. While
training, a client sums every training-time logit vector per class (train mode, before each
step, over all local epochs) and uploads their means ``F_c`` with the labels: at most
C * (C + 1) numbers. The server averages each class's row over the clients that sent it,
every client counting once (not weighted by samples), and sends the rows back; a client trains
with ``CE(o, y) + lambda * softCE(o, T)``, where ``T = softmax(G[y])`` is the federation's
average logit vector of the sample's class turned into a distribution — the paper's
cross-entropy regulariser, i.e. distillation at temperature 1. Samples whose class has no row
add nothing. Inference is the client's own model.

The client side is FedHe's (``strategies.fedhe``: the same per-class logit table and running
sums; FedHe is FD with an MSE logit loss and an asynchronous store); FD differs in its loss,
in plain means (no "+1"), and in a server that averages per client.

Choices, each a setting (docs/htfl-methods-1.md):

- ``fd.exclude-own`` (default true): client i receives the average of the *other* clients'
  rows, our reading of the paper's per-device global average F^(i); false includes its own
  row, as HtFLlib does.
- ``fd.raw-target`` (default false): HtFLlib since ca3e29a uses the raw averaged logits as the
  soft target; the gradient is then ``sum(T) * softmax(o) - T``, no longer distillation.
- ``fd.self-target`` (default false): HtFLlib lets a sample whose class has no row target its
  own detached logits; under raw targets that pulls o towards itself with a nonzero gradient.
- ``fd.history``: which uploads the server averages. ``round`` (HtFLlib) replaces the table
  with each round's senders; ``latest-per-client`` keeps every client's newest upload, the
  store that lets the server fold in one upload at a time (``server-loop = "async"``); the
  default ``auto`` takes the first in synchronous rounds and the second in that loop. With
  every client in every round both are the same.

With ``secure-aggregation`` (docs/privacy.md) each client uploads a table of all C classes
(FedHe's: its rows, zeros elsewhere, and which classes it holds), and the server holds only the
round's per-class sums and counts: the ``round`` history exactly. It cannot take a client's
own rows out of a sum it cannot see, so for ``exclude-own`` it tells each client whose rows
the sum holds (it knows the survivors) the counts and the round, and the client takes out the
rows it uploaded then, which it keeps in its state (:meth:`FDClient.others_rows`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord

from fedapp.runtime import secure_aggregation
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from strategies.fd import FDSettings
from strategies.fedhe.maths import FedHeClient, check_class_logits

# In a client's context.state, with secure aggregation and exclude-own: the rows it uploaded,
# "<round>/labels" and "<round>/logits", until no table the server sends can hold them.
SENT_KEY = "fd.sent"


def distillation(logits: torch.Tensor, y: torch.Tensor, class_logits: torch.Tensor,
                 has_logits: torch.Tensor, raw_target: bool = False,
                 self_target: bool = False) -> torch.Tensor:
    """Mean over the batch of ``softCE(o_b, T_b) = -sum_c T_bc log softmax(o_b)_c`` with
    ``T_b = softmax(G[y_b])`` (``raw_target``: ``G[y_b]`` itself). A sample whose class has no
    row in G adds zero (``self_target``: its target is its own detached logits)."""
    rows, has = class_logits[y], has_logits[y]
    if self_target:
        rows = torch.where(has[:, None], rows, logits.detach())
        has = torch.ones_like(has)
    target = rows if raw_target else F.softmax(rows, 1)
    per_sample = -(target * F.log_softmax(logits, 1)).sum(1)
    return (per_sample * has).mean()


class FDClient(FedHeClient):
    """CE + lambda * distillation to the federation's class logits; uploads its own."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        self.logit_sums.add(logits, y)  # train mode, before the step: what the paper averages
        loss = F.cross_entropy(logits, y)
        s = self.cfg.settings
        if s.lam > 0 and bool(self.has_logits.any()):
            loss = loss + s.lam * distillation(logits, y, self.class_logits, self.has_logits,
                                               s.raw_target, s.self_target)
        return loss

    def upload(self) -> Payload:
        means = self.logit_sums.means()
        self.sent = {"logits": means.means, "labels": means.labels}
        return self.sent

    def takes_out_own(self) -> bool:
        """Whether this client takes its own rows out of the server's table (exclude-own with
        secure aggregation: the server holds only sums)."""
        return self.cfg.secure_aggregation and self.cfg.settings.exclude_own

    def receive(self, payload: Payload, server_round: int) -> None:
        if self.takes_out_own():
            payload = self.others_rows(payload)
        super().receive(payload, server_round)

    def others_rows(self, payload: Payload) -> Payload:
        """The server's table without this client's rows, where the server says they are in
        its sums (``own-round``: the round it uploaded them): each such class's
        ``(count * mean - own row) / (count - 1)``, the plain server's F^(i). Every other
        round's rows are dropped: a table is of the last round the server aggregated, so a
        later one cannot hold them (at most two rounds' rows are ever kept)."""
        record = self.context.state.get(SENT_KEY)
        sent = {k: v.numpy() for k, v in record.items()} if record is not None else {}
        own = str(int(payload["own-round"][0])) if "own-round" in payload else None
        kept = {k: v for k, v in sent.items() if k.split("/")[0] == own}
        self.context.state[SENT_KEY] = ArrayRecord(array_dict={k: Array(v)
                                                               for k, v in kept.items()})
        if own is None:
            return payload  # none of this client's rows in the table: everyone's mean is F^(i)
        if not kept:
            raise PayloadError(
                f"the server's logits hold this client's rows of round {own}, which it no "
                "longer has (its state was lost), so it cannot take them out (fd.exclude-own)")
        return without_rows(payload, kept[f"{own}/labels"], kept[f"{own}/logits"],
                            self.num_classes)

    def save_state(self, server_round: int) -> None:
        if self.takes_out_own():
            # Beside what others_rows kept (this message's receive) of the earlier rounds.
            record = self.context.state.get(SENT_KEY) or ArrayRecord()
            record[f"{server_round}/labels"] = Array(np.asarray(self.sent["labels"]))
            record[f"{server_round}/logits"] = Array(np.asarray(self.sent["logits"]))
            self.context.state[SENT_KEY] = record
        super().save_state(server_round)


def _table(sums: np.ndarray, counts: np.ndarray) -> Payload:
    """Rows ``sums / counts`` of the classes with a count, as ``{"logits", "labels"}``."""
    labels = np.flatnonzero(counts > 0)
    if not len(labels):
        return {}
    return {"logits": (sums[labels] / counts[labels, None]).astype(np.float32),
            "labels": labels.astype(np.int32)}


def without_rows(table: Payload, labels: np.ndarray, rows: np.ndarray, num_classes: int
                 ) -> Payload:
    """A table of class means with their ``counts`` (``{"logits", "labels", "counts"}``)
    without one holder's ``rows`` of classes ``labels``; a class it alone held has no row."""
    sums = np.zeros((num_classes, num_classes), np.float64)
    counts = np.zeros(num_classes, np.float64)
    held = table["labels"].astype(np.int64)
    counts[held] = table["counts"]
    sums[held] = table["logits"].astype(np.float64) * counts[held, None]
    labels = np.asarray(labels, np.int64)
    sums[labels] -= rows
    counts[labels] -= 1
    return _table(sums, counts)


class FD(FedStrategy):
    """Averages each class's logits over the clients that sent it (each client counts once)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FDSettings = self.cfg.settings
        self.history = self.settings.resolved_history(self.cfg)
        c = self.num_classes
        self.client_logits: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # pid -> (labels, F)
        self.sums = np.zeros((c, c), np.float64)
        self.counts = np.zeros(c, np.float64)
        self._payload: Payload = {}
        # With secure aggregation: the partitions whose rows the table sums, and their round.
        self.summed: list[int] = []
        self.summed_round = 0

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if self.cfg.secure_aggregation:
            return self.secure_payload(client)
        own = self.client_logits.get(client.partition_id) if client is not None else None
        if not self.settings.exclude_own or own is None:
            return self._payload  # one object for everyone: encoded once
        if self.robust.rule != "none":
            return self.robust_table(exclude=client.partition_id)
        labels, logits = own
        sums, counts = self.sums.copy(), self.counts.copy()
        sums[labels] -= logits
        counts[labels] -= 1
        return _table(sums, counts)

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"logits": ArraySpec((None, self.num_classes)), "labels": self.label_spec()}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        check_class_logits(payload)  # the same upload as FedHe's

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        if self.history == "round":
            self.client_logits = {}
        for u in uploads:
            self.client_logits[u.client.partition_id] = (
                u.payload["labels"].astype(np.int64), u.payload["logits"].astype(np.float64))
        # Summed afresh in partition order: the result does not depend on arrival order.
        self.sums[:] = 0.0
        self.counts[:] = 0.0
        for pid in sorted(self.client_logits):
            labels, logits = self.client_logits[pid]
            self.sums[labels] += logits  # labels are unique within an upload
            self.counts[labels] += 1
        self._payload = (_table(self.sums, self.counts) if self.robust.rule == "none"
                         else self.robust_table())

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return secure_aggregation.class_table_layout(self.num_classes, (self.num_classes,))

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # fd.history = 'round' (the card refuses 'latest-per-client' with secure aggregation):
        # the table is the round's per-class sums and counts, which is all it is made of.
        self.sums, self.counts = secure_aggregation.holder_sums(sums)
        self.summed = [u.client.partition_id for u in uploads]
        self.summed_round = server_round
        self._payload = _table(self.sums, self.counts)

    def secure_payload(self, client: ClientInfo | None) -> Payload:
        """With secure aggregation: everyone's means (fd.exclude-own = false, or a client whose
        rows are not in them); with exclude-own, a client whose rows are in them also gets
        each class's count and the round of its rows, and takes them out itself
        (:meth:`FDClient.others_rows`)."""
        if not (self.settings.exclude_own and self._payload and client is not None
                and client.partition_id in self.summed):
            return self._payload
        labels = self._payload["labels"]
        return {**self._payload, "counts": self.counts[labels].astype(np.int32),
                "own-round": np.array([self.summed_round], np.int64)}

    def robust_table(self, exclude: int | None = None) -> Payload:
        """The table under robust-aggregation: each class's rule over the clients that sent
        it (but ``exclude``, for exclude-own), as the mean is over them."""
        rows: dict[int, list[np.ndarray]] = {}
        for pid in sorted(self.client_logits):
            if pid != exclude:
                for c, row in zip(*self.client_logits[pid]):
                    rows.setdefault(int(c), []).append(row)
        robust = self.robust_class_means(rows)
        if not robust:
            return {}
        labels = np.array(sorted(robust), np.int32)
        return {"logits": np.stack([robust[c] for c in labels]).astype(np.float32),
                "labels": labels}
