"""A SuperNode's own data folder: good data loads as the partition would, bad data is refused
with a message naming the file and the fault."""

import numpy as np
import pytest
import torch

from fedapp.config import ConfigError
from fedapp.data import datasets, setup
from fedapp.data.datasets import NORMALISATION
from fedapp.data.local_data import (DATASET_INPUTS, LocalDataError, export_shard, expected_input,
                                    load_local_data)
from fedapp.data.partitions import load_client_data
from fedapp.runtime.training import pick_device
from strategies import load_config

SHAPE, CLASSES = (1, 8, 8), 4


def write(folder, name, x, y):
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / name, x=x, y=y)


def good(folder, n=12, dtype=np.float32):
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 256, (n, *SHAPE)) if dtype == np.uint8
         else rng.normal(size=(n, *SHAPE))).astype(dtype)
    y = np.arange(n, dtype=np.int64) % CLASSES
    write(folder, "train.npz", x, y)
    write(folder, "test.npz", x[:5], y[:5])
    return x, y


def test_good_float_data_loads_unchanged_with_an_empty_val_split(tmp_path):
    x, y = good(tmp_path)
    data = load_local_data(tmp_path, SHAPE, CLASSES)
    assert torch.equal(data.train_x, torch.from_numpy(x))
    assert data.train_y.dtype == torch.int64 and data.train_y.tolist() == y.tolist()
    assert data.test_x.shape == (5, *SHAPE) and len(data.val_y) == 0


def test_uint8_pixels_are_normalised_like_the_dataset(tmp_path):
    x, _ = good(tmp_path, dtype=np.uint8)
    data = load_local_data(tmp_path, SHAPE, CLASSES, "fmnist")
    (mean,), (std,) = NORMALISATION["fmnist"]
    expected = (torch.from_numpy(x).float() / 255 - mean) / std
    assert torch.allclose(data.train_x, expected, atol=1e-6)


@pytest.mark.parametrize("fault, message", [
    ("missing-dir", "no such folder"),
    ("missing-test", "test.npz is missing"),
    ("wrong-shape", "x has shape (12, 1, 9, 9), but the run's dataset needs (N, 1, 8, 8)"),
    ("labels-out-of-range", "labels span 1..4, but the run's dataset has classes 0..3"),
    ("no-y", "needs x and y"),
    ("not-npz", "not a readable .npz file"),
    ("nan", "NaN"),
    ("length-mismatch", "12 samples in x but 11 labels"),
    ("float-labels", "integer labels"),
])
def test_bad_data_is_refused_naming_the_path(tmp_path, fault, message):
    folder = tmp_path / "site"
    if fault != "missing-dir":
        x, y = good(folder)
    if fault == "missing-test":
        (folder / "test.npz").unlink()
    elif fault == "wrong-shape":
        write(folder, "train.npz", np.zeros((12, 1, 9, 9), np.float32), y)
    elif fault == "labels-out-of-range":
        write(folder, "train.npz", x, y + 1)
    elif fault == "no-y":
        np.savez(folder / "train.npz", x=x, labels=y)
    elif fault == "not-npz":
        (folder / "train.npz").write_text("not numpy")
    elif fault == "nan":
        x[3, 0, 0, 0] = np.nan
        write(folder, "train.npz", x, y)
    elif fault == "length-mismatch":
        write(folder, "train.npz", x, y[:-1])
    elif fault == "float-labels":
        write(folder, "train.npz", x, y.astype(np.float32))
    with pytest.raises(LocalDataError) as info:
        load_local_data(folder, SHAPE, CLASSES)
    assert message in str(info.value) and str(folder) in str(info.value)
    assert isinstance(info.value, ConfigError)  # so the node fails like a bad setting does


def test_an_exported_shard_is_exactly_that_partition(tmp_path):
    cfg = load_config({"dataset": "synthetic", "synthetic-train": 200, "synthetic-test": 100,
                       "num-clients": 2, "partition": "iid", "arch-mix": "cnn5,cnn4"})
    export_shard(cfg, 1, tmp_path)
    loaded = load_local_data(tmp_path, *expected_input(cfg), cfg.dataset)
    direct = load_client_data(setup.dataset(cfg), setup.partition_spec(cfg), 1)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(loaded, name), getattr(direct, name)), name
    with pytest.raises(ConfigError, match="partition-id 2 is not in 0..1"):
        export_shard(cfg, 2, tmp_path / "nope")


def test_expected_input_matches_the_loaded_datasets():
    cfg = load_config({"dataset": "synthetic", "synthetic-shape": "3,16,16",
                       "synthetic-classes": 5})
    data = setup.dataset(cfg)
    assert expected_input(cfg) == (data.input_shape, data.num_classes) == ((3, 16, 16), 5)
    # Debian's dataset-fashion-mnist, where installed: skipped only where its files are absent;
    # files that are there but do not load fail the test.
    fmnist_cfg = load_config({"dataset": "fmnist"})
    if datasets._find_idx_files(fmnist_cfg.data_dir or datasets.FMNIST_DEBIAN_DIR) is None:
        pytest.skip("Fashion-MNIST not installed")
    fmnist = setup.dataset(fmnist_cfg)
    assert DATASET_INPUTS["fmnist"] == (fmnist.input_shape, fmnist.num_classes)


def test_device_requests():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda"):
        pick_device("mps")
    with pytest.raises(ValueError, match="CUDA device"):
        pick_device(f"cuda:{torch.cuda.device_count()}")  # one past the last GPU
