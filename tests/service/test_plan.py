"""POST /plan: a request planned without its data. Its numbers are those /forward and
/backward then report for the same graph and shapes, on every path; its errors are theirs;
a specs-only body allocates none of its tensors; `?format=dot` draws the program."""

from __future__ import annotations

import tracemalloc
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from bench.workloads import OBJECTIVES, objectives_data
from tests.support.in_process import serving
from tests.support.problems import assert_problem, strict_json
from tests.support.seeds import SEED_EXPR, SEED_OP

pytestmark = pytest.mark.anyio

RNN = {
    "nodes": [
        {
            "id": "rnn",
            "op": "scan",
            "args": ["h0", "xs"],
            "body": {
                "carry": ["h"],
                "xs": ["x"],
                "nodes": [{"id": "h2", "expr": "tanh(x @ w + h @ u)"}],
                "next": {"h": "h2"},
            },
            "results": {"h_last": "h"},
        },
        {"id": "loss", "expr": "sum(h_last * h_last)"},
        {"id": "g", "expr": "grad(loss, u)"},
        {"id": "total", "expr": "loss + sum(g * g)"},
    ],
    "outputs": ["total"],
}


def _tensor(a: np.ndarray, requires_grad: bool) -> dict[str, Any]:
    return {"data": a.tolist(), "dtype": str(a.dtype), "requires_grad": requires_grad}


def _spec(a: np.ndarray, requires_grad: bool) -> dict[str, Any]:
    return {"shape": list(a.shape), "dtype": str(a.dtype), "requires_grad": requires_grad}


def _requests() -> dict[str, tuple[dict[str, Any], dict[str, np.ndarray], list[str]]]:
    """name -> (graph, inputs, inputs that require grad): the seed examples, the 10
    objectives, and a differentiated loop with a grad node."""
    rng = np.random.default_rng(2)
    out: dict[str, tuple[dict[str, Any], dict[str, np.ndarray], list[str]]] = {}
    for name, seed in (("seed-op", SEED_OP), ("seed-expr", SEED_EXPR)):
        arrays = {k: np.array(v["data"], dtype=np.float32) for k, v in seed["inputs"].items()}
        out[name] = (seed["graph"], arrays, list(arrays))
    data = objectives_data()
    for name, (nodes, output, wrt) in OBJECTIVES.items():
        out[name] = ({"nodes": nodes, "outputs": [output]}, data, wrt)
    out["rnn"] = (
        RNN,
        {
            "xs": rng.standard_normal((6, 2, 3)),
            "w": rng.standard_normal((3, 4)),
            "u": rng.standard_normal((4, 4)) * 0.5,
            "h0": rng.standard_normal((2, 4)),
        },
        ["w"],
    )
    return out


REQUESTS = _requests()


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_planned_numbers_are_what_the_run_reports(
    client: httpx.AsyncClient, name: str
) -> None:
    graph, arrays, wrt = REQUESTS[name]
    for path, route, extra in (
        ("no_grad", "/forward", {"no_grad": True}),
        ("forward", "/forward", {}),
        ("backward", "/backward", {}),
    ):
        specs = {k: _spec(a, k in wrt) for k, a in arrays.items()}
        planned = strict_json(
            await client.post("/plan", json={"graph": graph, "inputs": specs, "path": path})
        )
        ran = await client.post(
            route,
            json={
                "graph": graph,
                "inputs": {k: _tensor(a, k in wrt) for k, a in arrays.items()},
                **extra,
            },
        )
        meta = strict_json(ran)["meta"]
        assert planned["planned_peak_bytes"] == meta["planned_peak_bytes"], (name, path)
        assert planned["compute_cost"] == meta["compute_cost"], (name, path)
        assert planned["graph_id"] == meta["graph_id"] and planned["admitted"]
        assert planned["path"] == path
        steps = planned["nodes"]
        assert [s["step"] for s in steps] == list(range(len(steps)))
        assert sum(s["cost"] for s in steps) == planned["compute_cost"]
        assert all(s["freed_after"] is None or s["freed_after"] >= s["step"] for s in steps)
        kinds = {s["kind"] for s in steps}
        assert ("backward" in kinds) == (path == "backward"), (name, path, kinds)


async def test_specs_only_bodies_allocate_none_of_their_tensors(client: httpx.AsyncClient) -> None:
    """Four inputs of 10^6 float32 each (16 MB): the plan holds a few kilobytes."""
    names = ["a", "b", "c", "d"]
    body = {
        "graph": {"nodes": [{"id": "y", "expr": "sum(a * b + c * d)"}], "outputs": ["y"]},
        "inputs": {
            n: {"shape": [1000, 1000], "dtype": "float32", "requires_grad": True} for n in names
        },
        "path": "backward",
    }
    await client.post("/plan", json=body)  # (warm: imports, memos)
    tracemalloc.start()
    try:
        r = await client.post("/plan", json=body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    planned = strict_json(r)
    assert planned["planned_peak_bytes"] >= 4 * 4_000_000  # the inputs are planned
    assert peak < 2_000_000, peak


async def test_errors_are_the_ones_forward_and_backward_give(client: httpx.AsyncClient) -> None:
    bad = {"graph": {"nodes": [{"id": "y", "expr": "x @ w"}], "outputs": ["y"]}}
    x, w = np.ones((3, 4), np.float32), np.ones((5, 2), np.float32)
    planned = await client.post(
        "/plan",
        json={**bad, "inputs": {"x": _spec(x, False), "w": _spec(w, False)}, "path": "no_grad"},
    )
    ran = await client.post(
        "/forward",
        json={**bad, "inputs": {"x": _tensor(x, False), "w": _tensor(w, False)}, "no_grad": True},
    )
    a, b = strict_json(planned), strict_json(ran)
    assert planned.status_code == ran.status_code == 422
    a.pop("request_id"), b.pop("request_id")
    assert a == b
    for body in (
        {
            "graph": {"nodes": [], "outputs": ["x"]},
            "inputs": {"x": {"shape": [2], "dtype": "float32"}},
            "path": "forward",
            "grad_outputs": {},
        },
        {
            "graph": {"nodes": [], "outputs": ["x"]},
            "inputs": {"x": {"shape": [2], "dtype": "complex64"}},
        },
    ):
        assert_problem(await client.post("/plan", json=body), 422, "invalid-request")
    for query in ("format=svg", "format="):  # (an empty format is neither: the document's enum)
        assert_problem(
            await client.post(f"/plan?{query}", json={}), 400, "bad-request", "json or dot"
        )


X34 = np.arange(12, dtype=np.float32).reshape(3, 4)
W52 = np.ones((5, 2), np.float32)
# name -> (path, graph, inputs, inputs that require grad, grad_outputs): each a different
# problem of the contract, found before any data would be needed.
BAD: dict[
    str, tuple[str, dict[str, Any], dict[str, np.ndarray], list[str], dict[str, np.ndarray] | None]
] = {
    "unknown-op": (
        "backward",
        {"nodes": [{"id": "y", "expr": "sum(logsumexpp(x))"}], "outputs": ["y"]},
        {"x": X34},
        ["x"],
        None,
    ),
    "arity": (
        "no_grad",
        {"nodes": [{"id": "y", "op": "add", "args": ["x"]}], "outputs": ["y"]},
        {"x": X34},
        [],
        None,
    ),
    "attribute": (
        "forward",
        {"nodes": [{"id": "y", "expr": "sum(x, keep_dim=True)"}], "outputs": ["y"]},
        {"x": X34},
        ["x"],
        None,
    ),
    "expr": (
        "no_grad",
        {"nodes": [{"id": "y", "expr": "x.__class__"}], "outputs": ["y"]},
        {"x": X34},
        [],
        None,
    ),
    "graph-cycle": (
        "no_grad",
        {"nodes": [{"id": "a", "expr": "b + x"}, {"id": "b", "expr": "a * 2"}], "outputs": ["b"]},
        {"x": X34},
        [],
        None,
    ),
    "graph-reference": (
        "backward",
        {"nodes": [{"id": "y", "expr": "sum(x * weight)"}], "outputs": ["y"]},
        {"x": X34},
        ["x"],
        None,
    ),
    "shape-mismatch": (
        "backward",
        {"nodes": [{"id": "y", "expr": "sum(relu(x) @ w)"}], "outputs": ["y"]},
        {"x": X34, "w": W52},
        ["x"],
        None,
    ),
    "dtype-mismatch": (
        "no_grad",
        {"nodes": [{"id": "y", "op": "matmul", "args": ["x", "i"]}], "outputs": ["y"]},
        {"x": X34, "i": np.ones((4, 2), np.int64)},
        [],
        None,
    ),
    "non-scalar output": (
        "backward",
        {"nodes": [{"id": "y", "expr": "x * 2"}], "outputs": ["y"]},
        {"x": X34},
        ["x"],
        None,
    ),
    "nothing requires grad": (
        "backward",
        {"nodes": [{"id": "y", "expr": "sum(x)"}], "outputs": ["y"]},
        {"x": X34},
        [],
        None,
    ),
    "grad_outputs shape": (
        "backward",
        {"nodes": [{"id": "y", "expr": "x * 2"}], "outputs": ["y"]},
        {"x": X34},
        ["x"],
        {"y": np.ones((4, 3), np.float32)},
    ),
    "requires_grad on integers": (
        "backward",
        {"nodes": [{"id": "y", "expr": "sum(i)"}], "outputs": ["y"]},
        {"i": np.ones(3, np.int64)},
        ["i"],
        None,
    ),
}


@pytest.mark.parametrize("name", list(BAD))
async def test_each_error_is_the_one_the_run_gives(client: httpx.AsyncClient, name: str) -> None:
    """The same problem, field for field (status, type, detail, node, errors), from /plan
    with specs and from /forward or /backward with the data."""
    path, graph, arrays, wrt, grad_outputs = BAD[name]
    specs = {k: _spec(a, k in wrt) for k, a in arrays.items()}
    tensors = {k: _tensor(a, k in wrt) for k, a in arrays.items()}
    plan_body: dict[str, Any] = {"graph": graph, "inputs": specs, "path": path}
    run_body: dict[str, Any] = {"graph": graph, "inputs": tensors}
    if grad_outputs is not None:
        plan_body["grad_outputs"] = {k: _spec(a, False) for k, a in grad_outputs.items()}
        run_body["grad_outputs"] = {k: _tensor(a, False) for k, a in grad_outputs.items()}
    if path == "no_grad":
        run_body["no_grad"] = True
    planned = await client.post("/plan", json=plan_body)
    ran = await client.post("/backward" if path == "backward" else "/forward", json=run_body)
    a, b = strict_json(planned), strict_json(ran)
    assert ran.status_code >= 400, b  # the case is a real problem
    a.pop("request_id"), b.pop("request_id")
    assert (planned.status_code, a) == (ran.status_code, b)


async def test_over_budget_is_not_admitted_with_its_numbers() -> None:
    body = {
        "graph": {"nodes": [{"id": "y", "expr": "sum(x * x)"}], "outputs": ["y"]},
        "inputs": {"x": {"shape": [1000, 1000], "dtype": "float32", "requires_grad": True}},
    }
    async with serving(memory_budget_bytes=1_000_000, compute_budget=1e6) as (c, _):
        planned = strict_json(await c.post("/plan", json={**body, "path": "backward"}))
        assert not planned["admitted"]
        assert planned["planned_peak_bytes"] > planned["memory_budget_bytes"] == 1_000_000
        assert planned["compute_cost"] > planned["compute_budget"]
        x = {"data": [0.0] * 4, "shape": [4], "dtype": "float32", "requires_grad": True}
        small = {**body, "inputs": {"x": x}, "path": "backward"}
        assert strict_json(await c.post("/plan", json=small))["admitted"]


async def test_dot_draws_forward_and_backward(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/plan?format=dot",
        json={
            "graph": SEED_OP["graph"],
            "path": "backward",
            "inputs": {
                "x": {"shape": [], "dtype": "float32", "requires_grad": True},
                "y": {"shape": [], "dtype": "float32", "requires_grad": True},
            },
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/vnd.graphviz")
    text = r.text
    assert text.startswith("digraph program {") and text.rstrip().endswith("}")
    assert "cluster_forward" in text and "cluster_backward" in text
    for node in ("s add", "d sub", "z mul"):
        assert f'label="{node}\\n[] float32' in text
    assert "in0 -> s0" in text and text.count("->") >= 6


# ---------------------------------------------------------------- found by schemathesis


async def test_a_plan_whose_figures_pass_64_bits_is_answered(client: httpx.AsyncClient) -> None:
    """A spec of 2**63 - 1 elements is a shape the codec takes (it spans no bytes it cannot
    address as bool), and its plan's figures pass 64 bits: answered, not a 500."""
    r = await client.post(
        "/plan",
        json={
            "graph": {"nodes": [{"id": "z", "expr": "x * 2"}], "outputs": ["z"]},
            "inputs": {"x": {"shape": [2**63 - 1], "dtype": "bool"}},
            "path": "no_grad",
        },
    )
    plan = strict_json(r)
    assert plan["planned_peak_bytes"] > 2**63 and plan["admitted"] is False


async def test_a_plan_takes_a_binary_body_and_checks_its_framing(client: httpx.AsyncClient) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = orjson.dumps(
        {
            "graph": {"nodes": [{"id": "z", "expr": "sum(x * x)"}], "outputs": ["z"]},
            "inputs": {
                "x": {
                    "binary_data_size": x.nbytes,
                    "dtype": "float32",
                    "shape": [2, 3],
                    "requires_grad": True,
                }
            },
        }
    )
    framed = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    r = await client.post("/plan", content=header + x.tobytes(), headers=framed)
    assert strict_json(r)["nodes"][0]["shape"] == [2, 3]
    r = await client.post("/plan", content=header + x.tobytes() + b"more", headers=framed)
    assert_problem(r, 400, "malformed-body", "bytes after the last tensor")


async def test_a_spec_refused_for_its_shape_names_its_input(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/plan",
        json={
            "graph": {"nodes": [{"id": "z", "expr": "x * 2"}], "outputs": ["z"]},
            "inputs": {"x": {"shape": [1] * 65, "dtype": "float32"}},
        },
    )
    p = assert_problem(r, 422, "tensor-data", "input 'x': shape has 65 dims")
    assert p["errors"][0]["loc"] == ["inputs", "x", "shape"]
