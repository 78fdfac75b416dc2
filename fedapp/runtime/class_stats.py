"""Per-class statistics of vectors (representations, prototypes, logits) — no Flower in here.

FedGH's local averaged representations, FedProto's prototypes and FedHe's per-class logits are
all "the mean vector of each class present": computed exactly over a data set after training
(:func:`class_means`) or accumulated batch by batch during training (:class:`ClassSums`).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from flwr.common.logger import log

from fedapp.runtime.aggregate import Robust, combine


@dataclass
class ClassMeans:
    """The classes present, their mean vectors and how many samples each mean is over."""

    labels: np.ndarray   # int32 [S], ascending
    means: np.ndarray    # float32 [S, d]
    counts: np.ndarray   # int64 [S]


@torch.no_grad()
def class_means(embed: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module,
                x: torch.Tensor, y: torch.Tensor, num_classes: int,
                batch_size: int = 512) -> ClassMeans:
    """Exact per-class mean of ``embed(x)`` over ``(x, y)``, with ``model`` in eval mode (no
    dropout, BatchNorm running statistics): one vector per class that occurs in ``y``."""
    was_training = model.training
    model.eval()
    sums = ClassSums(num_classes)
    for start in range(0, len(y), batch_size):
        sums.add(embed(x[start:start + batch_size]), y[start:start + batch_size])
    model.train(was_training)
    return sums.means()


class ClassSums:
    """Running per-class sums and counts of vectors, kept on the vectors' device."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, vectors: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch (``vectors [B, d]``, ``labels [B]``); gradients are not kept."""
        vectors = vectors.detach()
        if self.sums is None:
            self.sums = torch.zeros(self.num_classes, vectors.shape[1], dtype=vectors.dtype,
                                    device=vectors.device)
            self.counts = torch.zeros(self.num_classes, dtype=torch.long, device=vectors.device)
        self.sums.index_add_(0, labels, vectors)
        self.counts += torch.bincount(labels, minlength=self.num_classes)

    def means(self, plus_one: bool = False) -> ClassMeans:
        """Mean per class seen; ``plus_one`` divides by count + 1 (FedHe's Eq. 8)."""
        if self.sums is None:
            return ClassMeans(np.zeros(0, np.int32), np.zeros((0, 0), np.float32),
                              np.zeros(0, np.int64))
        seen = torch.nonzero(self.counts > 0).flatten()
        counts = self.counts[seen]
        means = self.sums[seen] / (counts + int(plus_one)).unsqueeze(1).to(self.sums.dtype)
        return ClassMeans(seen.cpu().numpy().astype(np.int32),
                          means.cpu().numpy().astype(np.float32), counts.cpu().numpy())


def class_target_mse(vectors: torch.Tensor, y: torch.Tensor, targets: torch.Tensor,
                     has_target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``MSE(vectors[i], targets[y_i])`` (mean over the vector's
    entries); samples whose class has no target add zero. Not excluding them from the mean
    keeps the term's weight from jumping when a class's first target arrives.

    FedProto's prototype regulariser and FedHe's logit loss are both this distance."""
    per_sample = (vectors - targets[y]).pow(2).mean(1)
    return (per_sample * has_target[y]).mean()


def robust_class_means(rows: Mapping[int, Sequence[np.ndarray]], robust: Robust,
                       what: str = "class") -> dict[int, np.ndarray]:
    """Per class, a robust combination of the rows the clients that hold the class sent
    (prototypes, logits, meta-gradients): ``{class: float32 vector}`` for every class with a
    row. Count weights are dropped on purpose: a count is what a client claims, so weighting
    by it is an attack surface of its own (a client that puts its whole count on one class).
    A class with too few holders for the rule is named in a warning."""
    out = {}
    thin = []
    for c in sorted(rows):
        stack = np.stack([np.asarray(r, np.float64) for r in rows[c]])
        if robust.too_few(len(stack)) is not None:
            thin.append(f"{c} ({len(stack)})")
        shape = stack.shape[1:]
        flat = stack.reshape(len(stack), -1)
        out[c] = combine(flat, [1.0] * len(flat), robust).reshape(shape).astype(np.float32)
    if thin:
        log(WARNING, "robust-aggregation = %s per %s: too few holders to protect %s "
            "(holders in brackets)", robust.rule, what, ", ".join(thin))
    return out
