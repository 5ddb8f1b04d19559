"""The compute path: wire request -> engine graph -> wire response.

The route hands over the raw body. The steps: parse (pydantic-core, once), decode
tensors, `compile_graph` (validation and memory plan; cached per graph and input specs),
admission of the planned bytes, `execute`, and encoding with orjson. They run in a worker
thread, so the event loop stays free (health checks, small requests) however large the
body or graph; only a small body whose program is cached and tiny runs on the loop,
where a thread hop would cost more than the run.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from pydantic import ValidationError

from engine.backends import get_backend, parse_device
from engine.errors import (
    ComputeBudgetError,
    DeadlineExceeded,
    GradserveError,
    MemoryBudgetError,
    TensorDataError,
    ValidationErrors,
)
from engine.graph import (
    GraphSpec,
    Limits,
    NodeSpec,
    Program,
    RunResult,
    TensorSpec,
    compile_graph,
    execute,
)
from service import codec
from service.admission import Admission
from service.errors import ProblemError, pydantic_errors, schema_problem
from service.metrics import Metrics
from service.schemas import BackwardRequest, ForwardRequest, Graph, TensorIn
from service.settings import Settings

Decoded = dict[str, tuple[np.ndarray, bool]]  # name -> (host array, requires_grad)

# The fast path that runs on the event loop: a small body and a cached, tiny program.
INLINE_MAX_BODY_BYTES = 16 * 1024
INLINE_MAX_NODES = 64
INLINE_MAX_BYTES = 256 * 1024


class Runner:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(
            settings.max_concurrency, settings.inflight_memory_bytes, metrics
        )
        # Our own thread budget: sized to the slots, shared with nothing else.
        self.limiter = anyio.CapacityLimiter(settings.max_concurrency)
        self.programs = ProgramCache()
        self._devices: dict[str | None, str] = {}  # request's device -> canonical name

    def _device(self, spec: str | None) -> str:
        """`parse_device`, remembered: the devices of a process do not change while it
        runs. Only names that parsed are kept, and only a few (clients choose them)."""
        name = self._devices.get(spec)
        if name is None:
            name = parse_device(spec, self.settings.default_device)
            if len(self._devices) < 16:
                self._devices[spec] = name
        return name

    async def run(self, body: bytes, model: type[ForwardRequest | BackwardRequest]) -> bytes:
        deadline = time.monotonic() + self.settings.request_timeout_s
        self.admission.enter()
        try:
            if len(body) > INLINE_MAX_BODY_BYTES:
                cancel = threading.Event()  # set if this request's task is cancelled
                return await self._in_thread(cancel, self._job, body, model, deadline, cancel)
            # A small body parses in microseconds: do it here, and when its program is
            # already compiled and tiny, run it here too. A thread hop costs more than such
            # a run (about 0.1-0.2 ms), and the loop is held for well under a millisecond.
            prepared = self._prepare(body, model)
            if prepared.program is not None and _tiny(prepared.program):
                return self._execute(prepared, deadline, None)
            cancel = threading.Event()
            return await self._in_thread(cancel, self._finish, prepared, deadline, cancel)
        finally:
            self.admission.leave()

    async def _in_thread(
        self, cancel: threading.Event, fn: Callable[..., bytes], *args: Any
    ) -> bytes:
        """Run `fn` in a worker thread. If this task is cancelled (the server's graceful
        shutdown ran out), the engine is told to stop at its next node, so the process
        can exit instead of waiting for the computation to finish."""
        try:
            return await anyio.to_thread.run_sync(
                fn, *args, limiter=self.limiter, abandon_on_cancel=True
            )
        except BaseException:
            cancel.set()
            raise

    def warm_up(self, body: bytes) -> None:
        """Run one small request end to end, off the books: a throwaway Metrics, and
        limits that a tiny configured one (in a test) cannot trip."""
        roomy = self.settings.model_copy(update={
            "max_nodes": 100_000, "memory_budget_bytes": 1 << 20,
            "no_grad_memory_budget_bytes": 1 << 20, "inflight_memory_bytes": 1 << 20,
        })
        Runner(roomy, Metrics())._job(body, BackwardRequest, time.monotonic() + 60, None)

    # ------------------------------------------------------------------ the steps
    def _job(
        self,
        body: bytes,
        model: type[ForwardRequest | BackwardRequest],
        deadline: float,
        cancel: threading.Event | None,
    ) -> bytes:
        return self._finish(self._prepare(body, model), deadline, cancel)

    def _prepare(self, body: bytes, model: type[ForwardRequest | BackwardRequest]) -> Prepared:
        """Parse, decode, and look the program up in the cache (compiling nothing)."""
        started = time.perf_counter()
        req = parse_body(body, model)
        errors: list[GradserveError] = []
        inputs = _decode_all("inputs", req.inputs, errors)
        grad_outputs = (
            _decode_all("grad_outputs", req.grad_outputs, errors)
            if isinstance(req, BackwardRequest) and req.grad_outputs is not None
            else None
        )
        if errors:
            raise ValidationErrors(errors)
        p = Prepared(
            req=req,
            device=self._device(req.device),
            inputs=inputs,
            grad_outputs=grad_outputs,
            no_grad=isinstance(req, ForwardRequest) and req.no_grad,
            backward=isinstance(req, BackwardRequest),
            started=started,
        )
        p.key = (req.graph.model_dump_json(), _spec_key(inputs), _spec_key(grad_outputs),
                 p.no_grad, p.backward, p.device)
        p.program = self.programs.get(p.key)
        return p

    def _finish(self, p: Prepared, deadline: float, cancel: threading.Event | None) -> bytes:
        if p.program is None:
            p.program = self._compile(
                p.req.graph, _specs(p.inputs),
                None if p.grad_outputs is None else _specs(p.grad_outputs),
                p.no_grad, p.backward, p.device,
            )
            self.programs.put(p.key, p.program)
        return self._execute(p, deadline, cancel)

    def _execute(self, p: Prepared, deadline: float, cancel: threading.Event | None) -> bytes:
        program = p.program
        assert program is not None
        plan_ms = (time.perf_counter() - p.started) * 1000  # parse, decode, compile or lookup
        planned, measured = self.metrics.peak_children("no_grad" if p.no_grad else "grad")
        self.admission.take(program.planned_peak_bytes)
        try:
            planned.observe(program.planned_peak_bytes)
            try:
                result = execute(
                    program,
                    _arrays(p.inputs, p.device),
                    grad_outputs=None if p.grad_outputs is None
                    else _arrays(p.grad_outputs, p.device),
                    deadline=deadline,
                    cancel=cancel,
                )
            except DeadlineExceeded:
                self.metrics.rejected["timeout"].inc()
                raise
            measured.observe(result.peak_bytes)
            result.timings_ms["plan"] = round(plan_ms, 3)  # this request's, cached or not
            return encode_result(
                program, result, device=p.device, no_grad=p.no_grad, encoding=p.req.encoding
            )
        finally:
            self.admission.release(program.planned_peak_bytes)

    def _compile(
        self,
        graph: Graph,
        inputs: dict[str, TensorSpec],
        grad_outputs: dict[str, TensorSpec] | None,
        no_grad: bool,
        backward: bool,
        device: str,
    ) -> Program:
        s = self.settings
        budget = s.no_grad_memory_budget_bytes if no_grad else s.memory_budget_bytes
        try:
            return compile_graph(
                graph_spec(graph),
                inputs,
                limits=Limits(max_nodes=s.max_nodes, expr_max_chars=s.expr_max_chars,
                              expr_max_depth=s.expr_max_depth, memory_budget_bytes=budget,
                              compute_budget=s.compute_budget, max_inputs=s.max_inputs,
                              max_id_chars=s.max_id_chars),
                no_grad=no_grad,
                backward=backward,
                grad_outputs=grad_outputs,
                device=device,
            )
        except MemoryBudgetError:
            self.metrics.rejected["memory_budget"].inc()
            raise
        except ComputeBudgetError:
            self.metrics.rejected["compute_budget"].inc()
            raise


@dataclass(eq=False)
class Prepared:
    """A parsed, decoded request, with its program when the cache had it."""

    req: ForwardRequest | BackwardRequest
    device: str
    inputs: Decoded
    grad_outputs: Decoded | None
    no_grad: bool
    backward: bool
    started: float  # perf_counter() when parsing began
    key: Hashable = None
    program: Program | None = None


def _tiny(program: Program) -> bool:
    return program.nodes <= INLINE_MAX_NODES and program.planned_peak_bytes <= INLINE_MAX_BYTES


class ProgramCache:
    """Compiled programs of small graphs, by graph, input specs and path.

    Clients send the same graph again and again with new data; validation and planning
    depend only on the graph and the inputs' shapes, dtypes and requires_grad, so a hit
    skips them. A Program is read-only to `execute`, so one can serve many threads. Large
    graphs are not kept: their compile cost is small next to their run.
    """

    MAX_NODES = 1024

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Program] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Program | None:
        with self._lock:
            program = self._items.get(key)
            if program is not None:
                self._items.move_to_end(key)
            return program

    def put(self, key: Hashable, program: Program) -> None:
        if program.nodes > self.MAX_NODES:
            return
        with self._lock:
            self._items[key] = program
            if len(self._items) > self.size:
                self._items.popitem(last=False)


def parse_body(body: bytes, model: type[ForwardRequest | BackwardRequest]) -> Any:
    """Strict JSON (RFC 8259: no bare NaN or Infinity) parsed once by pydantic-core, then
    validated: malformed JSON is 400, schema errors 422."""
    if not body or body.isspace():  # not `strip()`: a copy of a body that may be 64 MiB
        raise ProblemError("malformed-json", "the request body is empty; send a JSON object")
    try:
        data = codec.loads(body)
    except codec.JSONError as exc:
        raise ProblemError("malformed-json", f"the body is not valid JSON: {exc}",
                           errors=[{"loc": [], "msg": str(exc)}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise schema_problem(pydantic_errors(exc)) from None


def graph_spec(graph: Graph) -> GraphSpec:
    return GraphSpec(
        nodes=[
            NodeSpec(id=n.id, op=n.op, args=n.args or (), attrs=n.attrs or {}, expr=n.expr)
            for n in graph.nodes
        ],
        outputs=graph.outputs,
    )


def _decode_all(where: str, tensors: Mapping[str, Any], errors: list[GradserveError]) -> Decoded:
    out: Decoded = {}
    for name, value in tensors.items():
        try:
            if isinstance(value, TensorIn):
                array = codec.decode_tensor(
                    (where, name), data=value.data, b64=value.b64,
                    dtype=value.dtype, shape=value.shape,
                )
                requires_grad = value.requires_grad
            else:
                array = codec.decode_tensor((where, name), data=value)
                requires_grad = False
        except TensorDataError as err:
            errors.append(err)
            continue
        out[name] = (array, requires_grad)  # requires_grad on an int: compile_graph refuses
    return out


def _specs(decoded: Decoded) -> dict[str, TensorSpec]:
    return {
        name: TensorSpec(shape=a.shape, dtype=codec.dtype_name(a), requires_grad=rg)
        for name, (a, rg) in decoded.items()
    }


def _spec_key(decoded: Decoded | None) -> Hashable:
    """What `_specs` would say, as a cache key, without making the specs."""
    if decoded is None:
        return None
    return tuple([(name, a.shape, a.dtype, rg) for name, (a, rg) in decoded.items()])


def _arrays(decoded: Decoded, device: str) -> dict[str, Any]:
    """The decoded host arrays on the request's device (on the CPU: the arrays themselves)."""
    backend = get_backend(device)
    return {name: backend.from_host(a) for name, (a, _) in decoded.items()}


def encode_result(program: Program, result: RunResult, *, device: str, no_grad: bool,
                  encoding: str) -> bytes:
    to_host = get_backend(device).to_host
    slots = dict(program.outputs)
    outputs = {}
    for name, value in result.outputs.items():
        entry = codec.encode_tensor(np.asarray(to_host(value)), encoding)
        entry["requires_grad"] = program.requires_grad[slots[name]]
        entry["grad_fn"] = program.grad_fn[slots[name]]
        outputs[name] = entry
    content: dict[str, Any] = {"outputs": outputs}
    if result.gradients is not None:
        content["gradients"] = {
            name: codec.encode_tensor(np.asarray(to_host(g)), encoding)
            for name, g in result.gradients.items()
        }
    content["meta"] = {
        "device": device,
        "no_grad": no_grad,
        "nodes": result.nodes,
        "peak_bytes": result.peak_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "compute_cost": program.compute_cost,
        "timings_ms": result.timings_ms,
    }
    return codec.dumps(content)
