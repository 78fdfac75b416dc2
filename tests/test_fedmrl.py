"""FedMRL: the Matryoshka loss by hand, the projector's lifetime, traffic, evaluation."""

from __future__ import annotations

import math

import pytest
import torch

import fedapp.runtime.client_base as client_base
from fedapp.config import ConfigError
from fedapp.runtime.payload import wire_size
from fedapp.runtime.two_models import MODULE_STATE_KEY
from strategies.fedmrl.maths import MatryoshkaPredictor, matryoshka_loss
from tests.conftest import InProcessFederation, cfg_of, client_manager, make_strategy
from tests.test_hostile_uploads import small_smoke_overrides

# FedGH's CNN-5 at 1x28x28 with d = 500 pooled to s = 128 (HtFLlib's -sfd), C = 10, counted by
# hand: conv1 1*16*25 + 16, conv2 16*32*25 + 32, fc1 (32*4*4)*500 + 500, fc2 500*500 + 500 (the
# pooling has no parameters), head 128*10 + 10; with shared-reduce = "linear" fc2 is 500*128 + 128.
PSI_FLOATS = 416 + 12832 + (512 * 500 + 500) + (500 * 500 + 500) + (128 * 10 + 10)
PSI_FLOATS_LINEAR = 416 + 12832 + (512 * 500 + 500) + (500 * 128 + 128) + (128 * 10 + 10)


class Columns(torch.nn.Module):
    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, x):
        return x[:, self.start:self.stop]


def _linear(weight, bias):
    layer = torch.nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        layer.bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return layer


def test_the_matryoshka_loss_by_hand():
    # g(x) = 1 (s = 1), f(x) = (2, 0) (d = 2); P = [[1, 0, 0], [0, 1, 1]] gives r = (1, 2).
    predictor = MatryoshkaPredictor(Columns(0, 1), Columns(1, 3),
                                    _linear([[1, 0, 0], [0, 1, 1]], [0, 0]),
                                    _linear([[1, 0], [0, 1]], [0, 0]))
    shared_head = _linear([[1], [0]], [0, 0])
    x, y = torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([0])
    torch.testing.assert_close(predictor.represent(x), torch.tensor([[1.0, 2.0]]))
    # Private head: logits (1, 2); shared head on r[:1] = 1: logits (1, 0).
    expected = math.log(1 + math.e) + math.log(1 + math.exp(-1))
    assert matryoshka_loss(predictor, shared_head, x, y).item() == pytest.approx(expected,
                                                                                  rel=1e-6)


def test_with_projector_zero_identity_the_private_path_is_the_plain_local_model():
    fed = InProcessFederation("fedmrl", **small_smoke_overrides("fedmrl"))
    client = fed.client(0)
    projector = client.modules["projector"]
    s, d = client.shared.feature_dim, client.model.feature_dim
    with torch.no_grad():
        projector.weight.copy_(torch.cat([torch.zeros(d, s), torch.eye(d)], dim=1))
        projector.bias.zero_()
    x = client.data.test_x[:8]
    client.model.eval()
    client.shared.eval()
    torch.testing.assert_close(client.predictor()(x), client.model(x))


def test_psi_travels_whole_each_way_and_only_psi():
    assert PSI_FLOATS == 521_538 and PSI_FLOATS_LINEAR == 335_166
    strategy = make_strategy("fedmrl", num_clients=5, feature_dim=500,
                             arch_mix="cnn1,cnn2,cnn3,cnn4,cnn5")
    assert strategy.shared_arch == "cnn5"
    manager, _ = client_manager(strategy)
    assert [wire_size(ins.parameters).data for _, ins in strategy.configure_fit(1, None, manager)
            ] == [PSI_FLOATS * 4] * 5
    # Evaluation uses the client's own psi: nothing is sent (HtFLlib's "global": psi again).
    assert all(wire_size(ins.parameters).data == 0
               for _, ins in strategy.configure_evaluate(1, None, manager))
    htfl = make_strategy("fedmrl", num_clients=5, feature_dim=500, **{
        "fedmrl.eval-shared": "global"}, arch_mix="cnn1,cnn2,cnn3,cnn4,cnn5")
    manager, _ = client_manager(htfl)
    htfl.configure_fit(1, None, manager)
    assert all(wire_size(ins.parameters).data == PSI_FLOATS * 4
               for _, ins in htfl.configure_evaluate(1, None, manager))
    with pytest.raises(ConfigError, match="s <= d"):
        cfg_of(method="fedmrl", feature_dim=64, **{"fedmrl.shared-dim": 100})
    linear = make_strategy("fedmrl", num_clients=5, feature_dim=500, **{
        "fedmrl.shared-reduce": "linear"}, arch_mix="cnn1,cnn2,cnn3,cnn4,cnn5")
    manager, _ = client_manager(linear)
    assert [wire_size(ins.parameters).data for _, ins in linear.configure_fit(1, None, manager)
            ] == [PSI_FLOATS_LINEAR * 4] * 5


def test_the_pooled_shared_extractor_averages_groups_of_d_over_s_features():
    # HtFLlib's BaseHeadSplit: the extractor's own d-long output, averaged in s groups.
    fed = InProcessFederation("fedmrl", **{**small_smoke_overrides("fedmrl"), "feature_dim": 64,
                                           "fedmrl.shared-dim": 16})
    shared = fed.client(0).shared
    inner, pool = shared.extractor
    x = fed.client(0).data.test_x[:4]
    with torch.no_grad():
        full = inner(x)
        assert full.shape[1] == 64 and shared.head.in_features == 16 == shared.feature_dim
        torch.testing.assert_close(shared.extractor(x), full.view(4, 16, 4).mean(dim=2))


@pytest.mark.parametrize("keep", [True, False])
def test_the_projector_learns_across_rounds_unless_htfllibs_is_asked_for(keep):
    client_base._MODEL_CACHE.clear()
    fed = InProcessFederation("fedmrl", **small_smoke_overrides("fedmrl"),
                              **{"fedmrl.keep-projector": keep})
    initial = {k: v.clone() for k, v in fed.client(0).modules["projector"].state_dict().items()}
    fed.fit_round(1)
    after = fed.client(0).modules["projector"].state_dict()
    moved = any(not torch.equal(after[k], initial[k]) for k in initial)
    assert moved == keep
    assert (MODULE_STATE_KEY.format(name="projector") in fed.contexts[0].state) == keep
    fed.fit_round(2)
    again = fed.client(0).modules["projector"].state_dict()
    assert any(not torch.equal(again[k], after[k]) for k in after) == keep

