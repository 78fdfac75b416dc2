"""A whole deployment on this machine, from ``fedapp deploy``'s own commands (docs/deployment.md):
a SuperLink with TLS and SuperNode authentication on a free loopback port, the keys of ``site0``,
``site1``, ... registered, one SuperNode per site, and ``fedapp deploy run`` against them. The
loopback deployment tests (tests/test_deploy.py) and the deployed benchmarks
(benchmarks/secagg_round.py) start their deployments here, so that what they measure or check is
the deployment the docs describe, started one way.

Every process is started in a process group of its own (:class:`Processes`), so that stopping
it stops what Flower spawned under it (the SuperLink's SuperExec and ServerApp, a SuperNode's
SuperExec and ClientApps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from fedapp.cli.deploy import connected_env
from fedapp.cli.flower import _free_port, group_members, stop_process_group, wait_for_port
from fedapp.config import PROJECT_ROOT

FEDAPP = [sys.executable, "-m", "fedapp.cli.main"]


class Processes:
    """``fedapp deploy ...`` commands started in process groups of their own, each writing
    ``logs/NAME.log``; :meth:`stop_all` stops every one and all they spawned."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen] = []

    def __call__(self, name: str, *args: str) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "w") as log:
            proc = subprocess.Popen([*FEDAPP, "deploy", *args], cwd=PROJECT_ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc

    def stop_all(self) -> list[int]:
        """Stop every group, the last started first; the processes of ours still alive after
        (none, unless one refused to stop)."""
        for proc in reversed(self.started):
            stop_process_group(proc)
        return [pid for proc in self.started for pid in group_members(proc.pid)]


def _fedapp(*args: str) -> None:
    """A ``fedapp`` step that must succeed (in this process: it only writes files or calls
    ``flwr`` once)."""
    from fedapp.cli.main import main
    if main(list(args)) != 0:
        raise RuntimeError(f"`fedapp {' '.join(args)}` failed")


class Loopback:
    """A deployment in ``folder`` (``fedapp deploy --dir``): certificates, the key pairs of
    ``site0`` ... ``site{sites-1}`` (and of ``intruder``, made but never registered), a
    SuperLink started with ``superlink_options`` (its log ``superlink``), the sites' keys
    registered, and one SuperNode per site with node config ``partition-id=K
    num-partitions=SITES`` and ``node_config(K)``, started with ``supernode_options``. Runs
    submitted by :meth:`run` need ``num-clients = sites``."""

    def __init__(self, folder: Path, processes: Processes, sites: int = 2,
                 superlink_options: tuple[str, ...] = (),
                 node_config: Callable[[int], str] = lambda pid: "",
                 supernode_options: tuple[str, ...] = ()) -> None:
        self.folder, self.processes, self.sites = folder, processes, sites
        self.superlink_options, self.supernode_options = superlink_options, supernode_options
        self.dir = ["--dir", str(folder)]
        self.names = [f"site{pid}" for pid in range(sites)]
        self.keys = folder / "keys"
        _fedapp("deploy", "certs", *self.dir)
        _fedapp("deploy", "node-key", *self.names, "intruder", *self.dir)
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.superlink()
        _fedapp("deploy", "connect", self.address, *self.dir)
        _fedapp("deploy", "register", *(str(self.keys / f"{n}.pub") for n in self.names),
                *self.dir)
        for pid, name in enumerate(self.names):
            self.supernode(name, f"partition-id={pid} num-partitions={sites} "
                                 f"{node_config(pid)}".strip())
        self.env = connected_env(folder / "flwr-home")  # for plain `flwr` commands

    def superlink(self, name: str = "superlink") -> subprocess.Popen:
        """Start the SuperLink (again: the same port and database), once it accepts
        connections; it is ``superlink_process`` from then on."""
        proc = self.processes(name, "superlink", "--port", str(self.port),
                              *self.superlink_options, *self.dir)
        wait_for_port(proc, self.port, "the SuperLink", self.processes.logs / f"{name}.log")
        self.superlink_process = proc
        return proc

    def supernode(self, name: str, node_config: str, *extra: str) -> subprocess.Popen:
        """Start a SuperNode with the key pair ``name`` (its log ``name``)."""
        return self.processes(name, "supernode", "--superlink", self.address, "--key",
                              str(self.keys / f"{name}.key"), "--port", str(_free_port()),
                              "--node-config", node_config, *self.supernode_options,
                              *extra, *self.dir)

    def run_command(self, *args: str) -> list[str]:
        """``fedapp deploy run ARGS`` against this deployment."""
        return [*FEDAPP, "deploy", "run", *args, *self.dir]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``fedapp deploy run ARGS``, waited for (its output captured)."""
        return subprocess.run(self.run_command(*args), cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=timeout)
