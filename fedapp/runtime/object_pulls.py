"""A message's objects asked for again sooner than Flower 1.41 does, in any process that pulls
them: a SuperNode (``fedapp.cli.prompt_supernode``), its forked ClientApps
(``fedapp.cli.warm_superexec``) and a deployed ServerApp (``fedapp.server_app``)."""

from __future__ import annotations

import os

VERSION = "1.41.0"  # the Flower release whose object pulls this changes

PULL_ENV = "FEDAPP_OBJECT_PULL_SECONDS"
DEFAULT_PULL_SECONDS = 0.05


def prompt_object_pulls() -> bool:
    """Retry a message's missing objects sooner, in this process (a SuperNode, its ClientApps,
    a deployed ServerApp). Flower 1.41 sends a message, then its objects (its arrays): a
    receiver that asks between the two finds an object missing and waits 1 s before it asks
    again (``pull_objects``' first backoff), then 2, 4... This makes the first wait
    ``FEDAPP_OBJECT_PULL_SECONDS`` (default 0.05 s; 1 is Flower's), doubling as Flower's does.
    On the Flower release it was written for only; returns whether it did."""
    import flwr
    from flwr.supercore.inflatable import inflatable_utils

    if flwr.__version__ != VERSION:
        return False
    first_wait = positive_seconds(os.environ.get(PULL_ENV), PULL_ENV, DEFAULT_PULL_SECONDS)
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__["initial_backoff"] = first_wait
    return True


def positive_seconds(text: str | None, name: str, default: float) -> float:
    """The environment variable ``name``'s ``text`` as a positive number of seconds."""
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise SystemExit(f"fedapp: {name} = {text!r} is not a positive number of seconds")
    return value
