"""FedRE: one mix of d + 2K numbers up and the head down per client per round, the
hand-computed loss, the mix itself, the weights' check and the head's round trip."""

import math

import numpy as np
import pytest
import torch

from fedapp.runtime.payload import PayloadError, decode
from strategies.fedre.maths import entangle, soft_label_loss
from tests.conftest import InProcessFederation, client_manager, make_strategy, recorded_federation

D = 64
SMALL = dict(dataset="synthetic", synthetic_train=450, synthetic_test=90, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             model_width=0.25, feature_dim=D)


def test_one_mix_up_and_the_head_down_from_the_encoded_payloads(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedre", **SMALL)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    up = (D + 2 * 10) * 4       # the mix, K = 10 float32 weights and K int32 labels
    down = (D * 10 + 10) * 4    # the head Linear(d, C)
    for record in recorder.history:
        assert record["bytes_up"] == 3 * up
        assert record["bytes_down"] == 3 * down  # from round 1: clients start from it
        assert record["eval_bytes_down"] > 3 * down  # the head again, with its framing


def test_hand_computed_zero_head_and_one_class():
    w = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    logits = torch.zeros(1, 4, requires_grad=True)  # a zero head: every logit 0
    loss = soft_label_loss(logits, w)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(4))
    torch.testing.assert_close(logits.grad, 1 / 4 - w)
    # Summed, not averaged, over the batch.
    assert soft_label_loss(torch.zeros(3, 4), w.repeat(3, 1)).item() == pytest.approx(
        3 * math.log(4))
    # With one class, the upload is that prototype (weight 1).
    proto = np.arange(5, dtype=np.float32)[None]
    mix, weights = entangle(proto, torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(mix, proto[0])
    np.testing.assert_array_equal(weights, [1.0])


def test_the_mix_is_the_weighted_prototypes_redrawn_every_round():
    fed = InProcessFederation("fedre", **SMALL)
    client = fed.client(0)
    uploads = []
    for rnd in (1, 2):
        client.fit([], {"server-round": rnd})
        uploads.append(client.upload())
    from fedapp.runtime.class_stats import class_means
    protos = class_means(client.model.features, client.model, client.data.train_x,
                         client.data.train_y, 10)
    last = uploads[-1]
    assert abs(float(last["weights"].sum()) - 1) < 1e-6 and last["weights"].min() >= 0
    np.testing.assert_array_equal(last["labels"], protos.labels)
    np.testing.assert_allclose(last["representation"], last["weights"] @ protos.means,
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(uploads[0]["weights"], uploads[1]["weights"])


def test_weights_that_do_not_form_a_convex_mix_are_refused():
    strategy = make_strategy("fedre", num_clients=2, arch_mix="cnn1", sizes=[50, 50],
                             feature_dim=D)
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    info = strategy.clients[proxies[0].cid]
    rep, labels = np.zeros(D, np.float32), np.array([1, 4], np.int32)
    strategy.validate_upload({"representation": rep, "weights": np.array([.25, .75], np.float32),
                              "labels": labels}, info)
    for bad, words in (([2.0, 3.0], "sum to 1"), ([1.5, -0.5], "non-negative"),
                       ([1.0], "1 weights for 2 labels")):
        with pytest.raises(PayloadError, match=words):
            strategy.validate_upload({"representation": rep,
                                      "weights": np.array(bad, np.float32), "labels": labels},
                                     info)
    with pytest.raises(PayloadError, match="twice"):
        strategy.validate_upload({"representation": rep, "weights": np.array([.5, .5],
                                  np.float32), "labels": np.array([4, 4], np.int32)}, info)


def test_clients_start_from_the_server_head_and_report_both_heads():
    fed = InProcessFederation("fedre", **SMALL)
    sent = fed.fit_round(1)
    for pid, (payload, _) in sent.items():
        client = fed.client(pid)
        client.receive(payload, 1)
        np.testing.assert_array_equal(client.model.head.weight.detach().cpu().numpy(),
                                      payload["head.weight"])
    metrics = fed.evaluate_round(1)  # the own head is the headline, the server's beside it
    assert all("accuracy-global-header" in m and "accuracy-own-head" not in m
               for m in metrics.values())
    head = decode(fed.strategy.configure_fit(2, None, fed.manager)[0][1].parameters)
    assert not np.array_equal(head["head.weight"], sent[0][0]["head.weight"])  # it learnt


def test_the_release_variant_never_sends_the_head():
    fed = InProcessFederation("fedre", **SMALL, **{"fedre.send-head": False})
    sent = fed.fit_round(1)
    assert all(payload == {} for payload, _ in sent.values())
    metrics = fed.evaluate_round(1)  # one head only: the client's own
    assert all("accuracy-own-head" not in m and "accuracy-global-header" not in m
               for m in metrics.values())


def test_the_server_head_as_headline_reports_the_own_head_beside_it():
    fed = InProcessFederation("fedre", **SMALL, **{"fedre.eval-head": "global"})
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    assert all("accuracy-own-head" in m and "accuracy-global-header" not in m
               for m in metrics.values())
    own = InProcessFederation("fedre", **SMALL)  # the same training, the other headline
    own.fit_round(1)
    for pid, m in own.evaluate_round(1).items():
        assert m["accuracy"] == metrics[pid]["accuracy-own-head"]
        assert m["accuracy-global-header"] == metrics[pid]["accuracy"]
