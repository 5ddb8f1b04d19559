"""Rematerialization (engine.graph.remat): a backward over its memory budget recomputes
forward values in its backward, within the budget, bit for bit.

Every graph here is compiled with a budget just over the least peak the compiler can
reach (what its MemoryBudgetError names for a budget of 0), and the rematerialized
program must: give the outputs and gradients of the plain one bit for bit, run at its
planned peak (measured), within the budget, with its recomputation priced, and store and
load as itself. The graphs: every op sample that has a backward, the graphs of the
transforms' tests and the objectives, chains and DAGs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from gradserve.engine.errors import ComputeBudgetError, MemoryBudgetError, ValidationErrors
from gradserve.engine.graph import (
    BodySpec,
    GraphSpec,
    Limits,
    NodeSpec,
    Program,
    TensorSpec,
    compile_graph,
)
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import BYTE_COST, RECOMPUTE
from gradserve.engine.graph.scan import SCAN, replay_cost
from gradserve.engine.graph.serial import dump_program
from gradserve.engine.ops import OPS
from tests.engine import test_objectives, test_transforms
from tests.support.op_samples import Sample
from tests.support.ops import is_float_array, op_cases
from tests.support.remat import sin_chain
from tests.support.serial import corrupt, frame, round_trip, run_both, split


def least_peak(spec: GraphSpec, inputs: Mapping[str, TensorSpec], **kw: Any) -> int:
    """The least peak the compiler reaches for this backward, recomputing."""
    with pytest.raises(MemoryBudgetError) as info:
        compile_graph(spec, inputs, backward=True, limits=Limits(memory_budget_bytes=0), **kw)
    assert "even recomputing" in str(info.value)
    return int(info.value.planned_bytes)


def _bits(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    a = np.asarray(a)
    return str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes()


def check_forced(
    spec: GraphSpec,
    inputs: Mapping[str, TensorSpec],
    arrays: Mapping[str, np.ndarray],
    grad_outputs: Mapping[str, np.ndarray] | None = None,
    budget: int | None = None,
) -> tuple[Program, Program]:
    """Compile the backward of `spec` plain and within `budget` (default: just over the
    least peak reachable), run both, and hold the rematerialized one to its contract;
    the two programs."""
    kw: dict[str, Any] = {}
    if grad_outputs is not None:
        kw["grad_outputs"] = {k: TensorSpec(v.shape, str(v.dtype)) for k, v in grad_outputs.items()}
    plain = compile_graph(spec, inputs, backward=True, **kw)
    p0 = plain.planned_peak_bytes
    least = least_peak(spec, inputs, **kw)
    assert least <= p0
    if budget is None:
        budget = least
    program = compile_graph(
        spec, inputs, backward=True, limits=Limits(memory_budget_bytes=budget), **kw
    )
    peak = program.planned_peak_bytes
    assert peak <= budget
    recomputes = sum(step.kind == RECOMPUTE for step in program.steps)
    # (A loop over the budget is checkpointed first: it replays its forward in the backward.)
    replays = [replay_cost(s.attrs["body"]) for s in program.steps if s.op is SCAN]
    replayed = sum(f + BYTE_COST * b for f, b in replays)
    if budget < p0:
        assert peak < p0 and (recomputes or replayed) and program.recompute_cost > 0
    else:
        assert program.recompute_cost == recomputes == replayed == 0
    assert program.peak_without_recompute == p0 == plain.peak_without_recompute
    if not replayed:
        assert program.compute_cost == plain.compute_cost + program.recompute_cost
    assert program.recompute_cost == replayed + sum(
        c for s, c in zip(program.steps, program.step_costs, strict=True) if s.kind == RECOMPUTE
    )
    assert not any(s.op is SCAN for s in program.steps if s.kind == RECOMPUTE)

    expected = execute(plain, dict(arrays), grad_outputs=grad_outputs, verify=True)
    got = execute(program, dict(arrays), grad_outputs=grad_outputs, verify=True)
    assert expected.peak_bytes == p0
    assert got.peak_bytes == peak <= budget
    for name in ("outputs", "gradients"):
        a, b = getattr(expected, name), getattr(got, name)
        assert list(a) == list(b)
        for k in a:
            assert _bits(b[k]) == _bits(a[k]), (name, k)
    if recomputes:
        run_both(program, round_trip(program), dict(arrays), grad_outputs=grad_outputs, verify=True)
    return plain, program


# ---------------------------------------------------------------- every op sample


def _sample_graph(
    name: str, sample: Sample
) -> tuple[GraphSpec, dict[str, TensorSpec], dict[str, np.ndarray]] | None:
    """The op on its sample's arrays (floats in float64), the ones it differentiates made
    by a forward step (x * 1.0, exact) so that its backward reads values that may be
    recomputed, and a tail whose backward runs while they are kept: sin twice, summed."""
    op = OPS[name]
    nodes: list[NodeSpec] = []
    args: list[Any] = []
    inputs: dict[str, TensorSpec] = {}
    arrays: dict[str, np.ndarray] = {}
    for i, a in enumerate(sample.args):
        if not isinstance(a, np.ndarray):
            args.append(a)
            continue
        array = a.astype("float64") if is_float_array(a) else a
        wrt = is_float_array(a) and op.arg_differentiable(i)
        inputs[f"a{i}"] = TensorSpec(array.shape, str(array.dtype), wrt)
        arrays[f"a{i}"] = array
        if wrt:
            nodes.append(NodeSpec(f"p{i}", "mul", [f"a{i}", 1.0]))
        args.append(f"p{i}" if wrt else f"a{i}")
    if not any(t.requires_grad for t in inputs.values()):
        return None
    nodes += [
        NodeSpec("y", name, args, sample.attrs),
        NodeSpec("t", expr="sin(sin(y))"),
        NodeSpec("loss", "sum", ["t"]),
    ]
    return GraphSpec(nodes, ["loss"]), inputs, arrays


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_every_op_sample_recomputes_bit_for_bit(name: str, sample: Sample) -> None:
    graph = _sample_graph(name, sample)
    if graph is None:
        pytest.skip("no differentiable float input in this sample")
    try:
        compile_graph(graph[0], graph[1], backward=True)
    except ValidationErrors:
        pytest.skip("nothing differentiable flows into the output")
    check_forced(*graph)


# ---------------------------------------------------------------- the transforms' graphs


class _Recorder:
    """`compile_graph` and `execute` for another test module: each program that it runs
    is remembered with its graph, inputs and arrays."""

    def __init__(self) -> None:
        self.compiled: dict[int, tuple[GraphSpec, Mapping[str, TensorSpec], Program]] = {}
        self.ran: list[
            tuple[GraphSpec, Mapping[str, TensorSpec], Program, dict[str, Any], dict[str, Any], Any]
        ] = []

    def compile_graph(
        self, spec: GraphSpec, inputs: Mapping[str, TensorSpec], **kw: Any
    ) -> Program:
        program = compile_graph(spec, inputs, **kw)
        self.compiled[id(program)] = (spec, inputs, program)
        return program

    def execute(self, program: Program, arrays: Any, **kw: Any) -> Any:
        result = execute(program, arrays, **kw)
        spec, inputs, _ = self.compiled[id(program)]
        self.ran.append((spec, inputs, program, dict(arrays), kw, result))
        return result

    def backwards(
        self,
    ) -> Iterator[
        tuple[GraphSpec, dict[str, TensorSpec], dict[str, np.ndarray], dict[str, np.ndarray] | None]
    ]:
        """Each graph that ran, once, as a backward: every float input requiring grad, and
        an upstream gradient for each output of more than one element."""
        seen = set()
        rng = np.random.default_rng(5)
        for spec, inputs, program, arrays, kw, _ in self.ran:
            if repr(spec) in seen:
                continue
            seen.add(repr(spec))
            if program.backward:
                yield spec, dict(inputs), arrays, kw.get("grad_outputs")
                continue
            specs = {
                k: TensorSpec(t.shape, t.dtype, t.dtype.startswith("float"))
                for k, t in inputs.items()
            }
            upstream = {}
            for name, slot in program.outputs:
                meta = program.metas[slot]
                if meta.dtype.startswith("float") and int(np.prod(meta.shape)) != 1:
                    upstream[name] = rng.standard_normal(meta.shape).astype(meta.dtype)
            yield spec, specs, arrays, upstream or None


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    recorder = _Recorder()
    for module in (test_transforms, test_objectives):
        monkeypatch.setattr(module, "compile_graph", recorder.compile_graph)
        monkeypatch.setattr(module, "execute", recorder.execute)
    yield recorder


def _check_recorded(recorder: _Recorder) -> int:
    checked = 0
    for spec, inputs, arrays, upstream in recorder.backwards():
        specs = (
            None
            if upstream is None
            else {k: TensorSpec(v.shape, str(v.dtype)) for k, v in upstream.items()}
        )
        try:
            compile_graph(spec, inputs, backward=True, grad_outputs=specs)
        except ValidationErrors:
            continue  # (nothing to differentiate)
        check_forced(spec, inputs, arrays, upstream)
        checked += 1
    return checked


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, fn in vars(test_transforms).items()
        if n.startswith("test_") and not inspect.signature(fn).parameters
    ],
)
def test_transform_graphs_recompute_bit_for_bit(name: str, recorder: _Recorder) -> None:
    """grad, jvp, scans (never recomputed: a loop is a unit), nested and differentiated
    scans: each graph that a test of tests/engine/test_transforms.py runs, as a backward."""
    getattr(test_transforms, name)()
    _check_recorded(recorder)


@pytest.mark.parametrize("name", sorted(test_objectives.OBJECTIVES))
def test_objectives_recompute_bit_for_bit(name: str, recorder: _Recorder) -> None:
    test_objectives.test_objective_matches_torch(name)
    assert _check_recorded(recorder) == 1


# ---------------------------------------------------------------- chains and DAGs


def residual(blocks: int) -> GraphSpec:
    """A residual DAG with several outputs: h_{i+1} = h_i + tanh(h_i * w) @ m, a value
    read by every block's backward (w), a detach, a promotion cast (an int input) and a
    constant, and a loss over the middle of the net as well as its end."""
    nodes = [NodeSpec("k", expr="2 * 3 + 1"), NodeSpec("h0", expr="x * n + k")]
    for i in range(blocks):
        nodes.append(NodeSpec(f"h{i + 1}", expr=f"h{i} + tanh(h{i} * w) @ m"))
        if i == blocks // 2:
            nodes.append(NodeSpec("d", expr=f"detach(h{i + 1}) * h{i + 1}"))
    nodes += [
        NodeSpec("mid", expr=f"sum(d * h{blocks // 3})"),
        NodeSpec("loss", expr=f"sum(h{blocks} * h{blocks})"),
    ]
    return GraphSpec(nodes, ["loss", "mid", f"h{blocks}"])


def _residual_inputs(width: int) -> tuple[dict[str, TensorSpec], dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    arrays = {
        "x": rng.standard_normal((8, width)),
        "w": rng.standard_normal(width),
        "m": rng.standard_normal((width, width)) / width,
        "n": rng.integers(0, 3, (8, width), dtype=np.int64),
    }
    inputs = {k: TensorSpec(a.shape, str(a.dtype), a.dtype.kind == "f") for k, a in arrays.items()}
    return inputs, arrays


def test_a_chain_recomputes_within_the_least_budget_and_others() -> None:
    spec = sin_chain(200)
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    arrays = {"x": np.random.default_rng(0).standard_normal(1000)}
    plain, least = check_forced(spec, inputs, arrays)
    values = 1000 * 8
    # √n segments: far below the plain peak (201 values kept), about 2√n values.
    assert least.planned_peak_bytes <= 30 * values < plain.planned_peak_bytes // 6
    for fraction in (0.15, 0.5, 0.9):
        _, program = check_forced(
            spec, inputs, arrays, budget=int(plain.planned_peak_bytes * fraction)
        )
        # Each value the backward reads that is not held where the forward ends is
        # recomputed once (two steps of the chain's): no more.
        held = program.planned_peak_bytes // values
        assert sum(s.kind == RECOMPUTE for s in program.steps) <= 2 * (200 - held + 8)
    # (the least budget recomputes about one forward: sin and mul per value)
    assert least.recompute_cost <= sum(
        c for s, c in zip(plain.steps, plain.step_costs, strict=True) if s.kind == "node"
    )


def test_recompute_steps_write_into_dead_buffers_only() -> None:
    """Past REUSE_MIN_BYTES a ufunc writes into the buffer of an operand that dies there:
    recompute steps do too, and never into a value a later step reads (bit for bit)."""
    spec = sin_chain(60)
    inputs = {"x": TensorSpec((8192,), "float64", True)}
    arrays = {"x": np.random.default_rng(1).standard_normal(8192)}
    for budget in (None, 20 * 8 * 8192):
        _, program = check_forced(spec, inputs, arrays, budget=budget)
        assert any(
            program.reuse[i] >= 0 for i, s in enumerate(program.steps) if s.kind == RECOMPUTE
        )


@pytest.mark.parametrize("blocks", [3, 40])
def test_a_residual_dag_with_several_outputs_recomputes_bit_for_bit(blocks: int) -> None:
    inputs, arrays = _residual_inputs(64)
    spec = residual(blocks)
    upstream = {f"h{blocks}": np.random.default_rng(4).standard_normal((8, 64))}
    plain, program = check_forced(spec, inputs, arrays, upstream)
    if blocks > 3:
        assert program.planned_peak_bytes < plain.planned_peak_bytes // 2


def test_over_the_budget_even_recomputing_names_what_it_would_need() -> None:
    spec = sin_chain(100)
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    least = least_peak(spec, inputs)
    with pytest.raises(MemoryBudgetError) as info:
        compile_graph(spec, inputs, backward=True, limits=Limits(memory_budget_bytes=least - 1))
    err = info.value
    assert err.planned_bytes == least and err.budget_bytes == least - 1
    assert f"would need at least {least} bytes even recomputing" in str(err)
    assert (
        compile_graph(
            spec, inputs, backward=True, limits=Limits(memory_budget_bytes=least)
        ).planned_peak_bytes
        <= least
    )


def test_nothing_to_recompute_is_refused_with_the_plain_peak() -> None:
    """A backward that reads only what is held anyway (inputs, outputs) cannot go lower."""
    spec = GraphSpec([NodeSpec("y", expr="x * x")], ["y"])
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    upstream = {"y": TensorSpec((1000,), "float64")}
    plain = compile_graph(spec, inputs, backward=True, grad_outputs=upstream)
    assert least_peak(spec, inputs, grad_outputs=upstream) == plain.planned_peak_bytes


def test_recompute_false_and_no_budget_give_the_plain_program_and_refusal() -> None:
    spec = sin_chain(50)
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    plain = compile_graph(spec, inputs, backward=True)
    budget = plain.planned_peak_bytes // 2
    with pytest.raises(MemoryBudgetError) as info:
        compile_graph(
            spec, inputs, backward=True, limits=Limits(memory_budget_bytes=budget, recompute=False)
        )
    assert str(info.value) == (
        f"the planned peak memory of this request is "
        f"{plain.planned_peak_bytes} bytes; the grad budget is "
        f"{budget} bytes"
    )
    assert info.value.planned_bytes == plain.planned_peak_bytes
    for limits in (Limits(), Limits(memory_budget_bytes=plain.planned_peak_bytes)):
        program = compile_graph(spec, inputs, backward=True, limits=limits)
        assert len(program.steps) == len(plain.steps) and program.recompute_cost == 0
    # Only a backward recomputes: a forward over the budget is refused as before.
    with pytest.raises(MemoryBudgetError, match=r"budget is 1 bytes$"):
        compile_graph(spec, inputs, limits=Limits(memory_budget_bytes=1))


def test_the_compute_budget_counts_the_recomputation() -> None:
    spec = sin_chain(100)
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    plain = compile_graph(spec, inputs, backward=True)
    budget = plain.planned_peak_bytes // 3
    program = compile_graph(spec, inputs, backward=True, limits=Limits(memory_budget_bytes=budget))
    assert program.recompute_cost > 0
    limits = Limits(memory_budget_bytes=budget, compute_budget=program.compute_cost - 1)
    with pytest.raises(ComputeBudgetError):
        compile_graph(spec, inputs, backward=True, limits=limits)


def random_dag(
    seed: int,
) -> tuple[GraphSpec, dict[str, TensorSpec], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A random DAG of elementwise steps, each reading the value before it and, now and
    then, one made long before (residuals), with detaches, float32 round trips (casts),
    literals and constants; a loss at its end, and an output from its middle that gets an
    upstream gradient."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(64, 512)) * (16 if seed % 2 else 1)  # (odd seeds: buffers reused)
    values = ["x", "w"]
    nodes = []
    for i in range(int(rng.integers(20, 60))):
        a = values[-1]
        b = values[int(rng.integers(0, len(values)))]
        kind = int(rng.integers(0, 8))
        expr = [
            f"sin({a}) * 0.9",
            f"tanh({a} * {b})",
            f"{a} + cos({b})",
            f"detach({a}) * {b}",
            f"cast(cast({a}, dtype='float32') * 2, dtype='float64')",
            f"{a} * (1 + 2 * 3) / 7",
            f"sin({a}) - {b} * {b}",
            f"exp(-{a} * {a}) + {b}",
        ][kind]
        nodes.append(NodeSpec(f"v{i}", expr=expr))
        values.append(f"v{i}")
    mid = values[len(values) // 2]
    nodes.append(NodeSpec("loss", expr=f"sum({values[-1]} * {values[-2]})"))
    inputs = {"x": TensorSpec((n,), "float64", True), "w": TensorSpec((n,), "float64", True)}
    arrays = {"x": rng.standard_normal(n), "w": rng.standard_normal(n)}
    return (GraphSpec(nodes, ["loss", mid]), inputs, arrays, {mid: rng.standard_normal(n)})


@pytest.mark.parametrize("seed", range(16))
def test_random_dags_recompute_bit_for_bit(seed: int) -> None:
    spec, inputs, arrays, upstream = random_dag(seed)
    plain, least = check_forced(spec, inputs, arrays, upstream)
    p0 = plain.planned_peak_bytes
    budget = least.planned_peak_bytes + (p0 - least.planned_peak_bytes) // 3
    check_forced(spec, inputs, arrays, upstream, budget=budget)


def test_values_a_loop_reads_are_recomputed_but_never_the_loop() -> None:
    """A scan step is a unit: what it makes is kept, what it reads may be recomputed
    before the backward's loop that reads it."""
    body = BodySpec(
        carry=["h"], xs=["x"], nodes=[NodeSpec("h2", expr="tanh(x * w + h)")], next={"h": "h2"}
    )
    nodes = [
        NodeSpec("xs", expr="sin(seq) * 0.5"),
        NodeSpec("w", expr="cos(v) * 2"),
        NodeSpec("rnn", op="scan", args=["h0", "xs"], body=body, results={"last": "h", "hs": "h2"}),
        NodeSpec("t", expr="sin(sin(sin(sin(hs))))"),
        NodeSpec("loss", expr="sum(t) + sum(last)"),
    ]
    rng = np.random.default_rng(8)
    arrays = {
        "seq": rng.standard_normal((6, 400)),
        "v": rng.standard_normal(400),
        "h0": rng.standard_normal(400),
    }
    inputs = {k: TensorSpec(a.shape, "float64", True) for k, a in arrays.items()}
    _, program = check_forced(GraphSpec(nodes, ["loss"]), inputs, arrays)
    # (the sequence the loop reads, recomputed for the backward's loop)
    assert "xs" in {s.origin for s in program.steps if s.kind == RECOMPUTE}


def test_a_stored_program_keeps_its_recomputation_and_checks_its_cost() -> None:
    spec = sin_chain(40)
    inputs = {"x": TensorSpec((100,), "float64", True)}
    plain = compile_graph(spec, inputs, backward=True)
    program = compile_graph(
        spec,
        inputs,
        backward=True,
        limits=Limits(memory_budget_bytes=plain.planned_peak_bytes // 3),
    )
    loaded = round_trip(program)
    assert loaded.recompute_cost == program.recompute_cost > 0
    assert loaded.peak_without_recompute == plain.planned_peak_bytes
    assert [s.kind for s in loaded.steps] == [s.kind for s in program.steps]
    # (its run's backward starts at its first step of the backward, as the compiled one's)
    assert len(loaded.run.forward) == len(program.run.forward) == 2 * 40 + 1
    header, columns = split(dump_program(program))
    for key, value in (
        ("recompute_cost", program.recompute_cost - 1),
        ("recompute_cost", 0),
        ("peak_without_recompute", None),
    ):
        damaged = {**header, "programs": [{**header["programs"][0], key: value}]}
        corrupt(frame(damaged, columns))


def test_a_value_an_output_is_a_detach_of_stays() -> None:
    """An output that is a detach of a forward value is that value's array: the value stays
    to the end and is never recomputed; its neighbours are."""
    spec = sin_chain(30)
    spec = GraphSpec([*spec.nodes, NodeSpec("kept", "detach", ["h10"])], ["loss", "kept"])
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    arrays = {"x": np.random.default_rng(3).standard_normal(1000)}
    _, program = check_forced(spec, inputs, arrays)
    recomputed = {s.origin for s in program.steps if s.kind == RECOMPUTE and s.op.name == "mul"}
    assert recomputed and "h10" not in recomputed
