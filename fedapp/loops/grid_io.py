"""Every call the app makes on Flower's ``Grid`` (the Message API), in one place, for the loops
that are not synchronous rounds (``fedapp.loops.asynchronous``). The synchronous methods go through
Flower's own Strategy driver; what they take from here is ``PromptGrid``, its grid with a
faster wait for replies.

The loops talk to the same ``ClientApp`` as the rounds do: a legacy ``FitIns``/``EvaluateIns``
becomes a ``"train"``/``"evaluate"`` message with Flower's own converters (those its
``GridClientProxy`` uses), so a client cannot tell which loop sent it work.
"""

from __future__ import annotations

import threading
import time

from flwr.app import Message, MessageType
from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes
from flwr.compat.common.recorddict_compat import (evaluateins_to_recorddict,
                                                  fitins_to_recorddict,
                                                  recorddict_to_evaluateres,
                                                  recorddict_to_fitres)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid

from fedapp.runtime import timeline


class ClientFailed(RuntimeError):
    """A reply that carries an error instead of a result (the client raised, the message's
    TTL ran out, the node went away)."""


class GridClientManager(SimpleClientManager):
    """A client manager that learns the nodes from the Grid: waiting for clients polls
    ``grid.get_node_ids()`` (it lists the nodes online now) and registers a proxy for each new
    one, so the Strategy's own waiting, messages and identity checks serve this loop too."""

    def __init__(self, grid: Grid) -> None:
        super().__init__()
        self.grid = grid

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        deadline = time.time() + timeout
        while True:
            for node_id in sorted(self.grid.get_node_ids()):
                if str(node_id) not in self.clients:
                    self.register(GridClientProxy(node_id, self.grid, self.grid.run.run_id))
            if len(self.clients) >= num_clients or time.time() >= deadline:
                return len(self.clients) >= num_clients
            time.sleep(0.5)


class _Call:
    """One ``send_and_receive``: the replies it still awaits and those that came."""

    def __init__(self, pending: list[str], pushed: float) -> None:
        self.pending, self.pushed = set(pending), pushed
        self.replies: list[Message] = []
        self.error: BaseException | None = None
        self.done = threading.Event()


class PromptGrid:
    """The run's ``Grid`` whose ``send_and_receive`` looks for the replies promptly.

    Flower's synchronous driver (``start_grid``) sends each client's message with
    ``grid.send_and_receive`` from a thread of its own; in deployment that is Flower's HTTP
    grid, which sleeps 3 s between two pulls, so every reply waits for the next pull: up to
    3 s per message, twice a round (train, evaluate), however fast the client was. Here one
    poller thread pulls the replies of every waiting call at once, 0.05 s after a push and
    then backing off to at most 0.1 s, and hands each reply to the call that awaits it: one
    pull per look however many clients a round has (``MAX_DRIVER_THREADS`` of
    ``fedapp.server_app`` wait at once), where a pull per waiting call would multiply the
    SuperLink's load by the clients. The simulator's in-memory grid pulls every 0.1 s.
    Everything else is the grid's own."""

    FIRST_WAIT, MAX_WAIT, BACKOFF = 0.05, 0.1, 1.5

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self._lock = threading.Lock()
        self._waiting: dict[str, _Call] = {}  # message id -> the call awaiting its reply
        self._poller: threading.Thread | None = None
        self._pushed = threading.Event()  # a call came: look again 0.05 s on, then back off

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        # Flower's semantics: no timeout = wait for every reply; otherwise return what came.
        pushed = timeline.now()
        call = _Call(list(self._grid.push_messages(messages)), pushed)
        if not call.pending:
            return []
        with self._lock:
            self._waiting.update(dict.fromkeys(call.pending, call))
            self._pushed.set()
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, daemon=True,
                                                name="fedapp-reply-poller")
                self._poller.start()
        call.done.wait(timeout)
        with self._lock:  # what did not come by the deadline is not looked for any more
            for message_id in call.pending:
                self._waiting.pop(message_id, None)
            if call.error is not None:
                raise call.error
            return list(call.replies)

    def _poll(self) -> None:
        """Pull the replies of every waiting call until none waits."""
        wait = self.FIRST_WAIT
        while True:
            with self._lock:
                if not self._waiting:
                    self._poller = None
                    return
            if self._pushed.is_set():  # a reply is never there at once: look soon after
                self._pushed.clear()
                wait = self.FIRST_WAIT
            time.sleep(wait)
            wait = min(wait * self.BACKOFF, self.MAX_WAIT)
            with self._lock:
                ids = list(self._waiting)
            if not ids:
                continue
            try:
                self._hand_out(list(self._grid.pull_messages(ids)))
            except BaseException as exc:  # every waiting call raises it, as its own pull did
                with self._lock:
                    for call in set(self._waiting.values()):
                        call.error = exc
                        call.done.set()
                    self._waiting.clear()
                    self._poller = None
                return

    def _hand_out(self, replies: list[Message]) -> None:
        """Each reply to the call that awaits it; a call with all its replies is done."""
        replied = timeline.now()
        with self._lock:
            for reply in replies:
                message_id = reply.metadata.reply_to_message_id
                call = self._waiting.pop(message_id, None)
                if call is None:
                    continue
                call.pending.discard(message_id)
                call.replies.append(reply)
                if not call.pending:
                    call.done.set()
                if timeline.enabled():
                    timeline.write("server", id=message_id, pushed=call.pushed,
                                   replied=replied)


def push(grid: Grid, proxy: ClientProxy, ins: FitIns | EvaluateIns, ttl: float,
         group: str) -> str:
    """Send one train or evaluate message; returns its message id."""
    if isinstance(ins, FitIns):
        content, kind = fitins_to_recorddict(ins, keep_input=True), MessageType.TRAIN
    else:
        content, kind = evaluateins_to_recorddict(ins, keep_input=True), MessageType.EVALUATE
    message = Message(content=content, dst_node_id=int(proxy.cid), message_type=kind,
                      group_id=group, ttl=ttl)
    (message_id,) = list(grid.push_messages([message]))
    return message_id


def pull(grid: Grid, message_ids: list[str]) -> dict[str, Message]:
    """The replies that have arrived, by the id of the message they answer (never pull an id
    again once its reply came)."""
    if not message_ids:
        return {}
    return {reply.metadata.reply_to_message_id: reply
            for reply in grid.pull_messages(message_ids)}


def _content(reply: Message):
    if reply.has_error():
        raise ClientFailed(f"error {reply.error.code}: {reply.error.reason}")
    return reply.content


def fit_result(reply: Message) -> FitRes:
    return recorddict_to_fitres(_content(reply), keep_input=False)


def evaluate_result(reply: Message) -> EvaluateRes:
    return recorddict_to_evaluateres(_content(reply))
