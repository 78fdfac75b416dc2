"""Tests for fedapp.data.datasets (fast: synthetic data, tiny fake IDX files, optional Debian
FMNIST)."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from fedapp.data import datasets as data_mod
from fedapp.data.datasets import (
    DATASETS,
    FMNIST_DEBIAN_DIR,
    FMNIST_FILES,
    DatasetError,
    TensorData,
    load_dataset,
    make_synthetic,
    read_idx,
)


# --------------------------------------------------------------------------- #
# Synthetic data
# --------------------------------------------------------------------------- #
def test_synthetic_is_deterministic_per_seed():
    a = make_synthetic(seed=7, num_train=300, num_test=100)
    b = make_synthetic(seed=7, num_train=300, num_test=100)
    c = make_synthetic(seed=8, num_train=300, num_test=100)
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.train_x, c.train_x)


def test_synthetic_shape_dtype_balance():
    d = load_dataset("synthetic", synthetic_shape=(3, 16, 12), synthetic_classes=5,
                     synthetic_train=1000, synthetic_test=250)
    assert isinstance(d, TensorData)
    assert d.train_x.shape == (1000, 3, 16, 12) and d.test_x.shape == (250, 3, 16, 12)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.input_shape == (3, 16, 12) and d.num_classes == 5
    assert d.train_y.bincount(minlength=5).tolist() == [200] * 5
    assert d.test_y.bincount(minlength=5).tolist() == [50] * 5


def test_synthetic_is_learnable_by_a_linear_model():
    """Softmax regression, 3 epochs of SGD: well above chance (10%) on held-out data."""
    d = load_dataset("synthetic", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(784, d.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = d.train_x.flatten(1), d.train_y
    for _ in range(3):
        for idx in torch.randperm(len(x)).split(64):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (model(d.test_x.flatten(1)).argmax(1) == d.test_y).float().mean().item()
    assert acc > 0.6, acc


# --------------------------------------------------------------------------- #
# Caching
# --------------------------------------------------------------------------- #
def test_load_dataset_is_cached_per_process():
    a = load_dataset("synthetic", seed=1)
    assert load_dataset("synthetic", seed=1) is a
    assert load_dataset(name="synthetic", data_dir="", download=False, seed=1) is a
    assert load_dataset("synthetic", seed=2) is not a


# --------------------------------------------------------------------------- #
# Fashion-MNIST
# --------------------------------------------------------------------------- #
@pytest.mark.skipif(
    not os.path.isdir(FMNIST_DEBIAN_DIR),
    reason=f"{FMNIST_DEBIAN_DIR} absent (install with `apt-get install dataset-fashion-mnist`)",
)
def test_fmnist_from_debian_dir():
    d = load_dataset("fmnist")
    assert load_dataset("fmnist", "") is d  # cached
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert d.train_y.shape == (60000,) and d.test_y.shape == (10000,)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.num_classes == 10 and d.input_shape == (1, 28, 28)
    assert d.train_y.bincount().tolist() == [6000] * 10
    # normalised with the FMNIST constants 0.2860 / 0.3530
    assert abs(d.train_x.mean().item()) < 0.01 and abs(d.train_x.std().item() - 1) < 0.01


def test_fmnist_missing_files_error_names_the_fix(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_dataset("fmnist", str(tmp_path))
    msg = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "train-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg
    assert "download=true" in msg and str(tmp_path) in msg


def _write_idx(path: str, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "i" * array.ndim, *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("layout,suffix", [("flat", ".gz"), ("torchvision", "")])
def test_fmnist_from_data_dir_idx_files(tmp_path, layout, suffix):
    """Tiny fake IDX files, gzipped in data_dir or plain in torchvision's FashionMNIST/raw."""
    folder = tmp_path if layout == "flat" else tmp_path / "FashionMNIST" / "raw"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        ("train", "images"): rng.integers(0, 256, (20, 28, 28)),
        ("train", "labels"): np.arange(20) % 10,
        ("test", "images"): rng.integers(0, 256, (10, 28, 28)),
        ("test", "labels"): np.arange(10) % 10,
    }
    for key, stem in FMNIST_FILES.items():
        _write_idx(str(folder / (stem + suffix)), arrays[key])
    assert np.array_equal(read_idx(str(folder / (FMNIST_FILES["train", "labels"] + suffix))),
                          arrays["train", "labels"])
    d = load_dataset("fmnist", str(tmp_path))
    assert d.train_x.shape == (20, 1, 28, 28) and d.test_x.shape == (10, 1, 28, 28)
    expected = (arrays["train", "images"][3] / 255.0 - 0.2860) / 0.3530
    np.testing.assert_allclose(d.train_x[3, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert d.train_y.tolist() == arrays["train", "labels"].tolist()


# --------------------------------------------------------------------------- #
# torchvision datasets (no files here: errors, and conversion via fakes)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name,layout", [
    ("mnist", "MNIST/raw"),
    ("cifar10", "cifar-10-batches-py"),
    ("cifar100", "cifar-100-python"),
    ("emnist-letters", "EMNIST/raw"),
])
def test_torchvision_missing_files_error_names_layout(tmp_path, name, layout):
    with pytest.raises(DatasetError) as info:
        load_dataset(name, str(tmp_path))
    msg = str(info.value)
    assert os.path.join(str(tmp_path), layout) in msg and "download=true" in msg


def test_unknown_dataset_lists_allowed_names():
    with pytest.raises(DatasetError) as info:
        load_dataset("imagenet")
    assert all(name in str(info.value) for name in DATASETS)


class _FakeSplit:
    """Mimics a torchvision dataset object: only ``.data`` and ``.targets`` are used."""

    def __init__(self, data, targets):
        self.data, self.targets = data, targets


def test_emnist_letters_orientation_and_label_shift(monkeypatch, tmp_path):
    raw = torch.zeros(4, 28, 28, dtype=torch.uint8)
    raw[:, 0, 5] = 255  # stored transposed: pixel (row 0, col 5) is really (row 5, col 0)
    labels = torch.tensor([1, 2, 26, 13])
    monkeypatch.setattr(data_mod, "_torchvision_split",
                        lambda name, root, train, download: _FakeSplit(raw, labels))
    d = load_dataset("emnist-letters", str(tmp_path))
    assert d.num_classes == 26 and d.train_y.tolist() == [0, 1, 25, 12]
    bright = d.train_x[0, 0] > 0
    assert bright[5, 0] and not bright[0, 5]


def test_cifar_channels_last_conversion(monkeypatch, tmp_path):
    images = np.zeros((3, 32, 32, 3), dtype=np.uint8)
    images[..., 2] = 255  # blue channel only
    monkeypatch.setattr(data_mod, "_torchvision_split",
                        lambda name, root, train, download: _FakeSplit(images, [0, 5, 9]))
    d = load_dataset("cifar10", str(tmp_path))
    assert d.train_x.shape == (3, 3, 32, 32) and d.input_shape == (3, 32, 32)
    mean, std = data_mod.NORMALISATION["cifar10"]
    assert torch.allclose(d.train_x[0, 2], torch.full((32, 32), (1 - mean[2]) / std[2]))
    assert torch.allclose(d.train_x[0, 0], torch.full((32, 32), -mean[0] / std[0]))
    assert d.train_y.dtype == torch.int64 and d.train_y.tolist() == [0, 5, 9]
