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
