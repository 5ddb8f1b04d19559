"""Running a Program on engine tensors: the dynamic graph is built as it runs.

The no_grad path runs under `engine.no_grad()` and drops each value after its
last use; the grad path records the graph as it goes, then back-propagates
from the outputs. A deadline is checked between nodes (forward and backward).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from engine.autograd import backward
from engine.backends import use_device
from engine.errors import Cancelled, DeadlineExceeded, GradserveError
from engine.grad_mode import set_grad_enabled
from engine.graph.program import Program
from engine.graph.spec import RunResult
from engine.memory import MemoryTracker
from engine.ops.dispatch import apply
from engine.tensor import Tensor


def _deadline_check(
    deadline: float | None, cancel: threading.Event | None, started: float
) -> Callable[[], None]:
    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the request was cancelled: the server is shutting down")
        if deadline is not None and time.monotonic() > deadline:
            elapsed = time.monotonic() - started
            raise DeadlineExceeded(f"the request ran past its time limit ({elapsed:.2f} s)")

    return check


def execute(
    program: Program,
    inputs: Mapping[str, Tensor],
    *,
    grad_outputs: Mapping[str, Tensor] | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    device: str | None = None,
) -> RunResult:
    """Run `program`; `deadline` is a `time.monotonic()` value, and setting `cancel` stops
    the run at its next node."""
    started = time.monotonic()
    check = _deadline_check(deadline, cancel, started)
    values: list[Tensor | None] = [None] * len(program.metas)
    grad_outputs = grad_outputs or {}
    if device is None:
        device = next(iter(inputs.values())).device if inputs else "cpu"
    timings = {"plan": round(program.plan_ms, 3)}

    with MemoryTracker() as memory, use_device(device), set_grad_enabled(not program.no_grad):
        for name, slot in program.input_slots.items():
            t = inputs[name]
            if program.backward and t.requires_grad:
                t.grad = None  # this run's gradients only
            values[slot] = t
            memory.retain(t.data)
        try:
            t0 = time.perf_counter()
            for step in program.steps:
                check()
                args = [values[v] if is_ref else v for is_ref, v in step.args]
                try:
                    values[step.slot] = apply(step.op, args, step.attrs)
                except GradserveError as err:
                    raise err.at(node=step.origin, op=step.op.name) from None
                del args
                for slot in step.frees:
                    values[slot] = None
            outputs: dict[str, Tensor] = {
                name: values[slot] for name, slot in program.outputs  # type: ignore[misc]
            }
            timings["forward"] = round((time.perf_counter() - t0) * 1000, 3)
            del values

            gradients = None
            if program.backward:
                t1 = time.perf_counter()
                roots = [outputs[name] for name in program.roots]
                backward(roots, [grad_outputs.get(name) for name in program.roots], check=check)
                gradients = {}
                for name in program.grad_inputs:
                    t = inputs[name]
                    gradients[name] = t.grad if t.grad is not None else Tensor(
                        t._backend.xp.zeros_like(t.data), t._backend)
                timings["backward"] = round((time.perf_counter() - t1) * 1000, 3)
        finally:
            for name in program.input_slots:
                memory.release(inputs[name].data)
    return RunResult(
        outputs=outputs,
        gradients=gradients,
        peak_bytes=memory.peak,
        planned_peak_bytes=program.planned_peak_bytes,
        nodes=program.nodes,
        timings_ms=timings,
    )
