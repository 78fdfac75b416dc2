"""``PromptGrid``: the synchronous driver's wait for replies, without Flower's 3 s sleeps."""

from __future__ import annotations

import threading
import time
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
    # Flower's HTTP grid sleeps 3 s between pulls; this looks 0.05 s after the push, waits
    # 1.5x longer each time and never more than 0.1 s.
    assert sleeps[0] == pytest.approx(0.05)
    assert all(b == pytest.approx(min(a * 1.5, 0.1)) for a, b in zip(sleeps, sleeps[1:]))
    assert max(sleeps) == 0.1 and len(sleeps) == 12


def test_a_timeout_returns_the_replies_that_came_and_stops_looking():
    grid = FakeGrid(arrive_at=[1, 10**9])
    prompt = PromptGrid(grid)
    replies = prompt.send_and_receive(["a", "b"], timeout=0.3)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    pulls = grid.pulls
    time.sleep(0.3)
    assert grid.pulls <= pulls + 1 and prompt._poller is None   # m1 is not pulled any more


def test_a_failed_pull_is_raised_by_every_waiting_call():
    class Broken(FakeGrid):
        def pull_messages(self, ids):
            raise ConnectionError("SuperLink gone")

    with pytest.raises(ConnectionError, match="SuperLink gone"):
        PromptGrid(Broken(arrive_at=[1])).send_and_receive(["a"])


def test_one_poller_pulls_for_every_waiting_call_and_hands_each_its_reply():
    # Flower's driver awaits each client's reply from a thread of its own: one look at the
    # SuperLink serves them all, however many wait.
    class Grid:
        def __init__(self):
            self.lock, self.count, self.pulls = threading.Lock(), 0, []

        def push_messages(self, messages):
            with self.lock:
                self.count += 1
                return [f"m{self.count}"]

        def pull_messages(self, ids):
            self.pulls.append((threading.get_ident(), len(ids)))
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i))
                    for i in ids if len(self.pulls) >= 3]   # every reply on the third look

    grid, calls = Grid(), 30
    prompt = PromptGrid(grid)
    barrier, got = threading.Barrier(calls), {}

    def client(k):
        barrier.wait()
        got[k] = [r.metadata.reply_to_message_id for r in prompt.send_and_receive([k])]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(m for replies in got.values() for m in replies) == sorted(
        f"m{k}" for k in range(1, calls + 1))
    assert all(len(replies) == 1 for replies in got.values())
    assert len({ident for ident, _ in grid.pulls}) == 1      # one poller thread
    assert len(grid.pulls) < calls                           # not a pull per waiting call


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
