"""Datasets as in-memory tensors, loaded once per process.

Why tensors and not ``torch.utils.data.Dataset`` objects with PIL transforms?
The methods in this project run many small clients on a
2-core CPU.  Decoding 28x28 images through PIL on every epoch would cost more
than the tiny CNNs themselves, so every dataset is converted ONCE into a
normalised ``float32 [N, C, H, W]`` tensor plus an ``int64 [N]`` label tensor
(the Debian IDX files are read directly with gzip + numpy, normalised and
cached as tensors).  Clients then index these tensors
with the partition indices from :mod:`fedapp.data.partitions`.

Sources
-------
``fmnist``
    The Debian package ``dataset-fashion-mnist`` installs the original IDX
    files in ``/usr/share/datasets/fashion-mnist``; they are read directly with
    ``gzip`` + ``numpy`` (their checksums differ from the list torchvision
    checks, so torchvision would refuse them).  A ``data_dir`` may hold the same
    four files (``.gz`` or uncompressed), either directly or in torchvision's
    ``FashionMNIST/raw`` layout.  ``download=True`` (needs internet) fetches
    them with torchvision into ``data_dir`` and then reads the raw files.
``mnist``, ``cifar10``, ``cifar100``, ``emnist-letters``
    torchvision datasets under ``data_dir`` (downloaded only if
    ``download=True``).  Converted from the datasets' ``.data``/``.targets``
    arrays in one go, never sample by sample through PIL.
``synthetic``
    A deterministic, class-conditional, learnable stand-in (smooth random
    prototype per class + Gaussian noise) for tests and machines without data.

Every loader returns a frozen :class:`TensorData`.  ``load_dataset`` is cached
per process, so a second call with the same arguments returns the SAME object
(treat its tensors as read-only: they are shared by all callers).
"""

from __future__ import annotations

import functools
import gzip
import os
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DATASETS",
    "DEFAULT_DOWNLOAD_DIR",
    "FMNIST_DEBIAN_DIR",
    "FMNIST_FILES",
    "NORMALISATION",
    "DatasetError",
    "TensorData",
    "load_dataset",
    "make_tensor_data",
    "read_idx",
]


class DatasetError(RuntimeError):
    """A dataset could not be loaded; the message says what to install or put where."""


@dataclass(frozen=True, eq=False)  # eq=False: compare/hash by identity, never tensor-wise
class TensorData:
    """A whole dataset (train and test split) as normalised tensors.

    Attributes
    ----------
    name:
        Dataset name as passed to :func:`load_dataset` (one of ``DATASETS``).
    train_x, test_x:
        ``float32 [N, C, H, W]``, pixels scaled to [0, 1] and then normalised
        with the per-dataset channel mean/std in ``NORMALISATION``.
    train_y, test_y:
        ``int64 [N]`` labels in ``0 .. num_classes - 1``.
    num_classes:
        Number of classes.
    input_shape:
        ``(C, H, W)`` of one sample.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, int, int]
    # A federation given as per-client files (``fedapp.data.files``): client k's indices into
    # the training and the test split; None for a data set the run partitions itself.
    clients: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None


DATASETS: tuple[str, ...] = (
    "fmnist",
    "mnist",
    "cifar10",
    "cifar100",
    "emnist-letters",
    "synthetic",
)

FMNIST_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"

# Where ``download=True`` puts files when no ``data_dir`` is given.
DEFAULT_DOWNLOAD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "fedapp", "data")

# The four IDX files of (Fashion-)MNIST, keyed by (split, kind).  The same file
# names are used by the Debian package, by the original Zalando release and by
# torchvision's ``<root>/FashionMNIST/raw`` folder.
FMNIST_FILES: dict[tuple[str, str], str] = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}

# Per-channel (mean, std) of the TRAIN split after scaling pixels to [0, 1].
# FMNIST 0.2860/0.3530 and the others are the
# usual published values for these datasets.
NORMALISATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fmnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "emnist-letters": ((0.1722,), (0.3309,)),
}

# How torchvision lays out each dataset under ``root`` (used in error messages).
_TORCHVISION_LAYOUT: dict[str, str] = {
    "mnist": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    "cifar10": "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
    "cifar100": "cifar-100-python/{train,test,meta}",
    "emnist-letters": "EMNIST/raw/emnist-letters-{train,test}-{images-idx3,labels-idx1}-ubyte",
}


# --------------------------------------------------------------------------- #
# Public entry point
# --------------------------------------------------------------------------- #
def load_dataset(
    name: str,
    data_dir: str = "",
    download: bool = False,
    *,
    seed: int = 0,
    synthetic_shape: tuple[int, int, int] = (1, 28, 28),
    synthetic_classes: int = 10,
    synthetic_train: int = 2000,
    synthetic_test: int = 500,
) -> TensorData:
    """Load dataset ``name`` as a :class:`TensorData`, once per process.

    Parameters
    ----------
    name:
        One of :data:`DATASETS`.
    data_dir:
        Folder with the dataset files.  For ``fmnist`` an empty string means
        the Debian folder :data:`FMNIST_DEBIAN_DIR`; for the torchvision
        datasets it is torchvision's ``root`` (empty = :data:`DEFAULT_DOWNLOAD_DIR`).
    download:
        Allow fetching missing files from the internet (torchvision).
    seed, synthetic_shape, synthetic_classes, synthetic_train, synthetic_test:
        Only used by ``synthetic`` (ignored, and not part of the cache key,
        for the real datasets).

    Raises
    ------
    DatasetError
        Unknown name, or files missing / download failed; the message says
        what to install or where to put which files.
    """
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    # Normalise the arguments BEFORE the cache so that equivalent calls
    # (positional vs keyword, irrelevant synthetic settings for real data,
    # relative vs absolute paths) hit the same cache entry and return the
    # same object.
    if name == "synthetic":
        key = (
            name,
            "",
            False,
            int(seed),
            tuple(int(s) for s in synthetic_shape),
            int(synthetic_classes),
            int(synthetic_train),
            int(synthetic_test),
        )
    else:
        path = os.path.abspath(os.path.expanduser(data_dir)) if data_dir else ""
        key = (name, path, bool(download), 0, (1, 28, 28), 10, 2000, 500)
    return _load_cached(*key)


@functools.lru_cache(maxsize=8)
def _load_cached(
    name: str,
    data_dir: str,
    download: bool,
    seed: int,
    synthetic_shape: tuple[int, int, int],
    synthetic_classes: int,
    synthetic_train: int,
    synthetic_test: int,
) -> TensorData:
    """Cached worker behind :func:`load_dataset` (arguments already normalised)."""
    if name == "synthetic":
        return make_synthetic(
            seed=seed,
            shape=synthetic_shape,
            num_classes=synthetic_classes,
            num_train=synthetic_train,
            num_test=synthetic_test,
        )
    if name == "fmnist":
        return _load_fmnist(data_dir, download)
    return _load_torchvision(name, data_dir, download)


# --------------------------------------------------------------------------- #
# Conversion helpers
# --------------------------------------------------------------------------- #
def _to_normalised_tensor(images: np.ndarray | torch.Tensor, name: str) -> torch.Tensor:
    """uint8 images ``[N, H, W]`` or ``[N, H, W, C]`` -> normalised float32 ``[N, C, H, W]``.

    Works in place on the single float copy so that peak memory stays at
    about one float32 copy of the dataset (FMNIST: ~190 MB).
    """
    x = torch.as_tensor(images)
    if x.dim() == 3:  # grey-scale [N, H, W] -> [N, 1, H, W]
        x = x.unsqueeze(1)
    elif x.dim() == 4:  # channels-last [N, H, W, C] (CIFAR) -> [N, C, H, W]
        x = x.permute(0, 3, 1, 2)
    else:
        raise DatasetError(f"{name}: unexpected image array shape {tuple(x.shape)}")
    x = x.to(torch.float32).contiguous()
    x.div_(255.0)
    mean, std = NORMALISATION[name]
    if len(mean) != x.shape[1]:
        raise DatasetError(f"{name}: {x.shape[1]} channels but {len(mean)} normalisation constants")
    x.sub_(torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
    x.div_(torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
    return x


def _to_label_tensor(labels: np.ndarray | torch.Tensor | list, offset: int = 0) -> torch.Tensor:
    """Labels (any int array/list) -> ``int64 [N]``, minus ``offset``."""
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64).reshape(-1)
    if offset:
        y = y - offset
    return y


def make_tensor_data(name, train_x, train_y, test_x, test_y, num_classes,
                     clients=None) -> TensorData:
    """Assemble a :class:`TensorData` and check the invariants every caller relies on."""
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise DatasetError(f"{name}: number of images and labels differ")
    for split, y in (("train", train_y), ("test", test_y)):
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise DatasetError(
                f"{name}: {split} labels span {int(y.min())}..{int(y.max())}, "
                f"expected 0..{num_classes - 1}"
            )
    return TensorData(
        name=name,
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=int(num_classes),
        input_shape=tuple(int(s) for s in train_x.shape[1:]),  # type: ignore[arg-type]
        clients=clients,
    )


# --------------------------------------------------------------------------- #
# Fashion-MNIST from IDX files
# --------------------------------------------------------------------------- #
def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (``.gz`` or uncompressed) into a numpy array.

    IDX format (LeCun's MNIST page): 2 zero bytes, 1 byte type code (0x08 =
    uint8), 1 byte number of dimensions, then one big-endian int32 per
    dimension, then the data in C order.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        # bytearray (not bytes) so the numpy view is writable and torch can
        # wrap it without a "non-writable array" warning.
        raw = bytearray(fh.read())
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path} is not an IDX file (bad magic number)")
    if raw[2] != 0x08:
        raise DatasetError(f"{path}: IDX type code {raw[2]:#x} is not uint8 (0x08)")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">i4", count=ndim, offset=4).astype(np.int64)
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise DatasetError(
            f"{path}: header says {expected} bytes of data, file has {len(raw) - offset}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(tuple(dims))


def _find_idx_files(folder: str) -> dict[tuple[str, str], str] | None:
    """Locate the four FMNIST IDX files in ``folder`` or ``folder/FashionMNIST/raw``.

    Accepts ``<name>.gz`` and plain ``<name>``.  Returns None unless all four are found.
    """
    if not folder:
        return None
    found: dict[tuple[str, str], str] = {}
    for base in (folder, os.path.join(folder, "FashionMNIST", "raw")):
        for key, stem in FMNIST_FILES.items():
            if key in found:
                continue
            for candidate in (stem + ".gz", stem):
                path = os.path.join(base, candidate)
                if os.path.isfile(path):
                    found[key] = path
                    break
    return found if len(found) == len(FMNIST_FILES) else None


def _fmnist_missing_message(folder: str) -> str:
    names = ", ".join(f"{stem}[.gz]" for stem in FMNIST_FILES.values())
    return (
        f"Fashion-MNIST not found in {folder!r} (looked there and in "
        f"{os.path.join(folder, 'FashionMNIST', 'raw')!r}). Either\n"
        f"  * install the Debian package: `sudo apt-get install dataset-fashion-mnist` "
        f"(puts the files in {FMNIST_DEBIAN_DIR}) and leave data-dir empty, or\n"
        f"  * put the four IDX files {names} into data-dir, or\n"
        f"  * set download=true (needs internet; torchvision fetches them into data-dir)."
    )


def _load_fmnist(data_dir: str, download: bool) -> TensorData:
    """Fashion-MNIST from IDX files; see the module docstring for the search order."""
    folder = data_dir or FMNIST_DEBIAN_DIR
    files = _find_idx_files(folder)
    if files is None and download:
        # Online users: torchvision downloads (and unpacks) the files into
        # <root>/FashionMNIST/raw; we then read them like any other IDX files.
        root = data_dir or DEFAULT_DOWNLOAD_DIR
        try:
            from torchvision.datasets import FashionMNIST

            for train in (True, False):
                FashionMNIST(root=root, train=train, download=True)
        except Exception as exc:  # network errors come in many types
            raise DatasetError(
                f"download of Fashion-MNIST into {root!r} failed ({type(exc).__name__}: {exc}). "
                + _fmnist_missing_message(root)
            ) from exc
        folder = root
        files = _find_idx_files(root)
    if files is None:
        raise DatasetError(_fmnist_missing_message(folder))

    arrays = {key: read_idx(path) for key, path in files.items()}
    return make_tensor_data(
        "fmnist",
        _to_normalised_tensor(arrays[("train", "images")], "fmnist"),
        _to_label_tensor(arrays[("train", "labels")]),
        _to_normalised_tensor(arrays[("test", "images")], "fmnist"),
        _to_label_tensor(arrays[("test", "labels")]),
        num_classes=10,
    )


# --------------------------------------------------------------------------- #
# torchvision datasets
# --------------------------------------------------------------------------- #
def _torchvision_split(name: str, root: str, train: bool, download: bool):
    """Instantiate the torchvision dataset object for one split (no transform)."""
    from torchvision import datasets as tvd

    if name == "mnist":
        return tvd.MNIST(root=root, train=train, download=download)
    if name == "cifar10":
        return tvd.CIFAR10(root=root, train=train, download=download)
    if name == "cifar100":
        return tvd.CIFAR100(root=root, train=train, download=download)
    if name == "emnist-letters":
        return tvd.EMNIST(root=root, split="letters", train=train, download=download)
    raise DatasetError(f"no torchvision loader for {name!r}")


def _load_torchvision(name: str, data_dir: str, download: bool) -> TensorData:
    """mnist / cifar10 / cifar100 / emnist-letters via torchvision, converted in one go."""
    root = data_dir or DEFAULT_DOWNLOAD_DIR
    splits = {}
    for split, train in (("train", True), ("test", False)):
        try:
            splits[split] = _torchvision_split(name, root, train, download)
        except Exception as exc:  # torchvision raises RuntimeError; downloads raise URLError etc.
            what = "download failed" if download else "files not found"
            raise DatasetError(
                f"{name}: {what} under {root!r} ({type(exc).__name__}: {exc}). torchvision "
                f"expects {os.path.join(root, _TORCHVISION_LAYOUT[name])}. Put the files "
                f"there (data-dir is torchvision's root), or set download=true (needs "
                f"internet) to fetch them."
            ) from exc

    tensors = {}
    for split, ds in splits.items():
        images = ds.data  # uint8: torch [N,28,28] (MNIST/EMNIST) or numpy [N,32,32,3] (CIFAR)
        labels_offset = 0
        if name == "emnist-letters":
            # The EMNIST raw files store every image transposed (column-major),
            # so letters appear mirrored and rotated; swap H and W to fix it.
            images = torch.as_tensor(images).transpose(1, 2)
            # split="letters" labels are 1..26 (0 = unused "N/A" class);
            # shift to 0..25 (FedClassAvg's official code uses 27 outputs instead;
            # Jang et al., ICPP 2022).
            labels_offset = 1
        tensors[split] = (
            _to_normalised_tensor(images, name),
            _to_label_tensor(ds.targets, offset=labels_offset),
        )
    num_classes = {"mnist": 10, "cifar10": 10, "cifar100": 100, "emnist-letters": 26}[name]
    return make_tensor_data(name, *tensors["train"], *tensors["test"], num_classes=num_classes)


# --------------------------------------------------------------------------- #
# Synthetic data
# --------------------------------------------------------------------------- #
def make_synthetic(
    *,
    seed: int = 0,
    shape: tuple[int, int, int] = (1, 28, 28),
    num_classes: int = 10,
    num_train: int = 2000,
    num_test: int = 500,
    noise: float = 2.5,
) -> TensorData:
    """Deterministic class-conditional data: smooth random prototype per class + noise.

    Each class ``c`` has a fixed prototype image: Gaussian noise at 1/4 of the
    resolution, bilinearly upsampled (so it is smooth, i.e. has the kind of
    local structure a CNN can exploit) and standardised.  A sample of class
    ``c`` is ``a * prototype[c] + noise * N(0, 1)`` with a per-sample contrast
    ``a ~ U(0.5, 1.5)``.  The default ``noise=2.5`` (pixel-wise SNR 0.4) is
    chosen so that the task is learnable but not saturated: on 28x28x1 with
    2000 samples a linear model reaches ~90-95% test accuracy within a few
    epochs (chance 10%), while a client with only a few dozen samples per class
    still benefits from collaboration.

    Classes are balanced (``n // C`` or ``n // C + 1`` samples each) and
    shuffled; everything is derived from ``seed`` only (a ``torch.Generator``),
    so the same arguments always give bit-identical tensors.
    """
    channels, height, width = (int(s) for s in shape)
    if min(channels, height, width) < 1 or num_classes < 2 or num_train < 1 or num_test < 0:
        raise DatasetError(
            f"synthetic: invalid settings shape={shape}, classes={num_classes}, "
            f"train={num_train}, test={num_test} (need positive shape, >= 2 classes)"
        )
    gen = torch.Generator().manual_seed(int(seed))
    low = (max(1, height // 4), max(1, width // 4))
    coarse = torch.randn(num_classes, channels, *low, generator=gen)
    protos = torch.nn.functional.interpolate(
        coarse, size=(height, width), mode="bilinear", align_corners=False
    )
    # Standardise each prototype so classes are equally "loud".
    flat = protos.reshape(num_classes, -1)
    flat = (flat - flat.mean(dim=1, keepdim=True)) / (flat.std(dim=1, keepdim=True) + 1e-6)
    protos = flat.reshape(num_classes, channels, height, width)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n, dtype=torch.int64) % num_classes  # balanced
        y = y[torch.randperm(n, generator=gen)]
        contrast = torch.empty(n, 1, 1, 1).uniform_(0.5, 1.5, generator=gen)
        x = contrast * protos[y] + noise * torch.randn(n, channels, height, width, generator=gen)
        return x.to(torch.float32).contiguous(), y

    train_x, train_y = sample(int(num_train))
    test_x, test_y = sample(int(num_test))
    return make_tensor_data("synthetic", train_x, train_y, test_x, test_y, num_classes)
