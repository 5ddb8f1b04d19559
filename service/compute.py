"""One request's computation, in one pass, in whichever process runs it: the body's
envelope, the request, its program (found in this process, loaded from the store, or
compiled), the run, and the encoded reply.

The front process runs it for the requests it places in its fast lane (with a guard: a
program that turns out too costly to run there is not run, `Misplaced`), and each worker
process for the rest (service/worker.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np

from gradserve.engine.backends import get_backend
from gradserve.engine.errors import GradserveError, quoted
from gradserve.engine.graph import (
    Limits,
    Program,
    RunResult,
    TensorSpec,
    check_budgets,
    compile_graph,
    execute,
)
from gradserve.engine.graph.compiler import lifting_shape
from gradserve.engine.graph.lifting import Templates
from gradserve.engine.graph.scan import executed_steps
from gradserve.engine.graph.xla import INDEX_ORDERED
from gradserve.service.codec import JSONError
from gradserve.service.encode import Reply, encode_result, output_bytes, value_bytes
from gradserve.service.errors import ProblemError
from gradserve.service.literals import Resolve, find_sites
from gradserve.service.plan_view import plan_reply
from gradserve.service.programs import Programs, count_nodes
from gradserve.service.request import Envelope, Parser, Request, open_envelope, parse_graph
from gradserve.service.schemas import KeepOutputs
from gradserve.service.settings import Settings
from gradserve.service.store import entry_name
from gradserve.service.tensors import Held, TensorStore
from gradserve.service.tier import ANOMALY, FAST_LANE, INTERPRETER, OFF, XLA, Tier

Reserve = Callable[[int], None]  # reserves a program's bytes in flight, or raises 503
PLAN, PLAN_DOT = "plan", "plan-dot"  # POST /plan, answered as JSON or as DOT

# Engine errors that count as a rejection in the metrics, by class name.
_REJECTIONS = {
    "MemoryBudgetError": "memory_budget",
    "ComputeBudgetError": "compute_budget",
    "DeadlineExceeded": "timeout",
}


@dataclass
class Stats:
    """What a computation tells the front process's metrics and placement, filled in as it
    goes (also when it ends in an error)."""

    kind: str = ""  # forward, backward or plan
    role: str = "front"  # the process that computed: "front" or "worker"
    path: str = "grad"  # "grad" or "no_grad"
    graph_id: str | None = None
    program_key: str | None = None  # the program's, once this process holds it
    # Where the program came from: "process", "store", "lifted" or "compiled".
    program: str | None = None
    compute_cost: int | None = None  # the program's static cost, and the steps a run executes
    steps: int | None = None
    planned_peak_bytes: int | None = None
    peak_bytes: int | None = None
    rejected: str | None = None  # a rejection reason of the metrics, if refused
    compile_ms: float | None = None  # when it was compiled
    load_ms: float | None = None  # when it was loaded from the store
    cache_evictions: int = 0
    cache_bytes: int = 0  # of the program cache of the process that computed
    graph_evictions: int = 0
    tier: str | None = None  # the tier that ran it: "interpreter" or "xla"
    lowered: bool = False  # the program has an executable (its runs belong in a worker)
    pid: int = 0  # the worker that computed (0: the front process)
    store_evictions: int = 0  # by that process since it last reported
    store_damaged: int = 0
    # The programs whose XLA executables that process loaded since it last reported, and
    # the tier's predictions against what it measured (what: "interpreted", "xla" or
    # "compile"; predicted ms; measured ms).
    loads: list[str] = field(default_factory=list)
    predictions: list[tuple[str, float, float]] = field(default_factory=list)
    tensor_evictions: int = 0  # held tensors that process evicted since it last reported
    # The key of its graph's text (all but its numbers: service/literals.py) when its
    # program was lifted: graphs of that text come with new literals, and share a program.
    text_key: str | None = None


class Misplaced(Exception):
    """A request placed in the front process's lanes whose program turns out too costly to
    run there, or lowered to XLA (which the front process does not load): it goes to a
    worker, and the front process learns its figures."""

    def __init__(self, stats: Stats) -> None:
        super().__init__("too costly for the fast lane")
        self.stats = stats


@dataclass(frozen=True)
class Bounds:
    """What the fast lane runs: a graph of at most `nodes` nodes compiled there, a program
    of at most `cost` cost units and `steps` steps executed (a loop's body as often as it
    iterates: the interpreter's overhead is ~1 us a step)."""

    nodes: int
    cost: int
    steps: int
    peak_bytes: int | None = None  # its planned peak (None: the cost bounds it enough)
    # Its runs answer `fast lane: ...` (what the contract shows for a tiny request) rather
    # than the tier's books on the program (which the front process keeps too).
    fast_lane: bool = True

    def admits(self, cost: int, steps: int, peak_bytes: int) -> bool:
        return (
            cost <= self.cost
            and steps <= self.steps
            and (self.peak_bytes is None or peak_bytes <= self.peak_bytes)
        )

    def admit(self, program: Program) -> bool:
        return self.admits(
            program.compute_cost, executed_steps(program), program.planned_peak_bytes
        )


class Compute:
    """A process's computations over its programs (service/programs.py) and its native
    tier (service/tier.py)."""

    def __init__(self, settings: Settings, role: str = "worker") -> None:
        self.settings = settings
        self.role = role
        self.programs = Programs(settings)
        # Graphs that differ only in float literals: a quarter of the program cache's bytes.
        self.templates = Templates(max_bytes=settings.program_cache_bytes // 4)
        # The host's tensors held by id (None where no directory is set: a bare Compute).
        self.tensors = (
            None
            if settings.tensor_store_dir is None
            else TensorStore(settings.tensor_store_dir, settings.tensor_quota_bytes)
        )
        self._tensor_evictions = 0  # of `tensors`, at the last report
        self.parser = Parser(settings, self.programs, self.tensors)
        self.tier = Tier(settings, role, self.programs.store)

    def serve(
        self,
        kind: str,
        body: bytes | memoryview,
        header_length: int | None,
        tenant: str | None,
        deadline: float,
        reserve: Reserve,
        stats: Stats,
        *,
        raw_key: str | None = None,
        envelope: Envelope | None = None,
        bounds: Bounds | None = None,
    ) -> Reply:
        """The response body of one request: "forward", "backward", or a plan ("plan",
        "plan-dot"). `header_length`: the body is binary (its JSON header's length);
        `tenant`: the API key's id (None with keys off); `raw_key` or `envelope`: its
        graph's bytes' key, or the whole envelope, when the process that placed it has
        opened it already; `bounds`: the fast lane's (a program past them raises Misplaced
        before it runs). `stats` is filled in as it goes, also when it ends in an error."""
        stats.kind, stats.role = kind.removesuffix("-dot"), self.role
        if envelope is None:
            envelope = open_envelope(body, header_length, self.programs, raw_key)
        del body
        request = self.parser.parse(envelope, stats.kind, tenant)
        del envelope
        try:
            stats.path = "no_grad" if request.no_grad else "grad"
            stats.graph_id = request.graph_id
            stats.graph_evictions = request.graphs_evicted
            if kind in (PLAN, PLAN_DOT):
                return plan_reply(self, request, stats, dot=kind == PLAN_DOT, bounds=bounds)
            program = self.program(request, stats, bounds)
            return self.run(request, program, deadline, reserve, stats, bounds)
        finally:
            request.pins.release()  # (its arrays stay valid: the mappings outlive the locks)

    # ------------------------------------------------------------------ the program
    def program(self, request: Request, stats: Stats, bounds: Bounds | None = None) -> Program:
        """The request's program: from this process's memory or the host's store, else
        compiled and kept. Past `bounds`, Misplaced (a program compiled for nothing is not
        kept)."""
        key = request.program_key
        found = self.programs.find(key, request.device)
        stats.program = found.source or "compiled"
        program = found.program
        if found.source == "store":
            stats.load_ms = found.load_ms
        if program is None and request.lifted is not None:
            program = self.lift(request, stats, keep=bounds is None)
        if program is None:
            if (
                bounds is not None
                and count_nodes(self.parser.graph_of(request).nodes) > bounds.nodes
            ):
                raise Misplaced(stats)
            program = self.compile(request, stats, keep=bounds is None)
        if (
            program.vmap_budgeted
            and program.planned_peak_bytes > request.budget
            and not request.budget_shapes_program
        ):
            # Its vmaps chunked to fit the budget: a program of its own, kept by the budget.
            if bounds is not None:
                raise Misplaced(stats)
            key = entry_name("p", key, f"vmap-chunks<={request.budget}")[2:]
            found = self.programs.find(key, request.device)
            program = found.program or self.compile(request, stats, keep=False, chunked=True)
            if found.program is None:
                stats.cache_evictions = self.programs.remember(
                    key, program, request.device, stats.compile_ms or 0.0
                )
        stats.program_key = key
        if stats.program == "lifted" and request.text is not None:
            stats.text_key = request.text.found.text_key
        stats.compute_cost, stats.steps = program.compute_cost, executed_steps(program)
        stats.planned_peak_bytes = program.planned_peak_bytes
        if bounds is not None:
            if not bounds.admit(program):
                raise Misplaced(stats)
            if found.program is None:
                self.keep(request, program, stats)
        return program

    def compile(
        self,
        request: Request,
        stats: Stats,
        keep: bool = True,
        recompute: bool | None = None,
        chunked: bool = False,
    ) -> Program:
        """Compile the request's program. The budgets are checked on each use, not here;
        only a backward that may recompute is compiled for its memory budget (the planner
        recomputes what it must to fit it), and, `chunked`, a program whose vmaps the
        planner chunks to fit it."""
        started = time.perf_counter()
        shaped = request.budget_shapes_program if recompute is None else recompute
        inputs, grad_outputs = request.specs()
        limits = self.limits(request.budget if shaped or chunked else None, None, shaped)
        try:
            program = compile_graph(
                self.parser.graph_of(request),
                inputs,
                limits=limits,
                no_grad=request.no_grad,
                backward=request.backward,
                grad_outputs=grad_outputs,
                device=request.device,
                templates=self.templates,
            )
        except GradserveError as err:
            stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        stats.compile_ms = (time.perf_counter() - started) * 1000
        if program.lifted:
            stats.program = "lifted"
            text = request.text
            if text is not None and not chunked and not self.parser.sites.known(text.sites_key):
                # The second graph of its shape: where its literals are written, found once.
                resolve = self._resolver(request, inputs, grad_outputs, limits)
                sites = find_sites(text.graph, text.found, resolve)
                self.parser.sites.learn(text.sites_key, text.found.text_key, sites)
        if keep:
            self.keep(request, program, stats)
        return program

    def lift(self, request: Request, stats: Stats, keep: bool) -> Program | None:
        """The program of a graph whose literals were read off its bytes (request.lifted),
        from its shape's template; None if the template is gone (it is then compiled)."""
        assert request.lifted is not None
        started = time.perf_counter()
        program = self.templates.instantiate(*request.lifted)
        if program is None:
            return None
        stats.compile_ms = program.plan_ms = (time.perf_counter() - started) * 1000
        stats.program = "lifted"
        if keep:
            self.keep(request, program, stats)
        return program

    def _resolver(
        self,
        request: Request,
        inputs: Mapping[str, TensorSpec],
        grad_outputs: Mapping[str, TensorSpec] | None,
        limits: Limits,
    ) -> Resolve:
        """A graph's bytes to the lifting shape and literals it has in `request`'s place
        (its specs, `limits`; None if it is not a valid graph there)."""

        def resolve(graph: bytes) -> tuple[Hashable, list[float]] | None:
            try:
                return lifting_shape(
                    parse_graph(graph),
                    inputs,
                    limits=limits,
                    no_grad=request.no_grad,
                    backward=request.backward,
                    grad_outputs=grad_outputs,
                    device=request.device,
                )
            except (GradserveError, ProblemError, JSONError):
                return None

        return resolve

    def keep(self, request: Request, program: Program, stats: Stats) -> None:
        """A program just compiled, kept in this process (and the store, in time)."""
        stats.cache_evictions = self.programs.remember(
            request.program_key, program, request.device, stats.compile_ms or 0.0
        )
        stats.cache_bytes = self.programs.memory.bytes

    def limits(
        self, memory_budget: int | None, compute_budget: float | None, recompute: bool = False
    ) -> Limits:
        s = self.settings
        return Limits(
            max_nodes=s.max_nodes,
            expr_max_chars=s.expr_max_chars,
            expr_max_depth=s.expr_max_depth,
            memory_budget_bytes=memory_budget,
            compute_budget=compute_budget,
            max_inputs=s.max_inputs,
            max_id_chars=s.max_id_chars,
            recompute=recompute,
        )

    # ------------------------------------------------------------------ the run
    def run(
        self,
        request: Request,
        program: Program,
        deadline: float,
        reserve: Reserve,
        stats: Stats,
        bounds: Bounds | None = None,
    ) -> Reply:
        """Check the budgets, reserve the planned bytes, run (lowered, or interpreted), and
        encode the answer (`bounds`: the front process's lane it runs in)."""
        try:
            check_budgets(
                program, self.limits(request.budget, self.settings.compute_budget), request.no_grad
            )
        except GradserveError as err:
            stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        key = request.program_key
        anomaly = request.detect_anomaly  # (looked for step by step: the interpreter's)
        if not anomaly and not self.tier.loads and self.tier.lowered(key):  # (XLA: a worker's)
            stats.lowered = True
            raise Misplaced(stats)
        plan_ms = (time.perf_counter() - request.started) * 1000  # parse, find, compile
        reserve(program.planned_peak_bytes + output_bytes(program, request.encoding))
        if request.keep is not None:  # (room for what it keeps, before it runs)
            self._tensors(request).reserve(
                request.tenant, kept_bytes(program, request.keep), request.pins
            )
        interpreted = anomaly or program.index_ordered  # (step by step, or sums in order)
        if interpreted:
            lowered, tier = None, ANOMALY if anomaly else INDEX_ORDERED
        else:
            lowered, tier = self.tier.choose(key, program, request.device, deadline)
        inputs, grad_outputs = request.inputs, request.grad_outputs
        try:
            result = None
            if lowered is not None:  # (None again, and why, if XLA failed: interpreted)
                result, tier = self.tier.run(
                    key,
                    lowered,
                    {n: a for n, (a, _) in inputs.items()},
                    None if grad_outputs is None else {n: a for n, (a, _) in grad_outputs.items()},
                )
            if result is None:
                backend = get_backend(request.device)
                started = time.perf_counter()
                result = execute(
                    program,
                    {n: backend.from_host(a) for n, (a, _) in inputs.items()},
                    grad_outputs=None
                    if grad_outputs is None
                    else {n: backend.from_host(a) for n, (a, _) in grad_outputs.items()},
                    deadline=deadline,
                    detect_anomaly=anomaly,
                )
                if self.tier.off is None and not interpreted:
                    tier = self.tier.interpreted(
                        key, program, (time.perf_counter() - started) * 1000
                    )
        except GradserveError as err:
            stats.rejected = _REJECTIONS.get(type(err).__name__)
            raise
        del inputs, grad_outputs  # (the inputs' memory goes before the answer's)
        stats.peak_bytes = result.peak_bytes
        stats.tier = XLA if tier == XLA else INTERPRETER
        stats.lowered = self.tier.lowered(key)
        if (
            not self.tier.loads
            and tier not in (OFF, ANOMALY, INDEX_ORDERED)
            and (bounds is None or bounds.fast_lane)
        ):
            tier = FAST_LANE
        result.timings_ms["plan"] = round(plan_ms, 3)  # this request's, cached or not
        return encode_result(
            program,
            result,
            device=request.device,
            no_grad=request.no_grad,
            encoding=request.encoding,
            graph_id=request.graph_id,
            source=stats.program or "compiled",
            tier=tier,
            kept=None if request.keep is None else self.keep_values(request, result),
        )

    def _tensors(self, request: Request) -> TensorStore:
        if self.tensors is None:
            raise ProblemError(
                "tensor-store-unavailable", "this process holds no tensors (no tensor store)"
            )
        return self.tensors

    def keep_values(self, request: Request, result: RunResult) -> dict[tuple[str, str], Held]:
        """The values a request keeps, held in the store: by ("outputs" or "gradients",
        name)."""
        assert request.keep is not None
        store = self._tensors(request)
        to_host = get_backend(request.device).to_host
        named = [
            ((section, name), np.asarray(to_host(values[name])))
            for section, names, values in (
                ("outputs", request.keep.outputs, result.outputs),
                ("gradients", getattr(request.keep, "gradients", []), result.gradients or {}),
            )
            for name in names
        ]
        held = store.put_many(request.tenant, [a for _, a in named], request.pins)
        return {where: h for (where, _), (h, _) in zip(named, held, strict=True)}

    def report(self, stats: Stats) -> None:
        """What this process's stores and tier did since it last reported, into `stats`."""
        stats.store_evictions, stats.store_damaged = self.programs.changes()
        stats.loads, stats.predictions = self.tier.ended()
        if self.role == "worker":  # (the front process's, at the scrape: tensor_usage)
            stats.tensor_evictions = self.tensor_evictions()

    def tensor_evictions(self) -> int:
        """Held tensors this process evicted since it last said."""
        if self.tensors is None:
            return 0
        evictions = self.tensors.evictions
        new, self._tensor_evictions = evictions - self._tensor_evictions, evictions
        return new


def kept_bytes(program: Program, keep: KeepOutputs) -> int:
    """The bytes of the values `keep` names (422 naming one the program does not make:
    an output it does not have, a gradient of an input that needs none)."""
    metas = program.metas
    total = 0
    for section, names, slots in (
        ("outputs", keep.outputs, dict(program.outputs)),
        ("gradients", getattr(keep, "gradients", []), dict(program.gradients)),
    ):
        for at, name in enumerate(names):
            slot = slots.get(name)
            if slot is None:
                what = (
                    "an output of the graph"
                    if section == "outputs"
                    else "an input whose gradient the request computes (one that requires grad)"
                )
                raise ProblemError(
                    "invalid-request",
                    f"keep.{section} names {quoted(name)}, which is not {what}",
                    errors=[{"loc": ["keep", section, at], "msg": f"not {what}"}],
                )
            total += value_bytes(metas[slot])
    return total


# The contract's seed example: warms a process's imports, first calls and memos.
WARM_UP = (
    b'{"graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},'
    b' "inputs": {"x": {"data": 2.0, "requires_grad": true},'
    b' "y": {"data": 3.0, "requires_grad": true}}}'
)


def warm_up(settings: Settings, body: bytes = WARM_UP) -> None:
    """Run one small request end to end, with limits that a tiny configured one (in a
    test) cannot trip, and no bookkeeping."""
    roomy = settings.model_copy(
        update={
            "max_nodes": 100_000,
            "memory_budget_bytes": 1 << 20,
            "no_grad_memory_budget_bytes": 1 << 20,
            "inflight_memory_bytes": 1 << 20,
            "compute_budget": 1e9,
            "max_inputs": 16,
            "max_id_chars": 64,
            "program_store_dir": None,  # (nothing of it for the store)
            "xla": "off",  # (nor for the native tier)
        }
    )
    Compute(roomy).serve(
        "backward", body, None, None, time.monotonic() + 60, lambda _: None, Stats()
    )
