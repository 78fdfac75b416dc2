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
and FedKD share), with a Standalone of it beside. A public-data method runs with a public set cut
out of the training data (common.PUBLIC), beside a Standalone with the same cut; a sub-model
method gives each architecture group of the mix the level of its global model nearest in
parameters (common.zoo_levels), beside a Standalone that trains each client's model
(common.submodel_standalone): ``grounds``. The asynchronous loop (methods whose server
folds in one upload at a time) and the device-to-device loops (walk, gossip) have their own
rows; they are not run at 30 % participation, a notion of the synchronous round. A few
diagnostic rows (``DIAGNOSTICS``) run a method with one setting changed, in the column whose
reading names that setting as a cause.

Each cell: mean ± std over the seeds of the mean per-client local-test accuracy after the last
round, and its difference to Standalone on the same setting; for a method whose recipe is not
Standalone's, also to a Standalone trained with that recipe (one row per recipe), which tells
what the recipe does from what the method does. Writes docs/scoreboard.md (between
its generated markers) and docs/scoreboard.png.

    .venv/bin/python reproduce/scoreboard.py                              # everything, 3 seeds
    .venv/bin/python reproduce/scoreboard.py --settings dir0.3            # one column
    .venv/bin/python reproduce/scoreboard.py --settings dir0.3 --methods fedgh fd
    .venv/bin/python reproduce/scoreboard.py --table-only                 # runs nothing
    .venv/bin/python reproduce/scoreboard.py --methods heterofl --dry-run  # what it would run
    .venv/bin/python reproduce/scoreboard.py --jobs 4                     # 4 runs at once

Finished runs are reused (results/scoreboard/, else their records in
reproduce/records/scoreboard/), so an interrupted scoreboard resumes, on this machine or
another, and a column run alone joins the others in the table; cells whose runs do not exist
read "not run".
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (ROOT, add_resource_options, finished, mean_std,  # noqa: E402
                    mean_client_accuracy, page_methods, paired, resource_overrides,
                    run_parallel, run_seeds, write_generated)

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
# Rows that test a cause docs/scoreboard.md gives for a row, in the columns where it gives it:
# variant -> (label, each method's overrides, settings). Felo and Velo run without group
# averaging by default (measured: docs/felo.md); their paper's setting, every client installing
# its architecture group's average, is a row of its own in every column.
DIAGNOSTICS: dict[str, tuple[str, dict[str, dict[str, Any]], tuple[str, ...]]] = {
    "group-avg": ("group-avg = true, the paper's", {m: {f"{m}.group-avg": True}
                                                    for m in ("felo", "velo")},
                  tuple(SETTINGS)),
    "server-lr-0.1": ("fedgen.server-lr = 0.1, HtFLlib's total.sh",
                      {"fedgen": {"fedgen.server-lr": 0.1}}, tuple(SETTINGS)),
    "nearest-prototype": ("fedtgp.eval-rule = nearest-prototype, the paper's headline",
                          {"fedtgp": {"fedtgp.eval-rule": "nearest-prototype"}},
                          tuple(SETTINGS)),
    "global-head": ("fedre.eval-head = global, the method's inference",
                    {"fedre": {"fedre.eval-head": "global"}}, tuple(SETTINGS)),
}


# What a client's training is, beyond the local work every row shares (COMMON): a method's
# recipe sets these, and a Standalone trained with the same values tells the recipe's share of
# the method's difference to Standalone from the method's own.
TRAINING = ("optimizer", "lr", "momentum", "adam-beta1", "adam-beta2", "weight-decay",
            "grad-clip", "optimizer-state", "lr-decay-at", "lr-decay", "drop-last",
            "feature-dim")


BASE = tuple(COMMON.items())


def training(method: str) -> tuple[tuple[str, Any], ...]:
    """How ``method``'s clients train in every row of the table (its recipe under COMMON): the
    TRAINING values that act (common.training)."""
    return common.training(method, BASE, TRAINING)


def recipes() -> dict[str, tuple[tuple[str, Any], ...]]:
    """Each recipe of the table other than Standalone's own, by its variant name
    (common.recipes: ``fedper-recipe`` serves FedPer and FedRep, ``htfllib-recipe`` is FD's)."""
    return common.recipes(BASE, TRAINING)


def recipe_of(method: str) -> str | None:
    """The variant of the Standalone that trains as ``method`` does; None if Standalone's own
    recipe is ``method``'s."""
    return common.recipe_of(method, BASE, TRAINING)


# The global model of a sub-model method beside the zoo, where its default does not fit: DepthFL's
# ResNet-18 has 12 M parameters (a CPU's minutes per round), 6 times the mix's largest CNN;
# HeteroFL's 4-block conv (1.56 M at depth 4, as HeteroFL's and FjORD's `heterofl-conv`) does.
SUBMODEL_MODEL = {"depthfl": {"depthfl.model": "cnn4"}}


# FML at its paper's weight, as this table's runs were made: its default (0.9) was chosen later,
# on docs/defaults.md's settings, where the paper's 0.5 loses to local training at its recipe.
PAPER_SETTINGS = {"fml": {"fml.alpha": 0.5}}


def own_settings(method: str) -> dict[str, Any]:
    """What ``method``'s runs set besides COMMON and its recipe: a public-data method's public
    set (common.PUBLIC); a sub-model method's global model and each architecture group's level
    of it, mapped from the mix at equal budget (common.zoo_levels: the mix names the groups);
    FML's paper's weight (PAPER_SETTINGS)."""
    if method in PAPER_SETTINGS:
        return dict(PAPER_SETTINGS[method])
    if common.needs_public(method):
        return dict(common.PUBLIC)
    if common.is_submodel(method):
        model = SUBMODEL_MODEL.get(method, {})
        return {**model, **common.zoo_levels(tuple({**COMMON, "method": method,
                                                    **model}.items()))}
    return {}


@functools.cache
def ground_settings(method: str) -> tuple[tuple[str, Any], ...]:
    """What the Standalone ``method`` reads against sets besides COMMON: the same public set cut
    (so the same shards), or each client's model of the sub-model method (by import path:
    common.submodel_standalone); nothing for a method of the mix."""
    if common.needs_public(method):
        return tuple(common.PUBLIC.items())
    if common.is_submodel(method):
        return tuple(common.submodel_standalone(
            {**COMMON, "method": method, **own_settings(method)}).items())
    return ()


def ground(method: str) -> str:
    """The variant of the Standalone ``method`` reads against ('' for the mix): ``holdout`` for
    the public-data methods, ``<method>-models`` for a sub-model method (the first in the
    table's order whose clients train the same models: FedRolex's are HeteroFL's)."""
    if not ground_settings(method):
        return ""
    if common.needs_public(method):
        return "holdout"
    return next(f"{m}-models" for m in page_methods()
                if ground_settings(m) == ground_settings(method))


def grounds() -> dict[str, tuple[dict[str, Any], str]]:
    """Each Standalone variant of another data cut or other models -> (overrides, label)."""
    out = {}
    for method in page_methods():
        g = ground(method)
        if g and g not in out:
            users = [m for m in page_methods() if ground(m) == g]
            out[g] = (dict(ground_settings(method)),
                      "public set held out" if g == "holdout" else
                      f"each client's model of {', '.join(users)}")
    return out


def on_ground(g: str, recipe: str | None) -> str:
    """The variant of the Standalone on ground ``g`` trained with ``recipe`` (None: its own)."""
    return "-".join(x for x in (g, recipe) if x)


def default_recipes() -> list[str]:
    """The recipes whose Standalone on the mix some row reads against (the table's first
    Standalone rows): those of the methods of the mix."""
    used = {recipe_of(m) for m in page_methods() if not ground(m)}
    return [r for r in recipes() if r in used]


def variants() -> dict[str, tuple[dict[str, Any], str]]:
    """A row's variant -> (its overrides, its label). ``cnn5``: one architecture (FedAvg and its
    Standalone); ``<method>-recipe``: Standalone trained with that method's recipe (the rows it
    serves say which methods train so); ``holdout``, ``<method>-models``: Standalone on the
    public-data methods' cut, or training a sub-model method's clients' models (``grounds``),
    and each with a recipe (``holdout-<method>-recipe``)."""
    out = {"": ({}, ""), "cnn5": (ONE_ARCH, f"{ONE_ARCH['arch-mix']} only")}
    for name, values in recipes().items():
        out[name] = (dict(values), common.recipe_label(name, BASE, TRAINING))
    for g, (settings, text) in grounds().items():
        out[g] = (settings, text)
        for name, values in recipes().items():  # the ground's settings win (feature-dim)
            out[on_ground(g, name)] = ({**dict(values), **settings},
                                       f"{text}, {common.recipe_label(name, BASE, TRAINING)}")
    for name, (text, _, _) in DIAGNOSTICS.items():  # their overrides depend on the method
        out[name] = ({}, text)
    return out


def base_variant(method: str, variant: str) -> str:
    """The variant of the Standalone a row's first difference is against: its ground's for a
    method (``cnn5``'s for FedAvg); for a Standalone on a ground with a recipe, that ground's;
    for the others the mix's (a row is not read against itself)."""
    if variant == "cnn5":
        return "cnn5"
    if method != "standalone":
        return ground(method)
    return next((g for g in grounds() if variant.startswith(f"{g}-")), "")


def rows() -> list[tuple[str, str]]:
    """(method, loop) for every registered method and every loop it can run."""
    METHODS = page_methods()
    out = []
    for name, method in METHODS.items():
        out.append((name, "rounds"))
        if method.asynchronous and name != "standalone":  # local training has no server
            out.append((name, "async"))
        if method.decentralised:
            out += [(name, "walk"), (name, "gossip")]
    return out


def run_name(setting: str, method: str, loop: str, variant: str) -> str:
    name = f"{setting}-{method}" + ("" if loop == "rounds" else f"-{loop}")
    return re.sub(r"[^a-z0-9.]+", "-", name) + (f"-{variant}" if variant else "")


def overrides(setting: str, method: str, loop: str, variant: str) -> dict[str, Any]:
    return {**COMMON, **SETTINGS[setting][1], "method": method, **own_settings(method),
            **({} if loop == "rounds" else {"server-loop": loop}),
            **variants()[variant][0], **DIAGNOSTICS.get(variant, ("", {}, ()))[1].get(method, {})}


def runs(setting: str, method: str, loop: str, variant: str, seeds: list[int],
         execute: bool, out: Path, resources: dict[str, Any]) -> list[dict] | None:
    """The seeds' summaries; ``execute`` runs the missing ones (with ``resources``, which
    change no result), otherwise None if any is."""
    name = run_name(setting, method, loop, variant)
    if not execute and any(finished(out, f"{name}-seed{s}") is None for s in seeds):
        return None
    return run_seeds(None, {**overrides(setting, method, loop, variant), **resources}, name,
                     seeds, out)


def label(method: str, loop: str, variant: str) -> str:
    own = ("public set held out" if common.needs_public(method) else
           ", ".join(f"{k} = {v}" for k, v in own_settings(method).items()))
    notes = [x for x in (loop if loop not in ("", "rounds") else "", own,
                         variants()[variant][1]) if x]
    return method + (f" ({', '.join(notes)})" if notes else "")


def traffic(summary: dict) -> float:
    c = summary["communication"]
    return c["per_client_per_round_up"] + c["per_client_per_round_down"]


Key = tuple[str, str, str]  # (method, loop, variant): a row


def planned(chosen: set[str], settings: set[str], execute: bool = True
            ) -> dict[tuple[Key, str], bool]:
    """Every (row, setting) cell of the table, in the table's order -> whether to run its
    missing seeds: ``execute`` and its setting is in ``settings`` and a method it is made for
    is in ``chosen`` (a Standalone row: for every method read against it; those on the mix
    always)."""
    METHODS = page_methods()
    wanted: dict[tuple[Key, str], bool] = {}
    for method, loop in rows():
        if METHODS[method].homogeneous_only:
            keys = [(method, loop, "cnn5"), ("standalone", "rounds", "cnn5")]
        elif method == "standalone":
            keys = [(method, loop, "")] + [("standalone", "rounds", r)
                                           for r in default_recipes()]
        else:
            keys = [(method, loop, "")]
            if ground(method):  # its Standalone, and that Standalone at its recipe
                keys += [("standalone", "rounds", on_ground(ground(method), r))
                         for r in dict.fromkeys([None, recipe_of(method)])]
        keys += [(method, loop, name) for name, (_, methods, _) in DIAGNOSTICS.items()
                 if method in methods and loop == "rounds"]
        for key in keys:
            for setting in SETTINGS:
                if ((loop == "rounds" or setting not in ROUNDS_ONLY)
                        and (key[2] not in DIAGNOSTICS or setting in DIAGNOSTICS[key[2]][2])):
                    wanted[key, setting] = wanted.get((key, setting), False) or (
                        execute and setting in settings and method in chosen)
    return wanted


def dry_run(wanted: dict[tuple[Key, str], bool], seeds: list[int], out: Path,
            resources: dict[str, Any], jobs: int) -> list[str]:
    """Print every run the invocation would make (the cells ``wanted`` runs), marking those
    made already (``out`` or its records); check the settings of each row to run as ``fedapp
    run`` does; estimate the time of those to run (common.estimate). Returns the refusals."""
    made, to_run, refused = 0, 0, []
    for (key, setting), execute in wanted.items():
        if not execute:
            continue
        name = run_name(setting, *key)
        missing = [s for s in seeds if finished(out, f"{name}-seed{s}") is None]
        made += len(seeds) - len(missing)
        to_run += len(missing)
        if missing:
            refused += common.check_settings(name, {**overrides(setting, *key), **resources})
        for seed in seeds:
            print(f"{'to run' if seed in missing else 'made  '} {name}-seed{seed}")
    print(f"\n[reproduce] {made + to_run} runs: {made} made already, {to_run} to run; "
          + common.estimate(out, to_run, jobs)
          + (f"; {len(refused)} refused:\n" + "\n".join(refused) if refused else
             "; the settings of every run to make pass fedapp's checks"))
    return refused


def main() -> None:
    METHODS = page_methods()
    from fedapp.runtime.results import human_bytes
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the columns to run (the table shows every column that has runs)")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        help="the methods to run (default: all; Standalone always)")
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the runs that exist")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the runs this invocation would make (made or to run), check "
                             "their settings and estimate their time; run nothing, write "
                             "nothing")
    parser.add_argument("--out", type=Path, default=OUT,
                        help="the folder of the runs (default results/scoreboard); the table "
                             "always goes to docs/scoreboard.md")
    add_resource_options(parser)
    args = parser.parse_args()
    out, seeds, resources = args.out.resolve(), args.seeds, resource_overrides(args)
    chosen = set(args.methods or METHODS) | {"standalone"}

    wanted = planned(chosen, set(args.settings), not args.table_only)
    if args.dry_run:
        raise SystemExit(1 if dry_run(wanted, seeds, out, resources, args.jobs) else 0)
    run_parallel([(None, {**overrides(setting, *key), "seed": seed, **resources},
                  f"{run_name(setting, *key)}-seed{seed}")
                  for (key, setting), execute in wanted.items() if execute for seed in seeds],
                 out, args.jobs)
    table: dict[tuple[str, str, str], dict[str, list[dict] | None]] = {}
    for (key, setting), execute in wanted.items():
        table.setdefault(key, {})[setting] = runs(setting, *key, seeds, execute, out,
                                                  resources)

    columns = [s for s in SETTINGS if any(cells.get(s) for cells in table.values())]
    if not columns:
        raise SystemExit(f"scoreboard: no runs in {out} or in its records "
                         f"(--out is the runs' folder); {DOC} is left as it is")
    lines = [
        f"Produced by `.venv/bin/python {SCRIPT}`"
        + ("" if seeds == SEEDS else f" --seeds {' '.join(map(str, seeds))}") + ". "
        "Mean per-client local-test accuracy after round 20, ± std over the seeds "
        f"({len(seeds)} per cell), and in brackets its difference to Standalone on the same "
        "setting and architectures, seed by seed (the same partition and, where both start "
        "from the same models, initial weights): "
        "mean ± std of the differences; for a method whose recipe is not Standalone's, also "
        "the difference to the Standalone trained with its recipe (\"at its recipe\"). "
        "Traffic: bytes of "
        "arrays up + down per participating client per round; seconds: wall-clock seconds per "
        "round of the whole run, on the machine that made the table (indicative: see "
        "docs/benchmarks.md for timings).", "",
        "| method | loop | " + " | ".join(SETTINGS[s][0] for s in columns)
        + " | traffic / client / round | s / round |",
        "|---|---|" + "---|" * len(columns) + "---|---|"]
    bars: dict[str, dict[str, tuple[float, float]]] = {}  # (difference, its standard error)
    notes: list[str] = []  # the other predictions a method reports (common.other_predictions)
    for (method, loop, variant), cells in table.items():
        base_key = ("standalone", "rounds", base_variant(method, variant))
        texts, done = [], []
        for s in columns:
            mine = cells.get(s)
            if not mine:
                texts.append("—" if s not in cells else "not run")  # not a cell of this row
                continue
            mean, std = mean_std(mean_client_accuracy(x) for x in mine)
            text = f"{mean:.3f} ± {std:.3f}"
            base = table.get(base_key, {}).get(s)
            if base and (method, loop, variant) != base_key:
                diff, diff_std = paired(mine, base)
                text += f" ({diff:+.3f} ± {diff_std:.3f}"
                recipe = (recipe_of(method) if method != "standalone"
                          and (not variant or variant in DIAGNOSTICS) else None)
                recipe_base = table.get(("standalone", "rounds", on_ground(
                    ground(method), recipe)), {}).get(s) if recipe else None
                if recipe_base:
                    text += "; {:+.3f} ± {:.3f} at its recipe".format(*paired(mine, recipe_base))
                text += ")"
                bars.setdefault(SETTINGS[s][0], {})[label(method, loop, variant)] = (
                    diff, diff_std / np.sqrt(max(len(mine) - 1, 1)))
            texts.append(text)
            done += mine
            notes += common.other_predictions(f"{label(method, loop, variant)}, "
                                              f"{SETTINGS[s][0]}", mine)
        cost = (f"{human_bytes(np.mean([traffic(x) for x in done]))} | "
                f"{np.mean([x['wall_seconds'] / x['rounds'] for x in done]):.1f}"
                if done else "— | —")
        lines.append(f"| {label(method, '', variant)} | {loop} | " + " | ".join(texts)
                     + f" | {cost} |")
    if notes:
        lines += ["", "The same runs' other predictions (mean over clients, ± std over the "
                  "seeds), where a method reports one beside its headline:", "", *notes]
    write_generated(DOC, SCRIPT, "\n".join(lines))
    if bars:
        plot(bars)
    print(f"[reproduce] wrote {DOC}")


def plot(bars: dict[str, dict[str, tuple[float, float]]]) -> None:
    """One panel per setting: each method's difference to Standalone (± one standard error of
    the seed-by-seed differences), best at the top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(bars), figsize=(5.2 * len(bars), 6.5), squeeze=False,
                             sharey=False)
    for ax, (title, diffs) in zip(axes[0], bars.items()):
        names = sorted(diffs, key=lambda n: diffs[n][0])
        values, errors = zip(*(diffs[n] for n in names))
        ax.barh(names, values, xerr=errors, capsize=2,
                color=["tab:green" if v >= 0 else "tab:red" for v in values])
        ax.axvline(0, color="black", lw=0.8)
        ax.set(title=title, xlabel="accuracy − Standalone, ± 1 standard error")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110, bbox_inches="tight")  # long row names: nothing clipped
    plt.close(fig)


if __name__ == "__main__":
    main()
