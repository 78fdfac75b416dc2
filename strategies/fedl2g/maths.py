"""FedL2G (Zhang et al., arXiv 2410.06490): learning to guide local training in heterogeneous
federated learning.

The server keeps learnable *guiding vectors* V in R^{C x m}, one per class, drawn from N(0, 1);
they replace the data-derived prototypes of FedProto. Variant ``feat`` guides the features
(v = f(x), m = d; every extractor must output the same d), variant ``logit`` the logits
(v = h(f(x)), m = C; any architectures). Each client holds out a fixed *quiz set* of
``quiz-batches * batch-size`` training samples and trains only on the rest, the *study set*.

Each round t (1-based) a client

1. after the warm-up (t > wu = floor(``warmup-fraction`` * rounds)) trains its whole model on
   the study set with ``CE + MSE(v, V[y])`` (gradients clipped at 100, the recipe's
   ``grad-clip``);
2. takes one look-ahead step on a copy of its parameters, ``theta' = theta - eta * grad L_s``,
   with ``L_s`` the mean of ``CE + MSE(v, V[y])`` over ``study-batches`` random study batches,
   and computes the meta-gradient ``G = dL_q(theta') / dV`` of the quiz set's cross-entropy,
   through the look-ahead step (the step is then discarded);
3. uploads the rows of G that are not zero: those of the classes in its study batches.

The server averages each class's rows over the clients that sent one (zero for classes nobody
sent), clips the whole matrix to norm 100 and takes one SGD step ``V <- V - eta_s * G``; V goes
down to every client. During the warm-up clients only take the meta step: V learns against the
untrained models, and nobody is evaluated (the last round excepted, whose evaluation the results
need).

The meta-gradient is second-order: ``G_c = (2 eta / (B * mdb * m)) * sum_{i: y_i = c} J_i .
grad_theta' L_q``, with J_i the Jacobian of v(x_i) at theta. It is computed with
``torch.func.functional_call`` and double backward (the authors' code uses the unmaintained
``higher``), on copies of the parameters and buffers, so the model and its BatchNorm statistics
are untouched.

Traffic per client per round: up the nonzero rows, S*m floats plus their S labels (32-bit) for S
classes in the study batches (at most 10 * 512 floats = 20,480 bytes for ``feat`` at d = 512,
C = 10; 400 bytes for ``logit``); down V, C*m floats.

With ``secure-aggregation`` the client sends a table of all C classes instead (its rows where
it sent them, zeros elsewhere, a weight and a holders column of 1 for the classes sent): summed
over the survivors, row c over its weight is the same per-class mean over the senders, and the
clip and the step act on that mean as they do without it (docs/privacy.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedapp.runtime import secure_aggregation
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import TrainStats, train_recipe
from fedapp.seeding import derive_seed
from strategies.fedl2g import FedL2GSettings

GUIDE = "guiding-vectors"
LABELS, GRADS = "labels", "meta-gradients"
# The whole aggregated meta-gradient is clipped to this norm (the authors' code).
SERVER_CLIP = 100.0


def guided_loss(params: dict[str, torch.Tensor], model: torch.nn.Module,
                guide: torch.Tensor, x: torch.Tensor, y: torch.Tensor, variant: str,
                with_guide: bool = True) -> torch.Tensor:
    """``CE + MSE(v, V[y])`` (or CE alone) of the model with ``params`` (parameters and
    buffers, by state-dict name) on one batch; v = features or logits."""
    features = functional_call(model.extractor, _part(params, "extractor."), (x,))
    logits = functional_call(model.head, _part(params, "head."), (features,))
    loss = F.cross_entropy(logits, y)
    if with_guide:
        v = features if variant == "feat" else logits
        loss = loss + F.mse_loss(v, guide[y])
    return loss


def _part(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}


def meta_gradient(model: torch.nn.Module, guide: torch.Tensor,
                  study: list[tuple[torch.Tensor, torch.Tensor]],
                  quiz: list[tuple[torch.Tensor, torch.Tensor]], lr: float,
                  variant: str) -> torch.Tensor:
    """``dL_q(theta') / dV`` with ``theta' = theta - lr * grad_theta L_s(theta, V)``: ``L_s``
    the mean guided loss over the ``study`` batches, ``L_q`` the mean cross-entropy over the
    ``quiz`` batches. On copies of the parameters and buffers, in the model's current mode;
    the model itself is not changed. Returns a tensor shaped like ``guide``."""
    params = {k: v.detach().clone().requires_grad_(True)
              for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    v_guide = guide.detach().clone().requires_grad_(True)
    study_loss = sum(guided_loss({**params, **buffers}, model, v_guide, x, y, variant)
                     for x, y in study) / len(study)
    grads = torch.autograd.grad(study_loss, list(params.values()), create_graph=True)
    # The look-ahead step, differentiable in V (create_graph keeps dtheta'/dV).
    ahead = {k: p - lr * g for (k, p), g in zip(params.items(), grads)}
    quiz_loss = sum(guided_loss({**ahead, **buffers}, model, v_guide, x, y, variant,
                                with_guide=False) for x, y in quiz) / len(quiz)
    (meta,) = torch.autograd.grad(quiz_loss, v_guide)
    return meta.detach()


class FedL2GClient(FedClient):
    """Trains on its study set with the guiding vectors (after the warm-up), then sends the
    meta-gradient of its quiz loss with respect to them."""

    def receive(self, payload: Payload, server_round: int) -> None:
        self.guide = torch.from_numpy(payload[GUIDE]).to(self.device)

    def quiz_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(quiz indices, study indices) of the training set: a fixed random quiz set of
        ``quiz-batches * batch-size`` samples. HtFLlib takes the first samples of its stored
        split (``fedl2g.quiz-set = "first"``); partitions here keep indices sorted, so the
        first ones would follow the dataset's order."""
        n = len(self.data.train_y)
        size = min(self.cfg.settings.quiz_batches * self.cfg.batch_size, n - 1)
        if self.cfg.settings.quiz_set == "first":
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                derive_seed(self.cfg.seed, "fedl2g-quiz", self.partition_id)))
        return order[:size].to(self.device), order[size:].to(self.device)

    def train(self, server_round: int):
        s = self.cfg.settings
        quiz_idx, study_idx = self.quiz_split()
        x, y = self.data.train_x, self.data.train_y
        study_x, study_y = x[study_idx], y[study_idx]
        if server_round > s.warmup_rounds(self.cfg.num_server_rounds):
            def loss(bx: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
                features = self.model.features(bx)
                logits = self.model.head(features)
                v = features if s.variant == "feat" else logits
                return F.cross_entropy(logits, by) + F.mse_loss(v, self.guide[by])
            stats = train_recipe(self.model, study_x, study_y, loss_fn=loss,
                                 optimizer=self.optimizer(), cfg=self.cfg,
                                 generator=self.batch_generator(server_round),
                                 steps=self.local_steps())
        else:
            stats = None
        # The look-ahead: random study batches and the quiz set in random batches, as the
        # authors' shuffled loaders give them.
        rng = self.batch_generator(server_round, "fedl2g-meta")
        b = self.cfg.batch_size
        study_order = study_idx[torch.randperm(len(study_idx), generator=rng).to(self.device)]
        quiz_order = quiz_idx[torch.randperm(len(quiz_idx), generator=rng).to(self.device)]
        study = [(x[i], y[i]) for i in study_order[:s.study_batches * b].split(b)]
        quiz = [(x[i], y[i]) for i in quiz_order.split(b)][:s.quiz_batches]
        self.model.train()
        lr = self.cfg.lr * self.cfg.lr_factor(server_round)
        self.meta = meta_gradient(self.model, self.guide, study, quiz, lr, s.variant)
        # Warm-up: nothing trained, so no training loss to report (NaN: left out as n/a).
        return stats or TrainStats(loss=math.nan, steps=0, samples=0)

    def upload(self) -> Payload:
        rows = torch.nonzero(self.meta.abs().sum(1) > 0).flatten()
        return {LABELS: rows.cpu().numpy().astype(np.int32),
                GRADS: self.meta[rows].cpu().numpy().astype(np.float32)}

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation: a table of all C classes, its rows in the rows of the
        # classes it sent, each counting once (weight 1), so that the server's sums give the
        # same per-class mean over the senders (FedL2G.aggregate_sums).
        labels = upload[LABELS]
        return secure_aggregation.class_table(labels, upload[GRADS], np.ones(len(labels)),
                                              self.num_classes)


class FedL2G(FedStrategy):
    """Averages the meta-gradients per class and steps the guiding vectors."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedL2GSettings = self.cfg.settings
        self.dim = (self.new_model(self.architectures[0]).feature_dim
                    if self.settings.variant == "feat" else self.num_classes)
        # N(0, 1), as nn.Embedding's initialisation in the authors' code; with guide-seed the
        # same draw in every run, which for 0 is HtFLlib's guide exactly.
        seed = self.settings.guide_seed
        rng = torch.Generator().manual_seed(
            seed if seed >= 0 else derive_seed(self.cfg.seed, "fedl2g-guide-init"))
        self.guide = torch.randn(self.num_classes, self.dim, generator=rng)
        self._payload = {GUIDE: self.guide.numpy().copy()}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {LABELS: self.label_spec(), GRADS: ArraySpec((None, self.dim))}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        labels = payload[LABELS]
        if len(labels) != len(payload[GRADS]) or len(labels) == 0:
            raise PayloadError(f"{len(payload[GRADS])} meta-gradient rows for {len(labels)} "
                               "labels")
        if len(np.unique(labels)) != len(labels):
            raise PayloadError("a class appears twice among the labels")

    def evaluation_clients(self, server_round: int, available):
        # HtFLlib evaluates only after the warm-up (the models are untrained before it).
        if server_round <= self.settings.warmup_rounds(self.cfg.num_server_rounds) \
                and server_round != self.cfg.num_server_rounds:
            return []
        return super().evaluation_clients(server_round, available)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        sums = np.zeros((self.num_classes, self.dim), np.float64)
        senders = np.zeros(self.num_classes, np.int64)
        for u in uploads:
            sums[u.payload[LABELS]] += u.payload[GRADS]
            senders[u.payload[LABELS]] += 1
        # Per-class mean over the clients that sent the class; zero where nobody did.
        mean = np.divide(sums, senders[:, None], out=np.zeros_like(sums),
                         where=senders[:, None] > 0)
        if self.robust.rule != "none":
            rows: dict[int, list[np.ndarray]] = {}
            for u in uploads:
                for c, row in zip(u.payload[LABELS], u.payload[GRADS]):
                    rows.setdefault(int(c), []).append(row)
            for c, row in self.robust_class_means(rows).items():
                mean[c] = row
        self.step_guide(mean)

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return secure_aggregation.class_table_layout(self.num_classes, (self.dim,))

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # The same per-class mean over the senders as aggregate, from the sums of the
        # survivors' class tables (zero where no survivor sent the class); the clip and the
        # step act on that mean, as they do without secure aggregation.
        mean = np.zeros((self.num_classes, self.dim), np.float64)
        for c, row in secure_aggregation.class_means_from_sums(sums).items():
            mean[c] = row
        self.step_guide(mean)

    def step_guide(self, mean: np.ndarray) -> None:
        """The server's step on the guiding vectors from the round's [C, m] mean
        meta-gradient: the whole matrix clipped to norm 100, then ``V <- V - eta_s * G``."""
        norm = float(np.linalg.norm(mean))
        if norm > SERVER_CLIP:
            mean = mean * (SERVER_CLIP / (norm + 1e-6))  # as torch's clip_grad_norm_
        self.guide = (self.guide.double() - self.settings.eta_s() * torch.from_numpy(mean)
                      ).float()
        self._payload = {GUIDE: self.guide.numpy().copy()}
