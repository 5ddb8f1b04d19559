"""`grad`, `jvp` and `scan` nodes in the engine: values and gradients against PyTorch
(torch.autograd.grad with create_graph, torch.func.jvp/jacfwd/jacrev, Python loops) and
against central finite differences in float64; memory planned against measured; the
problem each bad node gets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from gradserve.engine.errors import ComputeBudgetError, MemoryBudgetError, ValidationErrors
from gradserve.engine.graph import BodySpec, GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import Program

RNG = np.random.default_rng(9)


def spec_of(
    arrays: Mapping[str, np.ndarray], requires: Sequence[str] = ()
) -> dict[str, TensorSpec]:
    return {k: TensorSpec(a.shape, str(a.dtype), k in requires) for k, a in arrays.items()}


def run(
    nodes: Sequence[NodeSpec],
    outputs: Sequence[str],
    arrays: Mapping[str, np.ndarray],
    *,
    requires: Sequence[str] = (),
    backward: bool = False,
    no_grad: bool = False,
    grad_outputs: Mapping[str, np.ndarray] | None = None,
) -> tuple[Program, Any]:
    """Compile and run; every step's result is checked against its shape rule, and the
    measured peak against the planned one."""
    program = compile_graph(
        GraphSpec(list(nodes), list(outputs)),
        spec_of(arrays, requires),
        backward=backward,
        no_grad=no_grad,
        grad_outputs=None if grad_outputs is None else spec_of(grad_outputs),
    )
    result = execute(program, dict(arrays), grad_outputs=grad_outputs, verify=True)
    assert result.peak_bytes == result.planned_peak_bytes
    return program, result


def errors_of(
    nodes: Sequence[NodeSpec], outputs: Sequence[str], arrays: Mapping[str, np.ndarray], **kw: Any
) -> list[Any]:
    with pytest.raises(ValidationErrors) as info:
        compile_graph(GraphSpec(list(nodes), list(outputs)), spec_of(arrays), **kw)
    return info.value.errors


def value(nodes: Sequence[NodeSpec], output: str, arrays: Mapping[str, np.ndarray]) -> float:
    _, result = run(nodes, [output], arrays, no_grad=True)
    return float(result.outputs[output])


def finite_difference(
    nodes: Sequence[NodeSpec],
    output: str,
    arrays: Mapping[str, np.ndarray],
    name: str,
    eps: float = 1e-6,
) -> np.ndarray:
    """∂output/∂arrays[name] by central differences in float64."""
    base = arrays[name]
    grad = np.zeros_like(base)
    for i in np.ndindex(base.shape):
        plus, minus = base.copy(), base.copy()
        plus[i] += eps
        minus[i] -= eps
        grad[i] = (
            value(nodes, output, {**arrays, name: plus})
            - value(nodes, output, {**arrays, name: minus})
        ) / (2 * eps)
    return grad


def tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(a, requires_grad=a.dtype.kind == "f") for k, a in arrays.items()}


def close(a: Any, b: Any, tol: float = 1e-9) -> None:
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else b
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ------------------------------------------------------------------ grad
OBJECTIVE = [NodeSpec("loss", expr="sum(exp(w) * x) + sum(w * w * w) / 3")]


def torch_objective(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.exp(w) * x).sum() + (w * w * w).sum() / 3


def test_grad_first_and_second_order_and_hvp_against_torch() -> None:
    arrays = {"w": RNG.standard_normal(4), "x": RNG.standard_normal(4), "v": RNG.standard_normal(4)}
    nodes = [
        *OBJECTIVE,
        NodeSpec("g", op="grad", args=["loss", "w"]),
        NodeSpec("hv", expr="grad(sum(g * v), w)"),
    ]
    program, result = run(nodes, ["g", "hv"], arrays)
    t = tensors(arrays)
    (g,) = torch.autograd.grad(torch_objective(t["w"], t["x"]), t["w"], create_graph=True)
    (hv,) = torch.autograd.grad((g * t["v"]).sum(), t["w"])
    close(result.outputs["g"], g)
    close(result.outputs["hv"], hv)
    # As torch.func.grad: w is differentiated whether or not it requires grad, and the
    # result requires grad only where an input that does flows into it.
    assert not any(program.requires_grad[s] for _, s in program.outputs)


def test_grad_with_an_upstream_gradient_is_a_vjp() -> None:
    arrays = {
        "w": RNG.standard_normal((3, 2)),
        "a": RNG.standard_normal((4, 3)),
        "v": RNG.standard_normal((4, 2)),
    }
    nodes = [NodeSpec("y", expr="tanh(a @ w)"), NodeSpec("g", expr="grad(y, w, v)")]
    _, result = run(nodes, ["g"], arrays)
    t = tensors(arrays)
    (g,) = torch.autograd.grad(torch.tanh(t["a"] @ t["w"]), t["w"], t["v"])
    close(result.outputs["g"], g)


def test_grad_of_an_unused_value_is_zeros_and_of_an_intermediate_node() -> None:
    arrays = {"w": RNG.standard_normal(3), "z": RNG.standard_normal((2, 2))}
    nodes = [
        NodeSpec("m", expr="w * 2"),
        NodeSpec("loss", expr="sum(sin(m))"),
        NodeSpec("gz", expr="grad(loss, z)"),
        NodeSpec("gm", expr="grad(loss, m)"),
    ]
    _, result = run(nodes, ["gz", "gm"], arrays)
    assert result.outputs["gz"].shape == (2, 2) and not result.outputs["gz"].any()
    close(result.outputs["gm"], np.cos(arrays["w"] * 2))


def test_grad_results_are_differentiated_again_by_backward() -> None:
    """A third derivative: /backward through an HVP, against torch and finite
    differences."""
    arrays = {"w": RNG.standard_normal(3), "x": RNG.standard_normal(3), "v": RNG.standard_normal(3)}
    nodes = [
        *OBJECTIVE,
        NodeSpec("g", expr="grad(loss, w)"),
        NodeSpec("hv", expr="grad(sum(g * v), w)"),
        NodeSpec("out", expr="sum(hv * hv)"),
    ]
    program, result = run(nodes, ["out"], arrays, requires=["w"], backward=True)
    assert program.grad_fn[program.outputs[0][1]] == "SumBackward"
    t = tensors(arrays)
    (g,) = torch.autograd.grad(torch_objective(t["w"], t["x"]), t["w"], create_graph=True)
    (hv,) = torch.autograd.grad((g * t["v"]).sum(), t["w"], create_graph=True)
    (gw,) = torch.autograd.grad((hv * hv).sum(), t["w"])
    close(result.gradients["w"], gw)
    close(result.gradients["w"], finite_difference(nodes, "out", arrays, "w"), tol=1e-5)


def test_grad_nodes_over_one_target_share_one_derivation() -> None:
    arrays = {"w": RNG.standard_normal(3), "x": RNG.standard_normal(3)}
    one = [*OBJECTIVE, NodeSpec("gw", expr="grad(loss, w)")]
    two = [*one, NodeSpec("gx", expr="grad(loss, x)")]
    both = [*two, NodeSpec("again", expr="grad(loss, w)")]
    p1, _ = run(one, ["gw"], arrays)
    p2, r2 = run(two, ["gw", "gx"], arrays)
    p3, r3 = run(both, ["gw", "gx", "again"], arrays)
    # x's gradient is one more step (exp(w) times the upstream 1), not a second backward.
    assert len(p2.steps) - len(p1.steps) <= 2
    assert len(p3.steps) == len(p2.steps)
    close(r3.outputs["again"], r2.outputs["gw"])
    close(r2.outputs["gx"], np.exp(arrays["w"]))


def test_grad_under_no_grad_computes_the_derivative_and_keeps_nothing() -> None:
    arrays = {"w": RNG.standard_normal(5), "x": RNG.standard_normal(5)}
    nodes = [*OBJECTIVE, NodeSpec("g", expr="grad(loss, w)")]
    program, result = run(nodes, ["g"], arrays, requires=["w"], no_grad=True)
    close(result.outputs["g"], np.exp(arrays["w"]) * arrays["x"] + arrays["w"] ** 2)
    assert not program.held  # nothing kept for an outer backward
    assert not program.requires_grad[program.outputs[0][1]]


def test_grad_errors_name_the_node() -> None:
    arrays = {
        "w": RNG.standard_normal(3),
        "i": np.arange(3),
        "v": RNG.standard_normal(2),
        "v32": RNG.standard_normal(3).astype(np.float32),
    }
    cases = {
        "grad(w * 2, w)": ("BackwardError", "only a one-element target"),
        "grad(sum(w), i)": ("DTypeError", "floating point"),
        "grad(w * 2, w, v)": ("ShapeError", "grad_output has shape (2,)"),
        "grad(w * 2, w, v32)": ("DTypeError", "grad_output has dtype float32"),
        "grad(sum(w))": ("ArityError", "takes 2 or 3 arguments"),
        "grad(sum(w), 1.0)": ("DTypeError", "must be a tensor"),
    }
    for expr, (kind, text) in cases.items():
        (err,) = errors_of([NodeSpec("g", expr=expr)], ["g"], arrays)
        assert type(err).__name__ == kind and text in str(err), (expr, str(err))
        assert err.node == "g" and err.loc[:3] == ("graph", "nodes", 0), err.loc


# ------------------------------------------------------------------ jvp
def test_jvp_against_torch_func_jvp_and_differentiable() -> None:
    arrays = {
        "x": RNG.standard_normal(4),
        "t": RNG.standard_normal(4),
        "m": RNG.standard_normal((3, 4)),
    }
    nodes = [
        NodeSpec("y", expr="sin(m @ x) * sum(x * x)"),
        NodeSpec("j", expr="jvp(y, x, t)"),
        NodeSpec("s", expr="sum(j * j)"),
    ]
    _, result = run(
        nodes, ["j", "s"], arrays, requires=["x"], backward=True, grad_outputs={"j": np.ones(3)}
    )
    m, t = torch.tensor(arrays["m"]), torch.tensor(arrays["t"])

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(m @ x) * (x * x).sum()

    x = torch.tensor(arrays["x"], requires_grad=True)
    _, j = torch.func.jvp(f, (x,), (t,))
    close(result.outputs["j"], j)
    ((j * j).sum() + j.sum()).backward()
    close(result.gradients["x"], x.grad)


def test_dense_jacobian_by_jvp_columns_and_grad_rows() -> None:
    n, m = 3, 4
    arrays = {
        "x": RNG.standard_normal(n),
        "a": RNG.standard_normal((m, n)),
        **{f"e{i}": np.eye(n)[i] for i in range(n)},
        **{f"r{i}": np.eye(m)[i] for i in range(m)},
    }
    nodes = [NodeSpec("y", expr="tanh(a @ x) * sum(x)")]
    nodes += [NodeSpec(f"col{i}", expr=f"jvp(y, x, e{i})") for i in range(n)]
    nodes += [NodeSpec(f"row{i}", expr=f"grad(y, x, r{i})") for i in range(m)]
    nodes += [
        NodeSpec("jf", op="stack", args=[f"col{i}" for i in range(n)], attrs={"dim": 1}),
        NodeSpec("jr", op="stack", args=[f"row{i}" for i in range(m)], attrs={"dim": 0}),
    ]
    _, result = run(nodes, ["jf", "jr"], arrays)
    a = torch.tensor(arrays["a"])

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ x) * x.sum()

    x = torch.tensor(arrays["x"])
    close(result.outputs["jf"], torch.func.jacfwd(f)(x))
    close(result.outputs["jr"], torch.func.jacrev(f)(x))


def test_jvp_errors() -> None:
    arrays = {
        "x": RNG.standard_normal(3),
        "t2": RNG.standard_normal(2),
        "t32": RNG.standard_normal(3).astype(np.float32),
    }
    for expr, kind in {
        "jvp(x * 2, x, t2)": "ShapeError",
        "jvp(x * 2, x, t32)": "DTypeError",
        "jvp(x * 2, x)": "ArityError",
    }.items():
        (err,) = errors_of([NodeSpec("j", expr=expr)], ["j"], arrays)
        assert type(err).__name__ == kind and err.node == "j", (expr, str(err))


# ------------------------------------------------------------------ scan
def rnn_nodes(body_expr: str = "tanh(x @ w + h @ u + b)", **scan: Any) -> list[NodeSpec]:
    body = BodySpec(carry=["h"], xs=["x"], nodes=[NodeSpec("h2", expr=body_expr)], next={"h": "h2"})
    return [
        NodeSpec(
            "rnn",
            op="scan",
            args=["h0", "xs"],
            body=body,
            results={"h_last": "h", "hs": "h2"},
            attrs=scan,
        ),
        NodeSpec("loss", expr="sum(hs * hs) + sum(h_last)"),
    ]


def rnn_arrays(steps: int = 6, batch: int = 2, d: int = 3, h: int = 4) -> dict[str, np.ndarray]:
    return {
        "xs": RNG.standard_normal((steps, batch, d)),
        "w": RNG.standard_normal((d, h)),
        "u": RNG.standard_normal((h, h)) * 0.5,
        "b": RNG.standard_normal(h),
        "h0": RNG.standard_normal((batch, h)),
    }


def torch_rnn(t: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, hs = t["h0"], []
    for x in t["xs"]:
        h = torch.tanh(x @ t["w"] + h @ t["u"] + t["b"])
        hs.append(h)
    stacked = torch.stack(hs)
    return (stacked * stacked).sum() + h.sum(), stacked, h


def test_scan_against_a_python_loop_forward_and_gradients() -> None:
    arrays = rnn_arrays()
    _, result = run(rnn_nodes(), ["loss", "hs", "h_last"], arrays, no_grad=True)
    t = tensors(arrays)
    loss, hs, h = torch_rnn(t)
    close(result.outputs["hs"], hs)
    close(result.outputs["h_last"], h)
    names = list(arrays)
    _, result = run(rnn_nodes(), ["loss"], arrays, requires=names, backward=True)
    close(result.outputs["loss"], loss)
    grads = torch.autograd.grad(loss, [t[n] for n in names])
    for name, g in zip(names, grads, strict=True):
        close(result.gradients[name], g)
    for name in ("u", "h0"):
        close(
            result.gradients[name], finite_difference(rnn_nodes(), "loss", arrays, name), tol=1e-5
        )


def test_scan_reports_requires_grad_and_grad_fn_as_a_loop_would() -> None:
    arrays = rnn_arrays()
    program, _ = run(rnn_nodes(), ["hs", "h_last", "loss"], arrays, requires=["w"])
    slots = dict(program.outputs)
    assert [program.grad_fn[slots[n]] for n in ("hs", "h_last", "loss")] == [
        "StackBackward",
        "TanhBackward",
        "AddBackward",
    ]
    # An input that nothing requiring grad reaches keeps no grad_fn.
    program, _ = run(rnn_nodes(), ["hs"], arrays)
    assert not program.requires_grad[program.outputs[0][1]]


def test_a_loop_nothing_differentiates_keeps_no_residuals() -> None:
    arrays = rnn_arrays(steps=50)
    forward, r1 = run(rnn_nodes(), ["loss"], arrays, no_grad=True)
    trained, r2 = run(rnn_nodes(), ["loss"], arrays, requires=["u"], backward=True)
    (loop,) = [s for s in forward.steps if s.op.name == "scan"]
    assert len(loop.attrs["body"].ys) == 1  # hs only
    # u's gradient reads each step's carry and tanh's result, which hs already stacks: the
    # carry is read from hs one step back (and h0 at the first), not stacked again.
    scans = [s for s in trained.steps if s.op.name == "scan"]
    assert len(scans) == 2 and len(scans[0].attrs["body"].ys) == 1
    assert len(scans[1].attrs["body"].shifted) == 1
    assert r2.planned_peak_bytes > r1.planned_peak_bytes


def test_a_carry_and_its_next_value_are_stacked_once() -> None:
    """The same derivative, derived to be differentiated again (a `grad` node: both
    stacks) and to run once (/backward: one): the plan saves a stack of the carry, and the
    gradients are the same, bit for bit."""
    steps, arrays = 50, rnn_arrays(steps=50)
    _, r1 = run(rnn_nodes(), ["loss"], arrays, requires=["u"], backward=True)
    twice, r2 = run([*rnn_nodes(), NodeSpec("g", expr="grad(loss, u)")], ["g"], arrays)
    assert next(len(s.attrs["body"].ys) for s in twice.steps if s.op.name == "scan") == 2
    assert r1.gradients["u"].tobytes() == r2.outputs["g"].tobytes()
    carry = arrays["h0"].nbytes
    loss = 8  # (the backward's program also holds its output, the loss)
    assert r2.planned_peak_bytes - r1.planned_peak_bytes == steps * carry - loss


def test_long_scan_plans_its_memory_exactly() -> None:
    arrays = rnn_arrays(steps=10_000, batch=1, d=2, h=3)
    program, result = run(rnn_nodes(), ["loss"], arrays, requires=["w", "u"], backward=True)
    assert result.peak_bytes == result.planned_peak_bytes
    t = tensors(arrays)
    loss, _, _ = torch_rnn(t)
    close(result.outputs["loss"], loss, tol=1e-7)
    (gu,) = torch.autograd.grad(loss, t["u"])
    close(result.gradients["u"], gu, tol=1e-7)
    assert program.nodes < 20  # the body counts once


def test_scan_without_sequences_literal_carries_and_next_anywhere() -> None:
    """A counter and a running sum as number-literal carries, a carry whose next value is
    an outer value, and attrs.length for the step count."""
    body = BodySpec(
        carry=["i", "acc", "k"],
        xs=[],
        nodes=[NodeSpec("i2", expr="i + 1"), NodeSpec("acc2", expr="acc + w * i2")],
        next={"i": "i2", "acc": "acc2", "k": "w"},
    )
    nodes = [
        NodeSpec(
            "loop",
            op="scan",
            args=[0, 0.0, "w"],
            body=body,
            results={"n": "i", "total": "acc", "kk": "k", "path": "acc2"},
            attrs={"length": 4},
        )
    ]
    arrays = {"w": np.array(1.5, dtype=np.float32)}  # (a carry keeps its dtype: float32)
    _, result = run(nodes, ["n", "total", "kk", "path"], arrays)
    assert result.outputs["n"] == 4 and result.outputs["n"].dtype == np.int64
    close(result.outputs["total"], 1.5 * (1 + 2 + 3 + 4))
    close(result.outputs["path"], 1.5 * np.cumsum([1, 2, 3, 4]))
    assert result.outputs["total"].dtype == np.float32


def test_length_zero_scan_gives_its_initial_carries_and_empty_stacks() -> None:
    arrays = {**rnn_arrays(steps=0), "xs": np.zeros((0, 2, 3))}
    names = ["w", "h0"]
    _, result = run(rnn_nodes(), ["loss", "hs", "h_last"], arrays)
    assert result.outputs["hs"].shape == (0, 2, 4)
    close(result.outputs["h_last"], arrays["h0"])
    _, result = run(rnn_nodes(), ["loss"], arrays, requires=names, backward=True)
    close(result.gradients["h0"], np.ones((2, 4)))
    assert not result.gradients["w"].any()


def test_grad_inside_a_body_differentiates_one_step_and_cost_stays_linear() -> None:
    """Gradient descent as a loop: each step takes grad of a loss at the current point."""

    def descent(steps: int) -> list[NodeSpec]:
        body = BodySpec(
            carry=["p"],
            xs=[],
            nodes=[
                NodeSpec("f", expr="sum((p - target) ** 2) + sum(p ** 4) / 4"),
                NodeSpec("p2", expr="p - 0.1 * grad(f, p)"),
            ],
            next={"p": "p2"},
        )
        return [
            NodeSpec(
                "gd",
                op="scan",
                args=["p0"],
                body=body,
                results={"p_end": "p"},
                attrs={"length": steps},
            ),
            NodeSpec("loss", expr="sum(p_end * p_end)"),
        ]

    arrays = {"p0": RNG.standard_normal(3), "target": RNG.standard_normal(3)}
    _, result = run(descent(5), ["loss"], arrays, requires=["p0", "target"], backward=True)
    t = tensors(arrays)
    p = t["p0"]
    for _ in range(5):
        f = ((p - t["target"]) ** 2).sum() + (p**4).sum() / 4
        (g,) = torch.autograd.grad(f, p, create_graph=True)
        p = p - 0.1 * g
    loss = (p * p).sum()
    close(result.outputs["loss"], loss)
    for name, g in zip(
        ("p0", "target"), torch.autograd.grad(loss, [t["p0"], t["target"]]), strict=True
    ):
        close(result.gradients[name], g)
    close(
        result.gradients["target"],
        finite_difference(descent(5), "loss", arrays, "target"),
        tol=1e-5,
    )
    cost = {
        n: compile_graph(
            GraphSpec(descent(n), ["loss"]), spec_of(arrays, ["p0"]), backward=True
        ).compute_cost
        for n in (100, 1000)
    }
    assert cost[1000] <= 12 * cost[100]


def test_nested_inner_descent_in_an_outer_objective_like_saddle() -> None:
    """GradBench's saddle: an inner two-step gradient descent on y inside the objective
    of x, differentiated with respect to x (a scan inside a grad target)."""
    body = BodySpec(
        carry=["y"],
        xs=[],
        nodes=[
            NodeSpec("inner", expr="sum(x * y) - sum(y * y) - sum(y ** 4) / 10"),
            NodeSpec("y2", expr="y + 0.1 * grad(inner, y)"),
        ],
        next={"y": "y2"},
    )
    nodes = [
        NodeSpec(
            "ascent",
            op="scan",
            args=["y0"],
            body=body,
            results={"y_star": "y"},
            attrs={"length": 2},
        ),
        NodeSpec("outer", expr="sum(x * x) + sum(x * y_star) + sum(y_star ** 2)"),
        NodeSpec("gx", expr="grad(outer, x)"),
    ]
    arrays = {"x": RNG.standard_normal(2), "y0": RNG.standard_normal(2)}
    _, result = run(nodes, ["outer", "gx"], arrays)
    t = tensors(arrays)
    y = t["y0"]
    for _ in range(2):
        inner = (t["x"] * y).sum() - (y * y).sum() - (y**4).sum() / 10
        (g,) = torch.autograd.grad(inner, y, create_graph=True)
        y = y + 0.1 * g
    outer = (t["x"] * t["x"]).sum() + (t["x"] * y).sum() + (y**2).sum()
    (gx,) = torch.autograd.grad(outer, t["x"])
    close(result.outputs["outer"], outer)
    close(result.outputs["gx"], gx)


def test_scan_inside_scan_and_hvp_through_a_loop() -> None:
    inner = BodySpec(
        carry=["c"], xs=["r"], nodes=[NodeSpec("c2", expr="sin(c * r + a)")], next={"c": "c2"}
    )
    outer = BodySpec(
        carry=["a"],
        xs=["row"],
        nodes=[
            NodeSpec("in", op="scan", args=["a", "row"], body=inner, results={"c_end": "c"}),
            NodeSpec("a2", expr="a * 0.5 + c_end"),
        ],
        next={"a": "a2"},
    )
    nodes = [
        NodeSpec("out", op="scan", args=["a0", "m"], body=outer, results={"a_end": "a"}),
        NodeSpec("loss", expr="sum(a_end * a_end)"),
        NodeSpec("g", expr="grad(loss, m)"),
        NodeSpec("hv", expr="grad(sum(g * v), m)"),
    ]
    arrays = {
        "a0": RNG.standard_normal(2),
        "m": RNG.standard_normal((3, 4, 2)),
        "v": RNG.standard_normal((3, 4, 2)),
    }
    _, result = run(nodes, ["loss", "g", "hv"], arrays)
    t = tensors(arrays)

    def f(m: torch.Tensor) -> torch.Tensor:
        a = t["a0"]
        for row in m:
            c = a
            for r in row:
                c = torch.sin(c * r + a)
            a = a * 0.5 + c
        return (a * a).sum()

    loss = f(t["m"])
    (g,) = torch.autograd.grad(loss, t["m"], create_graph=True)
    (hv,) = torch.autograd.grad((g * t["v"]).sum(), t["m"])
    close(result.outputs["loss"], loss)
    close(result.outputs["g"], g)
    close(result.outputs["hv"], hv)


def test_jvp_through_a_scan() -> None:
    arrays = {**rnn_arrays(steps=4), "t": RNG.standard_normal((2, 4))}
    nodes = [*rnn_nodes(), NodeSpec("j", expr="jvp(hs, h0, t)")]
    _, result = run(nodes, ["j"], arrays)
    t = tensors(arrays)

    def f(h0: torch.Tensor) -> torch.Tensor:
        return torch_rnn({**t, "h0": h0})[1]

    _, j = torch.func.jvp(f, (t["h0"].detach(),), (t["t"].detach(),))
    close(result.outputs["j"], j)


def test_reverse_gradient_of_a_scan_over_several_sequences_and_carries() -> None:
    body = BodySpec(
        carry=["s", "p"],
        xs=["a", "c"],
        nodes=[
            NodeSpec("s2", expr="s + a * c * p"),
            NodeSpec("p2", expr="p * cos(a)"),
            NodeSpec("y", expr="s2 * p2"),
        ],
        next={"s": "s2", "p": "p2"},
    )
    nodes = [
        NodeSpec(
            "loop",
            op="scan",
            args=["s0", "p0", "as_", "cs"],
            body=body,
            results={"s_end": "s", "ys": "y"},
        ),
        NodeSpec("loss", expr="sum(ys) + s_end"),
    ]
    arrays = {
        "s0": np.array(0.3),
        "p0": np.array(1.0),
        "as_": RNG.standard_normal(7),
        "cs": RNG.standard_normal(7),
    }
    _, result = run(nodes, ["loss"], arrays, requires=list(arrays), backward=True)
    for name in arrays:
        close(result.gradients[name], finite_difference(nodes, "loss", arrays, name), tol=1e-5)


# ------------------------------------------------------------------ scan errors
def scan_error(
    body: BodySpec,
    args: Sequence[Any] = ("h0", "xs"),
    results: Mapping[str, str] | None = None,
    attrs: Mapping[str, Any] | None = None,
    extra: Sequence[NodeSpec] = (),
    outputs: Sequence[str] = ("r",),
) -> Any:
    nodes = [
        NodeSpec(
            "rnn",
            op="scan",
            args=list(args),
            body=body,
            results=dict(results or {"r": "h"}),
            attrs=dict(attrs or {}),
        ),
        *extra,
    ]
    errs = errors_of(nodes, outputs, rnn_arrays())
    return errs[0]


def test_scan_errors_name_the_scan_and_the_body_node() -> None:
    def body(expr: str = "tanh(x @ w + h @ u + b)", **kw: Any) -> BodySpec:
        return BodySpec(
            **{
                "carry": ["h"],
                "xs": ["x"],
                "nodes": [NodeSpec("h2", expr=expr)],
                "next": {"h": "h2"},
                **kw,
            }
        )

    err = scan_error(body("sum(h, dim=1)"))
    assert type(err).__name__ == "ShapeError" and err.node == "h2"
    assert "carry 'h'" in str(err) and "'rnn'" in str(err)
    assert err.loc == ("graph", "nodes", 0, "body", "next", "h")
    err = scan_error(body("x @ w + h @ u > 0"))
    assert type(err).__name__ == "DTypeError" and err.node == "h2"
    err = scan_error(body("tanh(x @ nowhere)"))
    assert "unknown reference 'nowhere'" in str(err) and "in the body of scan 'rnn'" in str(err)
    assert err.loc[:6] == ("graph", "nodes", 0, "body", "nodes", 0) and err.node == "h2"
    err = scan_error(body("x @ w @ w"))  # (2, 4) @ (3, 4): the body node's shape error
    assert type(err).__name__ == "ShapeError" and err.node == "h2"
    assert err.loc == ("graph", "nodes", 0, "body", "nodes", 0)
    err = scan_error(body(), extra=[NodeSpec("use", expr="rnn * 2")], outputs=["use"])
    assert "'rnn' is a scan node, not a value" in str(err) and "'r'" in str(err)
    err = scan_error(body(carry=["w"], next={"w": "h2"}))
    assert "is also a name of the enclosing graph" in str(err)
    err = scan_error(
        BodySpec(carry=["h"], xs=["x"], nodes=[NodeSpec("b", expr="h")], next={"h": "b"})
    )
    assert "node id 'b' is also a name of the enclosing graph" in str(err)
    err = scan_error(body(), results={"w": "h"})
    assert "result id 'w' is also the name of an input" in str(err)
    err = scan_error(body(), args=["h0"])
    assert type(err).__name__ == "ArityError" and "takes 2 arguments" in str(err)
    err = scan_error(body(), attrs={"length": 5})
    assert "has 6 steps but attrs.length has 5" in str(err)
    err = scan_error(BodySpec(carry=["h"], xs=[], nodes=[], next={"h": "h"}), args=["h0"])
    assert "needs attrs.length" in str(err)
    err = scan_error(body(), attrs={"length": -1})
    assert "attrs.length must be >= 0" in str(err) and err.loc[-1] == "length"
    err = scan_error(body(next={}))
    assert "no next value for the carry 'h'" in str(err)
    err = scan_error(body(), results={"r": "x"})
    assert "neither a carry nor a node of the body" in str(err)


def test_body_nodes_count_once_against_the_node_limit() -> None:
    body = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[NodeSpec("h2", expr="tanh(x @ w + h @ u + b)")],
        next={"h": "h2"},
    )
    nodes = [NodeSpec("rnn", op="scan", args=["h0", "xs"], body=body, results={"r": "h"})]
    arrays = rnn_arrays(steps=1000)
    program = compile_graph(GraphSpec(nodes, ["r"]), spec_of(arrays), limits=Limits(max_nodes=6))
    assert program.nodes == 5
    with pytest.raises(ValidationErrors, match="expands to 6 op nodes; the limit is 5"):
        compile_graph(GraphSpec(nodes, ["r"]), spec_of(arrays), limits=Limits(max_nodes=5))


def test_a_loop_over_the_budgets_is_refused_before_it_runs() -> None:
    """The residuals a differentiated loop keeps count in its planned memory, and its
    steps times its length in its cost."""
    arrays = rnn_arrays(steps=2000)
    specs = spec_of(arrays, ["u"])
    graph = GraphSpec(rnn_nodes(), ["loss"])
    planned = compile_graph(graph, specs, backward=True).planned_peak_bytes
    forward = compile_graph(graph, specs, no_grad=True).planned_peak_bytes
    assert planned > forward + 2000 * 2 * 4 * 8  # at least one stacked carry per step
    with pytest.raises(MemoryBudgetError):
        compile_graph(
            graph, specs, backward=True, limits=Limits(memory_budget_bytes=(planned + forward) // 2)
        )
    body = BodySpec(carry=["c"], xs=[], nodes=[NodeSpec("c2", expr="c + 1.0")], next={"c": "c2"})
    endless = GraphSpec(
        [
            NodeSpec(
                "loop",
                op="scan",
                args=[0.0],
                body=body,
                results={"end": "c"},
                attrs={"length": 10**12},
            )
        ],
        ["end"],
    )
    with pytest.raises(ComputeBudgetError, match="'loop'"):
        compile_graph(endless, {}, limits=Limits(compute_budget=5e12))


def test_loops_and_derivatives_on_a_strict_array_api_backend(backend_name: str) -> None:
    """A differentiated scan with a grad node in its body, and an in-graph HVP, on NumPy
    and on array-api-strict (which stands in for CuPy on hosts without a GPU)."""
    from gradserve.engine.backends import get_backend

    arrays = {**rnn_arrays(steps=5), "v": RNG.standard_normal((3, 4))}
    body = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[
            NodeSpec("e", expr="sum(tanh(x @ w + h @ u + b) ** 2)"),
            NodeSpec("h2", expr="h - 0.1 * grad(e, h)"),
        ],
        next={"h": "h2"},
    )
    nodes = [
        NodeSpec("loop", op="scan", args=["h0", "xs"], body=body, results={"hs": "h2"}),
        NodeSpec("loss", expr="sum(hs * hs)"),
        NodeSpec("g", expr="grad(loss, w)"),
        NodeSpec("hv", expr="grad(sum(g * v), w)"),
    ]
    program = compile_graph(
        GraphSpec(nodes, ["hv"]),
        spec_of(arrays, ["u"]),
        backward=True,
        grad_outputs=spec_of({"hv": np.ones((3, 4))}),
    )
    backend = get_backend("cpu")
    result = execute(
        program,
        {k: backend.from_host(a) for k, a in arrays.items()},
        grad_outputs={"hv": backend.from_host(np.ones((3, 4)))},
        verify=True,
    )
    assert result.peak_bytes == result.planned_peak_bytes
    t = tensors(arrays)
    h, hs = t["h0"], []
    for x in t["xs"]:
        e = (torch.tanh(x @ t["w"] + h @ t["u"] + t["b"]) ** 2).sum()
        (gh,) = torch.autograd.grad(e, h, create_graph=True)
        h = h - 0.1 * gh
        hs.append(h)
    loss = (torch.stack(hs) ** 2).sum()
    (g,) = torch.autograd.grad(loss, t["w"], create_graph=True)
    (hv,) = torch.autograd.grad((g * t["v"]).sum(), t["w"], create_graph=True)
    (gu,) = torch.autograd.grad(hv.sum(), t["u"])
    close(np.asarray(backend.to_host(result.outputs["hv"])), hv)
    close(np.asarray(backend.to_host(result.gradients["u"])), gu)


def test_body_aliases_of_outer_values_are_closures() -> None:
    """A body node that is just an outer name (an alias), read by another body node, given
    as a carry's next value, and declared as a result."""
    body = BodySpec(
        carry=["c", "k"],
        xs=["x"],
        nodes=[NodeSpec("a", expr="w"), NodeSpec("c2", expr="c + x * a")],
        next={"c": "c2", "k": "a"},
    )
    nodes = [
        NodeSpec(
            "loop",
            op="scan",
            args=["c0", "c0", "xs"],
            body=body,
            results={"end": "c", "k_end": "k", "ws": "a"},
        )
    ]
    arrays = {"c0": np.array(1.0), "w": np.array(2.0), "xs": np.arange(3.0)}
    _, result = run(nodes, ["end", "k_end", "ws"], arrays)
    close(result.outputs["end"], 1.0 + 2.0 * (0 + 1 + 2))
    close(result.outputs["k_end"], 2.0)
    close(result.outputs["ws"], [2.0, 2.0, 2.0])
