"""Felo (Chan & Ngai, Computer Networks): clients exchange per-class mid-level features and
logits, and same-architecture clients average their whole models.

Client k's model is an extractor g_k (x -> s in R^d, the *mid-level feature*, with one d for
every client) and a one-layer classifier h_k (s -> p in R^C, the logits). Each round it

1. installs its architecture group's averaged weights (``felo.group-avg``, paper Sec. 3.1.2);
2. trains on its private data with, per sample (x, y) (paper Eq. 1),
   ``CE(h(g(x)), y) + alpha * (MSE(g(x), s[y]) + l_logit(h(g(x)), p[y]))``,
   where ``s[c]`` and ``p[c]`` are the server's feature and logit of class c, and the logit
   loss is ``KL(softmax(p[y] / T) || softmax(h(g(x)) / T))`` (paper: KL; the server
   distribution is the target) or MSE between raw logits (``felo.logit-loss = "mse"``, the
   authors' code default). Samples of a class the server has no entry for get no distillation
   terms, and the first ``warmup-fraction`` of the rounds are plain cross-entropy (the paper's
   initial training; the code switches distillation on after 5 % of its iterations);
3. accumulates, over the forward passes of that training, per-class sums of its features and
   logits and uploads the per-class means with their labels, ``S_k * (d + C + 1)`` numbers, plus
   its whole model when group averaging is on.

The server keeps a per-class history of the received (feature, logit) entries
(:class:`ClassStore`: the last ``history-size`` entries of each class, the paper's "server
dataset"; ``history = "latest-round"`` keeps only the entries of the latest round that brought
the class), averages it per class into the tables ``s[c]``, ``p[c]`` and averages the models of
each architecture group weighted by n_k (``FedStrategy.average_per_group``).
Every client downloads the tables of all classes and its own group's weights.

Deliberate choices where paper and code differ or are silent (see docs/felo.md):

- uploads are per-class means (paper); the code uploads every feature vector;
- ``group-avg = true`` averages same-architecture models (paper); ``false`` reproduces the
  released code, which never does. Group models start from one server initialisation per
  architecture (``new_model``), sent in round 1 as FedAvg sends its initial model;
- the server's tables are plain means over the history entries (no sample-count weighting:
  the paper states none); the code averages features over its FIFO buffers too;
- warm-up and the local update (the recipe's ``local-steps = 10`` mini-batches of 50 with Adam
  1e-3, the code's ``clients_training_epoch``) follow the code; alpha = 0.5 is the code's
  (paper: none given);
- rounds are synchronous with client sampling (paper); the code simulates asynchrony.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.data.local_data import expected_input
from fedapp.runtime import secure_aggregation
from fedapp.runtime.class_stats import ClassSums, class_target_mse
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from strategies.fedhe.maths import logit_loss
from strategies.felo import FeloSettings

# The per-class tables, up and down. Every other array of a payload is a model weight, named
# as in the model's state dict (``extractor.0.weight``, ``head.bias``), which never clash.
FEATURES, LOGITS, LABELS = "class-features", "class-logits", "class-labels"
TABLES = (FEATURES, LOGITS, LABELS)


def model_part(payload: Payload) -> Payload:
    """The model weights of a payload (everything but the per-class tables)."""
    return {k: v for k, v in payload.items() if k not in TABLES}


# With secure-aggregation and group-avg: the architecture groups' slots of the upload, apart
# from the class table's columns.
GROUP_PREFIX = "group/"


def group_layouts(cfg, input_shape: tuple[int, int, int], num_classes: int
                  ) -> dict[str, dict[str, tuple[int, ...]]]:
    """{architecture: {array name: shape}} of every architecture's model (the slots of the
    secure upload), the same for the server and every client."""
    return secure_aggregation.architecture_layouts(cfg, input_shape, num_classes, state_arrays)


class FeloClient(FedClient):
    """Installs its group's weights, trains with CE + alpha * (feature MSE + logit loss) and
    uploads its per-class mean features and logits (and its model)."""

    def receive(self, payload: Payload, server_round: int) -> None:
        c, d = self.num_classes, self.model.feature_dim
        self.class_features = torch.zeros(c, d, device=self.device)       # s[c]
        self.class_logits = torch.zeros(c, c, device=self.device)         # p[c]
        self.has_entry = torch.zeros(c, dtype=torch.bool, device=self.device)
        if LABELS in payload:
            labels = torch.from_numpy(payload[LABELS].astype(np.int64)).to(self.device)
            self.class_features[labels] = torch.from_numpy(payload[FEATURES]).to(self.device)
            self.class_logits[labels] = torch.from_numpy(payload[LOGITS]).to(self.device)
            self.has_entry[labels] = True
        load_arrays(self.model, model_part(payload))  # the group average, if sent
        self.feature_sums, self.logit_sums = ClassSums(c), ClassSums(c)

    def receive_for_evaluation(self, payload: Payload) -> bool:
        # Only with eval-model = "group" does the server send anything for evaluation.
        load_arrays(self.model, model_part(payload))
        return bool(payload)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.model.features(x)                 # g(x)
        logits = self.model.head(features)                # h(g(x))
        # The knowledge uploaded is that of the training forward passes (paper Sec. 3.1.1).
        self.feature_sums.add(features, y)
        self.logit_sums.add(logits, y)
        loss = F.cross_entropy(logits, y)
        s = self.cfg.settings
        if s.alpha > 0 and bool(self.has_entry.any()):
            loss = loss + s.alpha * distillation_loss(
                features, logits, y, self.class_features, self.class_logits, self.has_entry,
                s.logit_loss, s.temperature)
        return loss

    def upload(self) -> Payload:
        features, logits = self.feature_sums.means(), self.logit_sums.means()
        payload = {FEATURES: features.means, LOGITS: logits.means, LABELS: features.labels}
        if self.cfg.settings.group_avg:
            payload.update(state_arrays(self.model))
        return payload

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation (history = "latest-round", the card's refusal): a table of all
        # C classes, row c = [s_kc, p_kc] with weight 1 (the plain store averages its entries
        # without weights), and the model in its architecture's slot weighted by n_k over a
        # public scale, so that the sums give the server the same tables and group models
        # (Felo.aggregate_sums).
        labels = upload[LABELS]
        rows = np.concatenate([upload[FEATURES], upload[LOGITS]], 1)
        dense = secure_aggregation.class_table(labels, rows, np.ones(len(labels)),
                                               self.num_classes)
        if self.cfg.settings.group_avg:
            dense.update(secure_aggregation.group_table(
                group_layouts(self.cfg, *expected_input(self.cfg)), self.arch,
                model_part(upload), self.secure_weight(),
                prefix=GROUP_PREFIX))
        return dense


def distillation_loss(features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor,
                      class_features: torch.Tensor, class_logits: torch.Tensor,
                      has_entry: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """``MSE(g(x), s[y]) + l_logit(h(g(x)), p[y])``, averaged over the batch; samples of a
    class without a server entry add zero. The MSE reaches only the extractor (it is a function
    of g), the logit loss the whole model."""
    return (class_target_mse(features, y, class_features, has_entry)
            + logit_loss(logits, y, class_logits, has_entry, kind, temperature))


class ClassStore:
    """The server's per-class history of (mid-level feature, logit) entries."""

    def __init__(self, num_classes: int, size: int, latest_round_only: bool) -> None:
        self.latest_round_only = latest_round_only
        self.entries: list[deque] = [deque(maxlen=size) for _ in range(num_classes)]

    def add_round(self, uploads: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Take one round's uploads, each ``(labels [S], features [S, d], logits [S, C])``,
        in a fixed (partition id) order, so a capped history drops the same entries every run."""
        if self.latest_round_only:
            for c in {int(c) for labels, _, _ in uploads for c in labels}:
                self.entries[c].clear()
        for labels, features, logits in uploads:
            for c, s, p in zip(labels, features, logits):
                self.entries[int(c)].append((s, p))

    def labels(self) -> np.ndarray:
        """The classes with at least one entry, ascending."""
        return np.array([c for c, e in enumerate(self.entries) if e], np.int32)

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(labels [S], mean features [S, d], mean logits [S, C])`` over each class's
        entries: the tables s[c] and p[c]."""
        labels = self.labels()
        feats = [np.mean([s for s, _ in self.entries[c]], 0, dtype=np.float64) for c in labels]
        logits = [np.mean([p for _, p in self.entries[c]], 0, dtype=np.float64) for c in labels]
        return (labels, np.asarray(feats, np.float32).reshape(len(labels), -1),
                np.asarray(logits, np.float32).reshape(len(labels), -1))

    def feature_dataset(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored (feature, label) pair: Velo's CVAE training set."""
        pairs = [(s, c) for c, e in enumerate(self.entries) for s, _ in e]
        if not pairs:
            return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
        return (np.stack([s for s, _ in pairs]).astype(np.float32),
                np.array([c for _, c in pairs], np.int64))


class Felo(FedStrategy):
    """Keeps the class store and one model per architecture group; sends every client the
    tables of all classes and its group's weights."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FeloSettings = self.cfg.settings
        s = self.settings
        models = {arch: self.new_model(arch) for arch in sorted(set(self.architectures))}
        self.feature_dim = next(iter(models.values())).feature_dim
        # One server initialisation per architecture, so a group's clients start alike.
        self.group_models: dict[str, Payload] = (
            {arch: state_arrays(m) for arch, m in models.items()} if s.group_avg else {})
        self.store = ClassStore(self.num_classes, s.history_size, s.history == "latest-round")
        self.warmup_rounds = math.floor(s.warmup_fraction * self.cfg.num_server_rounds)
        self.tables: Payload = {}
        self._payloads: dict[tuple, Payload] = {}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        tables = self.tables if server_round > self.warmup_rounds else {}
        arch = client.arch if client is not None else None
        # One dict per (architecture, tables) so the base encodes it once per round.
        key = (arch, bool(tables))
        if key not in self._payloads:
            self._payloads[key] = {**tables, **self.group_models.get(arch, {})}
        return self._payloads[key]

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if self.settings.eval_model == "group" and client is not None:
            return self.group_models.get(client.arch, {})
        return {}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        spec = {FEATURES: ArraySpec((None, self.feature_dim)),
                LOGITS: ArraySpec((None, self.num_classes)), LABELS: self.label_spec()}
        # The client's own architecture's state: another architecture's model fails here.
        for name, array in self.group_models.get(client.arch, {}).items():
            spec[name] = ArraySpec(array.shape, "float" if array.dtype.kind == "f" else "int")
        return spec

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        labels = payload[LABELS]
        if not len(labels) == len(payload[FEATURES]) == len(payload[LOGITS]) or not len(labels):
            raise PayloadError(f"{len(payload[FEATURES])} features and {len(payload[LOGITS])} "
                               f"logit vectors for {len(labels)} labels")
        if len(np.unique(labels)) != len(labels):
            raise PayloadError("a class appears twice among the labels")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        self.store.add_round([(u.payload[LABELS], u.payload[FEATURES], u.payload[LOGITS])
                              for u in uploads])
        if self.settings.group_avg:
            self.group_models.update(self.average_per_group(
                [u.client.arch for u in uploads], [model_part(u.payload) for u in uploads],
                [u.num_examples for u in uploads], references=self.group_models))
        self.update_tables(server_round)

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        layout = secure_aggregation.class_table_layout(
            self.num_classes, (self.feature_dim + self.num_classes,))
        if self.settings.group_avg:
            layout.update(secure_aggregation.group_table_layout(
                group_layouts(self.cfg, self.input_shape, self.num_classes),
                prefix=GROUP_PREFIX))
        return layout

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # history = "latest-round": a class of this round is stored as the one mean of its
        # holders' entries, which is what the store's mean over them is; the other classes
        # keep their entries. Each group model is the n_k-weighted mean of its survivors.
        means = secure_aggregation.class_means_from_sums(sums)
        labels = np.array(sorted(means), np.int64)
        rows = (np.stack([means[c] for c in labels]) if len(labels) else
                np.zeros((0, self.feature_dim + self.num_classes), np.float32))
        self.store.add_round([(labels, rows[:, :self.feature_dim], rows[:, self.feature_dim:])])
        if self.settings.group_avg:
            means = secure_aggregation.group_means_from_sums(
                sums, group_layouts(self.cfg, self.input_shape, self.num_classes),
                prefix=GROUP_PREFIX)
            self.group_models.update({arch: secure_aggregation.in_dtypes_of(
                mean, self.group_models[arch]) for arch, mean in means.items()})
        self.update_tables(server_round)

    def update_tables(self, server_round: int) -> None:
        """The tables s[c], p[c] sent down: the store's per-class means (or the robust
        rule's combination of each class's entries)."""
        labels, features, logits = self.store.means()
        if self.robust.rule != "none" and len(labels):
            # Per class over its stored entries (the history holds an attacker's too).
            entries = {int(c): self.store.entries[c] for c in labels}
            feats = self.robust_class_means({c: [s for s, _ in e] for c, e in entries.items()})
            logs = self.robust_class_means({c: [p for _, p in e] for c, e in entries.items()})
            features = np.stack([feats[int(c)] for c in labels])
            logits = np.stack([logs[int(c)] for c in labels])
        features = self.class_features(server_round, labels, features)
        self.tables = {FEATURES: features, LOGITS: logits, LABELS: labels}
        self._payloads = {}

    def class_features(self, server_round: int, labels: np.ndarray,
                       means: np.ndarray) -> np.ndarray:
        """The features s[c] sent for ``labels``: Felo sends the per-class means."""
        return means
