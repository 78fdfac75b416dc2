"""The Flower ClientApp: build the method's client for this node and message."""

from __future__ import annotations

import functools
import os

from flwr.app import Context, Message
from flwr.client import Client
from flwr.clientapp import ClientApp

from fedapp.config import RunConfig
from fedapp.runtime import secure_aggregation, timeline
from strategies import get_method, load_config


@functools.lru_cache(maxsize=8)
def _config(items: frozenset) -> RunConfig:
    # Parsed once per process and run config, not once per message.
    return load_config(dict(items))


def client_fn(context: Context) -> Client:
    cfg = _config(frozenset(context.run_config.items()))
    return get_method(cfg.method).client(context, cfg).to_client()


def timeline_marks(message: Message, context: Context, call_next) -> Message:
    """With a timeline on (``FEDAPP_TIMELINE``), when this process began and ended handling a
    message: in a simulation the marks that split a message's way into the engine's share on
    the way in, the handling, and the engine's share on the way back."""
    if not timeline.enabled():
        return call_next(message, context)
    entered = timeline.now()
    reply = call_next(message, context)
    timeline.write("handler", id=message.metadata.message_id, entered=entered,
                   left=timeline.now(), pid=os.getpid())
    return reply


# Flower's SecAgg+ mod acts only on the messages of its protocol (secure-aggregation).
app = ClientApp(client_fn=client_fn, mods=[timeline_marks, secure_aggregation.client_mod])
