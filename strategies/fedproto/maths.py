"""FedProto (Tan et al., AAAI 2022): clients share per-class prototypes, not model weights.

The baseline FedGH compares against. A client's prototype of class c is the mean
representation ``g_k(x)`` of its training samples of class c (computed exactly after training,
eval mode, as FedGH's LARs). The server's global prototype of class c is the average of the
clients' prototypes of c weighted by their sample counts |D_kc|. A client trains with
``CE + lambda * MSE(g_k(x), global prototype of y)``, so that its representations of a class
move towards what every client agrees on; classes without a global prototype add nothing.

Traffic: d floats per local class each way (1000 for d=500 and two classes, FedGH's Table 3).
Labels and the per-class counts the weighting needs travel in the array names
(``class-3/n-120``), i.e. in the framing that the byte accounting reports apart, because the
paper counts prototypes only. Each client downloads the global prototypes of its own classes
(all of them before its first upload).

Evaluation: the model's own head by default; ``fedproto.eval-rule = "nearest-prototype"``
predicts the class whose global prototype is nearest to ``g_k(x)`` (the FedProto paper's rule).
Both are reported.

FedProto's released code and HtFLlib differ in two points, each a setting whose default is the
paper's: a client's prototypes are the means of the representations its training steps computed
(``fedproto.prototypes = "during-training"``: the model changes under them), and the server
averages the clients' prototypes of a class without weights (``fedproto.average = "uniform"``).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from fedapp.runtime import secure_aggregation
from fedapp.runtime.class_stats import ClassMeans, ClassSums, class_target_mse
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload

# Labels and counts in canonical ASCII decimal only: "03" or a non-ASCII digit would name the
# same class twice under another spelling, and the length caps keep int() cheap and bounded.
UPLOAD_NAME = re.compile(r"class-(0|[1-9][0-9]{0,8})/n-([1-9][0-9]{0,17})", re.ASCII)


def _prototype_table(payload: Payload, num_classes: int, dim: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``{"class-c": vector}`` -> (prototypes [C, d], which classes have one [C])."""
    table = torch.zeros(num_classes, dim, device=device)
    has = torch.zeros(num_classes, dtype=torch.bool, device=device)
    for name, vector in payload.items():
        c = int(name.removeprefix("class-"))
        table[c], has[c] = torch.from_numpy(vector).to(device), True
    return table, has


class FedProtoClient(FedClient):
    """CE + lambda * distance to the global prototypes; uploads its own prototypes."""

    seen: ClassSums | None = None  # prototypes = "during-training": this round's steps' sums

    def during_training(self) -> bool:
        """Whether the prototypes are the means over the round's training steps."""
        return self.cfg.settings.prototypes == "during-training"

    def train(self, server_round: int):
        self.seen = ClassSums(self.num_classes) if self.during_training() else None
        return super().train(server_round)

    def prototypes(self) -> ClassMeans:
        """The client's class prototypes now: exact class means of its model, or (during
        training) the means of what the round's steps computed, with the class's training
        samples |D_kc| as counts all the same (a sample seen in several epochs is one sample)."""
        if self.seen is None:
            return self.class_means()
        protos = self.seen.means()
        protos.counts = np.bincount(self.data.train_y.cpu().numpy(),
                                    minlength=self.num_classes)[protos.labels]
        return protos

    def receive(self, payload: Payload, server_round: int) -> None:
        self.global_prototypes, self.has_prototype = _prototype_table(
            payload, self.num_classes, self.model.feature_dim, self.device)

    def receive_for_evaluation(self, payload: Payload) -> bool:
        self.receive(payload, 0)
        return False  # the model itself is untouched

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.model.features(x)
        if self.seen is not None:
            self.seen.add(features, y)
        loss = torch.nn.functional.cross_entropy(self.model.head(features), y)
        lam = self.cfg.settings.lam
        if lam > 0 and bool(self.has_prototype.any()):
            loss = loss + lam * class_target_mse(features, y, self.global_prototypes,
                                                 self.has_prototype)
        return loss

    def upload(self) -> Payload:
        protos = self.prototypes()
        return {f"class-{c}/n-{n}": v for c, n, v in zip(protos.labels, protos.counts,
                                                          protos.means)}

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation: a table of all C classes, row c weighted by |D_kc| over a
        # public scale (or 1 with average = "uniform"), so that the server's sums give the
        # same global prototypes (FedProto.aggregate_sums).
        labels, counts = zip(*(map(int, UPLOAD_NAME.fullmatch(name).groups())
                               for name in upload)) if upload else ((), ())
        weights = (np.ones(len(counts)) if self.cfg.settings.average == "uniform" else
                   np.asarray(counts, np.float64) / secure_aggregation.weight_scale(self.cfg))
        return secure_aggregation.class_table(np.asarray(labels, np.int64),
                                              np.stack(list(upload.values())) if upload else
                                              np.zeros((0, self.model.feature_dim)),
                                              weights, self.num_classes)

    def headline_variant(self) -> str | None:
        return "nearest-prototype" if self.cfg.settings.eval_rule == "nearest-prototype" else None

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        if not bool(self.has_prototype.any()):
            return {}
        correct, start = 0, 0
        with torch.no_grad():
            for z in self.test_features(x):
                dist = torch.cdist(z, self.global_prototypes)
                dist[:, ~self.has_prototype] = float("inf")
                correct += int((dist.argmin(1) == y[start:start + len(z)]).sum())
                start += len(z)
        return {"nearest-prototype": correct / len(y)}


class FedProto(FedStrategy):
    """Averages prototypes per class, weighted by the clients' per-class sample counts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feature_dim = self.new_model(self.architectures[0]).feature_dim
        self.global_prototypes: dict[int, np.ndarray] = {}
        self.client_classes: dict[int, list[int]] = {}  # partition id -> classes last uploaded

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        classes = (self.client_classes.get(client.partition_id) if client is not None
                   else None) or sorted(self.global_prototypes)
        return {f"class-{c}": self.global_prototypes[c] for c in classes
                if c in self.global_prototypes}

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # The nearest-prototype rule needs every class's global prototype.
        return {f"class-{c}": v for c, v in sorted(self.global_prototypes.items())}

    def named_upload_spec(self, names: list[str], client: ClientInfo
                          ) -> dict[str, ArraySpec]:
        # The names carry label and count, so the spec is built from them, after checking them.
        specs, labels, total = {}, set(), 0
        for name in names:
            match = UPLOAD_NAME.fullmatch(name)
            if match is None:
                raise PayloadError(f"array name {name!r} is not 'class-<label>/n-<count>'")
            label, count = int(match.group(1)), int(match.group(2))
            if not label < self.num_classes:
                raise PayloadError(f"array {name!r}: label must be in [0, {self.num_classes})")
            if label in labels:
                raise PayloadError(f"class {label} appears twice")
            labels.add(label)
            total += count
            specs[name] = ArraySpec((self.feature_dim,))
        if not names:
            raise PayloadError("expected one prototype per local class")
        # The counts weight the global prototypes: together they cannot exceed the client's
        # training set, as far as the server knows it.
        if total > self.examples_bound(client):
            raise PayloadError(f"class counts sum to {total}, more than the "
                               f"{self.examples_bound(client)} training examples of partition "
                               f"{client.partition_id}")
        return specs

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        sums: dict[int, np.ndarray] = {}
        counts: dict[int, int] = {}
        rows: dict[int, list[np.ndarray]] = {}
        for u in uploads:
            classes = []
            for name, vector in u.payload.items():
                match = UPLOAD_NAME.fullmatch(name)
                c, n = int(match.group(1)), int(match.group(2))
                n = 1 if self.cfg.settings.average == "uniform" else n
                sums[c] = sums.get(c, 0.0) + n * vector.astype(np.float64)
                counts[c] = counts.get(c, 0) + n
                rows.setdefault(c, []).append(vector)
                classes.append(c)
            self.client_classes[u.client.partition_id] = sorted(classes)
        # Classes nobody uploaded this round keep their previous prototype (partial
        # participation), so a later client of that class still has a target.
        if self.robust.rule != "none":
            self.global_prototypes.update(self.robust_class_means(rows))
            return
        for c in sums:
            self.global_prototypes[c] = (sums[c] / counts[c]).astype(np.float32)

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return secure_aggregation.class_table_layout(self.num_classes, (self.feature_dim,))

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # The same count-weighted (or uniform) means per class as aggregate, from the sums of
        # the survivors' class tables; the server no longer learns who holds which class, so
        # every client is sent every global prototype (fit_payload: client_classes is empty).
        self.global_prototypes.update(secure_aggregation.class_means_from_sums(sums))
