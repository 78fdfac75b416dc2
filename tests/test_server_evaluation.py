"""Server-side evaluation: the models a method's server holds (``FedStrategy.server_predict``)
scored by the base on the global test set, on the rounds the clients are evaluated, into the
round's record, the summary, TensorBoard and the progress line. A method without server models
writes nothing new (every method's records: test_determinism.py, test_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

from fedapp.data import setup
from fedapp.runtime import strategy_base
from fedapp.runtime.results import Recorder
from fedapp.runtime.strategy_base import FedStrategy
from fedapp.runtime.tensorboard import round_scalars
from tests.conftest import cfg_of

# Six global test images; image i is the constant i, so a model can be told what to predict
# for each by its index. Labels and the two models' predictions, by hand:
LABELS = [0, 1, 2, 0, 1, 2]
PREDICTS = {"student": [0, 1, 0, 0, 2, 2],   # right on 0, 1, 3, 5: 4/6
            "server": [1, 1, 1, 1, 1, 1]}    # right on 1, 4: 2/6


class WithServerModels(FedStrategy):
    """Two fixed 'models' whose logits put 1 on the class PREDICTS gives each image."""

    calls: list[int]

    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        assert not torch.is_grad_enabled()  # the base scores under no_grad
        self.calls.append(len(x))
        index = x.flatten(1)[:, 0].long()
        return {name: torch.nn.functional.one_hot(torch.tensor(p)[index], 3).float()
                for name, p in PREDICTS.items()}


def _global_test(cfg):
    x = torch.arange(len(LABELS), dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 1, 2, 2)
    return x.contiguous(), torch.tensor(LABELS)


def _strategy(tmp_path, cls=WithServerModels, rounds=3, **overrides):
    cfg = cfg_of(method="standalone", num_server_rounds=rounds, **overrides)
    recorder = Recorder(tmp_path / "run", method="standalone", dataset="synthetic",
                        num_clients=3, num_rounds=rounds, config={}, partition={})
    strategy = cls(cfg, recorder, input_shape=(1, 2, 2), num_classes=3)
    strategy.calls = []
    return strategy, recorder


EVALS = [{"partition-id": 0, "arch": "cnn5", "accuracy": 0.5},
         {"partition-id": 1, "arch": "cnn4", "accuracy": 0.7}]


def test_server_models_are_scored_on_the_global_test_set_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "global_test", _global_test)
    monkeypatch.setattr(strategy_base, "EVAL_BATCH", 4)  # two batches, one of them short
    strategy, recorder = _strategy(tmp_path, eval_every=2)
    for rnd in (1, 2, 3):
        strategy._evaluated = [0, 1] if strategy.evaluation_round(rnd) else []
        strategy._finish_round(rnd, EVALS if strategy._evaluated else [])
    want = {"server": pytest.approx(2 / 6), "student": pytest.approx(4 / 6)}
    records = recorder.history
    assert "server_accuracy" not in records[0]  # round 1 is not evaluated (eval-every = 2)
    assert records[1]["server_accuracy"] == want  # round 2 is ...
    assert records[2]["server_accuracy"] == want  # ... and the last round always is
    assert list(records[2]["server_accuracy"]) == ["server", "student"]
    assert strategy.calls == [4, 2, 4, 2]
    summary = recorder.finish()
    assert summary["accuracy"]["server"] == want
    assert summary["accuracy"]["mean"] == pytest.approx(0.6)  # the clients' stays as it was
    assert round_scalars(records[2])["server_accuracy/student"] == pytest.approx(4 / 6)
    line = recorder.record_round(dict(records[2], round=3))
    assert " | server server 0.3333, student 0.6667 | " in line


def test_one_server_model_named_server_reads_briefly(tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "global_test", _global_test)

    class One(WithServerModels):
        def server_predict(self, x):
            return {"server": super().server_predict(x)["server"]}

    strategy, recorder = _strategy(tmp_path, cls=One, rounds=1)
    strategy._finish_round(1, EVALS)
    assert recorder.history[0]["server_accuracy"] == {"server": pytest.approx(1 / 3)}
    assert " | server 0.3333 | " in recorder.record_round(dict(recorder.history[0]))


def test_a_method_without_server_models_records_nothing_new(tmp_path, monkeypatch):
    def never(cfg):
        raise AssertionError("the global test set is loaded for a method without server models")
    monkeypatch.setattr(setup, "global_test", never)
    strategy, recorder = _strategy(tmp_path, cls=FedStrategy, rounds=1)
    strategy._finish_round(1, EVALS)
    assert "server_accuracy" not in recorder.history[0]
    assert "server" not in recorder.finish()["accuracy"]
    assert "server" not in recorder.record_round(dict(recorder.history[0]))


def test_no_models_this_round_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "global_test", _global_test)

    class NotYet(WithServerModels):
        def server_predict(self, x):
            return {}

    strategy, recorder = _strategy(tmp_path, cls=NotYet, rounds=1)
    strategy._finish_round(1, EVALS)
    assert "server_accuracy" not in recorder.history[0]


def test_logits_of_the_wrong_shape_are_a_bug_named(tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "global_test", _global_test)

    class Wrong(WithServerModels):
        def server_predict(self, x):
            return {"server": torch.zeros(len(x), 5)}

    strategy, _ = _strategy(tmp_path, cls=Wrong, rounds=1)
    with pytest.raises(ValueError, match="'server' logits of shape"):
        strategy.server_accuracy()


def test_the_server_and_the_clients_share_one_global_test_subset():
    from fedapp.runtime import client_base
    cfg = cfg_of(method="standalone", dataset="synthetic", synthetic_train=60,
                 synthetic_test=40, global_test_samples=25, num_clients=2)
    x, y = setup.global_test(cfg)
    cx, cy = client_base._global_test(cfg, "cpu")
    assert len(y) == 25 and torch.equal(x, cx) and torch.equal(y, cy)
    assert torch.equal(y, setup.global_test(cfg)[1])  # the same draw every time
