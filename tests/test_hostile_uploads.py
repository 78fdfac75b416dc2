"""Hostile uploads against every registered method, through the one validation path of the base.

Each method's honest round-1 uploads come from its real clients (the smoke preset, smaller and
at a quarter of the width, in process);
then one client's upload is replaced by each row of ``HOSTILE`` in turn. A row either must be
refused — and then the server's state afterwards is exactly what the two honest uploads alone
give — or must be accepted as the same values in the wire dtypes. Nothing may raise out of
``aggregate_fit``, and what the server sends next must be finite float32. A method registered in
``strategies/`` (``strategies.METHODS``) is covered without touching this file.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import tracemalloc
from typing import Callable

import numpy as np
import pytest
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters

from fedapp.config import CONF_DIR, read_preset
from fedapp.runtime.aggregate import weighted_average
from fedapp.runtime.payload import (ArraySpec, PayloadError, check_layout, decode, from_ndarrays,
                                    load, read_headers, to_ndarrays, to_wire, validate,
                                    wire_size)
from fedapp.runtime.results import Recorder
from fedapp.runtime.strategy_base import clean_eval_metrics
from strategies import METHODS
from tests.conftest import InProcessFederation, client_manager, eval_res, make_strategy

HOSTILE_PID = 2  # the smoke preset has three clients; 0 and 1 stay honest


def smoke_overrides(method: str) -> dict:
    """The smoke preset (what `fedapp run conf/smoke.toml --set method=...` runs), as keyword
    overrides; a method that averages whole models gets one architecture, one that needs a
    public set gets a train-holdout one."""
    flat = read_preset(CONF_DIR / "smoke.toml")
    if METHODS[method].homogeneous_only:
        flat["arch-mix"] = "cnn5"
    if METHODS[method].needs_public:  # a method that distils on a public set gets one
        flat["public-source"] = "train-holdout"
    return {k.replace("-", "_"): v for k, v in flat.items()}


def small_smoke_overrides(method: str) -> dict:
    """The smoke preset, smaller and faster, for tests of bookkeeping rather than learning: one
    local epoch whatever the method's recipe (HeteroFL's, DepthFL's and FedGH's train five,
    KT-pFL's ten)."""
    return {**smoke_overrides(method), "synthetic_train": 180, "synthetic_test": 90,
            "model_width": 0.25, "feature_dim": 64, "local_epochs": 1}


# -- the table ------------------------------------------------------------------------------------
# Each row: (name, must be refused?, mutation of (payload, num_examples) -> (tensors, n)), where
# tensors is the list of npy blobs the client sends; a mutation returns None where it does not
# apply (e.g. no float array to corrupt in an empty upload).

def _npy(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def _blobs(payload: dict) -> list[bytes]:
    return [_npy(a) for a in to_ndarrays(payload)]


def _first(payload: dict, kind: str) -> str | None:
    return next((k for k, v in payload.items() if v.dtype.kind in kind), None)


def _retype(float_dtype, int_dtype=None):
    def mutate(payload, n):
        if _first(payload, "fiu") is None:
            return None
        out = {k: v.astype(float_dtype if v.dtype.kind == "f" else int_dtype or v.dtype)
               for k, v in payload.items()}
        return _blobs(out), n
    return mutate


def _set_value(value: float):
    def mutate(payload, n):
        name = _first(payload, "f")
        if name is None:
            return None
        bad = payload[name].copy()
        bad.flat[0] = value
        return _blobs({**payload, name: bad}), n
    return mutate


def _reshape(payload, n):
    name = _first(payload, "f")
    if name is None:
        return None
    a = payload[name]
    bad = a.reshape(-1) if a.ndim > 1 else np.append(a, a[:1])
    return _blobs({**payload, name: bad}), n


def _label_out_of_range(payload, n):
    name = _first(payload, "iu")
    if name is None or payload[name].size == 0:
        return None
    bad = payload[name].copy()
    bad.flat[0] = 10_000
    return _blobs({**payload, name: bad}), n


def _without_last(payload, n):
    if not payload:
        return None
    return _blobs(payload)[:-1], n  # the names tensor still names it


def _renamed(payload, n):
    if not payload:
        return None
    (name, value), *rest = payload.items()
    return _blobs({"evil." + name: value, **dict(rest)}), n


def _replace_tensor(blob_of: Callable[[list[bytes]], bytes]):
    def mutate(payload, n):
        if not payload:
            return None
        blobs = _blobs(payload)
        blobs[1] = blob_of(blobs)
        return blobs, n
    return mutate


def _giant_shape_claim(blobs):
    # An npy header claiming 2^62 x 3 float32 values, followed by 12 bytes of data.
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**62, 3)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + b"\0" * 12


def _names_only_duplicated(payload, n):
    if len(payload) < 2:  # one array (FedMD's logits) has one name: nothing to duplicate
        return None
    arrays = to_ndarrays(payload)
    names = list(payload)
    arrays[0] = np.array([names[0]] * len(names))
    return [_npy(a) for a in arrays], n


def _claim(count):
    return lambda payload, n: (_blobs(payload), count)


HOSTILE = [
    # Same values in another dtype or byte order: converted to the wire dtypes and accepted.
    ("float64", False, _retype(np.float64)),
    ("float16", False, _retype(np.float16)),
    ("longdouble", False, _retype(np.longdouble)),
    ("big-endian", False, _retype(np.dtype(">f4"), np.dtype(">i8"))),
    # Refused.
    ("NaN", True, _set_value(np.nan)),
    ("inf", True, _set_value(np.inf)),
    ("1e20", True, _set_value(1e20)),
    ("3e38", True, _set_value(3e38)),
    ("-3e38", True, _set_value(-3e38)),
    ("wrong shape", True, _reshape),
    ("label out of range", True, _label_out_of_range),
    ("array missing", True, _without_last),
    ("array renamed", True, _renamed),
    ("extra array", True, lambda p, n: (_blobs({**p, "evil": np.zeros(3, np.float32)}), n)),
    ("duplicate names", True, _names_only_duplicated),
    ("pickle", True, _replace_tensor(lambda b: pickle.dumps({"x": 1}))),
    ("object array", True, _replace_tensor(lambda b: _npy(np.array([{}], dtype=object), True))),
    ("truncated", True, _replace_tensor(lambda b: b[1][: len(b[1]) // 2])),
    ("giant shape claim", True, _replace_tensor(_giant_shape_claim)),
    ("num_examples 2^62", True, _claim(2**62)),
    ("num_examples + 1", True, lambda p, n: (_blobs(p), n + 1)),
    ("num_examples 0", True, _claim(0)),
    ("num_examples -5", True, _claim(-5)),
]


def _fit_res(blobs: list[bytes], n: int, metrics: dict) -> FitRes:
    return FitRes(Status(Code.OK, ""), Parameters(tensors=blobs, tensor_type=""), n, metrics)


def _server_state(strategy, manager) -> list[dict]:
    """What the strategy sends next (round 2, every client, training and evaluation)."""
    sent = [ins.parameters for _, ins in strategy.configure_fit(2, None, manager)]
    sent += [ins.parameters for _, ins in strategy.configure_evaluate(2, None, manager)]
    return [decode(p) for p in sent]


def _aggregate(method, honest, hostile=None):
    strategy = make_strategy(method, **small_smoke_overrides(method))
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    results = [(proxies[pid], res) for pid, res in sorted(honest.items())]
    if hostile is not None:
        results.append((proxies[HOSTILE_PID], hostile))
    strategy.aggregate_fit(1, results, [])
    return strategy, manager


@pytest.fixture(scope="module", params=sorted(METHODS))
def honest_round(request):
    """A method and its clients' honest round-1 replies, {pid: FitRes}."""
    fed = InProcessFederation(request.param, **small_smoke_overrides(request.param))
    return request.param, {pid: res for pid, (_, res) in fed.fit_round(1).items()}


def test_hostile_upload_table(honest_round):
    method, replies = honest_round
    honest = {pid: res for pid, res in replies.items() if pid != HOSTILE_PID}
    template = replies[HOSTILE_PID]
    upload = decode(template.parameters)
    bound = make_strategy(method, **small_smoke_overrides(method)).cfg.upload_max_abs
    floats = [np.abs(a).max() for a in upload.values() if a.dtype.kind == "f" and a.size]
    # The bound has to leave honest uploads alone, with a wide margin.
    assert not floats or max(floats) < bound / 10
    without, manager = _aggregate(method, honest)
    reference_without = _server_state(without, manager)
    with_all, manager = _aggregate(method, {**honest, HOSTILE_PID: template})
    reference_with = _server_state(with_all, manager)
    wrong = []
    for name, refuse, mutate in HOSTILE:
        made = mutate(dict(upload), template.num_examples)
        if made is None:
            continue
        res = _fit_res(*made, template.metrics)
        try:
            strategy, manager = _aggregate(method, honest, res)
        except Exception as exc:  # noqa: BLE001 - the table records whatever escapes
            wrong.append(f"{name}: {type(exc).__name__} escaped aggregate_fit: {exc}")
            continue
        counts = strategy._counts
        if counts["rejected"] != int(refuse):
            wrong.append(f"{name}: rejected={counts['rejected']}, expected {int(refuse)}")
            continue
        if wire_size(res.parameters).data < 0:
            wrong.append(f"{name}: negative byte count")
        state = _server_state(strategy, manager)
        for payload in state:
            for key, array in payload.items():
                if array.dtype.kind == "f" and (array.dtype != np.float32
                                                or not np.all(np.isfinite(array))):
                    wrong.append(f"{name}: the server now sends {key} as {array.dtype} "
                                 "with non-finite values or in another dtype")
        expected = reference_without if refuse else reference_with
        if name == "float16":  # rounded values: only their dtype and finiteness are promised
            continue
        for got, want in zip(state, expected):
            if got.keys() != want.keys() or any(not np.array_equal(got[k], want[k])
                                                for k in got):
                wrong.append(f"{name}: the server's state differs from the "
                             f"{'honest-only' if refuse else 'honest'} one")
                break
    assert not wrong, f"{method}:\n" + "\n".join(wrong)


def test_refusing_a_large_wrong_shaped_upload_costs_no_more_than_its_size(honest_round):
    # 64 MiB of float32 under the name of one of the method's arrays (or an extra array, for a
    # method that uploads nothing), in a shape the method does not expect. Refusing it must
    # cost the server at most 1.2 times the upload's size beyond the bytes it received: the
    # headers are checked before any data is read. (Decoding first cost about 5 times.)
    method, replies = honest_round
    template = replies[HOSTILE_PID]
    upload = decode(template.parameters)
    name = _first(upload, "f") or "evil"
    big = np.ones(16 * 2**20, np.float32)
    blobs = _blobs({**upload, name: big})
    del big
    size = sum(map(len, blobs))
    strategy = make_strategy(method, **small_smoke_overrides(method))
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    res = _fit_res(blobs, template.num_examples, template.metrics)
    tracemalloc.start()  # numpy reports its array allocations to tracemalloc
    try:
        with pytest.raises(PayloadError, match="shape|unexpected"):
            strategy.accept_upload(proxies[HOSTILE_PID], res, set())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 1.2 * size, f"{method}: {peak / 2**20:.0f} MiB to refuse {size / 2**20:.0f} MiB"


def test_a_round_of_refused_uploads_keeps_the_state_and_the_run_goes_on(honest_round):
    # Round 2 of every method: the round's only uploads are refused (each client claims the
    # other's partition, as a squatting node would). The round must not raise, and the server
    # must send next exactly what it would have sent without that round.
    method, replies = honest_round
    honest = {pid: res for pid, res in replies.items() if pid != HOSTILE_PID}
    reference, manager = _aggregate(method, honest)
    want = _server_state(reference, manager)
    strategy, manager = _aggregate(method, honest)
    proxies = sorted(strategy.clients, key=lambda cid: strategy.clients[cid].partition_id)
    by_cid = {p.cid: p for p in manager.all().values()}
    strategy.configure_fit(2, None, manager)
    swapped = [(by_cid[proxies[1 - pid]], res) for pid, res in honest.items()]
    strategy.aggregate_fit(2, swapped, [])
    assert strategy._counts["clients_fit"] == 0 and strategy._counts["rejected"] == 2
    got = _server_state(strategy, manager)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in g), method


def test_value_checks_read_the_received_bytes_in_slices():
    # A 64 MiB float64 array of the right shape whose last value is NaN: refused after reading
    # every value, at a small constant cost (no float64 copy, no float32 copy); the same array
    # honest is accepted as float32, the one copy the server keeps.
    values = np.zeros(8 * 2**20, np.float64)
    values[-1] = np.nan
    params = Parameters(tensors=[_npy(np.array(["w"])), _npy(values)], tensor_type="")
    spec = {"w": ArraySpec((values.size,))}
    tracemalloc.start()
    try:
        headers = read_headers(params)
        check_layout(headers, spec)
        with pytest.raises(PayloadError, match="NaN"):
            load(headers, max_abs=1e4)
        refused = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        values[-1] = 1.0
        params.tensors[1] = _npy(values)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        payload = load(read_headers(params), max_abs=1e4)
        validate(payload, spec)
        wire = to_wire(payload)
        accepted = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert refused <= 8 * 2**20, f"{refused / 2**20:.1f} MiB"
    assert wire["w"].dtype == np.float32 and wire["w"][-1] == 1.0
    assert accepted <= values.nbytes // 2 + 8 * 2**20, f"{accepted / 2**20:.1f} MiB"


# -- findings outside the table ---------------------------------------------------------------------

def test_averages_are_float32_whatever_the_first_upload():
    half = {"w": np.array([1.0, 2.0], np.float16)}
    single = {"w": np.array([3.0, 4.0], np.float32)}
    out = weighted_average([half, single], [1, 1])
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], [2.0, 3.0])


def test_a_giant_shape_claim_does_not_wrap_the_byte_count():
    blobs = [_npy(np.array(["a"])), _giant_shape_claim([])]
    size = wire_size(Parameters(tensors=blobs, tensor_type=""))
    # At most what really came (the claim is not believed), never a negative count.
    assert 0 < size.data <= len(blobs[1]) and size.total == sum(map(len, blobs))


@pytest.mark.parametrize("name", ["class-03/n-5", "class-\u0663/n-5", "class-3/n-\u0665",
                                  "class-3/n-" + "9" * 401, "class-3/n-" + "9" * 10_001,
                                  "class-3/n-05", "class-3/n-0"])
def test_fedproto_refuses_labels_and_counts_in_any_but_canonical_spelling(name):
    strategy = make_strategy("fedproto", num_clients=2, arch_mix="cnn1", sizes=[50, 50])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    info = strategy.clients[proxies[0].cid]
    vector = np.zeros(strategy.feature_dim, np.float32)
    with pytest.raises(PayloadError):
        strategy.validate_upload({"class-3/n-5": vector, name: vector}, info)
    with pytest.raises(PayloadError):
        strategy.validate_upload({name: vector}, info)


def test_fedproto_counts_cannot_outweigh_the_clients_data():
    strategy = make_strategy("fedproto", num_clients=2, arch_mix="cnn1", sizes=[50, 50])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    info = strategy.clients[proxies[0].cid]
    vector = np.zeros(strategy.feature_dim, np.float32)
    strategy.validate_upload({"class-3/n-30": vector, "class-4/n-20": vector}, info)
    with pytest.raises(PayloadError, match="more than the 50 training examples"):
        strategy.validate_upload({"class-3/n-30": vector, "class-4/n-21": vector}, info)
    with pytest.raises(PayloadError):
        strategy.validate_upload({"class-3/n-" + str(10**18): vector}, info)


def test_own_data_clients_are_bounded_by_max_num_examples():
    strategy = make_strategy("lg-fedavg", num_clients=2, arch_mix="cnn1", sizes=[50, 50],
                             max_num_examples=1000)
    manager, proxies = client_manager(strategy, [
        {"partition-id": 0, "arch": "cnn1", "own-data": True},
        {"partition-id": 1, "arch": "cnn1"}])
    strategy.configure_fit(1, None, manager)
    own, partition = (strategy.clients[p.cid] for p in proxies)
    strategy.check_num_examples(1000, own)  # any size up to the bound: the server cannot know
    with pytest.raises(PayloadError, match="max-num-examples"):
        strategy.check_num_examples(1001, own)
    with pytest.raises(PayloadError, match="has 50 training examples"):
        strategy.check_num_examples(1000, partition)


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_evaluation_metrics_are_checked_and_results_stay_valid_json(tmp_path):
    assert clean_eval_metrics({"accuracy": 0.5, "global-accuracy": "x"}) == {"accuracy": 0.5}
    with pytest.raises(PayloadError):
        clean_eval_metrics({"accuracy": math.nan})
    recorder = Recorder(tmp_path / "run", method="lg-fedavg", dataset="synthetic",
                        num_clients=3, num_rounds=1, config={}, partition={})
    strategy = make_strategy("lg-fedavg", recorder, num_clients=3, arch_mix="cnn1",
                             sizes=[10, 10, 10])
    manager, proxies = client_manager(strategy)
    strategy.configure_fit(1, None, manager)
    # A method's term-* training diagnostics: only finite numbers reach the results.
    terms = [{"term-a": math.nan, "term-b": "x", "device": "cpu"},
             {"term-a": 2.0, "term-c": True, "device": "cuda:0", "gpu-peak-mib": 12.5},
             {"term-a": 4.0, "term-d": 1e400, "device": "cuda" + "x" * 500,
              "gpu-peak-mib": math.inf}]
    strategy.aggregate_fit(1, [(p, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
        to_ndarrays(strategy.global_head)), 10, {"partition-id": i, "arch": "cnn1",
                                                 "train-seconds": math.inf, **terms[i]}))
        for i, p in enumerate(proxies)], [])
    strategy.configure_evaluate(1, None, manager)
    hostile = [{"global-accuracy": "x", "eval-seconds": math.inf},
               {"global-accuracy": math.nan, "accuracy-variant": 1e308, "global-loss": -1.0},
               {"global-accuracy": 7.0, "accuracy-variant": math.nan}]
    results = []
    for i, (p, extra) in enumerate(zip(proxies, hostile)):
        res = eval_res(i, "cnn1", 0.5)
        res.metrics.update(extra)
        results.append((p, res))
    strategy.aggregate_evaluate(1, results, [])
    [record] = [_strict_json(line) for line in
                (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert record["per_client"] == {"0": 0.5, "1": 0.5, "2": 0.5}
    assert "global_accuracy_mean" not in record and "variants" not in record
    assert math.isfinite(record["client_seconds"])
    assert 0 < record["server_seconds"] <= record["seconds"]
    assert record["train_terms"] == {"a": 3.0}
    # Where each client trained, and its GPU memory: only a device name and a finite number.
    assert record["devices"] == {"0": "cpu", "1": "cuda:0"}
    assert record["gpu_peak_mib"] == {"1": 12.5}
    summary = _strict_json((tmp_path / "run" / "summary.json").read_text())
    assert summary["accuracy"]["mean"] == 0.5


def test_payload_decode_refuses_unsigned_integers_beyond_int64():
    blob = Parameters(tensors=[_npy(np.array(["n"])), _npy(np.array([2**64 - 1], np.uint64))],
                      tensor_type="")
    with pytest.raises(PayloadError, match="2\\^31"):
        decode(blob)
    ok = decode(Parameters(tensors=[_npy(np.array(["n"])), _npy(np.array([7], np.uint8))],
                           tensor_type=""))
    assert ok["n"].dtype == np.int64 and from_ndarrays([np.array(["n"]), ok["n"]])["n"] == 7
