"""A simulation attached to a Ray cluster the user started (``fedapp run --ray-address``): the
virtual clients run as actors of that cluster, the results are those of a run on a private Ray
instance, and the cluster is stopped by its process ids, leaving no Ray process behind.

What attaching means and why it goes through ``RAY_ADDRESS``: ``fedapp.cli.cluster``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedapp.cli import cluster
from fedapp.cli.flower import stop_process_group
from fedapp.config import ConfigError
from tests.test_flwr_run import _outcome
from tests.test_tensorboard import check_against_rounds

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_processes(session: int, temp_dir: str) -> list[int]:
    """Live processes of the head's session, or naming its private temp dir (zombies
    excluded)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z" and (int(fields[3]) == session or temp_dir.encode() in cmdline):
            found.append(int(stat.parent.name))
    return found


class RayHead:
    """``ray start --head --block`` on free ports with a private temp dir (so that no other
    ``ray.init()`` on this machine finds it), in a session of its own: every process of the
    cluster (GCS, raylet, agents, workers) is in that session's process group, which
    ``stop`` ends by its id."""

    def __init__(self) -> None:
        # Short: Ray's unix socket paths live under it (at most 107 characters).
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 180.0) -> str:
        ports = {flag: _free_port() for flag in (
            "node-manager-port", "object-manager-port", "ray-client-server-port",
            "metrics-export-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port")}
        cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={self.port}",
               "--num-cpus=2", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
               "--include-dashboard=false", "--disable-usage-stats",
               *(f"--{flag}={port}" for flag, port in ports.items())]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        self.process = subprocess.Popen(cmd, env=env, stdout=open(Path(self.temp_dir) / "start.log", "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        # ``ray start`` writes the address other processes connect to once the head is up.
        address_file = Path(self.temp_dir) / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while not address_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ray start failed: "
                                   + (Path(self.temp_dir) / "start.log").read_text()[-3000:])
            time.sleep(0.5)
        self.address = address_file.read_text().strip()
        return self.address

    def stop(self) -> list[int]:
        """Stop every process of the cluster; return those still alive (none, we hope)."""
        stop_process_group(self.process)
        deadline = time.monotonic() + 30
        while (left := _ray_processes(self.process.pid, self.temp_dir)) \
                and time.monotonic() < deadline:
            time.sleep(0.3)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def _client_actors(address: str) -> list[dict]:
    """The ClientAppActor actors the cluster's GCS knows of (alive or dead), asked from a
    driver of our own in a separate process. Ray's ``ray.util.state`` would ask the dashboard,
    which the minimal Ray that Flower installs does not run; the GCS tables behind it do
    answer."""
    script = (
        "import json, ray\n"
        "from ray._private import state\n"
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
        "node = ray.get_runtime_context().get_node_id()\n"
        "actors = [{'id': a['ActorID'], 'class': a['ActorClassName'], 'state': a['State'],\n"
        "           'job': a['JobID'], 'node': a['Address']['NodeID'], 'head': node}\n"
        "          for a in state.actors().values()]\n"
        "print(json.dumps([a for a in actors if a['class'].endswith('ClientAppActor')]))\n"
        "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fedapp(*args, env=None):
    return subprocess.run([str(BIN / "fedapp"), *args], capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.mark.slow
@pytest.mark.long
def test_a_simulation_on_a_running_ray_cluster_equals_one_on_a_private_instance(tmp_path):
    head = RayHead()
    try:
        address = head.start()
        assert _client_actors(address) == []  # a new cluster: nobody has run there yet
        # No RAY_ADDRESS of the user's: the cluster comes from --ray-address alone.
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        common = ["run", "smoke", "--output-dir", str(tmp_path)]
        attached = _fedapp(*common, "--set", 'run-name="attached"', "--set", "tensorboard=true",
                           "--ray-address", address, env=env)
        assert attached.returncode == 0, attached.stdout + attached.stderr
        assert f"run on the Ray cluster at {address}" in attached.stdout
        actors = _client_actors(address)
        # The virtual clients were actors of this cluster, on its (only) node, for one job
        # (the run's simulation process, a driver of the cluster), ended with the run.
        assert actors, "no client actor ran in the cluster"
        assert {a["node"] for a in actors} == {actors[0]["head"]}
        assert len({a["job"] for a in actors}) == 1
        assert {a["state"] for a in actors} == {"DEAD"}
        # The same run on a private Ray instance (the default): it leaves the cluster alone.
        private = _fedapp(*common, "--set", 'run-name="private"', env=env)
        assert private.returncode == 0, private.stdout + private.stderr
        assert "Ray cluster" not in private.stdout
        assert [a["id"] for a in _client_actors(address)] == [a["id"] for a in actors]
    finally:
        left = head.stop()
    assert left == [], f"Ray processes left running: {left}"
    assert _outcome(tmp_path / "attached") == _outcome(tmp_path / "private")
    check_against_rounds(tmp_path / "attached")  # TensorBoard through a real ServerApp


def test_the_ray_address_comes_from_the_option_then_the_environment_else_private():
    assert cluster.ray_address("10.0.0.1:6379", {"RAY_ADDRESS": "10.0.0.2:6379"}) == \
        "10.0.0.1:6379"
    assert cluster.ray_address(None, {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.2:6379"
    # Never whatever `ray start` last started on this machine: a private instance.
    assert cluster.ray_address(None, {}) == cluster.LOCAL == "local"
    assert cluster.ray_address(None, {"RAY_ADDRESS": " "}) == "local"
    with pytest.raises(ConfigError, match="--ray-address is empty"):
        cluster.ray_address("  ", {})


def test_the_superlink_hands_the_address_to_its_simulations(tmp_path):
    from fedapp.cli.flower import LocalSuperLink
    link = LocalSuperLink(tmp_path / "home", tmp_path / "superlink.log", ray_address="local")
    assert link.env["RAY_ADDRESS"] == "local"
    attached = LocalSuperLink(tmp_path / "home2", tmp_path / "s.log", ray_address="10.0.0.1:1")
    assert attached.env["RAY_ADDRESS"] == "10.0.0.1:1"
