"""FedPer and FedRep: the extractor each way (exactly its parameters), per-architecture
averaging, private heads, and FedRep's two frozen phases."""

import numpy as np
import pytest
import torch

from fedapp.runtime.results import Recorder
from tests.conftest import InProcessFederation, client_manager, fit_res, make_strategy

FED = dict(dataset="synthetic", synthetic_train=240, synthetic_test=80, num_clients=4,
           partition="pathological", classes_per_client=3, max_samples_per_client=0,
           arch_mix="fedpac-cnn,fedpac-cnn3", feature_dim=0, batch_size=50,
           **{"fedrep.head-epochs": 2})
EXTRACTOR_FLOATS = {"fedpac-cnn": 115776, "fedpac-cnn3": 236672}


@pytest.mark.parametrize("method", ["fedper", "fedrep"])
def test_the_own_extractor_goes_each_way(method, tmp_path):
    recorder = Recorder(tmp_path / "run", method=method, dataset="synthetic", num_clients=4,
                        num_rounds=1, config={}, partition={})
    fed = InProcessFederation(method, recorder=recorder, **FED)
    sent = fed.fit_round(1)
    fed.evaluate_round(1)
    floats = sum(EXTRACTOR_FLOATS[fed.strategy.architectures[pid]] for pid in sent)
    assert recorder.history[0]["bytes_up"] == recorder.history[0]["bytes_down"] == floats * 4
    for pid, (payload, _) in sent.items():
        assert all(k.startswith("extractor.") for k in payload)  # heads never travel


def test_extractors_are_averaged_within_each_architecture(rng):
    strategy = make_strategy("fedper", **FED, sizes=[100, 100, 300, 100])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    large0 = {k: v.copy() for k, v in strategy.extractors["fedpac-cnn3"].items()}
    uploads = [{k: rng.normal(size=v.shape).astype(np.float32)
                for k, v in strategy.extractors["fedpac-cnn"].items()} for _ in range(2)]
    strategy.aggregate_fit(1, [(proxies[0], fit_res(uploads[0], 100, 0, "fedpac-cnn")),
                               (proxies[2], fit_res(uploads[1], 300, 2, "fedpac-cnn"))], [])
    for k in uploads[0]:
        np.testing.assert_allclose(strategy.extractors["fedpac-cnn"][k],
                                   0.25 * uploads[0][k] + 0.75 * uploads[1][k], rtol=1e-5,
                                   atol=1e-6)
    for k, v in large0.items():
        np.testing.assert_array_equal(strategy.extractors["fedpac-cnn3"][k], v)


def test_a_wrong_architecture_extractor_is_rejected(caplog):
    fed = InProcessFederation("fedper", **FED)
    large = make_strategy("fedper", **FED).extractors["fedpac-cnn3"]
    fed.assert_rejects(lambda p: large, "unexpected", caplog, pid=0)


def test_fedrep_trains_the_head_with_the_extractor_frozen_then_the_extractor_alone():
    fed = InProcessFederation("fedrep", **FED)
    client = fed.client(1)
    global_extractor = fed.strategy.extractors[client.arch]
    head_before = {k: v.clone() for k, v in client.model.head.state_dict().items()}
    client.receive(global_extractor, 1)
    client.train_head(1)
    for k, v in client.model.extractor.state_dict().items():
        np.testing.assert_array_equal(v.cpu().numpy(), global_extractor[f"extractor.{k}"])
    assert not torch.equal(client.model.head.weight, head_before["weight"])
    head_after_head_phase = {k: v.clone() for k, v in client.model.head.state_dict().items()}

    fed = InProcessFederation("fedrep", **FED)
    sent = fed.fit_round(1)
    model = fed.client(1).model
    for k, v in model.head.state_dict().items():  # the extractor phase left the head alone
        torch.testing.assert_close(v, head_after_head_phase[k])
    upload = sent[1][1]
    assert upload.metrics["train-samples"] == len(fed.client(1).data.train_y)  # 1 epoch
    assert all(p.requires_grad for p in model.parameters())  # nothing stays frozen
