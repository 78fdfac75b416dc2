"""FedL2G with ``secure-aggregation = true``: each client sends a table of all C classes (its
meta-gradient rows where it sent them, a weight and a holders column of 1 there), and the
server's per-class mean over the senders, its clip and its step come from the sums. The whole
SecAgg+ protocol runs in process (tests/test_secure_aggregation.py's harness) and its guiding
vectors are held against the plain round's of the same seed; the layout and the sums by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedapp.config import ConfigError
from fedapp.runtime.secure_aggregation import HOLDERS, ROWS, SUM_WEIGHT
from strategies import METHODS, load_config
from strategies.fedl2g.maths import GRADS, GUIDE, LABELS, SERVER_CLIP, FedL2GClient
from tests.test_fedl2g import C, _server
from tests.test_secure_aggregation import flat_config, run, step

D = 16  # the harness's feature-dim: m for variant "feat"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One plain and one secure round of FedL2G's defaults (variant "feat", upload-max-abs
    1e4) on the harness's 4 small clients, each made once."""
    made = {}

    def get(name, **kwargs):
        if name not in made:
            made[name] = run(tmp_path_factory.mktemp(name), name, method="fedl2g", **kwargs)
        return made[name]
    return get


def test_fedl2g_secure_guiding_vectors_equal_the_plain_ones(runs):
    plain, _, _ = runs("plain")
    secure, records, _ = runs("secure", secure_aggregation=True)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    assert plain.dim == secure.dim == D
    initial = METHODS["fedl2g"].strategy(plain.cfg, None, input_shape=(1, 28, 28),
                                         num_classes=C).guide.numpy()
    eta = plain.settings.eta_s()
    want, got = plain.guide.numpy(), secure.guide.numpy()
    mean = (initial.astype(np.float64) - want) / eta  # the plain round's mean meta-gradient
    # The clip did not act (it is 1-Lipschitz in norm, not per value), so the bound below holds
    # value by value.
    assert float(np.linalg.norm(mean)) < SERVER_CLIP
    # Each of the 4 survivors' table values (zero rows included) and weights is off by less
    # than one step, and a sent class has at least one sender: class c's mean is off by at
    # most 4 step (1 + |mean|) / 1, the guiding vectors by eta_s times that, plus float32's
    # rounding of V (both paths round V - eta_s G to float32: 1e-6 covers |V| < 8).
    tol = eta * 4 * step() * (1 + np.abs(mean).max()) + 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert np.abs(want - initial).max() > 10 * tol  # the step itself is far above the error
    assert not np.array_equal(got, want)  # SecAgg+ quantised: it ran
    # Each masked upload: C x m rows, C weights, C holders, SecAgg+'s own weight, in int64.
    assert records[0]["bytes_up"] == 4 * 8 * (C * D + C + C + 1)


def test_fedl2g_class_tables_sum_to_the_per_class_mean_over_senders_then_the_step():
    # tests/test_fedl2g.py's hand example, through the class tables: client 0 sends classes 0
    # and 3 (rows 1, 2), client 1 class 0 (row 3); class 0's mean is (1 + 3) / 2 = 2, class 3's
    # 2 from its one sender, every other class 0.
    strategy, _ = _server(**{"fedl2g.server-lr": 0.5})  # variant "logit": m = C
    v0 = strategy.guide.clone()
    row = np.ones(C, np.float32)
    tables = [_table({LABELS: np.array([0, 3], np.int32), GRADS: np.stack([row, 2 * row])}),
              _table({LABELS: np.array([0], np.int32), GRADS: 3 * row[None]})]
    layout = strategy.secure_layout()
    assert layout == {ROWS: (C, C), SUM_WEIGHT: (C,), HOLDERS: (C,)}
    assert all(t[name].shape == shape for t in tables for name, shape in layout.items())
    np.testing.assert_array_equal(tables[0][SUM_WEIGHT], tables[0][HOLDERS])  # weight 1
    np.testing.assert_array_equal(tables[0][HOLDERS], [1, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(tables[0][ROWS][[1, 2, 4, 5, 6, 7, 8, 9]], 0)
    sums = {name: tables[0][name] + tables[1][name] for name in layout}
    strategy.aggregate_sums(1, sums, [])
    step_ = torch.zeros(C, C)
    step_[0], step_[3] = 2.0, 2.0
    torch.testing.assert_close(strategy.guide, v0 - 0.5 * step_)
    assert strategy.fit_payload(2, None)[GUIDE].tolist() == strategy.guide.tolist()
    # One masked upload: C x C rows, C weights, C holders, SecAgg+'s own weight, in int64.
    assert strategy.secure_upload_size().data == 8 * (C * C + C + C + 1)


def test_fedl2g_clip_acts_on_the_mean_from_the_sums():
    # One client, two rows of norm 100 sqrt(10): the mean's norm 100 sqrt(20) is clipped to 100.
    strategy, _ = _server(**{"fedl2g.server-lr": 1.0})
    v0 = strategy.guide.clone()
    big = np.full(C, 100.0, np.float32)
    strategy.aggregate_sums(1, _table({LABELS: np.array([1, 2], np.int32),
                                       GRADS: np.stack([big, big])}), [])
    moved = v0 - strategy.guide
    assert float(moved.norm()) == pytest.approx(100.0, rel=1e-5)
    torch.testing.assert_close(moved[1], torch.full((C,), 100.0 / np.sqrt(20)))
    torch.testing.assert_close(moved[0], torch.zeros(C))


def _table(upload):
    """A client's secure upload of ``upload`` (FedL2GClient.secure_upload needs only C)."""
    return FedL2GClient.secure_upload(SimpleNamespace(num_classes=C), upload)


@pytest.mark.parametrize("setting", [
    {}, {"fedl2g.variant": "logit"}, {"fedl2g.warmup-fraction": 0.5, "num_server_rounds": 2},
    {"fedl2g.study-batches": 2, "fedl2g.quiz-batches": 2}, {"fedl2g.quiz-set": "first"},
    {"fedl2g.server-lr": 0.01}, {"fedl2g.guide-seed": 0},
])
def test_every_fedl2g_setting_takes_secure_aggregation(setting):
    # The server's step needs only the per-class mean, whatever the setting: none is refused.
    cfg = load_config(flat_config(method="fedl2g", secure_aggregation=True, **setting))
    assert cfg.secure_aggregation


def test_fedl2g_with_a_robust_rule_is_refused_with_secure_aggregation():
    with pytest.raises(ConfigError, match="robust-aggregation = 'median'.*hides"):
        load_config(flat_config(method="fedl2g", secure_aggregation=True,
                                robust_aggregation="median"))

