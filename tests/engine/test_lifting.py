"""Constant lifting (engine.graph.lifting): graphs that differ only in float literals share
one program, and answer bit for bit as each graph compiled on its own; a literal that an
op computes with, an integer literal, an attribute, an id are the graph's shape."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import GraphSpec, NodeSpec, Program, TensorSpec, compile_graph, execute
from gradserve.engine.graph.lifting import Templates
from tests.support.objectives import OBJECTIVES, objective_data
from tests.support.op_samples import SAMPLES

RNG = np.random.default_rng(7)


def _cell(steps: int, one: float, rate: float) -> GraphSpec:
    """A recurrent cell as define-by-run records it: `steps` unrolled copies, a literal
    (`one`) in every copy and a step size (`rate`) in the loss."""
    nodes, h = [], "h0"
    for t in range(steps):
        nodes += [
            NodeSpec(f"a{t}", expr=f"x{t} @ w + {h} @ u + b"),
            NodeSpec(
                f"h{t + 1}", expr=f"sigmoid(a{t} + {one!r}) * {h} + sigmoid(a{t}) * tanh(a{t})"
            ),
        ]
        h = f"h{t + 1}"
    nodes.append(NodeSpec("loss", expr=f"sum({h} * {h}) * {rate!r}"))
    return GraphSpec(nodes, ["loss"])


def _cell_inputs(steps: int) -> tuple[dict[str, TensorSpec], dict[str, np.ndarray]]:
    data = {f"x{t}": RNG.standard_normal((2, 3)) for t in range(steps)}
    data |= {
        "w": RNG.standard_normal((3, 3)) * 0.5,
        "u": RNG.standard_normal((3, 3)) * 0.5,
        "b": RNG.standard_normal(3) * 0.1,
        "h0": RNG.standard_normal((2, 3)),
    }
    return {k: TensorSpec(v.shape, str(v.dtype), True) for k, v in data.items()}, data


def _steps(program: Program) -> list[tuple[Any, ...]]:
    """A program step for step, literals by value and sign (0.0 is not -0.0)."""

    def arg(a: Any) -> Any:
        return a if type(a) is int else (type(a.value), repr(a.value))

    return [
        (s.op.name, tuple(arg(a) for a in s.args), repr(s.attrs), s.out, s.kind, s.origin)
        for s in program.steps
    ]


def assert_same_program(lifted: Program, compiled: Program, data: dict[str, np.ndarray]) -> None:
    """The same steps, plan and costs as its own compile, and the same bits out."""
    assert _steps(lifted) == _steps(compiled)
    for field in (
        "frees",
        "reuse",
        "ufunc",
        "planned_peak_bytes",
        "flops",
        "bytes_moved",
        "cost_by_node",
        "requires_grad",
        "grad_fn",
        "outputs",
        "gradients",
    ):
        assert getattr(lifted, field) == getattr(compiled, field), field
    got, want = execute(lifted, data, verify=True), execute(compiled, data, verify=True)
    for k in want.outputs:
        np.testing.assert_array_equal(got.outputs[k], want.outputs[k], strict=True)
    for k in want.gradients or {}:
        np.testing.assert_array_equal(got.gradients[k], want.gradients[k], strict=True)  # type: ignore[index]
    assert got.peak_bytes == got.planned_peak_bytes == want.peak_bytes


def test_a_cell_with_new_literals_takes_the_first_ones_program() -> None:
    specs, data = _cell_inputs(6)
    templates = Templates()
    first = compile_graph(_cell(6, 1.25, 0.1), specs, backward=True, templates=templates)
    assert not first.lifted
    for one, rate in ((1.5, 0.01), (-0.0, 2.5), (0.0, -0.0), (1e300, 1e-300), (1.25, 0.1)):
        lifted = compile_graph(_cell(6, one, rate), specs, backward=True, templates=templates)
        assert lifted.lifted, (one, rate)
        assert_same_program(lifted, compile_graph(_cell(6, one, rate), specs, backward=True), data)
    assert len(templates) == 1


def test_a_lifted_program_has_the_gradients_of_finite_differences_and_torch() -> None:
    torch = pytest.importorskip("torch")
    specs, data = _cell_inputs(3)
    templates = Templates()
    compile_graph(_cell(3, 0.75, 0.5), specs, backward=True, templates=templates)
    lifted = compile_graph(_cell(3, 1.5, 0.25), specs, backward=True, templates=templates)
    assert lifted.lifted
    result = execute(lifted, data)
    for k, x in data.items():  # central differences, float64, along a random direction
        u = RNG.standard_normal(x.shape)
        up = execute(lifted, data | {k: x + 1e-6 * u}).outputs["loss"]
        down = execute(lifted, data | {k: x - 1e-6 * u}).outputs["loss"]
        np.testing.assert_allclose(
            (up - down) / 2e-6,
            np.sum(result.gradients[k] * u),  # type: ignore[index]
            rtol=1e-5,
            atol=1e-8,
            err_msg=k,
        )

    t = {k: torch.tensor(v, requires_grad=True) for k, v in data.items()}
    h = t["h0"]
    for step in range(3):
        a = t[f"x{step}"] @ t["w"] + h @ t["u"] + t["b"]
        h = torch.sigmoid(a + 1.5) * h + torch.sigmoid(a) * torch.tanh(a)
    loss = torch.sum(h * h) * 0.25
    loss.backward()
    np.testing.assert_allclose(result.outputs["loss"], loss.detach().numpy(), rtol=1e-12)
    for k, v in t.items():
        np.testing.assert_allclose(
            result.gradients[k],
            v.grad.numpy(),
            rtol=1e-10,  # type: ignore[index]
            atol=1e-12,
            err_msg=k,
        )


# A float literal of an expr, not an attribute's (`min=-0.2`).
_FLOAT = re.compile(r"(?<![\w.=])(?<!=-)(\d+\.\d*(?:e[-+]?\d+)?|\d+e[-+]?\d+)")


def _perturbed(nodes: list[NodeSpec], factor: float) -> list[NodeSpec]:
    """The nodes with every float literal of their exprs (not an attribute's) scaled."""
    return [
        NodeSpec(
            n.id,
            n.op,
            n.args,
            n.attrs,
            None
            if n.expr is None
            else _FLOAT.sub(lambda m: repr(float(m.group()) * factor), n.expr),
        )
        for n in nodes
    ]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_objectives_with_new_literals_are_bit_identical_to_their_own_compile(name: str) -> None:
    nodes, output, wrt, _ = OBJECTIVES[name]
    data = objective_data()
    specs = {k: TensorSpec(v.shape, str(v.dtype), k in wrt) for k, v in data.items()}
    templates = Templates()
    for factor in (1.0, 1.37, 0.61):
        graph = GraphSpec(_perturbed(nodes, factor), [output])
        program = compile_graph(graph, specs, backward=True, templates=templates)
        if factor == 0.61:  # (no literal of theirs is pow's: all are lifted)
            assert program.lifted
        assert_same_program(program, compile_graph(graph, specs, backward=True), data)


def _op_graph(
    name: str, args: list[Any], attrs: dict[str, Any], grad: bool
) -> tuple[GraphSpec, dict[str, TensorSpec], dict[str, np.ndarray]]:
    data, refs = {}, []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            data[f"a{i}"] = a
            refs.append(f"a{i}")
        else:
            refs.append(a)
    specs = {
        k: TensorSpec(v.shape, str(v.dtype), grad and v.dtype.kind == "f") for k, v in data.items()
    }
    graph = GraphSpec(
        [NodeSpec("y", name, refs, attrs), NodeSpec("loss", expr="sum(y * y)" if grad else "y")],
        ["loss"],
    )
    return graph, specs, data


def _literal_samples() -> list[Any]:
    """Every op sample with a float literal among its arguments, and every sample of an op
    with an array argument made a literal (where the op takes one, beside another array: an
    op on literals alone computes on constants, whose values are attributes)."""
    cases = []
    for name, samples in sorted(SAMPLES.items()):
        for k, sample in enumerate(samples):
            args = list(sample.args)
            for i, a in enumerate(args):
                if type(a) is float:
                    cases.append(pytest.param(name, args, i, sample, id=f"{name}-{k}-{i}"))
                elif (
                    isinstance(a, np.ndarray)
                    and a.dtype.kind == "f"
                    and any(isinstance(o, np.ndarray) for o in args[:i] + args[i + 1 :])
                ):
                    made = [*args[:i], 0.7, *args[i + 1 :]]
                    graph, specs, _ = _op_graph(name, made, sample.attrs, sample.grad)
                    try:
                        compile_graph(graph, specs, backward=sample.grad)
                    except GradserveError:
                        continue  # (the op takes no literal there)
                    cases.append(pytest.param(name, made, i, sample, id=f"{name}-{k}-{i}-made"))
    return cases


@pytest.mark.parametrize(("name", "args", "i", "sample"), _literal_samples())
def test_every_op_with_a_new_literal_is_its_own_compile(
    name: str, args: list[Any], i: int, sample: Any
) -> None:
    grad = sample.grad
    graph, specs, data = _op_graph(name, args, sample.attrs, grad)
    templates = Templates()
    assert not compile_graph(graph, specs, backward=grad, templates=templates).lifted
    value = args[i]
    lifted = []
    for new in (value * 1.37 + 0.11, -value, 0.0, -0.0):
        changed = [*args[:i], new, *args[i + 1 :]]
        graph, _, _ = _op_graph(name, changed, sample.attrs, grad)
        try:
            own = compile_graph(graph, specs, backward=grad)
        except GradserveError:
            continue  # (refused on its own: it is refused with the template too, below)
        program = compile_graph(graph, specs, backward=grad, templates=templates)
        assert_same_program(program, own, data)
        lifted.append(program.lifted)
    # pow's VJPs compute with its exponent and its base; every other op passes them on
    assert any(lifted) == (name != "pow"), lifted


def test_an_integer_literal_an_attribute_or_an_id_is_the_graphs_shape() -> None:
    x = RNG.standard_normal((2, 3))
    specs, data = {"x": TensorSpec((2, 3), "float64", True)}, {"x": x}
    templates = Templates()

    def compiled(*nodes: NodeSpec, out: str = "y") -> Program:
        graph = GraphSpec(list(nodes), [out])
        program = compile_graph(graph, specs, backward=True, templates=templates)
        assert_same_program(program, compile_graph(graph, specs, backward=True), data)
        return program

    compiled(NodeSpec("y", expr="sum(x * 2)"))
    assert not compiled(NodeSpec("y", expr="sum(x * 3)")).lifted  # an int: a dtype's
    compiled(NodeSpec("y", expr="sum(sum(x * 0.5, dim=0))"))
    assert not compiled(NodeSpec("y", expr="sum(sum(x * 0.5, dim=1))")).lifted  # a shape's
    assert compiled(NodeSpec("y", expr="sum(sum(x * 0.25, dim=1))")).lifted
    assert not compiled(NodeSpec("z", expr="sum(sum(x * 0.25, dim=1))"), out="z").lifted  # an id
    compiled(NodeSpec("y", expr="sum(clamp(x, min=0.5) * 0.5)"))
    assert not compiled(NodeSpec("y", expr="sum(clamp(x, min=0.25) * 0.5)")).lifted
    compiled(NodeSpec("y", expr="sum(x ** 1.5)"))
    assert not compiled(NodeSpec("y", expr="sum(x ** 2.5)")).lifted  # pow's exponent


def test_one_float_object_used_twice_is_lifted_only_with_one_value() -> None:
    """In process, one Python float may be two literals (one object): they are one, and a
    graph with two values there is compiled."""
    specs = {"x": TensorSpec((3,), "float64", True)}
    data = {"x": RNG.standard_normal(3)}
    templates = Templates()

    def graph(a: float, b: float) -> GraphSpec:
        return GraphSpec(
            [
                NodeSpec("p", "mul", ["x", a]),
                NodeSpec("q", "add", ["p", b]),
                NodeSpec("y", "sum", ["q"]),
            ],
            ["y"],
        )

    shared = 0.375
    compile_graph(graph(shared, shared), specs, backward=True, templates=templates)
    both = float("0.625")
    program = compile_graph(graph(both, both), specs, backward=True, templates=templates)
    assert program.lifted
    assert_same_program(program, compile_graph(graph(both, both), specs, backward=True), data)
    program = compile_graph(graph(0.125, 0.875), specs, backward=True, templates=templates)
    assert not program.lifted
    assert_same_program(program, compile_graph(graph(0.125, 0.875), specs, backward=True), data)


def test_a_literal_equal_to_a_value_of_the_program_is_not_lifted() -> None:
    """`maximum`'s VJP halves a tie's gradient with its own 0.5: a literal 0.5 beside it
    cannot be told from it, and stays as it is."""
    specs = {"x": TensorSpec((3,), "float64", True), "y": TensorSpec((3,), "float64", True)}
    data = {"x": np.array([1.0, 2.0, 3.0]), "y": np.array([1.0, 0.0, 4.0])}
    templates = Templates()

    def graph(c: float) -> GraphSpec:
        return GraphSpec([NodeSpec("m", expr=f"sum(maximum(x, y) * {c!r})")], ["m"])

    compile_graph(graph(0.5), specs, backward=True, templates=templates)
    program = compile_graph(graph(0.75), specs, backward=True, templates=templates)
    assert not program.lifted
    assert_same_program(program, compile_graph(graph(0.75), specs, backward=True), data)
    program = compile_graph(graph(0.875), specs, backward=True, templates=templates)
    assert program.lifted  # (0.75, the template now, is no value of the VJPs)
    assert_same_program(program, compile_graph(graph(0.875), specs, backward=True), data)


def test_loops_and_flags_are_not_lifted_across() -> None:
    specs = {"x": TensorSpec((3,), "float64", True)}
    templates = Templates()
    for c in (0.5, 0.75):
        loop = GraphSpec(
            [
                NodeSpec(
                    "s", "scan", ["x"], {"length": 2}, body=_loop_body(c), results={"last": "h"}
                ),
                NodeSpec("y", "sum", ["last"]),
            ],
            ["y"],
        )
        assert not compile_graph(loop, specs, backward=True, templates=templates).lifted
    plain = GraphSpec([NodeSpec("y", expr="sum(x * 0.5)")], ["y"])
    compile_graph(plain, specs, backward=True, templates=templates)
    other = GraphSpec([NodeSpec("y", expr="sum(x * 0.25)")], ["y"])
    assert not compile_graph(other, specs, backward=False, templates=templates).lifted
    assert not compile_graph(other, specs, no_grad=True, backward=False, templates=templates).lifted
    assert compile_graph(other, specs, backward=True, templates=templates).lifted


def _loop_body(c: float) -> Any:
    from gradserve.engine.graph import BodySpec

    return BodySpec(["h"], [], [NodeSpec("h2", expr=f"tanh(h) * {c!r}")], {"h": "h2"})


def test_templates_keep_the_most_recently_used_shapes() -> None:
    specs = {"x": TensorSpec((3,), "float64", True)}
    templates = Templates(limit=2)
    for name in ("a", "b", "c"):
        compile_graph(
            GraphSpec([NodeSpec(name, expr="sum(x * 0.5)")], [name]),
            specs,
            backward=True,
            templates=templates,
        )
    assert len(templates) == 2
    again = {
        name: compile_graph(
            GraphSpec([NodeSpec(name, expr="sum(x * 0.25)")], [name]),
            specs,
            backward=True,
            templates=templates,
        ).lifted
        for name in ("b", "c", "a")
    }
    assert again == {"b": True, "c": True, "a": False}


def test_templates_hold_programs_within_their_bytes() -> None:
    specs = {"x": TensorSpec((3,), "float64", True)}

    def compiled(name: str, c: float, templates: Templates) -> Program:
        return compile_graph(
            GraphSpec([NodeSpec(name, expr=f"sum(x * {c!r})")], [name]),
            specs,
            backward=True,
            templates=templates,
        )

    size = compiled("a", 0.5, Templates()).estimated_bytes
    templates = Templates(max_bytes=2 * size)
    for name in ("a", "b", "c"):
        compiled(name, 0.5, templates)
    assert len(templates) == 2 and templates.bytes == 2 * size
    assert not compiled("a", 0.25, templates).lifted
    assert compiled("c", 0.25, templates).lifted
    small = Templates(max_bytes=size - 1)
    compiled("a", 0.5, small)
    assert len(small) == 0 and not compiled("a", 0.25, small).lifted


def _body(graph: GraphSpec, data: dict[str, np.ndarray]) -> dict[str, Any]:
    nodes = [{"id": n.id, "expr": n.expr} for n in graph.nodes]
    return {
        "graph": {"nodes": nodes, "outputs": list(graph.outputs)},
        "inputs": {
            k: {"data": v.tolist(), "dtype": "float64", "requires_grad": True}
            for k, v in data.items()
        },
    }


@pytest.mark.anyio
async def test_over_http_a_new_literal_is_lifted_and_answers_as_its_own_compile() -> None:
    from gradserve.wire.graph_id import graph_key
    from tests.support.in_process import serving

    _, data = _cell_inputs(3)
    bodies = [_body(_cell(3, one, 0.5), data) for one in (1.25, 1.5, 1.75)]
    async with serving() as (c, _):
        answers = [(await c.post("/backward", json=body)).json() for body in bodies]
        metrics = (await c.get("/metrics")).text
    # (all three in the front process's fast lane: one compile, two lifted lookups)
    assert 'gradserve_compiles_total{role="front"} 1.0' in metrics
    assert 'gradserve_program_lookups_total{role="front",source="lifted"} 2.0' in metrics
    async with serving() as (c, _):
        own = (await c.post("/backward", json=bodies[2])).json()
    assert [a["meta"]["program"] for a in answers] == ["compiled", "lifted", "lifted"]
    assert own["meta"]["program"] == "compiled"
    for answer, body in zip(answers, bodies, strict=True):
        assert answer["meta"]["graph_id"] == graph_key(body["graph"])
    assert answers[2]["outputs"] == own["outputs"]
    assert answers[2]["gradients"] == own["gradients"]
