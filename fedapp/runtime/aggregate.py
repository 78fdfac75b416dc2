"""Aggregation maths shared by several methods: weighted averages and their Byzantine-robust
replacements (``robust-aggregation``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Hashable, Mapping, Sequence, TypeVar

import numpy as np
from flwr.common.logger import log

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


# -- Byzantine-robust aggregation (robust-aggregation) -------------------------------------
#
# One entry point per shape of what a server combines: whole payloads of one layout (a global
# model, a head: robust_average, per group: robust_average_per_group) and per-class rows
# (fedapp.runtime.class_stats.robust_class_means). Each flattens what it combines into one
# vector per upload and hands the stack to `combine`, which uses Flower's own functions
# (flwr.server.strategy.aggregate) where they exist. With rule "none" each entry point is
# exactly the method's plain average, so every number stays what it was.

# Smoothed Weiszfeld (Pillutla et al., "Robust Aggregation for Federated Learning", 2022,
# Algorithm 2): the smoothing nu keeps a step finite when the estimate sits on an upload.
GEOMED_NU = 1e-6
GEOMED_ITERATIONS = 100
GEOMED_TOLERANCE = 1e-8


@dataclass(frozen=True)
class Robust:
    """The robust rule of a run and its parameters (the ``robust-*`` settings)."""

    rule: str = "none"
    trim_fraction: float = 0.1
    krum_f: int = 1
    norm_bound: float = 0.0
    filter_mads: float = 3.0

    @classmethod
    def of(cls, cfg: Any) -> "Robust":
        return cls(cfg.robust_aggregation, cfg.robust_trim_fraction, cfg.robust_krum_f,
                   cfg.robust_norm_bound, cfg.robust_filter_mads)

    def too_few(self, n: int) -> str | None:
        """Why ``n`` values cannot be protected by this rule, or None: Krum needs n > 2f + 2
        (Blanchard et al. 2017, Proposition 1); a median of fewer than 3 is their mean; a
        trimmed mean that cuts int(beta n) = 0 values is the mean."""
        if self.rule in ("krum", "multi-krum") and n <= 2 * self.krum_f + 2:
            return (f"{n} uploads, and {self.rule} with robust-krum-f = {self.krum_f} needs more "
                    f"than {2 * self.krum_f + 2}: the coordinate-wise median is used instead")
        if self.rule in ("median", "geomed", "krum", "multi-krum") and n < 3:
            return f"{n} uploads: their median is their mean, which no rule can protect"
        if self.rule == "trimmed-mean" and int(self.trim_fraction * n) == 0:
            return (f"{n} uploads: robust-trim-fraction = {self.trim_fraction} cuts none of "
                    "them, so the trimmed mean is the mean")
        return None


def geometric_median(vectors: np.ndarray, weights: Sequence[float] | None = None,
                     nu: float = GEOMED_NU, iterations: int = GEOMED_ITERATIONS,
                     tolerance: float = GEOMED_TOLERANCE) -> np.ndarray:
    """The weighted geometric median of the rows of ``vectors`` [n, D]: argmin_z sum_k
    alpha_k ||z - x_k||, by the smoothed Weiszfeld iteration of Pillutla et al. (RFA): each
    step is a weighted average with weights alpha_k / max(nu, ||z - x_k||), so its breakdown
    point is 1/2 and it never needs more than averages of the uploads."""
    x = np.asarray(vectors, np.float64)
    alpha = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    alpha = alpha / alpha.sum()
    z = alpha @ x
    for _ in range(iterations):
        beta = alpha / np.maximum(nu, np.linalg.norm(x - z, axis=1))
        new = (beta / beta.sum()) @ x
        done = np.linalg.norm(new - z) <= tolerance * max(1.0, np.linalg.norm(z))
        z = new
        if done:
            break
    return z


def combine(stack: np.ndarray, weights: Sequence[float], robust: Robust) -> np.ndarray:
    """One robust combination of the rows of ``stack`` [n, D] (float64): median, trimmed mean
    (Yin et al. 2018) or Krum / multi-Krum (Blanchard et al. 2017) by Flower's functions, or the
    geometric median. ``weights`` (n_k) matter only to multi-Krum's average of the kept rows
    and the geometric median; coordinate-wise rules ignore them, as Flower's do."""
    from flwr.server.strategy.aggregate import (aggregate_krum, aggregate_median,
                                                aggregate_trimmed_avg)
    n = len(stack)
    rule = robust.rule
    if rule in ("krum", "multi-krum") and n <= 2 * robust.krum_f + 2:
        rule = "median"  # too few for Krum's guarantee: Robust.too_few says so
    results = [([row], int(w) if float(w).is_integer() and w > 0 else 1)
               for row, w in zip(stack, weights)]
    if rule == "median":
        return aggregate_median(results)[0]
    if rule == "trimmed-mean":
        return aggregate_trimmed_avg(results, robust.trim_fraction)[0]
    if rule == "krum":
        return aggregate_krum(results, robust.krum_f, 0)[0]
    if rule == "multi-krum":
        # Blanchard et al.'s multi-Krum keeps m = n - f uploads.
        return np.asarray(aggregate_krum(results, robust.krum_f, n - robust.krum_f)[0],
                          np.float64)
    if rule == "geomed":
        return geometric_median(stack, weights)
    raise ValueError(f"robust rule {robust.rule!r} does not combine a stack")


def _flatten(payloads: Sequence[Mapping[str, np.ndarray]], names: list[str]) -> np.ndarray:
    return np.stack([np.concatenate([p[n].astype(np.float64).ravel() for n in names])
                     for p in payloads])


def _unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray], names: list[str]
               ) -> Payload:
    out: Payload = {}
    start = 0
    for name in names:
        first = like[name]
        part = vector[start:start + first.size].reshape(first.shape)
        start += first.size
        out[name] = np.rint(part).astype(np.int64) if first.dtype.kind in "iu" \
            else part.astype(np.float32)
    return out


def norm_bounded(payloads: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray], bound: float) -> list[Payload]:
    """Each payload moved towards ``reference`` until its float arrays lie within L2 distance
    ``bound`` of it (Sun et al. 2019, "Can you really backdoor federated learning?": norm
    bounding of each update before the average); integer arrays are left as they are."""
    names = [n for n, a in payloads[0].items() if a.dtype.kind == "f"]
    ref = {n: reference[n].astype(np.float64) for n in names}
    out = []
    for p in payloads:
        dist = float(np.sqrt(sum(np.sum((p[n].astype(np.float64) - ref[n]) ** 2)
                                 for n in names)))
        scale = min(1.0, bound / dist) if dist > 0 else 1.0
        out.append({**p, **{n: ref[n] + scale * (p[n].astype(np.float64) - ref[n])
                            for n in names}})
    return out


def robust_average(payloads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                   robust: Robust, reference: Mapping[str, np.ndarray] | None = None,
                   what: str = "the uploads") -> Payload:
    """The one entry point for combining same-layout payloads (a model, a head, an extractor):
    :func:`weighted_average` under rule "none", else the rule. ``reference`` is the current
    state the uploads started from, which norm bounding measures distances to (default: the
    uploads' coordinate-wise median, an estimate of it no minority can move far)."""
    if robust.rule == "none":
        return weighted_average(payloads, weights)
    if not payloads:
        raise ValueError("nothing to average")
    why = robust.too_few(len(payloads))
    if why is not None:
        log(WARNING, "robust-aggregation = %s over %s: %s", robust.rule, what, why)
    names = list(payloads[0])
    if robust.rule == "norm-bound":
        if reference is None:
            reference = robust_average(payloads, weights, Robust("median"))
        return weighted_average(norm_bounded(payloads, reference, robust.norm_bound), weights)
    return _unflatten(combine(_flatten(payloads, names), weights, robust), payloads[0], names)


def robust_average_per_group(groups: Sequence[Group],
                             payloads: Sequence[Mapping[str, np.ndarray]],
                             weights: Sequence[float], robust: Robust,
                             references: Mapping[Group, Mapping[str, np.ndarray]] | None = None
                             ) -> dict[Group, Payload]:
    """:func:`average_per_group` with the robust rule applied within each group (each
    architecture's or expert's uploads); a group too small for the rule is named in a
    warning. Rule "none": exactly :func:`average_per_group`."""
    if robust.rule == "none":
        return average_per_group(groups, payloads, weights)
    members: dict[Group, tuple[list, list]] = {}
    for group, payload, weight in zip(groups, payloads, weights, strict=True):
        ps, ws = members.setdefault(group, ([], []))
        ps.append(payload)
        ws.append(weight)
    return {group: robust_average(ps, ws, robust, (references or {}).get(group),
                                  what=f"group {group}")
            for group, (ps, ws) in members.items()}


# -- filtering the pairs a server trains on (the "server-training" payload kind) --------------
#
# FedGH, FedRE, FedTGP and Velo's servers do not average: they train a model of their own on
# the individual (row, label) pairs the clients sent. There is no average to replace, so the
# rule decides, per label, which rows the server may train on (Pillutla et al.'s and Yin et
# al.'s centres, Blanchard et al.'s scores, Hampel's outlier identifier); the method's own
# training then runs on the kept rows unchanged.

# Hampel's identifier: a distance is an outlier beyond median + k * 1.4826 * MAD, the factor
# making the MAD estimate a normal standard deviation (Leys et al. 2013 recommend k = 2.5-3).
MAD_TO_STD = 1.4826


def krum_scores(stack: np.ndarray, f: int) -> np.ndarray:
    """Blanchard et al.'s Krum score of each row of ``stack`` [n, D]: the sum of its squared
    distances to its n - f - 2 nearest other rows (at least one), as Flower's
    ``aggregate_krum`` computes it (which returns the aggregate, not the scores)."""
    x = np.asarray(stack, np.float64)
    squared = (x * x).sum(1)
    dist = np.maximum(squared[:, None] + squared[None] - 2 * x @ x.T, 0.0)
    np.fill_diagonal(dist, np.inf)  # a row is not its own neighbour
    closest = max(1, len(x) - f - 2)
    return np.sort(dist, axis=1)[:, :closest].sum(1)


def _kept_by_rule(x: np.ndarray, robust: Robust) -> tuple[np.ndarray, np.ndarray]:
    """(rows, keep) for the rows ``x`` [n, D] (float64) of one label under ``robust``."""
    n = len(x)
    keep = np.ones(n, dtype=bool)
    rule = robust.rule
    if rule in ("krum", "multi-krum") and n <= 2 * robust.krum_f + 2:
        rule = "median"  # too few for Krum's guarantee, as in `combine`: too_few says so
    if rule in ("krum", "multi-krum"):
        # Krum keeps its one best-scored row, multi-Krum the n - f best (ties: first sent).
        best = np.argsort(krum_scores(x, robust.krum_f), kind="stable")
        keep[:] = False
        keep[best[:1 if rule == "krum" else n - robust.krum_f]] = True
        return x, keep
    centre = geometric_median(x) if rule == "geomed" else np.median(x, axis=0)
    dist = np.linalg.norm(x - centre, axis=1)
    if rule == "norm-bound":
        # Every row kept, moved towards its label's median until within the bound.
        # A row already within it stays exactly as sent.
        scale = np.minimum(1.0, robust.norm_bound / np.maximum(dist, 1e-300))
        return np.where(scale[:, None] < 1.0, centre + scale[:, None] * (x - centre), x), keep
    if rule == "trimmed-mean":
        # The int(beta n) rows farthest from the median are cut (ties: the last sent).
        cut = int(robust.trim_fraction * n)
        if cut:
            keep[np.argsort(dist, kind="stable")[n - cut:]] = False
        return x, keep
    # median, geomed: Hampel's identifier on the distances to the centre.
    middle = np.median(dist)
    mad = np.median(np.abs(dist - middle))
    return x, dist <= middle + robust.filter_mads * MAD_TO_STD * mad


def _filter_sets(sets: Sequence[tuple[str, np.ndarray]], robust: Robust, over: str
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(rows, keep)`` of :func:`_kept_by_rule` for each named set of rows ``[n, D]``
    (float64): a label's rows, or one architecture's flattened uploads. A set with too few
    rows for the rule is named in one warning (a median of two is their mean: nothing is
    dropped). The scoring and keeping of :func:`filter_pairs` and :func:`filter_uploads`."""
    thin = [f"{name}: {why}" for name, x in sets if (why := robust.too_few(len(x))) is not None]
    if thin:
        log(WARNING, "robust-aggregation = %s over %s, too few to protect: %s", robust.rule,
            over, "; ".join(thin))
    return [_kept_by_rule(x, robust) for _, x in sets]


def filter_pairs(rows: np.ndarray, labels: np.ndarray, robust: Robust,
                 what: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """The (row, label) pairs a server may train on under ``robust``: ``(rows, keep)``, where
    ``keep`` [N] (bool) says which pairs stay and ``rows`` are the pairs' rows as the server
    trains on them (moved only by norm-bound). Per label, over that label's rows:

    - ``median`` / ``geomed``: the distance of each row to the label's coordinate-wise /
      geometric median; a row farther than the median distance plus ``robust-filter-mads``
      scaled MADs of the distances is dropped (Hampel's identifier);
    - ``trimmed-mean``: the ``int(beta n)`` rows farthest from the coordinate-wise median are
      dropped;
    - ``krum`` / ``multi-krum``: the best-scored row, or the n - f best, are kept (Krum's
      scores among the label's rows; with n <= 2f + 2 the median's rule instead);
    - ``norm-bound``: every row is kept, moved towards the label's coordinate-wise median
      until within ``robust-norm-bound`` of it.

    Rule "none" returns ``rows`` itself and every pair kept. A label with too few rows for the
    rule is named in a warning (a median of two is their mean: nothing is dropped)."""
    labels = np.asarray(labels)
    keep = np.ones(len(labels), dtype=bool)
    if robust.rule == "none" or not len(labels):
        return rows, keep
    flat = np.asarray(rows, np.float64).reshape(len(labels), -1)
    out = flat.copy()
    members = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    kept = _filter_sets([(f"{what} {labels[m[0]]}", flat[m]) for m in members], robust,
                        "the pairs a server trains on")
    for m, (moved, kept_rows) in zip(members, kept):
        out[m], keep[m] = moved, kept_rows
    moved = out.reshape(np.shape(rows)).astype(np.asarray(rows).dtype) \
        if robust.rule == "norm-bound" else rows
    return moved, keep


# -- filtering the uploads a server distils from (the "teachers" payload kinds) ---------------
#
# FedGen's and FedDF's servers distil from each individual upload (heads, whole models) and
# average them too; KT-pFL's mixes the individual soft predictions into each client's target.
# The rule decides which uploads stay, over the round's uploads of one layout (each
# architecture's, for FedDF), with the same scores and cuts as the pairs above, each upload
# one row (its float arrays flattened); the method's own distillation, average or mixing then
# runs on the kept uploads unchanged.

def filter_uploads(payloads: Sequence[Mapping[str, np.ndarray]], robust: Robust,
                   groups: Sequence[Hashable] | None = None, what: str = "the uploads"
                   ) -> tuple[list[Payload], np.ndarray]:
    """The uploads a server may keep as teachers (and average) under ``robust``:
    ``(payloads, keep)``, ``keep`` [n] bool, and the payloads as the server uses them (moved
    only by norm-bound, as float32). Within each group (``groups``, e.g. each upload's
    architecture; None = one group, named ``what``), each upload's float arrays are one row,
    filtered as :func:`filter_pairs` filters a label's rows (Hampel's identifier around the
    coordinate-wise or geometric median, the trimmed cut, Krum's scores, or the norm bound
    around the coordinate-wise median); integer arrays (BatchNorm's step counter) count for
    nothing and are left as sent. Rule "none": the payloads as they came, every one kept."""
    keep = np.ones(len(payloads), dtype=bool)
    out = list(payloads)
    if robust.rule == "none" or not payloads:
        return out, keep
    named = groups is not None
    groups = list(groups) if named else [what] * len(payloads)
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    names = {g: [n for n, a in payloads[idx[0]].items() if a.dtype.kind == "f"]
             for g, idx in members.items()}
    flats = {g: _flatten([payloads[i] for i in idx], names[g]) for g, idx in members.items()}
    kept = _filter_sets([(f"group {g}" if named else what, flats[g]) for g in members], robust,
                        "the uploads a server distils from")
    for (g, idx), (rows, kept_rows) in zip(members.items(), kept):
        keep[idx] = kept_rows
        for i, row, sent in zip(idx, rows, flats[g]):
            if not np.array_equal(row, sent):  # moved by norm-bound
                out[i] = {**payloads[i], **_unflatten(row, payloads[i], names[g])}
    return out, keep


def held_coordinates(stack: np.ndarray, robust: Robust) -> np.ndarray:
    """Per coordinate, the robust combination of the values of the clients that hold it:
    ``stack`` [n, ...] holds one client's full-size array per row, NaN where that client's
    sub-model does not hold the coordinate (the sub-model methods: a different set of
    clients per coordinate). "median": the median of the held values; "trimmed-mean": the
    mean without the int(beta h) smallest and largest of the h held values. Coordinates held
    by nobody come back NaN. Counts are ignored, as the coordinate-wise rules elsewhere."""
    x = np.asarray(stack, np.float64)
    if robust.rule == "median":
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: nobody holds it
            return np.nanmedian(x, axis=0)
    if robust.rule != "trimmed-mean":
        raise ValueError(f"robust rule {robust.rule!r} is not a coordinate-wise rule")
    held = np.sum(~np.isnan(x), axis=0)
    cut = np.floor(robust.trim_fraction * held).astype(np.int64)
    ranked = np.sort(x, axis=0)  # NaN last
    rank = np.arange(len(x)).reshape((-1,) + (1,) * (x.ndim - 1))
    keep = (rank >= cut) & (rank < held - cut)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(keep, ranked, 0.0).sum(axis=0) / keep.sum(axis=0)


def average_where_held(payloads: Sequence[Mapping[str, np.ndarray]],
                       robust: Robust | None = None
                       ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """({name: the unweighted mean over the payloads that hold it}, {name: how many hold it})
    for every name any payload holds: the sub-model methods' server step (DepthFL's prefixes),
    Σ values and Σ counts per entry. Sums run in float64; means stay float64 (the caller
    decides the stored dtype). With a coordinate-wise ``robust`` rule each entry is that rule
    over its holders instead of their mean (:func:`held_coordinates`)."""
    if robust is not None and robust.rule != "none":
        held: dict[str, list[np.ndarray]] = {}
        for payload in payloads:
            for name, value in payload.items():
                held.setdefault(name, []).append(value)
        return ({name: held_coordinates(np.stack(values), robust)
                 for name, values in held.items()},
                {name: len(values) for name, values in held.items()})
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for payload in payloads:
        for name, value in payload.items():
            if name in sums:
                sums[name] += value.astype(np.float64)
            else:
                sums[name] = value.astype(np.float64)  # a copy: the uploads stay as sent
            counts[name] = counts.get(name, 0) + 1
    return {name: total / counts[name] for name, total in sums.items()}, counts
