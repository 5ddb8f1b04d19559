"""The tensor codec on its own: decoding rules, strict JSON, base64 round trips."""

from __future__ import annotations

import base64
import json
import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from gradserve.engine.errors import TensorDataError
from gradserve.service import codec
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


# ------------------------------------------------ large arrays read straight into arrays
# codec.loads_tensors reads a large JSON array of numbers without a Python number for each
# (Numbers); whatever it reads, and every error, must be what the general parse gives.
def _decoded(member: dict[str, object], raw: bytes, fast: bool) -> dict[str, object]:
    """Each tensor of a tensors member decoded, or its error's message, through the fast
    parse or the general one."""
    tensors = codec.loads_tensors(raw) if fast else codec.loads(raw)
    out: dict[str, object] = {}
    for name, value in tensors.items():
        fields = value if isinstance(value, dict) else {"data": value}
        try:
            out[name] = decode_tensor(
                ("inputs", name),
                data=fields.get("data"),
                dtype=fields.get("dtype"),
                shape=fields.get("shape"),
            )
        except TensorDataError as err:
            out[name] = f"{err} at {err.loc}"
    return out


def _assert_same_as_general_parse(member: dict[str, object], raw: bytes | None = None) -> None:
    raw = json.dumps(member).encode() if raw is None else raw
    fast, general = _decoded(member, raw, True), _decoded(member, raw, False)
    assert fast.keys() == general.keys()
    for name in general:
        a, b = fast[name], general[name]
        if isinstance(b, str):
            assert a == b, name
        else:
            assert isinstance(a, np.ndarray), (name, a)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert a.tobytes() == b.tobytes(), name  # bit for bit (-0.0, subnormals too)


def _numbers(n: int, seed: int = 0) -> list[float]:
    return np.random.default_rng(seed).standard_normal(n).tolist()


BIG = 2000  # numbers: well past codec.NUMBERS_MIN_BYTES


@pytest.mark.parametrize(
    "member",
    [
        {"x": {"data": _numbers(BIG), "dtype": "float64"}},  # flat
        {"x": {"data": _numbers(BIG)}},  # default dtype: float32
        {"x": {"data": _numbers(BIG), "dtype": "float16"}},
        {"x": {"data": np.reshape(_numbers(BIG), (40, 50)).tolist(), "dtype": "float64"}},
        {"x": {"data": np.reshape(_numbers(BIG), (10, 4, 50)).tolist(), "requires_grad": True}},
        {"x": {"data": _numbers(BIG), "shape": [40, 50], "dtype": "float64"}},  # flat + shape
        {"x": {"data": _numbers(BIG), "shape": [41, 50], "dtype": "float64"}},  # wrong shape
        {"x": {"data": list(range(-BIG, BIG))}},  # ints: int64
        {"x": {"data": list(range(BIG)), "dtype": "float32"}},
        {"x": {"data": list(range(BIG)), "dtype": "int32"}},
        {"x": {"data": [*range(BIG), 2**40], "dtype": "int32"}},  # out of int32's range
        {"x": {"data": [*range(BIG), 2**63]}},  # past int64: the general parse's error
        {"x": {"data": [*range(BIG), 2**70, 1.5], "dtype": "float64"}},  # past 64 bits
        {"x": {"data": [*range(BIG), 2.5]}},  # ints and floats: floats
        {"x": {"data": [*range(BIG), 2.5], "dtype": "int64"}},  # a fraction for an int
        {"x": {"data": [*_numbers(BIG), True]}},  # a boolean among numbers
        {"x": {"data": [*_numbers(BIG), "NaN", "-Infinity"], "dtype": "float64"}},
        {"x": {"data": [*_numbers(BIG), "nan"]}},  # not one of the three strings
        {"x": {"data": [*_numbers(BIG), None]}},
        {"x": {"data": [_numbers(50, k) for k in range(40)] + [_numbers(49)]}},  # ragged
        {"x": {"data": [_numbers(50, k) for k in range(40)] + [[_numbers(50)]]}},  # deeper
        {"x": {"data": [*_numbers(BIG), [1.5]]}},  # a list among numbers
        {"x": {"data": [[] for _ in range(BIG)]}},  # empty rows
        {"x": {"data": [[v] for v in _numbers(BIG)], "dtype": "float64"}},  # a column
        {"x": {"data": [[v] for v in _numbers(BIG)] + [[]]}},  # a column, a row empty
        {"x": {"data": [_numbers(51), _numbers(49)] + [_numbers(50, k) for k in range(40)]}},
        {"x": {"data": [[True, False] * 50 for _ in range(30)], "dtype": "bool"}},
        {"x": {"data": [1e308, -1e308, 5e-324, -0.0, 0.0, 2.2250738585072014e-308] * 400}},
        {"x": {"data": _numbers(BIG), "dtype": "float64"}, "y": {"data": [1.0, 2.0]}},
        {"x": _numbers(BIG), "y": 3.0},  # bare data
        {"x": np.reshape(_numbers(BIG), (50, 40)).tolist(), "y": {"data": _numbers(BIG)}},
    ],
    ids=lambda m: None,
)
def test_large_arrays_read_as_the_general_parse_reads_them(member: dict[str, object]) -> None:
    _assert_same_as_general_parse(member)


@pytest.mark.parametrize(
    "text",
    [
        # numbers as other writers write them: exponents, spaces, newlines, long digits
        b'{"x": {"data": [' + b", ".join(b"%.17e" % v for v in _numbers(BIG)) + b"]}}",
        b'{"x": {"data": [\n  ' + b",\n  ".join(b"%r" % v for v in _numbers(BIG)) + b"\n]}}",
        b'{"x": {"data": [' + b",".join(b"%.3E" % v for v in _numbers(BIG)) + b"]}}",
        b'{"x": {"data": [' + b",".join(b"1e%d" % k for k in range(-300, 300)) + b"]}}",
        b'{"x": {"data": [' + b",".join(b"%d" % k for k in range(BIG)) + b", 1e400]}}",
        b'{"x": {"data": [' + b",".join(b"-0" for _ in range(BIG)) + b"]}}",  # int zeros
        b'{"x": {"data": [' + b",".join(b"%d.0" % k for k in range(BIG)) + b"]}}",
        b'{"x": {"data": [' + b",".join(b"0.1" for _ in range(BIG)) + b']}, "x": {"data": 2}}',
        b'{"x": {"data": [' + b",".join(b"0.1" for _ in range(BIG)) + b'], "data": [1, 2]}}',
    ],
    ids=[
        "exponents",
        "newlines",
        "short-E",
        "powers",
        "overflow",
        "minus-zero",
        "dot-zero",
        "dup-tensor",
        "dup-data",
    ],
)
def test_numbers_written_any_way_read_as_the_general_parse_reads_them(text: bytes) -> None:
    _assert_same_as_general_parse({}, text)


@settings(max_examples=40, deadline=None)
@given(
    arrays(np.float64, array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=30)),
    st.sampled_from(["float64", "float32", None]),
)
def test_any_float_array_reads_bit_for_bit(array: np.ndarray, dtype: str | None) -> None:
    array = np.nan_to_num(array)  # (non-finite numbers travel as strings)
    # as many copies along its first dim as take its text past the fast parse's threshold
    copies = -(-codec.NUMBERS_MIN_BYTES // len(json.dumps(array.tolist()))) + 1
    array = np.concatenate([array] * copies)
    _assert_same_as_general_parse({"x": {"data": array.tolist(), "dtype": dtype}})


def test_large_arrays_are_read_as_arrays_not_python_numbers() -> None:
    raw = json.dumps({"x": {"data": _numbers(BIG)}, "y": {"data": [1.0, 2.0]}}).encode()
    tensors = codec.loads_tensors(raw)
    assert isinstance(tensors["x"]["data"], codec.Numbers)
    assert tensors["x"]["data"].kind == "f"
    assert tensors["y"]["data"] == [1.0, 2.0]  # (small: the general parse)


@pytest.mark.parametrize(
    "document",
    [
        {"graph_id": "0" * 32, "inputs": {"x": {"data": _numbers(20 * BIG)}}, "no_grad": True},
        {"graph_id": "0" * 32, "inputs": {"x": _numbers(20 * BIG)}},  # bare data
        {"graph_id": "0" * 32, "inputs": {"x": {"data": _numbers(20 * BIG)}}, "other": 1},
        {
            "graph": {"nodes": [{"id": "y", "expr": "x * 2.0"}], "outputs": ["y"]},
            "inputs": {"x": {"data": np.reshape(_numbers(20 * BIG), (200, 200)).tolist()}},
            "grad_outputs": {"y": {"data": _numbers(20 * BIG), "shape": [200, 200]}},
        },
        {"inputs": {"x": {"data": [*_numbers(20 * BIG), "a"]}}, "inputs2": None},
    ],
    ids=["members", "bare-data", "unknown-member", "both-tensors", "bad-data"],
)
def test_a_large_document_split_in_one_pass_parses_as_split_member_by_member(
    document: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """request._split splits a document of SPLIT_DEEP_BYTES or more down to its tensors'
    fields in one pass (or, where it cannot, member by member): the members it parses
    to are the same either way."""
    from gradserve.service import request
    from gradserve.service.programs import Programs
    from gradserve.service.settings import Settings

    raw = json.dumps(document).encode()
    programs = Programs(Settings(program_store_bytes=0))
    parsed = []
    for deep_from in (0, math.inf):
        monkeypatch.setattr(request, "SPLIT_DEEP_BYTES", deep_from)
        envelope = request.open_envelope(raw, None, programs)
        members = request._parse_members(envelope)
        assert members is not None
        parsed.append({k: _plain(v) for k, v in members.items()})
    assert parsed[0] == parsed[1]
    assert parsed[0].keys() == document.keys()


def _plain(value: object) -> object:
    """A parsed member with its Numbers as lists (to compare)."""
    if isinstance(value, codec.Numbers):
        return (value.kind, value.array.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_both_rectangularity_checks_read_arrays_as_numpy_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """codec._numbers checks that an array is rectangular on its parsed rows where they are
    few for its text, else on its text without its numbers: on arrays made ragged, deeper
    or not numbers at random, both accept what NumPy reads as a numeric array, as it
    reads it, and nothing else."""
    rng = np.random.default_rng(5)
    edits = [b"[", b"]", b",", b"", b"1", b"1.5", b"[2]", b" ", b"null", b'"["', b"[]"]
    texts = [b"[[0],[],[2]]", b"[[1,[2]],[3,4]]", b"[[[1,2],[3,4]],[[5,6,7],[8]]]"]
    for _ in range(2000):
        shape = tuple(rng.integers(1, 5, rng.integers(1, 5)))
        text = bytearray(json.dumps(np.arange(math.prod(shape)).reshape(shape).tolist()).encode())
        for _ in range(rng.integers(0, 3)):
            at = int(rng.integers(len(text)))
            text[at : at + 1] = edits[rng.integers(len(edits))]
        texts.append(bytes(text))
    for text in texts:
        read = []
        for bytes_a_row in (0, 1 << 62):  # rows always few / always many
            monkeypatch.setattr(codec, "BYTES_A_ROW", bytes_a_row)
            read.append(codec._numbers(text))
        try:
            want = np.array(json.loads(text))
        except (ValueError, TypeError):
            want = None
        numeric = want is not None and want.size > 0 and want.dtype.kind in "if"
        for got in read:
            if got is None:
                continue
            assert numeric, text
            assert want is not None and got.array.shape == want.shape, text
            assert np.array_equal(got.array, want), text
        assert (read[0] is None) == (read[1] is None), text


def test_the_small_fields_beside_large_data_parse_as_each_on_its_own() -> None:
    """tensors_of_fields parses every field but a large `data` in one go: the same values,
    in the same places, as a parse of each; a field that is not strict JSON is refused
    with the message its own parse gives."""
    member = {
        f"t{k}": {"data": [[k * 0.5, -1.0]], "dtype": "float32", "requires_grad": k % 2 == 0}
        for k in range(30)
    } | {"big": {"data": _numbers(BIG), "requires_grad": True}}
    fields = codec._TENSOR_FIELDS.decode(json.dumps(member).encode())
    parsed = codec.tensors_of_fields(fields)
    for name, f in fields.items():
        for key, value in f.items():
            got = parsed[name][key]
            if name == "big" and key == "data":
                assert got.kind == "f" and got.array.tolist() == member["big"]["data"]
            else:
                own = codec.loads(bytes(value))
                assert got == own == member[name][key] and type(got) is type(own)
    assert list(parsed) == list(fields) and all(list(parsed[n]) == list(fields[n]) for n in fields)
    bad = {"x": {"data": msgspec.Raw(b"[1.0, 2.0]"), "requires_grad": msgspec.Raw(b"NaN")}}
    with pytest.raises(codec.JSONError) as caught:
        codec.tensors_of_fields(bad)
    with pytest.raises(codec.JSONError) as alone:
        codec.loads(b"NaN")
    assert str(caught.value) == str(alone.value)
