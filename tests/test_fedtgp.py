"""FedTGP: K (d + 1) numbers up and C d down per client per round, the hand-computed
margin and loss, the server's training, and the prototypes' timing."""

import math

import numpy as np
import pytest
import torch

from fedapp.runtime.class_stats import class_means
from fedapp.runtime.strategy_base import ClientInfo, Upload
from strategies.fedtgp import FedTGPSettings
from strategies.fedtgp.maths import (TrainableGlobalPrototypes, adaptive_margin, margin_loss,
                                     train_tgp)
from tests.conftest import InProcessFederation, evaluate_on, recorded_federation, two_feature_model

D = 64
SMALL = dict(dataset="synthetic", synthetic_train=450, synthetic_test=90, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             model_width=0.25, feature_dim=D, **{"fedtgp.server-epochs": 5})


def test_prototypes_up_and_every_class_down_from_the_encoded_payloads(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedtgp", **SMALL)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    up = 10 * (D + 1) * 4   # K = 10 prototypes of d float32 and their int32 labels
    down = 10 * D * 4       # P[C x d], every class
    assert round1["bytes_up"] == round2["bytes_up"] == 3 * up
    assert round1["bytes_down"] == 0  # nothing before the first server step
    assert round2["bytes_down"] == 3 * down
    assert round1["eval_bytes_down"] > 3 * down  # the prototypes, with their framing


def test_hand_computed_margin_and_loss():
    q = np.array([[0, 0], [3, 4], [6, 8]], np.float32)
    delta, gaps = adaptive_margin(q, np.array([0, 1, 2]), 3, tau=100.0)
    assert delta == pytest.approx(5.0) and gaps == pytest.approx([5, 5, 5])
    # The TGP outputs Q: the loss of a class-0 prototype is ln(2 + e^-5) = 0.6965.
    loss = margin_loss(torch.from_numpy(q[:1]), torch.tensor([0]), torch.from_numpy(q), delta)
    assert loss.item() == pytest.approx(math.log(2 + math.exp(-5)), abs=1e-5)
    assert loss.item() == pytest.approx(0.6965, abs=1e-4)


def test_the_margin_is_capped_and_classes_without_a_neighbour_take_the_smallest_gap():
    q = np.array([[0, 0], [3, 4], [30, 40], [0, 0]], np.float32)
    labels = np.array([0, 1, 2, 0])  # class 0 twice (two clients), class 3 absent
    delta, gaps = adaptive_margin(q, labels, 4, tau=100.0)
    assert gaps == pytest.approx([5, 5, math.hypot(27, 36), 5])
    assert delta == pytest.approx(45.0)
    assert adaptive_margin(q, labels, 4, tau=10.0)[0] == 10.0
    assert adaptive_margin(q[:1], labels[:1], 4, tau=7.0)[0] == 7.0  # one class: tau


def test_distance_zero_gives_a_finite_gradient():
    centers = torch.zeros(3, 4, requires_grad=True)
    margin_loss(torch.zeros(1, 4), torch.tensor([0]), centers, 1.0).backward()
    assert torch.isfinite(centers.grad).all()


def test_server_training_separates_the_classes_by_the_margin():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 3)
    protos = (np.eye(4, 8)[labels] * 3 + 0.1 * rng.standard_normal((12, 8))).astype(np.float32)
    torch.manual_seed(0)
    tgp = TrainableGlobalPrototypes(4, 8)
    classes = torch.arange(4)
    x, y = torch.from_numpy(protos), torch.from_numpy(labels)
    before = margin_loss(x, y, tgp(classes), 1.0).item()
    train_tgp(tgp, protos, labels, 1.0, FedTGPSettings(server_epochs=50, server_lr=0.05), 1)
    with torch.no_grad():
        centers = tgp(classes)
        after = margin_loss(x, y, centers, 1.0).item()
        nearest = torch.cdist(x, centers).argmin(1)
    assert after < before / 2
    assert torch.equal(nearest, y)


def test_prototypes_after_training_by_default_before_it_with_the_code_parity_flag():
    for before in (False, True):
        fed = InProcessFederation("fedtgp", **SMALL,
                                  **{"fedtgp.pre-training-prototypes": before})
        client = fed.client(0)
        initial = class_means(client.model.features, client.model, client.data.train_x,
                              client.data.train_y, 10).means.copy()
        client.receive({}, 1)
        client.train(1)
        trained = class_means(client.model.features, client.model, client.data.train_x,
                              client.data.train_y, 10).means
        upload = client.upload()["prototypes"]
        np.testing.assert_array_equal(upload, initial if before else trained)
        assert not np.allclose(initial, trained)


def test_one_server_seed_gives_every_run_the_same_server_randomness():
    def server_round(seed, server_seed):
        fed = InProcessFederation("fedtgp", **SMALL, seed=seed,
                                  **{"fedtgp.server-seed": server_seed})
        start = [p.detach().clone() for p in fed.strategy.tgp.parameters()]
        prototypes = np.random.default_rng(0).normal(size=(20, D)).astype(np.float32)
        upload = {"prototypes": prototypes[:10], "labels": np.arange(10, dtype=np.int32)}
        fed.strategy.aggregate(1, [Upload(ClientInfo(0, "cnn5"), 1, upload, {})])
        return start, fed.strategy._payload["prototypes"]
    (a0, p0), (a1, p1) = server_round(0, 7), server_round(1, 7)
    assert all(torch.equal(x, y) for x, y in zip(a0, a1)) and np.array_equal(p0, p1)
    (b0, q0), (b1, q1) = server_round(0, -1), server_round(1, -1)  # the run's seed
    assert not torch.equal(b0[0], b1[0]) and not np.array_equal(q0, q1)


def test_the_papers_headline_is_the_nearest_global_prototype():
    fed = InProcessFederation("fedtgp", **SMALL, **{"fedtgp.eval-rule": "nearest-prototype"})
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    assert all("accuracy-own-head" in m for m in metrics.values())
    client = fed.client(0)
    payload = fed.strategy.eval_payload(1, None)
    assert payload["prototypes"].shape == (10, D)
    client.receive_for_evaluation(payload)
    assert client.evaluation_variants(client.data.test_x, client.data.test_y)[
        "nearest-prototype"] == metrics[0]["accuracy"]


@pytest.mark.parametrize("rule", ["nearest-prototype", "head"])
def test_the_headline_by_hand(rule):
    # Every class's global prototype (classes 3-9 far away); representations z = x
    # (two_feature_model), whose own head predicts class 0 everywhere.
    chosen = {} if rule == "head" else {"fedtgp.eval-rule": rule}  # the default: head
    fed = InProcessFederation("fedtgp", **SMALL, **chosen)
    c = fed.client(0).num_classes
    prototypes = np.array([[4, 0], [0, 4], [4, 4]] + [[100 + k, 100] for k in range(3, c)],
                          np.float32)
    points, labels = [(3, 0), (0, 3), (4, 3), (2.5, 2.5)], [0, 1, 2, 0]
    # Nearest: 0, 1, 2 (each 1.0 away), 2 (2.12 against 2.92 to classes 0 and 1): 3 of 4.
    m = evaluate_on(fed, two_feature_model(c), points, labels, {"prototypes": prototypes})
    nearest, own_head = 3 / 4, 2 / 4  # the own head: class 0 for all
    if rule == "nearest-prototype":
        assert m["accuracy"] == pytest.approx(nearest)
        assert m["accuracy-own-head"] == pytest.approx(own_head)
    else:
        assert m["accuracy"] == pytest.approx(own_head)
        assert m["accuracy-nearest-prototype"] == pytest.approx(nearest)


@pytest.mark.parametrize("method, key", [("fedtgp", "prototypes"), ("fedgh", "representations")])
def test_class_means_leave_out_the_short_last_batch_only_when_asked(method, key):
    # 150 samples a client, batches of 64: HtFLlib's prototype pass sees the first 128.
    settings = {k: v for k, v in SMALL.items() if method == "fedtgp" or "fedtgp" not in k}
    for drop in (False, True):
        client = InProcessFederation(method, **settings, batch_size=64,
                                      class_means_drop_last=drop).client(0)
        client.receive({}, 1)
        x, y = client.data.train_x, client.data.train_y
        assert len(y) == 150
        keep = 128 if drop else 150
        expected = class_means(client.model.features, client.model, x[:keep], y[:keep], 10)
        np.testing.assert_array_equal(client.upload()[key], expected.means)
    assert not np.array_equal(expected.means, class_means(client.model.features, client.model,
                                                          x, y, 10).means)
