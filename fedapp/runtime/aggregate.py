"""Framework-free aggregation maths shared by several methods."""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

import numpy as np

from fedapp.runtime.payload import Payload

Group = TypeVar("Group", bound=Hashable)


def weighted_average(payloads: Sequence[Mapping[str, np.ndarray]],
                     weights: Sequence[float]) -> Payload:
    """Element-wise average of same-named arrays, weighted (FedAvg: weights = n_k).

    Sums run in float64 whatever the uploads' dtypes; float results are float32 (the wire and
    model dtype), so no single upload decides the precision of the global state. Integer arrays
    (e.g. BatchNorm's ``num_batches_tracked``) are rounded back to int64.
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
        out[name] = np.rint(acc).astype(np.int64) if first.dtype.kind in "iu" \
            else acc.astype(np.float32)
    return out


def average_per_group(groups: Sequence[Group], payloads: Sequence[Mapping[str, np.ndarray]],
                      weights: Sequence[float]) -> dict[Group, Payload]:
    """FedAvg within each group (e.g. each architecture): ``{group: weighted average of the
    payloads of that group}``, for the groups that appear. Felo's same-architecture averaging,
    CompFL's per-architecture experts and FedPer/FedRep's extractors are all this."""
    members: dict[Group, tuple[list, list]] = {}
    for group, payload, weight in zip(groups, payloads, weights, strict=True):
        ps, ws = members.setdefault(group, ([], []))
        ps.append(payload)
        ws.append(weight)
    return {group: weighted_average(ps, ws) for group, (ps, ws) in members.items()}
