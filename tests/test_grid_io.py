"""``PromptGrid``: the synchronous driver's wait for replies, without Flower's 3 s sleeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedapp.loops import grid_io
from fedapp.loops.grid_io import PromptGrid


class FakeGrid:
    """Replies to message ``i`` appear on pull number ``arrive_at[i]`` (1-based)."""

    def __init__(self, arrive_at: list[int]) -> None:
        self.arrive_at = arrive_at
        self.pulls = 0
        self.run = SimpleNamespace(run_id=7)

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i))
                for i in sorted(ids) if self.arrive_at[int(i[1:])] == self.pulls]


@pytest.fixture
def sleeps(monkeypatch):
    waited: list[float] = []
    monkeypatch.setattr(grid_io.time, "sleep", waited.append)
    return waited


def test_waits_briefly_then_backs_off_and_returns_every_reply(sleeps):
    grid = FakeGrid(arrive_at=[1, 4, 12])
    replies = PromptGrid(grid).send_and_receive(["a", "b", "c"])
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert grid.pulls == 12  # stops at the pull that brought the last reply
    # Flower's HTTP grid sleeps 3 s between pulls; this starts at 0.05 s, grows by 1.5x and
    # never waits more than 0.25 s.
    assert sleeps[0] == pytest.approx(0.05)
    assert all(b == pytest.approx(min(a * 1.5, 0.25)) for a, b in zip(sleeps, sleeps[1:]))
    assert max(sleeps) == 0.25 and len(sleeps) == 11


def test_a_timeout_returns_the_replies_that_came(sleeps, monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(grid_io.time, "monotonic", lambda: float(next(clock)))
    grid = FakeGrid(arrive_at=[1, 50])
    replies = PromptGrid(grid).send_and_receive(["a", "b"], timeout=3.0)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert grid.pulls < 50


def test_everything_else_is_the_grids_own():
    grid = FakeGrid(arrive_at=[1])
    assert PromptGrid(grid).run.run_id == 7
    assert PromptGrid(grid).push_messages(["x"]) == ["m0"]


def test_a_deployment_waits_for_every_nodes_reply_at_once_not_in_waves():
    # Flower's driver sends a round's messages from a thread pool, each thread waiting for one
    # reply; Python's default pool has min(32, cores + 4) threads. Deployed, the pool has a
    # thread per client; simulated (the in-memory grid), Flower's own pool is kept.
    import threading
    import time as clock

    from flwr.common import Code
    from flwr.server.server import fit_clients
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from fedapp.server_app import deployed_server

    nodes = 40
    strategy = SimpleNamespace(cfg=SimpleNamespace(num_clients=nodes))
    components = SimpleNamespace(strategy=strategy, client_manager=None)
    assert deployed_server(InMemoryGrid.__new__(InMemoryGrid), components) is None
    server = deployed_server(FakeGrid([1]), components)
    assert server.max_workers == nodes

    lock, waiting, most = threading.Lock(), [0], [0]

    class Node:  # a client proxy whose reply comes once every node has been asked (or 2 s)
        def fit(self, ins, timeout, group_id):
            with lock:
                waiting[0] += 1
                most[0] = max(most[0], waiting[0])
            deadline = clock.monotonic() + 2.0
            while most[0] < nodes and clock.monotonic() < deadline:
                clock.sleep(0.01)
            with lock:
                waiting[0] -= 1
            return SimpleNamespace(status=SimpleNamespace(code=Code.OK))

    results, failures = fit_clients([(Node(), None) for _ in range(nodes)],
                                    max_workers=server.max_workers, timeout=None, group_id=1)
    assert len(results) == nodes and not failures
    assert most[0] == nodes          # every node's reply awaited at once
