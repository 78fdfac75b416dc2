"""FedGH against Standalone and LG-FedAvg under Dirichlet 0.3 in several regimes: does replacing
the header by the global one every round cost accuracy when clients take few local steps, and
in which regime does the paper's ordering (FedGH above both) appear?

    .venv/bin/python reproduce/fedgh_regimes.py [--seeds 0 1 2] [--rich] [--jobs 2]

Each cell changes one thing of ``conf/fedgh-fmnist-dirichlet.toml`` (10 clients, at most 300
samples each, two local epochs, all clients every round, 20 rounds): more local epochs per
round, more samples per client, or partial participation with one local epoch (few steps per
round, the regime outside the presets where FedGH lost most). ``--rich`` adds both more epochs
and more samples (the heaviest cell). Three seeds by default (36 runs); a cell is the mean over
seeds, a difference the mean ± std over seeds of the seed-by-seed difference (two runs of one
seed share the partition and the initial weights). Finished runs are reused
(``results/fedgh-regimes/``). Writes its table between its markers in ``docs/fedgh.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, ROOT, add_resource_options, mean_client_accuracy,  # noqa: E402
                    mean_std, paired, resource_overrides, run_experiment, run_parallel,
                    write_generated, seeds_option)

PRESET = "conf/fedgh-fmnist-dirichlet.toml"
OUT = ROOT / "results" / "fedgh-regimes"
DOC = ROOT / "docs" / "fedgh.md"
METHODS = {"Standalone": "standalone", "LG-FedAvg": "lg-fedavg", "FedGH": "fedgh"}
REGIMES: dict[str, dict[str, Any]] = {
    "preset: 300 samples, E = 2, all clients, 20 rounds": {},
    "E = 10 local epochs": {"local-epochs": 10},
    "1200 samples per client": {"max-samples-per-client": 1200},
    "30 % of clients per round, E = 1, 40 rounds": {"fraction-fit": 0.3, "local-epochs": 1,
                                                    "num-server-rounds": 40},
}
RICH = {"E = 10 and 1200 samples per client": {"local-epochs": 10,
                                               "max-samples-per-client": 1200}}


def steps(overrides: Mapping[str, Any]) -> str:
    """Local SGD steps per round of a client with the cap's samples (batch 64)."""
    samples = overrides.get("max-samples-per-client", 300)
    return str(overrides.get("local-epochs", 2) * -(-samples // 64))


def global_header(summary: Mapping[str, Any]) -> float:
    """FedGH's accuracy with the server's header installed on each client's extractor."""
    return summary["accuracy"]["variants"]["global-header"]["mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--rich", action="store_true")
    add_resource_options(parser)
    args = parser.parse_args()
    regimes = {**REGIMES, **(RICH if args.rich else {})}
    plan = {(regime, label): [(PRESET, {**overrides, "method": method, "seed": seed,
                                        **resource_overrides(args)}, f"r{i}-{method}-s{seed}")
                              for seed in args.seeds]
            for i, (regime, overrides) in enumerate(regimes.items())
            for label, method in METHODS.items()}
    run_parallel([e for row in plan.values() for e in row], OUT, args.jobs)
    runs = {key: [run_experiment(*e, OUT) for e in row] for key, row in plan.items()}

    command = "reproduce/fedgh_regimes.py" + (" --rich" if args.rich else "") + (
        seeds_option(args.seeds))
    one = len(args.seeds) == 1
    lines = [f"Produced by `.venv/bin/python {command}`. Dirichlet 0.3, 10 clients, seed"
             f"{'' if one else 's'} {', '.join(map(str, args.seeds))}: mean local test accuracy "
             "after the last round" + ("" if one else ", mean over seeds") + " (FedGH's header: "
             "its own locally trained one; in brackets the global header installed)"
             + ("" if one else "; the differences paired by seed, mean ± std over seeds") + ".",
             "", "| regime | local steps per round (largest client) | Standalone | LG-FedAvg | "
             "FedGH | FedGH − Standalone | FedGH − LG-FedAvg |", "|---" * 7 + "|"]
    for regime, overrides in regimes.items():
        acc = {label: mean_std(map(mean_client_accuracy, runs[regime, label]))[0]
               for label in METHODS}
        header = mean_std(map(global_header, runs[regime, "FedGH"]))[0]
        diffs = [paired(runs[regime, "FedGH"], runs[regime, other])
                 for other in ("Standalone", "LG-FedAvg")]
        lines.append(f"| {regime} | {steps(overrides)} | {acc['Standalone']:.4f} | "
                     f"{acc['LG-FedAvg']:.4f} | {acc['FedGH']:.4f} ({header:.4f}) | "
                     + " | ".join(f"{m:+.4f}" + ("" if one else f" ± {sd:.4f}")
                                  for m, sd in diffs) + " |")
    table = "\n".join(lines)
    write_generated(DOC, "reproduce/fedgh_regimes.py", table)
    print(table)


if __name__ == "__main__":
    main()
