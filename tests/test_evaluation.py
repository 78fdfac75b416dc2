"""Evaluation that costs what the user asks for: ``eval-every``, ``fraction-evaluate`` and
``eval-clients``; what was (not) evaluated is written down. That a skipped evaluation changes
nothing trained is checked for every method in test_checkpoint.py."""

from __future__ import annotations

from fedapp.runtime.results import Recorder
from tests.conftest import InProcessFederation
from tests.test_hostile_uploads import small_smoke_overrides


def _federation(method, tmp_path, name, rounds, **extra):
    overrides = {**small_smoke_overrides(method), "num_server_rounds": rounds,
                 "fraction_fit": 0.6, **extra}
    recorder = Recorder(tmp_path / name, method=method, dataset="synthetic", num_clients=3,
                        num_rounds=rounds, config={}, partition={})
    return InProcessFederation(method, recorder=recorder, **overrides)


def _asked(fed, rnd):
    fed.fit_round(rnd)
    return sorted(fed.evaluate_round(rnd))


def test_fraction_evaluate_draws_a_seeded_share_each_round(tmp_path):
    runs = [_federation("fedavg", tmp_path, f"run{i}", 8, num_clients=6, fraction_fit=0.5,
                        fraction_evaluate=0.5, arch_mix="cnn5") for i in range(2)]
    drawn = [[_asked(fed, rnd) for rnd in range(1, 9)] for fed in runs]
    assert drawn[0] == drawn[1]  # the same seed, the same clients
    assert all(len(pids) == 3 for pids in drawn[0])  # ceil(0.5 * 6)
    assert len({tuple(pids) for pids in drawn[0]}) > 1  # a new draw each round
    assert [h["evaluated"] for h in runs[0].strategy.recorder.history] == drawn[0]


def test_participants_only_evaluates_the_clients_that_trained(tmp_path):
    fed = _federation("fedavg", tmp_path, "p", 4, num_clients=6, fraction_fit=0.5,
                      eval_clients="participants", arch_mix="cnn5")
    for rnd in range(1, 5):
        trained = sorted(fed.fit_round(rnd))
        assert sorted(fed.evaluate_round(rnd)) == trained


def test_a_round_without_evaluation_still_reports_progress(tmp_path):
    fed = _federation("fedavg", tmp_path, "q", 2, eval_every=5, arch_mix="cnn5")
    fed.fit_round(1)
    fed.evaluate_round(1)
    record = fed.strategy.recorder.history[0]
    line = fed.strategy.recorder.record_round(dict(record, round=1))
    assert "accuracy not evaluated" in line and "clients 2/2" in line
    assert f"train loss {record['train_loss']:.4f}" in line and record["train_loss"] > 0
    assert record["accuracy_mean"] is None and record["evaluated"] == []
    assert record["eval_bytes_down"] == 0 and record["clients_fit"] == 2
    fed.fit_round(2)
    assert sorted(fed.evaluate_round(2)) == [0, 1, 2]  # the last round always is
    assert fed.strategy.recorder.summary()["evaluated_rounds"] == [2]


def test_a_test_sets_features_serve_every_head_with_the_same_numbers():
    # The client evaluates its own head, and a variant's head, on features it computed once:
    # over several batches (one of them short) the loss and accuracy equal, bit for bit,
    # those of the whole model evaluated as one module.
    import torch

    from client_models import build_model
    from fedapp.runtime.training import evaluate, evaluate_head, features_in_batches
    torch.manual_seed(0)
    model = build_model("cnn1", input_shape=(1, 28, 28), num_classes=10)
    x, y = torch.randn(1100, 1, 28, 28), torch.randint(0, 10, (1100,))
    features = features_in_batches(model, x)
    assert [len(z) for z in features] == [512, 512, 76]
    assert evaluate_head(model.head, features, y) == evaluate(model, x, y)
    other = torch.nn.Linear(model.head.in_features, 10)
    assert evaluate_head(other, features, y) == evaluate(
        torch.nn.Sequential(model.extractor, other), x, y)
    assert evaluate_head(model.head, [], y[:0]) == (0.0, 0.0)
