"""Every call the app makes on Flower's ``Grid`` (the Message API), in one place, for the loops
that are not synchronous rounds (``fedapp.async_loop``). The synchronous methods go through
Flower's own Strategy driver and never come here.

The loops talk to the same ``ClientApp`` as the rounds do: a legacy ``FitIns``/``EvaluateIns``
becomes a ``"train"``/``"evaluate"`` message with Flower's own converters (those its
``GridClientProxy`` uses), so a client cannot tell which loop sent it work.
"""

from __future__ import annotations

import time
from logging import WARNING

from flwr.app import Message, MessageType
from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes
from flwr.common.logger import log
from flwr.compat.common.recorddict_compat import (evaluateins_to_recorddict,
                                                  fitins_to_recorddict,
                                                  recorddict_to_evaluateres,
                                                  recorddict_to_fitres)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid


class ClientFailed(RuntimeError):
    """A reply that carries an error instead of a result (the client raised, the message's
    TTL ran out, the node went away)."""


def client_manager(grid: Grid, want: int, wait_seconds: float) -> SimpleClientManager:
    """A client manager holding a proxy for every node online, once ``want`` are (or the wait
    is over: the caller's own check then says who is missing)."""
    deadline, said = time.time() + wait_seconds, 0.0
    while True:
        ids = sorted(grid.get_node_ids())
        if len(ids) >= want or time.time() >= deadline:
            break
        if time.time() - said >= 10:
            log(WARNING, "waiting for clients: %d of num-clients=%d connected", len(ids), want)
            said = time.time()
        time.sleep(0.5)
    manager = SimpleClientManager()
    for node_id in ids:
        manager.register(GridClientProxy(node_id, grid, grid.run.run_id))
    return manager


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
