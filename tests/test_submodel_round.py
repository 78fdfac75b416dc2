"""benchmarks/submodel_round.py's pieces: the bare loop trains exactly the sub-model the client
trains (the kit's parameter count at the rate; the entries and shapes the server sends, for
every method the script times), and the server's memory figure counts the round's uploads as
the kit sizes them."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from client_models.width import parameter_count
from fedapp.runtime.client_base import state_arrays
from fedapp.runtime.submodels import map_size
from tests.conftest import benchmark_script

TINY = {"dataset": "synthetic", "synthetic-shape": "1,8,8", "synthetic-train": 60,
        "synthetic-test": 20, "num-clients": 2, "max-samples-per-client": 0,
        "model-width": 0.125}  # HeteroFL's conv at 8-16-32-64 channels


@pytest.fixture(scope="module")
def bench():
    return benchmark_script("submodel_round")


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_the_bare_loop_trains_the_slice_the_client_receives(bench, method):
    rate = bench.WORKS[method].level("c")
    assert rate == Fraction(1, 4)
    cfg = bench.round_config(method, rate, 1, TINY)
    assert cfg.settings.client_rates(cfg, 1)[bench.PARTITION] == rate
    model = bench.slice_model(cfg, rate)
    held = map_size(bench.server_strategy(cfg).maps(bench.PARTITION, 1))
    full = parameter_count(bench.slice_model(cfg, Fraction(1)))
    assert parameter_count(model) == held < full
    # One round of each variant runs on the tiny work.
    threads = torch.get_num_threads()
    try:
        assert next(bench.bare(cfg, rate)) > 0 and next(bench.runtime(cfg)) > 0
    finally:
        torch.set_num_threads(threads)


def test_the_server_memory_counts_every_upload_at_its_slice_size(bench):
    cfg = bench.work_config({"method": "heterofl", **TINY, "num-clients": 5,
                             "heterofl.rates": "a1-b1-c1-d1-e1"})
    strategy = bench.server_strategy(cfg)
    sizes = sum(map_size(strategy.maps(pid, 1)) for pid in range(5))
    m = bench.server_memory(cfg)
    assert m["uploads"] == 4 * sizes
    assert m["global"] == 4 * map_size(strategy.maps(0, 1))  # client 0 holds rate a: all
    # Σ values and Σ counts in float64 over the global model at least.
    assert m["peak"] >= 4 * m["global"]


# Each method at a level below the whole model, with a global model the tiny input can take.
LOWER = {"heterofl": ("c", {}), "fedrolex": ("c", {}), "fjord": ("0.4", {}),
         "depthfl": ("2", {"depthfl.model": "cnn4"})}


@pytest.mark.parametrize("method", sorted(LOWER))
def test_the_bare_model_has_what_the_server_sends_at_every_method(bench, method):
    assert sorted(bench.WORKS) == sorted(LOWER)
    token, extra = LOWER[method]
    work = bench.WORKS[method]
    cfg = bench.round_config(method, work.level(token), 2, {**TINY, **extra})
    model = bench.slice_model(cfg, work.level(token))
    sent = work.sent(bench.server_strategy(cfg), bench.PARTITION, 1)
    assert {k: v.shape for k, v in state_arrays(model).items()} == \
        {k: v.shape for k, v in sent.items()}
    top = bench.slice_model(cfg, max(map(work.level, work.default_levels.split(","))))
    assert parameter_count(model) < parameter_count(top)
    # Two rounds of each variant run on the tiny work (the second with what the first kept).
    threads = torch.get_num_threads()
    try:
        assert all(t > 0 for t in bench.bare(cfg, work.level(token)))
        assert all(t > 0 for t in bench.runtime(cfg))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ["fjord", "depthfl"])
def test_the_server_memory_of_the_methods_with_their_own_mix(bench, method):
    extra = LOWER[method][1]
    cfg = bench.work_config({"method": method, **TINY, **extra, "num-clients": 5})
    strategy = bench.server_strategy(cfg)
    sent = [bench.WORKS[method].sent(strategy, pid, 1) for pid in range(5)]
    m = bench.server_memory(cfg)
    assert m["uploads"] == sum(v.nbytes for payload in sent for v in payload.values())
    assert m["global"] == sum(v.nbytes for v in strategy.global_model.values())
    assert 0 < m["peak"]
