"""A user's own data and models without editing the package: data sets from files (``npz``,
``imagefolder``, a PFLlib/HtFLlib-style ``federation``) and architectures by import path."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from fedapp.data import setup
from fedapp.config import ConfigError
from fedapp.data.datasets import DatasetError
from fedapp.data.files import load_file_dataset
from tests.conftest import InProcessFederation, cfg_of

TINY = "tests.user_model:TinyNet"


# -- models by import path ------------------------------------------------------------------------

def test_fedgh_runs_a_user_model_given_by_import_path():
    fed = InProcessFederation("fedgh", dataset="synthetic", synthetic_train=120,
                              synthetic_test=60, num_clients=3, partition="iid",
                              max_samples_per_client=0, arch_mix=f"{TINY},cnn5")
    assert fed.strategy.architectures == [TINY, "cnn5", TINY]
    model = fed.client(0).model
    # FedGH's common d = 500: the user's 24 features are projected, as for every family.
    assert model.family == "custom" and model.feature_dim == fed.cfg.feature_dim
    zeros = torch.zeros(2, 1, 28, 28, device=fed.client(0).device)
    assert model.features(zeros).shape == (2, fed.cfg.feature_dim)
    fed.fit_round(1)
    assert fed.strategy._counts == {"clients_fit": 3, "failures": 0, "rejected": 0}
    metrics = fed.evaluate_round(1)
    assert len(metrics) == 3 and all(0 <= m["accuracy"] <= 1 for m in metrics.values())


def test_a_user_model_keeps_its_own_head_when_d_matches():
    cfg = cfg_of(method="standalone", dataset="synthetic", arch_mix=TINY, feature_dim=0)
    model = setup.new_model(cfg, TINY, (1, 28, 28), 10)
    assert model.feature_dim == 24 and model.head.in_features == 24
    assert model.arch == TINY  # the import path keeps its case


@pytest.mark.parametrize("arch,message", [
    ("tests.user_model:NoHead", "must have an 'extractor'"),
    ("tests.user_model:WrongWidth", "head.in_features = 30"),
    ("tests.no_such_module:Net", "cannot import 'tests.no_such_module'"),
    ("tests.user_model:Missing", "has no 'Missing'"),
    ("not a path", "unknown architecture"),
])
def test_a_model_that_breaks_the_contract_is_refused_at_configuration(arch, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        setup.prepare(cfg_of(method="fedgh", dataset="synthetic", arch_mix=f"cnn5,{arch}"))


# -- data sets from files -------------------------------------------------------------------------

def _arrays(rng, n, classes=4, shape=(1, 8, 8), dtype=np.uint8):
    x = rng.integers(0, 256, size=(n, *shape)).astype(dtype)
    return x, (np.arange(n) % classes).astype(np.int64)


def test_npz_dataset_is_partitioned_like_any_other(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 200), ("test", 80)):
        np.savez(tmp_path / f"{split}.npz", *(), **dict(zip("xy", _arrays(rng, n))))
    cfg = cfg_of(dataset="npz", data_dir=str(tmp_path), num_clients=4, partition="iid",
                 arch_mix=TINY, max_samples_per_client=0)
    data, split = setup.prepare(cfg)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 4
    # uint8 pixels normalised by the training split's own statistics
    assert abs(float(data.train_x.mean())) < 1e-4 and abs(float(data.train_x.std()) - 1) < 1e-2
    assert sorted(np.concatenate([c.train for c in split.clients])) == list(range(200))


def test_npz_dataset_refuses_malformed_files_with_the_path(tmp_path):
    np.savez(tmp_path / "train.npz", x=np.zeros((3, 1, 4, 4), np.float32), y=np.zeros(2, int))
    np.savez(tmp_path / "test.npz", x=np.zeros((3, 1, 4, 4), np.float32), y=np.zeros(3, int))
    with pytest.raises(DatasetError, match="train.npz: y has shape"):
        load_file_dataset("npz", str(tmp_path))
    with pytest.raises(ConfigError, match="data-dir is empty"):
        cfg_of(dataset="npz")


def _federation(root, rng, sizes=((30, 10), (50, 20), (20, 8)), pickled=True):
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    for k, (n_train, n_test) in enumerate(sizes):
        for split, n in (("train", n_train), ("test", n_test)):
            x, y = _arrays(rng, n, classes=10, shape=(1, 28, 28))
            x = (x / 255.0 - 0.5) / 0.5  # PFLlib stores normalised floats
            with open(root / split / f"{k}.npz", "wb") as fh:
                if pickled:  # what PFLlib's generators write
                    np.savez_compressed(fh, data={"x": x.astype(np.float32), "y": y})
                else:
                    np.savez_compressed(fh, x=x.astype(np.float32), y=y)
    (root / "config.json").write_text(json.dumps({"num_clients": len(sizes), "num_classes": 10,
                                                  "partition": "dir", "alpha": 0.1}))


@pytest.mark.parametrize("pickled", [True, False])
def test_a_federation_of_per_client_files_is_its_own_partition(tmp_path, pickled):
    _federation(tmp_path, np.random.default_rng(1), pickled=pickled)
    cfg = cfg_of(method="fedgh", dataset="federation", partition="files",
                 data_dir=str(tmp_path), num_clients=3, arch_mix="cnn5")
    data, split = setup.prepare(cfg)
    assert [len(c.train) for c in split.clients] == [30, 50, 20]
    assert [len(c.test) for c in split.clients] == [10, 20, 8]
    with np.load(tmp_path / "train" / "1.npz", allow_pickle=True) as f:
        x1 = f["data"].item()["x"] if pickled else f["x"]
    shard = setup.partition(cfg)
    from fedapp.data.partitions import client_data
    np.testing.assert_array_equal(client_data(data, shard, 1).train_x.numpy(), x1)
    with pytest.raises(ConfigError, match="do not fit"):
        cfg_of(dataset="federation", data_dir=str(tmp_path), partition="dirichlet")


class _Hostile:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    _federation(tmp_path, np.random.default_rng(2))
    bad = np.empty((), dtype=object)
    bad[()] = {"x": _Hostile(), "y": np.zeros(3)}
    with open(tmp_path / "train" / "0.npz", "wb") as fh:
        np.savez_compressed(fh, data=bad)
    assert b"system" in pickle.dumps(bad)
    with pytest.raises(DatasetError, match="refused to load"):
        load_file_dataset("federation", str(tmp_path))


def test_image_folder_dataset(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(3)
    for split, n in (("train", 6), ("test", 2)):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(12, 10)).astype(np.uint8)
                Image.fromarray(pixels, mode="L").save(tmp_path / split / label / f"{i}.png")
    data = load_file_dataset("imagefolder", str(tmp_path), image_size=8)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 2
    assert data.train_y.tolist() == [0] * 6 + [1] * 6 and len(data.test_y) == 4
    with pytest.raises(DatasetError, match="several sizes|image-size"):
        Image.fromarray(np.zeros((5, 5), np.uint8), mode="L").save(tmp_path / "test/cat/x.png")
        load_file_dataset("imagefolder", str(tmp_path))
