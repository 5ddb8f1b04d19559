"""The graph layer: validation errors with locations, expr parsing, memory plan against
measured memory, the no_grad path, deadlines, deep graphs."""

from __future__ import annotations

import gc
import itertools
import threading
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradserve.engine as engine
from gradserve.engine.errors import (
    ArityError,
    AttributeError_,
    BackwardError,
    Cancelled,
    DeadlineExceeded,
    ExprError,
    GraphError,
    MemoryBudgetError,
    ShapeError,
    UnknownOpError,
    ValidationErrors,
)
from gradserve.engine.graph import GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph, execute

SCALAR = TensorSpec((), "float32", True)


def graph(*nodes: NodeSpec, outputs: list[str]) -> GraphSpec:
    return GraphSpec(nodes=list(nodes), outputs=outputs)


@dataclass
class Result:
    """A run's result, with what the response reports of each output."""

    outputs: dict[str, np.ndarray]
    gradients: dict[str, np.ndarray] | None
    requires_grad: dict[str, bool]
    grad_fn: dict[str, str | None]
    nodes: int
    peak_bytes: int
    planned_peak_bytes: int
    timings_ms: dict[str, float]


def run(
    spec: GraphSpec,
    inputs: dict[str, Any],
    *,
    no_grad: bool = False,
    backward: bool = False,
    grad_outputs: dict[str, Any] | None = None,
    limits: Limits | None = None,
    requires_grad: tuple[str, ...] = (),
) -> Result:
    arrays = {k: engine.tensor(v).numpy() for k, v in inputs.items()}
    specs = {k: TensorSpec(a.shape, str(a.dtype), k in requires_grad) for k, a in arrays.items()}
    go = {k: engine.tensor(v).numpy() for k, v in (grad_outputs or {}).items()}
    program = compile_graph(
        spec,
        specs,
        limits=limits,
        no_grad=no_grad,
        backward=backward,
        grad_outputs={k: TensorSpec(a.shape, str(a.dtype)) for k, a in go.items()},
    )
    r = execute(program, arrays, grad_outputs=go, verify=True)
    assert r.peak_bytes == r.planned_peak_bytes  # the plan is the run, on every graph here
    slots = dict(program.outputs)
    return Result(
        outputs={k: np.asarray(v) for k, v in r.outputs.items()},
        gradients=None
        if r.gradients is None
        else {k: np.asarray(v) for k, v in r.gradients.items()},
        requires_grad={k: program.requires_grad[s] for k, s in slots.items()},
        grad_fn={k: program.grad_fn[s] for k, s in slots.items()},
        nodes=r.nodes,
        peak_bytes=r.peak_bytes,
        planned_peak_bytes=r.planned_peak_bytes,
        timings_ms=r.timings_ms,
    )


def errors_of(spec: GraphSpec, inputs: dict[str, TensorSpec], **kw: Any) -> list[Any]:
    with pytest.raises(ValidationErrors) as info:
        compile_graph(spec, inputs, **kw)
    return info.value.errors


SEED = graph(
    NodeSpec("s", "add", ["x", "y"]),
    NodeSpec("d", "sub", ["x", "y"]),
    NodeSpec("z", "mul", ["s", "d"]),
    outputs=["z"],
)


@pytest.mark.parametrize(
    "spec",
    [SEED, graph(NodeSpec("z", expr="(x + y) * (x - y)"), outputs=["z"])],
    ids=["op-form", "expr"],
)
def test_seed_example(spec: GraphSpec) -> None:
    result = run(spec, {"x": 2.0, "y": 3.0}, backward=True, requires_grad=("x", "y"))
    assert result.outputs["z"].item() == -5.0
    assert result.requires_grad["z"] and result.grad_fn["z"] == "MulBackward"
    assert result.gradients["x"].item() == 4.0 and result.gradients["y"].item() == -6.0
    assert result.nodes == 3 and set(result.timings_ms) == {"plan", "forward", "backward"}


def test_seed_example_no_grad() -> None:
    result = run(
        graph(NodeSpec("B", expr="A ** 2 + 16"), outputs=["B", "A"]),
        {"A": [5.0]},
        no_grad=True,
        requires_grad=("A",),
    )
    assert result.outputs["B"].tolist() == [41.0]
    assert not result.requires_grad["B"] and result.grad_fn["B"] is None
    assert result.requires_grad["A"] and result.gradients is None


def test_duplicate_ids_and_input_collisions() -> None:
    errs = errors_of(
        graph(
            NodeSpec("a", "neg", ["x"]),
            NodeSpec("a", "neg", ["x"]),
            NodeSpec("x", "neg", ["a"]),
            outputs=["a"],
        ),
        {"x": SCALAR},
    )
    assert [str(e) for e in errs] == [
        "node 'a': duplicate node id 'a'",
        "node 'x': node id 'x' is also the name of an input",
    ]
    assert errs[0].loc == ("graph", "nodes", 1, "id") and errs[1].loc == ("graph", "nodes", 2, "id")


def test_unknown_op_and_reference_name_the_referring_node() -> None:
    errs = errors_of(
        graph(NodeSpec("a", "frobnicate", ["x"]), NodeSpec("b", "neg", ["q"]), outputs=["b"]),
        {"x": SCALAR},
    )
    assert isinstance(errs[0], UnknownOpError) and errs[0].node == "a"
    assert errs[0].loc == ("graph", "nodes", 0, "op")
    assert isinstance(errs[1], GraphError)
    assert str(errs[1]) == "node 'b' (neg): unknown reference 'q'"
    assert errs[1].loc == ("graph", "nodes", 1, "args", 0)


def test_cycle_lists_the_whole_cycle() -> None:
    errs = errors_of(
        graph(
            NodeSpec("a", "neg", ["c"]),
            NodeSpec("b", "neg", ["a"]),
            NodeSpec("c", "neg", ["b"]),
            NodeSpec("out", "neg", ["x"]),
            outputs=["out"],
        ),
        {"x": SCALAR},
    )
    assert len(errs) == 1 and errs[0].node in {"a", "b", "c"}
    text = str(errs[0])
    cycle = text.split("cycle: ")[1].split(" -> ")
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["a", "b", "c"]
    for u, v in itertools.pairwise(cycle):  # each arrow follows a real edge
        assert (u, v) in {("a", "b"), ("b", "c"), ("c", "a")}


def test_self_loop_is_a_cycle() -> None:
    errs = errors_of(graph(NodeSpec("a", "add", ["a", "x"]), outputs=["a"]), {"x": SCALAR})
    assert str(errs[0]) == "node 'a': cycle: a -> a"


def test_arity_and_attribute_errors() -> None:
    errs = errors_of(
        graph(
            NodeSpec("a", "neg", ["x", "x"]),
            NodeSpec("b", "sum", ["x"], {"axis": 0}),
            NodeSpec("c", "sum", ["x"], {"dim": "0"}),
            NodeSpec("d", "clamp", ["x"], {"min": 0.0, "max": [1]}),
            outputs=["a"],
        ),
        {"x": TensorSpec((3,), "float32")},
    )
    assert isinstance(errs[0], ArityError) and errs[0].node == "a"
    assert "takes 1 tensor argument(s) (input), got 2" in str(errs[0])
    assert isinstance(errs[1], AttributeError_) and "unknown attribute 'axis'" in str(errs[1])
    assert errs[1].loc == ("graph", "nodes", 1, "attrs", "axis")
    assert "attribute 'dim' must be int|ints" in str(errs[2])
    assert errs[3].loc == ("graph", "nodes", 3, "attrs", "max")


def test_shape_error_is_reported_before_compute_with_node_and_shapes() -> None:
    errs = errors_of(
        graph(NodeSpec("z", "add", ["a", "b"]), outputs=["z"]),
        {"a": TensorSpec((3, 4), "float32"), "b": TensorSpec((5,), "float32")},
    )
    assert isinstance(errs[0], ShapeError)
    assert str(errs[0]) == "node 'z' (add): shapes (3, 4) and (5,) cannot be broadcast together"


def test_all_errors_are_reported_not_only_the_first() -> None:
    nodes = [NodeSpec(f"n{i}", "neg", [f"missing{i}"]) for i in range(5)]
    errs = errors_of(graph(*nodes, outputs=["n0"]), {})
    assert [e.node for e in errs] == [f"n{i}" for i in range(5)]
    capped = errors_of(
        graph(*[NodeSpec(f"m{i}", "neg", ["q"]) for i in range(100)], outputs=["m0"]),
        {},
        limits=Limits(max_errors=7),
    )
    assert len(capped) == 7


def test_downstream_of_an_error_is_not_reported_again() -> None:
    errs = errors_of(
        graph(NodeSpec("z", "add", ["a", "b"]), NodeSpec("w", "exp", ["z"]), outputs=["w"]),
        {"a": TensorSpec((3,), "float32"), "b": TensorSpec((4,), "float32")},
    )
    assert [e.node for e in errs] == ["z"]


def test_outputs_must_exist() -> None:
    errs = errors_of(graph(NodeSpec("a", "neg", ["x"]), outputs=["a", "nope"]), {"x": SCALAR})
    assert "output 'nope' is not a node id or an input name" in str(errs[0])
    assert errs[0].loc == ("graph", "outputs", 1)
    assert "at least one" in str(errors_of(graph(outputs=[]), {"x": SCALAR})[0])


def test_node_limit() -> None:
    nodes = [NodeSpec(f"n{i}", "neg", ["x"]) for i in range(11)]
    errs = errors_of(graph(*nodes, outputs=["n0"]), {"x": SCALAR}, limits=Limits(max_nodes=10))
    assert "the graph has 11 nodes; the limit is 10" in str(errs[0])
    expanded = errors_of(
        graph(NodeSpec("z", expr="x + x + x + x"), outputs=["z"]),
        {"x": SCALAR},
        limits=Limits(max_nodes=2),
    )
    assert "expands to 3 op nodes; the limit is 2" in str(expanded[0])


def test_backward_needs_something_that_requires_grad() -> None:
    errs = errors_of(
        SEED, {"x": TensorSpec((), "float32"), "y": TensorSpec((), "float32")}, backward=True
    )
    assert isinstance(errs[0], BackwardError) and "no input has requires_grad" in str(errs[0])
    errs = errors_of(
        graph(NodeSpec("z", expr="y * 2"), outputs=["z"]),
        {"x": SCALAR, "y": TensorSpec((), "float32")},
        backward=True,
    )
    assert "no output depends on an input with requires_grad" in str(errs[0])


def test_non_scalar_output_needs_grad_outputs() -> None:
    vec = TensorSpec((3,), "float32", True)
    errs = errors_of(graph(NodeSpec("z", expr="x * 2"), outputs=["z"]), {"x": vec}, backward=True)
    assert errs[0].loc == ("grad_outputs", "z") and "give grad_outputs['z']" in str(errs[0])
    errs = errors_of(
        graph(NodeSpec("z", expr="x * 2"), outputs=["z"]),
        {"x": vec},
        backward=True,
        grad_outputs={"w": TensorSpec((3,), "float32"), "z": TensorSpec((2,), "float32")},
    )
    assert [e.loc for e in errs] == [("grad_outputs", "w"), ("grad_outputs", "z")]


def test_grad_outputs_several_outputs_are_summed() -> None:
    spec = graph(NodeSpec("a", expr="x * 2"), NodeSpec("b", expr="x * x"), outputs=["a", "b"])
    result = run(
        spec,
        {"x": [1.0, 2.0]},
        backward=True,
        requires_grad=("x",),
        grad_outputs={"a": [1.0, 1.0], "b": [10.0, 10.0]},
    )
    assert result.gradients["x"].tolist() == [22.0, 42.0]


def test_input_as_output_gets_its_own_grad_output_and_unused_input_gets_zeros() -> None:
    spec = graph(NodeSpec("y", expr="x * 3"), outputs=["y", "x"])
    result = run(
        spec,
        {"x": [1.0, 2.0], "u": [[1.0]]},
        backward=True,
        requires_grad=("x", "u"),
        grad_outputs={"y": [1.0, 1.0], "x": [5.0, 6.0]},
    )
    assert result.gradients["x"].tolist() == [8.0, 9.0]
    assert result.gradients["u"].tolist() == [[0.0]] and result.gradients["u"].dtype == "float32"


def test_dead_nodes_are_validated_but_not_run() -> None:
    spec = graph(NodeSpec("used", expr="x + 1"), NodeSpec("dead", expr="exp(x)"), outputs=["used"])
    assert run(spec, {"x": 1.0}).nodes == 1


def test_alias_and_constant_expressions() -> None:
    spec = graph(
        NodeSpec("a", expr="x"),
        NodeSpec("b", expr="a * 2"),
        NodeSpec("c", expr="2 + 3"),
        outputs=["a", "b", "c"],
    )
    result = run(spec, {"x": 4.0}, backward=False)
    assert result.outputs["a"].item() == 4.0 and result.outputs["b"].item() == 8.0
    assert result.outputs["c"].item() == 5 and result.outputs["c"].dtype == "int64"


def test_alias_cycle_and_unknown() -> None:
    errs = errors_of(
        graph(
            NodeSpec("a", expr="b"),
            NodeSpec("b", expr="a"),
            NodeSpec("c", expr="nowhere"),
            outputs=["c"],
        ),
        {},
    )
    assert "cycle: a -> b -> a" in str(errs[0]) and "unknown reference 'nowhere'" in str(errs[1])


def test_op_and_expr_are_exclusive() -> None:
    errs = errors_of(
        graph(NodeSpec("a", "neg", ["x"], expr="x"), NodeSpec("b"), outputs=["a"]), {"x": SCALAR}
    )
    assert all("exactly one of 'op' or 'expr'" in str(e) for e in errs) and len(errs) == 2


INJECTIONS = [
    "__import__('os').system('id')",
    "x.__class__",
    "[i for i in x]",
    "lambda: 0",
    "x[0]",
    "exec('1')",
    "eval('x')",
    "open('/etc/passwd')",
    "x if x else x",
    "x and x",
    "{'a': x}",
    "f'{x}'",
    "(y := x)",
    "sum(*x)",
    "sum(x, **{'dim': 0})",
    "x % 2",
    "x // 2",
    "a < b < c",
    "'hello'",
    "sum(x, dim='0') + 'str'",
]


@pytest.mark.parametrize("text", INJECTIONS)
def test_injection_attempts_are_refused(text: str) -> None:
    errs = errors_of(graph(NodeSpec("z", expr=text), outputs=["z"]), {"x": SCALAR})
    assert isinstance(errs[0], (ExprError, GraphError)) and errs[0].node == "z"
    assert errs[0].loc == ("graph", "nodes", 0, "expr") or "unknown" in str(errs[0])


def test_expr_errors_name_the_offending_piece() -> None:
    err = errors_of(graph(NodeSpec("z", expr="exp(x).real"), outputs=["z"]), {"x": SCALAR})[0]
    assert str(err) == "node 'z': attribute access is not allowed in expr: 'exp(x).real'"
    err = errors_of(graph(NodeSpec("z", expr="system(x)"), outputs=["z"]), {"x": SCALAR})[0]
    assert "unknown op 'system'" in str(err)
    err = errors_of(graph(NodeSpec("z", expr="y" * 1000 + "(x)"), outputs=["z"]), {"x": SCALAR})[0]
    assert f"unknown op '{'y' * 64}'...(1000 characters)" in str(err)  # quoted, shortened
    assert len(str(err)) < 200


@pytest.mark.parametrize(
    ("spelling", "python"), [("true", "True"), ("false", "False"), ("null", "None")]
)
def test_json_spellings_of_constants_get_a_hint(spelling: str, python: str) -> None:
    spec = graph(NodeSpec("z", expr=f"sum(x, dim=1, keepdim={spelling})"), outputs=["z"])
    err = errors_of(spec, {"x": SCALAR})[0]
    assert isinstance(err, ExprError) and err.node == "z"
    assert str(err) == (
        "node 'z': attribute values must be literals (numbers, strings, lists "
        f"of ints): '{spelling}'; did you mean {python}?"
    )
    # Python's spelling is the syntax; an input may still be called `true`.
    fine = graph(NodeSpec("z", expr="sum(x * true, dim=1, keepdim=True)"), outputs=["z"])
    assert run(fine, {"x": [[1.0, 2.0]], "true": 2.0}).outputs["z"].tolist() == [[6.0]]


def test_expr_limits() -> None:
    long = " + ".join(["x"] * 3000)
    err = errors_of(graph(NodeSpec("z", expr=long), outputs=["z"]), {"x": SCALAR})[0]
    assert "characters long; the limit is 10000" in str(err)
    for deep in [
        "(" * 101 + "x" + ")" * 101,
        "-" * 500 + "x",
        "exp(" * 150 + "x" + ")" * 150,
        "(" * 300 + "x" + ")" * 300,
        " + ".join(["x"] * 2000),
    ]:
        err = errors_of(
            graph(NodeSpec("z", expr=deep), outputs=["z"]),
            {"x": SCALAR},
            limits=Limits(expr_max_chars=20_000),
        )[0]
        assert "nested more than 100 levels deep" in str(err)
    ok = "(" * 100 + "x" + ")" * 100
    assert run(graph(NodeSpec("z", expr=ok), outputs=["z"]), {"x": 1.0}).outputs["z"].item() == 1
    # Depth counts expressions within expressions: 99 unary minuses around a name is 100.
    assert run(graph(NodeSpec("z", expr="-" * 99 + "x"), outputs=["z"]), {"x": 1.0}).nodes == 99
    err = errors_of(graph(NodeSpec("z", expr="-" * 100 + "x"), outputs=["z"]), {"x": SCALAR})[0]
    assert "nested more than 100 levels deep" in str(err)


def test_nfkc_lookalike_identifiers_are_refused() -> None:
    err = errors_of(graph(NodeSpec("z", expr="ｘ + 1"), outputs=["z"]), {"x": SCALAR})[0]
    assert "not in normal form" in str(err)


def test_generated_ids_never_collide_with_client_ids() -> None:
    spec = graph(
        NodeSpec("z#1", expr="x * 10"),
        NodeSpec("z", expr="(x + 1) * (x + 2)"),
        outputs=["z", "z#1"],
    )
    result = run(spec, {"x": 1.0})
    assert result.outputs["z"].item() == 6.0 and result.outputs["z#1"].item() == 10.0


def test_expr_keywords_and_comparisons() -> None:
    spec = graph(
        NodeSpec("s", expr="sum(x * 2, dim=1, keepdim=True)"),
        NodeSpec("c", expr="clamp(x, min=-1, max=2.5)"),
        NodeSpec("m", expr="x >= 2"),
        NodeSpec("r", expr="reshape(x, shape=(-1,))"),
        outputs=["s", "c", "m", "r"],
    )
    result = run(spec, {"x": [[1.0, 2.0], [3.0, -4.0]]})
    assert result.outputs["s"].tolist() == [[6.0], [-2.0]]
    assert result.outputs["c"].tolist() == [[1.0, 2.0], [2.5, -1.0]]
    assert result.outputs["m"].tolist() == [[False, True], [True, False]]
    assert result.outputs["r"].shape == (4,)


# ---------------------------------------------------------------- expr == op form

_UNARY = ["exp", "sin", "tanh", "sigmoid", "neg"]
_BINARY = {"add": "+", "sub": "-", "mul": "*"}


@st.composite
def expressions(draw: Any, depth: int = 0) -> tuple[str, list[tuple[str, str, list[Any]]]]:
    """A random expression as (expr text, op-form nodes in order)."""
    counter = draw(st.integers(0, 10**6))
    nodes: list[tuple[str, str, list[Any]]] = []

    def build(d: int) -> tuple[str, Any]:
        kind = draw(st.sampled_from(["leaf", "unary", "binary"] if d < 4 else ["leaf"]))
        if kind == "leaf":
            choice = draw(st.sampled_from(["x", "y", "lit"]))
            if choice == "lit":
                v = draw(st.floats(0.25, 2.0, allow_nan=False).map(lambda f: round(f, 2)))
                return repr(v), v
            return choice, choice
        nid = f"n{counter}_{len(nodes)}_{d}"
        if kind == "unary":
            op = draw(st.sampled_from(_UNARY))
            text, ref = build(d + 1)
            if isinstance(ref, float):
                ref = "x"
                text = "x"
            nodes.append((nid, op, [ref]))
            return (f"-({text})" if op == "neg" else f"{op}({text})"), nid
        op = draw(st.sampled_from(sorted(_BINARY)))
        lt, lref = build(d + 1)
        rt, rref = build(d + 1)
        if isinstance(lref, float) and isinstance(rref, float):
            lref, lt = "x", "x"
        nodes.append((nid, op, [lref, rref]))
        return f"({lt} {_BINARY[op]} {rt})", nid

    text, ref = build(0)
    if not nodes:
        nodes.append(("only", "mul", [ref if isinstance(ref, str) else "x", 1.0]))
        text = f"({text if isinstance(ref, str) else 'x'} * 1.0)"
    return text, nodes


@settings(max_examples=40, deadline=None)
@given(expressions())
def test_expr_and_op_form_agree(case: tuple[str, list[tuple[str, str, list[Any]]]]) -> None:
    text, nodes = case
    inputs = {"x": [0.3, -1.2, 0.7], "y": [1.5, 0.2, -0.4]}
    go = {"out": [1.0, 2.0, 3.0]}
    by_expr = run(
        graph(NodeSpec("out", expr=text), outputs=["out"]),
        inputs,
        backward=True,
        requires_grad=("x", "y"),
        grad_outputs=go,
    )
    op_nodes = [NodeSpec(nid, op, args) for nid, op, args in nodes]
    last = op_nodes[-1]
    op_nodes[-1] = NodeSpec("out", last.op, last.args)
    by_ops = run(
        graph(*op_nodes, outputs=["out"]),
        inputs,
        backward=True,
        requires_grad=("x", "y"),
        grad_outputs=go,
    )
    np.testing.assert_allclose(by_expr.outputs["out"], by_ops.outputs["out"], rtol=1e-6)
    for name in ("x", "y"):
        np.testing.assert_allclose(by_expr.gradients[name], by_ops.gradients[name], rtol=1e-6)
    assert by_expr.nodes == by_ops.nodes


# ---------------------------------------------------------------- memory and execution

MB8 = 1_000_000  # float64 elements in 8 MB


def _chain(n: int) -> GraphSpec:
    ops = ["sin", "tanh", "exp", "sigmoid", "mul", "softplus", "square", "cos"]
    nodes = []
    prev = "x"
    for i in range(n):
        op = ops[i % len(ops)]
        nodes.append(NodeSpec(f"v{i}", op, [prev, "x"] if op == "mul" else [prev]))
        prev = f"v{i}"
    return GraphSpec(nodes=nodes, outputs=[prev])


def test_no_grad_chain_peak_is_three_tensors_and_plan_matches() -> None:
    x = np.random.default_rng(0).uniform(0, 0.1, MB8)
    result = run(_chain(32), {"x": x}, no_grad=True, requires_grad=("x",))
    assert result.planned_peak_bytes == result.peak_bytes <= 3 * 8 * MB8


def test_grad_chain_holds_what_its_ops_save() -> None:
    x = np.random.default_rng(0).uniform(0, 0.1, MB8)
    spec = _chain(32)
    grad = run(
        spec, {"x": x}, backward=True, requires_grad=("x",), grad_outputs={"v31": np.ones(MB8)}
    )
    no_grad = run(spec, {"x": x}, no_grad=True, requires_grad=("x",))
    assert abs(grad.peak_bytes - grad.planned_peak_bytes) <= 0.1 * grad.peak_bytes
    # 32 ops each save one tensor (mul saves its intermediate; x is shared), plus x, the
    # output and a gradient or two.
    assert 30 * 8 * MB8 <= grad.peak_bytes <= 36 * 8 * MB8
    assert grad.peak_bytes / no_grad.peak_bytes > 8


@pytest.mark.parametrize("no_grad", [True, False])
def test_plan_matches_measured_on_a_branchy_graph(no_grad: bool) -> None:
    rng = np.random.default_rng(3)
    spec = graph(
        NodeSpec("h", expr="tanh(x * w + b)"),
        NodeSpec("g", expr="sigmoid(h) * h - exp(h * 0.1)"),
        NodeSpec("loss", expr="mean((g - t) ** 2) + mean(h * h) * 0.01"),
        outputs=["loss", "h"],
    )
    inputs = {
        "x": rng.standard_normal((256, 64)),
        "w": rng.standard_normal(64),
        "b": rng.standard_normal(64),
        "t": rng.standard_normal((256, 64)),
    }
    result = run(
        spec,
        inputs,
        no_grad=no_grad,
        backward=not no_grad,
        requires_grad=() if no_grad else ("w", "b"),
        grad_outputs=None if no_grad else {"h": np.ones((256, 64))},
    )
    assert abs(result.peak_bytes - result.planned_peak_bytes) <= 0.1 * result.peak_bytes


def test_memory_budget_is_checked_before_allocating() -> None:
    spec = _chain(4)
    with pytest.raises(MemoryBudgetError) as info:
        compile_graph(
            spec,
            {"x": TensorSpec((MB8,), "float64", True)},
            no_grad=True,
            limits=Limits(memory_budget_bytes=10_000_000),
        )
    assert info.value.planned_bytes == 24_000_000 and info.value.budget_bytes == 10_000_000
    assert "24000000 bytes" in str(info.value) and "no_grad budget is 10000000" in str(info.value)


def test_twenty_thousand_node_chain_validates_and_runs() -> None:
    nodes = [NodeSpec("n0", "mul", ["x", 1.0])]
    nodes += [
        NodeSpec(f"n{i}", "add" if i % 2 else "mul", [f"n{i - 1}", 0.0 if i % 2 else 1.0])
        for i in range(1, 20_000)
    ]
    result = run(
        GraphSpec(nodes=nodes[::-1], outputs=["n19999"]),
        {"x": 2.0},
        backward=True,
        requires_grad=("x",),
    )
    assert result.outputs["n19999"].item() == 2.0 and result.gradients["x"].item() == 1.0
    assert result.nodes == 20_000


def test_deadline_stops_a_run_and_frees_its_arrays() -> None:
    spec = _chain(64)
    x = np.ones(200_000)
    program = compile_graph(
        spec,
        {"x": TensorSpec(x.shape, "float64", True)},
        backward=True,
        grad_outputs={"v63": TensorSpec(x.shape, "float64")},
    )
    go = {"v63": np.ones(200_000)}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with pytest.raises(DeadlineExceeded, match="ran past its time limit"):
            execute(program, {"x": x}, grad_outputs=go, deadline=time.monotonic() + 0.002)
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before < 200_000  # nothing 1.6 MB held
    finally:
        tracemalloc.stop()
    with pytest.raises(DeadlineExceeded):
        execute(program, {"x": x}, grad_outputs=go, deadline=time.monotonic() - 1)


def test_cancel_stops_a_run_between_nodes() -> None:
    spec = _chain(8)
    x = np.ones(10)
    program = compile_graph(spec, {"x": TensorSpec(x.shape, "float64", True)}, no_grad=True)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled, match="cancelled"):
        execute(program, {"x": x}, cancel=cancel)
    assert execute(program, {"x": x}, cancel=threading.Event()).nodes == 8


def test_integer_literals_past_int64_are_refused_with_their_place() -> None:
    errs = errors_of(
        graph(
            NodeSpec("z", "sign", [1 << 63]),
            NodeSpec("w", expr=f"x + {1 << 63}"),
            NodeSpec("c", expr=f"clamp(x, min={-(1 << 63) - 1})"),
            outputs=["z", "w", "c"],
        ),
        {"x": SCALAR},
    )
    assert [str(e) for e in errs] == [
        "node 'z' (sign): integer literal 9223372036854775808 is outside the int64 range",
        "node 'w' (add): integer literal 9223372036854775808 is outside the int64 range",
        "node 'c' (clamp): attribute 'min' is outside the int64 range",
    ]
    assert errs[0].loc == ("graph", "nodes", 0, "args", 0)
    with pytest.raises(engine.GradserveError, match="outside the int64 range"):
        engine.tensor([1.0]) + (1 << 64)
    ok = graph(NodeSpec("m", expr=f"x * {-(1 << 63)} + 0x7fff_ffff_ffff_ffff"), outputs=["m"])
    compile_graph(ok, {"x": SCALAR})  # the int64 bounds themselves are fine


@pytest.mark.parametrize(
    "literal",
    [
        "9" * 9000,
        str(10**30),
        "0x" + "f" * 9000,
        "0o1" + "0" * 22,
        "-0b1" + "0" * 64,
        "1_000" * 7,
    ],
    ids=["9000-digits", "31-digits", "hex", "octal", "binary", "underscores"],
)
def test_integer_literals_with_more_digits_than_int64_are_refused_from_their_text(
    literal: str,
) -> None:
    # Python would not convert the first (ast.parse suggests sys.set_int_max_str_digits);
    # none of them can be within int64, whatever their value.
    errs = errors_of(
        graph(NodeSpec("w", expr=f"sum(x, dim={literal}) + 1"), outputs=["w"]), {"x": SCALAR}
    )
    assert len(errs) == 1 and isinstance(errs[0], ExprError)
    assert errs[0].node == "w" and errs[0].loc == ("graph", "nodes", 0, "expr")
    assert "is too long for int64 (PyTorch's integer range)" in str(errs[0])
    assert len(str(errs[0])) < 200 and "set_int_max_str_digits" not in str(errs[0])
    # Floats have no such limit: a long one is just a large (or infinite) float.
    compile_graph(graph(NodeSpec("f", expr=f"x * {'9' * 9000}.0"), outputs=["f"]), {"x": SCALAR})


def test_runtime_op_errors_name_the_node() -> None:
    spec = graph(NodeSpec("p", expr="x ** -1"), outputs=["p"])
    with pytest.raises(engine.GradserveError) as info:
        run(spec, {"x": [0, 1]})
    assert info.value.node == "p"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789abcdefxob_.()[]{}+-*/@ ,=eEjJ", max_size=60))
def test_the_fast_expr_scan_agrees_with_the_tokenizer(text: str) -> None:
    """Text without strings is scanned without Python's tokenizer: the bracket depth and the
    first integer literal too long for int64 must be what the tokenizer finds."""
    from gradserve.engine.graph import expr

    assert expr._scan_tokens(text) == expr._scan_with_tokenizer(text)


@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"[a-c0-9+\-*/@(),= \[\]]{1,40}", fullmatch=True))
def test_the_ast_depth_walk_agrees_with_ast_itself(text: str) -> None:
    import ast

    from gradserve.engine.graph import expr

    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return
    deepest, stack = 0, [(tree.body, 1)]
    while stack:  # the generic walk over every expression child
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in expr._expressions(node))
    assert expr._ast_depth(tree.body) == deepest
