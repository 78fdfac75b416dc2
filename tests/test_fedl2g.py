"""FedL2G: the meta-gradient against the spec's closed form, zero rows for absent classes, the
server's per-class mean, clipping and step, the warm-up, the traffic of the spec's formula and
one seed one result."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from client_models.base import HeteroModel
from fedapp.config import ConfigError
from fedapp.runtime.results import Recorder
from strategies.fedl2g.maths import GRADS, LABELS, meta_gradient
from tests.conftest import InProcessFederation, cfg_of, client_manager, fit_res, make_strategy
from tests.test_hostile_uploads import small_smoke_overrides

C = 10


def _linear_model(n_in, d):
    torch.manual_seed(3)
    extractor = nn.Sequential(nn.Flatten(), nn.Linear(n_in, d, bias=False))
    return HeteroModel("linear", "test", (1, 1, n_in), extractor, d, C)


def test_meta_gradient_of_a_linear_extractor_is_the_closed_form():
    # z = W x: G_c = (2 eta / (B d)) * sum_{i: y_i = c} sum_q (x_q . x_i) dL_q/dz_q, with
    # dL_q/dz_q taken at the look-ahead parameters theta' (spec, FedL2G's checks).
    n_in, d, eta = 7, 5, 0.3
    model = _linear_model(n_in, d)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(6, n_in, generator=g), torch.tensor([0, 2, 2, 5, 0, 7])
    xq, yq = torch.randn(4, n_in, generator=g), torch.tensor([1, 2, 3, 0])
    guide = torch.randn(C, d, generator=g)
    got = meta_gradient(model, guide, [(xs, ys)], [(xq, yq)], eta, "feat")

    # theta' by one plain SGD step on CE + MSE(z, V[y]) (first-order autograd only).
    params = dict(model.named_parameters())
    z = model.features(xs)
    study = F.cross_entropy(model.head(z), ys) + F.mse_loss(z, guide[ys])
    grads = torch.autograd.grad(study, list(params.values()))
    ahead = {k: (p - eta * gr).detach() for (k, p), gr in zip(params.items(), grads)}
    zq = (xq @ ahead["extractor.1.weight"].T).requires_grad_(True)
    quiz = F.cross_entropy(zq @ ahead["head.weight"].T + ahead["head.bias"], yq)
    (dl_dz,) = torch.autograd.grad(quiz, zq)                            # [Q, d]
    want = torch.zeros(C, d)
    for i, c in enumerate(ys.tolist()):
        want[c] += (xq @ xs[i]) @ dl_dz                                 # sum_q (x_q.x_i) dL/dz_q
    want *= 2 * eta / (len(ys) * d)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Classes absent from the study batch get exactly zero rows.
    absent = sorted(set(range(C)) - set(ys.tolist()))
    assert torch.count_nonzero(got[absent]) == 0
    assert all(torch.count_nonzero(got[c]) > 0 for c in set(ys.tolist()))


def test_logit_guides_and_the_model_is_left_untouched():
    model = _linear_model(7, 5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(6, 7), torch.tensor([0, 1, 1, 3, 3, 3])
    got = meta_gradient(model, torch.randn(C, C), [(x, y)], [(x[:3], y[:3])], 0.1, "logit")
    assert got.shape == (C, C) and torch.count_nonzero(got[[2, 4, 5, 6, 7, 8, 9]]) == 0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def _server(**extra):
    strategy = make_strategy("fedl2g", **{**small_smoke_overrides("fedl2g"),
                                          "fedl2g.variant": "logit", **extra})
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    return strategy, proxies


def _reply(strategy, pid, labels, grads):
    return fit_res({LABELS: np.array(labels, np.int32), GRADS: np.array(grads, np.float32)},
                   strategy.train_sizes[pid], pid, strategy.architectures[pid])


def test_server_averages_each_class_over_its_senders_then_steps():
    strategy, proxies = _server(**{"fedl2g.server-lr": 0.5})
    v0 = strategy.guide.clone()
    row = np.ones(C)
    strategy.aggregate_fit(1, [(proxies[0], _reply(strategy, 0, [0, 3], [row, 2 * row])),
                               (proxies[1], _reply(strategy, 1, [0], [3 * row]))], [])
    step = torch.zeros(C, C)
    step[0], step[3] = 2.0, 2.0       # class 0: mean(1, 3); class 3: 2 from its only sender
    torch.testing.assert_close(strategy.guide, v0 - 0.5 * step)


def test_server_clips_the_whole_matrix_to_norm_100():
    strategy, proxies = _server(**{"fedl2g.server-lr": 1.0})
    v0 = strategy.guide.clone()
    big = np.full(C, 100.0)           # two rows of norm 100 sqrt(10): total 100 sqrt(20)
    strategy.aggregate_fit(1, [(proxies[0], _reply(strategy, 0, [1, 2], [big, big]))], [])
    moved = v0 - strategy.guide
    assert float(moved.norm()) == pytest.approx(100.0, rel=1e-5)
    torch.testing.assert_close(moved[1], torch.full((C,), 100.0 / np.sqrt(20)))


def _federation(tmp_path, rounds=3, **extra):
    recorder = Recorder(tmp_path / "run", method="fedl2g", dataset="synthetic", num_clients=3,
                        num_rounds=rounds, config={}, partition={})
    overrides = {**small_smoke_overrides("fedl2g"), "num_server_rounds": rounds, **extra}
    return InProcessFederation("fedl2g", recorder=recorder, **overrides), recorder


@pytest.mark.parametrize("variant, m", [("feat", 64), ("logit", C)])
def test_traffic_per_client_per_round_is_the_specs_formula(tmp_path, variant, m):
    # Study batches cover the whole study set, so each client sends one row per class it
    # holds outside its quiz set: S (m + 1) numbers up (the labels as 32 bits), C m down.
    fed, recorder = _federation(tmp_path, **{"fedl2g.study-batches": 100,
                                             "fedl2g.variant": variant})
    classes = []
    for pid in range(3):
        client = fed.client(pid)
        _, study = client.quiz_split()
        classes.append(len(set(client.data.train_y[study].tolist())))
    for rnd in (1, 2, 3):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    assert len(recorder.history) == 3
    for record in recorder.history:
        assert record["bytes_down"] == 3 * 4 * C * m
        assert record["bytes_up"] == sum(4 * s * (m + 1) for s in classes)


def test_warmup_trains_nothing_and_evaluates_nobody(tmp_path):
    fed, recorder = _federation(tmp_path, **{"fedl2g.warmup-fraction": 0.7})  # 2 of 3
    initial = {k: v.clone() for k, v in fed.client(0).model.state_dict().items()}
    guide = fed.strategy.guide.clone()
    for rnd in (1, 2):
        fed.fit_round(rnd)
        assert fed.evaluate_round(rnd) == {}
    for k, v in fed.client(0).model.state_dict().items():
        torch.testing.assert_close(v, initial[k], rtol=0, atol=0)
    assert not torch.equal(fed.strategy.guide, guide)     # V learnt during the warm-up
    fed.fit_round(3)
    assert fed.evaluate_round(3)
    assert any(not torch.equal(v, initial[k])
               for k, v in fed.client(0).model.state_dict().items())


def test_a_warmup_as_long_as_the_run_is_refused():
    with pytest.raises(ConfigError, match="warmup-fraction = 1.0 is invalid"):
        cfg_of(method="fedl2g", num_server_rounds=2, **{"fedl2g.warmup-fraction": 1.0})
    assert cfg_of(method="fedl2g", num_server_rounds=2000).settings.warmup_rounds(2000) == 50


def test_one_seed_one_result(tmp_path):
    guides = []
    for name in ("a", "b"):
        fed, _ = _federation(tmp_path / name)
        for rnd in (1, 2, 3):
            fed.fit_round(rnd)
        guides.append(fed.strategy.guide)
    torch.testing.assert_close(guides[0], guides[1], rtol=0, atol=0)


@pytest.mark.parametrize("quiz_set", ["random", "first"])
def test_the_quiz_set_is_held_out_and_htfllibs_takes_the_first_samples(tmp_path, quiz_set):
    fed, _ = _federation(tmp_path, **{"fedl2g.quiz-set": quiz_set})
    client = fed.client(0)
    quiz, study = client.quiz_split()
    n, size = len(client.data.train_y), fed.strategy.cfg.batch_size
    assert sorted(torch.cat([quiz, study]).tolist()) == list(range(n)) and len(quiz) == size
    in_order = torch.equal(torch.cat([quiz, study]).cpu(), torch.arange(n))
    assert in_order == (quiz_set == "first")


def test_a_guide_seed_gives_every_run_htfllibs_embedding():
    # HtFLlib: torch re-seeded with 0 by its last client, then nn.Embedding(C, d).
    torch.manual_seed(0)
    htfllib = nn.Embedding(C, C).weight.detach()
    fixed = [_server(seed=s, **{"fedl2g.guide-seed": 0})[0].guide for s in (0, 1)]
    keyed = [_server(seed=s)[0].guide for s in (0, 1)]
    assert all(torch.equal(g, htfllib) for g in fixed)
    assert not torch.equal(keyed[0], keyed[1]) and not torch.equal(keyed[0], htfllib)
