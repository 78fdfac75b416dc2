"""Shared test helpers: a run config from overrides, and hand-built Flower clients/replies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters
from flwr.server import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedapp.payload import to_ndarrays
from strategies import METHODS, load_config


class FakeProxy(ClientProxy):
    """A client the strategy can address; Flower never calls it in these tests."""

    def get_properties(self, *a, **k): raise NotImplementedError
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


def client_manager(n):
    manager = SimpleClientManager()
    proxies = [FakeProxy(cid=f"node-{i}") for i in range(n)]
    for p in proxies:
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
