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


def _toml_value(value: Any) -> str:
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


class LocalSuperLink:
    """A simulation SuperLink on free loopback ports, owned (and stopped) by this process."""

    def __init__(self, flwr_home: Path, log_path: Path) -> None:
        self.http_port, self.control_port = _free_port(), _free_port()
        self.env = {**os.environ,
                    "FLWR_HOME": str(flwr_home),
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.http_port),
                    "FLWR_LOCAL_CONTROL_API_PORT": str(self.control_port),
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0",
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
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
        deadline = time.monotonic() + SUPERLINK_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with code {self.process.returncode};"
                                   f" see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.http_port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"flower-superlink did not start within {SUPERLINK_START_TIMEOUT} s;"
                           f" see {self.log_path}")

    def stop(self) -> None:
        """Stop the SuperLink and every process it spawned (its whole process group)."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


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


def cmd_run(args: argparse.Namespace) -> int:
    from strategies import load_config

    try:
        flat, changed = resolve_settings(args.preset, args.set)
        output_dir = Path(args.output_dir or flat["output-dir"] or "results").expanduser()
        flat["output-dir"] = changed["output-dir"] = str(output_dir.resolve())
        if not flat["run-name"]:
            from fedapp.server_app import default_run_name
            flat["run-name"] = default_run_name(flat["method"], flat["dataset"])
        changed["run-name"] = flat["run-name"]
        cfg = load_config(flat)
        from fedapp import experiment
        # A missing dataset, an impossible partition or an architecture that cannot take its
        # input is reported now, not a minute later from inside the simulation.
        experiment.prepare(cfg)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2

    run_dir = cfg.results_root() / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = Path(tempfile.mkdtemp(prefix="fedapp-flwr-home-"))
    overrides = flwr_home / "run-config.toml"
    overrides.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in changed.items()))
    federation = (f"num-supernodes={cfg.num_clients} "
                  f"client-resources-num-cpus={cfg.client_num_cpus} "
                  f"client-resources-num-gpus={cfg.client_num_gpus}")
    link = LocalSuperLink(flwr_home, run_dir / "superlink.log")
    print(f"fedapp: {cfg.method} on {cfg.dataset}, {cfg.num_clients} clients, "
          f"{cfg.num_server_rounds} rounds -> {run_dir}", flush=True)
    run_id, status = None, "not started"
    try:
        link.start()
        cmd = [str(BIN / "flwr"), "run", str(PROJECT_ROOT), "--stream",
               "--run-config", str(overrides), "--federation-config", federation]
        with open(run_dir / "flwr.log", "w") as log_file, subprocess.Popen(
                cmd, env=link.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1) as proc:
            for line in proc.stdout:  # type: ignore[union-attr]
                log_file.write(line)
                match = re.search(r"run (\d+)", line) if run_id is None else None
                if match and "start" in line.lower():
                    run_id = match.group(1)
                if args.verbose or SHOW.search(line):
                    text = line.rstrip()
                    print(text[text.find(PROGRESS_TAG):] if PROGRESS_TAG in text else text,
                          flush=True)
        status = _run_status(link.env, run_id) if run_id else "unknown (no run id)"
    except KeyboardInterrupt:
        status = "interrupted"
    except RuntimeError as exc:
        status = f"failed to start: {exc}"
    finally:
        link.stop()
        shutil.rmtree(flwr_home, ignore_errors=True)

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
    print(f"fedapp: the run did not complete (status: {status}). Flower's log: "
          f"{run_dir / 'flwr.log'}", file=sys.stderr)
    return 130 if status == "interrupted" else 1


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
    defaults = pyproject_defaults()
    for key, f in SHARED_KEYS.items():
        print(f"{key} = {_toml_value(defaults.get(key, f.default))}    # {f.metadata['help']}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from strategies import METHODS
    for name, method in METHODS.items():
        print(f"{name:14s} {method.summary}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from client_models import ARCHITECTURES
    for name, info in ARCHITECTURES.items():
        print(f"{name:16s} {info.description}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedapp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment through Flower (simulation)")
    run.add_argument("preset", nargs="?", default=None,
                     help="a preset name in conf/ (e.g. smoke) or a .toml path; "
                          "default: the defaults in pyproject.toml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help='override a setting (TOML value: --set method="fedavg")')
    run.add_argument("--output-dir", help="results root (default: ./results)")
    run.add_argument("--verbose", action="store_true", help="show Flower's whole log")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="plot and tabulate several finished runs")
    compare.add_argument("runs", nargs="+", help="run folders (each with a summary.json)")
    compare.add_argument("--output", default="compare.png", help="plot path")
    compare.set_defaults(func=cmd_compare)
    sub.add_parser("settings", help="list every setting with its default").set_defaults(
        func=cmd_settings)
    sub.add_parser("methods", help="list the methods").set_defaults(func=cmd_methods)
    sub.add_parser("models", help="list the architectures").set_defaults(func=cmd_models)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
