"""FedClassAvg's defaults, chosen by measurement on two data sets: Fashion-MNIST (the paper's)
and scikit-learn's handwritten digits (on which nothing was tuned), each beside Standalone
trained with the same recipe, over 3 seeds.

The variants go from the reference code's values (SupCon with T = 100 on unnormalised
features, scaled by T / 0.07; SimCLR crops of scale 0.2-1 with flips; cross-entropy on the
first view) to the usual normalised SupCon (T = T_base = 0.07) with the code's views, with
mild views (crops of scale 0.8-1, no flip) and the cross-entropy on the raw image, and with
no views at all. Every run trains
with FedClassAvg's recipe (docs/recipes.md), Standalone included, in the small settings of
docs/defaults.md (common.DEFAULTS_SETTINGS: its first two columns, FEDCLASSAVG_SETTINGS).
Writes the table and the verdict between the markers of docs/fedclassavg.md.

    .venv/bin/pip install -e ".[reproduce]"      # scikit-learn, for the digits
    .venv/bin/python reproduce/fedclassavg_defaults.py            # 30 runs
    .venv/bin/python reproduce/fedclassavg_defaults.py --variants 2   # code vs the default
    .venv/bin/python reproduce/fedclassavg_defaults.py --seeds 0  # one seed

Finished runs are reused (results/fedclassavg-defaults/), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, DEFAULTS_SETTINGS, FEDCLASSAVG_SETTINGS, ROOT,  # noqa: E402
                    cell, mean_std, per_client_accuracies, run_experiment, training_caption,
                    write_generated, seeds_option, slug as common_slug)

SCRIPT = "reproduce/fedclassavg_defaults.py"
OUT = ROOT / "results" / "fedclassavg-defaults"
DOC = ROOT / "docs" / "fedclassavg.md"

CODE_SUPCON = {"fedclassavg.temperature": 100.0, "fedclassavg.base-temperature": 0.07,
               "fedclassavg.normalize-features": False}
NORMALISED = {"fedclassavg.temperature": 0.07, "fedclassavg.base-temperature": 0.07,
              "fedclassavg.normalize-features": True}


def views(kind: str, ce_view: str = "augmented") -> dict:
    return {"fedclassavg.views": kind, "fedclassavg.ce-view": ce_view}


# One factor at a time, from the reference code's values towards the usual SupCon without
# views: the SupCon form, what the cross-entropy sees, how strong the views are, no views.
VARIANTS = {
    "code: T = 100 unnormalised, SimCLR views, CE on the view":
        {**CODE_SUPCON, **views("simclr")},
    "normalised T = 0.07, no views": {**NORMALISED, **views("none", "raw")},
    "normalised T = 0.07, SimCLR views, CE on the view": {**NORMALISED, **views("simclr")},
    "normalised T = 0.07, mild views, CE on the raw image": {**NORMALISED, **views("mild", "raw")},
}


def slug(text: str) -> str:
    return common_slug(text)[:80]


def recipe_overrides() -> dict:
    """FedClassAvg's recipe, set explicitly so that Standalone trains with it too."""
    from strategies import METHODS
    return dict(METHODS["fedclassavg"].recipe)


def mean_accuracy(summary: dict) -> float:
    return float(np.mean(per_client_accuracies(summary)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--variants", type=int, default=len(VARIANTS),
                        help="run the first N variants only (the code's values first)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    out = args.out.resolve()
    recipe = recipe_overrides()
    rows: dict[str, dict[str, list[dict]]] = {}
    runs = {"Standalone (same recipe)": {"method": "standalone"},
            **{label: {"method": "fedclassavg", **v}
               for label, v in list(VARIANTS.items())[:args.variants]}}
    for label, overrides in runs.items():
        for data_label in FEDCLASSAVG_SETTINGS:
            base = {**DEFAULTS_SETTINGS[data_label](), **recipe}
            rows.setdefault(label, {})[data_label] = [
                run_experiment(None, {**base, **overrides, "seed": seed},
                               f"{slug(data_label)}-{slug(label)}-s{seed}", out)
                for seed in args.seeds]

    def stats(label: str, data_label: str) -> tuple[float, float]:
        return mean_std(mean_accuracy(s) for s in rows[label][data_label])

    data_labels = list(FEDCLASSAVG_SETTINGS)
    baseline = {d: stats("Standalone (same recipe)", d) for d in data_labels}
    command = (f".venv/bin/python {SCRIPT}"
               + seeds_option(args.seeds)
               + ("" if args.variants == len(VARIANTS) else f" --variants {args.variants}"))
    lines = [f"Produced by `{command}`"
             + f". Mean per-client local-test accuracy after the last round, ± std over "
             f"{len(args.seeds)} seed(s); Δ = against Standalone trained with the same recipe "
             f"({training_caption(None, {**recipe, 'method': 'fedclassavg'})}).", "",
             "| variant | " + " | ".join(f"{d} | Δ {d}" for d in data_labels) + " |",
             "|---|" + "---|---|" * len(data_labels)]
    holds = {}
    for label in rows:
        cells = []
        for d in data_labels:
            mean, std = stats(label, d)
            cells.append(f"{cell(mean_accuracy(s) for s in rows[label][d])} | "
                         + ("—" if label.startswith("Standalone")
                            else f"{mean - baseline[d][0]:+.3f}"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if not label.startswith("Standalone"):
            # Holds on a data set: above Standalone, or below it by less than the seed spread.
            spread = {d: max(stats(label, d)[1], baseline[d][1]) for d in data_labels}
            holds[label] = all(stats(label, d)[0] >= baseline[d][0] - spread[d]
                               for d in data_labels)
    best = max(rows, key=lambda label: -1 if label.startswith("Standalone") else
               np.mean([stats(label, d)[0] - baseline[d][0] for d in data_labels]))
    lines += ["", f"- Best mean Δ over both data sets: **{best}**"
              + (" — within the seed spread of Standalone or above it on both."
                 if holds.get(best) else " — but below Standalone by more than the seed "
                 "spread on at least one."),
              "- Within the seed spread of Standalone or above it on both: "
              + (", ".join(label for label, ok in holds.items() if ok) or "none") + "."]
    write_generated(DOC, SCRIPT, "\n".join(lines))
    print(f"[reproduce] wrote {DOC}")


if __name__ == "__main__":
    main()
