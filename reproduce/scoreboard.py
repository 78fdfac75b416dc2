"""The scoreboard: every registered method, and every loop it can run, on a few common settings
at three seeds, beside Standalone — one table to choose a method by.

Fashion-MNIST, 10 clients of at most 300 training samples, the CNN-1..5 mix (FedGH's Table 2
CNNs, round-robin), 20 rounds. Every method does the same local work per update — one epoch of
batches of 10 (HtFLlib's), so 30 optimizer steps — with the rest of its recipe (optimizer, lr,
optimizer lifetime: docs/recipes.md) as its authors train. The settings differ only in how the
data is split and how many clients train per round:

- IID; Dirichlet 0.3; two classes per client (pathological); Dirichlet 0.3 with 30 % of the
  clients sampled per round.

FedAvg needs one architecture: it runs on the smallest of the mix (CNN-5, the model FML, FedMRL
and FedKD share), with a Standalone of it beside. The asynchronous loop (methods whose server
folds in one upload at a time) and the device-to-device loops (walk, gossip) have their own
rows; they are not run at 30 % participation, a notion of the synchronous round.

Each cell: mean ± std over the seeds of the mean per-client local-test accuracy after the last
round, and its difference to Standalone on the same setting. Writes docs/scoreboard.md (between
its generated markers) and docs/scoreboard.png.

    .venv/bin/python reproduce/scoreboard.py                              # everything, 3 seeds
    .venv/bin/python reproduce/scoreboard.py --settings dir0.3            # one column
    .venv/bin/python reproduce/scoreboard.py --settings dir0.3 --methods fedgh fd
    .venv/bin/python reproduce/scoreboard.py --table-only                 # runs nothing

Finished runs are reused (results/scoreboard/), so an interrupted scoreboard resumes and a
column run alone joins the others in the table; cells whose runs do not exist read "not run".
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, mean_std, mean_client_accuracy, run_seeds, write_generated  # noqa: E402

SCRIPT = "reproduce/scoreboard.py"
OUT = ROOT / "results" / "scoreboard"
DOC = ROOT / "docs" / "scoreboard.md"
PLOT = ROOT / "docs" / "scoreboard.png"
SEEDS = [0, 1, 2]

COMMON = {"dataset": "fmnist", "num-clients": 10, "max-samples-per-client": 300,
          "arch-mix": "cnn1,cnn2,cnn3,cnn4,cnn5", "num-server-rounds": 20, "eval-every": 5,
          # The same local work for every method (its recipe decides everything else).
          "local-epochs": 1, "local-steps": 0, "batch-size": 10}
# key -> (column title, settings)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "iid": ("IID", {"partition": "iid"}),
    "dir0.3": ("Dirichlet 0.3", {"partition": "dirichlet", "dirichlet-alpha": 0.3}),
    "two-class": ("2 classes per client", {"partition": "pathological",
                                            "classes-per-client": 2}),
    "dir0.3-p30": ("Dirichlet 0.3, 30 % per round", {"partition": "dirichlet",
                                                     "dirichlet-alpha": 0.3,
                                                     "fraction-fit": 0.3}),
}
ROUNDS_ONLY = {"dir0.3-p30"}          # settings that only the synchronous loop has
ONE_ARCH = {"arch-mix": "cnn5"}       # FedAvg: the smallest CNN of the mix


def rows() -> list[tuple[str, str]]:
    """(method, loop) for every registered method and every loop it can run."""
    from strategies import METHODS
    out = []
    for name, method in METHODS.items():
        out.append((name, "rounds"))
        if method.asynchronous and name != "standalone":  # local training has no server
            out.append((name, "async"))
        if method.decentralised:
            out += [(name, "walk"), (name, "gossip")]
    return out


def run_name(setting: str, method: str, loop: str, one_arch: bool) -> str:
    name = f"{setting}-{method}" + ("" if loop == "rounds" else f"-{loop}")
    return re.sub(r"[^a-z0-9.]+", "-", name) + ("-cnn5" if one_arch else "")


def overrides(setting: str, method: str, loop: str, one_arch: bool) -> dict[str, Any]:
    return {**COMMON, **SETTINGS[setting][1], "method": method,
            **({} if loop == "rounds" else {"server-loop": loop}),
            **(ONE_ARCH if one_arch else {})}


def runs(setting: str, method: str, loop: str, one_arch: bool, seeds: list[int],
         execute: bool, out: Path) -> list[dict] | None:
    """The seeds' summaries; ``execute`` runs the missing ones, otherwise None if any is."""
    name = run_name(setting, method, loop, one_arch)
    if not execute and not all((out / f"{name}-seed{s}" / "summary.json").exists()
                               for s in seeds):
        return None
    return run_seeds(None, overrides(setting, method, loop, one_arch), name, seeds, out)


def traffic(summary: dict) -> float:
    c = summary["communication"]
    return c["per_client_per_round_up"] + c["per_client_per_round_down"]


def main() -> None:
    from strategies import METHODS
    from fedapp.runtime.results import human_bytes
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the columns to run (the table shows every column that has runs)")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        help="the methods to run (default: all; Standalone always)")
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the runs that exist")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    out, seeds = args.out.resolve(), args.seeds
    chosen = set(args.methods or METHODS) | {"standalone"}

    table: dict[tuple[str, str, bool], dict[str, list[dict] | None]] = {}
    for method, loop in rows():
        one_arch = METHODS[method].homogeneous_only
        keys = [(method, loop, one_arch)] + ([("standalone", "rounds", True)] if one_arch else [])
        for key in keys:
            for setting in SETTINGS:
                if loop != "rounds" and setting in ROUNDS_ONLY:
                    continue
                execute = (not args.table_only and setting in args.settings
                           and method in chosen)
                table.setdefault(key, {})[setting] = runs(setting, *key, seeds, execute, out)

    columns = [s for s in SETTINGS if any(cells.get(s) for cells in table.values())]
    lines = [
        f"Produced by `.venv/bin/python {SCRIPT}`"
        + ("" if seeds == SEEDS else f" --seeds {' '.join(map(str, seeds))}") + ". "
        "Mean per-client local-test accuracy after round 20, ± std over the seeds "
        f"({len(seeds)} per cell), and in brackets its difference to Standalone on the same "
        "setting and architectures. Traffic: bytes of arrays up + down per participating "
        "client per round; seconds: wall-clock seconds per round of the whole run, on the "
        "machine that made the table (indicative: see docs/benchmarks.md for timings).", "",
        "| method | loop | " + " | ".join(SETTINGS[s][0] for s in columns)
        + " | traffic / client / round | s / round |",
        "|---|---|" + "---|" * len(columns) + "---|---|"]
    bars: dict[str, dict[str, float]] = {}
    for (method, loop, one_arch), cells in table.items():
        base = table[("standalone", "rounds", one_arch)]
        texts, done = [], []
        for s in columns:
            mine = cells.get(s)
            if not mine:
                texts.append("not run" if not (loop != "rounds" and s in ROUNDS_ONLY) else "—")
                continue
            mean, std = mean_std(mean_client_accuracy(x) for x in mine)
            text = f"{mean:.3f} ± {std:.3f}"
            if base.get(s) and method != "standalone":
                diff = mean - mean_std(mean_client_accuracy(x) for x in base[s])[0]
                text += f" ({diff:+.3f})"
                bars.setdefault(SETTINGS[s][0], {})[
                    method + ("" if loop == "rounds" else f" ({loop})")] = diff
            texts.append(text)
            done += mine
        label = method + (f" ({ONE_ARCH['arch-mix']} only)" if one_arch else "")
        cost = (f"{human_bytes(np.mean([traffic(x) for x in done]))} | "
                f"{np.mean([x['wall_seconds'] / x['rounds'] for x in done]):.1f}"
                if done else "— | —")
        lines.append(f"| {label} | {loop} | " + " | ".join(texts) + f" | {cost} |")
    write_generated(DOC, SCRIPT, "\n".join(lines))
    if bars:
        plot(bars)
    print(f"[reproduce] wrote {DOC}")


def plot(bars: dict[str, dict[str, float]]) -> None:
    """One panel per setting: each method's difference to Standalone, best at the top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(bars), figsize=(4.2 * len(bars), 6.5), squeeze=False,
                             sharey=False)
    for ax, (title, diffs) in zip(axes[0], bars.items()):
        names = sorted(diffs, key=diffs.get)
        values = [diffs[n] for n in names]
        ax.barh(names, values, color=["tab:green" if v >= 0 else "tab:red" for v in values])
        ax.axvline(0, color="black", lw=0.8)
        ax.set(title=title, xlabel="accuracy − Standalone (mean of 3 seeds)")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
