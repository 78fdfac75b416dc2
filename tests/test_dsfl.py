"""DS-FL: ERA by hand, the server's mean and checks, the exact traffic, the server model's
distillation and evaluation, and what the server keeps. Hostile uploads, checkpoints and one
seed one result are covered for every method (test_hostile_uploads.py, test_checkpoint.py,
test_determinism.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fedapp.data import setup
from strategies.dsfl.maths import (distillation_loss, entropy_reduction, largest_architecture,
                                   open_set)
from tests.conftest import (assert_public_subset_traffic, client_manager, fit_res, make_strategy,
                            recorded_rounds)
from tests.test_hostile_uploads import small_smoke_overrides

M = 16  # dsfl.open-size of the smoke preset
C = 10


def _entropy(p):
    p = np.asarray(p, np.float64)
    return float(-(p * np.log(p)).sum())


# -- ERA and the loss, by hand --------------------------------------------------------------------
def test_era_sharpens_the_mean_as_the_paper_says():
    q = entropy_reduction(np.array([[0.6, 0.4]]), 0.1)[0]
    # softmax((6, 4)) = (e^2, 1) / (e^2 + 1)
    np.testing.assert_allclose(q, [0.8808, 0.1192], atol=1e-4)
    assert _entropy([0.6, 0.4]) == pytest.approx(0.673, abs=1e-3)
    assert _entropy(q) == pytest.approx(0.365, abs=1e-3)


def test_a_uniform_mean_stays_uniform_and_t_1_flattens():
    np.testing.assert_allclose(entropy_reduction(np.full((3, 4), 0.25), 0.1), 0.25, atol=1e-7)
    flat = entropy_reduction(np.array([[0.6, 0.4]]), 1.0)[0]
    assert _entropy(flat) > _entropy([0.6, 0.4])  # T = 1 would raise the entropy


def test_the_distillation_loss_is_the_batch_mean_kl_to_q():
    zero = torch.zeros(2, 2)
    assert float(distillation_loss(zero, torch.full((2, 2), 0.5))) == pytest.approx(0.0)
    # KL((1, 0) || (1/2, 1/2)) = log 2 per sample; the batch mean of two equal ones is log 2.
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert float(distillation_loss(zero, q)) == pytest.approx(np.log(2))


# -- the server ------------------------------------------------------------------------------------
def _strategy(**extra):
    return make_strategy("dsfl", **{**small_smoke_overrides("dsfl"), **extra})


def _round(strategy, uploads, rnd=1):
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(rnd, None, manager)
    results = [(proxies[pid], fit_res({"probabilities": p}, strategy.train_sizes[pid], pid,
                                      strategy.architectures[pid]))
               for pid, p in enumerate(uploads)]
    strategy.aggregate_fit(rnd, results, [])
    return strategy


def _uploads(seed=0, k=3):
    rng = np.random.default_rng(seed)
    return [rng.dirichlet(np.ones(C), size=M).astype(np.float32) for _ in range(k)]


@pytest.mark.parametrize("aggregation", ["era", "sa"])
def test_the_server_averages_over_the_senders_then_applies_its_rule(aggregation):
    uploads = _uploads()
    strategy = _round(_strategy(**{"dsfl.aggregation": aggregation}), uploads)
    mean = np.mean(np.stack(uploads).astype(np.float64), axis=0)
    want = mean if aggregation == "sa" else \
        np.exp(mean / 0.1) / np.exp(mean / 0.1).sum(1, keepdims=True)
    sent = strategy.fit_payload(2, None)
    np.testing.assert_allclose(sent["soft-labels"], want, rtol=1e-5, atol=1e-7)
    assert sent["soft-labels"].dtype == np.float32
    # The indices of the round's open subset, as every client draws them.
    public_size = len(setup.public_set(strategy.cfg, labels=False))
    np.testing.assert_array_equal(sent["indices"], open_set(strategy.cfg.seed, 1, public_size, M))
    assert sent["indices"].dtype == np.int32


def test_open_subsets_are_keyed_by_seed_and_round():
    a = open_set(3, 1, 100, 16)
    assert np.array_equal(a, open_set(3, 1, 100, 16)) and len(np.unique(a)) == 16
    assert not np.array_equal(a, open_set(3, 2, 100, 16))
    assert not np.array_equal(a, open_set(4, 1, 100, 16))


@pytest.mark.parametrize("bad,reason", [
    (lambda p: p * 2, "sums to"),
    (lambda p: np.where(np.arange(C) == 0, -0.1, p + 0.1 / (C - 1)).astype(np.float32),
     "outside [0, 1]"),
])
def test_uploads_that_are_not_probability_vectors_are_refused(bad, reason, caplog):
    uploads = _uploads()
    uploads[2] = bad(uploads[2])
    with caplog.at_level(logging.WARNING):
        strategy = _round(_strategy(), uploads)
    assert strategy._counts["rejected"] == 1 and reason in caplog.text


def test_the_server_model_distillation_lowers_its_kl_to_q():
    strategy = _strategy(**{"dsfl.kd-epochs": 3, "dsfl.kd-batch-size": 4})
    indices = open_set(strategy.cfg.seed, 1, strategy.public_size, M)
    q = entropy_reduction(np.stack(_uploads(k=1))[0], 0.1)  # sharp, far from the start
    x = setup.public_set(strategy.cfg, labels=False).x[torch.from_numpy(indices.astype(np.int64))]

    def kl():
        with torch.no_grad():
            strategy.server_model.eval()
            return float(distillation_loss(strategy.server_model(x), torch.from_numpy(q)))
    before = kl()
    stats = strategy.distil_server_model(1, indices, q)
    assert stats.steps == 3 * 4  # 3 passes of 16 samples in batches of 4
    assert kl() < before


def test_the_server_keeps_one_round_of_soft_labels_whatever_the_rounds():
    strategy = _strategy()
    sizes = []
    for rnd in (1, 2, 3):
        _round(strategy, _uploads(seed=rnd), rnd)
        state = strategy.method_state()
        sizes.append(sum(v.nbytes for v in state["payload"].values()))
        assert not [k for k, v in state.items() if isinstance(v, (list, dict)) and k != "payload"]
    assert sizes == [M * 4 + M * C * 4] * 3  # no upload kept beyond the round's mean


def test_the_server_model_is_the_largest_architecture_unless_named():
    strategy = _strategy()
    params = {a: sum(p.numel() for p in strategy.new_model(a).parameters())
              for a in ("cnn5", "cnn4", "cnn3")}
    assert strategy.server_arch == max(params, key=params.get) == largest_architecture(strategy)
    assert _strategy(**{"dsfl.server-arch": "cnn5"}).server_model.arch == "cnn5"


# -- a federation: traffic, order, server accuracy -----------------------------------------------
@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    return recorded_rounds(tmp_path_factory.mktemp("dsfl"), "dsfl", rounds=2,
                           **small_smoke_overrides("dsfl"))


def test_exact_traffic_per_client_per_round(two_rounds):
    # up: the probabilities; down from round 2: the indices of the open subset + q
    assert_public_subset_traffic(two_rounds[1], M, C)


def test_clients_distil_from_round_2_and_upload_probabilities_on_the_open_subset(two_rounds):
    fed, _, seen = two_rounds
    from fedapp.runtime.payload import decode
    for rnd, round_seen in enumerate(seen, start=1):
        for pid, (sent, res) in round_seen.items():
            assert ("term-distil" in res.metrics) == (rnd == 2)
            p = decode(res.parameters)["probabilities"]
            assert p.shape == (M, C)
            np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-5)
    sent = seen[1][0][0]
    public_size = len(setup.public_set(fed.cfg, labels=False))
    np.testing.assert_array_equal(sent["indices"], open_set(fed.cfg.seed, 1, public_size, M))


def test_the_server_model_is_scored_on_every_evaluated_round(two_rounds):
    fed, recorder, _ = two_rounds
    x, y = setup.global_test(fed.cfg)
    with torch.no_grad():
        fed.strategy.server_model.eval()
        want = float((fed.strategy.server_model(x).argmax(1) == y).float().mean())
    assert [list(h["server_accuracy"]) for h in recorder.history] == [["server"]] * 2
    assert recorder.history[-1]["server_accuracy"]["server"] == pytest.approx(want)
    assert recorder.summary()["accuracy"]["server"] == {"server": pytest.approx(want)}
