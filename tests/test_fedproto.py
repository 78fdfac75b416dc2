"""FedProto: 1000 floats each way (labels and counts in the framing), count-weighted global
prototypes, the prototype regulariser, both prediction rules, and rejection of bad uploads."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import decode
from fedapp.runtime.results import Recorder
from tests.conftest import InProcessFederation

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
    protos = torch.stack([torch.from_numpy(sent[f"class-{int(c)}"]) for c in y])
    expected = F.cross_entropy(client.model.head(z), y) + 2.0 * F.mse_loss(z, protos)
    assert client.loss(x, y).item() == pytest.approx(expected.item(), rel=1e-5)


def test_nearest_prototype_rule_as_headline():
    fed = InProcessFederation("fedproto", **PAPER, **{"fedproto.eval-rule": "nearest-prototype"})
    fed.fit_round(1)
    for m in fed.evaluate_round(1).values():
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["accuracy-own-head"] <= 1
        assert "accuracy-nearest-prototype" not in m


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