"""A SuperNode's own data: a folder of ``.npz`` arrays named by its ``data-dir`` node config.

In deployment a node either takes its share of the run's dataset by ``partition-id`` (as in
simulation) or brings its own samples in this layout::

    DATA_DIR/
      train.npz   x: (N, C, H, W) float32 (already normalised) or uint8 (raw pixels 0..255)
                  y: (N,) integers in 0 .. num_classes-1
      test.npz    the node's local test set, same arrays (accuracy is measured on it)
      val.npz     optional, same arrays (only used by methods that read a validation split)

``C, H, W`` and ``num_classes`` must be those of the run config's ``dataset`` (e.g. 1x28x28
and 10 for ``fmnist``; ``synthetic-shape`` and ``synthetic-classes`` for ``synthetic``),
because the node's architecture is built for that input. uint8 pixels are scaled to [0, 1]
and normalised with the dataset's channel mean/std, exactly as the shared loaders do, so a
node's own photos and the shared dataset look alike to the models.

``export_shard`` writes one partition of the run's dataset in this layout (float32, already
normalised and label-permuted), so a node reading it trains on exactly the tensors that the
same ``partition-id`` would give it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from fedapp.config import ConfigError, RunConfig
from fedapp.data import setup
from fedapp.data.datasets import NORMALISATION
from fedapp.data.partitions import ClientData, load_client_data

LAYOUT = ("train.npz and test.npz (val.npz optional), each with arrays x (N, C, H, W; float32 "
          "or uint8) and y (N,; integer labels)")

# (C, H, W) and number of classes of each dataset, so that a node with its own data can check
# it and build its model without loading (or even having) the shared dataset.
DATASET_INPUTS: dict[str, tuple[tuple[int, int, int], int]] = {
    "fmnist": ((1, 28, 28), 10),
    "mnist": ((1, 28, 28), 10),
    "emnist-letters": ((1, 28, 28), 26),
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
}


class LocalDataError(ConfigError):
    """A node's data-dir is missing or malformed; the message names the path and the fault."""


def expected_input(cfg: RunConfig) -> tuple[tuple[int, int, int], int]:
    """``((C, H, W), num_classes)`` that the run config's dataset has."""
    if cfg.dataset == "synthetic":
        return cfg.shape, cfg.synthetic_classes
    if cfg.dataset not in DATASET_INPUTS:  # a user's own files: known once they are read
        data = setup.dataset(cfg)
        return data.input_shape, data.num_classes
    return DATASET_INPUTS[cfg.dataset]


def _read_split(path: Path, input_shape: tuple[int, int, int], num_classes: int,
                dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``.npz`` file as checked, normalised ``(x float32 [N,C,H,W], y int64 [N])``."""
    try:
        # allow_pickle=False: a data folder must never be able to run code on the node.
        with np.load(path, allow_pickle=False) as arrays:
            names = sorted(arrays.files)
            found = {name: arrays[name] for name in ("x", "y") if name in names}
    except (OSError, ValueError, TypeError, zipfile.BadZipFile) as exc:  # TypeError: a bare .npy
        raise LocalDataError(f"{path}: not a readable .npz file ({exc}); expected {LAYOUT}"
                             ) from None
    if len(found) < 2:
        raise LocalDataError(f"{path}: has arrays {names}, needs x and y; expected {LAYOUT}")
    x, y = found["x"], found["y"]
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(input_shape):
        raise LocalDataError(f"{path}: x has shape {x.shape}, but the run's dataset needs "
                             f"(N, {', '.join(map(str, input_shape))})")
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise LocalDataError(f"{path}: x has dtype {x.dtype}; expected float32 or uint8")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise LocalDataError(f"{path}: y has shape {y.shape} and dtype {y.dtype}; expected "
                             "(N,) integer labels")
    if len(y) != len(x):
        raise LocalDataError(f"{path}: {len(x)} samples in x but {len(y)} labels in y")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise LocalDataError(f"{path}: labels span {int(y.min())}..{int(y.max())}, but the "
                             f"run's dataset has classes 0..{num_classes - 1}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise LocalDataError(f"{path}: x contains NaN or infinite values")
    images = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
    if x.dtype == np.uint8:
        images = images.div_(255.0)
        if dataset in NORMALISATION:
            mean, std = NORMALISATION[dataset]
            images.sub_(torch.tensor(mean).view(1, -1, 1, 1)).div_(
                torch.tensor(std).view(1, -1, 1, 1))
    return images, torch.from_numpy(y.astype(np.int64))


def load_local_data(data_dir: str | Path, input_shape: tuple[int, int, int], num_classes: int,
                    dataset: str = "") -> ClientData:
    """The node's train / val / test tensors from ``data_dir`` (see the module doc)."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise LocalDataError(f"node data-dir {root}: no such folder; expected a folder with "
                             f"{LAYOUT}")
    for required in ("train.npz", "test.npz"):
        if not (root / required).is_file():
            raise LocalDataError(f"node data-dir {root}: {required} is missing; expected "
                                 f"{LAYOUT}")
    train = _read_split(root / "train.npz", input_shape, num_classes, dataset)
    if len(train[1]) == 0:
        raise LocalDataError(f"{root / 'train.npz'}: holds no samples")
    test = _read_split(root / "test.npz", input_shape, num_classes, dataset)
    if (root / "val.npz").is_file():
        val = _read_split(root / "val.npz", input_shape, num_classes, dataset)
    else:
        val = (train[0][:0], train[1][:0])
    return ClientData(*train, *val, *test)


def export_shard(cfg: RunConfig, partition_id: int, out_dir: str | Path) -> Path:
    """Write partition ``partition_id`` of the run's dataset into ``out_dir`` in the layout."""
    if not 0 <= partition_id < cfg.num_clients:
        raise ConfigError(f"partition-id {partition_id} is not in 0..{cfg.num_clients - 1} "
                          f"(num-clients={cfg.num_clients})")
    shard = load_client_data(setup.dataset(cfg), setup.partition_spec(cfg),
                             partition_id)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": (shard.train_x, shard.train_y), "test": (shard.test_x, shard.test_y)}
    if len(shard.val_y):
        splits["val"] = (shard.val_x, shard.val_y)
    for name, (x, y) in splits.items():
        np.savez(out / f"{name}.npz", x=x.numpy().astype(np.float32), y=y.numpy())
    return out
