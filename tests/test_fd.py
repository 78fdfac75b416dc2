"""FD: C * (C + 1) numbers each way per client per round, the hand-computed loss and
server checks, the parity options, and the server's two histories."""

import math

import numpy as np
import pytest
import torch

from fedapp.config import ConfigError
from fedapp.runtime.payload import decode
from strategies.fd.maths import distillation
from tests.conftest import (InProcessFederation, cfg_of, client_manager, fit_res, make_strategy,
                            recorded_federation)

# Every client holds all ten classes (iid), so every upload has C rows.
SMALL = dict(dataset="synthetic", synthetic_train=450, synthetic_test=90, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             model_width=0.25)


def test_c_times_c_plus_one_numbers_each_way_from_the_encoded_payloads(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fd", **SMALL)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    per_client = 10 * (10 + 1) * 4  # C rows of C float32 logits + C int32 labels
    assert round1["bytes_down"] == 0  # the server has nothing yet
    assert round1["bytes_up"] == round2["bytes_up"] == 3 * per_client
    # Each client gets the other two clients' averages: every class still has a row.
    assert round2["bytes_down"] == 3 * per_client
    assert round1["eval_bytes_down"] == 0  # inference is the client's own model


def test_hand_computed_of_the_distillation_term():
    o = torch.zeros(1, 2, requires_grad=True)
    y = torch.tensor([0])
    table, has = torch.tensor([[2.0, -1.0], [0.0, 0.0]]), torch.tensor([True, False])
    # Raw target (HtFLlib parity): ln 2, gradient (sum T) softmax(o) - T = (-1.5, 1.5).
    loss = distillation(o, y, table, has, raw_target=True)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    torch.testing.assert_close(o.grad, torch.tensor([[-1.5, 1.5]]))
    # Softmaxed target (.953, .047): the same loss, gradient (-.453, .453).
    o.grad = None
    loss = distillation(o, y, table, has)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    torch.testing.assert_close(o.grad, torch.tensor([[-0.4526, 0.4526]]), atol=1e-4, rtol=0)


def test_a_class_without_a_row_adds_nothing_unless_it_targets_itself():
    o = torch.tensor([[1.0, 3.0]], requires_grad=True)
    y = torch.tensor([1])
    table, has = torch.zeros(2, 2), torch.tensor([True, False])
    assert distillation(o, y, table, has).item() == 0.0
    # HtFLlib's self-target: under raw targets a nonzero loss and gradient pulling o to itself.
    loss = distillation(o, y, table, has, raw_target=True, self_target=True)
    loss.backward()
    assert loss.item() > 0 and o.grad.abs().sum() > 0
    # Under softmax targets the self-target's gradient is zero (only its value is not).
    o.grad = None
    distillation(o, y, table, has, self_target=True).backward()
    torch.testing.assert_close(o.grad, torch.zeros(1, 2))


def _row(values):
    row = np.zeros((1, 10), np.float32)
    row[0, :len(values)] = values
    return row


def _round(strategy, proxies, manager, rnd, rows):
    """Round ``rnd`` in which partition pid uploads class 0's row ``rows[pid]``."""
    sent = {strategy.clients[p.cid].partition_id: decode(ins.parameters)
            for p, ins in strategy.configure_fit(rnd, None, manager)}
    strategy.aggregate_fit(rnd, [
        (proxies[pid], fit_res({"logits": _row(r), "labels": np.array([0], np.int32)}, 10,
                               pid, "cnn1")) for pid, r in rows.items()], [])
    return sent


def test_rows_1_0_and_3_2_average_to_2_1_and_each_client_gets_the_others():
    for exclude_own in (True, False):
        strategy = make_strategy("fd", num_clients=3, arch_mix="cnn1", sizes=[10] * 3,
                                 **{"fd.exclude-own": exclude_own})
        manager, proxies = client_manager(strategy)
        _round(strategy, proxies, manager, 1, {0: (1, 0), 1: (3, 2)})
        sent = {strategy.clients[p.cid].partition_id: decode(ins.parameters)
                for p, ins in strategy.configure_fit(2, None, manager)}
        np.testing.assert_array_equal(sent[2]["logits"], _row((2, 1)))  # not a sender
        np.testing.assert_array_equal(sent[2]["labels"], [0])
        if exclude_own:  # the paper's F^(i): the other senders' rows only
            np.testing.assert_array_equal(sent[0]["logits"], _row((3, 2)))
            np.testing.assert_array_equal(sent[1]["logits"], _row((1, 0)))
        else:  # HtFLlib: the same average for everyone
            assert all(np.array_equal(s["logits"], _row((2, 1))) for s in sent.values())


def test_round_history_forgets_absent_clients_latest_per_client_keeps_them():
    got = {}
    for history in ("round", "latest-per-client"):
        strategy = make_strategy("fd", num_clients=3, arch_mix="cnn1", sizes=[10] * 3,
                                 **{"fd.history": history, "fd.exclude-own": False})
        manager, proxies = client_manager(strategy)
        strategy.configure_fit(1, None, manager)
        for rnd, rows in ((1, {0: (1, 0), 1: (3, 2)}), (2, {1: (5, 4)})):
            strategy.aggregate_fit(rnd, [
                (proxies[pid], fit_res({"logits": _row(r), "labels": np.array([0], np.int32)},
                                       10, pid, "cnn1")) for pid, r in rows.items()], [])
        got[history] = strategy.fit_payload(3, None)["logits"]
    np.testing.assert_array_equal(got["round"], _row((5, 4)))               # round 2 alone
    np.testing.assert_array_equal(got["latest-per-client"], _row((3, 2)))   # (1,0) and (5,4)


def test_the_upload_is_the_plain_mean_of_the_training_time_logits():
    fed = InProcessFederation("fd", **SMALL)
    client = fed.client(0)
    client.fit([], {"server-round": 1})
    sums, counts = client.logit_sums.sums, client.logit_sums.counts
    upload = client.upload()
    seen = np.flatnonzero(counts.cpu().numpy())
    assert upload["labels"].tolist() == seen.tolist() == list(range(10))
    np.testing.assert_allclose(upload["logits"], (sums[seen] / counts[seen, None]).cpu().numpy(),
                               rtol=1e-6)
    assert int(counts.sum()) == 150 // 10 * 10  # one epoch, batch 10, short batch dropped


def test_the_asynchronous_loop_needs_the_latest_per_client_history():
    with pytest.raises(ConfigError, match="fd.history"):
        cfg_of(method="fd", server_loop="async", **{"fd.history": "round"})
    assert cfg_of(method="fd", server_loop="async",
                  **{"fd.history": "latest-per-client"}).method == "fd"


def test_the_default_history_is_the_rounds_in_rounds_and_the_latest_per_client_async():
    for loop, history in (("rounds", "round"), ("async", "latest-per-client")):
        strategy = make_strategy("fd", num_clients=3, arch_mix="cnn1", sizes=[10] * 3,
                                 server_loop=loop)
        assert strategy.history == history
