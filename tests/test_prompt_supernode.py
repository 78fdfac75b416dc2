"""fedapp.cli.prompt_supernode: Flower's SuperNode with its loop's waits capped."""

from __future__ import annotations

import os
import time

import pytest

from fedapp.cli import prompt_supernode


def test_sleep_is_capped_and_everything_else_is_time_s_own(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    capped = prompt_supernode.CappedSleep(0.5)
    capped.sleep(3)     # Flower's idle wait for the SuperLink
    capped.sleep(0.5)   # Flower's wait for its own ClientApp's reply: a tenth of the poll
    capped.sleep(0.01)  # shorter waits are kept
    assert slept == [0.5, 0.05, 0.01]
    assert capped.time is time.time and capped.monotonic is time.monotonic


def test_after_a_message_the_node_looks_sooner_then_backs_off_to_the_poll(monkeypatch):
    # The loop as Flower 1.41 runs it: receive (a run id, or None when nothing came), and
    # after nothing, time.sleep(3). Our wrapper of the receiving step shortens the waits that
    # follow a message; an idle node's waits stay the poll.
    from flwr.supernode import start_client_internal as loop
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    inbox = iter([None, None, 7, None, None, None, None, None, None, 8, None])
    monkeypatch.setattr(loop, "_pull_and_store_message", lambda **kwargs: next(inbox))
    sleeper = prompt_supernode.CappedSleep(0.5)
    prompt_supernode.prompt_receiving(loop, sleeper)
    for _ in range(11):
        if loop._pull_and_store_message(object_store=None, pull_object=None) is None:
            sleeper.sleep(3)
    assert slept == [0.5, 0.5,                      # idle: the poll
                     0.05, 0.1, 0.2, 0.4, 0.5, 0.5,  # after message 7: soon, backing off
                     0.05]                           # after message 8: soon again
    sleeper.sleep(0.5)  # a wait on the node's own state is a tenth of the poll, as before
    assert slept[-1] == 0.05 and sleeper.next_look == 0.1


@pytest.fixture
def receiving(monkeypatch):
    """Flower 1.41's own receiving step, run on a real node state and object store with a
    message of two arrays, as the loop calls it; returns ``receive(store_class, wrapped)`` ->
    (the step's run id, for each pull how many of the message's objects were in the store
    already, the message's object count). Put back after the test: the task identity, the step."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import (get_all_nested_objects,
                                                             get_object_tree)
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.nodestate import NodeStateFactory

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    monkeypatch.setattr(loop, "_pull_and_store_message", loop._pull_and_store_message)
    message = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(4.0)),
                                                         "b": Array(np.ones(2))})}),
                      dst_node_id=5, message_type="train")
    objects, tree = get_all_nested_objects(message), get_object_tree(message)

    def receive(store_class: type[InMemoryObjectStore], wrapped: bool):
        store = store_class()
        state = NodeStateFactory(type("Stores", (), {"store": lambda self: store})()).state()
        state.store_run(Run.create_empty(7))
        if wrapped:
            prompt_supernode.prompt_receiving(loop, prompt_supernode.CappedSleep(0.5))
        there_before = []

        def pull_object(run_id: int, object_id: str) -> bytes:
            there_before.append(sum(bool(store.get(o)) for o in objects))
            return objects[object_id].deflate()
        run_id = loop._pull_and_store_message(
            state=state, object_store=store, node_config={}, receive=lambda: (message, tree),
            get_run=None, get_fab=None, pull_object=pull_object,
            confirm_message_received=lambda run_id, message_id: None, trusted_entities=None)
        return run_id, there_before, len(objects)
    receive.objects, receive.root = list(objects), tree.object_id
    return receive


def test_a_message_s_objects_are_stored_as_they_arrive(receiving):
    # Flower's step pulls every object (two at a time), then stores them all; wrapped, each is
    # in the node's store as soon as it is pulled, where the node's ClientApp finds it.
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    run_id, there_before, count = receiving(InMemoryObjectStore, wrapped=False)
    assert run_id == 7 and max(there_before) == 0
    run_id, there_before, count = receiving(InMemoryObjectStore, wrapped=True)
    assert run_id == 7 and count == 7 and max(there_before) >= count - 2


def test_a_clientapp_that_takes_the_message_at_once_does_not_fail_it(receiving):
    # The node's ClientApp pulls the objects from the store as they come and, with the last,
    # confirms, which deletes the message's objects from the store; the receiving step's own
    # puts that follow must not fail the message (they did when the step stored them again).
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore

    class ClientAppTakesAll(InMemoryObjectStore):
        def put(self, object_id: str, object_content: bytes) -> None:
            super().put(object_id, object_content)
            if all(self.get(o) for o in receiving.objects):
                self.delete(receiving.root)  # the ClientApp's confirmation

    for wrapped in (False, True):
        run_id, _, _ = receiving(ClientAppTakesAll, wrapped)
        assert run_id == 7


def test_install_caps_the_supernode_loop_of_this_flower_release(monkeypatch):
    from flwr.supernode import start_client_internal
    monkeypatch.setattr(start_client_internal, "time", time)   # undone after the test
    monkeypatch.setattr(start_client_internal, "_pull_and_store_message",
                        start_client_internal._pull_and_store_message)
    assert prompt_supernode.install(0.25)
    assert isinstance(start_client_internal.time, prompt_supernode.CappedSleep)
    assert start_client_internal.time.cap == 0.25
    # The module's waits are where this reads them: a Flower release that moves them is not
    # patched blindly.
    import inspect
    source = inspect.getsource(start_client_internal)
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source
    assert "pull_object_fn=lambda obj_id: pull_object(run_id, obj_id)" in source


def test_a_bad_poll_is_refused_with_its_name():
    assert prompt_supernode.poll_seconds(None) == prompt_supernode.DEFAULT_POLL_SECONDS
    assert prompt_supernode.poll_seconds("0.1") == 0.1
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit, match="FEDAPP_SUPERNODE_POLL_SECONDS"):
            prompt_supernode.poll_seconds(bad)


@pytest.fixture
def pulls(monkeypatch):
    """Flower's two object-pull functions, their waits and tries put back after the test, with
    neither of our environment variables set."""
    from fedapp.runtime import object_pulls
    from flwr.supercore.inflatable import inflatable_utils
    fns = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    for fn in fns:
        for key in ("initial_backoff", "backoff_cap", "max_tries_per_object",
                    "max_concurrent_pulls"):
            monkeypatch.setitem(fn.__kwdefaults__, key, fn.__kwdefaults__[key])
    monkeypatch.delenv(object_pulls.PULL_ENV, raising=False)
    monkeypatch.delenv(object_pulls.CAP_ENV, raising=False)
    monkeypatch.delenv(object_pulls.TRANSFERS_ENV, raising=False)
    return fns


def test_object_pulls_retry_sooner_than_flowers_first_second(monkeypatch, pulls):
    from fedapp.runtime import object_pulls
    assert object_pulls.prompt_object_pulls()
    assert [fn.__kwdefaults__["initial_backoff"] for fn in pulls] == [0.05, 0.05]
    # Waits double to 0.1 s at most, and only the time limit (Flower's 2 h) stops a pull.
    assert [fn.__kwdefaults__["backoff_cap"] for fn in pulls] == [0.1, 0.1]
    assert [fn.__kwdefaults__["max_tries_per_object"] for fn in pulls] == [None, None]
    assert all(fn.__kwdefaults__["max_time"] == 7200 for fn in pulls)
    # Flower's own first wait (1 s) and cap (10 s), by choice; a wait that is not positive is
    # refused by its variable's name.
    for env, key, flowers in ((object_pulls.CAP_ENV, "backoff_cap", 10.0),
                              (object_pulls.PULL_ENV, "initial_backoff", 1.0)):
        monkeypatch.setenv(env, str(flowers))
        object_pulls.prompt_object_pulls()
        assert [fn.__kwdefaults__[key] for fn in pulls] == [flowers, flowers]
        for bad in ("0", "-1"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(SystemExit, match=env):
                object_pulls.prompt_object_pulls()
        monkeypatch.delenv(env)


def test_object_transfers_at_a_time_by_choice(monkeypatch, pulls):
    from fedapp.runtime import object_pulls
    from flwr.supercore.inflatable import inflatable_utils
    pushes = (inflatable_utils.push_objects,
              inflatable_utils.push_object_contents_from_iterable)
    for fn in pushes:
        monkeypatch.setitem(fn.__kwdefaults__, "max_concurrent_pushes",
                            fn.__kwdefaults__["max_concurrent_pushes"])
    monkeypatch.setattr(inflatable_utils, "get_num_workers", inflatable_utils.get_num_workers)
    monkeypatch.delenv(object_pulls.TRANSFERS_ENV, raising=False)
    object_pulls.prompt_object_pulls()  # unset: Flower's two at a time, capped by the cores
    assert [fn.__kwdefaults__["max_concurrent_pulls"] for fn in pulls] == [2, 2]
    assert inflatable_utils.get_num_workers(64) == min(64, os.cpu_count() or 1)
    monkeypatch.setenv(object_pulls.TRANSFERS_ENV, "8")
    object_pulls.prompt_object_pulls()
    assert [fn.__kwdefaults__["max_concurrent_pulls"] for fn in pulls] == [8, 8]
    assert [fn.__kwdefaults__["max_concurrent_pushes"] for fn in pushes] == [8, 8]
    assert inflatable_utils.get_num_workers(8) == 8  # whatever the cores
    for bad in ("0", "two", "1.5"):
        monkeypatch.setenv(object_pulls.TRANSFERS_ENV, bad)
        with pytest.raises(SystemExit, match=object_pulls.TRANSFERS_ENV):
            object_pulls.prompt_object_pulls()


def test_an_object_late_by_many_tries_is_still_pulled_with_waits_capped(monkeypatch, pulls):
    # Flower's own pull loop with our defaults: the waits it asks for (recorded, not slept)
    # double from 0.05 s to the 0.1 s cap, and an object missing for 600 tries (beyond
    # Flower's 500) still arrives.
    from fedapp.runtime import object_pulls
    from flwr.supercore.inflatable import inflatable_utils
    ObjectUnavailableError = inflatable_utils.ObjectUnavailableError
    assert object_pulls.prompt_object_pulls()
    waits: list[float] = []

    class RecordedEvent(__import__("threading").Event):
        def wait(self, timeout=None):  # the pull loop's timed waits; others as they are
            if timeout is None:
                return super().wait()
            waits.append(timeout)
            return self.is_set()

    monkeypatch.setattr(inflatable_utils.threading, "Event", RecordedEvent)
    monkeypatch.setattr(inflatable_utils.random, "uniform", lambda a, b: 0.0)  # no jitter
    asked = []

    def pull(object_id: str) -> bytes:
        asked.append(object_id)
        if len(asked) <= 600:
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert inflatable_utils.pull_objects(["a"], pull) == {"a": b"content"}
    assert len(asked) == 601
    assert waits[:3] == [0.05, 0.1, 0.1] and max(waits) == 0.1 and len(waits) == 600


def test_a_forked_clientapp_asks_its_own_node_again_sooner(monkeypatch, pulls):
    # The forking SuperExec's ClientApps pull from their own SuperNode, not the SuperLink:
    # 0.01 s, doubling to 0.02 s, unless the environment says otherwise.
    import sys

    import flwr.supercore.cli
    from flwr.supercore.superexec import run_superexec

    from fedapp.cli import warm_superexec
    from fedapp.runtime import object_pulls
    from flwr.supernode.runtime import run_clientapp
    monkeypatch.setattr(run_superexec, "get_executor", run_superexec.get_executor)
    monkeypatch.setattr(run_clientapp, "install_from_fab", run_clientapp.install_from_fab)
    monkeypatch.setattr(warm_superexec, "preload", lambda: None)
    monkeypatch.setattr(flwr.supercore.cli, "flower_superexec", lambda: None)
    monkeypatch.setattr(sys, "argv", ["warm_superexec"])
    monkeypatch.setenv(warm_superexec.POLL_ENV, "0.05")
    warm_superexec.main()
    assert [(fn.__kwdefaults__["initial_backoff"], fn.__kwdefaults__["backoff_cap"])
            for fn in pulls] == [(0.01, 0.02)] * 2
    monkeypatch.setenv(object_pulls.CAP_ENV, "0.5")
    warm_superexec.main()
    assert [fn.__kwdefaults__["backoff_cap"] for fn in pulls] == [0.5, 0.5]
