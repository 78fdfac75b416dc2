"""Local training and evaluation on tensor batches — no Flower in here.

The loop is deliberately the bare PyTorch loop (shuffle indices with a seeded generator, slice
batches, step) so that the benchmark can hold it against one written by hand; methods change
only the loss, through the ``loss_fn(x, y) -> Tensor`` they pass in.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F


def pick_device(request: str = "") -> torch.device:
    """The device a client trains on: ``request`` ("cpu", "cuda", "cuda:1") when given (a
    SuperNode's ``device`` node config), else CUDA when the process can see a GPU, else CPU.

    A request the machine cannot honour is refused rather than silently run on the CPU, so a
    node set up for a GPU never trains 50x slower without anyone noticing."""
    if not request or request == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(request)
    except RuntimeError:
        raise ValueError(f"device={request!r} is not a device name; use 'cpu', 'cuda' or "
                         "'cuda:N'") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"device={request!r} was asked for, but this process sees "
                             f"{count} CUDA device(s) (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    elif device.type != "cpu":
        raise ValueError(f"device={request!r}: only 'cpu' and 'cuda[:N]' are supported")
    return device


def deterministic_cuda() -> None:
    """Make this process's CUDA kernels deterministic, before its first CUDA work.

    On the CPU one seed gives one result to the bit. On a GPU it did not: cuDNN picks
    convolution algorithms by timing them and several of them (and cuBLAS's split reductions)
    add in a varying order, so two runs of one seed differed by ~1e-7 after a round and more
    later. These settings fix the algorithms and cuBLAS's workspace; an operation with no
    deterministic CUDA kernel warns instead of failing."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float, momentum: float,
                   weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
                   ) -> torch.optim.Optimizer:
    """The local optimizer named in the run config."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


def recipe_optimizer(params: Iterable[torch.nn.Parameter], cfg, lr: float | None = None
                     ) -> torch.optim.Optimizer:
    """A new optimizer over ``params`` as the run config's recipe says (``optimizer``, ``lr``
    unless given, ``momentum``, the Adam betas, ``weight-decay``)."""
    return make_optimizer(params, cfg.optimizer, cfg.lr if lr is None else lr, cfg.momentum,
                          cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2))


@dataclass
class TrainStats:
    """What one local training call did."""

    loss: float
    steps: int
    samples: int


def _batches(n: int, batch_size: int, epochs: int, steps: int, generator: torch.Generator,
             device: torch.device, drop_last: bool = False, shuffle: bool = True):
    """Index batches: ``epochs`` shuffled passes (without their short last batch when
    ``drop_last``), or exactly ``steps`` batches when > 0 (reshuffling at each pass end, so
    every batch is full-sized unless n < batch_size). ``shuffle=False``: every pass in the
    data's own order (an unshuffled DataLoader's batches)."""
    done = 0
    while True:
        order = (torch.randperm(n, generator=generator) if shuffle
                 else torch.arange(n)).to(device)
        for start in range(0, n, batch_size):
            if steps and done == steps:
                return
            if (steps or drop_last) and start + batch_size > n and start > 0:
                break  # a short tail: reshuffle instead, as a fresh random batch would be
            yield order[start:start + batch_size]
            done += 1
        epochs -= 1
        if not steps and epochs <= 0:
            return


def train_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, epochs: int, batch_size: int,
                 generator: torch.Generator, grad_clip: float = 0.0, steps: int = 0,
                 drop_last: bool = False, shuffle: bool = True) -> TrainStats:
    """``epochs`` passes over ``(x, y)`` in shuffled mini-batches (the last one may be short),
    or, with ``steps`` > 0, exactly that many random mini-batches (FedHe's client update);
    ``shuffle=False`` keeps the data's order in every pass."""
    model.train()
    n = len(y)
    total, steps_done, samples = torch.zeros((), device=x.device), 0, 0
    if n:
        for idx in _batches(n, batch_size, epochs, steps, generator, x.device, drop_last,
                            shuffle):
            loss = loss_fn(x[idx], y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            # Accumulate on the device: .item() every step would force a sync per batch.
            total += loss.detach()
            steps_done += 1
            samples += len(idx)
    return TrainStats(loss=float(total) / max(steps_done, 1), steps=steps_done, samples=samples)


def train_recipe(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, cfg, generator: torch.Generator,
                 epochs: int | None = None, steps: int | None = None) -> TrainStats:
    """:func:`train_epochs` as the run's recipe says: ``local-epochs`` passes or
    ``local-steps`` mini-batches (unless ``epochs``/``steps`` are given: a method's own phase),
    ``batch-size``, ``grad-clip``, ``drop-last`` and ``batch-order``."""
    if epochs is not None and steps is None:
        steps = 0  # a phase of whole passes
    return train_epochs(model, x, y, loss_fn=loss_fn, optimizer=optimizer,
                        epochs=cfg.local_epochs if epochs is None else epochs,
                        steps=cfg.local_steps if steps is None else steps,
                        batch_size=cfg.batch_size, grad_clip=cfg.grad_clip,
                        generator=generator, drop_last=cfg.drop_last,
                        shuffle=cfg.batch_order == "shuffled")


EVAL_BATCH = 512  # evaluation's batches: every score of a test set uses the same ones


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = EVAL_BATCH) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``; ``(0, 0)`` when empty."""
    if len(y) == 0:
        return 0.0, 0.0
    model.eval()
    return _scores((model(x[i:i + batch_size]) for i in range(0, len(y), batch_size)), y,
                   batch_size)


@torch.no_grad()
def features_in_batches(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``model.features`` of ``x`` in eval mode, batch by batch as :func:`evaluate` runs (an
    empty ``x``: none, the model's mode untouched, as :func:`evaluate` leaves it)."""
    if len(x) == 0:
        return []
    model.eval()
    return [model.features(x[i:i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)]


@torch.no_grad()
def evaluate_head(head: torch.nn.Module, features: list[torch.Tensor],
                  y: torch.Tensor) -> tuple[float, float]:
    """:func:`evaluate` of a model made of the extractor behind ``features`` (from
    :func:`features_in_batches`) and ``head``: the same batches and operations, so the same
    numbers, without running the extractor again."""
    head.eval()
    return _scores((head(z) for z in features), y, EVAL_BATCH)


def _scores(logits: Iterable[torch.Tensor], y: torch.Tensor,
            batch_size: int) -> tuple[float, float]:
    if len(y) == 0:
        return 0.0, 0.0
    loss, correct = torch.zeros((), device=y.device), torch.zeros((), device=y.device)
    for start, batch in zip(range(0, len(y), batch_size), logits):
        target = y[start:start + batch_size]
        loss += F.cross_entropy(batch, target, reduction="sum")
        correct += (batch.argmax(1) == target).sum()
    return float(loss) / len(y), float(correct) / len(y)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one CPU thread, then restore the thread count: a tiny server-side
    model (FedTGP's prototype network, a head) trains many times faster on one thread than
    on a CPU the clients already keep busy, where every small kernel waits for its threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
