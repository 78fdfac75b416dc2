"""FedMD: the server's consensus, the MAE digest, the round's exact traffic, the sequence of
its phases, and the settings it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedapp.config import ConfigError
from fedapp.data import setup
from fedapp.runtime.client_base import OPTIMIZER_STATE_KEY
from fedapp.runtime.payload import decode
from strategies.fedmd import maths
from strategies.fedmd.maths import PRETRAINED_KEY, alignment_set, digest_loss
from tests.conftest import InProcessFederation, cfg_of, client_manager, fit_res, make_strategy
from tests.test_hostile_uploads import small_smoke_overrides

SMALL = small_smoke_overrides("fedmd")  # 180 synthetic samples: 18 public, A_t of 16


def test_the_consensus_of_1_3_and_3_1_is_2_2():
    # Through the server's one validation path, from two clients' replies (C = 2, m = 1).
    strategy = make_strategy("fedmd", num_classes=2, **{**SMALL, "fedmd.alignment-size": 1})
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    sizes = strategy.train_sizes
    replies = [(proxies[pid], fit_res({"logits": np.array([row], np.float32)}, sizes[pid], pid,
                                      strategy.architectures[pid]))
               for pid, row in ((0, [1.0, 3.0]), (1, [3.0, 1.0]))]
    strategy.aggregate_fit(1, replies, [])
    assert strategy._counts["rejected"] == 0
    assert strategy.payload["consensus"].tolist() == [[2.0, 2.0]]
    assert strategy.payload["indices"].tolist() == strategy.alignment(1).tolist()
    assert strategy.payload["indices"].dtype == np.int32


def test_the_mae_digest_of_0_0_to_2_2_is_2_with_gradient_minus_half_per_logit():
    logits = torch.zeros(1, 2, requires_grad=True)
    loss = digest_loss(logits, torch.tensor([[2.0, 2.0]]), "mae")
    loss.backward()
    assert loss.item() == 2.0
    assert logits.grad.tolist() == [[-0.5, -0.5]]
    # The options: MSE = mean square = 4; KL of equal softmaxes = 0.
    assert digest_loss(torch.zeros(1, 2), torch.tensor([[2.0, 2.0]]), "mse").item() == 4.0
    assert digest_loss(torch.zeros(1, 2), torch.tensor([[2.0, 2.0]]), "kl").item() == 0.0


def test_the_alignment_set_is_keyed_by_seed_and_round_and_redrawn_every_round():
    a1 = alignment_set(0, 1, 100, 20)
    assert a1.dtype == np.int32 and len(set(a1.tolist())) == 20 and a1.max() < 100
    assert np.array_equal(a1, alignment_set(0, 1, 100, 20))
    assert not np.array_equal(a1, alignment_set(0, 2, 100, 20))
    assert not np.array_equal(a1, alignment_set(1, 1, 100, 20))


def test_exact_traffic_and_what_each_message_carries():
    fed = InProcessFederation("fedmd", **SMALL)
    m, c = fed.cfg.settings.alignment_size, 10
    first = fed.fit_round(1)
    assert all(sent == {} for sent, _ in first.values())  # nothing to digest yet
    uploads = {pid: decode(res.parameters) for pid, (_, res) in first.items()}
    assert all(set(u) == {"logits"} and u["logits"].shape == (m, c) for u in uploads.values())
    assert {s.data for s in fed.strategy._up.values()} == {m * c * 4}
    second = fed.fit_round(2)
    for sent, _ in second.values():
        assert set(sent) == {"indices", "consensus"}
        assert sent["consensus"].shape == (m, c)  # (int32 on the wire: the byte count below)
        assert np.array_equal(sent["indices"], alignment_set(fed.cfg.seed, 1, 18, m))
        mean = np.mean([uploads[pid]["logits"].astype(np.float64) for pid in sorted(uploads)], 0)
        np.testing.assert_allclose(sent["consensus"], mean, rtol=1e-6)
    # m*C floats and m int32 indices down, m*C floats up, per client per round.
    assert {s.data for s in fed.strategy._down.values()} == {m * c * 4 + m * 4}
    assert {s.data for s in fed.strategy._up.values()} == {m * c * 4}


def test_uploaded_logits_are_the_models_pre_softmax_outputs_on_a_t_in_eval_mode():
    fed = InProcessFederation("fedmd", **SMALL)
    sent = fed.fit_round(1)
    client = fed.client(0)
    model = client.model  # as saved after round 1
    public = setup.public_set(fed.cfg)
    a1 = torch.from_numpy(alignment_set(fed.cfg.seed, 1, len(public), 16).astype(np.int64))
    model.eval()
    with torch.no_grad():
        want = model(public.x[a1].to(client.device)).cpu().numpy()
    np.testing.assert_allclose(decode(sent[0][1].parameters)["logits"], want, rtol=1e-5,
                               atol=1e-6)


def test_phases_their_kept_optimizers_and_the_transfer_learning_once(monkeypatch):
    calls = []
    real = maths.FedMDClient.pretrain
    monkeypatch.setattr(maths.FedMDClient, "pretrain",
                        lambda self: calls.append(self.partition_id) or real(self))
    fed = InProcessFederation("fedmd", **SMALL)
    first = fed.fit_round(1)
    # Round 1: transfer learning (public + private) and scores; the revisit starts with the
    # first digest, as the authors' sequence.
    assert sorted(calls) == [0, 1, 2]
    state = fed.contexts[0].state
    assert PRETRAINED_KEY in state and OPTIMIZER_STATE_KEY.format(name="revisit") not in state
    assert "term-digest" not in first[0][1].metrics
    fed.fit_round(2)
    assert sorted(calls) == [0, 1, 2]  # once per client
    for name in ("digest", "revisit"):
        assert OPTIMIZER_STATE_KEY.format(name=name) in state
    assert "term-digest" in fed.fit_round(3)[0][1].metrics


def test_the_codes_revisit_continues_the_adam_of_the_private_pretraining():
    def steps(fed: InProcessFederation) -> int:
        record = fed.contexts[0].state[OPTIMIZER_STATE_KEY.format(name="revisit")]
        return int(record.to_torch_state_dict()["0.step"])  # Adam's count, parameter 0

    recipe = {**SMALL, "local_epochs": 2}  # FedMD's recipe's, which SMALL replaces by one
    own = InProcessFederation("fedmd", **recipe)
    code = InProcessFederation("fedmd", **{**recipe,
                                           "fedmd.revisit-optimizer": "private-pretraining"})
    code.fit_round(1)  # round 1: no revisit, but the pre-training's Adam is kept as its own
    assert steps(code) > 0
    for fed in (own, code):
        fed.fit_round(1)
        fed.fit_round(2)
    # Round 2's revisit: 2 epochs of batches of 5 over the shard, on top of the pre-training's.
    revisit = 2 * -(-len(own.client(0).data.train_y) // 5)
    assert steps(own) == revisit
    assert steps(code) > revisit


@pytest.mark.parametrize("changed", [{"fedmd.pretrain": "public"},
                                     {"optimizer-state": "fresh"}])
def test_continuing_the_pretrainings_adam_needs_it_and_a_kept_optimizer(changed):
    with pytest.raises(ConfigError, match="fedmd.revisit-optimizer"):
        cfg_of(**{**SMALL, "fedmd.revisit-optimizer": "private-pretraining", **changed},
               method="fedmd")


def test_without_pretraining_round_1_revisits_the_private_data():
    fed = InProcessFederation("fedmd", **{**SMALL, "fedmd.pretrain": "none"})
    fed.fit_round(1)
    assert PRETRAINED_KEY not in fed.contexts[0].state
    assert OPTIMIZER_STATE_KEY.format(name="revisit") in fed.contexts[0].state


def test_early_stopping_holds_out_training_data_never_the_test_set(monkeypatch):
    seen = []
    real = maths.evaluate
    monkeypatch.setattr(maths, "evaluate", lambda model, x, y: seen.append(x) or real(model, x, y))
    fed = InProcessFederation("fedmd", **{**SMALL, "eval_global_test": True})
    fed.fit_round(1)
    client = fed.client(0)
    test_rows = {r.tobytes() for r in client.data.test_x.cpu().numpy()}
    test_rows |= {r.tobytes() for r in setup.dataset(fed.cfg).test_x.cpu().numpy()}
    allowed = {r.tobytes() for r in setup.public_set(fed.cfg).x.cpu().numpy()}
    allowed |= {r.tobytes() for r in setup.dataset(fed.cfg).train_x.cpu().numpy()}
    assert seen
    for x in seen:
        rows = {r.tobytes() for r in x.cpu().numpy()}
        assert rows <= allowed and not rows & test_rows


def test_a_method_that_needs_a_public_set_is_refused_without_one():
    with pytest.raises(ConfigError, match="needs a public set"):
        cfg_of(**{**SMALL, "public_source": "none"}, method="fedmd")


def test_an_alignment_set_larger_than_the_public_set_is_refused_before_training():
    cfg = cfg_of(**{**SMALL, "fedmd.alignment-size": 19}, method="fedmd")
    with pytest.raises(ConfigError, match="fewer than the 19"):
        setup.prepare(cfg)
    setup.prepare(cfg_of(**SMALL, method="fedmd"))  # 18 public samples, A_t of 16


def test_public_pretraining_needs_the_public_labels_and_their_classes():
    with pytest.raises(ConfigError, match="public-labels"):
        cfg_of(**{**SMALL, "public_labels": "unlabelled"}, method="fedmd")
    cfg = cfg_of(**{**SMALL, "public_labels": "unlabelled", "fedmd.pretrain": "none"},
                 method="fedmd")
    assert setup.public_set(cfg, labels=False).y is None
    with pytest.raises(ConfigError, match="digits"):
        cfg_of(**{**SMALL, "public_source": "digits"}, method="fedmd")


def test_the_client_reads_the_public_labels_only_when_allowed():
    cfg = cfg_of(**{**SMALL, "public_labels": "unlabelled", "fedmd.pretrain": "none"},
                 method="fedmd")
    fed = InProcessFederation("fedmd", **{**SMALL, "public_labels": "unlabelled",
                                          "fedmd.pretrain": "none"})
    assert fed.client(0).public()[1] is None
    assert InProcessFederation("fedmd", **SMALL).client(0).public()[1] is not None
    assert cfg.public_labels == "unlabelled"


def test_a_consensus_round_digests_toward_the_consensus(monkeypatch):
    # The digest alone (no revisit): the MAE to the consensus falls.
    fed = InProcessFederation("fedmd", **{**SMALL, "fedmd.pretrain": "none",
                                          "fedmd.digest-epochs": 5, "fedmd.digest-batch-size": 4})
    fed.fit_round(1)
    client = fed.client(0)
    public = setup.public_set(fed.cfg)
    idx = alignment_set(fed.cfg.seed, 1, len(public), 16)
    target = np.full((16, 10), 0.5, np.float32)
    client.receive({"indices": idx, "consensus": target}, 2)
    x = public.x[torch.from_numpy(idx.astype(np.int64))].to(client.device)
    before = digest_loss(torch.from_numpy(maths.scores(client.model, x)),
                         torch.from_numpy(target), "mae").item()
    monkeypatch.setattr(maths, "train_recipe", lambda *a, **k: None)  # no revisit
    client.train(2)
    after = digest_loss(torch.from_numpy(maths.scores(client.model, x)),
                        torch.from_numpy(target), "mae").item()
    assert after < before


def test_no_digest_is_the_transfer_learning_alone(monkeypatch):
    # fedmd.digest-epochs = 0: a consensus round trains exactly as the revisit alone; with the
    # digest, the same round from the same state ends elsewhere.
    def after_a_consensus_round(digest_epochs: int) -> tuple[list, InProcessFederation]:
        fed = InProcessFederation("fedmd", **{**SMALL, "fedmd.digest-epochs": digest_epochs})
        fed.fit_round(1)
        fed.fit_round(2)
        return [p.detach().clone() for p in fed.client(0).model.parameters()], fed

    plain, fed = after_a_consensus_round(0)
    assert OPTIMIZER_STATE_KEY.format(name="digest") not in fed.contexts[0].state
    assert OPTIMIZER_STATE_KEY.format(name="revisit") in fed.contexts[0].state
    assert "term-digest" not in fed.fit_round(3)[0][1].metrics
    digested, _ = after_a_consensus_round(1)
    assert any(not torch.equal(a, b) for a, b in zip(plain, digested))

