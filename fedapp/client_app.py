"""The Flower ClientApp: build the method's client for this node and message."""

from __future__ import annotations

import functools

from flwr.app import Context
from flwr.client import Client
from flwr.clientapp import ClientApp

from fedapp.config import RunConfig
from strategies import METHODS, load_config


@functools.lru_cache(maxsize=8)
def _config(items: frozenset) -> RunConfig:
    # Parsed once per process and run config, not once per message.
    return load_config(dict(items))


def client_fn(context: Context) -> Client:
    cfg = _config(frozenset(context.run_config.items()))
    return METHODS[cfg.method].client(context, cfg).to_client()


app = ClientApp(client_fn=client_fn)
