"""The robustness table of docs/robustness.md: every method's honest clients under each attack,
at 10 % and 30 % malicious clients, without a defence and with the method's best robust rule,
beside the run without attackers.

    .venv/bin/python reproduce/robustness.py --dry-run      # the missing runs, by stage, and how
                                                            # long they take
    .venv/bin/python reproduce/robustness.py                # everything, 3 seeds (days on 2 cores)
    .venv/bin/python reproduce/robustness.py --fractions 0.3 --methods fedgh fedproto
    .venv/bin/python reproduce/robustness.py --table-only   # runs nothing
    .venv/bin/python reproduce/robustness.py --quick        # one seed, 2 rounds, two methods:
                                                            # the pipeline only

The setting is the scoreboard's Dirichlet 0.3 column (reproduce/scoreboard.py: Fashion-MNIST, 10
clients of at most 300 samples, the CNN-1..5 mix, 20 rounds, one epoch of batches of 10 per
update, each method's recipe otherwise); FedAvg on CNN-5 alone, as there; the methods that need
a public set take ``public-source = "train-holdout"``. ``malicious-fraction`` 0.1 and 0.3 of 10
clients are 1 and 3 attackers, drawn from (seed, "malicious"): the same clients for every method
and attack at one seed. Each attack at its default strength (``attack-scale`` 10,
``attack-noise-std`` 1, ``attack-target`` 0).

Which cells exist is what ``fedapp run`` accepts (``strategies.load_config``, from each card):
``targeted`` only where the upload has per-class rows, a rule only where it fits every kind of
payload the method's server combines; a refused rule reads "no rule" with the reason.

The best rule of a method: among ``median``, ``trimmed-mean``, ``geomed`` and ``multi-krum``
(those the method takes), the one whose honest clients' accuracy, averaged over every attack the
method takes at 30 % attackers, is highest in a pre-pass at seed 3 — a seed the table does not
report, so that the table's cells are not chosen on their own noise (ties: the first in that
order). ``trimmed-mean`` cuts the attackers' share at each end (β = the fraction) and
``multi-krum`` tolerates the attackers' number (f = 1 or 3): each rule is told the fraction it
faces, as their papers assume. ``--rule`` fixes one rule for every method instead (no pre-pass).

The plan runs in stages, each cell's seeds before the next cell: the pre-pass; each method's
attack-free run; then, per fraction (30 % first), per method, the attack-free run with the rule,
and each attack without and with the rule. An interrupted run thus leaves whole cells, and
resumes: finished runs are reused (results/robustness/, else their records in
reproduce/records/robustness/). ``--quick`` writes its runs and its table to
results/robustness/quick, never into docs/.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, RECORDS, ROOT, add_resource_options,  # noqa: E402
                    finished, mean_client_accuracy, mean_std, page_methods, quick_folder,
                    resource_overrides, run_parallel, run_seeds, seeds_option, signed,
                    write_generated)
from scoreboard import COMMON, ONE_ARCH, SETTINGS  # noqa: E402

SCRIPT = "reproduce/robustness.py"
OUT = ROOT / "results" / "robustness"
DOC = ROOT / "docs" / "robustness.md"
SETTING = {**COMMON, **SETTINGS["dir0.3"][1]}
PUBLIC = {"public-source": "train-holdout"}   # for the methods that need a public set
FRACTIONS = [0.3, 0.1]                        # run in this order; the table shows them ascending
CANDIDATES = ("median", "trimmed-mean", "geomed", "multi-krum")
PREPASS_SEED, PREPASS_FRACTION = 3, 0.3
# A Flower and Ray start per cell (its seeds share one SuperLink): reproduce/records_time.py.
START_SECONDS = 30
# The rule of a method whose pre-pass is incomplete, in a plan (--dry-run): counted as a rule
# with a parameter, whose attack-free run each fraction needs (the most runs a rule can take).
PENDING = "<best rule>"
QUICK = {"num-server-rounds": 2, "max-samples-per-client": 50}
QUICK_METHODS = ["lg-fedavg", "fedproto"]
QUICK_ATTACKS = ["sign-flip", "targeted"]


def attacks() -> list[str]:
    from fedapp.config import ATTACKS
    return [a for a in ATTACKS if a != "none"]


def methods() -> list[str]:
    """Every registered method but Standalone (its server combines nothing, so attackers reach
    no one): the pages' order, then the others by name."""
    from strategies import METHODS
    order = [m for m in page_methods() if m != "standalone"]
    return order + sorted(m for m in METHODS if m not in order and m != "standalone")


@dataclass(frozen=True)
class Cell:
    """One cell's runs: ``method`` under ``attack`` (``none``: no attackers) at ``fraction``,
    combined by ``rule`` (``none``: the method's own average). ``fraction`` also sets the
    rule's parameter, so an attack-free run with a parameterised rule has one."""
    method: str
    attack: str
    fraction: float | None
    rule: str
    seeds: tuple[int, ...]

    @property
    def name(self) -> str:
        return run_name(self.method, self.attack, self.fraction, self.rule)


def rule_settings(rule: str, fraction: float | None) -> dict[str, Any]:
    """The rule's settings, its parameter set for ``fraction`` attackers."""
    if rule == "none":
        return {}
    out: dict[str, Any] = {"robust-aggregation": rule}
    if rule == "trimmed-mean":
        out["robust-trim-fraction"] = fraction
    if rule in ("krum", "multi-krum"):
        out["robust-krum-f"] = attackers(fraction)
    return out


def rule_label(rule: str, fraction: float | None) -> str:
    """The rule with the parameter it was given: ``trimmed-mean-b0.3``, ``multi-krum-f3``."""
    return rule + (f"-b{fraction:g}" if rule == "trimmed-mean" else
                   f"-f{attackers(fraction)}" if rule in ("krum", "multi-krum") else
                   f"-p{round(100 * fraction)}" if rule == PENDING else "")


def attackers(fraction: float | None) -> int:
    """How many of the setting's clients attack at ``fraction``: the run config's own count."""
    if fraction is None:
        return 0
    cfg = config(methods()[0], "label-flip", fraction, "none", ())
    if isinstance(cfg, Exception):
        raise cfg
    return cfg.num_malicious


def run_name(method: str, attack: str, fraction: float | None, rule: str) -> str:
    parts = [method, attack] + ([f"p{round(100 * fraction)}"] if attack != "none" else [])
    if rule != "none":
        parts.append(rule_label(rule, fraction))
    return re.sub(r"[^a-z0-9.<>]+", "-", "-".join(parts))


def overrides(method: str, attack: str, fraction: float | None, rule: str,
              extra: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    from strategies import METHODS
    card = METHODS[method]
    return {**SETTING, "method": method, **(ONE_ARCH if card.homogeneous_only else {}),
            **(PUBLIC if card.needs_public else {}),
            **({"attack": attack, "malicious-fraction": fraction} if attack != "none" else {}),
            **rule_settings(rule, fraction), **dict(extra)}


@functools.cache
def config(method: str, attack: str, fraction: float | None, rule: str,
           extra: tuple[tuple[str, Any], ...]) -> Any:
    """The run config ``fedapp run`` would use, or the ConfigError it would stop with."""
    from fedapp.cli.run import resolve_settings
    from fedapp.config import ConfigError, toml_value
    from strategies import load_config
    o = overrides(method, attack, fraction, rule, extra)
    try:
        return load_config(resolve_settings(None, [f"{k}={toml_value(v)}"
                                                   for k, v in o.items()])[0])
    except ConfigError as exc:
        return exc


def refusal(method: str, attack: str, fraction: float | None, rule: str,
            extra: tuple[tuple[str, Any], ...] = ()) -> str | None:
    """Why ``fedapp run`` refuses the cell (its message), or None."""
    cfg = config(method, attack, fraction, rule, extra)
    return str(cfg) if isinstance(cfg, Exception) else None


def candidates(method: str, extra: tuple = ()) -> list[str]:
    return [r for r in CANDIDATES if refusal(method, "none", PREPASS_FRACTION, r, extra) is None]


def method_attacks(method: str, chosen: Sequence[str], extra: tuple = ()) -> list[str]:
    return [a for a in chosen if refusal(method, a, PREPASS_FRACTION, "none", extra) is None]


# --- what a cell reads ------------------------------------------------------------------------

def summaries(cell: Cell, out: Path, extra: tuple) -> list[dict] | None:
    """The cell's summaries, one per seed (read through ``run_seeds``, which counts them among
    the table's runs), or None when any is missing."""
    if any(finished(out, f"{cell.name}-seed{s}") is None for s in cell.seeds):
        return None
    return run_seeds(None, overrides(cell.method, cell.attack, cell.fraction, cell.rule, extra),
                     cell.name, list(cell.seeds), out)


def stopped(out: Path, run: str) -> str | None:
    """Why the server stopped ``run`` before its end (its ``failed.json``: an attack can make
    every upload of a round unusable, or the state non-finite), or None. A stopped run is a
    result, not retried: delete its folder to make it again."""
    from fedapp.runtime.results import FAILURE_FILE
    path = Path(out) / run / FAILURE_FILE
    if finished(out, run) is not None or not path.exists():
        return None
    failure = json.loads(path.read_text())
    return f"{failure.get('kind', 'stopped')}: {failure.get('reason', '')}".rstrip(": ")


def honest(summary: Mapping[str, Any], malicious: Sequence[int]) -> list[float]:
    """The last round's accuracies of the clients not in ``malicious``."""
    out = set(malicious)
    return [float(v) for k, v in summary["accuracy"]["per_client"].items() if int(k) not in out]


def honest_mean(summary: Mapping[str, Any]) -> float:
    return float(np.mean(honest(summary, summary.get("malicious_clients", []))))


def versus_clean(attacked: Sequence[Mapping], clean: Sequence[Mapping]) -> list[float]:
    """Seed by seed: the attacked run's honest clients' mean accuracy minus the same clients'
    mean in the attack-free run of that seed (the same partition and initial weights)."""
    return [honest_mean(a) - float(np.mean(honest(c, a.get("malicious_clients", []))))
            for a, c in zip(attacked, clean, strict=True)]


def text(values: Sequence[float], diffs: Sequence[float] | None) -> str:
    """``0.812 ± 0.010 (−0.050 ± 0.012)``: mean ± std over seeds, and the paired difference;
    one seed: the values alone."""
    one = len(values) == 1
    mean, std = mean_std(values)
    out = f"{mean:.3f}" + ("" if one else f" ± {std:.3f}")
    if diffs is not None:
        dmean, dstd = mean_std(diffs)
        out += f" ({signed(dmean)}" + ("" if one else f" ± {dstd:.3f}") + ")"
    return out


# --- the run-time estimate --------------------------------------------------------------------

@functools.cache
def wall_medians(folder: str) -> dict[str, float]:
    """Median wall seconds of a run per method, over this script's records and the
    scoreboard's runs of the same setting (its Dirichlet 0.3 column), made on a CPU; ``""``:
    over all of them (for a method with none)."""
    walls: dict[str, list[float]] = {}
    files = sorted((RECORDS / folder).glob("*.json")) + sorted(
        f for f in (RECORDS / "scoreboard").glob("dir0.3-*.json")
        if re.fullmatch(r"dir0\.3-[a-z0-9-]+?(-cnn5)?-seed\d+", f.stem)
        and not re.search(r"-(async|walk|gossip|recipe|no-group-avg)", f.stem))
    for f in files:
        summary = json.loads(f.read_text())
        if "gpu" in summary.get("provenance", {}):
            continue
        walls.setdefault(summary["method"], []).append(summary["wall_seconds"])
    out = {m: statistics.median(v) for m, v in walls.items()}
    out[""] = statistics.median([w for v in walls.values() for w in v]) if walls else 45.0
    return out


def seconds(cells: Sequence[Cell], out: Path, only_missing: bool = False) -> float:
    """About how long ``cells`` take (their missing seeds only, with ``only_missing``), one
    run at a time: each run its method's median wall time, and a start per cell."""
    medians = wall_medians(out.name)
    return sum(START_SECONDS + len(missing(c, out) if only_missing else c.seeds)
               * medians.get(c.method, medians[""])
               for c in cells if not only_missing or missing(c, out))


# --- the plan ---------------------------------------------------------------------------------

def best_rule(method: str, attack_list: Sequence[str], out: Path, fixed: str | None,
              extra: tuple) -> tuple[str | None, str]:
    """(the method's rule, how it was chosen): None with the reason when no rule applies,
    None with ``pending`` while the pre-pass lacks a run."""
    if fixed:
        why = refusal(method, "none", PREPASS_FRACTION, fixed, extra)
        return (None, why) if why else (fixed, "fixed by --rule")
    rules = candidates(method, extra)
    if not rules:
        return None, refusal(method, "none", PREPASS_FRACTION, CANDIDATES[0], extra) or ""
    scores = prepass_scores(method, rules, attack_list, out)
    if any(v is None for v in scores.values()):
        return None, "pending"
    return max(rules, key=lambda r: scores[r]), "pre-pass"


def prepass_cells(method: str, attack_list: Sequence[str], extra: tuple) -> list[Cell]:
    return [Cell(method, a, PREPASS_FRACTION, r, (PREPASS_SEED,))
            for r in candidates(method, extra) for a in method_attacks(method, attack_list, extra)]


def prepass_scores(method: str, rules: Sequence[str], attack_list: Sequence[str],
                   out: Path) -> dict[str, float | None]:
    """Each rule's honest accuracy at the pre-pass seed, averaged over the attacks (None while
    a run is missing); a run the server stopped counts as 0 (the rule did not keep it going)."""
    out_scores: dict[str, float | None] = {}
    for r in rules:
        values = []
        for a in method_attacks(method, attack_list):
            name = f"{run_name(method, a, PREPASS_FRACTION, r)}-seed{PREPASS_SEED}"
            path = finished(out, name)
            values.append(honest_mean(json.loads(path.read_text())) if path else
                          0.0 if stopped(out, name) else None)
        out_scores[r] = None if None in values or not values else float(np.mean(values))
    return out_scores


def plan(chosen_methods: Sequence[str], attack_list: Sequence[str],
         fractions: Sequence[float], seeds: Sequence[int], out: Path, fixed: str | None,
         prepass_attacks: Sequence[str], extra: tuple) -> dict[str, list[Cell]]:
    """The stages, in the order they run: each a list of cells, each cell's seeds together.
    A stage whose rule is still ``pending`` counts the rule's cells with a placeholder rule,
    and its attack-free run once per fraction (the most it can need)."""
    seeds = tuple(seeds)
    stages: dict[str, list[Cell]] = {"pre-pass": [], "attack-free": []}
    for m in chosen_methods:
        if not fixed:
            stages["pre-pass"] += prepass_cells(m, prepass_attacks, extra)
        stages["attack-free"].append(Cell(m, "none", None, "none", seeds))
    for f in fractions:
        stage = stages.setdefault(f"{round(100 * f)} % attackers", [])
        for m in chosen_methods:
            rule, why = best_rule(m, prepass_attacks, out, fixed, extra)
            rule = rule or (PENDING if why == "pending" else None)
            if rule:
                stage.append(Cell(m, "none", f, rule, seeds))
            for a in method_attacks(m, attack_list, extra):
                stage.append(Cell(m, a, f, "none", seeds))
                if rule:
                    stage.append(Cell(m, a, f, rule, seeds))
    # An attack-free run with a rule of no parameter serves each fraction: one cell. (A pre-pass
    # run has a cell's name, at a seed of its own.)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for name, cells in stages.items():
        stages[name] = [c for c in cells if not ((c.name, c.seeds) in seen
                                                 or seen.add((c.name, c.seeds)))]
    return stages


def missing(cell: Cell, out: Path) -> list[int]:
    """The seeds of ``cell`` still to run: neither finished nor stopped by the server."""
    return [s for s in cell.seeds if finished(out, f"{cell.name}-seed{s}") is None
            and stopped(out, f"{cell.name}-seed{s}") is None]


def dry_run(stages: Mapping[str, list[Cell]], out: Path, full: Mapping[str, list[Cell]]) -> None:
    medians = wall_medians(out.name)
    print(f"[robustness] estimate: each run its method's median wall time "
          f"(overall median {medians['']:.0f} s), plus {START_SECONDS} s per cell to start")
    total_runs, total_s = 0, 0.0
    for name, cells in stages.items():
        todo = [c for c in cells if missing(c, out)]
        runs = sum(len(missing(c, out)) for c in todo)
        s = seconds(todo, out, only_missing=True)
        total_runs, total_s = total_runs + runs, total_s + s
        print(f"[robustness] stage {name}: {runs} of its {sum(len(c.seeds) for c in cells)} "
              f"runs missing, in {len(todo)} cells, about {s / 3600:.1f} h; "
              f"after it {total_s / 3600:.1f} h in all")
        for c in todo:
            print(f"    {c.name}: seeds {' '.join(map(str, missing(c, out)))}")
    full_runs = sum(len(c.seeds) for cells in full.values() for c in cells)
    print(f"[robustness] this selection: {total_runs} runs missing, about "
          f"{total_s / 3600:.1f} h on the records' kind of machine, one run at a time")
    print(f"[robustness] the whole design: {full_runs} runs, about "
          f"{seconds([c for cells in full.values() for c in cells], out) / 3600:.1f} h from "
          "nothing (placeholder rules count the most runs they can need)")


# --- the table --------------------------------------------------------------------------------

def table(all_methods: Sequence[str], attack_list: Sequence[str], fractions: Sequence[float],
          seeds: Sequence[int], out: Path, fixed: str | None, prepass_attacks: Sequence[str],
          extra: tuple, command: str) -> tuple[str, bool]:
    """The page's text, and whether any run was found."""
    found, stops = False, []

    def entry(cell: Cell, clean: list[dict] | None) -> str:
        """A cell's text against the attack-free runs ``clean``: ``stopped`` if the server
        stopped a run of it (the reason below the table), ``not run`` if a run is missing."""
        nonlocal found
        runs = summaries(cell, out, extra)
        found |= runs is not None
        why = [f"{cell.name}-seed{s}: {stopped(out, f'{cell.name}-seed{s}')}"
               for s in cell.seeds if stopped(out, f"{cell.name}-seed{s}")]
        if why:
            stops.extend(why)
            return "stopped"
        if runs is None or clean is None:
            return "not run"
        if cell.attack == "none" and cell.rule == "none":
            return text(list(map(mean_client_accuracy, runs)), None)
        return text(list(map(honest_mean, runs)), versus_clean(runs, clean))

    fractions = sorted(fractions)
    one = len(seeds) == 1
    lines = [
        f"Produced by `{command}`. The honest clients' mean local-test accuracy after the last "
        "round" + ("" if one else ", mean ± std over seeds " + ", ".join(map(str, seeds)))
        + ", and in brackets its difference to the same clients in the run without attackers "
        "(no rule), seed by seed" + ("" if one else ": mean ± std of the differences") + ". "
        "Row *none*: no attackers; its \"no defence\" cells are every client's accuracy, its "
        "rule cells the rule's cost without attackers (the rule at that fraction's parameter). "
        "*not run*: the cell's runs do not exist yet; *no rule*: the method's server takes "
        "none (reasons below the table).", "",
        "| method — rule | attack | " + " | ".join(
            f"{round(100 * f)} %: no defence | {round(100 * f)} %: rule" for f in fractions)
        + " |", "|---|---|" + "---|---|" * len(fractions)]
    no_rule: dict[str, str] = {}
    for m in all_methods:
        rule, why = best_rule(m, prepass_attacks, out, fixed, extra)
        if rule is None and why != "pending":
            no_rule[m] = why
        label = f"{m} — " + (rule if rule else "rule not chosen yet (pre-pass)"
                             if why == "pending" else "no rule")
        clean_cell = Cell(m, "none", None, "none", tuple(seeds))
        clean = summaries(clean_cell, out, extra)
        for a in ["none", *method_attacks(m, attack_list, extra)]:
            cells = []
            for f in fractions:
                cells.append(entry(clean_cell if a == "none" else
                                   Cell(m, a, f, "none", tuple(seeds)), clean))
                cells.append(entry(Cell(m, a, f, rule, tuple(seeds)), clean) if rule else
                             "not run" if why == "pending" else "no rule")
            lines.append(f"| {label if a == 'none' else ''} | {a} | " + " | ".join(cells) + " |")
    untargeted = [m for m in all_methods
                  if "targeted" in attack_list and refusal(m, "targeted", PREPASS_FRACTION,
                                                            "none", extra)]
    if untargeted:
        lines += ["", "*targeted* is not a row of " + ", ".join(untargeted)
                  + ": their uploads hold no per-class rows."]
    if stops:
        lines += ["", "Runs the server stopped (*stopped*; `failed.json` in the run's folder):",
                  ""] + [f"- {why}" for why in dict.fromkeys(stops)]
    if no_rule:
        lines += ["", "No rule, as `fedapp run` refuses it:", ""]
        lines += [f"- {m}: {why}" for m, why in no_rule.items()]
    prepass_stops: list[str] = []
    if not fixed:
        lines += ["", f"The pre-pass that chose each rule: the honest clients' mean accuracy at "
                  f"seed {PREPASS_SEED}, {round(100 * PREPASS_FRACTION)} % attackers, averaged "
                  "over the method's attacks (the chosen rule in bold).", "",
                  "| method | attacks | " + " | ".join(CANDIDATES) + " |",
                  "|---|---|" + "---|" * len(CANDIDATES)]
        for m in all_methods:
            rules = candidates(m, extra)
            if not rules:
                continue
            for c in prepass_cells(m, prepass_attacks, extra):  # the runs the scores read
                found |= summaries(c, out, extra) is not None
                run = f"{c.name}-seed{PREPASS_SEED}"
                prepass_stops += [f"{run}: {stopped(out, run)}"] if stopped(out, run) else []
            scores = prepass_scores(m, rules, prepass_attacks, out)
            rule = best_rule(m, prepass_attacks, out, fixed, extra)[0]
            row = [("—" if r not in scores else "not run" if scores[r] is None else
                    f"**{scores[r]:.3f}**" if r == rule else f"{scores[r]:.3f}")
                   for r in CANDIDATES]
            lines.append(f"| {m} | {len(method_attacks(m, prepass_attacks, extra))} | "
                         + " | ".join(row) + " |")
        if prepass_stops:
            lines += ["", "Pre-pass runs the server stopped, each counted as 0:", ""]
            lines += [f"- {why}" for why in prepass_stops]
    return "\n".join(lines), found


def main() -> None:
    all_methods, all_attacks = methods(), attacks()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=all_methods,
                        help="the methods to run (default: all; the table shows every method)")
    parser.add_argument("--attacks", nargs="+", choices=all_attacks,
                        help="the attacks to run (default: all; the pre-pass always takes "
                             "every attack, so that the rule does not depend on this choice)")
    parser.add_argument("--fractions", nargs="+", type=float, choices=FRACTIONS,
                        help="the attackers' shares to run (default 0.3, then 0.1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--rule", choices=CANDIDATES,
                        help="one rule for every method that takes it, instead of each "
                             "method's best from the pre-pass")
    parser.add_argument("--dry-run", action="store_true",
                        help="run nothing: list the missing runs by stage, count them and "
                             "estimate their time from the records' median wall time")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the table from the runs that exist")
    parser.add_argument("--quick", action="store_true",
                        help=f"one seed, 2 rounds, 50 samples per client, "
                             f"{' and '.join(QUICK_METHODS)} under {' and '.join(QUICK_ATTACKS)}"
                             "; its runs and its table go to the output folder only")
    parser.add_argument("--out", type=Path, default=OUT,
                        help="the folder of the runs (default results/robustness)")
    add_resource_options(parser)
    args = parser.parse_args()

    out, doc, seeds, extra = args.out.resolve(), DOC, args.seeds, ()
    table_methods, prepass_attacks = all_methods, all_attacks
    chosen_attacks = args.attacks or all_attacks
    chosen_methods = args.methods or all_methods
    fractions = args.fractions or FRACTIONS
    if args.quick:
        out, seeds, extra = quick_folder(out), seeds[:1], tuple(QUICK.items())
        doc = out / "robustness.md"
        table_methods = [m for m in all_methods if m in (args.methods or QUICK_METHODS)]
        chosen_methods = table_methods
        prepass_attacks = chosen_attacks = [a for a in all_attacks
                                            if a in (args.attacks or QUICK_ATTACKS)]
    resources = resource_overrides(args)

    def stages(selected: Sequence[str], attack_list: Sequence[str],
               fraction_list: Sequence[float]) -> dict[str, list[Cell]]:
        return plan(selected, attack_list, fraction_list, seeds, out, args.rule,
                    prepass_attacks, extra)

    if args.dry_run:
        dry_run(stages(chosen_methods, chosen_attacks, fractions), out,
                stages(table_methods, prepass_attacks if args.quick else all_attacks,
                       FRACTIONS))
        return
    failed: list[str] = []
    if not args.table_only:
        # Stage by stage: the rules of the later stages come from the pre-pass.
        for name in stages(chosen_methods, chosen_attacks, fractions):
            cells = stages(chosen_methods, chosen_attacks, fractions)[name]
            if any(c.rule == PENDING for c in cells):
                print(f"[robustness] stage {name} needs the pre-pass, which is incomplete: "
                      "stopping here", flush=True)
                break
            todo = [c for c in cells if missing(c, out)]
            print(f"[robustness] stage {name}: {len(todo)} cells to run", flush=True)
            if args.jobs > 1:
                try:
                    run_parallel([(None, {**overrides(c.method, c.attack, c.fraction, c.rule,
                                                      extra), "seed": s, **resources},
                                   f"{c.name}-seed{s}") for c in todo
                                  for s in missing(c, out)], out, args.jobs)
                except RuntimeError as exc:
                    print(f"[robustness] {exc}", flush=True)
            else:
                for c in todo:
                    try:  # a failed run must not keep the other cells from running
                        run_seeds(None, {**overrides(c.method, c.attack, c.fraction, c.rule,
                                                     extra), **resources},
                                  c.name, missing(c, out), out)
                    except RuntimeError as exc:
                        print(f"[robustness] {exc}", flush=True)
            # A run the server stopped is a result; any other failure is tried again next time.
            failed += [f"{c.name}: seeds {' '.join(map(str, missing(c, out)))}"
                       for c in todo if missing(c, out)]
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + seeds_option(
        args.seeds) + (f" --rule {args.rule}" if args.rule else "")
    body, found = table(table_methods, prepass_attacks if args.quick else all_attacks,
                        FRACTIONS, seeds, out, args.rule, prepass_attacks, extra, command)
    if not found:
        raise SystemExit(f"robustness: no runs in {out} or in its records; {doc} is left as "
                         "it is")
    write_generated(doc, SCRIPT, body)
    print(body)
    print(f"[reproduce] wrote {doc}")
    if failed:
        raise SystemExit("robustness: runs that failed (not stopped by the server on "
                         "purpose: a rerun tries them again):\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
