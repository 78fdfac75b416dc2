"""FedGH: the paper's traffic, exact local averaged representations, the server's header
training, both evaluated headers, and rejection of bad uploads."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.config import ConfigError
from flwr.common import parameters_to_ndarrays

from fedapp.runtime.payload import from_ndarrays
from strategies import load_config
from strategies.fedgh import FedGHSettings
from strategies.fedgh.maths import train_header
from tests.conftest import InProcessFederation, evaluate_on, recorded_federation, two_feature_model

# Paper shapes: d = 500, C = 10, two classes per client (FedGH Table 3, CIFAR-10 column).
PAPER = dict(dataset="synthetic", synthetic_train=600, synthetic_test=200, num_clients=3,
             partition="pathological", classes_per_client=2, max_samples_per_client=0,
             arch_mix="cnn5,cnn4,cnn3", feature_dim=500)


def test_paper_traffic_1002_up_5010_down_from_the_encoded_payloads(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedgh", num_server_rounds=2, **PAPER)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    # Round 1: clients train with their own random headers; nothing is sent.
    assert round1["bytes_down"] == 0
    for record in (round1, round2):
        assert record["bytes_up"] == 3 * 1002 * 4        # 2 x (500 + 1), label as 32 bits
        assert 0 < record["framing_up"] < 3 * 600        # npy headers and names, apart
    assert round2["bytes_down"] == 3 * 5010 * 4          # the global header, 500 x 10 + 10
    com = recorder.summary()["communication"]
    assert com["last_round_floats_per_client_up"] == 1002
    assert com["last_round_floats_per_client_down"] == 5010


def test_local_averaged_representations_are_exact_class_means_after_training():
    fed = InProcessFederation("fedgh", **PAPER)
    uploads = fed.fit_round(1)
    client = fed.client(0)
    model, data = client.model, client.data
    model.eval()
    with torch.no_grad():
        z = model.features(data.train_x)
    payload = from_ndarrays(parameters_to_ndarrays(uploads[0][1].parameters))  # as uploaded
    labels = sorted(set(data.train_y.tolist()))
    assert payload["labels"].tolist() == labels and payload["labels"].dtype == np.int32
    for row, c in zip(payload["representations"], labels):
        np.testing.assert_allclose(row, z[data.train_y == c].mean(0).cpu().numpy(), rtol=1e-4,
                                   atol=1e-5)


def test_clients_install_the_global_header_before_training():
    fed = InProcessFederation("fedgh", **PAPER)
    fed.fit_round(1)
    sent = fed.fit_round(2)
    header = fed.strategy._payload
    for pid, (payload, _) in sent.items():
        assert set(payload) == {"head.weight", "head.bias"}
    # The server header moved away from its initial weights (it was trained on the LARs).
    init = fed.strategy.new_model(fed.strategy.architectures[0]).head.weight.detach().numpy()
    assert not np.allclose(header["head.weight"], init)


def test_pooled_order_batches_every_clients_lars_together_as_htfllib():
    # HtFLlib's server shuffles all (LAR, label) pairs of the round into one DataLoader:
    # 10 pairs in batches of 3 are 4 steps an epoch, where client by client (2 pairs each)
    # they are 5.
    rng = np.random.default_rng(0)
    lars = [(rng.normal(size=(2, 20)).astype(np.float32), np.array([2 * k, 2 * k + 1], np.int32))
            for k in range(5)]
    for order, steps, mixed in (("pooled", 4, True), ("shuffled", 5, False)):
        header, batches = torch.nn.Linear(20, 10), []
        header.register_forward_hook(lambda m, inp, out: batches.append(inp[0].shape[0]))
        train_header(header, lars, FedGHSettings(server_batch_size=3, client_order=order),
                     seed=0)
        assert len(batches) == steps and (3 in batches) == mixed


def test_server_training_lowers_the_loss_on_the_lars_and_frozen_mode_keeps_the_init():
    rng = np.random.default_rng(0)
    lars = [(rng.normal(size=(2, 20)).astype(np.float32) + 3 * np.eye(20, dtype=np.float32)[
        [2 * k, 2 * k + 1]], np.array([2 * k, 2 * k + 1], np.int32)) for k in range(5)]
    header = torch.nn.Linear(20, 10)
    reps = torch.from_numpy(np.concatenate([r for r, _ in lars]))
    labels = torch.from_numpy(np.concatenate([y for _, y in lars])).long()
    before = F.cross_entropy(header(reps), labels).item()
    for epoch in range(20):
        train_header(header, lars, FedGHSettings(server_lr=0.1), seed=epoch)
    assert F.cross_entropy(header(reps), labels).item() < before / 2

    fed = InProcessFederation("fedgh", **PAPER, **{"fedgh.server-head-training": False})
    start = {k: v.copy() for k, v in fed.strategy._payload.items()}
    fed.fit_round(1)
    fed.fit_round(2)
    for k, v in fed.strategy._payload.items():
        np.testing.assert_array_equal(v, start[k])


def test_evaluation_reports_local_and_global_header_accuracy():
    fed = InProcessFederation("fedgh", **PAPER)
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    assert len(metrics) == fed.cfg.num_clients
    for m in metrics.values():
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["accuracy-global-header"] <= 1


def test_global_header_accuracy_by_hand():
    # Representations z = x (two_feature_model); the client's own header is all zero (class 0
    # everywhere), the global one scores class 0 by z1, class 1 by z2, class 2 by -(z1 + z2),
    # and every other class -5.
    fed = InProcessFederation("fedgh", **PAPER)
    c = fed.client(0).num_classes
    weight = np.zeros((c, 2), np.float32)
    weight[:3] = [[1, 0], [0, 1], [-1, -1]]
    bias = np.full(c, -5, np.float32)
    bias[:3] = 0
    model = two_feature_model(c)
    points, labels = [(2, 1), (1, 3), (3, 2), (-1, -2)], [0, 1, 1, 2]
    # Global header: 0 (2 > 1 > -3), 1 (3 > 1), 0 (3 > 2: wrong), 2 (3 > -1 > -2): 3 of 4.
    m = evaluate_on(fed, model, points, labels, {"head.weight": weight, "head.bias": bias})
    assert m["accuracy-global-header"] == pytest.approx(3 / 4)
    assert m["accuracy"] == pytest.approx(1 / 4)  # the own header: class 0 for all
    assert not model.head.weight.any() and not model.head.bias.any()  # left as it was


@pytest.mark.parametrize("bad,reason", [
    (lambda p: {**p, "representations": p["representations"][:, :499]}, "shape"),
    (lambda p: {**p, "representations": np.full_like(p["representations"], np.nan)}, "NaN"),
    (lambda p: {**p, "labels": np.array([3, 10], np.int32)}, "> 9"),
    (lambda p: {**p, "labels": np.array([3, 3], np.int32)}, "twice"),
])
def test_a_bad_upload_is_rejected_and_the_round_goes_on(bad, reason, caplog):
    fed = InProcessFederation("fedgh", **PAPER)
    fed.assert_rejects(bad, reason, caplog, pid=1)


def test_fedgh_needs_one_representation_dimension():
    with pytest.raises(ConfigError, match="feature-dim"):
        load_config({"method": "fedgh", "feature-dim": 0, "arch-mix": "cnn1"})
    with pytest.raises(ConfigError, match="fedgh.server-lr"):
        load_config({"method": "fedgh", "fedgh.server-lr": -1.0})
    with pytest.raises(ConfigError, match="fedgh.sever-lr"):
        load_config({"method": "fedgh", "fedgh.sever-lr": 0.1})  # a typo is not ignored
