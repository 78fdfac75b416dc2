"""The Strategy base every method's server side builds on.

It holds the plumbing that is the same for every method, so that a method module holds only its
maths: deterministic client sampling, one ``FitIns`` per client (methods may send different
payloads to different clients), the one validation path for uploads (identity, claimed size,
wire dtypes, magnitude, the method's spec: a malformed or hostile payload is rejected with a
logged reason and the round goes on), tolerance of failed clients (who failed is recorded),
byte accounting of what really crosses the wire, evaluation on the rounds and clients the
run asks for (``eval-every``, ``fraction-evaluate``, ``eval-clients``), the results folder,
and checkpoints (a method's state is whatever it adds to the base). The asynchronous loop
(``fedapp.loops.asynchronous``) reaches the same validation and the method's maths through
:meth:`FedStrategy.accept_upload`, :meth:`FedStrategy.accept_evaluation` and
:meth:`FedStrategy.aggregate`.

A method overrides :meth:`FedStrategy.fit_payload`, :meth:`FedStrategy.upload_spec` (or
:meth:`FedStrategy.named_upload_spec` when its array names carry information; optionally
:meth:`FedStrategy.check_upload`, and :meth:`FedStrategy.decode_upload` when its maths consumes
something other than the arrays as sent),
:meth:`FedStrategy.aggregate` and, if it sends something for evaluation,
:meth:`FedStrategy.eval_payload`; a method whose server holds models of its own (a global model,
a distilled student) returns their logits from :meth:`FedStrategy.server_predict`, and the base
scores them on the global test set on every evaluated round (``server_accuracy``).
"""

from __future__ import annotations

import functools
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, GetPropertiesIns,
                         Parameters, Scalar)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from client_models import HeteroModel
from fedapp.config import RunConfig, sampled_per_round
from fedapp.data import setup
from fedapp.runtime import attacks, checkpoint, secure_aggregation, timeline
from fedapp.runtime.aggregate import (Robust, filter_pairs, filter_uploads, robust_average,
                                      robust_average_per_group)
from fedapp.runtime.class_stats import robust_class_means
from fedapp.runtime.payload import (ArraySpec, Payload, PayloadError, WireSize, check_layout,
                                    check_values, encode, float32, load, read_headers, to_wire,
                                    validate, wire_size)
from fedapp.runtime.privacy import STATE_KEY, ServerPrivacy
from fedapp.runtime.results import (Recorder, format_accuracy, format_server_accuracy,
                                    round_record)
from fedapp.runtime.speeds import update_duration
from fedapp.runtime.training import EVAL_BATCH
from fedapp.seeding import derive_seed


@dataclass(frozen=True)
class ClientInfo:
    """Who a client is, as it reported itself (Flower node ids are not partition ids)."""

    partition_id: int
    arch: str
    own_data: bool = False  # a deployed node training on its own data-dir, not the partition


@dataclass(frozen=True)
class Upload:
    """One client's validated contribution to a round."""

    client: ClientInfo
    num_examples: int
    payload: Payload  # what the method's maths consumes: FedStrategy.decode_upload's arrays
    metrics: Mapping[str, Scalar]


def finite_number(value: Any, low: float = -math.inf,
                  high: float = math.inf) -> float | None:
    """``value`` as a finite float in ``[low, high]``, or None (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None


TERM_PREFIX = "term-"


def train_terms(uploads: list[Upload]) -> dict[str, float]:
    """The mean over the round's uploads of each ``term-<name>`` training metric a method
    reports (its loss terms, their gradient norms: diagnostics a user can plot per round).
    A value that is not a finite number is left out, so a hostile client cannot put a NaN
    or a string into the results."""
    values: dict[str, list[float]] = {}
    for upload in uploads:
        for key, value in upload.metrics.items():
            if key.startswith(TERM_PREFIX) and (number := finite_number(value)) is not None:
                values.setdefault(key[len(TERM_PREFIX):], []).append(number)
    return {name: float(np.mean(v)) for name, v in sorted(values.items())}


# What a client may report as the device it trained on (anything else is left out).
DEVICE_NAME = re.compile(r"cpu|cuda(:\d{1,3})?")


def training_devices(uploads: list[Upload]) -> dict[str, dict[str, Any]]:
    """Where each client of the round trained (``devices``: partition id -> "cpu", "cuda:0")
    and, for those on a GPU, the most GPU memory their training held (``gpu_peak_mib``). A
    value of another form is left out, as for :func:`train_terms`."""
    devices: dict[str, Any] = {}
    peaks: dict[str, Any] = {}
    for upload in uploads:
        pid = str(upload.client.partition_id)
        device = upload.metrics.get("device")
        if isinstance(device, str) and DEVICE_NAME.fullmatch(device):
            devices[pid] = device
        if (mib := finite_number(upload.metrics.get("gpu-peak-mib"), low=0.0)) is not None:
            peaks[pid] = mib
    return {"devices": devices, **({"gpu_peak_mib": peaks} if peaks else {})}


def _seconds(metrics: Mapping[str, Any], key: str) -> float:
    return finite_number(metrics.get(key, 0.0), low=0.0) or 0.0


def clean_eval_metrics(metrics: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The evaluation metrics that may reach the results, checked: ``accuracy`` must be a
    number in [0, 1] (else PayloadError: the evaluation is ignored); other accuracies
    (``global-accuracy``, ``accuracy-<variant>``) likewise, losses and seconds finite and
    non-negative — an optional metric that is not is dropped. Whatever is kept is JSON-safe."""
    if finite_number(metrics.get("accuracy"), 0.0, 1.0) is None:
        raise PayloadError(f"accuracy {metrics.get('accuracy')!r} is not a number in [0, 1]")
    clean: dict[str, Scalar] = {}
    for key, value in metrics.items():
        if key in ("partition-id", "arch", "own-data"):
            clean[key] = value
        elif key == "accuracy" or key == "global-accuracy" or key.startswith("accuracy-"):
            if (number := finite_number(value, 0.0, 1.0)) is not None:
                clean[key] = number
        elif key.endswith("-loss") or key.endswith("-seconds"):
            if (number := finite_number(value, low=0.0)) is not None:
                clean[key] = number
    return clean


class Encoder:
    """Encodes payloads for one round's messages, once per distinct payload object: a method
    that sends everyone the same global model returns the same dict, encoded only once."""

    def __init__(self) -> None:
        self._done: dict[int, tuple[Payload, Parameters, WireSize]] = {}

    def __call__(self, payload: Payload) -> tuple[Parameters, WireSize]:
        hit = self._done.get(id(payload))
        if hit is None or hit[0] is not payload:
            payload_32 = float32(payload)
            broken = [k for k, v in payload_32.items() if v.dtype.kind == "f"
                      and not np.all(np.isfinite(v))]
            if broken:
                # Never send NaN to every client: stop here, naming what broke.
                raise RoundFailed(f"the server's state holds NaN or infinite values in "
                                  f"{broken}; the run cannot go on")
            params = encode(payload_32)
            hit = self._done[id(payload)] = (payload, params, wire_size(params))
        return hit[1], hit[2]


class RoundFailed(RuntimeError):
    """The run cannot meaningfully go on (``kind`` says why, for the results folder)."""

    kind = "failed"


class EmptyRounds(RoundFailed):
    """``max-empty-rounds`` rounds in a row without a usable update."""

    kind = "empty-rounds"


def _server_work(method: Callable) -> Callable:
    """Counts the seconds spent in ``method`` (one of Flower's four calls of a round) as the
    round's ``server_seconds``: the strategy's own work (payloads encoded, uploads checked,
    the method's server step), apart from the wait for the clients (their replies, and in
    ``list_clients`` their connections and identities). Writing the round's record, which
    reads it, is not in it."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        self._phase_started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._server_seconds += time.perf_counter() - self._phase_started
    return timed


class FedStrategy(Strategy):
    """Shared server side. Subclasses implement one method's maths."""

    def __init__(self, cfg: RunConfig, recorder: Recorder | None, *,
                 input_shape: tuple[int, int, int], num_classes: int) -> None:
        self.cfg = cfg
        self.recorder = recorder
        self.architectures = setup.architectures(cfg)  # by partition id, as clients do
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.clients: dict[str, ClientInfo] = {}  # Flower cid -> identity, learnt from replies
        # In a simulation: node id -> partition id, from the engine (linkstate.node_partitions).
        self.node_partitions: Callable[[], dict[int, int]] | None = None
        self._down: dict[str, WireSize] = {}
        self._up: dict[str, WireSize] = {}
        self._eval_down = 0
        self._round_started = 0.0
        self._counts = {"clients_fit": 0, "failures": 0, "rejected": 0}
        self._sampled: dict[str, int] = {}  # Flower cid -> partition id, this round
        self._failed: list[int] = []  # partition ids that crashed or timed out, this round
        self._rejected: list[int] = []  # partition ids whose upload was refused, this round
        self._client_seconds = 0.0
        self._server_seconds = 0.0  # this round's, so far (_server_work)
        self._phase_started = time.perf_counter()
        self._train_loss: float | None = None  # mean over this round's uploads
        self._train_terms: dict[str, float] = {}  # the same for a method's term-* metrics
        self._devices: dict[str, dict[str, Any]] = {}  # training_devices of this round
        self._evaluated: list[int] = []  # partition ids asked to evaluate, this round
        self._empty = False  # this round had no usable update
        # With secure-aggregation: the round's survivors, or why SecAgg+ halted it.
        self._secure: dict[str, Any] = {}
        self._filtered_pairs: dict[str, Any] = {}  # training_pairs' count, this round
        self._filtered_uploads: dict[str, Any] = {}  # teachers' count, this round
        # Rounds in a row without a usable update, counted on from a resumed run's records.
        self._empty_in_a_row = 0
        for record in reversed(recorder.history if recorder is not None else []):
            if not record.get("empty_round"):
                break
            self._empty_in_a_row += 1
        # The rule every average of the method goes through (robust-aggregation) and, in a
        # run with attacks on purpose, who attacks: recorded beside the accuracies.
        self.robust = Robust.of(cfg)
        self.malicious = attacks.malicious_partitions(cfg)
        # Client-level differential privacy (differential-privacy): its accountant and, for a
        # method whose server only averages models, the noisy averages (fedapp.runtime.privacy).
        self.privacy = ServerPrivacy(cfg) if cfg.differential_privacy else None
        # Flower counts rounds from 1 in every run; a resumed run continues after its last
        # checkpoint, so the rounds every method sees are Flower's plus this offset.
        self.round_offset = 0
        # Whatever a method adds to these is its state across rounds (see method_state).
        self._base_attributes = set(vars(self)) | {"_base_attributes", "train_sizes"}

    # -- what a method changes ---------------------------------------------------------------
    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        """What to send a client for training (``None``: not yet known who it is)."""
        return {}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        """The arrays a client must upload (names, shapes, kinds, label ranges)."""
        return {}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        """Method-specific checks beyond :meth:`upload_spec`; raise PayloadError to reject."""

    def named_upload_spec(self, names: list[str], client: ClientInfo
                          ) -> dict[str, ArraySpec]:
        """The spec of an upload whose arrays are called ``names`` (default:
        :meth:`upload_spec`). A method whose array names carry information (which class, which
        expert) builds the spec from them here, raising PayloadError for a name it refuses.
        The base checks it against the arrays' npy headers before any data is read, and
        against their values after."""
        return self.upload_spec(client)

    def validate_upload(self, payload: Payload, client: ClientInfo) -> None:
        """Reject (PayloadError) anything the method's maths must not see: the spec, then
        :meth:`check_upload`. ``payload`` holds read-only views in the sender's dtypes."""
        validate(payload, self.named_upload_spec(list(payload), client))
        self.check_upload(payload, client)

    def decode_upload(self, payload: Payload, client: ClientInfo) -> Payload:
        """The arrays the method's maths consumes, from an upload that passed
        :meth:`validate_upload` (in the wire dtypes); default: the arrays as sent. A method
        whose upload encodes them (FedKD's SVD factors of an update) decodes them here, once:
        the base checks what this returns as it checks what was sent (finite, within
        ``upload-max-abs``) and hands it to :meth:`aggregate` as ``Upload.payload``."""
        return payload

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        """The method's server maths on the round's validated uploads (decoded:
        :meth:`decode_upload`)."""

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        """With ``secure-aggregation``: the fixed layout (name -> shape) of every client's
        dense upload (its client's ``FedClient.secure_upload``). Default, for a method whose
        server averages uploads of one layout (card: ``secure_aggregation = "as-is"``): the
        upload's arrays and their summed weight."""
        first = ClientInfo(0, self.architectures[0])
        return {**{name: tuple(spec.shape) for name, spec in self.upload_spec(first).items()},
                secure_aggregation.SUM_WEIGHT: (1,)}

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        """With ``secure-aggregation``: the method's server maths from the sums of the
        survivors' dense uploads (``uploads``: who they are and their metrics, no arrays).
        Default ("as-is"): the weighted mean of the uploads, which is what the method's
        :meth:`aggregate` makes of them, handed to it as the round's one upload."""
        mean = secure_aggregation.weighted_mean(sums)
        upload_spec = self.upload_spec(uploads[0].client)
        mean = {name: (np.rint(a).astype(np.int64) if upload_spec[name].kind == "int"
                       else a.astype(np.float32)) for name, a in mean.items()}
        self.aggregate(server_round, [Upload(uploads[0].client, 1, mean, {})])

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        """What to send a client before evaluation (default: nothing)."""
        return {}

    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logits of the models the server holds, by name, on a batch of global test
        inputs; {} (the default) = none, the method is evaluated on its clients only.

        ``x`` [B, *input_shape] is on the CPU; each value must be [B, C]. The base calls it
        under ``torch.no_grad`` on every evaluated round (:meth:`server_accuracy`); the method
        puts its models in eval mode."""
        return {}

    # -- helpers for methods -------------------------------------------------------------------
    def average(self, payloads: list[Payload], weights: list[float],
                reference: Payload | None = None, what: str = "the uploads") -> Payload:
        """The n_k-weighted average of same-layout payloads (a model, a head), or with
        ``robust-aggregation`` set the robust rule's combination of them (``reference``: the
        state they started from, which norm bounding measures them against). Every method
        that averages whole models or heads goes through here. Under differential privacy
        (server mode) it is instead the clipped uploads' noisy unweighted mean."""
        if self.privacy is not None and self.privacy.mode == "server":
            return self.privacy.mean(payloads, reference)
        return robust_average(payloads, weights, self.robust, reference, what)

    def average_per_group(self, groups: list, payloads: list[Payload], weights: list[float],
                          references: Mapping[Any, Payload] | None = None) -> dict[Any, Payload]:
        """:meth:`average` within each group (architecture, expert)."""
        if self.privacy is not None and self.privacy.mode == "server":
            references = references or {}
            return {g: self.privacy.mean([p for h, p in zip(groups, payloads, strict=True)
                                          if h == g], references.get(g), group=g)
                    for g in dict.fromkeys(groups)}
        return robust_average_per_group(groups, payloads, weights, self.robust, references)

    def robust_class_means(self, rows: Mapping[int, list[np.ndarray]]) -> dict[int, np.ndarray]:
        """Per class, the robust rule's combination of the rows its holders sent (only with
        ``robust-aggregation`` set: a method keeps its own per-class average otherwise)."""
        return robust_class_means(rows, self.robust)

    def training_pairs(self, rows: np.ndarray, labels: np.ndarray,
                       owners: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The (row, label) pairs a server that trains on its clients' uploads (FedGH's LARs,
        FedRE's mixes, FedTGP's prototypes, Velo's stored features) may train on:
        ``(rows, keep)``, ``keep`` [N] bool. Under ``robust-aggregation`` the rule filters
        each label's rows (:func:`~fedapp.runtime.aggregate.filter_pairs`; norm-bound moves
        them instead); under "none" every pair is kept and ``rows`` is returned as it came.
        ``owners`` (the partition id of each row, where the server knows it) makes the round
        record say whose pairs were dropped (``filtered_pairs``)."""
        out, keep = filter_pairs(rows, labels, self.robust)
        if self.robust.rule != "none":
            record = self._filtered_pairs
            record["pairs"] = record.get("pairs", 0) + len(keep)
            record["dropped"] = record.get("dropped", 0) + int((~keep).sum())
            if out is not rows:
                moved = np.any(np.reshape(out != rows, (len(keep), -1)), axis=1)
                record["clipped"] = record.get("clipped", 0) + int(moved.sum())
            if owners is not None and not keep.all():
                by_client = record.setdefault("dropped_by_client", {})
                for pid in np.asarray(owners)[~keep]:
                    by_client[str(int(pid))] = by_client.get(str(int(pid)), 0) + 1
        return out, keep

    def teachers(self, payloads: list[Payload], owners: Sequence[int],
                 groups: Sequence[Any] | None = None, what: str = "the uploads"
                 ) -> tuple[list[Payload], np.ndarray]:
        """The individual uploads a server that distils from them (FedGen's heads, FedDF's
        models, KT-pFL's predictions) keeps as teachers and averages or mixes:
        ``(payloads, keep)``, ``keep`` [n] bool. Under
        ``robust-aggregation`` the rule filters the uploads within each of ``groups`` (each
        upload's architecture; None = all together) as it filters a label's pairs
        (:func:`~fedapp.runtime.aggregate.filter_uploads`; norm-bound moves them instead);
        under "none" every upload is kept as it came. ``owners`` (each upload's partition id)
        makes the round record say whose uploads were dropped (``filtered_uploads``)."""
        out, keep = filter_uploads(payloads, self.robust, groups, what)
        if self.robust.rule != "none":
            record = self._filtered_uploads
            record["uploads"] = record.get("uploads", 0) + len(keep)
            record["dropped"] = record.get("dropped", 0) + int((~keep).sum())
            moved = sum(a is not b for a, b in zip(out, payloads))
            if moved:
                record["clipped"] = record.get("clipped", 0) + moved
            if not keep.all():
                record["dropped_clients"] = sorted(
                    record.get("dropped_clients", [])
                    + [int(pid) for pid, k in zip(owners, keep) if not k])
        return out, keep

    def new_model(self, arch: str) -> HeteroModel:
        """A model of ``arch`` initialised from the seed (for server-side initial weights)."""
        return setup.new_model(self.cfg, arch, self.input_shape, self.num_classes, "server")

    @functools.cached_property
    def train_sizes(self) -> list[int]:
        """Every partition's training-set size, as the server computes it from the run config
        (the same partition the clients compute; cached per process)."""
        partition = setup.partition(self.cfg)
        return [len(client.train) for client in partition.clients]

    def examples_bound(self, client: ClientInfo) -> int:
        """The most training examples ``client`` can honestly have: its partition's size, or
        for a node with its own data the ``max-num-examples`` setting (0 = the run's whole
        training set). Weights and counts a client claims are checked against it."""
        if not client.own_data:
            return self.train_sizes[client.partition_id]
        return self.cfg.max_num_examples or sum(self.train_sizes)

    def check_num_examples(self, num_examples: Any, client: ClientInfo) -> None:
        """A client's claimed training-set size is its weight in every average: it must be
        its partition's size exactly, or, with its own data, within :meth:`examples_bound`."""
        if not isinstance(num_examples, int) or isinstance(num_examples, bool) \
                or num_examples < 1:
            raise PayloadError(f"num_examples={num_examples!r} is not a positive integer")
        bound = self.examples_bound(client)
        if client.own_data and num_examples > bound:
            raise PayloadError(f"num_examples={num_examples} is more than a client with its own "
                               f"data may claim (max-num-examples: {bound})")
        if not client.own_data and num_examples != bound:
            raise PayloadError(f"num_examples={num_examples}, but partition "
                               f"{client.partition_id} has {bound} training examples")

    def label_spec(self, count: int | None = None) -> ArraySpec:
        """Spec of a vector of class labels in ``[0, C)``."""
        return ArraySpec(shape=(count,), kind="int", low=0, high=self.num_classes - 1)

    # -- checkpoints -------------------------------------------------------------------------------
    def method_state(self) -> dict[str, Any]:
        """What the method keeps across rounds: every attribute it added to the base's (and,
        under differential privacy, the accountant's ledger)."""
        state = {k: v for k, v in vars(self).items() if k not in self._base_attributes}
        if self.privacy is not None:
            state[STATE_KEY] = self.privacy.state()
        return state

    def restore(self, server_round: int, method_state: dict[str, Any]) -> None:
        """Continue after ``server_round`` from a checkpoint's method state."""
        method_state = dict(method_state)
        ledger = method_state.pop(STATE_KEY, None)
        if self.privacy is not None:
            if ledger is None:
                raise ValueError("differential-privacy = true, but the checkpoint holds no "
                                 "privacy ledger: it was taken by a run without it")
            self.privacy.load(ledger)
        vars(self).update(method_state)
        self.round_offset = server_round

    def message_config(self, server_round: int) -> dict[str, Scalar]:
        """The config of every message for ``server_round`` (in the asynchronous loop: the
        client's own update number, which keys its random streams)."""
        config: dict[str, Scalar] = {"server-round": server_round}
        if (self.cfg.checkpoint_every or self.cfg.client_state == "disk") \
                and self.recorder is not None:
            config["state-dir"] = str(self.recorder.run_dir / "client-state")
        return config

    # -- Flower Strategy interface ---------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        # Empty rather than None: None would make Flower ask one client for its weights.
        return Parameters(tensors=[], tensor_type="")

    def list_clients(self, client_manager: ClientManager) -> list[ClientProxy]:
        """Every connected client whose identity is known, in partition order (waits for
        ``num-clients`` and asks the newcomers who they are). Waiting for clients: its time is
        not the strategy's own (``server_seconds``)."""
        started = time.perf_counter()
        try:
            return self._list_clients(client_manager)
        finally:
            self._server_seconds -= time.perf_counter() - started

    def _list_clients(self, client_manager: ClientManager) -> list[ClientProxy]:
        now = time.time
        want, deadline = self.cfg.num_clients, now() + self.cfg.wait_for_clients_seconds
        if self.federation_met() and not self.cfg.differential_privacy:
            # Every partition has identified itself once: a node that has left since (a
            # device switched off, a crash) no longer holds the others back, and the round
            # goes on with those connected. Not under DP, whose accountant counts a round's
            # sampling over all num-clients (fewer to draw from would spend more).
            want = self.cfg.min_fit_clients
        # Wait in slices and say so, rather than sit silent until the timeout: a simulation
        # started with too few SuperNodes is the usual cause, and the user should see it.
        while not client_manager.wait_for(want, timeout=int(max(1, min(10, deadline - now())))):
            if now() >= deadline:
                break
            log(WARNING, "waiting for clients: %d of num-clients=%d connected (in simulation "
                "num-supernodes must equal num-clients)", client_manager.num_available(), want)
        if client_manager.num_available() < want:
            raise RoundFailed(
                f"only {client_manager.num_available()} of num-clients={want} clients connected "
                f"within {self.cfg.wait_for_clients_seconds} s. In simulation set "
                f"num-supernodes={want}; in deployment start {want} SuperNodes.")
        proxies = list(client_manager.all().values())
        self._ask_identities([p for p in proxies if p.cid not in self.clients])
        known = [p for p in proxies if p.cid in self.clients]
        missing = sorted(set(range(self.cfg.num_clients))
                         - {self.clients[p.cid].partition_id for p in known})
        if missing:
            log(WARNING, "partition(s) %s not connected: the round goes on with the %d "
                "others (num-clients=%d)", missing, len(known), self.cfg.num_clients)
        # Ordered by partition id, never by node id (random per run) or arrival order, so that
        # sampling and the order of aggregation, hence the result, follow from the seed alone.
        return sorted(known, key=lambda p: self.clients[p.cid].partition_id)

    def federation_met(self) -> bool:
        """Whether every partition has identified itself at least once in this run."""
        seen = {info.partition_id for info in self.clients.values()}
        return seen >= set(range(self.cfg.num_clients))

    def _ask_identities(self, proxies: list[ClientProxy]) -> None:
        """Learn who the new clients are (partition id, architecture) before they are sampled
        or sent anything, in parallel: in deployment each answer starts a process. In a
        simulation the engine's own assignment answers without a message; every reply a client
        sends later still carries its identity, checked against this one."""
        assigned = self.node_partitions() if self.node_partitions is not None else {}
        if len(assigned) != self.cfg.num_clients:
            assigned = {}  # not the whole federation: ask everyone

        def ask(proxy: ClientProxy) -> None:
            try:
                pid = assigned.get(getattr(proxy, "node_id", None))
                if pid is not None:
                    identity = {"partition-id": pid, "arch": self.architectures[pid]}
                else:
                    identity = proxy.get_properties(GetPropertiesIns({}), timeout=None,
                                                    group_id=0).properties
                self._identify(proxy, identity)
            except Exception as exc:  # a crashed or lying client is left out, not fatal
                log(WARNING, "client %s did not identify itself and is left out: %s",
                    proxy.cid, exc)
        asked = []
        for proxy in proxies:
            if getattr(proxy, "node_id", None) in assigned:
                ask(proxy)  # answered here, no message
            else:
                asked.append(proxy)
        if asked:
            with ThreadPoolExecutor(max_workers=min(32, len(asked))) as pool:
                list(pool.map(ask, asked))

    @_server_work
    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        server_round += self.round_offset
        self._round_started = time.time()
        self._down, self._up, self._eval_down = {}, {}, 0
        self._counts = {"clients_fit": 0, "failures": 0, "rejected": 0}
        self._failed, self._rejected = [], []
        self._client_seconds = self._server_seconds = 0.0
        self._train_loss, self._train_terms, self._evaluated = None, {}, []
        self._devices = {}
        self._empty = False
        self._secure = {}
        self._filtered_pairs = {}
        self._filtered_uploads = {}
        available = self.list_clients(client_manager)
        n = sampled_per_round(self.cfg, len(available))
        if self.privacy is not None:
            self.privacy.start_round(server_round, n)  # stops the run at dp-target-epsilon
        # Sampling from (seed, round), not Flower's global RNG, so a seed fixes the schedule.
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "sample", server_round))
        chosen = [available[i] for i in sorted(rng.choice(len(available), n, replace=False))]
        self._sampled = {}
        encoded = Encoder()
        instructions = []
        for proxy in chosen:
            params, size = encoded(self.fit_payload(server_round, self.clients.get(proxy.cid)))
            self._down[proxy.cid] = size
            self._sampled[proxy.cid] = self.clients[proxy.cid].partition_id
            instructions.append((proxy, FitIns(params, self.message_config(server_round))))
        return instructions

    @_server_work
    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        server_round += self.round_offset
        if self.privacy is not None:
            self.privacy.released(server_round, len(self._sampled))
        uploads: list[Upload] = []
        seen: set[int] = set()
        secure = self.cfg.secure_aggregation
        for proxy, res in results:
            self._up[proxy.cid] = self.secure_upload_size() if secure \
                else wire_size(res.parameters)
            try:
                upload = (self.accept_secure_reply if secure else self.accept_upload)(
                    proxy, res, seen)
            except PayloadError as exc:
                self._counts["rejected"] += 1
                self._rejected.append(self._sampled.get(proxy.cid, -1))
                log(WARNING, "round %s: rejected the upload of client %s: %s", server_round,
                    proxy.cid, exc)
                continue
            uploads.append(upload)
        for failure in failures:
            self._counts["failures"] += 1
            reason = failure if isinstance(failure, BaseException) else failure[1].status.message
            log(WARNING, "round %s: a client failed during training: %r", server_round, reason)
        # Flower reports a crashed or timed-out client as a bare exception: who failed is who
        # was sampled and did not reply.
        replied = {proxy.cid for proxy, _ in results}
        self._failed = sorted(pid for cid, pid in self._sampled.items() if cid not in replied)
        uploads.sort(key=lambda u: u.client.partition_id)  # sums in a fixed order
        if secure:
            self._secure = {"survivors": sorted(u.client.partition_id for u in uploads)}
            if len(uploads) != len(results):
                # A refused survivor's masked upload is in the one sum, which cannot be taken
                # apart: the round has no usable update.
                self._secure["refused"] = sorted(self._rejected)
                uploads = []
        self._counts["clients_fit"] = len(uploads)
        # Time the clients spent computing, to tell it apart from the framework's share.
        self._client_seconds = sum(_seconds(u.metrics, "train-seconds") for u in uploads)
        losses = [loss for u in uploads
                  if (loss := finite_number(u.metrics.get("train-loss"), low=0.0)) is not None]
        self._train_loss = float(np.mean(losses)) if losses else None
        self._train_terms = train_terms(uploads)
        self._devices = training_devices(uploads)
        if not uploads:
            # As Flower's own strategies do, the round leaves the state as it was and the run
            # goes on: one bad round (a node down, a squatter refused) need not end a run. Many
            # in a row mean something is wrong that more rounds will not mend.
            self._empty = True
            self._empty_in_a_row += 1
            limit = self.cfg.max_empty_rounds
            why = (f"round {server_round}: no client returned a usable update "
                   f"({self._counts['failures']} failed, {self._counts['rejected']} rejected; "
                   "see the warnings above)")
            if limit and self._empty_in_a_row >= limit:
                raise EmptyRounds(f"{why}: {self._empty_in_a_row} such rounds in a row, "
                                  f"max-empty-rounds = {limit}; the run stops")
            log(WARNING, "%s; the method's state stays as it was (%d such rounds in a row, "
                "the run stops at max-empty-rounds = %s)", why, self._empty_in_a_row,
                limit or "never")
            return None, {}
        self._empty_in_a_row = 0
        if secure:
            self.aggregate_secure(server_round, uploads, results)
        else:
            self.aggregate(server_round, uploads)
        return None, {}

    # -- secure aggregation (fedapp.runtime.secure_aggregation) -------------------------------
    def accept_secure_reply(self, proxy: ClientProxy, res: FitRes, seen: set[int]) -> Upload:
        """A survivor of a SecAgg+ round: who it is (once per round) and its claimed size (a
        metric: its SecAgg+ weight, ``num_examples``, must be 1). Its arrays are the round's
        unmasked aggregate, the same in every reply, decoded once by :meth:`aggregate_secure`.
        Raises PayloadError."""
        client = self._identify(proxy, res.metrics)
        if client.partition_id in seen:
            raise PayloadError(f"partition {client.partition_id} already uploaded in this round")
        seen.add(client.partition_id)
        if res.num_examples != 1:
            raise PayloadError(f"a secure upload's SecAgg+ weight must be 1, got "
                               f"num_examples={res.num_examples!r}")
        self.check_num_examples(secure_aggregation.metrics_size(res.metrics), client)
        return Upload(client, secure_aggregation.metrics_size(res.metrics), {}, res.metrics)

    def aggregate_secure(self, server_round: int, uploads: list[Upload],
                         results: list[tuple[ClientProxy, FitRes]]) -> None:
        """Decode the round's unmasked aggregate (SecAgg+'s mean of the survivors' dense
        uploads, the same in every reply) into sums and hand them to :meth:`aggregate_sums`.
        (A refused survivor's reply leaves the round empty: ``aggregate_fit``.)"""
        aggregate = results[0][1].parameters
        if any(res.parameters.tensors != aggregate.tensors for _, res in results[1:]):
            raise RoundFailed("the replies of a secure round carry different aggregates")
        from flwr.common import parameters_to_ndarrays
        mean = secure_aggregation.from_arrays(parameters_to_ndarrays(aggregate),
                                              self.secure_layout())
        sums = secure_aggregation.sums_from_mean(mean, len(uploads))
        self.aggregate_sums(server_round, sums, uploads)

    def secure_upload_size(self) -> WireSize:
        """Bytes of one masked upload: int64 values of the dense layout, plus SecAgg+'s own
        weight (the key exchanges of the protocol's other three messages are not counted)."""
        values = sum(math.prod(shape) for shape in self.secure_layout().values()) + 1
        return WireSize(data=8 * values)

    def secure_round_halted(self, server_round: int, why: str,
                            failures: list[BaseException], active: set[str]) -> None:
        """SecAgg+ stopped the round (too few clients left to rebuild the masks; ``active``:
        the Flower cids still in the protocol): the round is recorded empty with the reason,
        as a round without a usable update; the failed clients are those that dropped out."""
        self.aggregate_fit(server_round, [], list(failures))
        self._failed = sorted(pid for cid, pid in self._sampled.items() if cid not in active)
        self._secure = {"survivors": [], "halted": why}

    def accept_upload(self, proxy: ClientProxy, res: FitRes, seen: set[int]) -> Upload:
        """The one validation path of every upload, whatever the loop: who sent it (and not
        twice: ``seen`` holds the partitions already heard in this round), its claimed size,
        its wire dtypes and magnitudes, the method's spec, and the magnitudes of what the
        method's maths consumes (:meth:`decode_upload`). Raises PayloadError."""
        client = self._identify(proxy, res.metrics)
        if client.partition_id in seen:
            raise PayloadError(f"partition {client.partition_id} already uploaded in this round")
        seen.add(client.partition_id)
        self.check_num_examples(res.num_examples, client)
        # Headers first: a wrong name, shape or dtype is refused before a byte of data is
        # read, and the values are checked on views of the received bytes, so a refused upload
        # costs the server no more than a bounded amount beyond what it received. (A method
        # that overrides validate_upload alone has its spec checked on those views.)
        headers = read_headers(res.parameters)
        if type(self).validate_upload is FedStrategy.validate_upload \
                or type(self).named_upload_spec is not FedStrategy.named_upload_spec:
            check_layout(headers, self.named_upload_spec(list(headers), client))
        payload = load(headers, max_abs=self.cfg.upload_max_abs)
        self.validate_upload(payload, client)
        # Only an accepted upload is copied, into the wire dtypes the method's maths sees.
        wire = to_wire(payload)
        used = self.decode_upload(wire, client)
        if used is not wire:
            # The bound must hold on what the server computes with, not only on what
            # travelled: a product of factors within the bound (FedKD's U s V^T) need not be.
            for name, array in used.items():
                check_values(name, array, self.cfg.upload_max_abs, what="decoded array")
        return Upload(client, res.num_examples, used, res.metrics)

    def _identify(self, proxy: ClientProxy, metrics: Mapping[str, Scalar]) -> ClientInfo:
        pid, arch = metrics.get("partition-id"), metrics.get("arch")
        if not isinstance(pid, int) or isinstance(pid, bool) \
                or not 0 <= pid < len(self.architectures):
            raise PayloadError(f"partition-id {pid!r} is not a known partition")
        if arch != self.architectures[pid]:
            raise PayloadError(f"partition {pid} reports architecture {arch!r}, the run config "
                               f"gives it {self.architectures[pid]!r}")
        owner = self.cfg.partition_owners.get(pid)
        if owner is not None and owner != str(proxy.cid):
            # Deployment: the SuperLink authenticated this node by its key, and the operator
            # bound the partition to another node, so a registered node cannot squat it.
            raise PayloadError(f"node {proxy.cid} claims partition {pid}, which partition-nodes "
                               f"binds to node {owner}")
        info = ClientInfo(pid, arch, metrics.get("own-data", False) is True)
        known = self.clients.setdefault(proxy.cid, info)
        if known != info:
            raise PayloadError(f"client {proxy.cid} was partition {known.partition_id} "
                               f"({known.arch}) and now claims {pid} ({arch})")
        return info

    def evaluation_round(self, server_round: int) -> bool:
        """Whether ``server_round`` is evaluated: every ``eval-every`` rounds, and the last."""
        return not server_round % self.cfg.eval_every \
            or server_round == self.cfg.num_server_rounds

    def server_terms(self) -> dict[str, float]:
        """Diagnostics of the server's own training this round (its losses), written per round
        as ``server_terms`` in rounds.jsonl; default none."""
        return {}

    def server_accuracy(self) -> dict[str, float]:
        """{name: accuracy} of the server's own models (:meth:`server_predict`) on the global
        test set (``global-test-samples`` of it, loaded once per process), in batches of
        ``EVAL_BATCH``; {} when the method holds none. Deterministic: no random draw."""
        if type(self).server_predict is FedStrategy.server_predict:
            return {}  # a method without server models never loads the global test set
        x, y = setup.global_test(self.cfg)
        correct: dict[str, int] = {}
        with torch.no_grad():
            for start in range(0, len(y), EVAL_BATCH):
                logits = self.server_predict(x[start:start + EVAL_BATCH])
                if not logits:
                    return {}  # none this round (e.g. not built yet)
                want = y[start:start + EVAL_BATCH]
                for name, out in logits.items():
                    if tuple(out.shape) != (len(want), self.num_classes):
                        raise ValueError(f"server_predict gave {name!r} logits of shape "
                                         f"{tuple(out.shape)}, expected "
                                         f"{(len(want), self.num_classes)}")
                    hits = int((out.argmax(1).cpu() == want).sum())
                    correct[name] = correct.get(name, 0) + hits
        return {name: hits / len(y) for name, hits in sorted(correct.items())} if len(y) else {}

    def evaluation_clients(self, server_round: int, available: list[ClientProxy]
                           ) -> list[ClientProxy]:
        """Who is evaluated this round: nobody between ``eval-every`` rounds (the last round
        always is), else ``fraction-evaluate`` of the eligible clients (all, or the round's
        participants), drawn from (seed, round) so that a seed fixes the schedule."""
        cfg = self.cfg
        if not self.evaluation_round(server_round):
            return []
        pool = available if cfg.eval_clients == "all" else \
            [p for p in available if p.cid in self._sampled]
        n = min(len(pool), max(1, math.ceil(cfg.fraction_evaluate * len(pool))))
        if n == len(pool):
            return pool
        rng = np.random.default_rng(derive_seed(cfg.seed, "evaluate", server_round))
        return [pool[i] for i in sorted(rng.choice(len(pool), n, replace=False))]

    @_server_work
    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        server_round += self.round_offset
        # By default every client is evaluated every round (not only the ones that trained),
        # as FedClassAvg and FedGH's code report the mean over all clients.
        chosen = self.evaluation_clients(server_round, self.list_clients(client_manager))
        self._evaluated = sorted(self.clients[p.cid].partition_id for p in chosen)
        if not chosen:
            # Flower skips aggregate_evaluate when nobody is asked: the round ends here.
            self._finish_round(server_round, [])
            return []
        encoded = Encoder()
        instructions = []
        for proxy in chosen:
            params, size = encoded(self.eval_payload(server_round, self.clients.get(proxy.cid)))
            self._eval_down += size.total
            instructions.append((proxy, EvaluateIns(params,
                                                    self.message_config(server_round))))
        return instructions

    @_server_work
    def aggregate_evaluate(self, server_round: int,
                           results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[tuple[ClientProxy, EvaluateRes] | BaseException]
                           ) -> tuple[float | None, dict[str, Scalar]]:
        server_round += self.round_offset
        evals = []
        for proxy, res in results:
            try:
                evals.append(self.accept_evaluation(proxy, res))
            except PayloadError as exc:
                log(WARNING, "round %s: ignored the evaluation of client %s: %s", server_round,
                    proxy.cid, exc)
        for failure in failures:
            log(WARNING, "round %s: a client failed during evaluation: %r", server_round,
                failure if isinstance(failure, BaseException) else failure[1].status.message)
        evals.sort(key=lambda e: e["partition-id"])
        self._finish_round(server_round, evals)
        return None, {}

    def accept_evaluation(self, proxy: ClientProxy, res: EvaluateRes) -> dict[str, Scalar]:
        """A client's evaluation metrics, checked (:func:`clean_eval_metrics`) and tagged with
        who it is. Raises PayloadError."""
        client = self._identify(proxy, res.metrics)
        return {**clean_eval_metrics(res.metrics), "partition-id": client.partition_id}

    def _finish_round(self, server_round: int, evals: list[dict[str, Any]]) -> None:
        """Record the round (with its evaluations, if it had any), checkpoint, and at the last
        round write the summary."""
        up = sum(self._up.values(), WireSize())
        down = sum(self._down.values(), WireSize())
        traffic = {"bytes_up": up.data, "bytes_down": down.data, "framing_up": up.framing,
                   "framing_down": down.framing, "eval_bytes_down": self._eval_down}
        client_seconds = self._client_seconds + sum(_seconds(e, "eval-seconds") for e in evals)
        # The server's own models, on the rounds its clients are evaluated (counted in
        # server_seconds: it is the strategy's work).
        server = self.server_accuracy() if self.evaluation_round(server_round) else {}
        # The server's own losses; one that is not a finite number is left out, as a
        # client's term-* metrics are (train_terms).
        server_terms = {k: v for k, v in self.server_terms().items()
                        if finite_number(v) is not None}
        who = {"clients_sampled": len(self._sampled), "failed_clients": self._failed,
               "rejected_clients": sorted(self._rejected), "evaluated": self._evaluated,
               "empty_round": self._empty,
               **({"privacy": self.privacy.record()} if self.privacy is not None else {}),
               **({"secure_aggregation": self._secure} if self.cfg.secure_aggregation else {}),
               **self.attack_record(evals),
               **({"filtered_pairs": self._filtered_pairs} if self._filtered_pairs else {}),
               **({"filtered_uploads": self._filtered_uploads}
                  if self._filtered_uploads else {}),
               "train_loss": self._train_loss,
               **({"train_terms": self._train_terms} if self._train_terms else {}),
               **({"server_terms": server_terms} if server_terms else {}),
               **self._devices,
               # What the round would take if clients were as fast as fedapp.runtime.speeds
               # says: the barrier waits for the slowest client sampled.
               "virtual_seconds": max((update_duration(self.cfg, pid, server_round)
                                       for pid in self._sampled.values()), default=0.0),
               "server_seconds": self._server_seconds + time.perf_counter()
               - self._phase_started}
        record = round_record(server_round, evals, traffic, {**self._counts, **who},
                              time.time() - self._round_started, client_seconds,
                              server_accuracy=server)
        if self.recorder is None:
            return
        log(INFO, self.recorder.record_round(record))
        timeline.between_rounds(server_round)  # a no-op unless a benchmark interleaves
        every = self.cfg.checkpoint_every
        if every and server_round % every == 0:
            checkpoint.save_server(self.recorder.run_dir / "checkpoint", server_round,
                                   self.method_state())
        if server_round == self.recorder.num_rounds:
            summary = self.recorder.finish()
            acc = summary["accuracy"]
            log(INFO, "[fedapp] done: accuracy %s over %d clients%s; results in %s",
                format_accuracy(acc["mean"], acc["std"]), len(acc["per_client"]),
                format_server_accuracy(acc.get("server", {})).replace(" |", ","),
                self.recorder.run_dir)

    def attack_record(self, evals: list[dict[str, Any]]) -> dict[str, Any]:
        """In a run with malicious clients: who they are, and the mean accuracy of the honest
        clients evaluated (what papers report), beside the overall mean."""
        if not self.malicious:
            return {}
        honest = [float(e["accuracy"]) for e in evals if e["partition-id"] not in self.malicious]
        return {"malicious_clients": sorted(self.malicious),
                "honest_accuracy_mean": float(np.mean(honest)) if honest else None}

    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Scalar]] | None:
        return None  # no server-side test set: every method is evaluated on its clients
