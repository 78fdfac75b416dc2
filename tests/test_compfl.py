"""CompFL: prototype head init, expert weights, the ensemble target and both KL directions,
epsilon-greedy frequencies, who trains what, per-architecture aggregation, exact traffic,
private heads kept in the context, and rejection of bad uploads."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.runtime.class_stats import ClassSums
from fedapp.runtime.results import Recorder
from fedapp.seeding import derive_seed
from strategies.compfl import CompFLSettings
from strategies.compfl.maths import (HEAD_STATE_KEY, AdaptedExpert, alignment_loss, compfl_loss,
                                     ensemble_target, expert_weights, kd_loss, pack,
                                     prototype_head_init, select_expert, unpack)
from tests.conftest import InProcessFederation, client_manager, fit_res, make_strategy

SMALL, LARGE = "fedpac-cnn", "fedpac-cnn3"
# Extractor parameters for 1x28x28 inputs and d = 128 (FedPAC's CNN_FMNIST, + a 32->64 conv).
EXTRACTOR_FLOATS = {SMALL: 416 + 12832 + 800 * 128 + 128,
                    LARGE: 416 + 12832 + 18496 + 1600 * 128 + 128}
# Clients 0, 2 run the small expert, 1, 3 the large one (round-robin).
FED = dict(dataset="synthetic", synthetic_train=240, synthetic_test=80, num_clients=4,
           partition="pathological", classes_per_client=3, max_samples_per_client=0,
           arch_mix=f"{SMALL},{LARGE}", feature_dim=0, batch_size=50, val_fraction=0.1,
           num_server_rounds=4)


def test_extractor_sizes_and_expert_order():
    strategy = make_strategy("compfl", **FED)
    assert strategy.order == (SMALL, LARGE)
    for arch, floats in EXTRACTOR_FLOATS.items():
        assert sum(a.size for a in strategy.extractors[arch].values()) == floats
    # "Ordered by size" is the parameter count, not the order of arch-mix.
    assert make_strategy("compfl", **{**FED, "arch_mix": f"{LARGE},{SMALL}"}).order == (
        SMALL, LARGE)


def test_prototype_head_init_on_hand_made_features():
    z = torch.tensor([[3.0, 4.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    y = torch.tensor([0, 0, 2])
    sums = ClassSums(4)
    sums.add(z, y)
    prototypes = sums.means()
    for normalise, row0, row2 in [(True, [1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], [0, 0, 1.0]),
                                  (False, [2.0, 2.0, 0.0], [0, 0, 2.0])]:
        head = torch.nn.Linear(3, 4)
        before = {k: v.clone() for k, v in head.state_dict().items()}
        prototype_head_init(head, prototypes, normalise)
        torch.testing.assert_close(head.weight[0], torch.tensor(row0))
        torch.testing.assert_close(head.weight[2], torch.tensor(row2, dtype=torch.float32))
        assert head.bias[0] == head.bias[2] == 0
        for c in (1, 3):  # absent classes keep their rows
            torch.testing.assert_close(head.weight[c], before["weight"][c])
            assert head.bias[c] == before["bias"][c]


def test_adaptation_without_fine_tuning_leaves_the_prototype_head():
    fed = InProcessFederation("compfl", **FED, **{"compfl.head-epochs": 0, "compfl.kd": False,
                                                   "compfl.greedy": False})
    fed.fit_round(1)
    client = fed.client(0)
    from strategies.compfl.maths import adapt_expert
    extractor = fed.strategy.extractors[SMALL]
    adapted = adapt_expert(SMALL, client.model, extractor, client.data.train_x,
                           client.data.train_y, client.cfg, torch.Generator().manual_seed(0))
    client.model.eval()
    with torch.no_grad():
        z = client.model.features(client.data.train_x)
    for c in client.data.train_y.unique():
        mean = z[client.data.train_y == c].mean(0)
        torch.testing.assert_close(adapted.anchors[c], mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(client.model.head.weight[c], F.normalize(mean, dim=0),
                                   rtol=1e-4, atol=1e-5)
    assert int(adapted.has_anchor.sum()) == len(client.data.train_y.unique())


def test_expert_weights_are_a_softmax_of_min_max_accuracies():
    s = expert_weights([0.5, 0.9, 0.7], tau=0.1)
    e = np.exp([0.0, 10.0, 5.0])
    np.testing.assert_allclose(s, e / e.sum())
    np.testing.assert_allclose(expert_weights([0.6, 0.6], 0.1), [0.5, 0.5])
    np.testing.assert_allclose(expert_weights([0.3], 0.1), [1.0])


def test_ensemble_target_and_both_kl_directions_by_hand():
    y = torch.tensor([1])
    p1, p2 = torch.tensor([[0.2, 0.5, 0.3]]), torch.tensor([[0.6, 0.2, 0.2]])
    t = ensemble_target(y, [p1, p2], np.array([0.25, 0.75]), 3)
    # 0.5 * onehot + 0.5 * (0.25 * p1 + 0.75 * p2) = 0.5 * [0, 1, 0] + 0.5 * [0.5, 0.275, 0.225]
    expected = [0.25, 0.6375, 0.1125]
    torch.testing.assert_close(t, torch.tensor([expected]))
    p = [0.1, 0.7, 0.2]
    logits = torch.log(torch.tensor([p]))
    kl_tp = sum(ti * math.log(ti / pi) for ti, pi in zip(expected, p))
    kl_pt = sum(pi * math.log(pi / ti) for ti, pi in zip(expected, p))
    assert kd_loss(logits, t, "target-first").item() == pytest.approx(kl_tp, rel=1e-5)
    assert kd_loss(logits, t, "prediction-first").item() == pytest.approx(kl_pt, rel=1e-5)
    assert kl_tp != pytest.approx(kl_pt, rel=1e-2)  # the two directions really differ here
    # A batch: the mean over samples.
    two = kd_loss(logits.repeat(2, 1), t.repeat(2, 1), "target-first")
    assert two.item() == pytest.approx(kl_tp, rel=1e-5)


def test_alignment_forms_and_the_full_loss():
    z = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    anchors = torch.tensor([[0.0, 0.0], [2.0, 3.0]])
    has = torch.tensor([True, True])
    # per sample squared norms: 1 + 4 = 5 and 4 + 4 = 8
    assert alignment_loss(z, y, anchors, has, "squared-norm").item() == pytest.approx(6.5)
    assert alignment_loss(z, y, anchors, has, "mse").item() == pytest.approx(13 / 4)
    logits = torch.tensor([[2.0, 0.0], [0.5, 0.5]])
    expert = AdaptedExpert("x", None, z, anchors, has)
    target = ensemble_target(y, [F.softmax(logits, 1)], np.array([1.0]), 2)
    s = CompFLSettings(lam=0.5, mu=2.0)
    expected = (F.cross_entropy(logits, y) + 0.5 * 13 / 4
                + 2.0 * kd_loss(logits, target, "target-first"))
    assert compfl_loss(logits, z, y, expert, target, s).item() == pytest.approx(expected.item())
    off = CompFLSettings(align=False)
    assert compfl_loss(logits, z, y, expert, None, off).item() == pytest.approx(
        F.cross_entropy(logits, y).item())


@pytest.mark.parametrize("own,epsilon", [(1, 0.3), (2, 0.3), (1, 1.0)])
def test_epsilon_greedy_frequencies_within_a_binomial_bound(own, epsilon):
    n = 4000
    draws = np.array([select_expert(own, epsilon, np.random.default_rng(
        derive_seed(0, "compfl-greedy", 5, rnd))) for rnd in range(n)])
    for j in range(own + 1):
        p = epsilon / (own + 1) + (1 - epsilon if j == own else 0.0)
        freq = np.mean(draws == j)
        assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n), (j, freq, p)


def test_the_smallest_expert_has_no_choice():
    rng = np.random.default_rng(0)
    assert {select_expert(0, 1.0, rng) for _ in range(100)} == {0}


def test_a_small_client_never_trains_the_large_expert_and_large_ones_follow_their_draw():
    fed = InProcessFederation("compfl", **FED, **{"compfl.epsilon": 1.0})
    trained = {}
    for rnd in (1, 2, 3):
        for pid, (payload, res) in fed.fit_round(rnd).items():
            experts = set(unpack(dict(zip(*_named(res)))))
            assert experts == {res.metrics["compfl-expert"]}
            trained[pid, rnd] = experts.pop()
            # What was sent: the own expert and the smaller one (never a larger one).
            assert set(unpack(payload)) == ({SMALL} if pid % 2 == 0 else {SMALL, LARGE})
    for (pid, rnd), arch in trained.items():
        if pid % 2 == 0:
            assert arch == SMALL
        else:
            draw = select_expert(1, 1.0, np.random.default_rng(
                derive_seed(0, "compfl-greedy", pid, rnd)))
            assert arch == (SMALL, LARGE)[draw]
    assert {trained[pid, rnd] for pid in (1, 3) for rnd in (1, 2, 3)} == {SMALL, LARGE}


def _named(res):
    from flwr.common import parameters_to_ndarrays
    arrays = parameters_to_ndarrays(res.parameters)
    return [str(n) for n in arrays[0]], arrays[1:]


@pytest.mark.parametrize("upload", ["delta", "weights"])
def test_aggregation_per_architecture_leaves_the_other_untouched(rng, upload):
    strategy = make_strategy("compfl", **FED, **{"compfl.upload": upload},
                             sizes=[100, 300, 600, 100])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    small0 = {k: v.copy() for k, v in strategy.extractors[SMALL].items()}
    large0 = {k: v.copy() for k, v in strategy.extractors[LARGE].items()}
    deltas = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in small0.items()}
              for _ in range(3)]
    sent = [d if upload == "delta" else {k: small0[k] + v for k, v in d.items()} for d in deltas]
    # Clients 0 and 2 (small) and client 1 (large, its epsilon-greedy pick) train the small expert.
    results = [(proxies[pid], fit_res(pack(SMALL, s), n, pid, strategy.architectures[pid]))
               for pid, s, n in zip((0, 1, 2), sent, (100, 300, 600))]
    strategy.aggregate_fit(1, results, [])
    for k, v in small0.items():
        expected = v + (100 * deltas[0][k] + 300 * deltas[1][k] + 600 * deltas[2][k]) / 1000
        np.testing.assert_allclose(strategy.extractors[SMALL][k], expected, rtol=1e-5,
                                   atol=1e-5)
    for k, v in large0.items():
        np.testing.assert_array_equal(strategy.extractors[LARGE][k], v)


@pytest.mark.parametrize("switches,down", [
    ({}, {SMALL: [SMALL], LARGE: [SMALL, LARGE]}),
    ({"compfl.greedy": False, "compfl.kd": False}, {SMALL: [SMALL], LARGE: [LARGE]}),
])
def test_traffic_is_exactly_the_extractors_from_the_encoded_payloads(tmp_path, switches, down):
    recorder = Recorder(tmp_path / "run", method="compfl", dataset="synthetic", num_clients=4,
                        num_rounds=2, config={}, partition={})
    fed = InProcessFederation("compfl", recorder=recorder, **FED, **switches)
    for rnd in (1, 2):
        sent = fed.fit_round(rnd)
        fed.evaluate_round(rnd)
        record = recorder.history[-1]
        up = sum(EXTRACTOR_FLOATS[res.metrics["compfl-expert"]] for _, res in sent.values())
        expected_down = sum(EXTRACTOR_FLOATS[a] for pid in sent
                            for a in down[fed.strategy.architectures[pid]])
        assert record["bytes_up"] == up * 4
        assert record["bytes_down"] == expected_down * 4
        assert record["rejected"] == record["failures"] == 0


def test_private_heads_of_smaller_experts_live_in_the_context():
    fed = InProcessFederation("compfl", **FED)
    fed.fit_round(1)
    key = HEAD_STATE_KEY.format(arch=SMALL)
    assert key not in fed.contexts[0].state  # the small client's own head is its model's
    saved = fed.contexts[1].state[key].to_torch_state_dict()
    restored = fed.client(1)._smaller_expert(SMALL).head.state_dict()
    for name, value in saved.items():
        torch.testing.assert_close(restored[name], value.to(restored[name].device))
    other = fed.contexts[3].state[key].to_torch_state_dict()["weight"]
    assert not torch.equal(other, saved["weight"])  # one private head per client
    del fed.contexts[3].state[key]
    fresh = fed.client(3)._smaller_expert(SMALL).head.weight  # from the seed at first use
    assert not torch.equal(fresh, other.to(fresh.device))


@pytest.mark.parametrize("bad,reason", [
    (lambda p: {k: np.full_like(v, np.nan) for k, v in p.items()}, "NaN"),
    (lambda p: dict(list(p.items())[1:]), "missing"),
    (lambda p: {k: v[..., :-1] if k.endswith("2.weight") else v for k, v in p.items()},
     "shape"),
    (lambda p: pack(SMALL, _large_extractor()), "unexpected"),   # the wrong architecture
    (lambda p: pack(LARGE, _large_extractor()), "may train only"),  # a larger expert
    (lambda p: {**p, **pack(LARGE, _large_extractor())}, "one expert"),
    (lambda p: {"extractor.0.0.weight": next(iter(p.values()))}, "does not name its expert"),
])
def test_a_bad_upload_is_rejected_and_the_round_goes_on(bad, reason, caplog):
    fed = InProcessFederation("compfl", **FED)
    fed.assert_rejects(bad, reason, caplog, pid=0)  # a client of the small expert


def _large_extractor():
    return {k: v for k, v in make_strategy("compfl", **FED).extractors[LARGE].items()}
