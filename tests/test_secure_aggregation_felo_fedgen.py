"""Felo's and FedGen's fixed-layout variants under secure aggregation (SecAgg+, in process:
tests/test_secure_aggregation.py's harness): the server's state from the sums equals the plain
one of the same seed within the quantisation error, the masked upload is the layout's size, and
the layouts' sums give the server's quantities by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.runtime import secure_aggregation
from strategies import load_config
from tests.test_secure_aggregation import _class_counts, flat_config, run, step

FELO = {"method": "felo", "arch_mix": "cnn1,cnn2", "felo.history": "latest-round"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests compare, each made once."""
    made = {}

    def get(name, **kwargs):
        if name not in made:
            made[name] = run(tmp_path_factory.mktemp(name), name, **kwargs)
        return made[name]
    return get


def _values(layout) -> int:
    return sum(math.prod(shape) for shape in layout.values())


# -- Felo ----------------------------------------------------------------------------------------
def test_felo_secure_tables_and_group_models_equal_the_plain_ones(runs):
    plain, _, _ = runs("plain-felo", **FELO)
    secure, records, _ = runs("secure-felo", secure_aggregation=True, **FELO)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    want, got = plain.tables, secure.tables
    np.testing.assert_array_equal(got["class-labels"], want["class-labels"])
    # Class c's row is the unweighted mean over its h_c >= 1 holders: each of the 4 survivors'
    # row values and weights is off by less than one step, so the mean is off by at most
    # 4 step (1 + |mean|) / h_c (and float32's rounding).
    changed = 0
    for name in ("class-features", "class-logits"):
        tol = 4 * step() * (1 + np.abs(want[name]).max()) + 1e-6
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=tol, err_msg=name)
        changed += int(not np.array_equal(got[name], want[name]))
    # Group g's model: weights n_k / weight_scale sum to S_g over its members; every survivor
    # adds an error below one step to every slot (zeros in the other groups' slots), so the
    # mean is off by at most 4 step (1 + |mean|) / S_g.
    sizes, scale = secure.train_sizes, max(secure.train_sizes)
    assert sorted(plain.group_models) == sorted(secure.group_models) == ["cnn1", "cnn2"]
    for arch, model in plain.group_models.items():
        s_g = sum(n for n, a in zip(sizes, secure.architectures) if a == arch) / scale
        for name, array in model.items():
            tol = 4 * step() * (1 + np.abs(array).max()) / s_g + 1e-6
            assert secure.group_models[arch][name].dtype == array.dtype
            np.testing.assert_allclose(secure.group_models[arch][name], array, rtol=0,
                                       atol=tol, err_msg=f"{arch} {name}")
            changed += int(not np.array_equal(secure.group_models[arch][name], array))
    assert changed, "SecAgg+ quantises: a bit-identical result means it never ran"
    # Each masked upload: the class table (C x (d + C) rows, C weights, C holders), every
    # architecture's model slot with its weight and holders, SecAgg+'s own weight, in int64.
    models = sum(sum(a.size for a in m.values()) + 2 for m in plain.group_models.values())
    assert records[0]["bytes_up"] == 4 * 8 * (10 * (16 + 10) + 10 + 10 + models + 1)


def test_felo_settings_whose_server_needs_individual_uploads_are_refused():
    with pytest.raises(ConfigError) as refused:
        load_config(flat_config(secure_aggregation=True, method="felo"))  # history = "fifo"
    for word in ("'felo'", "felo.history = 'fifo'", "history = 'latest-round'"):
        assert word in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        load_config(flat_config(secure_aggregation=True, **{**FELO, "felo.history-size": 3}))
    for word in ("'felo'", "felo.history-size = 3", "4 clients of a round"):
        assert word in str(refused.value)
    load_config(flat_config(secure_aggregation=True, **FELO))  # latest-round: taken


def test_group_slots_sums_give_each_groups_weighted_mean():
    # A (group "a", weight 0.5) and B ("a", 0.25) average into group "a"; C ("b", 1.0) alone
    # is group "b"'s mean; nobody is in group "c". An integer counter is rounded back.
    layouts = {"a": {"w": (2,), "n": (1,)}, "b": {"w": (2,), "n": (1,)},
               "c": {"w": (2,), "n": (1,)}}
    uploads = [("a", {"w": np.array([1.0, 2.0]), "n": np.array([4])}, 0.5),
               ("a", {"w": np.array([4.0, -4.0]), "n": np.array([7])}, 0.25),
               ("b", {"w": np.array([3.0, 3.0]), "n": np.array([1])}, 1.0)]
    dense = [secure_aggregation.group_slots(g, p, w, layouts) for g, p, w in uploads]
    assert {k: v.shape for k, v in dense[0].items()} == \
        secure_aggregation.group_slots_layout(layouts)
    np.testing.assert_array_equal(dense[0]["group/b/w"], [0.0, 0.0])
    sums = {k: sum(d[k] for d in dense) for k in dense[0]}
    references = {g: {"w": np.zeros(2, np.float32), "n": np.zeros(1, np.int64)}
                  for g in layouts}
    means = secure_aggregation.group_means_from_sums(sums, references)
    assert sorted(means) == ["a", "b"]
    np.testing.assert_allclose(means["a"]["w"], [(0.5 * 1 + 0.25 * 4) / 0.75,
                                                 (0.5 * 2 - 0.25 * 4) / 0.75])
    assert means["a"]["n"].dtype == np.int64 and means["a"]["n"][0] == 5  # (0.5 * 4 + 0.25 * 7) / 0.75
    assert means["a"]["w"].dtype == np.float32
    np.testing.assert_allclose(means["b"]["w"], [3.0, 3.0])
