"""Flower process control: the processes ``fedapp run`` and ``fedapp deploy`` start and stop.

The environment every Flower process of ours gets (``flower_env``), free loopback ports, waiting
for a process to listen, a simulation SuperLink owned by this process (``LocalSuperLink``),
stopping a process and everything it spawned (its process group; the simulation SuperLink
under a watchdog that also ends what leaves the group, and everything if ``fedapp`` itself is
killed: ``fedapp.cli.watchdog``), streaming ``flwr run``'s
output and reading a run's final status from the SuperLink (``flwr run`` itself exits 0 even when
the run failed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

BIN = Path(sys.executable).parent
SUPERLINK_START_TIMEOUT = 60.0
# What is worth showing from Flower's stream besides our own progress lines.
SHOW = re.compile(r"\[fedapp\]|ERROR|Traceback|Exception|rejected|failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """The environment every Flower process of ours gets: a private ``FLWR_HOME``, no runtime
    dependency installation (it would download ~5.5 GB per run), no update check or
    telemetry, this venv's ``bin`` first on PATH (Flower spawns ``flower-superexec`` by
    name), and Ray's workers at the simulation's own priority.

    Ray starts its workers (the virtual clients' actors) at nice 15 (``RAY_worker_niceness``).
    Beside them the simulation's own processes run at nice 0 and are never idle (the engine
    and the SuperLink poll), so on a machine with few cores the clients' torch threads got a
    sliver of a core whenever one of those woke, and a training step waits for its slowest
    thread. A user's own ``RAY_worker_niceness`` is kept."""
    return {**os.environ,
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),
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

    def __init__(self, flwr_home: Path, log_path: Path, ray_address: str | None = None) -> None:
        """``ray_address``: the ``RAY_ADDRESS`` its simulations inherit (fedapp.cli.cluster);
        None leaves the environment's."""
        self.http_port, self.control_port = _free_port(), _free_port()
        self.env = flower_env(flwr_home,
                              FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(self.http_port),
                              FLWR_LOCAL_CONTROL_API_PORT=str(self.control_port),
                              # The SuperExec that starts a submitted run's simulation looks
                              # for one every 0.2 s, not Flower's 1 s: half a second of each
                              # run's start-up on average (a user's own value is kept).
                              FLWR_SUPEREXEC_TASK_POLL_INTERVAL=os.environ.get(
                                  "FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2"),
                              **({"RAY_ADDRESS": ray_address} if ray_address else {}))
        (flwr_home / "local-superlink").mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.flwr_home = flwr_home
        self._append_log_to: Path | None = None

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the SuperLink's process without waiting for it (``wait_ready``)."""
        # The same command `flwr run` would start for its ':local:' connection, but on our own
        # ports and in our own process group, so that we know exactly what to stop; under a
        # watchdog (fedapp.cli.watchdog), so that the SuperExec and the simulation, which
        # start sessions of their own, end with it, and all of them if this process is killed.
        cmd = [sys.executable, "-m", "fedapp.cli.watchdog", "--",
               str(BIN / "flower-superlink"), "--insecure", "--simulation",
               "--isolation", "subprocess",
               "--control-api-address", f"127.0.0.1:{self.control_port}",
               "--host", "127.0.0.1", "--port", str(self.http_port),
               "--database", str(self.flwr_home / "local-superlink" / "state.db"),
               "--log-file", str(self.log_path)]
        self.process = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self) -> None:
        """Return once the SuperLink takes connections; raise RuntimeError if it died."""
        wait_for_port(self.process, self.http_port, "flower-superlink", self.log_path)

    def keep_log(self, path: Path) -> None:
        """Make the SuperLink's log, still being written, appear at ``path`` too: a hard link
        where the file system allows, else appended there when the SuperLink stops (as it is
        where ``path`` already holds the log of an earlier part of a resumed run)."""
        if not path.exists():
            try:
                self.log_path.touch()
                os.link(self.log_path, path)
                return
            except OSError:
                pass
        self._append_log_to = path

    def stop(self) -> None:
        """Stop the SuperLink and every process it spawned (the watchdog's process group: the
        watchdog ends every descendant before it exits)."""
        stop_process_group(self.process)
        if self._append_log_to is not None and self.log_path.exists():
            with open(self._append_log_to, "ab") as log:
                log.write(self.log_path.read_bytes())


# Folders no FAB file comes from: git's, Flower's, a virtual environment, bytecode caches.
NOT_THE_APP = {".git", ".flwr", ".venv", "__pycache__"}


def stage_app(root: Path, dest: Path) -> Path:
    """A copy of the Flower app at ``root`` in ``dest`` (hard links where the file system
    allows), without the folders its FAB leaves out anyway (``NOT_THE_APP`` and what its
    ``.gitignore`` ignores), for ``flwr run`` to submit. Flower 1.41's ``flwr run`` lists
    every file under the app's folder before it applies its rules: with the README's
    ``.venv`` (about 45,000 files) inside the project that cost 6.4 s a run on 2 cores, 0.1 s
    from a clean clone. The FAB built from the copy is the same, byte for byte
    (``tests/test_flwr_run.py``)."""
    import shutil

    import pathspec

    gitignore = root / ".gitignore"
    ignored = pathspec.PathSpec.from_lines(
        "gitwildmatch", gitignore.read_text().splitlines() if gitignore.exists() else [])
    shutil.rmtree(dest, ignore_errors=True)
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel = here.relative_to(root)
        # A folder git ignores holds nothing git (or Flower's .gitignore rule) takes back.
        dirnames[:] = [d for d in dirnames if d not in NOT_THE_APP
                       and not ignored.match_file(f"{(rel / d).as_posix()}/")]
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if (here / name).is_symlink():
                continue  # Flower leaves links out too
            try:
                os.link(here / name, dest / rel / name)
            except OSError:
                shutil.copy2(here / name, dest / rel / name)
    return dest


def run_status(env: dict, run_id: str, local_address: str | None = None) -> str:
    """The run's final status as the SuperLink reports it (e.g. 'finished:completed').

    ``local_address``: an insecure SuperLink of our own (``LocalSuperLink``) at that host:port,
    asked in this process over its Control API, as ``flwr list`` asks it: starting ``flwr
    list`` costs a whole Flower CLI start, seconds a run on 2 cores. Otherwise, or should that
    fail, ``flwr list`` asks with its own connection settings (a deployment's TLS, its
    account)."""
    if local_address is not None:
        try:
            return _local_run_status(local_address, run_id)
        except Exception:  # noqa: BLE001 - another Flower release, a refused call: ask flwr
            pass
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


def _local_run_status(address: str, run_id: str) -> str:
    """``flwr list --run-id``'s status of a run on an insecure SuperLink at ``address``
    (Flower 1.41's Control HTTP client; its status and sub-status joined as ``flwr list``
    joins them)."""
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.control.control_http_client import ControlHttpClient

    client = ControlHttpClient.from_server_address(address, insecure=True,
                                                   root_certificates=None, interceptors=())
    run = client.ListRuns(ListRunsRequest(run_id=int(run_id))).run_dict[int(run_id)]
    status, sub_status = run.status.status, run.status.sub_status
    return f"{status}:{sub_status}" if sub_status else status


def stream_run(cmd: Sequence[str], env: dict, log_path: Path, verbose: bool) -> str | None:
    """Run ``flwr run ... --stream``: keep its whole output in ``log_path``, print our progress
    lines (or everything with ``verbose``), and return the run id it started (None if none)."""
    from fedapp.runtime.results import PROGRESS_TAG  # numpy: not for every fedapp command
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
