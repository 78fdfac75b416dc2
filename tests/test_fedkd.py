"""FedKD: the SVD codec, the energy schedule, the bytes of the factors actually sent, the
adaptive loss by hand, the mentee kept in step with the server's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.common import (Code, FitRes, Status, ndarrays_to_parameters,
                         parameters_to_ndarrays)

import fedapp.runtime.client_base as client_base
import strategies.fedkd.maths as fedkd
from fedapp.runtime.aggregate import weighted_average
from fedapp.runtime.payload import (PayloadError, decode, encode, to_ndarrays, validate,
                                    wire_size)
from fedapp.runtime.strategy_base import FedStrategy
from fedapp.runtime.two_models import SHARED_STATE_KEY
from strategies.fedkd import FedKDSettings
from strategies.fedkd.maths import (check_factors, codec_spec, compress, compressible,
                                    decompress, energy, fedkd_loss, svd_rank)
from tests.conftest import InProcessFederation, client_manager, make_strategy
from tests.test_hostile_uploads import small_smoke_overrides


def _matrix(singular_values, m, n, seed=0):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(m, len(singular_values))))
    v, _ = np.linalg.qr(rng.normal(size=(n, len(singular_values))))
    return ((u * np.asarray(singular_values, float)) @ v.T).astype(np.float32)


def test_the_rank_holds_the_energy_and_the_full_rank_is_tried():
    s = np.array([3.0, 2.0, 1.0])  # cumulative energies 0.643, 0.929, 1
    assert svd_rank(s, 0.95) == 3 and svd_rank(s, 0.9) == 2 and svd_rank(s, 0.5) == 1
    assert svd_rank(s, 0.95, "htfllib") == 0  # HtFLlib's search never tries r = 3
    assert svd_rank(s, 0.9, "htfllib") == 2
    assert svd_rank(np.zeros(4), 0.95) == 0


def test_a_matrix_needing_its_full_rank_is_sent_exactly():
    full = _matrix([3.0, 2.0, 1.0], 3, 3)
    sent = compress({"w": full}, 0.95)
    assert set(sent) == {"w"} and np.array_equal(decompress(sent, {"w": full})["w"], full)
    # HtFLlib's rank search sends it as zeros (rank-0 factors).
    zeros = compress({"w": full}, 0.95, "htfllib")
    assert zeros["w:s"].shape == (0,)
    assert not decompress(zeros, {"w": full})["w"].any()


def test_factors_cost_r_m_plus_n_plus_1_floats_and_keep_the_energy():
    low = _matrix([3.0, 2.0, 1.0], 40, 30)
    like = {"w": low, "b": np.ones(40, np.float32)}
    sent = compress(like, 0.95)
    assert {k: v.shape for k, v in sent.items()} == {
        "w:U": (40, 3), "w:s": (3,), "w:V": (3, 30), "b": (40,)}
    assert wire_size(encode(sent)).data == (3 * (40 + 30 + 1) + 40) * 4
    np.testing.assert_allclose(decompress(sent, like)["w"], low, atol=1e-5)
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(40, 30)).astype(np.float32)
    got = decompress(compress({"w": dense}, 0.9), {"w": dense})["w"]
    assert np.linalg.norm(got - dense) <= math.sqrt(1 - 0.9) * np.linalg.norm(dense)
    # A convolution is flattened to out x in*k*k, not sliced per kernel position.
    conv = rng.normal(size=(8, 3, 5, 5)).astype(np.float32)
    sent = compress({"c": conv}, 0.5)
    assert sent["c:U"].shape[0] == 8 and sent["c:V"].shape[1] == 75
    assert decompress(sent, {"c": conv})["c"].shape == conv.shape


def test_htfllibs_codec_factors_each_kernel_with_one_rank_per_layer():
    rng = np.random.default_rng(5)
    conv = (rng.normal(size=(6, 3, 5, 5)) * np.linspace(0.2, 2.0, 5)).astype(np.float32)
    like = {"c": conv}
    sent = compress(like, 0.9, codec="htfllib")
    # Counted apart: every kernel's SVD; the rank from the j-th singular values' energy summed
    # over the layer's kernels; each kernel rebuilt from its own leading r.
    svds = [np.linalg.svd(k) for k in conv.reshape(-1, 5, 5).astype(np.float64)]
    energy_j = np.cumsum(sum(sv ** 2 for _, sv, _ in svds))
    r = int(np.argmax(energy_j > 0.9 * energy_j[-1])) + 1
    assert 1 < r < 5
    assert {k: v.shape for k, v in sent.items()} == {
        "c:U": (6, 3, 5, r), "c:s": (6, 3, r), "c:V": (6, 3, r, 5)}
    rebuilt = np.stack([(u[:, :r] * sv[:r]) @ vt[:r] for u, sv, vt in svds])
    np.testing.assert_allclose(decompress(sent, like)["c"], rebuilt.reshape(conv.shape),
                               atol=1e-5)
    # Factors even where larger than the tensor (the compact codec sends it exactly).
    full = {"w": _matrix([3.0, 2.0, 1.0], 3, 3)}
    assert set(compress(full, 0.95)) == {"w"}
    factored = compress(full, 0.95, codec="htfllib")
    assert factored["w:U"].shape == (3, 3)
    np.testing.assert_allclose(decompress(factored, full)["w"], full["w"], atol=1e-5)
    # A hostile upload: factors of one kernel shape but two ranks, or of the wrong layer shape.
    validate(sent, codec_spec(like, sent, "htfllib"))
    check_factors(sent, like, "htfllib")
    with pytest.raises(PayloadError, match="ranks"):
        check_factors({**sent, "c:s": sent["c:s"][..., :r - 1]}, like, "htfllib")
    with pytest.raises(PayloadError):
        validate({**sent, "c:U": sent["c:U"][:5]}, codec_spec(like, sent, "htfllib"))


def test_the_energy_threshold_rises_from_start_to_end():
    s = FedKDSettings()
    assert energy(s, 1, 10) == pytest.approx(0.95)
    assert energy(s, 6, 10) == pytest.approx(0.965)
    assert energy(s, 11, 10) == pytest.approx(0.98)


def _expected_bytes(arrays, threshold):
    """The codec's bytes counted independently: r (m + n + 1) floats per factorised matrix."""
    total = 0
    for a in arrays.values():
        if a.dtype.kind == "f" and a.ndim >= 2 and a.shape[0] > 1:
            m = a.reshape(a.shape[0], -1)
            s = np.linalg.svd(m.astype(np.float64), compute_uv=False)
            cum = np.cumsum(s ** 2)
            r = 0 if cum[-1] == 0 else int(np.argmax(cum > threshold * cum[-1])) + 1
            floats = r * (sum(m.shape) + 1)
            total += 4 * (m.size if r and floats >= m.size else floats)
        else:
            total += a.nbytes
    return total


def test_each_round_sends_exactly_the_bytes_of_the_factors(monkeypatch):
    calls = []
    real = fedkd.compress

    def recording(arrays, threshold, rule="energy", codec="compact"):
        out = real(arrays, threshold, rule, codec)
        calls.append((arrays, threshold, out))
        return out
    monkeypatch.setattr(fedkd, "compress", recording)
    fed = InProcessFederation("fedkd", **{**small_smoke_overrides("fedkd"), "num_server_rounds": 4})
    fed.fit_round(1)
    # Round 1: every client starts from the run's initial mentee: only the versions travel.
    assert sorted(s.data for s in fed.strategy._down.values()) == [16] * 3
    uploads = calls[:3]
    assert all(t == pytest.approx(0.95) for _, t, _ in uploads)
    assert sorted(s.data for s in fed.strategy._up.values()) == \
        sorted(_expected_bytes(a, 0.95) for a, _, _ in uploads)
    server_update, threshold, sent = calls[3]
    assert threshold == pytest.approx(0.95)
    assert any(k.endswith(":U") for k in sent)  # factors really travel
    calls.clear()
    fed.fit_round(2)
    # Round 2: the compressed average update, plus the two versions.
    assert [s.data for s in fed.strategy._down.values()] == \
        [_expected_bytes(server_update, 0.95) + 16] * 3
    assert all(t == pytest.approx(0.95 + 0.03 / 4) for _, t, _ in calls)
    assert sorted(s.data for s in fed.strategy._up.values()) == \
        sorted(_expected_bytes(a, t) for a, t, _ in calls[:3])


def test_clients_keep_the_global_mentee_the_server_has_and_refuse_an_update_out_of_step():
    client_base._MODEL_CACHE.clear()
    fed = InProcessFederation("fedkd", **small_smoke_overrides("fedkd"))
    fed.fit_round(1)
    first = dict(fed.strategy.shared_model)
    fed.fit_round(2)
    for context in fed.contexts:  # each kept the global mentee its round started from
        kept = {k: v.numpy() for k, v in context.state[SHARED_STATE_KEY]
                .to_torch_state_dict().items()}
        assert all(np.array_equal(kept[k], first[k]) for k in first)
    # A client that lost its state (version 0) refuses the update from version 1 ...
    from flwr.app import RecordDict
    fed.contexts[0].state = RecordDict()
    client_base._MODEL_CACHE.clear()
    results = []
    for proxy, ins in fed.strategy.configure_fit(3, None, fed.manager):
        pid = proxy.identity["partition-id"]
        if pid == 0:
            with pytest.raises(PayloadError, match="holds version 0"):
                fed.client(0).fit(parameters_to_ndarrays(ins.parameters), ins.config)
            continue
        arrays, n, metrics = fed.client(pid).fit(parameters_to_ndarrays(ins.parameters),
                                                 ins.config)
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n,
                                      metrics)))
    fed.strategy.aggregate_fit(3, results, [RuntimeError("client 0 failed")])
    # ... and, not counted as holding the new one, is sent the whole mentee next time.
    sent = {p.identity["partition-id"]: decode(i.parameters)
            for p, i in fed.strategy.configure_fit(4, None, fed.manager)}
    assert list(sent[0]["fedkd.version"]) == [-1, 3]
    assert all(np.array_equal(sent[0][k], fed.strategy.shared_model[k])
               for k in fed.strategy.shared_model)
    assert [list(sent[p]["fedkd.version"]) for p in (1, 2)] == [[2, 3]] * 2
    fed.client(0).fit(parameters_to_ndarrays(ndarrays_to_parameters(
        to_ndarrays(sent[0]))), {"server-round": 4})


def test_the_adaptive_loss_by_hand():
    o, o_m = torch.zeros(1, 2), torch.tensor([[math.log(9.0), 0.0]])  # p = (.5,.5), q = (.9,.1)
    z, z_m = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0]])
    w_h = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        w_h.weight.copy_(torch.tensor([[1.0], [0.0]]))  # W_h z' = (1, 0): MSE = (0 + 4) / 2
    y = torch.tensor([0])
    task, task_m = math.log(2), -math.log(0.9)
    kl_qp = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0)
    expected = task + task_m + (kl_qp + kl_pq + 2.0) / (task + task_m)
    assert fedkd_loss(o, z, o_m, z_m, w_h, y, FedKDSettings()).item() == pytest.approx(
        expected, rel=1e-6)
    htfl = task + task_m + (kl_qp + kl_pq + 4.0) / (task + task_m)
    assert fedkd_loss(o, z, o_m, z_m, w_h, y, FedKDSettings(htfllib_loss=True)).item() == \
        pytest.approx(htfl, rel=1e-6)


@pytest.mark.parametrize("rule, codec", [("energy", "compact"), ("htfllib", "compact"),
                                         ("htfllib", "htfllib")])
def test_htfllibs_weights_mode_sends_the_compressed_mentee_itself(rule, codec):
    fed = InProcessFederation("fedkd", **small_smoke_overrides("fedkd"),
                              **{"fedkd.compress": "weights", "fedkd.rank-rule": rule,
                                 "fedkd.codec": codec})
    initial = dict(fed.strategy.shared_model)
    seen = fed.fit_round(1)
    # Round 1: nothing goes down; every client trains the run's initial mentee (HtFLlib's
    # clients copy the server's), not a compressed one (which HtFLlib's rank search would zero).
    assert all(sent == {} for sent, _ in seen.values())
    client = fed.client(0)
    uploads = [decode(res.parameters) for _, res in seen.values()]
    if rule == "energy":  # HtFLlib's search sends a matrix needing its full rank as zeros
        assert all(not k.endswith(":U") or v.shape[1] > 0 for u in uploads for k, v in u.items())
    # Round 2: the average of the uploads, compressed with round 1's energy, no versions.
    weights = [float(res.num_examples) for _, res in seen.values()]  # average = "samples"
    expected = compress(weighted_average([decompress(u, initial) for u in uploads], weights),
                        energy(fed.strategy.cfg.settings, 1, fed.strategy.cfg.num_server_rounds),
                        rule, codec)
    sent = fed.fit_round(2)[client.partition_id][0]
    assert sent.keys() == expected.keys()
    assert all(np.allclose(sent[k], expected[k], atol=1e-6) for k in expected)



def _round_one(overrides: dict, replies: dict) -> FedStrategy:
    """A fresh server's round 1 on ``replies`` ({pid: FitRes})."""
    strategy = make_strategy("fedkd", **overrides)
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    strategy.aggregate_fit(1, [(proxies[pid], res) for pid, res in sorted(replies.items())], [])
    return strategy


@pytest.mark.parametrize("mode", ["update", "weights"])
def test_factors_within_the_bound_whose_product_is_not_are_refused(mode, caplog):
    # Every factor at upload-max-abs passes a check of the values as sent, but the server
    # averages U s V^T: at rank 2 each entry is 2 * 1e4^3 = 2e12. Refused, as reconstructed,
    # with a reason naming the tensor; the honest client's upload is still aggregated.
    overrides = {**small_smoke_overrides("fedkd"), "fedkd.compress": mode}
    replies = {pid: res for pid, (_, res) in
               InProcessFederation("fedkd", **overrides).fit_round(1).items()}
    server = make_strategy("fedkd", **overrides)
    like, bound = server.shared_model, server.cfg.upload_max_abs
    name = next(k for k, v in like.items() if compressible(v))
    m, n = like[name].reshape(like[name].shape[0], -1).shape
    assert min(m, n) >= 2  # rank 2 is a rank the server accepts
    hostile = {k: v for k, v in decode(replies[1].parameters).items()
               if k != name and not k.startswith(name + ":")}
    hostile.update({name + ":U": np.full((m, 2), bound, np.float32),
                    name + ":s": np.full(2, bound, np.float32),
                    name + ":V": np.full((2, n), bound, np.float32)})
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(to_ndarrays(hostile)),
                 replies[1].num_examples, replies[1].metrics)
    with caplog.at_level("WARNING"):
        strategy = _round_one(overrides, {0: replies[0], 1: res})
    assert strategy._counts == {"clients_fit": 1, "failures": 0, "rejected": 1}
    assert strategy._rejected == [1]
    assert f"decoded array {name!r} holds values of magnitude up to 2e+12, above " \
        f"upload-max-abs = {bound:g}" in caplog.text
    honest_only = _round_one(overrides, {0: replies[0]})
    assert honest_only._counts["clients_fit"] == 1
    assert any(not np.array_equal(honest_only.shared_model[k], like[k]) for k in like)
    assert all(np.array_equal(strategy.shared_model[k], honest_only.shared_model[k])
               for k in like)
    assert max(float(np.abs(v).max()) for v in strategy.shared_model.values()) < bound
