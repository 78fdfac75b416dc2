"""The sub-model kit: clients that train slices of one global model (HeteroFL, FedRolex,
FjORD; docs/submodels.md).

A client of rate r holds a model built at its own width (``client_models.width``); which
coordinates of the global model its tensors are, is an **index map**: per tensor, one index
array per dimension into the global tensor. The maps follow from the shapes alone: a
dimension is sliced exactly where the slice is narrower than the global tensor (a hidden
layer's channels), and every other dimension (the image channels, a kernel's 3x3, the C
outputs of the head) is kept whole. Along a sliced dimension of global size w the slice keeps
k = ⌈r·w⌉ indices chosen by the **index scheme**:

- ``leading``: 0, 1, ..., k-1 (HeteroFL, FjORD: nested sub-models);
- ``rolling``: {(j − t) mod w : j < k} for the round's offset t, in that order (FedRolex:
  ``torch.roll(arange(w), t)[:k]``), so that over w rounds every channel is trained equally
  often. A layer's input indices are its predecessor's output indices because both are the
  same function of (w, k, t).

The server's step is the **coordinate-count average** (:class:`CoordinateAverage`): every
client adds its values and a count of 1 at the coordinates its slice holds (Σ values and Σ
counts per coordinate, what a secure sum gives); coordinates with a count take Σ/count, the
others keep their value. Optionally the head's rows are restricted to the client's own labels
(HeteroFL's label-split head) and the values weighted (FjORD's n_k).

With ``secure-aggregation`` the same average runs on the other side of the sum: each client
makes its own one-client average and uploads its Σ and Σ weights padded to the global model's
shapes (:meth:`CoordinateAverage.padded`, :func:`padded_layout`), so the survivors' sum is
the round's Σ and Σ weights, and the server divides (:meth:`CoordinateAverage.from_padded`).
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedapp.runtime.aggregate import Robust, held_coordinates
from fedapp.runtime.payload import Payload

INDEX_SCHEMES = ("leading", "rolling")
HEAD_KEYS = ("head.weight", "head.bias")
# With secure aggregation, the prefix of a tensor's summed weights in a padded upload.
HELD = "secagg/held/"

# Per tensor, one int64 index array per dimension into the global tensor.
IndexMap = dict[str, tuple[np.ndarray, ...]]


def window(width: int, kept: int, scheme: str, offset: int = 0) -> np.ndarray:
    """The ``kept`` indices out of ``width`` that a slice holds along one dimension."""
    if not 0 < kept <= width:
        raise ValueError(f"a slice cannot keep {kept} of {width} indices")
    if scheme == "leading" or kept == width:
        # A whole dimension is kept in its own order: the rolled order of all w indices would
        # give the same function, permuted.
        return np.arange(kept, dtype=np.int64)
    if scheme == "rolling":
        return np.roll(np.arange(width, dtype=np.int64), offset % width)[:kept]
    raise ValueError(f"unknown index scheme {scheme!r}; expected one of {INDEX_SCHEMES}")


def index_maps(global_shapes: Mapping[str, Sequence[int]],
               slice_shapes: Mapping[str, Sequence[int]], scheme: str = "leading",
               offset: int = 0) -> IndexMap:
    """Per tensor of a slice, its index arrays into the global model's tensor of that name."""
    unknown = sorted(set(slice_shapes) - set(global_shapes))
    if unknown:
        raise ValueError(f"a slice holds tensors the global model has not: {unknown}")
    maps: IndexMap = {}
    # A slice may hold a subset of the tensors (FjORD: the statistics of its own widths only).
    for name, part in slice_shapes.items():
        full, part = global_shapes[name], tuple(part)
        if len(part) != len(full) or any(p > f for p, f in zip(part, full)):
            raise ValueError(f"{name}: slice shape {part} does not fit in {tuple(full)}")
        maps[name] = tuple(window(f, p, scheme, offset) for f, p in zip(full, part))
    return maps


def extract(global_arrays: Payload, maps: IndexMap) -> Payload:
    """The slice of the global model that ``maps`` names (a copy, float32)."""
    return {name: np.ascontiguousarray(global_arrays[name][np.ix_(*idx)], dtype=np.float32)
            for name, idx in maps.items()}


def map_size(maps: IndexMap) -> int:
    """Number of coordinates a slice holds (its floats on the wire)."""
    return sum(int(np.prod([len(i) for i in idx])) for idx in maps.values())


class CoordinateAverage:
    """Σ values and Σ counts per coordinate of the global model, over the round's slices.

    ``add(values, maps, weight, rows)``: a client's slice at its coordinates; ``rows``, when
    given, keeps only those output rows of the head (``head.weight``, ``head.bias``: HeteroFL's
    label-split head, where a client adds and counts only its own classes' rows). ``result``:
    Σ/count where the count is positive, the previous global value elsewhere.

    With a coordinate-wise ``robust`` rule (``robust-aggregation`` "median" or
    "trimmed-mean") each coordinate is instead that rule over the values of the clients that
    hold it (:func:`~fedapp.runtime.aggregate.held_coordinates`): every slice is kept at the
    global model's size, NaN where it holds nothing, for the round."""

    def __init__(self, global_arrays: Payload, robust: Robust | None = None) -> None:
        self.previous = global_arrays
        self.sums = {k: np.zeros(v.shape, np.float64) for k, v in global_arrays.items()}
        self.counts = {k: np.zeros(v.shape, np.float64) for k, v in global_arrays.items()}
        self.robust = robust if robust is not None and robust.rule != "none" else None
        self.slices: dict[str, list[np.ndarray]] = {k: [] for k in global_arrays}

    def add(self, values: Payload, maps: IndexMap, weight: float = 1.0,
            rows: np.ndarray | None = None) -> None:
        for name, idx in maps.items():
            value = np.asarray(values[name], dtype=np.float64)
            if rows is not None and name in HEAD_KEYS:
                # The head's output dimension is whole (idx[0] = arange(C)): keep the rows of
                # the client's classes only.
                idx = (idx[0][rows],) + idx[1:]
                value = value[rows]
            where = np.ix_(*idx)
            self.sums[name][where] += weight * value
            self.counts[name][where] += weight
            if self.robust is not None:
                full = np.full(self.previous[name].shape, np.nan, np.float32)
                full[where] = value
                self.slices[name].append(full)

    # -- secure aggregation: the sums travel, padded to the global model ----------------------
    def padded(self) -> Payload:
        """Σ values and Σ weights as a fixed-layout upload (``secure-aggregation``): every
        tensor at the global model's shape, zeros where nothing was added, and its weights
        beside it (:func:`padded_layout`). A client's one :meth:`add` makes its upload; the
        sum of the survivors' is the round's :class:`CoordinateAverage`."""
        return {**self.sums, **{HELD + name: count for name, count in self.counts.items()}}

    @classmethod
    def from_padded(cls, previous: Payload, sums: Mapping[str, np.ndarray],
                    noise: float) -> CoordinateAverage:
        """The average of summed :meth:`padded` uploads. A coordinate counts as held where
        its summed weight is above ``noise``, the quantisation error of a sum of weights (an
        unheld coordinate sums exact zeros; a held one at least the smallest client weight)."""
        total = cls(previous)
        total.sums = {name: np.asarray(sums[name], np.float64) for name in previous}
        total.counts = {name: np.where(sums[HELD + name] > noise, sums[HELD + name], 0.0)
                        for name in previous}
        return total

    def result(self) -> Payload:
        out = {}
        for name, previous in self.previous.items():
            count = self.counts[name]
            held = count > 0
            merged = np.array(previous, dtype=np.float32, copy=True)
            if self.robust is not None and self.slices[name]:
                combined = held_coordinates(np.stack(self.slices[name]), self.robust)
                merged[held] = combined[held].astype(np.float32)
            else:
                merged[held] = (self.sums[name][held] / count[held]).astype(np.float32)
            out[name] = merged
        return out


def padded_layout(global_shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """The fixed layout of :meth:`CoordinateAverage.padded`: every tensor of the global model,
    and its weights (``secagg/held/<name>``) at the same shape: the global model twice over."""
    return {**{name: tuple(shape) for name, shape in global_shapes.items()},
            **{HELD + name: tuple(shape) for name, shape in global_shapes.items()}}


def padded_upload(global_shapes: Mapping[str, Sequence[int]], values: Payload, maps: IndexMap,
                  weight: float = 1.0, rows: np.ndarray | None = None) -> Payload:
    """One client's fixed-layout upload (``secure-aggregation``): the :class:`CoordinateAverage`
    of its slice alone (``add``'s arguments), :meth:`~CoordinateAverage.padded`."""
    total = CoordinateAverage({name: np.zeros(shape, np.float32)
                               for name, shape in global_shapes.items()})
    total.add(values, maps, weight, rows)
    return total.padded()


def whole_maps(shapes: Mapping[str, Sequence[int]]) -> IndexMap:
    """Index maps that hold every coordinate of each tensor named (DepthFL's prefix entries,
    which are the global model's own)."""
    return {name: tuple(np.arange(d, dtype=np.int64) for d in shape)
            for name, shape in shapes.items()}


def meta_shapes(build: Callable[[], nn.Module]) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of the model ``build()`` makes, as ``state_arrays`` gives them (a
    0-d entry as (1,)), built on the meta device: nothing allocated, no random draw (a client
    that needs the global model's shapes and holds only its slice)."""
    with torch.device("meta"):
        model = build()
    return {name: tuple(v.shape) or (1,) for name, v in model.state_dict().items()}


def window_offset(server_round: int) -> int:
    """t, the rolling window's offset in ``server_round`` (t = round - 1; the leading scheme
    ignores it). The server and, under secure aggregation, the client compute it alike."""
    return server_round - 1


def masked_logits(logits: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """HeteroFL's masked head: the logits of classes outside the client's labels set to 0 (not
    −∞, as the code's ``masked_fill(label_mask == 0, 0)``): they stay in the softmax's
    denominator but get no gradient."""
    return logits.masked_fill(~label_mask, 0.0)


def label_mask(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[C] bool: the classes present in ``labels``."""
    mask = torch.zeros(num_classes, dtype=torch.bool, device=labels.device)
    mask[labels.long().unique()] = True
    return mask


@torch.no_grad()
def with_statistics(model: nn.Module, x: torch.Tensor, batch_size: int) -> nn.Module:
    """A copy of ``model`` whose static BatchNorms carry statistics of ``x`` (HeteroFL's sBN),
    in eval mode: each BN tracks a cumulative average (``momentum=None``) over one pass of
    ``x`` in batches, as the code's ``stats`` pass. Only the BNs run in training mode: a
    Scaler stays the identity it is at evaluation, so that the statistics are those of the
    activations the evaluation will see (the code runs the whole model in training mode, the
    same thing at the global model's rate 1)."""
    tracked = copy.deepcopy(model)
    norms = [m for m in tracked.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return tracked.eval()
    for bn in norms:
        bn.track_running_stats = True
        bn.momentum = None
        device = bn.weight.device if bn.weight is not None else x.device
        bn.register_buffer("running_mean", torch.zeros(bn.num_features, device=device))
        bn.register_buffer("running_var", torch.ones(bn.num_features, device=device))
        bn.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long,
                                                               device=device))
    tracked.eval()
    for bn in norms:
        bn.train()
    for start in range(0, len(x), batch_size):
        tracked(x[start:start + batch_size])
    return tracked.eval()
