"""FedGen: the traffic of the spec's formula, the teacher weights and ensemble of its checks, the
generator, the client's generator term, the histogram asked for once, and one seed one result."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapp.runtime.payload import PayloadError, decode
from fedapp.runtime.results import Recorder
from strategies.fedgen import FedGenSettings
from strategies.fedgen.maths import Generator, diversity_loss, teacher_weights, train_generator
from tests.conftest import InProcessFederation
from tests.test_hostile_uploads import small_smoke_overrides

D, C, ND, HD = 64, 10, 32, 512  # small_smoke_overrides' d; the generator's defaults


def _federation(tmp_path, rounds=3, **extra):
    recorder = Recorder(tmp_path / "run", method="fedgen", dataset="synthetic", num_clients=3,
                        num_rounds=rounds, config={}, partition={})
    overrides = {**small_smoke_overrides("fedgen"), "num_server_rounds": rounds, **extra}
    return InProcessFederation("fedgen", recorder=recorder, **overrides), recorder


def generator_params(nd, c, hd, d):
    """Linear(nd + C, hd) + BatchNorm1d(hd)'s affine pair + Linear(hd, d)."""
    return (nd + c) * hd + hd + 2 * hd + hd * d + d


def test_generator_size_is_the_specs_285696_at_nd_32_hd_512_d_512():
    g = Generator(32, 10, 512, 512)
    assert sum(p.numel() for p in g.parameters()) == generator_params(32, 10, 512, 512) \
        == 285_696
    # Head + G down: about 1.16 MB, as the spec says.
    assert round(4 * (512 * 10 + 10 + 285_696) / 1e6, 2) == 1.16


def test_traffic_per_client_per_round_is_the_specs_formula(tmp_path):
    fed, recorder = _federation(tmp_path)
    for rnd in (1, 2, 3):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    head = D * C + C
    per_round = [(r["bytes_up"] / 3, r["bytes_down"] / 3) for r in recorder.history]
    # Round 1: the head down, with the one-int request for the histogram; the head and the C
    # label counts (32 bits each) up.
    assert per_round[0] == (4 * (head + C), 4 * (head + 1))
    # Then: the head up; the head, G's parameters and the pooled histogram down.
    for up, down in per_round[1:]:
        assert up == 4 * head
        assert down == 4 * (head + generator_params(ND, C, HD, D) + C)


def test_teacher_weights_sum_to_one_and_follow_the_sample_counts():
    counts = np.array([[20, 10, 0], [0, 10, 0]])   # two clients, three labels
    n = np.array([30.0, 10.0])
    samples = teacher_weights(counts, n, "samples")
    np.testing.assert_allclose(samples, [[0.75, 0.25]] * 3)         # n = (30, 10)
    labels = teacher_weights(counts, n, "label")
    np.testing.assert_allclose(labels, [[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]])
    np.testing.assert_allclose(samples.sum(1), 1.0)
    np.testing.assert_allclose(labels[:2].sum(1), 1.0)   # every label somebody holds


def test_with_identical_heads_the_ensemble_is_that_head():
    # Two copies of one head weighted (.75, .25) train G exactly as the head alone does.
    settings = FedGenSettings(server_steps=3, noise_dim=4, hidden_dim=8)
    torch.manual_seed(0)
    head = {"head.weight": np.random.default_rng(0).normal(size=(C, 6)).astype(np.float32),
            "head.bias": np.random.default_rng(1).normal(size=C).astype(np.float32)}
    pool = np.arange(1, C + 1)
    gens = [Generator(4, C, 8, 6) for _ in range(2)]
    gens[1].load_state_dict(gens[0].state_dict())
    loss_two = train_generator(gens[0], [head, head], np.tile([0.75, 0.25], (C, 1)), pool,
                               settings, batch_size=5, seed=7)
    loss_one = train_generator(gens[1], [head], np.ones((C, 1)), pool, settings,
                               batch_size=5, seed=7)
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    # (Compared by output: the bias before BatchNorm has a zero gradient, which Adam turns
    # into steps of rounding noise, and which BatchNorm's batch statistics cancel.)
    labels, eps = torch.arange(C), torch.rand(C, 4)
    torch.testing.assert_close(gens[0](labels, eps), gens[1](labels, eps), rtol=1e-4,
                               atol=1e-4)


def test_generator_outputs_b_by_d_and_its_diversity_term_by_hand():
    g = Generator(ND, C, HD, D)
    out = g(torch.tensor([0, 3, 9]), torch.rand(3, ND))
    assert out.shape == (3, D)
    # eps 0 and 1 (squared distance 1), features 0 and 2 (absolute distance 2): the mean over
    # the 2 x 2 pairs of 1 * 2 is 1, so the term is exp(-1).
    value = diversity_loss(torch.tensor([[0.0], [1.0]]), torch.tensor([[0.0], [2.0]]))
    assert float(value) == pytest.approx(math.exp(-1))


def test_client_term_weight_decays_as_the_authors_code_with_its_floor():
    s = FedGenSettings()
    assert s.client_term_weight(1) == 10.0
    assert s.client_term_weight(2) == pytest.approx(9.8)
    assert s.client_term_weight(1000) == 1e-4
    assert FedGenSettings(client_weight=1.0, client_weight_decay=1.0).client_term_weight(50) \
        == 1.0


def test_the_generator_term_trains_the_head_only_and_draws_absent_classes(tmp_path):
    fed, _ = _federation(tmp_path, partition="pathological", classes_per_client=2)
    fed.fit_round(1)
    payload = fed.strategy.fit_payload(2, None)
    client = fed.client(0)
    client.receive(payload, 2)
    own = set(client.data.train_y.tolist())
    pool = client.label_pool.numpy()
    assert set(np.flatnonzero(pool)) - own, "the pooled labels include classes it lacks"
    # Only the head gets a gradient from CE(h(G(y~)), y~).
    model = client.model
    labels = torch.arange(C, device=client.device)
    with torch.no_grad():
        generated = client.generator(labels, torch.randn(C, ND, device=client.device))
    model.zero_grad()
    F.cross_entropy(model.head(generated), labels).backward()
    assert all(p.grad is None for p in model.extractor.parameters())
    assert model.head.weight.grad is not None and model.head.weight.grad.abs().sum() > 0


def test_the_histogram_is_asked_for_once_and_checked(tmp_path):
    fed, _ = _federation(tmp_path)
    first = fed.fit_round(1)
    assert all("send-label-counts" in sent for sent, _ in first.values())
    second = fed.fit_round(2)
    assert not any("send-label-counts" in sent for sent, _ in second.values())
    strategy = fed.strategy
    client = next(iter(strategy.clients.values()))
    assert strategy.label_counts[client.partition_id].sum() == \
        strategy.train_sizes[client.partition_id]
    # A new server asks again; a histogram that does not count every sample is refused.
    fresh, _ = _federation(tmp_path / "again")
    fresh.fit_round(1)
    bad = {"label-counts": np.zeros(C, np.int64)}
    with pytest.raises(PayloadError, match="label counts sum to 0"):
        fresh.strategy.check_upload(bad, client)


def test_one_seed_one_result(tmp_path):
    runs = []
    for name in ("a", "b"):
        fed, _ = _federation(tmp_path / name)
        for rnd in (1, 2):
            fed.fit_round(rnd)
        runs.append(fed.strategy)
    a, b = runs
    for k in a.global_head:
        np.testing.assert_array_equal(a.global_head[k], b.global_head[k])
    for pa, pb in zip(a.generator.parameters(), b.generator.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_htfllibs_discarded_generator_sends_the_initial_one_every_round(tmp_path):
    # keep-generator = false is HtFLlib's code: its server trains a copy of the initial G and
    # drops it, so the clients get the untrained G in every round (fails if G is trained or
    # no G is sent).
    fed, _ = _federation(tmp_path, **{"fedgen.keep-generator": False})
    initial = {k: v.detach().clone() for k, v in fed.strategy.generator.named_parameters()}
    for rnd in (1, 2, 3):
        fed.fit_round(rnd)
        sent = fed.strategy.fit_payload(rnd + 1, None)
        for k, v in initial.items():
            np.testing.assert_array_equal(sent["generator." + k], v.numpy())
    kept, _ = _federation(tmp_path / "kept")
    kept.fit_round(1)
    trained = kept.strategy.fit_payload(2, None)
    assert any(not np.array_equal(trained["generator." + k], v.numpy())
               for k, v in initial.items()), "the paper's server trains G"


@pytest.mark.parametrize("permuted", [False, True])
def test_label_pool_from_the_partition_sends_g_in_round_one_and_asks_for_nothing(tmp_path,
                                                                                 permuted):
    # label-pool = "partition" is HtFLlib's start-up: the server knows every client's labels
    # (as the client sees them) before round 1, so G and the pool go down at once and no
    # client uploads its histogram (fails on a server that waits for the first uploads).
    fed, _ = _federation(tmp_path, label_permutation=permuted,
                         **{"fedgen.label-pool": "partition"})
    first = fed.fit_round(1)
    for pid, (sent, res) in first.items():
        assert "send-label-counts" not in sent
        assert "label-counts" not in decode(res.parameters)
        assert any(k.startswith("generator.") for k in sent)
        client = fed.client(pid)
        np.testing.assert_array_equal(fed.strategy.label_counts[pid], np.bincount(
            client.data.train_y.cpu().numpy(), minlength=C))
    expected = sum(np.bincount(fed.client(p).data.train_y.cpu().numpy(), minlength=C)
                   for p in first)
    np.testing.assert_array_equal(sent["label-pool"], expected)
    client = fed.client(0)
    client.receive(sent, 1)
    assert client.generator is not None  # round 1 trains with the generator term
    uploads, _ = _federation(tmp_path / "uploads")
    assert not any(k.startswith("generator.") for sent, _ in uploads.fit_round(1).values()
                   for k in sent)


@pytest.mark.parametrize("init", ["per-client", "per-architecture", "shared"])
def test_the_first_global_head_is_client_0s_initial_head_under_every_model_init(tmp_path, init):
    # HtFLlib's clients all start from one head; the server's must be client 0's start as the
    # clients build it, whatever key model-init gives a client's model.
    fed, _ = _federation(tmp_path, model_init=init)
    head = fed.client(0).model.head.state_dict()
    for k, v in fed.strategy.global_head.items():
        np.testing.assert_array_equal(v, head[k.split(".", 1)[1]].cpu().numpy())


def test_rounds_record_the_client_terms_and_the_generators_loss(tmp_path):
    """What finds a collapse (docs/fedgen.md): per round, how well the heads fit G's features,
    the share of the loss that term is, both feature norms, and G's own loss on the server."""
    fed, recorder = _federation(tmp_path)
    for rnd in (1, 2, 3):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    first, *later = recorder.history
    assert "train_terms" not in first  # no G in round 1: plain cross-entropy
    s = FedGenSettings()
    for rnd, record in enumerate(later, start=2):
        terms = record["train_terms"]
        assert 0 < terms["generated-share"] < 1
        assert terms["feature-norm-real"] > 0 and terms["feature-norm-generated"] > 0
        # The loss the clients minimised is the two terms, the generated one at alpha_t.
        alpha = s.client_term_weight(rnd)
        assert record["train_loss"] == pytest.approx(
            terms["ce-real"] + alpha * terms["ce-generated"], rel=0.05)
    assert all(math.isfinite(r["server_terms"]["generator-ce"]) for r in recorder.history)
