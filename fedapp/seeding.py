"""Seeds and random streams keyed by what they are for: ``derive_seed`` and ``isolated_rng``.

The foundation of reproducibility, below the data set-up, the client speeds and the topologies,
which need a seed without importing the training runtime.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``(seed, partition id, round, ...)``.

    Every random stream is keyed by what it is *for*, never by execution order: Ray schedules
    virtual clients in no fixed order, so a global RNG would make runs irreproducible.
    """
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def isolated_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block with torch's global generator (and ``device``'s, for CUDA) seeded with
    ``seed``, and restore both afterwards.

    For what torch can only draw from its global generator: a module's initial weights and
    dropout masks. Inside the block nothing else runs, so the draws depend on ``seed`` alone;
    after it, code that draws from the global generator sees the state it had before, so a
    model built or trained here never shifts anyone else's random stream."""
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
