"""How fast each client is, so that stragglers can be studied (settings ``slow-fraction``,
``slowdown``, ``speed-jitter``, ``clock``).

A client's *speed factor* is 1, or ``slowdown`` for the ``slow-fraction`` of clients drawn from
the seed. The duration of one update is ``factor x jitter`` virtual seconds, where the jitter is
log-normal with sigma ``speed-jitter`` drawn per (seed, client, update): one virtual second is
one update of a normal client. With ``clock = "virtual"`` nothing sleeps and the loops account
time by these durations; with ``clock = "arrival"`` a slow client really sleeps
``(factor - 1) x`` its own training time, as a slower device would take.
"""

from __future__ import annotations

import functools

import numpy as np

from fedapp.config import RunConfig
from fedapp.seeding import derive_seed


@functools.lru_cache(maxsize=16)
def speed_factors(cfg: RunConfig) -> tuple[float, ...]:
    """Each partition's speed factor (1 = normal, ``slowdown`` = slow)."""
    n = cfg.num_clients
    slow = round(cfg.slow_fraction * n)
    rng = np.random.default_rng(derive_seed(cfg.seed, "speeds"))
    chosen = set(rng.choice(n, slow, replace=False).tolist()) if slow else set()
    return tuple(cfg.slowdown if pid in chosen else 1.0 for pid in range(n))


def update_duration(cfg: RunConfig, partition_id: int, update: int) -> float:
    """Virtual seconds that update number ``update`` of ``partition_id`` takes."""
    factor = speed_factors(cfg)[partition_id]
    if cfg.speed_jitter == 0:
        return factor
    rng = np.random.default_rng(derive_seed(cfg.seed, "duration", partition_id, update))
    return factor * float(rng.lognormal(0.0, cfg.speed_jitter))


def has_stragglers(cfg: RunConfig) -> bool:
    return cfg.slow_fraction > 0 or cfg.speed_jitter > 0
