"""FedHe (Chan & Ngai, MSN 2021): heterogeneous models that share only per-class average logits.

Nothing of a model is shared, so any architecture with C logits takes part. A client installs
nothing; it trains with ``CE + alpha * l_logit(f_k(x), P[y])`` where ``P[c]`` is the server's
average logit vector of class c (MSE between raw logits, as the authors' code; KL with a
temperature as an option). Classes the server has no logits for yet contribute no logit loss,
so the very first updates are plain cross-entropy (the cold start). While training, the client
accumulates the sum and count of its forward passes' logits per class and uploads
``p_kc = sum / (count + 1)`` (the paper's Eq. 8; ``fedhe.plus-one = false`` divides by the
count, as the code does) with the class labels: C * (C + 1) = 110 numbers for C = 10.

The server's knowledge is a per-class logit store (:class:`LogitStore`), independent of the
round loop so that the asynchronous mode can feed it one upload at a time. Its policies follow
the paper and the code: ``all`` (every vector ever received counts equally: the paper's union),
``running-mean`` (the code: every ``collapse-every`` uploads the past collapses into one vote, so
recent uploads dominate) and ``latest-per-client`` (each client's newest vector only).

With ``secure-aggregation`` (docs/privacy.md) a client uploads a table of all C classes (its
rows, zeros elsewhere, and which classes it holds) and the server sees only a round's sum:
``all``'s per-class sums and counts exactly; the other stores need each upload (the card
refuses them).

Rounds here are synchronous (``server-loop = "async"`` drops the barrier): a round is one upload
per sampled client. The paper's client update of three random mini-batches of 50 with Adam
(1e-3), one optimizer kept for the client's whole run as the authors' code does, is the method's
recipe (``local-steps = 3``, ``optimizer-state = "keep"``; docs/recipes.md).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.runtime import secure_aggregation
from fedapp.runtime.class_stats import ClassSums, class_target_mse
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload


class FedHeClient(FedClient):
    """CE + alpha * logit loss; uploads its per-class average logits."""

    def receive(self, payload: Payload, server_round: int) -> None:
        c = self.num_classes
        self.class_logits = torch.zeros(c, c, device=self.device)      # P^s
        self.has_logits = torch.zeros(c, dtype=torch.bool, device=self.device)
        if payload:
            labels = torch.from_numpy(payload["labels"].astype(np.int64)).to(self.device)
            self.class_logits[labels] = torch.from_numpy(payload["logits"]).to(self.device)
            self.has_logits[labels] = True
        self.logit_sums = ClassSums(c)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        self.logit_sums.add(logits, y)
        loss = F.cross_entropy(logits, y)
        s = self.cfg.settings
        if s.alpha > 0 and bool(self.has_logits.any()):
            loss = loss + s.alpha * logit_loss(logits, y, self.class_logits, self.has_logits,
                                               s.logit_loss, s.temperature)
        return loss

    def upload(self) -> Payload:
        means = self.logit_sums.means(plus_one=self.cfg.settings.plus_one)
        return {"logits": means.means, "labels": means.labels}

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation: a table of all C classes in which each class this client
        # holds counts once, as one vector in the store (FedHe.aggregate_sums; FD's the same).
        return secure_aggregation.holder_rows(upload["labels"], upload["logits"],
                                              self.num_classes)


def logit_loss(logits: torch.Tensor, y: torch.Tensor, class_logits: torch.Tensor,
               has_logits: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Mean over the batch of the distance between each sample's logits and its class's server
    logits; samples of a class without server logits add zero."""
    if kind == "mse":
        return class_target_mse(logits, y, class_logits, has_logits)
    # KL(server || client) on tempered softmaxes, scaled by T^2 as in distillation.
    per_sample = F.kl_div(F.log_softmax(logits / temperature, 1),
                          F.log_softmax(class_logits[y] / temperature, 1), log_target=True,
                          reduction="none").sum(1) * temperature ** 2
    return (per_sample * has_logits[y]).mean()


class LogitStore:
    """The server's per-class logit knowledge D_l, fed one upload at a time."""

    def __init__(self, num_classes: int, policy: str, collapse_every: int) -> None:
        self.num_classes, self.policy, self.collapse_every = num_classes, policy, collapse_every
        self.sums = np.zeros((num_classes, num_classes), np.float64)
        self.counts = np.zeros(num_classes, np.float64)
        self.latest: dict[tuple[int, int], np.ndarray] = {}  # (client, class) -> vector
        self.uploads = 0

    def add(self, client: int, labels: np.ndarray, logits: np.ndarray) -> None:
        """Take one client's per-class average logits."""
        if self.policy == "latest-per-client":
            for c, vector in zip(labels, logits):
                self.latest[(client, int(c))] = vector.astype(np.float64)
            return
        np.add.at(self.sums, labels, logits)
        np.add.at(self.counts, labels, 1)
        self.uploads += 1
        if self.policy == "running-mean" and self.uploads % self.collapse_every == 0:
            # The authors' code: the past becomes a single vote per class.
            seen = self.counts > 0
            self.sums[seen] /= self.counts[seen, None]
            self.counts[seen] = 1

    def add_sums(self, sums: np.ndarray, counts: np.ndarray, uploads: int) -> None:
        """Take several uploads at once, as their per-class sums and counts (all that secure
        aggregation shows the server). Exact for ``all`` only: ``running-mean`` may collapse
        between two uploads of one sum, ``latest-per-client`` replaces a client's own vectors
        (the card refuses both with secure aggregation)."""
        if self.policy != "all":
            raise ValueError(f"the {self.policy!r} store needs each upload, not their sum")
        self.sums += sums
        self.counts += counts
        self.uploads += uploads

    def averages(self) -> tuple[np.ndarray, np.ndarray]:
        """(labels [S], mean logits [S, C]) for every class with at least one vector."""
        if self.policy == "latest-per-client":
            sums = np.zeros_like(self.sums)
            counts = np.zeros_like(self.counts)
            for (_, c), vector in sorted(self.latest.items()):
                sums[c] += vector
                counts[c] += 1
        else:
            sums, counts = self.sums, self.counts
        labels = np.flatnonzero(counts > 0)
        return labels.astype(np.int32), (sums[labels] / counts[labels, None]).astype(np.float32)


def check_class_logits(payload: Payload) -> None:
    """One logit vector per class the upload names, each class once (FedHe's and FD's upload)."""
    labels = payload["labels"]
    if len(labels) != len(payload["logits"]) or len(labels) == 0:
        raise PayloadError(f"{len(payload['logits'])} logit vectors for {len(labels)} labels")
    if len(np.unique(labels)) != len(labels):
        raise PayloadError("a class appears twice among the labels")


class FedHe(FedStrategy):
    """Keeps the logit store; sends every client the current per-class averages."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s = self.cfg.settings
        self.store = LogitStore(self.num_classes, s.history,
                                s.collapse_every or 10 * self.cfg.num_clients)
        self._payload: Payload = {}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload  # empty until the first logits arrive: the cold start

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"logits": ArraySpec((None, self.num_classes)), "labels": self.label_spec()}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        check_class_logits(payload)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        for u in uploads:
            self.store.add(u.client.partition_id, u.payload["labels"], u.payload["logits"])
        labels, logits = self.store.averages()
        if self.robust.rule != "none" and len(labels):
            # fedhe.history = 'latest-per-client' (the card refuses the others): each class's
            # rule over the latest row of every client that sent it.
            rows: dict[int, list[np.ndarray]] = {}
            for (_, c), vector in sorted(self.store.latest.items()):
                rows.setdefault(c, []).append(vector)
            robust = self.robust_class_means(rows)
            logits = np.stack([robust[int(c)] for c in labels])
        self.publish(labels, logits)

    def publish(self, labels: np.ndarray, logits: np.ndarray) -> None:
        """What every client is sent from now on: the store's per-class averages."""
        self._payload = {"logits": logits, "labels": labels} if len(labels) else {}

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return secure_aggregation.class_table_layout(self.num_classes, (self.num_classes,))

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # fedhe.history = 'all' (the card refuses the other stores with secure aggregation):
        # the store is per-class sums and counts, which grow by the round's, as they would
        # upload by upload.
        self.store.add_sums(*secure_aggregation.holder_sums(sums), len(uploads))
        self.publish(*self.store.averages())
