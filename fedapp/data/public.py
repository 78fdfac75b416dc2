"""The public set: data every party holds, on which methods such as FedMD exchange scores.

Messages name public samples by their *index* in the public set, never by their pixels: the
server and every client load the same set the same way, once per process, from the run config
alone (as they do the private data). Three sources (``public-source``):

``train-holdout``
    A seeded, stratified ``public-fraction`` of the run's training split, cut **before**
    partitioning: the private data the partitioners see is the rest, so no client shard, no
    local validation split and no ``local-test = "split"`` test set can hold a public sample
    (``tests/test_public.py`` checks it for every scheme). The FedHe and Felo papers' FedMD
    (about 10% of the training data).
``digits``
    scikit-learn's bundled handwritten digits (1,797 images of 8x8, 10 classes), scaled to
    [0, 1], upsampled bilinearly to 28x28 as ``reproduce/common.py``'s ``digits_data`` does and
    normalised with Fashion-MNIST's mean and std: an out-of-domain public set that works
    offline, as MNIST is for FEMNIST in FedMD's paper. For 1x28x28 private data only.
``npz``
    A file of the user's (``public-file``): ``x`` (N, C, H, W) or (N, H, W), float (used as
    it is) or uint8 (scaled and normalised by its own channel statistics), and optionally
    ``y``.

Every random choice comes from a generator keyed by ``(seed, "public-holdout")``
(:func:`fedapp.seeding.derive_seed`), never from a global one.
"""

from __future__ import annotations

import functools
import threading
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedapp.data.datasets import DatasetError, TensorData, make_tensor_data
from fedapp.data.files import NPZ_LAYOUT, _images, _labels, _normalise
from fedapp.data.partitions import _stratified_pick
from fedapp.seeding import derive_seed

PUBLIC_SOURCES = ("none", "train-holdout", "digits", "npz")
FMNIST_MEAN_STD = (0.2860, 0.3530)  # digits is normalised as the private FMNIST it sits beside


class PublicSetError(ValueError):
    """The public set cannot serve the run; the message says which setting to change."""


@dataclass(frozen=True, eq=False)
class PublicSet:
    """The public set as normalised tensors.

    ``y`` is None when the set has no labels or the method may not read them
    (``public-labels``); ``rows`` are, for ``train-holdout``, the rows of the loaded training
    split it was cut from (what the tests check against every client's shard)."""

    source: str
    x: torch.Tensor                 # float32 [P, C, H, W]
    y: torch.Tensor | None          # int64 [P] or None
    rows: np.ndarray | None = None  # int64 [P], train-holdout only

    def __len__(self) -> int:
        return len(self.x)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.x.shape[1:])  # type: ignore[return-value]

    def without_labels(self) -> "PublicSet":
        return PublicSet(self.source, self.x, None, self.rows)


# -- train-holdout ------------------------------------------------------------------------------

def round_subset(seed: int, purpose: str, server_round: int, public_size: int,
                 size: int, replace: bool = False) -> np.ndarray:
    """A round's subset of the public set (FedMD's alignment set A_t, DS-FL's open subset):
    ``size`` distinct indices (``replace``: ``size`` draws that may repeat, as KT-pFL's code
    draws), sorted, int32, drawn from ``(seed, purpose, round)``. The server and every client
    compute it alike, so it need not travel."""
    rng = np.random.default_rng(derive_seed(seed, purpose, server_round))
    return np.sort(rng.choice(public_size, size, replace=replace)).astype(np.int32)


def holdout_rows(train_y: np.ndarray, fraction: float, seed: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(public rows, private rows) of a training split with labels ``train_y``: a stratified
    ``round(fraction * N)`` of it (each class in its share, by largest remainder) from the
    generator keyed by ``(seed, "public-holdout")``; both sorted ascending."""
    y = np.asarray(train_y).astype(np.int64, copy=False)
    rng = np.random.default_rng(derive_seed(seed, "public-holdout"))
    private, public = _stratified_pick(np.arange(len(y)), y, round(fraction * len(y)), 0, rng)
    return np.sort(public), np.sort(private)


# The private part of each loaded data set, per (fraction, seed): the split is cut once per
# process, like the data itself (weak keys: it goes when the loaders' caches drop the data).
_PRIVATE: "weakref.WeakKeyDictionary[TensorData, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _holdout(data: TensorData, fraction: float, seed: int
             ) -> tuple[TensorData, "PublicSet", np.ndarray]:
    with _LOCK:
        found = _PRIVATE.setdefault(data, {}).get((fraction, seed))
    if found is not None:
        return found
    public, private = holdout_rows(data.train_y.numpy(), fraction, seed)
    if len(public) == 0 or len(private) == 0:
        raise PublicSetError(
            f"setting public-fraction = {fraction} leaves "
            f"{'no public sample' if len(public) == 0 else 'no training sample'} of the "
            f"{len(data.train_y)} in {data.name}'s training split; choose another fraction")
    keep = torch.from_numpy(np.array(private))
    cut = make_tensor_data(data.name, data.train_x.index_select(0, keep),
                           data.train_y.index_select(0, keep), data.test_x, data.test_y,
                           data.num_classes)
    index = torch.from_numpy(np.array(public))
    public_set = PublicSet("train-holdout", data.train_x.index_select(0, index),
                           data.train_y.index_select(0, index), public)
    for rows in (public, private):
        rows.setflags(write=False)
    with _LOCK:
        found = _PRIVATE.setdefault(data, {}).setdefault((fraction, seed),
                                                         (cut, public_set, private))
    return found


def private_part(data: TensorData, fraction: float, seed: int) -> TensorData:
    """``data`` without its public rows: what the partitioners split (train-holdout)."""
    return _holdout(data, fraction, seed)[0]


def holdout_public(data: TensorData, fraction: float, seed: int) -> PublicSet:
    """The public rows of ``data``'s training split, with their labels."""
    return _holdout(data, fraction, seed)[1]


def holdout_private_rows(data: TensorData, fraction: float, seed: int) -> np.ndarray:
    """Row ``i`` of the private part is row ``private_rows[i]`` of the loaded training split."""
    return _holdout(data, fraction, seed)[2]


# -- digits -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def digits_public() -> PublicSet:
    """scikit-learn's digits as a 1x28x28 public set (its import stays optional)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PublicSetError(
            "public-source = 'digits' needs scikit-learn, which is not installed: "
            "pip install -e '.[reproduce]' (or use public-source = 'train-holdout')") from None
    import torch.nn.functional as F
    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0
    up = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    # The same 8-bit pixels as reproduce/common.py's digits_data writes, then FMNIST's scale.
    x = (up.clamp(0, 1) * 255).round() / 255.0
    x = (x - FMNIST_MEAN_STD[0]) / FMNIST_MEAN_STD[1]
    return PublicSet("digits", x.contiguous(), torch.from_numpy(digits.target.astype(np.int64)))


# -- a user's npz -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def npz_public(path: str) -> PublicSet:
    """The public set of an ``.npz`` file (``x``, optionally ``y``), read without pickles."""
    file = Path(path)
    if not file.is_file():
        raise PublicSetError(f"setting public-file = {path!r}: no such file; expected a .npz "
                             f"with {NPZ_LAYOUT} (y optional)")
    try:
        with np.load(file, allow_pickle=False) as arrays:
            names = set(arrays.files)
            x = arrays["x"] if "x" in names else None
            y = arrays["y"] if "y" in names else None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise PublicSetError(f"public-file {path}: not a readable .npz file ({exc})") from None
    if x is None:
        raise PublicSetError(f"public-file {path}: has arrays {sorted(names)}; needs x "
                             f"({NPZ_LAYOUT}; y optional)")
    try:
        images = _images(x, str(file))
        labels = None if y is None else _labels(y, len(images), str(file))
    except DatasetError as exc:
        raise PublicSetError(str(exc)) from None
    _normalise(images, raw=x.dtype == np.uint8)
    return PublicSet("npz", images, labels)


# -- the checks every run's public set passes -----------------------------------------------------

def check_public(public: PublicSet, input_shape: tuple[int, int, int], num_classes: int,
                 needed: int = 1) -> None:
    """Refuse a public set that the private models cannot read, that is empty, that is
    smaller than the ``needed`` samples a method draws from it per round, or whose labels (if
    a method may read them) are not classes of the private data."""
    if public.input_shape != tuple(input_shape):
        what = "channels" if public.input_shape[0] != input_shape[0] else "image size"
        raise PublicSetError(
            f"the public set ({public.source}) has images of shape {public.input_shape}, but "
            f"the private data's are {tuple(input_shape)} ({what} differ): every model must "
            "score both. Use public-source = 'train-holdout', or a public-file of that shape.")
    if len(public) < max(needed, 1):
        raise PublicSetError(
            f"the public set ({public.source}) has {len(public)} samples, fewer than the "
            f"{max(needed, 1)} the method draws from it per round: raise public-fraction, use a "
            "larger public set or lower the method's per-round sample")
    if public.y is not None and len(public.y) and int(public.y.max()) >= num_classes:
        raise PublicSetError(
            f"the public set's ({public.source}) labels span 0..{int(public.y.max())}, but the "
            f"private data has {num_classes} classes, so a model cannot learn them; set "
            "public-labels = 'unlabelled' (or relabel the file)")
