"""The methods: one module each, registered here by the name the run config uses.

Adding a method = its module (a ``FedClient`` and a ``FedStrategy`` subclass), one line in
``METHODS`` and a preset in ``conf/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fedapp.client_base import FedClient
from fedapp.config import ConfigError, RunConfig, parse_run_config
from fedapp.strategy_base import FedStrategy
from strategies.fedavg import FedAvg, FedAvgClient
from strategies.lg_fedavg import LgFedAvg, LgFedAvgClient
from strategies.standalone import Standalone, StandaloneClient


@dataclass(frozen=True)
class Method:
    """A method's two halves and the constraints it puts on the federation."""

    summary: str
    strategy: type[FedStrategy]
    client: type[FedClient]
    homogeneous_only: bool = False  # every client must run the same architecture
    shared_head: bool = False       # the head is exchanged, so every d must be equal


METHODS: dict[str, Method] = {
    "standalone": Method("local training only; no communication (lower bound)",
                         Standalone, StandaloneClient),
    "fedavg": Method("average the whole model (homogeneous architectures only)",
                     FedAvg, FedAvgClient, homogeneous_only=True),
    "lg-fedavg": Method("average only the shared head; extractors stay local",
                        LgFedAvg, LgFedAvgClient, shared_head=True),
}


def method_keys(flat: Mapping[str, Any]) -> set[str]:
    """The namespaced keys (``<method>.<setting>``) of registered methods found in ``flat``."""
    return {k for k in flat if "." in k and k.split(".", 1)[0] in METHODS}


def load_config(flat: Mapping[str, Any]) -> RunConfig:
    """Validate a whole flat run config, method constraints included (before any training)."""
    cfg = parse_run_config(flat, method_keys=method_keys(flat))
    method = METHODS.get(cfg.method)
    if method is None:
        raise ConfigError(f"setting method = {cfg.method!r} is invalid: expected one of "
                          + ", ".join(repr(m) for m in METHODS) + ".")
    from fedapp.experiment import architectures  # models import torch; keep this module light
    try:
        archs = architectures(cfg)
    except ValueError as exc:  # ModelConfigError: unknown architecture or assignment
        raise ConfigError(f"setting arch-mix = {cfg.arch_mix!r} is invalid: {exc}") from None
    if method.homogeneous_only and len(set(archs)) > 1:
        raise ConfigError(
            f"method {cfg.method!r} averages whole models, so every client needs the same "
            f"architecture, but arch-mix = {cfg.arch_mix!r} gives {sorted(set(archs))}. Use "
            "one architecture (e.g. --set arch-mix=\"cnn1\") or a heterogeneous method "
            "(lg-fedavg, standalone).")
    if method.shared_head and cfg.feature_dim == 0 and len(set(archs)) > 1:
        raise ConfigError(
            f"method {cfg.method!r} shares the head, so every extractor must output the same "
            "dimension: set feature-dim > 0 (got 0 = each model's own) or use one architecture.")
    return cfg
