"""A message's objects asked for again sooner than Flower 1.41 does, in any process that pulls
them: a SuperNode (``fedapp.cli.prompt_supernode``), its forked ClientApps
(``fedapp.cli.warm_superexec``) and a deployed ServerApp (``fedapp.server_app``)."""

from __future__ import annotations

import os

VERSION = "1.41.0"  # the Flower release whose object pulls this changes

PULL_ENV = "FEDAPP_OBJECT_PULL_SECONDS"
DEFAULT_PULL_SECONDS = 0.05
CAP_ENV = "FEDAPP_OBJECT_PULL_CAP_SECONDS"
DEFAULT_CAP_SECONDS = 0.1
TRANSFERS_ENV = "FEDAPP_OBJECT_TRANSFERS"
# A ClientApp asks its own SuperNode, on the same machine, whose answer costs no SuperLink
# traffic: it asks again sooner.
NODE_LOCAL_PULL_SECONDS, NODE_LOCAL_CAP_SECONDS = 0.01, 0.02


def prompt_object_pulls(first_wait: float = DEFAULT_PULL_SECONDS,
                        cap: float = DEFAULT_CAP_SECONDS) -> bool:
    """Retry a message's missing objects sooner, in this process (a SuperNode, its ClientApps,
    a deployed ServerApp). Flower 1.41 sends a message, then its objects (its arrays): a
    receiver that asks between the two finds an object missing and waits 1 s before it asks
    again (``pull_objects``' first backoff), then 2, 4... This makes the first wait
    ``FEDAPP_OBJECT_PULL_SECONDS`` (default ``first_wait``, 0.05 s; 1 is Flower's), doubling as
    Flower's does up to ``FEDAPP_OBJECT_PULL_CAP_SECONDS`` (default ``cap``, 0.1 s; Flower's is
    10; a forked ClientApp's defaults are 0.01 and 0.02 s, as it asks its own node): doubling
    unbounded, an object that came at 0.36 s is found at 0.75 s, capped at 0.1 s at 0.45 s.
    Flower also gives up on an object after 500 tries, which at a short cap would be under a
    minute of a slow upload: the tries are left unbounded, and Flower's limit in time (2 h)
    alone stops a pull. On the Flower release it was written for only; returns whether it
    did."""
    import flwr
    from flwr.supercore.inflatable import inflatable_utils

    if flwr.__version__ != VERSION:
        return False
    first_wait = positive_seconds(os.environ.get(PULL_ENV), PULL_ENV, first_wait)
    cap = positive_seconds(os.environ.get(CAP_ENV), CAP_ENV, cap)
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__.update(initial_backoff=first_wait, backoff_cap=max(cap, first_wait),
                                 max_tries_per_object=None)
    concurrent_transfers(inflatable_utils, os.environ.get(TRANSFERS_ENV))
    return True


def concurrent_transfers(inflatable_utils, text: str | None) -> None:
    """With ``FEDAPP_OBJECT_TRANSFERS`` set to n: a message's objects (every array, and the
    records around them, is one) are pushed and pulled n at a time. Flower sends each object in
    a call of its own, at most two at a time and never more than the machine's cores
    (``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS``/``PUSHES``, capped by ``get_num_workers``).
    Where each call waits on a network more than on the cores, more at a time may help; on one
    2-core machine running the whole deployment it gave no consistent gain (docs/benchmarks.md).
    Unset: Flower's own."""
    if text is None:
        return
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(f"fedapp: {TRANSFERS_ENV} = {text!r} is not a positive whole number")
    inflatable_utils.get_num_workers = lambda max_concurrent: max_concurrent
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__["max_concurrent_pulls"] = n
    for fn in (inflatable_utils.push_objects,
               inflatable_utils.push_object_contents_from_iterable):
        fn.__kwdefaults__["max_concurrent_pushes"] = n


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
