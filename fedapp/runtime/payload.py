"""Named-array payloads: the one wire format every method uses, and its validation.

A payload is a ``dict[str, np.ndarray]`` (``{"head.weight": ..., "labels": ...}``). On the wire
it is a Flower ``Parameters``: tensor 0 holds the names as a unicode array, tensor i the i-th
array, each encoded with ``np.save(allow_pickle=False)`` — the same encoding ``NumPyClient``
applies to the list it returns, so a client returns :func:`to_ndarrays` and the server reads
:func:`decode`. Decoding never unpickles, and reads in three steps, so that a refused upload costs
the server a bounded amount of memory beyond the bytes it received: the npy headers and the names
(:func:`read_headers`: encoding, dtypes, sizes, and against the method's :class:`ArraySpec`
names, shapes and kinds, :func:`check_layout`), then the values as read-only views of the
received bytes, checked a slice at a time (:func:`load`, :func:`validate`), and only then a copy
in the wire dtypes (:func:`to_wire`).

Byte accounting distinguishes the *data* (``nbytes`` of the numeric arrays: what the papers
count, e.g. 5010 floats = 20040 bytes for a 500x10 head) from the *framing* (npy headers and the
names tensor), so both can be reported honestly.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
# The names tensor: 4096 names of 64 characters (UTF-32) in all. Honest names are tens of
# characters (``extractor.layer4.1.bn2.running_mean``).
MAX_NAMES_BYTES = MAX_ARRAYS * 64 * 4
# Values are checked this many at a time: the temporaries of a check stay at a few MiB.
CHUNK = 1 << 18


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


@dataclass(frozen=True)
class Header:
    """One received array as its npy header describes it, and where its data lies in the blob
    (``blob[offset:]``, exactly ``size * dtype.itemsize`` bytes). Reading it costs nothing
    beyond the header: shape, dtype and names are checked on these before any data is read."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    blob: bytes
    offset: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # Python ints: a (2^62, 3) claim does not wrap around


def _header(blob: bytes, i: int) -> Header:
    """Tensor ``i``'s npy header, refused unless it describes a plain array whose data is
    exactly the rest of the blob (no pickle, no object dtype, nothing truncated or appended)."""
    if not isinstance(blob, bytes):
        raise PayloadError(f"tensor {i} is not bytes")
    buf = io.BytesIO(blob)  # shares the bytes object: no copy
    try:
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(buf)]
        shape, fortran_order, dtype = read(buf)
    except Exception as exc:  # not npy, an unknown version, a header numpy refuses, ...
        raise PayloadError(f"tensor {i} is not a plain .npy array ({exc!r})") from None
    header = Header(tuple(int(n) for n in shape), dtype, bool(fortran_order), blob, buf.tell())
    if dtype.hasobject or dtype.kind not in ALLOWED_KINDS | {"U"}:
        raise PayloadError(f"tensor {i} has dtype {dtype}, not a numeric dtype "
                           f"(not a plain .npy array)")
    claimed = header.size * dtype.itemsize
    if claimed != len(blob) - header.offset:
        raise PayloadError(f"tensor {i} holds {len(blob) - header.offset} bytes of data where "
                           f"its header ({dtype}, shape {header.shape}) says {claimed}: "
                           "truncated or padded")
    return header


def _view(header: Header) -> np.ndarray:
    """The array's data in the sender's dtype, read-only and without a copy (flat)."""
    return np.frombuffer(header.blob, dtype=header.dtype, count=header.size,
                         offset=header.offset)


def read_headers(parameters: Parameters) -> dict[str, Header]:
    """Flower ``Parameters`` -> {name: :class:`Header`}, reading headers and names only.

    Refused with PayloadError: too many tensors, a tensor that is not a plain numeric .npy
    array whose data is exactly what its header says, a names tensor that does not name every
    array once. Only the names tensor is decoded (bounded by ``MAX_NAMES_BYTES``)."""
    tensors = parameters.tensors
    if len(tensors) > MAX_ARRAYS + 1:
        raise PayloadError(f"too many tensors ({len(tensors)})")
    if not tensors:
        return {}
    headers = [_header(blob, i) for i, blob in enumerate(tensors)]
    names = headers[0]
    if names.dtype.kind != "U" or names.ndim != 1 or names.shape[0] != len(tensors) - 1:
        raise PayloadError("the first tensor must name the other tensors")
    if names.size * names.dtype.itemsize > MAX_NAMES_BYTES:
        raise PayloadError(f"the names tensor is larger than {MAX_NAMES_BYTES} bytes")
    keys = [str(n) for n in _view(names)]
    if len(set(keys)) != len(keys):
        raise PayloadError("duplicate array names")
    for i, header in enumerate(headers[1:], 1):
        if header.dtype.kind == "U":
            raise PayloadError(f"array {keys[i - 1]!r} has dtype {header.dtype}, not a "
                               "numeric dtype")
    return dict(zip(keys, headers[1:]))


def _chunks(flat: np.ndarray):
    """``flat`` in slices (views) of ``CHUNK`` elements: checks on them allocate a bounded
    amount, whatever the array's size."""
    for start in range(0, flat.size, CHUNK):
        yield flat[start:start + CHUNK]


def load(headers: Mapping[str, Header], max_abs: float = math.inf) -> Payload:
    """{name: Header} -> payload of read-only views of the received bytes, in the sender's
    dtypes: no copy. Refused with PayloadError: NaN or infinite values, a float of magnitude
    above ``max_abs`` (out of scale for any honest model, representation or logit; see the
    ``upload-max-abs`` setting), an integer beyond +-2^31. The values are checked a slice at
    a time (a float wider than float32 in float64, so that a float64 or longdouble beyond
    float32's range is caught before any cast), so refusing an upload costs a bounded
    amount of memory beyond the bytes received."""
    payload = {}
    for name, header in headers.items():
        flat = _view(header)
        check_values(name, flat, max_abs)
        payload[name] = flat.reshape(header.shape, order="F" if header.fortran_order else "C")
    return payload


def check_values(name: str, array: np.ndarray, max_abs: float = math.inf,
                 what: str = "array") -> None:
    """Refuse (PayloadError) NaN or infinite values, a float of magnitude above ``max_abs``
    and an integer beyond +-2^31 in ``array`` (``what`` names it in the message), a slice at a
    time and a float wider than float32 in float64, so that the check allocates a bounded
    amount and a value beyond float32's range is caught before any cast."""
    kind = array.dtype.kind
    for chunk in _chunks(array.ravel(order="K")):
        if kind == "f":
            with np.errstate(over="ignore", invalid="ignore"):
                wide = chunk.astype(np.float64)
            if not np.all(np.isfinite(wide)):
                raise PayloadError(f"{what} {name!r} holds NaN or infinite values")
            if wide.size and float(np.abs(wide).max()) > max_abs:
                raise PayloadError(f"{what} {name!r} holds values of magnitude up to "
                                   f"{float(np.abs(wide).max()):.3g}, above "
                                   f"upload-max-abs = {max_abs:g}")
        elif kind in "iu" and chunk.size and (int(chunk.min()) < -MAX_ABS_INT
                                              or int(chunk.max()) > MAX_ABS_INT):
            raise PayloadError(f"{what} {name!r} holds integers beyond +-2^31")


def to_wire(payload: Mapping[str, np.ndarray]) -> Payload:
    """Float arrays as native float32, integers as native int64, booleans as bool: whatever
    dtype and byte order a sender chose, no upload decides the precision or byte order of what
    the server computes. Always a fresh, writable, C-ordered copy."""
    wire = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}
    return {name: array.astype(wire[array.dtype.kind], order="C")
            for name, array in payload.items()}


def decode(parameters: Parameters, max_abs: float = math.inf) -> Payload:
    """Flower ``Parameters`` -> payload in the wire dtypes, never unpickling: headers first
    (:func:`read_headers`), then values (:func:`load`), then the wire dtypes
    (:func:`to_wire`). Anything that is not a plain numeric .npy array, non-finite values,
    floats above ``max_abs`` and integers beyond +-2^31 are refused with PayloadError."""
    return to_wire(load(read_headers(parameters), max_abs))


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


def check_layout(arrays: Mapping[str, Any], specs: Mapping[str, ArraySpec]) -> None:
    """Check names, shapes and dtype kinds against ``specs``: what a :class:`Header` already
    tells (so it runs before any data is read) and an array tells alike."""
    missing = [n for n in specs if n not in arrays]
    extra = [n for n in arrays if n not in specs]
    if missing or extra:
        raise PayloadError(f"expected arrays {sorted(specs)}, missing {missing}, unexpected "
                           f"{extra}")
    for name, spec in specs.items():
        array = arrays[name]
        if array.ndim != len(spec.shape) or any(
                want is not None and got != want for got, want in zip(array.shape, spec.shape)):
            want_text = "x".join("*" if s is None else str(s) for s in spec.shape)
            raise PayloadError(f"array {name!r} has shape {tuple(array.shape)}, expected "
                               f"{want_text}")
        if spec.kind == "float" and array.dtype.kind != "f":
            raise PayloadError(f"array {name!r} has dtype {array.dtype}, expected float")
        if spec.kind != "float" and array.dtype.kind not in "iu":
            raise PayloadError(f"array {name!r} has dtype {array.dtype}, expected integer")


def validate(payload: Payload, specs: Mapping[str, ArraySpec]) -> None:
    """Check names, shapes, dtypes, finiteness and integer ranges against ``specs``.

    Raises PayloadError with the first reason found; a payload that passes is safe for the
    method's maths (no NaN/inf, no out-of-range label, every expected array present). Values
    are checked a slice at a time, so that the check allocates a bounded amount.
    """
    check_layout(payload, specs)
    for name, spec in specs.items():
        flat = payload[name].ravel(order="K")  # a view of a contiguous array
        for chunk in _chunks(flat):
            if spec.kind == "float":
                if not np.all(np.isfinite(chunk)):
                    raise PayloadError(f"array {name!r} holds NaN or infinite values")
            elif chunk.size:
                if spec.low is not None and chunk.min() < spec.low:
                    raise PayloadError(f"array {name!r} holds {chunk.min()} < {spec.low}")
                if spec.high is not None and chunk.max() > spec.high:
                    raise PayloadError(f"array {name!r} holds {chunk.max()} > {spec.high}")


def float32(payload: Mapping[str, np.ndarray]) -> Payload:
    """Cast every float array to float32 (4 bytes a float on the wire, as the papers count)."""
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in payload.items()}
