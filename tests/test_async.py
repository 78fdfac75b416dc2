"""The asynchronous loop (server-loop = "async"), in process: a fake Grid runs the real
ClientApp on each message and delivers the replies in an order of its choosing, so that what
the virtual clock promises (one seed, one commit order, one result, whatever the arrival order)
and what the loop must survive (failures, hostile uploads, dropped clients) can be checked.
The same loop against a real `flwr run` is in test_flwr_run.py, against SuperNodes over TLS in
test_deploy.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.compat.common.recorddict_compat import recorddict_to_fitins, recorddict_to_fitres
from flwr.supercore.task_identity import TaskIdentity

from fedapp import client_app
from fedapp.config import ConfigError, pyproject_defaults
from fedapp.loops.asynchronous import AsyncLoop
from fedapp.runtime.results import Recorder
from fedapp.runtime.speeds import speed_factors
from strategies import METHODS, load_config


class FakeGrid:
    """What the loop needs of a Flower Grid. Each pushed message is answered by the real
    ClientApp of its node; ``shuffle`` delivers the replies in a seeded random order, a few at
    a time; ``break_reply(pid, update, message)`` may replace a training reply."""

    def __init__(self, run_config: dict, num_nodes: int, shuffle: int | None = None,
                 break_reply=None) -> None:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
        self.run = SimpleNamespace(run_id=7)
        self.contexts = {
            1000 + pid: Context(run_id=7, node_id=1000 + pid, state=RecordDict(),
                                run_config=run_config,
                                node_config={"partition-id": pid, "num-partitions": num_nodes})
            for pid in range(num_nodes)}
        self.pending: dict[str, Message] = {}
        self.answered: set[str] = set()
        self.rng = random.Random(shuffle) if shuffle is not None else None
        self.break_reply = break_reply
        self.in_flight_per_node: dict[int, int] = {}
        self.count = 0
        self.trains: list[tuple[int, dict, list[bytes], list[bytes]]] = []  # (pid, config,
        # the tensors sent, the tensors replied) of every answered train message

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            self.count += 1
            mid = f"m{self.count}"
            message.metadata.__dict__["_message_id"] = mid
            node = message.metadata.dst_node_id
            self.in_flight_per_node[node] = self.in_flight_per_node.get(node, 0) + 1
            assert self.in_flight_per_node[node] == 1, "two messages in flight to one node"
            self.pending[mid] = message
            ids.append(mid)
        return ids

    def send_and_receive(self, messages, *, timeout=None):  # get_properties, at start
        return [self._answer(m) for m in messages]

    def pull_messages(self, message_ids):
        # As the SuperLink: an id whose reply was already pulled answers "unavailable".
        gone = [mid for mid in message_ids if mid in self.answered]
        assert not gone, f"pulled again after their replies came: {gone}"
        ready = [mid for mid in message_ids if mid in self.pending]
        if self.rng is not None:
            self.rng.shuffle(ready)
            ready = ready[:self.rng.randint(1, 3)]
        replies = []
        for mid in ready:
            message = self.pending.pop(mid)
            self.answered.add(mid)
            self.in_flight_per_node[message.metadata.dst_node_id] -= 1
            replies.append(self._answer(message))
        return replies

    def _answer(self, message: Message) -> Message:
        context = self.contexts[message.metadata.dst_node_id]
        try:
            reply = client_app.app(message, context)
        except Exception as exc:  # as a SuperNode reports a ClientApp that raised
            return Message(Error(code=2, reason=repr(exc)), reply_to=message)
        if message.metadata.message_type != "train":
            return reply
        pid = context.node_config["partition-id"]
        if self.break_reply is not None:
            update = int(message.content["fitins.config"]["server-round"])
            reply = self.break_reply(pid, update, message, reply) or reply
        if not reply.has_error():
            self.trains.append((pid, dict(message.content["fitins.config"]),
                                recorddict_to_fitins(message.content, True).parameters.tensors,
                                recorddict_to_fitres(reply.content, True).parameters.tensors))
        return reply


def run_config(**overrides) -> dict:
    """The smoke preset in the asynchronous loop, small: synthetic data, 3 clients."""
    flat = pyproject_defaults()
    flat.update({"method": "fedhe", "dataset": "synthetic", "synthetic-train": 240,
                 "synthetic-test": 90, "num-clients": 4, "num-server-rounds": 3,
                 "max-samples-per-client": 0, "arch-mix": "cnn1,cnn2", "model-width": 0.25,
                 "server-loop": "async", "local-steps": 2, "batch-size": 16})
    flat.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return flat


def run_async(tmp_path, name, shuffle=None, break_reply=None, flat=None, loop=AsyncLoop,
              grid_out=None, **overrides):
    """(summary, updates.jsonl lines, strategy) of an asynchronous run on the fake grid, of
    ``run_config(**overrides)`` or of a whole flat run config ``flat``; ``loop``: another
    loop over the same grid; ``grid_out``: a list that receives the grid."""
    flat = flat or run_config(**overrides)
    cfg = load_config(flat)
    rounds = AsyncLoop.evaluations_of(cfg)
    recorder = Recorder(tmp_path / name, method=cfg.method, dataset=cfg.dataset,
                        num_clients=cfg.num_clients, num_rounds=rounds, config={},
                        partition={})
    strategy = METHODS[cfg.method].strategy(cfg, recorder, input_shape=(1, 28, 28),
                                            num_classes=10)
    grid = FakeGrid(flat, cfg.num_clients, shuffle=shuffle, break_reply=break_reply)
    if grid_out is not None:
        grid_out.append(grid)
    summary = loop(grid, strategy, recorder).run()
    updates = [json.loads(line) for line in
               (tmp_path / name / "updates.jsonl").read_text().splitlines()]
    return summary, updates, strategy


def _commits(updates):
    return [(u["client"], u["client_update"], u["staleness"]) for u in updates]


def test_the_virtual_clock_gives_one_result_whatever_the_arrival_order(tmp_path):
    kwargs = dict(slow_fraction=0.25, slowdown=3.0, speed_jitter=0.2, async_concurrency=3)
    a, ua, sa = run_async(tmp_path, "a", shuffle=None, **kwargs)
    b, ub, sb = run_async(tmp_path, "b", shuffle=5, **kwargs)
    assert _commits(ua) == _commits(ub)
    assert a["accuracy"]["per_client"] == b["accuracy"]["per_client"]
    assert [h["accuracy_mean"] for h in a["history"]] == [h["accuracy_mean"] for h in b["history"]]
    la, xa = sa.store.averages()
    lb, xb = sb.store.averages()
    assert np.array_equal(la, lb) and np.array_equal(xa, xb)
    # Commits follow the virtual finish times, and the budget is num-server-rounds x clients.
    assert [u["virtual_end"] for u in ua] == sorted(u["virtual_end"] for u in ua)
    assert a["updates"]["committed"] == 12 and len(a["history"]) == 3
    # The check has teeth: taken as they arrive, the same shuffled replies commit otherwise.
    _, uc, _ = run_async(tmp_path, "c", shuffle=5, clock="arrival", **kwargs)
    assert _commits(uc) != _commits(ua)


def test_slow_clients_update_less_and_arrive_stale(tmp_path):
    summary, updates, _ = run_async(tmp_path, "s", slow_fraction=0.25, slowdown=4.0,
                                    num_server_rounds=6)
    cfg = load_config(run_config(slow_fraction=0.25, slowdown=4.0))
    slow = [pid for pid, f in enumerate(speed_factors(cfg)) if f > 1]
    assert len(slow) == 1
    per_client = summary["updates"]["per_client"]
    fast = [n for pid, n in per_client.items() if int(pid) not in slow]
    # Over 24 updates a 4x slower client updates about a quarter as often as each fast one.
    assert per_client[str(slow[0])] * 3 <= min(fast)
    stale = [u["staleness"] for u in updates if u["client"] == slow[0] and u["client_update"] > 1]
    assert min(stale) >= 3  # the fast clients committed meanwhile
    assert summary["staleness"]["max"] == max(u["staleness"] for u in updates)
    # Each committed update says where it trained (these clients run in this process).
    from fedapp.runtime.training import pick_device
    assert {u.get("device") for u in updates if u["status"] == "ok"} == {str(pick_device())}
    # With no stragglers every client gets the same number of updates.
    even, _, _ = run_async(tmp_path, "e", num_server_rounds=2)
    assert set(even["updates"]["per_client"].values()) == {2}


def test_at_most_k_clients_train_at_once(tmp_path):
    _, updates, _ = run_async(tmp_path, "k", async_concurrency=2)
    most = 0
    for u in updates:
        overlapping = [v for v in updates if v["virtual_start"] < u["virtual_end"]
                       and u["virtual_start"] < v["virtual_end"]]
        assert len(overlapping) <= 2
        most = max(most, len(overlapping))
    assert updates and most == 2  # two do train at once: not a serial loop


def test_a_hostile_upload_is_rejected_and_the_loop_goes_on(tmp_path, caplog):
    import logging

    from fedapp.runtime.payload import from_ndarrays, to_ndarrays
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common.recorddict_compat import (fitres_to_recorddict,
                                                      recorddict_to_fitres)

    def poison(pid, update, message, reply):
        if (pid, update) != (1, 2):
            return None
        res = recorddict_to_fitres(reply.content, keep_input=True)
        arrays = from_ndarrays(parameters_to_ndarrays(res.parameters))
        arrays["logits"][0, 0] = np.nan
        res.parameters = ndarrays_to_parameters(to_ndarrays(arrays))
        return Message(fitres_to_recorddict(res, keep_input=True), reply_to=message)

    with caplog.at_level(logging.WARNING):
        summary, updates, _ = run_async(tmp_path, "h", break_reply=poison)
    bad = [u for u in updates if u["status"] == "rejected"]
    assert [(u["client"], u["client_update"]) for u in bad] == [(1, 2)]
    assert "non-finite" in bad[0]["reason"] or "NaN" in bad[0]["reason"]
    assert "rejected the upload of client 1" in caplog.text
    assert summary["updates"]["rejected"] == 1 and summary["updates"]["committed"] == 12
    assert summary["rejected_clients"] == {"1": 1}


def test_a_failing_client_is_retried_then_dropped(tmp_path, caplog):
    import logging

    def crash(pid, update, message, reply):
        if pid == 2 and update >= 2:
            return Message(Error(code=2, reason="boom"), reply_to=message)
        return None

    with caplog.at_level(logging.WARNING):
        summary, updates, _ = run_async(tmp_path, "f", break_reply=crash, async_retries=1)
    failed = [u for u in updates if u["status"] == "failed"]
    assert [u["client"] for u in failed] == [2, 2]  # the first try and one retry
    assert "client 2 failed 2 times in a row and is dropped" in caplog.text
    assert summary["updates"]["committed"] == 12  # the others did client 2's share
    assert summary["updates"]["per_client"]["2"] == 1
    assert "2" not in summary["accuracy"]["per_client"]  # dropped: not evaluated at the end


def test_too_few_nodes_fail_the_run_with_a_message(tmp_path):
    from fedapp.runtime.strategy_base import RoundFailed
    flat = run_config(wait_for_clients_seconds=1)
    cfg = load_config(flat)
    recorder = Recorder(tmp_path / "few", method="fedhe", dataset="synthetic", num_clients=4,
                        num_rounds=3, config={}, partition={})
    strategy = METHODS["fedhe"].strategy(cfg, recorder, input_shape=(1, 28, 28),
                                         num_classes=10)
    with pytest.raises(RoundFailed, match="only 3 of num-clients=4 clients connected"):
        AsyncLoop(FakeGrid(flat, 3), strategy, recorder).run()


def test_every_client_dropped_fails_the_run(tmp_path):
    from fedapp.runtime.strategy_base import RoundFailed

    def crash(pid, update, message, reply):
        return Message(Error(code=2, reason="boom"), reply_to=message)

    with pytest.raises(RoundFailed, match="every client was dropped"):
        run_async(tmp_path, "x", break_reply=crash, async_retries=0)


def test_evaluations_are_called_every_e_updates_and_at_the_end(tmp_path):
    summary, updates, _ = run_async(tmp_path, "ev", async_updates=10, async_eval_every=4)
    assert [h["updates"] for h in summary["history"]] == [4, 8, 10]
    assert all(h["evaluated"] == [0, 1, 2, 3] for h in summary["history"])
    assert [h["clients_fit"] for h in summary["history"]] == [4, 4, 2]
    assert summary["evaluated_rounds"] == [1, 2, 3]
    assert (tmp_path / "ev" / "timeline.png").stat().st_size > 5_000
    assert sum(u["bytes_up"] for u in updates) == summary["communication"]["bytes_up"] + \
        summary["communication"]["framing_bytes_up"]


def test_methods_that_aggregate_whole_rounds_are_refused():
    with pytest.raises(ConfigError, match="server-loop = 'async' is invalid for method 'fedgh'"):
        load_config(run_config(method="fedgh"))
    with pytest.raises(ConfigError, match="only synchronous rounds keep checkpoints"):
        load_config(run_config(checkpoint_every=1))


def test_fedapp_methods_says_which_methods_run_without_a_barrier(capsys):
    from fedapp.cli.main import main
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in METHODS)
    assert 'server-loop = "async" (no round barrier) runs: fd, fedhe, fedre, standalone\n' \
        in out
    assert 'server-loop = "walk" / "gossip" (device to device, the server only relays) runs: ' \
        'compfl' in out
