"""Every call the app makes on Flower's ``Grid`` (the Message API), in one place, for the loops
that are not synchronous rounds (``fedapp.loops.asynchronous``). The synchronous methods go through
Flower's own Strategy driver; what they take from here is ``PromptGrid``, its grid with a
faster wait for replies.

The loops talk to the same ``ClientApp`` as the rounds do: a legacy ``FitIns``/``EvaluateIns``
becomes a ``"train"``/``"evaluate"`` message with Flower's own converters (those its
``GridClientProxy`` uses), so a client cannot tell which loop sent it work.
"""

from __future__ import annotations

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


class PromptGrid:
    """The run's ``Grid`` whose ``send_and_receive`` looks for the replies promptly.

    Flower's synchronous driver (``start_grid``) sends each client's message with
    ``grid.send_and_receive``; in deployment that is Flower's HTTP grid, which sleeps 3 s
    between two pulls, so every reply waits for the next pull: up to 3 s per message, twice a
    round (train, evaluate), however fast the client was. This pulls after 0.05 s, then backs
    off to at most 0.25 s: four pulls a second per waiting message on a long round, since
    each message is awaited by its own driver thread (up to ``MAX_DRIVER_THREADS`` of
    ``fedapp.server_app`` at once), so a shorter cap multiplies the SuperLink's load by the
    clients of a round. The simulator's in-memory grid pulls every 0.1 s. Everything else is
    the grid's own."""

    FIRST_WAIT, MAX_WAIT, BACKOFF = 0.05, 0.25, 1.5

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        # Flower's semantics: no timeout = wait for every reply; otherwise return what came.
        pushed = timeline.now()
        pending = set(self._grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        wait = self.FIRST_WAIT
        while pending:
            got = list(self._grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if timeline.enabled():
                for m in got:
                    timeline.write("server", id=m.metadata.reply_to_message_id, pushed=pushed,
                                   replied=timeline.now())
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(wait if deadline is None else
                       max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(wait * self.BACKOFF, self.MAX_WAIT)
        return replies


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
