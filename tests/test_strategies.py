"""Strategies driven directly through configure_fit / aggregate_fit with hand-built replies."""

import io
import logging
import threading
import time

import numpy as np
import pytest

from fedapp.runtime import timeline
from fedapp.runtime.payload import decode, wire_size
from fedapp.runtime.results import Recorder
from fedapp.runtime.strategy_base import EmptyRounds, RoundFailed
from tests.conftest import (InProcessFederation, client_manager, eval_res, fit_res,
                            make_strategy)

HEAD = {"head.weight": (10, 500), "head.bias": (10,)}


def _heads(rng, n):
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in HEAD.items()} for _ in range(n)]


def test_lg_fedavg_moves_exactly_the_head_each_way(rng, tmp_path):
    # FedGH Table 3: LG-FedAvg with d=500, C=10 moves 5010 floats each way per client per round.
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="fmnist", num_clients=3,
                        num_rounds=1, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder, num_clients=3, feature_dim=500,
                             arch_mix="cnn1,cnn2,cnn3", sizes=[100, 200, 700])
    manager, proxies = client_manager(strategy)
    instructions = strategy.configure_fit(1, None, manager)
    assert len(instructions) == 3
    for _, ins in instructions:
        assert wire_size(ins.parameters).data == 5010 * 4
        assert {k: v.shape for k, v in decode(ins.parameters).items()} == HEAD
    heads = _heads(rng, 3)
    results = [(p, fit_res(h, n, i, f"cnn{i + 1}"))
               for i, (p, h, n) in enumerate(zip(proxies, heads, [100, 200, 700]))]
    strategy.aggregate_fit(1, results, [])
    expected = (heads[0]["head.weight"] * 0.1 + heads[1]["head.weight"] * 0.2
                + heads[2]["head.weight"] * 0.7)
    np.testing.assert_allclose(strategy.global_head["head.weight"], expected, rtol=1e-5, atol=1e-6)
    strategy.configure_evaluate(1, None, manager)
    strategy.aggregate_evaluate(1, [(p, eval_res(i, f"cnn{i + 1}", 0.5 + 0.1 * i))
                                    for i, p in enumerate(proxies)], [])
    summary = recorder.summary()
    com = summary["communication"]
    assert com["per_client_per_round_up"] == com["per_client_per_round_down"] == 5010 * 4
    assert com["floats_per_client_per_round_up"] == 5010
    assert 0 < com["framing_per_client_per_round_up"] < 600
    assert summary["accuracy"]["mean"] == pytest.approx(0.6)
    assert summary["accuracy"]["per_architecture"] == pytest.approx(
        {"cnn1": 0.5, "cnn2": 0.6, "cnn3": 0.7})
    assert (tmp_path / "run" / "rounds.jsonl").read_text().count("\n") == 1


def test_lg_fedavg_also_reports_the_global_head_as_htfllib_evaluates(tmp_path):
    # The headline is the personalised model; "global-head" installs the averaged head on the
    # client's extractor (HtFLlib's LG-FedAvg tests that model), leaving the model untouched.
    import torch
    # The evaluation runs the extractor once for both heads: the same numbers, bit for bit,
    # as each whole model evaluated on its own.
    from fedapp.runtime.client_base import load_arrays
    from fedapp.runtime.training import evaluate
    fed = InProcessFederation("lg-fedavg", num_clients=2, arch_mix="cnn5",
                              **{"output-dir": str(tmp_path)})
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    client = fed.client(0)
    client._recover_state({}, 1)
    client._take_back_state()
    x, y = client.data.test_x, client.data.test_y
    own = evaluate(client.model, x, y)
    head = torch.nn.Linear(*client.model.head.weight.shape[::-1]).to(x.device)
    load_arrays(head, {k.removeprefix("head."): v for k, v in fed.strategy.global_head.items()})
    with_global = evaluate(torch.nn.Sequential(client.model.extractor, head), x, y)[1]
    assert metrics[0]["accuracy"] == own[1]
    assert metrics[0]["accuracy-global-head"] == with_global
    assert not torch.equal(client.model.head.weight.detach(),
                           torch.from_numpy(fed.strategy.global_head["head.weight"]))


def test_bad_uploads_are_rejected_and_the_round_goes_on(rng, caplog):
    strategy = make_strategy("lg-fedavg", num_clients=5, arch_mix="cnn1", sizes=[50] * 5)
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    good = _heads(rng, 1)[0]
    wrong_shape = {**good, "head.weight": np.zeros((10, 499), np.float32)}
    with_nan = {**good, "head.bias": np.full(10, np.nan, np.float32)}
    # An object array, pickled: Flower's encoder refuses to write one, so the blobs are
    # written by hand, as a client that bypasses it would send them.
    pickled = fit_res(good, 50, 4, "cnn1")
    pickled.parameters.tensors[2] = _npy(np.array([object()], dtype=object), allow_pickle=True)
    results = [(proxies[0], fit_res(good, 50, 0, "cnn1")),
               (proxies[1], fit_res(wrong_shape, 50, 1, "cnn1")),
               (proxies[2], fit_res(with_nan, 50, 2, "cnn1")),
               (proxies[3], fit_res(good, 50, 3, "cnn9")),  # lies about its architecture
               (proxies[4], pickled)]
    strategy.aggregate_fit(1, results, [RuntimeError("client crashed")])
    np.testing.assert_array_equal(strategy.global_head["head.weight"], good["head.weight"])
    assert strategy._counts["clients_fit"] == 1
    assert strategy._counts["rejected"] == 4
    assert strategy._counts["failures"] == 1
    text = caplog.text
    assert "shape" in text and "NaN" in text and "architecture" in text
    assert "not a plain .npy" in text


def _npy(array, allow_pickle=False):
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def run_round(strategy, rnd, upload):
    """A synchronous round of two cnn1 clients that upload ``upload`` (None: both crash)."""
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(rnd, None, manager)
    if upload is None:
        strategy.aggregate_fit(rnd, [], [RuntimeError("a"), RuntimeError("b")])
    else:
        strategy.aggregate_fit(rnd, [(p, fit_res(upload, 50, i, "cnn1"))
                                     for i, p in enumerate(proxies)], [])
    strategy.configure_evaluate(rnd, None, manager)
    strategy.aggregate_evaluate(rnd, [(p, eval_res(i, "cnn1", 0.5))
                                      for i, p in enumerate(proxies)], [])


def test_a_round_recorded_then_paused_while_a_benchmark_runs_its_own(tmp_path, monkeypatch):
    # benchmarks/runtime_overhead.py --interleave: after recording a round the ServerApp
    # waits for the benchmark's go, so the pause is in no round's seconds.
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv(timeline.PAUSE_ENV, str(pause))
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=2, num_rounds=2, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder, num_clients=2, arch_mix="cnn1",
                             sizes=[50, 50])
    head = {k: np.zeros_like(v) for k, v in strategy.global_head.items()}
    paused = threading.Thread(target=run_round, args=(strategy, 1, head))
    paused.start()
    while not (pause / "round-1.done").exists():
        assert paused.is_alive()
        time.sleep(0.01)
    time.sleep(0.2)
    assert paused.is_alive() and len(recorder.history) == 1
    (pause / "round-1.go").touch()
    paused.join(timeout=5)
    assert not paused.is_alive()
    (pause / "round-2.go").touch()  # the last round pauses too
    run_round(strategy, 2, head)
    assert [h["round"] for h in recorder.history] == [1, 2]
    assert recorder.history[0]["seconds"] < 0.2


def test_rounds_without_a_usable_update_keep_the_state_until_max_empty_rounds(tmp_path,
                                                                               caplog):
    # Rounds 2, 4 and 5 have no usable update (every client crashed, or every upload was
    # refused): each keeps the head as it was and is recorded as empty; the run goes on until
    # max-empty-rounds = 2 such rounds come in a row, and then stops saying why.
    def recorder(resume_after=0):
        return Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=2, num_rounds=6, config={}, partition={},
                        resume_after=resume_after)

    strategy = make_strategy("lg-fedavg", recorder(), num_clients=2, arch_mix="cnn1",
                             sizes=[50, 50], max_empty_rounds=2)
    heads = [{k: np.full_like(v, r) for k, v in strategy.global_head.items()} for r in range(4)]
    with_nan = {k: np.full_like(v, np.nan) for k, v in heads[0].items()}
    run_round(strategy, 1, heads[1])
    run_round(strategy, 2, None)  # every client failed
    np.testing.assert_array_equal(strategy.global_head["head.weight"], heads[1]["head.weight"])
    run_round(strategy, 3, heads[3])
    with caplog.at_level(logging.WARNING):
        run_round(strategy, 4, with_nan)  # every upload refused
    assert "the method's state stays as it was (1 such rounds in a row" in caplog.text
    np.testing.assert_array_equal(strategy.global_head["head.weight"], heads[3]["head.weight"])
    assert [h["empty_round"] for h in strategy.recorder.history] == [False, True, False, True]
    assert strategy.recorder.summary()["empty_rounds"] == [2, 4]
    assert strategy.recorder.history[3]["rejected_clients"] == [0, 1]
    with pytest.raises(EmptyRounds, match="round 5: no client returned a usable update .*"
                       "2 such rounds in a row, max-empty-rounds = 2"):
        run_round(strategy, 5, None)
    # A run resumed after round 4 counts round 4 in: one more empty round stops it.
    resumed = make_strategy("lg-fedavg", recorder(resume_after=4), num_clients=2,
                            arch_mix="cnn1", sizes=[50, 50], max_empty_rounds=2)
    with pytest.raises(EmptyRounds):
        run_round(resumed, 5, None)
    # max-empty-rounds = 0: never stops.
    patient = make_strategy("lg-fedavg", num_clients=2, arch_mix="cnn1", max_empty_rounds=0)
    for rnd in range(1, 6):
        run_round(patient, rnd, None)


def test_fedapp_says_why_a_run_stopped_and_exits_3_after_empty_rounds(tmp_path, capsys):
    from fedapp.cli.run import report_run
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=2, num_rounds=6, config={}, partition={})
    recorder.record_failure("empty-rounds", "round 3: no client returned a usable update")
    assert report_run("finished:failed", tmp_path / "run") == 3
    assert "no client returned a usable update" in capsys.readouterr().err
    recorder.record_failure("failed", "the server's state holds NaN")
    assert report_run("finished:failed", tmp_path / "run") == 1
    assert "holds NaN" in capsys.readouterr().err
    Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic", num_clients=2,
             num_rounds=6, config={}, partition={})  # a new start forgets the old failure
    assert report_run("finished:failed", tmp_path / "run") == 1
    assert "; " not in capsys.readouterr().err.split("(status:")[1].split(")")[0]


def test_fedavg_averages_the_whole_model_weighted_by_samples(rng):
    strategy = make_strategy("fedavg", num_clients=2, arch_mix="cnn5", feature_dim=500,
                             sizes=[30, 10])
    manager, proxies = client_manager(strategy)
    [(_, ins), _] = strategy.configure_fit(1, None, manager)
    sent = decode(ins.parameters)
    n_floats = sum(a.size for a in sent.values())
    assert wire_size(ins.parameters).data == n_floats * 4
    a = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in sent.items()}
    b = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in sent.items()}
    strategy.aggregate_fit(1, [(proxies[0], fit_res(a, 30, 0, "cnn5")),
                               (proxies[1], fit_res(b, 10, 1, "cnn5"))], [])
    for k in sent:
        np.testing.assert_allclose(strategy.global_model[k], 0.75 * a[k] + 0.25 * b[k],
                                   rtol=1e-5, atol=1e-6)
    # Evaluation uses the global model, not the clients' last local updates.
    [(_, eval_ins), _] = strategy.configure_evaluate(1, None, manager)
    np.testing.assert_array_equal(decode(eval_ins.parameters)["head.bias"],
                                  strategy.global_model["head.bias"])


def test_standalone_moves_nothing(rng):
    strategy = make_strategy("standalone", num_clients=2, sizes=[10, 10])
    manager, proxies = client_manager(strategy)
    instructions = strategy.configure_fit(1, None, manager)
    assert all(wire_size(ins.parameters).total == 0 for _, ins in instructions)
    strategy.aggregate_fit(1, [(p, fit_res({}, 10, i, a))
                               for i, (p, a) in enumerate(zip(proxies, ["cnn1", "cnn2"]))], [])
    assert strategy._counts["clients_fit"] == 2


def test_sampling_is_deterministic_and_respects_fraction():
    picks = []
    for _ in range(2):
        strategy = make_strategy("standalone", num_clients=10, fraction_fit=0.3, seed=4)
        manager, _ = client_manager(strategy)
        picks.append([[p.cid for p, _ in strategy.configure_fit(r, None, manager)]
                      for r in (1, 2, 3)])
    assert picks[0] == picks[1]
    assert all(len(round_) == 3 for round_ in picks[0])
    assert len({tuple(r) for r in picks[0]}) > 1  # rounds differ


def test_a_partition_uploading_twice_in_a_round_counts_once(rng):
    # Two nodes that both claim partition 0 (a misconfigured deployment, or a forger).
    strategy = make_strategy("lg-fedavg", num_clients=2, arch_mix="cnn1", sizes=[10, 10])
    manager, proxies = client_manager(strategy, [{"partition-id": 0, "arch": "cnn1"}] * 2)
    strategy.configure_fit(1, None, manager)
    a, b = _heads(rng, 2)
    strategy.aggregate_fit(1, [(proxies[0], fit_res(a, 10, 0, "cnn1")),
                               (proxies[1], fit_res(b, 10, 0, "cnn1"))], [])
    np.testing.assert_array_equal(strategy.global_head["head.weight"], a["head.weight"])
    assert strategy._counts["rejected"] == 1


def test_too_few_clients_is_a_clear_error_not_a_hang(caplog):
    strategy = make_strategy("standalone", num_clients=3, wait_for_clients_seconds=2)
    manager, _ = client_manager(strategy, identities=[{"partition-id": 0, "arch": "cnn1"},
                                                      {"partition-id": 1, "arch": "cnn2"}])
    with pytest.raises(RoundFailed, match="only 2 of num-clients=3 .* num-supernodes=3"):
        strategy.configure_fit(1, None, manager)
    assert "waiting for clients: 2 of num-clients=3" in caplog.text


@pytest.mark.parametrize("dp", [False, True])
def test_once_the_federation_has_met_a_node_that_left_does_not_hold_the_rounds(dp, caplog):
    # Round 1 waits for every partition; after it, a node gone for good (unregistered, as the
    # SuperLink does once it misses its heartbeats) leaves the round to the others. Under DP
    # the accountant counts each round's sampling over num-clients, so the server still waits.
    dp_settings = {"differential_privacy": True, "dp_noise_multiplier": 1.0,
                   "dp_clip_norm": 1.0} if dp else {}
    strategy = make_strategy("lg-fedavg", num_clients=3, arch_mix="cnn1,cnn2,cnn3",
                             wait_for_clients_seconds=1, **dp_settings)
    manager, proxies = client_manager(strategy)
    assert len(strategy.configure_fit(1, None, manager)) == 3
    manager.unregister(proxies[2])
    if dp:
        with pytest.raises(RoundFailed, match="only 2 of num-clients=3"):
            strategy.configure_fit(2, None, manager)
        return
    chosen = strategy.configure_fit(2, None, manager)
    assert sorted(strategy.clients[p.cid].partition_id for p, _ in chosen) == [0, 1]
    assert "partition(s) [2] not connected: the round goes on with the 2 others" in caplog.text


def test_clients_are_identified_first_and_ordered_by_partition_not_node_id():
    strategy = make_strategy("standalone", num_clients=3, arch_mix="cnn1,cnn2,cnn3")
    identities = [{"partition-id": 2, "arch": "cnn3"}, None,  # this one crashes
                  {"partition-id": 0, "arch": "cnn1"}]
    manager, proxies = client_manager(strategy, identities)
    listed = strategy.list_clients(manager)
    assert [strategy.clients[p.cid].partition_id for p in listed] == [0, 2]
    assert proxies[1].cid not in strategy.clients


@pytest.mark.parametrize("engine_knows", [3, 2])
def test_a_simulation_identifies_its_clients_from_the_engine_without_a_message(engine_knows):
    # Every client would crash if asked; the engine's node -> partition assignment answers for
    # all of them, unless it does not cover the federation (then they are asked, and crash).
    strategy = make_strategy("standalone", num_clients=3, arch_mix="cnn1,cnn2,cnn3")
    manager, proxies = client_manager(strategy, [None, None, None])
    for k, proxy in enumerate(proxies):
        proxy.node_id = 100 + k
    assigned = {100: 2, 101: 0, 102: 1}
    strategy.node_partitions = lambda: dict(list(assigned.items())[:engine_knows])
    listed = strategy.list_clients(manager)
    if engine_knows < 3:
        assert listed == [] and strategy.clients == {}
        return
    assert [p.node_id for p in listed] == [101, 102, 100]
    assert [(strategy.clients[p.cid].partition_id, strategy.clients[p.cid].arch)
            for p in proxies] == [(2, "cnn3"), (0, "cnn1"), (1, "cnn2")]


def test_a_client_cannot_change_identity_midway(rng):
    strategy = make_strategy("lg-fedavg", num_clients=2, arch_mix="cnn1", sizes=[10, 10])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    a, b = _heads(rng, 2)
    strategy.aggregate_fit(1, [(proxies[0], fit_res(a, 10, 0, "cnn1")),
                               (proxies[1], fit_res(b, 10, 0, "cnn1"))], [])
    assert strategy._counts["rejected"] == 1
    assert strategy.clients[proxies[1].cid].partition_id == 1


def test_a_node_cannot_squat_a_partition_bound_to_another():
    # Node "node-919" (really partition 1's) answers first, claiming partition 0; with
    # partition-nodes binding 0 to node-000 it is refused, and the honest node is not.
    strategy = make_strategy("standalone", num_clients=2, arch_mix="cnn1",
                             partition_nodes="0=node-000, 1=node-919")
    manager, proxies = client_manager(strategy, [{"partition-id": 0, "arch": "cnn1"},
                                                 {"partition-id": 0, "arch": "cnn1"}])
    listed = strategy.list_clients(manager)
    assert [p.cid for p in listed] == ["node-000"]
    assert strategy.clients["node-000"].partition_id == 0


@pytest.mark.parametrize("value", ["0=a,0=b", "0=a,1=a", "5=a", "x", "0=", "0=a=b"])
def test_partition_nodes_is_validated(value):
    from fedapp.config import ConfigError
    with pytest.raises(ConfigError, match="partition-nodes"):
        make_strategy("standalone", num_clients=2, partition_nodes=value)


def test_server_seconds_is_the_strategys_own_work_not_the_wait_for_clients(tmp_path,
                                                                           monkeypatch):
    # A clock that moves only where the test says: 100 s in each wait for clients
    # (list_clients), 50 s of the clients' training between Flower's calls, 2 s in the
    # method's server step. The round's record counts the 2 s alone.
    import json
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from fedapp.runtime import strategy_base
    from fedapp.runtime.payload import to_ndarrays
    clock = {"t": 0.0}
    monkeypatch.setattr(strategy_base.time, "perf_counter", lambda: clock["t"])
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=3, num_rounds=1, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder, num_clients=3, arch_mix="cnn1",
                             sizes=[10, 10, 10])
    manager, proxies = client_manager(strategy)
    waits = manager.wait_for

    def slow_wait(*args, **kwargs):
        clock["t"] += 100.0
        return waits(*args, **kwargs)
    monkeypatch.setattr(manager, "wait_for", slow_wait)
    step = strategy.aggregate

    def slow_step(*args):
        clock["t"] += 2.0
        return step(*args)
    monkeypatch.setattr(strategy, "aggregate", slow_step)
    strategy.configure_fit(1, None, manager)
    clock["t"] += 50.0
    strategy.aggregate_fit(1, [(p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
        to_ndarrays(strategy.global_head)), 10, {"partition-id": i, "arch": "cnn1"}))
        for i, p in enumerate(proxies)], [])
    strategy.configure_evaluate(1, None, manager)
    clock["t"] += 50.0
    strategy.aggregate_evaluate(1, [(p, eval_res(i, "cnn1", 0.5))
                                    for i, p in enumerate(proxies)], [])
    [record] = [json.loads(line) for line in
                (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert record["server_seconds"] == 2.0
