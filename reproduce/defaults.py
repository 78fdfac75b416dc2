"""Every registered method with its own default recipe, on two small data sets, beside
Standalone: do the defaults lose in silence?

Each method runs with nothing set but the data and the federation (common.DEFAULTS_SETTINGS:
Fashion-MNIST, and scikit-learn's handwritten digits, on which nothing was tuned), so it trains
with its recipe (docs/recipes.md) and its own defaults — what ``--set method=...`` gives a
user. Standalone (local training with the global defaults) sits beside every method; FedAvg,
which needs one architecture, runs on the smallest CNN, with a Standalone of that CNN beside it.
Three seeds, each method's seeds on one SuperLink. Writes docs/defaults.md.

    .venv/bin/pip install -e ".[reproduce]"      # scikit-learn, for the digits
    .venv/bin/python reproduce/defaults.py                      # every method, 3 seeds
    .venv/bin/python reproduce/defaults.py --methods fedgh fedhe --seeds 0

Finished runs are reused (results/defaults/), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULTS_SETTINGS, ROOT, cell, mean_std, per_client_accuracies,  # noqa: E402
                    run_seeds, training_caption, write_generated)

SCRIPT = "reproduce/defaults.py"
OUT = ROOT / "results" / "defaults"
DOC = ROOT / "docs" / "defaults.md"
# FedAvg needs one architecture: the smallest CNN of the mix, the model FML, FedMRL and FedKD
# share beside each client's own (so its row is "the shared model alone").
ONE_ARCH = {"arch-mix": "cnn5"}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def accuracy(summary: dict) -> float:
    return float(np.mean(per_client_accuracies(summary)))


def main() -> None:
    from strategies import METHODS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        default=[m for m in METHODS if m != "standalone"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    out, seeds = args.out.resolve(), args.seeds

    def runs(data: str, method: str, extra: dict) -> list[dict]:
        name = f"{slug(data)}-{method}" + ("-one-arch" if extra else "")
        return run_seeds(None, {**DEFAULTS_SETTINGS[data](), "method": method, **extra},
                         name, seeds, out)

    lines = [f"Produced by `.venv/bin/python {SCRIPT}`"
             + ("" if seeds == [0, 1, 2] else f" --seeds {' '.join(map(str, seeds))}")
             + ". Mean per-client local-test accuracy after the last round, ± std over "
             f"{len(seeds)} seed(s); Δ = against Standalone on the same data and architectures "
             "(local training with the global defaults). Every method trains with its own "
             "recipe, shown in the last column.", ""]
    data_sets = list(DEFAULTS_SETTINGS)
    lines += ["| method | " + " | ".join(f"{d} | Δ {d}" for d in data_sets)
              + " | recipe |", "|---|" + "---|---|" * len(data_sets) + "---|"]
    losers = []
    for method in ["standalone", *args.methods]:
        extra = ONE_ARCH if METHODS[method].homogeneous_only else {}
        cells = []
        for d in data_sets:
            mine = runs(d, method, extra)
            base = runs(d, "standalone", extra)
            mean, std = mean_std(accuracy(s) for s in mine)
            base_mean, base_std = mean_std(accuracy(s) for s in base)
            cells.append(f"{cell(accuracy(s) for s in mine)} | "
                         + ("—" if method == "standalone" else f"{mean - base_mean:+.3f}"))
            if method != "standalone" and mean < base_mean - max(std, base_std):
                losers.append(f"{method} on {d}")
        label = method + (f" ({ONE_ARCH['arch-mix']} only; Standalone of it: see below)"
                          if extra else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " | "
                     + training_caption(None, {"method": method}) + " |")
    if any(METHODS[m].homogeneous_only for m in args.methods):
        cells = [cell(accuracy(s) for s in runs(d, "standalone", ONE_ARCH)) + " | —"
                 for d in data_sets]
        lines.append(f"| standalone ({ONE_ARCH['arch-mix']} only) | " + " | ".join(cells)
                     + " | " + training_caption(None, {"method": "standalone"}) + " |")
    lines += ["", "Below Standalone by more than the seed spread: "
              + (", ".join(losers) if losers else "none") + "."]
    write_generated(DOC, SCRIPT, "\n".join(lines))
    print(f"[reproduce] wrote {DOC}")


if __name__ == "__main__":
    main()
