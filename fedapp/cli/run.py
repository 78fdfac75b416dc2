"""``fedapp``: run experiments through Flower and compare their results.

The ``run``, ``settings``, ``methods`` and ``models`` commands and their helpers (``compare`` is
``fedapp.cli.compare``; the Flower processes themselves are started and stopped by
``fedapp.cli.flower``).

``fedapp run <preset> [--set key=value ...]`` validates the settings before anything starts,
runs the app with ``flwr run --stream`` against a SuperLink it starts on free loopback ports with
a private ``FLWR_HOME`` (runtime dependency installation, update check and telemetry off), prints
one line per round, reads the run's final status (``flwr run`` itself exits 0 even when the run
failed), stops the SuperLink and everything it spawned, and exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from fedapp.cli import cluster
from fedapp.cli.flower import BIN, LocalSuperLink, run_status, stage_app, stream_run
from fedapp.config import (METHOD_SETTINGS_KEY, PROJECT_ROOT, SHARED_KEYS, ConfigError,
                           client_cache_budget, default_run_name, explicit_layers,
                           format_explicit, parse_override, pyproject_defaults, read_preset,
                           resolve_preset, toml_value)

# What needs torch, Flower or numpy (strategies' methods, the data, fedapp.runtime.results) is
# imported inside the commands that use it: `fedapp settings`, `fedapp methods` and a refused
# setting answer in about a second without them (docs/benchmarks.md).


def resolve_settings(preset: str | None, overrides: Sequence[str],
                     variant: Sequence[tuple[str, Any]] = ()) -> tuple[dict, dict]:
    """(all settings, the ones the run sets: the preset's, then ``--set`` and the sweep
    ``variant``). ``explicit-settings`` names them with their layer, so that the method's
    recipe, applied wherever the settings are read, never replaces what the run set."""
    defaults = pyproject_defaults()
    changed: dict[str, Any] = {}
    layers: dict[str, str] = {}
    if preset:
        changed.update(read_preset(resolve_preset(preset)))
        layers.update(dict.fromkeys(changed, "preset"))
    for key, value in [parse_override(text) for text in overrides] + list(variant):
        changed[key], layers[key] = value, "set"
    layers.update(explicit_layers(str(changed.get("explicit-settings", ""))))
    layers.pop("explicit-settings", None)
    changed["explicit-settings"] = format_explicit(layers)
    return {**defaults, **changed}, changed


def resume_settings(run_dir: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """The settings of the run in ``run_dir`` (its ``config.json``), to continue it after its
    last checkpoint: same folder, same everything, ``resume = true``."""
    if args.preset or args.set or args.output_dir:
        raise ConfigError("--resume continues a run with its own settings: give no preset, "
                          "--set or --output-dir with it.")
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume {run_dir}: not a run folder ({exc})") from None
    saved = saved.get("settings", saved)  # older runs wrote the flat settings alone
    defaults = pyproject_defaults()
    flat = {**defaults, **saved, "resume": True,
            "output-dir": str(run_dir.resolve().parent), "run-name": run_dir.resolve().name}
    return flat, {k: v for k, v in flat.items() if defaults.get(k) != v}


def resolve_run(args: argparse.Namespace, *,
                variant: Sequence[tuple[str, Any]] = ()) -> tuple[Any, dict[str, Any], Path]:
    """(validated config, the settings to send as overrides, run folder) of ``fedapp run`` /
    ``fedapp deploy run``; raises ConfigError (or OSError, ...) with a message for the user.

    ``variant``: one run of a sweep, settings set after ``--set`` and named in the run name.
    ``output-dir`` is made absolute and ``run-name`` fixed here, because the ServerApp runs
    from a copy of the app in another directory and must write where this command looks."""
    from strategies import load_config

    if getattr(args, "resume", None):
        flat, changed = resume_settings(Path(args.resume), args)
    else:
        flat, changed = resolve_settings(args.preset, args.set, variant)
    output_dir = Path(args.output_dir or flat["output-dir"] or "results").expanduser()
    flat["output-dir"] = changed["output-dir"] = str(output_dir.resolve())
    if not flat["run-name"]:
        flat["run-name"] = default_run_name(flat["method"], flat["dataset"])
    if variant:  # fedgh-fmnist-...-seed1: every run of a sweep in its own folder
        flat["run-name"] += "".join(f"-{k}{v}" for k, v in variant)
    changed["run-name"] = flat["run-name"]
    cfg = load_config(flat)
    return cfg, changed, cfg.results_root() / cfg.run_name


def check_run_data(cfg: Any) -> None:
    """A missing dataset, an impossible partition or an architecture that cannot take its
    input is reported now, not a minute later from inside the simulation."""
    from fedapp.data import setup
    setup.prepare(cfg)


def write_run_config(changed: dict[str, Any], path: Path) -> Path:
    """The overrides as the TOML file ``flwr run --run-config`` reads. Flower refuses a key
    the app's ``pyproject.toml`` does not have, so the settings of a method given by import
    path travel as one JSON object in ``method-settings`` (``strategies`` unpacks it)."""
    app_keys = pyproject_defaults()
    plain = {k: v for k, v in changed.items() if k in app_keys}
    packed = {k: v for k, v in changed.items() if k not in app_keys}
    if packed:
        packed.update(json.loads(plain.get(METHOD_SETTINGS_KEY) or "{}"))
        plain[METHOD_SETTINGS_KEY] = json.dumps(packed, sort_keys=True)
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in plain.items()))
    return path


def report_run(status: str, run_dir: Path, *, results_elsewhere: bool = False) -> int:
    """Print how the run ended and return fedapp's exit status (0 only if it completed).

    ``results_elsewhere``: the ServerApp ran on another machine (a deployed SuperLink), so a
    completed run's results may not be visible here."""
    from fedapp.runtime.results import format_accuracy, human_bytes
    summary_path = run_dir / "summary.json"
    if status == "finished:completed" and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        acc, com = summary["accuracy"], summary["communication"]
        print(f"fedapp: done. accuracy {format_accuracy(acc['mean'], acc['std'])} (per-client "
              f"local test, {summary['num_clients']} clients); per client per round up "
              f"{human_bytes(com['per_client_per_round_up'])}, down "
              f"{human_bytes(com['per_client_per_round_down'])}; "
              f"{summary['wall_seconds']:.0f} s")
        if "stopped" in summary:  # e.g. at its privacy budget (dp-target-epsilon)
            print(f"fedapp: stopped early: {summary['stopped']['reason']}")
        if "privacy" in summary:
            p = summary["privacy"]
            print(f"fedapp: privacy spent: epsilon {p['epsilon']:.4g} at delta {p['delta']:g} "
                  f"({p['releases']} rounds, noise on the {p['mode']})")
        print(f"fedapp: results in {run_dir} (summary.json, rounds.jsonl, accuracy.png)")
        return 0
    if status == "finished:completed" and results_elsewhere:
        print(f"fedapp: done. Results in {run_dir} on the SuperLink's machine")
        return 0
    failure = _failure(run_dir)
    print(f"fedapp: the run did not complete (status: {status}"
          + (f"; {failure['reason']}" if failure else "")
          + f"). Flower's log: {run_dir / 'flwr.log'}", file=sys.stderr)
    if status == "interrupted":
        return 130
    return EXIT_EMPTY_ROUNDS if failure.get("kind") == "empty-rounds" else 1


# fedapp's exit status: 0 completed, 1 failed, 2 bad settings, 3 stopped after max-empty-rounds
# rounds in a row without a usable update, 130 interrupted.
EXIT_EMPTY_ROUNDS = 3


def _failure(run_dir: Path) -> dict[str, str]:
    """Why the ServerApp stopped the run ({} if it did not say: ``failed.json``)."""
    from fedapp.runtime.results import FAILURE_FILE
    try:
        failure = json.loads((run_dir / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return failure if isinstance(failure, dict) else {}


def sweep_variants(sweeps: Sequence[str]) -> list[list[tuple[str, Any]]]:
    """``--sweep seed=0,1,2 --sweep method=fedgh,standalone``: one list of (key, value) per run,
    every combination (``[[]]``, one plain run, without a sweep)."""
    variants: list[list[tuple[str, Any]]] = [[]]
    for text in sweeps:
        key = text.split("=", 1)[0].strip()
        if "=" not in text or not text.split("=", 1)[1].strip():
            raise ConfigError(f"--sweep {text!r} is invalid: expected key=value,value,... e.g. "
                              "seed=0,1,2")
        values = [parse_override(f"{key}={raw}")[1] for raw in text.split("=", 1)[1].split(",")]
        variants = [v + [(key, value)] for v in variants for value in values]
    return variants


def run_on_link(link: LocalSuperLink, app: Path, cfg: Any, changed: dict[str, Any],
                run_dir: Path, verbose: bool) -> tuple[str, dict[str, float]]:
    """Submit one run of the app staged in ``app`` (``stage_app``) to a started SuperLink and
    follow it. Returns its final status and when its phases happened (seconds since the
    epoch, the clock of the ServerApp's ``started_at``): ``submitted`` as ``flwr run`` was
    started, ``stream_ended`` as it exited, ``status`` once the status was read."""
    marks = {"submitted": time.time()}
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = write_run_config(changed, link.flwr_home / f"{cfg.run_name}.toml")
    federation = cluster.federation_config(cfg)
    cmd = [str(BIN / "flwr"), "run", str(app), "--stream",
           "--run-config", str(overrides), "--federation-config", federation]
    run_id = stream_run(cmd, link.env, run_dir / "flwr.log", verbose)
    marks["stream_ended"] = time.time()
    status = (run_status(link.env, run_id, f"127.0.0.1:{link.http_port}") if run_id
              else "unknown (no run id)")
    marks["status"] = time.time()
    return status, marks


def report_fixed_cost(run_dir: Path, phases: dict[str, float], marks: dict[str, float],
                      shared_by: int) -> None:
    """Write ``timing.json`` (where a run's time went outside its rounds) and say it in one
    line. The fixed cost is everything but the ServerApp's own ``wall_seconds`` (from its
    recorder's start to the summary): settings and data checked here, the SuperLink's start
    beyond those checks (it starts while the data are checked), the run's start-up (``flwr
    run``'s submission, the simulation process and the ServerApp loading the data), its end
    (Ray's shutdown, the log stream's end), the status query and the shutdown; a sweep shares
    the SuperLink's start and stop among its runs."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return
    record = json.loads(summary.read_text())
    wall = float(record["wall_seconds"])
    started = float(record.get("started_at", marks["submitted"]))
    timing = {**phases, "flwr_run": marks["status"] - marks["submitted"],
              "start_up": started - marks["submitted"],
              "end": marks["stream_ended"] - started - wall,
              "status_query": marks["status"] - marks["stream_ended"],
              "server_app_wall": wall, "shared_by": shared_by}
    timing["fixed"] = ((phases["validate"] + phases["superlink_start"] + phases["stop"])
                       / shared_by + timing["flwr_run"] - wall)
    (run_dir / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    print(f"fedapp: fixed cost {timing['fixed']:.0f} s (settings and data "
          f"{phases['validate']:.0f} s, SuperLink start {phases['superlink_start']:.0f} s"
          + (f" shared by {shared_by} runs" if shared_by > 1 else "")
          + f", the run's start-up {timing['start_up']:.0f} s and end {timing['end']:.0f} s, "
          f"status {timing['status_query']:.0f} s, shutdown {phases['stop']:.0f} s) beside "
          f"{wall:.0f} s of rounds", flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        if getattr(args, "resume", None) and args.sweep:
            raise ConfigError("--resume continues one run; give no --sweep with it.")
        runs = [resolve_run(args, variant=v) for v in sweep_variants(args.sweep)]
        address = cluster.ray_address(getattr(args, "ray_address", None))
        if address == cluster.LOCAL:  # its virtual clients read it, but only once started
            client_cache_budget()
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    # The settings hold: the SuperLink starts (about 3 s of a Python process importing Flower)
    # while this process checks the data (about 2 s of imports and reads) — two cores, two
    # processes. Its log joins the run folder once the checks pass.
    flwr_home = Path(tempfile.mkdtemp(prefix="fedapp-flwr-home-"))
    link = LocalSuperLink(flwr_home, flwr_home / "superlink.log", ray_address=address)
    link.launch()
    try:
        for cfg, _, _ in runs:
            check_run_data(cfg)
        if any(cfg.tensorboard for cfg, _, _ in runs):
            # The ServerApp runs on this machine and would refuse it only after start-up.
            from fedapp.runtime.tensorboard import require
            require()
        for cfg, _, _ in runs:
            if cfg.client_num_gpus > 0:
                cluster.check_gpus(cfg, address, cluster.visible_gpus())
    except BaseException as exc:
        link.stop()
        shutil.rmtree(flwr_home, ignore_errors=True)
        if not isinstance(exc, (ConfigError, OSError, RuntimeError, ValueError)):
            raise
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    phases = {"validate": time.perf_counter() - start}

    runs[0][2].mkdir(parents=True, exist_ok=True)
    link.keep_log(runs[0][2] / "superlink.log")
    if address != cluster.LOCAL:
        print(f"fedapp: the virtual clients run on the Ray cluster at {address}", flush=True)
    if len(runs) > 1:
        print(f"fedapp: a sweep of {len(runs)} runs on one SuperLink: "
              + ", ".join(run_dir.name for _, _, run_dir in runs), flush=True)
    ended: list[tuple[str, Path, dict[str, float]]] = []
    try:
        mark = time.perf_counter()
        link.wait_ready()
        # What the SuperLink's start cost beyond the checks it overlapped.
        phases["superlink_start"] = time.perf_counter() - mark
        app = stage_app(PROJECT_ROOT, flwr_home / "app")  # once: a sweep runs one snapshot
        for cfg, changed, run_dir in runs:
            print(f"fedapp: {cfg.method} on {cfg.dataset}, {cfg.num_clients} clients, "
                  f"{cfg.num_server_rounds} rounds -> {run_dir}", flush=True)
            status, marks = run_on_link(link, app, cfg, changed, run_dir, args.verbose)
            ended.append((status, run_dir, marks))
    except KeyboardInterrupt:
        ended.append(("interrupted", runs[len(ended)][2], {}))
    except RuntimeError as exc:
        ended.append((f"failed to start: {exc}", runs[len(ended)][2], {}))
    finally:
        mark = time.perf_counter()
        link.stop()
        phases["stop"] = time.perf_counter() - mark
        shutil.rmtree(flwr_home, ignore_errors=True)
    codes = []
    for status, run_dir, marks in ended:
        if marks:
            report_fixed_cost(run_dir, phases, marks, len(runs))
        codes.append(report_run(status, run_dir))
    # A sweep fails if any of its runs did not complete, or never started after an
    # interruption.
    codes += [1] * (len(runs) - len(ended))
    return max(codes)


LAYER_NAMES = {"set": "--set", "preset": "preset", "config": "run config"}


def cmd_settings(args: argparse.Namespace) -> int:
    """Every setting's effective value for ``[PRESET] [--set ...]`` and where it came from."""
    from strategies import known_methods, method_keys, settings_report
    try:
        flat = resolve_settings(args.preset, args.set)[0]
        report = settings_report(flat)
        known, fields = known_methods(flat), {**SHARED_KEYS, **method_keys(flat)}
        check = getattr(args, "check", False)
        if check or report["settings"].get("differential-privacy"):
            # The rules across settings (the method's card, the loop, DP) and, with --check,
            # the data and the models need torch, which listing the settings does not: the
            # run's whole check, refused here as `fedapp run` refuses.
            from strategies import load_config
            cfg = load_config(flat)
            if check:
                check_run_data(cfg)
    except (ConfigError, OSError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    values, layers = report["settings"], report["layers"]
    method = values["method"]
    print("# effective settings; [where each value comes from]: default, recipe <method> "
          "(docs/recipes.md), preset, --set")
    own = [k for k in values if k not in SHARED_KEYS]
    for key in list(SHARED_KEYS) + own:
        if own and key == own[0]:
            print(f"\n# {method}'s own settings")
        print(f"{key} = {toml_value(values[key])}    "
              f"# [{LAYER_NAMES.get(layers[key], layers[key])}] {fields[key].metadata['help']}")
    defaults = pyproject_defaults()
    for name, m in known.items():
        if name == method or m.settings is None:
            continue
        print(f"\n# {name}'s own settings (used when method = \"{name}\")")
        for key, f in fields.items():
            if key.startswith(f"{name}.") and key.count(".") == name.count(".") + 1:
                print(f"{key} = {toml_value(defaults.get(key, f.default))}    "
                      f"# {f.metadata['help']}")
    if check:
        print("\n# --check: every check fedapp run makes before it starts passes (the "
              "settings, the data, the partition, the models)")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """The methods (with those of the packages ``method-packages`` names) and their loops."""
    from strategies import known_methods
    try:
        known = known_methods(resolve_settings(args.preset, args.set)[0])
    except (ConfigError, OSError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    for name, method in known.items():
        print(f"{name:14s} {method.summary}")
    print("\nserver-loop = \"async\" (no round barrier) runs: "
          + ", ".join(n for n, m in known.items() if m.asynchronous))
    print("server-loop = \"walk\" / \"gossip\" (device to device, the server only relays) runs: "
          + ", ".join(n for n, m in known.items() if m.decentralised))
    from strategies import SECURE_FORMS
    print("secure-aggregation = true (the server sees only sums, docs/privacy.md) runs: "
          + ", ".join(n for n, m in known.items() if m.secure_aggregation in SECURE_FORMS))
    needs = [f"{n} ({'labelled' if m.public_labels else 'unlabelled'})"
             for n, m in known.items() if m.needs_public]
    if needs:
        print("needs a public set (public-source; public-labels = \"method\" gives): "
              + ", ".join(needs))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from client_models import ARCHITECTURES
    for name, info in ARCHITECTURES.items():
        print(f"{name:16s} {info.description}")
    return 0
