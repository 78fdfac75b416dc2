"""What does each robust-aggregation rule cost the server?

Times, on this machine's CPU, the server's combination of n uploads of D values under every
rule (``fedapp.runtime.aggregate.robust_average``: the coordinate-wise median and trimmed mean,
Krum and multi-Krum with their n^2 pairwise distances, the geometric median's Weiszfeld
iterations, the norm bound), beside the plain weighted average (rule ``none``), and the filter
of the pairs a server trains on (``filter_pairs``: per label, over the rows of that label) for
the same rules. The uploads are random normal vectors, one in ten scaled by 100 (an attacker:
Weiszfeld's iterations depend on the data), drawn from a fixed seed. Each figure is the median
of ``--repeats`` timings, in milliseconds. No Flower process, no training: the maths only.

Record a figure only from a quiet machine (nothing else running): the timings are of a few
milliseconds and move with any other load.

    .venv/bin/python benchmarks/robust_rules.py                          # n = 10, 20, 50; D = 1e5
    .venv/bin/python benchmarks/robust_rules.py --clients 5 10 --dim 20000 --repeats 3
    .venv/bin/python benchmarks/robust_rules.py --pairs-per-label 5 20 --pair-dim 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedapp.runtime.aggregate import Robust, filter_pairs, robust_average  # noqa: E402

RULES = ("none", "median", "trimmed-mean", "krum", "multi-krum", "geomed", "norm-bound")


def uploads(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """n random uploads of ``dim`` float32 values; every tenth (at least the last) scaled by
    100, as an attacker's."""
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    rows[::-10] *= 100.0
    return rows


def robust_of(rule: str) -> Robust:
    # f = 1 keeps Krum's condition n > 2f + 2 for n >= 5; smaller n falls back to the median.
    return Robust(rule, trim_fraction=0.1, krum_f=1, norm_bound=1.0)


def median_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def averages(clients: list[int], dim: int, repeats: int) -> None:
    print(f"robust_average: n uploads of D = {dim} values (ms, median of {repeats})")
    print("| n | " + " | ".join(RULES) + " |")
    print("|---" * (len(RULES) + 1) + "|")
    for n in clients:
        payloads = [{"w": row} for row in uploads(n, dim)]
        weights = [1.0] * n
        cells = [median_ms(lambda r=rule: robust_average(payloads, weights, robust_of(r)),
                           repeats) for rule in RULES]
        print(f"| {n} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def pair_filters(per_label: list[int], dim: int, labels: int, repeats: int) -> None:
    print(f"\nfilter_pairs: {labels} labels x m rows of d = {dim} values (ms, median of "
          f"{repeats})")
    print("| m | " + " | ".join(RULES) + " |")
    print("|---" * (len(RULES) + 1) + "|")
    for m in per_label:
        rows = uploads(m * labels, dim)
        label = np.repeat(np.arange(labels), m)
        cells = [median_ms(lambda r=rule: filter_pairs(rows, label, robust_of(r)), repeats)
                 for rule in RULES]
        print(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 50],
                        help="numbers of uploads n to combine")
    parser.add_argument("--dim", type=int, default=100_000,
                        help="values per upload D (a head of 64 x 10 is 650, a small CNN 1e5)")
    parser.add_argument("--pairs-per-label", type=int, nargs="+", default=[5, 20, 50],
                        help="rows per label m the pair filter sees")
    parser.add_argument("--pair-dim", type=int, default=512, help="values per row d")
    parser.add_argument("--labels", type=int, default=10, help="labels C")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import logging
    logging.getLogger("flwr").setLevel(logging.ERROR)  # too-few warnings of small n
    averages(args.clients, args.dim, args.repeats)
    pair_filters(args.pairs_per_label, args.pair_dim, args.labels, args.repeats)


if __name__ == "__main__":
    main()
