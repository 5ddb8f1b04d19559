"""Loop rolling (engine.graph.rolling, compiler.roll_program): an unrolled loop of a
program becomes a `scan`, and the program answers bit for bit as the unrolled one
(outputs, gradients, nodes, grad_fn, requires_grad); a block that differs in one op,
dtype or shape, a value read from inside the run, a literal or an input of its own per
step leave it unrolled; a rolled program measures the memory it planned."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from gradserve.engine.graph import (
    GraphSpec,
    Limits,
    NodeSpec,
    Program,
    TensorSpec,
    compile_graph,
    execute,
)
from gradserve.engine.graph.compiler import roll_program, rolled_fraction
from gradserve.engine.graph.serial import dump_program, load_program
from tests.engine import test_compiled, test_transforms
from tests.support.objectives import OBJECTIVES, objective_data

RNG = np.random.default_rng(11)


def _cell(steps: int, outputs: tuple[str, ...] = (), per_step_input: bool = False) -> GraphSpec:
    """A recurrent cell as define-by-run records it: `steps` copies of its step, reading
    one input `x` (or an input x_t each)."""
    nodes, h = [], "h0"
    for t in range(steps):
        x = f"x{t}" if per_step_input else "x"
        nodes += [
            NodeSpec(f"a{t}", expr=f"{h} @ u + {x} @ w + b"),
            NodeSpec(f"h{t + 1}", expr=f"sigmoid(a{t} + 1.0) * {h} + sigmoid(a{t}) * tanh(a{t})"),
        ]
        h = f"h{t + 1}"
    nodes.append(NodeSpec("loss", expr=f"sum({h} * {h})"))
    return GraphSpec(nodes, ["loss", *outputs])


def _cell_data(steps: int = 0, dtype: str = "float64") -> dict[str, np.ndarray]:
    """The cell's inputs: x_t for `steps` steps, else one x."""
    xs = {f"x{t}": RNG.standard_normal((4, 5)) for t in range(steps)} or {
        "x": RNG.standard_normal((4, 5))
    }
    data = xs | {
        "w": RNG.standard_normal((5, 5)) * 0.4,
        "u": RNG.standard_normal((5, 5)) * 0.4,
        "b": RNG.standard_normal(5) * 0.1,
        "h0": RNG.standard_normal((4, 5)),
    }
    return {k: v.astype(dtype) for k, v in data.items()}


def _specs(data: dict[str, np.ndarray], wrt: Any = None) -> dict[str, TensorSpec]:
    return {k: TensorSpec(v.shape, str(v.dtype), wrt is None or k in wrt) for k, v in data.items()}


def _loops(program: Program | None) -> list[int]:
    """The lengths of the loops that rolling made."""
    if program is None:
        return []
    return [
        s.attrs["body"].length
        for s in program.steps
        if s.op.name == "scan" and s.attrs["body"].unrolled_nodes
    ]


def both_ways(spec: GraphSpec, data: dict[str, np.ndarray], **kw: Any) -> Program | None:
    """Compile `spec` and roll its program; both answer the same bits, report the same
    nodes, the same grad_fn and requires_grad for every output, and measure the memory
    they planned. Returns the rolled program (None: nothing rolled)."""
    specs = kw.pop("specs", None) or _specs(data)
    unrolled = compile_graph(spec, specs, **kw)
    assert not _loops(unrolled)
    rolled = roll_program(unrolled)
    if rolled is None:
        assert rolled_fraction(unrolled) == 1.0
        return None
    assert 0 < rolled_fraction(unrolled) < 1
    got, want = execute(rolled, data, verify=True), execute(unrolled, data, verify=True)
    assert got.nodes == want.nodes
    for k in want.outputs:
        np.testing.assert_array_equal(got.outputs[k], want.outputs[k], strict=True, err_msg=k)
    for k in want.gradients or {}:
        np.testing.assert_array_equal(got.gradients[k], want.gradients[k], strict=True, err_msg=k)  # type: ignore[index]
    assert [n for n, _ in rolled.outputs] == [n for n, _ in unrolled.outputs]
    assert [n for n, _ in rolled.gradients] == [n for n, _ in unrolled.gradients]
    for (name, slot), (_, other) in zip(rolled.outputs, unrolled.outputs, strict=True):
        assert rolled.grad_fn[slot] == unrolled.grad_fn[other], name
        assert rolled.requires_grad[slot] == unrolled.requires_grad[other], name
    assert got.peak_bytes == got.planned_peak_bytes
    return rolled


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_unrolled_cell_is_one_loop_and_answers_bit_for_bit(dtype: str) -> None:
    data = _cell_data(dtype=dtype)
    rolled = both_ways(_cell(24), data, backward=True)
    assert rolled is not None and _loops(rolled) == [24]
    unrolled = compile_graph(_cell(24), _specs(data), backward=True)
    assert len(rolled.steps) * 5 < len(unrolled.steps)


def test_forward_only_and_no_grad_are_rolled_too() -> None:
    data = _cell_data()
    assert _loops(both_ways(_cell(8), data)) == [8]
    assert _loops(both_ways(_cell(8), data, no_grad=True)) == [8]


def test_a_cell_whose_steps_read_an_input_each_is_not_rolled() -> None:
    """x_t per step: the loop would read them stacked, copies that the unrolled program's
    plan does not hold."""
    assert both_ways(_cell(8, per_step_input=True), _cell_data(8), backward=True) is None


def test_a_rolled_cell_has_the_gradients_of_finite_differences_and_torch() -> None:
    torch = pytest.importorskip("torch")
    data = _cell_data()
    program = roll_program(compile_graph(_cell(6), _specs(data), backward=True))
    assert program is not None and _loops(program) == [6]
    result = execute(program, data)
    for k, x in data.items():  # central differences, float64, along a random direction
        v = RNG.standard_normal(x.shape)
        up = execute(program, data | {k: x + 1e-6 * v}).outputs["loss"]
        down = execute(program, data | {k: x - 1e-6 * v}).outputs["loss"]
        np.testing.assert_allclose(
            (up - down) / 2e-6,
            np.sum(result.gradients[k] * v),  # type: ignore[index]
            rtol=1e-5,
            atol=1e-8,
            err_msg=k,
        )
    t = {k: torch.tensor(v, requires_grad=True) for k, v in data.items()}
    h = t["h0"]
    for _ in range(6):
        a = h @ t["u"] + t["x"] @ t["w"] + t["b"]
        h = torch.sigmoid(a + 1.0) * h + torch.sigmoid(a) * torch.tanh(a)
    loss = torch.sum(h * h)
    loss.backward()
    np.testing.assert_allclose(result.outputs["loss"], loss.detach().numpy(), rtol=1e-12)
    for k, tensor in t.items():
        np.testing.assert_allclose(result.gradients[k], tensor.grad.numpy(), rtol=1e-10, err_msg=k)  # type: ignore[index, union-attr]


def _chain(
    steps: int, differ: int | None = None, how: str = ""
) -> tuple[GraphSpec, dict[str, Any]]:
    """h_i = sin(h_{i-1}) * c over 8 values; step `differ` another op (`how` "op"), or
    reading a c of another dtype or shape."""
    other = {"op": "c", "dtype": "c32", "shape": "c1"}.get(how, "c")
    nodes = []
    for i in range(1, steps + 1):
        fn = "cos" if i == differ and how == "op" else "sin"
        nodes.append(NodeSpec(f"h{i}", expr=f"{fn}(h{i - 1}) * {other if i == differ else 'c'}"))
    nodes.append(NodeSpec("loss", "sum", [f"h{steps}"]))
    c = RNG.uniform(0.5, 1.0, 8)
    data = {"h0": RNG.standard_normal(8), "c": c, "c32": c.astype(np.float32), "c1": c[:1]}
    return GraphSpec(nodes, ["loss"]), data


def test_a_chain_is_rolled() -> None:
    spec, data = _chain(12)
    assert _loops(both_ways(spec, data, backward=True)) == [12]


@pytest.mark.parametrize("how", ["op", "dtype", "shape"])
def test_a_block_that_differs_is_not_rolled(how: str) -> None:
    """Nine steps, the fifth another op, or reading a c of another dtype or shape: the
    four steps on either side are rolled, the fifth stays as it is."""
    spec, data = _chain(9, differ=5, how=how)
    rolled = both_ways(spec, data, backward=True)
    assert rolled is not None and _loops(rolled) == [4, 4]
    assert any(s.origin == "h5" for s in rolled.steps if s.op.name != "scan")


def test_fewer_than_four_repeats_stay_unrolled() -> None:
    spec, data = _chain(3)
    assert both_ways(spec, data, backward=True) is None


def test_a_value_read_from_inside_the_run_keeps_its_steps() -> None:
    """An output (h3) or a later node (one that reads h2) made in the middle of the run:
    the run is not rolled across it."""
    data = _cell_data()
    assert sum(_loops(both_ways(_cell(8, outputs=("h3",)), data))) < 8
    spec = _cell(8)
    spec = GraphSpec(
        [*spec.nodes[:-1], NodeSpec("loss", expr="sum(h8 * h8) + sum(h2)")], spec.outputs
    )
    assert sum(_loops(both_ways(spec, data, backward=True))) < 8


def test_a_literal_that_changes_from_step_to_step_is_not_rolled() -> None:
    """h_i = sin(h_{i-1}) * t_i with t_i a literal per step (a time): not one block."""
    nodes = [NodeSpec(f"h{i}", expr=f"sin(h{i - 1}) * {0.1 * i!r}") for i in range(1, 9)]
    spec = GraphSpec([*nodes, NodeSpec("loss", "sum", ["h8"])], ["loss"])
    assert both_ways(spec, {"h0": RNG.standard_normal(8)}, backward=True) is None


def test_a_stack_of_every_steps_value_is_the_loops_stacked_result() -> None:
    steps = 6
    spec, data = _chain(steps)
    stacked = NodeSpec("hs", "stack", [f"h{i}" for i in range(1, steps + 1)], {"dim": 0})
    nodes = [*spec.nodes[:-1], stacked, NodeSpec("loss", expr="sum(hs * hs)")]
    for outputs, backward in ((["loss"], True), (["loss", "hs"], False)):
        rolled = both_ways(GraphSpec(nodes, outputs), data, backward=backward)
        assert rolled is not None and _loops(rolled) == [steps]
        assert not any(s.op.name == "stack" and s.origin == "hs" for s in rolled.steps)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_objectives_have_nothing_to_roll(name: str) -> None:
    nodes, output, wrt, _ = OBJECTIVES[name]
    data = objective_data()
    spec = GraphSpec(nodes, [output])
    assert both_ways(spec, data, specs=_specs(data, wrt), backward=True) is None


def test_a_program_that_a_memory_budget_shaped_is_not_rolled() -> None:
    """Its recomputation is planned for its unrolled steps: it stays as it is."""
    spec, data = _chain(60)
    free = compile_graph(spec, _specs(data), backward=True)
    limits = Limits(memory_budget_bytes=free.planned_peak_bytes * 3 // 4)
    shaped = compile_graph(spec, _specs(data), backward=True, limits=limits)
    assert shaped.recompute_cost > 0
    assert roll_program(shaped) is None and roll_program(free) is not None


def test_a_rolled_program_is_stored_and_loaded_as_it_is() -> None:
    data = _cell_data()
    program = compile_graph(_cell(8), _specs(data), backward=True)
    rolled = roll_program(program)
    assert rolled is not None
    loaded = load_program(dump_program(rolled))
    assert _loops(loaded) == [8] and loaded.nodes == rolled.nodes
    got, want = execute(loaded, data), execute(rolled, data)
    for k in want.gradients or {}:
        np.testing.assert_array_equal(got.gradients[k], want.gradients[k], strict=True)  # type: ignore[index]
    again = roll_program(load_program(dump_program(program)))  # (a stored program's steps)
    assert again is not None and _loops(again) == [8]


# ---------------------------------------------------------------- the suites' graphs, rolled


def rolled_too(
    program: Program,
    inputs: Mapping[str, Any],
    *,
    grad_outputs: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Any:
    """`execute` as the suites call it, checked: where the program rolls, the rolled one
    answers the same bits (or the same error)."""
    try:
        result = execute(program, inputs, grad_outputs=grad_outputs, **kw)
    except Exception as error:
        rolled = roll_program(program, program.run.backend.device)
        if rolled is not None:
            with pytest.raises(type(error)):
                execute(rolled, inputs, grad_outputs=grad_outputs, **kw)
        raise
    rolled = roll_program(program, program.run.backend.device)
    if rolled is not None:
        again = execute(rolled, inputs, grad_outputs=grad_outputs, **kw)
        backend = program.run.backend
        for part in ("outputs", "gradients"):
            want, got = getattr(result, part) or {}, getattr(again, part) or {}
            assert want.keys() == got.keys()
            for k in want:
                np.testing.assert_array_equal(
                    backend.to_host(got[k]), backend.to_host(want[k]), strict=True, err_msg=k
                )
        assert again.nodes == result.nodes
    return result


globals().update(
    {
        f"{name}_rolled": fn
        for module in (test_compiled, test_transforms)
        for name, fn in vars(module).items()
        if name.startswith("test_")
        and callable(fn)
        and name
        not in {
            "test_forward_is_the_eager_forward",
            "test_gradients_are_the_eager_gradients_and_torch",
            "test_second_order_by_differentiating_the_program_twice",
        }
    }
)


@pytest.fixture(autouse=True)
def _roll_the_suites(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """For the suites' tests: `execute` is `rolled_too`."""
    if request.function.__module__ != __name__:
        for module in (test_compiled, test_transforms):
            monkeypatch.setattr(module, "execute", rolled_too)
    yield
