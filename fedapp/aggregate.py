"""Framework-free aggregation maths shared by several methods."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fedapp.payload import Payload


def weighted_average(payloads: Sequence[Mapping[str, np.ndarray]],
                     weights: Sequence[float]) -> Payload:
    """Element-wise average of same-named arrays, weighted (FedAvg: weights = n_k).

    Integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are averaged in float64 and
    rounded back to their dtype; float arrays keep their dtype.
    """
    if not payloads:
        raise ValueError("nothing to average")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out: Payload = {}
    for name, first in payloads[0].items():
        acc = np.zeros(first.shape, dtype=np.float64)
        for payload, w in zip(payloads, weights):
            acc += payload[name].astype(np.float64) * (w / total)
        out[name] = np.rint(acc).astype(first.dtype) if first.dtype.kind in "iu" \
            else acc.astype(first.dtype)
    return out
