"""DepthFL: depth-prefix models (the depth-d model is the global model's first d stages and
exits), depths from the run config and their refusals, the exits' loss and its weight by hand,
FedDyn's client and server terms by hand, the per-entry average over the clients holding each
entry, the exact prefix traffic each way, and evaluation on the server (the global model's
ensemble and exits) and on the clients (each one's prefix)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from client_models import ModelConfigError
from client_models.depth_prefix import (DEPTH_FAMILIES, build_depth_model, max_depth,
                                        prefix_names)
from fedapp.config import ConfigError
from fedapp.runtime.client_base import load_arrays
from fedapp.runtime.payload import decode
from strategies.depthfl import DepthFLSettings
from strategies.depthfl.maths import (FEDDYN_STATE_KEY, aggregate_prefixes,
                                      distillation_weight, exit_losses, feddyn_penalty, kl_from)
from tests.conftest import (cfg_of, client_manager, fit_res, make_strategy,
                            recorded_federation)

# Four clients of depths 1, 2, 3, 4 on the 4-block CNN at a quarter width, one local epoch.
SMALL = {"dataset": "synthetic", "synthetic_train": 80, "synthetic_test": 40,
         "num_clients": 4, "partition": "iid", "max_samples_per_client": 0,
         "model_width": 0.25, "local_epochs": 1, "depthfl.model": "cnn4"}


def _model(family, depth, seed=0, width=0.25):
    torch.manual_seed(seed)
    return build_depth_model(family, depth, (1, 28, 28), 10, width=width)


# -- the models --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["resnet18", "cnn4"])
def test_the_depth_d_model_is_the_global_models_first_d_stages_and_exits(family):
    full = _model(family, max_depth(family))
    whole = full.state_dict()
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    for depth in range(1, max_depth(family) + 1):
        model = _model(family, depth)
        state = model.state_dict()
        # Names, shapes and initial weights: those of the global model's prefix.
        assert list(state) == prefix_names(list(whole), depth)
        assert all(torch.equal(state[k], whole[k]) for k in state)
        model.eval()
        outs = model.exit_logits(x)  # 28x28: the third stage's 7x7 map has an exit too
        assert len(outs) == depth and all(o.shape == (3, 10) for o in outs)
        torch.testing.assert_close(model(x), torch.stack(outs).mean(0))
    # A deeper prefix holds every entry of a shallower one, and more.
    assert set(prefix_names(whole, 1)) < set(prefix_names(whole, 2)) < set(whole)


def test_every_zoo_resnet_and_the_cnn_have_a_depth_prefix_form():
    assert set(DEPTH_FAMILIES) == {"resnet10", "resnet14", "resnet18", "resnet22", "resnet26",
                                   "cnn4"}
    assert {max_depth(f) for f in DEPTH_FAMILIES} == {4}


@pytest.mark.parametrize("family,depth,why", [
    ("cnn1", 1, "'cnn1' has no depth-prefix form"),
    ("resnet18", 5, "depth 5 is not allowed for 'resnet18': expected an integer from 1 to 4"),
    ("cnn4", 0, "depth 0 is not allowed"), ("cnn4", -1, "depth -1 is not allowed"),
    ("cnn4", True, "depth True is not allowed"), ("cnn4", 2.0, "depth 2.0 is not allowed")])
def test_a_depth_the_model_does_not_have_is_refused(family, depth, why):
    with pytest.raises(ModelConfigError, match=why):
        build_depth_model(family, depth, (1, 28, 28), 10)


# -- depths from the run config ----------------------------------------------------------------

def _depths(**overrides):
    cfg = cfg_of(method="depthfl", **overrides)
    return cfg.settings.client_depths(cfg)


def test_depths_per_client_per_group_and_by_level_name():
    # The reference's contiguous quarters (client i: i // (K/4) + 1), blocks of 3, 3, 2, 2.
    assert _depths() == [1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert _depths(**{"depthfl.assignment": "round-robin"}) == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert _depths(**{"depthfl.depths": "a,b,c,d"}) == _depths()
    # One entry per client: exactly that list (the reference's K = 10, where its integer
    # division gives the last two clients n_blocks = 5, i.e. the whole model).
    listed = "1,1,2,2,3,3,4,4,4,4"
    assert _depths(**{"depthfl.depths": listed}) == [int(d) for d in listed.split(",")]
    # Per architecture group of arch-mix (cnn1..cnn5 round-robin over 10 clients).
    pairs = "cnn1:1,cnn2:1,cnn3:2,cnn4:3,cnn5:d"
    assert _depths(**{"depthfl.depths": pairs}) == [1, 1, 2, 3, 4] * 2


@pytest.mark.parametrize("settings,why", [
    ({"depthfl.depths": "0"}, "depth 0 is not allowed for 'resnet18'"),
    ({"depthfl.depths": "1,-2"}, "depth -2 is not allowed"),
    ({"depthfl.depths": "1,5"}, "depth 5 is not allowed for 'resnet18': expected an integer "
                                "from 1 to 4"),
    ({"depthfl.depths": "e"}, "depth 5 is not allowed"),
    ({"depthfl.depths": "1,,2"}, "an entry is empty"),
    ({"depthfl.depths": "deep"}, "depth 'deep' is not allowed"),
    ({"depthfl.model": "cnn1"}, "depthfl.model = 'cnn1' is invalid: model 'cnn1' has no "
                                "depth-prefix form"),
    ({"depthfl.depths": "cnn1:1,cnn2:2"}, r"no depth for the architecture\(s\) cnn3, cnn4, "
                                          "cnn5"),
    ({"depthfl.depths": "resnet18:1"}, "'resnet18' is not an architecture of arch-mix"),
    ({"depthfl.depths": "cnn1:1,cnn1:2"}, "is not one 'arch:depth' pair per architecture")])
def test_bad_depths_are_refused_before_anything_starts(settings, why):
    with pytest.raises(ConfigError, match=why):
        cfg_of(method="depthfl", **settings)


# -- the client's loss -------------------------------------------------------------------------

def test_the_distillation_weight_ramps_as_the_reference():
    assert distillation_weight(1, 300) == pytest.approx(0.0067, abs=1e-4)  # t = 0
    assert distillation_weight(151, 300) == pytest.approx(0.2865, abs=1e-4)  # t = 150
    assert distillation_weight(301, 300) == distillation_weight(900, 300) == 1.0
    assert distillation_weight(1, 0) == 1.0


def test_two_exits_that_agree_teach_each_other_nothing():
    o = torch.tensor([[1.0, -2.0, 0.5]])
    assert float(kl_from(o, o.clone(), 0.0)) == pytest.approx(0.0, abs=1e-7)
    assert 0 < float(kl_from(o, o.clone(), 1e-7)) < 1e-6  # the reference's 1e-7 on the target


def test_the_exits_loss_by_hand():
    o1 = torch.tensor([[0.0, 0.0]], requires_grad=True)  # sigma = (1/2, 1/2)
    o2 = torch.tensor([[math.log(3.0), 0.0]], requires_grad=True)  # sigma = (3/4, 1/4)
    y, w = torch.tensor([0]), 0.5
    kl_21 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(s2 || s1)
    kl_12 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(s1 || s2)
    ce1, ce2 = math.log(2.0), math.log(4.0 / 3.0)
    exact = DepthFLSettings(kl_target_eps=0.0)
    assert float(exit_losses([o1, o2], y, w, exact).detach()) == pytest.approx(
        ce1 + ce2 + w * (kl_21 + kl_12))
    no_kd = DepthFLSettings(kl_target_eps=0.0, self_distillation=False)
    assert float(exit_losses([o1, o2], y, w, no_kd)) == pytest.approx(ce1 + ce2)
    # InclusiveFL: the deepest exit alone, still taught by the shallower one, which learns
    # nothing from it (each target is held constant).
    inclusive = DepthFLSettings(kl_target_eps=0.0, all_exits=False)
    loss = exit_losses([o1, o2], y, w, inclusive)
    assert float(loss) == pytest.approx(ce2 + w * kl_12)
    loss.backward()
    assert o1.grad is None and o2.grad is not None


def test_feddyns_client_terms_by_hand():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    penalty = feddyn_penalty(model, {"weight": torch.ones(1, 1)}, {"weight": torch.full(
        (1, 1), 3.0)}, alpha=0.1)
    assert float(penalty) == pytest.approx(-2.0 * 3.0 + 0.1 / 2 * 1.0)  # -<theta,h> + a/2 |.|^2


# -- the server step ---------------------------------------------------------------------------

def test_each_entry_is_averaged_over_the_clients_holding_it_by_hand():
    old = {"a": np.array([1.0, 1.0], np.float32), "b": np.array([2.0], np.float32),
           "c": np.array([3.0], np.float32), "r": np.array([1.0], np.float32),
           "n": np.array([4], np.int64)}
    h = {k: np.zeros(old[k].shape) for k in "abc"}  # the parameters ("r", "n": buffers)
    up_a = {"a": np.array([3.0, 5.0], np.float32), "b": np.array([4.0], np.float32),
            "r": np.array([2.0], np.float32), "n": np.array([6], np.int64)}
    up_b = {"a": np.array([5.0, 7.0], np.float32), "r": np.array([4.0], np.float32),
            "n": np.array([9], np.int64)}
    plain, _ = aggregate_prefixes(old, [up_a, up_b], h, 0.1, 4, feddyn=False)
    assert plain["a"].tolist() == [4.0, 6.0] and plain["b"].tolist() == [4.0]  # 2 and 1 holders
    assert plain["c"].tolist() == [3.0]  # nobody held it: kept
    assert plain["r"].tolist() == [3.0] and plain["n"].tolist() == [8]  # 7.5 rounded to even
    assert plain["a"].dtype == np.float32 and plain["n"].dtype == np.int64
    # FedDyn (alpha 0.1, K = 4): h <- h - alpha * count * (mean - old) / K, theta = mean - h/alpha.
    new, h1 = aggregate_prefixes(old, [up_a, up_b], h, 0.1, 4, feddyn=True)
    np.testing.assert_allclose(h1["a"], [-0.15, -0.25])  # -0.1 * 2 * (3, 5) / 4
    np.testing.assert_allclose(h1["b"], [-0.05])  # -0.1 * 1 * 2 / 4
    np.testing.assert_allclose(new["a"], [5.5, 8.5])  # (4, 6) + (1.5, 2.5)
    np.testing.assert_allclose(new["b"], [4.5])
    assert new["c"].tolist() == [3.0] and h1["c"].tolist() == [0.0]
    assert new["r"].tolist() == [3.0]  # buffers: the plain mean
    # The next round, clients that send back exactly theta: h stays, theta moves by -h/alpha.
    again, h2 = aggregate_prefixes(new, [{"a": new["a"], "b": new["b"]}], h1, 0.1, 4, True)
    np.testing.assert_allclose(h2["a"], h1["a"])
    np.testing.assert_allclose(again["a"], [7.0, 11.0])


def test_a_robust_rule_takes_each_entrys_median_over_its_holders_by_hand():
    from fedapp.runtime.aggregate import Robust
    old = {"a": np.array([0.0], np.float32), "b": np.array([0.0], np.float32),
           "c": np.array([3.0], np.float32)}
    h = {k: np.zeros(1) for k in "abc"}
    ups = [{"a": np.array([1.0], np.float32), "b": np.array([4.0], np.float32)},
           {"a": np.array([2.0], np.float32), "b": np.array([6.0], np.float32)},
           {"a": np.array([1000.0], np.float32)}]  # a deep client's poisoned prefix
    new, _ = aggregate_prefixes(old, ups, h, 0.1, 4, feddyn=False, robust=Robust("median"))
    assert new["a"].tolist() == [2.0]  # the median of (1, 2, 1000), not their mean 334.3
    assert new["b"].tolist() == [5.0] and new["c"].tolist() == [3.0]  # two holders; none


def test_a_stage_is_averaged_over_exactly_the_clients_deep_enough_to_hold_it():
    strategy = make_strategy("depthfl", sizes=[20] * 4, **SMALL, **{"depthfl.feddyn": False})
    assert strategy.depths == [1, 2, 3, 4]
    old = dict(strategy.global_model)
    # Client p adds p + 1 to every weight, and its one local step to BatchNorm's counts.
    uploads = {pid: {k: (v + (pid + 1 if v.dtype.kind == "f" else 1)).astype(v.dtype)
                     for k, v in strategy.prefix(depth).items()}
               for pid, depth in enumerate(strategy.depths)}
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    archs = strategy.architectures
    strategy.aggregate_fit(1, [(proxies[p], fit_res(u, 20, p, archs[p]))
                               for p, u in uploads.items()], [])
    assert strategy._counts["rejected"] == 0
    for name, value in strategy.global_model.items():
        stage = int(name.split(".")[1]) if name.split(".")[0] in ("stages", "exits") else 0
        holders = [p + 1 for p, d in enumerate(strategy.depths) if d > stage]
        # Stage 4 (index 3): the depth-4 client alone; stage 1 and the stem: all four.
        assert len(holders) == 4 - stage
        want = old[name] + (np.mean(holders) if value.dtype.kind == "f" else 1)
        np.testing.assert_allclose(value, want, rtol=1e-6)


def test_a_batch_count_beyond_the_rounds_local_steps_is_refused():
    strategy = make_strategy("depthfl", sizes=[20] * 4, **SMALL)
    count = "stages.0.1.num_batches_tracked"
    # One local epoch of 20 samples in batches of 50: one step; what was sent is 0.
    assert strategy.upload_spec(strategy_client(strategy, 0))[count].high == 1
    upload = {**strategy.prefix(1), count: np.array([2], np.int64)}
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    strategy.aggregate_fit(1, [(proxies[0], fit_res(upload, 20, 0, "cnn1"))], [])
    assert strategy._counts["rejected"] == 1


def strategy_client(strategy, pid):
    from fedapp.runtime.strategy_base import ClientInfo
    return ClientInfo(pid, strategy.architectures[pid])


def test_a_stage_no_client_of_the_round_holds_keeps_its_value():
    strategy = make_strategy("depthfl", sizes=[20] * 4, **SMALL)
    old = dict(strategy.global_model)
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    strategy.aggregate_fit(1, [(proxies[p], fit_res(strategy.prefix(p + 1), 20, p, a))
                               for p, a in [(0, "cnn1"), (1, "cnn2")]], [])
    deep = [k for k in old if k.split(".")[0] in ("stages", "exits") and k.split(".")[1] in "23"]
    assert deep and all(np.array_equal(strategy.global_model[k], old[k]) for k in deep)
    assert all(not strategy.h[k].any() for k in deep if k in strategy.h)


# -- traffic, the client's state, evaluation ---------------------------------------------------

def _nbytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


@pytest.mark.parametrize("download", ["prefix", "global"])
def test_a_client_receives_and_sends_only_its_prefix(tmp_path, download):
    rounds = 2 if download == "prefix" else 1
    fed, recorder = recorded_federation(tmp_path, "depthfl", rounds=rounds, **SMALL,
                                        **{"depthfl.download": download})
    prefix_bytes = {d: _nbytes(_model("cnn4", d).state_dict()) for d in range(1, 5)}
    for rnd in range(1, rounds + 1):
        seen = fed.fit_round(rnd)
        fed.evaluate_round(rnd)
        for pid, (sent, res) in seen.items():
            depth = fed.strategy.depths[pid]
            names = list(_model("cnn4", depth).state_dict())
            assert list(decode(res.parameters)) == names  # up: its prefix, nothing else
            assert list(sent) == (names if download == "prefix"
                                  else list(_model("cnn4", 4).state_dict()))
    up = sum(prefix_bytes[d] for d in (1, 2, 3, 4))
    down = up if download == "prefix" else 4 * prefix_bytes[4]
    for record in recorder.history:
        assert record["bytes_up"] == up and record["bytes_down"] == down


def test_the_client_keeps_feddyns_h_and_the_server_scores_the_global_model(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "depthfl", rounds=2, **SMALL)
    seen = fed.fit_round(1)
    h1 = {}
    for pid, (sent, res) in seen.items():
        upload = decode(res.parameters)
        h1[pid] = fed.contexts[pid].state[FEDDYN_STATE_KEY].to_torch_state_dict()
        assert set(h1[pid]) < set(upload)
        assert "stages.0.1.running_mean" not in h1[pid]  # the parameters only
        for name, value in h1[pid].items():  # h_1 = 0 - alpha * (theta - theta_g)
            np.testing.assert_allclose(value.numpy(), -0.1 * (upload[name] - sent[name]),
                                       atol=1e-6)
    fed.evaluate_round(1)
    seen = fed.fit_round(2)  # h_2 = h_1 - alpha * (theta - theta_g): read back and updated
    metrics = fed.evaluate_round(2)
    for pid, (sent, res) in seen.items():
        upload = decode(res.parameters)
        h2 = fed.contexts[pid].state[FEDDYN_STATE_KEY].to_torch_state_dict()
        for name, value in h2.items():
            np.testing.assert_allclose(value.numpy(), h1[pid][name].numpy()
                                       - 0.1 * (upload[name] - sent[name]), atol=1e-6)
        # Each client scores its depth's prefix: the ensemble, and each of its exits.
        depth = fed.strategy.depths[pid]
        assert {k for k in metrics[pid] if k.startswith("accuracy-")} == \
            {f"accuracy-exit-{i}" for i in range(1, depth + 1)}
    # The server scores the global model's ensemble and each exit on the global test set.
    record = recorder.history[-1]
    assert list(record["server_accuracy"]) == ["ensemble", "exit-1", "exit-2", "exit-3",
                                               "exit-4"]
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    got = fed.strategy.server_predict(x)
    model = _model("cnn4", 4)
    load_arrays(model, fed.strategy.global_model)
    model.eval()
    with torch.no_grad():
        outs = model.exit_logits(x)
    torch.testing.assert_close(got["ensemble"], torch.stack(outs).mean(0))
    torch.testing.assert_close(got["exit-3"], outs[2])
    assert F.softmax(got["ensemble"], 1).shape == (5, 10)
