"""Local training and evaluation on tensor batches — no Flower in here.

The loop is deliberately the bare PyTorch loop (shuffle indices with a seeded generator, slice
batches, step) so that the benchmark can hold it against one written by hand; methods change
only the loss, through the ``loss_fn(x, y) -> Tensor`` they pass in.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``(seed, partition id, round, ...)``.

    Every random stream is keyed by what it is *for*, never by execution order: Ray schedules
    virtual clients in no fixed order, so a global RNG would make runs irreproducible.
    """
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def pick_device() -> torch.device:
    """CUDA when the process can see a GPU, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float, momentum: float,
                   weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
                   ) -> torch.optim.Optimizer:
    """The local optimizer named in the run config."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


@dataclass
class TrainStats:
    """What one local training call did."""

    loss: float
    steps: int
    samples: int


def train_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, epochs: int, batch_size: int,
                 generator: torch.Generator, grad_clip: float = 0.0) -> TrainStats:
    """``epochs`` passes over ``(x, y)`` in shuffled mini-batches (the last one may be short)."""
    model.train()
    n = len(y)
    total, steps = torch.zeros((), device=x.device), 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(x.device)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            loss = loss_fn(x[idx], y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            # Accumulate on the device: .item() every step would force a sync per batch.
            total += loss.detach()
            steps += 1
    return TrainStats(loss=float(total) / max(steps, 1), steps=steps, samples=n * epochs)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``; ``(0, 0)`` when empty."""
    if len(y) == 0:
        return 0.0, 0.0
    model.eval()
    loss, correct = torch.zeros((), device=x.device), torch.zeros((), device=x.device)
    for start in range(0, len(y), batch_size):
        logits = model(x[start:start + batch_size])
        target = y[start:start + batch_size]
        loss += F.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(1) == target).sum()
    return float(loss) / len(y), float(correct) / len(y)
