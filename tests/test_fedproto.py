"""FedProto: 1000 floats each way (labels and counts in the framing), count-weighted global
prototypes, the prototype regulariser, both prediction rules, and rejection of bad uploads."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import decode
from fedapp.runtime.results import Recorder
from tests.conftest import InProcessFederation, evaluate_on, two_feature_model

PAPER = dict(dataset="synthetic", synthetic_train=600, synthetic_test=200, num_clients=3,
             partition="pathological", classes_per_client=2, max_samples_per_client=0,
             arch_mix="cnn5,cnn4,cnn3", feature_dim=500)


def test_paper_traffic_1000_floats_each_way(tmp_path):
    recorder = Recorder(tmp_path / "run", method="fedproto", dataset="synthetic",
                        num_clients=3, num_rounds=2, config={}, partition={})
    fed = InProcessFederation("fedproto", recorder=recorder, **PAPER)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    assert round1["bytes_down"] == 0
    assert round1["bytes_up"] == round2["bytes_up"] == 3 * 1000 * 4
    assert round2["bytes_down"] == 3 * 1000 * 4   # each client gets its own two classes back
    assert round2["framing_up"] > 0 and round2["framing_down"] > 0


def test_global_prototypes_are_count_weighted_class_means():
    fed = InProcessFederation("fedproto", **PAPER)
    uploads = [decode(res.parameters) for _, res in fed.fit_round(1).values()]
    per_class = {}
    for payload in uploads:
        for name, vector in payload.items():
            c, n = (int(part.split("-")[1]) for part in name.split("/"))
            per_class.setdefault(c, []).append((n, vector))
    for c, parts in per_class.items():
        expected = sum(n * v for n, v in parts) / sum(n for n, _ in parts)
        np.testing.assert_allclose(fed.strategy.global_prototypes[c], expected, rtol=1e-5)


def test_loss_adds_lambda_times_distance_to_the_global_prototype():
    fed = InProcessFederation("fedproto", **PAPER, **{"fedproto.lambda": 2.0})
    fed.fit_round(1)
    client = fed.client(0)
    sent = fed.strategy.fit_payload(2, fed.strategy.clients[fed.proxies[0].cid])
    client.receive(sent, 2)
    x, y = client.data.train_x[:32], client.data.train_y[:32]
    client.model.eval()  # no dropout: both computations see the same features
    z = client.model.features(x)
    protos = torch.stack([torch.from_numpy(sent[f"class-{int(c)}"]) for c in y]).to(z.device)
    expected = F.cross_entropy(client.model.head(z), y) + 2.0 * F.mse_loss(z, protos)
    assert client.loss(x, y).item() == pytest.approx(expected.item(), rel=1e-5)


def test_nearest_prototype_rule_as_headline():
    fed = InProcessFederation("fedproto", **PAPER, **{"fedproto.eval-rule": "nearest-prototype"})
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    assert len(metrics) == fed.cfg.num_clients
    for m in metrics.values():
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["accuracy-own-head"] <= 1
        assert "accuracy-nearest-prototype" not in m


def test_nearest_prototype_accuracy_by_hand():
    # Global prototypes of classes 0-3 only; representations z = x (two_feature_model), whose
    # own head predicts class 0 everywhere.
    fed = InProcessFederation("fedproto", **PAPER, **{"fedproto.eval-rule": "nearest-prototype"})
    prototypes = {"class-0": [4, 0], "class-1": [0, 4], "class-2": [4, 4], "class-3": [2, 9]}
    points = [(3, 0), (0, 3), (4, 3), (2.5, 2.5), (0.4, 0.6), (4, 7)]
    labels = [0, 1, 2, 0, 1, 3]
    # Nearest (Euclidean): 0, 1, 2 (each 1.0 away); 2 (2.12 against 2.92 to classes 0 and 1);
    # 1 (3.42 against 3.65 to class 0; the classes without a prototype do not count, though
    # their empty rows, at the origin, are 0.72 away); 3 (2.83 against 3.00 to class 2, which
    # the L1 distance would choose): 5 of 6 right.
    m = evaluate_on(fed, two_feature_model(fed.client(0).num_classes), points, labels,
                    {k: np.array(v, np.float32) for k, v in prototypes.items()})
    assert m["accuracy"] == pytest.approx(5 / 6)
    assert m["accuracy-own-head"] == pytest.approx(2 / 6)  # class 0 for all: the two zeros


@pytest.mark.parametrize("bad,reason", [
    (lambda p: {k.replace("class-", "klass-"): v for k, v in p.items()}, "not 'class-"),
    (lambda p: {k.replace("class-", "class-1"): v for k, v in p.items()}, "label must be"),
    (lambda p: {k: v[:10] for k, v in p.items()}, "shape"),
    (lambda p: {k: v * np.nan for k, v in p.items()}, "NaN"),
    (lambda p: {}, "one prototype per local class"),
])
def test_a_bad_upload_is_rejected_and_the_round_goes_on(bad, reason, caplog):
    fed = InProcessFederation("fedproto", **PAPER)
    fed.assert_rejects(bad, reason, caplog, pid=0)

def test_htfllibs_prototypes_are_means_over_the_training_steps_averaged_uniformly():
    # prototypes = "during-training": the mean of the representations the round's training
    # steps computed (one epoch of full batches here), not of the trained model's.
    htfl = {"fedproto.prototypes": "during-training", "fedproto.average": "uniform",
            "batch_order": "fixed", "drop_last": True, "batch_size": 10}
    htfl = {**PAPER, **htfl, "partition": "iid"}  # classes shared, in unequal counts
    fed = InProcessFederation("fedproto", **htfl)
    client = fed.client(0)
    start = {k: v.clone() for k, v in client.model.state_dict().items()}
    results = fed.fit_round(1)
    uploads = [decode(res.parameters) for _, res in results.values()]
    mine = decode(results[0][1].parameters)
    # Replay client 0's training step by step from its initial weights.
    replay = InProcessFederation("fedproto", **htfl).client(0)
    replay.model.load_state_dict(start)
    optimizer = replay.optimizer()
    x, y = replay.data.train_x, replay.data.train_y
    sums, counts = {}, {}
    replay.model.train()
    for i in range(0, len(y) - len(y) % 10, 10):
        z = replay.model.features(x[i:i + 10])
        for c, v in zip(y[i:i + 10].tolist(), z.detach()):
            sums[c], counts[c] = sums.get(c, 0) + v, counts.get(c, 0) + 1
        loss = F.cross_entropy(replay.model.head(z), y[i:i + 10])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert len(mine) == len(sums)
    for name, vector in mine.items():
        c = int(name.split("/")[0].split("-")[1])
        np.testing.assert_allclose(vector, (sums[c] / counts[c]).cpu().numpy(), rtol=1e-4,
                                   atol=1e-5)
        assert name.endswith(f"/n-{int((y == c).sum())}")  # the class's samples, as before
    # Uniform: each client's prototype of a class once, whatever its count.
    per_class = {}
    for payload in uploads:
        for name, vector in payload.items():
            per_class.setdefault(int(name.split("/")[0].split("-")[1]), []).append(vector)
    assert any(len(vectors) > 1 for vectors in per_class.values())
    for c, vectors in per_class.items():
        np.testing.assert_allclose(fed.strategy.global_prototypes[c], np.mean(vectors, 0),
                                   rtol=1e-5)
