"""The wire format: round trips, byte accounting and refusal of hostile payloads."""

import io
import pickle

import numpy as np
import pytest
from flwr.common import Parameters, ndarrays_to_parameters

from fedapp.runtime.payload import (ArraySpec, PayloadError, decode, encode, from_ndarrays,
                                    to_ndarrays, validate, wire_size)


def test_round_trip_keeps_names_and_values_in_the_wire_dtypes():
    payload = {"head.weight": np.random.rand(10, 500).astype(np.float32),
               "head.bias": np.zeros(10, np.float32), "labels": np.array([3, 7], np.int32)}
    back = decode(encode(payload))
    assert list(back) == list(payload)
    assert [a.dtype for a in back.values()] == [np.float32, np.float32, np.int64]
    for name in payload:
        np.testing.assert_array_equal(back[name], payload[name])


def test_client_side_list_matches_server_side_encoding():
    # A NumPyClient returns to_ndarrays(...); Flower encodes that list with np.save. The server
    # must read exactly the same payload back.
    payload = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    params = ndarrays_to_parameters(to_ndarrays(payload))
    np.testing.assert_array_equal(decode(params)["a"], payload["a"])
    assert from_ndarrays(to_ndarrays({})) == {} and encode({}).tensors == []


def test_wire_size_separates_data_from_framing():
    # The LG-FedAvg head of FedGH Table 3: 500*10 + 10 = 5010 floats = 20040 bytes of data.
    payload = {"head.weight": np.zeros((10, 500), np.float32),
               "head.bias": np.zeros(10, np.float32)}
    size = wire_size(encode(payload))
    assert size.data == 5010 * 4
    assert size.framing == sum(len(t) for t in encode(payload).tensors) - 5010 * 4
    assert 0 < size.framing < 600  # npy headers and the names tensor only


def test_pickled_object_arrays_are_refused():
    buf = io.BytesIO()
    np.save(buf, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    names = io.BytesIO()
    np.save(names, np.array(["x"]), allow_pickle=False)
    with pytest.raises(PayloadError, match="not a plain .npy"):
        decode(Parameters(tensors=[names.getvalue(), buf.getvalue()], tensor_type=""))
    with pytest.raises(PayloadError):
        decode(Parameters(tensors=[pickle.dumps({"x": 1})], tensor_type=""))


def test_garbage_and_inconsistent_names_are_refused():
    with pytest.raises(PayloadError):
        decode(Parameters(tensors=[b"\x93NUMPY garbage"], tensor_type=""))
    params = encode({"a": np.zeros(2, np.float32)})
    with pytest.raises(PayloadError, match="name"):
        decode(Parameters(tensors=params.tensors[1:] + params.tensors[1:], tensor_type=""))


def test_validate_checks_shape_kind_finiteness_and_label_range():
    spec = {"protos": ArraySpec((None, 4)), "labels": ArraySpec((None,), "int", 0, 9)}
    ok = {"protos": np.zeros((2, 4), np.float32), "labels": np.array([0, 9], np.int32)}
    validate(ok, spec)
    cases = [
        ({**ok, "protos": np.zeros((2, 5), np.float32)}, "shape"),
        ({**ok, "protos": np.full((2, 4), np.nan, np.float32)}, "NaN"),
        ({**ok, "protos": np.full((2, 4), np.inf, np.float32)}, "NaN or infinite"),
        ({**ok, "labels": np.array([0, 10], np.int32)}, "> 9"),
        ({**ok, "labels": np.array([-1, 2], np.int32)}, "< 0"),
        ({**ok, "labels": np.array([0.0, 1.0], np.float32)}, "expected integer"),
        ({"protos": ok["protos"]}, "missing"),
        ({**ok, "extra": np.zeros(1, np.float32)}, "unexpected"),
    ]
    for payload, reason in cases:
        with pytest.raises(PayloadError, match=reason):
            validate(payload, spec)
