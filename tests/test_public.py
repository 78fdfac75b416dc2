"""The public set (public-source): cut before partitioning, never in a client's shard or local
test set, the same in every process, and refused clearly when it cannot serve the run."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.data import setup
from fedapp.data.partitions import load_client_data
from fedapp.data.public import holdout_private_rows, holdout_rows
from tests.conftest import cfg_of

BASE = dict(method="standalone", dataset="synthetic", synthetic_train=600, synthetic_test=200,
            num_clients=4, arch_mix="cnn5", max_samples_per_client=0,
            public_source="train-holdout", public_fraction=0.1)
SCHEMES = {
    "iid": {},
    "dirichlet": {"dirichlet_alpha": 0.5, "min_partition_size": 5},
    "pathological": {"classes_per_client": 3},
    "two-class": {"classes_per_client": 2},
    "fixed-size": {"classes_per_client": 3, "samples_per_client": 60},
}


def _image_keys(x) -> set[bytes]:
    return {row.tobytes() for row in x.numpy()}


@pytest.mark.parametrize("local_test", ["global", "split"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_no_public_sample_is_in_any_shard_or_local_test_set(scheme, local_test):
    cfg = cfg_of(**BASE, partition=scheme, local_test=local_test, val_fraction=0.1,
                 **SCHEMES[scheme])
    data, split = setup.prepare(cfg)
    loaded = setup.loaded_dataset(cfg)
    public = setup.public_set(cfg)
    assert len(public) == 60 and len(data.train_y) == 540  # cut before partitioning
    private_rows = holdout_private_rows(loaded, cfg.public_fraction, cfg.seed)
    public_rows = set(public.rows.tolist())
    public_images = _image_keys(public.x)
    assert len(public_images) == len(public)  # synthetic images are distinct: content checks
    for pid, client in enumerate(split.clients):
        own = [client.train, client.val] + ([client.test] if local_test == "split" else [])
        for idx in own:  # in the loaded split's rows
            assert not public_rows & set(private_rows[idx].tolist()), (scheme, pid)
        shard = load_client_data(data, setup.partition_spec(cfg), pid)
        for x in (shard.train_x, shard.val_x, shard.test_x):  # and by content
            assert not public_images & _image_keys(x), (scheme, pid)


def test_the_holdout_is_stratified_seeded_and_keyed():
    y = np.repeat(np.arange(10), [100, 50, 30, 20, 200, 100, 100, 100, 100, 200])
    public, private = holdout_rows(y, 0.1, seed=3)
    assert len(public) == 100 and len(private) == 900 and not set(public) & set(private)
    assert np.bincount(y[public], minlength=10).tolist() == [10, 5, 3, 2, 20, 10, 10, 10, 10, 20]
    again, _ = holdout_rows(y, 0.1, seed=3)
    other, _ = holdout_rows(y, 0.1, seed=4)
    assert np.array_equal(public, again) and not np.array_equal(public, other)
    # No global generator is read or moved.
    np.random.seed(0)
    state = np.random.get_state()[1].copy()
    holdout_rows(y, 0.1, seed=3)
    assert np.array_equal(np.random.get_state()[1], state)


def test_every_process_loads_the_same_public_set_once():
    cfg = cfg_of(**BASE, partition="iid")
    assert setup.public_set(cfg) is setup.public_set(cfg)
    assert setup.dataset(cfg) is setup.dataset(cfg)
    assert setup.public_set(cfg, labels=False).y is None


def test_no_public_source_leaves_the_data_as_it_was():
    cfg = cfg_of(**{**BASE, "public_source": "none"}, partition="iid")
    assert setup.dataset(cfg) is setup.loaded_dataset(cfg)
    with pytest.raises(Exception, match="no public set"):
        setup.public_set(cfg)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.1])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ConfigError, match="public-fraction"):
        cfg_of(**{**BASE, "public_fraction": fraction})


def test_a_fraction_that_leaves_no_public_sample_is_refused():
    cfg = cfg_of(**{**BASE, "public_fraction": 0.0001}, partition="iid")
    with pytest.raises(ConfigError, match="no public sample"):
        setup.prepare(cfg)


def test_npz_needs_its_absolute_file_and_only_npz_takes_one(tmp_path):
    with pytest.raises(ConfigError, match="public-file"):
        cfg_of(**{**BASE, "public_source": "npz"})
    with pytest.raises(ConfigError, match="absolute"):
        cfg_of(**{**BASE, "public_source": "npz", "public_file": "rel/p.npz"})
    with pytest.raises(ConfigError, match="public-file"):
        cfg_of(**{**BASE, "public_file": str(tmp_path / "p.npz")})


def test_an_npz_public_set_of_another_shape_or_channel_count_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    for name, shape, words in (("grey32.npz", (20, 32, 32), "image size"),
                               ("rgb.npz", (20, 3, 28, 28), "channels")):
        path = tmp_path / name
        np.savez(path, x=rng.integers(0, 255, shape, dtype=np.uint8))
        cfg = cfg_of(**{**BASE, "public_source": "npz", "public_file": str(path)},
                     partition="iid")
        with pytest.raises(ConfigError, match=words):
            setup.prepare(cfg)
    ok = tmp_path / "ok.npz"
    np.savez(ok, x=rng.random((30, 1, 28, 28), dtype=np.float32))
    cfg = cfg_of(**{**BASE, "public_source": "npz", "public_file": str(ok)}, partition="iid")
    setup.prepare(cfg)
    public = setup.public_set(cfg)
    assert len(public) == 30 and public.y is None and public.rows is None
    # The private data is whole: nothing was cut from it.
    assert len(setup.dataset(cfg).train_y) == 600


def test_digits_is_refused_beside_private_data_of_another_shape():
    pytest.importorskip("sklearn")
    cfg = cfg_of(**{**BASE, "public_source": "digits"}, partition="iid")
    setup.prepare(cfg)
    public = setup.public_set(cfg)
    assert len(public) == 1797 and public.input_shape == (1, 28, 28)
    assert int(public.y.max()) == 9
    rgb = cfg_of(**{**BASE, "public_source": "digits"}, partition="iid",
                 synthetic_shape="3,32,32")
    with pytest.raises(ConfigError, match="channels"):
        setup.prepare(rgb)


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch):
    import sys

    from fedapp.data import public
    public.digits_public.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    try:
        with pytest.raises(public.PublicSetError, match="scikit-learn"):
            public.digits_public()
    finally:
        public.digits_public.cache_clear()
