"""KT-pFL: the server's coefficient step and personalised targets by hand, the code's step
size, the distillation loss and epoch schedule, the exact traffic, what the clients upload and
what the server keeps. Hostile uploads, checkpoints and one seed one result are covered for
every method (test_hostile_uploads.py, test_checkpoint.py, test_determinism.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.config import ConfigError
from fedapp.data import setup
from fedapp.runtime.payload import decode
from strategies import public_labels
from strategies.dsfl.maths import probabilities
from strategies.ktpfl import KTpFLSettings
from strategies.ktpfl.maths import (alignment_set, code_step_size, coefficient_gradient,
                                    kd_loss, personalised_target, private_epochs,
                                    update_coefficients)
from tests.conftest import (assert_public_subset_traffic, cfg_of, client_manager, fit_res,
                            make_strategy, recorded_rounds)
from tests.test_hostile_uploads import small_smoke_overrides

SMALL = small_smoke_overrides("ktpfl")  # 180 synthetic samples: 18 public, A_t of 16
M = 16  # ktpfl.alignment-size of the smoke preset
C = 10
CODE = KTpFLSettings()


def _sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


# -- the code's step size, by hand ----------------------------------------------------------------
@pytest.mark.parametrize("g,step", [
    (0.5, 0.04),     # 0.5 -> 0.1 -> 0.02 -> 0.004, back to 0.02: 1/25
    (0.02, 1.0),     # within (0.01, 0.05]: divided and multiplied back every pass
    (0.001, 25.0),   # 0.001 -> 0.005 -> 0.025, then divided and multiplied back
    (0.0, 5.0 ** 5),
])
def test_the_code_step_size(g, step):
    assert code_step_size(g) == pytest.approx(step)


# -- the coefficient step and the targets, by hand ------------------------------------------------
P2 = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # two clients, m = 1, C = 2


def test_one_coefficient_step_on_two_clients_by_hand():
    # c = 1/2 everywhere; client 0's target (1/2, 1/2), residual p_0 - t_0 = (1/2, -1/2);
    # dL_0/dc_0j = -2/(mC) <r, p_j> = (-1/2, 1/2), no penalty at uniform; mean |g| = 1/2 gives
    # the step 1/25: row (0.52, 0.48); softmax(5 row) = (sigmoid(0.2), 1 - sigmoid(0.2)).
    c = np.full((2, 2), 0.5)
    np.testing.assert_allclose(coefficient_gradient(c, P2, 1.0), [[-0.5, 0.5], [0.5, -0.5]])
    new = update_coefficients(c, P2, CODE)
    s = _sigmoid(0.2)
    np.testing.assert_allclose(new, [[s, 1 - s], [1 - s, s]], rtol=1e-12)
    np.testing.assert_allclose(personalised_target(new[0], P2), [[s, 1 - s]], rtol=1e-6)
    # A second step: now the regulariser pulls toward 1/2, rho (2/N)(c - 1/N) = (s - 1/2) per
    # entry, against the data term -(1 - s): g_0 = (-(1 - s) + (s - 1/2), ...) = (-0.40033, .);
    # its step is 1/25 again; row (s + 0.016013, 1 - s - 0.016013) -> softmax(5 row).
    second = update_coefficients(new, P2, CODE)
    g = -(1 - s) + (s - 0.5)
    assert g == pytest.approx(-0.400332, abs=1e-6)
    first = _sigmoid(5 * ((s - g / 25) - (1 - s + g / 25)))
    assert first == pytest.approx(0.658917, abs=1e-6)
    np.testing.assert_allclose(second[0], [first, 1 - first], rtol=1e-12)


def test_the_gradient_is_the_codes_autograd_of_its_mse_losses():
    # The code's L_i = MSELoss(p_i, sum_j c_ij p_j) + rho * MSELoss(c_i, 1/N), on 3 clients.
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=(3, 5))  # [N, m, C]
    c = rng.dirichlet(np.ones(3), size=3)
    for i in range(3):
        row = torch.tensor(c[i], requires_grad=True)
        pt = torch.from_numpy(p)
        loss = F.mse_loss(pt[i], torch.einsum("j,jmc->mc", row, pt)) \
            + 0.7 * F.mse_loss(row, torch.full((3,), 1 / 3, dtype=torch.float64))
        loss.backward()
        np.testing.assert_allclose(coefficient_gradient(c, p, 0.7)[i], row.grad.numpy(),
                                   rtol=1e-10)


def test_a_fixed_step_and_another_scale_are_options():
    c = np.full((2, 2), 0.5)
    new = update_coefficients(c, P2, dataclasses.replace(CODE, coefficient_lr=0.1,
                                                         softmax_scale=1.0))
    s = _sigmoid(1.0 * ((0.5 + 0.05) - (0.5 - 0.05)))  # row (0.55, 0.45)
    np.testing.assert_allclose(new[0], [s, 1 - s], rtol=1e-12)


def test_the_personalised_target_is_the_row_mix_renormalised():
    p = np.array([[[1.0, 0.0]], [[0.0, 1.0]], [[0.5, 0.5]]])
    np.testing.assert_allclose(personalised_target(np.array([0.2, 0.3, 0.5]), p),
                               [[0.45, 0.55]], rtol=1e-6)
    # A row that does not sum to 1 (a non-sender's, over the last senders) is re-normalised.
    np.testing.assert_allclose(personalised_target(np.array([1.0, 1.0, 2.0]), p),
                               [[0.5, 0.5]], rtol=1e-6)
    assert personalised_target(np.array([0.2, 0.3, 0.5]), p).dtype == np.float32


# -- the server through its validation path -------------------------------------------------
def _strategy(**extra):
    return make_strategy("ktpfl", num_classes=2,
                         **{**SMALL, "ktpfl.alignment-size": 1, **extra})


def _round(strategy, uploads, rnd=1):
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(rnd, None, manager)
    results = [(proxies[pid], fit_res({"probabilities": np.asarray(p, np.float32)},
                                      strategy.train_sizes[pid], pid,
                                      strategy.architectures[pid]))
               for pid, p in uploads.items()]
    strategy.aggregate_fit(rnd, results, [])
    return strategy


def test_every_client_in_the_round_gets_the_codes_step_and_its_own_target():
    # Three clients, all sending: c starts at 1/3, as the code's.
    p = {0: [[1.0, 0.0]], 1: [[0.0, 1.0]], 2: [[0.5, 0.5]]}
    strategy = _round(_strategy(), p)
    assert strategy._counts["rejected"] == 0
    stacked = np.array([p[i] for i in range(3)])
    want = update_coefficients(np.full((3, 3), 1 / 3), stacked, CODE)
    np.testing.assert_allclose(strategy.coefficients, want, rtol=1e-12)
    manager, proxies = client_manager(strategy)
    sent = {proxy.identity["partition-id"]: decode(ins.parameters)
            for proxy, ins in strategy.configure_fit(2, None, manager)}
    for pid in range(3):
        np.testing.assert_allclose(sent[pid]["target"],
                                   personalised_target(want[pid], stacked), rtol=1e-6)
        assert sent[pid]["indices"].tolist() == strategy.indices.tolist()
    # Personalised: clients 0 and 1 learn most from themselves, so their targets differ.
    assert sent[0]["target"][0, 0] > 0.5 > sent[1]["target"][0, 0]


def test_a_round_without_a_client_steps_the_senders_block_only():
    # Clients 0 and 1 send; their block of 1/3 is re-normalised to 1/2: the two-client case
    # by hand. Client 2's row is untouched, and its target mixes the senders' predictions by
    # it, re-normalised: (1/2, 1/2).
    strategy = _round(_strategy(), {0: [[1.0, 0.0]], 1: [[0.0, 1.0]]})
    s = _sigmoid(0.2)
    np.testing.assert_allclose(strategy.coefficients[:2, :2], [[s, 1 - s], [1 - s, s]],
                               rtol=1e-12)
    np.testing.assert_allclose(strategy.coefficients[2], 1 / 3)
    np.testing.assert_allclose(strategy.coefficients[:2, 2], 1 / 3)
    manager, proxies = client_manager(strategy)
    sent = {proxy.identity["partition-id"]: decode(ins.parameters)
            for proxy, ins in strategy.configure_fit(2, None, manager)}
    np.testing.assert_allclose(sent[0]["target"], [[s, 1 - s]], rtol=1e-6)
    np.testing.assert_allclose(sent[2]["target"], [[0.5, 0.5]], rtol=1e-6)


def test_uploads_that_are_not_probability_vectors_are_refused():
    strategy = _round(_strategy(), {0: [[1.0, 0.0]], 1: [[0.0, 1.0]], 2: [[0.9, 0.9]]})
    assert strategy._counts["rejected"] == 1
    assert strategy.senders.tolist() == [0, 1]


def test_the_server_keeps_one_round_of_uploads_whatever_the_rounds():
    strategy = make_strategy("ktpfl", **SMALL)
    rng = np.random.default_rng(0)
    for rnd in (1, 2, 3):
        _round(strategy, {pid: rng.dirichlet(np.ones(C), size=M) for pid in range(3)}, rnd)
        state = strategy.method_state()
        assert state["predictions"].shape == (3, M, C)
        assert state["coefficients"].shape == (3, 3)
        assert state["indices"].tolist() == alignment_set(
            strategy.cfg.seed, rnd, strategy.public_size, strategy.settings).tolist()


# -- the client's side -------------------------------------------------------------------------
def test_the_distillation_loss_is_the_codes_element_mean_and_its_options():
    zero = torch.zeros(2, 2)
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # KL to uniform: log 2 per sample
    assert float(kd_loss(zero, q, CODE)) == pytest.approx(math.log(2) / 2)  # / C
    assert float(kd_loss(zero, q, dataclasses.replace(CODE, kd_reduction="batchmean"))) \
        == pytest.approx(math.log(2))
    assert float(kd_loss(zero, q, dataclasses.replace(CODE, kd_reduction="batchmean-t2"))) \
        == pytest.approx(100 * math.log(2))
    # The temperature divides the logits: (20, 0) / 10 against softmax((2, 0)) is zero KL.
    logits = torch.tensor([[20.0, 0.0]])
    assert float(kd_loss(logits, torch.softmax(torch.tensor([[2.0, 0.0]]), 1), CODE)) \
        == pytest.approx(0.0, abs=1e-7)


def test_private_epochs_ramp_up_as_the_code():
    assert [private_epochs(t, 10, CODE) for t in range(1, 14)] == \
        [1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    flat = dataclasses.replace(CODE, epoch_ramp=False, init_epochs=2)
    assert [private_epochs(t, 10, flat) for t in (1, 2, 3)] == [2, 10, 10]


def test_the_alignment_set_is_keyed_and_may_repeat_only_when_asked():
    small = dataclasses.replace(CODE, alignment_size=20)
    distinct = alignment_set(0, 1, 20, small)
    assert distinct.dtype == np.int32 and distinct.tolist() == list(range(20))
    drawn = alignment_set(0, 1, 20, dataclasses.replace(small, alignment_replacement=True))
    assert len(drawn) == 20 and len(set(drawn.tolist())) < 20  # repeats, as the code's draw
    assert np.array_equal(alignment_set(3, 2, 100, dataclasses.replace(CODE, alignment_size=9)),
                          alignment_set(3, 2, 100, dataclasses.replace(CODE, alignment_size=9)))
    assert not np.array_equal(
        alignment_set(3, 2, 100, dataclasses.replace(CODE, alignment_size=9)),
        alignment_set(3, 3, 100, dataclasses.replace(CODE, alignment_size=9)))


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    # Two initialisation epochs, so that round 1's private epochs differ from round 2's one.
    return recorded_rounds(tmp_path_factory.mktemp("ktpfl"), "ktpfl", rounds=2,
                           **{**SMALL, "ktpfl.init-epochs": 2})


def test_exact_traffic_per_client_per_round(two_rounds):
    # Up: the soft predictions. Down: nothing in round 1 (the code's model initialisation),
    # then the indices of A_(t-1) and the client's own target.
    assert_public_subset_traffic(two_rounds[1], M, C)


def test_clients_distil_from_round_2_and_upload_soft_predictions_on_a_t(two_rounds):
    fed, _, seen = two_rounds
    for rnd, round_seen in enumerate(seen, start=1):
        for pid, (sent, res) in round_seen.items():
            assert ("term-distil" in res.metrics) == (rnd == 2)
            assert bool(sent) == (rnd == 2)
            # Private epochs: ktpfl.init-epochs (2) in round 1, min(t - 1, 10) = 1 in round 2.
            assert res.metrics["train-samples"] == (3 - rnd) * res.num_examples
    # The last upload is softmax(o / T) of the model as saved, in eval mode, on A_2.
    public = setup.public_set(fed.cfg, labels=False)
    a2 = alignment_set(fed.cfg.seed, 2, len(public), fed.cfg.settings)
    want = probabilities(fed.client(0).model, public.x[torch.from_numpy(a2.astype(np.int64))]
                         .to(fed.client(0).device), 10.0)
    np.testing.assert_allclose(decode(seen[1][0][1].parameters)["probabilities"], want,
                               rtol=1e-5, atol=1e-7)
    # Round 2's targets: each client its own, on A_1.
    sent = {pid: s for pid, (s, _) in seen[1].items()}
    a1 = alignment_set(fed.cfg.seed, 1, len(public), fed.cfg.settings)
    assert all(s["indices"].tolist() == a1.tolist() for s in sent.values())
    assert not np.allclose(sent[0]["target"], sent[1]["target"])


def test_the_public_labels_are_never_read_and_a_public_set_is_required():
    assert not public_labels(cfg_of(method="ktpfl", **SMALL))
    with pytest.raises(ConfigError, match="needs a public set"):
        cfg_of(method="ktpfl", **{**SMALL, "public_source": "none"})


def test_norm_bounding_predictions_is_refused_the_filters_are_not():
    with pytest.raises(ConfigError, match="robust-aggregation = 'norm-bound' is invalid.*"
                       "target must stay a probability vector"):
        cfg_of(method="ktpfl", **{**SMALL, "robust_aggregation": "norm-bound",
                                  "robust_norm_bound": 1.0})
    cfg_of(method="ktpfl", **{**SMALL, "robust_aggregation": "median"})


def test_a_dropped_upload_counts_as_not_sent():
    # Three honest tables near (1/2, 1/2) and one far. Their coordinate-wise median is
    # (0.45, 0.55); distances 0.21, 0.07, 0.07 and 0.64, whose median is 0.14 and MAD 0.07:
    # the cut 0.14 + 3 * 1.4826 * 0.07 = 0.46 drops client 3, and the round is then the
    # round of clients 0-2 alone.
    p = {0: [[0.6, 0.4]], 1: [[0.5, 0.5]], 2: [[0.4, 0.6]], 3: [[0.0, 1.0]]}
    overrides = {"num_clients": 4, "robust_aggregation": "median"}
    robust = _round(_strategy(**overrides), p)
    assert robust._filtered_uploads == {"uploads": 4, "dropped": 1, "dropped_clients": [3]}
    alone = _round(_strategy(num_clients=4), {k: p[k] for k in range(3)})
    assert robust.senders.tolist() == alone.senders.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(robust.predictions, alone.predictions)
    np.testing.assert_array_equal(robust.coefficients, alone.coefficients)


def test_an_alignment_set_larger_than_the_public_set_is_refused_before_training():
    cfg = cfg_of(method="ktpfl", **{**SMALL, "ktpfl.alignment-size": 19})
    with pytest.raises(ConfigError, match="fewer than the 19"):
        setup.prepare(cfg)
    setup.prepare(cfg_of(method="ktpfl", **SMALL))  # 18 public samples, A_t of 16
