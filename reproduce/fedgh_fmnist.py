"""FedGH's heterogeneous comparison (paper Table 3) on Fashion-MNIST, data-scarce.

Runs Standalone, LG-FedAvg, FedProto, FedHe and FedGH (plus FedGH with the released code's
frozen header) on 10 clients with the CNN-1..5 mix, under the pathological 2/10 split
(conf/fedgh-fmnist-pathological.toml) and a Dirichlet(0.3) skew
(conf/fedgh-fmnist-dirichlet.toml), for several seeds, through ``fedapp run``; writes the table
into docs/fedgh.md (between its generated markers) and the curves into docs/fedgh-fmnist.png.

    .venv/bin/python reproduce/fedgh_fmnist.py                 # 3 seeds, 36 runs: 36 min of run time on 2 cores, plus their starts
    .venv/bin/python reproduce/fedgh_fmnist.py --seeds 0 --rounds 3   # a quick look

Finished runs are reused (their summary.json), so an interrupted reproduction resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import (DEFAULT_SEEDS, ROOT, VERDICT_RULE, cell, claim_line, mean_std,
                    per_client_accuracies, plot_panels, run_experiment, write_generated,
                    seeds_option)

# (label, method, overrides). Every method runs the same local training (the preset's SGD,
# E = local-epochs passes), so FedHe's update is set to full passes rather than the paper's
# three mini-batches: the comparison is then at equal local compute.
METHODS = [
    ("Standalone", "standalone", {}),
    ("LG-FedAvg", "lg-fedavg", {}),
    ("FedProto", "fedproto", {}),
    ("FedHe", "fedhe", {"local-steps": 0}),
    ("FedGH", "fedgh", {}),
    ("FedGH, frozen header (released code)", "fedgh", {"fedgh.server-head-training": False}),
]
SETTINGS = [("pathological 2/10", "fedgh-fmnist-pathological"),
            ("Dirichlet 0.3", "fedgh-fmnist-dirichlet")]
SCRIPT = "reproduce/fedgh_fmnist.py"


def row(label: str, summaries: list[dict]) -> str:
    accs = [np.mean(per_client_accuracies(s)) for s in summaries]
    client_std = np.mean([np.std(per_client_accuracies(s)) for s in summaries])
    glob = [s["accuracy"].get("global_mean") for s in summaries]
    header = [s["accuracy"].get("variants", {}).get("global-header", {}).get("mean")
              for s in summaries]
    com = summaries[0]["communication"]
    return (f"| {label} | {cell(accs)} | {client_std:.4f} | "
            f"{cell(glob) if None not in glob else '–'} | "
            f"{cell(header) if None not in header else '–'} | "
            f"{com['last_round_floats_per_client_up']:.0f} / "
            f"{com['last_round_floats_per_client_down']:.0f} | "
            f"{mean_std(s['wall_seconds'] for s in summaries)[0]:.0f} |")


def claims(results: dict[str, list[dict]]) -> list[str]:
    """The papers' orderings on the local accuracy, each judged by common.VERDICT_RULE."""
    return [claim_line(a, b, results[a], results[b])
            for a, b in [("FedGH", "Standalone"), ("FedGH", "LG-FedAvg"),
                         ("FedHe", "Standalone"), ("FedGH", "FedProto")]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="override num-server-rounds (default: the presets' 20)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reproduce-fedgh")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "fedgh.md")
    args = parser.parse_args()

    extra = {} if args.rounds is None else {"num-server-rounds": args.rounds}
    runs: dict[tuple[str, str], list[dict]] = {}
    for label, method, overrides in METHODS:  # method by method: the ablation comes last
        tag = label.split(",")[0].lower().replace(" ", "-") + (
            "-frozen" if "frozen" in label else "")
        for title, preset in SETTINGS:
            runs[title, label] = [
                run_experiment(preset, {"method": method, "seed": seed, **overrides, **extra},
                               f"{preset}-{tag}-seed{seed}", args.out.resolve())
                for seed in args.seeds]
    tables, panels = [], {}
    for title, _ in SETTINGS:
        results = {label: runs[title, label] for label, _, _ in METHODS}
        rounds = results["FedGH"][0]["rounds"]
        tables.append("\n".join([
            f"### {title} ({len(args.seeds)} seeds: {', '.join(map(str, args.seeds))}; "
            f"accuracy after round {rounds})",
            "",
            "| method | local accuracy (mean over clients; ± std over seeds) | std over "
            "clients | global-test accuracy | FedGH: global header installed | floats per "
            "client per round up / down | wall s |",
            "|---|---|---|---|---|---|---|",
            *(row(label, runs) for label, runs in results.items()),
            "",
            *(f"- {c}" for c in claims(results)),
        ]))
        panels[title] = {label: runs for label, runs in results.items()}
    plot = args.doc.parent / "fedgh-fmnist.png"
    plot_panels(panels, plot)
    command = f".venv/bin/python {SCRIPT}" + (
        seeds_option(args.seeds)) + (
        "" if args.rounds is None else f" --rounds {args.rounds}")
    write_generated(args.doc, SCRIPT, "\n\n".join([
        f"Produced by `{command}`.", VERDICT_RULE, *tables,
        f"![accuracy per round]({plot.name})"]))
    print(f"[reproduce] wrote {args.doc} and {plot}")


if __name__ == "__main__":
    main()
