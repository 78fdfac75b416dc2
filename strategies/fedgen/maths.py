"""FedGen (Zhu, Hong and Zhou, ICML 2021): data-free knowledge distillation through a feature
generator the server learns from the ensemble of the clients' heads.

Client k owns a heterogeneous extractor f_k and a head h_k = Linear(d, C) of the same shape for
everyone (HtFLlib's heterogeneous FedGen: only heads are shared, bases stay private). The server
keeps a conditional generator G(y) of d-dimensional features,
``[eps, onehot(y)] -> Linear(nd + C, hd) -> BatchNorm1d -> ReLU -> Linear(hd, d)``, and the
global head. Each round:

1. the client installs the global head and trains its whole model on
   ``CE(h(f(x)), y) + alpha_t * CE(h(G(y~)), y~)``, with B labels y~ drawn from the label
   multiset pooled over every client (so that its head also sees features of classes it lacks);
   G is fixed and only the head learns from the second term;
2. it uploads its head, and, the first time only, its label histogram (C counts);
3. the server trains G for ``server-steps`` Adam steps (a new Adam on the persistent G each round)
   on ``CE(sum_k w_k h_k(G(y~)), y~)``, the weighted ensemble of the uploaded heads labelling the
   generated features, plus ``diversity`` times the diversity regulariser; then the global head is
   the sample-weighted average of the uploaded heads. With ``robust-aggregation`` set, the rule
   first filters the heads (:meth:`~fedapp.runtime.strategy_base.FedStrategy.teachers`), and
   the ensemble, its label pool and the average are those of the kept heads.

Evaluation uses the client's extractor with the global head (what HtFLlib measures at the start
of a round); the client's own head after local training is reported as ``accuracy-own-head``.

Traffic per client per round: up the head, d*C + C floats (5,130 = 20,520 bytes for d = 512,
C = 10), plus C 32-bit counts once; down the head, G's parameters (285,696 floats for nd = 32,
hd = 512, d = 512, C = 10; its BatchNorm buffers are not sent: G always runs in train mode, on
batch statistics) and the pooled label histogram (C 32-bit counts). In round 1 nothing has been
pooled and G is untrained, so only the head goes down and clients train with CE alone (the
paper's first round; HtFLlib instead uses its untrained G from round 0, as it reads every
client's labels at start-up, which a federation cannot: ``label-pool = "partition"`` does so
in a simulation, from the partition the server computes).

The paper and the authors' code differ from HtFLlib in five points; each is a setting whose
default is the paper's (the authors' code gives the numbers the paper leaves out):
``noise`` (paper N(0, I); HtFLlib U[0, 1) despite its comment), ``teacher-weights`` (paper
per-label weights n_k^y / sum_j n_j^y; HtFLlib one weight n_k / sum n per client),
``diversity`` (the paper's diversity regulariser, weight 1 in the authors' code; HtFLlib 0) and
``client-weight`` / ``client-weight-decay`` (the authors' alpha_t = max(1e-4, 10 * 0.98^t);
HtFLlib 1, constant) and ``keep-generator`` (HtFLlib's server trains a copy of its initial G
each round and discards it, so its clients only ever see the untrained G). docs/fedgen.md
lists the settings that reproduce HtFLlib.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedapp.config import RunConfig
from fedapp.data import setup
from fedapp.runtime import secure_aggregation
from fedapp.runtime.aggregate import weighted_average
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import train_recipe
from fedapp.seeding import derive_seed, isolated_rng
from strategies.fedgen import FedGenSettings

HEAD = ("head.weight", "head.bias")
GENERATOR_PREFIX = "generator."
LABEL_POOL = "label-pool"          # down: the label histogram pooled over every known client
LABEL_COUNTS = "label-counts"      # up, once: the client's own label histogram
SEND_COUNTS = "send-label-counts"  # down: the server has no histogram of this client yet
# With secure-aggregation, the arrays of the fixed layout besides the weighted head: the
# per-label teacher heads (a class table), the round's label histogram and the histogram of a
# client the server asked for it (zeros otherwise).
TEACHERS, ROUND_COUNTS, NEW_COUNTS = "teachers/", "label-counts/round", "label-counts/new"


class Generator(nn.Module):
    """G(y, eps): features of class y from noise eps (FedGen's latent generator)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int,
                 feature_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.hidden = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim),
                                    nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(eps.dtype)
        return self.out(self.hidden(torch.cat([eps, onehot], 1)))


def sample_noise(n: int, dim: int, kind: str, generator: torch.Generator,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` noise vectors eps for G, from ``generator`` (never torch's global stream)."""
    if kind == "normal":
        return torch.randn(n, dim, generator=generator).to(device)
    return torch.rand(n, dim, generator=generator).to(device)


def sample_labels(histogram: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` labels drawn with replacement from the multiset a histogram of counts describes."""
    return torch.multinomial(histogram.double(), n, replacement=True, generator=generator)


def diversity_loss(eps: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """FedGen's diversity regulariser: ``exp(-mean_ij d2(eps_i, eps_j) * d1(G_i, G_j))`` with d2
    the mean squared and d1 the mean absolute difference; small when distant noises give
    distant features, so G does not collapse every noise of a class onto one feature."""
    noise_dist = (eps[:, None, :] - eps[None, :, :]).pow(2).mean(2)
    feature_dist = (features[:, None, :] - features[None, :, :]).abs().mean(2)
    return torch.exp(-(noise_dist * feature_dist).mean())


def teacher_weights(counts: np.ndarray, num_examples: np.ndarray, mode: str) -> np.ndarray:
    """Weights ``[C, K]`` of the K uploaded heads for each label: per label
    ``n_k^y / sum_j n_j^y`` ('label'; zero for a label nobody holds), or ``n_k / sum_j n_j``
    for every label ('samples'). ``counts`` is ``[K, C]``, ``num_examples`` ``[K]``."""
    if mode == "samples":
        w = num_examples / num_examples.sum()
        return np.tile(w, (counts.shape[1], 1))
    per_label = counts.T.astype(np.float64)
    totals = per_label.sum(1, keepdims=True)
    return np.divide(per_label, totals, out=np.zeros_like(per_label), where=totals > 0)


def train_generator(generator: Generator, heads: list[Payload], weights: np.ndarray,
                    pool: np.ndarray, settings: FedGenSettings, batch_size: int,
                    seed: int) -> float:
    """``server-steps`` Adam steps of G on the ensemble's cross-entropy (+ diversity); a new
    Adam each round (HtFLlib's) on the persistent G. ``weights`` is ``[C, K]``
    (:func:`teacher_weights`), ``pool`` the histogram the labels are drawn from. Returns the
    last step's ensemble cross-entropy.

    The heads are used only through label y's ensemble logits ``sum_k w[y, k] (W_k z + b_k)``
    = ``(sum_k w[y, k] W_k) z + sum_k w[y, k] b_k``: the logits of one head, y's teacher (no
    softmax or other non-linearity acts on a single head). So C teacher heads with the identity
    as weights train G as the K heads do (secure aggregation: :func:`teacher_heads`)."""
    rng = torch.Generator().manual_seed(seed)
    w = torch.from_numpy(weights.astype(np.float32))
    stacked_w = torch.stack([torch.from_numpy(h["head.weight"]) for h in heads])  # [K, C, d]
    stacked_b = torch.stack([torch.from_numpy(h["head.bias"]) for h in heads])    # [K, C]
    histogram = torch.from_numpy(pool.astype(np.int64))
    optimizer = torch.optim.Adam(generator.parameters(), lr=settings.server_lr,
                                 betas=(0.9, 0.999))
    generator.train()
    ce = torch.zeros(())
    for _ in range(settings.server_steps):
        labels = sample_labels(histogram, batch_size, rng)
        eps = sample_noise(batch_size, settings.noise_dim, settings.noise, rng)
        features = generator(labels, eps)
        # Every head's logits [K, B, C], weighted per sample by its label's weights.
        logits = torch.einsum("bd,kcd->kbc", features, stacked_w) + stacked_b[:, None, :]
        ensemble = (w[labels].T[:, :, None] * logits).sum(0)
        ce = F.cross_entropy(ensemble, labels)
        loss = (ce + settings.diversity * diversity_loss(eps, features)
                if settings.diversity > 0 else ce)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(ce.detach())


class FedGenClient(FedClient):
    """Installs the global head, trains with CE + alpha_t * CE on generated features, uploads
    its head (and its label histogram when the server asks)."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, {k: payload[k] for k in HEAD if k in payload})
        self.send_counts = SEND_COUNTS in payload
        self.generator, self.label_pool = None, None
        params = {k.removeprefix(GENERATOR_PREFIX): v for k, v in payload.items()
                  if k.startswith(GENERATOR_PREFIX)}
        if params and LABEL_POOL in payload and int(payload[LABEL_POOL].sum()) > 0:
            s = self.cfg.settings
            self.generator = Generator(s.noise_dim, self.num_classes, s.hidden_dim,
                                       self.model.feature_dim).to(self.device)
            load_arrays(self.generator, params)
            # Train mode: batch statistics, as the server trained it (no buffers were sent).
            self.generator.train()
            self.label_pool = torch.from_numpy(payload[LABEL_POOL].astype(np.int64))

    def receive_for_evaluation(self, payload: Payload) -> bool:
        self.global_head = {k: payload[k] for k in HEAD if k in payload}
        return False  # the model is evaluated with the global head as a variant

    def headline_variant(self) -> str | None:
        return "global-head"

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        head = getattr(self, "global_head", None)
        return {"global-head": self.head_accuracy(head, x, y)} if head else {}

    def train(self, server_round: int):
        if self.generator is None:
            return super().train(server_round)
        s = self.cfg.settings
        alpha = s.client_term_weight(server_round)
        rng = self.batch_generator(server_round, "fedgen-labels")
        batch = self.cfg.batch_size

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            labels = sample_labels(self.label_pool, batch, rng).to(self.device)
            with torch.no_grad():  # G is fixed: only the head learns from this term
                generated = self.generator(labels, sample_noise(batch, s.noise_dim, s.noise,
                                                                rng, self.device))
            features = self.model.features(x)
            real = F.cross_entropy(self.model.head(features), y)
            synthetic = F.cross_entropy(self.model.head(generated), labels)
            # Per round in rounds.jsonl (train_terms): how well the head fits G's features,
            # how much of the loss that term is at alpha_t, and whether G's features live
            # where the extractor's do.
            self.record_terms({"ce-real": real, "ce-generated": synthetic,
                               "generated-share": alpha * synthetic / (real + alpha * synthetic),
                               "feature-norm-real": features.norm(dim=1).mean(),
                               "feature-norm-generated": generated.norm(dim=1).mean()})
            return real + alpha * synthetic

        return train_recipe(self.model, self.data.train_x, self.data.train_y, loss_fn=loss,
                            optimizer=self.optimizer(), cfg=self.cfg,
                            generator=self.batch_generator(server_round),
                            steps=self.local_steps())

    def upload(self) -> Payload:
        payload = state_arrays(self.model, list(HEAD))
        if self.send_counts:
            payload[LABEL_COUNTS] = self.histogram().astype(np.int32)
        return payload

    def histogram(self) -> np.ndarray:
        """n_k^y: the client's training samples of each label."""
        return np.bincount(self.data.train_y.cpu().numpy(), minlength=self.num_classes)

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation: the head weighted by n_k over a public scale (the global
        # head), and with per-label teachers the head weighted by n_k^y in row y of a table of
        # every label (the teacher of y: FedGen.aggregate_sums); the histogram over a scale
        # that keeps counts integral through the sum: every round ('label': the round's pool)
        # and when the server asked for it (the pool of every client it knows).
        histogram, scale = self.histogram(), secure_aggregation.weight_scale(self.cfg)
        head = {k: upload[k] for k in HEAD}
        dense = secure_aggregation.weighted(head, self.secure_weight())
        per_count = count_scale(self.cfg)
        if self.cfg.settings.teacher_weights == "label":
            held = np.flatnonzero(histogram)
            row = np.concatenate([head["head.weight"].ravel(), head["head.bias"]])
            table = secure_aggregation.class_table(held, np.tile(row, (len(held), 1)),
                                                   histogram[held] / scale, self.num_classes)
            dense.update({TEACHERS + k: v for k, v in table.items()})
            dense[ROUND_COUNTS] = histogram / per_count
        dense[NEW_COUNTS] = (histogram / per_count if LABEL_COUNTS in upload
                             else np.zeros(self.num_classes))
        return dense


def count_scale(cfg: RunConfig) -> int:
    """The public divisor of label counts in a secure upload: the least integer that keeps any
    client's count within upload-max-abs, so that the summed counts, times it, round back to
    the exact integers (each survivor's count is off by less than one quantisation step
    times this divisor)."""
    return max(1, math.ceil(secure_aggregation.weight_scale(cfg) / cfg.upload_max_abs))


def counts_from_sum(summed: np.ndarray, scale: int) -> np.ndarray:
    """Integer label counts from the sum of secure uploads' ``counts / scale``."""
    return np.maximum(np.rint(summed * scale), 0).astype(np.int64)


def teacher_heads(table: Payload, num_classes: int, feature_dim: int
                  ) -> tuple[list[Payload], np.ndarray]:
    """From the summed table of per-label weighted heads (row y: ``sum_k n_k^y [W_k, b_k]``
    over S, its weight ``sum_k n_k^y`` over S): the C teacher heads ``sum_k w[y, k] h_k`` as
    heads (zeros for a label nobody holds, whose weights are zero too), with the identity as
    their weights [C, C], which :func:`train_generator` takes as it takes the K heads."""
    c, d = num_classes, feature_dim
    rows = secure_aggregation.class_means_from_sums(table)
    heads = [{"head.weight": np.zeros((c, d), np.float32), "head.bias": np.zeros(c, np.float32)}
             for _ in range(c)]
    for y, row in rows.items():
        heads[y] = {"head.weight": row[:c * d].reshape(c, d), "head.bias": row[c * d:]}
    return heads, np.eye(c)


class FedGen(FedStrategy):
    """Trains G on the ensemble of the uploaded heads, then averages the heads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedGenSettings = self.cfg.settings
        # The global head starts as client 0's initial head (HtFLlib), so that every client
        # starts from the same head: partition 0's model, from its key under model-init.
        first = setup.new_model(self.cfg, self.architectures[0], self.input_shape,
                                self.num_classes, *setup.own_key(self.cfg, 0))
        self.feature_dim = first.feature_dim
        self.global_head: Payload = state_arrays(first, list(HEAD))
        s = self.settings
        with isolated_rng(derive_seed(self.cfg.seed, "fedgen-generator-init")):
            self.generator = Generator(s.noise_dim, self.num_classes, s.hidden_dim,
                                       self.feature_dim)
        self.label_counts: dict[int, np.ndarray] = {}  # partition id -> its label histogram
        # With secure-aggregation: the histograms reported, known only as their sum.
        self.reported_pool = np.zeros(self.num_classes, np.int64)
        self.reported: set[int] = set()  # partition ids whose histogram came in an upload
        if s.label_pool == "partition":  # HtFLlib's: every client's labels known at start-up
            labels = setup.dataset(self.cfg).train_y.numpy()
            for pid, split in enumerate(setup.partition(self.cfg).clients):
                own = labels[np.asarray(split.train, np.int64)]
                if split.label_permutation is not None:  # the labels the client sees
                    own = np.asarray(split.label_permutation, np.int64)[own]
                self.label_counts[pid] = np.bincount(own, minlength=self.num_classes)
        # G goes down once the label pool is known: from the first aggregation on, or at once.
        self.generator_sent = bool(self.label_counts)
        self.last_generator_ce: float | None = None

    def server_terms(self) -> dict[str, float]:
        """The ensemble's cross-entropy on G's features at the last step of this round's
        training: how well G has learnt to produce what the heads call each label."""
        return {} if self.last_generator_ce is None else {
            "generator-ce": self.last_generator_ce}

    def _pool(self, partitions) -> np.ndarray:
        pool = np.zeros(self.num_classes, np.int64)
        for pid in partitions:
            pool += self.label_counts[pid]
        return pool

    def known_pool(self) -> np.ndarray:
        """The label histogram pooled over every client the server knows."""
        return self._pool(self.label_counts) + self.reported_pool

    def wants_counts(self, client: ClientInfo | None) -> bool:
        """Whether the server asks ``client`` for its label histogram: once, unless the
        partition already gave it (a node that trains on its own data is asked all the same)."""
        if client is None:
            return True
        pid = client.partition_id
        return pid not in self.reported and (pid not in self.label_counts or client.own_data)

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        wanted = self.wants_counts(client)
        cache = getattr(self, "_payloads", None)
        if cache is None or cache[0] != server_round:
            cache = self._payloads = (server_round, {})
        if wanted not in cache[1]:
            payload = dict(self.global_head)
            if self.generator_sent:
                payload.update({GENERATOR_PREFIX + k: v.detach().numpy().astype(np.float32)
                                for k, v in self.generator.named_parameters()})
                payload[LABEL_POOL] = self.known_pool().astype(np.int32)
            if wanted:
                payload[SEND_COUNTS] = np.ones(1, np.int32)
            cache[1][wanted] = payload
        return cache[1][wanted]

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.global_head

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        spec = {"head.weight": ArraySpec((self.num_classes, self.feature_dim)),
                "head.bias": ArraySpec((self.num_classes,))}
        if self.wants_counts(client):
            spec[LABEL_COUNTS] = ArraySpec((self.num_classes,), kind="int", low=0)
        return spec

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        if LABEL_COUNTS in payload:
            # Every training sample counted once: the histogram weighs the teachers.
            total, bound = int(payload[LABEL_COUNTS].sum()), self.examples_bound(client)
            if total == 0 or total > bound or (not client.own_data and total != bound):
                raise PayloadError(f"label counts sum to {total}; partition "
                                   f"{client.partition_id} has {bound} training examples")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        for u in uploads:
            if LABEL_COUNTS in u.payload:
                self.label_counts[u.client.partition_id] = u.payload[LABEL_COUNTS].astype(
                    np.int64)
                self.reported.add(u.client.partition_id)
        pids = [u.client.partition_id for u in uploads]
        # Under robust-aggregation the rule drops (or, norm-bound, moves) outlying heads: the
        # ensemble and the average are then those of the kept heads, as if the others had not
        # been sent this round (their label histograms stay known: they are the clients' own).
        heads, keep = self.teachers([{k: u.payload[k] for k in HEAD} for u in uploads], pids,
                                    what="the heads")
        heads = [h for h, kept in zip(heads, keep) if kept]
        pids = [p for p, kept in zip(pids, keep) if kept]
        num_examples = np.array([u.num_examples for u, kept in zip(uploads, keep) if kept],
                                np.float64)
        s = self.settings
        counts = np.stack([self.label_counts[p] for p in pids])
        # The paper's teachers are this round's clients: with per-label weights the labels
        # come from their pooled histogram; HtFLlib's from every client's.
        pool = counts.sum(0) if s.teacher_weights == "label" else self.known_pool()
        self.server_step(server_round, heads,
                         teacher_weights(counts, num_examples, s.teacher_weights), pool,
                         weighted_average(heads, num_examples.tolist()))

    def server_step(self, server_round: int, heads: list[Payload], weights: np.ndarray,
                    pool: np.ndarray, head: Payload) -> None:
        """Train G on the ensemble of ``heads`` with ``weights`` [C, K], labels drawn from
        ``pool``, then install the averaged ``head`` as the global head."""
        s = self.settings
        if s.keep_generator:
            self.last_generator_ce = train_generator(
                self.generator, heads, weights, pool, s,
                s.server_batch_size or self.cfg.batch_size,
                derive_seed(self.cfg.seed, "fedgen-server", server_round))
        # else HtFLlib's code: its server reloads the initial G before each training
        # (servergen.py:112) and never saves the trained one, so its clients only ever see
        # the initial G; training a copy to throw away changes nothing, so none is trained.
        self.generator_sent = True
        self.global_head = head
        self._payloads = None

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        c, d = self.num_classes, self.feature_dim
        layout = {"head.weight": (c, d), "head.bias": (c,), secure_aggregation.SUM_WEIGHT: (1,),
                  NEW_COUNTS: (c,)}
        if self.settings.teacher_weights == "label":
            layout.update({TEACHERS + k: v for k, v in secure_aggregation.class_table_layout(
                c, (c * d + c,)).items()})
            layout[ROUND_COUNTS] = (c,)
        return layout

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # The survivors the server asked for their histogram sent it (NEW_COUNTS): the sum
        # joins the known pool (a histogram the partition gave is replaced by the reported one,
        # as in aggregate). The round's own pool and each label's teacher head (the table of
        # n_k^y-weighted heads) come from the sums, and G trains on those C heads.
        for u in uploads:
            if self.wants_counts(u.client):
                self.label_counts.pop(u.client.partition_id, None)
                self.reported.add(u.client.partition_id)
        per_count = count_scale(self.cfg)
        self.reported_pool = self.reported_pool + counts_from_sum(sums[NEW_COUNTS], per_count)
        mean = secure_aggregation.weighted_mean(
            {k: sums[k] for k in (*HEAD, secure_aggregation.SUM_WEIGHT)})
        c, d = self.num_classes, self.feature_dim
        if self.settings.teacher_weights == "label":
            heads, weights = teacher_heads(
                {k.removeprefix(TEACHERS): v for k, v in sums.items() if k.startswith(TEACHERS)},
                c, d)
            pool = counts_from_sum(sums[ROUND_COUNTS], per_count)
        else:  # one weight n_k / sum_j n_j per client: every label's teacher is the mean head
            heads = [{k: mean[k].astype(np.float32) for k in HEAD}]
            weights, pool = np.ones((c, 1)), self.known_pool()
        self.server_step(server_round, heads, weights, pool,
                         {k: mean[k].astype(np.float32) for k in HEAD})
