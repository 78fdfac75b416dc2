"""Secure aggregation for the sub-model methods (HeteroFL, FedRolex, FjORD, DepthFL): each client
pads its slice (or prefix) to the global model's shapes, with its weight at every coordinate it
holds (``CoordinateAverage.padded``), and the server divides the survivors' two sums. The whole
SecAgg+ protocol runs in process (tests/test_secure_aggregation.py's harness) and its result is
compared with the plain round of the same seed."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fedapp.runtime.strategy_base import ClientInfo
from fedapp.runtime.submodels import (HELD, CoordinateAverage, index_maps, padded_layout,
                                      padded_upload, whole_maps)
from strategies import METHODS, load_config
from tests.test_secure_aggregation import flat_config, run_cache, step

# Four clients at four width rates (HeteroFL's a1-b1-c1-d1-e1 gives 4 clients a, b, c, d), so
# every hidden coordinate has its own holders; HeteroFL's and FedRolex's label-split head (the
# synthetic partition is label-skewed) gives each head row its own holders too; FjORD's
# clients have three tiers. No sBN pass over the pooled training set: an evaluation the
# comparison does not need.
WIDTH = {"heterofl": {"heterofl.sbn": "none"}, "fedrolex": {"fedrolex.sbn": "none"},
         "fjord": {"fjord.rates": "0.25,0.5,1,0.5", "fjord.widths": "0.25,0.5,1"}}
# Two depths of the 4-stage conv: stages 2 and 3 are nobody's and keep their value.
DEPTH = {"depthfl.model": "cnn4", "depthfl.depths": "1,2"}
SMALL = {"model_width": 0.125}  # half the harness's width: a cheaper round


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests compare, each made once."""
    return run_cache(tmp_path_factory)


def rolled(method: str):
    """A context in which the method's strategy starts at round 3 (as a resumed run does):
    FedRolex's window is then offset by t = 2, which each client computes from the round it is
    told to pad its slice."""
    cls = METHODS[method].strategy
    init = cls.__init__

    def starting_at_round_3(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.round_offset = 2
    patch = pytest.MonkeyPatch()
    patch.setattr(cls, "__init__", starting_at_round_3)
    return patch


def pair(runs, method: str, **settings):
    """(plain strategy, secure strategy, secure records) of one round of ``method``."""
    patch = rolled(method) if method == "fedrolex" else None
    try:
        plain, _, _ = runs(f"plain-{method}", method=method, **SMALL, **settings)
        secure, records, _ = runs(f"secure-{method}", method=method, secure_aggregation=True,
                                  **SMALL, **settings)
    finally:
        if patch is not None:
            patch.undo()
    return plain, secure, records


def global_size(strategy) -> int:
    return sum(a.size for a in strategy.global_model.values())


def assert_not_identical(secure, plain) -> None:
    assert any(not np.array_equal(secure.global_model[n], plain.global_model[n])
               for n in plain.global_model), \
        "SecAgg+ quantises: a result bit-identical to the plain one means it never ran"


# HeteroFL's round runs with the fast tests (the label-split head, four rates); FedRolex's
# (its rolled windows) and FjORD's (n_k weights, per-width statistics) with the long ones.
@pytest.mark.parametrize("method", [
    "heterofl", pytest.param("fedrolex", marks=pytest.mark.long),
    pytest.param("fjord", marks=pytest.mark.long)])
def test_a_width_method_secure_average_equals_the_plain_one(runs, method):
    plain, secure, records = pair(runs, method, **WIDTH[method])
    server_round = records[0]["round"]
    assert server_round == (3 if method == "fedrolex" else 1)
    rates = secure.settings.client_rates(secure.cfg, server_round)
    assert len(set(rates)) >= 3 and Fraction(1) in rates  # several holders' sets
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    # Each coordinate's mean is Σ w_k u_k over Σ w_k; each of the 4 uploads is off by less
    # than one step in both, so the mean is off by at most 4 step (1 + |mean|) / Σ w_k, with
    # Σ w_k at least the smallest weight: 1 (HeteroFL, FedRolex) or min n_k / S (FjORD).
    sizes = secure.train_sizes
    smallest = 1.0 if method != "fjord" else min(sizes[p] for p in range(4)) / max(sizes)
    for name, want in plain.global_model.items():
        got = secure.global_model[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 4 * step() * (1 + np.abs(want).max()) / smallest + 1e-6
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
    assert_not_identical(secure, plain)
    # Each masked upload: the global model's values and their weights, and SecAgg+'s own
    # weight, in int64; a slice's traffic saving is gone.
    assert records[0]["bytes_up"] == 4 * 8 * (2 * global_size(secure) + 1)


def test_the_rolled_windows_and_head_rows_have_their_own_holders():
    # What the averages above rely on: in round 3 FedRolex's slices are rolled windows (which
    # each client computes from the round, SubmodelClient.secure_upload), and the head's rows
    # (label-split) are held by different numbers of clients.
    cfg = load_config(flat_config(method="fedrolex", **SMALL))
    strategy = METHODS["fedrolex"].strategy(cfg, None, input_shape=(1, 28, 28),
                                            num_classes=10)
    # Partition 3's rate d keeps ⌈8/8⌉ = 1 of the first layer's 8 channels: roll(arange(8), 2).
    assert list(strategy.maps(3, 3)["extractor.0.weight"][0]) == [6]
    holders = np.zeros(10)
    for pid in range(4):
        holders[strategy.label_rows(ClientInfo(pid, strategy.architectures[pid]))] += 1
    assert len(set(holders)) > 1


# -- DepthFL: prefixes padded to the full depth, then FedDyn ----------------------------------
def test_depthfl_secure_step_equals_the_plain_one(runs):
    plain, secure, records = pair(runs, "depthfl", **DEPTH)
    assert sorted(set(secure.depths)) == [1, 2]
    old = type(secure)(secure.cfg, None, input_shape=(1, 28, 28), num_classes=10).global_model
    # An entry's mean is off by at most 4 step (1 + |mean|) / count, count >= 1; FedDyn's
    # theta = mean - h/alpha with h = -alpha count (mean - old) / K (h was 0) multiplies that
    # by 1 + count / K <= 2, and |mean| <= max(|theta|, |old|).
    for name, want in plain.global_model.items():
        got = secure.global_model[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype.kind in "iu":  # BatchNorm's counters, sent as their change: exact
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        tol = 2 * 4 * step() * (1 + max(np.abs(want).max(), np.abs(old[name]).max())) + 1e-6
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
        if name.startswith(("stages.2", "stages.3", "exits.2", "exits.3")):
            np.testing.assert_array_equal(got, old[name])  # nobody's: kept as it was
    for name, want in plain.h.items():
        np.testing.assert_allclose(secure.h[name], want, rtol=0, atol=1e-3, err_msg=name)
    assert any(np.abs(plain.h[n]).max() > 0 for n in plain.h)  # FedDyn's h moved
    assert_not_identical(secure, plain)
    assert records[0]["bytes_up"] == 4 * 8 * (2 * global_size(secure) + 1)


# -- the padded layout, by hand -----------------------------------------------------------------
def test_padded_sums_give_the_coordinate_average_by_hand():
    # A global model of one [4, 2] layer and a [3, 4] head ("head.weight", label rows apply).
    previous = {"layer": np.full((4, 2), 9.0, np.float32),
                "head.weight": np.full((3, 4), 7.0, np.float32)}
    shapes = {n: a.shape for n, a in previous.items()}
    # A: rate 1/2 rolled by t = 1 (rows 3, 0 of the layer; head columns 3, 0), weight 0.5,
    # head rows of its classes 0 and 2 only. B: rate 1, weight 0.25, every head row.
    maps_a = index_maps(shapes, {"layer": (2, 2), "head.weight": (3, 2)}, "rolling", 1)
    maps_b = index_maps(shapes, shapes)
    assert [list(i) for i in maps_a["layer"]] == [[3, 0], [0, 1]]
    a = {"layer": np.array([[1.0, 2.0], [3.0, 4.0]]), "head.weight": np.arange(6.0).reshape(3, 2)}
    b = {"layer": np.ones((4, 2)), "head.weight": np.ones((3, 4))}
    uploads = [padded_upload(shapes, a, maps_a, 0.5, np.array([0, 2])),
               padded_upload(shapes, b, maps_b, 0.25)]
    assert {n: u.shape for n, u in uploads[0].items()} == padded_layout(shapes)
    assert sorted(uploads[0]) == sorted(["layer", "head.weight", HELD + "layer",
                                         HELD + "head.weight"])
    sums = {n: uploads[0][n] + uploads[1][n] for n in uploads[0]}
    got = CoordinateAverage.from_padded(previous, sums, noise=1e-9).result()
    # layer row 3 = A's row 0 with B's: (0.5 [1, 2] + 0.25 [1, 1]) / 0.75; row 0 = A's row 1.
    np.testing.assert_allclose(got["layer"][3], [(0.5 + 0.25) / 0.75, (1.0 + 0.25) / 0.75])
    np.testing.assert_allclose(got["layer"][0], [(1.5 + 0.25) / 0.75, (2.0 + 0.25) / 0.75])
    np.testing.assert_allclose(got["layer"][1], [1.0, 1.0])  # B's alone
    # Head row 1: A's class 1 is not among its rows, so B's alone; row 2 col 3 = A's [2, 0].
    np.testing.assert_allclose(got["head.weight"][1], [1.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(got["head.weight"][2, 3], (0.5 * 4.0 + 0.25) / 0.75)
    np.testing.assert_allclose(got["head.weight"][2, 1], 1.0)
    # The plain average of the same two slices gives the same.
    plain = CoordinateAverage(previous)
    plain.add(a, maps_a, 0.5, np.array([0, 2]))
    plain.add(b, maps_b, 0.25)
    for name, want in plain.result().items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6)
    # A summed weight at or below the noise is nobody's: the previous value stays.
    only_a = CoordinateAverage.from_padded(previous, uploads[0], noise=0.5).result()
    np.testing.assert_array_equal(only_a["layer"], previous["layer"])


def test_whole_maps_hold_every_coordinate():
    maps = whole_maps({"a": (2, 3), "b": (1,)})
    assert [list(i) for i in maps["a"]] == [[0, 1], [0, 1, 2]] and list(maps["b"][0]) == [0]
    assert math.prod(len(i) for i in maps["a"]) == 6
