"""Named-array payloads: the one wire format every method uses, and its validation.

A payload is a ``dict[str, np.ndarray]`` (``{"head.weight": ..., "labels": ...}``). On the wire
it is a Flower ``Parameters``: tensor 0 holds the names as a unicode array, tensor i the i-th
array, each encoded with ``np.save(allow_pickle=False)`` — the same encoding ``NumPyClient``
applies to the list it returns, so a client returns :func:`to_ndarrays` and the server reads
:func:`decode`. Decoding never unpickles (``allow_pickle=False``), and :func:`validate` checks
every array against the method's :class:`ArraySpec` before any maths touches it.

Byte accounting distinguishes the *data* (``nbytes`` of the numeric arrays: what the papers
count, e.g. 5010 floats = 20040 bytes for a 500x10 head) from the *framing* (npy headers and the
names tensor), so both can be reported honestly.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from flwr.common import Parameters

Payload = dict[str, np.ndarray]
TENSOR_TYPE = "fedapp.named-ndarrays"
# Only plain numeric arrays travel. Object, string (except the names tensor) and structured
# dtypes are refused: they are either pickles in disguise or nothing a method needs.
ALLOWED_KINDS = {"f", "i", "u", "b"}
MAX_ARRAYS = 4096
# Integers that travel are labels, counts and BatchNorm's step counter: none comes near 2^31,
# and keeping them there keeps every sum and float64 average of them exact.
MAX_ABS_INT = 2**31


class PayloadError(ValueError):
    """A payload that cannot be decoded or does not match what the method expects."""


@dataclass(frozen=True)
class ArraySpec:
    """What one named array must look like.

    ``shape`` entries are ints or ``None`` (any length); ``kind`` is ``"float"`` or ``"int"``;
    ``low``/``high`` bound integer values (labels in ``[0, C)``: low=0, high=C-1).
    """

    shape: tuple[int | None, ...]
    kind: str = "float"
    low: int | None = None
    high: int | None = None


@dataclass(frozen=True)
class WireSize:
    """Bytes of one encoded payload: the arrays' data and the encoding around them."""

    data: int = 0
    framing: int = 0

    @property
    def total(self) -> int:
        return self.data + self.framing

    def __add__(self, other: "WireSize") -> "WireSize":
        return WireSize(self.data + other.data, self.framing + other.framing)


def to_ndarrays(payload: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Payload -> the list a ``NumPyClient`` returns (names first). Empty payload -> ``[]``."""
    if not payload:
        return []
    names = list(payload)
    return [np.array(names, dtype=np.str_)] + [np.ascontiguousarray(payload[n]) for n in names]


def from_ndarrays(arrays: Sequence[np.ndarray]) -> Payload:
    """The list a ``NumPyClient`` receives -> payload (inverse of :func:`to_ndarrays`)."""
    if len(arrays) == 0:
        return {}
    names = arrays[0]
    if names.dtype.kind != "U" or names.ndim != 1 or len(names) != len(arrays) - 1:
        raise PayloadError("the first tensor must name the other tensors")
    keys = [str(n) for n in names]
    if len(set(keys)) != len(keys):
        raise PayloadError("duplicate array names")
    return dict(zip(keys, arrays[1:]))


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def encode(payload: Mapping[str, np.ndarray]) -> Parameters:
    """Payload -> Flower ``Parameters`` (what the server sends)."""
    return Parameters(tensors=[_npy_bytes(a) for a in to_ndarrays(payload)],
                      tensor_type=TENSOR_TYPE)


def decode(parameters: Parameters, max_abs: float = math.inf) -> Payload:
    """Flower ``Parameters`` -> payload in the wire dtypes, never unpickling.

    Whatever dtype and byte order a sender chose, float arrays come back as native float32
    and integer arrays as native int64, so that no upload decides the precision or byte order
    of what the server computes. Refused with PayloadError: anything that is not a plain
    numeric .npy array, NaN or infinite values, a float of magnitude above ``max_abs`` (out of
    scale for any honest model, representation or logit; see the ``upload-max-abs`` setting),
    and an integer beyond +-2^31."""
    if len(parameters.tensors) > MAX_ARRAYS + 1:
        raise PayloadError(f"too many tensors ({len(parameters.tensors)})")
    arrays = []
    for i, blob in enumerate(parameters.tensors):
        try:
            arrays.append(np.load(io.BytesIO(blob), allow_pickle=False))
        except Exception as exc:  # np.load raises ValueError, EOFError, OSError, ...
            raise PayloadError(f"tensor {i} is not a plain .npy array ({exc})") from None
    payload = from_ndarrays(arrays)
    return {name: _to_wire_dtype(name, array, max_abs) for name, array in payload.items()}


def _to_wire_dtype(name: str, array: np.ndarray, max_abs: float) -> np.ndarray:
    kind = array.dtype.kind
    if kind not in ALLOWED_KINDS:
        raise PayloadError(f"array {name!r} has dtype {array.dtype}, not a numeric dtype")
    if kind == "b":
        return array.astype(np.bool_)
    if kind == "f":
        # Checked in float64 before the cast: a longdouble or float64 beyond float32's range
        # would otherwise turn into inf silently, or into a finite but absurd value.
        with np.errstate(over="ignore", invalid="ignore"):
            wide = array.astype(np.float64)
        if not np.all(np.isfinite(wide)):
            raise PayloadError(f"array {name!r} holds NaN or infinite values")
        if wide.size and float(np.abs(wide).max()) > max_abs:
            raise PayloadError(f"array {name!r} holds values of magnitude up to "
                               f"{float(np.abs(wide).max()):.3g}, above upload-max-abs = "
                               f"{max_abs:g}")
        return wide.astype(np.float32)
    if array.size and (int(array.min()) < -MAX_ABS_INT or int(array.max()) > MAX_ABS_INT):
        raise PayloadError(f"array {name!r} holds integers beyond +-2^31")
    return array.astype(np.int64)


def wire_size(parameters: Parameters) -> WireSize:
    """Bytes that crossed the wire for ``parameters``, split into data and framing.

    Reads only each tensor's npy header (shape and dtype), not its data: this runs for every
    message, and decoding a whole model twice per upload would be wasted work."""
    total = sum(len(t) for t in parameters.tensors)
    data = 0
    for blob in parameters.tensors[1:]:
        try:
            buf = io.BytesIO(blob)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}[
                np.lib.format.read_magic(buf)]
            shape, _, dtype = read_header(buf)
            # Python ints: a header claiming (2^62, 3) must not wrap around to a negative size.
            nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
        except Exception:
            continue  # an unreadable tensor is all framing as far as the papers' count goes
        # A header may claim more than the blob holds; count only what really came.
        data += min(nbytes, len(blob))
    return WireSize(data=data, framing=total - data)


def validate(payload: Payload, specs: Mapping[str, ArraySpec]) -> None:
    """Check names, shapes, dtypes, finiteness and integer ranges against ``specs``.

    Raises PayloadError with the first reason found; a payload that passes is safe for the
    method's maths (no NaN/inf, no out-of-range label, every expected array present).
    """
    missing = [n for n in specs if n not in payload]
    extra = [n for n in payload if n not in specs]
    if missing or extra:
        raise PayloadError(f"expected arrays {sorted(specs)}, missing {missing}, unexpected "
                           f"{extra}")
    for name, spec in specs.items():
        array = payload[name]
        if array.ndim != len(spec.shape) or any(
                want is not None and got != want for got, want in zip(array.shape, spec.shape)):
            want_text = "x".join("*" if s is None else str(s) for s in spec.shape)
            raise PayloadError(f"array {name!r} has shape {array.shape}, expected {want_text}")
        if spec.kind == "float":
            if array.dtype.kind != "f":
                raise PayloadError(f"array {name!r} has dtype {array.dtype}, expected float")
            if not np.all(np.isfinite(array)):
                raise PayloadError(f"array {name!r} holds NaN or infinite values")
        else:
            if array.dtype.kind not in "iu":
                raise PayloadError(f"array {name!r} has dtype {array.dtype}, expected integer")
            if array.size and spec.low is not None and array.min() < spec.low:
                raise PayloadError(f"array {name!r} holds {array.min()} < {spec.low}")
            if array.size and spec.high is not None and array.max() > spec.high:
                raise PayloadError(f"array {name!r} holds {array.max()} > {spec.high}")


def float32(payload: Mapping[str, np.ndarray]) -> Payload:
    """Cast every float array to float32 (4 bytes a float on the wire, as the papers count)."""
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in payload.items()}
