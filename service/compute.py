"""One request's computation, wherever it runs: the body in, the response body out.

The steps: split a binary body (a JSON header, then raw tensor bytes: the Open Inference
Protocol's binary extension), parse (strict JSON, once), check the request's size limits,
find its graph (sent, or held by id), decode its tensors, find or compile its program
(cached by the graph's id and the inputs' specs), reserve its planned bytes in the
in-flight memory, run it, encode the result. The front process runs these for tiny
requests; worker processes run them for the rest (service/workers.py). Each process has
its own `Compute`, graph-id cache and program cache.
"""

from __future__ import annotations

import gc
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson
from pydantic import ValidationError

from engine.backends import get_backend, parse_device
from engine.errors import GradserveError, GraphError, TensorDataError, ValidationErrors, quoted
from engine.graph import (
    BodySpec,
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
from service.errors import ProblemError, pydantic_errors, schema_problem
from service.schemas import (
    BackwardRequest,
    ForwardRequest,
    Graph,
    Node,
    PlanRequest,
    TensorIn,
    TensorSpecIn,
    Wire,
)
from service.settings import Settings

Decoded = dict[str, tuple[np.ndarray, bool]]  # name -> (host array, requires_grad)
Model = type[ForwardRequest | BackwardRequest]
W = TypeVar("W", bound=Wire)
MODELS: dict[str, Model] = {"forward": ForwardRequest, "backward": BackwardRequest}
PLANS = frozenset({"plan", "plan-dot"})  # POST /plan, answered as JSON or as DOT


@dataclass
class Stats:
    """What a computation tells the front process's metrics (workers have none)."""

    path: str = "grad"  # "grad" or "no_grad"
    planned_peak_bytes: int | None = None
    peak_bytes: int | None = None
    rejected: str | None = None  # a rejection reason of the metrics, if refused
    cache_evictions: int = 0
    cache_bytes: int = 0  # of the cache of the process that computed
    graph_evictions: int = 0
    pid: int = 0  # that process, when a worker
    # What the computation left in its process's memory (its graph id, its program key):
    # the pool sends later tasks with these keys to that worker while it is idle.
    affinity_keys: tuple[str, ...] = ()


@dataclass(eq=False)
class Reply:
    """A response body: its parts in order (a binary body's JSON header, then each
    tensor's bytes, viewed where they lie), and that header's length (None: a JSON body)."""

    parts: list[bytes | memoryview]
    header_length: int | None = None
    media_type: str = "application/json"  # of a body that is not binary
    release: Callable[[], None] | None = None  # lets the parts' memory go, once sent

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in self.parts)


@dataclass(eq=False)
class Prepared:
    """A parsed, decoded request, with its program when the cache had it."""

    req: ForwardRequest | BackwardRequest
    graph_id: str
    graph: Graph | None  # None: sent by id, and this process does not hold it
    device: str
    inputs: Decoded
    grad_outputs: Decoded | None
    no_grad: bool
    backward: bool
    started: float  # perf_counter() when parsing began
    key: Hashable = None
    program: Program | None = None
    stats: Stats = field(default_factory=Stats)


Reserve = Callable[[int], None]  # reserves a program's bytes in flight, or raises 503


class Compute:
    """A process's request computation, with its program cache."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.programs = ProgramCache(settings.program_cache_bytes)
        self.graphs = GraphCache(settings.graph_cache_bytes)
        self._devices: dict[str | None, str] = {}  # request's device -> canonical name

    def device(self, spec: str | None) -> str:
        """`parse_device`, remembered: the devices of a process do not change while it
        runs. Only names that parsed are kept, and only a few (clients choose them)."""
        name = self._devices.get(spec)
        if name is None:
            name = parse_device(spec, self.settings.default_device)
            if len(self._devices) < 16:
                self._devices[spec] = name
        return name

    def run(self, body: bytes | memoryview, model: Model, deadline: float, reserve: Reserve,
            stats: Stats | None = None, header_length: int | None = None) -> Reply:
        """The whole computation; `stats` (if given) is filled in as it goes, also when it
        ends in an error. `header_length`: the body is binary (its JSON header's length)."""
        p = self.prepare(body, model, stats, header_length)
        del body
        if p.program is None:
            self.compile(p)
        return self.execute(p, deadline, reserve, None)

    def prepare(self, body: bytes | memoryview, model: Model, stats: Stats | None = None,
                header_length: int | None = None) -> Prepared:
        """Split a binary body, parse, check limits, find the graph, decode, and look the
        program up in the cache."""
        started = time.perf_counter()
        header, tail = split_binary(body, header_length)
        # The parse makes only acyclic objects, by the hundred thousand in a large body:
        # the cycle collector would walk them again and again for nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            data = parse_json(header)
            check_sizes(data, self.settings)
            req = validate(data, model)
            graph_id, graph = self._graph(data, req)
            binary = binary_tensors(data, tail)
            errors: list[GradserveError] = []
            inputs = _decode_all("inputs", req.inputs, errors, binary)
            grad_outputs = (
                _decode_all("grad_outputs", req.grad_outputs, errors, binary)
                if isinstance(req, BackwardRequest) and req.grad_outputs is not None else None
            )
        finally:
            if collecting:
                gc.enable()
        if errors:
            raise ValidationErrors(errors)
        p = Prepared(
            req=req, graph_id=graph_id, graph=graph, device=self.device(req.device),
            inputs=inputs, grad_outputs=grad_outputs,
            no_grad=isinstance(req, ForwardRequest) and req.no_grad,
            backward=isinstance(req, BackwardRequest), started=started,
            stats=stats or Stats(),
        )
        p.stats.path = "no_grad" if p.no_grad else "grad"
        p.key = (graph_id, _spec_key(inputs), _spec_key(grad_outputs), p.no_grad, p.backward,
                 p.device)
        p.program = self.programs.get(p.key)
        if p.program is not None and graph is not None:
            p.stats.graph_evictions = self.graphs.put(graph_id, graph)
        return p

    def plan(self, body: bytes, dot: bool = False, max_nodes: int | None = None
             ) -> Reply | None:
        """POST /plan: the request's program compiled for its path without data (inputs
        may be specs), and what it would hold and cost against the budgets; as JSON, or
        as Graphviz DOT. The errors are those /forward or /backward would give. None
        when the graph has more than `max_nodes` nodes (the caller compiles it elsewhere)."""
        data = parse_json(body)
        check_sizes(data, self.settings)
        req = validate(data, PlanRequest)
        graph_id, graph = self._graph(data, req)
        if max_nodes is not None and (graph is None or len(graph.nodes) > max_nodes):
            return None
        errors: list[GradserveError] = []
        inputs = _specs_of("inputs", req.inputs, errors)
        grad_outputs = (None if req.grad_outputs is None
                        else _specs_of("grad_outputs", req.grad_outputs, errors))
        if errors:
            raise ValidationErrors(errors)
        no_grad, backward = req.path == "no_grad", req.path == "backward"
        device = self.device(req.device)
        key = (graph_id, _spec_tuple(inputs), _spec_tuple(grad_outputs), no_grad, backward,
               device)
        program = self.programs.get(key)  # (cached programs were compiled within budget)
        if program is None:
            if graph is None:
                raise _graph_unknown(graph_id)
            # Compiled without the budgets, which are compared below: the plan answers
            # with the numbers, where /forward would refuse. Not cached, for that reason.
            program = compile_graph(graph_spec(graph), inputs,
                                    limits=self._limits(None, None), no_grad=no_grad,
                                    backward=backward, grad_outputs=grad_outputs,
                                    device=device)
        s = self.settings
        budget = s.no_grad_memory_budget_bytes if no_grad else s.memory_budget_bytes
        if dot:
            return Reply([program_dot(program, budget).encode()],
                         media_type="text/vnd.graphviz; charset=utf-8")
        return Reply([codec.dumps({
            "planned_peak_bytes": program.planned_peak_bytes,
            "memory_budget_bytes": budget,
            "compute_cost": program.compute_cost,
            "compute_budget": s.compute_budget,
            "admitted": (program.planned_peak_bytes <= budget
                         and program.compute_cost <= s.compute_budget),
            "path": req.path,
            "graph_id": graph_id,
            "nodes": planned_steps(program),
        })])

    def _limits(self, memory_budget: int | None, compute_budget: float | None) -> Limits:
        s = self.settings
        return Limits(max_nodes=s.max_nodes, expr_max_chars=s.expr_max_chars,
                      expr_max_depth=s.expr_max_depth, memory_budget_bytes=memory_budget,
                      compute_budget=compute_budget, max_inputs=s.max_inputs,
                      max_id_chars=s.max_id_chars)

    def _graph(self, data: Any, req: ForwardRequest | BackwardRequest | PlanRequest
               ) -> tuple[str, Graph | None]:
        """The request's graph id, and its graph: sent (it must be the id's, if an id is
        sent with it), or held by id (None if this process does not hold it: only a
        program cached for these inputs can serve it then)."""
        if req.graph is None:
            assert req.graph_id is not None
            return req.graph_id, self.graphs.get(req.graph_id)
        graph_id = graph_key(data["graph"])
        if req.graph_id is not None and req.graph_id != graph_id:
            raise ProblemError(
                "invalid-request", f"graph_id {quoted(req.graph_id)} is not the id of the "
                f"graph sent with it ({graph_id}); send one or the other, or both matching",
                errors=[{"loc": ["graph_id"], "msg": "does not match the graph"}])
        return graph_id, req.graph

    def compile(self, p: Prepared) -> None:
        s = self.settings
        budget = s.no_grad_memory_budget_bytes if p.no_grad else s.memory_budget_bytes
        if p.graph is None:
            raise _graph_unknown(p.graph_id)
        try:
            p.program = compile_graph(
                graph_spec(p.graph),
                _specs(p.inputs),
                limits=self._limits(budget, s.compute_budget),
                no_grad=p.no_grad,
                backward=p.backward,
                grad_outputs=None if p.grad_outputs is None else _specs(p.grad_outputs),
                device=p.device,
            )
        except GradserveError as err:
            p.stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        p.stats.cache_evictions = self.programs.put(p.key, p.program)
        p.stats.cache_bytes = self.programs.bytes
        p.stats.graph_evictions = self.graphs.put(p.graph_id, p.graph)

    def execute(self, p: Prepared, deadline: float, reserve: Reserve,
                cancel: threading.Event | None) -> Reply:
        program = p.program
        assert program is not None
        plan_ms = (time.perf_counter() - p.started) * 1000  # parse, decode, compile or lookup
        p.stats.planned_peak_bytes = program.planned_peak_bytes
        reserve(program.planned_peak_bytes + _output_bytes(program, p.req.encoding))
        try:
            result = execute(
                program,
                _arrays(p.inputs, p.device),
                grad_outputs=None if p.grad_outputs is None
                else _arrays(p.grad_outputs, p.device),
                deadline=deadline,
                cancel=cancel,
            )
        except GradserveError as err:
            p.stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        p.stats.peak_bytes = result.peak_bytes
        p.inputs, p.grad_outputs = {}, None  # the inputs' memory goes before the answer's
        result.timings_ms["plan"] = round(plan_ms, 3)  # this request's, cached or not
        return encode_result(program, result, device=p.device, no_grad=p.no_grad,
                             encoding=p.req.encoding, graph_id=p.graph_id)


# The contract's seed example: warms a process's imports, first calls and memos.
WARM_UP = (
    b'{"graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},'
    b' "inputs": {"x": {"data": 2.0, "requires_grad": true},'
    b' "y": {"data": 3.0, "requires_grad": true}}}'
)


def warm_up(settings: Settings, body: bytes = WARM_UP) -> None:
    """Run one small request end to end, with limits that a tiny configured one (in a
    test) cannot trip, and no bookkeeping."""
    roomy = settings.model_copy(update={
        "max_nodes": 100_000, "memory_budget_bytes": 1 << 20,
        "no_grad_memory_budget_bytes": 1 << 20, "inflight_memory_bytes": 1 << 20,
        "compute_budget": 1e9, "max_inputs": 16, "max_id_chars": 64,
    })
    Compute(roomy).run(body, MODELS["backward"], time.monotonic() + 60, lambda _: None)


# Engine errors that count as a rejection in the metrics, by class name.
_REJECTIONS = {"MemoryBudgetError": "memory_budget", "ComputeBudgetError": "compute_budget",
               "DeadlineExceeded": "timeout"}

# A JSON text of tensor data takes up to ~20 characters a number; base64 4/3 a byte; the
# binary encoding views the arrays (a copy only of one that is not contiguous).
_TEXT_PER_BYTE = {"json": 5, "base64": 2, "binary": 1}


def _output_bytes(program: Program, encoding: str) -> int:
    """What encoding the outputs and gradients may take, on top of the program's plan."""
    metas = program.metas
    raw = sum(program_bytes(metas[s]) for _, s in [*program.outputs, *program.gradients])
    return raw * _TEXT_PER_BYTE.get(encoding, 2)


def program_bytes(meta: Any) -> int:
    n = 1
    for d in meta.shape:
        n *= d
    return n * np.dtype(meta.dtype).itemsize


class ProgramCache:
    """Compiled programs by a hash of their graph and their inputs' specs, bounded by
    their estimated bytes, least recently used first out.

    Clients send the same graph again and again with new data; validation, the derived
    backward, planning and kernel binding depend only on the graph and the inputs' shapes,
    dtypes and requires_grad, so a hit skips them all. A Program is read-only to `execute`,
    so one serves many threads.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[Hashable, Program] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Program | None:
        with self._lock:
            program = self._items.get(key)
            if program is not None:
                self._items.move_to_end(key)
            return program

    def put(self, key: Hashable, program: Program) -> int:
        """Keep `program` (unless it alone is over the bound); returns how many were
        evicted to make room."""
        size = program.estimated_bytes
        if size > self.max_bytes:
            return 0
        evicted = 0
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.estimated_bytes
            self._items[key] = program
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self.bytes -= gone.estimated_bytes
                evicted += 1
            self.evictions += evicted
        return evicted

    def __len__(self) -> int:
        return len(self._items)


class GraphCache:
    """Graphs by id (`meta.graph_id`), for requests that send the id instead, bounded by
    their canonical JSON's bytes, least recently used first out. Per process and
    forgotten on restart: a miss is 409 graph-unknown, and the client sends the graph."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[Graph, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, graph_id: str) -> Graph | None:
        with self._lock:
            item = self._items.get(graph_id)
            if item is None:
                return None
            self._items.move_to_end(graph_id)
            return item[0]

    def put(self, graph_id: str, graph: Graph) -> int:
        """Hold `graph` (unless it alone is over the bound); returns how many were evicted
        to make room."""
        evicted = 0
        with self._lock:
            if graph_id in self._items:
                self._items.move_to_end(graph_id)
                return 0
            size = _graph_bytes(graph)
            if size > self.max_bytes:
                return 0
            self._items[graph_id] = (graph, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, gone) = self._items.popitem(last=False)
                self.bytes -= gone
                evicted += 1
        return evicted

    def __len__(self) -> int:
        return len(self._items)


def _graph_bytes(graph: Graph) -> int:
    """What a held graph takes: its models, about 1 KB a node (the canonical JSON is far
    smaller, but the models are what is held)."""
    return 1024 * (1 + _count_nodes(graph.nodes))


def _count_nodes(nodes: list[Node]) -> int:
    return sum(1 + (_count_nodes(n.body.nodes) if n.body is not None else 0) for n in nodes)


def graph_key(graph: Any) -> str:
    """The graph's id: a BLAKE2b-128 hash (32 hex digits) of its canonical form, JSON with
    keys sorted, no whitespace, and numbers as orjson writes them (shortest round-trip
    digits), so that neither key order nor spacing changes it, nor the inputs' data."""
    try:
        canonical = orjson.dumps(graph, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer past 64 bits (which compiling will refuse)
        canonical = json.dumps(graph, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


BINARY_HEADER = "inference-header-content-length"


def split_binary(body: bytes | memoryview, header_length: int | None
                 ) -> tuple[bytes, memoryview | None]:
    """A binary body's JSON header and its tail (a view: no copy), or the body as it is."""
    if header_length is None:
        return bytes(body), None  # (a no-op on bytes)
    if header_length > len(body):
        raise ProblemError(
            "malformed-body", f"Inference-Header-Content-Length is {header_length}, past the "
            f"body's {len(body)} bytes",
            errors=[{"loc": ["headers", BINARY_HEADER], "msg": "past the body"}])
    view = memoryview(body)
    return bytes(view[:header_length]), view[header_length:]


def binary_tensors(data: Any, tail: memoryview | None) -> dict[tuple[str, str], memoryview]:
    """Each tensor given by `binary_data_size`, by (where, name): its bytes of the tail,
    taken in the order such tensors appear in the header. The sizes must add up to the
    tail exactly."""
    found: dict[tuple[str, str], memoryview] = {}
    offset = 0
    for where, tensors in data.items():  # (a dict keeps the document's order)
        if where not in ("inputs", "grad_outputs") or not isinstance(tensors, dict):
            continue
        for name, tensor in tensors.items():
            if not isinstance(tensor, dict) or tensor.get("binary_data_size") is None:
                continue
            size = tensor["binary_data_size"]
            loc = [where, name, "binary_data_size"]
            if tail is None:
                raise ProblemError(
                    "malformed-body", f"{where}[{quoted(name)}] has binary_data_size, but the "
                    "body is not binary (no Inference-Header-Content-Length header)",
                    errors=[{"loc": loc, "msg": "needs a binary body"}])
            if offset + size > len(tail):
                raise ProblemError(
                    "malformed-body", f"{where}[{quoted(name)}] has binary_data_size {size}, "
                    f"but the binary tail has {len(tail) - offset} bytes left",
                    errors=[{"loc": loc, "msg": "past the end of the body"}])
            found[(where, name)] = tail[offset:offset + size]
            offset += size
    if tail is not None and offset != len(tail):
        raise ProblemError(
            "malformed-body", f"the binary tail has {len(tail) - offset} bytes after the "
            f"last tensor's ({offset} of {len(tail)} are given a tensor by binary_data_size)",
            errors=[{"loc": ["body"], "msg": "bytes left over"}])
    return found


def parse_json(body: bytes) -> Any:
    """Strict JSON (RFC 8259: no bare NaN or Infinity), parsed once by pydantic-core:
    malformed JSON is 400."""
    if not body or body.isspace():  # not `strip()`: a copy of a body that may be 64 MiB
        raise ProblemError("malformed-json", "the request body is empty; send a JSON object")
    try:
        return codec.loads(body)
    except codec.JSONError as exc:
        raise ProblemError("malformed-json", f"the body is not valid JSON: {exc}",
                           errors=[{"loc": [], "msg": str(exc)}]) from None


def check_sizes(data: Any, settings: Settings) -> None:
    """The request's counts, before its objects are built: a body of a million tiny
    inputs is refused before it becomes a million models."""
    if not isinstance(data, dict):
        return  # validation says what is wrong
    for where in ("inputs", "grad_outputs"):
        tensors = data.get(where)
        if isinstance(tensors, dict) and len(tensors) > settings.max_inputs:
            raise GraphError(f"the request has {len(tensors)} {where.replace('_', ' ')}; the "
                             f"limit is {settings.max_inputs}", loc=(where,))
    graph = data.get("graph")
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if isinstance(nodes, list) and len(nodes) > settings.max_nodes:
        raise GraphError(f"the graph has {len(nodes)} nodes; the limit is {settings.max_nodes}",
                         loc=("graph", "nodes"))


def validate(data: Any, model: type[W]) -> W:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise schema_problem(pydantic_errors(exc)) from None


def graph_spec(graph: Graph) -> GraphSpec:
    return GraphSpec(nodes=_node_specs(graph.nodes), outputs=graph.outputs)


def _node_specs(nodes: list[Node]) -> list[NodeSpec]:
    return [NodeSpec(id=n.id, op=n.op, args=n.args or (), attrs=n.attrs or {}, expr=n.expr,
                     body=None if n.body is None else BodySpec(
                         carry=n.body.carry, xs=n.body.xs, nodes=_node_specs(n.body.nodes),
                         next=n.body.next),
                     results=n.results)
            for n in nodes]


def _graph_unknown(graph_id: str) -> ProblemError:
    return ProblemError(
        "graph-unknown", f"this server does not hold graph {quoted(graph_id)} (a server holds "
        "the graphs it was sent recently, per process, and forgets them on restart): send "
        "the graph itself, which it then holds under that id",
        errors=[{"loc": ["graph_id"], "msg": "unknown here"}])


def _specs_of(where: str, tensors: Mapping[str, Any], errors: list[GradserveError]
              ) -> dict[str, TensorSpec]:
    """A /plan request's tensors as specs: given as specs, or decoded from their data."""
    specs = {}
    for name, value in tensors.items():
        if isinstance(value, TensorSpecIn):
            loc = (where, name, "shape")
            try:
                codec.check_shape(loc, value.shape, np.dtype(value.dtype).itemsize)
            except TensorDataError as err:
                errors.append(err)
                continue
            specs[name] = TensorSpec(tuple(value.shape), value.dtype, value.requires_grad)
        else:
            decoded = _decode_all(where, {name: value}, errors, {})
            specs.update(_specs(decoded))
    return specs


def _spec_tuple(specs: Mapping[str, TensorSpec] | None) -> Hashable:
    """Specs as `_spec_key` keys decoded arrays (so that /plan finds their programs)."""
    if specs is None:
        return None
    return tuple([(name, t.shape, np.dtype(t.dtype), t.requires_grad)
                  for name, t in specs.items()])


def planned_steps(program: Program) -> list[dict[str, Any]]:
    """Each step of a program, forward then backward: what it makes, its bytes and cost,
    and the step after which its value is freed (None: held to the end)."""
    freed: dict[int, int] = {}
    for i, slots in enumerate(program.frees):
        for slot in slots:
            freed[slot] = i
    metas = program.metas
    out = []
    for i, (step, cost) in enumerate(zip(program.steps, program.step_costs, strict=True)):
        meta = metas[step.out]
        out.append({
            "step": i, "id": step.origin, "op": step.op.name, "kind": step.kind,
            "shape": list(meta.shape), "dtype": meta.dtype,
            "bytes": sum(program_bytes(metas[o]) for o in step.outs), "cost": cost,
            "freed_after": freed.get(step.out),
        })
    return out


def program_dot(program: Program, budget: int) -> str:
    """Graphviz DOT of a program: its steps (forward and backward in two clusters, the
    step's op, shape and bytes, coloured by bytes) and edges from the values they read."""
    metas = program.metas
    maker = {o: i for i, step in enumerate(program.steps) for o in step.outs}
    sizes = [sum(program_bytes(metas[o]) for o in step.outs) for step in program.steps]
    biggest = max(sizes, default=0) or 1
    lines = ["digraph program {", '  rankdir=TB; node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];',
             f'  label="planned peak {program.planned_peak_bytes} bytes (budget {budget}), '
             f'cost {program.compute_cost}"; labelloc=t;']
    inputs = {slot: name for name, slot in program.inputs.items()}
    for slot, name in inputs.items():
        meta = metas[slot]
        lines.append(f'  in{slot} [label="{_dot(name)}\\n{list(meta.shape)} {meta.dtype}", '
                     'shape=ellipse, fillcolor="#e8f0fe"];')
    for phase, kinds in (("forward", None), ("backward", {"backward"})):
        lines.append(f'  subgraph cluster_{phase} {{ label="{phase}"; color="#bbbbbb";')
        for i, step in enumerate(program.steps):
            if (step.kind == "backward") != (kinds is not None):
                continue
            meta = metas[step.out]
            shade = int(255 - 155 * sizes[i] / biggest)  # more bytes, more red
            lines.append(
                f'    s{i} [label="{_dot(step.origin or "")} {step.op.name}\\n'
                f'{list(meta.shape)} {meta.dtype}\\n{sizes[i]} B", '
                f'fillcolor="#ff{shade:02x}{shade:02x}"];')
        lines.append("  }")
    for i, step in enumerate(program.steps):
        for a in dict.fromkeys(step.slots):
            source = f"s{maker[a]}" if a in maker else f"in{a}" if a in inputs else None
            if source is not None:
                meta = metas[a]
                lines.append(f'  {source} -> s{i} [label="{list(meta.shape)}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _decode_all(where: str, tensors: Mapping[str, Any], errors: list[GradserveError],
                binary: Mapping[tuple[str, str], memoryview]) -> Decoded:
    out: Decoded = {}
    for name, value in tensors.items():
        try:
            if isinstance(value, TensorIn):
                array = codec.decode_tensor(
                    (where, name), data=value.data, b64=value.b64,
                    binary=binary.get((where, name)), dtype=value.dtype, shape=value.shape,
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
                  encoding: str, graph_id: str) -> Reply:
    """The response: JSON, or with the binary encoding a JSON header whose tensors say
    `binary_data_size`, followed by their bytes in the order they appear in it."""
    to_host = get_backend(device).to_host
    tail: list[memoryview] = []
    slots = dict(program.outputs)
    outputs = {}
    for name, value in result.outputs.items():
        entry = codec.encode_tensor(np.asarray(to_host(value)), encoding, tail)
        entry["requires_grad"] = program.requires_grad[slots[name]]
        entry["grad_fn"] = program.grad_fn[slots[name]]
        outputs[name] = entry
    content: dict[str, Any] = {"outputs": outputs}
    if result.gradients is not None:
        content["gradients"] = {
            name: codec.encode_tensor(np.asarray(to_host(g)), encoding, tail)
            for name, g in result.gradients.items()
        }
    content["meta"] = {
        "device": device,
        "graph_id": graph_id,
        "no_grad": no_grad,
        "nodes": result.nodes,
        "peak_bytes": result.peak_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "compute_cost": program.compute_cost,
        "timings_ms": result.timings_ms,
    }
    header = codec.dumps(content)
    if encoding != "binary":
        return Reply([header])
    # Spaces after the JSON (which allows them) so that the tensors start 8-byte aligned.
    header += b" " * (-len(header) % 8)
    return Reply([header, *tail], header_length=len(header))
