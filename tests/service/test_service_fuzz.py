"""Hostile input through the HTTP API, in process: the regressions that fuzzing found, and
a short, deterministic fuzz run over the op catalog. The contract under test: every bad
request gets application/problem+json with a 4xx status that says what is wrong, never a
500 or a non-strict JSON body, and the requests after it are served as usual."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
from anyio.from_thread import BlockingPortal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradserve.engine as engine
from tests.support.portal import app_portal  # noqa: F401 (the `portal_client` fixture)
from tests.support.problems import PROBLEM, assert_problem, strict_json
from tests.support.seeds import SEED_OP

pytestmark = pytest.mark.anyio

INT64_END = 1 << 63


def _one(node: dict[str, Any], inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"graph": {"nodes": [{"id": "z", **node}], "outputs": ["z"]}, "inputs": inputs or {}}


def _x(**tensor: Any) -> dict[str, Any]:
    return {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": tensor}}


# ------------------------------------------------------------------ regressions
# Each of these was a 500 (an exception that reached the middleware's last resort).


async def test_planned_bytes_past_64_bits_is_a_memory_budget_problem(
    client: httpx.AsyncClient,
) -> None:
    # float32 [2**31, 2**31] plans 2**64 bytes: orjson cannot write that int.
    r = await client.post(
        "/forward", json=_one({"op": "zeros", "attrs": {"shape": [1 << 31, 1 << 31]}})
    )
    body = assert_problem(r, 422, "memory-budget", "18446744073709551616 bytes")
    assert body["planned_bytes"] == 1 << 64
    r = await client.post("/forward", json=_one({"expr": f"eye(n={INT64_END - 1})"}))
    assert_problem(r, 422, "memory-budget")
    r = await client.post("/forward", json=_one({"expr": f"eye(n={INT64_END})"}))
    assert_problem(r, 422, "attribute", "'n' is outside the int64 range")


@pytest.mark.parametrize(
    ("tensor", "detail"),
    [
        # Dims whose product overflows what an array can address, even with a 0 among them.
        ({"b64": "", "dtype": "float32", "shape": [0, 1 << 62]}, "too large for any tensor"),
        ({"data": [], "shape": [0, 1 << 62]}, "too large for any tensor"),
        ({"data": [], "shape": [1 << 64, 0]}, "too large for any tensor"),
        ({"data": [1.0], "shape": [10**40]}, "too large for any tensor"),
        # More dims than NumPy (and PyTorch) support.
        ({"b64": "AA==", "dtype": "bool", "shape": [1] * 100}, "at most 64"),
        ({"data": [], "shape": [0] * 65}, "at most 64"),
    ],
    ids=[
        "b64-zero-size",
        "data-zero-size",
        "dim-past-uint64",
        "huge-dim",
        "b64-100-dims",
        "data-65-dims",
    ],
)
async def test_unrepresentable_declared_shape(
    client: httpx.AsyncClient, tensor: dict[str, Any], detail: str
) -> None:
    body = assert_problem(
        await client.post("/forward", json=_x(**tensor)), 422, "tensor-data", detail
    )
    assert body["errors"][0]["loc"] == ["inputs", "x", "shape"]


async def test_64_dims_are_still_fine(client: httpx.AsyncClient) -> None:
    r = await client.post("/forward", json=_x(data=[], shape=[0] * 64))
    assert r.status_code == 200, r.text
    assert strict_json(r)["outputs"]["x"]["shape"] == [0] * 64


async def test_data_nested_deeper_than_a_tensor_can_be(client: httpx.AsyncClient) -> None:
    deep = json.loads("[" * 70 + "1.0" + "]" * 70)
    assert_problem(
        await client.post("/forward", json=_x(data=deep)),
        422,
        "tensor-data",
        "nested deeper than the 64 dims",
    )


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (9.223372036854775807e18, "int64"),  # == 2**63 as a float: it wrapped to -2**63
        (2147483648.0, "int32"),
    ],
)
async def test_float_data_at_the_int_bound_is_out_of_range(
    client: httpx.AsyncClient, value: float, dtype: str
) -> None:
    r = await client.post("/forward", json=_x(data=[value], dtype=dtype))
    assert_problem(r, 422, "tensor-data", f"out of the range of {dtype}")
    ok = await client.post("/forward", json=_x(data=[-value], dtype=dtype))
    assert strict_json(ok)["outputs"]["x"]["data"] == [-int(value)]


@pytest.mark.parametrize(
    "node",
    [
        {"op": "index_select", "args": [7, 1], "attrs": {"dim": 0}},
        {"op": "index_select", "args": ["x", 1], "attrs": {"dim": 0}},
        {"op": "gather", "args": [2.5, "i"], "attrs": {"dim": 0}},
        {"expr": "scatter_add(x, i, 2.5, dim=0)"},
        {"expr": "scatter_add(x, 0, x, dim=0)"},
    ],
)
async def test_number_literal_where_an_index_op_wants_a_tensor(
    client: httpx.AsyncClient, node: dict[str, Any]
) -> None:
    inputs = {"x": {"data": [1.0, 2.0], "requires_grad": True}, "i": [0]}
    r = await client.post("/backward", json=_one(node, inputs))
    body = assert_problem(r, 422, "dtype-mismatch", "must be a tensor, not a number literal")
    assert body["node"] == "z"


@pytest.mark.parametrize(
    ("attrs", "detail"),
    [
        ({"end": 1e308, "step": 1e-308}, "too many values"),
        ({"end": 10**400}, "'end' is outside the int64 range"),
        ({"end": 10**400, "dtype": "float32"}, "'end' is outside the int64 range"),
    ],
)
async def test_arange_whose_length_overflows(
    client: httpx.AsyncClient, attrs: dict[str, Any], detail: str
) -> None:
    r = await client.post("/forward", json=_one({"op": "arange", "attrs": attrs}))
    assert_problem(r, 422, "attribute", detail)


async def test_requests_after_hostile_ones_are_served(client: httpx.AsyncClient) -> None:
    for body in (
        _one({"op": "zeros", "attrs": {"shape": [1 << 31, 1 << 31]}}),
        _x(data=[], shape=[0, 1 << 62]),
        _one({"op": "index_select", "args": [7, 1], "attrs": {"dim": 0}}),
    ):
        assert (await client.post("/backward", json=body)).status_code == 422
    r = await client.post("/backward", json=SEED_OP)
    assert r.status_code == 200, r.text
    assert strict_json(r)["gradients"]["x"]["data"] == 4.0


# ------------------------------------------------------------------ a short fuzz run

OPS = {name: op.describe() for name, op in engine.OPS.items()}
NAMES = ["x", "y", "i", "b"]
INPUTS = {
    "x": {"data": [[1.0, -2.0], [0.5, 3.0]], "requires_grad": True},
    "y": {"data": [1.5, "NaN"], "dtype": "float64", "requires_grad": True},
    "i": {"data": [1, 0], "dtype": "int64"},
    "b": [True, False],
}
_INTS = st.sampled_from([0, 1, -1, 2, 5, -(1 << 63), (1 << 63) - 1, 1 << 63, 1 << 64, 10**30])
_NUMBERS = _INTS | st.sampled_from([0.5, -2.5, 1e308, -1e308, 5e-324, 1e-300])
# Number literals in `args`, past int64 too (refused as PyTorch refuses them).
_LITERALS = st.sampled_from(
    [0, 1, -1, 2, -(1 << 63), (1 << 63) - 1, 1 << 63, 10**30, 0.5, -2.5, 1e308, 5e-324]
)
_SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 1 << 31, 1 << 62, 10**6]), max_size=4)
_ATTR = {
    "int": _INTS,
    "int|null": st.none() | _INTS,
    "int|ints|null": st.none() | _INTS | st.lists(_INTS, max_size=3),
    "ints": st.lists(_INTS, max_size=3),
    "shape": _SHAPES,
    "bool": st.booleans(),
    "number": _NUMBERS,
    "number|null": st.none() | _NUMBERS,
    "dtype": st.sampled_from(["float16", "float32", "float64", "int32", "int64", "bool"]),
    "str": st.sampled_from(["ij,jk->ik", "ii->i", "i,i->", "->", "ab", "i->j", "...->..."]),
}
_ATTR["dtype|null"] = st.none() | _ATTR["dtype"]
_ANY = st.none() | st.booleans() | _NUMBERS | st.text(max_size=5) | st.lists(_INTS, max_size=2)


@st.composite
def _node(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(st.sampled_from(sorted(OPS)))
    info = OPS[name]
    arity = len(info["args"]) + draw(st.integers(-1, 2) if info["variadic"] else st.just(0))
    args = draw(
        st.lists(st.sampled_from(NAMES) | _LITERALS, min_size=max(arity, 0), max_size=max(arity, 0))
    )
    attrs = {}
    for attr, spec in info["attrs"].items():
        if spec["required"] or draw(st.booleans()):
            attrs[attr] = (
                draw(_ATTR.get(spec["type"], _ANY) | _ANY)
                if draw(st.integers(0, 9)) == 0
                else draw(_ATTR.get(spec["type"], _ANY))
            )
    return {"id": "z", "op": name, "args": args, "attrs": attrs}


def _check(r: httpx.Response) -> None:
    assert r.status_code in (200, 422), r.text
    body = strict_json(r)
    if r.status_code != 200:
        assert r.headers["content-type"] == PROBLEM
        assert body["detail"] and "Traceback" not in r.text


@pytest.mark.anyio(False)  # a synchronous test: the portal runs the event loop
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(node=_node(), backward=st.booleans())
def test_fuzz_op_nodes(
    portal_client: tuple[BlockingPortal, httpx.AsyncClient],
    node: dict[str, Any],
    backward: bool,
) -> None:
    portal, client = portal_client
    body = {"graph": {"nodes": [node], "outputs": ["z"]}, "inputs": INPUTS}
    if backward:
        body["graph"]["nodes"].append({"id": "s", "expr": "sum(cast(z, dtype='float32'))"})
        body["graph"]["outputs"] = ["s"]
    path = "/backward" if backward else "/forward"
    _check(portal.call(partial(client.post, path, content=json.dumps(body))))
