"""CompFL's comparison (paper Table 2) and ablation (Table 3) on Fashion-MNIST.

Runs Standalone, FedAvg (every client on the small expert, the only way it applies), LG-FedAvg,
FedPer, FedRep and CompFL on conf/compfl-fmnist.toml — 20 clients (10 small + 10 large
experts; ``--clients 10`` for 5 + 5), 500 samples per client — for N in {3, 5} classes per
client, with unified and independent (per-client permuted) labels, over several seeds; then
CompFL's ablation (align / greedy / kd alone and in pairs) by configuration alone. Writes the
tables into docs/compfl.md (between its generated markers) and the curves into
docs/compfl-fmnist.png.

    .venv/bin/python reproduce/compfl_fmnist.py                   # 3 seeds: several hours
    .venv/bin/python reproduce/compfl_fmnist.py --clients 10 --seeds 0
    .venv/bin/python reproduce/compfl_fmnist.py --quick           # checks the pipeline only

``--quick`` runs every method once on a tiny setting (4 clients, 100 samples, 2 rounds, one
seed, no ablation) into its own folder and writes its table there, never into docs/.
Finished runs are reused (their summary.json), so an interrupted reproduction resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import (DEFAULT_SEEDS, ROOT, cell, mean_std, paired_line, per_architecture,
                    per_client_accuracies, plot_panels, quick_folder, run_experiment,
                    write_generated)

PRESET = "compfl-fmnist"
SCRIPT = "reproduce/compfl_fmnist.py"
# (label, overrides). FedAvg averages whole models, so it runs with one architecture.
METHODS = [
    ("Standalone", {"method": "standalone"}),
    ("FedAvg (small expert only)", {"method": "fedavg", "arch-mix": "fedpac-cnn"}),
    ("LG-FedAvg", {"method": "lg-fedavg"}),
    ("FedPer", {"method": "fedper"}),
    ("FedRep", {"method": "fedrep"}),
    ("CompFL", {"method": "compfl"}),
]
# Table 3: which of align / greedy / kd are on (all three = CompFL above; none = FedPer-like).
ABLATION = [("align",), ("greedy",), ("kd",), ("align", "greedy"), ("align", "kd")]
COMPONENTS = ("align", "greedy", "kd")


def ablation_overrides(on: tuple[str, ...]) -> dict:
    return {"method": "compfl", **{f"compfl.{c}": c in on for c in COMPONENTS}}


def accuracy(summary: dict) -> float:
    return float(np.mean(per_client_accuracies(summary)))


def row(label: str, summaries: list[dict]) -> str:
    com = summaries[0]["communication"]
    arch_text = per_architecture(summaries)
    return (f"| {label} | {cell(accuracy(s) for s in summaries)} | {arch_text} | "
            f"{com['floats_per_client_per_round_up']:.0f} / "
            f"{com['floats_per_client_per_round_down']:.0f} | "
            f"{mean_std(s['wall_seconds'] for s in summaries)[0]:.0f} |")


# The paper's claims, each a difference of two rows of a table, paired by seed.
PAIRS = [("CompFL", "FedPer"), ("CompFL", "FedRep"), ("CompFL", "Standalone"),
         ("FedRep", "Standalone"), ("FedPer", "Standalone"), ("LG-FedAvg", "Standalone")]
BASELINE = "FedPer (baseline of Table 3)"
SHORT = {BASELINE: "FedPer"}  # how a row is named in the paired differences


TABLE_HEAD = ["| method | local accuracy (mean over clients; ± std over seeds) | per "
              "architecture | floats per client per round up / down | wall s |",
              "|---|---|---|---|---|"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="override num-server-rounds (default: the preset's 30)")
    parser.add_argument("--clients", type=int, choices=(20, 10), default=20,
                        help="20 (10 + 10, the paper) or 10 (5 + 5)")
    parser.add_argument("--classes", type=int, nargs="+", default=[3, 5],
                        help="classes per client N")
    parser.add_argument("--ablation-classes", type=int, default=5,
                        help="N of the ablation (unified labels)")
    parser.add_argument("--quick", action="store_true",
                        help="one tiny run per method to check the pipeline (not for docs)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reproduce-compfl")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "compfl.md")
    args = parser.parse_args()

    extra = {"num-clients": args.clients}
    if args.rounds is not None:
        extra["num-server-rounds"] = args.rounds
    seeds, classes, labelings = args.seeds, args.classes, [("unified", False),
                                                             ("independent", True)]
    ablation = ABLATION
    if args.quick:
        extra = {"num-clients": 4, "samples-per-client": 100, "num-server-rounds": 2}
        seeds, classes, labelings, ablation = [0], [3], [("unified", False)], []
        args.out = quick_folder(args.out)
        args.doc = args.out / "compfl-quick.md"
    out = args.out.resolve()

    def runs(tag: str, overrides: dict, n: int, permuted: bool) -> list[dict]:
        setting = {"classes-per-client": n, "label-permutation": permuted}
        name = f"{PRESET}-c{extra['num-clients']}-n{n}-{'perm' if permuted else 'unif'}-{tag}"
        return [run_experiment(PRESET, {**overrides, **setting, **extra, "seed": seed},
                               f"{name}-seed{seed}", out) for seed in seeds]

    tables, panels = [], {}
    for n in classes:
        for labels, permuted in labelings:
            results = {label: runs(label.split(" ")[0].lower(), overrides, n, permuted)
                       for label, overrides in METHODS}
            title = f"N = {n}, {labels} labels"
            tables.append("\n".join([f"### {title}", "", *TABLE_HEAD,
                                     *(row(label, s) for label, s in results.items()), "",
                                     paired_line(results, PAIRS, SHORT)]).rstrip())
            panels[title] = results
    if ablation:
        n = args.ablation_classes
        results = {" + ".join(on): runs("ablation-" + "-".join(on), ablation_overrides(on), n,
                                        False) for on in ablation}
        results["align + greedy + kd (CompFL)"] = runs("compfl", {"method": "compfl"}, n, False)
        results[BASELINE] = runs("fedper", {"method": "fedper"}, n, False)
        tables.append("\n".join([f"### Ablation (Table 3): N = {n}, unified labels", "",
                                 *TABLE_HEAD, *(row(label, s) for label, s in results.items()),
                                 "", paired_line(results, [(label, BASELINE) for label in results
                                                           if label != BASELINE], SHORT)]).rstrip())
    rounds = next(iter(panels.values()))["CompFL"][0]["rounds"]
    plot = args.doc.parent / "compfl-fmnist.png"
    plot_panels(panels, plot)
    command = f".venv/bin/python {SCRIPT}" + ("" if seeds == [0, 1, 2] or args.quick else
                                             " --seeds " + " ".join(map(str, seeds)))
    command += " --quick" if args.quick else "".join(
        [f" --clients {args.clients}" if args.clients != 20 else "",
         f" --rounds {args.rounds}" if args.rounds is not None else "",
         " --classes " + " ".join(map(str, classes)) if classes != [3, 5] else ""])
    write_generated(args.doc, SCRIPT, "\n\n".join([
        f"Produced by `{command}` ({len(seeds)} seed(s): {', '.join(map(str, seeds))}; "
        f"accuracy after round {rounds}).", *tables, f"![accuracy per round]({plot.name})"]))
    print(f"[reproduce] wrote {args.doc} and {plot}")


if __name__ == "__main__":
    main()
