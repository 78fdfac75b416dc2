"""Felo and Velo under sparse participation: why the paper's group averaging loses to
Standalone trained with their own recipe, one cause at a time.

The setting is docs/defaults.md's sparse column (common.DEFAULTS_SETTINGS: 100 clients of at
most 300 samples, Dirichlet 0.3, 10 % of them per round, 100 rounds, so each client trains
about ten times), every method at its defaults but for the row's settings. The first row is
Felo's defaults, the second the paper's Felo (``felo.group-avg = true``: every client installs
its architecture group's FedAvg model); each other row changes one thing of the paper's, and
reads Felo against Standalone trained the same way (Felo's recipe, with the same change where
the change is to the recipe;
a federation setting such as ``group-avg`` leaves Standalone as it is):

- group averaging off (``group-avg = false``, the released code's servers, and the default
  since this measurement): a client keeps its own weights between visits instead of
  installing its group's;
- a new Adam on every visit (``optimizer-state = "fresh"``): the kept moments no longer meet
  weights that group averaging replaced since the client's last visit;
- no learning-rate decay (``lr-decay-at = ""``): the tenfold cut at half the run falls on
  clients that have trained about five times;
- three times the visits (``fraction-fit = 0.3``): a client's group changes less often
  between two of its visits.

Velo, which shares Felo's client step and group averaging, runs with and without it. The
rows with and without group averaging are docs/defaults.md's runs (its default rows and its
tried ones: the same names in the same folder, ``results/defaults/``), so neither script makes
them twice.

    .venv/bin/python reproduce/felo_sparse.py                  # 3 seeds
    .venv/bin/python reproduce/felo_sparse.py --table-only     # the table from the runs made
    .venv/bin/python reproduce/felo_sparse.py --jobs 4 --client-num-gpus 0.25

Writes its table between its markers in ``docs/felo.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, DEFAULTS_SETTINGS, ROOT, VERDICT_RULE,  # noqa: E402
                    add_resource_options, cell, finished, mean_client_accuracy, mean_std,
                    recipes, resource_overrides, run_seeds, run_parallel, seeds_option, signed,
                    slug, verdict, write_generated)

from defaults import settings_text  # noqa: E402
from fedapp.config import toml_value  # noqa: E402

SCRIPT = "reproduce/felo_sparse.py"
OUT = ROOT / "results" / "defaults"
DOC = ROOT / "docs" / "felo.md"
COLUMN = "Fashion-MNIST sparse"
PAPER = {"group-avg": True}
# row -> (the method's settings, whether they change the recipe, so that Standalone makes the
# change too): the defaults, the paper's Felo, then one change of the paper's at a time.
CHANGES: dict[str, tuple[dict[str, Any], bool]] = {
    "group-avg = false (the defaults)": ({}, False),
    "the paper's: group-avg = true": (PAPER, False),
    'optimizer-state = "fresh" (a new Adam every visit)':
        ({**PAPER, "optimizer-state": "fresh"}, True),
    'lr-decay-at = "" (no decay)': ({**PAPER, "lr-decay-at": ""}, True),
    "fraction-fit = 0.3 (three times the visits)": ({**PAPER, "fraction-fit": 0.3}, True),
}
VELO_CHANGES = ("group-avg = false (the defaults)", "the paper's: group-avg = true")


def method_settings(method: str, changed: dict[str, Any]) -> dict[str, Any]:
    """``changed`` with ``group-avg`` under the method's table (``felo.group-avg``)."""
    return {f"{method}.{k}" if k == "group-avg" else k: v for k, v in changed.items()}


def run_name(who: str, changed: dict[str, Any]) -> str:
    """docs/defaults.md's name for its runs (``who`` is the method, or ``standalone felo
    recipe``): the column and ``who``, then the changed settings as its tried rows
    (defaults.TRIED) name them, so that the runs both scripts make are made once."""
    what = settings_text(changed)
    return slug(f"{COLUMN} {who}") + (f"-{slug(what)}" if what else "")


def plan(resources: dict[str, Any]) -> dict[tuple[str, str], tuple[dict[str, Any], str]]:
    """(who, change) -> (the runs' settings, their name); ``who`` is felo, velo or
    standalone (at Felo's recipe, with the change where it is to the recipe)."""
    recipe = dict(recipes()["felo-recipe"])
    base = {**DEFAULTS_SETTINGS[COLUMN](), **resources}
    rows: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
    for change, (changed, in_recipe) in CHANGES.items():
        for method in ("felo", "velo") if change in VELO_CHANGES else ("felo",):
            mine = method_settings(method, changed)
            rows[method, change] = ({**base, "method": method, **mine}, run_name(method, mine))
        if in_recipe or not changed:
            alone = {k: v for k, v in changed.items() if k not in PAPER}
            rows["standalone", change] = ({**base, "method": "standalone", **recipe, **alone},
                                          run_name("standalone felo recipe", alone))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the runs that exist")
    add_resource_options(parser)
    args = parser.parse_args()
    seeds, out = args.seeds, OUT.resolve()
    rows = plan(resource_overrides(args))
    if not args.table_only:
        run_parallel([(None, {**settings, "seed": s}, f"{name}-seed{s}")
                      for settings, name in rows.values() for s in seeds], out, args.jobs)
    runs = {key: run_seeds(None, settings, name, seeds, out)  # runs what is missing
            for key, (settings, name) in rows.items()
            if not args.table_only or all(finished(out, f"{name}-seed{s}") for s in seeds)}

    missing: list[str] = []

    def accuracy(key: tuple[str, str]) -> str:
        """The row's cell: its mean ± std, '—' where the row is not in the plan."""
        if key not in rows:
            return "—"
        if key not in runs:
            missing.append(rows[key][1])
            return "not run"
        return cell(map(mean_client_accuracy, runs[key]))

    def claim(method: str, change: str) -> str:
        """``method`` ≥ Standalone trained as it is: the verdict and the paired difference."""
        alone = ("standalone", change if ("standalone", change) in rows else next(iter(CHANGES)))
        if (method, change) not in runs or alone not in runs:
            return "—"
        diffs = [mean_client_accuracy(x) - mean_client_accuracy(y)
                 for x, y in zip(runs[method, change], runs[alone])]
        mean, spread = mean_std(diffs)
        return f"{verdict(diffs)} ({signed(mean)} ± {spread:.3f})"

    setting = ", ".join(f"{k} = {toml_value(v)}"
                        for k, v in DEFAULTS_SETTINGS[COLUMN]().items())
    lines = [f"Produced by `.venv/bin/python {SCRIPT}{seeds_option(seeds)}`. The sparse column "
             f"of docs/defaults.md ({setting}), each method at its defaults but for the row's "
             "settings (below the second row, each a change of the paper's): the clients' mean local-test accuracy after the last round, mean ± std "
             "over seeds; Standalone trains with Felo's recipe, and with the row's change where "
             "that is to the recipe. Each claim pairs runs of one seed.", "", VERDICT_RULE, "",
             "| row | Felo | Velo | Standalone at Felo's recipe | Felo ≥ Standalone | "
             "Velo ≥ Standalone |", "|---|---|---|---|---|---|"]
    for change in CHANGES:
        alone = change if ("standalone", change) in rows else "(the first row's)"
        lines.append(f"| {change} | {accuracy(('felo', change))} | "
                     f"{accuracy(('velo', change))} | "
                     + (accuracy(("standalone", change)) if alone == change else alone)
                     + f" | {claim('felo', change)} | {claim('velo', change)} |")
    if missing:
        lines += ["", f"Not run yet: {', '.join(missing)}."]
    table = "\n".join(lines)
    write_generated(DOC, SCRIPT, table)
    print(table)


if __name__ == "__main__":
    main()
