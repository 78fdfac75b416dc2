"""Faults on purpose (crashing and stalling clients) and what the server makes of failures."""

from __future__ import annotations

import gc
import signal
import time
import tracemalloc

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedapp.runtime.client_base import InjectedFault
from fedapp.runtime.results import Recorder
from strategies import METHODS
from tests.conftest import cfg_of, client_manager, eval_res, fit_res, make_strategy


def _crashes(cfg, rounds, clients):
    """{(pid, round)} of the clients that crash, asking the real clients."""
    crashed = set()
    for pid in range(clients):
        context = Context(run_id=1, node_id=pid, state=RecordDict(), run_config={},
                          node_config={"partition-id": pid, "num-partitions": clients})
        client = METHODS[cfg.method].client(context, cfg)
        for rnd in range(1, rounds + 1):
            try:
                client.inject_faults(rnd)
            except InjectedFault as exc:
                assert f"partition {pid} crashes in round {rnd}" in str(exc)
                crashed.add((pid, rnd))
    return crashed


def test_crashes_follow_the_seed_and_the_fraction():
    cfg = cfg_of(method="standalone", num_clients=10, fault_crash_fraction=0.2)
    crashed = _crashes(cfg, 50, 10)
    assert crashed == _crashes(cfg, 50, 10)  # the same clients in the same rounds
    # 500 Bernoulli(0.2) draws: 100 expected, std 8.9; 5 std either way.
    assert 55 <= len(crashed) <= 145
    assert _crashes(cfg_of(method="standalone", num_clients=10, fault_crash_fraction=0.2,
                           seed=1), 50, 10) != crashed
    assert not _crashes(cfg_of(method="standalone", num_clients=10), 50, 10)


def test_stalled_clients_stall_for_the_set_time(monkeypatch):
    slept = []
    monkeypatch.setattr("fedapp.runtime.client_base.time.sleep", slept.append)
    cfg = cfg_of(method="standalone", num_clients=2, fault_stall_fraction=1.0,
                 fault_stall_seconds=7.5)
    _crashes(cfg, 3, 2)
    assert slept == [7.5] * 6


def test_a_client_gives_up_at_the_round_deadline():
    # A client stalled for 60 s in a run with round-timeout = 1 s gives up after 1 s instead
    # of holding what runs it (in simulation a Ray actor that other clients queue for); the
    # server has counted it failed by then anyway. Without a deadline it would sleep 60 s.
    from fedapp.runtime.client_base import DeadlineExceeded
    cfg = cfg_of(method="standalone", num_clients=2, fault_stall_fraction=1.0,
                 fault_stall_seconds=60.0, round_timeout=1.0)
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "num-partitions": 2})
    client = METHODS[cfg.method].client(context, cfg)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="round-timeout = 1 s"):
        client.fit([], {"server-round": 1})
    assert time.monotonic() - start < 10
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed
    # The same client in time: the deadline changes nothing.
    cfg = cfg_of(method="standalone", num_clients=2, round_timeout=60.0, dataset="synthetic",
                 synthetic_train=60, synthetic_test=30, model_width=0.25)
    _, n, metrics = METHODS[cfg.method].client(context, cfg).fit([], {"server-round": 1})
    assert n > 0 and metrics["partition-id"] == 0


def test_the_round_deadline_reaches_flower():
    from fedapp.server_app import server_fn
    context = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                      run_config={"dataset": "synthetic", "num-clients": 3, "round-timeout": 9.0,
                                  "output-dir": "/tmp/fedapp-test-deadline",
                                  "max-samples-per-client": 0, "partition": "iid"})
    assert server_fn(context).config.round_timeout == 9.0


def test_long_run_with_crashing_clients_keeps_server_memory_flat(tmp_path):
    # 200 rounds, 20 % of the clients crashing each round (seeded), honest uploads from the
    # others: every round completes, failures are recorded by partition, and the server's
    # Python heap grows by no more than the rounds' own records (bound: 4 KiB per round).
    clients, rounds = 5, 200
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=clients, num_rounds=rounds + 1, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder, num_clients=clients, arch_mix="cnn1",
                             sizes=[20] * clients)
    manager, proxies = client_manager(strategy)
    rng = np.random.default_rng(0)
    head = {k: rng.normal(size=v.shape).astype(np.float32)
            for k, v in strategy.global_head.items()}
    failed = []

    def one_round(rnd):
        crash = rng.random(clients) < 0.2
        strategy.configure_fit(rnd, None, manager)
        results = [(p, fit_res(head, 20, i, "cnn1")) for i, p in enumerate(proxies)
                   if not crash[i]]
        strategy.aggregate_fit(rnd, results, [RuntimeError("crashed")] * int(crash.sum()))
        strategy.configure_evaluate(rnd, None, manager)
        strategy.aggregate_evaluate(rnd, [(p, eval_res(i, "cnn1", 0.5))
                                          for i, p in enumerate(proxies)], [])
        failed.append(sorted(np.flatnonzero(crash).tolist()))

    for rnd in range(1, 21):  # warm-up: caches, first allocations
        one_round(rnd)
    # pytest keeps every logged warning for its report: that is the harness's memory, not the
    # server's, so allocations made inside the logging machinery are left out of the count.
    harness = [tracemalloc.Filter(False, "*/logging/*"), tracemalloc.Filter(False, "*/_pytest/*")]

    def heap() -> int:
        gc.collect()
        return sum(s.size for s in tracemalloc.take_snapshot().filter_traces(harness)
                   .statistics("filename"))

    tracemalloc.start()
    before = heap()
    for rnd in range(21, rounds + 1):
        one_round(rnd)
    growth = heap() - before
    tracemalloc.stop()
    assert growth < 4096 * (rounds - 20), f"{growth} bytes over {rounds - 20} rounds"
    assert [h["failed_clients"] for h in recorder.history] == failed
    summary = recorder.summary()
    assert summary["failures"] == sum(map(len, failed))
    assert sum(summary["failed_clients"].values()) == summary["failures"]


@pytest.mark.parametrize("key,value", [("fault-crash-fraction", 1.5),
                                       ("round-timeout", -1.0)])
def test_fault_settings_are_validated(key, value):
    from fedapp.config import ConfigError
    with pytest.raises(ConfigError, match=key):
        cfg_of(**{key.replace("-", "_"): value})
