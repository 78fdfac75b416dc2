"""The sub-model methods on Fashion-MNIST at CPU scale, each at its paper's mix of widths or
depths, beside Standalone training exactly each client's model.

HeteroFL (levels a1-b1-c1-d1-e1 on ``heterofl-conv``), FedRolex (the same levels, rolling
windows), FjORD (five uniform tiers p_max 0.2..1 on ``heterofl-conv``) and DepthFL (depths 1, 2,
3, 4 in blocks on the 4-block CNN with an exit per block), each at its defaults (its paper's mix
and its authors' recipe: docs/recipes.md), on 10 clients of at most 300 Fashion-MNIST training
samples, 20 rounds, every client every round, IID and Dirichlet 0.3. Beside each, at the same
seeds (the same partitions): Standalone training, on each client, the very model that client of
the method trains (common.submodel_standalone), once with Standalone's recipe and once with the
method's, which tells what the recipe does from what the method does. Reports each row's
local-test accuracy (the project's metric, a client's own model on its own test split), its
global-test accuracy, and the method's global model on the server (its paper's metric:
HeteroFL's and FedRolex's full-width model, FjORD's at each width, DepthFL's ensemble of exits);
writes each method's table into its page (docs/<method>.md, between its generated markers).

    .venv/bin/python reproduce/submodels_fmnist.py                     # 3 seeds, every method
    .venv/bin/python reproduce/submodels_fmnist.py --methods heterofl  # one page
    .venv/bin/python reproduce/submodels_fmnist.py --table-only        # runs nothing
    .venv/bin/python reproduce/submodels_fmnist.py --quick             # a pipeline check

``--quick`` (one seed, IID only, 2 rounds, 60-sample shards) writes its pages to the output
folder, never into docs/. Finished runs are reused (results/reproduce-submodels/, else their
records), so an interrupted reproduction resumes.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import common
from common import (ROOT, VERDICT_RULE, add_page_options, claim_line, comparison_table,
                    finished, global_accuracy, mean_client_accuracy, quick_folder,
                    resource_overrides, run_experiment, run_parallel, seeds_option,
                    write_generated)

SCRIPT = "reproduce/submodels_fmnist.py"
BASE = {"dataset": "fmnist", "num-clients": 10, "max-samples-per-client": 300,
        "num-server-rounds": 20, "eval-every": 5, "eval-global-test": True,
        "global-test-samples": 1000}
SPLITS = [("IID", {"partition": "iid"}),
          ("Dirichlet 0.3", {"partition": "dirichlet", "dirichlet-alpha": 0.3})]
# method -> (its name in the tables, the server model its paper reports, what its runs set
# beyond BASE: DepthFL on the 4-block CNN with an exit per block, the spec's other model for
# Fashion-MNIST beside a quarter-width ResNet-18: the layout of the width methods' global
# model, heterofl-conv, so that the four pages train one family of models)
METHODS = {"heterofl": ("HeteroFL", "global", {}), "fedrolex": ("FedRolex", "global", {}),
           "fjord": ("FjORD", "width-1", {}),
           "depthfl": ("DepthFL", "ensemble", {"depthfl.model": "cnn4"})}
# Rows tried beside a method at its defaults on one split, each changing one setting to test a
# cause its page names. DepthFL's distillation weight w_t ramps to 1 over 300 rounds (the
# reference's), so in 20 rounds it stays between 0.007 and 0.012, close to the paper's ablation
# without KD: the row ramps it over the run's own 20 rounds.
# FedRolex's code trains at lr 2e-4, tuned for 3,200 rounds, and barely moves in 20: the row at
# HeteroFL's recipe is the paper's comparison, rolling windows against HeteroFL's leading ones,
# at the same training (RIVALS).
TRIED = {"depthfl": {"IID": {"DepthFL, distillation ramped over 20 rounds (tried)":
                             {"depthfl.kd-ramp-rounds": 20}}},
         "fedrolex": {split: {"FedRolex at HeteroFL's recipe (tried)": "heterofl"}
                      for split in ("IID", "Dirichlet 0.3")}}
# The method a page's paper argues against, read from its own runs on the same split: each
# row's global model against the rival's (the paper's metric), where those runs are made.
RIVALS = {"fedrolex": "heterofl"}
QUICK = {"num-server-rounds": 2, "max-samples-per-client": 60, "global-test-samples": 100,
         "eval-every": 1}


def masked_accuracy(summary: dict[str, Any]) -> float:
    """The mean over clients of the last round's local-test accuracy with the label mask."""
    return float(summary["accuracy"]["variants"]["masked"]["mean"])


def rows(method: str, split_name: str, split: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The method at its defaults, its rows tried on this split (TRIED), and the Standalone
    of its clients' models at Standalone's recipe and at the method's (this setting's values
    of docs/recipes.md's keys)."""
    label, _, settings = METHODS[method]
    own = {**BASE, **split, "method": method, **settings}
    alone = {**BASE, **split, "method": "standalone", **common.submodel_standalone(own)}
    tried = TRIED.get(method, {}).get(split_name, {})
    out = {label: own, **{row: {**own, **changed(change)} for row, change in tried.items()},
           "Standalone (same models)": alone}
    if common.recipe_of(method) is not None:
        out[f"Standalone (same models, {label}'s recipe)"] = {
            **alone, **dict(common.training(method)), "feature-dim": 0}
    return out


def changed(change: dict[str, Any] | str) -> dict[str, Any]:
    """A tried row's change: settings, or another method's name for its whole recipe."""
    return dict(common.training(change)) if isinstance(change, str) else change


def client_levels(settings: dict[str, Any]) -> list[str]:
    """Each client's level in the sub-model run ``settings``, by partition id: its depth
    (DepthFL) or its width rate (fixed per client; none where rates are drawn each round)."""
    cfg = common.run_config(settings)
    if cfg.method == "depthfl":
        return [f"depth {d}" for d in cfg.settings.client_depths(cfg)]
    return [f"rate {r}" for r in cfg.settings.plan(cfg).per_client]


def by_level_table(levels: list[str], results: dict[str, list[dict[str, Any]]]) -> str:
    """Each row's clients' local-test accuracy by their level (the mean over a level's clients,
    mean over seeds): where the mean of a row comes from. The same partition gives each client
    the same level in every row (Standalone trains exactly the method's client models)."""
    groups = {lv: [i for i, x in enumerate(levels) if x == lv] for lv in dict.fromkeys(levels)}

    def mean_of(summary: dict[str, Any], ids: list[int]) -> float:
        return float(np.mean([summary["accuracy"]["per_client"][str(i)] for i in ids]))
    return "\n".join([
        "Each row's clients by level: local-test accuracy, the mean over the level's clients "
        "(how many in brackets), mean over seeds.", "",
        "| row | " + " | ".join(f"{lv} ({len(ids)})" for lv, ids in groups.items()) + " |",
        "|---|" + "---|" * len(groups),
        *(f"| {label} | " + " | ".join(f"{np.mean([mean_of(s, ids) for s in runs]):.3f}"
                                       for ids in groups.values()) + " |"
          for label, runs in results.items())])


def ensemble_claim(label: str, runs: list[dict[str, Any]]) -> str:
    """``label``'s global ensemble of exits ≥ its deepest exit alone, in the same runs."""
    server = runs[0]["accuracy"]["server"]
    deepest = max((k for k in server if k.startswith("exit-")), key=lambda k: int(k[5:]))
    return claim_line(f"{label}: the global model's ensemble", f"its deepest exit ({deepest})",
                      runs, runs, lambda s: s["accuracy"]["server"]["ensemble"],
                      lambda s: s["accuracy"]["server"][deepest])


def rival_claims(method: str, split: str, results: dict[str, list[dict[str, Any]]],
                 experiments, split_settings: dict[str, Any], out) -> list[str]:
    """Each of ``method``'s rows' global model against its rival's on the same split and
    seeds (its paper's claim), from the rival's runs if they are made (none is started)."""
    mine, rival = METHODS[method][1], RIVALS[method]
    name, headline, _ = METHODS[rival]
    todo = experiments(rival, name, rows(rival, split, split_settings)[name], split)
    if any(finished(out, n) is None for _, _, n in todo):
        return [f"{name}'s runs under {split} are not made yet: no claim against it."]
    theirs = [run_experiment(*e, out) for e in todo]
    return [claim_line(f"{label}'s global model", f"{name}'s global model ({split}, its page's "
                       "runs)", runs, theirs, lambda s: s["accuracy"]["server"][mine],
                       lambda s: s["accuracy"]["server"][headline])
            for label, runs in results.items() if not label.startswith("Standalone")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    add_page_options(parser, ROOT / "results" / "reproduce-submodels")
    args = parser.parse_args()

    resources, seeds, out = resource_overrides(args), args.seeds, args.out.resolve()
    extra, docs, splits = {}, ROOT / "docs", SPLITS
    if args.quick:
        extra, seeds, out = QUICK, seeds[:1], quick_folder(out)
        docs, splits = out, SPLITS[:1]

    def experiments(method: str, label: str, settings: dict, split: str):
        name = common.slug(f"{method}-{split.split()[0]}-{label}")
        return [(None, {**settings, "seed": seed, **extra, **resources}, f"{name}-seed{seed}")
                for seed in seeds]

    plan = {m: {split: rows(m, split, s) for split, s in splits} for m in args.methods}
    if not args.table_only:
        run_parallel([e for m, by_split in plan.items() for split, table in by_split.items()
                      for label, settings in table.items()
                      for e in experiments(m, label, settings, split)], out, args.jobs)

    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + (
        seeds_option(args.seeds))
    for method, by_split in plan.items():
        name, headline, _ = METHODS[method]
        # Each page's line on where its runs were made counts the runs that page reads (its
        # rows' and its rival's), not the pages written before it by the same invocation.
        common.READ.clear()
        tables, missing = [], []
        for split, table in by_split.items():
            results = {}
            for label, settings in table.items():
                todo = experiments(method, label, settings, split)
                if args.table_only and any(finished(out, n) is None for _, _, n in todo):
                    missing.append(f"{label} under {split}")
                    continue
                results[label] = [run_experiment(*e, out) for e in todo]
            if name not in results:
                continue
            alone = [label for label in results if label.startswith("Standalone")]
            # The paper reads the server's model on the global test set, the clients' against
            # their own models on the same test set.
            claims = [claim_line(f"{name}'s global model ({headline}, its paper's metric)",
                                 f"{label} on the global test set", results[name],
                                 results[label], lambda s: s["accuracy"]["server"][headline],
                                 global_accuracy) for label in alone]
            # Where a method's clients also read their slice through its label-masked head
            # (HeteroFL's and FedRolex's `accuracy-masked`, the code's "Local", which the
            # paper reports beside "Global" under label skew), that reading too.
            if "masked" in results[name][0]["accuracy"].get("variants", {}):
                claims += [claim_line(f"{name} with its label mask", label, results[name],
                                      results[label], masked_accuracy, mean_client_accuracy)
                           for label in alone]
            if method in RIVALS:
                claims += rival_claims(method, split, results, experiments,
                                       dict(splits)[split], out)
            # Where the paper's metric is an ensemble of exits (DepthFL's), whether it beats
            # the deepest exit alone, in the same runs.
            if headline == "ensemble":
                claims += [ensemble_claim(label, runs) for label, runs in results.items()
                           if not label.startswith("Standalone")]
            tables.append(comparison_table(
                f"{name}, {split}", results, seeds, [(name, label) for label in alone],
                metric=mean_client_accuracy, extra_claims=claims))
            levels = client_levels(table[name])
            if levels:
                tables[-1] += "\n\n" + by_level_table(levels, results)
        write_generated(docs / f"{method}.md", SCRIPT, "\n\n".join([
            f"Produced by `{command}` (the claims on the clients read local-test accuracy).",
            VERDICT_RULE, *tables,
            *([f"Not run yet at every seed, so not in the tables: {', '.join(missing)}."]
              if missing else [])]))
        print(f"[reproduce] wrote {docs / f'{method}.md'}")


if __name__ == "__main__":
    main()
