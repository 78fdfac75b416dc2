"""FedHe without a round barrier on Fashion-MNIST: Private, FedHe in synchronous rounds and
FedHe asynchronous, with equal speeds and with 30 % of the clients 5x slower.

Runs conf/fedhe-async-fmnist.toml and conf/fedhe-async-stragglers-fmnist.toml (10 clients,
FedHe's CNNs 0-9, 3 mini-batches per update, 300 updates = 30 "rounds" of 10 updates) under
IID and Dirichlet 0.5 over several seeds, through ``fedapp run``. The virtual clock makes the
time comparison exact and reproducible (one virtual second = one update of a normal client);
Private, FedHe (synchronous, asynchronous) and the straggler runs run at every seed;
``--arrival`` repeats the straggler runs on IID at the first seed with the arrival clock, where
slow clients really sleep, for the wall time (a quiet machine's figure). Writes the tables into
docs/fedhe-async.md (between its generated markers) and the curves (accuracy per update;
accuracy per virtual second) into docs/fedhe-async-fmnist.png.

    .venv/bin/python reproduce/fedhe_async_fmnist.py                 # 3 seeds, 30 runs
    .venv/bin/python reproduce/fedhe_async_fmnist.py --seeds 0 --splits IID
    .venv/bin/python reproduce/fedhe_async_fmnist.py --quick         # pipeline check only
    .venv/bin/python reproduce/fedhe_async_fmnist.py --jobs 6 --client-num-gpus 0.25   # on a GPU

``--quick`` (one seed, IID, 3 rounds, 100-sample shards) writes into its own folder, never
into docs/. Finished runs are reused (their summary.json), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import (slug, DEFAULT_SEEDS, ROOT, VERDICT_RULE, add_resource_options, cell, claim_line,
                    mean_std, per_client_accuracies, quick_folder, resource_overrides,
                    run_experiment, run_parallel, training_caption, write_generated, seeds_option)

SCRIPT = "reproduce/fedhe_async_fmnist.py"
EQUAL, SLOW = "fedhe-async-fmnist", "fedhe-async-stragglers-fmnist"
SYNC = {"server-loop": "rounds"}
# (label, preset, overrides). Private is FedHe with alpha = 0: the same 3-batch updates as a
# FedHe client, and nothing of the others enters its loss (the paper's "Private" baseline;
# `standalone` would train local-epochs full passes instead).
PRIVATE = "Private (FedHe with alpha = 0)"
VARIANTS = [
    (PRIVATE, EQUAL, {"fedhe.alpha": 0.0, **SYNC}),
    ("FedHe synchronous", EQUAL, SYNC),
    ("FedHe asynchronous", EQUAL, {}),
]
STRAGGLERS = [  # the virtual clock makes their time exact at any seed
    ("FedHe synchronous, 30 % 5x slower", SLOW, SYNC),
    ("FedHe asynchronous, 30 % 5x slower", SLOW, {}),
]
ARRIVAL = [  # IID, first seed only: the same straggler runs in real time (wall time)
    ("FedHe synchronous, 30 % 5x slower, arrival clock", SLOW, {**SYNC, "clock": "arrival"}),
    ("FedHe asynchronous, 30 % 5x slower, arrival clock", SLOW, {"clock": "arrival"}),
]
SPLITS = [("IID", {"partition": "iid"}), ("Dirichlet 0.5", {"partition": "dirichlet",
                                                            "dirichlet-alpha": 0.5})]
# Every client is evaluated every 50 updates (5 rounds) instead of every 10: evaluation on 600
# images per client costs more than the 3-batch updates themselves, and the last update is
# always evaluated, so the accuracies in the tables do not change; the curves have 6 points.
EVAL = {"eval-every": 5, "async-eval-every": 50}
QUICK = {"num-server-rounds": 3, "max-samples-per-client": 100, "global-test-samples": 100}


def global_mean(summary: dict) -> float:
    return float(np.mean(list(summary["accuracy"]["global_per_client"].values())))


def evaluated(summary: dict) -> list[bool]:
    """Which entries of the history hold an evaluation (``eval-every`` skips the others)."""
    return [h.get("global_accuracy_mean") is not None for h in summary["history"]]


def at_evaluations(summary: dict, values: list) -> list:
    return [v for v, e in zip(values, evaluated(summary)) if e]


def updates_axis(summary: dict) -> list[int]:
    """Committed updates at each evaluation (synchronous: round x clients that trained)."""
    if summary.get("loop") == "async":
        return at_evaluations(summary, [h["updates"] for h in summary["history"]])
    return at_evaluations(summary, list(np.cumsum([h["clients_fit"]
                                                   for h in summary["history"]])))


def virtual_axis(summary: dict) -> list[float]:
    return at_evaluations(summary, list(np.cumsum([h["virtual_seconds"]
                                                   for h in summary["history"]])))


def row(label: str, runs: list[dict]) -> str:
    staleness = [s["staleness"]["mean"] for s in runs if "staleness" in s]
    per_client = [s["updates"]["per_client"] for s in runs if "updates" in s]
    total = updates_axis(runs[0])[-1]
    spread = (f"{min(min(c.values()) for c in per_client)}–"
              f"{max(max(c.values()) for c in per_client)}") if per_client else \
        f"{total / runs[0]['num_clients']:g} each"
    virtual = [s["virtual_seconds"] for s in runs]
    return (f"| {label} | {cell(global_mean(s) for s in runs)} | "
            f"{cell(np.mean(per_client_accuracies(s)) for s in runs)} | "
            f"{total} | {spread} | "
            f"{'—' if None in virtual else f'{np.mean(virtual):.1f}'} | "
            f"{mean_std(s['wall_seconds'] for s in runs)[0]:.0f} | "
            f"{f'{np.mean(staleness):.1f}' if staleness else '0'} |")


def claims(results: dict[str, list[dict]]) -> list[str]:
    """The paper's ordering and the asynchronous loop's, on the global-test accuracy, each
    judged by common.VERDICT_RULE; then the straggler runs' virtual time."""
    out = [claim_line(fedhe, "Private (paper)", results[fedhe], results[PRIVATE], global_mean)
           for fedhe in ("FedHe synchronous", "FedHe asynchronous")]
    # The asynchronous loop is as good as the synchronous one when this is level or holds.
    out.append(claim_line("FedHe asynchronous", "FedHe synchronous at the same number of "
                          "updates", results["FedHe asynchronous"],
                          results["FedHe synchronous"], global_mean))
    slow = [label for label in results if "slower" in label and "arrival" not in label]
    if len(slow) == 2:
        sync, asyn = (np.mean([s["virtual_seconds"] for s in results[label]])
                      for label in slow)  # synchronous first
        n = updates_axis(results["FedHe asynchronous"][0])[-1]
        out.append(f"with stragglers the asynchronous loop reaches the same {n} updates in "
                   f"{asyn:.1f} virtual seconds against {sync:.1f} in synchronous rounds "
                   f"({sync / asyn:.1f}x less time)")
    return out


def plot(panels: dict[str, dict[str, list[dict]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 8), squeeze=False)
    for col, (title, results) in enumerate(panels.items()):
        for i, (label, runs) in enumerate(results.items()):
            curves = np.array([at_evaluations(s, [h.get("global_accuracy_mean")
                                                  for h in s["history"]]) for s in runs])
            mean = curves.mean(0)
            style = dict(marker="o", ms=2, label=label, color=f"C{i}",
                         linestyle="--" if label.startswith("FedHe synchronous") else "-")
            axes[0][col].plot(updates_axis(runs[0]), mean, **style)
            if "slower" in label:
                axes[1][col].plot(virtual_axis(runs[0]), mean, **style)
        axes[0][col].set(xlabel="client updates", ylabel="global-test accuracy (mean over "
                         "clients and seeds)", title=title)
        axes[1][col].set(xlabel="virtual time (1 = one update of a normal client)",
                         ylabel="global-test accuracy", title=f"{title}: stragglers")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def split_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a comparison on FedHe's CNNs over SPLITS: --seeds and --splits (the
    script adds its own, then calls parse_split_options)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--splits", nargs="+", choices=[s.split()[0] for s, _ in SPLITS],
                        default=[s.split()[0] for s, _ in SPLITS],
                        help="which partitions (default: both)")
    return parser


def parse_split_options(parser: argparse.ArgumentParser, out: str,
                        doc: str) -> argparse.Namespace:
    """Adds --quick, --out (results/``out``), --doc (docs/``doc``) and the resource options,
    and parses."""
    parser.add_argument("--quick", action="store_true",
                        help="one seed, IID, 3 rounds, small shards; tables go to --out only")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / doc)
    add_resource_options(parser)
    return parser.parse_args()


def quick_or_full(args: argparse.Namespace, quick: dict) -> tuple[list, dict, list[int], Path,
                                                                  Path]:
    """(splits, overrides every run adds, seeds, runs' folder, page): with --quick, ``quick``
    on one seed and IID, into the folder's quick/ and a page of its own, never docs/."""
    splits = [(name, o) for name, o in SPLITS if name.split()[0] in args.splits]
    if not args.quick:
        return splits, {}, args.seeds, args.out.resolve(), args.doc
    out = quick_folder(args.out.resolve())
    return SPLITS[:1], quick, args.seeds[:1], out, out / args.doc.name


def main() -> None:
    parser = split_parser(__doc__)
    parser.add_argument("--stragglers", action=argparse.BooleanOptionalAction, default=True,
                        help="also the runs with 30 %% of the clients 5x slower")
    parser.add_argument("--arrival", action="store_true",
                        help="also the straggler runs on the arrival clock, where slow clients "
                        "really sleep (IID, first seed): a wall-time figure, for a quiet machine")
    args = parse_split_options(parser, "reproduce-fedhe-async", "fedhe-async.md")
    splits, extra, seeds, out, doc = quick_or_full(args, QUICK)
    resources = resource_overrides(args)

    def plan(split: str, split_overrides: dict, every: bool) -> dict[str, list[tuple]]:
        """Each row's (preset, overrides, run name) per seed: Private against FedHe, and with
        ``every`` the straggler runs, at every seed; the arrival runs at the first seed."""
        variants = ([(v, seeds) for v in VARIANTS]
                    + ([(v, seeds) for v in STRAGGLERS] if every and args.stragglers else [])
                    + ([(v, seeds[:1]) for v in ARRIVAL]
                       if every and split == "IID" and args.arrival else []))
        rows = {}
        for (label, preset, overrides), runs_seeds in variants:
            name = slug(f"{split.split()[0]} {label}")
            if len(runs_seeds) < len(seeds):
                label = f"{label} (seed {runs_seeds[0]} only)"
            rows[label] = [(preset, {**overrides, **split_overrides, **EVAL, "seed": seed,
                                     **extra, **resources}, f"{name}-seed{seed}")
                           for seed in runs_seeds]
        return rows

    # Private against FedHe at every seed on both splits first; then the straggler runs (one
    # at a time unless --jobs says otherwise), so an interrupted reproduction has the main
    # comparison first.
    todo = [e for every in (False, True) for split, o in splits
            for runs_of in plan(split, o, every).values() for e in runs_of]
    run_parallel(todo, out, args.jobs)
    for e in todo:
        run_experiment(*e, out)
    tables, panels = [], {}
    for split, split_overrides in splits:
        results = {label: [run_experiment(*e, out) for e in runs_of]
                   for label, runs_of in plan(split, split_overrides, every=True).items()}
        tables.append("\n".join([
            f"### {split} ({len(seeds)} seed(s): {', '.join(map(str, seeds))})", "",
            "| run | global-test accuracy (mean over clients; ± std over seeds) | local-test "
            "accuracy | updates | updates per client | virtual seconds | wall s | mean "
            "staleness |",
            "|---|---|---|---|---|---|---|---|",
            *(row(label, runs) for label, runs in results.items()), "",
            *(f"- {c}" for c in claims(results))]))
        panels[split] = {k: v for k, v in results.items() if "arrival" not in k}
    image = doc.parent / "fedhe-async-fmnist.png"
    plot(panels, image)
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + (
        seeds_option(args.seeds)) + (
        "" if len(splits) == len(SPLITS) or args.quick else " --splits " + " ".join(
            args.splits)) + ("" if args.stragglers else " --no-stragglers") + (
        " --arrival" if args.arrival else "")
    caption = (f"Every run, Private included, trains each client the same way: "
               f"{training_caption(EQUAL)}; a synchronous round is one update of every client.")
    write_generated(doc, SCRIPT, "\n\n".join([f"Produced by `{command}`.", caption,
                                              VERDICT_RULE, *tables,
                                              f"![accuracy per update and per virtual second]"
                                              f"({image.name})"]))
    print(f"[reproduce] wrote {doc} and {image}")


if __name__ == "__main__":
    main()
