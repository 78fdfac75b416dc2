"""``fedapp``: run experiments through Flower and compare their results.

``fedapp run <preset> [--set key=value ...]`` validates the settings before anything starts,
runs the app with ``flwr run --stream`` against a SuperLink it starts on free loopback ports with
a private ``FLWR_HOME`` (runtime dependency installation, update check and telemetry off), prints
one line per round, reads the run's final status (``flwr run`` itself exits 0 even when the run
failed), stops the SuperLink and everything it spawned, and exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from fedapp.config import (PROJECT_ROOT, SHARED_KEYS, ConfigError, parse_override,
                           pyproject_defaults, read_preset, resolve_preset)
from fedapp.results import PROGRESS_TAG, format_accuracy, human_bytes, plot_runs

BIN = Path(sys.executable).parent
SUPERLINK_START_TIMEOUT = 60.0
# What is worth showing from Flower's stream besides our own progress lines.
SHOW = re.compile(r"\[fedapp\]|ERROR|Traceback|Exception|rejected|failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def resolve_settings(preset: str | None, overrides: Sequence[str]) -> tuple[dict, dict]:
    """(all settings, the ones that differ from pyproject's defaults) after preset and --set."""
    defaults = pyproject_defaults()
    changed: dict[str, Any] = {}
    if preset:
        changed.update(read_preset(resolve_preset(preset)))
    for text in overrides:
        key, value = parse_override(text)
        changed[key] = value
    return {**defaults, **changed}, changed


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """The environment every Flower process of ours gets: a private ``FLWR_HOME``, no runtime
    dependency installation (it would download ~5.5 GB per run), no update check or
    telemetry, and this venv's ``bin`` first on PATH (Flower spawns ``flower-superexec`` by
    name)."""
    return {**os.environ,
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            **extra}


def wait_for_port(process: subprocess.Popen, port: int, what: str, log_path: Path,
                  timeout: float = SUPERLINK_START_TIMEOUT, host: str = "127.0.0.1") -> None:
    """Return once ``process`` accepts connections on ``port``; raise if it exits or hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}; see {log_path}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not start within {timeout:.0f} s; see {log_path}")


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) in process group ``pgid``, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the command name "(...)": state, ppid, pgrp, ...
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if int(pgrp) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def stop_process_group(process: subprocess.Popen | None) -> None:
    """Stop ``process`` and everything it spawned: it must have been started with
    ``start_new_session=True``, so that its process group is exactly ours to kill. Waits for
    the whole group, not only the leader: Flower's children may outlive it by a moment."""
    if process is None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, else it stays a member as a zombie
            if process.returncode is not None and not group_members(process.pid):
                return
            time.sleep(0.1)
    process.poll()


class LocalSuperLink:
    """A simulation SuperLink on free loopback ports, owned (and stopped) by this process."""

    def __init__(self, flwr_home: Path, log_path: Path) -> None:
        self.http_port, self.control_port = _free_port(), _free_port()
        self.env = flower_env(flwr_home,
                              FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(self.http_port),
                              FLWR_LOCAL_CONTROL_API_PORT=str(self.control_port))
        (flwr_home / "local-superlink").mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.flwr_home = flwr_home

    def start(self) -> None:
        # The same command `flwr run` would start for its ':local:' connection, but on our own
        # ports and in our own process group, so that we know exactly what to stop.
        cmd = [str(BIN / "flower-superlink"), "--insecure", "--simulation",
               "--isolation", "subprocess",
               "--control-api-address", f"127.0.0.1:{self.control_port}",
               "--host", "127.0.0.1", "--port", str(self.http_port),
               "--database", str(self.flwr_home / "local-superlink" / "state.db"),
               "--log-file", str(self.log_path)]
        self.process = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for_port(self.process, self.http_port, "flower-superlink", self.log_path)

    def stop(self) -> None:
        """Stop the SuperLink and every process it spawned (its whole process group)."""
        stop_process_group(self.process)


def _run_status(env: dict, run_id: str) -> str:
    """The run's final status as the SuperLink reports it (e.g. 'finished:completed')."""
    out = subprocess.run([str(BIN / "flwr"), "list", "--run-id", run_id, "--format", "json"],
                         env=env, capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        return f"unknown (flwr list said: {out.stdout.strip() or out.stderr.strip()})"
    for run in runs:
        if str(run.get("run-id")) == run_id:
            return str(run.get("status"))
    return "unknown (run not listed)"


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
    defaults = pyproject_defaults()
    flat = {**defaults, **saved, "resume": True,
            "output-dir": str(run_dir.resolve().parent), "run-name": run_dir.resolve().name}
    return flat, {k: v for k, v in flat.items() if defaults.get(k) != v}


def resolve_run(args: argparse.Namespace, *, check_data: bool = True
                ) -> tuple[Any, dict[str, Any], Path]:
    """(validated config, the settings to send as overrides, run folder) of ``fedapp run`` /
    ``fedapp deploy run``; raises ConfigError (or OSError, ...) with a message for the user.

    ``output-dir`` is made absolute and ``run-name`` fixed here, because the ServerApp runs
    from a copy of the app in another directory and must write where this command looks."""
    from strategies import load_config

    if getattr(args, "resume", None):
        flat, changed = resume_settings(Path(args.resume), args)
    else:
        flat, changed = resolve_settings(args.preset, args.set)
    output_dir = Path(args.output_dir or flat["output-dir"] or "results").expanduser()
    flat["output-dir"] = changed["output-dir"] = str(output_dir.resolve())
    if not flat["run-name"]:
        from fedapp.server_app import default_run_name
        flat["run-name"] = default_run_name(flat["method"], flat["dataset"])
    changed["run-name"] = flat["run-name"]
    cfg = load_config(flat)
    if check_data:
        from fedapp import experiment
        # A missing dataset, an impossible partition or an architecture that cannot take its
        # input is reported now, not a minute later from inside the simulation.
        experiment.prepare(cfg)
    return cfg, changed, cfg.results_root() / cfg.run_name


def write_run_config(changed: dict[str, Any], path: Path) -> Path:
    """The overrides as the TOML file ``flwr run --run-config`` reads."""
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in changed.items()))
    return path


def stream_run(cmd: Sequence[str], env: dict, log_path: Path, verbose: bool) -> str | None:
    """Run ``flwr run ... --stream``: keep its whole output in ``log_path``, print our progress
    lines (or everything with ``verbose``), and return the run id it started (None if none)."""
    run_id = None
    with open(log_path, "w") as log_file, subprocess.Popen(
            list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            log_file.write(line)
            match = re.search(r"run (\d+)", line) if run_id is None else None
            if match and "start" in line.lower():
                run_id = match.group(1)
            if verbose or SHOW.search(line):
                text = line.rstrip()
                print(text[text.find(PROGRESS_TAG):] if PROGRESS_TAG in text else text,
                      flush=True)
    return run_id


def report_run(status: str, run_dir: Path, *, results_elsewhere: bool = False) -> int:
    """Print how the run ended and return fedapp's exit status (0 only if it completed).

    ``results_elsewhere``: the ServerApp ran on another machine (a deployed SuperLink), so a
    completed run's results may not be visible here."""
    summary_path = run_dir / "summary.json"
    if status == "finished:completed" and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        acc, com = summary["accuracy"], summary["communication"]
        print(f"fedapp: done. accuracy {format_accuracy(acc['mean'], acc['std'])} (per-client "
              f"local test, {summary['num_clients']} clients); per client per round up "
              f"{human_bytes(com['per_client_per_round_up'])}, down "
              f"{human_bytes(com['per_client_per_round_down'])}; "
              f"{summary['wall_seconds']:.0f} s")
        print(f"fedapp: results in {run_dir} (summary.json, rounds.jsonl, accuracy.png)")
        return 0
    if status == "finished:completed" and results_elsewhere:
        print(f"fedapp: done. Results in {run_dir} on the SuperLink's machine")
        return 0
    print(f"fedapp: the run did not complete (status: {status}). Flower's log: "
          f"{run_dir / 'flwr.log'}", file=sys.stderr)
    return 130 if status == "interrupted" else 1


def cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg, changed, run_dir = resolve_run(args)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2

    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = Path(tempfile.mkdtemp(prefix="fedapp-flwr-home-"))
    overrides = write_run_config(changed, flwr_home / "run-config.toml")
    federation = (f"num-supernodes={cfg.num_clients} "
                  f"client-resources-num-cpus={cfg.client_num_cpus} "
                  f"client-resources-num-gpus={cfg.client_num_gpus}")
    link = LocalSuperLink(flwr_home, run_dir / "superlink.log")
    print(f"fedapp: {cfg.method} on {cfg.dataset}, {cfg.num_clients} clients, "
          f"{cfg.num_server_rounds} rounds -> {run_dir}", flush=True)
    status = "not started"
    try:
        link.start()
        cmd = [str(BIN / "flwr"), "run", str(PROJECT_ROOT), "--stream",
               "--run-config", str(overrides), "--federation-config", federation]
        run_id = stream_run(cmd, link.env, run_dir / "flwr.log", args.verbose)
        status = _run_status(link.env, run_id) if run_id else "unknown (no run id)"
    except KeyboardInterrupt:
        status = "interrupted"
    except RuntimeError as exc:
        status = f"failed to start: {exc}"
    finally:
        link.stop()
        shutil.rmtree(flwr_home, ignore_errors=True)
    return report_run(status, run_dir)


def compare_table(summaries: Sequence[dict], labels: Sequence[str]) -> str:
    """One markdown table row per run."""
    rows = ["| run | method | dataset | clients | rounds | accuracy (mean ± std) | "
            "global accuracy | up / client / round | down / client / round | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s, label in zip(summaries, labels):
        acc, com = s["accuracy"], s["communication"]
        glob = f"{acc['global_mean']:.4f}" if acc.get("global_mean") is not None else "-"
        rows.append(f"| {label} | {s['method']} | {s['dataset']} | {s['num_clients']} | "
                    f"{s['rounds']} | {format_accuracy(acc['mean'], acc['std'])} | {glob} | "
                    f"{human_bytes(com['per_client_per_round_up'])} | "
                    f"{human_bytes(com['per_client_per_round_down'])} | "
                    f"{s['wall_seconds']:.0f} |")
    return "\n".join(rows)


def cmd_compare(args: argparse.Namespace) -> int:
    summaries, labels = [], []
    for run_dir in args.runs:
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            print(f"fedapp: {path} not found (did that run complete?)", file=sys.stderr)
            return 2
        summaries.append(json.loads(path.read_text()))
        labels.append(Path(run_dir).resolve().name)
    out = Path(args.output)
    plot_runs(summaries, out, labels)
    print(compare_table(summaries, labels))
    print(f"\nplot: {out.resolve()}")
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    from strategies import method_keys
    defaults = pyproject_defaults()
    print("# shared settings")
    for key, f in SHARED_KEYS.items():
        print(f"{key} = {toml_value(defaults.get(key, f.default))}    # {f.metadata['help']}")
    section = None
    for key, f in method_keys().items():
        if key.split(".", 1)[0] != section:
            section = key.split(".", 1)[0]
            print(f"\n# {section}'s own settings (used when method = \"{section}\")")
        print(f"{key} = {toml_value(defaults.get(key, f.default))}    # {f.metadata['help']}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from strategies import METHODS
    for name, method in METHODS.items():
        print(f"{name:14s} {method.summary}")
    print("\nserver-loop = \"async\" (no round barrier) runs: "
          + ", ".join(n for n, m in METHODS.items() if m.asynchronous))
    print("server-loop = \"walk\" / \"gossip\" (device to device, the server only relays) runs: "
          + ", ".join(n for n, m in METHODS.items() if m.decentralised))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from client_models import ARCHITECTURES
    for name, info in ARCHITECTURES.items():
        print(f"{name:16s} {info.description}")
    return 0
