"""The path from ``client-num-gpus`` / ``device`` to the device a client trains on, checked
without CUDA: what fedapp hands to Flower, what Flower makes of it for Ray, what Ray shows a
client's process, the device a client then picks, and a clear refusal when a GPU is asked for
and there is none. (Training on a GPU itself needs one: docs/usage.md, "GPUs and Ray
resources".)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fedapp.cli import cluster
from fedapp.cli.main import main
from fedapp.config import ConfigError
from fedapp.runtime.training import pick_device
from tests.conftest import cfg_of


def _flower_backend_config(federation: str) -> dict:
    """What Flower 1.41 builds for Ray from ``flwr run --federation-config TEXT``: the CLI's
    parsing into its SimulationConfig message, then the simulation process's backend config."""
    from flwr.common.config import parse_config_args
    from flwr.simulation.app import _run_simulation_settings
    from flwr.supercore.utils import simulation_config_from_json
    parsed = {k.replace("-", "_"): v for k, v in parse_config_args([federation]).items()}
    num_supernodes, backend, config, _, _ = _run_simulation_settings(
        simulation_config_from_json(parsed))
    return {"num_supernodes": num_supernodes, "backend": backend, **config}


@pytest.mark.parametrize("gpus", [0.0, 0.25, 1.0])
def test_client_resources_reach_rays_actor_options(gpus):
    cfg = cfg_of(num_clients=7, client_num_cpus=2, client_num_gpus=gpus)
    backend = _flower_backend_config(cluster.federation_config(cfg))
    assert backend["num_supernodes"] == 7 and backend["backend"] == "ray"
    # Each virtual client is a Ray actor created with these options.
    assert backend["client_resources"] == {"num_cpus": 2, "num_gpus": gpus}
    # No num_cpus / num_gpus for ray.init: what lets a run join a running cluster.
    assert backend["init_args"] == {}


def test_how_many_gpu_clients_train_at_once(monkeypatch):
    # Flower sizes its actor pool from every node's resources: a GPU share packs clients on a
    # GPU, and no GPU at all means no client (the failure check_gpus refuses up front).
    from flwr.simulation.ray_transport import ray_actor
    nodes = [{"Resources": {"CPU": 16.0, "GPU": 1.0}}, {"Resources": {"CPU": 4.0}}]
    monkeypatch.setattr(ray_actor.ray, "nodes", lambda: nodes)
    assert ray_actor.pool_size_from_resources({"num_cpus": 1, "num_gpus": 0.25}) == 4
    assert ray_actor.pool_size_from_resources({"num_cpus": 1, "num_gpus": 0.0}) == 20
    monkeypatch.setattr(ray_actor.ray, "nodes", lambda: nodes[1:])
    with pytest.raises(ValueError, match="ActorPool is empty"):
        ray_actor.pool_size_from_resources({"num_cpus": 1, "num_gpus": 0.25})


def test_a_gpu_share_without_a_gpu_is_refused_before_anything_starts(monkeypatch, capsys,
                                                                     tmp_path):
    cfg = cfg_of(client_num_gpus=0.25)
    with pytest.raises(ConfigError, match=r"client-num-gpus = 0.25 .* no CUDA device"):
        cluster.check_gpus(cfg, cluster.LOCAL, gpus=0)
    cluster.check_gpus(cfg, cluster.LOCAL, gpus=1)           # a GPU here: fine
    cluster.check_gpus(cfg, "10.0.0.1:6379", gpus=0)         # the cluster's GPUs are elsewhere
    cluster.check_gpus(cfg_of(client_num_gpus=0.0), cluster.LOCAL, gpus=0)
    # Through the command line, on a machine shown without a GPU.
    monkeypatch.setattr(cluster, "visible_gpus", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["run", "smoke", "--set", "client-num-gpus=0.25", "--output-dir",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "client-num-gpus = 0.25" in err and "client-num-gpus = 0" in err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_the_device_a_client_picks(monkeypatch):
    # Ray shows a client with a GPU share its GPU (CUDA_VISIBLE_DEVICES), a client without one
    # none; the client then trains on CUDA if it sees a device, else on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert pick_device("") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees 0 CUDA device"):
        pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("") == torch.device("cuda")
    assert pick_device("cuda:0") == torch.device("cuda:0")
    assert pick_device("cpu") == torch.device("cpu")  # a SuperNode may insist on the CPU
    with pytest.raises(ValueError, match="sees 1 CUDA device"):
        pick_device("cuda:1")


def _fedavg_client(node_config, **settings):
    from flwr.app import Context, RecordDict
    from strategies import METHODS
    cfg = cfg_of(method="fedavg", dataset="synthetic", num_clients=2, arch_mix="cnn5",
                 **settings)
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "num-partitions": 2, **node_config})
    return METHODS["fedavg"].client(context, cfg)


def test_a_clients_device_comes_from_its_node_config(monkeypatch):
    import fedapp.runtime.client_base as client_base
    monkeypatch.setattr(client_base, "deterministic_cuda", lambda: None)  # no real GPU here
    client = _fedavg_client
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert client({}).device == torch.device("cuda")
    assert client({"device": "cuda:1"}).device == torch.device("cuda:1")
    assert client({"device": "cpu"}).device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert client({}).device == torch.device("cpu")
    with pytest.raises(ValueError, match="sees 0 CUDA device"):
        client({"device": "cuda:0"})


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_gpu_client_asks_for_deterministic_kernels_unless_told_not_to(monkeypatch,
                                                                         deterministic):
    # On a GPU one seed gave results differing by ~1e-7 run to run (cuDNN's timed choice of
    # algorithm, reductions in varying order); the CPU never needs it.
    import fedapp.runtime.client_base as client_base
    calls = []
    monkeypatch.setattr(client_base, "deterministic_cuda", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _fedavg_client({}, deterministic=deterministic)
    _fedavg_client({"device": "cpu"}, deterministic=deterministic)
    assert calls == ([1] if deterministic else [])


def test_deterministic_cuda_settings(monkeypatch):
    from fedapp.runtime.training import deterministic_cuda
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored afterwards
    was = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
           torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = was[:2]
        torch.use_deterministic_algorithms(was[2], warn_only=was[3])


@pytest.mark.slow
def test_ray_shows_a_gpu_client_its_gpu_and_hides_gpus_from_the_others():
    # A private Ray instance that declares one (logical) GPU: an actor with a GPU share is
    # shown GPU 0, an actor without one is shown none (so it cannot touch a GPU by mistake).
    script = (
        "import json, os, ray\n"
        "ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level='ERROR',\n"
        "         log_to_driver=False)\n"
        "@ray.remote\n"
        "class Client:\n"
        "    def seen(self):\n"
        "        return os.environ.get('CUDA_VISIBLE_DEVICES'), ray.get_gpu_ids()\n"
        "out = [ray.get(Client.options(num_cpus=1, num_gpus=g).remote().seen.remote())\n"
        "       for g in (0.25, 0.0)]\n"
        "print(json.dumps(out))\n"
        "ray.shutdown()\n")
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu_client, cpu_client = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gpu_client == ["0", [0]]
    assert cpu_client == ["", []]
