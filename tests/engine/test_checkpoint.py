"""Checkpointed loops (engine.graph.checkpoint, engine.graph.scan): a differentiated scan
that keeps its carries every k steps and recomputes its residuals segment by segment
gives the plain loop's results and gradients bit for bit, with its planned peak equal to
the measured one; the budget chooses which loops and k, and what it cannot fit it
refuses, saying what it needs; stored programs carry it all."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradserve.engine.errors import MemoryBudgetError
from gradserve.engine.graph import BodySpec, GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.checkpoint import checkpoint_every
from gradserve.engine.graph.compiler import _backend_ufuncs
from gradserve.engine.graph.executor import bind, execute
from gradserve.engine.graph.ir import Program
from gradserve.engine.graph.scan import SCAN, Body, replay_cost
from tests.engine import test_transforms
from tests.support.loops import RNG, forced, rnn, rnn_arrays, specs
from tests.support.serial import round_trip


def loops(program: Program) -> list[Body]:
    return [s.attrs["body"] for s in program.steps if s.op is SCAN]


def checkpointed(program: Program) -> list[int]:
    """The k of each checkpointed loop of `program`."""
    return [body.every for body in loops(program) if body.every]


def least(spec: GraphSpec, inputs: Mapping[str, TensorSpec], **kw: Any) -> int:
    """The least planned peak recomputation reaches (what a budget of 1 byte is told)."""
    with pytest.raises(MemoryBudgetError, match="need at least") as info:
        compile_graph(spec, inputs, limits=Limits(memory_budget_bytes=1), **kw)
    return info.value.planned_bytes


def same_run(expected: Any, got: Any) -> None:
    """Bit for bit the same outputs and gradients; the measured peak is the planned one."""
    assert got.peak_bytes == got.planned_peak_bytes
    for name in ("outputs", "gradients"):
        a, b = getattr(expected, name) or {}, getattr(got, name) or {}
        assert list(a) == list(b)
        for k in a:
            x, y = np.asarray(a[k]), np.asarray(b[k])
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), k


# ---------------------------------------------------------------- the transforms' graphs


class _Checkpointed:
    """`compile_graph` and `execute` for tests/engine/test_transforms.py: each /backward program
    is also compiled with a budget just over what recomputation needs, and with every
    loop that may be checkpointed every 2 steps (stored and loaded too); each run of the
    program runs those, which must agree with it bit for bit."""

    def __init__(self) -> None:
        # (by id: the program is kept, so that no other one gets its id)
        self.variants: dict[int, tuple[Program, list[Program]]] = {}
        self.checkpointed = 0

    def compile_graph(
        self, spec: GraphSpec, inputs: Mapping[str, TensorSpec], **kw: Any
    ) -> Program:
        program = compile_graph(spec, inputs, **kw)
        if not kw.get("backward") or "limits" in kw:
            return program
        variants = []
        budget = least(spec, inputs, **kw)
        variants.append(
            compile_graph(spec, inputs, limits=Limits(memory_budget_bytes=budget), **kw)
        )
        assert variants[-1].planned_peak_bytes <= budget
        every = compile_graph(spec, inputs, **kw)
        if checkpoint_every(every, 2, ufuncs=_backend_ufuncs("cpu")):
            every.run = bind(every)
            variants += [every, round_trip(every)]
        self.checkpointed += sum(bool(checkpointed(v)) for v in variants)
        self.variants[id(program)] = program, variants
        return program

    def execute(self, program: Program, inputs: Any, **kw: Any) -> Any:
        result = execute(program, inputs, **kw)
        for variant in self.variants.get(id(program), (program, []))[1]:
            same_run(result, execute(variant, inputs, **kw))
        return result


@pytest.fixture
def twins(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Checkpointed]:
    twins = _Checkpointed()
    monkeypatch.setattr(test_transforms, "compile_graph", twins.compile_graph)
    monkeypatch.setattr(test_transforms, "execute", twins.execute)
    yield twins


def _tests(needs_backend: bool) -> list[str]:
    return [
        name
        for name, fn in vars(test_transforms).items()
        if name.startswith("test_")
        and ("backend_name" in inspect.signature(fn).parameters) == needs_backend
    ]


@pytest.mark.parametrize("name", _tests(needs_backend=False))
def test_transform_tests_with_forced_checkpointing(name: str, twins: _Checkpointed) -> None:
    getattr(test_transforms, name)()


@pytest.mark.parametrize("name", _tests(needs_backend=True))
def test_transform_tests_with_forced_checkpointing_on_each_backend(
    name: str, backend_name: str, twins: _Checkpointed
) -> None:
    """(a forward loop that runs backwards: the reverse loop of a `grad` node's, which the
    /backward differentiates)"""
    getattr(test_transforms, name)(backend_name)
    assert twins.checkpointed


def test_the_transform_tests_checkpoint_loops(twins: _Checkpointed) -> None:
    """Every /backward through a loop (but the one of length 0) has its loops
    checkpointed every 2 steps, and some fit a budget only so."""
    for name in _tests(needs_backend=False):
        getattr(test_transforms, name)()
    assert twins.checkpointed >= 10


# ---------------------------------------------------------------- against the plain loop


@settings(max_examples=40, deadline=None)
@given(
    steps=st.integers(2, 30),
    k=st.integers(1, 30),
    carries=st.integers(1, 2),
    last_only=st.booleans(),
)
def test_random_lengths_and_k_against_the_plain_loop(
    steps: int, k: int, carries: int, last_only: bool
) -> None:
    arrays = rnn_arrays(steps, carries)
    spec, inputs = rnn(last_only, carries), specs(arrays, list(arrays))
    plain = compile_graph(spec, inputs, backward=True)
    expected = execute(plain, arrays, verify=True)
    program = forced(spec, inputs, k, backward=True)
    assert checkpointed(program) == [min(k, steps)]
    same_run(expected, execute(program, arrays, verify=True))
    same_run(expected, execute(round_trip(program), arrays, verify=True))


def test_the_cost_counts_the_replay() -> None:
    """The reverse loop replays every step but those of the last segment (the first
    takes what is left over: 3, then 5, 5, 5 and 5 steps), each at the forward body's
    planned cost."""
    arrays = rnn_arrays(23)
    spec, inputs = rnn(True), specs(arrays, ["u", "h00"])
    plain = compile_graph(spec, inputs, backward=True)
    program = forced(spec, inputs, 5, backward=True)
    forward, reverse = loops(program)
    assert forward.segments == 5 and reverse.replay is forward
    assert [forward.start(j) for j in range(5)] == [0, 3, 8, 13, 18]
    flops, moved = replay_cost(reverse)
    assert forward.program is not None
    assert flops == 18 * forward.program.flops > 0 and moved > 18 * forward.program.bytes_moved
    assert program.compute_cost > plain.compute_cost + flops


def test_nested_loops_checkpoint_the_outer_one() -> None:
    """A scan in a scan's body, through /backward: the outer loop is checkpointed (its
    replay runs the inner loop, which stacks its residuals for the inner reverse loop in
    the outer one's body); the inner one is not (it is not a step of the program)."""
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
    spec = GraphSpec(
        [
            NodeSpec("out", op="scan", args=["a0", "m"], body=outer, results={"a_end": "a"}),
            NodeSpec("loss", expr="sum(a_end * a_end)"),
        ],
        ["loss"],
    )
    arrays = {"a0": RNG.standard_normal(2), "m": RNG.standard_normal((9, 4, 2))}
    inputs = specs(arrays, ["a0", "m"])
    expected = execute(compile_graph(spec, inputs, backward=True), arrays, verify=True)
    for every in (1, 2, 4, 9):
        program = forced(spec, inputs, every, backward=True)
        assert checkpointed(program) == [every]
        same_run(expected, execute(program, arrays, verify=True))
        same_run(expected, execute(round_trip(program), arrays, verify=True))


# ---------------------------------------------------------------- the budget


def test_the_budget_chooses_k_and_what_it_cannot_fit_it_refuses() -> None:
    arrays = rnn_arrays(400, h=16)
    spec, inputs = rnn(True), specs(arrays, ["w", "u", "b", "h00"])
    plain = compile_graph(spec, inputs, backward=True)
    expected = execute(plain, arrays, verify=True)
    need = least(spec, inputs, backward=True)
    assert need < plain.planned_peak_bytes // 3
    ks = []
    for budget in (
        need,
        (need + plain.planned_peak_bytes) // 2,
        plain.planned_peak_bytes - 1,
        plain.planned_peak_bytes,
    ):
        program = compile_graph(
            spec, inputs, backward=True, limits=Limits(memory_budget_bytes=budget)
        )
        assert program.planned_peak_bytes <= budget
        same_run(expected, execute(program, arrays, verify=True))
        ks.append(checkpointed(program))
    # The least memory near √n; a larger k (less recomputed) as the budget allows; none
    # where the plain loop fits.
    assert 10 <= ks[0][0] <= 40 and ks[0][0] < ks[1][0] < ks[2][0] < 400 and ks[3] == []
    # (the largest k that fits: one more does not)
    program = forced(spec, inputs, ks[1][0] + 1, backward=True)
    assert program.planned_peak_bytes > (need + plain.planned_peak_bytes) // 2
    with pytest.raises(MemoryBudgetError, match=f"need at least {need} bytes"):
        compile_graph(spec, inputs, backward=True, limits=Limits(memory_budget_bytes=need - 1))
    with pytest.raises(MemoryBudgetError) as info:
        compile_graph(
            spec, inputs, backward=True, limits=Limits(memory_budget_bytes=need, recompute=False)
        )
    assert "recomputation" not in str(info.value)
    assert info.value.planned_bytes == plain.planned_peak_bytes
