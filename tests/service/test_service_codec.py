"""The tensor codec on its own: decoding rules, strict JSON, base64 round trips."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from gradserve.engine.errors import TensorDataError
from gradserve.service.codec import decode_tensor, dumps, encode_tensor

LOC = ("inputs", "x")
DTYPES = ["float16", "float32", "float64", "int32", "int64", "bool"]


def strict(text: bytes) -> object:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("data", "dtype", "shape"),
    [
        (2.0, "float32", ()),
        (2, "int64", ()),
        (True, "bool", ()),
        ([1, 2.5], "float32", (2,)),
        ([[1, 2], [3, 4]], "int64", (2, 2)),
        ([], "float32", (0,)),
        ([[], []], "float32", (2, 0)),
        ("NaN", "float32", ()),
        ([1, "Infinity"], "float32", (2,)),
    ],
)
def test_default_dtypes_follow_torch_tensor(data: object, dtype: str, shape: tuple) -> None:
    array = decode_tensor(LOC, data=data)
    assert (array.dtype.name, array.shape) == (dtype, shape)


def test_declared_dtype_and_flat_shape() -> None:
    array = decode_tensor(LOC, data=[1, 2, 3, 4, 5, 6], dtype="float64", shape=[3, 2])
    assert array.dtype == np.float64 and array.shape == (3, 2)
    assert decode_tensor(LOC, data=[2.0, -3.0], dtype="int32").tolist() == [2, -3]


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"data": 1.0, "shape": [2]}, "shape", "scalar"),
        ({"data": [1.0, 2.0, 3.0], "shape": [2, 2]}, "shape", "does not match"),
        ({"data": [[1.0, 2.0]], "shape": [2, 1]}, "shape", "does not match"),
        ({"data": [0.5], "dtype": "int64"}, "data", "non-integral"),
        ({"data": ["NaN"], "dtype": "int32"}, "data", "NaN"),
        ({"data": [1.0, True]}, "data", "boolean"),
        ({"data": True, "dtype": "float32"}, "data", "boolean"),
        ({"data": [1, 0], "dtype": "bool"}, "data", "booleans"),
        ({"data": [[1.0], [2.0, 3.0]]}, "data", "ragged"),
        ({"data": [1.0, None]}, "data", "NoneType"),
        ({"data": "nan"}, "data", "string"),
        ({"data": [2**63]}, "data", "int64"),
        ({"data": [2**31], "dtype": "int32"}, "data", "range"),
        ({"b64": "AAAA"}, "dtype", "dtype"),
        ({"b64": "AAAA", "dtype": "float32"}, "shape", "shape"),
        ({"b64": "AA AA", "dtype": "int32", "shape": [1]}, "b64", "base64"),
        ({"b64": "AAA", "dtype": "int32", "shape": [1]}, "b64", "base64"),
        ({"b64": "AAAAAAA=", "dtype": "int32", "shape": [1]}, "b64", "bytes"),
        (
            {"b64": base64.b64encode(b"\x01\x03").decode(), "dtype": "bool", "shape": [2]},
            "b64",
            "0 or 1",
        ),
    ],
)
def test_errors_name_the_input(kwargs: dict, field: str, message: str) -> None:
    with pytest.raises(TensorDataError, match=message) as info:
        decode_tensor(LOC, **kwargs)
    assert info.value.loc == (*LOC, field)
    assert str(info.value).startswith("input 'x': ")


def test_float16_overflow_is_infinity_as_in_torch() -> None:
    assert decode_tensor(LOC, data=[1e6], dtype="float16").tolist() == [math.inf]


@pytest.mark.parametrize("dtype", DTYPES)
def test_base64_is_little_endian_row_major(dtype: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(dtype)
    raw = array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    out = decode_tensor(LOC, b64=base64.b64encode(raw).decode(), dtype=dtype, shape=[2, 3])
    np.testing.assert_array_equal(out, array)
    assert out.dtype.isnative
    enc = json.loads(dumps(encode_tensor(array, "base64")))
    assert base64.b64decode(enc["b64"]) == raw
    assert (enc["dtype"], enc["shape"]) == (dtype, [2, 3])


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )
)
def test_json_round_trip_is_exact_and_strict(array: np.ndarray) -> None:
    text = dumps(encode_tensor(array, "json"))
    wire = strict(text)
    assert isinstance(wire, dict)
    back = decode_tensor(LOC, data=wire["data"], dtype=wire["dtype"], shape=wire["shape"])
    np.testing.assert_array_equal(back, array)  # NaN equal to NaN, -0.0 kept by value


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        st.sampled_from([np.int32, np.int64, np.bool_, np.float32]),
        array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )
)
def test_base64_round_trip(array: np.ndarray) -> None:
    wire = strict(dumps(encode_tensor(array, "base64")))
    assert isinstance(wire, dict)
    back = decode_tensor(LOC, b64=wire["b64"], dtype=wire["dtype"], shape=wire["shape"])
    np.testing.assert_array_equal(back, array)


def test_non_finite_values_become_strings() -> None:
    array = np.array([[0.1, np.nan], [np.inf, -np.inf]], dtype=np.float32)
    text = dumps({"t": encode_tensor(array, "json")})
    assert b'"data":[[0.1,"NaN"],["Infinity","-Infinity"]]' in text
    assert dumps(encode_tensor(np.array(-np.inf), "json")).endswith(b'"data":"-Infinity"}')


def test_float32_writes_shortest_digits() -> None:
    assert dumps(encode_tensor(np.array(0.1, dtype=np.float32), "json")).endswith(b"0.1}")


def test_the_wire_dtypes_are_the_engines() -> None:
    """The schemas' Literal (which the OpenAPI document lists) is the engine's dtype table."""
    from typing import get_args

    from gradserve.engine.dtypes import DTYPES
    from gradserve.service.schemas import DType

    assert get_args(DType) == DTYPES
