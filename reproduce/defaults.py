"""Every registered method with its own default recipe, on three small settings, beside
Standalone at the default recipe and Standalone at the method's own recipe: do the defaults lose
in silence, and is what a method gains its own or its recipe's?

Each method runs with nothing set but the data and the federation (common.DEFAULTS_SETTINGS),
so it trains with its recipe (docs/recipes.md) and its own defaults — what ``--set method=...``
gives a user. The columns:

- *Fashion-MNIST*: 10 clients of at most 300 samples, Dirichlet 0.5, all clients every round,
  20 rounds.
- *digits*: scikit-learn's handwritten digits (a data set nothing was tuned on), 10 clients,
  Dirichlet 0.5, 40 rounds.
- *Fashion-MNIST sparse*: sparse participation, the cross-device regime: 100 clients of at most
  300 samples, Dirichlet 0.3, 10 % of them sampled per round, 100 rounds — each client trains
  about ten times, and a method's state meets a client after about ten rounds of others.

The rows: Standalone (local training: the global defaults, one optimizer for the whole run);
Standalone trained with each distinct recipe of the methods (common.recipes: the scoreboard's
recipes, here with their batch size and local epochs or steps too, since nothing pins them:
``standalone (the recipe of fedper, fedrep)``, ``standalone (HtFLlib's recipe: ...)``); then
every method. FedAvg, which needs one architecture, runs on the smallest CNN, beside a
Standalone of that CNN and one of that CNN at FedAvg's recipe. A public-data method (FedMD,
DS-FL, FedDF, KT-pFL) runs with a public set cut out of the training split (common.PUBLIC),
beside a Standalone with the same cut and one at its recipe; the digits hold no public set of
the size their defaults draw (``NO_PUBLIC_SET``). A sub-model method (HeteroFL, FedRolex, FjORD,
DepthFL) runs at its defaults, beside a Standalone that trains each client's model of it
(common.submodel_standalone, reproduce/submodel_models.py) and one at its recipe. In each
column, three cells per
row: the accuracy, Δ against the default Standalone, and Δ against the Standalone trained with
the row's own recipe, paired by seed (mean ± std over the seeds of the seed-by-seed difference).
The verdicts under the table read each method against Standalone at its own recipe, by
common.VERDICT_RULE. Three seeds, each row's seeds on one SuperLink. Writes docs/defaults.md,
and the evidence tables of the pages of the methods taken from HtFLlib (``PAGES``: their rows
beside Standalone, LG-FedAvg, FedProto and FedAvg, and the Standalone at each one's recipe).

    .venv/bin/pip install -e ".[reproduce]"      # scikit-learn, for the digits
    .venv/bin/python reproduce/defaults.py                      # every method, 3 seeds
    .venv/bin/python reproduce/defaults.py --dry-run            # the runs it would make
    .venv/bin/python reproduce/defaults.py --table-only         # the table from the runs made
    .venv/bin/python reproduce/defaults.py --methods fedgh fedhe --seeds 0
    .venv/bin/python reproduce/defaults.py --jobs 8 --client-num-gpus 0.25   # 8 runs at once

Finished runs are reused (results/defaults/, else their records), so an interrupted run
resumes. With ``--methods``, the table's other rows are kept as the page has them (written by
an earlier invocation of this script, with the same columns), so one method can be added or
re-run without re-running the rest; the caption names the methods whose rows were taken from
the page. ``--dry-run`` lists every run the invocation needs, which of them are made already,
and checks each one's settings as ``fedapp run`` would, running nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (slug, DEFAULT_SEEDS, DEFAULTS_SETTINGS, ROOT, VERDICT_RULE,  # noqa: E402
                    add_resource_options, cell, finished, mean_client_accuracy, mean_std,
                    page_methods, read_generated, recipe_label, recipe_named, recipes,
                    resource_overrides, run_parallel, run_seeds, seeds_option, signed, training,
                    training_caption, verdict, write_generated)

from fedapp.config import RECIPE_KEYS, toml_value  # noqa: E402

SCRIPT = "reproduce/defaults.py"
OUT = ROOT / "results" / "defaults"
DOC = ROOT / "docs" / "defaults.md"
# FedAvg needs one architecture: the smallest CNN of the mix, the model FML, FedMRL and FedKD
# share beside each client's own (so its row is "the shared model alone").
ONE_ARCH = {"arch-mix": "cnn5"}


# The verdicts under the table, each a line of "<label> on <column>" entries separated by "; "
# (a label may hold a comma).
VERDICTS = {"fails": "Below Standalone at its own recipe (**fails**): ",
            "level": "Level with Standalone at its own recipe: ",
            "holds": "Above Standalone at its own recipe (**holds**): "}


# The pages of the methods added from HtFLlib, each with its methods' rows beside the baselines
# every one of them is compared with (FedAvg: the shared model alone, for the shared-model pages).
BASELINES = ["standalone", "lg-fedavg", "fedproto", "fedavg"]
# Settings tried beside a method's defaults: where the defaults lose to local training here,
# to tell the cause; where a default was chosen by measurement, the paper's value it replaced
# (docs/defaults.md explains each): method -> the changed settings of each try.
TRIED = {  # FedRE's repository's batch of 64 and the server's head as the headline, which its
         # defaults replaced; the headline alone; the repository's with the server stepping once
         # per mix.
         "fedre": [{"batch-size": 64, "fedre.eval-head": "global"}, {"fedre.eval-head": "global"},
                   {"batch-size": 64, "fedre.eval-head": "global", "fedre.server-batch-size": 1}],
         # Felo's and Velo's paper's group averaging, which their defaults leave off: it costs
         # them most under sparse participation (reproduce/felo_sparse.py, docs/felo.md).
         "felo": [{"felo.group-avg": True}], "velo": [{"velo.group-avg": True}],
         # FedGen's generator at HtFLlib's total.sh rate, which its default replaced (at that
         # rate the generator never fits the heads' ensemble, docs/fedgen.md), and at that rate
         # its clients' term at HtFLlib's weight instead of the authors' 10.
         "fedgen": [{"fedgen.server-lr": 0.1},
                    {"fedgen.server-lr": 0.1, "fedgen.client-weight": 1.0}],
         # FedTGP's paper's headline, the nearest global prototype, which its default replaced
         # by the model's own head (the same training; both are in every run's results).
         "fedtgp": [{"fedtgp.eval-rule": "nearest-prototype"}],
         # FedGH with one local epoch, its default until this measurement chose five (its paper
         # grid-searches E in 1..100, its code trains 30): one epoch of 64 leaves a client of 300
         # samples 5 steps a round to re-fit the global header it installs (docs/fedgh.md: the
         # gap follows the local steps).
         "fedgh": [{"local-epochs": 1}],
         # FML's private model at the authors' 0.5, its default until this measurement chose
         # 0.9, and at 0.75 (alpha = 1 would be local training): how much of its loss is the KL
         # to the meme model.
         "fml": [{"fml.alpha": 0.5}, {"fml.alpha": 0.75}],
         # LG-FedAvg with its MNIST scripts' batch of 10 instead of its code's default 50
         # (about 30 steps a round instead of 6): how much of its loss is the few steps in
         # which a client re-fits its extractor to the averaged head.
         "lg-fedavg": [{"batch-size": 10}]}
PAGES = {"docs/htfl-methods-1.md": ["fd", "fedre", "fedtgp"], "docs/fedgen.md": ["fedgen"],
         "docs/fedl2g.md": ["fedl2g"], "docs/shared-model-methods.md": ["fml", "fedmrl", "fedkd"]}


@dataclass
class Row:
    """A row of the table: ``method`` with ``changed`` (nothing else but the column's data and
    federation), its runs named ``<column>-<name>-seed<s>``. ``base``: the key of the Standalone
    row its Δ is against (None: a baseline, no Δ); ``own``: the key of the Standalone row
    trained with its own recipe (None: none is, or the row is a Standalone). ``owners``: the
    methods whose asking for runs this row is run for (empty: always). ``skip``: the columns
    where the row is no cell (NO_PUBLIC_SET)."""

    key: str
    label: str
    method: str
    changed: dict[str, Any]
    name: str
    base: str | None = None
    own: str | None = None
    owners: tuple[str, ...] = field(default_factory=tuple)
    skip: tuple[str, ...] = ()


# The columns whose data holds no public set of the size the public-data methods draw from it
# per round at their defaults: the digits' training split (1,347 images) cut by public-fraction
# 0.1 leaves 134, below FedMD's and DS-FL's 500 and KT-pFL's 5,000 (fedapp refuses them). Their
# rows, FedDF's too, and the Standalone on their cut are no cells there: one rule for the four.
NO_PUBLIC_SET = ("digits",)


def settings_text(changed: Mapping[str, Any]) -> str:
    """``felo.group-avg = true, lr = 0.1``: a tried row's settings as its label says them (and,
    slugged, as its runs are named)."""
    return ", ".join(f"{k} = {toml_value(v)}" for k, v in changed.items())


def submodel_ground(method: str) -> dict[str, Any]:
    """What makes Standalone train each client's model of the sub-model ``method`` at its
    defaults (common.submodel_standalone), the same in every column (checked)."""
    found = [common.submodel_standalone({**DEFAULTS_SETTINGS[c](), "method": method})
             for c in DEFAULTS_SETTINGS]
    if any(f != found[0] for f in found):
        raise ValueError(f"{method}: its clients' models differ between the columns; a "
                         "Standalone row trains one set of them")
    return found[0]


def table_rows(every: Sequence[str]) -> list[Row]:
    """The rows of the table for the methods ``every``, in order: the Standalone rows (the
    default recipe, then each recipe of the methods), then each method with, after it, the
    Standalone rows only it and the methods after it need (one architecture; the public set
    held out; each client's model of a sub-model method, at the default recipe and at the
    method's) and its tried settings."""
    METHODS = page_methods()
    methods: list[Row] = []
    # The Standalone row each method's Δ is against, by its key: what it sets, how its label
    # says it, its row (made on first need; the default one's is the first row).
    grounds: dict[str, tuple[dict[str, Any], str, Row | None]] = {
        "standalone": ({}, "", None),
        "standalone-one-arch": (dict(ONE_ARCH), f"{ONE_ARCH['arch-mix']} only", None)}
    # The Standalone rows trained with a recipe, by (ground, recipe); the recipe each key is
    # or varies (a tried change's).
    alone: dict[tuple[str, str], Row] = {}
    named: dict[str, str] = {}

    def own_row(method: str, changed: dict[str, Any], base: str) -> str | None:
        """The key of the Standalone row that trains as ``method`` with ``changed`` does on
        ``base``'s ground (made on first need); ``base`` if that is Standalone's default
        recipe; None if no recipe's is. A tried change to the training itself (FedRE's
        ``batch-size = 10``) has a Standalone of its own: the method's recipe with it."""
        values = training(method, tuple(changed.items()))
        recipe = recipe_named(values)
        moved = {k: v for k, v in changed.items() if k in RECIPE_KEYS}
        mine = recipe_named(training(method))
        if recipe is None and values == training("standalone"):
            return base
        if recipe is not None:
            key, trains, label = recipe, dict(recipes()[recipe]), recipe_label(recipe)
        elif moved and mine is not None:
            key = f"{mine}-{slug(settings_text(moved))}"
            trains = {**dict(recipes()[mine]), **moved}
            label = f"{recipe_label(mine)}, with {settings_text(moved)}"
        else:
            return None
        if (base, key) not in alone:
            ground, where, row = grounds[base]
            alone[base, key] = Row(
                f"{base}-{key}", f"standalone ({where + ', ' if where else ''}{label})",
                "standalone", {**trains, **ground}, f"{base}-{key}",
                base=base, skip=row.skip if row else ())
            if base not in ("standalone", "standalone-one-arch"):  # after its method's row
                methods.append(alone[base, key])
            named[key] = recipe or mine
        alone[base, key].owners += (method,)
        return alone[base, key].key

    def ground_row(method: str) -> str:
        """The key of the Standalone row on ``method``'s public set cut, or training its
        clients' models (made, after the method's row, on first need)."""
        if common.needs_public(method):
            key, ground, where = ("standalone-holdout", dict(common.PUBLIC),
                                  "public set held out")
        else:
            ground = submodel_ground(method)
            key = next(f"standalone-{m}-models" for m in every
                       if common.is_submodel(m) and submodel_ground(m) == ground)
            where = "each client's model of " + ", ".join(
                m for m in every if common.is_submodel(m) and submodel_ground(m) == ground)
        if key not in grounds:
            grounds[key] = (ground, where, Row(
                key, f"standalone ({where})", "standalone", ground, key, base="standalone",
                skip=NO_PUBLIC_SET if common.needs_public(method) else ()))
            methods.append(grounds[key][2])
        grounds[key][2].owners += (method,)
        return key

    for method in every:
        if METHODS[method].homogeneous_only:
            methods.append(Row(method, f"{method} ({ONE_ARCH['arch-mix']} only)", method,
                               dict(ONE_ARCH), f"{method}-one-arch", base="standalone-one-arch",
                               own=own_row(method, ONE_ARCH, "standalone-one-arch")))
            methods.append(Row("standalone-one-arch", f"standalone ({ONE_ARCH['arch-mix']} only)",
                               "standalone", dict(ONE_ARCH), "standalone-one-arch",
                               owners=(method,)))
        elif common.needs_public(method) or common.is_submodel(method):
            public = common.needs_public(method)
            row = Row(method, f"{method} (public set held out)" if public else method, method,
                      dict(common.PUBLIC) if public else {}, method,
                      skip=NO_PUBLIC_SET if public else ())
            methods.append(row)
            row.base = ground_row(method)
            row.own = own_row(method, row.changed, row.base)
        else:
            methods.append(Row(method, method, method, {}, method, base="standalone",
                               own=own_row(method, {}, "standalone")))
        for i, changed in enumerate(TRIED.get(method, [])):
            what = settings_text(changed)
            methods.append(Row(f"{method}-tried-{i}", f"{method} with {what}", method, changed,
                               f"{method}-{slug(what)}", base="standalone",
                               own=own_row(method, changed, "standalone")))
    order = list(recipes())  # the recipes' Standalone rows in their order, one-arch ones last
    first = [alone[k] for k in sorted((k for k in alone if k[0] in (
        "standalone", "standalone-one-arch")), key=lambda k: (
            k[0] != "standalone", order.index(named[k[1]]), k[1] != named[k[1]]))]
    return [Row("standalone", "standalone", "standalone", {}, "standalone"), *first, *methods]


Runs = Callable[[Row, str], "list[dict] | None"]


def header(columns: Sequence[str]) -> list[str]:
    return ["| method | " + " | ".join(f"{c} | Δ {c} | Δ own recipe {c}" for c in columns)
            + " | recipe |", "|---|" + "---|---|---|" * len(columns) + "---|"]


def row_text(row: Row, by_key: Mapping[str, Row], columns: Sequence[str], runs: Runs,
             verdicts: dict[str, list[str]]) -> str:
    """The row's line of the table; each of its verdicts against Standalone at its own recipe
    (VERDICT_RULE) joins ``verdicts`` as ``"<label> on <column>"``. ``runs(row, column)``:
    the summaries of the row's seeds in that column (None: not run)."""
    cells = []
    for column in columns:
        if column in row.skip:
            cells.append("— | — | —")
            continue
        mine = runs(row, column)
        if not mine:
            cells.append("not run | — | —")
            continue
        base = runs(by_key[row.base], column) if row.base else None
        own = runs(by_key[row.own], column) if row.own and row.method != "standalone" else None
        delta = "—"
        if base:
            means = [mean_std(map(mean_client_accuracy, x))[0] for x in (mine, base)]
            delta = signed(means[0] - means[1])
        against = "—"
        if own:
            if len(mine) != len(own):
                raise ValueError(f"paired runs: {len(mine)} seeds against {len(own)}")
            diffs = [mean_client_accuracy(x) - mean_client_accuracy(y) for x, y in zip(mine, own)]
            mean, spread = mean_std(diffs)
            against = f"{signed(mean)} ± {spread:.3f}"
            verdicts[verdict(diffs)].append(f"{row.label} on {column}")
        cells.append(f"{cell(map(mean_client_accuracy, mine))} | {delta} | {against}")
    return (f"| {row.label} | " + " | ".join(cells) + " | "
            + training_caption(None, {"method": row.method, **row.changed}) + " |")


def verdict_lines(verdicts: Mapping[str, Sequence[str]]) -> list[str]:
    """The rule, then one line per verdict (``none`` where no entry has it)."""
    return [VERDICT_RULE, "", *(f"- {start}{'; '.join(verdicts.get(v, [])) or 'none'}."
                                for v, start in VERDICTS.items())]


def previous_table(doc: Path, columns: Sequence[str]) -> tuple[dict[str, str],
                                                                dict[str, list[str]]]:
    """The rows (label -> row) and the verdict entries (verdict -> entries) of the table
    ``doc`` has, if its columns are ``columns`` (a table of other columns keeps nothing)."""
    text = read_generated(doc, SCRIPT)
    if header(columns)[0] not in text:
        return {}, {}
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| method |")}
    verdicts = {v: [e for line in text.splitlines() if line.startswith(f"- {start}")
                    for e in line[len(start) + 2:].rstrip(".").split("; ") if e != "none"]
                for v, start in VERDICTS.items()}
    return rows, verdicts


def needed(rows: Sequence[Row], methods: Sequence[str]) -> set[str]:
    """The keys of the rows an invocation for ``methods`` runs: those whose owners (default:
    the row's method; none for a Standalone row: always) include one of ``methods``, and the
    Standalone rows they read against."""
    asked = set()
    for row in rows:
        owners = row.owners or (() if row.method == "standalone" else (row.method,))
        if not owners or set(owners) & set(methods):
            asked |= {row.key} | {k for k in (row.base, row.own) if k}
    return asked


def planned(rows: Sequence[Row], asked: set[str], columns: Sequence[str],
            seeds: Sequence[int]) -> list[tuple[str, Row, str]]:
    """(column, row, run name without the seed) of every asked row, column by column."""
    return [(c, row, f"{slug(c)}-{row.name}") for c in columns for row in rows
            if row.key in asked and c not in row.skip]


def dry_run(plan: Sequence[tuple[str, Row, str]], seeds: Sequence[int], out: Path,
            resources: Mapping[str, Any], jobs: int = 1) -> list[str]:
    """Print every run of ``plan`` at ``seeds``, marking those made already (``out`` or its
    records), after each column's settings; check every run's settings as ``fedapp run`` does
    before anything starts, and each column's data and partition at every seed (they do not
    depend on the method); estimate the time of those to run (common.estimate). Returns the
    refusals, one line each."""
    def check(name: str, settings: Mapping[str, Any], data: bool = False) -> None:
        refused.extend(common.check_settings(name, settings, data))

    refused: list[str] = []
    made, column = 0, None
    for c, row, name in plan:
        if c != column:
            column = c
            print(f"\n# {c}: " + ", ".join(f"{k} = {toml_value(v)}"
                                          for k, v in DEFAULTS_SETTINGS[c]().items()))
            for seed in seeds:
                check(f"{slug(c)} data at seed {seed}",
                      {**DEFAULTS_SETTINGS[c](), "method": "standalone", "seed": seed}, True)
        check(name, {**DEFAULTS_SETTINGS[c](), "method": row.method, **row.changed, **resources})
        for seed in seeds:
            done = finished(out, f"{name}-seed{seed}") is not None
            made += done
            print(f"{'made  ' if done else 'to run'} {name}-seed{seed}: method = "
                  f"{toml_value(row.method)}"
                  + "".join(f", {k} = {toml_value(v)}" for k, v in row.changed.items()))
    total = len(plan) * len(seeds)
    print(f"\n[reproduce] {total} runs: {made} made already, {total - made} to run; "
          + common.estimate(out, total - made, jobs)
          + (f"; {len(refused)} refused:\n" + "\n".join(refused) if refused else
             "; every one's settings, and each column's data and partition at every seed, "
             "pass fedapp's checks"))
    return refused


def main() -> None:
    METHODS = page_methods()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        default=[m for m in METHODS if m != "standalone"])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--dry-run", action="store_true",
                        help="list the runs this invocation needs (made or to run), check "
                             "their settings and estimate their time; run nothing, write "
                             "nothing")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the runs that exist (a row "
                             "whose runs are missing reads 'not run')")
    add_resource_options(parser)
    args = parser.parse_args()
    out, seeds, resources = args.out.resolve(), args.seeds, resource_overrides(args)

    every = [m for m in METHODS if m != "standalone"]
    columns = list(DEFAULTS_SETTINGS)
    rows = table_rows(every)
    by_key = {row.key: row for row in rows}
    asked = needed(rows, args.methods)
    plan = planned(rows, asked, columns, seeds)
    if args.dry_run:
        raise SystemExit(1 if dry_run(plan, seeds, out, resources, args.jobs) else 0)

    def overrides(column: str, row: Row) -> dict[str, Any]:
        return {**DEFAULTS_SETTINGS[column](), "method": row.method, **row.changed, **resources}

    def exists(name: str) -> bool:
        return all(finished(out, f"{name}-seed{s}") is not None for s in seeds)

    # With --jobs, every run the asked rows need, that many at a time; the rows then reuse them.
    if not args.table_only:
        run_parallel([(None, {**overrides(c, row), "seed": seed}, f"{name}-seed{seed}")
                      for c, row, name in plan for seed in seeds], out, args.jobs)
    made = {(row.key, c): run_seeds(None, overrides(c, row), name, seeds, out)
            for c, row, name in plan if not args.table_only or exists(name)}

    old_rows, old_verdicts = previous_table(DOC, columns)
    texts: dict[str, str] = {}
    verdicts: dict[str, list[str]] = {v: [] for v in VERDICTS}
    for row in rows:
        if row.key in asked:
            texts[row.key] = row_text(row, by_key, columns,
                                      lambda r, c: made.get((r.key, c)), verdicts)
        elif row.label in old_rows:  # not asked for: the page's row, and its verdicts
            texts[row.key] = old_rows[row.label]
            for v, entries in old_verdicts.items():
                verdicts[v] += [e for e in entries if e.rsplit(" on ", 1)[0] == row.label]

    ran = [m for m in every if m in args.methods]
    kept = [m for m in every if m not in ran and any(
        k == m or k.startswith(f"{m}-tried-") for k in texts)]
    covered = ran + kept

    def caption(command: str) -> str:
        return (f"Produced by `.venv/bin/python {command}"
                + ("" if covered == every else f" --methods {' '.join(covered)}")
                + seeds_option(seeds)
                + "`"
                + (f" (in parts: the last invocation, `--methods {' '.join(ran)}`, re-ran the"
                   " baselines and replaced those methods' rows, keeping the others')"
                   if kept and ran else "")
                + ". Mean per-client local-test accuracy after the last round, ± std over "
                f"{len(seeds)} seed(s); Δ = against Standalone on the same data and "
                "architectures with its default recipe (the row *standalone*, or *standalone "
                f"({ONE_ARCH['arch-mix']} only)*, *standalone (public set held out)*, "
                "*standalone (each client's model of ...)*); Δ own recipe = against the "
                "Standalone row on the same data and models "
                "trained with the row's own recipe (the same optimizer, lifetime, lr, batches "
                "and local steps), paired by seed: mean ± std over the seeds of the "
                "seed-by-seed difference (— where no Standalone trains as the row does). "
                "Every method trains with its own recipe, shown in the last column.")

    lines = [caption(SCRIPT), "", *header(columns), *texts.values(), "",
             *verdict_lines(verdicts)]
    write_generated(DOC, SCRIPT, "\n".join(lines))
    print(f"[reproduce] wrote {DOC}")
    for page, methods in PAGES.items():
        named = set(BASELINES + methods + ["standalone-one-arch"]) | {
            f"{m}-tried-{i}" for m in methods for i in range(len(TRIED.get(m, [])))}
        named |= {by_key[k].own for k in named if k in by_key and by_key[k].own}
        wanted = [row.key for row in rows if row.key in named]
        if all(k in texts for k in wanted) and asked & set(methods):
            write_generated(ROOT / page, SCRIPT, "\n".join(
                [caption(SCRIPT) + " The whole table, with the verdicts: "
                 "[defaults.md](defaults.md).", "", *header(columns),
                 *(texts[k] for k in wanted)]))
            print(f"[reproduce] wrote {page}")


if __name__ == "__main__":
    main()
