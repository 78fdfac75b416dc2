"""Shared test helpers: a run config from overrides, and hand-built Flower clients/replies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from flwr.common import (Code, EvaluateRes, FitRes, GetPropertiesRes, Status,
                         ndarrays_to_parameters)
from flwr.server import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedapp.runtime.payload import to_ndarrays
from strategies import get_method, load_config


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


def benchmark_script(name):
    """``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cfg_of(**overrides):
    """A validated RunConfig from keyword overrides (underscores for dashes), each set as
    ``--set`` sets it: the method's recipe fills only the training settings not given."""
    flat = {k.replace("_", "-"): v for k, v in overrides.items()}
    flat["explicit-settings"] = ",".join(f"{k}=set" for k in flat)
    return load_config(flat)


def make_strategy(method, recorder=None, input_shape=(1, 28, 28), num_classes=10, sizes=None,
                  **overrides):
    """A method's strategy for a run config of ``overrides``; ``sizes`` replaces the training-set
    sizes the server computes from the partition (what clients must claim as num_examples), so
    that hand-built replies can carry weights of the test's choosing."""
    cfg = cfg_of(method=method, **overrides)
    strategy = get_method(method).strategy(cfg, recorder, input_shape=input_shape,
                                           num_classes=num_classes)
    if sizes is not None:
        strategy.train_sizes = list(sizes)
    return strategy


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


class InProcessFederation:
    """A strategy and its real clients driven round by round in this process — what Flower
    does, minus Ray and the network — with every payload really encoded and decoded."""

    def __init__(self, method, **overrides):
        from flwr.app import Context, RecordDict
        self.strategy = make_strategy(method, **overrides)
        self.cfg = self.strategy.cfg
        self.manager, self.proxies = client_manager(self.strategy)
        n = self.cfg.num_clients
        self.contexts = [Context(run_id=11, node_id=pid, state=RecordDict(), run_config={},
                                 node_config={"partition-id": pid, "num-partitions": n})
                         for pid in range(n)]

    def client(self, pid):
        """A fresh client object for partition ``pid`` (Flower builds one per message)."""
        return get_method(self.cfg.method).client(self.contexts[pid], self.cfg)

    def fit_round(self, rnd, tamper=None):
        """One training round; ``tamper(pid, arrays)`` may replace what a client uploads.
        Returns {pid: (FitIns payload, uploaded payload)}."""
        from flwr.common import parameters_to_ndarrays
        from fedapp.runtime.payload import decode
        seen, results = {}, []
        for proxy, ins in self.strategy.configure_fit(rnd, None, self.manager):
            pid = proxy.identity["partition-id"]
            arrays, n, metrics = self.client(pid).fit(parameters_to_ndarrays(ins.parameters),
                                                      ins.config)
            if tamper is not None:
                arrays = tamper(pid, arrays)
            res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)
            seen[pid] = (decode(ins.parameters), res)
            results.append((proxy, res))
        self.strategy.aggregate_fit(rnd, results, [])
        return seen

    def assert_rejects(self, bad, reason, caplog, pid=0):
        """Round 1 with client ``pid``'s upload replaced by ``bad(upload)``: that upload is
        rejected with a logged ``reason`` and the round goes on with the others."""
        import logging
        from fedapp.runtime.payload import from_ndarrays

        def tamper(p, arrays):
            return to_ndarrays(bad(from_ndarrays(arrays))) if p == pid else arrays

        with caplog.at_level(logging.WARNING):
            self.fit_round(1, tamper=tamper)
        assert self.strategy._counts == {"clients_fit": self.cfg.num_clients - 1,
                                         "failures": 0, "rejected": 1}
        assert reason in caplog.text and "rejected the upload" in caplog.text

    def evaluate_round(self, rnd):
        """Evaluate the clients the strategy asks for; returns {pid: metrics}."""
        from flwr.common import parameters_to_ndarrays
        metrics, results = {}, []
        instructions = self.strategy.configure_evaluate(rnd, None, self.manager)
        if not instructions:
            return metrics  # as Flower: nobody asked, no aggregate_evaluate
        for proxy, ins in instructions:
            pid = proxy.identity["partition-id"]
            loss, n, m = self.client(pid).evaluate(parameters_to_ndarrays(ins.parameters),
                                                   ins.config)
            metrics[pid] = m
            results.append((proxy, EvaluateRes(Status(Code.OK, ""), loss, n, m)))
        self.strategy.aggregate_evaluate(rnd, results, [])
        return metrics


def two_feature_model(num_classes, head=None):
    """A model whose representation is its input: x [B, 1, 1, 2] -> z = (x1, x2), with the
    head ``head`` ({"weight": [C, 2], "bias": [C]}; default all zero, so its logits tie and
    it predicts class 0 everywhere). An evaluation on it can be worked out by hand."""
    import torch
    from client_models.base import HeteroModel
    model = HeteroModel("two-features", "two-features", (1, 1, 2), torch.nn.Flatten(), 2,
                        num_classes)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
        for name, value in (head or {}).items():
            getattr(model.head, name).copy_(torch.as_tensor(value, dtype=torch.float32))
    return model


def evaluate_on(fed, model, points, labels, payload, pid=0):
    """Client ``pid``'s own ``evaluate`` of what the server sent for evaluation (``payload``),
    with ``model`` and the test set (``points`` [n, 2], ``labels``) in place of its CNN and
    shard; its metrics."""
    import torch
    from fedapp.data.partitions import ClientData
    from fedapp.runtime import client_base
    client = fed.client(pid)
    x = torch.as_tensor(np.asarray(points, np.float32), device=client.device).reshape(-1, 1, 1, 2)
    y = torch.as_tensor(labels, dtype=torch.int64, device=client.device)
    model = model.to(client.device)
    client.__dict__.update(model=model, _version=0, global_test=None,
                           data=ClientData(x[:0], y[:0], x[:0], y[:0], x, y))
    try:
        return client.evaluate(to_ndarrays(payload), {"server-round": 1})[2]
    finally:  # the client keeps its evaluated model for the next message: not this one
        client_base._MODEL_CACHE.pop((fed.contexts[pid].run_id, fed.cfg, pid), None)


def recorded_federation(tmp_path, method, rounds=2, **overrides):
    """(an InProcessFederation of ``method``, the Recorder its server writes ``rounds`` rounds
    to under ``tmp_path``): for tests that read a run's traffic and accuracies as recorded."""
    from fedapp.runtime.results import Recorder
    recorder = Recorder(tmp_path / "run", method=method,
                        dataset=overrides.get("dataset", "synthetic"),
                        num_clients=overrides.get("num_clients", 3), num_rounds=rounds,
                        config={}, partition={})
    return InProcessFederation(method, recorder=recorder, **overrides), recorder


def recorded_rounds(tmp_path, method, rounds=2, **overrides):
    """(federation, recorder, [{pid: (payload sent, reply)} of each round]) after ``rounds``
    rounds of training and evaluation of :func:`recorded_federation`."""
    fed, recorder = recorded_federation(tmp_path, method, rounds=rounds,
                                        **{**overrides, "num_server_rounds": rounds})
    seen = []
    for rnd in range(1, rounds + 1):
        seen.append(fed.fit_round(rnd))
        fed.evaluate_round(rnd)
    return fed, recorder, seen


def assert_public_subset_traffic(recorder, m, c):
    """The exact traffic of a method that exchanges one table over m public samples (DS-FL,
    KT-pFL), as recorded in two rounds: up m*C float32 in each; down nothing in round 1 (no
    table yet), then m int32 indices + the m*C float32 table per client."""
    first, second = recorder.history
    clients = first["clients_sampled"]
    assert first["bytes_up"] == second["bytes_up"] == clients * m * c * 4
    assert first["bytes_down"] == 0
    assert second["bytes_down"] == clients * (m * 4 + m * c * 4)
    summary = recorder.summary()["communication"]
    assert summary["last_round_floats_per_client_up"] == m * c
    assert summary["last_round_floats_per_client_down"] == m + m * c
