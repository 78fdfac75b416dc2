"""The client runtime in-process with real Flower Contexts: state, caching, determinism."""

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

import fedapp.runtime.client_base as client_base
from fedapp.config import ConfigError, client_cache_budget
from fedapp.data import setup
from fedapp.runtime.payload import from_ndarrays, to_ndarrays
from strategies import METHODS
from tests.conftest import cfg_of

SMOKE = dict(dataset="synthetic", synthetic_train=300, synthetic_test=100, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3")


def context(pid, n=3):
    return Context(run_id=7, node_id=pid, node_config={"partition-id": pid, "num-partitions": n},
                   state=RecordDict(), run_config={})


def client(method, ctx, **overrides):
    cfg = cfg_of(method=method, **{**SMOKE, **overrides})
    return METHODS[method].client(ctx, cfg)


def test_private_model_survives_the_client_object_and_the_process_cache():
    ctx = context(1)
    arrays, n, metrics = client("lg-fedavg", ctx).fit([], {"server-round": 1})
    assert n == 100 and metrics["partition-id"] == 1 and metrics["arch"] == "cnn4"
    trained = {k: v.clone() for k, v in client("lg-fedavg", ctx).model.state_dict().items()}
    client_base._MODEL_CACHE.clear()  # as if the next message ran in another process
    restored = client("lg-fedavg", ctx).model.state_dict()
    for k in trained:
        torch.testing.assert_close(restored[k], trained[k])
    assert set(from_ndarrays(arrays)) == {"head.weight", "head.bias"}


def test_the_process_caches_are_bounded_by_bytes_and_keep_the_newest():
    cache = client_base.BytesBoundedCache(10, size_of=len)
    cache.put("a", "xxxx")
    cache.put("b", "xxxx")
    assert cache.take("a") == "xxxx"  # now the most recently used: "b" goes first
    cache.put("c", "xxxx")
    assert list(cache) == ["a", "c"]
    assert cache.total == 8
    cache.put("huge", "x" * 50)  # larger than the budget: kept alone, the others evicted
    assert list(cache) == ["huge"] and cache.take("a") is None and cache.total == 50
    assert cache.pop("huge") == "x" * 50 and cache.total == 0 and len(cache) == 0


def test_the_cache_budget_comes_from_the_environment_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("FEDAPP_CLIENT_CACHE_MIB", raising=False)
    assert client_cache_budget() == 1 << 30
    monkeypatch.setenv("FEDAPP_CLIENT_CACHE_MIB", "0.5")
    assert client_cache_budget() == 1 << 19
    for bad in ("-1", "lots", "nan", "inf"):
        monkeypatch.setenv("FEDAPP_CLIENT_CACHE_MIB", bad)
        with pytest.raises(ConfigError, match="FEDAPP_CLIENT_CACHE_MIB"):
            client_cache_budget()


def test_a_process_serving_twenty_clients_keeps_all_their_shards_and_models():
    # One Ray actor serves every virtual client of its share, all fits of a round and then
    # all evaluations: a cache smaller than that share would rebuild a shard and a model
    # for every message.
    n = 20
    assert client_base._DATA_CACHE.budget >= 1 << 30, "FEDAPP_CLIENT_CACHE_MIB set low"
    client_base._MODEL_CACHE.clear()
    first, contexts = {}, [context(pid, n) for pid in range(n)]
    for pid in range(n):
        c = client("standalone", contexts[pid], num_clients=n)
        c.fit([], {"server-round": 1})
        first[pid] = (c.data, c.model)
    for pid in range(n):
        c = client("standalone", contexts[pid], num_clients=n)
        assert c.data is first[pid][0]
        assert c._restore_model() is first[pid][1]


@pytest.mark.parametrize("init", ["per-client", "per-architecture", "shared"])
def test_model_init_per_client_or_shared_by_the_clients_of_an_architecture(init):
    # Clients 0 and 3 of four get cnn5 (round-robin over three architectures).
    client_base._MODEL_CACHE.clear()
    weights = [client("lg-fedavg", context(pid, 4), num_clients=4, model_init=init)
               .model.state_dict()["head.weight"] for pid in (0, 3, 1)]
    assert torch.equal(weights[0], weights[1]) == (init != "per-client")
    assert weights[2].shape != weights[0].shape or not torch.equal(weights[2], weights[0])


@pytest.mark.parametrize("init", ["per-client", "per-architecture", "shared"])
def test_a_private_module_starts_as_the_model_init_says(init):
    # FedKD's W_h: each client's own draw, or one draw shared by every client (as HtFLlib's).
    client_base._MODEL_CACHE.clear()
    w_h = [client("fedkd", context(pid), model_init=init).modules["hidden"].weight
           for pid in (0, 1)]
    assert w_h[0].shape == w_h[1].shape
    assert torch.equal(w_h[0], w_h[1]) == (init != "per-client")


@pytest.mark.parametrize("init", ["per-client", "per-architecture", "shared"])
def test_a_shared_model_starts_as_its_architectures_clients_unless_per_client(init):
    # FedKD's mentee is the smallest of the mix, cnn5, which client 0 trains privately.
    client_base._MODEL_CACHE.clear()
    fedkd = client("fedkd", context(0), model_init=init)
    assert fedkd.arch == fedkd.shared.arch == "cnn5"
    same = [torch.equal(a, b) for a, b in zip(fedkd.model.state_dict().values(),
                                             fedkd.shared.state_dict().values())]
    assert all(same) == (init != "per-client") and any(same) == all(same)


@pytest.mark.parametrize("init", ["per-architecture", "shared"])
def test_shared_init_gives_architectures_that_begin_alike_the_same_first_layers(init):
    # HtFLlib seeds torch alike before building every model, so its CNNs that begin with the
    # same layers begin with the same weights: c1 and c1-512 share the convolution and the
    # Linear 4608 -> 512 after it, c2 only the convolution; c1-1024's first Linear holds
    # c1's as its first 512 rows (one stream of draws, row by row).
    cfg = cfg_of(**{**SMOKE, "arch_mix": "htfllib-cnn-c1,htfllib-cnn-c1-512,htfllib-cnn-c2,"
                    "htfllib-cnn-c1-1024", "feature_dim": 512, "model_init": init})
    c1, c1_512, c2, c1_1024 = (setup.new_model(cfg, arch, (1, 28, 28), 10)
                               for arch in cfg.architectures[:4])
    conv, fc = c1.extractor[0][0], c1.extractor[2]
    shared = init == "shared"
    assert torch.equal(conv.weight, c1_512.extractor[0][0].weight) == shared
    assert torch.equal(conv.weight, c2.extractor[0][0].weight) == shared
    assert torch.equal(fc.weight, c1_512.extractor[2].weight) == shared
    assert torch.equal(fc.weight, c1_1024.extractor[2].weight[:512]) == shared


def test_same_seed_same_result_whatever_the_order():
    def run(order):
        client_base._MODEL_CACHE.clear()
        ctxs = {pid: context(pid) for pid in range(3)}
        out = {}
        for rnd in (1, 2):
            for pid in order:
                arrays, _, _ = client("lg-fedavg", ctxs[pid]).fit([], {"server-round": rnd})
                out[(pid, rnd)] = from_ndarrays(arrays)["head.weight"]
        return out
    a, b = run([0, 1, 2]), run([2, 0, 1])
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_what_is_sent_for_evaluation_does_not_leak_into_training():
    ctx = context(0)
    c = client("fedavg", ctx, arch_mix="cnn5")
    c.fit([], {"server-round": 1})
    state = client("fedavg", ctx, arch_mix="cnn5").model.state_dict()
    saved = {k: v.clone() for k, v in state.items()}
    zeros = {k: np.zeros(v.shape, np.float32) for k, v in saved.items() if v.is_floating_point()}
    loss, n, metrics = client("fedavg", ctx, arch_mix="cnn5").evaluate(to_ndarrays(zeros), {})
    assert 0.0 <= metrics["accuracy"] <= 1.0
    after = client("fedavg", ctx, arch_mix="cnn5").model.state_dict()
    for k in saved:
        torch.testing.assert_close(after[k], saved[k])


def test_evaluation_reports_global_accuracy_when_asked():
    _, n, metrics = client("standalone", context(2), eval_global_test=True,
                           global_test_samples=50).evaluate([], {})
    assert n > 0 and 0 <= metrics["global-accuracy"] <= 1 and "global-loss" in metrics


def test_a_node_outside_the_federation_is_refused_clearly():
    with pytest.raises(ConfigError, match="num-supernodes=3"):
        client("standalone", context(0, n=5))
