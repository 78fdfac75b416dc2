"""A user's own data set, read from files: no code change, a ``dataset`` name and a folder.

``dataset = "npz"``, ``data-dir = DIR``: the whole federation's data in two files, partitioned
by the run's ``partition`` setting like any built-in data set::

    DIR/train.npz, DIR/test.npz   x: (N, C, H, W) or (N, H, W); float (used as it is) or uint8
                                  (scaled to [0, 1] and normalised by the training split's
                                  channel mean and std); y: (N,) integer labels 0..C-1

``dataset = "imagefolder"``, ``data-dir = DIR``: ``DIR/train/<class>/<image>`` and
``DIR/test/<class>/<image>`` as torchvision's ``ImageFolder`` reads them (the class names of
``train/`` give the labels; ``test/`` must use the same ones). Every image is decoded once,
resized to ``image-size`` (0 = keep: then all images must have one size), grey-scale when all
are, RGB otherwise, and normalised by the training split's statistics.

``dataset = "federation"``, ``data-dir = DIR`` with ``partition = "files"``: a federation given
as ready-made per-client files, in the layout the PFLlib / HtFLlib generators write, so a run
uses exactly the partitions that library's published numbers use::

    DIR/config.json     {"num_clients": K, "num_classes": C, ...}
    DIR/train/<k>.npz   client k's training data, k = 0..K-1
    DIR/test/<k>.npz    client k's test data (its local test set)

Each ``.npz`` holds arrays ``x`` and ``y``, or (as those generators write it) one pickled dict
``data = {"x": ..., "y": ...}``. A pickle can run code, so it is read with an unpickler that
accepts nothing but numpy arrays and plain containers: anything else is refused.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedapp.data.datasets import DatasetError, TensorData, make_tensor_data

FILE_DATASETS = ("npz", "imagefolder", "federation")
NPZ_LAYOUT = ("arrays x (N, C, H, W) or (N, H, W), float or uint8, and y (N,) integer labels")


def load_file_dataset(name: str, data_dir: str, image_size: int = 0) -> TensorData:
    """The data set ``name`` (one of :data:`FILE_DATASETS`) from ``data_dir``, once per
    process."""
    if name not in FILE_DATASETS:
        raise DatasetError(f"unknown file data set {name!r}; allowed: {', '.join(FILE_DATASETS)}")
    if not data_dir:
        raise DatasetError(f"dataset = {name!r} reads a folder: set data-dir (see the layout in "
                           "docs/data.md)")
    root = Path(data_dir).expanduser().resolve()
    if not root.is_dir():
        raise DatasetError(f"data-dir {root}: no such folder")
    return _load(name, str(root), int(image_size))


@functools.lru_cache(maxsize=4)
def _load(name: str, root: str, image_size: int) -> TensorData:
    if name == "npz":
        return _from_npz(Path(root))
    if name == "imagefolder":
        return _from_image_folder(Path(root), image_size)
    return _from_federation(Path(root))


# -- arrays ---------------------------------------------------------------------------------------

def _images(x: np.ndarray, where: str) -> torch.Tensor:
    """``x`` as float32 [N, C, H, W]: uint8 scaled to [0, 1] (normalised later), float as is."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or min(x.shape[1:], default=0) < 1:
        raise DatasetError(f"{where}: x has shape {x.shape}; expected {NPZ_LAYOUT}")
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise DatasetError(f"{where}: x has dtype {x.dtype}; expected float or uint8")
    images = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
    if x.dtype.kind == "f" and not torch.isfinite(images).all():
        raise DatasetError(f"{where}: x contains NaN or infinite values")
    return images.div_(255.0) if x.dtype == np.uint8 else images


def _labels(y: np.ndarray, n: int, where: str) -> torch.Tensor:
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != n:
        raise DatasetError(f"{where}: y has shape {y.shape} and dtype {y.dtype}; expected {n} "
                           "integer labels")
    if len(y) and int(y.min()) < 0:
        raise DatasetError(f"{where}: negative label {int(y.min())}")
    return torch.from_numpy(y.astype(np.int64))


def _normalise(train_x: torch.Tensor, *others: torch.Tensor, raw: bool) -> None:
    """Raw pixels (uint8 in the files) are normalised in place by the training split's channel
    mean and std, as the built-in data sets are by theirs."""
    if not raw:
        return
    mean = train_x.mean(dim=(0, 2, 3), keepdim=True)
    std = train_x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    for x in (train_x, *others):
        x.sub_(mean).div_(std)


def _dataset(name: str, splits: list[tuple[np.ndarray, np.ndarray, str]],
             num_classes: int = 0) -> tuple[TensorData, list[int]]:
    """One :class:`TensorData` from the (x, y, where) of its training and test files (several
    of each for a federation); also the sizes of the pieces, in order."""
    xs, ys, raw = [], [], set()
    for x, y, where in splits:
        raw.add(x.dtype == np.uint8)
        xs.append(_images(x, where))
        ys.append(_labels(y, len(xs[-1]), where))
        if xs[-1].shape[1:] != xs[0].shape[1:]:
            raise DatasetError(f"{where}: images of shape {tuple(xs[-1].shape[1:])}, but "
                               f"{splits[0][2]} has {tuple(xs[0].shape[1:])}")
    if len(raw) > 1:
        raise DatasetError(f"{name}: some files hold uint8 pixels and others floats; use one")
    classes = num_classes or 1 + max(int(y.max()) for y in ys if len(y))
    half = len(splits) // 2
    train_x, test_x = torch.cat(xs[:half]), torch.cat(xs[half:])
    _normalise(train_x, test_x, raw=raw == {True})
    return (make_tensor_data(name, train_x, torch.cat(ys[:half]), test_x, torch.cat(ys[half:]),
                             classes), [len(y) for y in ys])


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``x`` and ``y`` of one ``.npz``: stored as two arrays, or as one pickled dict
    ``data`` (PFLlib's layout), read without running anything but numpy's own loaders."""
    if not path.is_file():
        raise DatasetError(f"{path}: missing; expected a .npz with {NPZ_LAYOUT}")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            if {"x", "y"} <= set(arrays.files):
                return arrays["x"], arrays["y"]
            names = arrays.files
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: not a readable .npz file ({exc})") from None
    if names != ["data"]:
        raise DatasetError(f"{path}: has arrays {names}; expected x and y, or one dict 'data' "
                           "with them")
    found = _safe_unpickle_npy(path, "data.npy")
    if not isinstance(found, np.ndarray) or found.dtype != object or found.shape != ():
        raise DatasetError(f"{path}: 'data' is not a dict of arrays")
    data = found.item()
    if not (isinstance(data, dict) and {"x", "y"} <= set(data)
            and all(isinstance(data[k], np.ndarray) for k in ("x", "y"))):
        raise DatasetError(f"{path}: 'data' must be a dict with arrays x and y")
    return data["x"], data["y"]


# What a pickled numpy array needs; nothing that could run other code.
_NUMPY_GLOBALS = {("numpy", "ndarray"), ("numpy", "dtype"),
                  ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only numpy arrays and "
                                     "plain containers may be in a data file")


def _safe_unpickle_npy(path: Path, member: str) -> object:
    try:
        with zipfile.ZipFile(path) as archive, archive.open(member) as fh:
            stream = io.BytesIO(fh.read())
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"npy format version {version} is not supported")
        _, _, dtype = read_header(stream)
        if dtype != object:
            return np.lib.format.read_array(io.BytesIO(stream.getvalue()), allow_pickle=False)
        return _ArraysOnly(stream).load()
    except (pickle.UnpicklingError, EOFError, ValueError, OSError, zipfile.BadZipFile,
            AttributeError, TypeError) as exc:
        raise DatasetError(f"{path}: cannot read {member} ({exc})") from None


# -- the three layouts ----------------------------------------------------------------------------

def _from_npz(root: Path) -> TensorData:
    splits = [(*_read_npz(root / f"{split}.npz"), str(root / f"{split}.npz"))
              for split in ("train", "test")]
    return _dataset("npz", splits)[0]


def _from_image_folder(root: Path, image_size: int) -> TensorData:
    from PIL import Image
    from torchvision.datasets import ImageFolder

    folders = {split: root / split for split in ("train", "test")}
    for split, folder in folders.items():
        if not folder.is_dir():
            raise DatasetError(f"{folder}: missing; an image folder data set needs "
                               f"{root}/train/<class>/<image> and {root}/test/<class>/<image>")
    try:
        train, test = (ImageFolder(str(f), loader=Image.open) for f in folders.values())
    except (FileNotFoundError, OSError) as exc:
        raise DatasetError(f"{root}: {exc}") from None
    if test.classes != train.classes:
        raise DatasetError(f"{root}: test/ has classes {test.classes}, train/ has "
                           f"{train.classes}; they must be the same")
    modes = {Image.open(path).mode for path, _ in train.samples + test.samples}
    mode = "L" if modes <= {"L", "1"} else "RGB"

    def arrays(folder: ImageFolder) -> tuple[np.ndarray, np.ndarray]:
        images = []
        for path, _ in folder.samples:
            with Image.open(path) as image:
                image = image.convert(mode)
                if image_size:
                    image = image.resize((image_size, image_size))
                images.append(np.asarray(image, dtype=np.uint8))
        if len({a.shape for a in images}) > 1:
            raise DatasetError(f"{folder.root}: images of several sizes; set image-size to "
                               "resize them all to one square size")
        x = np.stack(images)
        x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
        return x, np.asarray(folder.targets, dtype=np.int64)

    splits = [(*arrays(f), str(f.root)) for f in (train, test)]
    return _dataset("imagefolder", splits, num_classes=len(train.classes))[0]


def _from_federation(root: Path) -> TensorData:
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text())
        num_clients, num_classes = int(config["num_clients"]), int(config["num_classes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{config_path}: needs a JSON object with num_clients and "
                           f"num_classes ({exc!r})") from None
    if num_clients < 1 or num_classes < 2:
        raise DatasetError(f"{config_path}: num_clients = {num_clients}, num_classes = "
                           f"{num_classes}; expected >= 1 and >= 2")
    splits = [(*_read_npz(root / split / f"{k}.npz"), str(root / split / f"{k}.npz"))
              for split in ("train", "test") for k in range(num_clients)]
    data, sizes = _dataset("federation", splits, num_classes)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    clients = tuple((np.arange(starts[k], ends[k]), np.arange(starts[num_clients + k] -
                                                              ends[num_clients - 1],
                                                              ends[num_clients + k] -
                                                              ends[num_clients - 1]))
                    for k in range(num_clients))
    return make_tensor_data("federation", data.train_x, data.train_y, data.test_x, data.test_y,
                            num_classes, clients=clients)
