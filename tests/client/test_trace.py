"""Graphs traced from Python (client/trace.py): every catalog op against PyTorch, the 10
objectives of tests/engine/test_objectives.py as Python functions against their hand-written
graphs, grad/jvp/scan against hand-written nodes, readable ids and exprs, what needs data,
a catalog that differs, and traced functions sent through the client to a real server."""

from __future__ import annotations

import ast
import asyncio
import functools
import math
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from gradserve.client.trace import (
    Catalog,
    F,
    Functional,
    TracedTensor,
    TraceError,
    grad,
    jvp,
    scan,
    trace,
)
from gradserve.engine.graph import NodeSpec, TensorSpec, compile_graph, execute
from gradserve.engine.graph.spec import RunResult
from gradserve.service.routes.catalog import _ops_body
from gradserve.service.schemas import Graph
from tests.support.objectives import OBJECTIVES
from tests.support.objectives import objective_data as objective_data
from tests.support.op_samples import TORCH, Sample
from tests.support.ops import is_float_array, op_cases, torch_args

torch = pytest.importorskip("torch")
CATALOG: list[dict[str, Any]] = orjson.loads(_ops_body())["ops"]  # GET /ops, as served
ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(11)


def compile_run(
    graph: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    wrt: tuple[str, ...] | list[str] = (),
    backward: bool = False,
) -> RunResult:
    """The graph JSON parsed as the server parses it, compiled and run in-process."""
    spec = Graph.model_validate(graph)
    specs = {k: TensorSpec(a.shape, str(a.dtype), k in wrt) for k, a in arrays.items()}
    program = compile_graph(spec, specs, backward=backward, no_grad=not backward and not wrt)
    return execute(program, dict(arrays), verify=True)


def specs_of(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {k: (a.shape, str(a.dtype)) for k, a in arrays.items()}


# ------------------------------------------------------------------ every op
def _op_inputs(sample: Sample) -> dict[str, np.ndarray]:
    return {
        f"a{i}": a.astype("float64") if is_float_array(a) else a
        for i, a in enumerate(sample.args)
        if isinstance(a, np.ndarray)
    }


def _call_forms(name: str, sample: Sample) -> dict[str, Callable[..., Any]]:
    """The op called as a function with keyword attributes, with positional ones (PyTorch's
    order), and as a method of its `self` tensor."""
    op = Catalog(CATALOG).ops[name]

    def args_of(inputs: Mapping[str, TracedTensor]) -> list[Any]:
        return [inputs.get(f"a{i}", a) for i, a in enumerate(sample.args)]

    def keywords(**inputs: TracedTensor) -> Any:
        return getattr(F, name)(*args_of(inputs), **sample.attrs)

    forms = {"keywords": keywords}
    if not op.variadic:

        def positional(**inputs: TracedTensor) -> Any:
            given = dict(zip(op.args, args_of(inputs), strict=True))
            given.update(sample.attrs)
            args = []
            for slot in op.order:
                if slot not in given:
                    break
                args.append(given.pop(slot))
            return getattr(F, name)(*args, **given)

        forms["positional"] = positional
        self_index = op.args.index(op.self_arg) if op.args else -1
        if self_index >= 0 and isinstance(sample.args[self_index], np.ndarray):

            def method(**inputs: TracedTensor) -> Any:
                args = args_of(inputs)
                this = args.pop(self_index)
                return getattr(this, name)(*args, **sample.attrs)

            forms["method"] = method
    return forms


@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_every_op_traced_matches_torch(name: str, sample: Sample) -> None:
    arrays = _op_inputs(sample)
    forms = _call_forms(name, sample)
    seen: list[TracedTensor] = []

    def fn(**inputs: TracedTensor) -> Any:
        out = forms["keywords"](**inputs)
        seen.append(out)
        return out

    graph = trace(fn, CATALOG, **specs_of(arrays))
    for form, other in forms.items():  # PyTorch's other spellings give the same graph
        assert trace(other, CATALOG, **specs_of(arrays)) == graph, form
    result = compile_run(graph, arrays)
    ours = np.asarray(result.outputs["out"])
    (traced,) = seen
    assert (traced.shape, traced.dtype) == (ours.shape, str(ours.dtype))  # the static rules
    ref = TORCH[name](torch, *torch_args(name, sample, "float64", False), **sample.attrs)
    expected = ref.detach().numpy()
    assert ours.shape == expected.shape
    assert str(ours.dtype) == str(ref.dtype).removeprefix("torch.")
    tol = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-10}.get(str(ours.dtype), 0)
    np.testing.assert_allclose(ours, expected, rtol=tol, atol=tol, equal_nan=True)


def test_every_catalog_op_has_a_function_and_its_methods() -> None:
    catalog = Catalog(CATALOG)
    names = set(dir(Functional(CATALOG)))
    assert set(catalog.ops) | {"grad", "jvp", "scan"} <= names

    def fn(x: TracedTensor) -> TracedTensor:
        for name, op in catalog.ops.items():
            assert callable(getattr(F, name))
            if op.args and not op.variadic:
                assert callable(getattr(x, name)), name
        return x

    trace(fn, CATALOG, x=((2, 2), "float32"))


# ------------------------------------------------------------------ the 10 objectives
def least_squares(X: Any, w: Any, b: Any, y: Any, **_: Any) -> Any:
    return {"loss": ((X @ w + b - y) ** 2).mean()}


def logistic_regression_l2(X: Any, w: Any, b: Any, y: Any, **_: Any) -> Any:
    margin = -y * (X @ w + b)
    return {"loss": F.softplus(margin).mean() + 0.01 * (w * w).sum()}


def mlp_cross_entropy(X: Any, W1: Any, b1: Any, W2: Any, onehot: Any, **_: Any) -> Any:
    h = F.relu(X @ W1 + b1)
    logits = h @ W2
    return {"loss": -(onehot * F.log_softmax(logits, dim=1)).sum(dim=1).mean()}


def nll_by_gather(X: Any, W1: Any, W2: Any, labels: Any, **_: Any) -> Any:
    logp = F.log_softmax(F.tanh(X @ W1) @ W2, dim=-1)
    picked = logp.gather(1, labels)
    return {"loss": -picked.mean()}


def attention(Q: Any, K: Any, V: Any, **_: Any) -> Any:
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    out = F.softmax(scores, dim=-1) @ V
    return {"loss": (out * out).sum()}


def layer_norm(X: Any, gamma: Any, beta: Any, **_: Any) -> Any:
    mu = X.mean(dim=-1, keepdim=True)
    var = X.var(dim=-1, keepdim=True, correction=0)
    n = (X - mu) / (var + 1e-5).sqrt() * gamma + beta
    return {"loss": (n**3).sum()}


def logsumexp_softmax_margin(X: Any, W1: Any, **_: Any) -> Any:
    s = X @ W1
    return {"loss": (s.logsumexp(dim=1) - s.max(dim=1)).mean()}


def linear_system(A: Any, t: Any, **_: Any) -> Any:
    x = F.solve(A, t)
    return {"loss": (x * x).sum() + F.log(abs(F.det(A))) + (A.inverse() * A).sum()}


def huber_with_where_and_clamp(X: Any, w: Any, **_: Any) -> Any:
    r = X @ w - 0.5
    huber = F.where(r.abs() < 1.0, 0.5 * r**2, r.abs() - 0.5)
    return {"loss": huber.mean() + (w.clamp(-0.2, 0.2) ** 2).sum()}


def einsum_bilinear(X: Any, W1: Any, **_: Any) -> Any:
    return {"loss": (F.einsum("bi,ij,bj->b", X, W1 @ W1.T, X) ** 2).sum() / 100.0}


PYTHON_OBJECTIVES: dict[str, Callable[..., Any]] = {
    "least-squares": least_squares,
    "logistic-regression-l2": logistic_regression_l2,
    "mlp-cross-entropy": mlp_cross_entropy,
    "nll-by-gather": nll_by_gather,
    "attention": attention,
    "layer-norm": layer_norm,
    "logsumexp-softmax-margin": logsumexp_softmax_margin,
    "linear-system": linear_system,
    "huber-with-where-and-clamp": huber_with_where_and_clamp,
    "einsum-bilinear": einsum_bilinear,
}
# Where the Python reads differently from the hand-written graph (same math).
EXPECTED_DIFFERENCES = {
    "huber-with-where-and-clamp": {
        "loss": "mean(huber) + sum(clamp(w, min=-0.2, max=0.2) ** 2)",
        "huber": "where(abs(r) < 1.0, 0.5 * r ** 2, abs(r) - 0.5)",
    },
    "linear-system": {"loss": "sum(x * x) + log(abs(det(A))) + sum(inv(A) * A)"},
}


def node_text(node: Mapping[str, Any] | NodeSpec) -> tuple[str, str]:
    """(id, what it computes as expr text): an op-form node written as its call."""
    if isinstance(node, NodeSpec):
        node = {
            "id": node.id,
            "op": node.op,
            "args": list(node.args),
            "attrs": dict(node.attrs),
            "expr": node.expr,
        }
    if node.get("expr"):
        return node["id"], node["expr"]
    parts = [*map(str, node["args"]), *(f"{k}={v!r}" for k, v in (node.get("attrs") or {}).items())]
    return node["id"], f"{node['op']}({', '.join(parts)})"


def same_math(text: str) -> str:
    """An expr's syntax tree: the same for `1e-5` and `1e-05`, or spare parentheses."""
    return ast.dump(ast.parse(text, mode="eval"))


def test_objectives_are_all_here() -> None:
    assert set(PYTHON_OBJECTIVES) == set(OBJECTIVES)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_traced_equals_the_hand_written_graph(name: str) -> None:
    nodes, output, wrt, reference = OBJECTIVES[name]
    data = objective_data()
    graph = trace(PYTHON_OBJECTIVES[name], CATALOG, **specs_of(data))
    # Structure: the same ids, one node per line of math, the same expressions.
    ours = dict(node_text(n) for n in graph["nodes"])
    theirs = dict(node_text(n) for n in nodes)
    theirs.update(EXPECTED_DIFFERENCES.get(name, {}))
    assert graph["outputs"] == [output]
    assert {k: same_math(v) for k, v in ours.items()} == {
        k: same_math(v) for k, v in theirs.items()
    }, (ours, theirs)
    # Values and gradients: the same as the hand-written graph's, and PyTorch's.
    hand = compile_run(
        {
            "nodes": [{k: v for k, v in vars(n).items() if v not in (None, (), {})} for n in nodes],
            "outputs": [output],
        },
        data,
        wrt=wrt,
        backward=True,
    )
    traced = compile_run(graph, data, wrt=wrt, backward=True)
    np.testing.assert_allclose(traced.outputs[output], hand.outputs[output], rtol=1e-13)
    assert traced.gradients is not None and hand.gradients is not None
    for k in wrt:
        np.testing.assert_allclose(
            traced.gradients[k], hand.gradients[k], rtol=1e-12, atol=1e-14, err_msg=k
        )
    ref_in = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in data.items()}
    ref = reference(ref_in)
    ref.backward()
    np.testing.assert_allclose(traced.outputs[output], ref.detach().numpy(), rtol=1e-9)
    for k in wrt:
        np.testing.assert_allclose(
            traced.gradients[k], ref_in[k].grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=k
        )


# ------------------------------------------------------------------ grad, jvp, scan
def hvp(w: Any, x: Any, v: Any) -> Any:
    loss = (F.exp(w) * x).sum() + (w * w * w).sum() / 3
    g = grad(loss, w)
    hv = grad((g * v).sum(), w)
    return {"g": g, "hv": hv}


HVP_GRAPH = {
    "nodes": [
        {"id": "loss", "expr": "sum(exp(w) * x) + sum(w * w * w) / 3"},
        {"id": "g", "expr": "grad(loss, w)"},
        {"id": "hv", "expr": "grad(sum(g * v), w)"},
    ],
    "outputs": ["g", "hv"],
}
HVP_INPUTS = {
    "w": np.array([0.5, -1.0, 2.0]),
    "x": np.array([1.0, 2.0, 3.0]),
    "v": np.array([1.0, 0.0, -1.0]),
}


def newton(A: Any, b: Any, w: Any, e0: Any, e1: Any) -> Any:
    loss = ((A @ w - b) ** 2).sum() / 2 + (w**4).sum() / 4
    g = grad(loss, w)
    H = F.stack([grad(g, w, e0), grad(g, w, e1)])
    return {"w_next": w - F.solve(H, g)}


NEWTON_GRAPH = {
    "nodes": [
        {"id": "loss", "expr": "sum((A @ w - b) ** 2) / 2 + sum(w ** 4) / 4"},
        {"id": "g", "expr": "grad(loss, w)"},
        {"id": "H", "op": "stack", "args": ["h0", "h1"]},
        {"id": "h0", "expr": "grad(g, w, e0)"},
        {"id": "h1", "expr": "grad(g, w, e1)"},
        {"id": "w_next", "expr": "w - solve(H, g)"},
    ],
    "outputs": ["w_next"],
}
NEWTON_INPUTS = {
    "A": np.array([[2.0, 1.0], [1.0, 3.0], [0.0, 1.0]]),
    "b": np.array([1.0, 2.0, 3.0]),
    "w": np.array([0.5, -0.5]),
    "e0": np.array([1.0, 0.0]),
    "e1": np.array([0.0, 1.0]),
}


def jacobian(M: Any, x: Any, e0: Any, e1: Any) -> Any:
    y = F.tanh(M @ x) * x.sum()
    return {"J": F.stack([jvp(y, x, e0), jvp(y, x, e1)], dim=1)}


JACOBIAN_GRAPH = {
    "nodes": [
        {"id": "y", "expr": "tanh(M @ x) * sum(x)"},
        {"id": "J", "op": "stack", "args": ["c0", "c1"], "attrs": {"dim": 1}},
        {"id": "c0", "expr": "jvp(y, x, e0)"},
        {"id": "c1", "expr": "jvp(y, x, e1)"},
    ],
    "outputs": ["J"],
}
JACOBIAN_INPUTS = {
    "M": np.array([[1.0, 2.0], [0.5, -1.0], [0.0, 3.0]]),
    "x": np.array([0.3, -0.2]),
    "e0": np.array([1.0, 0.0]),
    "e1": np.array([0.0, 1.0]),
}


def rnn(h0: Any, xs: Any, w: Any, u: Any, b: Any) -> Any:
    def cell(h: Any, x: Any) -> Any:
        h2 = F.tanh(x @ w + h @ u + b)
        return h2, h2

    h_last, hs = scan(cell, h0, xs)
    return {"loss": (h_last * h_last).sum() + hs.sum() / 10}


def rnn_unrolled(h0: Any, xs: Any, w: Any, u: Any, b: Any) -> Any:
    h, hs = h0, []
    for x in xs:
        h = F.tanh(x @ w + h @ u + b)
        hs.append(h)
    return {"loss": (h * h).sum() + F.stack(hs).sum() / 10}


RNN_GRAPH = {
    "nodes": [
        {
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
        },
        {"id": "loss", "expr": "sum(h_last * h_last) + sum(hs) / 10"},
    ],
    "outputs": ["loss"],
}
RNN_INPUTS = {
    "xs": np.array([[[1.0, 0.5]], [[0.0, -1.0]], [[2.0, 0.1]]]),
    "h0": np.array([[0.0, 0.0]]),
    "w": np.array([[0.5, -0.2], [0.1, 0.4]]),
    "u": np.array([[0.3, 0.0], [-0.1, 0.2]]),
    "b": np.array([0.1, -0.1]),
}

TRANSFORM_CASES = {
    "hvp": (hvp, HVP_GRAPH, HVP_INPUTS, ()),
    "newton": (newton, NEWTON_GRAPH, NEWTON_INPUTS, ()),
    "jacobian": (jacobian, JACOBIAN_GRAPH, JACOBIAN_INPUTS, ()),
    "rnn": (rnn, RNN_GRAPH, RNN_INPUTS, ("w", "u")),
    "rnn-unrolled": (rnn_unrolled, RNN_GRAPH, RNN_INPUTS, ("w", "u")),
}


@pytest.mark.parametrize("name", sorted(TRANSFORM_CASES))
def test_helpers_match_the_hand_written_nodes(name: str) -> None:
    fn, hand, inputs, wrt = TRANSFORM_CASES[name]
    graph = trace(fn, CATALOG, **inputs)
    backward = bool(wrt)
    ours = compile_run(graph, inputs, wrt=wrt, backward=backward)
    theirs = compile_run(hand, inputs, wrt=wrt, backward=backward)
    assert graph["outputs"] == hand["outputs"]
    for k in hand["outputs"]:
        np.testing.assert_allclose(ours.outputs[k], theirs.outputs[k], rtol=1e-12, err_msg=k)
    for k in wrt:
        np.testing.assert_allclose(ours.gradients[k], theirs.gradients[k], rtol=1e-12)  # type: ignore[index]


def test_helpers_write_the_nodes_a_person_would() -> None:
    assert trace(hvp, CATALOG, **HVP_INPUTS) == HVP_GRAPH
    graph = trace(newton, CATALOG, **NEWTON_INPUTS)
    assert [node_text(n) for n in graph["nodes"]] == [
        ("loss", "sum((A @ w - b) ** 2) / 2 + sum(w ** 4) / 4"),
        ("g", "grad(loss, w)"),
        ("H", "stack(grad(g, w, e0), grad(g, w, e1))"),
        ("w_next", "w - solve(H, g)"),
    ]
    graph = trace(jacobian, CATALOG, **JACOBIAN_INPUTS)
    assert [node_text(n) for n in graph["nodes"]] == [
        ("y", "tanh(M @ x) * sum(x)"),
        ("J", "stack(jvp(y, x, e0), jvp(y, x, e1), dim=1)"),
    ]
    graph = trace(rnn, CATALOG, **RNN_INPUTS)
    expected = orjson.loads(orjson.dumps(RNN_GRAPH))
    expected["nodes"][0]["id"] = "cell"  # the body function's name
    del expected["nodes"][0]["attrs"]  # the length is the sequences'
    assert graph == expected
    # The unrolled loop: one node per step, named after the variable a loop rebinds.
    graph = trace(rnn_unrolled, CATALOG, **RNN_INPUTS)
    assert [node_text(n) for n in graph["nodes"]] == [
        ("x", "squeeze(slice(xs, dim=0, stop=1), dim=0)"),
        ("h", "tanh(x @ w + h0 @ u + b)"),
        ("x_1", "squeeze(slice(xs, dim=0, start=1, stop=2), dim=0)"),
        ("h_1", "tanh(x_1 @ w + h @ u + b)"),
        ("x_2", "squeeze(slice(xs, dim=0, start=2, stop=3), dim=0)"),
        ("h_2", "tanh(x_2 @ w + h_1 @ u + b)"),
        ("loss", "sum(h_2 * h_2) + sum(stack(h, h_1, h_2)) / 10"),
    ]


def lstm_like(c0: Any, h0: Any, xs: Any, zs: Any, w: Any) -> Any:
    """Two carries, two sequences, two ys; a literal carry; a y that is a carry, one that
    is an outer value, one that is a number; an inner scan that closes over the outer
    body's carry; a grad inside the body."""

    def step(carry: Any, x: Any) -> Any:
        c, h, k = carry
        x_t, z_t = x
        pre = x_t @ w + h
        c2 = F.sigmoid(pre) * c + F.tanh(pre) * z_t
        h2 = F.tanh(c2)
        inner, _ = scan(lambda acc, _: (acc * 0.5 + h2.sum(), None), h.sum() * 0.0, length=2)
        slope = grad((h2 * h2).sum(), c2)
        return (c2, h2 + inner * 0.01, k + 1.0), (h2, c, w, 2.0, slope)

    (c_last, h_last, k_last), (hs, cs, ws, twos, slopes) = scan(step, (c0, h0, 0.0), (xs, zs))
    return {
        "loss": hs.sum() + cs.sum() + c_last.sum() * h_last.sum(),
        "steps": k_last,
        "ws": ws,
        "twos": twos,
        "slopes": slopes,
    }


def lstm_like_unrolled(c0: Any, h0: Any, xs: Any, zs: Any, w: Any) -> Any:
    c, h, k = c0, h0, 0.0
    hs, cs, slopes = [], [], []
    for x_t, z_t in zip(xs, zs, strict=True):
        pre = x_t @ w + h
        c2 = F.sigmoid(pre) * c + F.tanh(pre) * z_t
        h2 = F.tanh(c2)
        acc = h.sum() * 0.0
        for _ in range(2):
            acc = acc * 0.5 + h2.sum()
        hs.append(h2)
        cs.append(c)
        slopes.append(grad((h2 * h2).sum(), c2))
        c, h, k = c2, h2 + acc * 0.01, k + 1.0
    n = len(hs)
    return {
        "loss": F.stack(hs).sum() + F.stack(cs).sum() + c.sum() * h.sum(),
        "steps": F.full([], k, dtype="float32"),
        "ws": F.stack([w] * n),
        "twos": F.full([n], 2.0),
        "slopes": F.stack(slopes),
    }


def test_scan_structures_closures_nesting_and_grad_in_a_body() -> None:
    arrays = {
        "c0": RNG.standard_normal((2, 3)),
        "h0": RNG.standard_normal((2, 3)),
        "xs": RNG.standard_normal((4, 2, 3)),
        "zs": RNG.standard_normal((4, 2, 3)),
        "w": RNG.standard_normal((3, 3)),
    }
    graph = trace(lstm_like, CATALOG, **arrays)
    (loop,) = [n for n in graph["nodes"] if n.get("op") == "scan"]
    assert loop["id"] == "step" and loop["args"] == ["c0", "h0", 0.0, "xs", "zs"]
    assert loop["body"]["carry"] == ["c", "h", "k"] and loop["body"]["xs"] == ["x_t", "z_t"]
    # Results take the outputs' names first (`steps`), then the variables'.
    assert set(loop["results"]) == {"c_last", "h_last", "steps", "hs", "cs", "ws", "twos", "slopes"}
    assert "cs" not in [n["id"] for n in loop["body"]["nodes"]]
    (inner,) = [n for n in loop["body"]["nodes"] if n.get("op") == "scan"]
    assert inner["attrs"] == {"length": 2}
    loop_free = trace(lstm_like_unrolled, CATALOG, **arrays)
    ours, theirs = compile_run(graph, arrays), compile_run(loop_free, arrays)
    for k in graph["outputs"]:
        np.testing.assert_allclose(ours.outputs[k], theirs.outputs[k], rtol=1e-12, err_msg=k)
    ours = compile_run({**graph, "outputs": ["loss"]}, arrays, wrt=["w", "c0"], backward=True)
    theirs = compile_run({**loop_free, "outputs": ["loss"]}, arrays, wrt=["w", "c0"], backward=True)
    for k in ("w", "c0"):
        np.testing.assert_allclose(ours.gradients[k], theirs.gradients[k], rtol=1e-10)  # type: ignore[index]


def test_scan_without_sequences_and_gradient_descent_as_a_loop() -> None:
    arrays = {
        "w0": np.array([1.0, -2.0]),
        "A": np.array([[3.0, 1.0], [1.0, 2.0]]),
        "b": np.array([1.0, 1.0]),
    }

    def descend(w0: Any, A: Any, b: Any) -> Any:
        def step(w: Any, _: None) -> Any:
            loss = (w @ A @ w) / 2 - (b * w).sum()
            return w - 0.25 * grad(loss, w), loss

        w_final, losses = scan(step, w0, length=60)
        return {"w": w_final, "losses": losses}

    result = compile_run(trace(descend, CATALOG, **arrays), arrays)
    np.testing.assert_allclose(
        result.outputs["w"], np.linalg.solve(arrays["A"], arrays["b"]), atol=1e-3
    )
    assert result.outputs["losses"].shape == (60,)
    assert np.all(np.diff(result.outputs["losses"]) <= 1e-12)


def test_scan_errors() -> None:
    def length_missing(x: Any) -> Any:
        return scan(lambda c, _: (c, None), x)[0]

    def wrong_structure(x: Any) -> Any:
        return scan(lambda c, x: ((c, c), None), x, x)[0]

    def carry_changes(x: Any) -> Any:
        return scan(lambda c, _: (c.sum(), None), x, length=2)[0]

    def literal_carry_promoted(xs: Any) -> Any:
        return scan(lambda c, x: (c + x, None), 0.0, xs)[0]

    def leaked(xs: Any) -> Any:
        kept = []

        def body(c: Any, x: Any) -> Any:
            kept.append(c * 2)
            return c, None

        scan(body, xs[0], xs)
        return kept[0] + 1

    def returns_one_thing(xs: Any) -> Any:
        return scan(lambda c, x: c, xs[0], xs)

    for fn, match in [
        (length_missing, "length="),
        (wrong_structure, "structure"),
        (carry_changes, r"carry 0 is \(3,\) float64 .* \(\) float64"),
        (literal_carry_promoted, r"\(\) float32 .* \(\) float64.*cast"),
        (leaked, "inside a scan body is used outside"),
        (returns_one_thing, r"must return \(new_carry, y\)"),
    ]:
        with pytest.raises(TraceError, match=match):
            trace(
                fn, CATALOG, **{"xs" if "xs" in fn.__code__.co_varnames else "x": ((3,), "float64")}
            )


# ------------------------------------------------------------------ readable graphs
def test_ids_come_from_variables_outputs_from_keys() -> None:
    def helper(pred: Any, target: Any) -> Any:
        return ((pred - target) ** 2).mean()

    def fn(x: Any, w: Any, y: Any) -> Any:
        z = x @ w
        loss = helper(z + 1.0, y) + helper(z * 2, y)
        return {"loss": loss, "z": z, "again": z, "x": x, "x_too": x}

    graph = trace(fn, CATALOG, x=((3, 2), "float32"), w=((2,), "float32"), y=((3,), "float32"))
    assert graph == {
        "nodes": [
            {"id": "z", "expr": "x @ w"},
            {"id": "pred", "expr": "z + 1.0"},
            {"id": "pred_1", "expr": "z * 2"},
            {"id": "loss", "expr": "mean((pred - y) ** 2) + mean((pred_1 - y) ** 2)"},
            {"id": "again", "expr": "z"},
            {"id": "x_too", "expr": "x"},
        ],
        "outputs": ["loss", "z", "again", "x", "x_too"],
    }
    compile_run(
        graph,
        {
            "x": np.ones((3, 2), np.float32),
            "w": np.ones(2, np.float32),
            "y": np.zeros(3, np.float32),
        },
    )


def test_names_nearer_the_traced_function_win_and_other_tracers_still_run() -> None:
    def dense(x: Any, w: Any) -> Any:
        out = F.relu(x @ w)
        return out

    def fn(x: Any, w1: Any, w2: Any) -> Any:
        h1 = dense(x, w1)
        h2 = dense(h1, w2)
        return {"loss": dense(h2, w1).sum()}  # named by the helper: `out`

    events: list[str] = []

    def debugger(frame: Any, event: str, arg: Any) -> Any:
        events.append(event)
        return debugger

    before = sys.gettrace()
    sys.settrace(debugger)
    try:
        graph = trace(
            fn, CATALOG, x=((2, 3), "float32"), w1=((3, 3), "float32"), w2=((3, 3), "float32")
        )
    finally:
        sys.settrace(before)
    assert graph["nodes"] == [
        {"id": "h1", "expr": "relu(x @ w1)"},
        {"id": "h2", "expr": "relu(h1 @ w2)"},
        {"id": "out", "expr": "relu(h2 @ w1)"},
        {"id": "loss", "expr": "sum(out)"},
    ]
    assert "line" in events and "call" in events  # the debugger's trace function still ran


def test_unnamed_shared_values_tuples_and_one_output() -> None:
    def fn(x: Any) -> Any:
        return (F.exp(x) + 1) * (F.exp(x) + 1), x.sum()  # two exp: no variable, no sharing

    graph = trace(fn, CATALOG, x=((2,), "float32"))
    assert graph == {
        "nodes": [
            {"id": "out0", "expr": "(exp(x) + 1) * (exp(x) + 1)"},
            {"id": "out1", "expr": "sum(x)"},
        ],
        "outputs": ["out0", "out1"],
    }

    def shared(x: Any) -> Any:
        return F.exp(x + 1) * F.exp(x + 1).sum() * (x + 1)  # `x + 1` is not shared either

    graph = trace(shared, CATALOG, x=((2,), "float32"))
    assert graph["nodes"] == [{"id": "out", "expr": "exp(x + 1) * sum(exp(x + 1)) * (x + 1)"}]

    def reused(x: Any) -> Any:
        return [(lambda e: e * e.sum())(F.exp(x + 1))]  # one value used twice: a node

    graph = trace(reused, CATALOG, x=((2,), "float32"))
    assert graph["nodes"] == [
        {"id": "e", "expr": "exp(x + 1)"},
        {"id": "out0", "expr": "e * sum(e)"},
    ]


def test_operators_precedence_and_literals_round_trip() -> None:
    def fn(a: Any, b: Any) -> Any:
        return {
            "p": -(a**2) + (-a) ** 2 + a**-b + 2**a + (a**b) ** 2 + a**b**2,
            "q": (a - (b - a)) - (a + b) / (a * b) - a / (a / b) + -(-a) + a - -2.5,  # noqa: B002
            "r": F.where((a < b) == (b >= a), 1e-05, a @ b),
            "s": (a > 0.5) != (b <= 1),
        }

    a, b = np.array([0.7, 1.3]), np.array([1.1, 0.4])
    graph = trace(fn, CATALOG, a=a, b=b)
    assert dict(node_text(n) for n in graph["nodes"]) == {
        "p": "-a ** 2 + (-a) ** 2 + a ** -b + 2 ** a + (a ** b) ** 2 + a ** b ** 2",
        "q": "a - (b - a) - (a + b) / (a * b) - a / (a / b) + -(-a) + a - -2.5",
        "r": "where((a < b) == (b >= a), 1e-05, a @ b)",
        "s": "(a > 0.5) != (b <= 1)",
    }
    ours = compile_run(graph, {"a": a, "b": b}).outputs
    assert np.allclose(ours["p"], -(a**2) + (-a) ** 2 + a**-b + 2**a + (a**b) ** 2 + a**b**2)
    assert np.allclose(ours["q"], (a - (b - a)) - (a + b) / (a * b) - a / (a / b) + a + a + 2.5)
    assert np.allclose(ours["r"], np.where((a < b) == (b >= a), 1e-05, a @ b))
    assert list(ours["s"]) == [True, False]


def test_pytorch_spellings_indexing_and_shapes() -> None:
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def fn(x: Any, idx: Any) -> Any:
        assert x.shape == (2, 3, 4) and x.ndim == 3 and x.dtype == "float64"
        assert len(x) == 2 and x.size(1) == 3 and x.numel() == 24 and x.dim() == 3
        out = {
            "first": x[0],
            "last": x[-1, :, 1:3],
            "every_other": x[..., ::2],
            "new_axis": x[:, None, 1],
            "picked": x[:, idx],
            "T": x[0].T,
            "mT": x.mT,
            "view": x.view(6, 4),
            "reshape": x.reshape(-1),
            "permute": x.permute(2, 0, 1),
            "float": x.float(),
            "to": x.to("float32"),
            "narrow": x.narrow(2, 1, 2),
            "clip": x.clip(-0.5, 0.5),
            "amax": x.amax(dim=(0, 2)),
            "zeros": F.zeros(2, 3),
            "arange": F.arange(5),
            "cat": F.cat([x, x], 1),
            "stack": F.stack([x[0], x[1]], dim=-1),
            "sum_all": x.sum(),
            "sum_kept": x.sum(1, True),
        }
        shapes.update({k: (v.shape, v.dtype) for k, v in out.items()})
        return out

    x = RNG.standard_normal((2, 3, 4))
    idx = np.array([2, 0])
    graph = trace(fn, CATALOG, x=x, idx=idx)
    result = compile_run(graph, {"x": x, "idx": idx}).outputs
    t = torch.tensor(x)
    expected = {
        "first": t[0],
        "last": t[-1, :, 1:3],
        "every_other": t[..., ::2],
        "new_axis": t[:, None, 1],
        "picked": t[:, torch.tensor(idx)],
        "T": t[0].T,
        "mT": t.mT,
        "view": t.view(6, 4),
        "reshape": t.reshape(-1),
        "permute": t.permute(2, 0, 1),
        "float": t.float(),
        "to": t.to(torch.float32),
        "narrow": t.narrow(2, 1, 2),
        "clip": t.clip(-0.5, 0.5),
        "amax": t.amax(dim=(0, 2)),
        "zeros": torch.zeros(2, 3),
        "arange": torch.arange(5),
        "cat": torch.cat([t, t], 1),
        "stack": torch.stack([t[0], t[1]], dim=-1),
        "sum_all": t.sum(),
        "sum_kept": t.sum(1, True),
    }
    for k, want in expected.items():
        got = np.asarray(result[k])
        assert shapes[k] == (got.shape, str(got.dtype)), k
        assert str(want.dtype).removeprefix("torch.") == str(got.dtype), k
        np.testing.assert_allclose(got, want.numpy(), err_msg=k)


def test_python_loops_unroll_on_shapes_and_long_chains_are_cut() -> None:
    def fn(x: Any) -> Any:
        total = functools.reduce(lambda acc, i: F.sin(acc) * 1.01 + x[i], range(len(x)), x[0])
        for _ in range(x.shape[0] // 100):
            total = total * 2
        return total

    x = RNG.standard_normal(300)
    graph = trace(fn, CATALOG, x=x)
    assert len(graph["nodes"]) > 300 // 24
    assert max(len(n["expr"]) for n in graph["nodes"]) <= 1200
    expected = x[0]
    for v in x:
        expected = np.sin(expected) * 1.01 + v
    np.testing.assert_allclose(compile_run(graph, {"x": x}).outputs["out"], expected * 8)


def test_names_that_are_not_identifiers_and_outputs_that_clash() -> None:
    def fn(*args: Any) -> Any:
        a, b = args
        return {"my-sum": (a + b).sum(), "ok": a * 2}

    graph = trace(fn, CATALOG, **{"a-1": ((2,), "float64"), "lambda": ((2,), "float64")})
    arrays = {"a-1": np.array([1.0, 2.0]), "lambda": np.array([3.0, 4.0])}
    out = compile_run(graph, arrays).outputs
    assert float(out["my-sum"]) == 10.0 and list(out["ok"]) == [2.0, 4.0]
    with pytest.raises(TraceError, match="name of an input"):
        trace(lambda x, y: {"y": x * 2}, CATALOG, x=((), "float32"), y=((), "float32"))


# ------------------------------------------------------------------ what needs data
def _while(x: Any) -> Any:
    while x.sum() > 1:
        x = x / 2
    return x


def _assert(x: Any) -> Any:
    assert x.sum() > 0
    return x


def test_what_needs_data_raises_trace_error() -> None:
    cases: dict[str, Callable[..., Any]] = {
        "if": lambda x: x if x > 0 else -x,
        "while": _while,
        "assert": _assert,
        "and": lambda x: (x > 0) and x,
        "not": lambda x: not x,
        "float": lambda x: float(x.sum()),
        "int": lambda x: int(x.sum()),
        "range": lambda x: range(x.sum()),
        "index": lambda x: [1, 2, 3][x.sum()],
        "item": lambda x: x.sum().item(),
        "tolist": lambda x: x.tolist(),
        "numpy": lambda x: x.numpy(),
        "asarray": lambda x: np.asarray(x),
        "builtin max": lambda x: max(x[0], x[1]),
        "mask": lambda x: x[x > 0],
        "assign": lambda x: x.__setitem__(0, 1.0),
        "array constant": lambda x: x + np.ones(3),
        "array constant reflected": lambda x: np.ones(3) * x,
        "inf literal": lambda x: x * float("inf"),
        "tensor attribute": lambda x: x.sum(dim=x.sum()),
    }
    for what, fn in cases.items():
        with pytest.raises(TraceError) as info:
            trace(fn, CATALOG, x=((3,), "float32"))
        message = str(info.value)
        assert message, what
        if what in (
            "if",
            "while",
            "assert",
            "and",
            "not",
            "float",
            "int",
            "range",
            "index",
            "item",
            "tolist",
            "numpy",
            "builtin max",
            "asarray",
        ):
            assert "where(cond, a, b)" in message and "scan" in message, (what, message)
    # What shapes answer statically works: len, .shape, loops over range(len(x)).
    graph = trace(lambda x: sum(x[i] * i for i in range(len(x))), CATALOG, x=((3,), "float32"))
    assert graph["nodes"][-1]["id"] == "out"


def test_misuse_outside_a_trace_and_across_traces() -> None:
    with pytest.raises(TraceError, match="no trace is in progress"):
        F.relu(1.0)
    kept: list[TracedTensor] = []
    trace(lambda x: kept.append(x) or x, CATALOG, x=((), "float32"))
    with pytest.raises(TraceError, match="another trace"):
        trace(lambda y: y + kept[0], CATALOG, y=((), "float32"))
    with pytest.raises(TraceError, match="must return a tensor"):
        trace(lambda x: 1.0, CATALOG, x=((), "float32"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'axis'.*takes: dim"):
        trace(lambda x: x.sum(axis=0), CATALOG, x=((2,), "float32"))
    with pytest.raises(TypeError, match=r"missing required argument.*dim"):
        trace(lambda x: F.softmax(x), CATALOG, x=((2,), "float32"))


# ------------------------------------------------------------------ another catalog
def _modified_catalog() -> list[dict[str, Any]]:
    ops = [dict(o) for o in CATALOG if o["name"] not in ("softmax", "add", "grad")]
    ops.append(
        {
            "name": "gelu",
            "group": "elementwise",
            "args": ["input"],
            "variadic": False,
            "attrs": {"approximate": {"type": "str", "default": "none", "required": False}},
            "differentiable": True,
            "doc": "GELU.",
        }
    )
    ops.append(
        {
            "name": "hypot",
            "group": "arithmetic",
            "args": ["input", "other"],
            "variadic": False,
            "attrs": {},
            "differentiable": True,
            "doc": "sqrt(a²+b²)",
        }
    )
    ops.append(
        {
            "name": "fft_norm",
            "group": "spectral",
            "args": ["input"],
            "variadic": False,
            "attrs": {"n": {"type": "int", "default": None, "required": False}},
            "differentiable": False,
            "doc": "A new kind.",
        }
    )
    ops.append(
        {
            "name": "hcat",
            "group": "shape",
            "args": ["tensors"],
            "variadic": True,
            "attrs": {"axis": {"type": "int", "default": 0, "required": False}},
            "differentiable": True,
            "doc": "A variadic op.",
        }
    )
    return ops


def test_a_catalog_that_differs() -> None:
    catalog = _modified_catalog()
    for fn, missing in [
        (lambda x: F.softmax(x, dim=0), "softmax"),
        (lambda x: x.softmax(0), "softmax"),
        (lambda x: x + x, "add"),
        (lambda x: grad(x.sum(), x), "grad"),
        (lambda x: F.grad(x.sum(), x), "grad"),
    ]:
        with pytest.raises(
            AttributeError,
            match=f"'{missing}' is not in this server's op "
            r"catalog \(GET /ops\)",
        ):
            trace(fn, catalog, x=((3,), "float32"))
    with pytest.raises(AttributeError, match=r"'softmax'.*did you mean 'log_softmax'"):
        Functional(catalog).softmax  # noqa: B018
    assert "gelu" in dir(Functional(catalog)) and "softmax" not in dir(Functional(catalog))

    seen = {}

    def fn(x: Any, y: Any) -> Any:
        g = F.hypot(x.gelu() * F.gelu(y, "tanh"), 2.0)
        spectral = F.fft_norm(g, n=4)
        seen.update(g=g, spectral=spectral)
        return {"out": F.hcat(spectral, x, axis=0) - 1, "also": F.hcat([x, y])}

    graph = trace(fn, catalog, x=((3,), "float32"), y=((3,), "float64"))
    assert graph["nodes"] == [
        {"id": "g", "expr": 'hypot(gelu(x) * gelu(y, approximate="tanh"), 2.0)'},
        {"id": "spectral", "expr": "fft_norm(g, n=4)"},
        {"id": "out", "expr": "hcat(spectral, x) - 1"},
        {"id": "also", "expr": "hcat(x, y)"},
    ]
    assert seen["g"].shape == (3,) and seen["g"].dtype == "float64"  # the group's rule
    with pytest.raises(TraceError, match="'fft_norm' has no shape rule"):
        seen["spectral"].shape  # noqa: B018


# What the light client may not load: the server's dependencies and the eager engine.
HEAVY = (
    "fastapi",
    "starlette",
    "uvicorn",
    "pebble",
    "pydantic_settings",
    "prometheus_client",
    *(
        f"gradserve.{m}"
        for m in (
            "engine._tensor",
            "engine.autograd",
            "engine.functions",
            "engine.ops.dispatch",
            "engine.tensor",
            "engine.graph",
            "engine.backends",
            "service.app",
        )
    ),
)


def test_the_client_and_tracer_load_the_rules_and_nothing_heavy() -> None:
    """The tracer's shapes are the engine's rules (engine.rules), which import without the
    eager engine; the client and tracer load no server dependency either, not even to trace
    on the standard catalog."""
    code = (
        "import sys, gradserve.client.http, gradserve.client.trace as t; "
        "g = t.trace(lambda x: x.sum(1), x=((2, 3), 'float32')); "
        "assert g['nodes'] == [{'id': 'out', 'expr': 'sum(x, dim=1)'}], g; "
        f"heavy = [m for m in sys.modules if m.startswith({HEAVY!r})]; "
        "assert not heavy, heavy; assert 'gradserve.engine.rules' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# ------------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.support.server import start_server, stop_server

    s = start_server(tmp_path_factory.mktemp("trace-server"))
    yield s
    stop_server(s)


@pytest.mark.integration
def test_traced_functions_and_their_hand_written_json_agree_over_http(server: Any) -> None:
    from gradserve.client.http import Client

    data = objective_data()
    with Client(server.base) as gs:
        for name, (nodes, output, wrt, _) in sorted(OBJECTIVES.items()):
            hand = {
                "nodes": [
                    {k: v for k, v in vars(n).items() if v not in (None, (), {})} for n in nodes
                ],
                "outputs": [output],
            }
            ours = gs.backward(PYTHON_OBJECTIVES[name], data, requires_grad=wrt)
            theirs = gs.backward(hand, data, requires_grad=wrt)
            np.testing.assert_array_equal(ours.outputs[output], theirs.outputs[output])
            assert ours.gradients is not None and theirs.gradients is not None
            for k in wrt:
                np.testing.assert_allclose(
                    ours.gradients[k],
                    theirs.gradients[k],
                    rtol=1e-14,
                    atol=1e-15,
                    err_msg=f"{name} {k}",
                )
        for name, (fn, graph, inputs, wrt) in sorted(TRANSFORM_CASES.items()):
            if wrt:
                ours = gs.backward(fn, inputs, requires_grad=wrt)
                theirs = gs.backward(graph, inputs, requires_grad=wrt)
            else:
                ours = gs.forward(fn, inputs, no_grad=True)
                theirs = gs.forward(graph, inputs, no_grad=True)
            for k in graph["outputs"]:
                np.testing.assert_allclose(
                    ours.outputs[k], theirs.outputs[k], rtol=1e-14, err_msg=f"{name} {k}"
                )
            for k in wrt:
                np.testing.assert_allclose(
                    ours.gradients[k],
                    theirs.gradients[k],  # type: ignore[index]
                    rtol=1e-14,
                )


@pytest.mark.integration
def test_client_trace_f_and_the_trace_cache(server: Any) -> None:
    from gradserve.client.http import Client

    calls = []

    with Client(server.base) as gs:

        def model(x: Any, w: Any) -> Any:
            calls.append(1)
            return {"y": gs.F.relu(x @ w).sum(dim=-1)}

        x, w = RNG.standard_normal((4, 3)), RNG.standard_normal((3, 2))
        assert gs.trace(model, x=x, w=w) == trace(model, gs.ops(), x=x, w=w)
        assert gs.trace(model, x=x, w=w) == {
            "nodes": [{"id": "y", "expr": "sum(relu(x @ w), dim=-1)"}],
            "outputs": ["y"],
        }
        calls.clear()
        r1 = gs.forward(model, {"x": x, "w": w})
        r2 = gs.forward(model, {"x": x * 2, "w": w})
        assert len(calls) == 1  # traced once for these specs
        np.testing.assert_allclose(r1.outputs["y"], np.maximum(x @ w, 0).sum(-1))
        np.testing.assert_allclose(r2.outputs["y"], np.maximum(2 * x @ w, 0).sum(-1))
        gs.forward(model, {"x": x[:2], "w": w})  # other shapes: traced again
        gs.forward(model, {"x": x.astype(np.float32), "w": w.astype(np.float32)})
        assert len(calls) == 3
        r = gs.backward(model, {"x": x, "w": w}, grad_outputs={"y": np.ones(4)})
        np.testing.assert_allclose(r.gradients["w"], x.T @ (x @ w > 0))  # type: ignore[index]
        assert len(calls) == 3
        with pytest.raises(AttributeError, match="'no_such_op'"):
            gs.F.no_such_op  # noqa: B018


@pytest.mark.integration
def test_async_client_traces(server: Any) -> None:
    from gradserve.client.http import AsyncClient

    async def go() -> None:
        async with AsyncClient(server.base) as gs:
            with pytest.raises(TraceError, match=r"await client\.ops"):
                gs.F.relu  # noqa: B018
            r = await gs.backward(rnn, RNN_INPUTS, requires_grad=["w", "u"])
            theirs = compile_run(RNN_GRAPH, RNN_INPUTS, wrt=("w", "u"), backward=True)
            np.testing.assert_allclose(r.outputs["loss"], theirs.outputs["loss"], rtol=1e-14)
            np.testing.assert_allclose(r.gradients["u"], theirs.gradients["u"], rtol=1e-14)  # type: ignore[index]
            graph = await gs.trace(lambda x: gs.F.relu(x), x=((2,), "float32"))
            assert graph == {"nodes": [{"id": "out", "expr": "relu(x)"}], "outputs": ["out"]}

    asyncio.run(go())
