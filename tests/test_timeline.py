"""``fedapp.runtime.timeline``: a deployed message's timestamps in every process on its way,
joined by its id."""

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


def test_phases_join_each_messages_marks_and_add_up_to_the_round_trip():
    def message(i, t):  # every mark of message i, one second apart from t on
        return [{"kind": "server", "id": i, "pushed": t, "replied": t + 12.0},
                {"kind": "supernode", "id": i, "received": t + 1.0},
                {"kind": "clientapp", "id": i, **{k: t + 2.0 + n for n, k in enumerate(
                    ("forked", "connected", "listed", "pulled", "installed", "loaded",
                     "handled"))}, "pushed": t + 9.5, "exited": t + 20.0},
                {"kind": "supernode", "id": i, "reply_seen": t + 9.0, "reply_told": t + 9.5},
                {"kind": "supernode", "id": i, "reply_sent": t + 10.0}]
    lines = [*message("a", 0.0), *message("b", 100.0), *message("c", 200.0)[:3],
             {"kind": "server", "id": "lost", "pushed": 300.0, "replied": 301.0}]
    rows = timeline.phases(lines)
    assert len(rows) == 2                   # "c" lacks the SuperNode's reply marks, "lost" all
    for row in rows:
        assert row["total"] == 12.0
        assert [row[name] for name, _, _ in timeline.PHASES] == [1.0] * 9 + [0.5, 0.5, 2.0]
    assert timeline.phases(lines, last=3) == rows[1:]   # only "b" of the last three pushes


def test_the_supernode_marks_a_message_its_replys_sight_and_its_sending(tmp_path, monkeypatch):
    from fedapp.cli import prompt_supernode
    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    tree = SimpleNamespace(object_id="m1")
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))

    def pull_and_store(*, receive, **kwargs):   # Flower's step: receive, then store
        receive()
        return 5

    def push(*, send, **kwargs):                 # Flower's step: wait for the reply, send it
        send(reply, tree, 0.1)

    loop = SimpleNamespace(_pull_and_store_message=pull_and_store, _push_messages=push)
    prompt_supernode.trace(loop)
    assert loop._pull_and_store_message(receive=lambda: ("message", tree), state=None) == 5
    loop._push_messages(send=lambda *a: None, state=None)
    marks = {k: v for x in timeline.read(tmp_path) for k, v in x.items() if x["id"] == "m1"}
    assert marks["received"] <= marks["reply_seen"] <= marks["reply_told"] <= marks["reply_sent"]


def test_the_clientapp_marks_its_handling_of_each_message(tmp_path, monkeypatch):
    from fedapp import client_app
    message = SimpleNamespace(metadata=SimpleNamespace(message_id="m3"))
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert client_app.timeline_marks(message, "ctx", lambda m, c: "reply") == "reply"
    assert not list(tmp_path.iterdir())                      # off: nothing written
    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    assert client_app.timeline_marks(message, "ctx", lambda m, c: "reply") == "reply"
    (line,) = timeline.read(tmp_path)
    assert line["kind"] == "handler" and line["id"] == "m3" and line["left"] >= line["entered"]
    assert client_app.timeline_marks in client_app.app._mods  # every message passes it


def test_a_simulated_messages_way_in_three_phases(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    for i, t in enumerate((0.0, 10.0)):
        timeline.write("server", id=f"m{i}", pushed=t, replied=t + 2.0)
        timeline.write("handler", id=f"m{i}", entered=t + 0.25, left=t + 1.5)
    rows = timeline.phases(timeline.read(tmp_path), way=timeline.SIMULATED_PHASES)
    assert [[r[name] for name, _, _ in timeline.SIMULATED_PHASES] for r in rows] == \
        [[0.25, 1.25, 0.5]] * 2
    table = timeline.breakdown(tmp_path, last=1, way=timeline.SIMULATED_PHASES)
    assert "(1 messages" in table[0] and table[-1] == "| total | 2.000 (2.000-2.000) |"


def test_handover_gaps_count_an_actors_idle_time_while_the_next_message_waits():
    lines = [{"kind": "server", "id": i, "pushed": 0.0 if i != "late" else 9.0, "replied": 20.0}
             for i in ("a", "b", "c", "late", "other")]
    lines += [{"kind": "handler", "id": "a", "entered": 0.1, "left": 1.0, "pid": 1},
              {"kind": "handler", "id": "b", "entered": 1.2, "left": 2.0, "pid": 1},
              {"kind": "handler", "id": "c", "entered": 2.5, "left": 3.0, "pid": 1},
              # pushed after "c" was handed back: the actor was idle, not the engine's cost
              {"kind": "handler", "id": "late", "entered": 9.1, "left": 9.5, "pid": 1},
              {"kind": "handler", "id": "other", "entered": 1.1, "left": 1.4, "pid": 2}]
    assert timeline.handover_gaps(lines) == pytest.approx([0.2, 0.5])
    assert timeline.handover_gaps(lines, last=2) == []   # "late" and "other": one each
    assert timeline.handled_seconds(lines) == pytest.approx(0.9 + 0.8 + 0.5 + 0.4 + 0.3)
    assert timeline.handled_seconds(lines, last=2) == pytest.approx(0.4 + 0.3)


def test_between_rounds_returns_at_once_unless_a_pause_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.PAUSE_ENV, raising=False)
    timeline.between_rounds(3, limit=0.0)
    monkeypatch.setenv(timeline.PAUSE_ENV, str(tmp_path))
    (tmp_path / "round-3.go").touch()
    timeline.between_rounds(3, limit=0.0)
    assert (tmp_path / "round-3.done").exists()


def test_a_pause_without_its_go_fails_after_its_limit(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline.PAUSE_ENV, str(tmp_path))
    with pytest.raises(TimeoutError, match="round-4.go"):
        timeline.between_rounds(4, limit=0.1)
