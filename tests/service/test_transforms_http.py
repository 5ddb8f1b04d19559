"""`grad`, `jvp` and `scan` over HTTP: each wire form as the issue fixes it, `GET /ops`,
and the problem each kind of bad node gets."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.support.problems import assert_problem, strict_json

pytestmark = pytest.mark.anyio

RNG = np.random.default_rng(4)


def tensor(a: np.ndarray, requires_grad: bool = False) -> dict[str, Any]:
    return {"data": a.tolist(), "dtype": str(a.dtype), "requires_grad": requires_grad}


RNN = {
    "id": "rnn",
    "op": "scan",
    "args": ["h0", "xs"],
    "body": {
        "carry": ["h"],
        "xs": ["x"],
        "nodes": [{"id": "h2", "expr": "tanh(x @ w + h @ u + b)"}],
        "next": {"h": "h2"},
    },
    "results": {"h_last": "h", "hs": "h2"},
    "attrs": {"length": None},
}


def rnn_inputs(steps: int = 5) -> dict[str, np.ndarray]:
    return {
        "xs": RNG.standard_normal((steps, 2, 3)),
        "w": RNG.standard_normal((3, 4)),
        "u": RNG.standard_normal((4, 4)) * 0.5,
        "b": RNG.standard_normal(4),
        "h0": RNG.standard_normal((2, 4)),
    }


async def test_scan_wire_form_forward_and_backward(client: httpx.AsyncClient) -> None:
    arrays = rnn_inputs()
    body = {
        "graph": {
            "nodes": [RNN, {"id": "loss", "expr": "sum(hs * hs) + sum(h_last)"}],
            "outputs": ["loss", "hs"],
        },
        "inputs": {k: tensor(a, k in ("w", "u")) for k, a in arrays.items()},
        "grad_outputs": {"hs": tensor(np.zeros((5, 2, 4)))},
    }
    r = await client.post("/backward", json=body)
    assert r.status_code == 200, r.text
    out = strict_json(r)
    t = {k: torch.tensor(a, requires_grad=k in ("w", "u")) for k, a in arrays.items()}
    h, hs = t["h0"], []
    for x in t["xs"]:
        h = torch.tanh(x @ t["w"] + h @ t["u"] + t["b"])
        hs.append(h)
    loss = (torch.stack(hs) ** 2).sum() + h.sum()
    gw, gu = torch.autograd.grad(loss, [t["w"], t["u"]])
    np.testing.assert_allclose(out["outputs"]["loss"]["data"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(
        out["outputs"]["hs"]["data"], torch.stack(hs).detach().numpy(), rtol=1e-12
    )
    assert out["outputs"]["hs"]["grad_fn"] == "StackBackward"
    np.testing.assert_allclose(out["gradients"]["w"]["data"], gw.numpy(), rtol=1e-10)
    np.testing.assert_allclose(out["gradients"]["u"]["data"], gu.numpy(), rtol=1e-10)
    assert out["meta"]["peak_bytes"] == out["meta"]["planned_peak_bytes"]


async def test_grad_and_jvp_wire_forms(client: httpx.AsyncClient) -> None:
    w, v = RNG.standard_normal(3), RNG.standard_normal(3)
    nodes = [
        {"id": "loss", "expr": "sum(exp(w) * w)"},
        {"id": "g", "op": "grad", "args": ["loss", "w"]},
        {"id": "hv", "expr": "grad(sum(g * v), w)"},
        {"id": "jv", "op": "jvp", "args": ["g", "w", "v"]},
        {"id": "vjp", "expr": "grad(g, w, v)"},
    ]
    r = await client.post(
        "/forward",
        json={
            "graph": {"nodes": nodes, "outputs": ["g", "hv", "jv", "vjp"]},
            "inputs": {"w": tensor(w, True), "v": tensor(v)},
            "no_grad": True,
        },
    )
    assert r.status_code == 200, r.text
    out = strict_json(r)["outputs"]
    hessian_diag = np.exp(w) * (w + 2)  # d²/dw² of exp(w)·w, elementwise
    np.testing.assert_allclose(out["g"]["data"], np.exp(w) * (w + 1), rtol=1e-12)
    for name in ("hv", "jv", "vjp"):  # a diagonal Hessian: all three are H v
        np.testing.assert_allclose(out[name]["data"], hessian_diag * v, rtol=1e-12)


async def test_ops_lists_the_node_kinds(client: httpx.AsyncClient) -> None:
    ops = {op["name"]: op for op in strict_json(await client.get("/ops"))["ops"]}
    assert ops["grad"]["args"] == ["target", "wrt", "grad_output"]
    assert ops["grad"]["min_args"] == 2
    assert ops["jvp"]["args"] == ["output", "input", "tangent"]
    assert ops["scan"]["args"] == ["carries...", "xs..."] and ops["scan"]["variadic"]
    assert set(ops["scan"]["fields"]) == {"body", "results"}
    assert ops["scan"]["attrs"]["length"]["required"] is False
    spec = strict_json(await client.get("/openapi.json"))
    node = spec["components"]["schemas"]["Node"]["properties"]
    assert "body" in node and "results" in node


@pytest.mark.parametrize(
    ("nodes", "slug", "node", "text"),
    [
        ([{"id": "g", "op": "grad", "args": ["w"]}], "arity", "g", "takes 2 or 3 arguments"),
        ([{"id": "g", "op": "jvp", "args": ["w", "w"]}], "arity", "g", "takes 3 arguments"),
        ([{"id": "g", "expr": "grad(w * 2, w)"}], "backward", "g", "one-element target"),
        ([{"id": "g", "expr": "grad(sum(w), n)"}], "dtype-mismatch", "g", "floating point"),
        ([{"id": "g", "expr": "jvp(w * 2, w, n)"}], "dtype-mismatch", "g", "tangent has dtype"),
        (
            [{**RNN, "body": {**RNN["body"], "nodes": [{"id": "h2", "expr": "sum(h, dim=1)"}]}}],
            "shape-mismatch",
            "h2",
            "the carry 'h' is (2, 4) float64 but its next value is (2,)",
        ),
        (
            [{**RNN, "body": {**RNN["body"], "nodes": [{"id": "h2", "expr": "tanh(x @ nope)"}]}}],
            "graph",
            "h2",
            "unknown reference 'nope'",
        ),
        ([RNN, {"id": "y", "expr": "rnn + 1"}], "graph", "y", "'rnn' is a scan node, not a value"),
        ([{**RNN, "args": ["h0"]}], "arity", "rnn", "takes 2 arguments"),
    ],
)
async def test_bad_transform_nodes(
    client: httpx.AsyncClient, nodes: list[dict[str, Any]], slug: str, node: str, text: str
) -> None:
    arrays = {**rnn_inputs(), "n": np.arange(16).reshape(4, 4)}
    outputs = ["hs" if nodes[-1].get("op") == "scan" else nodes[-1]["id"]]
    r = await client.post(
        "/forward",
        json={
            "graph": {"nodes": nodes, "outputs": outputs},
            "inputs": {k: tensor(a) for k, a in arrays.items()} | {"w": tensor(arrays["u"])},
        },
    )
    problem = assert_problem(r, 422, slug, text)
    assert problem["node"] == node
    loc = problem["errors"][0]["loc"]
    assert loc[:3] == ["graph", "nodes", len(nodes) - 1]
    if node == "h2":  # inside the scan's body: the location goes through it
        assert loc[3] == "body" and "in the body of scan 'rnn'" in problem["detail"]


async def test_body_and_results_belong_to_scan(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/forward",
        json={
            "graph": {
                "nodes": [{"id": "y", "op": "neg", "args": ["w"], "body": RNN["body"]}],
                "outputs": ["y"],
            },
            "inputs": {"w": 1.0},
        },
    )
    assert_problem(r, 422, "invalid-request", "'body' belongs to")


def readme_examples() -> list[dict[str, Any]]:
    """The request bodies of the docs' page on these nodes, in order."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "transforms.md").read_text()
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]


async def test_readme_examples_compute_what_they_say(client: httpx.AsyncClient) -> None:
    hvp, newton, jacobian, scan, unrolled, *_ = readme_examples()
    out = strict_json(await client.post("/forward", json=hvp))["outputs"]
    w, x, v = (torch.tensor(hvp["inputs"][k], requires_grad=k == "w") for k in "wxv")
    (g,) = torch.autograd.grad((torch.exp(w) * x).sum() + (w**3).sum() / 3, w, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), w)
    np.testing.assert_allclose(out["hv"]["data"], hv.numpy(), rtol=1e-6)

    out = strict_json(await client.post("/forward", json=newton))["outputs"]
    a, b, w0 = (np.array(newton["inputs"][k], dtype=np.float64) for k in ("A", "b", "w"))
    grad = a.T @ (a @ w0 - b) + w0**3
    hessian = a.T @ a + np.diag(3 * w0**2)
    np.testing.assert_allclose(
        out["w_next"]["data"], w0 - np.linalg.solve(hessian, grad), rtol=1e-5
    )

    out = strict_json(await client.post("/forward", json=jacobian))["outputs"]
    m = torch.tensor(jacobian["inputs"]["M"])
    expected = torch.func.jacfwd(lambda x: torch.tanh(m @ x) * x.sum())(
        torch.tensor(jacobian["inputs"]["x"])
    )
    np.testing.assert_allclose(out["J"]["data"], expected.numpy(), rtol=1e-5, atol=1e-7)

    looped = strict_json(await client.post("/backward", json=scan))
    flat = strict_json(await client.post("/backward", json=unrolled))
    np.testing.assert_allclose(
        looped["outputs"]["loss"]["data"], flat["outputs"]["loss"]["data"], rtol=1e-6
    )
    assert set(looped["gradients"]) == set(flat["gradients"]) == {"w", "u"}
    for name in ("w", "u"):
        np.testing.assert_allclose(
            looped["gradients"][name]["data"], flat["gradients"][name]["data"], rtol=1e-5
        )
