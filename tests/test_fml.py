"""FML and the two-model client it shares with FedMRL and FedKD (fedapp/runtime/two_models.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedapp.runtime.client_base as client_base
from fedapp.config import ConfigError
from fedapp.runtime.payload import decode, wire_size
from fedapp.runtime.results import Recorder
from fedapp.runtime.two_models import SHARED_STATE_KEY, kl_to
from strategies.fml import FMLSettings
from strategies.fml.maths import mutual_losses
from tests.conftest import InProcessFederation, cfg_of, client_manager, fit_res, make_strategy
from tests.test_hostile_uploads import small_smoke_overrides

# FedGH's CNN-5 at 1x28x28 with d = 500, C = 10, counted by hand: conv1 1*16*25 + 16, conv2
# 16*32*25 + 32, fc1 (32*4*4)*500 + 500, fc2 500*500 + 500, head 500*10 + 10.
CNN5_FLOATS = (16 * 25 + 16) + (32 * 16 * 25 + 32) + (512 * 500 + 500) + (500 * 500 + 500) + 5010


def test_the_shared_model_is_the_smallest_architecture_and_travels_whole_each_way(tmp_path):
    assert CNN5_FLOATS == 525_258
    recorder = Recorder(tmp_path / "run", method="fml", dataset="fmnist", num_clients=5,
                        num_rounds=1, config={}, partition={})
    strategy = make_strategy("fml", recorder, num_clients=5, feature_dim=500,
                             arch_mix="cnn1,cnn2,cnn3,cnn4,cnn5", sizes=[100, 200, 300, 150, 250])
    assert strategy.shared_arch == "cnn5"
    manager, proxies = client_manager(strategy)
    instructions = strategy.configure_fit(1, None, manager)
    assert [wire_size(ins.parameters).data for _, ins in instructions] == [CNN5_FLOATS * 4] * 5
    sent = decode(instructions[0][1].parameters)
    rng = np.random.default_rng(1)
    uploads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in sent.items()}
               for _ in range(5)]
    sizes = [100, 200, 300, 150, 250]
    strategy.aggregate_fit(1, [(p, fit_res(u, n, i, f"cnn{i + 1}")) for i, (p, u, n)
                               in enumerate(zip(proxies, uploads, sizes))], [])
    # Weighted by training-set size (the paper; HtFLlib: fml.average = "uniform").
    expected = sum(u["head.weight"].astype(np.float64) * n for u, n in zip(uploads, sizes)) / 1000
    np.testing.assert_allclose(strategy.shared_model["head.weight"], expected, rtol=1e-5,
                               atol=1e-6)
    assert sum(size.data for size in strategy._up.values()) == 5 * CNN5_FLOATS * 4
    uniform = make_strategy("fml", num_clients=5, feature_dim=500, **{"fml.average": "uniform"},
                            arch_mix="cnn1,cnn2,cnn3,cnn4,cnn5", sizes=sizes)
    manager, proxies = client_manager(uniform)
    uniform.configure_fit(1, None, manager)
    uniform.aggregate_fit(1, [(p, fit_res(u, n, i, f"cnn{i + 1}")) for i, (p, u, n)
                              in enumerate(zip(proxies, uploads, sizes))], [])
    np.testing.assert_allclose(uniform.shared_model["head.weight"],
                               np.mean([u["head.weight"] for u in uploads], axis=0), rtol=1e-5,
                               atol=1e-6)


def test_the_shared_architecture_is_a_setting_checked_before_training():
    assert make_strategy("fml", num_clients=2, arch_mix="cnn1,cnn3",
                         **{"fml.shared-arch": "cnn3"}).shared_arch == "cnn3"
    with pytest.raises(ConfigError, match="fml.shared-arch"):
        cfg_of(method="fml", **{"fml.shared-arch": "nosuchnet"})
    with pytest.raises(ConfigError, match="one architecture"):
        cfg_of(method="fml", **{"fml.shared-arch": "cnn1,cnn2"})


def test_mutual_losses_by_hand():
    # p = (.5, .5), q = (.9, .1), y = 0; alpha = 0.9 (the default), beta = 0.5.
    o_private = torch.zeros(1, 2, requires_grad=True)
    o_meme = torch.tensor([[math.log(9.0), 0.0]], requires_grad=True)
    y = torch.tensor([0])
    kl_qp = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)      # 0.368
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0)  # 0.511
    settings = FMLSettings()
    l_private, l_meme = mutual_losses(o_private, o_meme, y, settings)
    assert kl_qp == pytest.approx(0.368, abs=1e-3)
    assert l_private.item() == pytest.approx(0.9 * math.log(2) + 0.1 * kl_qp, rel=1e-6)
    assert l_meme.item() == pytest.approx(0.5 * -math.log(0.9) + 0.5 * kl_pq, rel=1e-6)
    # The paper's alpha = 0.5: half the private model's loss is its KL to the meme model.
    paper, _ = mutual_losses(o_private, o_meme, y, FMLSettings(alpha=0.5))
    assert paper.item() == pytest.approx(0.5 * math.log(2) + 0.5 * kl_qp, rel=1e-6)
    # KLDivLoss's default (HtFLlib) also divides by C = 2: KLm = 0.184.
    assert kl_to(o_meme, o_private, "mean").item() == pytest.approx(kl_qp / 2, rel=1e-6)
    # The partner is held constant: L_theta does not move the meme model ...
    (grad,) = torch.autograd.grad(l_private, o_meme, allow_unused=True, retain_graph=True)
    assert grad is None
    # ... unless HtFLlib's undetached form is asked for.
    undetached, _ = mutual_losses(o_private, o_meme, y, FMLSettings(detach_partner=False))
    assert torch.count_nonzero(torch.autograd.grad(undetached, o_meme)[0]) == 2
    # alpha = beta = 1 (HtFLlib's defaults): two independent cross-entropies.
    l_private, l_meme = mutual_losses(o_private, o_meme, y, FMLSettings(alpha=1.0, beta=1.0))
    assert (l_private + l_meme).item() == pytest.approx(math.log(2) - math.log(0.9), rel=1e-6)
    # Equal logits: no KL gradient.
    same = torch.tensor([[1.0, -2.0]], requires_grad=True)
    assert torch.count_nonzero(torch.autograd.grad(kl_to(same.detach(), same), same)[0]) == 0


def test_both_models_and_their_optimizers_live_in_the_clients_state():
    fed = InProcessFederation("fml", **small_smoke_overrides("fml"), optimizer_state="keep")
    fed.fit_round(1)
    state = fed.contexts[1].state
    assert SHARED_STATE_KEY in state
    assert {"fedapp.optimizer.model", "fedapp.optimizer.shared"} <= set(state)
    trained = {k: v.clone() for k, v in fed.client(1).shared.state_dict().items()}
    client_base._MODEL_CACHE.clear()
    restored = fed.client(1).shared.state_dict()
    assert all(torch.equal(restored[k], trained[k]) for k in trained)
    # What was trained is what was uploaded, and it differs from what was sent.
    sent = fed.strategy.shared_model
    fed2 = InProcessFederation("fml", **small_smoke_overrides("fml"), optimizer_state="keep")
    seen = fed2.fit_round(1)
    upload = decode(seen[1][1].parameters)
    assert any(not np.array_equal(upload[k], seen[1][0][k]) for k in upload)
    assert sent.keys() == upload.keys()

