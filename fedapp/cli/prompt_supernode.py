"""``flower-supernode`` that looks for its next message sooner than every 3 s.

Flower 1.41's SuperNode (``flwr.supernode.start_client_internal``) asks the SuperLink for a
message and, when there is none, sleeps 3 s before it asks again; once it has handed a message
to its ClientApp process it looks for the reply every 0.5 s. Each synchronous round sends a node
two messages (train, then evaluate), so a node spends up to 7 s of every round just waiting to
look: on a small method, more than its training.

This module runs Flower's own ``flower-supernode`` (its arguments, its connection, its retries,
its message handling) with one difference: every wait of that module for the SuperLink is
capped at ``FEDAPP_SUPERNODE_POLL_SECONDS`` (``fedapp deploy supernode --poll-seconds``,
default 0.5), and every wait on the node's own state at a tenth of it (:class:`CappedSleep`).
The price is traffic: an idle node asks the SuperLink twice a second instead of once every
3 s, so a federation of many nodes may want a longer poll (3 gives Flower's wait for the
SuperLink while idle).
After a message, the node looks for the next one sooner: a tenth of the poll, doubling back to
the poll (0.05, 0.1, 0.2, 0.4, 0.5 s). A synchronous round's next message (evaluate after
train, the next round's train) comes a fraction of a second after the node's reply, just after
the node's first look found nothing, so a steady poll made it wait nearly a whole poll; the
backoff adds a few looks after each message (four in its first 0.75 s, against one or two) and
none to an idle node. And each of a message's objects goes into the node's store as it
arrives (Flower stores them once all have), so the node's ClientApp, already started, takes
the first ones while the others travel.
Likewise a message's objects that are not there yet are asked for again after 0.05 s, not 1 s
(:func:`prompt_object_pulls`, here and in the node's ClientApps and a deployed ServerApp).
Other Flower releases run unchanged: the module's waits are 1.41's.

    FEDAPP_SUPERNODE_POLL_SECONDS=0.5 python -m fedapp.cli.prompt_supernode --superlink ...
"""

from __future__ import annotations

import os
import sys
import time

from fedapp.runtime.object_pulls import positive_seconds, prompt_object_pulls

VERSION = "1.41.0"  # the Flower release whose SuperNode waits this caps
POLL_ENV = "FEDAPP_SUPERNODE_POLL_SECONDS"
DEFAULT_POLL_SECONDS = 0.5


class CappedSleep:
    """The ``time`` module as the SuperNode's loop sees it: ``sleep`` waits at most ``cap``
    seconds for the SuperLink (Flower's 3 s between two looks for a message; after a message,
    ``next_look``: a tenth of ``cap``, doubling back to it, see :meth:`message_received`) and at most
    ``cap / 10`` for the node's own state (Flower's 0.5 s between two looks for its ClientApp's
    reply or for an object in its store: a look costs no traffic); everything else is ``time``'s
    own. The loop's waits are polls, so a shorter wait changes when it looks, not what it
    does."""

    LOCAL_WAIT = 0.5  # Flower 1.41's waits on the node's own state

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.next_look = cap  # the next wait for the SuperLink

    def __getattr__(self, name: str):
        return getattr(time, name)

    def message_received(self) -> None:
        """A message came: the next one is likely soon, so look again after a tenth of the
        poll, and double the wait on each empty look until it is the poll again."""
        self.next_look = self.cap / 10

    def sleep(self, seconds: float) -> None:
        if seconds <= self.LOCAL_WAIT:
            time.sleep(min(seconds, self.cap / 10))
            return
        wait = min(seconds, self.next_look)
        self.next_look = min(self.cap, 2 * self.next_look)
        time.sleep(wait)


def install(cap: float) -> bool:
    """Cap the waits of Flower's SuperNode loop in this process, on the Flower release it was
    written for only. Returns whether it did."""
    import flwr
    from flwr.supernode import start_client_internal

    if flwr.__version__ != VERSION:
        return False
    sleeper = start_client_internal.time = CappedSleep(cap)
    prompt_receiving(start_client_internal, sleeper)
    prompt_object_pulls()
    from fedapp.runtime import timeline
    if timeline.enabled():
        trace(start_client_internal)
    return True


class StoreAsPulled:
    """A node's object store as its receiving step sees it: :meth:`put_pulled` stores an object
    the moment it is pulled; the step's own :meth:`put` of it afterwards is skipped. Skipped, not
    repeated: once every object is in, the node's ClientApp may take the message and delete its
    objects before the step's own puts run, which would then fail the message; and a repeated put
    would hash every object again."""

    def __init__(self, store) -> None:
        self.store = store
        self.pulled: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def put_pulled(self, object_id: str, content: bytes) -> None:
        self.store.put(object_id, content)
        self.pulled.add(object_id)

    def put(self, object_id: str, content: bytes) -> None:
        if object_id not in self.pulled:
            self.store.put(object_id, content)


def prompt_receiving(loop, sleeper: CappedSleep) -> None:
    """Wrap the loop's receiving step (Flower 1.41's ``_pull_and_store_message``, called with
    keywords; it returns the run's id when it stored a message, None when there was none): each
    object it pulls goes into the node's store at once (:class:`StoreAsPulled`), and ``sleeper``
    hears of each message received."""
    receive_step = loop._pull_and_store_message

    def receive_promptly(**kwargs):
        store, pull = StoreAsPulled(kwargs["object_store"]), kwargs["pull_object"]

        def pull_and_put(run_id: int, object_id: str) -> bytes:
            content = pull(run_id, object_id)
            store.put_pulled(object_id, content)
            return content
        run_id = receive_step(**{**kwargs, "object_store": store, "pull_object": pull_and_put})
        if run_id is not None:
            sleeper.message_received()
        return run_id
    loop._pull_and_store_message = receive_promptly


def trace(loop) -> None:
    """Write the SuperNode's marks of ``fedapp.runtime.timeline`` (when it received a message,
    when it saw its ClientApp's reply, when it had sent it): wrap the two steps of the loop
    (``loop``: Flower 1.41's ``start_client_internal`` module), which it calls with keywords."""
    from fedapp.runtime import timeline
    receive_step, push_step = loop._pull_and_store_message, loop._push_messages

    def pull_and_store(**kwargs):
        receive = kwargs["receive"]

        def received():
            got = receive()
            if got is not None:  # (message, its object tree): the tree's id is the message's
                timeline.write("supernode", id=got[1].object_id, received=timeline.now())
            return got
        return receive_step(**{**kwargs, "receive": received})

    def push(**kwargs):
        send, ids = kwargs["send"], []

        def sent(message, *args):
            ids.append(message.metadata.reply_to_message_id)
            seen = timeline.now()
            result = send(message, *args)
            timeline.write("supernode", id=ids[-1], reply_seen=seen, reply_told=timeline.now())
            return result
        result = push_step(**{**kwargs, "send": sent})
        for message_id in ids:
            timeline.write("supernode", id=message_id, reply_sent=timeline.now())
        return result

    loop._pull_and_store_message, loop._push_messages = pull_and_store, push


def poll_seconds(text: str | None) -> float:
    """``FEDAPP_SUPERNODE_POLL_SECONDS`` as a positive number of seconds (default 0.5)."""
    return positive_seconds(text, POLL_ENV, DEFAULT_POLL_SECONDS)


def main() -> None:
    cap = poll_seconds(os.environ.get(POLL_ENV))
    if not install(cap):
        print(f"fedapp: Flower is not {VERSION}: the SuperNode keeps its own waits",
              file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
