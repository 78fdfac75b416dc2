"""DepthFL (Kim, Yu, Kim and Moon, "DepthFL: Depthwise Federated Learning for
Heterogeneous Clients", ICLR 2023): depth-scaled sub-models of one multi-exit global model.

The global model (``depthfl.model``, ``client_models.depth_prefix``) has D stages and an exit
classifier after each; client k holds its first d_k stages and their d_k exits
(``depthfl.depths``). Nothing but that prefix travels each way; its entries carry the global
model's names, so no index map is needed.

Client k, each round, from the prefix it received (theta_g):

    L = sum_i [ CE(o_i, y) + w_t / (d_k - 1) * sum_{j != i} KL(sigma(o_j) || sigma(o_i)) ]
        - <theta, h_k> + alpha/2 ||theta - theta_g||^2

over its exits i (all of them; only the deepest with ``depthfl.all-exits = false``, InclusiveFL),
each KL holding its target exit constant (mutual self-distillation within one model, T = 1),
w_t = exp(-5 (1 - min(t, 300)/300)^2) with t = round - 1, and FedDyn's terms (``depthfl.feddyn``)
with h_k kept in ``context.state``: after training h_k <- h_k - alpha (theta - theta_g). SGD at
lr x 0.998^t. It uploads its whole prefix, BatchNorm statistics included.

Server: every entry of the global model is averaged, unweighted, over the clients whose prefix
holds it (Σ values and Σ counts per entry: :func:`~fedapp.runtime.aggregate.average_where_held`);
an entry nobody held keeps its value. With FedDyn, for every parameter (weights and biases, not
BatchNorm's statistics) h <- h - alpha * count * (mean - theta_old) / K, K = num-clients, and
theta = mean - h / alpha.

Evaluation: the server scores the global model on the global test set (``server_accuracy``):
the ensemble, the mean of all D exits' logits (``ensemble``), and each exit alone (``exit-i``),
as the paper reports; each client scores its depth's prefix of the global model on its own
test split, the ensemble of its exits as ``accuracy`` and each exit as ``accuracy-exit-i``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from client_models.depth_prefix import (DepthPrefixModel, build_depth_model, max_depth,
                                        prefix_names)
from fedapp.config import RunConfig
from fedapp.data.local_data import expected_input
from fedapp.data.setup import model_init_seed
from fedapp.runtime import secure_aggregation
from fedapp.runtime.aggregate import Robust, average_where_held
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.submodels import (CoordinateAverage, meta_shapes, padded_layout,
                                      padded_upload, whole_maps)
from fedapp.runtime.training import EVAL_BATCH, TrainStats, train_recipe
from fedapp.seeding import isolated_rng
from strategies.depthfl import DepthFLSettings
from strategies.fedper.maths import arrays_spec

FEDDYN_STATE_KEY = "depthfl.feddyn-h"  # h_k in context.state, beside the prefix; never sent


def distillation_weight(server_round: int, ramp_rounds: int) -> float:
    """w_t = exp(-5 (1 - min(t, R)/R)^2) with t = ``server_round`` - 1 (the reference's
    ``consistency_weight``: 0.0067 in round 1, 1 from round R + 1); 1 when R = 0."""
    if ramp_rounds == 0:
        return 1.0
    t = min(max(server_round - 1, 0), ramp_rounds)
    return math.exp(-5.0 * (1.0 - t / ramp_rounds) ** 2)


def kl_from(target_logits: torch.Tensor, logits: torch.Tensor, eps: float) -> torch.Tensor:
    """KL(p || sigma(logits)), summed over classes and averaged over the batch, with p =
    sigma(target_logits) + ``eps`` held constant (the reference's ``KLLoss`` at T = 1: its
    target is not renormalised)."""
    p = F.softmax(target_logits.detach(), dim=1) + eps
    return (p * (p.log() - F.log_softmax(logits, dim=1))).sum(1).mean()


def exit_losses(outs: list[torch.Tensor], y: torch.Tensor, weight: float,
                settings: DepthFLSettings) -> torch.Tensor:
    """The exits' loss on one batch: each trained exit's CE plus ``weight`` times its mean KL
    from every other exit (the reference's ``_train_one_epoch``)."""
    n = len(outs)
    loss = outs[0].new_zeros(())
    for i, o in enumerate(outs):
        if not settings.all_exits and i != n - 1:
            continue  # InclusiveFL trains the deepest exit only
        loss = loss + F.cross_entropy(o, y)
        if settings.self_distillation and n > 1:
            loss = loss + weight * sum(kl_from(outs[j], o, settings.kl_target_eps)
                                       for j in range(n) if j != i) / (n - 1)
    return loss


def feddyn_penalty(model: torch.nn.Module, anchor: dict[str, torch.Tensor],
                   h: dict[str, torch.Tensor], alpha: float) -> torch.Tensor:
    """FedDyn's client terms: -<theta, h_k> + alpha/2 ||theta - theta_g||^2 over the
    parameters (``anchor``: theta_g, the received prefix)."""
    total = next(model.parameters()).new_zeros(())
    for name, p in model.named_parameters():
        total = total - (p * h[name]).sum() + alpha / 2 * (p - anchor[name]).pow(2).sum()
    return total


def aggregate_prefixes(global_model: Payload, payloads: list[Payload], h: dict[str, np.ndarray],
                       alpha: float, num_clients: int, feddyn: bool,
                       robust: Robust | None = None) -> tuple[Payload, dict[str, np.ndarray]]:
    """(the new global model, the new h) from the round's prefixes: each entry the mean over
    the payloads holding it (``robust``: that coordinate-wise rule over them instead); with
    ``feddyn``, for the entries of ``h`` (the parameters), h <- h - alpha * count * (mean -
    theta_old) / K and theta = mean - h / alpha. An entry no payload holds keeps its value
    (and its h)."""
    means, counts = average_where_held(payloads, robust)
    return feddyn_step(global_model, means, counts, h, alpha, num_clients, feddyn)


def feddyn_step(global_model: Payload, means: dict[str, np.ndarray], counts: dict[str, int],
                h: dict[str, np.ndarray], alpha: float, num_clients: int, feddyn: bool
                ) -> tuple[Payload, dict[str, np.ndarray]]:
    """:func:`aggregate_prefixes` from the entries' means and holder counts (the entries held
    this round; what a secure sum gives as well: ``DepthFL.aggregate_sums``)."""
    new_model, new_h = dict(global_model), dict(h)
    for name, mean in means.items():
        old = global_model[name]
        if feddyn and name in h:
            new_h[name] = h[name] - alpha * counts[name] * (mean - old) / num_clients
            mean = mean - new_h[name] / alpha
        new_model[name] = (np.rint(mean).astype(old.dtype) if old.dtype.kind in "iu"
                           else mean.astype(np.float32))
    return new_model, new_h


@torch.no_grad()
def exit_accuracies(model: DepthPrefixModel, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each exit's accuracy on ``(x, y)`` in eval mode, in evaluation's batches."""
    model.eval()
    correct = torch.zeros(model.depth)
    for start in range(0, len(y), EVAL_BATCH):
        want = y[start:start + EVAL_BATCH]
        for i, o in enumerate(model.exit_logits(x[start:start + EVAL_BATCH])):
            correct[i] += int((o.argmax(1) == want).sum())
    return [float(c) / max(len(y), 1) for c in correct]


def depth_model(cfg: RunConfig, depth: int, input_shape: tuple[int, int, int],
                num_classes: int, *seed_parts: object) -> DepthPrefixModel:
    """The depth-``depth`` prefix of the run's global model, initialised from (seed, model,
    *seed_parts)."""
    s: DepthFLSettings = cfg.settings
    with isolated_rng(model_init_seed(cfg, s.model, *seed_parts)):
        return build_depth_model(s.model, depth, input_shape, num_classes,
                                 width=cfg.model_width)


class DepthFLClient(FedClient):
    """Trains its prefix's exits with self-distillation (and FedDyn); uploads its prefix."""

    anchor: dict[str, torch.Tensor] = {}  # theta_g, the prefix as received

    @functools.cached_property
    def depth(self) -> int:
        return self.cfg.settings.client_depths(self.cfg)[self.partition_id]

    def new_private_model(self) -> torch.nn.Module:
        # Overwritten by every message: what the server sends is the model.
        return depth_model(self.cfg, self.depth, *expected_input(self.cfg), "client",
                           self.depth)

    def receive(self, payload: Payload, server_round: int) -> None:
        # With depthfl.download = "global" the whole global model comes; the client keeps its
        # prefix, as the reference's zip of its own state-dict keys with the received list.
        names = set(self.model.state_dict())
        load_arrays(self.model, {k: v for k, v in payload.items() if k in names})
        self.anchor = {k: p.detach().clone() for k, p in self.model.named_parameters()}
        # BatchNorm's batch counters as received (secure_upload sends their change).
        self.received_counts = {k: np.asarray(v) for k, v in payload.items()
                                if k in names and np.asarray(v).dtype.kind in "iu"}

    def feddyn_h(self) -> dict[str, torch.Tensor]:
        """h_k as last saved (zeros at first)."""
        record = self.context.state.get(FEDDYN_STATE_KEY)
        saved = record.to_torch_state_dict() if record is not None else {}
        return {k: saved[k].to(self.device) if k in saved else torch.zeros_like(p)
                for k, p in self.model.named_parameters()}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s: DepthFLSettings = self.cfg.settings
        loss = exit_losses(self.model.exit_logits(x), y, self.kd_weight, s)
        if s.feddyn:
            loss = loss + feddyn_penalty(self.model, self.anchor, self.h, s.feddyn_alpha)
        return loss

    def train(self, server_round: int) -> TrainStats:
        s: DepthFLSettings = self.cfg.settings
        self.kd_weight = distillation_weight(server_round, s.kd_ramp_rounds)
        self.h = self.feddyn_h() if s.feddyn else {}
        lr = self.cfg.lr * s.lr_round_decay ** max(server_round - 1, 0)
        stats = train_recipe(self.model, self.data.train_x, self.data.train_y,
                             loss_fn=self.loss, optimizer=self.optimizer(lr=lr), cfg=self.cfg,
                             generator=self.batch_generator(server_round),
                             steps=self.local_steps())
        if s.feddyn:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    self.h[name] -= s.feddyn_alpha * (p - self.anchor[name])
        return stats

    def upload(self) -> Payload:
        return state_arrays(self.model)

    def secure_weight(self) -> float:
        return 1.0  # DepthFL's average is unweighted

    def secure_upload(self, upload: Payload) -> Payload:
        # The prefix padded to the full depth: every entry it holds (whole, at the global
        # model's name) and a weight of 1 there, zeros for the deeper entries; the survivors'
        # sum gives each entry's Σ and its number of holders (DepthFL.aggregate_sums).
        # BatchNorm's batch counters travel as their change since the round's global value,
        # which every holder received: the counters keep growing over the rounds and would
        # pass the clipping range (upload-max-abs), their change is the round's local steps.
        values = {name: array - self.received_counts[name] if name in self.received_counts
                  else array for name, array in upload.items()}
        s: DepthFLSettings = self.cfg.settings
        global_shapes = meta_shapes(lambda: build_depth_model(
            s.model, max_depth(s.model), *expected_input(self.cfg), width=self.cfg.model_width))
        return padded_upload(global_shapes, values,
                             whole_maps({name: a.shape for name, a in values.items()}),
                             self.secure_weight())

    def fit_metrics(self) -> dict:
        return {"term-kd-weight": self.kd_weight}

    def save_state(self, server_round: int) -> None:
        if getattr(self, "h", None):
            self.context.state[FEDDYN_STATE_KEY] = ArrayRecord(
                torch_state_dict={k: v.detach().cpu() for k, v in self.h.items()})
        super().save_state(server_round)

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return {f"exit-{i + 1}": a for i, a in enumerate(exit_accuracies(self.model, x, y))}


class DepthFL(FedStrategy):
    """Keeps the global model (and FedDyn's h); sends each client its depth's prefix."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: DepthFLSettings = self.cfg.settings
        self.depths = self.settings.client_depths(self.cfg)  # by partition id
        model = self.global_module()
        self.global_model = state_arrays(model)
        self.h = ({name: np.zeros(p.shape) for name, p in model.named_parameters()}
                  if self.settings.feddyn else {})
        # Caches of the current global model (not state): its prefixes and its module.
        self._prefixes: tuple[Payload | None, dict[int, Payload]] = (None, {})
        self._predictor: tuple[Payload | None, DepthPrefixModel | None] = (None, None)

    def method_state(self) -> dict:
        return {k: v for k, v in super().method_state().items()
                if k not in ("_prefixes", "_predictor")}

    def global_module(self) -> DepthPrefixModel:
        """A full-depth model (initial weights from (seed, model, "server"))."""
        return depth_model(self.cfg, max_depth(self.settings.model), self.input_shape,
                           self.num_classes, "server")

    def prefix(self, depth: int) -> Payload:
        """The global model's depth-``depth`` prefix: one dict per depth and global model, so
        that it is encoded once per round for all the clients of that depth."""
        # Keyed by the global model itself, not its id(): a later model may reuse a freed one's
        # address.
        model, cache = self._prefixes
        if model is not self.global_model:
            cache = {}
            self._prefixes = (self.global_model, cache)
        if depth not in cache:
            cache[depth] = {k: self.global_model[k]
                            for k in prefix_names(self.global_model, depth)}
        return cache[depth]

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if client is None:
            return {}
        if self.settings.download == "global":
            return self.global_model
        return self.prefix(self.depths[client.partition_id])

    eval_payload = fit_payload  # each client evaluates its prefix of the global model

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        sent = self.prefix(self.depths[client.partition_id])
        spec = arrays_spec(sent)
        # BatchNorm's batch counts come back as what was sent plus the round's local steps:
        # a larger count is refused, as it would be averaged into everyone's model.
        cfg = self.cfg
        steps = cfg.local_steps or cfg.local_epochs * math.ceil(
            self.examples_bound(client) / cfg.batch_size)
        for name, array in sent.items():
            if array.dtype.kind in "iu":
                spec[name] = ArraySpec(array.shape, "int", low=0,
                                       high=int(array.max(initial=0)) + steps)
        return spec

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        s = self.settings
        self.global_model, self.h = aggregate_prefixes(
            self.global_model, [u.payload for u in uploads], self.h, s.feddyn_alpha,
            self.cfg.num_clients, s.feddyn, self.robust)

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return padded_layout({name: array.shape for name, array in self.global_model.items()})

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # aggregate's step from the sums of the survivors' padded prefixes: an entry's summed
        # weight is its number of holders (a prefix holds an entry whole), its Σ over that the
        # mean; a counter's mean change is added to the value every holder received.
        noise = secure_aggregation.sum_error(self.cfg, len(uploads))
        total = CoordinateAverage.from_padded(self.global_model, sums, noise)
        means, counts = {}, {}
        for name, weight in total.counts.items():
            if not weight.size or weight.flat[0] <= 0:
                continue  # no survivor's prefix holds it
            old = self.global_model[name]
            means[name] = total.sums[name] / weight + (old if old.dtype.kind in "iu" else 0)
            counts[name] = int(np.rint(weight.flat[0]))
        s = self.settings
        self.global_model, self.h = feddyn_step(self.global_model, means, counts, self.h,
                                                s.feddyn_alpha, self.cfg.num_clients, s.feddyn)

    @torch.no_grad()
    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The global model's logits on a batch of global test inputs: the ensemble (the mean
        of all exits, the paper's headline) and each exit alone."""
        arrays, model = self._predictor
        if arrays is not self.global_model or model is None:
            model = self.global_module()
            load_arrays(model, self.global_model)
            self._predictor = (self.global_model, model)
        model.eval()
        outs = model.exit_logits(x)
        return {"ensemble": torch.stack(outs).mean(0),
                **{f"exit-{i + 1}": o for i, o in enumerate(outs)}}
