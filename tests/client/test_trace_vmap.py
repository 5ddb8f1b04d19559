"""The tracer's `vmap`, `jacobian` (`jacrev`, `jacfwd`) and `hessian`, spelt as torch.func
spells them: the nodes they write, and their values against torch.func once the graph is
compiled and run as the server would."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.func

import gradserve as gs
from gradserve.client.trace import F, TraceError, trace
from gradserve.engine.graph import TensorSpec, compile_graph, execute
from gradserve.engine.graph.spec import RunResult
from gradserve.service.schemas import Graph

RNG = np.random.default_rng(30)


def specs_of(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: (a.shape, str(a.dtype)) for k, a in arrays.items()}


def compile_run(graph: dict[str, Any], arrays: dict[str, np.ndarray]) -> RunResult:
    """The graph JSON parsed as the server parses it, compiled and run in process."""
    specs = {k: TensorSpec(a.shape, str(a.dtype)) for k, a in arrays.items()}
    program = compile_graph(Graph.model_validate(graph), specs, no_grad=True)
    return execute(program, dict(arrays), verify=True)


def mlp_arrays(batch: int = 6) -> dict[str, np.ndarray]:
    return {
        "X": RNG.standard_normal((batch, 4)),
        "Y": RNG.standard_normal((batch, 3)),
        "w1": RNG.standard_normal((4, 5)) / 2,
        "w2": RNG.standard_normal((5, 3)) / 2,
    }


def per_sample_gradients(X: Any, Y: Any, w1: Any, w2: Any) -> Any:
    def loss_and_grads(x: Any, y: Any) -> Any:
        loss = ((F.tanh(x @ w1) @ w2 - y) ** 2).sum()
        g1, g2 = gs.grad(loss, [w1, w2])
        return loss, g1, g2

    losses, g1s, g2s = gs.vmap(loss_and_grads)(X, Y)
    return {"losses": losses, "g1s": g1s, "g2s": g2s}


def torch_loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
    return ((torch.tanh(x @ w1) @ w2 - y) ** 2).sum()


def test_vmap_of_grad_is_torch_func_per_sample_gradients() -> None:
    arrays = mlp_arrays()
    graph = trace(per_sample_gradients, **specs_of(arrays))
    (node,) = [n for n in graph["nodes"] if n.get("op") == "vmap"]
    assert node["id"] == "loss_and_grads" and node["args"] == ["X", "Y"]
    assert node["body"]["in"] == ["x", "y"]
    assert node["attrs"] == {"in_axes": [0, 0], "chunk_size": None}
    assert set(node["results"]) == {"losses", "g1s", "g2s"}
    result = compile_run(graph, arrays)
    t = {k: torch.tensor(v) for k, v in arrays.items()}
    per = torch.func.vmap(torch.func.grad(torch_loss, (0, 1)), (None, None, 0, 0))
    g1, g2 = per(t["w1"], t["w2"], t["X"], t["Y"])
    losses = torch.func.vmap(torch_loss, (None, None, 0, 0))(t["w1"], t["w2"], t["X"], t["Y"])
    np.testing.assert_allclose(result.outputs["g1s"], g1.numpy(), rtol=1e-10)
    np.testing.assert_allclose(result.outputs["g2s"], g2.numpy(), rtol=1e-10)
    np.testing.assert_allclose(result.outputs["losses"], losses.numpy(), rtol=1e-12)


def test_in_axes_in_dims_chunks_nesting_and_shapes() -> None:
    arrays = {"A": RNG.standard_normal((3, 4)), "B": RNG.standard_normal((4, 5))}

    def pairwise(A: Any, B: Any) -> Any:
        def row(a: Any) -> Any:
            def one(b: Any) -> Any:
                return ((a - b) ** 2).sum()

            return gs.vmap(one, in_dims=1)(B)

        d = gs.vmap(row, chunk_size=2)(A)
        assert d.shape == (3, 5) and d.dtype == "float64"  # (shapes known at trace time)
        return {"d": d}

    graph = trace(pairwise, **specs_of(arrays))
    outer = next(n for n in graph["nodes"] if n.get("op") == "vmap")
    assert outer["attrs"] == {"in_axes": [0], "chunk_size": 2}
    inner = next(n for n in outer["body"]["nodes"] if n.get("op") == "vmap")
    assert inner["attrs"]["in_axes"] == [1]
    result = compile_run(graph, arrays)
    A, Bm = arrays["A"], arrays["B"]
    np.testing.assert_allclose(
        result.outputs["d"], ((A[:, None, :] - Bm.T[None]) ** 2).sum(-1), rtol=1e-12
    )


def test_jacobian_jacrev_jacfwd_and_hessian() -> None:
    arrays = {"x": RNG.standard_normal(4), "M": RNG.standard_normal((3, 4))}

    def derivatives(x: Any, M: Any) -> Any:
        y = F.tanh(M @ x)
        return {
            "J": gs.jacobian(y, x),
            "Jf": gs.jacobian(y, x, mode="fwd"),
            "Jr": gs.jacrev(lambda x: F.tanh(M @ x))(x),
            "Jw": gs.jacfwd(lambda M, x: F.tanh(M @ x))(M, x),
            "H": gs.hessian((y * y).sum(), x),
            "Hf": gs.hessian(lambda x: F.logsumexp(x, dim=0))(x),
        }

    graph = trace(derivatives, **specs_of(arrays))
    exprs = {n["id"]: n.get("expr", "") for n in graph["nodes"]}
    assert exprs["Jf"].startswith("jacobian(") and 'mode="fwd"' in exprs["Jf"]
    result = compile_run(graph, arrays)
    x, m = torch.tensor(arrays["x"]), torch.tensor(arrays["M"])
    jac = torch.func.jacrev(lambda x: torch.tanh(m @ x))(x).numpy()
    for name in ("J", "Jf", "Jr"):
        np.testing.assert_allclose(result.outputs[name], jac, rtol=1e-12, atol=1e-14)
    jw = torch.func.jacfwd(lambda m: torch.tanh(m @ x))(m).numpy()
    np.testing.assert_allclose(result.outputs["Jw"], jw, rtol=1e-12, atol=1e-14)
    h = torch.func.hessian(lambda x: (torch.tanh(m @ x) ** 2).sum())(x).numpy()
    np.testing.assert_allclose(result.outputs["H"], h, rtol=1e-12, atol=1e-14)
    hf = torch.func.hessian(lambda x: torch.logsumexp(x, 0))(x).numpy()
    np.testing.assert_allclose(result.outputs["Hf"], hf, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("fn", "error", "text"),
    [
        (lambda X, Y: gs.vmap(lambda x, y: x + y)(X, Y[:2]), TraceError, "argument 0 has 6"),
        (lambda X, Y: gs.vmap(lambda x: x, in_axes=2)(X), TraceError, "in_axes 2"),
        (lambda X, Y: gs.vmap(lambda x, y: x, in_axes=[0])(X, Y), TraceError, "1 in_axes"),
        (lambda X, Y: gs.jacobian(X, Y, mode="up"), ValueError, "mode must be"),
    ],
)
def test_trace_errors(fn: Any, error: type[Exception], text: str) -> None:
    arrays = mlp_arrays()
    with pytest.raises(error, match=text):
        trace(lambda X, Y: {"out": fn(X, Y)}, X=arrays["X"], Y=arrays["Y"])
