"""Secure aggregation (``secure-aggregation = true``) with Flower's own SecAgg+: its server
workflow (``SecAggPlusWorkflow``) and its client mod (``secaggplus_mod``), not a protocol of
ours. Everything the project adds around them is here; docs/privacy.md says which methods
take it and why.

What SecAgg+ computes is one thing: the weighted mean of every client's list of arrays, each
array clipped to ``[-clipping_range, clipping_range]`` and stochastically rounded to one of
``quantization_range`` steps before it is masked. The server learns that mean and nothing of
any single upload. To serve methods whose weights are not Flower's (``num_examples``), every
client here gives SecAgg+ the weight 1 and carries its method's own weight *inside* a
fixed-layout ("dense") upload: its arrays pre-multiplied by the weight, plus the weight itself
(``SUM_WEIGHT``), or a per-class table of all C classes with a weight column. The server gets
back the mean of those, multiplies it by the number of survivors and has the sums its method
needs (:func:`sums_from_mean`); a weighted mean is then a ratio of two sums, exact whatever
the survivors.

Ranges, from the payloads' bounds (docs/privacy.md, "Secure aggregation"):

- clipping: every value a client may upload is within ``upload-max-abs`` (the server refuses
  more in the plain path), and a dense upload multiplies values by weights in [0, 1] (``n_k``
  over the largest training set, :func:`weight_scale`; a class's count share; 1), so
  ``clipping_range = upload-max-abs`` never clips an upload the plain path would accept. A
  client checks its own dense upload against it before masking (a NaN or an out-of-range value
  would become an arbitrary integer): it fails rather than send it;
- quantisation: ``QUANTIZATION_RANGE = 2**30`` steps (the most Flower's quantiser holds: it
  rounds into int32), one step ``2 * upload-max-abs / 2**30`` (1.9e-5 at the default 1e4);
- modulus: ``MODULUS_RANGE = 2**52``, so that the sum of every client's quantised values
  (< N * 2**30) cannot wrap for N < 2**22 clients, and a sum converts to float64 exactly.
  Flower's default (2**32 with 2**22 steps) would leave 3.8e-6 * 1e4 / 8 = 4.8e-3 per step at
  this clipping range. Masks are added in int64 and reduced modulo a power of two that
  divides 2**64, so an int64 wrap on the way cannot change the result.

The loop: :func:`run_rounds` replaces Flower's ``start_grid`` by its ``DefaultWorkflow``
with :class:`SecureSumWorkflow` as the fit step. A round that SecAgg+ halts (too few clients
left to rebuild the masks) is handed to the strategy as a round without survivors, so it is
recorded empty with the reason (Flower's workflow only logs and returns). One fix of Flower
1.41's workflow: a client that drops before it shared its secrets is taken out of the round
(Flower asked every survivor for a share of its key at unmasking, which none holds, and lost
the round; docs/privacy.md).
"""

from __future__ import annotations


import functools
import time
from logging import ERROR, INFO
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
from flwr.app import Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.server import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from fedapp.config import RunConfig
from fedapp.runtime.payload import Payload, PayloadError

if TYPE_CHECKING:
    from flwr.server import ServerAppComponents
    from flwr.serverapp import Grid

QUANTIZATION_RANGE = 2**30
MODULUS_RANGE = 2**52
# The most clients one sum may hold without wrapping modulo MODULUS_RANGE.
MAX_CLIENTS = (MODULUS_RANGE - 1) // QUANTIZATION_RANGE
# The array of a dense upload that holds the upload's own weight (a summed weight comes back).
SUM_WEIGHT = "secagg/weight"
ROWS, HOLDERS = "secagg/rows", "secagg/holders"  # a per-class table's rows and holders
# The metric that carries a client's training-set size: SecAgg+ reads num_examples as its
# weight, which is 1 for every client here.
NUM_EXAMPLES = "num-examples"
# What each of the protocol's stages is called in a message (Flower's stage names).
STAGES = {"setup_stage": "setup (public keys)", "share_keys_stage": "key sharing",
          "collect_masked_vectors_stage": "masked uploads",
          "unmask_stage": "unmasking"}


# -- the fixed-layout (dense) upload ------------------------------------------------------------
def clipping_range(cfg: RunConfig) -> float:
    """The bound on every value of a dense upload: ``upload-max-abs`` (see the module)."""
    return float(cfg.upload_max_abs)


def weight_scale(cfg: RunConfig) -> int:
    """A public bound on any client's training-set size: the largest partition, or
    ``max-num-examples`` where it is larger (a deployed node's own data). A client's weight
    ``n_k / weight_scale`` is then in (0, 1], the same for every party that computes it."""
    from fedapp.data import setup  # the dataset is loaded once per process
    sizes = [len(client.train) for client in setup.partition(cfg).clients]
    return max(max(sizes), cfg.max_num_examples)


def weighted(payload: Mapping[str, np.ndarray], weight: float) -> Payload:
    """The dense upload of a method whose server averages same-layout uploads with weights:
    every float array times ``weight``, and the weight itself. (Integer arrays, BatchNorm's
    counters, are summed as floats; the method's average rounds them back.)"""
    dense = {name: np.asarray(v, np.float64) * weight for name, v in payload.items()}
    dense[SUM_WEIGHT] = np.array([weight], np.float64)
    return dense


def class_table(labels: np.ndarray, rows: np.ndarray, weights: np.ndarray,
                num_classes: int) -> Payload:
    """The dense upload of per-class rows: a table of all C classes, ``weights[i] *
    rows[i]`` in row ``labels[i]`` and zeros elsewhere, the weights in a column
    (``SUM_WEIGHT``, [C]) and which classes the client holds (``HOLDERS``, 0 or 1). Summed,
    row c over weight c is the weighted mean of class c over the survivors that hold it, and
    the holders column says which classes some survivor holds (a count, far above the
    quantisation error, where a small weight may not be). The server no longer learns which
    classes one client holds."""
    table = np.zeros((num_classes,) + rows.shape[1:], np.float64)
    column = np.zeros(num_classes, np.float64)
    holders = np.zeros(num_classes, np.float64)
    for label, row, weight in zip(labels, rows, weights, strict=True):
        table[int(label)] = weight * np.asarray(row, np.float64)
        column[int(label)], holders[int(label)] = weight, 1.0
    return {ROWS: table, SUM_WEIGHT: column, HOLDERS: holders}


def class_table_layout(num_classes: int, row_shape: tuple[int, ...]
                       ) -> dict[str, tuple[int, ...]]:
    """The layout of :func:`class_table`."""
    return {ROWS: (num_classes, *row_shape), SUM_WEIGHT: (num_classes,),
            HOLDERS: (num_classes,)}


def class_means_from_sums(sums: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    """{class: weighted mean row} of the classes some survivor holds, from summed
    :func:`class_table` uploads."""
    column, table, holders = sums[SUM_WEIGHT], sums[ROWS], sums[HOLDERS]
    return {c: (table[c] / column[c]).astype(np.float32)
            for c in range(len(column)) if holders[c] >= 0.5 and column[c] > 0}


def to_arrays(dense: Payload, bound: float) -> list[np.ndarray]:
    """A dense upload as what SecAgg+ masks: its arrays in name order (no names array: the
    layout is fixed, both sides know it), after checking every value is finite and within
    ``bound``. Raises PayloadError."""
    arrays = []
    for name in sorted(dense):
        array = np.asarray(dense[name], np.float64)
        if not np.all(np.isfinite(array)):
            raise PayloadError(f"the secure upload {name!r} holds NaN or infinite values: not "
                               "sent (masked, it would corrupt the sum)")
        if array.size and float(np.max(np.abs(array))) > bound:
            raise PayloadError(
                f"the secure upload {name!r} holds a value of magnitude "
                f"{float(np.max(np.abs(array))):.4g}, beyond upload-max-abs = {bound:g}, the "
                "clipping range of secure aggregation: not sent (raise upload-max-abs)")
        arrays.append(array)
    return arrays


def from_arrays(arrays: list[np.ndarray], layout: Mapping[str, tuple[int, ...]]) -> Payload:
    """The aggregate SecAgg+ returns, as named arrays of the fixed ``layout``. Raises
    PayloadError when it does not fit (a client that sent another layout)."""
    names = sorted(layout)
    if len(arrays) != len(names):
        raise PayloadError(f"the secure aggregate has {len(arrays)} arrays, the layout "
                           f"{len(names)} ({names})")
    out = {}
    for name, array in zip(names, arrays):
        if tuple(array.shape) != tuple(layout[name]):
            raise PayloadError(f"the secure aggregate's {name!r} has shape {array.shape}, "
                               f"the layout {tuple(layout[name])}")
        if not np.all(np.isfinite(array)):
            raise PayloadError(f"the secure aggregate's {name!r} is not finite")
        out[name] = np.asarray(array, np.float64)
    return out


def sums_from_mean(mean: Payload, survivors: int) -> Payload:
    """SecAgg+'s mean over the survivors (every weight 1) -> the sums of their dense uploads."""
    return {name: array * survivors for name, array in mean.items()}


def weighted_mean(sums: Mapping[str, np.ndarray]) -> Payload:
    """The weighted mean of :func:`weighted` uploads from their sums."""
    total = float(sums[SUM_WEIGHT][0])
    if total <= 0:
        raise PayloadError(f"the summed weight of the secure aggregate is {total:g}")
    return {name: array / total for name, array in sums.items() if name != SUM_WEIGHT}


# -- per-class rows that count once per holder (FD, FedHe) --------------------------------------
def holder_rows(labels: np.ndarray, rows: np.ndarray, num_classes: int) -> Payload:
    """The :func:`class_table` of a client whose rows each count once (weight 1): summed,
    row c is the sum of the survivors' rows of class c and the holders column their number."""
    return class_table(labels, rows, np.ones(len(labels)), num_classes)


def holder_sums(sums: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(summed rows [C, ...], holders per class [C]) of summed :func:`holder_rows` uploads.
    A holder count is an integer and each survivor's 0 or 1 is off by less than one step, so
    rounding gives it back exactly: the count a plain server would have made."""
    return sums[ROWS], np.rint(sums[HOLDERS])


# -- per-group tables: one model per group (FedPer/FedRep's architectures, CompFL's experts,
# Felo's architecture groups) ----------------------------------------------------------------
# A group's layout: its arrays' names and shapes; a run's groups: {group: layout}, which every
# party derives from the run config. The columns follow the groups' names in sorted order, so
# the order a party built the mapping in does not matter. ``prefix`` keeps a group table apart
# from another table in the same upload (Felo's class table has columns of its own).
GroupLayouts = Mapping[str, Mapping[str, tuple[int, ...]]]


@functools.lru_cache(maxsize=8)
def architecture_layouts(cfg: RunConfig, input_shape: tuple[int, int, int], num_classes: int,
                         arrays_of: Callable[[Any], Payload]) -> dict[str, dict[str, tuple]]:
    """{architecture: {name: shape}} of ``arrays_of(model)`` for every architecture of the run,
    sorted by name: the groups of a table, which the server and every client derive alike from
    the run config (a client knows no other architecture's model otherwise)."""
    from fedapp.data import setup
    return {arch: {name: a.shape for name, a in arrays_of(
                setup.new_model(cfg, arch, input_shape, num_classes, "layout")).items()}
            for arch in sorted(set(setup.architectures(cfg)))}


def group_table(groups: GroupLayouts, group: str, arrays: Mapping[str, np.ndarray],
                weight: float, prefix: str = "") -> Payload:
    """The dense upload of a client whose server averages uploads within groups of the same
    layout: every group's arrays under ``"<prefix><group>/<name>"``, ``weight * arrays`` in
    the slot of its own ``group`` and zeros in every other, a weight column
    (``<prefix>SUM_WEIGHT``, [G]) and a holders column (``<prefix>HOLDERS``, [G], 1 for its
    own group). Summed, a group's arrays over its weight are its weighted mean over the
    survivors that wrote into it, and its holders entry counts them (far above the
    quantisation error, where a small weight may not be). The server no longer learns which
    group a survivor's model averaged into. Raises ValueError if ``arrays`` is not the layout
    of ``group``."""
    if group not in groups:
        raise ValueError(f"group {group!r} is not one of the run's {sorted(groups)}")
    layout = groups[group]
    shapes = {name: tuple(np.shape(a)) for name, a in arrays.items()}
    if shapes != {name: tuple(shape) for name, shape in layout.items()}:
        raise ValueError(f"the arrays of group {group!r} do not have its layout: "
                         f"{sorted(set(shapes) ^ set(layout))} differ in name, or a shape does")
    order = sorted(groups)
    table = {f"{prefix}{g}/{name}": (weight * np.asarray(arrays[name], np.float64)
                                     if g == group else np.zeros(shape, np.float64))
             for g in order for name, shape in groups[g].items()}
    column = np.zeros(len(order), np.float64)
    holders = np.zeros(len(order), np.float64)
    column[order.index(group)], holders[order.index(group)] = weight, 1.0
    return {**table, prefix + SUM_WEIGHT: column, prefix + HOLDERS: holders}


def group_table_layout(groups: GroupLayouts, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The layout of :func:`group_table`."""
    layout = {f"{prefix}{g}/{name}": tuple(shape) for g in sorted(groups)
              for name, shape in groups[g].items()}
    if prefix + SUM_WEIGHT in layout or prefix + HOLDERS in layout:
        # a group named "secagg" with an array named as a column
        raise ValueError(f"a group's array is named as the table's column "
                         f"{prefix + SUM_WEIGHT!r} or {prefix + HOLDERS!r}")
    return {**layout, prefix + SUM_WEIGHT: (len(groups),), prefix + HOLDERS: (len(groups),)}


def group_means_from_sums(sums: Mapping[str, np.ndarray], groups: GroupLayouts,
                          prefix: str = "") -> dict[str, Payload]:
    """{group: {name: weighted mean (float64)}} of the groups some survivor wrote into, from
    summed :func:`group_table` uploads; a group without one is absent (its state stays)."""
    column, holders = sums[prefix + SUM_WEIGHT], sums[prefix + HOLDERS]
    return {g: {name: sums[f"{prefix}{g}/{name}"] / column[i] for name in groups[g]}
            for i, g in enumerate(sorted(groups)) if holders[i] >= 0.5 and column[i] > 0}


def in_dtypes_of(mean: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> Payload:
    """A mean from sums in the dtypes a plain average keeps: float32, and integer arrays
    (BatchNorm's counters) rounded back to int64."""
    return {name: (np.rint(a).astype(np.int64) if like[name].dtype.kind in "iu"
                   else a.astype(np.float32)) for name, a in mean.items()}
# -- sub-models: slices padded to the global model (fedapp.runtime.submodels) -----------------
def sum_error(cfg: RunConfig, survivors: int) -> float:
    """The most a sum of ``survivors`` dense uploads' values is off by: less than one
    quantisation step (2c / Q) per upload. A summed weight at or below it is nobody's (a
    coordinate no survivor holds sums exact zeros: 0 quantises exactly)."""
    return survivors * 2 * clipping_range(cfg) / QUANTIZATION_RANGE


# -- the client: Flower's mod, on the messages of the protocol only ------------------------------
def client_mod(message: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` for the protocol's messages (TRAIN messages that carry its
    config record); any other message goes straight to the ClientApp. (The bare mod indexes
    that record on every TRAIN message.)"""
    if message.metadata.message_type == MessageType.TRAIN \
            and RECORD_KEY_CONFIGS in message.content.config_records:
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


# -- the server: Flower's workflow, with a halted round recorded ------------------------------
class SecureSumWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ fit workflow; a round it halts is handed to the strategy as a round
    without survivors (``FedStrategy.secure_round_halted``), so that the round is recorded
    empty with the reason and the run goes on, as for any round without a usable update."""

    def __call__(self, grid: Grid, context: Context) -> None:
        if not isinstance(context, LegacyContext):
            raise TypeError(f"Expect a LegacyContext, but get {type(context).__name__}.")
        state = WorkflowState()
        for step in (self.setup_stage, self.share_keys_stage,
                     self.collect_masked_vectors_stage, self.unmask_stage):
            if not step(grid, context, state):
                current = int(context.state.config_records[MAIN_CONFIGS_RECORD]
                              [WorkflowKey.CURRENT_ROUND])
                why = (f"secure aggregation halted at its {STAGES[step.__name__]} stage: "
                       f"{len(state.active_node_ids)} of {len(state.sampled_node_ids)} sampled "
                       f"clients left, and each needs {state.threshold} active neighbours to "
                       "rebuild the masks (secure-aggregation-threshold)")
                log(ERROR, "round %s: %s", current, why)
                context.strategy.secure_round_halted(
                    current, why, state.failures, {str(n) for n in state.active_node_ids})
                return
            if step == self.share_keys_stage:
                # A client gone before it shared its secrets is out of the round: nobody
                # masked with it, so nothing of it is to be rebuilt. Flower 1.41 keeps it among
                # the sampled clients, and at unmasking asks every survivor for a share of its
                # key that none holds: each survivor's mod raises, and the round is lost.
                state.sampled_node_ids = set(state.active_node_ids)
        log(INFO, "secure aggregation: the round's sum is unmasked")


def workflow(cfg: RunConfig) -> SecureSumWorkflow:
    """The SecAgg+ workflow of a run's settings (every client's SecAgg+ weight is 1)."""
    timeout = cfg.secure_aggregation_timeout or cfg.round_timeout or None
    return SecureSumWorkflow(num_shares=float(cfg.secure_aggregation_shares),
                             reconstruction_threshold=float(cfg.secure_aggregation_threshold),
                             max_weight=1.0, clipping_range=clipping_range(cfg),
                             quantization_range=QUANTIZATION_RANGE,
                             modulus_range=MODULUS_RANGE, timeout=timeout)


def run_rounds(grid: Grid, context: Context, components: ServerAppComponents) -> None:
    """The synchronous rounds with SecAgg+ as their fit step: Flower's ``DefaultWorkflow`` in
    place of ``start_grid`` (same Strategy: its ``configure_fit`` names the clients and their
    ``FitIns``, its ``aggregate_fit`` gets the one unmasked aggregate in every reply)."""
    legacy = LegacyContext(context, config=components.config, strategy=components.strategy,
                           client_manager=components.client_manager or PromptClientManager())
    DefaultWorkflow(fit_workflow=workflow(components.strategy.cfg))(grid, legacy)


class PromptClientManager(SimpleClientManager):
    """Flower's client manager, for its ``DefaultWorkflow``: that workflow's thread registers
    the Grid's nodes every 5 s, or whenever ``num_available``, ``all`` or ``sample`` is called
    (it wraps them), but not while ``wait_for`` waits, so the first round waited 5 s for
    nodes that were there. Here waiting asks for them every 0.1 s."""

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        deadline = time.monotonic() + timeout
        while self.num_available() < num_clients:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True


def metrics_size(metrics: Mapping[str, Any]) -> int | None:
    """A client's training-set size from its reply's metrics (None if absent)."""
    value = metrics.get(NUM_EXAMPLES)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
