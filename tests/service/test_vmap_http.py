"""`vmap`, `jacobian` and `hessian` over HTTP, in the wire forms the issue fixes: per-sample
gradients and their reductions against torch.func, `/backward` through them, the chunks
`meta` and `/plan` report under a memory budget, `GET /ops`, and the problem each kind of
bad node gets."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.func

from gradserve.engine.graph.xla import INDEX_ORDERED
from tests.support.problems import assert_problem, strict_json

pytestmark = pytest.mark.anyio

RNG = np.random.default_rng(28)

# The issue's node, as it gives it.
PER_SAMPLE: dict[str, Any] = {
    "id": "ps",
    "op": "vmap",
    "args": ["X", "Y"],
    "body": {
        "in": ["x", "y"],
        "nodes": [
            {"id": "l", "expr": "sum((tanh(x @ w1) @ w2 - y) ** 2)"},
            {"id": "g1", "op": "grad", "args": ["l", "w1"]},
            {"id": "g2", "op": "grad", "args": ["l", "w2"]},
        ],
    },
    "results": {
        "G1": "g1",
        "L": "l",
        "S1": {"of": "g1", "reduce": "sum"},
        "C1": {"of": "g1", "reduce": "clip_sum", "max_norm": 1.0, "norm_of": ["g1", "g2"]},
    },
    "attrs": {"in_axes": [0, 0], "chunk_size": None},
}


def tensor(a: np.ndarray, requires_grad: bool = False) -> dict[str, Any]:
    return {"data": a.tolist(), "dtype": str(a.dtype), "requires_grad": requires_grad}


def mlp_inputs(batch: int = 16, features: int = 6) -> dict[str, np.ndarray]:
    return {
        "X": RNG.standard_normal((batch, features)),
        "Y": RNG.standard_normal((batch, 3)),
        "w1": RNG.standard_normal((features, 5)) / 2,
        "w2": RNG.standard_normal((5, 3)) / 2,
    }


def torch_reference(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    def loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
        return ((torch.tanh(x @ w1) @ w2 - y) ** 2).sum()

    t = {k: torch.tensor(v) for k, v in arrays.items()}
    per = torch.func.vmap(torch.func.grad(loss, (0, 1)), (None, None, 0, 0))
    g1, g2 = per(t["w1"], t["w2"], t["X"], t["Y"])
    losses = torch.func.vmap(loss, (None, None, 0, 0))(t["w1"], t["w2"], t["X"], t["Y"])
    norms = torch.sqrt((g1**2).sum((1, 2)) + (g2**2).sum((1, 2)))
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    return {
        "G1": g1.numpy(),
        "L": losses.numpy(),
        "S1": g1.sum(0).numpy(),
        "C1": (g1 * factor[:, None, None]).sum(0).numpy(),
    }


def request(arrays: dict[str, np.ndarray], outputs: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "graph": {"nodes": [PER_SAMPLE, *extra.pop("nodes", [])], "outputs": outputs},
        "inputs": {k: tensor(a, k in ("w1", "w2")) for k, a in arrays.items()},
        **extra,
    }


async def test_the_issues_per_sample_gradients(client: httpx.AsyncClient) -> None:
    arrays = mlp_inputs()
    r = await client.post("/forward", json=request(arrays, ["G1", "L", "S1", "C1"]))
    body = strict_json(r)
    want = torch_reference(arrays)
    for name, value in want.items():
        np.testing.assert_allclose(body["outputs"][name]["data"], value, rtol=1e-9, atol=1e-12)
    assert body["meta"]["vmap_chunks"] == {"ps": 16}
    assert body["meta"]["peak_bytes"] == body["meta"]["planned_peak_bytes"]
    # Its reductions add index after index: never lowered to XLA, which keeps no order.
    assert body["meta"]["tier_reason"] == INDEX_ORDERED


async def test_backward_through_a_clipped_sum(client: httpx.AsyncClient) -> None:
    """A DP-SGD step's loss of the clipped gradient, differentiated again: against
    torch.func."""
    arrays = mlp_inputs(batch=6)
    body = request(arrays, ["T"], nodes=[{"id": "T", "expr": "sum(C1 * C1) + sum(L)"}])
    out = strict_json(await client.post("/backward", json=body))
    leaves = {k: torch.tensor(arrays[k], requires_grad=True) for k in ("w1", "w2")}

    def loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
        return ((torch.tanh(x @ w1) @ w2 - y) ** 2).sum()

    x, y = torch.tensor(arrays["X"]), torch.tensor(arrays["Y"])
    g1, g2 = torch.func.vmap(torch.func.grad(loss, (0, 1)), (None, None, 0, 0))(
        leaves["w1"], leaves["w2"], x, y
    )
    norms = torch.sqrt((g1**2).sum((1, 2)) + (g2**2).sum((1, 2)))
    c1 = (g1 * (1.0 / (norms + 1e-6)).clamp(max=1.0)[:, None, None]).sum(0)
    losses = torch.func.vmap(loss, (None, None, 0, 0))(leaves["w1"], leaves["w2"], x, y)
    ((c1 * c1).sum() + losses.sum()).backward()
    for name, leaf in leaves.items():
        np.testing.assert_allclose(
            out["gradients"][name]["data"], leaf.grad.numpy(), rtol=1e-9, atol=1e-12
        )


async def test_a_budget_chunks_the_batch_and_plan_says_so(client: httpx.AsyncClient) -> None:
    arrays = mlp_inputs(batch=64, features=300)
    whole = request(arrays, ["S1", "C1"], no_grad=True)
    to_plan = {**request(arrays, ["S1", "C1"]), "path": "no_grad"}
    plan = strict_json(await client.post("/plan", json=to_plan))
    assert plan["vmap_chunks"] == {"ps": 64}
    budget = plan["planned_peak_bytes"] // 4
    chunked = {**whole, "memory_budget_bytes": budget}
    plan = strict_json(await client.post("/plan", json={**to_plan, "memory_budget_bytes": budget}))
    assert plan["admitted"] and plan["planned_peak_bytes"] <= budget
    assert 1 < plan["vmap_chunks"]["ps"] < 64
    a = strict_json(await client.post("/forward", json=whole))
    b = strict_json(await client.post("/forward", json=chunked))
    assert b["meta"]["vmap_chunks"] == plan["vmap_chunks"]
    assert b["meta"]["peak_bytes"] <= budget
    for name in ("S1", "C1"):
        assert a["outputs"][name]["data"] == b["outputs"][name]["data"]  # the same bits
    r = await client.post("/forward", json={**whole, "memory_budget_bytes": 2048})
    assert_problem(r, 422, "memory-budget", "one index at a time")


async def test_jacobian_and_hessian_in_expr(client: httpx.AsyncClient) -> None:
    x = RNG.standard_normal(5)
    m = RNG.standard_normal((3, 5))
    body = {
        "graph": {
            "nodes": [
                {"id": "y", "expr": "tanh(M @ x)"},
                {"id": "J", "expr": "jacobian(y, x)"},
                {"id": "Jf", "op": "jacobian", "args": ["y", "x"], "attrs": {"mode": "fwd"}},
                {"id": "H", "expr": "hessian(logsumexp(x, dim=0), x)"},
            ],
            "outputs": ["J", "Jf", "H"],
        },
        "inputs": {"x": tensor(x), "M": tensor(m)},
        "no_grad": True,
    }
    out = strict_json(await client.post("/forward", json=body))["outputs"]
    tm = torch.tensor(m)
    jac = torch.func.jacrev(lambda x: torch.tanh(tm @ x))(torch.tensor(x)).numpy()
    hess = torch.func.hessian(lambda x: torch.logsumexp(x, 0))(torch.tensor(x)).numpy()
    np.testing.assert_allclose(out["J"]["data"], jac, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out["Jf"]["data"], jac, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out["H"]["data"], hess, rtol=1e-12, atol=1e-14)


async def test_ops_lists_vmap_jacobian_and_hessian(client: httpx.AsyncClient) -> None:
    ops = {op["name"]: op for op in strict_json(await client.get("/ops"))["ops"]}
    assert ops["vmap"]["group"] == "transforms" and ops["vmap"]["variadic"]
    assert set(ops["vmap"]["fields"]) == {"body", "results"}
    assert set(ops["vmap"]["attrs"]) == {"in_axes", "chunk_size"}
    assert ops["jacobian"]["args"] == ["output", "input"]
    assert ops["jacobian"]["attrs"]["mode"]["default"] == "auto"
    assert ops["hessian"]["args"] == ["output", "input"] and ops["hessian"]["min_args"] == 2


def with_node(**changes: Any) -> dict[str, Any]:
    return {**PER_SAMPLE, **changes}


@pytest.mark.parametrize(
    ("node", "slug", "where", "text"),
    [
        (with_node(args=["X", "Z"]), "shape-mismatch", "ps", "every mapped size must agree"),
        (
            with_node(attrs={"in_axes": [0, 5]}),
            "attribute",
            "ps",
            "in_axes[1] is 5, but argument 1 has 2 dims",
        ),
        (
            with_node(body={"in": ["x", "y"], "nodes": [{"id": "l", "expr": "x @ nope"}]}),
            "graph",
            "l",
            "unknown reference 'nope'",
        ),
        (
            with_node(results={"R": {"of": "g9", "reduce": "sum"}}),
            "graph",
            "ps",
            "not a node or an input of the body",
        ),
        (with_node(args=["X"]), "arity", "ps", "one per name of body.in"),
    ],
)
async def test_bad_vmap_nodes(
    client: httpx.AsyncClient, node: dict[str, Any], slug: str, where: str, text: str
) -> None:
    arrays = {**mlp_inputs(batch=4), "Z": RNG.standard_normal((5, 3))}
    outputs = [next(iter(node["results"]))]
    r = await client.post(
        "/forward",
        json={
            "graph": {"nodes": [node], "outputs": outputs},
            "inputs": {k: tensor(a) for k, a in arrays.items()},
        },
    )
    problem = assert_problem(r, 422, slug, text)
    assert problem["node"] == where
    loc = problem["errors"][0]["loc"]
    assert loc[:3] == ["graph", "nodes", 0]
    if where == "l":  # inside the body: the location goes through it
        assert loc[3:6] == ["body", "nodes", 0] and "in the body of vmap 'ps'" in problem["detail"]


@pytest.mark.parametrize(
    ("node", "text"),
    [
        (with_node(body={"carry": ["x"], "next": {"x": "x"}}), "names its slices in 'in'"),
        (
            {**PER_SAMPLE, "op": "scan", "body": {"in": ["x"], "nodes": []}},
            "'carry' and 'next' ('in' is a vmap's)",
        ),
        (
            with_node(results={"R": {"of": "l", "reduce": "sum", "max_norm": 1.0}}),
            "'max_norm' belongs to",
        ),
        (with_node(results={"R": {"of": "l", "reduce": "clip_sum"}}), "'max_norm' belongs to"),
        (with_node(results={"R": {"of": "l", "reduce": "max"}}), "results"),
        (with_node(body={"in": ["x", "y"], "xs": ["x"], "nodes": []}), "'xs'"),
    ],
)
async def test_malformed_vmap_nodes_are_invalid_requests(
    client: httpx.AsyncClient, node: dict[str, Any], text: str
) -> None:
    r = await client.post(
        "/forward",
        json={"graph": {"nodes": [node], "outputs": ["R"]}, "inputs": {"X": [[1.0]]}},
    )
    problem = assert_problem(r, 422, "invalid-request")
    assert text in problem["detail"] or any(text in str(e) for e in problem["errors"])
