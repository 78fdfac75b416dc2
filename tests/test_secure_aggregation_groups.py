"""Secure aggregation of the methods that average within groups (FedPer and FedRep: one
extractor per architecture; CompFL in rounds: one per expert): every client uploads a table of
every group's extractor, its own in its group's slot (``secure_aggregation.group_table``), and
the server's per-group averages from the sums equal the plain ones of the same seed. The whole
SecAgg+ protocol runs in process (tests/test_secure_aggregation.py's harness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.runtime import secure_aggregation
from fedapp.seeding import derive_seed
from strategies import METHODS, load_config
from strategies.compfl.maths import select_expert
from tests import test_secure_aggregation
from tests.test_secure_aggregation import COLLECT, flat_config, step

# Round-robin over three architectures and four clients: cnn1 holds partitions 0 and 3, cnn2
# partition 1 alone (a group of one), cnn3 partition 2 alone. Seed 3 gives cnn1's two clients
# 34 and 64 samples, and lr 0.1 moves their extractors apart by about 1e-2 in two steps, so
# that a wrong weighting within a group (uniform instead of n_k) is far beyond the tolerance.
THREE = "cnn1,cnn2,cnn3"
GROUPS = {"cnn1": [0, 3], "cnn2": [1], "cnn3": [2]}
FAST = {"arch_mix": THREE, "seed": 3, "lr": 0.1}

runs = test_secure_aggregation.runs  # the fixture of the runs compared, each made once


def initial_extractors(strategy) -> dict:
    """The seed's initial extractors of the strategy's method (no round run)."""
    return METHODS[strategy.cfg.method].strategy(strategy.cfg, None, input_shape=(1, 28, 28),
                                                 num_classes=10).extractors


def assert_groups_within_quantisation(secure, plain, survivors: list[int]) -> int:
    """Every group's extractor under SecAgg+ is the plain one within the quantisation error;
    returns how many arrays differ at all.

    Every survivor's value of every coordinate (zeros in other groups' slots too) and its
    weight column are off by less than one step, so a group's sum of w_k u_k and its summed
    weight W_g are off by less than N steps (N survivors), and its mean by at most
    N step (1 + |mean|) / W_g. W_g is at least the smallest survivor's weight n_k / S (S =
    weight_scale), whichever survivors trained the group (CompFL's epsilon-greedy chooses).
    The mean is the extractor, or (CompFL's delta upload) the extractor minus the initial
    one: 1 + |plain| + |initial| bounds 1 + |mean| in both cases. Plus float32's rounding."""
    scale = secure_aggregation.weight_scale(secure.cfg)
    smallest = min(secure.train_sizes[p] for p in survivors) / scale
    initial = initial_extractors(plain)
    changed = 0
    assert sorted(secure.extractors) == sorted(plain.extractors)
    for arch, extractor in plain.extractors.items():
        for name, want in extractor.items():
            got = secure.extractors[arch][name]
            assert got.dtype == want.dtype and got.shape == want.shape
            bound = 1 + np.abs(want).max() + np.abs(initial[arch][name]).max()
            tol = len(survivors) * step() * bound / smallest + 1e-6
            np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"{arch} {name}")
            changed += int(not np.array_equal(got, want))
    return changed


def table_values(strategy) -> int:
    """Values of one client's table: every group's extractor, a weight and a holders column."""
    return (sum(a.size for e in strategy.extractors.values() for a in e.values())
            + 2 * len(strategy.extractors))


# -- the sums are the plain per-group averages, within the quantisation error -----------------
def test_fedper_secure_averages_per_architecture_equal_the_plain_ones(runs):
    # Partition 2, cnn3's only client, goes away when it should train: cnn3 has no survivor
    # and keeps its extractor, cnn2's average is its one survivor's extractor.
    setting = dict(method="fedper", drop={(2, COLLECT)}, **FAST)
    plain, _, _ = runs("plain-fedper", **setting)
    secure, records, _ = runs("secure-fedper", secure_aggregation=True, **setting)
    assert {a: [p for p, b in enumerate(secure.architectures) if b == a]
            for a in secure.extractors} == GROUPS
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 3]}
    assert records[0]["failed_clients"] == [2] and records[0]["clients_fit"] == 3
    assert assert_groups_within_quantisation(secure, plain, [0, 1, 3])
    initial = initial_extractors(secure)
    for strategy in (plain, secure):
        for name, want in initial["cnn3"].items():  # the same arrays, bit for bit
            np.testing.assert_array_equal(strategy.extractors["cnn3"][name], want)
        for arch in ("cnn1", "cnn2"):  # trained and averaged
            assert any(not np.array_equal(strategy.extractors[arch][n], a)
                       for n, a in initial[arch].items())
    # Each survivor's masked upload: every architecture's extractor, 3 weights, 3 holders and
    # SecAgg+'s own weight, in int64 (8 bytes a value).
    assert records[0]["bytes_up"] == 3 * 8 * (table_values(secure) + 1)


def test_fedrep_secure_averages_per_architecture_equal_the_plain_ones(runs):
    setting = {"method": "fedrep", "fedrep.head-epochs": 1, **FAST}
    plain, _, _ = runs("plain-fedrep", **setting)
    secure, records, _ = runs("secure-fedrep", secure_aggregation=True, **setting)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    assert assert_groups_within_quantisation(secure, plain, [0, 1, 2, 3])
    assert records[0]["bytes_up"] == 4 * 8 * (table_values(secure) + 1)


def test_compfl_secure_averages_per_expert_equal_the_plain_ones(runs):
    # Three experts, the upload a delta (Algorithm 1). Epsilon-greedy moves partition 3 (cnn1,
    # the largest expert) to cnn3 in this seed: it writes into cnn3's slot, beside partition 2.
    setting = {"method": "compfl", **FAST}
    plain, _, _ = runs("plain-compfl", **setting)
    secure, records, _ = runs("secure-compfl", secure_aggregation=True, **setting)
    assert plain.order == ("cnn3", "cnn2", "cnn1")
    rng = np.random.default_rng(derive_seed(plain.cfg.seed, "compfl-greedy", 3, 1))
    assert select_expert(2, plain.settings.epsilon, rng) == 0
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    assert assert_groups_within_quantisation(secure, plain, [0, 1, 2, 3])
    assert records[0]["bytes_up"] == 4 * 8 * (table_values(secure) + 1)


# -- the layout, by hand ----------------------------------------------------------------------
def test_group_table_sums_give_the_weighted_mean_of_each_group():
    groups = {"a": {"w": (2,)}, "b": {"w": (1, 2), "n": (1,)}, "c": {"w": (3,)}}
    # Clients 1 and 2 trained group a (weights 0.5 and 0.25), client 3 group b (weight 1);
    # nobody trained c.
    one = secure_aggregation.group_table(groups, "a", {"w": np.array([2.0, -4.0])}, 0.5)
    two = secure_aggregation.group_table(groups, "a", {"w": np.array([8.0, 2.0])}, 0.25)
    three = secure_aggregation.group_table(groups, "b", {"w": np.array([[1.0, 3.0]]),
                                                         "n": np.array([7])}, 1.0)
    layout = secure_aggregation.group_table_layout(groups)
    assert layout == {"a/w": (2,), "b/w": (1, 2), "b/n": (1,), "c/w": (3,),
                      secure_aggregation.SUM_WEIGHT: (3,), secure_aggregation.HOLDERS: (3,)}
    for table in (one, two, three):
        assert {k: v.shape for k, v in table.items()} == layout
    # One client's table: its weighted arrays in its slot, zeros elsewhere, its columns.
    np.testing.assert_array_equal(one["a/w"], [1.0, -2.0])
    np.testing.assert_array_equal(one["b/w"], [[0.0, 0.0]])
    np.testing.assert_array_equal(one["c/w"], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(one[secure_aggregation.SUM_WEIGHT], [0.5, 0.0, 0.0])
    np.testing.assert_array_equal(three[secure_aggregation.HOLDERS], [0.0, 1.0, 0.0])
    sums = {k: one[k] + two[k] + three[k] for k in layout}
    means = secure_aggregation.group_means_from_sums(sums, groups)
    assert sorted(means) == ["a", "b"]  # c keeps its state
    np.testing.assert_allclose(means["a"]["w"], [(0.5 * 2 + 0.25 * 8) / 0.75,
                                                 (0.5 * -4 + 0.25 * 2) / 0.75])
    np.testing.assert_allclose(means["b"]["w"], [[1.0, 3.0]])
    np.testing.assert_allclose(means["b"]["n"], [7.0])


def test_a_group_table_of_another_layout_is_not_built():
    groups = {"a": {"w": (2,)}, "b": {"w": (1,)}}
    with pytest.raises(ValueError, match="not one of the run's"):
        secure_aggregation.group_table(groups, "z", {"w": np.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match="do not have its layout"):
        secure_aggregation.group_table(groups, "a", {"w": np.zeros(3)}, 1.0)
    with pytest.raises(ValueError, match="do not have its layout"):
        secure_aggregation.group_table(groups, "a", {"v": np.zeros(2)}, 1.0)


def test_client_and_server_derive_the_same_table():
    # The client builds its table from the run config alone: the server's layout, and the
    # architectures sorted by name whatever arch-mix's order.
    from strategies.fedper.maths import extractor_layouts
    cfg = load_config(flat_config(method="fedper", arch_mix="cnn3,cnn1",
                                  secure_aggregation=True))
    strategy = METHODS["fedper"].strategy(cfg, None, input_shape=(1, 28, 28), num_classes=10)
    groups = extractor_layouts(cfg, (1, 28, 28), 10)
    assert list(groups) == ["cnn1", "cnn3"]
    assert groups == {a: {n: v.shape for n, v in e.items()} for a, e in strategy.extractors.items()}
    layout = strategy.secure_layout()
    assert strategy.secure_upload_size().data == 8 * (sum(
        math.prod(s) for s in layout.values()) + 1)
    assert layout[secure_aggregation.SUM_WEIGHT] == (2,)


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedper", "fedrep", "compfl"])
def test_the_group_methods_take_secure_aggregation(method):
    cfg = load_config(flat_config(method=method, arch_mix=THREE, secure_aggregation=True))
    assert cfg.secure_aggregation


@pytest.mark.parametrize("loop", ["walk", "gossip"])
def test_compfl_device_to_device_loops_are_still_refused(loop):
    with pytest.raises(ConfigError, match=f"server-loop = '{loop}'.*device to device"):
        load_config(flat_config(method="compfl", arch_mix=THREE, server_loop=loop,
                                secure_aggregation=True))


def test_compfl_fmnist_experts_upload_both_extractors_under_secure_aggregation():
    # docs/compfl.md's experts (d = 128): every client's table holds both extractors, 2
    # weights, 2 holders, and SecAgg+'s own weight, 8 bytes each, whichever expert it trained.
    from tests.conftest import make_strategy
    from tests.test_compfl import EXTRACTOR_FLOATS, FED
    strategy = make_strategy("compfl", **FED, secure_aggregation=True)
    values = sum(EXTRACTOR_FLOATS.values()) + 2 + 2 + 1
    assert strategy.secure_upload_size().data == 8 * values == 2_819_624
