"""Running a compiled program: a flat loop over prebound kernels and value slots.

`bind` turns each planned step into a tuple the loop can run without looking anything up:
a kernel with the step's number literals and static decisions already in it (the op's
ufunc, its shape-specialised kernel, or its forward on the backend's namespace), the
slots it reads and writes, and the slots to drop after it. No Tensor or Node objects, no
promotion or argument checks (the compiler made them), no dictionaries.

The loop counts the bytes of the arrays it holds, as the planner does, and reports that
measured peak. It checks the deadline and a cancel event every few steps: a long program
stops between steps (a single long kernel cannot be interrupted from inside a process).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

from gradserve.engine.backends import Backend, get_backend
from gradserve.engine.dtypes import ITEMSIZE
from gradserve.engine.errors import (
    Cancelled,
    DeadlineExceeded,
    GradserveError,
    NonFiniteError,
    ShapeError,
)
from gradserve.engine.graph.builder import Memo
from gradserve.engine.graph.facts import Facts, facts_of
from gradserve.engine.graph.ir import BACKWARD, DERIVED, NODE, RECOMPUTE, Lit, Program, Step
from gradserve.engine.graph.scan import MADE, OUTER, SCAN, Body, carry_sources
from gradserve.engine.graph.spec import RunResult
from gradserve.engine.shapes import fmt, numel

# Step codes: how many slots the kernel reads, or how it runs.
NULLARY, UNARY, BINARY, NARY, ALIAS, LOOP, UNARY_INTO, BINARY_INTO = range(8)
CHECK_EVERY = 8  # steps between two deadline and cancel checks

Kernel = Callable[..., Any]
Run = tuple[int, Kernel | None, int, int, int, Any, tuple[int, ...]]


class Bound:
    """A program's run on one backend: the step tuples, forward then backward (from its
    first step of the backward, or recomputed for it), and what it is given (name, slot,
    shape, dtype, and whether it is an upstream gradient)."""

    __slots__ = ("backend", "backward", "forward", "given")

    def __init__(
        self,
        backend: Backend,
        forward: list[Run],
        backward: list[Run],
        given: list[tuple[str, int, tuple[int, ...], str, bool]],
    ) -> None:
        self.backend = backend
        self.forward = forward
        self.backward = backward
        self.given = given


def bind(
    program: Program, device: str = "cpu", *, facts: Mapping[Step, Facts] | None = None
) -> Bound:
    """Prebind every step's kernel for `device`. `facts`: the steps' facts where their
    emitter knew them (engine.graph.facts)."""
    return _bind(program, get_backend(device), facts)


def _bind(program: Program, backend: Backend, facts: Mapping[Step, Facts] | None = None) -> Bound:
    steps = program.steps
    known = facts or {}
    has_ufuncs = backend.ufuncs is not None
    ufuncs, reuses, frees = program.ufunc, program.reuse, program.frees
    runs: list[Run] = []
    split = len(steps)
    for i, step in enumerate(steps):
        if split == len(steps) and (step.kind == BACKWARD or step.kind == RECOMPUTE):
            split = i
        runs.append(
            _run(
                step,
                program,
                backend,
                ufuncs[i] and has_ufuncs,
                reuses[i],
                frees[i],
                known.get(step),
            )
        )
    return Bound(backend, runs[:split], runs[split:], given_of(program))


def rebind(program: Program, bound: Bound, changed: Sequence[int]) -> Bound:
    """`bound`, the run of a program with `program`'s plan and steps but for the literals
    of the steps at `changed`, with those steps bound again (their literals are in their
    kernels: engine.graph.lifting)."""
    runs = bound.forward + bound.backward
    split = len(bound.forward)
    backend = bound.backend
    has_ufuncs = backend.ufuncs is not None
    for i in changed:
        runs[i] = _run(
            program.steps[i],
            program,
            backend,
            program.ufunc[i] and has_ufuncs,
            program.reuse[i],
            program.frees[i],
        )
    return Bound(backend, runs[:split], runs[split:], bound.given)


def given_of(program: Program) -> list[tuple[str, int, tuple[int, ...], str, bool]]:
    """What a program's run is given (`Bound.given`)."""
    metas = program.metas
    given = [
        (name, slot, metas[slot].shape, metas[slot].dtype, False)
        for name, slot in program.inputs.items()
    ]
    given += [
        (name, slot, metas[slot].shape, metas[slot].dtype, True)
        for name, slot in program.grad_inputs.items()
    ]
    return given


def _run(
    step: Step,
    program: Program,
    backend: Backend,
    ufunc: bool,
    reuse: int,
    frees: tuple[int, ...],
    facts: Facts | None = None,
) -> Run:
    """One step bound; its kernel comes from its facts' (worked out here if not given),
    else from the memo of kernels, else is made."""
    op = step.op
    if facts is None:
        if op is SCAN:
            return LOOP, None, step.out, 0, 0, _Loop(step, backend), frees
        facts = facts_of(step, program.metas)
    if facts.returns_input:
        return ALIAS, None, step.out, step.slots[0], 0, None, frees
    into = reuse >= 0
    fn = kernel_of(step, program, backend, ufunc, into, facts)
    slots = step.args if facts.slots_only else step.slots
    if into:
        code = UNARY_INTO if len(slots) == 1 else BINARY_INTO
        return code, fn, step.out, slots[0], slots[-1], reuse, frees  # type: ignore[return-value]
    n = len(slots)
    if n == 2:
        return BINARY, fn, step.out, slots[0], slots[1], None, frees  # type: ignore[return-value]
    if n == 1:
        return UNARY, fn, step.out, slots[0], 0, None, frees  # type: ignore[return-value]
    if n == 0:
        return NULLARY, fn, step.out, 0, 0, None, frees
    return NARY, fn, step.out, 0, 0, slots, frees


# A kernel depends only on its op, argument metas, literals and attributes, and how it runs
# (a ufunc, writing into a buffer): kernels are shared by steps and programs alike.
_KERNELS = Memo(1 << 14)


def kernel_of(
    step: Step,
    program: Program,
    backend: Backend,
    ufunc: bool,
    into: bool,
    facts: Facts | None = None,
) -> Kernel:
    """`step`'s kernel: its facts' (one per backend and way of running), else the memo of
    kernels by signature, else made. Binding calls it for every step (with the step's
    facts), and loading a stored program (engine.graph.serial) once per signature."""
    if facts is None:
        facts = facts_of(step, program.metas)
    kernels = facts.kernels.get(backend)
    if kernels is None:
        kernels = facts.kernels[backend] = [None] * 4
    fn = kernels[2 * ufunc + into]
    if fn is None:
        key = (backend, step.op, ufunc, into, *facts.sig)
        fn = _KERNELS.get(key)
        if fn is None:
            fn = _KERNELS.remember(key, _kernel(step, program, backend, ufunc, into))
        kernels[2 * ufunc + into] = fn
    return fn


def _kernel(step: Step, program: Program, backend: Backend, ufunc: bool, into: bool) -> Kernel:
    op = step.op
    if ufunc:
        return _ufunc_kernel(backend, op.ufunc, step, program, into=into)  # type: ignore[arg-type]
    kernel = None
    if op.kernel is not None:
        metas = [program.metas[a] if type(a) is int else None for a in step.args]
        kernel = op.kernel(backend, metas, **step.attrs)
    if kernel is None:
        kernel = partial(op.forward, backend.xp, **step.attrs)
    return _with_literals(kernel, step.args)


# Ufuncs for which f(a, b) == f(b, a) bit for bit, so that a literal may be bound first.
_COMMUTATIVE = frozenset({"add", "multiply", "maximum", "minimum"})


def _ufunc_kernel(backend: Backend, name: str, step: Step, program: Program, into: bool) -> Kernel:
    """A ufunc step's kernel. A number literal becomes a 0-d array of the result's dtype
    (the value NumPy would convert it to, without converting it on every call) and is bound
    first where that computes the same (a - v is a + (-v) exactly)."""
    ufuncs, xp = backend.ufuncs, backend.xp
    fn = getattr(ufuncs, name)
    args = step.args
    if len(args) != 2 or all(type(a) is int for a in args):
        return fn
    dtype = backend.dtype(program.metas[step.out].dtype)
    lit, first = (args[1], False) if type(args[1]) is Lit else (args[0], True)
    value = lit.value  # type: ignore[union-attr]
    if not first and name == "subtract":
        fn, value, first = ufuncs.add, -value, True
    elif not first and name in _COMMUTATIVE:
        first = True
    v = xp.asarray(value, dtype=dtype)
    if first:
        return partial(fn, v)
    return (lambda a, out: fn(a, v, out=out)) if into else (lambda a: fn(a, v))


def _with_literals(fn: Kernel, args: Sequence[Any]) -> Kernel:
    """`fn` over all of a step's arguments, as a kernel over its slots alone: the number
    literals are bound in."""
    if all(type(a) is int for a in args):
        return fn
    values = [a.value if type(a) is Lit else None for a in args]
    if len(args) == 2:
        if type(args[1]) is Lit:
            v = values[1]
            return lambda a: fn(a, v)
        if type(args[0]) is Lit:
            return partial(fn, values[0])
    is_slot = [type(a) is int for a in args]

    def kernel(*arrays: Any) -> Any:
        it = iter(arrays)
        return fn(*[next(it) if s else v for s, v in zip(is_slot, values, strict=True)])

    return kernel


def wrong_input(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    got: tuple[tuple[int, ...], str] | None,
) -> ShapeError:
    """An input that is not what the program was compiled for (`got`: its shape and dtype,
    None when it is missing), the same error in either tier."""
    given = "nothing" if got is None else f"{fmt(got[0])} {got[1]}"
    return ShapeError(
        f"input {name!r} must be {fmt(shape)} {dtype} on {device}, as compiled; got {given}"
    )


def execute(
    program: Program,
    inputs: Mapping[str, Any],
    *,
    grad_outputs: Mapping[str, Any] | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    verify: bool = False,
    detect_anomaly: bool = False,
) -> RunResult:
    """Run `program` (compiled and bound) on arrays of its backend. `deadline` is a
    `time.monotonic()` value; setting `cancel` stops the run at its next check. `verify`
    checks every result against its planned shape and dtype (tests). `detect_anomaly`:
    the first step that makes NaN or infinite values from finite inputs raises
    NonFiniteError (`Watch`)."""
    if not detect_anomaly:
        return _execute(program, inputs, grad_outputs, deadline, cancel, verify, None)
    backend = program.run.backend
    watch = Watch(backend, exact=backend.ufuncs is not np)  # (traps: NumPy's alone)
    with watch.traps():
        result = _execute(program, inputs, grad_outputs, deadline, cancel, verify, watch)
    if not watch.exact and any(
        watch.non_finite(a) for a in (*result.outputs.values(), *(result.gradients or {}).values())
    ):
        # A kernel that made them without the floating-point flags (BLAS, LAPACK), or an
        # input's: looked for step by step (it raises where one is found).
        _execute(program, inputs, grad_outputs, deadline, cancel, verify, Watch(backend, True))
    return result


def _execute(
    program: Program,
    inputs: Mapping[str, Any],
    grad_outputs: Mapping[str, Any] | None,
    deadline: float | None,
    cancel: threading.Event | None,
    verify: bool,
    watch: Watch | None,
) -> RunResult:
    started = time.monotonic()
    bound: Bound = program.run
    backend = bound.backend
    slots: list[Any] = [None] * len(program.metas)
    sizes = [0] * len(program.metas)
    live = 0
    given = grad_outputs or {}
    for name, slot, shape, dtype, upstream in bound.given:
        array = (given if upstream else inputs).get(name)
        if array is None or array.shape != shape or backend.dtype_name(array) != dtype:
            raise wrong_input(
                name,
                shape,
                dtype,
                backend.device,
                None if array is None else (tuple(array.shape), backend.dtype_name(array)),
            )
        if slots[slot] is None:  # (a name given twice is one array, counted once)
            slots[slot] = array
            sizes[slot] = nbytes = backend.nbytes(array)
            live += nbytes

    check = None
    if deadline is not None or cancel is not None:

        def check() -> None:
            if cancel is not None and cancel.is_set():
                raise Cancelled("the request was cancelled")
            if deadline is not None and time.monotonic() > deadline:
                elapsed = time.monotonic() - started
                raise DeadlineExceeded(f"the request ran past its time limit ({elapsed:.2f} s)")

    state = [live, live]  # live bytes, peak
    with backend.activate():
        t0 = time.perf_counter()
        _loop(bound.forward, slots, sizes, state, check, program, verify, 0, backend, watch)
        backend.synchronize()
        t1 = time.perf_counter()
        if bound.backward:
            _loop(
                bound.backward,
                slots,
                sizes,
                state,
                check,
                program,
                verify,
                len(bound.forward),
                backend,
                watch,
            )
            backend.synchronize()
    timings = {"plan": round(program.plan_ms, 3), "forward": round((t1 - t0) * 1000, 3)}
    if bound.backward:
        timings["backward"] = round((time.perf_counter() - t1) * 1000, 3)
    return RunResult(
        outputs={name: slots[slot] for name, slot in program.outputs},
        gradients=(
            {name: slots[slot] for name, slot in program.gradients} if program.backward else None
        ),
        peak_bytes=state[1],
        planned_peak_bytes=program.planned_peak_bytes,
        nodes=program.nodes,
        timings_ms=timings,
    )


def _loop(
    runs: list[Run],
    s: list[Any],
    sizes: list[int],
    state: list[int],
    check: Callable[[], None] | None,
    program: Program,
    verify: bool,
    offset: int,
    backend: Backend,
    watch: Watch | None = None,
) -> None:
    live, peak = state
    nbytes = backend.nbytes
    if watch is not None:
        runs = watch.out_of_place(runs)
    k = 0
    try:
        for k, (code, fn, out, a0, a1, rest, frees) in enumerate(runs):
            if check is not None and not k % CHECK_EVERY:
                check()
            if watch is not None and code != ALIAS and code != LOOP:
                r = watch.run(program, offset + k, code, fn, s, a0, a1, rest)
            elif code == BINARY:
                r = fn(s[a0], s[a1])  # type: ignore[misc]
            elif code == UNARY:
                r = fn(s[a0])  # type: ignore[misc]
            elif code == BINARY_INTO:
                r = fn(s[a0], s[a1], out=s[rest])  # type: ignore[misc]
            elif code == UNARY_INTO:
                r = fn(s[a0], out=s[rest])  # type: ignore[misc]
            elif code == ALIAS:
                s[out] = s[a0]
                for f in frees:
                    live -= sizes[f]
                    sizes[f] = 0
                    s[f] = None
                continue
            elif code == LOOP:
                held, results = rest.run(s, check, verify, backend, watch)
                peak = max(peak, live + held)
                for slot, r in results:
                    s[slot] = r
                    sizes[slot] = nb = nbytes(r)
                    live += nb
                peak = max(peak, live)
                for f in frees:
                    live -= sizes[f]
                    sizes[f] = 0
                    s[f] = None
                continue
            elif code == NULLARY:
                r = fn()  # type: ignore[misc]
            else:
                r = fn(*[s[j] for j in rest])  # type: ignore[misc]
            s[out] = r
            if code >= UNARY_INTO:  # the result took over a dead operand's buffer
                sizes[out] = sizes[rest]
                sizes[rest] = 0
            else:
                sizes[out] = nb = nbytes(r)
                live += nb
                if live > peak:
                    peak = live
            if verify:
                _verify(program, offset + k, r, backend)
            for f in frees:
                live -= sizes[f]
                sizes[f] = 0
                s[f] = None
    except GradserveError as err:
        step = program.steps[offset + k]
        raise err.at(node=step.origin, op=step.op.name) from None
    except (ValueError, TypeError, IndexError, ArithmeticError, RuntimeError) as exc:
        step = program.steps[offset + k]
        raise GradserveError(
            f"{type(exc).__name__}: {exc}", node=step.origin, op=step.op.name
        ) from None
    state[0], state[1] = live, peak


class _Body:
    """A loop body bound: its runs, the bytes of the inputs it is given at each step (its
    closures' are added per run), and where its carries' next values come from."""

    __slots__ = ("body", "bound", "distinct", "given", "sizes", "sources")

    def __init__(self, body: Body, backend: Backend, runs: list[Run] | None) -> None:
        program = body.program
        assert program is not None, "a scan is bound after its body is planned"
        if runs is None:  # (a loaded program's loader has them: engine.graph.serial)
            bound = _bind(program, backend, body.b.facts)
            runs = bound.forward + bound.backward
        self.body = body
        self.bound = runs
        self.sources, roots = carry_sources(body, program)
        # The arrays have the shapes they were compiled for (`verify` checks it): the bytes
        # of the body's inputs are known, and of its carries when each next value is a new
        # array of its own (else they are counted by array, as they are shared).
        metas = program.metas
        self.sizes = [0] * len(metas)
        replayed = body.replay.replayed if body.replay is not None else []
        for slot in (*body.carries, *body.xs, *replayed):
            self.sizes[slot] = numel(metas[slot].shape) * ITEMSIZE[metas[slot].dtype]
        self.given = sum(self.sizes)
        distinct = all(s == MADE for s in self.sources) and len(set(roots)) == len(roots)
        self.distinct = (
            sum(numel(metas[r].shape) * ITEMSIZE[metas[r].dtype] for r in roots)
            if distinct
            else None
        )

    def template(
        self, closures: list[Any], nbytes: Callable[[Any], int]
    ) -> tuple[list[Any], list[int], int]:
        """The slots and their bytes that every step starts from (the closures set), and
        the bytes given."""
        body = self.body
        template: list[Any] = [None] * len(self.sizes)
        sizes = self.sizes.copy()
        for slot, array in zip(body.closures, closures, strict=True):
            template[slot] = array
            sizes[slot] = nbytes(array)
        return template, sizes, self.given + sum(sizes[slot] for slot in body.closures)

    def made(
        self, carries: list[Any], outer: list[bool], nbytes: Callable[[Any], int]
    ) -> tuple[int, list[bool]]:
        """The bytes of the next carries `carries` that the body made, and per carry whether
        it is an array the outer program counts (from `outer`, the carries' before)."""
        if self.distinct is not None:
            return self.distinct, outer
        outer = [src == OUTER or (src >= 0 and outer[src]) for src in self.sources]
        return sum(
            nbytes(a)
            for a in {id(a): a for a, o in zip(carries, outer, strict=True) if not o}.values()
        ), outer


class _Loop:
    """A scan step bound: its body, a checkpointed reverse loop's replay, and how its
    arguments and results map to the bodies' slots."""

    __slots__ = ("args", "body", "inner", "kept", "replay", "results", "ys")

    def __init__(
        self,
        step: Step,
        backend: Backend,
        runs: list[Run] | None = None,
        replay_runs: list[Run] | None = None,
    ) -> None:
        body: Body = step.attrs["body"]
        self.body = body
        self.inner = _Body(body, backend, runs)
        self.replay = None if body.replay is None else _Body(body.replay, backend, replay_runs)
        self.args = step.slots
        nc, ny = len(body.carries), len(body.ys)
        wanted = body.wanted
        # (result number, body slot) per stacked result the program uses
        self.ys = [(nc + k, y) for k, y in enumerate(body.ys) if wanted[nc + k]]
        # A checkpointed forward loop's: (result number, carry number) per checkpoint, and
        # (result number, body slot) per buffer
        self.kept = (
            (
                [(nc + ny + k, k) for k in range(nc) if wanted[nc + ny + k]],
                [
                    (nc + ny + nc + k, r)
                    for k, r in enumerate(body.buffered())
                    if wanted[nc + ny + nc + k]
                ],
            )
            if body.every
            else ([], [])
        )
        # (outer slot, result number)
        self.results = [(slot, k) for k, slot in enumerate(step.outs) if wanted[k]]

    def run(
        self,
        s: list[Any],
        check: Callable[[], None] | None,
        verify: bool,
        backend: Backend,
        watch: Watch | None = None,
    ) -> tuple[int, list[tuple[int, Any]]]:
        """Run the loop on the outer slots `s`: the most bytes it held beyond what the
        outer program counts, and its results (outer slot, array)."""
        if self.replay is not None:
            return self._segments(s, check, verify, backend, watch)
        body, inner = self.body, self.inner
        program = body.program
        assert program is not None
        nbytes = backend.nbytes
        metas = program.metas
        args = [s[a] for a in self.args]
        nc, nx = len(body.carries), len(body.xs)
        carries, xs, closures = args[:nc], args[nc : nc + nx], args[nc + nx :]
        length, every = body.length, body.every
        stacks = {k: _stack(backend, length, metas[y]) for k, y in self.ys}
        checkpoints, buffers = self.kept
        stacks.update(
            (k, _stack(backend, body.segments, metas[body.carries[c]])) for k, c in checkpoints
        )
        stacks.update((k, _stack(backend, every, metas[r])) for k, r in buffers)
        held = sum(nbytes(a) for a in stacks.values())
        starts = {body.start(j): j for j in range(body.segments)}
        last = length - every  # (the first step of the last segment)
        template, sizes, given = inner.template(closures, nbytes)
        carry_slots, x_slots, nexts, ys, runs = (
            body.carries,
            body.xs,
            body.nexts,
            self.ys,
            inner.bound,
        )
        # (a shifted slice is the row of the step this loop visits next)
        shifted = [(x_slots[i], xs[i], closures[j]) for i, j in body.shifted]
        ahead = -1 if body.reverse else 1
        distinct = inner.distinct
        outer = [True] * nc  # per carry: an array the outer program counts
        made = 0  # bytes of the carries the body made, held into the next step
        most = 0
        for p in range(length):
            t = length - 1 - p if body.reverse else p
            if checkpoints and p in starts:
                for k, c in checkpoints:
                    stacks[k][starts[p], ...] = carries[c]
            slots = template.copy()
            for slot, array in zip(carry_slots, carries, strict=True):
                slots[slot] = array
            for slot, seq in zip(x_slots, xs, strict=True):
                slots[slot] = seq[t, ...]  # (the array API indexes every dim)
            for slot, seq, first in shifted:
                slots[slot] = seq[t + ahead, ...] if p < length - 1 else first
            state = [given, given]
            _loop(runs, slots, sizes.copy(), state, check, program, verify, 0, backend, watch)
            if made + state[1] - given > most:
                most = made + state[1] - given
            for k, y in ys:
                stacks[k][t, ...] = slots[y]
            if buffers and p >= last:
                for k, r in buffers:
                    stacks[k][p - last, ...] = slots[r]
            carries = [slots[n] for n in nexts]
            if distinct is not None:
                made = distinct
            else:
                made, outer = inner.made(carries, outer, nbytes)
        results = [(slot, carries[k] if k < nc else stacks[k]) for slot, k in self.results]
        return held + most, results

    def _segments(
        self,
        s: list[Any],
        check: Callable[[], None] | None,
        verify: bool,
        backend: Backend,
        watch: Watch | None,
    ) -> tuple[int, list[tuple[int, Any]]]:
        """A checkpointed reverse loop: per segment from the last, the forward body replayed
        from its checkpoint into the buffers (the last segment's the forward filled), then
        this body over them, the other way."""
        body, inner, replay = self.body, self.inner, self.replay
        forward = body.replay
        program = body.program
        assert program is not None and replay is not None and forward is not None
        forward_program = forward.program
        assert forward_program is not None
        nbytes = backend.nbytes
        metas = program.metas
        args = [s[a] for a in self.args]
        nc, nx, nz = len(body.carries), len(body.xs), len(body.closures)
        carries, xs, closures = args[:nc], args[nc : nc + nx], args[nc + nx : nc + nx + nz]
        buffered, lags = forward.buffered(), forward.lagged()
        rest = args[nc + nx + nz :]
        fc, fb, fx = len(forward.carries), len(buffered), len(forward.xs)
        checkpoints, buffers = rest[:fc], rest[fc : fc + fb]
        forward_xs, forward_closures = rest[fc + fb : fc + fb + fx], rest[fc + fb + fx :]
        length = body.length
        stacks = {k: _stack(backend, length, metas[y]) for k, y in self.ys}
        held = sum(nbytes(a) for a in stacks.values())
        template, sizes, given = inner.template(closures, nbytes)
        replay_template, replay_sizes, replay_given = replay.template(forward_closures, nbytes)
        fill = list(zip(buffered, buffers, strict=True))
        buffer_of = dict(fill)
        lagging = [(c, buffer_of[forward.nexts[k]], checkpoints[k]) for c, k in lags.items()]
        carry_slots, x_slots, nexts, ys, runs = (
            body.carries,
            body.xs,
            body.nexts,
            self.ys,
            inner.bound,
        )
        f_carries, f_xs, f_nexts = forward.carries, forward.xs, forward.nexts
        outer = [True] * nc
        made = most = 0
        segments = forward.segments
        for segment in range(segments - 1, -1, -1):
            first = forward.start(segment)
            count = (forward.start(segment + 1) if segment < segments - 1 else length) - first
            if segment < segments - 1:  # (the forward filled the last one's buffers)
                state_carries = [c[segment, ...] for c in checkpoints]
                f_outer = [True] * fc
                f_made = 0
                for i in range(count):
                    t = length - 1 - (first + i) if forward.reverse else first + i
                    slots = replay_template.copy()
                    for slot, array in zip(f_carries, state_carries, strict=True):
                        slots[slot] = array
                    for slot, seq in zip(f_xs, forward_xs, strict=True):
                        slots[slot] = seq[t, ...]
                    state = [replay_given, replay_given]
                    _loop(
                        replay.bound,
                        slots,
                        replay_sizes.copy(),
                        state,
                        check,
                        forward_program,
                        verify,
                        0,
                        backend,
                        watch,
                    )
                    if made + f_made + state[1] - replay_given > most:
                        most = made + f_made + state[1] - replay_given
                    for r, buffer in fill:
                        buffer[i, ...] = slots[r]
                    state_carries = [slots[n] for n in f_nexts]
                    f_made, f_outer = replay.made(state_carries, f_outer, nbytes)
                del slots, state_carries
            for i in range(count - 1, -1, -1):
                t = length - 1 - (first + i) if forward.reverse else first + i
                slots = template.copy()
                for slot, array in zip(carry_slots, carries, strict=True):
                    slots[slot] = array
                for slot, seq in zip(x_slots, xs, strict=True):
                    slots[slot] = seq[t, ...]
                for r, buffer in fill:
                    slots[r] = buffer[i, ...]
                for c, buffer, checkpoint in lagging:
                    slots[c] = buffer[i - 1, ...] if i else checkpoint[segment, ...]
                state = [given, given]
                _loop(runs, slots, sizes.copy(), state, check, program, verify, 0, backend, watch)
                if made + state[1] - given > most:
                    most = made + state[1] - given
                for k, y in ys:
                    stacks[k][t, ...] = slots[y]
                carries = [slots[n] for n in nexts]
                made, outer = inner.made(carries, outer, nbytes)
        results = [(slot, carries[k] if k < nc else stacks[k]) for slot, k in self.results]
        return held + most, results


# Run lists made out of place for a watch, by the list they came from (a program's, a loop
# body's), for the programs watched most recently (a watch is made anew for every run).
_MADE: OrderedDict[int, tuple[list[Run], list[Run]]] = OrderedDict()
_MADE_KEPT = 64
_MADE_LOCK = threading.Lock()


class Watch:
    """detect_anomaly over a run. On NumPy the run goes under NumPy's floating-point traps
    (`traps`): a kernel that makes a NaN or an infinity (invalid, overflow, division by
    zero) raises, and costs nothing when none does; that step is then run again with the
    traps off and blamed if its inputs were finite (quiet NaNs pass through a kernel
    without a flag: a NaN given is never blamed on a step). `exact` (CuPy, and the second
    look when a run's answers hold what no flag announced): every step's result is looked
    at. Kernels that would overwrite an operand run out of place, so that a step's inputs
    can still be looked at."""

    def __init__(self, backend: Backend, exact: bool) -> None:
        self.xp = backend.xp
        self.exact = exact

    @contextmanager
    def traps(self) -> Iterator[None]:
        if self.exact:
            yield
            return
        with np.errstate(invalid="raise", over="raise", divide="raise", under="ignore"):
            yield

    def out_of_place(self, runs: list[Run]) -> list[Run]:
        """`runs` with each in-place kernel run out of place (its dead operand freed after
        it instead)."""
        with _MADE_LOCK:
            known = _MADE.get(id(runs))
            if known is not None and known[0] is runs:
                _MADE.move_to_end(id(runs))
                return known[1]
        plain = [_out_of_place(run) for run in runs]
        with _MADE_LOCK:
            _MADE[id(runs)] = (runs, plain)
            if len(_MADE) > _MADE_KEPT:
                _MADE.popitem(last=False)
        return plain

    def run(
        self,
        program: Program,
        index: int,
        code: int,
        fn: Any,
        s: list[Any],
        a0: int,
        a1: int,
        rest: Any,
    ) -> Any:
        """One step's result, looked at as the watch does."""
        args = (
            (s[a0],)
            if code == UNARY
            else (s[a0], s[a1])
            if code == BINARY
            else ()
            if code == NULLARY
            else tuple(s[j] for j in rest)
        )
        if not self.exact:
            try:
                return fn(*args)
            except FloatingPointError:
                with np.errstate(all="ignore"):
                    r = fn(*args)
        else:
            r = fn(*args)
        count = self.non_finite(r)
        if count and not any(self.non_finite(a) for a in args):
            raise _blame(program, index, r, count)
        return r

    def non_finite(self, a: Any) -> int:
        """How many values of `a` are NaN or infinite (0 for an integer, a bool, a literal)."""
        dtype = getattr(a, "dtype", None)
        if dtype is None or dtype.kind not in "fc":
            return 0
        return int(a.size - self.xp.count_nonzero(self.xp.isfinite(a)))


def _out_of_place(run: Run) -> Run:
    """A step that writes into a dead operand's buffer, writing a new array instead (the
    operand freed after it)."""
    code, fn, out, a0, a1, rest, frees = run
    if code not in (UNARY_INTO, BINARY_INTO) or fn is None:
        return run
    code = UNARY if code == UNARY_INTO else BINARY
    return code, partial(fn, out=None), out, a0, a1, None, (*frees, rest)


def _blame(program: Program, index: int, result: Any, count: int) -> NonFiniteError:
    step = program.steps[index]
    backward = step.kind == BACKWARD or step.kind == DERIVED
    op = _differentiated(program, step) if backward else step.op.name
    size = int(getattr(result, "size", 1))
    values = "all" if count == size else f"{count} of {size}"
    where = f"the derivative of {op!r} (in the backward)" if backward else f"{op!r}"
    return NonFiniteError(
        f"{values} values of {where} are NaN or infinite, from finite inputs (detect_anomaly)",
        node=step.origin,
        op=op,
        phase="backward" if backward else "forward",
        count=count,
    )


def _differentiated(program: Program, step: Step) -> str:
    """The forward primitive whose derivative a backward step computes (PyTorch's
    `SqrtBackward0`): the nearest forward step of its node whose result or arguments it
    reads, directly or through the backward steps of its node; else its own primitive."""
    made = {t.out: t for t in program.steps}
    level, seen = list(step.slots), set()
    while level:
        found = []
        for slot in level:
            seen.add(slot)
            t = made.get(slot)
            if t is not None and t.origin == step.origin:
                found.append(t)
        forward = [t for t in found if t.kind == NODE]
        if forward:
            return forward[0].op.name
        level = [a for t in found for a in t.slots if a not in seen]
    return step.op.name


def _stack(backend: Backend, rows: int, meta: Any) -> Any:
    """An uninitialized array of `rows` values of `meta`."""
    return backend.xp.empty((rows, *meta.shape), dtype=backend.dtype(meta.dtype))


def _verify(program: Program, index: int, result: Any, backend: Backend) -> None:
    step = program.steps[index]
    meta = program.metas[step.out]
    shape, dtype = tuple(result.shape), backend.dtype_name(result)
    if shape != meta.shape or dtype != meta.dtype:
        raise ShapeError(
            f"step {index} ({step.op.name}) made shape {fmt(shape)} {dtype}, but its "
            f"shape rule says {fmt(meta.shape)} {meta.dtype}",
            node=step.origin,
        )
