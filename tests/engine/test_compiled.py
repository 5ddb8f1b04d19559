"""Every op sample through the compiled path (engine.graph): the static shape rule against
the forward, values and gradients against the eager engine (bit for bit: the same kernels)
and against PyTorch, second order by differentiating the program twice, planned against
measured memory; on NumPy and again on array-api-strict."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import gradserve.engine as engine
from gradserve.engine.backends import get_backend
from gradserve.engine.graph import GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.ops import OPS
from tests.support.op_samples import ERRORS, TORCH, Sample
from tests.support.ops import engine_args, op_cases, run, torch_args
from tests.support.programs import (
    differentiated_twice,
    forward_program,
    with_gradients,
)


def _run(program: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`execute` on the current CPU backend (NumPy, or array-api-strict), results on the host,
    with every step's result checked against its shape rule."""
    backend = get_backend("cpu")
    result = execute(program, {k: backend.from_host(a) for k, a in arrays.items()}, verify=True)
    result.outputs = {k: np.asarray(backend.to_host(v)) for k, v in result.outputs.items()}
    return result


def assert_same(got: Any, expected: Any) -> None:
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (
        got.shape,
        got.dtype,
        expected.shape,
        expected.dtype,
    )
    np.testing.assert_array_equal(got, expected)  # NaN equals NaN here


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_forward_is_the_eager_forward(
    name: str, sample: Sample, dtype: str, backend_name: str
) -> None:
    """One step: the shape rule equals the forward's shape and dtype (`verify`), the value
    is the eager one bit for bit, and the planned peak is the measured one."""
    program, arrays = forward_program(name, sample, dtype)
    result = _run(program, arrays)
    eager = run(name, engine_args(name, sample, dtype, False), sample.attrs)
    assert_same(result.outputs["out"], eager.numpy())
    assert result.peak_bytes == result.planned_peak_bytes


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_gradients_are_the_eager_gradients_and_torch(
    name: str, sample: Sample, backend_name: str
) -> None:
    program, arrays, wrt, upstream = with_gradients(name, sample)
    result = _run(program, arrays)
    assert result.peak_bytes == result.planned_peak_bytes

    eager_in = engine_args(name, sample, "float64", True)
    eager = run(name, eager_in, sample.attrs)
    eager.backward(np.asarray(upstream))
    ref_in = torch_args(name, sample, "float64", True)
    ref = TORCH[name](torch, *ref_in, **sample.attrs)
    ref.backward(torch.tensor(upstream))
    for k in wrt:
        i = int(k[1:])
        got = result.outputs.get(f"d{k}", np.zeros(arrays[k].shape))
        # The same VJP rules: equal up to where the eager plain backward calls NumPy's
        # operators and the program the op's kernel (pow's literal -0.5 is rsqrt there).
        np.testing.assert_allclose(
            got, eager_in[i].grad.numpy(), rtol=1e-14, atol=1e-300, equal_nan=True
        )
        np.testing.assert_allclose(
            got, ref_in[i].grad.numpy(), rtol=1e-7, atol=1e-9, equal_nan=True
        )


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_second_order_by_differentiating_the_program_twice(name: str, sample: Sample) -> None:
    """d/dx ⟨∂f/∂x · v, w⟩: the derived backward is differentiated again, as a program,
    against PyTorch's double backward."""
    if not sample.second_order:
        pytest.skip("PyTorch's double backward differs here on purpose (see the sample)")
    program, arrays, wrt = differentiated_twice(name, sample)
    result = _run(program, arrays)
    assert result.peak_bytes == result.planned_peak_bytes

    ref_in = torch_args(name, sample, "float64", True)
    ref = TORCH[name](torch, *ref_in, **sample.attrs)
    ref_wrt = [ref_in[int(k[1:])] for k in wrt]
    ref_firsts = torch.autograd.grad(
        ref, ref_wrt, torch.tensor(arrays["v"]), create_graph=True, allow_unused=True
    )
    ref_total = sum(
        (
            torch.sum(g * torch.tensor(arrays[f"w{k}"]))
            for g, k in zip(ref_firsts, wrt, strict=True)
            if g is not None and g.requires_grad
        ),
        torch.tensor(0.0, dtype=torch.float64),
    )
    ref_seconds = (
        torch.autograd.grad(ref_total, ref_wrt, allow_unused=True)
        if ref_total.requires_grad
        else [None] * len(wrt)
    )
    for k, ref_g in zip(wrt, ref_seconds, strict=True):
        expected = np.zeros(arrays[k].shape) if ref_g is None else ref_g.numpy(force=True)
        got = result.outputs.get(f"d{k}", np.zeros(arrays[k].shape))
        np.testing.assert_allclose(
            got,
            expected,
            rtol=1e-7,
            atol=1e-9,
            equal_nan=True,
            err_msg=f"second derivative w.r.t. {k}",
        )


# ---------------------------------------------------------------- the static rules, whole graphs


def _compile(nodes: list[NodeSpec], inputs: dict[str, TensorSpec], **kw: Any) -> Any:
    return compile_graph(GraphSpec(nodes=nodes, outputs=[nodes[-1].id]), inputs, **kw)


def test_stack_gives_its_new_dim_the_operand_count() -> None:
    x = TensorSpec((2, 3), "float32", True)
    program = _compile(
        [NodeSpec("s", expr="stack(x, y, x, dim=1)")],
        {"x": x, "y": x},
        backward=True,
        grad_outputs={"s": TensorSpec((2, 3, 3), "float32")},
    )
    assert program.metas[dict(program.outputs)["s"]].shape == (2, 3, 3)
    program = _compile(
        [NodeSpec("z", expr="transpose(stack(x, y), dim0=0, dim1=1) @ k")],
        {"x": x, "y": x, "k": TensorSpec((3, 4), "float32")},
    )
    assert program.metas[dict(program.outputs)["z"]].shape == (2, 2, 4)


def test_stacking_many_copies_is_planned_at_its_size() -> None:
    """Fifty copies of a 4 MB tensor are 200 MB, in the plan and in the run."""
    n = 1 << 20
    program = _compile(
        [NodeSpec("s", "stack", ["x"] * 50)], {"x": TensorSpec((n,), "float32")}, no_grad=True
    )
    assert program.planned_peak_bytes == 51 * 4 * n
    result = execute(program, {"x": np.ones(n, np.float32)}, verify=True)
    assert result.peak_bytes == program.planned_peak_bytes


def test_detach_is_its_input_array_and_counted_once() -> None:
    n = 1000
    program = _compile(
        [NodeSpec("d", "detach", ["x"]), NodeSpec("y", expr="d * 2")],
        {"x": TensorSpec((n,), "float64")},
        no_grad=True,
    )
    assert program.planned_peak_bytes == 2 * 8 * n
    result = execute(program, {"x": np.ones(n)}, verify=True)
    assert result.peak_bytes == program.planned_peak_bytes


_OPERATORS = {"sub": "__sub__", "neg": "__neg__", "abs": "__abs__"}


@pytest.mark.parametrize(
    "name", sorted(n for n, op in OPS.items() if op.check_args and n in _OPERATORS)
)
def test_operators_and_functions_check_the_same(name: str) -> None:
    """`x - y` and `engine.sub(x, y)` run the same checks: each error sample of an op with
    its own argument checks fails the same way through the op's operator."""
    operators = _OPERATORS
    for err in ERRORS[name]:
        args = [engine.tensor(a) if isinstance(a, np.ndarray) else a for a in err.args]
        if err.attrs or len(args) != len(OPS[name].args) or not isinstance(args[0], engine.Tensor):
            continue
        with pytest.raises(err.error) as by_function:
            getattr(engine, name)(*args)
        with pytest.raises(err.error) as by_operator:
            getattr(args[0], operators[name])(*args[1:])
        assert str(by_operator.value) == str(by_function.value)


def test_a_hundred_thousand_node_chain_compiles_and_runs() -> None:
    nodes = [NodeSpec("n0", "mul", ["x", 1.0])]
    nodes += [
        NodeSpec(f"n{i}", "add" if i % 2 else "mul", [f"n{i - 1}", 0.5 if i % 2 else 1.0])
        for i in range(1, 100_000)
    ]
    program = _compile(
        nodes,
        {"x": TensorSpec((), "float64", True)},
        backward=True,
        limits=Limits(max_nodes=100_000),
    )
    result = execute(program, {"x": np.float64(2.0)})
    assert result.outputs["n99999"] == 2.0 + 0.5 * 50_000
    assert result.gradients["x"] == 1.0 and result.nodes == 100_000


def test_a_zero_literal_keeps_its_sign_whatever_was_compiled_before() -> None:
    """0.0 == -0.0, but `x * -0.0` is not `x * 0.0` (nor `1 / (x * -0.0)` its `1 / (x * 0.0)`):
    the memos of decisions, VJP templates and kernels key a float literal by its sign too,
    so a program compiled after one with the other zero keeps its own."""
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    inputs = {"x": TensorSpec((3,), "float32", True)}
    for order in ((0.0, -0.0), (-0.0, 0.0)):
        for k in order:
            spec = GraphSpec(
                [
                    NodeSpec("m", "mul", ["x", k]),
                    NodeSpec("y", "div", [1.0, "m"]),
                    NodeSpec("s", "sum", ["m"]),
                ],
                ["y", "s"],
            )
            program = compile_graph(
                spec, inputs, backward=True, grad_outputs={"y": TensorSpec((3,), "float32")}
            )
            r = execute(program, {"x": x}, grad_outputs={"y": np.ones(3, np.float32)})
            want = x * np.float32(k)
            np.testing.assert_array_equal(np.signbit(r.outputs["y"]), np.signbit(1 / want))
            np.testing.assert_array_equal(r.outputs["y"], np.float32(1) / want)
            # d(1/m)/dx = -k / m**2: infinities of k's sign flipped
            assert np.all(np.isinf(r.gradients["x"]) | np.isnan(r.gradients["x"]))
            np.testing.assert_array_equal(np.signbit(r.outputs["s"]), np.signbit(want.sum()))
