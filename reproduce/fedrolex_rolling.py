"""FedRolex against HeteroFL for as many rounds as its windows need to roll through every layer:
whether the paper's gain appears once they have (docs/fedrolex.md).

FedRolex's window of a layer of width w moves one channel a round, so in its page's 20 rounds a
client at rate 1/2 has held only 0.80, 0.65, 0.57 and 0.54 of ``heterofl-conv``'s 64, 128, 256
and 512 channels, against HeteroFL's leading 0.50: the two methods barely differ there, and the
page finds their global models level. The paper runs thousands of rounds, the windows passing
through every layer many times. Here the global model is ``heterofl-conv`` at an eighth of its
width (8, 16, 32 and 64 channels: ``model-width``), trained for 64 rounds, as many as its
widest layer has channels, so that every window rolls through its layer at least once; both
methods at HeteroFL's recipe but one local epoch a round (the same work for both), levels
a1-b1-c1-d1-e1, 10 clients of at most 300 Fashion-MNIST samples, IID and a sparse split
(Dirichlet 0.3, 30 % a round: rounds without a rate-1 client leave HeteroFL's outer
channels untrained). The claim, the paper's: FedRolex's global model (full width, the global
test set) ≥ HeteroFL's, paired by seed.

Each split runs twice: with every client's rate fixed (``rate-mode = "fix"``, the pages'
setting) and drawn anew every round (``"dynamic"``), the mode of every command in FedRolex's
README (``dynamic`` in each ``--control_name``). Under a fixed rate a narrow client's rolling
window is a new sub-network every round, where HeteroFL's narrow client keeps one; drawn anew,
HeteroFL's clients change sub-networks too.

    .venv/bin/python reproduce/fedrolex_rolling.py                # 3 seeds, both splits and modes
    .venv/bin/python reproduce/fedrolex_rolling.py --table-only   # runs nothing
    .venv/bin/python reproduce/fedrolex_rolling.py --quick        # a pipeline check

Finished runs are reused (results/fedrolex-rolling/, else their records). Writes its table
between its markers in docs/fedrolex.md (``--quick``: into the output folder only).
"""

from __future__ import annotations

import argparse
from typing import Any

import common
from common import (ROOT, VERDICT_RULE, add_page_options, claim_line, comparison_table,
                    finished, quick_folder, resource_overrides, run_experiment, run_parallel,
                    seeds_option, slug, write_generated)
from submodels_fmnist import BASE, QUICK, SPLITS

# Partial participation, where HeteroFL's outer channels, which only its two rate-1 clients hold,
# miss every round without either (about half the rounds at three clients of ten) and rolling
# windows train them anyway. (A split's first word names its runs.)
SPARSE = ("Sparse: Dirichlet 0.3, 30 % a round",
          {"partition": "dirichlet", "dirichlet-alpha": 0.3, "fraction-fit": 0.3})

SCRIPT = "reproduce/fedrolex_rolling.py"
WIDTH, ROUNDS = 0.125, 64  # ⌈w/8⌉ channels; rounds = the widest layer's 64 channels
SETTINGS = {**BASE, **dict(common.training("heterofl")), "model-width": WIDTH,
            "num-server-rounds": ROUNDS, "local-epochs": 1, "eval-every": 16}
METHODS = {"heterofl": "HeteroFL", "fedrolex": "FedRolex"}
# Who trains which rate: each client its own (the runs' names carry no mode), or a new draw
# every round from the levels' equal shares (named "-dynamic").
MODES = ("fix", "dynamic")


def settings_of(method: str, split: dict[str, Any], mode: str) -> dict[str, Any]:
    """Both methods' runs differ in ``method`` alone (and the split and the rate mode)."""
    return {**SETTINGS, **split, "method": method,
            **({f"{method}.rate-mode": mode} if mode != "fix" else {})}


def server_global(summary: dict[str, Any]) -> float:
    """The global model at full width on the global test set (the paper's metric)."""
    return float(summary["accuracy"]["server"]["global"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_page_options(parser, ROOT / "results" / "fedrolex-rolling")
    args = parser.parse_args()
    resources, seeds, out = resource_overrides(args), args.seeds, args.out.resolve()
    extra, doc, splits = {}, ROOT / "docs" / "fedrolex.md", [SPLITS[0], SPARSE]
    if args.quick:
        extra, seeds, out = {**QUICK, "eval-every": 1}, seeds[:1], quick_folder(out)
        doc, splits = out / "fedrolex.md", splits[:1]

    def experiments(method: str, split: str, settings: dict[str, Any], mode: str):
        name = slug(f"{method}-{split.split()[0]}" + ("" if mode == "fix" else f"-{mode}"))
        return [(None, {**settings_of(method, settings, mode), "seed": seed, **extra,
                        **resources}, f"{name}-seed{seed}") for seed in seeds]

    todo = {(m, split, mode): experiments(m, split, s, mode)
            for mode in MODES for split, s in splits for m in METHODS}
    if not args.table_only:
        run_parallel([e for runs in todo.values() for e in runs], out, args.jobs)
    tables, missing = [], []
    for mode in MODES:
        for split, _ in splits:
            where = f"{split}, rates {'fixed' if mode == 'fix' else 'drawn anew every round'}"
            if args.table_only and any(finished(out, n) is None
                                       for m in METHODS for _, _, n in todo[m, split, mode]):
                missing.append(where)
                continue
            results = {label: [run_experiment(*e, out) for e in todo[m, split, mode]]
                       for m, label in METHODS.items()}
            claim = claim_line("FedRolex's global model", "HeteroFL's global model",
                               results["FedRolex"], results["HeteroFL"], server_global)
            tables.append(comparison_table(
                f"FedRolex against HeteroFL, {where}, a 1/8-width global model",
                results, seeds, [("FedRolex", "HeteroFL")], metric=common.mean_client_accuracy,
                extra_claims=[claim]))
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + (
        seeds_option(args.seeds))
    write_generated(doc, SCRIPT, "\n\n".join([
        f"Produced by `{command}` (the first claim under each table reads the clients' "
        "local-test accuracy, the second the global model's, the paper's metric).",
        VERDICT_RULE, *tables,
        *([f"Not run yet at every seed: {', '.join(missing)}."] if missing else [])]))
    print(f"[reproduce] wrote {doc}")


if __name__ == "__main__":
    main()
