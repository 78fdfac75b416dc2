"""Seeded partitioning of a labelled dataset into federated clients.

The train indices of every client are computed once, from the label array
alone, by plain numpy index arithmetic (one function per scheme), and the
whole :class:`Partition` is cached per process (:func:`get_partition`): no
dataset object is built per client.  ``iid`` and ``dirichlet`` give exactly
the rows that flwr-datasets' ``IidPartitioner`` and ``DirichletPartitioner``
give on a label-only ``datasets.Dataset`` in the same seeded row order (same
draws from the same generator; ``tests/test_partitions.py`` checks it against
them).  The papers' own schemes are functions here too, and
:mod:`fedapp.data.flwr_partitioners` wraps them as flwr-datasets
``Partitioner`` s for use with ``FederatedDataset``:

================  =======================================  ======================================
``scheme``        train indices as                         source
================  =======================================  ======================================
``iid``           flwr-datasets ``IidPartitioner``         equal random split
``dirichlet``     flwr-datasets ``DirichletPartitioner``   NIID-Bench Dir(alpha) label skew
                  (``self_balancing=True``)                (FedClassAvg: Jang et al., ICPP 2022)
``pathological``  :func:`_pathological_rows`               pFedHN/FedGH (Yi et al., ACM MM 2023)
``two-class``     :func:`_two_class_rows`                  FedClassAvg "skewed"
``fixed-size``    :func:`_fixed_size_rows`                 CompFL (Xu et al., FedKDD 2024)
================  =======================================  ======================================

After the train indices of each client are known, :func:`make_partition`
applies, per client and in this order:

1. ``max_samples_per_client`` cap: stratified subsample of the client's own
   samples (CPU budgets).  The cap bounds ALL the client's own samples (train +
   val, + test in ``split`` mode), so with ``val_fraction=0`` and
   ``local_test="global"`` the train size equals the cap.
2. ``local_test="split"``: a stratified test hold-out of ``test_fraction`` of
   the client's samples (pFedHN/FedGH 8:1:1 style: Shamsian et al., ICML 2021;
   Yi et al., ACM MM 2023).
   Every held-out class keeps at least one train sample, so test classes are a
   subset of train classes.
3. ``val_fraction``: a stratified validation hold-out, same rule.
4. ``local_test="global"``: a test set drawn ONCE, without replacement, from the
   global test split with the client's train label proportions, of size
   ``round(test_fraction * train size)`` (FedClassAvg's evaluation, Jang et al.,
   ICPP 2022, but fixed instead of re-sampled every round).
   If the test split lacks enough samples of a class, the whole local test set
   is shrunk so that the proportions are kept.
5. ``label_permutation``: a random permutation of label ids per client
   (CompFL "independent labels", Xu et al., FedKDD 2024); stored, and applied by
   :func:`client_data` to train, val and test labels alike.

With ``two_class_with_replacement=True`` a client's own indices may repeat
(official FedClassAvg code), so its train/val/"split" test sets may share
samples; every other scheme gives disjoint clients and disjoint hold-outs.

Seeds: every random choice derives from ``spec.seed`` only (numpy
``default_rng`` seeded with ``[seed, stream, client]``), so the same spec on
the same labels always yields the same indices, on any machine.  Index arrays
are sorted ascending and read-only (they are cached and shared): trainers must
shuffle their batches themselves.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from fedapp.data.datasets import TensorData

__all__ = [
    "LOCAL_TEST_MODES",
    "FILES_SCHEME",
    "SCHEMES",
    "ClientData",
    "ClientSplit",
    "Partition",
    "PartitionError",
    "PartitionSpec",
    "client_data",
    "load_client_data",
    "make_partition",
]

SCHEMES = ("iid", "dirichlet", "pathological", "two-class", "fixed-size")
# Not drawn here: the partition a federation's per-client files give (files_partition).
FILES_SCHEME = "files"
LOCAL_TEST_MODES = ("global", "split")

# Independent random streams, so that e.g. changing val_fraction does not
# change the label permutation or the cap subsample of a client.
_STREAM_ROW_ORDER = 0
_STREAM_CAP = 1
_STREAM_SPLIT_TEST = 2
_STREAM_VAL = 3
_STREAM_GLOBAL_TEST = 4
_STREAM_LABEL_PERM = 5


class PartitionError(ValueError):
    """A partition setting is invalid.

    The message names the setting, its value and what is allowed.
    """


# --------------------------------------------------------------------------- #
# Specification and results
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class PartitionSpec:
    """Everything that determines a partition (hashable, so it can be a cache key).

    See the module docstring for the meaning of each field and the order in
    which the per-client steps are applied.
    """

    scheme: str = "iid"
    num_clients: int = 10
    seed: int = 0
    alpha: float = 0.5  # dirichlet
    min_partition_size: int = 10  # dirichlet
    classes_per_client: int = 2  # pathological, two-class, fixed-size
    samples_per_client: int = 500  # fixed-size
    two_class_with_replacement: bool = False  # two-class: reproduce FedClassAvg code
    max_samples_per_client: int = 0  # 0 = no cap
    local_test: str = "global"  # "global" | "split"
    test_fraction: float = 0.2
    val_fraction: float = 0.0
    label_permutation: bool = False  # CompFL "independent labels"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of the fields."""
        return asdict(self)


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """Indices of one client (int64, sorted, read-only).

    ``train`` and ``val`` index the train pool.  ``test`` indexes the global
    test pool when ``spec.local_test == "global"`` and the train pool when it
    is ``"split"``.  ``label_permutation[c]`` is the client's label id for
    global class ``c`` (None when labels are not permuted).
    """

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    label_permutation: np.ndarray | None


@dataclass(frozen=True, eq=False)
class Partition:
    """The result of :func:`make_partition`: the spec plus one :class:`ClientSplit` per client."""

    spec: PartitionSpec
    clients: tuple[ClientSplit, ...]

    def class_counts(self, train_labels: np.ndarray, num_classes: int) -> np.ndarray:
        """``[K, C]`` int64 matrix of train samples per client and (global) class."""
        labels = np.asarray(train_labels).astype(np.int64, copy=False)
        return np.stack(
            [np.bincount(labels[c.train], minlength=num_classes) for c in self.clients]
        ).astype(np.int64)

    def summary(
        self, train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int
    ) -> dict[str, Any]:
        """JSON-ready description: the spec and, per client, sizes and class counts.

        Class counts are in GLOBAL label ids (before any label permutation).
        """
        train_labels = np.asarray(train_labels).astype(np.int64, copy=False)
        test_labels = np.asarray(test_labels).astype(np.int64, copy=False)
        test_pool = test_labels if self.spec.local_test == "global" else train_labels

        def counts(labels: np.ndarray, idx: np.ndarray) -> list[int]:
            return [int(v) for v in np.bincount(labels[idx], minlength=num_classes)]

        clients = []
        for cid, c in enumerate(self.clients):
            clients.append(
                {
                    "partition_id": cid,
                    "train_size": int(len(c.train)),
                    "val_size": int(len(c.val)),
                    "test_size": int(len(c.test)),
                    "train_class_counts": counts(train_labels, c.train),
                    "val_class_counts": counts(train_labels, c.val),
                    "test_class_counts": counts(test_pool, c.test),
                    "label_permutation": (
                        None
                        if c.label_permutation is None
                        else [int(v) for v in c.label_permutation]
                    ),
                }
            )
        return {
            "spec": self.spec.to_dict(),
            "num_clients": len(self.clients),
            "num_classes": int(num_classes),
            "clients": clients,
        }


@dataclass(frozen=True, eq=False)
class ClientData:
    """Tensors of one client; labels already mapped through its label permutation (if any)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The six tensors in field order (``ClientData(*data.tensors())`` rebuilds it)."""
        return (self.train_x, self.train_y, self.val_x, self.val_y, self.test_x, self.test_y)


# --------------------------------------------------------------------------- #
# Small numeric helpers
# --------------------------------------------------------------------------- #
def _rng(seed: int, *stream: int) -> np.random.Generator:
    """Independent generator for (seed, stream, client...); derived from ``seed`` only."""
    return np.random.default_rng([int(seed), *[int(s) for s in stream]])


def _allocate(weights: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
    """Split ``total`` integer units proportionally to ``weights``, never exceeding ``caps``.

    Deterministic (no randomness): repeatedly hand out the floor of each
    entry's proportional share among the entries that still have room, then
    single units to the largest fractional parts (ties -> lower index).
    Entries with zero weight get nothing.  Returns int64 counts summing to
    ``min(total, caps[weights > 0].sum())``.
    """
    w = np.asarray(weights, dtype=np.float64)
    caps = np.maximum(np.asarray(caps, dtype=np.int64), 0)
    alloc = np.zeros(len(w), dtype=np.int64)
    remaining = int(min(int(total), int(caps[w > 0].sum())))
    while remaining > 0:
        active = np.flatnonzero((w > 0) & (alloc < caps))
        ideal = remaining * w[active] / w[active].sum()
        add = np.minimum(np.floor(ideal).astype(np.int64), caps[active] - alloc[active])
        if add.sum() == 0:  # every share < 1: give single units by largest remainder
            order = np.argsort(-(ideal - np.floor(ideal)), kind="stable")[:remaining]
            add = np.zeros(len(active), dtype=np.int64)
            add[order] = 1
        alloc[active] += add
        remaining -= int(add.sum())
    return alloc


def _stratified_pick(
    idx: np.ndarray, labels: np.ndarray, n_pick: int, keep_per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Pick ``n_pick`` of ``idx`` with the class proportions of ``idx``.

    ``keep_per_class`` samples of every class stay un-picked (1 for hold-outs,
    so held-out classes remain a subset of the kept ones; 0 for subsampling).
    Returns ``(rest, picked)``.
    """
    y = labels[idx]
    classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    take = _allocate(counts, n_pick, counts - keep_per_class)
    picked_mask = np.zeros(len(idx), dtype=bool)
    for c in np.flatnonzero(take):
        positions = np.flatnonzero(inverse == c)
        picked_mask[rng.choice(positions, size=int(take[c]), replace=False)] = True
    return idx[~picked_mask], idx[picked_mask]


def _draw_like(
    train_y: np.ndarray,
    pool_by_class: list[np.ndarray],
    n_draw: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw ``n_draw`` pool indices, without replacement, with ``train_y``'s class proportions.

    ``pool_by_class[c]`` lists the pool indices of class ``c``.  If some class
    has too few pool samples, the whole draw shrinks so proportions are kept.
    """
    num_classes = len(pool_by_class)
    train_counts = np.bincount(train_y, minlength=num_classes).astype(np.float64)
    available = np.array([len(p) for p in pool_by_class], dtype=np.int64)
    if n_draw <= 0 or train_counts.sum() == 0:
        return np.empty(0, dtype=np.int64)
    share = train_counts / train_counts.sum()
    present = share > 0
    max_total = int(np.floor(np.min(available[present] / share[present]) + 1e-9))
    take = _allocate(train_counts, min(n_draw, max_total), available)
    parts = [
        rng.choice(pool_by_class[c], size=int(take[c]), replace=False)
        for c in np.flatnonzero(take)
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)


def _frozen(a: np.ndarray) -> np.ndarray:
    """Sorted int64 copy marked read-only (partitions are cached and shared)."""
    out = np.sort(np.asarray(a, dtype=np.int64))
    out.setflags(write=False)
    return out


def _balanced_class_assignment(
    num_clients: int, classes_per_client: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Give each client ``k`` distinct classes so that every class has ``k*K/C`` holders.

    pFedHN/FedGH recipe (Shamsian et al., ICML 2021; Yi et al., ACM MM 2023):
    each class is given to ``k*K/C`` clients.  When ``k*K/C`` is not an integer,
    ``(k*K) mod C`` randomly chosen classes get one holder more than the others
    (floor/ceil), i.e. the holders are spread as evenly as possible.

    Realisation: visit the clients in random order and give each the ``k``
    classes with the most remaining holder slots (random tie-break).  This
    greedy (Ryser's construction for bipartite degree sequences) always
    succeeds because every class needs at most ``ceil(k*K/C) <= K`` holders.
    Returns, per client, the sorted class positions (0..C-1).
    """
    total = classes_per_client * num_clients
    slots = np.full(num_classes, total // num_classes, dtype=np.int64)
    slots[rng.choice(num_classes, size=total % num_classes, replace=False)] += 1
    assignment: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for client in rng.permutation(num_clients):
        order = rng.permutation(num_classes)  # random tie-break
        chosen = order[np.argsort(-slots[order], kind="stable")][:classes_per_client]
        if np.any(slots[chosen] <= 0):  # cannot happen (see docstring); guard anyway
            raise RuntimeError("balanced class assignment failed")
        slots[chosen] -= 1
        assignment[int(client)] = np.sort(chosen)
    return assignment


# --------------------------------------------------------------------------- #
# Train indices per client: one function per scheme, on the label array alone
# --------------------------------------------------------------------------- #
def _iid_rows(order: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """flwr-datasets' ``IidPartitioner``: contiguous shards of the (seeded) row order.

    Its ``Dataset.shard(K, i, contiguous=True)`` gives the first ``n mod K``
    shards one row more than the others, as ``np.array_split`` does.
    """
    return np.array_split(order, num_clients)


# DirichletPartitioner draws once and re-draws up to 10 times before it gives up.
_DIRICHLET_DRAWS = 11


def _dirichlet_rows(
    labels: np.ndarray, num_clients: int, alpha: float, min_size: int, seed: int
) -> list[np.ndarray] | None:
    """flwr-datasets' ``DirichletPartitioner`` (``self_balancing=True``, ``shuffle=True``).

    The same draws from the same generator (``default_rng(seed)``), so the same
    rows: for each class in ascending label order, proportions ~ Dir(alpha) over
    the clients; a client already holding more than ``n/K`` rows gets no more
    (self-balancing, NIID-Bench: Li et al., ICDE 2022); the class's rows, in
    dataset order, are cut at ``int(cumsum(proportions) * n_c)``.  If a client
    ends with fewer than ``min_size`` rows everything is re-drawn, at most
    ``_DIRICHLET_DRAWS`` times in all (then None).  Finally each client's rows,
    in class order, are shuffled in place, client after client.
    """
    rng = np.random.default_rng(seed)
    alphas = np.full(num_clients, float(alpha))
    balance_cap = len(labels) / num_clients
    members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(_DIRICHLET_DRAWS):
        sizes = np.zeros(num_clients, dtype=np.int64)
        owner_per_class = []
        for rows in members:
            proportions = rng.dirichlet(alphas)
            proportions[sizes > balance_cap] = 0.0
            # flwr-datasets normalises by Python's sum(), a left-to-right sum: cumsum's last
            # element is that very sum (np.sum adds pairwise and may differ in the last bit).
            proportions = proportions / np.cumsum(proportions)[-1]
            cuts = (np.cumsum(proportions) * len(rows)).astype(np.int64)[:-1]
            bounds = np.concatenate(([0], np.minimum(cuts, len(rows)), [len(rows)]))
            counts = np.diff(bounds)
            sizes += counts
            owner_per_class.append(np.repeat(np.arange(num_clients), counts))
        if sizes.min() >= min_size:
            break
    else:
        return None
    # Each client's rows in class order, and in dataset order within a class (a stable sort
    # by owner keeps that order), then shuffled with the generator that drew the proportions.
    owner = np.concatenate(owner_per_class)
    grouped = np.concatenate(members)[np.argsort(owner, kind="stable")]
    client_rows = np.split(grouped, np.cumsum(sizes)[:-1])
    for rows in client_rows:
        rng.shuffle(rows)
    return client_rows


def _check_classes_per_client(k: int, present: int) -> None:
    if not 1 <= k <= present:
        raise ValueError(
            f"num_classes_per_partition={k} must be between 1 and the "
            f"number of classes present ({present})"
        )


def _holders(assignment: list[np.ndarray], num_classes: int) -> list[list[int]]:
    """For every class position, the clients holding it (ascending)."""
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client, class_positions in enumerate(assignment):
        for c_pos in class_positions:
            holders[int(c_pos)].append(client)
    return holders


def _pathological_rows(
    labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator,
    low: float = 0.4, high: float = 0.6,
) -> list[np.ndarray]:
    """pFedHN / FedGH pathological split: ``k`` classes per client with random shares.

    FedGH official code (pFedHN recipe; Yi et al., ACM MM 2023): each class is given to
    ``k*K/C`` clients (balanced), and each (client, class) pair gets a share
    drawn from U(0.4, 0.6), normalised over the clients holding that class;
    the class's samples are cut in those proportions.  All samples are used.

    When ``k*K/C`` is not an integer (pFedHN asserts it is), the holders are
    distributed as evenly as possible: ``(k*K) mod C`` random classes get one
    more holder than the rest (see :func:`_balanced_class_assignment`).  When
    ``k*K < C`` some classes have no holder and are left out.
    """
    classes = np.unique(labels)
    _check_classes_per_client(k, len(classes))
    assignment = _balanced_class_assignment(num_clients, k, len(classes), rng)
    holders_of = _holders(assignment, len(classes))
    rows: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c_pos, c in enumerate(classes):
        holders = holders_of[c_pos]
        if not holders:
            continue
        shares = rng.uniform(low, high, size=len(holders))
        shares /= shares.sum()
        members = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for holder, part in zip(holders, np.split(members, cuts)):
            rows[holder].append(part)
    return [np.concatenate(r) if r else np.empty(0, np.int64) for r in rows]


def _two_class_rows(
    labels: np.ndarray, num_clients: int, k: int, with_replacement: bool,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """FedClassAvg "skewed" split: ``k`` (default 2) classes per client, ``n/(kK)`` samples each.

    FedClassAvg's official code (``utils.partition_data``, ``noniid-twoclass``;
    Jang et al., ICPP 2022): every client independently draws 2 distinct random labels and
    samples ``n/(2K)`` indices of each label WITH replacement, so clients (and
    even one client's own indices) may overlap.  ``with_replacement=True``
    reproduces exactly that.

    Default (``with_replacement=False``): disjoint clients, as even as
    possible.  Classes are assigned so that each has ``k*K/C`` holders
    (floor/ceil, random pairs; see :func:`_balanced_class_assignment`) and each
    (client, class) pair gets ``min(n // (k*K), n_c // holders_c)`` distinct
    samples, so on a balanced dataset every client has exactly
    ``k * (n // (k*K))`` samples.
    """
    classes = np.unique(labels)
    _check_classes_per_client(k, len(classes))
    shard = len(labels) // (k * num_clients)
    if shard < 1:
        raise ValueError(
            f"{len(labels)} samples are too few for {num_clients} partitions "
            f"x {k} classes (shard size n // (k*K) would be 0)"
        )
    members = {c_pos: np.flatnonzero(labels == c) for c_pos, c in enumerate(classes)}
    if with_replacement:
        rows = []
        for _ in range(num_clients):
            chosen = rng.choice(len(classes), size=k, replace=False)
            rows.append(
                np.concatenate([rng.choice(members[c], size=shard, replace=True) for c in chosen])
            )
        return rows

    assignment = _balanced_class_assignment(num_clients, k, len(classes), rng)
    holders_of = _holders(assignment, len(classes))
    rows_lists: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c_pos in range(len(classes)):
        holders = holders_of[c_pos]
        if not holders:
            continue
        pool = rng.permutation(members[c_pos])
        per = min(shard, len(pool) // len(holders))
        for j, holder in enumerate(holders):
            rows_lists[holder].append(pool[j * per : (j + 1) * per])
    return [np.concatenate(r) for r in rows_lists]


def _fixed_size_rows(
    labels: np.ndarray, num_clients: int, size: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """CompFL split: each client gets exactly ``size`` samples of ``k`` classes, balanced, disjoint.

    CompFL (Xu et al., FedKDD 2024): each client gets N classes, balanced samples
    per class, 500 samples per client.  Each client gets ``size // k`` samples of each
    of its classes, and ``size mod k`` of its classes (chosen at random) one more.
    Classes are spread evenly over clients (``k*K/C`` holders each, floor/ceil;
    see :func:`_balanced_class_assignment`) so that no class runs out early.
    Raises ``ValueError`` if some class has fewer samples than its holders need.
    """
    classes = np.unique(labels)
    _check_classes_per_client(k, len(classes))
    if size < k:
        raise ValueError(
            f"samples_per_partition={size} is smaller than num_classes_per_partition={k}"
        )
    assignment = _balanced_class_assignment(num_clients, k, len(classes), rng)
    # quota[i][c_pos]: samples of class c_pos for client i
    quota: list[dict[int, int]] = []
    for a in assignment:
        q = {int(c): size // k for c in a}
        for c in rng.choice(a, size=size % k, replace=False):
            q[int(c)] += 1
        quota.append(q)
    holders_of = _holders(assignment, len(classes))
    rows_lists: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c_pos, c in enumerate(classes):
        pool = rng.permutation(np.flatnonzero(labels == c))
        demand = [(i, quota[i][c_pos]) for i in holders_of[c_pos]]
        need = sum(n for _, n in demand)
        if need > len(pool):
            raise ValueError(
                f"class {c!r} has {len(pool)} samples but its {len(demand)} partitions "
                f"need {need} (samples_per_partition={size}, num_classes_per_partition={k})"
            )
        start = 0
        for holder, n in demand:
            rows_lists[holder].append(pool[start : start + n])
            start += n
    return [np.concatenate(r) for r in rows_lists]


def _shuffled(rows: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Every client's rows in random order, client after client, from the scheme's generator."""
    return [rng.permutation(r).astype(np.int64, copy=False) for r in rows]


# --------------------------------------------------------------------------- #
# make_partition
# --------------------------------------------------------------------------- #
# PartitionSpec fields whose run-config key is not just the field name with dashes.
_RUN_CONFIG_KEY = {"scheme": "partition", "alpha": "dirichlet-alpha"}


def _bad(key: str, value: Any, allowed: str) -> PartitionError:
    """Name the setting as the user wrote it in the run config (``classes-per-client``)."""
    setting = _RUN_CONFIG_KEY.get(key, key.replace("_", "-"))
    return PartitionError(f"setting {setting} = {value!r} is not allowed: {allowed}")


def _validate(spec: PartitionSpec, train_labels: np.ndarray, test_labels: np.ndarray,
              num_classes: int) -> None:
    """Reject bad settings early, with a message naming the setting and what is allowed."""
    n = len(train_labels)
    if spec.scheme not in SCHEMES:
        raise _bad("scheme", spec.scheme, "one of " + ", ".join(SCHEMES))
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise PartitionError(f"num_classes={num_classes!r} is not allowed: must be an int >= 1")
    for name, labels in (("train_labels", train_labels), ("test_labels", test_labels)):
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise PartitionError(
                f"{name} span {labels.min()}..{labels.max()}, allowed 0..{num_classes - 1} "
                f"(num_classes={num_classes})"
            )
    if not isinstance(spec.num_clients, (int, np.integer)) or not 1 <= spec.num_clients <= n:
        raise _bad("num_clients", spec.num_clients, f"an int between 1 and the {n} train samples")
    if not isinstance(spec.seed, (int, np.integer)) or spec.seed < 0:
        raise _bad("seed", spec.seed, "an int >= 0")
    if spec.local_test not in LOCAL_TEST_MODES:
        raise _bad("local_test", spec.local_test, "one of " + ", ".join(LOCAL_TEST_MODES))
    if not 0.0 <= spec.test_fraction <= 1.0:
        raise _bad("test_fraction", spec.test_fraction, "0 <= test_fraction <= 1")
    if not 0.0 <= spec.val_fraction < 1.0:
        raise _bad("val_fraction", spec.val_fraction, "0 <= val_fraction < 1")
    if spec.local_test == "split" and spec.test_fraction + spec.val_fraction >= 1.0:
        raise _bad(
            "val_fraction",
            spec.val_fraction,
            f"test_fraction + val_fraction < 1 in local_test='split' mode "
            f"(test_fraction={spec.test_fraction})",
        )
    cap = spec.max_samples_per_client
    if not isinstance(cap, (int, np.integer)) or cap < 0:
        raise _bad("max_samples_per_client", cap, "an int >= 0 (0 = no cap)")

    present = int(len(np.unique(train_labels)))
    if spec.scheme == "dirichlet":
        if not spec.alpha > 0:
            raise _bad("alpha", spec.alpha, "alpha > 0")
        if spec.min_partition_size < 0 or spec.min_partition_size * spec.num_clients > n:
            raise _bad(
                "min_partition_size",
                spec.min_partition_size,
                f"0 <= min_partition_size and min_partition_size * num_clients "
                f"({spec.num_clients}) <= {n} train samples",
            )
    if spec.scheme in ("pathological", "two-class", "fixed-size"):
        if not 1 <= spec.classes_per_client <= min(num_classes, present):
            raise _bad(
                "classes_per_client",
                spec.classes_per_client,
                f"between 1 and num_classes={num_classes}"
                + (f" ({present} present in train_labels)" if present < num_classes else ""),
            )
    if spec.scheme == "two-class" and n // (spec.classes_per_client * spec.num_clients) < 1:
        raise _bad(
            "num_clients",
            spec.num_clients,
            f"classes_per_client * num_clients <= {n} train samples for scheme 'two-class'",
        )
    if spec.scheme == "fixed-size":
        if spec.samples_per_client < spec.classes_per_client:
            raise _bad(
                "samples_per_client",
                spec.samples_per_client,
                f">= classes_per_client={spec.classes_per_client}",
            )
        if spec.samples_per_client * spec.num_clients > n:
            raise _bad(
                "samples_per_client",
                spec.samples_per_client,
                f"samples_per_client * num_clients ({spec.num_clients}) <= {n} train samples",
            )


_DIRICHLET_RESTARTS = 10  # fresh seeds, each with _DIRICHLET_DRAWS draws


def _dirichlet_seed(seed: int, restart: int) -> int:
    """Seed of Dirichlet restart ``restart`` (restart 0 uses ``seed`` itself)."""
    if restart == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), 99, restart]).generate_state(1)[0])


def _partition_train_indices(train_labels: np.ndarray, spec: PartitionSpec) -> list[np.ndarray]:
    """Train indices of every client under ``spec.scheme``, from the labels alone.

    The order of a client's indices matters: the cap and the hold-outs of
    :func:`make_partition` pick positions in it.
    """
    n = len(train_labels)
    if spec.scheme == "iid" or spec.scheme == "dirichlet":
        # Sharding contiguously (iid) and cutting each class in dataset order (dirichlet) would
        # give positional subsets, so both see the rows in a seeded random order.
        order = _rng(spec.seed, _STREAM_ROW_ORDER).permutation(n)
        if spec.scheme == "iid":
            return _iid_rows(order, spec.num_clients)
        # DirichletPartitioner gives up after its re-draws when min_partition_size is not met,
        # whereas NIID-Bench (FedClassAvg's code) re-draws until it is.  We approximate the
        # latter with up to _DIRICHLET_RESTARTS fresh seeds derived from spec.seed.
        labels = train_labels[order]
        for restart in range(_DIRICHLET_RESTARTS):
            rows = _dirichlet_rows(labels, spec.num_clients, spec.alpha,
                                   spec.min_partition_size, _dirichlet_seed(spec.seed, restart))
            if rows is not None:
                return [order[r] for r in rows]
        raise _scheme_failure(spec, None)
    rng = np.random.default_rng(int(spec.seed))
    try:
        if spec.scheme == "pathological":
            rows = _pathological_rows(train_labels, spec.num_clients, spec.classes_per_client, rng)
        elif spec.scheme == "two-class":
            rows = _two_class_rows(train_labels, spec.num_clients, spec.classes_per_client,
                                   spec.two_class_with_replacement, rng)
        elif spec.scheme == "fixed-size":
            rows = _fixed_size_rows(train_labels, spec.num_clients, spec.samples_per_client,
                                    spec.classes_per_client, rng)
        else:
            raise _bad("scheme", spec.scheme, "one of " + ", ".join(SCHEMES))
    except ValueError as exc:
        if isinstance(exc, PartitionError):
            raise
        raise _scheme_failure(spec, exc) from exc
    return _shuffled(rows, rng)


def _scheme_failure(spec: PartitionSpec, exc: ValueError | None) -> PartitionError:
    """A scheme that cannot be met, as a PartitionError naming the setting."""
    if spec.scheme == "dirichlet":
        return _bad(
            "min_partition_size",
            spec.min_partition_size,
            f"could not be met with alpha={spec.alpha} and num_clients={spec.num_clients} "
            f"within {_DIRICHLET_DRAWS * _DIRICHLET_RESTARTS} Dirichlet draws; lower "
            f"min_partition_size, raise alpha or use fewer clients",
        )
    if spec.scheme == "fixed-size":
        return _bad(
            "samples_per_client", spec.samples_per_client, f"feasible for every class: {exc}"
        )
    return PartitionError(f"scheme {spec.scheme!r} failed for {spec}: {exc}")


def make_partition(
    train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int, spec: PartitionSpec
) -> Partition:
    """Partition the train split into ``spec.num_clients`` clients, with per-client val/test.

    Parameters
    ----------
    train_labels, test_labels:
        Integer labels (0 .. num_classes-1) of the train and test pools.
    num_classes:
        Number of classes.
    spec:
        The :class:`PartitionSpec`.

    Raises
    ------
    PartitionError
        For invalid or infeasible settings (the message names the setting).
    """
    train_labels = np.asarray(train_labels).astype(np.int64).reshape(-1)
    test_labels = np.asarray(test_labels).astype(np.int64).reshape(-1)
    _validate(spec, train_labels, test_labels, num_classes)

    own_per_client = _partition_train_indices(train_labels, spec)
    test_pool_by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]

    clients = []
    for cid, own in enumerate(own_per_client):
        if len(own) == 0:
            raise PartitionError(
                f"scheme {spec.scheme!r} left client {cid} without samples "
                f"(num_clients={spec.num_clients}); use fewer clients"
            )
        # 1. cap the client's own samples (stratified, so proportions are kept)
        if 0 < spec.max_samples_per_client < len(own):
            _, own = _stratified_pick(
                own, train_labels, spec.max_samples_per_client, 0,
                _rng(spec.seed, _STREAM_CAP, cid),
            )
        n_own = len(own)
        # 2. "split": local test held out of the client's own samples
        test = np.empty(0, dtype=np.int64)
        if spec.local_test == "split":
            own, test = _stratified_pick(
                own, train_labels, round(spec.test_fraction * n_own), 1,
                _rng(spec.seed, _STREAM_SPLIT_TEST, cid),
            )
        # 3. validation held out of the client's own samples
        val = np.empty(0, dtype=np.int64)
        if spec.val_fraction > 0:
            own, val = _stratified_pick(
                own, train_labels, round(spec.val_fraction * n_own), 1,
                _rng(spec.seed, _STREAM_VAL, cid),
            )
        train = own
        # 4. "global": local test drawn once from the global test split
        if spec.local_test == "global":
            test = _draw_like(
                train_labels[train], test_pool_by_class,
                round(spec.test_fraction * len(train)),
                _rng(spec.seed, _STREAM_GLOBAL_TEST, cid),
            )
        # 5. CompFL "independent labels": perm[c] = this client's id of class c
        perm = None
        if spec.label_permutation:
            perm_rng = _rng(spec.seed, _STREAM_LABEL_PERM, cid)
            perm = perm_rng.permutation(num_classes).astype(np.int64)
            perm.setflags(write=False)
        clients.append(ClientSplit(_frozen(train), _frozen(val), _frozen(test), perm))
    return Partition(spec=spec, clients=tuple(clients))


# --------------------------------------------------------------------------- #
# Tensors per client
# --------------------------------------------------------------------------- #
def files_partition(data: "TensorData", spec: PartitionSpec) -> Partition:
    """``scheme = "files"``: the partition a federation's per-client files give
    (``fedapp.data.files``): client k trains on its training file and is tested on its test
    file; none of the other partition settings applies."""
    if data.clients is None:
        raise _bad("scheme", FILES_SCHEME, "a federation given as per-client files (dataset = "
                   "'federation'); other data sets are partitioned by another scheme")
    if spec.num_clients != len(data.clients):
        raise _bad("num_clients", spec.num_clients,
                   f"the {len(data.clients)} clients of the federation's files")
    if spec.local_test != "global" or spec.label_permutation:
        raise _bad("local_test" if spec.local_test != "global" else "label_permutation",
                   spec.local_test if spec.local_test != "global" else True,
                   "the default with per-client files: their test files are the local tests")
    empty = np.empty(0, dtype=np.int64)
    return Partition(spec=spec, clients=tuple(
        ClientSplit(_frozen(train), _frozen(empty), _frozen(test), None)
        for train, test in data.clients))


def client_data(data: "TensorData", partition: Partition, partition_id: int) -> ClientData:
    """Gather the tensors of client ``partition_id`` (copies; labels permuted if requested)."""
    if not 0 <= partition_id < len(partition.clients):
        raise PartitionError(
            f"partition_id={partition_id!r} is not allowed: 0..{len(partition.clients) - 1}"
        )
    split = partition.clients[partition_id]
    perm = None if split.label_permutation is None else torch.from_numpy(
        np.array(split.label_permutation, dtype=np.int64)
    )

    def take(x: torch.Tensor, y: torch.Tensor, idx: np.ndarray):
        index = torch.from_numpy(np.array(idx, dtype=np.int64))
        xs, ys = x.index_select(0, index), y.index_select(0, index)
        return xs, (perm[ys] if perm is not None else ys)

    test_x_pool, test_y_pool = (
        (data.test_x, data.test_y) if partition.spec.local_test == "global"
        else (data.train_x, data.train_y)
    )
    train_x, train_y = take(data.train_x, data.train_y, split.train)
    val_x, val_y = take(data.train_x, data.train_y, split.val)
    test_x, test_y = take(test_x_pool, test_y_pool, split.test)
    return ClientData(train_x, train_y, val_x, val_y, test_x, test_y)


_PARTITION_CACHE: "collections.OrderedDict[tuple, Partition]" = collections.OrderedDict()
_PARTITION_CACHE_SIZE = 8
_PARTITION_CACHE_LOCK = threading.Lock()


def _labels_key(data: "TensorData") -> str:
    """Cheap fingerprint of the labels (~1 ms for 70k labels), safer than ``id(data)``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(data.train_y.numpy().tobytes())
    h.update(b"|")
    h.update(data.test_y.numpy().tobytes())
    return h.hexdigest()


def get_partition(data: "TensorData", spec: PartitionSpec) -> Partition:
    """The :class:`Partition` of ``data`` under ``spec``, computed once per process."""
    key = (data.name, data.num_classes, _labels_key(data), spec)
    with _PARTITION_CACHE_LOCK:
        if key in _PARTITION_CACHE:
            _PARTITION_CACHE.move_to_end(key)
            return _PARTITION_CACHE[key]
    partition = (files_partition(data, spec) if spec.scheme == FILES_SCHEME else
                 make_partition(data.train_y.numpy(), data.test_y.numpy(), data.num_classes,
                                spec))
    with _PARTITION_CACHE_LOCK:
        _PARTITION_CACHE[key] = partition
        while len(_PARTITION_CACHE) > _PARTITION_CACHE_SIZE:
            _PARTITION_CACHE.popitem(last=False)
    return partition


def load_client_data(data: "TensorData", spec: PartitionSpec, partition_id: int) -> ClientData:
    """Tensors of client ``partition_id``; the partition itself is computed once per process.

    This is what a Flower ``ClientApp`` calls with its ``partition-id``: all
    clients simulated in one process share a single partitioning run.
    """
    return client_data(data, get_partition(data, spec), partition_id)
