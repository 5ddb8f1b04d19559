"""From a graph (a GraphSpec, or any GraphLike) to a Program: validate everything, infer
shapes, derive the backward, plan memory and cost, and bind kernels, before any tensor is
allocated.

Nothing here recurses on graph depth. Errors are collected (up to `Limits.max_errors`),
each naming its node and field, and raised together. The forward is emitted through the
same namespace the VJPs use (`engine.graph.builder`), so shape rules, promotion and the
backward's steps all come from the op registry.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from gradserve.engine import collector
from gradserve.engine.errors import (
    ArityError,
    AttributeError_,
    BackwardError,
    ComputeBudgetError,
    DTypeError,
    GradserveError,
    GraphError,
    MemoryBudgetError,
    ShapeError,
    UnknownOpError,
    ValidationErrors,
    did_you_mean,
    quoted,
)
from gradserve.engine.graph.autodiff import active_slots, vjp
from gradserve.engine.graph.builder import Builder, Sym, derived
from gradserve.engine.graph.checkpoint import checkpoint_loops
from gradserve.engine.graph.executor import bind
from gradserve.engine.graph.expr import Span, expand_expr, piece_of
from gradserve.engine.graph.facts import literal_key
from gradserve.engine.graph.ir import BACKWARD, BYTE_COST, DERIVED, NODE, Lit, Program, Step
from gradserve.engine.graph.lifting import GraphLiteral, Templates
from gradserve.engine.graph.plan import plan
from gradserve.engine.graph.remat import rematerialize
from gradserve.engine.graph.rolling import roll_loops
from gradserve.engine.graph.scan import SCAN, Body, emit_scan
from gradserve.engine.graph.spec import (
    BodyLike,
    GraphLike,
    Limits,
    MapBodyLike,
    NodeLike,
    TensorSpec,
)
from gradserve.engine.graph.transforms import (
    Derivations,
    emit_grad,
    emit_hessian,
    emit_jacobian,
    emit_jvp,
    emit_map,
)
from gradserve.engine.ops.registry import nbytes
from gradserve.engine.rules import (
    FLOATS,
    GRAD,
    HESSIAN,
    INT64_MAX,
    INT64_MIN,
    JACOBIAN,
    JVP,
    OPS,
    SCAN_NODE,
    TRANSFORMS,
    VMAP_NODE,
    Meta,
    OpDef,
    Transform,
    fmt,
    numel,
    scalar_dtype,
)

_NUMBER = (bool, int, float)
# A vmap whose results are all reductions never holds its batch's stacked values: its chunks
# stack at most this many bytes of what they reduce (about a core's L2 cache). Measured on
# the clipped per-sample gradients of a 784-128-10 MLP (bench_transforms): chunks of 2 run
# in 0.65x the time of the whole batch at once, whose 99 MiB stack leaves the cache.
REDUCED_CHUNK_BYTES = 1 << 20
_BODIED = ("scan", "vmap")  # the nodes with a body and results
_REDUCTIONS = ("sum", "mean", "clip_sum")


class _Errors:
    """Errors collected over one validation pass. Inside a loop body, each message says
    which loop's body it is in (`within`: "scan 'id'" or "vmap 'id'", outermost first)."""

    def __init__(self, limit: int) -> None:
        self.items: list[GradserveError] = []
        self.limit = limit
        self.within: list[str] = []

    def add(self, err: GradserveError) -> None:
        if self.within:
            err.message = f"in the body of {' > '.join(self.within)}: {err.message}"
        self.items.append(err)
        if len(self.items) >= self.limit:
            raise ValidationErrors(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise ValidationErrors(self.items)


@dataclass(slots=True, eq=False)
class _Node:
    """One op node of the client's graph or of a loop body (after `expr` expansion),
    resolved."""

    id: str  # the node id (generated for the inner nodes of an `expr`)
    origin: str  # the client's node id, for error messages
    where: tuple[str | int, ...]  # the location of its level's `nodes` list
    index: int  # the client's node's place in that list
    key: int  # its value's number among the request's values (inputs first)
    op: OpDef | Transform
    args: list[int | Lit]  # a value's key, or a number literal
    attrs: dict[str, Any]
    loop: _LoopGraph | _MapGraph | None  # a scan or vmap node's body
    source: tuple[str, Span] | None  # its piece of an `expr`, for errors
    reads: list[int]  # the keys it reads (a loop's closures too)
    writes: list[int]  # the keys it makes (a loop's results too)
    # Set when its level is ordered: its place in the level (an identity), and the nodes
    # that make what it reads, one per read.
    pos: int = 0
    deps: Sequence[_Node] = ()

    @property
    def loc(self) -> tuple[str | int, ...]:
        """Where the client's node is in the request."""
        return (*self.where, self.index)


@dataclass(slots=True, eq=False)
class _LoopGraph:
    """A scan node's body, resolved in its own scope."""

    carries: list[int]  # keys of the carry names
    xs: list[int]  # keys of the sequence slices' names
    nodes: list[_Node]  # in run order
    nexts: list[tuple[int, tuple[str | int, ...]]]  # per carry: its next value's key, loc
    closures: list[int]  # outer keys the body reads
    results: list[tuple[int, int]]  # (outer key, carry number or -1 - body key)

    @property
    def result_keys(self) -> list[int]:
        return [key for key, _ in self.results]


class _Chunking:
    """How the vmaps whose chunk_size is null (and the jacobian and hessian nodes, vmaps
    over a basis) are chunked in one compile: the whole batch first; over the memory
    budget, the largest chunk (at most `cap` indices at once) that fits, found by
    bisection, each try a compile of its own. A vmap's chunks never change its results'
    bits (engine.graph.transforms.emit_map), only the peak."""

    def __init__(self) -> None:
        self.cap: int | None = None
        self.largest = 0  # the largest batch of a vmap that the cap chunks
        self.used: dict[str, int] = {}  # vmap node id -> indices at once (every vmap)
        self.fit = 0  # the largest cap known to fit
        self.over = 0  # the least cap known not to
        self.best: Program | None = None  # the program of `fit`
        self.budgeted = False  # a vmap leaves its chunks to the planner
        self.ordered = False  # a vmap reduces over its batch

    def chunk(self, node: str, size: int, asked: int | None, reduced: int = 0) -> int:
        """The chunk a vmap of `size` indices (a Jacobian of `size` rows or columns) runs
        in, as its node asks or under the cap. `reduced`: where every result of the vmap
        is a reduction, the bytes one index reduces: its chunks then stack no more than
        REDUCED_CHUNK_BYTES of them (one index at least), never the whole batch's."""
        if asked is None:
            self.budgeted = True
            most = min(size, max(1, REDUCED_CHUNK_BYTES // reduced)) if reduced else size
            self.largest = max(self.largest, most)
            chunk = most if self.cap is None else min(self.cap, most)
        else:
            chunk = min(asked, size)
        self.used[node] = chunk
        return chunk

    def retry(self, program: Program | None) -> bool:
        """After a compile: its program, or None where it was over the memory budget.
        Whether to compile again (the next cap is set); if not, `best` is the program to
        keep, None where nothing fits."""
        if program is not None:
            program.vmap_chunks = self.used
            program.vmap_budgeted, program.index_ordered = self.budgeted, self.ordered
            self.best = program
            if self.cap is None:
                return False
            self.fit = self.cap
        elif self.cap is None:
            if self.largest <= 1:
                return False
            self.over = self.largest
        else:
            self.over = self.cap
        if self.over - self.fit <= 1:
            return False
        self.cap = (self.fit + self.over) // 2
        self.largest = 0
        self.used = {}
        return True


@dataclass(slots=True, eq=False)
class _MapResult:
    """A vmap result: its outer key, the body value it is made of, and its reduction over
    the mapped dim (None: the values stacked)."""

    key: int
    of: int
    reduce: str | None
    max_norm: float
    norm_of: list[int]


@dataclass(slots=True, eq=False)
class _MapGraph:
    """A vmap node's body, resolved in its own scope."""

    ins: list[int]  # keys of the slices' names
    nodes: list[_Node]  # in run order
    closures: list[int]  # outer keys the body reads
    results: list[_MapResult]

    @property
    def result_keys(self) -> list[int]:
        return [r.key for r in self.results]


class _Scope:
    """The names one graph level sees: its own (inputs or carries and slices, node ids,
    aliases, results), then its enclosing levels'."""

    def __init__(self, parent: _Scope | None, loc: tuple[str | int, ...]) -> None:
        self.parent = parent
        self.loc = loc  # the location of this level's `nodes` list
        self.names: dict[str, int] = {}
        self.depth: int = 0 if parent is None else parent.depth + 1

    def find(self, name: str) -> int | None:
        scope: _Scope | None = self
        while scope is not None:
            key = scope.names.get(name)
            if key is not None:
                return key
            scope = scope.parent
        return None

    def visible(self) -> list[str]:
        """Every name this level sees (the client's: not the ids `expr` generates)."""
        names: list[str] = []
        scope: _Scope | None = self
        while scope is not None:
            names.extend(n for n in scope.names if "#" not in n)
            scope = scope.parent
        return names

    def outer(self, name: str) -> bool:
        """Whether an enclosing level has `name` (no shadowing: a 422)."""
        return self.parent is not None and self.parent.find(name) is not None

    def node_loc(self, index: int, *rest: str | int) -> tuple[str | int, ...]:
        return (*self.loc, index, *rest)


def compile_graph(
    spec: GraphLike,
    inputs: Mapping[str, TensorSpec],
    *,
    limits: Limits | None = None,
    no_grad: bool = False,
    backward: bool = False,
    grad_outputs: Mapping[str, TensorSpec] | None = None,
    device: str = "cpu",
    templates: Templates | None = None,
) -> Program:
    """Validate, differentiate, plan and bind `spec` for `device`; raises ValidationErrors,
    MemoryBudgetError or ComputeBudgetError. `templates`: the programs of graphs compiled
    before, one of which this graph may take with its own float literals put in
    (engine.graph.lifting; the program says `lifted`)."""
    with collector.paused():  # (engine.collector: a compile's objects all live to its end)
        return _compile(spec, inputs, limits, no_grad, backward, grad_outputs, device, templates)


def _compile(
    spec: GraphLike,
    inputs: Mapping[str, TensorSpec],
    limits: Limits | None,
    no_grad: bool,
    backward: bool,
    grad_outputs: Mapping[str, TensorSpec] | None,
    device: str,
    templates: Templates | None,
) -> Program:
    started = time.perf_counter()
    limits = limits or Limits()
    graph, named_outputs, scope, errors = _resolve(spec, inputs, limits)
    lifting = (
        None
        if templates is None
        else _shape(graph, named_outputs, inputs, grad_outputs, no_grad, backward, device, limits)
    )
    if lifting is not None:
        shape, literals = lifting
        lifted = templates.instantiate(shape, [float(g.lit.value) for g in literals])  # type: ignore[union-attr]
        if lifted is not None:
            lifted.plan_ms = (time.perf_counter() - started) * 1000
            return lifted

    order = _run_order(graph, [key for _, key in named_outputs], ordered=False)
    chunking = _Chunking()
    while True:
        b = Builder()
        slots: dict[int, int] = {}  # by key
        for name, tspec in inputs.items():
            slots[scope.names[name]] = b.value(Meta(tuple(tspec.shape), tspec.dtype)).slot
        grad_syms = {
            name: b.value(Meta(tuple(t.shape), t.dtype)) for name, t in (grad_outputs or {}).items()
        }
        _emit(b, order, slots, errors, chunking)
        errors.raise_if_any()

        input_slots = {name: slots[scope.names[name]] for name in inputs}
        outputs = [(name, slots[key]) for name, key in named_outputs]
        try:
            program = _finish(
                b,
                inputs,
                input_slots,
                outputs,
                grad_syms,
                grad_outputs,
                no_grad,
                backward,
                device,
                limits,
            )
        except MemoryBudgetError as err:
            if chunking.retry(None):
                continue
            if chunking.best is None:
                if chunking.cap is not None:
                    err.message += " (with each vmap computing one index at a time)"
                raise
            program = chunking.best
            break
        if not chunking.retry(program):
            program = chunking.best or program
            break
    program.plan_ms = (time.perf_counter() - started) * 1000
    if lifting is not None:
        templates.learn(*lifting, program)  # type: ignore[union-attr]
    return program


def lifting_shape(
    spec: GraphLike,
    inputs: Mapping[str, TensorSpec],
    *,
    limits: Limits | None = None,
    no_grad: bool = False,
    backward: bool = False,
    grad_outputs: Mapping[str, TensorSpec] | None = None,
    device: str = "cpu",
) -> tuple[tuple[Any, ...], list[float]] | None:
    """What `compile_graph` keys its templates by (engine.graph.lifting), without compiling:
    the graph's shape and its float literals' values in order; None for a graph with loops.
    Raises ValidationErrors as compile_graph does."""
    with collector.paused():
        limits = limits or Limits()
        graph, named_outputs, _, _ = _resolve(spec, inputs, limits)
        lifting = _shape(
            graph, named_outputs, inputs, grad_outputs, no_grad, backward, device, limits
        )
    return None if lifting is None else (lifting[0], [float(g.lit.value) for g in lifting[1]])


def _resolve(
    spec: GraphLike, inputs: Mapping[str, TensorSpec], limits: Limits
) -> tuple[list[_Node], list[tuple[str, int]], _Scope, _Errors]:
    """The graph's nodes resolved (names to keys, exprs parsed) and its named outputs, with
    the scope and errors the compile goes on with; raises what makes it invalid."""
    errors = _Errors(limits.max_errors)
    _check_sizes(spec, inputs, limits, errors)
    resolver = _Resolver(limits, errors)
    scope = _Scope(None, ("graph", "nodes"))
    for name, tspec in inputs.items():
        scope.names[name] = resolver.new_key()
        if tspec.requires_grad and tspec.dtype not in FLOATS:
            errors.add(
                GradserveError(
                    f"input {quoted(name)} has dtype {tspec.dtype}: only floating point tensors "
                    'can require gradients; give it a floating dtype ("dtype": "float32" '
                    'or "float64")',
                    loc=("inputs", name, "requires_grad"),
                )
            )
    graph = resolver.graph(spec.nodes, scope, ordered=False)
    named_outputs = _outputs(spec.outputs, scope, resolver, errors)
    errors.raise_if_any()
    return graph, named_outputs, scope, errors


def _finish(
    b: Builder,
    inputs: Mapping[str, TensorSpec],
    input_slots: dict[str, int],
    outputs: list[tuple[str, int]],
    grad_syms: Mapping[str, Sym],
    grad_outputs: Mapping[str, TensorSpec] | None,
    no_grad: bool,
    backward: bool,
    device: str,
    limits: Limits,
) -> Program:
    """A program from its forward emitted on `b`: requires_grad, the derived backward, the
    plan (recomputing to fit the memory budget), the budgets checked, the kernels bound."""
    errors = _Errors(limits.max_errors)
    wrt = [] if no_grad else [input_slots[n] for n, t in inputs.items() if t.requires_grad]
    active = active_slots(b, b.steps, wrt)
    requires_grad = [False] * len(b.metas)
    for slot in active:
        requires_grad[slot] = True
    if no_grad:  # the inputs keep their flag; nothing computed under no_grad has one
        for name, tspec in inputs.items():
            requires_grad[input_slots[name]] = bool(tspec.requires_grad)
    program = Program(
        metas=b.metas,
        steps=b.steps,
        inputs=input_slots,
        grad_inputs={name: sym.slot for name, sym in grad_syms.items()},
        outputs=outputs,
        gradients=[],
        requires_grad=requires_grad,
        grad_fn=_grad_fns(b, requires_grad),
        no_grad=no_grad,
        backward=backward,
    )
    if backward:
        roots = _check_backward(program, inputs, grad_outputs or {}, errors)
        errors.raise_if_any()
        _derive_backward(b, program, roots, grad_syms, inputs, None if no_grad else active)
        program.steps = b.steps
    bound_on = _backend_ufuncs(device)
    plan(program, ufuncs=bound_on, record=not no_grad and not backward, facts=b.facts)
    budget = limits.memory_budget_bytes
    if backward and limits.recompute and budget is not None and program.planned_peak_bytes > budget:
        # Loops first (their stacked residuals, checkpointed within them), then the top
        # level's values (recomputed in the backward); the second names the least peak
        # reached when nothing fits.
        without = program.planned_peak_bytes
        if checkpoint_loops(program, budget, ufuncs=bound_on, facts=b.facts) is not None:
            program = rematerialize(program, budget, ufuncs=bound_on, facts=b.facts)
        program.peak_without_recompute = without
    check_budgets(program, limits, no_grad)
    program.run = bind(program, device, facts=b.facts)
    return program


def roll_program(program: Program, device: str = "cpu") -> Program | None:
    """`program` with the unrolled loops of its forward rolled (engine.graph.rolling) and
    its backward derived again from the loops: the same inputs, outputs and gradients, by
    name, and the same values bit for bit. None where nothing rolls, or where a memory
    budget shaped the program (its recomputation is planned for the unrolled steps)."""
    rolled_forward = _rolled_forward(program)
    if rolled_forward is None:
        return None
    b, renames = rolled_forward
    metas = program.metas
    inputs = {
        name: TensorSpec(metas[slot].shape, metas[slot].dtype, program.requires_grad[slot])
        for name, slot in program.inputs.items()
    }
    grad_outputs = {
        name: TensorSpec(metas[slot].shape, metas[slot].dtype)
        for name, slot in program.grad_inputs.items()
    }
    rolled = _finish(
        b,
        inputs,
        dict(program.inputs),
        [(name, renames.get(slot, slot)) for name, slot in program.outputs],
        {name: b.syms[slot] for name, slot in program.grad_inputs.items()},
        grad_outputs if program.backward else None,
        program.no_grad,
        program.backward,
        device,
        Limits(),
    )
    rolled.plan_ms = program.plan_ms
    rolled.vmap_chunks, rolled.vmap_budgeted = program.vmap_chunks, program.vmap_budgeted
    rolled.index_ordered = program.index_ordered
    return rolled


def rolled_fraction(program: Program) -> float:
    """What is left of the steps XLA compiles once `program` is rolled as `roll_program`
    rolls it (1.0: nothing rolls), from its forward alone (the backward of a loop is a loop
    as well): for the native tier's predicted compile."""
    rolled_forward = _rolled_forward(program)
    if rolled_forward is None:
        return 1.0
    forward = sum(step.kind != BACKWARD for step in _steps_of(program))
    b = rolled_forward[0]
    left = sum(1 + len(step.attrs["body"].steps) if step.op is SCAN else 1 for step in b.steps)
    return min(1.0, left / max(forward, 1))


def _steps_of(program: Program) -> Sequence[Step]:
    """A program's steps: a loaded program's are a Sequence, not a list (engine.graph.serial),
    which this module compiled by mypyc must not read as its declared list."""
    steps: Sequence[Step] = getattr(program, "steps")  # noqa: B009 (an untyped read)
    return steps


def _rolled_forward(program: Program) -> tuple[Builder, dict[int, int]] | None:
    """The forward of `program` on a Builder of its own, rolled, and the renames of its
    outputs; None where nothing rolls or a memory budget shaped the program (its
    recomputation is planned for the unrolled steps)."""
    if program.recompute_cost:
        return None
    b = Builder()
    b.metas = list(program.metas)
    b.steps = [step for step in _steps_of(program) if step.kind != BACKWARD]
    renames = roll_loops(b, {slot for _, slot in program.outputs})
    if not any(step.op is SCAN and step.attrs["body"].unrolled_nodes for step in b.steps):
        return None
    return b, renames


def _shape(
    graph: list[_Node],
    outputs: list[tuple[str, int]],
    inputs: Mapping[str, TensorSpec],
    grad_outputs: Mapping[str, TensorSpec] | None,
    no_grad: bool,
    backward: bool,
    device: str,
    limits: Limits,
) -> tuple[tuple[Any, ...], list[GraphLiteral]] | None:
    """A resolved graph's shape for constant lifting (engine.graph.lifting): all that
    decides its program but the values of its float literals, and those literals in
    order. None for a graph with loops (a body is a program of its own)."""
    literals: list[GraphLiteral] = []
    nodes: list[tuple[Any, ...]] = []
    for node in graph:
        if node.loop is not None:
            return None
        op = node.op
        args: list[Any] = []
        for a in node.args:
            if type(a) is int:
                args.append(a)
            elif type(a.value) is float:  # type: ignore[union-attr]
                literals.append(GraphLiteral(a, op if type(op) is OpDef else None))  # type: ignore[arg-type]
                args.append(float)
            else:
                args.append(literal_key(a.value))  # type: ignore[union-attr]
        nodes.append(
            (node.id, node.origin, node.index, node.key, op.name, tuple(args), repr(node.attrs))
        )
    specs = tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in inputs.items())
    given = tuple((n, tuple(t.shape), t.dtype) for n, t in (grad_outputs or {}).items())
    return (tuple(nodes), tuple(outputs), specs, given, no_grad, backward, device, limits), literals


def _grad_fns(b: Builder, requires_grad: list[bool]) -> list[str | None]:
    """The `grad_fn` each value would report: its node's op (a `grad` or `jvp` node's
    value is a derived step's); a loop's stacked result is a stack, its final carry what
    the body's last step made it."""
    grad_fn: list[str | None] = [None] * len(b.metas)
    for step in b.steps:
        if step.kind not in (NODE, DERIVED):
            continue
        if step.op is SCAN:
            body: Body = step.attrs["body"]
            made = {s.out: s.op.grad_fn_name for s in body.steps}
            nc = len(body.carries)
            for k, slot in enumerate(step.outs):
                if requires_grad[slot]:
                    grad_fn[slot] = (
                        made.get(body.nexts[k])
                        if k < nc and body.length
                        else "StackBackward"
                        if k >= nc
                        else None
                    )
        elif requires_grad[step.out]:
            grad_fn[step.out] = step.op.grad_fn_name
    return grad_fn


def assemble(
    b: Builder, inputs: Mapping[str, Sym], outputs: Mapping[str, Sym], *, device: str = "cpu"
) -> Program:
    """A program from steps emitted by hand on `b` (the engine's own tests and transforms):
    every step the outputs need runs, derived ones included."""
    program = Program(
        metas=b.metas,
        steps=b.steps,
        inputs={n: s.slot for n, s in inputs.items()},
        grad_inputs={},
        outputs=[(n, s.slot) for n, s in outputs.items()],
        gradients=[],
        requires_grad=[False] * len(b.metas),
        grad_fn=[None] * len(b.metas),
        no_grad=False,
        backward=False,
    )
    plan(program, ufuncs=_backend_ufuncs(device), facts=b.facts)
    program.run = bind(program, device, facts=b.facts)
    return program


def _backend_ufuncs(device: str) -> bool:
    from gradserve.engine.backends import get_backend

    return get_backend(device).ufuncs is not None


def _check_sizes(
    spec: GraphLike, inputs: Mapping[str, TensorSpec], limits: Limits, errors: _Errors
) -> None:
    """The request's size limits, before any work that grows with them."""
    if len(spec.nodes) > limits.max_nodes:
        raise ValidationErrors(
            [
                GraphError(
                    f"the graph has {len(spec.nodes)} nodes; the limit is {limits.max_nodes}",
                    loc=("graph", "nodes"),
                )
            ]
        )
    if len(inputs) > limits.max_inputs:
        raise ValidationErrors(
            [
                GraphError(
                    f"the request has {len(inputs)} inputs; the limit is {limits.max_inputs}",
                    loc=("inputs",),
                )
            ]
        )
    for name in inputs:
        if len(name) > limits.max_id_chars:
            errors.add(
                GraphError(
                    f"input name {quoted(name)} is longer than {limits.max_id_chars} characters",
                    loc=("inputs", name[: limits.max_id_chars]),
                )
            )
    for index, node in enumerate(spec.nodes):
        if isinstance(node.id, str) and len(node.id) > limits.max_id_chars:
            errors.add(
                GraphError(
                    f"node id {quoted(node.id)} is longer than {limits.max_id_chars} characters",
                    node=node.id[: limits.max_id_chars],
                    loc=("graph", "nodes", index, "id"),
                )
            )
    errors.raise_if_any()


def _emit(
    b: Builder, order: list[_Node], slots: dict[int, int], errors: _Errors, chunking: _Chunking
) -> None:
    """Emit each node's step (shape and dtype inferred, promotion made explicit), the
    steps of a `grad` or `jvp` node, or a loop. `slots`: each value's slot, by key. A node
    downstream of a refused one is skipped: its error was already reported."""
    derivations = Derivations()
    for node in order:
        args: list[int | Lit] = []  # (a step's arguments: slots and literals)
        for a in node.args:
            if type(a) is int:
                slot = slots.get(a)
                if slot is None:
                    break
                args.append(slot)
            else:
                args.append(a)
        else:
            b.origin = node.origin
            op = node.op
            try:
                if type(node.loop) is _LoopGraph:
                    _emit_loop(b, node, b.values(args), slots, errors, chunking)
                elif type(node.loop) is _MapGraph:
                    _emit_map(b, node, node.loop, b.values(args), slots, errors, chunking)
                elif op is GRAD:
                    slots[node.key] = emit_grad(b, derivations, b.values(args)).slot
                elif op is JVP:
                    slots[node.key] = emit_jvp(b, b.values(args)).slot
                elif op is JACOBIAN:
                    mode = node.attrs["mode"]
                    chunk = functools.partial(chunking.chunk, node.origin, asked=None)
                    slots[node.key] = emit_jacobian(
                        b, derivations, b.values(args), mode, chunk
                    ).slot
                elif op is HESSIAN:
                    chunk = functools.partial(chunking.chunk, node.origin, asked=None)
                    slots[node.key] = emit_hessian(b, derivations, b.values(args), chunk).slot
                else:
                    slots[node.key] = b.emit_args(op, args, node.attrs)  # type: ignore[arg-type]
            except GradserveError as err:
                err.at(node=node.origin, op=node.op.name)
                if not err.loc or err.loc[0] != "graph":  # (a loop's own errors say where)
                    err.loc = node.loc
                if node.source is not None:  # which piece of the expression
                    err.message += f" (in {piece_of(*node.source)})"
                errors.add(err)
    b.origin = None


def _emit_loop(
    b: Builder,
    node: _Node,
    args: list[Any],
    slots: dict[int, int],
    errors: _Errors,
    chunking: _Chunking,
) -> None:
    """A scan node: its body emitted once on a Builder of its own, then one loop step."""
    loop = node.loop
    assert type(loop) is _LoopGraph
    nc = len(loop.carries)
    inits = [a if type(a) is Sym else b.constant(a, scalar_dtype(a)) for a in args[:nc]]
    xs = args[nc:]
    length = node.attrs["length"]
    if length is not None and length < 0:
        raise AttributeError_(
            f"attrs.length must be >= 0, got {length}", loc=(*node.loc, "attrs", "length")
        )
    for j, x in enumerate(xs):
        if type(x) is not Sym or not x.shape:
            raise ShapeError(
                f"sequence {j} (argument {nc + j}) must be a tensor with a "
                "leading dim to loop over",
                loc=(*node.loc, "args", nc + j),
            )
        if length is None:
            length = x.shape[0]
        elif x.shape[0] != length:
            what = "attrs.length" if node.attrs["length"] is not None else "sequence 0"
            raise ShapeError(
                f"sequence {j} has {x.shape[0]} steps but {what} has {length}",
                loc=(*node.loc, "args", nc + j),
            )
    if length is None:
        raise AttributeError_(
            "a scan without sequences needs attrs.length, the number of steps",
            loc=(*node.loc, "attrs", "length"),
        )
    outer = [slots.get(k) for k in loop.closures]
    if any(c is None for c in outer):
        return  # an outer value it reads was refused: that error is reported
    closures = [b.syms[c] for c in outer]  # type: ignore[index]
    bb = Builder()
    inner: dict[int, int] = {}
    for key, init in zip(loop.carries, inits, strict=True):
        inner[key] = bb.value(init.meta).slot
    for key, x in zip(loop.xs, xs, strict=True):
        inner[key] = bb.value(Meta(x.shape[1:], x.dtype)).slot
    for key, c in zip(loop.closures, closures, strict=True):
        inner[key] = bb.value(c.meta).slot
    reported = len(errors.items)
    errors.within.append(f"scan {quoted(node.origin)}")
    try:
        _emit(bb, loop.nodes, inner, errors, chunking)
        nexts = []
        for (key, loc), carry in zip(loop.nexts, loop.carries, strict=True):
            if key not in inner:
                continue
            value, meta = bb.syms[inner[key]], bb.metas[inner[carry]]
            if value.shape != meta.shape or value.dtype != meta.dtype:
                kind = ShapeError if value.shape != meta.shape else DTypeError
                producer = _producer(loop, key)
                errors.add(
                    kind(
                        f"the carry {quoted(str(loc[-1]))} is {fmt(meta.shape)} {meta.dtype} but "
                        f"its next value is {fmt(value.shape)} {value.dtype}: a carry keeps its "
                        "shape and dtype",
                        node=producer or node.origin,
                        loc=loc,
                    )
                )
                continue
            nexts.append(value.slot)
    finally:
        errors.within.pop()
    if len(errors.items) > reported or len(nexts) < nc:
        return
    ys: list[int] = []
    for _, which in loop.results:
        if which < 0 and inner[-1 - which] not in ys:
            ys.append(inner[-1 - which])
    body = Body(
        b=bb,
        steps=list(bb.steps),
        carries=[inner[k] for k in loop.carries],
        xs=[inner[k] for k in loop.xs],
        closures=[inner[k] for k in loop.closures],
        nexts=nexts,
        ys=ys,
        length=length,
    )
    outs = emit_scan(b, body, inits, xs, closures)
    for key, which in loop.results:
        slots[key] = (outs[which] if which >= 0 else outs[nc + ys.index(inner[-1 - which])]).slot


def _emit_map(
    b: Builder,
    node: _Node,
    graph: _MapGraph,
    args: list[Any],
    slots: dict[int, int],
    errors: _Errors,
    chunking: _Chunking,
) -> None:
    """A vmap node: its body emitted once, for one index (its inputs are slots that no step
    writes), then batched (engine.graph.transforms.emit_map)."""
    in_axes = node.attrs["in_axes"]
    if isinstance(in_axes, int):
        in_axes = [in_axes] * len(args)
    if in_axes is not None and len(in_axes) != len(args):
        raise AttributeError_(
            f"attrs.in_axes has {len(in_axes)} entries for {len(args)} arguments",
            loc=(*node.loc, "attrs", "in_axes"),
        )
    asked = node.attrs["chunk_size"]
    if asked is not None and asked < 1:
        raise AttributeError_(
            f"attrs.chunk_size must be >= 1 or null, got {asked}",
            loc=(*node.loc, "attrs", "chunk_size"),
        )
    mapped: list[Sym] = []
    size = None
    for j, x in enumerate(args):
        axis = 0 if in_axes is None else in_axes[j]
        if type(x) is not Sym or not x.shape:
            raise ShapeError(
                f"argument {j} must be a tensor with a dim to map over",
                loc=(*node.loc, "args", j),
            )
        if not -x.ndim <= axis < x.ndim:
            raise AttributeError_(
                f"in_axes[{j}] is {axis}, but argument {j} has {x.ndim} dims",
                loc=(*node.loc, "attrs", "in_axes", j),
            )
        axis %= x.ndim
        if size is None:
            size = x.shape[axis]
        elif x.shape[axis] != size:
            raise ShapeError(
                f"argument {j} has size {x.shape[axis]} along its mapped dim {axis}, but "
                f"argument 0 has {size}: every mapped size must agree",
                loc=(*node.loc, "args", j),
            )
        if axis:
            x = b.call("permute", x, dims=[axis, *(d for d in range(x.ndim) if d != axis)])
        mapped.append(x)
    if size == 0:
        raise ShapeError("the mapped dim has size 0: nothing to map over", loc=(*node.loc, "args"))
    assert size is not None
    start = len(b.steps)
    inner = dict(slots)
    holders = []
    for key, x in zip(graph.ins, mapped, strict=True):
        holder = b.value(Meta(x.shape[1:], x.dtype))
        inner[key] = holder.slot
        holders.append(holder.slot)
    reported = len(errors.items)
    errors.within.append(f"vmap {quoted(node.origin)}")
    try:
        _emit(b, graph.nodes, inner, errors, chunking)
    finally:
        errors.within.pop()
    if len(errors.items) > reported:
        return
    b.origin = node.origin
    results = [
        (r.reduce, inner[r.of], r.max_norm, [inner[k] for k in r.norm_of]) for r in graph.results
    ]
    reduced = 0
    if all(r.reduce for r in graph.results):
        values = {inner[k] for r in graph.results for k in (r.of, *r.norm_of)}
        reduced = sum(nbytes(b.metas[v]) for v in values)
    chunk = chunking.chunk(node.origin, size, asked, reduced)
    chunking.ordered = chunking.ordered or any(r.reduce for r in graph.results)
    outs = emit_map(b, start, dict(zip(holders, mapped, strict=True)), results, size, chunk)
    for r, out in zip(graph.results, outs, strict=True):
        slots[r.key] = out.slot


def _producer(loop: _LoopGraph, key: int) -> str | None:
    """The body node that makes value `key` (None for a carry, a slice or an outer value)."""
    return next((n.origin for n in loop.nodes if n.key == key), None)


def _derive_backward(
    b: Builder,
    program: Program,
    roots: list[str],
    grad_syms: Mapping[str, Sym],
    inputs: Mapping[str, TensorSpec],
    active: set[int] | None,
) -> None:
    """Append the backward: the gradient of every input that requires grad, from the roots'
    upstream gradients (given, cast to the output's dtype, or the implicit 1). `active`:
    the values that depend on those inputs, where they are known already."""
    forward = list(b.steps)
    slots = dict(program.outputs)
    cotangents: list[tuple[int, Sym]] = []
    with derived(b, create_graph=False):
        for name in roots:
            slot = slots[name]
            meta = b.metas[slot]
            given = grad_syms.get(name)
            if given is None:
                g = b.call("ones", shape=list(meta.shape), dtype=meta.dtype)
            else:
                g = b.call("cast", given, dtype=meta.dtype)
            cotangents.append((slot, g))
    names = [n for n, t in inputs.items() if t.requires_grad]
    wrt = [program.inputs[n] for n in names]
    grads = vjp(b, forward, cotangents, wrt, active=active)
    with derived(b, create_graph=False):
        for name, slot, grad in zip(names, wrt, grads, strict=True):
            if grad is None:  # an input the outputs do not depend on gets zeros
                meta = b.metas[slot]
                grad = b.call("zeros", shape=list(meta.shape), dtype=meta.dtype)
            program.gradients.append((name, grad.slot))


def check_budgets(program: Program, limits: Limits, no_grad: bool) -> None:
    """MemoryBudgetError or ComputeBudgetError when `program` is over `limits`' budgets."""
    budget = limits.memory_budget_bytes
    if budget is not None and program.planned_peak_bytes > budget:
        path = "no_grad" if no_grad else "grad"
        raise MemoryBudgetError(
            f"the planned peak memory of this request is {program.planned_peak_bytes} bytes; "
            f"the {path} budget is {budget} bytes",
            planned_bytes=program.planned_peak_bytes,
            budget_bytes=budget,
        )
    cost = program.compute_cost
    if limits.compute_budget is not None and cost > limits.compute_budget:
        node, worst = max(program.cost_by_node.items(), key=lambda kv: kv[1])
        raise ComputeBudgetError(
            f"the planned compute of this request is {cost:.3g} cost units (floating-point "
            f"operations plus {BYTE_COST} per byte moved, forward and backward); the budget is "
            f"{limits.compute_budget:.3g}. The most expensive node is {quoted(node)} "
            f"({worst:.3g})",
            cost=cost,
            budget=int(limits.compute_budget),
            node=None if node == "<graph>" else node,
        )


class _Resolver:
    """Resolves the nodes of one graph level (the request's graph, or a loop body, which
    it resolves in turn): ids, `expr` expansion, references, arity and attributes, and
    the order of the level's nodes. Every value gets a key, numbered across levels."""

    def __init__(self, limits: Limits, errors: _Errors) -> None:
        self.limits = limits
        self.errors = errors
        self.keys = 0
        self.expanded = 0  # op nodes after `expr` expansion, over all levels
        # a scan or vmap node's key -> its op and its result ids
        self.loops: dict[int, tuple[str, list[str]]] = {}
        self.sources: dict[str, tuple[str, Span]] = {}  # an expr's node -> its piece

    def new_key(self) -> int:
        self.keys += 1
        return self.keys - 1

    def graph(self, nodes: Sequence[NodeLike], scope: _Scope, ordered: bool = True) -> list[_Node]:
        """The level's nodes in a topological order (`_topological`'s), linked; errors
        reported. Not `ordered`: in the client's order, for `_run_order` to order (the
        request's level, whose order only `_run_order` reads; a level where every node
        reads only nodes before it has no cycle, and needs no topological order)."""
        errors = self.errors
        kept = self._check_ids(nodes, scope)
        raw, aliases = self._expand(kept, scope)
        self.expanded += len(raw)
        if self.expanded > self.limits.max_nodes:
            errors.add(
                GraphError(
                    f"the graph expands to {self.expanded} op nodes; the limit is "
                    f"{self.limits.max_nodes} (a loop's body counts once)",
                    loc=("graph", "nodes"),
                )
            )
        errors.raise_if_any()
        names, key = scope.names, self.keys
        for node, _, _ in raw:
            names[node.id] = key
            key += 1
        self.keys = key
        for _, node in kept:
            if node.op in _BODIED and node.results is not None:
                self.loops[scope.names[node.id]] = (node.op, list(node.results))
                for result in node.results:
                    scope.names[result] = self.new_key()
        self._resolve_aliases(aliases, scope)
        bound, in_order = self._bind(raw, scope)
        errors.raise_if_any()
        if ordered:
            return _topological(bound, errors)
        if in_order:
            _link(bound)
        else:
            _topological(bound, errors)  # (a cycle is reported here)
        return bound

    def ref(
        self,
        name: str,
        scope: _Scope,
        loc: tuple[str | int, ...],
        origin: str,
        op: str | None = None,
    ) -> int | None:
        """The key of a reference, or None with the error reported."""
        key = scope.find(name)
        if key is None:
            self.errors.add(
                GraphError(
                    f"unknown reference {quoted(name)}{did_you_mean(name, scope.visible())}",
                    node=origin,
                    op=op,
                    loc=loc,
                )
            )
        elif key in self.loops:
            kind, ids = self.loops[key]
            results = ", ".join(quoted(r) for r in ids) or "none"
            self.errors.add(
                GraphError(
                    f"{quoted(name)} is a {kind} node, not a value: use its results ({results})",
                    node=origin,
                    op=op,
                    loc=loc,
                )
            )
            return None
        return key

    def _check_ids(self, nodes: Sequence[NodeLike], scope: _Scope) -> list[tuple[int, NodeLike]]:
        """Unique, non-empty ids that no other name of the level or an enclosing one has;
        returns (index, node) pairs to keep."""
        errors = self.errors
        names, parent = scope.names, scope.parent
        seen: set[str] = set()
        kept = []
        for index, node in enumerate(nodes):
            nid = node.id
            if not isinstance(nid, str) or not nid:
                errors.add(
                    GraphError(
                        "node id must be a non-empty string", loc=scope.node_loc(index, "id")
                    )
                )
                continue
            if nid in seen or nid in names or (parent is not None and parent.find(nid) is not None):
                clash = self._clash(nid, seen, scope)
                text = (
                    f"duplicate node id {quoted(nid)}"
                    if nid in seen
                    else f"node id {quoted(nid)} {clash}"
                )
                errors.add(GraphError(text, node=nid, loc=scope.node_loc(index, "id")))
                continue
            seen.add(nid)
            if node.op in _BODIED and node.results is not None:
                for result in node.results:
                    clash = self._clash(result, seen, scope)
                    if clash:
                        errors.add(
                            GraphError(
                                f"result id {quoted(result)} {clash}",
                                node=nid,
                                loc=scope.node_loc(index, "results", result),
                            )
                        )
                    seen.add(result)
            kept.append((index, node))
        return kept

    @staticmethod
    def _clash(name: str, seen: set[str], scope: _Scope) -> str:
        if name in seen:
            return "is used twice"
        if name in scope.names:
            return (
                "is also the name of an input"
                if scope.parent is None
                else "is also a carry or sequence name of this body"
            )
        if scope.outer(name):
            return "is also a name of the enclosing graph (names are never shadowed)"
        return ""

    def _expand(
        self,
        nodes: list[tuple[int, NodeLike]],
        scope: _Scope,
    ) -> tuple[list[tuple[NodeLike, str, int]], dict[str, tuple[str, int]]]:
        """Op-form nodes (node, client id, client index), and aliases (`expr` that is a
        name)."""
        limits, errors = self.limits, self.errors
        taken = {node.id for _, node in nodes}
        raw: list[tuple[NodeLike, str, int]] = []
        aliases: dict[str, tuple[str, int]] = {}
        for index, node in nodes:
            if (node.op is None) == (node.expr is None):
                errors.add(
                    GraphError(
                        "a node needs exactly one of 'op' or 'expr'",
                        node=node.id,
                        loc=scope.node_loc(index),
                    )
                )
                continue
            if node.op is not None:
                raw.append((node, node.id, index))
                continue
            counter = 0

            def new_id(origin: str = node.id) -> str:
                nonlocal counter
                while True:  # generated ids never collide with the client's ids or inputs
                    counter += 1
                    candidate = f"{origin}#{counter}"
                    if candidate not in taken and scope.find(candidate) is None:
                        taken.add(candidate)
                        return candidate

            try:
                expansion = expand_expr(
                    node.id,
                    node.expr or "",
                    new_id=new_id,
                    max_chars=limits.expr_max_chars,
                    max_depth=limits.expr_max_depth,
                )
            except GradserveError as err:
                err.loc = scope.node_loc(index, *(err.loc or ()))
                errors.add(err)
                continue
            if expansion.alias is not None:
                aliases[node.id] = (expansion.alias, index)
            raw.extend((sub, node.id, index) for sub in expansion.nodes)
            for sub_id, span in expansion.spans.items():
                self.sources[sub_id] = (node.expr or "", span)
        return raw, aliases

    def _resolve_aliases(self, aliases: dict[str, tuple[str, int]], scope: _Scope) -> None:
        """Each alias's final key, following chains of aliases, into the scope; reports
        unknowns and cycles."""
        errors = self.errors
        resolved: dict[str, int] = {}
        broken: set[str] = set()  # on a reported cycle: reported once, not once per member
        for start, (_, index) in aliases.items():
            if start in broken:
                continue
            chain = [start]
            name = start
            while name in aliases and name not in resolved:
                name = aliases[name][0]
                if name in chain or name in broken:
                    if name in chain:
                        cycle = " -> ".join([*chain[chain.index(name) :], name])
                        errors.add(
                            GraphError(
                                f"cycle: {cycle}", node=start, loc=scope.node_loc(index, "expr")
                            )
                        )
                    broken.update(chain)
                    break
                chain.append(name)
            else:
                if name in resolved:
                    target: int | None = resolved[name]
                else:
                    target = self.ref(name, scope, scope.node_loc(index, "expr"), start)
                if target is None:
                    continue
                for link in chain:
                    if link in aliases:
                        resolved[link] = target
        scope.names.update(resolved)

    def _bind(
        self, raw: list[tuple[NodeLike, str, int]], scope: _Scope
    ) -> tuple[list[_Node], bool]:
        """Resolve ops, references, arity and attributes (and loop bodies); and whether
        every node reads only values made before it (keys are numbered in order)."""
        errors = self.errors
        names, loops, sources, where = scope.names, self.loops, self.sources, scope.loc
        steps = []
        in_order = True
        for node, origin, index in raw:
            op: OpDef | Transform | None = None
            if isinstance(node.op, str):
                op = OPS.get(node.op) or TRANSFORMS.get(node.op)
            if op is None:
                hint = did_you_mean(node.op, [*OPS, *TRANSFORMS])
                errors.add(
                    UnknownOpError(
                        f"unknown op {quoted(str(node.op))}{hint} (see GET /ops)",
                        node=origin,
                        loc=scope.node_loc(index, "op"),
                    )
                )
                continue
            args: list[int | Lit] = []
            reads: list[int] = []
            ok = True
            own = names[node.id]
            node_args = node.args or ()  # (a graph's node may leave them out: None)
            for j, arg in enumerate(node_args):
                if type(arg) is str or isinstance(arg, str):
                    key = names.get(arg)  # (a name of this level that is a value: the most)
                    if key is None or key in loops:
                        key = self.ref(
                            arg, scope, scope.node_loc(index, "args", j), origin, op.name
                        )
                        if key is None:
                            ok = False
                            continue
                    args.append(key)
                    reads.append(key)
                    if key >= own:
                        in_order = False
                elif type(arg) is int and not INT64_MIN <= arg <= INT64_MAX:
                    errors.add(
                        DTypeError(
                            f"integer literal {arg} is outside the int64 range",
                            node=origin,
                            op=op.name,
                            loc=scope.node_loc(index, "args", j),
                        )
                    )
                    ok = False
                elif isinstance(arg, _NUMBER):
                    args.append(Lit(arg))
                else:
                    errors.add(
                        GraphError(
                            f"argument {j} must be a node id, an input name or a number, "
                            f"got {arg!r}",
                            node=origin,
                            op=op.name,
                            loc=scope.node_loc(index, "args", j),
                        )
                    )
                    ok = False
            try:
                given = node.attrs
                if type(op) is OpDef and not op.variadic and len(node_args) == len(op.args):
                    # (what check_arity accepts, and bind_attrs gives for no attributes)
                    attrs = (
                        op.defaults
                        if not given and len(op.defaults) == len(op.attrs)
                        else op.bind_attrs(dict(given) if given else {})
                    )
                else:
                    op.check_arity(len(node_args))
                    attrs = op.bind_attrs(dict(given) if given else {})
            except GradserveError as err:
                err.at(node=origin, op=op.name)
                err.loc = scope.node_loc(index, *(err.loc or ("args",)))
                errors.add(err)
                continue
            loop = None
            writes = [own]
            if op is SCAN_NODE or op is VMAP_NODE:
                resolve = self._loop if op is SCAN_NODE else self._map
                loop = resolve(node, scope.node_loc(index), scope)
                ok = ok and loop is not None
                if loop is not None:
                    reads += loop.closures
                    writes += loop.result_keys
                    in_order = False  # (its results are numbered after the level's nodes)
            if ok:
                steps.append(
                    _Node(
                        node.id,
                        origin,
                        where,
                        index,
                        own,
                        op,
                        args,
                        attrs,
                        loop,
                        sources.get(node.id) if sources else None,
                        reads,
                        writes,
                    )
                )
        return steps, in_order

    def _body_scope(
        self,
        node: NodeLike,
        loc: tuple[str | int, ...],
        scope: _Scope,
        fields: dict[str, Sequence[str]],
    ) -> _Scope | None:
        """A scan or vmap body's scope with the names its `fields` declare (a scan's carry
        and xs, a vmap's in), each checked against the names it would shadow; None with
        the errors reported."""
        errors = self.errors
        inner = _Scope(scope, (*loc, "body", "nodes"))
        reported = len(errors.items)
        for field_name, names in fields.items():
            for j, name in enumerate(names):
                clash = (
                    self._clash(name, set(), inner)
                    if isinstance(name, str) and name
                    else "must be a non-empty string"
                )
                if clash:
                    errors.add(
                        GraphError(
                            f"{field_name} name {quoted(str(name))} {clash}",
                            node=node.id,
                            loc=(*loc, "body", field_name, j),
                        )
                    )
                    continue
                inner.names[name] = self.new_key()
        return inner if len(errors.items) == reported else None

    def _map(self, node: NodeLike, loc: tuple[str | int, ...], scope: _Scope) -> _MapGraph | None:
        """A vmap node's body, resolved in a scope of its own."""
        errors = self.errors
        results = node.results
        if node.body is None or results is None:
            errors.add(GraphError("a vmap node needs 'body' and 'results'", node=node.id, loc=loc))
            return None
        if not hasattr(node.body, "in_"):
            errors.add(
                GraphError(
                    "a vmap body has 'in' and 'nodes' ('carry', 'xs' and 'next' are a scan body's)",
                    node=node.id,
                    loc=(*loc, "body"),
                )
            )
            return None
        body = cast(MapBodyLike, node.body)
        if scope.depth >= self.limits.max_loop_depth:
            errors.add(
                GraphError(
                    f"bodies are nested more than {self.limits.max_loop_depth} deep",
                    node=node.id,
                    loc=(*loc, "body"),
                )
            )
            return None
        if len(node.args or ()) != len(body.in_):
            errors.add(
                ArityError(
                    f"takes {len(body.in_)} arguments (one per name of body.in), got "
                    f"{len(node.args or ())}",
                    node=node.id,
                    op="vmap",
                    loc=(*loc, "args"),
                )
            )
            return None
        if not results:
            errors.add(
                GraphError(
                    "a vmap node must declare at least one result",
                    node=node.id,
                    loc=(*loc, "results"),
                )
            )
            return None
        inner = self._body_scope(node, loc, scope, {"in": body.in_})
        if inner is None:
            return None
        reported = len(errors.items)
        ins = [inner.names[n] for n in body.in_]
        errors.within.append(f"vmap {quoted(node.id)}")
        try:
            nodes = self.graph(body.nodes, inner)
        finally:
            errors.within.pop()
        out = _map_results(self, node, loc, scope, inner)
        if len(errors.items) > reported:
            return None
        locals_ = {*ins, *(k for n in nodes for k in n.writes)}
        used = [k for r in out for k in (r.of, *r.norm_of)]
        closures = [k for n in nodes for k in n.reads if k not in locals_]
        closures += [k for k in used if k not in locals_]
        return _MapGraph(
            ins=ins,
            nodes=_run_order(nodes, used),
            closures=list(dict.fromkeys(closures)),
            results=out,
        )

    def _loop(self, node: NodeLike, loc: tuple[str | int, ...], scope: _Scope) -> _LoopGraph | None:
        """A scan node's body, resolved in a scope of its own."""
        errors = self.errors
        results = node.results
        if node.body is None or results is None:
            errors.add(GraphError("a scan node needs 'body' and 'results'", node=node.id, loc=loc))
            return None
        if hasattr(node.body, "in_"):
            errors.add(
                GraphError(
                    "a scan body has 'carry', 'next' and optionally 'xs' and 'nodes' ('in' is "
                    "a vmap body's)",
                    node=node.id,
                    loc=(*loc, "body"),
                )
            )
            return None
        body = cast(BodyLike, node.body)
        if scope.depth >= self.limits.max_loop_depth:
            errors.add(
                GraphError(
                    f"scans are nested more than {self.limits.max_loop_depth} deep",
                    node=node.id,
                    loc=(*loc, "body"),
                )
            )
            return None
        want = len(body.carry) + len(body.xs)
        if len(node.args or ()) != want:
            errors.add(
                ArityError(
                    f"takes {want} arguments (the initial values of {len(body.carry)} carries, "
                    f"then {len(body.xs)} sequences, as body.carry and body.xs list them), got "
                    f"{len(node.args or ())}",
                    node=node.id,
                    op="scan",
                    loc=(*loc, "args"),
                )
            )
            return None
        inner = self._body_scope(node, loc, scope, {"carry": body.carry, "xs": body.xs})
        if inner is None:
            return None
        reported = len(errors.items)
        carries = [inner.names[n] for n in body.carry]
        xs = [inner.names[n] for n in body.xs]
        errors.within.append(f"scan {quoted(node.id)}")
        try:
            nodes = self.graph(body.nodes, inner)
        finally:
            errors.within.pop()
        nexts: list[tuple[int, tuple[str | int, ...]]] = []
        for name in body.next:
            if name not in body.carry:
                errors.add(
                    GraphError(
                        f"body.next names {quoted(name)}, which is not a carry",
                        node=node.id,
                        loc=(*loc, "body", "next", name),
                    )
                )
        for name in body.carry:
            where = (*loc, "body", "next", name)
            if name not in body.next:
                errors.add(
                    GraphError(
                        f"body.next gives no next value for the carry {quoted(name)}",
                        node=node.id,
                        loc=where,
                    )
                )
                continue
            key = self.ref(body.next[name], inner, where, node.id)
            if key is not None:
                nexts.append((key, where))
        # The values made in this body (an alias may name an outer value: that is a closure).
        locals_ = {*carries, *xs, *(k for n in nodes for k in n.writes)}
        out: list[tuple[int, int]] = []
        for result, value in results.items():
            where = (*loc, "results", result)
            if value in body.carry:
                out.append((scope.names[result], body.carry.index(value)))
            elif value in inner.names and value not in body.xs:
                out.append((scope.names[result], -1 - inner.names[value]))
            else:
                errors.add(
                    GraphError(
                        f"results[{quoted(result)}] is {quoted(str(value))}, which is neither a "
                        "carry nor a node of the body",
                        node=node.id,
                        loc=where,
                    )
                )
        if not results:
            errors.add(
                GraphError(
                    "a scan node must declare at least one result",
                    node=node.id,
                    loc=(*loc, "results"),
                )
            )
        if len(errors.items) > reported:
            return None
        closures = [k for n in nodes for k in n.reads if k not in locals_]
        closures += [k for k, _ in nexts if k not in locals_]
        closures += [-1 - w for _, w in out if w < 0 and -1 - w not in locals_]
        return _LoopGraph(
            carries=carries,
            xs=xs,
            nodes=_run_order(nodes, [*(k for k, _ in nexts), *(-1 - w for _, w in out if w < 0)]),
            nexts=nexts,
            closures=list(dict.fromkeys(closures)),
            results=out,
        )


def _map_results(
    resolver: _Resolver, node: NodeLike, loc: tuple[str | int, ...], scope: _Scope, inner: _Scope
) -> list[_MapResult]:
    """A vmap node's results, resolved in its body's scope; errors reported."""
    errors = resolver.errors
    out: list[_MapResult] = []
    for result, value in (node.results or {}).items():
        where = (*loc, "results", result)
        if isinstance(value, str):
            of, reduce, max_norm, norm_of = value, None, None, None
        else:
            of, reduce, max_norm, norm_of = value.of, value.reduce, value.max_norm, value.norm_of
            if reduce not in _REDUCTIONS:
                errors.add(
                    GraphError(
                        f"reduce must be one of {', '.join(_REDUCTIONS)}, got {reduce!r}",
                        node=node.id,
                        loc=(*where, "reduce"),
                    )
                )
                continue
            if (reduce == "clip_sum") != (max_norm is not None):
                errors.add(
                    GraphError(
                        "max_norm is required by, and belongs to, reduce 'clip_sum'",
                        node=node.id,
                        loc=(*where, "max_norm"),
                    )
                )
                continue
            if norm_of is not None and reduce != "clip_sum":
                errors.add(
                    GraphError(
                        "norm_of belongs to reduce 'clip_sum'",
                        node=node.id,
                        loc=(*where, "norm_of"),
                    )
                )
                continue
            if max_norm is not None and not (
                isinstance(max_norm, int | float)
                and not isinstance(max_norm, bool)
                and math.isfinite(max_norm)
                and max_norm > 0
            ):
                errors.add(
                    GraphError(
                        f"max_norm must be a finite number > 0, got {max_norm!r}",
                        node=node.id,
                        loc=(*where, "max_norm"),
                    )
                )
                continue
        keys = []
        for j, name in enumerate([of, *(norm_of or ())]):
            here = (*where, "of") if j == 0 else (*where, "norm_of", j - 1)
            key = inner.names.get(name) if isinstance(name, str) else None
            if key is None:
                visible = [n for n in inner.names if "#" not in n]
                errors.add(
                    GraphError(
                        f"{'results[' + quoted(result) + ']' if j == 0 else 'norm_of'} names "
                        f"{quoted(str(name))}, which is not a node or an input of the body"
                        f"{did_you_mean(str(name), visible)}",
                        node=node.id,
                        loc=here if not isinstance(value, str) else where,
                    )
                )
                break
            keys.append(key)
        else:
            out.append(
                _MapResult(
                    scope.names[result],
                    keys[0],
                    reduce,
                    float(max_norm or 0.0),
                    keys[1:] if norm_of is not None else keys[:1],
                )
            )
    return out


def _link(steps: list[_Node]) -> None:
    """Each node's place in its level (`pos`) and the nodes that make what it reads
    (`deps`, one per read of a value of the level)."""
    by_key = {}
    for pos, step in enumerate(steps):
        step.pos = pos
        for key in step.writes:
            by_key[key] = step
    for step in steps:
        step.deps = [by_key[key] for key in step.reads if key in by_key]


def _topological(steps: list[_Node], errors: _Errors, linked: bool = False) -> list[_Node]:
    """Kahn's algorithm over one level's nodes (linked on the way, unless they are); on a
    cycle, report one with its whole path."""
    if not linked:
        _link(steps)
    indegree = [0] * len(steps)
    consumers: list[list[_Node]] = [[] for _ in steps]
    for step in steps:
        deps = step.deps
        if deps:
            indegree[step.pos] = len(deps)
            for dep in deps:
                consumers[dep.pos].append(step)
    ready = [s for s in steps if not indegree[s.pos]]
    order: list[_Node] = []
    while ready:
        step = ready.pop()
        order.append(step)
        for consumer in consumers[step.pos]:
            indegree[consumer.pos] -= 1
            if not indegree[consumer.pos]:
                ready.append(consumer)
    if len(order) < len(steps):
        stuck = next(s for s in steps if indegree[s.pos] > 0)
        path: list[_Node] = []
        on_path: dict[int, int] = {}
        node = stuck
        while node.pos not in on_path:  # walk unfinished producers until one repeats
            on_path[node.pos] = len(path)
            path.append(node)
            node = next(dep for dep in node.deps if indegree[dep.pos] > 0)
        cycle = path[on_path[node.pos] :]
        names = [s.origin for s in reversed(cycle)]
        names = [n for k, n in enumerate(names) if k == 0 or n != names[k - 1]]
        text = " -> ".join([*names, names[0]]) if len(names) > 1 else f"{names[0]} -> {names[0]}"
        errors.add(GraphError(f"cycle: {text}", node=cycle[-1].origin, loc=cycle[-1].loc))
        errors.raise_if_any()
    return order


def _outputs(
    names: Any, scope: _Scope, resolver: _Resolver, errors: _Errors
) -> list[tuple[str, int]]:
    if not names:
        errors.add(
            GraphError(
                "graph.outputs must name at least one node or input", loc=("graph", "outputs")
            )
        )
    out: dict[str, int] = {}
    for k, name in enumerate(names):
        loc = ("graph", "outputs", k)
        if isinstance(name, str) and name in resolver.loops.keys() | set():
            pass
        key = scope.find(name) if isinstance(name, str) else None
        if key is None:
            errors.add(
                GraphError(
                    f"output {quoted(name)} is not a node id or an input name",
                    node=name if isinstance(name, str) else None,
                    loc=loc,
                )
            )
            continue
        if resolver.ref(name, scope, loc, name) is None:
            continue
        out[name] = key
    return list(out.items())


def _run_order(graph: list[_Node], roots: list[int], ordered: bool = True) -> list[_Node]:
    """The order steps are emitted, hence run: depth-first post-order from the roots (the
    outputs), so that each value is computed close to its use and few are alive at once;
    then, for validation only, the nodes no root needs (planning drops them), in
    `_topological`'s order. `graph` is a level as `_Resolver.graph` gives it (`ordered`
    or not)."""
    wanted = set(roots)
    by_key = {k: n for n in graph for k in n.writes if k in wanted}
    order: list[_Node] = []
    done = [False] * len(graph)  # by pos: the nodes emitted
    for root in roots:
        if root not in by_key:
            continue
        stack: list[tuple[_Node, int]] = [(by_key[root], 0)]
        while stack:
            node, k = stack.pop()
            if done[node.pos]:
                continue
            refs = node.deps
            while k < len(refs) and done[refs[k].pos]:
                k += 1
            if k < len(refs):
                stack.append((node, k + 1))
                stack.append((refs[k], 0))
                continue
            done[node.pos] = True
            order.append(node)
    if len(order) < len(graph):
        rest = graph if ordered else _topological(graph, _Errors(1), linked=True)  # (acyclic)
        order.extend(n for n in rest if not done[n.pos])
    return order


def _check_backward(
    program: Program,
    inputs: Mapping[str, TensorSpec],
    grad_outputs: Mapping[str, TensorSpec],
    errors: _Errors,
) -> list[str]:
    """The outputs the backward starts from; reports what /backward cannot do."""
    if not any(t.requires_grad for t in inputs.values()):
        errors.add(
            BackwardError(
                "nothing to differentiate: no input has requires_grad: true", loc=("inputs",)
            )
        )
        return []
    names = dict(program.outputs)
    for name, tspec in grad_outputs.items():
        if name not in names:
            errors.add(
                BackwardError(
                    f"grad_outputs names {quoted(name)}, which is not an output",
                    node=name,
                    loc=("grad_outputs", name),
                )
            )
            continue
        meta = program.metas[names[name]]
        if tuple(tspec.shape) != meta.shape:
            errors.add(
                BackwardError(
                    f"grad_outputs[{quoted(name)}] has shape {fmt(tspec.shape)} but the output "
                    f"has shape {fmt(meta.shape)}",
                    node=name,
                    loc=("grad_outputs", name),
                )
            )
    roots = []
    for name, slot in program.outputs:
        if not program.requires_grad[slot]:
            continue  # returned, but adds nothing to the gradients
        meta = program.metas[slot]
        if name not in grad_outputs and numel(meta.shape) != 1:
            errors.add(
                BackwardError(
                    f"output {quoted(name)} has shape {fmt(meta.shape)}: only a one-element output "
                    f"gets the implicit gradient 1; give grad_outputs[{quoted(name)}]",
                    node=name,
                    loc=("grad_outputs", name),
                )
            )
            continue
        roots.append(name)
    if not roots and not errors.items:
        errors.add(
            BackwardError(
                "no output depends on an input with requires_grad: true; nothing to differentiate",
                loc=("graph", "outputs"),
            )
        )
    return roots
