"""``fedapp.runtime.timeline``: a deployed message's timestamps at both ends, paired by id."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedapp.cli import warm_superexec
from fedapp.loops.grid_io import PromptGrid
from fedapp.runtime import timeline


def test_off_unless_a_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.write("server", id="m")
    assert not timeline.enabled() and not list(tmp_path.iterdir())


def test_the_driver_records_each_message_from_push_to_reply(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline.ENV, str(tmp_path))

    class Grid:
        pulls = 0

        def push_messages(self, messages):
            return ["m0", "m1"]

        def pull_messages(self, ids):
            self.pulls += 1
            reply = SimpleNamespace(reply_to_message_id=f"m{self.pulls - 1}")
            return [SimpleNamespace(metadata=reply)]

    PromptGrid(Grid()).send_and_receive(["a", "b"])
    lines = timeline.read(tmp_path)
    assert sorted(x["id"] for x in lines) == ["m0", "m1"]
    assert all(x["kind"] == "server" and x["replied"] >= x["pushed"] for x in lines)


def test_the_forked_clientapp_marks_each_step_of_flowers_run_clientapp(monkeypatch):
    from flwr.supernode.runtime import run_clientapp as flower
    message = SimpleNamespace(metadata=SimpleNamespace(message_id="m7"))
    # Stand-ins for Flower's steps; monkeypatch puts Flower's own back after the test.
    monkeypatch.setattr(flower, "pull_and_inflate_object_from_tree", lambda *a, **k: message)
    monkeypatch.setattr(flower, "pull_task_input", lambda client: (
        flower.pull_and_inflate_object_from_tree("tree"), "ctx", "run", "fab"))
    monkeypatch.setattr(flower, "install_from_fab", lambda *a, **k: None)
    monkeypatch.setattr(flower, "get_load_client_app_fn",
                        lambda **k: lambda *a: lambda message, context: "reply")
    monkeypatch.setattr(flower, "push_message", lambda *a: None)
    marks = warm_superexec._trace_clientapp()
    # The order run_clientapp calls them in (flwr 1.41).
    flower.pull_task_input("client")
    flower.install_from_fab(b"", skip_prompt=True)
    app = flower.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
        "id", "1", "hash")
    assert app(message=message, context="ctx") == "reply"
    flower.push_message("client", "reply", "ctx")
    assert marks["id"] == "m7"
    order = ["forked", "connected", "listed", "objects", "pulled", "installed", "loaded",
             "handled", "pushed"]
    assert [marks[k] for k in order] == sorted(marks[k] for k in order)


def test_phases_pair_the_two_ends_and_add_up_to_the_round_trip():
    lines = [{"kind": "server", "id": "a", "pushed": 0.0, "replied": 10.0},
             {"kind": "server", "id": "b", "pushed": 20.0, "replied": 27.0},
             {"kind": "server", "id": "lost", "pushed": 30.0, "replied": 31.0},
             {"kind": "server", "id": "c", "pushed": 40.0, "replied": 41.0},
             {"kind": "clientapp", "id": "c", "forked": 40.0, "connected": 40.0, "listed": 40.0,
              "pulled": 40.0, "installed": 40.0, "loaded": 40.0, "handled": 40.0,
              "pushed": 40.0, "exited": 40.0},
             {"kind": "clientapp", "id": "b", "forked": 21.0, "connected": 21.2, "listed": 21.3,
              "pulled": 21.5,
              "installed": 22.0, "loaded": 23.0, "handled": 25.0, "pushed": 25.5,
              "exited": 26.0}]
    rows = timeline.phases(lines)
    assert len(rows) == 2                                    # "a", "lost": one end only
    row = rows[0]
    assert row["total"] == 7.0
    assert sum(row[name] for name, _, _ in timeline.PHASES) == pytest.approx(7.0)
    assert row[timeline.PHASES[0][0]] == 1.0 and row[timeline.PHASES[-1][0]] == 1.5
    assert [r["total"] for r in timeline.phases(lines, last=2)] == [1.0]  # "lost", "c"
