"""The native tier: a compiled program lowered to XLA through JAX, as one function.

A Program is already everything an array compiler wants: static shapes and dtypes, the
derived backward as more steps, loops as `scan` steps. `lower` traces its steps, forward
and backward (RECOMPUTE ones included), into one pure JAX function, a `scan` step as
`lax.scan` over its body's steps, and has XLA compile it (`jax.jit(...).lower(...)
.compile()`). JAX is a compiler only here: the derivative is gradserve's, never jax.grad.

Each op runs its OpDef's `lower`, else its `forward`, on a JAX namespace (jax.numpy with
the extras the NumPy backend's namespace has, and `defer`); an op marked NOT_LOWERED, or
whose forward does not trace, keeps the program on the interpreter (NotLowerable says
which). Every traced step's shape and dtype is checked against its shape rule while
tracing, so a lowering that computes another dtype is refused before anything runs.

Checks that read the data (an index out of range) cannot raise inside XLA: a lowering
hands the values they read to `xp.defer(check, *values)`, they become extra results, and
`check` runs on them on the host after the run (inside a loop, stacked over its
iterations: a check reads them as a whole).

Budgets: XLA's buffer assignment (`memory_analysis()`: arguments, results and temporaries,
less what aliases) must fit the program's planned peak, or `lower` refuses; beyond the
plan's arrays, only XLA's bookkeeping (BOOKKEEPING_BYTES) is allowed. A recomputed
value (engine.graph.remat) is computed from its inputs passed through an optimization
barrier with the backward value made just before it, so that XLA neither merges it with
the forward's nor moves it earlier, and its memory stays the plan's. A checkpointed loop
(engine.graph.checkpoint) is refused: the plan chose it because the loop's plain
residuals did not fit, which a plain `lax.scan` would hold again.

jax is imported on first use only: gradserve imports and runs without it (`available`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from functools import cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from gradserve.engine.backends.base import namespace_with
from gradserve.engine.errors import GradserveError
from gradserve.engine.graph.compiler import roll_program
from gradserve.engine.graph.executor import given_of, wrong_input
from gradserve.engine.graph.ir import RECOMPUTE, Program, Step
from gradserve.engine.graph.scan import SCAN, Body
from gradserve.engine.graph.spec import RunResult
from gradserve.engine.ops.indexing import IndexRange
from gradserve.engine.ops.registry import NOT_LOWERED, Meta
from gradserve.engine.shapes import fmt

__all__ = ["Lowered", "NotLowerable", "available", "lower", "namespace"]


# What XLA's buffers hold besides array values, which the plan (arrays only) does not
# count: the tables of a tuple's buffers and a loop's counter, 8 bytes each (a 1,000-step
# RNN's loops and outputs, differentiated: 216 bytes).
BOOKKEEPING_BYTES = 4096

# XLA's CPU options tried in turn while its buffer assignment exceeds the budget; a
# program that fits at the first (XLA's defaults) compiles as before. XLA's default
# schedule is not the plan's order, and its loop fusion holds every operand of a fused
# computation at once: a gradient accumulated over an unrolled loop's steps
# (dW = Σ x_tᵀ·da_t, added one step at a time in the plan) becomes one fusion of all its
# terms, each a matmul's result that no fusion can absorb, so all of them are live
# together (the 24-step recurrent cell of bench/workloads.py: 2 x 24 16x16 float32
# terms, 48 KiB, against a plan of 34,692 bytes in all; XLA 79,532). The memory-optimized
# scheduler alone computes one such sum after the other (46,700); without fusion each
# step's result is materialized and freed as the plan frees it, and that scheduler keeps
# to the plan's peak (36,204). An optimization barrier cannot stand in: XLA's CPU
# pipeline removes them before fusion. Before giving up fusion: reductions kept from
# YNNPACK (its dots stay). A YNNPACK reduction is a library call on materialized
# operands, where XLA's own reduce fusion computes its elementwise operands as it reads
# them: GradBench's gmm (d=10, k=25, n=1000), whose dQ = Σ_n dLx·xc held a recomputed
# xc, 2 MB, next to three other f64[1000,25,10], needs 8,338,384 bytes with YNNPACK's
# reductions against a plan of 8,130,408, and 6,400,336 without them (and runs faster).
# CPU only: on another backend the options would mean something else (GPU fusion is most
# of its speed).
_MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
CPU_ATTEMPTS: tuple[dict[str, Any], ...] = (
    {},
    _MEMORY_SCHEDULER,
    {**_MEMORY_SCHEDULER, "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    {**_MEMORY_SCHEDULER, "xla_disable_hlo_passes": "fusion"},
)


# Why a program whose vmap reduces over its batch stays in the interpreter.
INDEX_ORDERED = "vmap: interpreted, its reductions add index after index (XLA keeps no order)"


class NotLowerable(Exception):
    """The program stays on the interpreter; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@cache
def _jax() -> Any:
    # On a GPU, JAX would take 75% of its memory at its first use: the GPU's memory is
    # CuPy's and the admission ledger's, and an executable needs only its own buffers.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    # Process-wide, and before any tracing: gradserve's programs are float64 by default.
    jax.config.update("jax_enable_x64", True)
    # A run's results are read at once: dispatched to another thread, a CPU executable
    # only adds a hand-over and a wake-up across cores to each call (the cell as a scan:
    # 0.20 ms asynchronous, 0.10 ms run on the calling thread, on 2 cores).
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return jax


def available() -> bool:
    """Whether jax can be imported (imports it the first time; never raises)."""
    try:
        _jax()
    except Exception:  # (ImportError, or a broken install: either way, no tier)
        return False
    return True


# A check deferred to the host: the check (data: engine.ops.indexing.IndexRange), the
# traced values it reads (stacked by the loops they are computed in), and the node and op
# of the step that deferred it (for its error).
Deferred = tuple[Callable[..., None], list[Any], str | None, str]
_tracing = threading.local()  # .deferred: the current trace's list of Deferred, .step


def _defer(check: Callable[..., None], *values: Any) -> None:
    """`xp.defer`: run `check(*values)` on the host after the run, on NumPy arrays."""
    step = _tracing.step
    _tracing.deferred.append((check, list(values), step.origin, step.op.name))


def _scatter_add(x: Any, dim: int, index: Any, src: Any) -> Any:
    """torch.scatter_add on JAX arrays: repeated indices accumulate (`.at[].add`)."""
    jnp = _jax().numpy
    grid = list(jnp.indices(index.shape, sparse=True))
    grid[dim] = index
    return x.at[tuple(grid)].add(src[tuple(slice(0, n) for n in index.shape)])


@cache
def namespace() -> SimpleNamespace:
    """The `xp` that ops' forwards and lowerings get in the tier: jax.numpy, plus the
    NumPy backend's extras (einsum, scatter_add) and `defer`."""
    jnp = _jax().numpy
    return namespace_with(jnp, einsum=jnp.einsum, scatter_add=_scatter_add, defer=_defer)


def _device(jax: Any, device: str) -> Any:
    """The JAX device of a gradserve device name ("cpu", "cuda:N")."""
    kind, _, index = device.partition(":")
    try:
        devices = jax.devices("gpu" if kind == "cuda" else kind)
        return devices[int(index or 0)]
    except (RuntimeError, IndexError, ValueError) as exc:
        raise NotLowerable(f"device {device!r}: JAX has no such device ({exc})") from None


class _Tracer:
    """Runs a program's steps on traced values (a list by slot), deferring its checks."""

    def __init__(self, jax: Any) -> None:
        self.jax = jax
        self.xp = namespace()

    def run(self, program: Program, env: list[Any], deferred: list[Deferred]) -> None:
        last = None  # the value of the step before (what a recomputation waits for)
        for step in program.steps:
            if step.op is SCAN:
                self._scan(step, env, deferred)
                last = env[step.out]
                continue
            args = [env[a] if type(a) is int else a.value for a in step.args]  # type: ignore[union-attr]
            if step.kind == RECOMPUTE and last is not None:
                arrays = [a for a in args if not isinstance(a, (bool, int, float))]
                barred = iter(self.jax.lax.optimization_barrier((arrays, last))[0])
                args = [a if isinstance(a, (bool, int, float)) else next(barred) for a in args]
            env[step.out] = last = self._apply(step, args, program.metas[step.out], deferred)

    def _apply(self, step: Step, args: list[Any], meta: Meta, deferred: list[Deferred]) -> Any:
        op = step.op
        if op.lower is NOT_LOWERED:
            raise NotLowerable(f"op {op.name!r} has no lowering")
        fn = op.lower or op.forward
        _tracing.deferred, _tracing.step = deferred, step
        try:
            out = fn(self.xp, *args, **step.attrs)
        except NotLowerable:
            raise
        except Exception as exc:  # (a concretization error: the forward reads the data)
            raise NotLowerable(
                f"op {op.name!r} has no lowering: its forward does not trace "
                f"({type(exc).__name__}: {exc})"
            ) from None
        out = self.xp.asarray(out)
        shape, dtype = tuple(out.shape), out.dtype.name
        if shape != meta.shape or dtype != meta.dtype:
            raise NotLowerable(
                f"op {op.name!r} traced to {fmt(shape)} {dtype}, but its shape "
                f"rule says {fmt(meta.shape)} {meta.dtype}"
            )
        return out

    def _scan(self, step: Step, env: list[Any], deferred: list[Deferred]) -> None:
        """A scan step as lax.scan over its body's program."""
        body: Body = step.attrs["body"]
        if body.every or body.replay is not None:
            raise NotLowerable(
                "op 'scan': a checkpointed loop (its residuals recomputed to "
                "fit the memory budget) is not lowered"
            )
        program = body.program
        assert program is not None, "a scan is lowered after its body is planned"
        jax, jnp = self.jax, self.xp
        metas = program.metas
        args = [env[a] for a in step.slots]
        nc, nx = len(body.carries), len(body.xs)
        carries, xs, closures = args[:nc], args[nc : nc + nx], args[nc + nx :]
        length, reverse = body.length, body.reverse
        # A shifted slice is the row of the step the loop visits next, and at its last
        # step a closure's value (engine.graph.scan): read by index, not copied shifted.
        shifted = {body.xs[i]: (xs[i], closures[j]) for i, j in body.shifted}
        plain = [(slot, seq) for slot, seq in zip(body.xs, xs, strict=True) if slot not in shifted]
        ys = [y for k, y in enumerate(body.ys) if body.wanted[nc + k]]
        inner: list[Deferred] = []
        ahead = -1 if reverse else 1

        def one_step(state: tuple[Any, tuple[Any, ...]], rows: list[Any]) -> Any:
            t, carry = state
            slots: list[Any] = [None] * len(metas)
            for slot, value in zip(body.closures, closures, strict=True):
                slots[slot] = value
            for slot, value in zip(body.carries, carry, strict=True):
                slots[slot] = value
            for (slot, _), row in zip(plain, rows, strict=True):
                slots[slot] = row
            for slot, (seq, first) in shifted.items():
                p = length - 1 - t if reverse else t
                row = jax.lax.dynamic_index_in_dim(
                    seq, jnp.clip(t + ahead, 0, length - 1), keepdims=False
                )
                slots[slot] = jnp.where(p < length - 1, row, first)
            inner.clear()
            self.run(program, slots, inner)
            nexts = tuple(self._strong(slots[n], metas[n]) for n in body.nexts)
            return (t + ahead, nexts), ([slots[y] for y in ys], [d[1] for d in inner])

        init = tuple(self._strong(c, metas[s]) for c, s in zip(carries, body.carries, strict=True))
        # The row's index is counted in the carry, not scanned over as an arange: that
        # would be one more array of the loop's length (a 1,000-step loop: 8,000 bytes).
        start = jnp.asarray(length - 1 if reverse else 0, dtype=np.int64)
        (_, final), (stacks, checked) = jax.lax.scan(
            one_step, (start, init), [seq for _, seq in plain], length=length, reverse=reverse
        )
        deferred.extend(
            (check, values, origin, op)
            for (check, _, origin, op), values in zip(inner, checked, strict=True)
        )
        stacked = iter(stacks)
        for k, slot in enumerate(step.outs):
            if k < nc:
                env[slot] = final[k]
            elif body.wanted[k]:
                env[slot] = next(stacked)

    def _strong(self, value: Any, meta: Meta) -> Any:
        """A carry as lax.scan needs it from step to step: its dtype, not weakly typed."""
        return self.jax.lax.convert_element_type(value, np.dtype(meta.dtype))


class Lowered:
    """A program compiled by XLA, run as one call."""

    def __init__(
        self,
        program: Program,
        device: str,
        compiled: Any,
        memory_bytes: int,
        compile_ms: float,
        deferred: list[Deferred],
        rolled: bool = False,
    ) -> None:
        self.program = program
        self.device = device
        self.memory_bytes = memory_bytes
        self.compile_ms = compile_ms
        self.rolled = rolled  # compiled from the program with its unrolled loops rolled
        self._compiled = compiled
        # (name, shape, dtype, upstream) of each argument: checked on every run
        self._given = [
            (name, shape, np.dtype(dtype), upstream)
            for name, _, shape, dtype, upstream in _given(program)
        ]
        self._deferred = deferred

    def run(
        self, inputs: Mapping[str, Any], grad_outputs: Mapping[str, Any] | None = None
    ) -> RunResult:
        """Run on NumPy arrays (checked against the compiled shapes and dtypes, as the
        executor checks them); NumPy arrays out."""
        program = self.program
        given = grad_outputs or {}
        arrays = []
        for name, shape, dtype, upstream in self._given:
            array = (given if upstream else inputs).get(name)
            if array is None or array.shape != shape or array.dtype != dtype:
                raise wrong_input(
                    name,
                    shape,
                    dtype.name,
                    self.device,
                    None if array is None else (tuple(array.shape), array.dtype.name),
                )
            arrays.append(array)
        t0 = time.perf_counter()
        results, checked = self._compiled(*arrays)
        results = [np.asarray(r) for r in results]
        elapsed = round((time.perf_counter() - t0) * 1000, 3)
        if checked:
            for (check, _, origin, op), values in zip(self._deferred, checked, strict=True):
                try:
                    check(*[np.asarray(v) for v in values])
                except GradserveError as err:
                    raise err.at(node=origin, op=op) from None
        it = iter(results)
        outputs = {name: next(it) for name, _ in program.outputs}
        gradients = {name: next(it) for name, _ in program.gradients} if program.backward else None
        # XLA runs the forward and the backward as one call: all of it counts as forward.
        timings = {"plan": round(program.plan_ms, 3), "forward": elapsed}
        return RunResult(
            outputs=outputs,
            gradients=gradients,
            peak_bytes=self.memory_bytes,
            planned_peak_bytes=program.planned_peak_bytes,
            nodes=program.nodes,
            timings_ms=timings,
        )

    def export(self) -> tuple[bytes, dict[str, Any]]:
        """The executable as bytes (XLA's own serialisation), and what loading it needs
        besides the program: data only (no pickle)."""
        from jax.experimental import serialize_executable

        payload, _, _ = serialize_executable.serialize(self._compiled)
        checks = []
        for check, values, origin, op in self._deferred:
            if not isinstance(check, IndexRange):
                raise NotLowerable(f"op {op!r}: its check on the host cannot be stored")
            checks.append([check.size, check.dim, origin, op, len(values)])
        return payload, {
            "device": self.device,
            "memory_bytes": self.memory_bytes,
            "compile_ms": round(self.compile_ms, 3),
            "checks": checks,
            "jax": _jax().__version__,
            "rolled": self.rolled,
        }

    @classmethod
    def load(cls, program: Program, payload: bytes, meta: dict[str, Any]) -> Lowered:
        """An executable `export` made for `program`, loaded (no tracing, no compile: XLA
        reads its own serialisation); NotLowerable when it cannot be."""
        try:
            jax = _jax()
            from jax.experimental import serialize_executable

            if meta.get("jax") != jax.__version__:
                raise NotLowerable(f"an executable of jax {meta.get('jax')}, not {jax.__version__}")
            _find_lapack()
            checks: list[Deferred] = [
                (IndexRange(size, dim), [None] * n, origin, op)
                for size, dim, origin, op, n in meta["checks"]
            ]
            results = len(program.outputs) + (len(program.gradients) if program.backward else 0)
            tree = jax.tree_util.tree_structure
            in_tree = tree(((0,) * len(_given(program)), {}))
            out_tree = tree(([0] * results, [[0] * len(c[1]) for c in checks]))
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            return cls(
                program,
                str(meta["device"]),
                compiled,
                int(meta["memory_bytes"]),
                float(meta["compile_ms"]),
                checks,
                bool(meta.get("rolled")),
            )
        except NotLowerable:
            raise
        except Exception as exc:  # (not an executable, or not this program's)
            raise NotLowerable(
                f"the stored executable does not load ({type(exc).__name__}: {exc})"
            ) from None


def _find_lapack() -> None:
    """XLA's CPU kernels of the LAPACK ops (det, inv, solve) look LAPACK's functions up when
    jax first lowers such an op in a process: a process that only loads executables must
    have them looked up, or such a kernel calls nothing, and the process dies (SIGSEGV)."""
    from jaxlib import lapack

    lapack._lapack.initialize()


def _given(program: Program) -> list[tuple[str, int, tuple[int, ...], str, bool]]:
    """What the program is given, one entry per slot (a name given twice is one array)."""
    seen: set[int] = set()
    out = []
    for entry in given_of(program):
        if entry[1] not in seen:
            seen.add(entry[1])
            out.append(entry)
    return out


def lower(
    program: Program, device: str = "cpu", *, budget: int | None = None, roll: bool = True
) -> Lowered:
    """`program` traced and compiled by XLA for `device`; raises NotLowerable (an op
    without a lowering, a checkpointed loop, XLA's memory over `budget`, by default the
    program's planned peak and XLA's bookkeeping, no jax). Slow (XLA compiles): call it off
    the request path.

    `roll`: what XLA compiles is the program with its unrolled loops rolled
    (compiler.roll_program): one block compiled, not k, and run as XLA's loop; within the
    same budget, else the program as it is."""
    if program.index_ordered:
        raise NotLowerable(INDEX_ORDERED)
    try:
        jax = _jax()
    except Exception as exc:
        raise NotLowerable(f"jax cannot be imported ({exc})") from None
    if budget is None:
        budget = program.planned_peak_bytes + BOOKKEEPING_BYTES
    rolled = roll_program(program, device) if roll else None
    if rolled is not None:
        try:
            return _lower(jax, program, rolled, device, budget)
        except NotLowerable:
            pass  # (over the budget as a loop, or a body XLA refuses: as it is)
    return _lower(jax, program, program, device, budget)


def _lower(jax: Any, program: Program, steps_of: Program, device: str, budget: int) -> Lowered:
    """`steps_of` (the program whose steps XLA compiles: `program`, or it rolled) lowered, as an
    executable of `program` (the same inputs and results, by name)."""
    started = time.perf_counter()
    target = _device(jax, device)
    sharding = jax.sharding.SingleDeviceSharding(target)
    given = _given(steps_of)
    results = [slot for _, slot in steps_of.outputs]
    if steps_of.backward:
        results += [slot for _, slot in steps_of.gradients]
    tracer = _Tracer(jax)
    deferred: list[Deferred] = []

    def whole(*arrays: Any) -> Any:
        env: list[Any] = [None] * len(steps_of.metas)
        for (_, slot, _, _, _), array in zip(given, arrays, strict=True):
            env[slot] = array
        deferred.clear()
        tracer.run(steps_of, env, deferred)
        return [env[s] for s in results], [d[1] for d in deferred]

    specs = [
        jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)
        for _, _, shape, dtype, _ in given
    ]
    attempts = CPU_ATTEMPTS if target.platform == "cpu" else ({},)
    # Float32 products in full precision, as NumPy and PyTorch compute them (not TF32).
    with jax.default_matmul_precision("highest"):
        try:
            traced = jax.jit(whole).lower(*specs)
            for options in attempts:
                compiled = traced.compile(compiler_options=options)
                stats = compiled.memory_analysis()
                if stats is None:
                    raise NotLowerable("memory: XLA gives no memory analysis for this device")
                need = (
                    stats.argument_size_in_bytes
                    + stats.output_size_in_bytes
                    + stats.temp_size_in_bytes
                    - stats.alias_size_in_bytes
                )
                if need <= budget:
                    break
        except NotLowerable:
            raise
        except Exception as exc:  # (XLA's own refusal: the interpreter keeps the program)
            raise NotLowerable(f"XLA: {type(exc).__name__}: {exc}") from None
    if need > budget:
        raise NotLowerable(
            f"memory: XLA needs {need} bytes, the plan "
            f"{program.planned_peak_bytes} (allowed: {budget})"
        )
    compile_ms = (time.perf_counter() - started) * 1000
    return Lowered(
        program, device, compiled, need, compile_ms, list(deferred), rolled=steps_of is not program
    )
