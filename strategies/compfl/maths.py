"""CompFL, server mode: cooperative training of several expert architectures for personalised FL.

A list of M expert architectures W_1 < ... < W_M (the run's ``arch-mix``, ordered by parameter
count) is trained together. Client i runs the expert j_i of its own architecture and may also
use every smaller one. Only extractors are shared, one global extractor theta~_j per
architecture; every head is private (per-client label permutations therefore work), and a
client keeps one private head per expert it uses. In round t a client:

1. *adapts* (:func:`adapt_expert`): installs theta~_j, sets the head row of each local class c
   to the (normalised) class prototype, the mean of theta~_j(x) over its class-c samples (bias
   0; rows of absent classes are kept), then fine-tunes the head for one epoch at lr eta_g —
   for its own expert and for each smaller expert it uses;
2. *evaluates* each adapted expert of the distillation ensemble on its validation split and
   weights them ``s = softmax(minmax(acc) / tau)`` (:func:`expert_weights`);
3. *selects* (:func:`select_expert`, epsilon-greedy): a client that can run more than the
   smallest expert trains, with probability epsilon, an expert drawn uniformly from
   {1, ..., j_i} instead of its own (its own model is then only adapted that round);
4. *trains* the selected expert end to end with ``CE + lambda * L_align + mu * L_kd``
   (:func:`compfl_loss`): ``L_align`` pulls each feature to its class mean under the received
   global extractor (the prototypes of step 1, fixed during training), ``L_kd`` is the KL
   divergence between the soft target ``0.5 * onehot(y) + 0.5 * sum_j s_j softmax(expert_j(x))``
   (:func:`ensemble_target`) and the local prediction, after the warm-up rounds;
5. *uploads* the trained extractor only, as the delta to the received one (Algorithm 1) or as
   weights; array names carry the architecture (``"<arch>/extractor.0.weight"``).

The server (:class:`CompFL`) keeps one extractor per architecture; architecture j becomes
``theta~_j + sum_i alpha_i Delta_i`` with ``alpha_i = n_i / sum n`` over the round's returners
of j (untouched when nobody trained it), and each client downloads its own expert and the
smaller ones it uses. Up: the trained extractor's parameters; down: the own and smaller
experts' extractors. ``compfl.align``, ``compfl.greedy`` and ``compfl.kd`` switch the three
components off one by one (the paper's Table 3 ablation).

With ``secure-aggregation`` (rounds only) a client uploads FedPer's table of every expert's
extractor instead, its trained one in that expert's slot (``CompFLClient.secure_upload``);
the server's per-expert averages, from the sums, are the same.

The client's steps are plain functions of models, tensors and settings (:func:`local_round`),
independent of how the extractors arrive, so a device-to-device relay can call them too.

Where the paper (Xu et al., FedKDD 2024) is silent or ambiguous (docs/compfl.md), the defaults
and switches are:

- learning rates: ``lr`` for the end-to-end training and ``compfl.head-lr`` = 0.1 for the head
  fine-tuning (FedPAC's values; the paper gives none);
- ``compfl.align-form = "mse"``: FedPAC's mean over samples *and* dimensions; the paper's
  squared L2 norm averaged over samples is ``"squared-norm"`` (d times larger);
- ``compfl.kd-direction = "target-first"``: ``KL(t || softmax(local))``, the usual KD direction
  (t has full support); the formula as printed, ``KL(softmax(local) || t)``, is
  ``"prediction-first"``. No temperature;
- ``compfl.kd-teachers = "own-and-smaller"``: the ensemble is the client's own adapted expert
  and the smaller ones. The appendix restricts KD to smaller experts (``"smaller"``), which
  leaves clients of the smallest expert without any teacher;
- ``compfl.kd-warmup = 0.1``: KD starts after the first 10% of the rounds ("some warm-up
  rounds" in the paper);
- ``compfl.prototype-init = "normalised"``: prototype rows scaled to unit norm; ``"raw"`` uses
  the class means as they are;
- the expert weights are measured on the client's validation split (``val-fraction``); a client
  without one uses its training data;
- prototypes, alignment anchors and the ensemble's predictions are computed once per round in
  eval mode with the received (frozen) extractors; the head is fine-tuned on these features.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from client_models import HeteroModel
from fedapp.config import RunConfig
from fedapp.data import setup
from fedapp.data.local_data import expected_input
from fedapp.data.partitions import ClientData
from fedapp.runtime.class_stats import ClassMeans, ClassSums, class_target_mse
from fedapp.runtime.client_base import FedClient, load_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError, from_ndarrays
from fedapp.runtime.strategy_base import ClientInfo, Upload
from fedapp.runtime.training import TrainStats, evaluate, recipe_optimizer, train_recipe
from fedapp.seeding import derive_seed
from strategies.compfl import CompFLSettings
from strategies.fedper.maths import (PerArchitectureExtractors, arrays_spec, extractor_arrays,
                                     secure_group_upload)

HEAD_STATE_KEY = "compfl.head.{arch}"  # a client's private head of a smaller expert
COPY_STATE_KEY = "compfl.copy.{arch}"  # device to device: its last copy of an expert


# -- who uses which expert -------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def expert_order(cfg: RunConfig, input_shape: tuple[int, int, int],
                 num_classes: int) -> tuple[str, ...]:
    """The run's architectures as CompFL's experts W_1 < ... < W_M: by parameter count (ties
    by name), computed identically by the server and every client."""
    def size(arch: str) -> int:
        model = setup.new_model(cfg, arch, input_shape, num_classes, "compfl-size")
        return sum(p.numel() for p in model.parameters())
    return tuple(sorted(set(cfg.architectures), key=lambda a: (size(a), a)))


def kd_active(settings: CompFLSettings, cfg: RunConfig, server_round: int) -> bool:
    """Whether ``L_kd`` is used in ``server_round`` (only after the warm-up rounds)."""
    warmup = int(settings.kd_warmup * cfg.num_server_rounds)
    return settings.kd and settings.mu > 0 and server_round > warmup


def experts_used(order: tuple[str, ...], arch: str, settings: CompFLSettings, cfg: RunConfig,
                 server_round: int) -> tuple[str, ...]:
    """The experts a client of ``arch`` needs in a round, smallest first, its own last: the
    smaller ones only when it may train them (greedy) or distils from them (KD)."""
    own = order.index(arch)
    if settings.greedy or kd_active(settings, cfg, server_round):
        return order[:own + 1]
    return (arch,)


def trainable_experts(order: tuple[str, ...], arch: str,
                      settings: CompFLSettings) -> tuple[str, ...]:
    """The experts a client of ``arch`` may train and upload: never a larger one."""
    own = order.index(arch)
    return order[:own + 1] if settings.greedy else (arch,)


def pack(arch: str, arrays: Payload) -> Payload:
    """Extractor arrays under names that carry their architecture (``"<arch>/<name>"``)."""
    return {f"{arch}/{name}": a for name, a in arrays.items()}


def unpack(payload: Payload) -> dict[str, Payload]:
    """The inverse of :func:`pack` over several experts: ``{arch: {name: array}}``."""
    out: dict[str, Payload] = {}
    for key, array in payload.items():
        arch, sep, name = key.partition("/")
        if not sep:
            raise PayloadError(f"array {key!r} does not name its expert ('<arch>/<name>')")
        out.setdefault(arch, {})[name] = array
    return out


# -- the client's steps: pure functions of models, tensors and settings ------------------------

@dataclass
class AdaptedExpert:
    """An expert fitted to a client's data: the received global extractor, a private head."""

    arch: str
    model: HeteroModel
    features: torch.Tensor      # eval-mode theta~(x) of the training data
    anchors: torch.Tensor       # [C, d] class prototypes z~_c (alignment targets)
    has_anchor: torch.Tensor    # [C] bool: the class occurs locally
    accuracy: float | None = None  # on the validation split, when it enters the ensemble


@torch.no_grad()
def embed(model: HeteroModel, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """``model.features(x)`` in eval mode (no dropout, BatchNorm running statistics)."""
    was_training = model.training
    model.eval()
    z = torch.cat([model.features(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
                  ) if len(x) else torch.zeros(0, model.feature_dim, device=x.device)
    model.train(was_training)
    return z


@torch.no_grad()
def prototype_head_init(head: torch.nn.Linear, prototypes: ClassMeans, normalise: bool) -> None:
    """Row c of the head := the prototype of class c (unit-norm when ``normalise``), bias 0,
    for every class in ``prototypes``; rows of the other classes are kept."""
    if len(prototypes.labels) == 0:
        return
    rows = torch.from_numpy(prototypes.means).to(head.weight)
    if normalise:
        rows = F.normalize(rows, dim=1)
    labels = torch.from_numpy(prototypes.labels.astype(np.int64)).to(head.weight.device)
    head.weight[labels] = rows
    head.bias[labels] = 0.0


def adapt_expert(arch: str, model: HeteroModel, extractor: Payload, x: torch.Tensor,
                 y: torch.Tensor, cfg: RunConfig, generator: torch.Generator) -> AdaptedExpert:
    """Model adaptation: install the global extractor, re-initialise the private head from the
    class prototypes and fine-tune it (extractor frozen) for ``compfl.head-epochs``."""
    s: CompFLSettings = cfg.settings
    load_arrays(model, extractor)
    features = embed(model, x)
    sums = ClassSums(model.num_classes)
    if len(y):
        sums.add(features, y)
    prototypes = sums.means()
    prototype_head_init(model.head, prototypes, s.prototype_init == "normalised")
    if s.head_epochs:
        # The extractor is frozen, so one pass of features serves every head epoch.
        head = model.head
        train_recipe(head, features, y, loss_fn=lambda z, t: F.cross_entropy(head(z), t),
                     # Fresh every round whatever optimizer-state says: the head was just
                     # re-initialised from the prototypes.
                     optimizer=recipe_optimizer(head.parameters(), cfg, s.head_lr), cfg=cfg,
                     epochs=s.head_epochs, generator=generator)
    anchors = torch.zeros(model.num_classes, model.feature_dim, device=features.device)
    has_anchor = torch.zeros(model.num_classes, dtype=torch.bool, device=features.device)
    if len(prototypes.labels):
        labels = torch.from_numpy(prototypes.labels.astype(np.int64)).to(features.device)
        anchors[labels] = torch.from_numpy(prototypes.means).to(features.device)
        has_anchor[labels] = True
    return AdaptedExpert(arch, model, features, anchors, has_anchor)


def expert_weights(accuracies: list[float], tau: float) -> np.ndarray:
    """``s_j = softmax(minmax(a)_j / tau)``; equal weights when all accuracies are equal."""
    a = np.asarray(accuracies, dtype=np.float64)
    span = a.max() - a.min()
    normalised = (a - a.min()) / span if span > 0 else np.zeros_like(a)
    e = np.exp((normalised - normalised.max()) / tau)
    return e / e.sum()


def select_expert(own: int, epsilon: float, rng: np.random.Generator) -> int:
    """Epsilon-greedy: the own expert index ``own`` with probability 1 - epsilon, otherwise one
    drawn uniformly from {0, ..., own}. A client of the smallest expert has no choice."""
    if own == 0:
        return 0
    return int(rng.integers(own + 1)) if rng.random() < epsilon else own


def ensemble_target(y: torch.Tensor, probabilities: list[torch.Tensor], weights: np.ndarray,
                    num_classes: int) -> torch.Tensor:
    """``t = 0.5 * onehot(y) + 0.5 * sum_j s_j * p_j`` with ``p_j`` = softmax of expert j."""
    mixture = sum(float(w) * p for w, p in zip(weights, probabilities))
    return 0.5 * F.one_hot(y, num_classes).to(mixture.dtype) + 0.5 * mixture


def kd_loss(logits: torch.Tensor, target: torch.Tensor, direction: str) -> torch.Tensor:
    """Mean over the batch of ``KL(t || softmax(logits))`` (``target-first``) or of
    ``KL(softmax(logits) || t)`` (``prediction-first``, the paper's formula as printed)."""
    log_p = F.log_softmax(logits, 1)
    if direction == "target-first":
        return F.kl_div(log_p, target, reduction="batchmean")
    return F.kl_div(target.log(), log_p, log_target=True, reduction="batchmean")


def alignment_loss(z: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor,
                   has_anchor: torch.Tensor, form: str) -> torch.Tensor:
    """``L_align``: distance of each feature to its class anchor; ``mse`` averages over the d
    dimensions too (FedPAC), ``squared-norm`` sums them (the paper)."""
    mse = class_target_mse(z, y, anchors, has_anchor)
    return mse * z.shape[1] if form == "squared-norm" else mse


def compfl_loss(logits: torch.Tensor, z: torch.Tensor, y: torch.Tensor, expert: AdaptedExpert,
                soft_target: torch.Tensor | None, settings: CompFLSettings) -> torch.Tensor:
    """``CE + lambda * L_align + mu * L_kd`` on one mini-batch (``soft_target`` None: no KD)."""
    loss = F.cross_entropy(logits, y)
    if settings.align and settings.lam > 0:
        loss = loss + settings.lam * alignment_loss(z, y, expert.anchors, expert.has_anchor,
                                                    settings.align_form)
    if soft_target is not None:
        loss = loss + settings.mu * kd_loss(logits, soft_target, settings.kd_direction)
    return loss


def train_expert(expert: AdaptedExpert, x: torch.Tensor, y: torch.Tensor,
                 soft_targets: torch.Tensor | None, cfg: RunConfig,
                 generator: torch.Generator, optimizer: torch.optim.Optimizer) -> TrainStats:
    """End-to-end training of the selected expert for ``local-epochs`` (or ``local-steps``
    mini-batches) with the CompFL loss."""
    model, s = expert.model, cfg.settings

    def loss_fn(idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = model.features(x[idx])
        return compfl_loss(model.head(z), z, target, expert,
                           None if soft_targets is None else soft_targets[idx], s)

    # train_recipe slices what it is given by mini-batch; giving it the sample indices lets
    # the loss look up each sample's soft target, computed once before training.
    return train_recipe(model, torch.arange(len(y), device=y.device), y, loss_fn=loss_fn,
                        optimizer=optimizer, cfg=cfg, generator=generator)


@dataclass
class LocalUpdate:
    """What one client's round produced."""

    arch: str                       # the expert that was trained
    upload: Payload                 # its extractor: delta or weights (unprefixed names)
    stats: TrainStats
    adapted: dict[str, AdaptedExpert] = field(default_factory=dict)
    weights: np.ndarray | None = None  # s_j of the ensemble (None: no KD this round)


def local_round(models: dict[str, HeteroModel], received: dict[str, Payload], data: ClientData,
                cfg: RunConfig, partition_id: int, server_round: int,
                expert: str | None = None, progress_round: int | None = None,
                optimizer_for: Callable[[str, HeteroModel], torch.optim.Optimizer] | None = None
                ) -> LocalUpdate:
    """One CompFL round of a client: adapt, evaluate, select, train, compute the upload.

    ``models`` holds the experts the client uses, smallest first and its own last (private
    heads; extractors are overwritten by ``received``, the extractors by architecture: the
    server's global ones, or in the device-to-device loops the model that arrived and the
    last copies of the others the client has seen). ``expert`` names the expert to train
    (device to device: the one that arrived) instead of the epsilon-greedy choice;
    ``progress_round`` is the round that decides the KD warm-up when it is not
    ``server_round`` (then the client's own update number); ``optimizer_for(arch, model)``
    gives the optimizer of the expert trained (default: a new one from the recipe). Experts
    absent from ``received`` are not adapted and teach nothing. The models are changed in
    place."""
    s: CompFLSettings = cfg.settings
    order = list(models)
    own = len(order) - 1
    if expert is None:
        rng = np.random.default_rng(derive_seed(cfg.seed, "compfl-greedy", partition_id,
                                                server_round))
        chosen = select_expert(own, s.epsilon if s.greedy else 0.0, rng)
    else:
        chosen = order.index(expert)
    teachers = []
    if kd_active(s, cfg, progress_round or server_round):
        teachers = [j for j in range(own + 1 if s.kd_teachers == "own-and-smaller" else own)
                    if order[j] in received]
    adapted = {}
    for j in sorted({chosen, *teachers} | ({own} if order[own] in received else set())):
        arch = order[j]
        if arch not in received:
            raise ValueError(f"the server did not send the global extractor of {arch!r}")
        adapted[j] = adapt_expert(arch, models[arch], received[arch], data.train_x,
                                  data.train_y, cfg, torch.Generator().manual_seed(derive_seed(
                                      cfg.seed, "compfl-head", partition_id, server_round, arch)))
    soft_targets, weights = None, None
    if teachers:
        # A client without a validation split measures its experts on its training data.
        val = (data.val_x, data.val_y) if len(data.val_y) else (data.train_x, data.train_y)
        for j in teachers:
            adapted[j].accuracy = evaluate(adapted[j].model, *val)[1]
        weights = expert_weights([adapted[j].accuracy for j in teachers], s.tau)
        with torch.no_grad():
            probabilities = [F.softmax(adapted[j].model.head(adapted[j].features), 1)
                             for j in teachers]
        soft_targets = ensemble_target(data.train_y, probabilities, weights,
                                       models[order[own]].num_classes)
    optimizer_for = optimizer_for or (lambda _, m: recipe_optimizer(m.parameters(), cfg))
    stats = train_expert(adapted[chosen], data.train_x, data.train_y, soft_targets, cfg,
                         torch.Generator().manual_seed(derive_seed(
                             cfg.seed, "batches", partition_id, server_round)),
                         optimizer_for(order[chosen], adapted[chosen].model))
    arch = order[chosen]
    trained = extractor_arrays(adapted[chosen].model)
    if s.upload == "delta":  # Delta = theta_{j,i}^{t+1} - theta~_j^t (Algorithm 1)
        trained = {k: v - received[arch][k].astype(v.dtype) for k, v in trained.items()}
    return LocalUpdate(arch, trained, stats, {a.arch: a for a in adapted.values()}, weights)


# -- Flower client and server -----------------------------------------------------------------

def gossip_mix(models: list[Payload], weights: list[float]) -> Payload:
    """``sum_j w_j theta_j`` over the models a gossip message carries (float arrays, summed
    in float64); integer buffers (BatchNorm's step counter) take the largest value."""
    mixed = {}
    for name, first in models[0].items():
        if first.dtype.kind == "f":
            mixed[name] = sum(w * m[name].astype(np.float64) for w, m in zip(weights, models)
                              ).astype(first.dtype)
        else:
            mixed[name] = np.max([m[name] for m in models], axis=0)
    return mixed


class CompFLClient(FedClient):
    """Runs :func:`local_round` on its own expert (``self.model``) and private smaller experts
    whose heads live in ``context.state`` between rounds.

    In the device-to-device loops (``fedapp.loops.relay``) a message is a *visit*: the config
    names the expert that arrived (``visit`` = ``walk``: the walker; ``gossip``: the client's
    and its neighbours' models with their mixing weights, mixed here). The client trains that
    expert with the same :func:`local_round`, its other experts' extractors taken from the last
    copies it kept of them (``compfl.copy.<arch>`` in its state), and replies with the trained
    extractor's weights, which the relay passes on."""

    def read_payload(self, parameters: list[np.ndarray], config: dict) -> Payload:
        if config.get("visit") != "gossip":
            return super().read_payload(parameters, config)
        sizes = [int(n) for n in str(config["mix-sizes"]).split(",")]
        weights = [float(w) for w in str(config["mix-weights"]).split(",")]
        bounds = np.cumsum([0, *sizes])
        return gossip_mix([from_ndarrays(parameters[a:b]) for a, b in zip(bounds, bounds[1:])],
                          weights)

    def receive(self, payload: Payload, server_round: int) -> None:
        order = expert_order(self.cfg, *expected_input(self.cfg))
        self.visit = self.message.get("visit")
        if self.visit is None:  # server mode: the global extractors of the experts used
            self.received = unpack(payload)
            used = experts_used(order, self.arch, self.cfg.settings, self.cfg, server_round)
        else:
            expert = str(self.message["expert"])
            mine = order[:order.index(self.arch) + 1]
            self.received = {a: self._copy(a) for a in mine
                             if COPY_STATE_KEY.format(arch=a) in self.context.state}
            self.received[expert] = unpack(payload)[expert]
            used = tuple(a for a in mine if a in self.received or a == self.arch)
        self.smaller_experts = {arch: self._smaller_expert(arch) for arch in used[:-1]}

    def train(self, server_round: int) -> TrainStats:
        visit = self.visit is not None
        self.update = local_round(
            {**self.smaller_experts, self.arch: self.model}, self.received, self.data, self.cfg,
            self.partition_id, server_round, expert=self.message["expert"] if visit else None,
            progress_round=int(self.message["progress-round"]) if visit else None,
            # One optimizer per expert the client trains (kept with optimizer-state = "keep").
            optimizer_for=lambda arch, model: self.optimizer(model.parameters(),
                                                             f"expert-{arch}"))
        return self.update.stats

    def upload(self) -> Payload:
        if self.visit is None:
            return pack(self.update.arch, self.update.upload)
        # The next holder installs it: weights, never a delta.
        return pack(self.update.arch, self.trained_weights())

    def secure_upload(self, upload: Payload) -> Payload:
        # With secure-aggregation (server mode only): the trained expert's extractor, delta or
        # weights, in that expert's slot of the table of every expert (fedper's layout).
        [(arch, arrays)] = unpack(upload).items()
        return secure_group_upload(self, arch, arrays)

    def trained_weights(self) -> Payload:
        return extractor_arrays(self.update.adapted[self.update.arch].model)

    def _copy(self, arch: str) -> Payload:
        record = self.context.state[COPY_STATE_KEY.format(arch=arch)]
        return {k: v.numpy() for k, v in record.to_torch_state_dict().items()}

    def fit_metrics(self) -> dict:
        return {"compfl-expert": self.update.arch}  # which expert epsilon-greedy trained

    def _smaller_expert(self, arch: str) -> HeteroModel:
        """A smaller expert with this client's private head for it (fresh at first use)."""
        model = setup.new_model(self.cfg, arch, *expected_input(self.cfg),
                                self.partition_id, "compfl-expert").to(self.device)
        key = HEAD_STATE_KEY.format(arch=arch)
        if key in self.context.state:
            model.head.load_state_dict(self.context.state[key].to_torch_state_dict())
        return model

    def save_state(self, server_round: int) -> None:
        """The private heads of the smaller experts used, and the own model (base; last, so
        that a checkpoint of ``context.state`` holds the heads too)."""
        for arch, model in getattr(self, "smaller_experts", {}).items():
            self.context.state[HEAD_STATE_KEY.format(arch=arch)] = ArrayRecord(
                torch_state_dict={k: v.detach().cpu() for k, v in model.head.state_dict().items()})
        if getattr(self, "visit", None) is not None:  # the copy of the expert it trained
            self.context.state[COPY_STATE_KEY.format(arch=self.update.arch)] = ArrayRecord(
                torch_state_dict={k: torch.from_numpy(v)
                                  for k, v in self.trained_weights().items()})
        super().save_state(server_round)


class CompFL(PerArchitectureExtractors):
    """One global extractor per expert; sends each client its own and the smaller ones it uses;
    ``theta~_j += sum_i alpha_i Delta_i`` over the returners of j."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: CompFLSettings = self.cfg.settings
        self.order = expert_order(self.cfg, self.input_shape, self.num_classes)
        self._sent: dict[tuple[str, ...], Payload] = {}  # this round's payload per expert set
        self._sent_round = 0

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if client is None:
            return {}
        if server_round != self._sent_round:
            self._sent, self._sent_round = {}, server_round
        used = experts_used(self.order, client.arch, self.settings, self.cfg, server_round)
        if used not in self._sent:  # one dict per expert set and round: encoded once
            self._sent[used] = {k: v for arch in used
                                for k, v in pack(arch, self.extractors[arch]).items()}
        return self._sent[used]

    def upload_spec(self, client: ClientInfo, expert: str | None = None
                    ) -> dict[str, ArraySpec]:
        """The trained extractor of ``expert`` (default: the client's own), named after it."""
        return pack(expert or client.arch, arrays_spec(self.extractors[expert or client.arch]))

    def named_upload_spec(self, names: list[str], client: ClientInfo
                          ) -> dict[str, ArraySpec]:
        # The names say which expert was trained (epsilon-greedy may pick a smaller one).
        experts = set(unpack(dict.fromkeys(names)))
        if len(experts) != 1:
            raise PayloadError(f"an upload must hold one expert's extractor, got {sorted(experts)}")
        expert = experts.pop()
        allowed = trainable_experts(self.order, client.arch, self.settings) \
            if self.cfg.server_loop == "rounds" else self.order[:self.order.index(client.arch) + 1]
        if expert not in allowed:
            raise PayloadError(f"a client of {client.arch} may train only {list(allowed)}, "
                               f"not {expert!r}")
        return self.upload_spec(client, expert)

    def trained_extractor(self, upload: Upload) -> tuple[str, Payload]:
        [(arch, arrays)] = unpack(upload.payload).items()
        return arch, arrays

    def starting_point(self, arch: str) -> Payload:
        if self.settings.upload == "weights":
            return super().starting_point(arch)
        return {k: np.zeros_like(v) for k, v in self.extractors[arch].items()}  # a delta

    def merge(self, arch: str, average: Payload) -> Payload:
        if self.settings.upload == "weights":
            return average  # = theta~ + sum_i alpha_i (w_i - theta~)
        return {k: (v + average[k]).astype(v.dtype) for k, v in self.extractors[arch].items()}

    # -- device to device (fedapp.loops.relay): the server only says which experts exist, who
    #    can run them and where they start; it never averages
    def experts(self) -> tuple[str, ...]:
        return self.order

    def can_run(self, arch: str, expert: str) -> bool:
        return self.order.index(expert) <= self.order.index(arch)

    def initial_model(self, expert: str) -> Payload:
        """The expert's extractor as initialised from the seed, named after it."""
        return pack(expert, self.extractors[expert])
