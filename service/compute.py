"""One request's computation, wherever it runs: the body in, the response body out.

The steps: split a binary body (a JSON header, then raw tensor bytes: the Open Inference
Protocol's binary extension), find its graph, parse and decode the rest, find or compile
its program, reserve its planned bytes in the in-flight memory, run it, encode the result.
The front process runs these for tiny requests; worker processes run them for the rest
(service/workers.py).

A graph is found before anything is parsed: the body's top-level members are split out
as raw bytes (msgspec), and the graph's bytes hashed. A graph seen before (by any process
of the host: service/programs.py) is known by that hash, and neither parsed nor validated
again; only the other members are. A new graph is parsed and validated with the rest of
the body, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
from pydantic import ValidationError

from gradserve.engine.backends import get_backend, parse_device
from gradserve.engine.errors import (
    GradserveError,
    GraphError,
    MemoryBudgetError,
    TensorDataError,
    ValidationErrors,
    quoted,
)
from gradserve.engine.graph import (
    BodySpec,
    GraphSpec,
    Limits,
    NodeSpec,
    Program,
    RunResult,
    TensorSpec,
    check_budgets,
    compile_graph,
    execute,
)
from gradserve.engine.graph.ir import RECOMPUTE
from gradserve.engine.graph.serial import Unstorable, dump_program, load_program
from gradserve.service import codec
from gradserve.service.errors import ProblemError, pydantic_errors, schema_problem
from gradserve.service.graph_json import graph_spec_from_json
from gradserve.service.programs import Programs
from gradserve.service.schemas import (
    BackwardRequest,
    ForwardRequest,
    Graph,
    Node,
    PlanRequest,
    TensorIn,
    TensorSpecIn,
    Wire,
)
from gradserve.service.settings import Settings
from gradserve.service.tier import COLD, INTERPRETER, XLA, Tier
from gradserve.wire.graph_id import canonical_graph, id_of_canonical

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
    program: str | None = None  # where the program came from: "process", "store", "compiled"
    compile_ms: float | None = None  # when it was compiled
    load_ms: float | None = None  # when it was loaded from the store
    graph_id: str | None = None
    program_key: str | None = None  # the program's, when it is in the process's memory now
    store_evictions: int = 0  # by this process since it last reported
    store_damaged: int = 0
    tier: str | None = None  # the tier that ran it: "interpreter" or "xla"
    # The process's background lowerings that ended since it last reported: (program key,
    # None when swapped in or why refused, XLA's compile time in ms).
    lowerings: list[tuple[str, str | None, float]] = field(default_factory=list)
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
class Call:
    """What a parsed request asks for: its graph (by id), device, encoding, decoded
    tensors, path, and memory budget."""

    graph_id: str
    device: str
    encoding: str
    inputs: Decoded
    grad_outputs: Decoded | None
    no_grad: bool
    backward: bool
    budget: int  # its memory budget: the server's for its path, or less if it asks less
    recompute: bool  # a backward over its budget may recompute forward values to fit

    @property
    def budget_shapes_program(self) -> bool:
        """Whether its program depends on its budget: a backward that may recompute (every
        other program is the same under any budget, checked against it on use)."""
        return self.backward and self.recompute

    def call(self) -> dict[str, Any]:
        """This call's fields alone (to make another kind of call of them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Call)}


@dataclass(eq=False)
class Prepared(Call):
    """A parsed, decoded request, with its program when one was found."""

    started: float  # perf_counter() when parsing began
    key: str = ""  # the program's
    graph: GraphSpec | None = None  # parsed here (None: found by its bytes, or sent by id)
    graph_raw: bytes | None = None  # the graph's JSON (as sent, or canonical), to hand on
    program: Program | None = None
    stats: Stats = field(default_factory=Stats)


@dataclass(eq=False)
class Handoff(Call):
    """A small request that the front process prepared but does not run (its program is
    too costly, or too large to compile there), for a worker to run without parsing it
    again: its decoded tensors, and its program serialized (or its graph, to compile)."""

    key: str
    program: bytes | None  # engine.graph.serial's form
    graph: bytes | None  # the graph's JSON, when there is no program yet


Reserve = Callable[[int], None]  # reserves a program's bytes in flight, or raises 503


class Compute:
    """A process's request computation, over its programs (service/programs.py)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.programs = Programs(settings)
        self.tier = Tier(settings)
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
            stats: Stats | None = None, header_length: int | None = None,
            tenant: str | None = None, raw_key: str | None = None) -> Reply:
        """The whole computation; `stats` (if given) is filled in as it goes, also when it
        ends in an error. `header_length`: the body is binary (its JSON header's length).
        `tenant`: the API key's id (service/middleware.py), None with keys off. `raw_key`:
        its graph's bytes' key, when the front process has hashed them (`locate`)."""
        p = self.prepare(body, model, stats, header_length, tenant, raw_key)
        del body
        if p.program is None:
            self.compile(p)
        return self.execute(p, deadline, reserve, None)

    def run_handoff(self, h: Handoff, deadline: float, reserve: Reserve,
                    stats: Stats | None = None) -> Reply:
        """A request the front process prepared (`Handoff`)."""
        p = Prepared(**h.call(), started=time.perf_counter(), key=h.key,
                     stats=stats or Stats())
        p.stats.path = "no_grad" if h.no_grad else "grad"
        p.stats.graph_id = h.graph_id
        p.graph_raw = h.graph
        self._find(p)
        if p.program is None and h.program is not None:
            p.program = load_program(h.program, h.device)
            self.programs.memory.put(h.key, p.program)
            p.stats.program_key = h.key
        if p.program is None:
            self.compile(p)
        return self.execute(p, deadline, reserve, None)

    def handoff(self, p: Prepared) -> Handoff:
        """`p` for a worker (see Handoff): its program when compiled here and not in the
        store, and its graph's JSON when this process has it (a worker that must compile
        a graph sent by id finds it by id)."""
        program = None
        if p.program is not None and not self.programs.stored(p.key):
            with contextlib.suppress(Unstorable):
                program = dump_program(p.program)
        return Handoff(**p.call(), key=p.key, program=program, graph=p.graph_raw)

    def prepare(self, body: bytes | memoryview, model: Model, stats: Stats | None = None,
                header_length: int | None = None, tenant: str | None = None,
                raw_key: str | None = None) -> Prepared:
        """Split a binary body, find the graph, parse the rest, check limits, decode, and
        look the program up."""
        started = time.perf_counter()
        header, tail = split_binary(body, header_length)
        # The parse makes only acyclic objects, by the hundred thousand in a large body:
        # the cycle collector would walk them again and again for nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            found = self._request(header, model, tenant, raw_key)
            req = found.req
            assert isinstance(req, ForwardRequest | BackwardRequest)
            binary = binary_tensors(found.data, tail)
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
        no_grad = isinstance(req, ForwardRequest) and req.no_grad
        p = Prepared(
            graph_id=found.graph_id, device=self.device(req.device), encoding=req.encoding,
            inputs=inputs, grad_outputs=grad_outputs, no_grad=no_grad,
            backward=isinstance(req, BackwardRequest),
            budget=self._budget(req.memory_budget_bytes, no_grad),
            recompute=req.recompute == "auto", started=started, graph=found.graph,
            graph_raw=found.raw, stats=stats or Stats(),
        )
        p.stats.path = "no_grad" if no_grad else "grad"
        p.stats.graph_id = found.graph_id
        p.stats.graph_evictions = found.evicted
        p.key = self._program_key(p, _spec_key(inputs), _spec_key(grad_outputs))
        self._find(p)
        return p

    def _find(self, p: Prepared) -> None:
        found = self.programs.find(p.key, p.device)
        p.program = found.program
        p.stats.program = found.source or "compiled"
        if found.program is not None:
            p.stats.program_key = p.key
        if found.source == "store":
            p.stats.load_ms = found.load_ms

    def locate(self, header: bytes | memoryview) -> Located:
        """Where a body's graph may be had without parsing it: the raw key of its bytes
        (and the id of a graph seen before), or the id it is sent by. The front process
        sends it to a worker that holds the graph's programs, which is handed the raw key
        rather than hashing the bytes again."""
        envelope = split_envelope(header)
        if envelope is None:
            return Located(None, None)
        raw = envelope.get("graph")
        if raw is not None and raw != b"null":
            raw_key = self.programs.raw_key(raw)
            return Located(raw_key, self.programs.alias(raw_key))
        graph_id = envelope.get("graph_id")
        if graph_id is None:
            return Located(None, None)
        try:
            value = codec.loads(bytes(graph_id))
        except codec.JSONError:
            return Located(None, None)
        return Located(None, value if isinstance(value, str) else None)

    def plan(self, body: bytes, dot: bool = False, max_nodes: int | None = None,
             tenant: str | None = None) -> Reply | None:
        """POST /plan: the request's program for its path without data (inputs may be
        specs), and what it would hold and cost against the budgets; as JSON, or as
        Graphviz DOT. The errors are those /forward or /backward would give. None when its
        program must be compiled and its graph has more than `max_nodes` nodes (the caller
        plans it elsewhere)."""
        found = self._request(body, PlanRequest, tenant)
        req = found.req
        assert isinstance(req, PlanRequest)
        errors: list[GradserveError] = []
        inputs = _specs_of("inputs", req.inputs, errors)
        grad_outputs = (None if req.grad_outputs is None
                        else _specs_of("grad_outputs", req.grad_outputs, errors))
        if errors:
            raise ValidationErrors(errors)
        no_grad, backward = req.path == "no_grad", req.path == "backward"
        device = self.device(req.device)
        p = Prepared(graph_id=found.graph_id, device=device, encoding="json", inputs={},
                     grad_outputs=None, no_grad=no_grad, backward=backward,
                     budget=self._budget(req.memory_budget_bytes, no_grad),
                     recompute=req.recompute == "auto", started=time.perf_counter(),
                     graph=found.graph, graph_raw=found.raw)
        p.key = self._program_key(p, _spec_tuple(inputs), _spec_tuple(grad_outputs))
        self._find(p)
        minimum = None  # the smallest peak recomputation reached, when even that was over
        if p.program is None:
            graph = self.graph_of(p)
            if max_nodes is not None and len(graph.nodes) > max_nodes:
                return None
            try:
                self._compile(p, graph, inputs, grad_outputs)
            except MemoryBudgetError as err:  # (the plan answers with the numbers)
                minimum = err.planned_bytes
                p.recompute = False
                self._compile(p, graph, inputs, grad_outputs, keep=False)
        program = p.program
        assert program is not None
        s = self.settings
        if dot:
            return Reply([program_dot(program, p.budget).encode()],
                         media_type="text/vnd.graphviz; charset=utf-8")
        recompute = recomputation(program)
        if recompute is not None:  # (the explorer draws both memory timelines)
            plain = compile_graph(self.graph_of(p), inputs, limits=self._limits(None, None),
                                  no_grad=no_grad, backward=backward,
                                  grad_outputs=grad_outputs, device=device)
            recompute["nodes_without"] = planned_steps(plain)
        return Reply([codec.dumps({
            "planned_peak_bytes": program.planned_peak_bytes,
            "memory_budget_bytes": p.budget,
            "compute_cost": program.compute_cost,
            "compute_budget": s.compute_budget,
            "admitted": (program.planned_peak_bytes <= p.budget
                         and program.compute_cost <= s.compute_budget),
            "path": req.path,
            "graph_id": found.graph_id,
            "nodes": planned_steps(program),
            "recompute": recompute,
            "minimum_peak_bytes": minimum,
        })])

    def _budget(self, asked: int | None, no_grad: bool) -> int:
        """A request's memory budget: the server's for its path, or less if it asks; more
        is refused (a budget protects the server, not the request)."""
        s = self.settings
        server = s.no_grad_memory_budget_bytes if no_grad else s.memory_budget_bytes
        if asked is None:
            return server
        if asked > server:
            path = "no_grad" if no_grad else "grad"
            raise ProblemError(
                "invalid-request", f"memory_budget_bytes is {asked}, over this server's {path} "
                f"budget of {server} bytes: a request may ask for less, never more",
                errors=[{"loc": ["memory_budget_bytes"], "msg": f"at most {server}"}])
        return asked

    def _program_key(self, p: Prepared, inputs: Hashable, grad_outputs: Hashable) -> str:
        """The program's key; with the budget in it where the program depends on it."""
        return self.programs.program_key(
            p.graph_id, inputs, grad_outputs, p.no_grad, p.backward, p.device,
            budget=p.budget if p.budget_shapes_program else None)

    def _limits(self, memory_budget: int | None, compute_budget: float | None,
                recompute: bool = False) -> Limits:
        s = self.settings
        return Limits(max_nodes=s.max_nodes, expr_max_chars=s.expr_max_chars,
                      expr_max_depth=s.expr_max_depth, memory_budget_bytes=memory_budget,
                      compute_budget=compute_budget, max_inputs=s.max_inputs,
                      max_id_chars=s.max_id_chars, recompute=recompute)

    def _request(self, header: bytes, model: type[W], tenant: str | None,
                 raw_key: str | None = None) -> _Found:
        """The request's members, validated, and its graph: found by its bytes as sent
        (a graph seen before: neither parsed nor validated again), or parsed with the rest
        of the body, or named by id. `raw_key`: the graph's bytes' key, if known."""
        envelope = split_envelope(header)
        raw = None if envelope is None else envelope.get("graph")
        if raw is None or raw == b"null":
            raw_key = None
        else:
            raw_key = raw_key or self.programs.raw_key(raw)
            graph_id = self.programs.alias(raw_key)
            rest = None if graph_id is None else _parse_members(envelope, skip="graph")
            if rest is not None and graph_id is not None:
                check_sizes(rest, self.settings)
                req = validate(_with_id(rest, graph_id), model)
                if req.graph_id != graph_id:  # type: ignore[attr-defined]
                    raise _id_mismatch(req.graph_id, graph_id)  # type: ignore[attr-defined]
                self.programs.grant(tenant, graph_id)
                return _Found(rest, req, graph_id, None, bytes(raw), 0)
        data = parse_json(header)
        check_sizes(data, self.settings)
        graph_json = data.get("graph") if isinstance(data, dict) else None
        spec = None if graph_json is None else \
            graph_spec_from_json(graph_json, max_nodes=self.settings.max_nodes)
        if spec is not None:  # the graph as pydantic would take it: the rest goes to it
            canonical = canonical_graph(graph_json)
            graph_id = id_of_canonical(canonical)
            rest = {k: v for k, v in data.items() if k != "graph"}
            req = validate(_with_id(rest, graph_id), model)
        else:  # pydantic validates everything, and says what is wrong, where
            req = validate(data, model)
            graph: Graph | None = req.graph  # type: ignore[attr-defined]
            if graph is None:
                graph_id = req.graph_id  # type: ignore[attr-defined]
                assert graph_id is not None
                if not self.programs.granted(tenant, graph_id):
                    raise _graph_unknown(graph_id)
                return _Found(data, req, graph_id, None, None, 0)
            canonical = canonical_graph(data["graph"])
            graph_id = id_of_canonical(canonical)
            spec = graph_spec(graph)
        if req.graph_id is not None and req.graph_id != graph_id:  # type: ignore[attr-defined]
            raise _id_mismatch(req.graph_id, graph_id)  # type: ignore[attr-defined]
        evicted = self.programs.remember_graph(graph_id, spec, canonical, raw_key)
        self.programs.grant(tenant, graph_id)
        return _Found(data, req, graph_id, spec, canonical, evicted)

    def graph_of(self, p: Prepared) -> GraphSpec:
        """The request's graph, to compile; 409 when nobody holds it."""
        graph = self.known_graph(p)
        if graph is None:
            raise _graph_unknown(p.graph_id)
        return graph

    def known_graph(self, p: Prepared) -> GraphSpec | None:
        """The request's graph: parsed with it, its JSON in hand, or held by id (by this
        process, or in the store); None if none of these has it."""
        if p.graph is None:
            if p.graph_raw is not None:
                p.graph = self._parse_graph(p.graph_raw)
            else:
                p.graph = self.programs.graph(p.graph_id, self._parse_graph)
        return p.graph

    def _parse_graph(self, raw: bytes) -> GraphSpec:
        """A graph's JSON that was validated before (its bytes, or its canonical form)."""
        obj = codec.loads(raw)
        return graph_spec_from_json(obj) or graph_spec(validate(obj, Graph))

    def compile(self, p: Prepared) -> None:
        self._compile(p, self.graph_of(p), _specs(p.inputs),
                      None if p.grad_outputs is None else _specs(p.grad_outputs))

    def _compile(self, p: Prepared, graph: GraphSpec, inputs: Mapping[str, TensorSpec],
                 grad_outputs: Mapping[str, TensorSpec] | None, keep: bool = True) -> None:
        """Compile, and keep the program here and in the store (`keep`). The budgets are
        checked on each use, not here; only a backward that may recompute is compiled for
        its memory budget (the planner recomputes what it must to fit it)."""
        started = time.perf_counter()
        shaped = p.budget_shapes_program
        limits = self._limits(p.budget if shaped else None, None, recompute=shaped)
        try:
            p.program = compile_graph(graph, inputs, limits=limits,
                                      no_grad=p.no_grad, backward=p.backward,
                                      grad_outputs=grad_outputs, device=p.device)
        except GradserveError as err:
            p.stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        p.stats.compile_ms = (time.perf_counter() - started) * 1000
        if keep:
            p.stats.cache_evictions = self.programs.remember(p.key, p.program, p.device,
                                                             p.stats.compile_ms)
            p.stats.program_key = p.key
        p.stats.cache_bytes = self.programs.memory.bytes

    def check_budgets(self, p: Prepared) -> None:
        """The request's program against the memory budget of its path and the compute
        budget: 422 when over."""
        assert p.program is not None
        s = self.settings
        try:
            check_budgets(p.program, self._limits(p.budget, s.compute_budget), p.no_grad)
        except GradserveError as err:
            p.stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise

    def execute(self, p: Prepared, deadline: float, reserve: Reserve,
                cancel: threading.Event | None) -> Reply:
        self.check_budgets(p)
        program = p.program
        assert program is not None
        plan_ms = (time.perf_counter() - p.started) * 1000  # parse, decode, compile or lookup
        p.stats.planned_peak_bytes = program.planned_peak_bytes
        reserve(program.planned_peak_bytes + _output_bytes(program, p.encoding))
        lowered, tier = self.tier.choose(p.key)
        try:
            result = None
            if lowered is not None:  # (None again, and why, if XLA failed: interpreted)
                result, tier = self.tier.run(p.key, lowered, _hosts(p.inputs),
                                             None if p.grad_outputs is None
                                             else _hosts(p.grad_outputs))
            if result is None:
                started = time.perf_counter()
                result = execute(
                    program,
                    _arrays(p.inputs, p.device),
                    grad_outputs=None if p.grad_outputs is None
                    else _arrays(p.grad_outputs, p.device),
                    deadline=deadline,
                    cancel=cancel,
                )
                if tier == COLD:
                    tier = self.tier.interpreted(p.key, program, p.device,
                                                 (time.perf_counter() - started) * 1000)
        except GradserveError as err:
            p.stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        p.stats.peak_bytes = result.peak_bytes
        p.stats.tier = XLA if tier == XLA else INTERPRETER
        p.inputs, p.grad_outputs = {}, None  # the inputs' memory goes before the answer's
        result.timings_ms["plan"] = round(plan_ms, 3)  # this request's, cached or not
        return encode_result(program, result, device=p.device, no_grad=p.no_grad,
                             encoding=p.encoding, graph_id=p.graph_id,
                             source=p.stats.program or "compiled", tier=tier)


@dataclass(frozen=True)
class Located:
    """A body's graph as far as it is known without a parse (see `Compute.locate`)."""

    raw_key: str | None  # of the graph's bytes as sent
    graph_id: str | None


@dataclass(eq=False)
class _Found:
    """A request's members (parsed), validated, and its graph as far as it was found."""

    data: Any
    req: Any
    graph_id: str
    graph: GraphSpec | None
    raw: bytes | None  # the graph's JSON: its bytes as sent (found by them, not parsed),
    # or its canonical form (parsed): what a worker compiles it from
    evicted: int  # graphs the process's cache evicted for this one


# Splits a JSON object into its members, each left as raw bytes (validated as JSON, not
# parsed into objects): what finds a graph by its bytes without parsing it.
_ENVELOPE = msgspec.json.Decoder(dict[str, msgspec.Raw])


def split_envelope(header: bytes | memoryview) -> dict[str, memoryview] | None:
    """A JSON object's members as raw bytes, in order, or None if it is not one (the
    full parse then says what is wrong)."""
    try:
        return {k: memoryview(v) for k, v in _ENVELOPE.decode(header).items()}
    except (msgspec.DecodeError, ValueError, RecursionError):  # (nested too deep)
        return None


def _parse_members(envelope: dict[str, memoryview] | None, skip: str) -> dict[str, Any] | None:
    """Every member but `skip` parsed as the full parse would, or None where that parse
    would refuse one (it then runs, and says what is wrong)."""
    if envelope is None:
        return None
    try:
        return {k: codec.loads(bytes(v)) for k, v in envelope.items() if k != skip}
    except codec.JSONError:
        return None


def _with_id(rest: dict[str, Any], graph_id: str) -> dict[str, Any]:
    """A request's members without its graph, validated in its stead by the graph's id (a
    `graph_id` the body gives stays, to be checked against it)."""
    return rest if rest.get("graph_id") is not None else {**rest, "graph_id": graph_id}


def recomputation(program: Program) -> dict[str, Any] | None:
    """What recomputing forward values in the backward bought and cost (None: nothing is
    recomputed)."""
    if not program.recompute_cost:  # (every step computed again costs something)
        return None
    steps = sum(step.kind == RECOMPUTE for step in program.steps)
    return {"peak_bytes_without": program.peak_without_recompute,
            "added_cost": program.recompute_cost, "steps": steps}


def _id_mismatch(given: str, graph_id: str) -> ProblemError:
    return ProblemError(
        "invalid-request", f"graph_id {quoted(given)} is not the id of the graph sent with it "
        f"({graph_id}); send one or the other, or both matching",
        errors=[{"loc": ["graph_id"], "msg": "does not match the graph"}])


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
        "program_store_dir": None,  # (nothing of it for the store)
        "xla": "off",  # (nor for the native tier)
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
        "the graphs it was sent recently, in its program store, and with API keys only for "
        "the key that sent them): send the graph itself, which it then holds under that id",
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
    phases = {"backward": "backward", RECOMPUTE: "recompute"}  # the rest: the forward
    for phase in ("forward", "recompute", "backward"):
        ours = [i for i, step in enumerate(program.steps)
                if phases.get(step.kind, "forward") == phase]
        if not ours:
            continue
        lines.append(f'  subgraph cluster_{phase} {{ label="{phase}"; color="#bbbbbb";')
        for i in ours:
            step = program.steps[i]
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


def _hosts(decoded: Decoded) -> dict[str, np.ndarray]:
    """The decoded host arrays (as the native tier takes them)."""
    return {name: a for name, (a, _) in decoded.items()}


def _arrays(decoded: Decoded, device: str) -> dict[str, Any]:
    """The decoded host arrays on the request's device (on the CPU: the arrays themselves)."""
    backend = get_backend(device)
    return {name: backend.from_host(a) for name, (a, _) in decoded.items()}


def encode_result(program: Program, result: RunResult, *, device: str, no_grad: bool,
                  encoding: str, graph_id: str, source: str, tier: str) -> Reply:
    """The response: JSON, or with the binary encoding a JSON header whose tensors say
    `binary_data_size`, followed by their bytes in the order they appear in it. `tier`:
    "xla", or why the interpreter ran it (service/tier.py)."""
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
        "program": source,
        "recompute": recomputation(program),
        "tier": XLA if tier == XLA else INTERPRETER,
        "tier_reason": None if tier == XLA else tier,
        "timings_ms": result.timings_ms,
    }
    header = codec.dumps(content)
    if encoding != "binary":
        return Reply([header])
    # Spaces after the JSON (which allows them) so that the tensors start 8-byte aligned.
    header += b" " * (-len(header) % 8)
    return Reply([header, *tail], header_length=len(header))
