"""The papers' partition schemes as flwr-datasets ``Partitioner`` s.

fedapp partitions with :func:`fedapp.data.partitions.make_partition`, which computes every
client's rows from the label array alone.  These classes give the same rows through the
``flwr_datasets.partitioner.Partitioner`` contract, for use with ``FederatedDataset`` or any
Hugging Face ``datasets.Dataset``: set ``dataset`` once, then ``load_partition(i)`` returns
``dataset.select(rows_i)``.  The whole assignment is computed on first use (it needs all labels
at once) and cached.  The schemes themselves (and their sources) are documented in
:mod:`fedapp.data.partitions`.

Importing this module imports ``datasets``; the rest of fedapp does not need it.
"""

from __future__ import annotations

from abc import abstractmethod

import datasets
import numpy as np
from flwr_datasets.partitioner import Partitioner

from fedapp.data.partitions import (
    _fixed_size_rows,
    _pathological_rows,
    _shuffled,
    _two_class_rows,
)

__all__ = ["FixedSizePartitioner", "PathologicalSharesPartitioner", "TwoClassPartitioner"]


class _LabelSkewPartitioner(Partitioner):
    """Shared plumbing: rows from the labels with ``default_rng(seed)``, then each shuffled."""

    def __init__(
        self,
        num_partitions: int,
        partition_by: str = "label",
        shuffle: bool = True,
        seed: int | None = 42,
    ) -> None:
        super().__init__()
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        self._num_partitions = int(num_partitions)
        self._partition_by = partition_by
        self._shuffle = shuffle
        self._seed = seed
        self._rows: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    @property
    def partition_rows(self) -> list[np.ndarray]:
        """Row positions (into ``self.dataset``) of every partition."""
        if self._rows is None:
            # Arrow format: the column as numpy without a per-row Python loop.
            labels = self.dataset.with_format("arrow")[self._partition_by].to_numpy()
            rng = np.random.default_rng(self._seed)
            rows = self._assign(labels, rng)
            if self._shuffle:
                rows = _shuffled(rows, rng)
            self._rows = [np.asarray(r, dtype=np.int64) for r in rows]
        return self._rows

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """Load partition ``partition_id`` (0 .. num_partitions - 1)."""
        if not 0 <= partition_id < self._num_partitions:
            raise ValueError(
                f"partition_id {partition_id} out of range 0..{self._num_partitions - 1}"
            )
        return self.dataset.select(self.partition_rows[partition_id])

    @abstractmethod
    def _assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """Return the row positions of every partition, given all labels."""


class PathologicalSharesPartitioner(_LabelSkewPartitioner):
    """pFedHN / FedGH pathological split (``scheme = "pathological"``): ``k`` classes per
    partition, each class cut among its holders in U(low, high) shares."""

    def __init__(
        self,
        num_partitions: int,
        num_classes_per_partition: int,
        partition_by: str = "label",
        low: float = 0.4,
        high: float = 0.6,
        shuffle: bool = True,
        seed: int | None = 42,
    ) -> None:
        super().__init__(num_partitions, partition_by, shuffle, seed)
        self._k = int(num_classes_per_partition)
        self._low, self._high = float(low), float(high)

    def _assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        return _pathological_rows(labels, self._num_partitions, self._k, rng,
                                  self._low, self._high)


class TwoClassPartitioner(_LabelSkewPartitioner):
    """FedClassAvg "skewed" split (``scheme = "two-class"``): ``k`` classes per partition,
    ``n/(kK)`` samples each; ``with_replacement=True`` as FedClassAvg's code."""

    def __init__(
        self,
        num_partitions: int,
        num_classes_per_partition: int = 2,
        with_replacement: bool = False,
        partition_by: str = "label",
        shuffle: bool = True,
        seed: int | None = 42,
    ) -> None:
        super().__init__(num_partitions, partition_by, shuffle, seed)
        self._k = int(num_classes_per_partition)
        self._with_replacement = bool(with_replacement)

    def _assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        return _two_class_rows(labels, self._num_partitions, self._k, self._with_replacement,
                               rng)


class FixedSizePartitioner(_LabelSkewPartitioner):
    """CompFL split (``scheme = "fixed-size"``): exactly ``samples_per_partition`` samples of
    ``num_classes_per_partition`` classes per partition, balanced, disjoint."""

    def __init__(
        self,
        num_partitions: int,
        samples_per_partition: int,
        num_classes_per_partition: int,
        partition_by: str = "label",
        shuffle: bool = True,
        seed: int | None = 42,
    ) -> None:
        super().__init__(num_partitions, partition_by, shuffle, seed)
        self._size = int(samples_per_partition)
        self._k = int(num_classes_per_partition)

    def _assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        return _fixed_size_rows(labels, self._num_partitions, self._size, self._k, rng)
