"""Where a simulation's virtual clients run, and with what resources.

Flower 1.41 starts Ray itself, in the simulation process the SuperLink spawns, with
``ray.init()`` and only the ``num_cpus``, ``num_gpus`` and logging settings of the federation
config (``flwr/server/superlink/fleet/vce/backend/raybackend.py``); it never passes an address.
So the cluster is chosen by Ray's own discovery, ``RAY_ADDRESS`` in the environment the
simulation inherits from the SuperLink:

- ``fedapp run --ray-address HOST:PORT`` (or ``RAY_ADDRESS`` already in the user's environment):
  the virtual clients become actors of that running cluster (docs/usage.md, "More than one
  machine"). fedapp never sets Ray's ``num_cpus``/``num_gpus`` init arguments, which Ray refuses
  when it connects to a cluster; the cluster's own resources decide how many clients train at
  once (``client-num-cpus``/``client-num-gpus`` per client, as without a cluster).
- otherwise ``RAY_ADDRESS=local``: a private Ray instance on this machine for this run. Without
  it ``ray.init()`` would also join whatever cluster ``ray start`` last started on this machine
  (``/tmp/ray/ray_current_cluster``), silently.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from fedapp.config import ConfigError

LOCAL = "local"


def ray_address(option: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The ``RAY_ADDRESS`` a run's simulation gets: the option, else the user's own
    ``RAY_ADDRESS``, else ``local`` (a private Ray instance)."""
    if option is not None:
        if not option.strip():
            raise ConfigError("--ray-address is empty: give the cluster's address as `ray start "
                              "--head` printed it (HOST:PORT), or leave the option out.")
        return option.strip()
    return environ.get("RAY_ADDRESS", "").strip() or LOCAL


def federation_config(cfg: Any) -> str:
    """``flwr run --federation-config``: one SuperNode per client and each client's Ray
    resources (``client-num-gpus`` is what makes Ray show a GPU to a client at all)."""
    return (f"num-supernodes={cfg.num_clients} "
            f"client-resources-num-cpus={cfg.client_num_cpus} "
            f"client-resources-num-gpus={cfg.client_num_gpus}")


def visible_gpus() -> int:
    """CUDA devices this process can see (what a private Ray instance would offer)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(cfg: Any, address: str, gpus: int) -> None:
    """Refuse ``client-num-gpus`` > 0 for a private Ray instance on a machine with ``gpus`` =
    0: Ray would start no client at all ("ActorPool is empty"), a minute later. A cluster's
    GPUs are on its nodes, not here: there Ray itself refuses."""
    if cfg.client_num_gpus > 0 and address == LOCAL and gpus == 0:
        raise ConfigError(
            f"setting client-num-gpus = {cfg.client_num_gpus} asks Ray for a GPU share per "
            "client, but this machine shows no CUDA device (torch.cuda.device_count() = 0, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}); "
            "use client-num-gpus = 0 to train on the CPU, or attach to a Ray cluster with GPUs "
            "(--ray-address).")
