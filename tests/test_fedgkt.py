"""FedGKT: the exact traffic, the client's loss (equal to Standalone's without distillation,
server logits keyed by sample id through shuffled batches, KL_T by hand), the server's
training on the uploads, its logits sent back by sample id, evaluation with the server model,
and what is refused."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from client_models import build_model
from client_models.stems import common_stem_shape, stem
from fedapp.config import ConfigError
from fedapp.runtime import client_base
from fedapp.runtime.client_base import MODEL_STATE_KEY
from fedapp.runtime.payload import encode, float32, wire_size
from strategies.fedgkt import FedGKTSettings
from strategies.fedgkt import maths
from strategies.fedgkt.maths import kl_t, train_server
from tests.conftest import InProcessFederation, cfg_of, recorded_federation

SMALL = dict(dataset="synthetic", synthetic_train=180, synthetic_test=90, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             model_width=0.25)
C = 10


def test_traffic_is_n_times_map_logits_label_id_up_and_n_logits_down(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedgkt", **SMALL)
    sizes = fed.strategy.train_sizes
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    round1, round2 = recorder.history
    f = math.prod(fed.strategy.map_shape)
    assert fed.strategy.map_shape == (4, 12, 12)  # FedGH CNN conv1 (16 x 0.25) after pooling
    # Per sample: F + C float32 and the label and id as int32.
    assert round1["bytes_up"] == round2["bytes_up"] == sum(sizes) * ((f + C) * 4 + 2 * 4)
    assert round1["bytes_down"] == 0  # no server logits before the server has trained
    assert round2["bytes_down"] == sum(sizes) * C * 4
    # The server model, sent for evaluation to each of the three clients, is counted apart
    # (with its encoding: eval_bytes_down is what crosses the wire).
    model_bytes = wire_size(encode(float32(fed.strategy.eval_payload(2, None)))).total
    assert model_bytes > 0
    assert round1["eval_bytes_down"] == round2["eval_bytes_down"] == 3 * model_bytes


def test_without_the_server_model_in_evaluation_nothing_more_is_sent(tmp_path):
    fed, recorder = recorded_federation(tmp_path, "fedgkt", rounds=1,
                                        **{**SMALL, "fedgkt.eval_server_model": False})
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    assert recorder.history[0]["eval_bytes_down"] == 0
    assert all("accuracy-server-model" not in m for m in metrics.values())


def test_evaluation_reports_the_own_model_and_the_stem_with_the_server_model():
    fed = InProcessFederation("fedgkt", **SMALL)
    fed.fit_round(1)
    metrics = fed.evaluate_round(1)
    server = fed.strategy.server_model.eval()
    for pid, m in metrics.items():
        client = fed.client(pid)
        x, y = client.data.test_x, client.data.test_y
        with torch.no_grad():
            own = (client.model.eval()(x).argmax(1) == y).float().mean().item()
            # The server model lives on the server (the CPU here), the stem on the client.
            maps = stem(client.model)(x).cpu()
            paper = (server(maps).argmax(1) == y.cpu()).float().mean().item()
        assert m["accuracy"] == pytest.approx(own)
        assert m["accuracy-server-model"] == pytest.approx(paper)


def test_kl_t_at_t3_is_zero_for_equal_logits_and_as_computed_by_hand():
    z = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    assert kl_t(z, z.clone(), 3.0).item() == pytest.approx(0.0, abs=1e-7)
    # target (3, 0) and logits (0, 0) at T = 3: p = softmax(1, 0), q = (1/2, 1/2).
    p = torch.tensor([math.e, 1.0]) / (math.e + 1)
    want = 9 * float((p * torch.log(p / 0.5)).sum())
    got = kl_t(torch.tensor([[3.0, 0.0]]), torch.zeros(1, 2), 3.0).item()
    assert got == pytest.approx(want, rel=1e-6)


def _training_settings(**extra):
    # Every training setting given, so that both methods train alike whatever their recipes.
    return dict(SMALL, optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4,
                grad_clip=0.0, batch_size=16, local_epochs=2, optimizer_state="keep",
                feature_dim=0, **extra)


def test_with_alpha_zero_the_client_trains_exactly_as_standalone():
    def states(method, **extra):
        client_base._MODEL_CACHE.clear()
        fed = InProcessFederation(method, **_training_settings(**extra))
        losses = []
        for rnd in (1, 2):  # round 2: FedGKT's clients hold server logits, weighted by 0
            losses.append({p: res.metrics["train-loss"]
                           for p, (_, res) in fed.fit_round(rnd).items()})
        return losses, [c.state[MODEL_STATE_KEY].to_torch_state_dict() for c in fed.contexts]

    gkt_losses, gkt = states("fedgkt", **{"fedgkt.alpha": 0.0})
    alone_losses, alone = states("standalone")
    assert gkt_losses == alone_losses
    for a, b in zip(gkt, alone):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_server_logits_meet_their_own_sample_through_shuffled_batches(monkeypatch):
    fed = InProcessFederation("fedgkt", **_training_settings())
    client = fed.client(0)
    x = client.data.train_x
    n = len(x)
    # Row i of the table is a fingerprint of sample i's pixels.
    table = x.reshape(n, -1)[:, :C].cpu().numpy().copy()
    client.receive({"logits": table}, 2)
    inputs, targets = [], []
    client.model.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    real = maths.kl_t
    monkeypatch.setattr(maths, "kl_t",
                        lambda t, o, temp: targets.append(t) or real(t, o, temp))
    client.train(2)
    assert len(inputs) == len(targets) == 2 * math.ceil(n / 16)
    assert not torch.equal(inputs[0], x[:len(inputs[0])])  # the batches are shuffled
    for batch, target in zip(inputs, targets):
        assert torch.equal(target, batch.reshape(len(batch), -1)[:, :C])


def test_one_server_epoch_lowers_the_servers_ce_on_the_uploads():
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randn(12, 2, 3, 3, generator=gen), torch.randn(12, C, generator=gen),
              torch.randint(0, C, (12,), generator=gen)) for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(18, C))
    maps = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[2] for p in parts])
    with torch.no_grad():
        before = F.cross_entropy(model(maps), labels).item()
        first = model(parts[0][0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    logits = train_server(model, optimizer, parts, FedGKTSettings(server_epochs=1),
                          batch_size=12, generator=gen)
    with torch.no_grad():
        after = F.cross_entropy(model(maps), labels).item()
    assert after < before
    # Client after client, one batch each: client 0's logits are the model's before any step.
    assert [z.shape for z in logits] == [(12, C)] * 3
    np.testing.assert_allclose(logits[0], first.numpy(), rtol=1e-6)


def test_the_server_sends_back_each_samples_logits_by_its_id():
    fed = InProcessFederation("fedgkt", **SMALL, **{"fedgkt.server_logits": "eval"})
    uploads = {}

    def shuffle_rows(pid, arrays):
        # A client may upload its samples in any order: the ids say which is which.
        from fedapp.runtime.payload import from_ndarrays, to_ndarrays
        payload = from_ndarrays(arrays)
        uploads[pid] = payload
        mix = np.random.default_rng(pid).permutation(len(payload["sample_ids"]))
        return to_ndarrays({k: v[mix] for k, v in payload.items()})

    fed.fit_round(1, tamper=shuffle_rows)
    assert fed.strategy._counts["rejected"] == 0
    server = fed.strategy.server_model.eval()
    for pid, payload in uploads.items():
        with torch.no_grad():
            want = server(torch.from_numpy(payload["features"])).numpy()  # in id order
        np.testing.assert_allclose(fed.strategy.fit_payload(2, fed.strategy.clients[
            fed.proxies[pid].cid])["logits"], want, rtol=1e-5, atol=1e-6)


def test_uploads_with_wrong_ids_or_counts_are_rejected(caplog):
    def duplicated(upload):
        ids = upload["sample_ids"].copy()
        ids[1] = ids[0]
        return {**upload, "sample_ids": ids}

    InProcessFederation("fedgkt", **SMALL).assert_rejects(duplicated, "sample ids", caplog)
    caplog.clear()

    def short(upload):
        return {k: v[:-1] for k, v in upload.items()}

    InProcessFederation("fedgkt", **SMALL).assert_rejects(short, "training examples", caplog)


def test_stems_that_differ_are_refused_before_the_run():
    with pytest.raises(ConfigError, match="different shapes.*cnn5: 4x12x12.*gkt-resnet8: "
                                          "4x28x28"):
        cfg_of(method="fedgkt", **{**SMALL, "arch_mix": "cnn5,gkt-resnet8"})
    with pytest.raises(ConfigError, match="no stem"):
        cfg_of(method="fedgkt", **{**SMALL, "arch_mix": "fedhe-cnn0"})
    with pytest.raises(ConfigError, match="fedgkt.server-arch"):
        cfg_of(method="fedgkt", **SMALL, **{"fedgkt.server_arch": "no-such-model"})
    # The gkt clients share one stem; their classifier paths differ.
    cfg_of(method="fedgkt", **{**SMALL, "arch_mix": "gkt-resnet5,gkt-resnet8,gkt-resnet11"})


def test_every_gkt_client_emits_16_channels_at_full_resolution_and_cnns_16x12x12():
    assert common_stem_shape(["gkt-resnet5", "gkt-resnet8", "gkt-resnet11"], (1, 28, 28),
                             C) == (16, 28, 28)
    assert common_stem_shape(["cnn1", "cnn2", "cnn3", "cnn4", "cnn5"], (1, 28, 28),
                             C) == (16, 12, 12)
    server = build_model("gkt-server-resnet20", (16, 12, 12), C)
    assert server(torch.zeros(2, 16, 12, 12)).shape == (2, C)


def test_robust_rules_are_refused_the_server_trains_on_each_upload():
    with pytest.raises(ConfigError, match="server-distillation"):
        cfg_of(method="fedgkt", robust_aggregation="median", **SMALL)


def test_a_shuffled_server_order_follows_its_keyed_generator_and_the_weighting_its_setting():
    def run(seed, **settings):
        gen = torch.Generator().manual_seed(0)
        parts = [(torch.randn(10, 2, 2, 2, generator=gen), torch.randn(10, C, generator=gen),
                  torch.randint(0, C, (10,), generator=gen)) for _ in range(2)]
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, C))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return train_server(model, optimizer, parts,
                            FedGKTSettings(server_epochs=2, **settings), batch_size=4,
                            generator=torch.Generator().manual_seed(seed))

    shuffled = run(5, server_order="shuffled")
    assert all(np.array_equal(a, b) for a, b in zip(shuffled, run(5, server_order="shuffled")))
    assert not all(np.array_equal(a, b) for a, b in zip(shuffled,
                                                         run(6, server_order="shuffled")))
    # With alpha = 1 the paper's and the reference's server losses are the same sum.
    paper = run(0, server_distill=True, server_weighting="paper")
    code = run(0, server_distill=True, server_weighting="code")
    assert all(np.allclose(a, b) for a, b in zip(paper, code))
    halved = run(0, server_distill=True, server_weighting="code", alpha=0.5)
    assert not all(np.allclose(a, b) for a, b in zip(halved, run(
        0, server_distill=True, server_weighting="paper", alpha=0.5)))
