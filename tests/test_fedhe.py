"""FedHe: 110 numbers per client per round, the cold start, the client's per-class averages,
the server store's policies, and rejection of bad uploads."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import decode
from strategies.fedhe.maths import LogitStore, logit_loss
from tests.conftest import InProcessFederation, recorded_federation

# Every client holds all ten classes (iid), as in the paper's MNIST/CIFAR-10 runs.
SMALL = dict(dataset="synthetic", synthetic_train=450, synthetic_test=90, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             batch_size=50)


def test_110_numbers_each_way_from_the_encoded_payloads(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedhe", **SMALL,
                                        local_steps=0)  # a full pass sees every class
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    assert round1["bytes_down"] == 0                   # cold start: the server has nothing
    assert round1["bytes_up"] == round2["bytes_up"] == 3 * 110 * 4   # 10 x (10 logits + label)
    assert round2["bytes_down"] == 3 * 110 * 4
    assert round2["framing_up"] > 0


def test_cold_start_is_plain_cross_entropy_and_uploads_plus_one_averages():
    fed = InProcessFederation("fedhe", **SMALL)
    client = fed.client(0)
    client.receive({}, 1)
    x, y = client.data.train_x[:50], client.data.train_y[:50]
    torch.manual_seed(0)
    loss = client.loss(x, y)
    torch.manual_seed(0)
    client.model.train()
    assert loss.item() == pytest.approx(F.cross_entropy(client.model(x), y).item(), rel=1e-5)
    # The upload divides the per-class logit sums of the forward passes by count + 1.
    sums, counts = client.logit_sums.sums, client.logit_sums.counts
    upload = client.upload()
    seen = np.flatnonzero(counts.cpu().numpy())
    assert upload["labels"].tolist() == seen.tolist()
    np.testing.assert_allclose(upload["logits"],
                               (sums[seen] / (counts[seen, None] + 1)).cpu().numpy(), rtol=1e-5)


def test_paper_update_is_three_mini_batches():
    fed = InProcessFederation("fedhe", **SMALL)  # the recipe: local-steps = 3
    _, n, metrics = fed.client(1).fit([], {"server-round": 1})
    assert metrics["train-samples"] == 3 * 50


def test_logit_loss_only_for_classes_the_server_knows():
    logits = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    table = torch.randn(4, 4)
    has = torch.tensor([True, True, False, False])
    expected = ((logits[:2] - table[:2]).pow(2).mean(1).sum()
                + (logits[4:] - table[[0, 1]]).pow(2).mean(1).sum()) / 6
    assert logit_loss(logits, y, table, has, "mse", 1.0).item() == pytest.approx(
        expected.item(), rel=1e-5)
    assert logit_loss(logits, y, table, torch.zeros(4, dtype=torch.bool), "kl", 2.0) == 0
    kl = logit_loss(table[y], y, table, torch.ones(4, dtype=torch.bool), "kl", 2.0)
    assert kl.item() == pytest.approx(0.0, abs=1e-6)  # identical logits: no divergence


def test_store_policies():
    a, b = np.full((1, 3), 1.0), np.full((1, 3), 3.0)
    c0 = np.array([0], np.int32)
    every = LogitStore(3, "all", 0)
    for vec in (a, a, b):
        every.add(0, c0, vec)
    labels, means = every.averages()
    assert labels.tolist() == [0] and means[0, 0] == pytest.approx(5 / 3)

    latest = LogitStore(3, "latest-per-client", 0)
    latest.add(0, c0, a)
    latest.add(0, c0, b)      # replaces client 0's vector
    latest.add(1, c0, a)
    assert latest.averages()[1][0, 0] == pytest.approx(2.0)

    running = LogitStore(3, "running-mean", collapse_every=2)
    running.add(0, c0, a)
    running.add(1, c0, a)     # collapse: the past becomes one vote of 1.0
    running.add(2, c0, b)
    assert running.averages()[1][0, 0] == pytest.approx(2.0)  # (1 + 3) / 2, not 5/3
    assert len(LogitStore(3, "all", 0).averages()[0]) == 0


@pytest.mark.parametrize("bad,reason", [
    (lambda p: {**p, "logits": p["logits"][:, :9]}, "shape"),
    (lambda p: {**p, "logits": p["logits"] * np.inf}, "infinite"),
    (lambda p: {**p, "labels": p["labels"] - 1}, "< 0"),
])
def test_a_bad_upload_is_rejected_and_the_round_goes_on(bad, reason, caplog):
    fed = InProcessFederation("fedhe", **SMALL)
    fed.assert_rejects(bad, reason, caplog, pid=2)
    sent = fed.fit_round(2)  # the next round's averages come from the two good uploads
    assert all(len(payload["labels"]) == 10 for payload, _ in sent.values())


def test_the_server_sends_the_store_averages():
    fed = InProcessFederation("fedhe", **SMALL)
    uploads = fed.fit_round(1)
    sent = fed.fit_round(2)
    vectors = [decode(res.parameters) for _, res in uploads.values()]
    for payload, _ in sent.values():
        for i, c in enumerate(payload["labels"]):
            parts = [v["logits"][list(v["labels"]).index(c)] for v in vectors
                     if c in v["labels"]]
            np.testing.assert_allclose(payload["logits"][i], np.mean(parts, 0), rtol=1e-5)
