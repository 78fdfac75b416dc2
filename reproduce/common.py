"""What every reproduction script shares: run one experiment through ``fedapp run`` (resuming
from a finished run's ``summary.json`` or its record), and turn several seeds' summaries into
table cells and a plot. Each script in this folder writes one table and one plot into ``docs/``.

Records: every finished run's summary is also kept under ``reproduce/records/<results folder>/
<run name>.json``, committed, with where it was made (commit, CPU, torch) and every effective
setting (a reused record whose settings its name no longer resolves to is refused). A table is
thus rebuilt, and a long reproduction resumed, on a machine that has never run it: runs on
other machines are reused as they are. Delete a script's records folder to make its runs anew.
A rerun is bit-for-bit equal on the same kind of CPU; on another kind it may not be
(docs/scoreboard.md)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fedapp.config import RECIPE_KEYS, toml_value, training_settings

ROOT = Path(__file__).resolve().parent.parent
# `fedapp` through this interpreter: the same as the console script, without needing it
# re-generated after the package moves.
FEDAPP = [sys.executable, "-m", "fedapp.cli.main"]
RECORDS = ROOT / "reproduce" / "records"
# What a run executes: a record says whether these had uncommitted changes when it was made.
RUN_CODE = ("fedapp", "strategies", "client_models", "conf", "pyproject.toml")


def slug(text: str) -> str:
    """A run's name from a table's label: lower case, each run of other characters one '-'
    (``"Dirichlet 0.5 FedMD"`` -> ``"dirichlet-0-5-fedmd"``)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def record_path(out_dir: Path, run_name: str) -> Path:
    """Where the record of ``out_dir/run_name`` is kept: by the results folder's name, so a
    script's records are found whatever its ``--out`` resolves to."""
    return RECORDS / Path(out_dir).name / f"{run_name}.json"


QUICK = "quick"


def quick_folder(out_dir: Path) -> Path:
    """Where a script's ``--quick`` pipeline check writes its runs (shrunk settings, one seed):
    beside its real runs, and never recorded."""
    return Path(out_dir) / QUICK


def finished(out_dir: Path, run_name: str) -> Path | None:
    """The summary of a finished run: the run's own ``summary.json``, else its record; None if
    the run has neither."""
    for path in (Path(out_dir) / run_name / "summary.json", record_path(out_dir, run_name)):
        if path.exists():
            return path
    return None


def provenance(made_here: bool) -> dict[str, Any]:
    """Where a run was made: the commit (``dirty`` if what a run executes had uncommitted
    changes), the CPU and the SIMD path torch takes on it, torch's version. For a run found
    under ``results/`` without a record, only that (its commit is not known)."""
    if not made_here:
        return {"recorded_from": "an earlier run's summary.json; commit and machine unknown"}
    import torch

    def git(*args: str) -> str:
        try:
            proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        except OSError:  # no git on this machine
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""
    cpu = next((line.split(":", 1)[1].strip() for line in
                (Path("/proc/cpuinfo").read_text().splitlines()
                 if Path("/proc/cpuinfo").exists() else [])
                if line.startswith("model name")), platform.processor())
    # A copy of the tree without its .git (as sent to a GPU machine) names its commit in
    # FEDAPP_SOURCE_COMMIT; whether it had uncommitted changes is then not known (None).
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", *RUN_CODE)) if commit else None
    gpu = {"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {}
    return {"commit": commit or os.environ.get("FEDAPP_SOURCE_COMMIT", "unknown"),
            "dirty": dirty,
            "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), **gpu,
            "torch": torch.__version__, "recorded_at": time.strftime("%Y-%m-%d")}


def record(out_dir: Path, run_name: str, origin: Mapping[str, Any],
           read: bool = True) -> dict[str, Any]:
    """The run's record: its summary with ``provenance`` (``origin`` if the run has no record
    yet, which it is then kept as) and ``settings``, every effective setting of the run (its
    ``config.json``; absent from records kept before they were stored); ``read``: counted
    among the runs a table comes from."""
    path = record_path(out_dir, run_name)
    if Path(out_dir).name == QUICK:  # a pipeline check's runs are no evidence
        return {**json.loads(finished(out_dir, run_name).read_text()), "provenance": dict(origin)}
    if not path.exists():
        from fedapp.cli.compare import run_settings
        summary = json.loads(finished(out_dir, run_name).read_text())
        settings = run_settings(Path(out_dir) / run_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**summary, "provenance": dict(origin),
                                    **({"settings": settings} if settings else {})},
                                   indent=1) + "\n")
    kept = json.loads(path.read_text())
    if read:
        READ[path] = kept
    return kept


# Every run this process has read (its record, by its path: a run two tables share, such as
# CompFL's in its comparison and its ablation, is one run): where a script's tables come from.
READ: dict[Path, dict[str, Any]] = {}


# Every script's default seeds; a "Produced by" line names the seeds only when they differ.
DEFAULT_SEEDS = [0, 1, 2]


def seeds_option(seeds: Sequence[int], flag: str = "--seeds") -> str:
    """``" --seeds 0 1"`` for a command line, or ``""`` for the default seeds 0, 1, 2."""
    return "" if list(seeds) == DEFAULT_SEEDS else f" {flag} " + " ".join(map(str, seeds))


def provenance_line(summaries: Iterable[Mapping[str, Any]]) -> str:
    """Where a table's runs were made, in a sentence: their commits and machines (records)."""
    origins = [s.get("provenance", {}) for s in summaries]
    commits: dict[str, int] = {}
    machines: dict[str, int] = {}
    for o in origins:
        dirty = o.get("dirty", False)
        commit = o.get("commit", "unknown")[:7] + (
            " with uncommitted changes" if dirty else
            " (uncommitted changes not known)" if dirty is None and "commit" in o else "")
        commits[commit] = commits.get(commit, 0) + 1
        if "cpu" in o:
            machine = (f"{o['cpu']} ({o['cpu_capability']})"
                       + (f" with {o['gpu']}" if "gpu" in o else "") + f", torch {o['torch']}")
            machines[machine] = machines.get(machine, 0) + 1

    def listed(counts: dict[str, int]) -> str:
        # Most runs first, ties by name: the line must not depend on the order runs were read
        # in (a resumed script reads its new runs from results/ before the recorded ones).
        return ", ".join(f"{k} ({n})" for k, n in sorted(counts.items(),
                                                        key=lambda x: (-x[1], x[0])))
    runs = f"{len(origins)} runs were" if len(origins) != 1 else "run was"
    return (f"This script's {runs} made at commits {listed(commits)}"
            + (f", on {listed(machines)}" if machines else "")
            + " (reproduce/records/).")


# Settings a record is not checked against besides fedapp compare's NOT_COMPARED (those that
# name a run or say where it ran): paths on the machine that made it.
UNCHECKED = frozenset({"data-dir", "public-file"})


def stale_settings(kept: Mapping[str, Any], preset: str | None,
                   overrides: Mapping[str, Any]) -> list[str]:
    """``key = recorded (now value)`` for every setting a recorded run was made with that the
    run's preset and overrides no longer resolve to (a default changed since, say): a run is
    found by its name alone, so a record whose settings moved would be read as the new ones'.
    Empty for a record kept without its settings."""
    made = kept.get("settings")
    if not made:
        return []
    from fedapp.cli.compare import NOT_COMPARED
    from fedapp.cli.run import resolve_settings
    from strategies import settings_report
    now = settings_report(resolve_settings(preset, [f"{k}={toml_value(v)}" for k, v in
                                                    overrides.items()])[0])["settings"]
    return [f"{k} = {toml_value(made[k])} ({toml_value(v)} now)" for k, v in now.items()
            if k in made and k not in NOT_COMPARED and k not in UNCHECKED and made[k] != v]


def run_experiment(preset: str | None, overrides: Mapping[str, Any], run_name: str,
                   out_dir: Path) -> dict[str, Any]:
    """``fedapp run [preset] --set ...`` into ``out_dir/run_name``; its summary. A run whose
    summary already exists is not repeated, so an interrupted reproduction resumes. In a
    pipeline check (``quick_folder``) a client that failed fails the check: a run survives
    failed rounds up to ``max-empty-rounds``, and a setting that crashes clients must not
    wait for the real runs to show it."""
    done = finished(out_dir, run_name)
    if done is not None:
        print(f"[reproduce] {run_name}: done before, reusing {done}", flush=True)
        kept = record(out_dir, run_name, provenance(made_here=False))
        stale = stale_settings(kept, preset, overrides)
        if stale:
            raise RuntimeError(
                f"{run_name} was made with {', '.join(stale)}: its record "
                f"({record_path(out_dir, run_name)}) no longer holds the run this name now "
                "asks for. Rename it (and its results folder) to the row it is, or delete both "
                "to make the run anew")
        return checked(out_dir, run_name, kept)
    cmd = [*FEDAPP, "run", *([preset] if preset else []), "--output-dir", str(out_dir),
           "--set", f"run-name={toml_value(run_name)}"]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={toml_value(value)}"]
    print(f"[reproduce] {run_name}: {' '.join(cmd[3:])}", flush=True)
    start, origin = time.time(), provenance(made_here=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
        raise RuntimeError(f"{run_name} failed with exit status {proc.returncode}")
    print(f"[reproduce] {run_name}: {proc.stdout.strip().splitlines()[-2]} "
          f"({time.time() - start:.0f} s)", flush=True)
    return checked(out_dir, run_name, record(out_dir, run_name, origin))


def checked(out_dir: Path, run_name: str, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary``, unless ``out_dir`` is a pipeline check's and a client failed in the run."""
    if Path(out_dir).name == QUICK and summary.get("failures"):
        raise RuntimeError(
            f"{run_name}: {summary['failures']} client update(s) failed in this pipeline check "
            f"(clients {summary.get('failed_clients')}): the run's settings crash clients; "
            f"see {Path(out_dir) / run_name / 'flwr.log'}")
    return summary


def run_seeds(preset: str | None, overrides: Mapping[str, Any], run_name: str,
              seeds: Sequence[int], out_dir: Path) -> list[dict[str, Any]]:
    """``run_experiment`` at each seed (``<run_name>-seed<s>``), the missing ones as one
    ``fedapp run --sweep seed=...`` on one SuperLink (its start and stop paid once)."""
    missing = [s for s in seeds if finished(out_dir, f"{run_name}-seed{s}") is None]
    if len(missing) > 1:
        cmd = [*FEDAPP, "run", *([preset] if preset else []), "--output-dir", str(out_dir),
               "--set", f"run-name={toml_value(run_name)}",
               *(x for k, v in overrides.items() for x in ("--set", f"{k}={toml_value(v)}")),
               "--sweep", "seed=" + ",".join(map(str, missing))]
        print(f"[reproduce] {run_name} seeds {missing}: {' '.join(cmd[3:])}", flush=True)
        start, origin = time.time(), provenance(made_here=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], file=sys.stderr)
            raise RuntimeError(f"{run_name} failed with exit status {proc.returncode}")
        print(f"[reproduce] {run_name}: {len(missing)} runs ({time.time() - start:.0f} s)",
              flush=True)
        for s in missing:  # kept now; counted once, when run_experiment reads it below
            record(out_dir, f"{run_name}-seed{s}", origin, read=False)
    return [run_experiment(preset, {**overrides, "seed": s}, f"{run_name}-seed{s}", out_dir)
            for s in seeds]


def run_parallel(experiments: Sequence[tuple[str | None, Mapping[str, Any], str]],
                 out_dir: Path, jobs: int) -> None:
    """Run the (preset, overrides, run name) experiments that have no summary yet (each name
    once), ``jobs`` at a time — each ``fedapp run`` has its own SuperLink and Ray instance —
    for a machine with cores (or a GPU) to spare; the script then reads them through
    ``run_experiment``, which reuses them. Every failure is reported, the others still run;
    then it raises."""
    from concurrent.futures import ThreadPoolExecutor
    todo = list({e[2]: e for e in experiments if finished(out_dir, e[2]) is None}.values())
    if jobs <= 1 or not todo:
        return
    print(f"[reproduce] {len(todo)} runs, {jobs} at a time", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        futures = {e[2]: pool.submit(run_experiment, *e, out_dir) for e in todo}
    failed = [name for name, f in futures.items() if f.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(todo)} runs failed: {', '.join(failed)}")


def check_settings(name: str, settings: Mapping[str, Any], data: bool = False) -> list[str]:
    """The refusal of the run ``name``'s ``settings`` as ``fedapp run`` checks them before it
    starts (``data``: its data and partition too), as ``["<name>: <why>"]``; [] if none."""
    from fedapp.cli.run import check_run_data
    from fedapp.config import ConfigError
    try:
        cfg = run_config(settings)
        if data:
            check_run_data(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        return [f"{name}: {exc}"]
    return []


def cpu_wall_seconds(folder: Path) -> list[float]:
    """The wall seconds of the recorded runs of a records folder made on a CPU alone."""
    runs = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("*.json"))]
    return [r["wall_seconds"] for r in runs
            if "cpu" in r.get("provenance", {}) and "gpu" not in r["provenance"]]


def estimate(out_dir: Path, count: int, jobs: int = 1) -> str:
    """``count`` runs' time at the median wall time of the script's runs recorded on a CPU
    (reproduce/records_time.py), ``jobs`` at a time, in words; each ``fedapp run``'s start
    (about half a minute on 2 cores, once per row's seeds) not counted."""
    walls = cpu_wall_seconds(RECORDS / Path(out_dir).name)
    if not walls:
        return "no recorded run to estimate their time from"
    median = float(np.median(walls))
    return (f"about {count * median / jobs / 3600:.1f} h at the median {median:.0f} s of the "
            f"{len(walls)} runs recorded on a CPU" + (f", {jobs} at a time" if jobs > 1 else "")
            + " (a method slower than the recorded ones takes longer)")


def add_resource_options(parser: argparse.ArgumentParser) -> None:
    """``--jobs`` and ``--client-num-gpus``: how a script's runs use the machine. Neither
    changes what a run computes, so runs made either way are reused alike."""
    def at_least(low: float, kind: type) -> Any:
        def parse(text: str) -> Any:
            value = kind(text)
            if not value >= low:
                raise argparse.ArgumentTypeError(f"must be at least {low}; got {text}")
            return value
        return parse
    parser.add_argument("--jobs", type=at_least(1, int), default=1,
                        help="runs at once, each its own SuperLink and Ray instance (default 1)")
    parser.add_argument("--client-num-gpus", type=at_least(0.0, float), default=0.0,
                        help="each virtual client's share of a GPU (default 0: on the CPU)")


def add_page_options(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options of a script that writes a page's tables from its runs: ``--seeds``,
    ``--quick`` (a pipeline check whose pages go to ``--out`` only), ``--table-only``, ``--out``
    (default ``out``) and the resource options."""
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 2 rounds, small shards; tables go to --out only")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write the tables from the runs that exist, leaving "
                        "out (and naming) a row that misses a seed")
    parser.add_argument("--out", type=Path, default=out)
    add_resource_options(parser)


def resource_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"client-num-gpus": args.client_num_gpus} if args.client_num_gpus > 0 else {}


# The methods the tables of docs/defaults.md and docs/scoreboard.md hold, in their order (rows,
# and which method names a recipe shared by several: the scoreboard's ``fedper-recipe``). A
# method joins these pages with its runs: naming it here makes the scripts run what is missing,
# with the settings it needs (the public-set methods need a ``public-source``).
PAGE_ORDER = ("standalone", "fedavg", "lg-fedavg", "fedclassavg", "fedgh", "fedproto", "fedhe",
              "fedper", "fedrep", "compfl", "felo", "velo", "fedgen", "fedl2g", "fml", "fedmrl",
              "fedkd", "fd", "fedre", "fedtgp", "fedgkt", "fedmd", "dsfl", "feddf", "ktpfl",
              "heterofl", "fedrolex", "fjord", "depthfl")


def page_methods() -> dict[str, Any]:
    """The registered methods (``strategies.METHODS``) the pages' tables hold, in their order."""
    from strategies import METHODS
    return {name: METHODS[name] for name in PAGE_ORDER}


# -- Methods that need more than the table's data and models -------------------------------------
# A public-data method (its card's ``needs_public``) runs with a public set cut out of the
# training split (``PUBLIC``: public-fraction's default 0.1, 6,000 Fashion-MNIST images), which
# changes every client's shard: the Standalone it is read against runs with the same cut, so
# that the pair still shares its partition. A sub-model method (payload kind ``sub-model``:
# HeteroFL, FedRolex, FjORD, DepthFL) trains slices of one global network, not the zoo's
# models: its Standalone trains, on each client, the very model that client trains
# (``submodel_standalone``).
PUBLIC = {"public-source": "train-holdout"}


def needs_public(method: str) -> bool:
    from strategies import METHODS
    return METHODS[method].needs_public


def is_submodel(method: str) -> bool:
    from strategies import METHODS
    return "sub-model" in METHODS[method].payload_kinds


def run_config(settings: Mapping[str, Any]) -> Any:
    """The checked RunConfig of a run with ``settings`` (``fedapp run``'s resolution)."""
    from fedapp.cli.run import resolve_settings
    from strategies import load_config
    return load_config(resolve_settings(
        None, [f"{k}={toml_value(v)}" for k, v in settings.items()])[0])


MODELS_MODULE = "reproduce.submodel_models"


def client_models_of(settings: Mapping[str, Any]) -> list[str]:
    """The model each client of the sub-model run ``settings`` trains, by partition id, as a
    name of reproduce/submodel_models.py: its width slice (HeteroFL, FedRolex, FjORD) or its
    depth prefix (DepthFL, at its model-width). Raises ValueError where no fixed model per
    client exists (rates drawn anew each round), or the models are not what that module builds
    (a width slice's model-width other than 1)."""
    import submodel_models as sm
    cfg = run_config(settings)
    s = cfg.settings
    if cfg.method == "depthfl":
        width = Fraction(str(cfg.model_width))
        return [sm.depth_name(s.model, d, width) for d in s.client_depths(cfg)]
    if cfg.model_width != 1:
        raise ValueError(f"model-width = {cfg.model_width}: a model given by import path is "
                         "built at width 1")
    plan = s.plan(cfg)
    if plan.dynamic:
        raise ValueError(f"{cfg.method}.rate-mode = 'dynamic': a client's width changes "
                         "every round, so no one model per client exists")
    names = []
    for rate in plan.per_client:
        options = s.model_options(rate)
        if set(options) - {"norm", "scaler", "od_widths"} or (
                options["norm"] == "per-width" and rate not in options.get("od_widths", ())):
            raise ValueError(f"{cfg.method} builds its models with {options}, which "
                             f"{MODELS_MODULE} does not")
        names.append(sm.width_name(s.global_arch, rate, options["norm"], options["scaler"]))
    return names


def submodel_standalone(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that make Standalone train, on each client, the model the sub-model run
    ``settings`` gives it (``client_models_of``), by import path: ``arch-mix`` and
    ``arch-assignment`` (the fewest names that give every client its model, in blocks or
    round-robin), and ``feature-dim = 0`` (the model's own head, no projection; the sub-model
    methods read no feature-dim)."""
    from client_models.registry import assign
    per_client = client_models_of(settings)
    tries = [(list(dict.fromkeys(per_client)), "blocks")] + [
        (per_client[:p], "round-robin") for p in range(1, len(per_client) + 1)]
    mix, mode = next((m, mode) for m, mode in tries
                     if assign(m, len(per_client), mode) == per_client)
    return {"arch-mix": ",".join(f"{MODELS_MODULE}:{m}" for m in mix),
            "arch-assignment": mode, "feature-dim": 0}


@functools.cache
def zoo_levels(settings: Settings) -> dict[str, str]:
    """The sub-model run ``settings``'s per-client levels mapped from its ``arch-mix`` at equal
    budget (docs/submodels.md): each architecture group gets the level whose share of the
    global model's parameters is nearest the group's zoo model's share of the largest zoo
    model's (r ≈ sqrt(params_k / params_max) for a width rate). HeteroFL's and FedRolex's levels
    a-e, FjORD's widths, DepthFL's depths 1..D, as the group form of ``<method>.rates``
    (``depthfl.depths``)."""
    from client_models import build_model, parse_arch_mix
    from client_models.depth_prefix import build_depth_model, max_depth
    from client_models.width import build_width_model, parameter_count
    from fedapp.data.local_data import expected_input
    from fedapp.runtime.submodel_settings import LEVELS
    cfg = run_config(dict(settings))
    shape, classes = expected_input(cfg)
    zoo = {a: parameter_count(build_model(a, shape, classes))
           for a in dict.fromkeys(parse_arch_mix(cfg.arch_mix))}
    s = cfg.settings
    if cfg.method == "depthfl":
        levels = {str(d): parameter_count(build_depth_model(s.model, d, shape, classes))
                  for d in range(1, max_depth(s.model) + 1)}
        key, pair = "depthfl.depths", ":"
    else:
        rates = ({name: rate for name, rate in LEVELS.items()} if cfg.method != "fjord" else
                 {f"{float(p):g}": p for p in s.width_set()})
        levels = {name: parameter_count(build_width_model(s.global_arch, shape, classes, rate,
                                                          **s.model_options(rate)))
                  for name, rate in rates.items()}
        key, pair = f"{cfg.method}.rates", "="
    top, biggest = max(levels.values()), max(zoo.values())
    nearest = {a: min(levels, key=lambda name: abs(levels[name] / top - n / biggest))
               for a, n in zoo.items()}
    return {key: ",".join(f"{a}{pair}{level}" for a, level in nearest.items())}


# A recipe's Standalone: local training with a method's recipe, which tells what the recipe does
# to a method's difference to the default Standalone from what the method does. The tables
# name a recipe by its first method in PAGE_ORDER (``fedper-recipe`` serves FedPer and FedRep);
# HtFLlib's (FD's: plain SGD, a new optimizer every round, shared by most of its methods) is
# ``htfllib-recipe``. ``base``: the settings every run of the table shares (a table that pins
# some training settings, as the scoreboard does, has fewer recipes); ``keys``: the training
# settings that tell recipes apart (default: every recipe key).
Settings = tuple[tuple[str, Any], ...]


@functools.cache
def training(method: str, base: Settings = (),
             keys: tuple[str, ...] = RECIPE_KEYS) -> Settings:
    """How ``method``'s clients train under ``base`` (its recipe under what ``base`` pins, as
    ``fedapp settings`` resolves it): the ``keys`` values that act (momentum for SGD, betas for
    Adam, the decay factor when the lr decays: fedapp.config.training_settings)."""
    from fedapp.cli.run import resolve_settings
    from strategies import settings_report
    texts = [f"{k}={toml_value(v)}" for k, v in {**dict(base), "method": method}.items()]
    values = settings_report(resolve_settings(None, texts)[0])["settings"]
    return tuple(training_settings(values, keys).items())


@functools.cache
def recipes(base: Settings = (), keys: tuple[str, ...] = RECIPE_KEYS) -> dict[str, Settings]:
    """Each recipe of the pages' methods under ``base`` other than Standalone's own, by its
    name (``<first method>-recipe``, or ``htfllib-recipe``). A one-architecture method (FedAvg)
    names none: it trains with LG-FedAvg's."""
    METHODS = page_methods()
    own, out = training("standalone", base, keys), {}
    for name, method in METHODS.items():
        values = training(name, base, keys)
        if method.homogeneous_only or values == own or values in out.values():
            continue
        out["htfllib-recipe" if values == training("fd", base, keys)
            else f"{name}-recipe"] = values
    return out


def recipe_named(values: Settings, base: Settings = (),
                 keys: tuple[str, ...] = RECIPE_KEYS) -> str | None:
    """The name of the recipe whose training is ``values``; None if none is (Standalone's own
    recipe included)."""
    return next((name for name, v in recipes(base, keys).items() if v == values), None)


def recipe_of(method: str, base: Settings = (),
              keys: tuple[str, ...] = RECIPE_KEYS) -> str | None:
    """The recipe of the Standalone that trains as ``method`` does; None if Standalone's own
    recipe is ``method``'s."""
    return recipe_named(training(method, base, keys), base, keys)


def recipe_label(name: str, base: Settings = (), keys: tuple[str, ...] = RECIPE_KEYS) -> str:
    """``"the recipe of fedper, fedrep"`` (``"HtFLlib's recipe: fd, ..."``): the recipe and the
    methods (of several architectures) that train with it."""
    METHODS = page_methods()
    users = [m for m in METHODS
             if recipe_of(m, base, keys) == name and not METHODS[m].homogeneous_only]
    return ("HtFLlib's recipe: " if name == "htfllib-recipe" else "the recipe of ") + ", ".join(
        users)


def training_caption(preset: str, overrides: Mapping[str, Any] = ()) -> str:
    """How every client of ``preset`` (with ``overrides``) trains, in words for a table's
    caption: optimizer, learning rate, lifetime, local steps and batch, as ``fedapp settings``
    resolves them (the method's recipe under what the preset pins)."""
    from fedapp.cli.run import resolve_settings
    from strategies import settings_report
    texts = [f"{k}={toml_value(v)}" for k, v in dict(overrides).items()]
    v = settings_report(resolve_settings(preset, texts)[0])["settings"]
    optimizer = (f"SGD (momentum {v['momentum']:g})" if v["optimizer"] == "sgd" else
                 f"Adam (betas {v['adam-beta1']:g}, {v['adam-beta2']:g})")
    steps = (f"{v['local-steps']} random mini-batches" if v["local-steps"] else
             f"{v['local-epochs']} epoch(s)") + f" of {v['batch-size']}"
    decay = f", x{v['lr-decay']:g} after {v['lr-decay-at']} of the rounds" \
        if v["lr-decay-at"] else ""
    life = {"fresh": "a new optimizer every round",
            "keep": "one optimizer per client for the whole run"}[v["optimizer-state"]]
    return (f"{optimizer}, lr {v['lr']:g}{decay}, weight decay {v['weight-decay']:g}, "
            f"{'clipping at ' + format(v['grad-clip'], 'g') if v['grad-clip'] else 'no clipping'}"
            f", {life}, {steps} per update")


DIGITS_DIR = ROOT / "results" / "data" / "digits"


def digits_data(out: Path = DIGITS_DIR) -> Path:
    """scikit-learn's bundled handwritten digits (1,797 images of 8x8) as a ``dataset = "npz"``
    folder: upsampled bilinearly to 28x28 uint8, split 75/25 stratified by class (seed 0). A
    small real data set outside Fashion-MNIST, on which no default was tuned. Needs
    scikit-learn (``pip install -e ".[reproduce]"``)."""
    if (out / "train.npz").exists() and (out / "test.npz").exists():
        return out
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise SystemExit("the digits data set needs scikit-learn: "
                         ".venv/bin/pip install -e '.[reproduce]'") from None
    import torch
    import torch.nn.functional as F
    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0
    up = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    x = (up.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target.astype(np.int64),
                                              test_size=0.25, stratify=digits.target,
                                              random_state=0)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "train.npz", x=x_tr, y=y_tr)
    np.savez(out / "test.npz", x=x_te, y=y_te)
    return out


# Small settings a user might start from, one on a data set nothing was tuned on, one with
# sparse participation (the cross-device regime: many small, skewed clients, a tenth of them
# per round, each training about ten times in the run): the columns of docs/defaults.md (every
# method with its own recipe); FedClassAvg's defaults were chosen on the first two
# (FEDCLASSAVG_SETTINGS). Only data and federation are set here; training is the method's
# recipe.
DEFAULTS_SETTINGS = {
    "Fashion-MNIST": lambda: {"dataset": "fmnist", "num-clients": 10, "partition": "dirichlet",
                              "dirichlet-alpha": 0.5, "max-samples-per-client": 300,
                              "num-server-rounds": 20, "eval-every": 10},
    "digits": lambda: {"dataset": "npz", "data-dir": str(digits_data()), "num-clients": 10,
                       "partition": "dirichlet", "dirichlet-alpha": 0.5,
                       "test-fraction": 0.5, "num-server-rounds": 40, "eval-every": 10},
    "Fashion-MNIST sparse": lambda: {"dataset": "fmnist", "num-clients": 100,
                                     "partition": "dirichlet", "dirichlet-alpha": 0.3,
                                     "max-samples-per-client": 300, "fraction-fit": 0.1,
                                     "num-server-rounds": 100, "eval-every": 20},
}
FEDCLASSAVG_SETTINGS = ("Fashion-MNIST", "digits")


def per_architecture(summaries: Sequence[Mapping[str, Any]]) -> str:
    """``"cnn1 0.8123, cnn2 0.7900"``: each architecture's accuracy, mean over the runs."""
    per_arch: dict[str, list[float]] = {}
    for s in summaries:
        for arch, acc in s["accuracy"]["per_architecture"].items():
            per_arch.setdefault(arch, []).append(acc)
    return ", ".join(f"{a} {np.mean(v):.4f}" for a, v in sorted(per_arch.items()))


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    arr = np.asarray(list(values), dtype=float)
    return float(arr.mean()), float(arr.std())


def cell(values: Iterable[float], digits: int = 4) -> str:
    """``0.8123 ± 0.0101`` (mean ± std over seeds)."""
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def per_client_accuracies(summary: Mapping[str, Any]) -> list[float]:
    """The last round's per-client local test accuracies."""
    return [float(v) for v in summary["accuracy"]["per_client"].values()]


def mean_client_accuracy(summary: Mapping[str, Any]) -> float:
    """The mean of the last round's per-client local test accuracies (a table cell's unit)."""
    return float(np.mean(per_client_accuracies(summary)))


def signed(value: float, digits: int = 3) -> str:
    """``value`` with its sign, rounded to ``digits`` places; a difference that rounds to zero
    reads +0.000, never -0.000."""
    return f"{round(value, digits) + 0.0:+.{digits}f}"


def paired(mine: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]],
           metric=mean_client_accuracy) -> tuple[float, float]:
    """Mean ± std over the seeds of the seed-by-seed difference of ``metric`` (default the mean
    client accuracy): two runs of one seed share the partition and the models' initial
    weights, so this spread is the one that tells whether a method changed anything."""
    if len(mine) != len(base):
        raise ValueError(f"paired runs: {len(mine)} seeds against {len(base)}")
    return mean_std(metric(x) - metric(y) for x, y in zip(mine, base))


# The one rule every script's verdicts follow, said once here and printed, word for word, above
# every list of verdicts it gives.
VERDICT_RULE = ("A claim a ≥ b **holds** when the mean over seeds of the seed-by-seed difference "
                "a − b is above the std over seeds of that difference, **fails** when it is "
                "below minus that std, and is **level** otherwise: a tie is level, not a win.")


def verdict(differences: Sequence[float]) -> str:
    """'holds', 'level' or 'fails' for a claim a ≥ b, from the seed-by-seed differences a − b
    (VERDICT_RULE): the mean against the std over seeds (numpy's, as ``paired`` prints it).
    Paired, because two runs of one seed share the partition and the initial weights: the
    differences vary less over seeds than either side does. With one seed there is no spread,
    so only an exact tie is level."""
    mean, spread = mean_std(differences)
    return "holds" if mean > spread else "fails" if mean < -spread else "level"


def claim_line(a: str, b: str, mine: Sequence[Mapping[str, Any]],
               base: Sequence[Mapping[str, Any]], metric=mean_client_accuracy,
               base_metric=None) -> str:
    """``a ≥ b: level (0.9596 vs 0.9596; paired by seed +0.0000 ± 0.0050: +0.0040, ...)``:
    the verdict of VERDICT_RULE on ``metric`` of runs ``mine`` against ``base`` (read with
    ``base_metric`` where a paper scores the other method another way), seed by seed, with
    both means and every difference it came from."""
    if len(mine) != len(base):
        raise ValueError(f"paired runs: {len(mine)} seeds against {len(base)}")
    base_metric = base_metric or metric
    diffs = [metric(x) - base_metric(y) for x, y in zip(mine, base)]
    mean, spread = mean_std(diffs)
    mean = round(mean, 12) + 0.0  # differences that cancel print as +0.0000, not -0.0000
    return (f"{a} ≥ {b}: {verdict(diffs)} ({np.mean([metric(x) for x in mine]):.4f} vs "
            f"{np.mean([base_metric(y) for y in base]):.4f}; paired by seed {mean:+.4f} ± "
            f"{spread:.4f}" + (": " + ", ".join(f"{d:+.4f}" for d in diffs)
                               if len(diffs) > 1 else "") + ")")


def global_accuracies(summary: Mapping[str, Any]) -> list[float]:
    """The last round's per-client global-test accuracies (``eval-global-test``)."""
    return [float(v) for v in summary["accuracy"]["global_per_client"].values()]


def global_accuracy(summary: Mapping[str, Any]) -> float:
    """The mean over clients of the global-test accuracy (the metric of the Felo and FedHe
    papers: every client's model on the same shared test set)."""
    return float(np.mean(global_accuracies(summary)))


def other_predictions(label: str, summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The other predictions a method reports beside its headline, one line each, mean ± std
    over the seeds: its clients' other models (``accuracy.variants``, mean over clients, e.g.
    FedGKT's stem + server model) and the server's own models (``accuracy.server``, e.g.
    HeteroFL's global model, the paper's metric)."""
    first = summaries[0]["accuracy"]
    lines = [f"- {label}: {name} " + "{:.3f} ± {:.3f}".format(
        *mean_std(x["accuracy"]["variants"][name]["mean"] for x in summaries))
        for name in first.get("variants", {})]
    lines += [f"- {label}: the server's {name} model on the global test set " + "{:.3f} ± {:.3f}"
              .format(*mean_std(x["accuracy"]["server"][name] for x in summaries))
              for name in first.get("server", {})]
    return lines


def comparison_table(title: str, results: Mapping[str, Sequence[Mapping[str, Any]]],
                     seeds: Sequence[int], pairs: Iterable[tuple[str, str]],
                     metric=global_accuracy, extra_claims: Sequence[str] = ()) -> str:
    """A paper's comparison on the global test set: per row, the global-test accuracy (mean
    over clients, ± std over seeds), its std over clients, the local-test accuracy, the floats
    a client sends and receives in the last round and the wall seconds; below, the verdict of
    each claim a ≥ b in ``pairs`` (VERDICT_RULE, on ``metric``, paired by seed), then
    ``extra_claims`` (claim lines made otherwise)."""
    def row(label: str, summaries: Sequence[Mapping[str, Any]]) -> str:
        com = summaries[0]["communication"]
        client_std = np.mean([np.std(global_accuracies(s)) for s in summaries])
        return (f"| {label} | {cell(global_accuracy(s) for s in summaries)} | "
                f"{client_std:.4f} | {cell(mean_client_accuracy(s) for s in summaries)} | "
                f"{com['last_round_floats_per_client_up']:.0f} / "
                f"{com['last_round_floats_per_client_down']:.0f} | "
                f"{mean_std(s['wall_seconds'] for s in summaries)[0]:.0f} |")

    rounds = next(iter(results.values()))[0]["rounds"]
    lines = [
        f"### {title} ({len(seeds)} seeds: {', '.join(map(str, seeds))}; accuracy after "
        f"round {rounds})",
        "",
        "| method | global-test accuracy (mean over clients; ± std over seeds) | std over "
        "clients | local-test accuracy | floats per client per round up / down | wall s |",
        "|---|---|---|---|---|---|",
        *(row(label, runs) for label, runs in results.items()),
        "",
        *(f"- {claim_line(a, b, results[a], results[b], metric)}"
          for a, b in pairs if a in results and b in results),
        *(f"- {claim}" for claim in extra_claims),
    ]
    others = [line for label, runs in results.items() for line in other_predictions(label, runs)]
    if others:
        lines += ["", "The same runs' other predictions, where a method reports one beside its "
                  "clients' own models:", "", *others]
    return "\n".join(lines)


def paired_line(results: Mapping[str, Sequence[Mapping[str, Any]]],
                pairs: Iterable[tuple[str, str]], names: Mapping[str, str] | None = None) -> str:
    """The differences of ``pairs`` of rows (a − b), each run against the run of the same seed,
    in one sentence; each row by its ``names`` entry, else its label. Empty with one seed (no
    spread to judge a difference by)."""
    if len(next(iter(results.values()))) < 2:
        return ""
    names = names or {}
    return ("Paired by seed (mean ± std over seeds of the difference in local accuracy): "
            + "; ".join("{} − {} {:+.4f} ± {:.4f}".format(names.get(a, a), names.get(b, b),
                                                         *paired(results[a], results[b]))
                        for a, b in pairs if a in results and b in results) + ".")


def plot_curves(groups: Mapping[str, Sequence[Mapping[str, Any]]], path: Path,
                title: str) -> None:
    """Mean accuracy per round (averaged over the seeds of each group) ± seed std."""
    plot_panels({title: groups}, path)


def plot_panels(panels: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
                path: Path) -> None:
    """One panel per title, one curve per group: mean accuracy per round over the seeds of
    the group, shaded ± the std over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, (title, groups) in zip(axes[0], panels.items()):
        for label, summaries in groups.items():
            # Rounds without evaluation (eval-every > 1) have no accuracy: plot the others.
            # (Summaries written before eval-every existed evaluated every round.)
            first = summaries[0]
            rounds = first.get("evaluated_rounds", [h["round"] for h in first["history"]])
            curves = np.array([[h["accuracy_mean"] for h in s["history"] if h["round"] in rounds]
                               for s in summaries], dtype=float)
            mean, std = curves.mean(0), curves.std(0)
            line, = ax.plot(rounds, mean, marker="o", ms=2.5, label=label)
            ax.fill_between(rounds, mean - std, mean + std, alpha=0.15, color=line.get_color())
        ax.set(xlabel="round", ylabel="mean per-client local test accuracy", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


GENERATED_BEGIN = "<!-- generated by {script}: begin -->"
GENERATED_END = "<!-- generated by {script}: end -->"


def read_generated(doc: Path, script: str) -> str:
    """The part of ``doc`` between the script's markers ('' if there is none)."""
    begin, end = GENERATED_BEGIN.format(script=script), GENERATED_END.format(script=script)
    old = doc.read_text() if doc.exists() else ""
    if begin not in old or end not in old:
        return ""
    return old[old.index(begin) + len(begin):old.index(end)]


def write_generated(doc: Path, script: str, text: str) -> None:
    """Replace the part of ``doc`` between the script's markers with ``text`` and a line on
    where the script's runs were made (the prose around it is kept); create the doc with just
    that part if it does not exist."""
    begin, end = GENERATED_BEGIN.format(script=script), GENERATED_END.format(script=script)
    if READ:
        text = f"{text.rstrip()}\n\n{provenance_line(READ.values())}"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = doc.read_text() if doc.exists() else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = (old.rstrip() + "\n\n" if old else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(new)
