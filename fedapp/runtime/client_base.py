"""The client runtime every method's client builds on.

Flower rebuilds the ``NumPyClient`` for every message, so nothing may live on the object
between rounds: the client's private model is restored from ``context.state`` at the start of
each message and written back after training. A method subclass changes only what it receives
(:meth:`FedClient.receive`), its loss (:meth:`FedClient.loss`) and what it uploads
(:meth:`FedClient.upload`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.client import NumPyClient

from client_models import HeteroModel
from fedapp.config import ConfigError, RunConfig, client_cache_budget
from fedapp.data import setup
from fedapp.data.local_data import expected_input, load_local_data
from fedapp.data.partitions import ClientData, load_client_data
from fedapp.runtime import attacks, checkpoint, privacy, secure_aggregation
from fedapp.runtime.class_stats import ClassMeans, class_means
from fedapp.runtime.payload import Payload, from_ndarrays, to_ndarrays
from fedapp.runtime.speeds import has_stragglers, update_duration
from fedapp.runtime.training import (TrainStats, deterministic_cuda, evaluate, evaluate_head,
                                     features_in_batches, pick_device, recipe_optimizer,
                                     train_recipe)
from fedapp.seeding import derive_seed, isolated_rng

MODEL_STATE_KEY = "fedapp.model"
VERSION_KEY = "fedapp.model-version"
ROUND_KEY = "fedapp.round"  # the round after which context.state was last saved
# With optimizer-state = "keep": each named optimizer's state (momentum buffers, Adam's moments
# and step), kept beside the private model wherever context.state goes (memory, the idle file
# of client-state = "disk", checkpoints, a SuperNode's state-dir), and never sent.
OPTIMIZER_STATE_KEY = "fedapp.optimizer.{name}"


class BytesBoundedCache:
    """Least recently used entries, evicted once their total size passes ``budget`` bytes
    (the newest entry is always kept, however large).

    Bounded by bytes, not entries: in simulation a Ray actor serves whichever virtual clients
    Flower hands it, up to all of them, and Flower sends a round's fits, then its evaluations,
    so a cache holding fewer clients than an actor serves misses on every message. Twenty
    small CNNs and their shards fit in a few hundred MB; a bound by entries would have to be
    tuned to each model and dataset."""

    def __init__(self, budget: int, size_of: Callable[[Any], int]) -> None:
        self.budget = budget
        self.size_of = size_of
        self.entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.total = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.entries)

    def put(self, key: Hashable, value: Any) -> None:
        self.pop(key)
        size = self.size_of(value)
        self.entries[key] = (value, size)
        self.total += size
        while len(self.entries) > 1 and self.total > self.budget:
            self.total -= self.entries.popitem(last=False)[1][1]

    def take(self, key: Hashable) -> Any:
        """The entry of ``key`` (None if absent), now the most recently used."""
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def pop(self, key: Hashable, default: Any = None) -> Any:
        """Remove and return the entry of ``key`` (``default`` if absent)."""
        if key not in self.entries:
            return default
        value, size = self.entries.pop(key)
        self.total -= size
        return value

    def clear(self) -> None:
        self.entries.clear()
        self.total = 0


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Built models kept per process: rebuilding (and re-initialising) a model for every message
# costs more than a round of training on small shards. A cached model is used as it is only
# when its version matches the one saved in context.state; otherwise the state is loaded into
# it. Bounded by bytes of parameters and buffers, so a process serving many virtual clients
# does not hoard memory (on a GPU too: the models sit on the client's device).
_MODEL_CACHE = BytesBoundedCache(
    client_cache_budget(), lambda entry: tensors_bytes(entry[1].state_dict().values()))
# Clients' shards on their device, bounded likewise (the global test subset is kept once for
# all of them, by _global_test).
_DATA_CACHE = BytesBoundedCache(client_cache_budget(),
                                lambda shard: tensors_bytes(shard.tensors()))


class InjectedFault(RuntimeError):
    """A crash asked for by the ``fault-crash-fraction`` setting."""


class DeadlineExceeded(RuntimeError):
    """A client's training ran past ``round-timeout``: the server has counted it failed."""


def _in_a_ray_actor() -> bool:
    """Whether this process is a Ray worker (a simulation's actor), where one client's message
    holds an actor that other virtual clients share."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def round_deadline(seconds: float, what: str) -> Iterator[None]:
    """Give up (raise DeadlineExceeded) once ``seconds`` have passed (0: never).

    A reply after the round's deadline is thrown away by the server, and in simulation the Ray
    actor running this client would stay busy for nothing while other clients' messages wait
    for an actor, and miss the next round's deadline in turn. SIGALRM interrupts a sleep and
    Python code alike. Signals reach only the main thread, which is where Flower's Ray actors
    and ClientApp processes run a message; in another thread nothing is done. The model cache
    is safe: a model goes back into it only after its message succeeded."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise DeadlineExceeded(f"{what}: still busy after round-timeout = {seconds:g} s, "
                               "when the server has stopped waiting; gave up")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def state_arrays(model: torch.nn.Module, names: list[str] | None = None) -> Payload:
    """Named arrays of ``model.state_dict()`` (all, or only ``names``), as float32 numpy.

    0-d entries (BatchNorm's ``num_batches_tracked``) come as 1-element vectors: Flower's
    message layer delivers a 0-d array as shape (1,), so every path uses that shape."""
    state = model.state_dict()
    names = list(state) if names is None else names
    out = {}
    for name in names:
        value = np.atleast_1d(state[name].detach().cpu().numpy())
        out[name] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return out


def load_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Overwrite the named entries of ``model``'s state with ``arrays`` (names must exist; a
    1-element vector fills a 0-d entry, see :func:`state_arrays`)."""
    state = model.state_dict()
    unknown = [n for n in arrays if n not in state]
    if unknown:
        raise ValueError(f"the model has no entries {unknown}")
    with torch.no_grad():
        for name, value in arrays.items():
            target = state[name]
            target.copy_(torch.from_numpy(np.asarray(value)).reshape(target.shape)
                         .to(target.dtype))


def optimizer_state_arrays(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state as named CPU tensors (``"3.exp_avg"``: parameter 3
    of its groups in order). Hyperparameters are not kept: they come from the run config."""
    return {f"{index}.{key}": torch.as_tensor(value).detach().cpu().clone()
            for index, entries in optimizer.state_dict()["state"].items()
            for key, value in entries.items() if value is not None}


def load_optimizer_state(optimizer: torch.optim.Optimizer,
                         arrays: Mapping[str, torch.Tensor]) -> None:
    """The inverse of :func:`optimizer_state_arrays`, into an optimizer built over the same
    parameters in the same order."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in arrays.items():
        index, key = name.split(".", 1)
        # A 0-d value (Adam's step) may come back from a message or a file as shape (1,).
        state.setdefault(int(index), {})[key] = value.reshape(()) if key == "step" else value
    optimizer.load_state_dict({"state": state,
                               "param_groups": optimizer.state_dict()["param_groups"]})


def _device_data(cfg: RunConfig, partition_id: int, device: str,
                 data_dir: str = "") -> ClientData:
    """This client's shard on ``device``, kept in the process (``_DATA_CACHE``).

    The shard is partition ``partition_id`` of the run's dataset, or, when the node config
    names a ``data-dir``, the node's own data (``fedapp.data.local_data``)."""
    key = (cfg, partition_id, device, data_dir)
    shard = _DATA_CACHE.take(key)
    if shard is None:
        if data_dir:
            shard = load_local_data(data_dir, *expected_input(cfg), cfg.dataset)
        else:
            shard = load_client_data(setup.dataset(cfg), setup.partition_spec(cfg), partition_id)
        shard = ClientData(*(t.to(device) for t in shard.tensors()))
        _DATA_CACHE.put(key, shard)
    return shard


@functools.lru_cache(maxsize=2)
def _global_test(cfg: RunConfig, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The global test subset of ``eval-global-test`` (:func:`setup.global_test`) on
    ``device``: the same for every client, so their global accuracies are comparable, and kept
    once per process for all of them. A node with its own data-dir loads the shared dataset
    only for this."""
    x, y = setup.global_test(cfg)
    return x.to(device), y.to(device)


class FedClient(NumPyClient):
    """A virtual or real client: one partition, one architecture, one private model."""

    def __init__(self, context: Context, cfg: RunConfig) -> None:
        self.context = context
        self.cfg = cfg
        node = context.node_config
        try:
            self.partition_id = int(node["partition-id"])
            num_partitions = int(node["num-partitions"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("the node config must give integer 'partition-id' and "
                              f"'num-partitions'; got {dict(node)}") from None
        if num_partitions != cfg.num_clients or not 0 <= self.partition_id < num_partitions:
            raise ConfigError(
                f"node has partition-id={self.partition_id} of num-partitions={num_partitions}, "
                f"but the run config says num-clients={cfg.num_clients}. In simulation set "
                f"num-supernodes={cfg.num_clients} (fedapp run does this for you).")
        # Deployment only: a SuperNode may name its device and bring its own data folder.
        self.device = pick_device(str(node.get("device", "")))
        if self.device.type == "cuda" and cfg.deterministic:
            deterministic_cuda()
        self.data_dir = str(node.get("data-dir", ""))
        # Where checkpoints keep this client: a deployed node's own state-dir (one sub-folder
        # per run), else the run folder the server names in its messages (simulation).
        self.state_dir = (str(Path(str(node["state-dir"])) / cfg.run_name)
                          if node.get("state-dir") else "")
        self.arch = setup.architectures(cfg)[self.partition_id]
        # The optimizers this message uses whose state lives on (optimizer-state = "keep").
        self._kept_optimizers: dict[str, torch.optim.Optimizer] = {}
        self.reset_terms()

    # Data and model are loaded on first use, so that answering the server's "who are you?"
    # (get_properties) costs nothing.
    @functools.cached_property
    def data(self) -> ClientData:
        """This client's train / val / test tensors, on its device (a malicious client of
        ``attack = "label-flip"`` trains on flipped labels; its test labels stay true)."""
        shard = _device_data(self.cfg, self.partition_id, str(self.device), self.data_dir)
        if self.malicious and self.cfg.attack == "label-flip":
            shard = dataclasses.replace(shard, train_y=attacks.flip_labels(shard.train_y,
                                                                           self.num_classes))
        return shard

    @functools.cached_property
    def malicious(self) -> bool:
        """Whether this client attacks (``attack``, ``malicious-*``: fedapp.runtime.attacks)."""
        return self.partition_id in attacks.malicious_partitions(self.cfg)

    @functools.cached_property
    def global_test(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared global-test subset (with ``eval-global-test``), else None."""
        return _global_test(self.cfg, str(self.device)) if self.cfg.eval_global_test else None

    @functools.cached_property
    def num_classes(self) -> int:
        return expected_input(self.cfg)[1]

    @functools.cached_property
    def model(self) -> torch.nn.Module:
        """The private model, as last saved in ``context.state``."""
        return self._restore_model()

    def _restore_model(self) -> torch.nn.Module:
        """The private model as saved in ``context.state`` (fresh from the seed at first)."""
        key = (self.context.run_id, self.cfg, self.partition_id)
        state = self.context.state
        version = int(state[VERSION_KEY]["version"]) if VERSION_KEY in state else 0
        cached_version, model = _MODEL_CACHE.pop(key, (None, None))
        if model is None or (cached_version != version and MODEL_STATE_KEY not in state):
            # From the run config alone: a node with its own data-dir need not hold the
            # shared dataset to build its model.
            model = self.new_private_model().to(self.device)
            cached_version = 0
        if cached_version != version:
            model.load_state_dict(state[MODEL_STATE_KEY].to_torch_state_dict())
        self._version = version
        return model

    def _cache_model(self, version: int) -> None:
        """Put the model back in the cache once it is known to equal ``context.state``.

        Only after a message succeeded: a client that crashed mid-training leaves no cached
        model behind, so its next message starts again from what it last saved."""
        # Its gradients are not kept: training clears them before every backward pass, and
        # they would double what the cache holds beyond what it counts.
        self.model.zero_grad(set_to_none=True)
        _MODEL_CACHE.put((self.context.run_id, self.cfg, self.partition_id),
                         (version, self.model))

    # -- what a method changes ---------------------------------------------------------------
    def new_private_model(self) -> torch.nn.Module:
        """A freshly initialised private model (default: this client's architecture, from its
        own seed); a method whose clients hold another model (DepthFL's depth prefix of one
        global network) builds it here. Built from the run config alone: a node with its own
        data-dir need not hold the shared dataset to build its model."""
        return setup.new_model(self.cfg, self.arch, *expected_input(self.cfg),
                               *setup.own_key(self.cfg, self.partition_id))

    def read_payload(self, parameters: list[np.ndarray], config: Mapping[str, Any]) -> Payload:
        """The payload of a training message (default: one named-array payload; a message of
        a device-to-device loop may carry several)."""
        return from_ndarrays(parameters)

    def receive(self, payload: Payload, server_round: int) -> None:
        """Apply what the server sent before local training (default: nothing)."""

    def receive_for_evaluation(self, payload: Payload) -> bool:
        """Apply what the server sent for evaluation (default: as for training). Returns
        whether the model was changed (then it no longer equals the saved private model)."""
        if not payload:
            return False
        self.receive(payload, 0)
        return True

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Accuracies of other ways to predict with this client's model, reported beside the
        headline ``accuracy`` as ``accuracy-<name>`` (e.g. FedGH with the global header)."""
        return {}

    def test_features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The private model's features of ``x`` in evaluation's batches
        (:func:`~fedapp.runtime.training.features_in_batches`). During :meth:`evaluate` those of
        the test set are computed once, for the own head and every variant that scores
        another head or rule on them (a received global head, the nearest prototype): the
        extractor is most of an evaluation's work."""
        kept = getattr(self, "_test_features", None)
        if kept is not None and kept[0] is x:
            return kept[1]
        return features_in_batches(self.model, x)

    def head_accuracy(self, head: Payload, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accuracy on ``(x, y)`` of the private model's extractor with another head
        (``head.weight``, ``head.bias``: a received global head) in place of its own; the
        model itself is left untouched."""
        weight = self.model.head.weight
        other = torch.nn.Linear(weight.shape[1], weight.shape[0]).to(weight.device)
        load_arrays(other, {k.removeprefix("head."): v for k, v in head.items()})
        return evaluate_head(other, self.test_features(x), y)[1]

    def headline_variant(self) -> str | None:
        """The variant reported as ``accuracy`` instead of the model's own head (then reported
        as ``accuracy-own-head``); None = the model's own head is the headline."""
        return None

    def predictor(self) -> torch.nn.Module:
        """What predicts at evaluation: the private model (default), or a method's composite
        of it with other modules (FedMRL's shared and private extractors with a projector)."""
        return self.model

    def class_means(self) -> ClassMeans:
        """Exact per-class means of the private model's representations over the local
        training data (prototypes, FedGH's LARs), after ``class-means-drop-last``: without
        the short last batch of the stored order, as HtFLlib computes them."""
        x, y = self.data.train_x, self.data.train_y
        size, n = self.cfg.batch_size, len(y)
        if self.cfg.class_means_drop_last and n > size:  # as training: a short pass is kept
            x, y = x[:n - n % size], y[:n - n % size]
        return class_means(self.model.features, self.model, x, y, self.num_classes)

    def local_steps(self) -> int:
        """Mini-batches per update (``local-steps``); 0 = ``local-epochs`` full passes."""
        return self.cfg.local_steps

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local training objective on one mini-batch (default: cross-entropy)."""
        return F.cross_entropy(self.model(x), y)

    def train(self, server_round: int) -> TrainStats:
        """The round's local training (default: ``local-epochs`` passes, or
        :meth:`local_steps` mini-batches, of :meth:`loss` on the private model). A method that
        trains in phases or another module than ``self.model`` replaces this, not ``fit``."""
        return train_recipe(self.model, self.data.train_x, self.data.train_y,
                            loss_fn=self.loss, optimizer=self.optimizer(), cfg=self.cfg,
                            generator=self.batch_generator(server_round),
                            steps=self.local_steps())

    def batch_generator(self, server_round: int, purpose: str = "batches") -> torch.Generator:
        """The generator of this client's mini-batch order in ``server_round``."""
        return torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, purpose, self.partition_id, server_round))

    def upload(self) -> Payload:
        """What goes to the server after local training (default: nothing)."""
        return {}

    def reset_terms(self) -> None:
        """Start the round's sums of :meth:`record_terms` (done before each ``receive``)."""
        self._terms: dict[str, Any] = {}
        self._term_batches = 0

    def record_terms(self, terms: Mapping[str, torch.Tensor | float]) -> None:
        """Add one batch's loss terms (or any per-batch diagnostic) to the round's sums: the
        training reply carries each one's mean over the round's batches as ``term-<name>``,
        which the server writes per round (``train_terms`` in rounds.jsonl)."""
        for key, value in terms.items():
            value = value.detach() if isinstance(value, torch.Tensor) else value
            self._terms[key] = self._terms.get(key, 0.0) + value
        self._term_batches += 1

    def fit_metrics(self) -> dict[str, Any]:
        """Metrics a method adds to the training reply (default: the means of the terms it
        recorded this round, :meth:`record_terms`)."""
        return {f"term-{key}": float(total) / max(self._term_batches, 1)
                for key, total in self._terms.items()}

    def secure_weight(self) -> float:
        """With ``secure-aggregation``: this upload's weight in the server's average, over a
        public scale so that it is at most 1 (default: n_k, as FedAvg's average)."""
        return len(self.data.train_y) / secure_aggregation.weight_scale(self.cfg)

    def secure_upload(self, upload: Payload) -> Payload:
        """With ``secure-aggregation``: the fixed-layout upload whose sum over the clients
        gives the server what its maths needs (its strategy's ``secure_layout``). Default:
        the upload times :meth:`secure_weight`, and that weight."""
        return secure_aggregation.weighted(upload, self.secure_weight())

    def optimizer(self, params: Iterable[torch.nn.Parameter] | None = None, name: str = "model",
                  lr: float | None = None) -> torch.optim.Optimizer:
        """The local optimizer over ``params`` (default: the whole private model), as the run's
        recipe says (``optimizer``, ``lr`` with its ``lr-decay-at`` schedule, ...; ``lr``
        replaces the recipe's, e.g. a head phase at its own rate).

        ``optimizer-state = "fresh"`` builds a new one for every message. ``"keep"`` gives one
        optimizer per ``name`` for the client's whole life: within a message the same object,
        across messages its state restored from ``context.state``, where :meth:`save_state`
        puts it after training — the authors' code of FedHe, for one, keeps one Adam per
        client for the whole run, and a fresh Adam over 3 mini-batches moves every weight by
        about lr * sign(gradient). A method with several optimizers gives each its own name,
        over the same parameters in the same order every message."""
        c = self.cfg
        kept = self._kept_optimizers
        if name in kept:
            return kept[name]
        server_round = int(getattr(self, "message", {}).get("server-round", 0))
        optimizer = recipe_optimizer(self.model.parameters() if params is None else params, c,
                                     (c.lr if lr is None else lr) * c.lr_factor(server_round))
        if c.optimizer_state == "keep":
            record = self.context.state.get(OPTIMIZER_STATE_KEY.format(name=name))
            if record is not None:
                load_optimizer_state(optimizer, record.to_torch_state_dict())
            kept[name] = optimizer
        return optimizer

    # -- the Flower side -----------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """Metrics that let the server tell clients apart (node ids are not partition ids)."""
        identity: dict[str, Any] = {"partition-id": self.partition_id, "arch": self.arch}
        if self.data_dir:  # the server then bounds its claimed size by max-num-examples
            identity["own-data"] = True
        return identity

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.identity()

    def inject_faults(self, server_round: int) -> None:
        """Crash or stall on purpose (``fault-*`` settings), drawn per (seed, partition,
        round), so that the same clients fail in the same rounds of every run."""
        c = self.cfg
        if not (c.fault_crash_fraction or c.fault_stall_fraction):
            return
        crash, stall = np.random.default_rng(
            derive_seed(c.seed, "faults", self.partition_id, server_round)).random(2)
        if crash < c.fault_crash_fraction:
            raise InjectedFault(f"partition {self.partition_id} crashes in round {server_round} "
                                f"on purpose (fault-crash-fraction = {c.fault_crash_fraction})")
        if stall < c.fault_stall_fraction:
            if c.round_timeout and c.fault_stall_seconds >= c.round_timeout \
                    and _in_a_ray_actor():
                # A stalled device holds only itself. In simulation it would hold a Ray
                # actor that serves other clients too, until the deadline at least (Flower
                # 1.41 waits for a message's actor without a timeout, and neither restarts nor
                # preempts it), and clients queued behind it would miss the round. Its reply
                # could only come too late: it fails now, as the server records it anyway.
                raise DeadlineExceeded(
                    f"partition {self.partition_id} stalls for {c.fault_stall_seconds:g} s in "
                    f"round {server_round}, past round-timeout = {c.round_timeout:g} s: "
                    "gave up at once, so as not to hold a Ray actor other clients wait for")
            time.sleep(c.fault_stall_seconds)

    def _recover_state(self, config: dict[str, Any], up_to_round: int) -> None:
        """In a resumed run, a client whose ``context.state`` is still empty takes its state as
        of ``up_to_round`` from its state folder (within one run ``context.state`` is kept by
        Flower and is always newer)."""
        self.state_dir = self.state_dir or str(config.get("state-dir", ""))
        if not (self.cfg.resume and self.state_dir) or ROUND_KEY in self.context.state:
            return
        saved = checkpoint.load_client(Path(self.state_dir), self.partition_id, up_to_round)
        for key, record in (saved or {}).items():
            self.context.state[key] = record

    def _take_back_state(self) -> None:
        """With ``client-state = "disk"``: this client's arrays, from its idle file."""
        if self.cfg.client_state != "disk":
            return
        if not self.state_dir:
            raise ConfigError("client-state = 'disk' needs a state folder: the server names "
                              "one in its messages; a deployed node may set state-dir")
        checkpoint.take_back(Path(self.state_dir), self.partition_id, self.context.state)

    def _put_away_state(self, changed: bool) -> None:
        if self.cfg.client_state == "disk":
            checkpoint.put_away(Path(self.state_dir), self.partition_id, self.context.state,
                                changed)

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        server_round = int(config.get("server-round", 0))
        with round_deadline(self.cfg.round_timeout,
                            f"partition {self.partition_id}, round {server_round}"):
            self.inject_faults(server_round)
            self._recover_state(config, server_round - 1)
            self._take_back_state()
            self.model  # restored (or built from its own seed) before any draw of this round
            # Batch order and augmentations draw from generators keyed by (seed, partition id,
            # round, purpose); dropout can only draw from torch's global generator, so training
            # runs with it seeded from the same key and isolated from every other stream.
            with isolated_rng(derive_seed(self.cfg.seed, "fit", self.partition_id,
                                          server_round), self.device):
                self.message = config  # what a method's visit depends on (CompFL's relays)
                received = self.read_payload(parameters, config)
                self.reset_terms()
                self.receive(received, server_round)
                on_gpu = self.device.type == "cuda"
                # This message's own peak, not an earlier client's in this actor; it includes
                # what the process keeps for other clients (the caches above).
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats(self.device)
                start = time.perf_counter()
                stats = self.train(server_round)
                seconds = time.perf_counter() - start
                upload = self.upload()
        if self.malicious:
            # After the method built its honest upload: one transform for every method's
            # payload (fedapp.runtime.attacks); the received arrays are what "the update" is
            # measured from.
            upload = attacks.attack_upload(upload, received, self.cfg, self.partition_id,
                                           server_round, self.num_classes)
        if self.cfg.differential_privacy and privacy.mode_of(self.cfg.payload_kinds) == "client":
            # Local differential privacy: the whole upload clipped and noised before it
            # leaves (fedapp.runtime.privacy; in server mode the server adds the noise).
            upload = privacy.private_upload(upload, received, self.cfg, self.partition_id,
                                            server_round)
        if self.cfg.clock == "arrival" and has_stragglers(self.cfg):
            # A slower device: the same work, taking (duration - 1) x longer
            # (fedapp.runtime.speeds).
            time.sleep(max(0.0, update_duration(self.cfg, self.partition_id, server_round) - 1)
                       * seconds)
        self.save_state(server_round)
        self._put_away_state(changed=True)
        metrics = {**self.identity(), "train-loss": stats.loss, "train-seconds": seconds,
                   "train-samples": stats.samples, "device": str(self.device),
                   **self.fit_metrics()}
        if on_gpu:  # what a client of this model needs of a GPU share (client-num-gpus)
            metrics["gpu-peak-mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.cfg.secure_aggregation:
            # SecAgg+ (fedapp.runtime.secure_aggregation) masks these arrays and weighs them
            # by num_examples: every client weighs 1, and its size travels as a metric.
            dense = secure_aggregation.to_arrays(
                self.secure_upload(upload), secure_aggregation.clipping_range(self.cfg))
            return dense, 1, {**metrics, secure_aggregation.NUM_EXAMPLES: len(self.data.train_y)}
        return to_ndarrays(upload), len(self.data.train_y), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        start = time.perf_counter()
        self._recover_state(config, int(config.get("server-round", 0)))
        self._take_back_state()
        changed = self.receive_for_evaluation(from_ndarrays(parameters))
        x, y = self.data.test_x, self.data.test_y
        predictor = self.predictor()
        try:
            if predictor is self.model and type(predictor).forward is HeteroModel.forward:
                self._test_features = (x, features_in_batches(predictor, x))
                loss, accuracy = evaluate_head(predictor.head, self._test_features[1], y)
            else:
                loss, accuracy = evaluate(predictor, x, y)
            variants = self.evaluation_variants(x, y) if len(y) else {}
        finally:
            self._test_features = None
        if self.headline_variant() in variants:  # e.g. FedProto's nearest-prototype rule
            variants["own-head"], accuracy = accuracy, variants.pop(self.headline_variant())
        metrics: dict[str, Any] = {**self.identity(), "accuracy": accuracy}
        metrics.update({f"accuracy-{name}": value for name, value in variants.items()})
        if self.global_test is not None:
            metrics["global-loss"], metrics["global-accuracy"] = evaluate(self.predictor(),
                                                                          *self.global_test)
        if not changed:
            # Nothing was installed for evaluation, so the model still equals context.state.
            # (What a server sends for evaluation is never kept: training goes on from the
            # private model saved after fit.)
            self._cache_model(self._version)
        self._put_away_state(changed=False)  # evaluation never changes the saved state
        metrics["eval-seconds"] = time.perf_counter() - start
        return loss, len(self.data.test_y), metrics

    def save_state(self, server_round: int) -> None:
        """Keep the private model for the next round (the client object is discarded), and,
        with checkpoints on, the whole ``context.state`` in the state folder."""
        state = self.context.state
        version = (int(state[VERSION_KEY]["version"]) if VERSION_KEY in state else 0) + 1
        state[MODEL_STATE_KEY] = ArrayRecord(
            torch_state_dict={k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        for name, optimizer in self._kept_optimizers.items():
            state[OPTIMIZER_STATE_KEY.format(name=name)] = ArrayRecord(
                torch_state_dict=optimizer_state_arrays(optimizer))
        state[VERSION_KEY] = ConfigRecord({"version": version})
        state[ROUND_KEY] = ConfigRecord({"round": server_round})
        if self.state_dir and self.cfg.checkpoint_every:
            checkpoint.save_client(Path(self.state_dir), self.partition_id, server_round, state,
                                   self.cfg.checkpoint_every)
        self._cache_model(version)
