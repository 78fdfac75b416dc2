"""The width sub-model kit (client_models/width.py, fedapp/runtime/submodels.py,
fedapp/runtime/submodel_settings.py) and the methods built on it: HeteroFL and FedRolex."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from client_models import ModelConfigError
from client_models.width import (Scaler, build_width_model, parameter_count, static_norms,
                                  width_channels)
from fedapp.config import ConfigError
from fedapp.runtime.client_base import load_arrays, state_arrays
from fedapp.runtime.submodel_settings import LEVELS, fixed_split, parse_levels, width_rate
from fedapp.runtime.submodels import (CoordinateAverage, extract, index_maps, label_mask,
                                      map_size, masked_logits, window, with_statistics)
from tests.conftest import (cfg_of, client_manager, fit_res,
                            make_strategy, recorded_federation)

torch.set_num_threads(1)

# Small images keep the full-width conv cheap; arch-mix only names the device groups.
SMALL = dict(dataset="synthetic", synthetic_shape="1,8,8", synthetic_train=90,
             synthetic_test=30, num_clients=3, partition="iid", max_samples_per_client=0,
             arch_mix="resnet10", local_epochs=1, batch_size=10)
RATES = {"a": 1, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}


# -- the models ------------------------------------------------------------------------------
@pytest.mark.parametrize("level,rate", RATES.items())
def test_channel_counts_at_every_level_are_the_papers(level, rate):
    assert LEVELS[level] == Fraction(str(rate))
    conv = build_width_model("heterofl-conv", (1, 28, 28), 10, LEVELS[level])
    widths = [m.out_channels for m in conv.modules() if isinstance(m, torch.nn.Conv2d)]
    expected = [math.ceil(rate * w) for w in (64, 128, 256, 512)]
    assert widths == expected
    assert conv.head.in_features == expected[-1] and conv.head.out_features == 10
    # HeteroFL's parameter counts (Flower's baseline README, by hand): no BN buffers at all.
    assert parameter_count(conv) == {"a": 1_556_874, "b": 391_370, "c": 98_922,
                                     "d": 25_274, "e": 6_594}[level]
    assert set(state_arrays(conv)) == {n for n, _ in conv.named_parameters()}
    if level == "a":
        return  # the full-width ResNet is built by the slice test below (seconds to build)
    resnet = build_width_model("heterofl-resnet10", (3, 16, 16), 10, LEVELS[level])
    stems = [m.out_channels for m in resnet.modules() if isinstance(m, torch.nn.Conv2d)
             and m.kernel_size == (3, 3) and m.stride == (2, 2) or m is resnet.extractor[0]]
    assert stems == [math.ceil(rate * w) for w in (64, 128, 256, 512)]


def test_widths_round_up_on_exact_rationals():
    # FjORD's 0.6 tier: ⌈0.6 * 64⌉ = 39 (the zoo's round() gives 38); 0.6 * 5 = 3 exactly,
    # where 0.6000000000000001 * 5 would give 4.
    assert width_channels(64, 0.6) == 39
    assert width_channels(5, 0.6) == 3
    assert width_channels(64, Fraction(1, 16)) == 4


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "x", float("nan")])
def test_a_rate_outside_0_1_or_a_model_that_cannot_be_sliced_is_refused(bad):
    with pytest.raises(ModelConfigError, match=r"\(0, 1\]"):
        build_width_model("heterofl-conv", (1, 28, 28), 10, bad)
    with pytest.raises(ModelConfigError, match="cannot be sliced"):
        build_width_model("cnn1", (1, 28, 28), 10, 0.5)


def test_the_scaler_divides_by_the_rate_while_training_only():
    scaler, x = Scaler(0.25), torch.ones(2, 3)
    assert torch.equal(scaler.train()(x), 4 * x)
    assert torch.equal(scaler.eval()(x), x)


def test_static_batchnorm_tracks_nothing_and_statistics_come_from_one_pass():
    model = build_width_model("heterofl-conv", (1, 8, 8), 10, 0.5)
    assert all(not bn.track_running_stats for bn in static_norms(model))
    x = torch.randn(50, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    tracked = with_statistics(model, x, batch_size=20)
    first = static_norms(tracked)[0]
    with torch.no_grad():
        pre = model.extractor[0](x)  # conv1, then the Scaler (identity in eval) and the BN
    # The cumulative average (momentum None) of the batches' means and unbiased variances.
    batches = [pre[i:i + 20] for i in range(0, 50, 20)]
    mean = torch.stack([b.mean((0, 2, 3)) for b in batches]).mean(0)
    var = torch.stack([b.var((0, 2, 3), unbiased=True) for b in batches]).mean(0)
    assert torch.allclose(first.running_mean, mean, atol=1e-5)
    assert torch.allclose(first.running_var, var, atol=1e-5)
    assert not tracked.training and model.training  # the original is left as it was


# -- index maps ---------------------------------------------------------------------------------
def test_rolling_windows_as_fedrolex_and_every_channel_equally_often():
    assert window(8, 4, "rolling", 0).tolist() == [0, 1, 2, 3]
    assert window(8, 4, "rolling", 1).tolist() == [7, 0, 1, 2]
    assert window(8, 4, "rolling", 2).tolist() == [6, 7, 0, 1]
    counts = np.bincount(np.concatenate([window(8, 4, "rolling", t) for t in range(8)]))
    assert counts.tolist() == [4] * 8
    assert window(8, 4, "leading", 5).tolist() == [0, 1, 2, 3]
    assert window(8, 8, "rolling", 3).tolist() == list(range(8))  # a whole dimension stays


@pytest.mark.parametrize("arch,scheme,offset", [
    ("heterofl-conv", "leading", 0), ("heterofl-conv", "rolling", 3),
    ("heterofl-resnet10", "rolling", 3)])
def test_a_slice_computes_what_the_global_model_does_with_the_rest_switched_off(arch, scheme,
                                                                                offset):
    # Zero every global coordinate outside the slice: the global model then computes the
    # slice's function (eval mode: Scalers are identities, BNs use batch statistics), which
    # holds only if each layer's input indices are its predecessor's output indices.
    torch.manual_seed(0)
    full = build_width_model(arch, (1, 8, 8), 10, 1).eval()
    part = build_width_model(arch, (1, 8, 8), 10, 0.25).eval()
    arrays = state_arrays(full)
    maps = index_maps({k: v.shape for k, v in arrays.items()},
                      {k: v.shape for k, v in state_arrays(part).items()}, scheme, offset)
    load_arrays(part, extract(arrays, maps))
    switched_off = {}
    for name, value in arrays.items():
        kept = np.zeros_like(value)
        kept[np.ix_(*maps[name])] = value[np.ix_(*maps[name])]
        switched_off[name] = kept
    load_arrays(full, switched_off)
    x = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(full(x), part(x), atol=1e-4)
    assert map_size(maps) == parameter_count(part)


def test_coordinate_average_by_hand():
    # The spec's check: global (x0..x3); A (r = 1) uploads (1,1,1,1), B (r = 1/2) (3,3).
    global_arrays = {"w": np.array([9.0, 9.0, 9.0, 9.0], np.float32)}
    total = CoordinateAverage(global_arrays)
    total.add({"w": np.ones(4)}, {"w": (np.arange(4),)})
    total.add({"w": np.full(2, 3.0)}, {"w": (np.arange(2),)})
    assert total.result()["w"].tolist() == [2, 2, 1, 1]
    # Nobody holds coordinate 3: it keeps its value. Head rows only for the sender's classes.
    head = {"head.weight": np.zeros((3, 2), np.float32), "head.bias": np.full(3, 7.0, np.float32)}
    total = CoordinateAverage(head)
    full = {"head.weight": (np.arange(3), np.arange(2)), "head.bias": (np.arange(3),)}
    total.add({"head.weight": np.full((3, 2), 2.0), "head.bias": np.full(3, 2.0)}, full,
              rows=np.array([0, 1]))
    total.add({"head.weight": np.full((3, 2), 4.0), "head.bias": np.full(3, 4.0)}, full,
              rows=np.array([1]))
    assert total.result()["head.bias"].tolist() == [2, 3, 7]
    assert total.result()["head.weight"][:, 0].tolist() == [2, 3, 0]
    # Weighted (FjORD's n_k): Σ n v / Σ n.
    total = CoordinateAverage(global_arrays)
    total.add({"w": np.ones(4)}, {"w": (np.arange(4),)}, weight=3)
    total.add({"w": np.full(2, 5.0)}, {"w": (np.arange(2),)}, weight=1)
    assert total.result()["w"].tolist() == [2, 2, 1, 1]


def test_the_masked_head_zeroes_other_classes_logits_and_their_gradient():
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = label_mask(torch.tensor([0, 2, 2]), 3)
    out = masked_logits(logits, mask)
    assert out.tolist() == [[1.0, 0.0, 3.0]]
    torch.nn.functional.cross_entropy(out, torch.tensor([2])).backward()
    assert logits.grad[0, 1] == 0 and logits.grad[0, 0] != 0


# -- rates from the run config ----------------------------------------------------------------
def _plan(text, archs=("x",) * 5, mode="fix"):
    return parse_levels(text, "heterofl.rates", LEVELS, width_rate, list(archs), mode)


def test_the_four_forms_of_rates():
    half, quarter = Fraction(1, 2), Fraction(1, 4)
    assert _plan("a1-b1-c1-d1-e1").per_client == tuple(LEVELS[k] for k in "abcde")
    assert _plan("b").per_client == (half,) * 5
    assert _plan("0.25").per_client == (quarter,) * 5
    assert _plan("a,b,b,0.25,e").per_client == (1, half, half, quarter, Fraction(1, 16))
    assert _plan("cnn1=a,cnn2=0.5", ("cnn1", "cnn2", "cnn1")).per_client == (1, half, 1)
    # HeteroFL's fix mode: 100 clients of a1-b1-c1-d1-e1 are 20 each, in order; the clients
    # left over when K is not a multiple go one each to the levels in order.
    split = fixed_split(list("abcde"), [1] * 5, 100)
    assert [split.count(c) for c in "abcde"] == [20] * 5 and split[19:21] == ["a", "b"]
    assert fixed_split(list("abcde"), [1] * 5, 3) == ["a", "b", "c"]
    assert fixed_split(list("ab"), [1, 3], 8) == ["a", "a", "b", "b", "b", "b", "b", "b"]


def test_dynamic_rates_are_redrawn_each_round_from_a_keyed_stream():
    cfg = cfg_of(method="heterofl", **{**SMALL, "num_clients": 40},
                 **{"heterofl.rate-mode": "dynamic", "heterofl.rates": "a1-e3"})
    s = cfg.settings
    one, two = s.client_rates(cfg, 1), s.client_rates(cfg, 2)
    assert one == s.client_rates(cfg, 1) and one != two
    assert set(one) <= {1, Fraction(1, 16)} and 20 < one.count(Fraction(1, 16)) < 40


@pytest.mark.parametrize("overrides,words", [
    ({"heterofl.rates": "0"}, ["heterofl.rates", "(0, 1]"]),
    ({"heterofl.rates": "1.5"}, ["heterofl.rates", "(0, 1]"]),
    ({"heterofl.rates": "a,f,b"}, ["'f'", "level"]),
    ({"heterofl.rates": "a,b"}, ["one per client", "num-clients = 3"]),
    ({"heterofl.rates": "resnet18=a"}, ["['resnet10'] have no level", "not in arch-mix"]),
    ({"heterofl.rates": "a1-x1"}, ["unknown level"]),
    ({"heterofl.rates": "a,b,c", "heterofl.rate-mode": "dynamic"}, ["not one", "fix"]),
    ({"heterofl.global-arch": "cnn1"}, ["cannot be sliced", "heterofl-conv"]),
    ({"robust-aggregation": "krum"}, ["sub-model", "coordinate-wise rules apply"]),
    ({"heterofl.rates": "a1-e1", "heterofl.rate-mode": "dynamic", "optimizer-state": "keep"},
     ["optimizer-state = 'keep'", "dynamic rate", "'fresh'"]),
])
def test_bad_sub_model_settings_are_refused_before_anything_starts(overrides, words):
    with pytest.raises(ConfigError) as error:
        cfg_of(method="heterofl", **SMALL, **overrides)
    for word in words:
        assert word in str(error.value)


def test_a_kept_optimizer_is_refused_only_where_the_slice_moves():
    """A fixed slice keeps its coordinates, so its optimizer may live across messages; FedRolex's
    window rolls every round, so it may not."""
    cfg_of(method="heterofl", **SMALL, **{"optimizer-state": "keep"})
    with pytest.raises(ConfigError, match="rolling window"):
        cfg_of(method="fedrolex", **SMALL, **{"optimizer-state": "keep"})


# -- the methods ---------------------------------------------------------------------------------
def _constant(shapes, value):
    return {k: np.full(v, value, np.float32) for k, v in shapes.items()}


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_one_round_is_the_per_entry_average_over_the_clients_holding_it(method):
    # Two rates (A at 1, B at 1/2) and, for FedRolex, round 2's window (t = 1): every entry of
    # the new global model is the mean of the uploads of the clients whose slice holds it.
    strategy = make_strategy(method, **{**SMALL, "num_clients": 2},
                             **{f"{method}.rates": "a,b", f"{method}.mask": False})
    manager, proxies = client_manager(strategy)
    rnd = 2
    before = {k: v.copy() for k, v in strategy.global_model.items()}
    strategy.configure_fit(rnd, None, manager)
    uploads = {0: _constant({k: v.shape for k, v in before.items()}, 1.0),
               1: _constant(strategy.slice_shapes(Fraction(1, 2)), 3.0)}
    strategy.aggregate_fit(rnd, [(proxies[p], fit_res(u, strategy.train_sizes[p], p, "resnet10"))
                                 for p, u in uploads.items()], [])
    assert strategy._counts["rejected"] == 0
    after = strategy.global_model
    # conv2's weight [128, 64, 3, 3]: B holds the rows and columns of its windows.
    name = "extractor.5.weight"
    rows = window(128, 64, strategy.index_scheme, rnd - 1)
    cols = window(64, 32, strategy.index_scheme, rnd - 1)
    expected = np.ones((128, 64), np.float32)
    expected[np.ix_(rows, cols)] = 2.0  # (1 + 3) / 2
    assert np.array_equal(after[name][:, :, 0, 0], expected)
    if method == "fedrolex":
        assert after[name][127, 63, 1, 1] == 2.0 and after[name][64, 0, 0, 0] == 1.0
    # The head: all C rows; its inputs are the last layer's window.
    last = window(512, 256, strategy.index_scheme, rnd - 1)
    assert np.all(after["head.weight"][:, last] == 2.0)
    assert np.all(np.delete(after["head.weight"], last, axis=1) == 1.0)


def test_the_label_split_head_counts_only_a_clients_own_classes():
    strategy = make_strategy("heterofl", **{**SMALL, "num_clients": 2, "partition": "pathological",
                                            "classes_per_client": 2},
                             **{"heterofl.rates": "a,a"})
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    shapes = {k: v.shape for k, v in strategy.global_model.items()}
    before = strategy.global_model["head.bias"].copy()
    strategy.aggregate_fit(1, [(proxies[p], fit_res(_constant(shapes, float(p + 1)),
                                                    strategy.train_sizes[p], p, "resnet10"))
                               for p in (0, 1)], [])
    own = [set(strategy.label_rows(strategy.clients[proxies[p].cid]).tolist()) for p in (0, 1)]
    assert [len(o) for o in own] == [2, 2]  # two classes each: most rows are not counted
    bias = strategy.global_model["head.bias"]
    for c in range(10):
        holders = [p + 1 for p in (0, 1) if c in own[p]]
        assert bias[c] == pytest.approx(np.mean(holders) if holders else before[c])


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_a_client_receives_and_sends_only_its_slice(tmp_path, method):
    # A global model of model-width 1/4 (16-32-64-128), sliced at 1, 1/4 and 1/16.
    fed, recorder = recorded_federation(tmp_path, method, rounds=2, **SMALL, model_width=0.25,
                                        **{f"{method}.rates": "a,c,e"})
    strategy = fed.strategy
    floats = {pid: parameter_count(build_width_model("heterofl-conv", (1, 8, 8), 10, r,
                                                     width=0.25))
              for pid, r in enumerate((1, Fraction(1, 4), Fraction(1, 16)))}
    # ⌈⌈w/4⌉/16⌉ = 1, 2, 4, 8 channels: each conv's weights and bias, each BN's γ and β, the head.
    assert floats[2] == (1 * 1 * 9 + 1 + 2) + (2 * 1 * 9 + 2 + 4) + (4 * 2 * 9 + 4 + 8) \
        + (8 * 4 * 9 + 8 + 16) + (10 * 8 + 10) == 522
    for rnd in (1, 2):
        seen = fed.fit_round(rnd)
        for pid, (down, res) in seen.items():
            assert sum(v.size for v in down.values()) == floats[pid]
            assert sum(v.nbytes for v in down.values()) == 4 * floats[pid]
        # The client built only its slice: never the global model.
        assert parameter_count(fed.client(2).model) == floats[2]
        metrics = fed.evaluate_round(rnd)
        assert set(metrics) == {0, 1, 2}
        assert all("accuracy-masked" in m for m in metrics.values())
    for record in recorder.history:
        assert record["bytes_up"] == record["bytes_down"] == 4 * sum(floats.values())
        # The paper's evaluation: the global model on the global test set, beside the clients'.
        assert "global" in record["server_accuracy"]
    assert strategy.global_model["head.weight"].shape == (10, 128)


def test_fedrolex_and_heterofl_differ_only_in_the_window():
    rolled = make_strategy("fedrolex", **SMALL, **{"fedrolex.rates": "a,b,c"})
    leading = make_strategy("heterofl", **SMALL, **{"heterofl.rates": "a,b,c"})
    assert all(np.array_equal(a, b) for a, b in zip(rolled.global_model.values(),
                                                  leading.global_model.values()))
    name = "extractor.0.weight"  # conv1 [64, 1, 3, 3]; rate 1/2 keeps 32 rows
    assert rolled.maps(1, 1)[name][0].tolist() == leading.maps(1, 1)[name][0].tolist()
    assert rolled.maps(1, 3)[name][0].tolist() == [62, 63] + list(range(30))
    assert leading.maps(1, 3)[name][0].tolist() == list(range(32))


def test_server_statistics_come_from_the_pooled_training_set():
    strategy = make_strategy("heterofl", **SMALL, **{"heterofl.rates": "e"})
    x = torch.randn(7, 1, 8, 8)
    pooled = strategy.server_predict(x)["global"]
    assert pooled.shape == (7, 10)
    bn = static_norms(strategy.global_predictor())[0]
    assert bn.track_running_stats and int(bn.num_batches_tracked) == 1  # 90 samples, 1 batch
    none = make_strategy("heterofl", **SMALL, **{"heterofl.rates": "e", "heterofl.sbn": "none"})
    assert not static_norms(none.global_predictor())[0].track_running_stats
    assert not torch.allclose(pooled, none.server_predict(x)["global"])


# -- FjORD ---------------------------------------------------------------------------------------
FIFTHS = tuple(Fraction(i, 5) for i in range(1, 6))


def test_fjord_samples_only_widths_up_to_its_tier():
    from strategies.fjord.maths import draw_widths
    drawn = draw_widths(np.random.default_rng(0), FIFTHS, Fraction(2, 5), 400)
    assert set(drawn) == {Fraction(1, 5), Fraction(2, 5)}  # never 0.6
    assert 150 < drawn.count(Fraction(1, 5)) < 250  # uniform


def test_fjord_tiers_default_to_five_uniform_blocks_and_must_be_widths():
    cfg = cfg_of(method="fjord", **{**SMALL, "num_clients": 10})
    assert cfg.settings.client_rates(cfg, 1) == tuple(p for p in FIFTHS for _ in range(2))
    with pytest.raises(ConfigError, match=r"tiers \[0.5\] are not in fjord.widths"):
        cfg_of(method="fjord", **SMALL, **{"fjord.rates": "0.5"})
    with pytest.raises(ConfigError, match="must include 1"):
        cfg_of(method="fjord", **SMALL, **{"fjord.widths": "0.2,0.5", "fjord.rates": "0.5"})


@pytest.mark.parametrize("arch", ["heterofl-conv", "heterofl-resnet10"])
def test_ordered_dropout_at_width_p_is_the_width_p_sub_model(arch):
    # The p_max = 1 model run at p = 2/5 computes what the model built at 2/5 does with the
    # leading slice and width 2/5's statistics: ordered dropout, its head and per-width BN
    # (in the ResNet: every convolution, the shortcuts' too, and every pre-activation BN).
    from client_models.width import set_width
    torch.manual_seed(0)
    options = {"norm": "per-width", "scaler": False, "od_widths": FIFTHS}
    full = build_width_model(arch, (1, 8, 8), 10, 1, **options)
    part = build_width_model(arch, (1, 8, 8), 10, Fraction(2, 5), **options)
    with torch.no_grad():  # statistics of their own for every width
        for name, buffer in full.named_buffers():
            buffer.copy_(torch.rand(buffer.shape) + 0.5)
    arrays = state_arrays(full)
    shapes = {k: v.shape for k, v in state_arrays(part).items()}
    assert not any(k.endswith(("_2", "_3", "_4")) for k in shapes)  # only widths 0.2, 0.4
    load_arrays(part, extract(arrays, index_maps({k: v.shape for k, v in arrays.items()},
                                                 shapes)))
    full.eval(), part.eval()
    set_width(full, Fraction(2, 5))
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(full(x), part(x), atol=1e-5)


def test_fjord_averages_nested_slices_by_samples_over_the_clients_holding_them():
    # A (p_max 1, n = 10) uploads a = 1 everywhere, B (p_max 0.4, n = 30) b = 5: B's slice
    # becomes (10·1 + 30·5) / 40 = 4, the rest A's 1; width 0.2's statistics both, 0.6's A's.
    strategy = make_strategy("fjord", sizes=[10, 30], **{**SMALL, "num_clients": 2},
                             **{"fjord.rates": "1,0.4"})
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    uploads = {0: _constant(strategy.slice_shapes(Fraction(1)), 1.0),
               1: _constant(strategy.slice_shapes(Fraction(2, 5)), 5.0)}
    strategy.aggregate_fit(1, [(proxies[p], fit_res(u, [10, 30][p], p, "resnet10"))
                               for p, u in uploads.items()], [])
    assert strategy._counts["rejected"] == 0
    after = strategy.global_model
    conv2 = after["extractor.5.weight"][:, :, 0, 0]  # [128, 64]; B holds [:52, :26]
    expected = np.ones((128, 64), np.float32)
    expected[:52, :26] = 4.0
    assert np.array_equal(conv2, expected)
    assert np.all(after["extractor.2.running_mean_0"] == 4.0)
    assert np.all(after["extractor.2.running_mean_2"] == 1.0)
    assert np.all(after["head.weight"][:, :205] == 4.0) and np.all(after["head.weight"][:, 205:] == 1.0)


def test_held_coordinates_combine_each_coordinate_over_its_holders_only():
    # Four clients, three coordinates: held by all four, by two, by none (NaN: not held).
    from fedapp.runtime.aggregate import Robust, held_coordinates
    stack = np.array([[1.0, 5.0, np.nan], [2.0, np.nan, np.nan], [3.0, 7.0, np.nan],
                      [100.0, np.nan, np.nan]])
    median = held_coordinates(stack, Robust("median"))
    assert median[0] == 2.5 and median[1] == 6.0 and np.isnan(median[2])
    # int(0.25 * 4) = 1 cut at each end of the first: (2 + 3) / 2; int(0.25 * 2) = 0 of the
    # second: its mean.
    trimmed = held_coordinates(stack, Robust("trimmed-mean", trim_fraction=0.25))
    assert trimmed[0] == 2.5 and trimmed[1] == 6.0 and np.isnan(trimmed[2])


@pytest.mark.parametrize("rule,inside,outside", [("median", 3.5, 2.0),
                                                 ("trimmed-mean", 3.5, 2.0)])
def test_a_robust_rule_combines_each_coordinate_over_the_clients_holding_it(rule, inside,
                                                                           outside):
    # FjORD, four clients: three at p_max 1 uploading 1, 2 and 1000 everywhere, one at 0.4
    # uploading 5. The 0.4 slice is held by all four: median (1, 2, 5, 1000) = 3.5, trimmed
    # (beta 0.34: int(1.36) = 1 cut at each end) (2 + 5) / 2 = 3.5; the rest by three: the
    # median 2, and int(1.02) = 1 cut at each end leaves 2.
    strategy = make_strategy("fjord", sizes=[10, 10, 10, 30], **{**SMALL, "num_clients": 4},
                             **{"fjord.rates": "1,1,1,0.4", "robust_aggregation": rule,
                                "robust_trim_fraction": 0.34})
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    values = [1.0, 2.0, 1000.0, 5.0]
    uploads = {p: _constant(strategy.slice_shapes(Fraction(2, 5) if p == 3 else Fraction(1)),
                            values[p]) for p in range(4)}
    strategy.aggregate_fit(1, [(proxies[p], fit_res(u, [10, 10, 10, 30][p], p, "resnet10"))
                               for p, u in uploads.items()], [])
    assert strategy._counts["rejected"] == 0
    conv2 = strategy.global_model["extractor.5.weight"][:, :, 0, 0]  # [128, 64]; 0.4: [:52, :26]
    expected = np.full((128, 64), outside, np.float32)
    expected[:52, :26] = inside
    assert np.array_equal(conv2, expected)


@pytest.mark.parametrize("arch", ["heterofl-conv", "heterofl-resnet10"])
def test_fjord_client_receives_and_sends_its_slice_and_the_server_scores_every_width(tmp_path,
                                                                                      arch):
    fed, recorder = recorded_federation(tmp_path, "fjord", rounds=1, **SMALL, model_width=0.25,
                                        **{"fjord.rates": "0.2,0.6,1",
                                           "fjord.global-arch": arch})
    seen = fed.fit_round(1)
    fed.evaluate_round(1)
    for pid, (down, res) in seen.items():
        rate = (Fraction(1, 5), Fraction(3, 5), Fraction(1))[pid]
        model = build_width_model(arch, (1, 8, 8), 10, rate, width=0.25,
                                  **fed.cfg.settings.model_options(rate))
        size = sum(v.numel() for v in model.state_dict().values())
        assert sum(v.nbytes for v in down.values()) == 4 * size
    record = recorder.history[0]
    assert record["bytes_up"] == record["bytes_down"]
    assert set(record["server_accuracy"]) == {"width-0.2", "width-0.4", "width-0.6",
                                              "width-0.8", "width-1"}


def test_fjord_self_distillation_is_the_baselines_two_backward_passes():
    # Flower's models.train with knowledge_distillation: full_loss = CE(full, y) backward,
    # then CE(partial, full.detach().softmax()) backward; one step on the summed gradients.
    from strategies.fjord.maths import self_distillation
    torch.manual_seed(0)
    w = torch.randn(6, 4, requires_grad=True)
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))

    def outputs():
        full = x @ w
        return full, (x[:, :3] @ w[:3]) * 0.5  # the "partial" width shares w's leading rows

    full, partial = outputs()
    torch.nn.functional.cross_entropy(full, y).backward()
    torch.nn.functional.cross_entropy(partial, full.detach().softmax(dim=1)).backward()
    baseline = w.grad.clone()
    w.grad = None
    full, partial = outputs()
    self_distillation(full, partial, y, alpha=1.0, temperature=1.0).backward()
    assert torch.allclose(w.grad, baseline, atol=1e-6)
    # alpha = 0: labels alone for both widths; T scales the soft term by T^2 on softened logits.
    full, partial = outputs()
    ce = torch.nn.functional.cross_entropy
    assert torch.isclose(self_distillation(full, partial, y, 0.0, 3.0),
                         ce(full, y) + ce(partial, y))
    soft = ce(partial / 3, (full.detach() / 3).softmax(1)) * 9
    assert torch.isclose(self_distillation(full, partial, y, 0.5, 3.0),
                         ce(full, y) + 0.5 * ce(partial, y) + 0.5 * soft)


def test_fjord_self_distillation_trains_p_max_every_batch_and_is_checked(tmp_path):
    # With kd the tier-1 client also runs its p_max = 1 output on every batch: its upload
    # differs from the run without, and its width-1 statistics (index 4 of the five widths)
    # have moved, whichever widths the batches drew.
    from fedapp.runtime.payload import decode
    seen = {}
    for kd in (False, True):
        fed, _ = recorded_federation(tmp_path / str(kd), "fjord", rounds=1, **SMALL,
                                     model_width=0.25, **{"fjord.rates": "0.2,0.6,1",
                                                          "fjord.kd": kd})
        seen[kd] = {pid: (down, decode(res.parameters))
                    for pid, (down, res) in fed.fit_round(1).items()}
    (down, off), (_, on) = seen[False][2], seen[True][2]
    assert off.keys() == on.keys()
    assert any(not np.array_equal(off[k], on[k]) for k in off)
    full_width = [k for k in on if k.endswith("running_mean_4")]
    assert full_width and all(not np.array_equal(on[k], down[k]) for k in full_width)
    with pytest.raises(ConfigError, match="fjord.kd-alpha"):
        cfg_of(method="fjord", **SMALL, **{"fjord.kd-alpha": 1.5})
    with pytest.raises(ConfigError, match="fjord.kd-temperature"):
        cfg_of(method="fjord", **SMALL, **{"fjord.kd-temperature": 0.0})
