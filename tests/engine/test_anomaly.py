"""detect_anomaly (engine.graph.executor.Watch): the first step that makes NaN or infinite
values from finite inputs raises NonFiniteError naming its node, phase and primitive (a
backward step's: the forward primitive it differentiates, as PyTorch's `SqrtBackward0`);
values already non-finite in an input are never blamed; without the flag they flow as in
PyTorch; and a clean run answers exactly as a plain one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from gradserve.engine.errors import NonFiniteError
from gradserve.engine.graph import BodySpec, GraphSpec, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import Program
from tests.support.objectives import OBJECTIVES, objective_data


def compiled(
    nodes: Sequence[NodeSpec],
    output: str,
    arrays: Mapping[str, np.ndarray],
    requires: Sequence[str],
) -> Program:
    specs = {k: TensorSpec(a.shape, str(a.dtype), k in requires) for k, a in arrays.items()}
    return compile_graph(GraphSpec(list(nodes), [output]), specs, backward=bool(requires))


def anomaly(
    nodes: Sequence[NodeSpec],
    arrays: Mapping[str, np.ndarray],
    requires: Sequence[str] = ("x",),
    output: str = "y",
) -> NonFiniteError:
    program = compiled(nodes, output, arrays, requires)
    execute(program, dict(arrays))  # without the flag: no error, whatever it makes
    with pytest.raises(NonFiniteError) as info:
        execute(program, dict(arrays), detect_anomaly=True)
    return info.value


def where(err: NonFiniteError) -> tuple[str | None, str, str | None, int]:
    return err.node, err.phase, err.op, err.count


def test_a_forward_nan_log_of_a_negative() -> None:
    nodes = [NodeSpec("l", expr="log(x)"), NodeSpec("y", expr="sum(l)")]
    err = anomaly(nodes, {"x": np.array([1.0, -1.0, -2.0])})
    assert where(err) == ("l", "forward", "log", 2)
    assert "2 of 3 values of 'log' are NaN or infinite" in str(err)


def test_a_forward_inf_exp_overflow_in_an_op_node() -> None:
    nodes = [NodeSpec("e", op="exp", args=["x"]), NodeSpec("y", op="sum", args=["e"])]
    err = anomaly(nodes, {"x": np.array([1.0, 1000.0])})
    assert where(err) == ("e", "forward", "exp", 1)


def test_a_backward_nan_sqrt_at_zero_times_zero() -> None:
    """PyTorch's detect_anomaly names SqrtBackward0 for the same graph."""
    x = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="SqrtBackward0"):
        (torch.sqrt(x) * 0).backward()
    arrays = {"x": np.array(0.0)}
    op_form = [NodeSpec("s", op="sqrt", args=["x"]), NodeSpec("y", op="mul", args=["s", 0.0])]
    assert where(anomaly(op_form, arrays)) == ("s", "backward", "sqrt", 1)
    expr_form = [NodeSpec("y", expr="sqrt(x) * 0")]  # (one node, two primitives)
    err = anomaly(expr_form, arrays)
    assert where(err) == ("y", "backward", "sqrt", 1)
    assert "the derivative of 'sqrt' (in the backward)" in str(err)


def test_a_non_finite_input_is_not_blamed_on_the_ops_it_flows_through() -> None:
    nodes = [NodeSpec("l", expr="log(x) * 2 + inf_free"), NodeSpec("y", expr="sum(l)")]
    arrays = {"x": np.array([np.nan, 1.0, np.inf]), "inf_free": np.array([1.0, 2.0, 3.0])}
    program = compiled(nodes, "y", arrays, ["x"])
    plain = execute(program, dict(arrays))
    watched = execute(program, dict(arrays), detect_anomaly=True)
    assert np.isnan(watched.outputs["y"]) and np.isnan(plain.outputs["y"])
    np.testing.assert_array_equal(watched.gradients["x"], plain.gradients["x"])
    np.testing.assert_array_equal(watched.gradients["x"], [np.nan, 2.0, 0.0])


def test_an_overflow_no_flag_announces_is_found_step_by_step() -> None:
    """BLAS raises no floating-point flag: the answer's infinities send the run through a
    second, step-by-step look."""
    arrays = {"x": np.full((2, 2), 1e200)}
    err = anomaly([NodeSpec("m", expr="x @ x"), NodeSpec("y", expr="sum(m)")], arrays)
    assert where(err) == ("m", "forward", "matmul", 4)


def test_an_anomaly_inside_a_scan_body_names_the_body_node() -> None:
    body = BodySpec(carry=["h"], xs=[], nodes=[NodeSpec("h2", expr="h * 10")], next={"h": "h2"})
    nodes = [
        NodeSpec(
            "loop", op="scan", args=["h0"], body=body, results={"hT": "h"}, attrs={"length": 400}
        ),
        NodeSpec("y", expr="sum(hT)"),
    ]
    err = anomaly(nodes, {"h0": np.array([1.0, 2.0])}, requires=("h0",))
    assert where(err) == ("h2", "forward", "mul", 1)  # (2 * 10**308 first)


def test_a_cast_to_float16_that_overflows_is_blamed() -> None:
    nodes = [NodeSpec("y", expr="sum(x * 1e5)")]
    arrays = {"x": np.array([1.0, 2.0], dtype=np.float16)}
    err = anomaly(nodes, arrays)
    assert err.phase == "forward" and err.node == "y"


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_clean_run_answers_as_a_plain_one_bit_for_bit(name: str) -> None:
    nodes, output, requires, _ = OBJECTIVES[name]
    arrays = objective_data()
    program = compiled(nodes, output, arrays, requires)
    plain = execute(program, dict(arrays))
    watched = execute(program, dict(arrays), detect_anomaly=True, verify=True)
    for part in ("outputs", "gradients"):
        got: dict[str, Any] = getattr(watched, part)
        for k, v in getattr(plain, part).items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{name} {part} {k}")
    assert np.geterr()["invalid"] == "warn"  # (the traps are the run's alone)
