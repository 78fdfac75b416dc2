"""FedGH against Standalone and LG-FedAvg under Dirichlet 0.3 in several regimes: does replacing
the header by the global one every round cost accuracy when clients take few local steps, and
in which regime does the paper's ordering (FedGH above both) appear?

    .venv/bin/python reproduce/fedgh_regimes.py [--seed 0] [--rich]

Each cell changes one thing of ``conf/fedgh-fmnist-dirichlet.toml`` (10 clients, at most 300
samples each, two local epochs, all clients every round, 20 rounds): more local epochs per
round, more samples per client, or partial participation with one local epoch (few steps per
round, the regime outside the presets where FedGH lost most). ``--rich`` adds both more epochs
and more samples (the heaviest cell). Finished runs are reused (``results/fedgh-regimes/``).
Writes its table between its markers in ``docs/fedgh.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, run_experiment, write_generated  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rich", action="store_true")
    args = parser.parse_args()
    regimes = {**REGIMES, **(RICH if args.rich else {})}
    command = "reproduce/fedgh_regimes.py" + (" --rich" if args.rich else "") + \
        (f" --seed {args.seed}" if args.seed else "")
    lines = [f"Produced by `.venv/bin/python {command}`. Dirichlet 0.3, 10 clients, seed "
             f"{args.seed}: mean local test accuracy after the last round (FedGH's header: its "
             "own locally trained one; in brackets the global header installed).", "",
             "| regime | local steps per round (largest client) | Standalone | LG-FedAvg | FedGH "
             "| FedGH − Standalone | FedGH − LG-FedAvg |", "|---|---|---|---|---|---|---|"]
    for i, (regime, overrides) in enumerate(regimes.items()):
        acc = {}
        for label, method in METHODS.items():
            s = run_experiment(PRESET, {**overrides, "method": method, "seed": args.seed},
                               f"r{i}-{method}-s{args.seed}", OUT)
            acc[label] = s["accuracy"]["mean"]
            if method == "fedgh":
                header = s["accuracy"].get("variants", {}).get("global-header", {}).get("mean")
        lines.append(f"| {regime} | {steps(overrides)} | {acc['Standalone']:.4f} | "
                     f"{acc['LG-FedAvg']:.4f} | {acc['FedGH']:.4f}"
                     + (f" ({header:.4f})" if header is not None else "")
                     + f" | {acc['FedGH'] - acc['Standalone']:+.4f} | "
                     f"{acc['FedGH'] - acc['LG-FedAvg']:+.4f} |")
    table = "\n".join(lines)
    write_generated(DOC, "reproduce/fedgh_regimes.py", table)
    print(table)


if __name__ == "__main__":
    main()
