"""The two-model client: a private model of the client's own architecture beside a *shared*
model of one architecture that every client holds and the server averages.

FML's meme model, FedMRL's small homogeneous model and FedKD's mentee are all this shared model;
each method's module then holds only its loss and what it uploads and downloads. Here:

- the settings every such method has (``<method>.shared-arch``, ``<method>.average``) are
  ``fedapp.runtime.two_model_settings.SharedModelSettings``, which the run's ``cfg.settings``
  derive from;
- :func:`shared_architecture` / :func:`build_shared_model`: the shared model's architecture
  (default: the smallest of the run's arch mix by parameter count) and its initial weights,
  the same on the server and on every client (seeded by the run's seed alone);
- :class:`TwoModelClient`: a ``FedClient`` whose training steps the private model, the shared
  model and any private modules of the method (FedMRL's projector, FedKD's W_h) together, each
  with its own optimizer (kept under its own name with ``optimizer-state = "keep"``), and keeps
  the shared model and those modules in ``context.state`` beside the private model (so in the
  idle file of ``client-state = "disk"``, in checkpoints and on a SuperNode's state-dir);
- :class:`SharedModelStrategy`: the server side that sends the shared model and averages the
  uploaded ones (``FedStrategy.average``: weighted, or robust-aggregation's rule).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from client_models import HeteroModel, build_model, parse_arch_mix
from fedapp.config import ConfigError, RunConfig
from fedapp.data import setup
from fedapp.data.local_data import expected_input
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import TrainStats, train_epochs
from fedapp.seeding import derive_seed, isolated_rng

SHARED_STATE_KEY = "fedapp.shared-model"
MODULE_STATE_KEY = "fedapp.module.{name}"


def _build(cfg: RunConfig, arch: str, input_shape: tuple[int, int, int], num_classes: int,
           *seed_parts: int | str) -> HeteroModel:
    pool = cfg.settings.shared_pool_dim(cfg)
    with isolated_rng(setup.model_init_seed(cfg, arch, *seed_parts)):
        model = build_model(arch, input_shape, num_classes,
                            feature_dim=(cfg.feature_dim or None) if pool
                            else cfg.settings.shared_feature_dim(cfg),
                            width=cfg.model_width)
        return pooled(model, pool) if pool else model


def pooled(model: HeteroModel, size: int) -> HeteroModel:
    """``model`` whose representation is average-pooled to ``size`` (HtFLlib's BaseHeadSplit
    puts ``AdaptiveAvgPool1d(feature_dim)`` where the model's own head was), with a new head
    ``Linear(size, C)``."""
    if size > model.feature_dim:
        raise ConfigError(f"the shared model {model.arch} represents with d = "
                          f"{model.feature_dim} features, fewer than the s = {size} to pool to")
    model.extractor = torch.nn.Sequential(model.extractor, torch.nn.AdaptiveAvgPool1d(size))
    model.feature_dim = size
    model.head = torch.nn.Linear(size, model.num_classes)
    return model


@functools.lru_cache(maxsize=8)
def shared_architecture(cfg: RunConfig, input_shape: tuple[int, int, int],
                        num_classes: int) -> str:
    """The shared model's architecture: ``<method>.shared-arch``, else the run's smallest by
    parameter count (ties by name), computed identically by the server and every client."""
    if cfg.settings.shared_arch:
        name = parse_arch_mix(cfg.settings.shared_arch)[0]
        _build(cfg, name, input_shape, num_classes, "shared-size")  # raises if it cannot run
        return name

    def size(arch: str) -> int:
        model = _build(cfg, arch, input_shape, num_classes, "shared-size")
        return sum(p.numel() for p in model.parameters())
    return min(sorted(set(cfg.architectures)), key=lambda a: (size(a), a))


def build_shared_model(cfg: RunConfig, input_shape: tuple[int, int, int],
                       num_classes: int) -> HeteroModel:
    """The shared model's initial weights: one key for the whole run, so the server's copy and
    every client's start equal. With ``model-init = "per-architecture"`` it is the draw of its
    architecture that the private models of that architecture start from, as in HtFLlib, which
    builds it right after seeding torch as every client does before building its model; with
    ``"shared"`` also the first layers of every other architecture that begins as it does."""
    own = ("shared-model",) if cfg.model_init == "per-client" else ()
    return _build(cfg, shared_architecture(cfg, tuple(input_shape), num_classes),
                  tuple(input_shape), num_classes, *own)


def kl_to(target_logits: torch.Tensor, logits: torch.Tensor,
          reduction: str = "batchmean") -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)), the distillation term of mutual learning.

    ``batchmean``: the textbook batch mean; ``mean``: PyTorch's ``KLDivLoss`` default (HtFLlib),
    which also divides by the number of classes."""
    return F.kl_div(F.log_softmax(logits, dim=1), F.log_softmax(target_logits, dim=1),
                    reduction=reduction, log_target=True)


class PerModuleSteps:
    """Several optimizers stepped as one, each over one module's parameters, each module's
    gradient clipped to ``clip`` on its own (as HtFLlib's FML and FedKD clip each model)."""

    def __init__(self, parts: list[tuple[list[torch.nn.Parameter], torch.optim.Optimizer]],
                 clip: float) -> None:
        self.parts = parts
        self.clip = clip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, optimizer in self.parts:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for params, optimizer in self.parts:
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(params, self.clip)
            optimizer.step()


class TwoModelClient(FedClient):
    """The private model (``self.model``), the shared model (``self.shared``) and the method's
    private modules (``self.modules``), trained together on the method's :meth:`loss`.

    By default the client installs what the server sends into the shared model and uploads the
    whole shared model back (FML, FedMRL); evaluation uses :meth:`predictor`, the private
    model unless the method says otherwise."""

    def private_modules(self) -> dict[str, Callable[[], torch.nn.Module]]:
        """The method's own private modules beside the two models, as constructors (default:
        none); each is built from (seed, name, partition id) and kept in ``context.state``."""
        return {}

    def keep_module(self, name: str) -> bool:
        """Whether module ``name`` is kept across rounds (default: yes)."""
        return True

    def module_lr(self, name: str) -> float | None:
        """The learning rate of module ``name`` ("model", "shared" or a private module's);
        None = the recipe's."""
        return None

    @functools.cached_property
    def shared(self) -> HeteroModel:
        """The shared model as this client last kept it (the run's initial one at first)."""
        model = build_shared_model(self.cfg, *expected_input(self.cfg)).to(self.device)
        record = self.context.state.get(SHARED_STATE_KEY)
        if record is not None:
            model.load_state_dict(record.to_torch_state_dict())
        return model

    @functools.cached_property
    def modules(self) -> dict[str, torch.nn.Module]:
        """The method's private modules, as this client last kept them. They start as the
        private model does (``model-init``): each client's own draw, or with
        ``"per-architecture"`` or ``"shared"`` one draw that every client shares (HtFLlib
        re-seeds torch before building them, so FedKD's W_h and FedMRL's projector start alike
        in all its clients)."""
        built = {}
        own = setup.own_key(self.cfg, self.partition_id)
        for name, make in self.private_modules().items():
            with isolated_rng(derive_seed(self.cfg.seed, "model-init", name, *own)):
                module = make().to(self.device)
            record = self.context.state.get(MODULE_STATE_KEY.format(name=name))
            if record is not None and self.keep_module(name):
                module.load_state_dict(record.to_torch_state_dict())
            built[name] = module
        return built

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """Every module a training step updates, by optimizer name."""
        return {"model": self.model, "shared": self.shared, **self.modules}

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.shared, payload)

    def upload(self) -> Payload:
        return state_arrays(self.shared)

    def secure_weight(self) -> float:
        # The weight SharedModelStrategy.average_weights gives this upload.
        return 1.0 if self.cfg.settings.average == "uniform" else super().secure_weight()

    def train(self, server_round: int) -> TrainStats:
        """The recipe's local epochs (or steps) of :meth:`loss`, one optimizer per module."""
        c = self.cfg
        modules = self.trained_modules()
        steps = PerModuleSteps([(list(m.parameters()), self.optimizer(
            m.parameters(), name, lr=self.module_lr(name))) for name, m in modules.items()],
            c.grad_clip)
        return train_epochs(torch.nn.ModuleDict(modules), self.data.train_x, self.data.train_y,
                            loss_fn=self.loss, optimizer=steps, epochs=c.local_epochs,
                            steps=self.local_steps(), batch_size=c.batch_size,
                            generator=self.batch_generator(server_round), grad_clip=0.0,
                            drop_last=c.drop_last, shuffle=c.batch_order == "shuffled")

    def save_state(self, server_round: int) -> None:
        """The shared model and the kept private modules, then the private model (base; last,
        so that a checkpoint of ``context.state`` holds them all)."""
        state = self.context.state
        state[SHARED_STATE_KEY] = _record(self.shared)
        for name, module in self.modules.items():
            if self.keep_module(name):
                state[MODULE_STATE_KEY.format(name=name)] = _record(module)
        super().save_state(server_round)


def _record(module: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord(torch_state_dict={k: v.detach().cpu()
                                         for k, v in module.state_dict().items()})


def spec_of(arrays: Payload) -> dict[str, ArraySpec]:
    """An upload must have exactly the names, shapes and kinds of ``arrays``."""
    return {name: ArraySpec(a.shape, "float" if a.dtype.kind == "f" else "int")
            for name, a in arrays.items()}


class SharedModelStrategy(FedStrategy):
    """Keeps the global shared model, sends it to every client trained, averages the uploads
    (``<method>.average``: by training-set size, or uniformly as HtFLlib)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        model = build_shared_model(self.cfg, self.input_shape, self.num_classes)
        self.shared_arch = model.arch
        self.shared_model: Payload = state_arrays(model)

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.shared_model  # one dict: encoded once a round

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return spec_of(self.shared_model)

    def average_weights(self, uploads: Iterable[Upload]) -> list[float]:
        uniform = self.cfg.settings.average == "uniform"
        return [1.0 if uniform else float(u.num_examples) for u in uploads]

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        self.shared_model = self.average([u.payload for u in uploads],
                                         self.average_weights(uploads),
                                         reference=self.shared_model)

