"""Shared test helpers: a run config from overrides, and hand-built Flower clients/replies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import (Code, EvaluateRes, FitRes, GetPropertiesRes, Status,
                         ndarrays_to_parameters)
from flwr.server import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedapp.payload import to_ndarrays
from strategies import METHODS, load_config


class FakeProxy(ClientProxy):
    """A client the strategy can address; it only answers "who are you?"."""

    def __init__(self, cid, identity):
        super().__init__(cid)
        self.identity = identity

    def get_properties(self, *a, **k):
        if self.identity is None:
            raise RuntimeError("this client crashed")
        return GetPropertiesRes(Status(Code.OK, ""), self.identity)

    def get_parameters(self, *a, **k): raise NotImplementedError
    def fit(self, *a, **k): raise NotImplementedError
    def evaluate(self, *a, **k): raise NotImplementedError
    def reconnect(self, *a, **k): raise NotImplementedError


def cfg_of(**overrides):
    """A validated RunConfig from keyword overrides (underscores for dashes)."""
    return load_config({k.replace("_", "-"): v for k, v in overrides.items()})


def make_strategy(method, recorder=None, input_shape=(1, 28, 28), num_classes=10, **overrides):
    cfg = cfg_of(method=method, **overrides)
    return METHODS[method].strategy(cfg, recorder, input_shape=input_shape,
                                    num_classes=num_classes)


def client_manager(strategy, identities=None):
    """Register one fake client per partition of ``strategy``'s run, in a shuffled node order
    (as Flower's random node ids would be); proxies are returned by partition id."""
    archs = strategy.architectures
    identities = identities or [{"partition-id": i, "arch": a} for i, a in enumerate(archs)]
    proxies = [FakeProxy(f"node-{(i * 7919) % 1000:03d}", ident)
               for i, ident in enumerate(identities)]
    manager = SimpleClientManager()
    for p in reversed(proxies):
        manager.register(p)
    return manager, proxies


def fit_res(payload, num_examples, pid, arch, raw_arrays=None):
    """A FitRes as a NumPyClient would return it (raw_arrays: send this list instead)."""
    arrays = raw_arrays if raw_arrays is not None else to_ndarrays(payload)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), num_examples,
                  {"partition-id": pid, "arch": arch})


def eval_res(pid, arch, accuracy):
    return EvaluateRes(Status(Code.OK, ""), 0.5, 10,
                       {"partition-id": pid, "arch": arch, "accuracy": accuracy})


@pytest.fixture
def rng():
    return np.random.default_rng(0)
