"""FedDF: the hand-computed ensemble targets and losses, the uniform per-architecture average, an
absent architecture left alone, the whole model each way, a distillation step towards the
ensemble, early stopping, and the server's predictions being its distilled models'."""

import math

import numpy as np
import pytest
import torch

from fedapp.config import ConfigError
from fedapp.data import setup
from fedapp.data.local_data import expected_input
from fedapp.runtime.aggregate import weighted_average
from fedapp.runtime.client_base import state_arrays
from fedapp.seeding import derive_seed, isolated_rng
from strategies.feddf import FedDFSettings
from strategies.feddf.maths import distil, distillation_loss, ensemble_target
from tests.conftest import (cfg_of, client_manager, fit_res, make_strategy,
                            recorded_federation)

# Three clients on two architectures (cnn1 twice), a train-holdout public set.
SMALL = dict(dataset="synthetic", synthetic_train=240, synthetic_test=60, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn1,cnn1,cnn2",
             model_width=0.25, feature_dim=32, public_source="train-holdout")
TEACHERS = torch.tensor([[[4.0, 0.0]], [[0.0, 0.0]]])  # K = 2 teachers, one sample, C = 2


def test_ensemble_targets_by_hand():
    # avg-logits: softmax of the mean logits (2, 0) = (e^2, 1) / (e^2 + 1).
    torch.testing.assert_close(ensemble_target(TEACHERS, "avg-logits", 1.0),
                               torch.tensor([[0.880797, 0.119203]]))
    # avg-probs: the mean of (0.982, 0.018) and (0.5, 0.5).
    torch.testing.assert_close(ensemble_target(TEACHERS, "avg-probs", 1.0),
                               torch.tensor([[0.741007, 0.258993]]))
    # T = 2 softens the mean logits to (1, 0).
    torch.testing.assert_close(ensemble_target(TEACHERS, "avg-logits", 2.0),
                               torch.tensor([[0.731059, 0.268941]]))


def test_losses_by_hand():
    student = torch.zeros(1, 2)  # uniform: KL(p || u) = sum p log(2 p)
    kl = lambda p: sum(q * math.log(2 * q) for q in p)  # noqa: E731
    assert distillation_loss(student, TEACHERS, "avg-logits", 1.0).item() == \
        pytest.approx(kl([0.880797, 0.119203]), rel=1e-5)
    assert distillation_loss(student, TEACHERS, "avg-probs", 1.0).item() == \
        pytest.approx(kl([0.741007, 0.258993]), rel=1e-5)
    # avg-losses: the mean of one KL per teacher; the second teacher is uniform, so 0.
    assert distillation_loss(student, TEACHERS, "avg-losses", 1.0).item() == \
        pytest.approx(kl([0.982014, 0.017986]) / 2, rel=1e-5)
    # Batch mean, not a sum over the batch, and no T^2 factor.
    two = distillation_loss(torch.zeros(2, 2), TEACHERS.expand(2, 2, 2), "avg-logits", 1.0)
    assert two.item() == pytest.approx(kl([0.880797, 0.119203]), rel=1e-5)


@pytest.mark.parametrize("kind", ["avg-logits", "avg-probs", "avg-losses"])
def test_one_teacher_equal_to_the_student_gives_zero_loss_and_gradient(kind):
    logits = torch.tensor([[1.5, -0.3, 0.2], [0.0, 2.0, -1.0]])
    student = logits.clone().requires_grad_(True)
    loss = distillation_loss(student, logits[None], kind, 3.0)
    loss.backward()
    assert abs(loss.item()) < 1e-6
    torch.testing.assert_close(student.grad, torch.zeros_like(logits), atol=1e-7, rtol=0)


def _linear(weight, bias):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    return model


def test_distillation_moves_the_student_towards_the_ensemble():
    teachers = [_linear([[2.0, 0.0], [0.0, 0.0]], [1.0, 0.0]),
                _linear([[0.0, 0.0], [0.0, 2.0]], [0.0, -1.0])]
    student = _linear([[0.0, 1.0], [1.0, 0.0]], [0.0, 0.0])
    x = torch.randn(32, 2, generator=torch.Generator().manual_seed(0))

    def gap():
        with torch.no_grad():
            return distillation_loss(student(x), torch.stack([t(x) for t in teachers]),
                                     "avg-logits", 1.0).item()
    before = gap()
    done = distil(student, teachers, x, FedDFSettings(server_steps=30, server_lr=0.05), 8, 0)
    assert done["steps"] == 30 and done["skipped"] == 0
    assert gap() < 0.5 * before
    # The teachers are frozen and untouched.
    assert not any(p.requires_grad for t in teachers for p in t.parameters())
    torch.testing.assert_close(teachers[0].weight, torch.tensor([[2.0, 0.0], [0.0, 0.0]]))


def test_steps_a_broken_teacher_makes_non_finite_are_skipped():
    # A teacher whose outputs are NaN (e.g. a negative BatchNorm variance in eval mode).
    teachers = [_linear([[math.nan, 0.0], [0.0, 0.0]], [0.0, 0.0])]
    student = _linear([[0.0, 1.0], [1.0, 0.0]], [0.0, 0.0])
    done = distil(student, teachers, torch.ones(8, 2), FedDFSettings(server_steps=3), 4, 0)
    assert done["skipped"] == 3 and math.isnan(done["loss"])
    torch.testing.assert_close(student.weight, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_early_stopping_keeps_the_best_validated_student():
    teachers = [_linear([[2.0, 0.0], [0.0, 0.0]], [1.0, 0.0])]
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(1))
    empty = (x[:0], torch.zeros(0, dtype=torch.int64))  # accuracy 0 at every validation

    def run(steps, validation):
        student = _linear([[0.0, 1.0], [1.0, 0.0]], [0.0, 0.0])
        s = FedDFSettings(server_steps=steps, validation_every=1, early_stopping_patience=2)
        return student, distil(student, teachers, x, s, 4, 0, validation)
    stopped, done = run(10, empty)
    # No improvement after the first validation: stops 2 steps later, back at step 1.
    assert done["steps"] == 3
    one_step, _ = run(1, None)  # the cosine schedule's first step is at the full rate
    torch.testing.assert_close(stopped.weight, one_step.weight)
    last, done = run(10, None)
    assert done["steps"] == 10 and not torch.equal(last.weight, stopped.weight)


def test_early_stopping_needs_labelled_public_samples():
    with pytest.raises(ConfigError, match="public-labels = 'labelled'"):
        cfg_of(method="feddf", **SMALL, **{"feddf.early_stopping": True})
    with pytest.raises(ConfigError, match="digits"):
        cfg_of(method="feddf", **{**SMALL, "public_source": "digits"},
               public_labels="labelled", **{"feddf.early_stopping": True})
    with pytest.raises(ConfigError, match="needs a public set"):
        cfg_of(method="feddf", **{**SMALL, "public_source": "none"})
    # Krum within each architecture needs more than 2f + 2 of its clients: cnn1 has two.
    with pytest.raises(ConfigError, match="cnn1 has 2 clients, cnn2 has 1"):
        cfg_of(method="feddf", **SMALL, robust_aggregation="krum")
    strategy = make_strategy("feddf", **SMALL, public_labels="labelled",
                             **{"feddf.early_stopping": True, "feddf.server_steps": 3,
                                "feddf.validation_every": 1})
    public_x, (val_x, val_y) = strategy.public_split()
    assert len(val_x) == len(val_y) == round(0.1 * (len(public_x) + len(val_x)))


def _model(strategy, arch, seed_part):
    """Hand-built uploads: the model of ``arch`` from its own initial weights."""
    return state_arrays(setup.new_model(strategy.cfg, arch, strategy.input_shape,
                                        strategy.num_classes, "upload", seed_part))


def _round(strategy, uploads, sizes, rnd=1):
    """Round ``rnd``'s aggregation of ``uploads`` {pid: payload} from clients claiming
    ``sizes``."""
    strategy.train_sizes = sizes
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(rnd, None, manager)
    archs = strategy.architectures
    strategy.aggregate_fit(rnd, [(proxies[p], fit_res(u, sizes[p], p, archs[p]))
                               for p, u in uploads.items()], [])
    assert strategy._counts["rejected"] == 0


@pytest.mark.parametrize("average,weights", [("uniform", [1, 1]), ("samples", [30, 90])])
def test_the_group_average_is_uniform_by_default(average, weights):
    overrides = {**SMALL, "feddf.server_steps": 0}
    if average != "uniform":
        overrides["feddf.average"] = average
    strategy = make_strategy("feddf", **overrides)
    uploads = {0: _model(strategy, "cnn1", 0), 1: _model(strategy, "cnn1", 1)}
    _round(strategy, uploads, [30, 90, 60])
    want = weighted_average([uploads[0], uploads[1]], weights)
    got = strategy.models["cnn1"]
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def test_an_architecture_absent_this_round_is_untouched():
    strategy = make_strategy("feddf", **SMALL, **{"feddf.server_steps": 3})
    before = {arch: dict(m) for arch, m in strategy.models.items()}
    _round(strategy, {0: _model(strategy, "cnn1", 0), 1: _model(strategy, "cnn1", 1)},
           [30, 90, 60])
    assert set(strategy.distillation) == {"cnn1"}
    assert all(np.array_equal(strategy.models["cnn2"][k], before["cnn2"][k])
               for k in before["cnn2"])
    assert not all(np.array_equal(strategy.models["cnn1"][k], before["cnn1"][k])
                   for k in before["cnn1"])


def test_server_predict_gives_each_distilled_models_logits():
    strategy = make_strategy("feddf", **SMALL, **{"feddf.server_steps": 3})
    uploads = {p: _model(strategy, a, p) for p, a in enumerate(strategy.architectures)}
    _round(strategy, uploads, [80, 80, 80])
    cfg, x = strategy.cfg, torch.randn(7, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    got = strategy.server_predict(x)
    assert set(got) == {"cnn1", "cnn2"}
    public_x = setup.public_set(cfg, labels=False).x
    for arch in ("cnn1", "cnn2"):
        assert got[arch].shape == (7, 10) and not got[arch].requires_grad
        # The same distillation by hand: the uniform average of the architecture's uploads,
        # distilled from all three uploads with the round's keyed streams.
        mine = [u for p, u in uploads.items() if strategy.architectures[p] == arch]
        student = strategy.module(arch, weighted_average(mine, [1.0] * len(mine)))
        teachers = [strategy.module(strategy.architectures[p], u) for p, u in uploads.items()]
        with isolated_rng(derive_seed(cfg.seed, "feddf-distillation", 1, arch)):
            distil(student, teachers, public_x, strategy.settings, cfg.batch_size,
                   derive_seed(cfg.seed, "feddf-batches", 1, arch))
        with torch.no_grad():
            torch.testing.assert_close(got[arch], student.eval()(x))
    # Distilled, not merely averaged; and a new round's models replace the cached ones.
    plain = strategy.module("cnn2", uploads[2]).eval()
    assert not torch.allclose(got["cnn2"], plain(x))
    _round(strategy, uploads, [80, 80, 80], rnd=2)
    assert not torch.equal(strategy.server_predict(x)["cnn1"], got["cnn1"])


def test_the_whole_model_of_its_architecture_each_way(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "feddf", **SMALL,
                                        **{"feddf.server_steps": 2})
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    cfg = fed.cfg
    size = {arch: sum(v.numel() * v.element_size() for v in setup.new_model(
        cfg, arch, *expected_input(cfg)).state_dict().values()) for arch in ("cnn1", "cnn2")}
    per_round = 2 * size["cnn1"] + size["cnn2"]
    for record in recorder.history:
        assert record["bytes_up"] == record["bytes_down"] == per_round
        # Each client evaluates its architecture's server model: the same messages again.
        assert record["eval_bytes_down"] == record["bytes_down"] + record["framing_down"]
