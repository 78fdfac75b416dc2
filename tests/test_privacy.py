"""Client-level differential privacy (fedapp.runtime.privacy): the clip and the noise worked
out by hand, the accountant against the Gaussian mechanism's closed form, the refusals, the
records, and the privacy spent surviving a checkpoint and resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.runtime import checkpoint, privacy
from fedapp.runtime.payload import decode, from_ndarrays
from fedapp.runtime.privacy import Accountant, PrivacyBudgetSpent, clip, private_mean
from fedapp.runtime.tensorboard import round_scalars
from tests.conftest import cfg_of, client_manager, fit_res, make_strategy
from tests.test_checkpoint import _federation

DP = {"differential_privacy": True, "dp_clip_norm": 1.0, "dp_noise_multiplier": 0.5}


# -- the mechanism, by hand ------------------------------------------------------------------------

def test_the_whole_upload_is_clipped_as_one_vector():
    # Two arrays of joint norm sqrt(3^2 + 4^2) = 5: both scaled by 1/5 to norm 1, although
    # each alone is already longer than 1 (clipping arrays apart would allow norm sqrt 2).
    clipped, norm = clip({"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0])
    np.testing.assert_allclose(clipped["b"], [[0.8]])
    # Shorter than the bound: unchanged.
    same, norm = clip({"a": np.array([0.3, 0.4])}, 1.0)
    assert norm == pytest.approx(0.5)
    np.testing.assert_allclose(same["a"], [0.3, 0.4])


def test_the_noisy_mean_is_the_clipped_changes_sum_plus_noise_over_m():
    reference = {"w": np.array([1.0, 1.0], np.float32), "steps": np.array(4, np.int64)}
    # Changes (3, 4) -> clipped to (0.6, 0.8); (0, 0.5) stays (norm 0.5 < 1).
    uploads = [{"w": np.array([4.0, 5.0], np.float32), "steps": np.array(4, np.int64)},
               {"w": np.array([1.0, 1.5], np.float32), "steps": np.array(6, np.int64)}]
    out = private_mean(uploads, reference, 1.0, 0.7, np.random.default_rng(3))
    noise = 0.7 * np.random.default_rng(3).standard_normal(2)
    np.testing.assert_allclose(out["w"], 1.0 + (np.array([0.6, 1.3]) + noise) / 2, rtol=1e-6)
    assert out["w"].dtype == np.float32
    assert out["steps"] == 5 and out["steps"].dtype == np.int64  # integers: plain mean


def test_the_noise_on_the_sum_has_std_2zS_over_m():
    # Every upload equal to the reference: what the mean adds is the noise alone, std 2 z S / m.
    reference = {"w": np.zeros(40_000, np.float32)}
    z, bound, m = 0.8, 2.0, 4
    out = private_mean([reference] * m, reference, bound, 2 * z * bound,
                       np.random.default_rng(7))
    assert np.std(out["w"]) == pytest.approx(2 * z * bound / m, rel=0.02)


def test_a_client_clips_its_change_from_what_it_received_and_adds_2zS_noise():
    cfg = cfg_of(method="fedproto", num_clients=4, **DP)
    received = {"p": np.array([1.0, 1.0], np.float32)}
    upload = {"p": np.array([4.0, 5.0], np.float32),  # received: its change (3, 4) counts
              "q": np.array([0.0, 2.0], np.float32),  # not received: (0, 2) as it is
              "labels": np.array([2, 7], np.int64)}   # integers travel as they are
    out = privacy.private_upload(upload, received, cfg, partition_id=3, server_round=5)
    # One vector (3, 4, 0, 2) of norm sqrt(29), clipped to 1; noise std 2 z S = 1, drawn from
    # the client's keyed stream array by array in the upload's order.
    scale, std = 1 / math.sqrt(29.0), 2 * 0.5 * 1.0
    rng = privacy.noise_rng(cfg, "client", 3, 5)
    noise_p, noise_q = rng.standard_normal(2), rng.standard_normal(2)
    np.testing.assert_allclose(out["p"], 1.0 + scale * np.array([3.0, 4.0]) + std * noise_p,
                               rtol=1e-6)
    np.testing.assert_allclose(out["q"], scale * np.array([0.0, 2.0]) + std * noise_q,
                               rtol=1e-6)
    np.testing.assert_array_equal(out["labels"], [2, 7])
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in upload.items()}
    # Another partition or round: another stream.
    other = privacy.private_upload(upload, received, cfg, partition_id=2, server_round=5)
    assert not np.allclose(other["p"], out["p"])


# -- the accountant ------------------------------------------------------------------------------

def test_epsilon_of_rounds_sampling_everyone_is_the_gaussian_mechanisms():
    # m = N: no amplification, T compositions of the Gaussian mechanism of multiplier z, whose
    # Renyi DP at order a is a / (2 z^2); epsilon = min over a of T a / (2 z^2)
    # + log(1 - 1/a) - log(delta a) / (a - 1) (Canonne, Kamath, Steinke 2020, as dp-accounting
    # converts), worked out here on a fine grid of orders.
    z, rounds, delta = 2.0, 5, 1e-5
    accountant = Accountant(z, population=10, delta=delta)
    for _ in range(rounds):
        accountant.spend(10)
    orders = np.linspace(1.02, 200, 400_000)
    closed = np.min(rounds * orders / (2 * z**2) + np.log1p(-1 / orders)
                    - np.log(delta * orders) / (orders - 1))
    # The library minimises over its own, coarser, list of orders: never below the optimum.
    assert closed <= accountant.epsilon() <= closed * 1.01
    # Sampling 2 of the 10 clients a round spends less (amplification by subsampling).
    sampled = Accountant(z, population=10, delta=delta, events=[(z, 2)] * rounds)
    assert 0 < sampled.epsilon() < accountant.epsilon()


def test_the_budget_stops_the_round_that_would_pass_it():
    probe = Accountant(1.0, population=4, delta=1e-5, events=[(1.0, 2)])
    one, two = probe.epsilon(), probe.epsilon_after(2)
    strategy = make_strategy("lg-fedavg", num_clients=4, fraction_fit=0.5,
                             dp_target_epsilon=(one + two) / 2,
                             **{**DP, "dp_noise_multiplier": 1.0})
    manager, _ = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    strategy.aggregate_fit(1, [], [])
    assert strategy.privacy.accountant.epsilon() == pytest.approx(one)
    with pytest.raises(PrivacyBudgetSpent, match="would spend epsilon"):
        strategy.configure_fit(2, None, manager)


# -- refusals: one check for every method, from its card -----------------------------------------

@pytest.mark.parametrize("overrides, reason", [
    ({"method": "standalone"}, "nothing to protect"),
    ({"method": "fedhe", "server_loop": "async"}, "one client's upload"),
    ({"method": "lg-fedavg", "robust_aggregation": "median"}, "robust rule replaces"),
    ({"method": "lg-fedavg", "dp_target_epsilon": 0.01}, "a single round"),
    ({"method": "lg-fedavg", "dp_delta": 1.0}, "below 1"),
])
def test_what_dp_cannot_protect_is_refused_before_anything_starts(overrides, reason):
    with pytest.raises(ConfigError, match=reason) as err:
        cfg_of(**{**DP, **overrides})
    assert "differential-privacy" in str(err.value) or "dp-" in str(err.value)


def test_fedapp_settings_shows_the_settings_and_refuses_what_run_refuses(capsys):
    from fedapp.cli.main import main as fedapp_main
    assert fedapp_main(["settings", "--set", 'method="fedproto"', "--set",
                        "differential-privacy=true"]) == 0
    shown = capsys.readouterr().out
    assert "differential-privacy = true" in shown and "dp-noise-multiplier = 1.0" in shown
    assert fedapp_main(["settings", "--set", 'method="standalone"', "--set",
                        "differential-privacy=true"]) == 2
    assert "method 'standalone'" in capsys.readouterr().err


def test_where_the_noise_goes_follows_the_card():
    assert privacy.mode_of(("model",)) == privacy.mode_of(("group-model",)) == "server"
    assert privacy.mode_of(("class-rows",)) == "client"
    assert privacy.mode_of(("model", "server-training")) == "client"
    assert cfg_of(method="fedproto", **DP).payload_kinds == ("class-rows",)


# -- the server step, and the records ----------------------------------------------------------

def test_lg_fedavg_under_dp_averages_clipped_head_changes_plus_noise(tmp_path):
    from fedapp.runtime.results import Recorder
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=3, num_rounds=1, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder=recorder, num_clients=3, sizes=[5, 6, 7],
                             **DP)
    manager, proxies = client_manager(strategy)
    head = {k: v.copy() for k, v in strategy.global_head.items()}
    results = []
    for proxy, ins in strategy.configure_fit(1, None, manager):
        pid = proxy.identity["partition-id"]
        sent = decode(ins.parameters)
        # Partition p moves every value of the head by p + 1 (far beyond the clip).
        upload = {k: v + np.float32(pid + 1) for k, v in sent.items()}
        results.append((proxy, fit_res(upload, [5, 6, 7][pid], pid, proxy.identity["arch"])))
    strategy.aggregate_fit(1, results, [])
    size = sum(v.size for v in head.values())
    # Each change is (p + 1) * ones, clipped to norm 1: ones / sqrt(size), whatever p.
    clipped_sum = 3 / math.sqrt(size)
    rng = privacy.noise_rng(strategy.cfg, "server", 1, "all")
    for name in head:  # the noise is drawn array by array, in the head's order
        noise = 2 * 0.5 * 1.0 * rng.standard_normal(head[name].shape)
        np.testing.assert_allclose(strategy.global_head[name],
                                   head[name] + (clipped_sum + noise) / 3, rtol=1e-5, atol=1e-6)
    # The round's record, the summary and TensorBoard's scalars carry the privacy spent.
    strategy.configure_evaluate(1, None, manager)
    strategy.aggregate_evaluate(1, [], [])
    record = json.loads((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()[-1])
    want = Accountant(0.5, 3, 1e-5, events=[(0.5, 3)]).epsilon()
    assert record["privacy"]["epsilon"] == pytest.approx(want)
    assert record["privacy"]["mode"] == "server" and record["privacy"]["sampling_rate"] == 1.0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"] == \
        record["privacy"]
    assert round_scalars(record)["privacy/epsilon"] == pytest.approx(want)


def _hand_round(strategy, manager, rnd):
    """One round of hand-made uploads: partition p moves the head it was sent by p + 1."""
    results = []
    for proxy, ins in strategy.configure_fit(rnd, None, manager):
        pid = proxy.identity["partition-id"]
        upload = {k: v + np.float32(pid + 1) for k, v in decode(ins.parameters).items()}
        results.append((proxy, fit_res(upload, 5, pid, proxy.identity["arch"])))
    strategy.aggregate_fit(rnd, results, [])
    strategy.configure_evaluate(rnd, None, manager)  # nobody evaluated: the round is recorded
    return json.loads((strategy.recorder.run_dir / "rounds.jsonl").read_text()
                      .splitlines()[-1])


def _recorded_strategy(run_dir, resume_after=0):
    from fedapp.runtime.results import Recorder
    recorder = Recorder(run_dir, method="lg-fedavg", dataset="synthetic", num_clients=3,
                        num_rounds=4, config={}, partition={}, resume_after=resume_after)
    strategy = make_strategy("lg-fedavg", recorder=recorder, num_clients=3, sizes=[5] * 3,
                             fraction_fit=0.6, checkpoint_every=2, eval_every=5,
                             num_server_rounds=4, **DP)  # round 3 is not evaluated
    return strategy, client_manager(strategy)[0]


def test_epsilon_after_a_resume_equals_the_uninterrupted_runs(tmp_path):
    whole, manager = _recorded_strategy(tmp_path / "whole")
    records = [_hand_round(whole, manager, rnd) for rnd in (1, 2, 3)]
    cut, manager = _recorded_strategy(tmp_path / "cut")
    for rnd in (1, 2, 3):  # killed after round 3, before its checkpoint (every 2 rounds)
        _hand_round(cut, manager, rnd)
    done, state = checkpoint.load_server(tmp_path / "cut" / "checkpoint")
    assert done == 2 and state[privacy.STATE_KEY] == [(0.5, 2), (0.5, 2)]
    resumed, manager = _recorded_strategy(tmp_path / "cut", resume_after=done)
    resumed.restore(done, state)
    again = _hand_round(resumed, manager, 1)  # Flower's round 1 of the resumed run is round 3
    assert again["round"] == 3
    assert again["privacy"] == records[-1]["privacy"]
    assert again["privacy"]["releases"] == 3 and again["privacy"]["sampling_rate"] == 2 / 3
    assert again["privacy"]["epsilon"] > records[1]["privacy"]["epsilon"] > 0
    # The noise is keyed by the round, so the resumed state is the uninterrupted one too.
    for name, value in whole.global_head.items():
        np.testing.assert_array_equal(resumed.global_head[name], value)


@pytest.mark.slow
@pytest.mark.long
def test_epsilon_after_a_resume_with_real_clients_equals_the_uninterrupted_runs(tmp_path):
    dp = {**DP, "fraction_fit": 0.6}
    whole = _federation("lg-fedavg", tmp_path / "whole", **dp)
    for rnd in (1, 2, 3):
        whole.fit_round(rnd)
        whole.evaluate_round(rnd)
    cut = _federation("lg-fedavg", tmp_path / "cut", **dp)
    for rnd in (1, 2):
        cut.fit_round(rnd)
        cut.evaluate_round(rnd)
    done, state = checkpoint.load_server(tmp_path / "cut" / "checkpoint")
    resumed = _federation("lg-fedavg", tmp_path / "cut", resume_after=done, resume=True, **dp)
    resumed.strategy.restore(done, state)
    resumed.fit_round(1)  # round 3
    resumed.evaluate_round(1)

    def last(run):
        return json.loads((tmp_path / run / "rounds.jsonl").read_text().splitlines()[-1])
    assert last("cut")["round"] == last("whole")["round"] == 3
    assert last("cut")["privacy"] == last("whole")["privacy"]
    for name, value in whole.strategy.global_head.items():
        np.testing.assert_array_equal(resumed.strategy.global_head[name], value)


def test_a_checkpoint_without_a_ledger_is_not_resumed_with_dp(tmp_path):
    strategy = make_strategy("lg-fedavg", num_clients=3, **DP)
    with pytest.raises(ValueError, match="no privacy ledger"):
        strategy.restore(2, {})


def test_a_client_mode_upload_reaches_the_server_noised_and_accepted():
    # FedProto (class-rows): each client noises its prototypes; the server accepts them, and
    # what it received is what the client's keyed stream makes of its honest upload.
    from tests.conftest import InProcessFederation
    from tests.test_hostile_uploads import small_smoke_overrides
    fed = InProcessFederation("fedproto", **{**small_smoke_overrides("fedproto"), **DP,
                                             "fraction_fit": 0.3, "min_fit_clients": 1})
    honest = {}
    original = privacy.private_upload

    def spy(upload, received, cfg, pid, rnd):
        honest[pid] = dict(upload)
        return original(upload, received, cfg, pid, rnd)
    privacy.private_upload = spy
    try:
        sent = fed.fit_round(1)
    finally:
        privacy.private_upload = original
    assert fed.strategy._counts == {"clients_fit": 1, "failures": 0, "rejected": 0}
    for pid, (_, res) in sent.items():
        got = from_ndarrays(_arrays(res))
        assert got.keys() == honest[pid].keys()  # names (FedProto's counts) travel as they are
        floats = [k for k in got if got[k].dtype.kind == "f"]
        assert floats and all(not np.allclose(got[k], honest[pid][k]) for k in floats)


def _arrays(res):
    from flwr.common import parameters_to_ndarrays
    return parameters_to_ndarrays(res.parameters)
