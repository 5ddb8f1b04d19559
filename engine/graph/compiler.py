"""From a GraphSpec to a Program: validate everything, infer shapes, derive the backward,
plan memory and cost, and bind kernels, before any tensor is allocated.

Nothing here recurses on graph depth. Errors are collected (up to `Limits.max_errors`),
each naming its node and field, and raised together. The forward is emitted through the
same namespace the VJPs use (`engine.graph.builder`), so shape rules, promotion and the
backward's steps all come from the op registry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.dtypes import FLOATS
from engine.errors import (
    BackwardError,
    ComputeBudgetError,
    DTypeError,
    GradserveError,
    GraphError,
    MemoryBudgetError,
    UnknownOpError,
    ValidationErrors,
    quoted,
)
from engine.graph.autodiff import active_slots, vjp
from engine.graph.builder import Builder, Sym, derived
from engine.graph.executor import bind
from engine.graph.expr import expand_expr
from engine.graph.ir import BYTE_COST, NODE, Program
from engine.graph.plan import plan
from engine.graph.spec import GraphSpec, Limits, NodeSpec, TensorSpec
from engine.ops import OPS
from engine.ops.registry import INT64_MAX, INT64_MIN, Meta, OpDef
from engine.shapes import fmt, numel

_NUMBER = (bool, int, float)


class _Errors:
    def __init__(self, limit: int) -> None:
        self.items: list[GradserveError] = []
        self.limit = limit

    def add(self, err: GradserveError) -> None:
        self.items.append(err)
        if len(self.items) >= self.limit:
            raise ValidationErrors(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise ValidationErrors(self.items)


@dataclass(slots=True, eq=False)
class _Node:
    """One op node of the client's graph (after `expr` expansion), resolved."""

    id: str  # the node id (generated for the inner nodes of an `expr`)
    origin: str  # the client's node id, for error messages
    index: int  # position of the client's node in `graph.nodes`, for error locations
    key: int  # its value's number among the graph's values (inputs first)
    op: OpDef
    args: list[tuple[bool, Any]]  # (True, key) for a value, (False, number) for a literal
    attrs: dict[str, Any]


def _node_loc(index: int, *rest: str | int) -> tuple[str | int, ...]:
    return ("graph", "nodes", index, *rest)


def _loc_of(err: GradserveError, index: int) -> tuple[str | int, ...]:
    """An error's location inside the client's node (errors from expr point at the expr)."""
    return _node_loc(index, *(err.loc or ()))


def compile_graph(
    spec: GraphSpec,
    inputs: Mapping[str, TensorSpec],
    *,
    limits: Limits | None = None,
    no_grad: bool = False,
    backward: bool = False,
    grad_outputs: Mapping[str, TensorSpec] | None = None,
    device: str = "cpu",
) -> Program:
    """Validate, differentiate, plan and bind `spec` for `device`; raises ValidationErrors,
    MemoryBudgetError or ComputeBudgetError."""
    started = time.perf_counter()
    limits = limits or Limits()
    errors = _Errors(limits.max_errors)
    _check_sizes(spec, inputs, limits, errors)

    keys: dict[str, int] = {}
    for name, tspec in inputs.items():
        keys[name] = len(keys)
        if tspec.requires_grad and tspec.dtype not in FLOATS:
            errors.add(GradserveError(
                f"input {quoted(name)} has dtype {tspec.dtype}: only floating point tensors "
                "can require gradients", loc=("inputs", name, "requires_grad")))

    nodes = _check_ids(spec.nodes, keys, errors)
    raw, aliases = _expand(nodes, keys, limits, errors)
    if len(raw) > limits.max_nodes:
        errors.add(GraphError(
            f"the graph expands to {len(raw)} op nodes; the limit is {limits.max_nodes}",
            loc=("graph", "nodes")))
    errors.raise_if_any()

    for node, _, _ in raw:
        keys[node.id] = len(keys)
    resolved = _resolve_aliases(aliases, keys, nodes, errors)
    graph = _bind(raw, keys, resolved, errors)
    errors.raise_if_any()
    order = _topological(graph, len(keys), errors)
    named_outputs = _outputs(spec.outputs, keys, resolved, errors)
    errors.raise_if_any()

    b = Builder()
    syms: list[Sym | None] = [None] * len(keys)
    for name, tspec in inputs.items():
        syms[keys[name]] = b.value(Meta(tuple(tspec.shape), tspec.dtype))
    grad_syms = {name: b.value(Meta(tuple(t.shape), t.dtype))
                 for name, t in (grad_outputs or {}).items()}
    _emit(b, _run_order(graph, order, named_outputs), syms, errors)
    errors.raise_if_any()

    input_slots = {name: syms[keys[name]].slot for name in inputs}  # type: ignore[union-attr]
    outputs = [(name, syms[key].slot) for name, key in named_outputs]  # type: ignore[union-attr]
    wrt = [] if no_grad else [input_slots[n] for n, t in inputs.items() if t.requires_grad]
    active = active_slots(b, b.steps, wrt)
    requires_grad = [False] * len(b.metas)
    for slot in active:
        requires_grad[slot] = True
    if no_grad:  # the inputs keep their flag; nothing computed under no_grad has one
        for name, tspec in inputs.items():
            requires_grad[input_slots[name]] = bool(tspec.requires_grad)
    grad_fn: list[str | None] = [None] * len(b.metas)
    for step in b.steps:
        if step.kind == NODE and requires_grad[step.out]:
            grad_fn[step.out] = step.op.grad_fn_name

    program = Program(
        metas=b.metas, steps=b.steps, inputs=input_slots,
        grad_inputs={name: sym.slot for name, sym in grad_syms.items()},
        outputs=outputs, gradients=[], requires_grad=requires_grad, grad_fn=grad_fn,
        no_grad=no_grad, backward=backward,
    )
    if backward:
        roots = _check_backward(program, inputs, grad_outputs or {}, errors)
        errors.raise_if_any()
        _derive_backward(b, program, roots, grad_syms, inputs)
        program.steps = b.steps
    bound_on = _backend_ufuncs(device)
    plan(program, ufuncs=bound_on, record=not no_grad and not backward)
    _check_budgets(program, limits, no_grad)
    program.run = bind(program, device)
    program.plan_ms = (time.perf_counter() - started) * 1000
    return program


def assemble(b: Builder, inputs: Mapping[str, Sym], outputs: Mapping[str, Sym], *,
             device: str = "cpu") -> Program:
    """A program from steps emitted by hand on `b` (the engine's own tests and transforms):
    every step the outputs need runs, derived ones included."""
    program = Program(
        metas=b.metas, steps=b.steps, inputs={n: s.slot for n, s in inputs.items()},
        grad_inputs={}, outputs=[(n, s.slot) for n, s in outputs.items()], gradients=[],
        requires_grad=[False] * len(b.metas), grad_fn=[None] * len(b.metas),
        no_grad=False, backward=False,
    )
    plan(program, ufuncs=_backend_ufuncs(device))
    program.run = bind(program, device)
    return program


def _backend_ufuncs(device: str) -> bool:
    from engine.backends import get_backend

    return get_backend(device).ufuncs is not None


def _check_sizes(spec: GraphSpec, inputs: Mapping[str, TensorSpec], limits: Limits,
                 errors: _Errors) -> None:
    """The request's size limits, before any work that grows with them."""
    if len(spec.nodes) > limits.max_nodes:
        raise ValidationErrors([GraphError(
            f"the graph has {len(spec.nodes)} nodes; the limit is {limits.max_nodes}",
            loc=("graph", "nodes"))])
    if len(inputs) > limits.max_inputs:
        raise ValidationErrors([GraphError(
            f"the request has {len(inputs)} inputs; the limit is {limits.max_inputs}",
            loc=("inputs",))])
    for name in inputs:
        if len(name) > limits.max_id_chars:
            errors.add(GraphError(
                f"input name {quoted(name)} is longer than {limits.max_id_chars} characters",
                loc=("inputs", name[:limits.max_id_chars])))
    for index, node in enumerate(spec.nodes):
        if isinstance(node.id, str) and len(node.id) > limits.max_id_chars:
            errors.add(GraphError(
                f"node id {quoted(node.id)} is longer than {limits.max_id_chars} characters",
                node=node.id[:limits.max_id_chars], loc=_node_loc(index, "id")))
    errors.raise_if_any()


def _emit(b: Builder, order: list[_Node], syms: list[Sym | None], errors: _Errors) -> None:
    """Emit each node's step (shape and dtype inferred, promotion made explicit). A node
    downstream of a refused one is skipped: its error was already reported."""
    for node in order:
        args = []
        for is_ref, v in node.args:
            if is_ref:
                sym = syms[v]
                if sym is None:
                    break
                args.append(sym)
            else:
                args.append(v)
        else:
            b.origin = node.origin
            try:
                syms[node.key] = b.emit(node.op, args, node.attrs)
            except GradserveError as err:
                err.at(node=node.origin, op=node.op.name)
                err.loc = _node_loc(node.index)
                errors.add(err)
    b.origin = None


def _derive_backward(b: Builder, program: Program, roots: list[str],
                     grad_syms: Mapping[str, Sym], inputs: Mapping[str, TensorSpec]) -> None:
    """Append the backward: the gradient of every input that requires grad, from the roots'
    upstream gradients (given, cast to the output's dtype, or the implicit 1)."""
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
    grads = vjp(b, forward, cotangents, wrt)
    with derived(b, create_graph=False):
        for name, slot, grad in zip(names, wrt, grads, strict=True):
            if grad is None:  # an input the outputs do not depend on gets zeros
                meta = b.metas[slot]
                grad = b.call("zeros", shape=list(meta.shape), dtype=meta.dtype)
            program.gradients.append((name, grad.slot))


def _check_budgets(program: Program, limits: Limits, no_grad: bool) -> None:
    budget = limits.memory_budget_bytes
    if budget is not None and program.planned_peak_bytes > budget:
        path = "no_grad" if no_grad else "grad"
        raise MemoryBudgetError(
            f"the planned peak memory of this request is {program.planned_peak_bytes} bytes; "
            f"the {path} budget is {budget} bytes",
            planned_bytes=program.planned_peak_bytes, budget_bytes=budget)
    cost = program.compute_cost
    if limits.compute_budget is not None and cost > limits.compute_budget:
        node, worst = max(program.cost_by_node.items(), key=lambda kv: kv[1])
        raise ComputeBudgetError(
            f"the planned compute of this request is {cost:.3g} cost units (floating-point "
            f"operations plus {BYTE_COST} per byte moved, forward and backward); the budget is "
            f"{limits.compute_budget:.3g}. The most expensive node is {quoted(node)} "
            f"({worst:.3g})", cost=cost, budget=int(limits.compute_budget),
            node=None if node == "<graph>" else node)


def _check_ids(
    nodes: Any, inputs: Mapping[str, int], errors: _Errors
) -> list[tuple[int, NodeSpec]]:
    """Unique, non-empty ids that are not input names; returns (index, node) pairs to keep."""
    seen: set[str] = set()
    kept = []
    for index, node in enumerate(nodes):
        nid = node.id
        if not isinstance(nid, str) or not nid:
            errors.add(GraphError("node id must be a non-empty string", loc=_node_loc(index, "id")))
            continue
        if nid in seen:
            errors.add(GraphError(f"duplicate node id {quoted(nid)}", node=nid,
                                  loc=_node_loc(index, "id")))
            continue
        if nid in inputs:
            errors.add(GraphError(f"node id {quoted(nid)} is also the name of an input", node=nid,
                                  loc=_node_loc(index, "id")))
            continue
        seen.add(nid)
        kept.append((index, node))
    return kept


def _expand(
    nodes: list[tuple[int, NodeSpec]], inputs: Mapping[str, int], limits: Limits, errors: _Errors
) -> tuple[list[tuple[NodeSpec, str, int]], dict[str, tuple[str, int]]]:
    """Op-form nodes (node, client id, client index), and aliases (`expr` that is a name)."""
    taken = set(inputs) | {node.id for _, node in nodes}
    raw: list[tuple[NodeSpec, str, int]] = []
    aliases: dict[str, tuple[str, int]] = {}
    for index, node in nodes:
        if (node.op is None) == (node.expr is None):
            errors.add(GraphError("a node needs exactly one of 'op' or 'expr'", node=node.id,
                                  loc=_node_loc(index)))
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
                if candidate not in taken:
                    taken.add(candidate)
                    return candidate

        try:
            expansion = expand_expr(node.id, node.expr or "", new_id=new_id,
                                    max_chars=limits.expr_max_chars,
                                    max_depth=limits.expr_max_depth)
        except GradserveError as err:
            err.loc = _loc_of(err, index)
            errors.add(err)
            continue
        if expansion.alias is not None:
            aliases[node.id] = (expansion.alias, index)
        raw.extend((sub, node.id, index) for sub in expansion.nodes)
    return raw, aliases


def _resolve_aliases(
    aliases: dict[str, tuple[str, int]], slots: dict[str, int], nodes: Any, errors: _Errors
) -> dict[str, int]:
    """Each alias's final slot, following chains of aliases; reports unknowns and cycles."""
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
                    cycle = " -> ".join([*chain[chain.index(name):], name])
                    errors.add(GraphError(f"cycle: {cycle}", node=start,
                                          loc=_node_loc(index, "expr")))
                broken.update(chain)
                break
            chain.append(name)
        else:
            if name in resolved:
                target = resolved[name]
            elif name in slots:
                target = slots[name]
            else:
                errors.add(GraphError(f"unknown reference {quoted(name)}", node=start,
                                      loc=_node_loc(index, "expr")))
                continue
            for link in chain:
                if link in aliases:
                    resolved[link] = target
    return resolved


def _bind(
    raw: list[tuple[NodeSpec, str, int]],
    slots: dict[str, int],
    aliases: dict[str, int],
    errors: _Errors,
) -> list[_Node]:
    """Resolve ops, references, arity and attributes."""
    steps = []
    for node, origin, index in raw:
        op = OPS.get(node.op) if isinstance(node.op, str) else None
        if op is None:
            errors.add(UnknownOpError(f"unknown op {quoted(str(node.op))} (see GET /ops)",
                                      node=origin, loc=_node_loc(index, "op")))
            continue
        args: list[tuple[bool, Any]] = []
        ok = True
        for j, arg in enumerate(node.args):
            if isinstance(arg, str):
                slot = aliases.get(arg, slots.get(arg))
                if slot is None:
                    errors.add(GraphError(f"unknown reference {quoted(arg)}", node=origin,
                                          op=op.name, loc=_node_loc(index, "args", j)))
                    ok = False
                    continue
                args.append((True, slot))
            elif type(arg) is int and not INT64_MIN <= arg <= INT64_MAX:
                errors.add(DTypeError(f"integer literal {arg} is outside the int64 range",
                                      node=origin, op=op.name, loc=_node_loc(index, "args", j)))
                ok = False
            elif isinstance(arg, _NUMBER):
                args.append((False, arg))
            else:
                errors.add(GraphError(
                    f"argument {j} must be a node id, an input name or a number, got {arg!r}",
                    node=origin, op=op.name, loc=_node_loc(index, "args", j)))
                ok = False
        try:
            op.check_arity(len(node.args))
            attrs = op.bind_attrs(dict(node.attrs))
        except GradserveError as err:
            err.at(node=origin, op=op.name)
            err.loc = _node_loc(index, *(err.loc or ("args",)))
            errors.add(err)
            continue
        if ok:
            steps.append(_Node(node.id, origin, index, slots[node.id], op, args, attrs))
    return steps


def _topological(steps: list[_Node], nslots: int, errors: _Errors) -> list[_Node]:
    """Kahn's algorithm over all steps; on a cycle, report one with its whole path."""
    by_slot = {s.key: s for s in steps}
    indegree = {s.key: 0 for s in steps}
    consumers: dict[int, list[_Node]] = {}
    for step in steps:
        for is_ref, slot in step.args:
            if is_ref and slot in by_slot:
                indegree[step.key] += 1
                consumers.setdefault(slot, []).append(step)
    ready = [s for s in steps if indegree[s.key] == 0]
    order: list[_Node] = []
    while ready:
        step = ready.pop()
        order.append(step)
        for consumer in consumers.get(step.key, ()):
            indegree[consumer.key] -= 1
            if indegree[consumer.key] == 0:
                ready.append(consumer)
    if len(order) < len(steps):
        stuck = next(s for s in steps if indegree[s.key] > 0)
        path: list[_Node] = []
        on_path: dict[int, int] = {}
        node = stuck
        while node.key not in on_path:  # walk unfinished producers until one repeats
            on_path[node.key] = len(path)
            path.append(node)
            node = next(by_slot[slot] for is_ref, slot in node.args
                        if is_ref and slot in by_slot and indegree[slot] > 0)
        cycle = path[on_path[node.key]:]
        names = [s.origin for s in reversed(cycle)]
        names = [n for k, n in enumerate(names) if k == 0 or n != names[k - 1]]
        text = " -> ".join([*names, names[0]]) if len(names) > 1 else f"{names[0]} -> {names[0]}"
        errors.add(GraphError(f"cycle: {text}", node=cycle[-1].origin,
                              loc=_node_loc(cycle[-1].index)))
        errors.raise_if_any()
    return order


def _outputs(names: Any, slots: dict[str, int], aliases: dict[str, int],
             errors: _Errors) -> list[tuple[str, int]]:
    if not names:
        errors.add(GraphError("graph.outputs must name at least one node or input",
                              loc=("graph", "outputs")))
    out: dict[str, int] = {}
    for k, name in enumerate(names):
        slot = aliases.get(name, slots.get(name)) if isinstance(name, str) else None
        if slot is None:
            errors.add(GraphError(f"output {quoted(name)} is not a node id or an input name",
                                  node=name if isinstance(name, str) else None,
                                  loc=("graph", "outputs", k)))
            continue
        out[name] = slot
    return list(out.items())




def _run_order(graph: list[_Node], topo: list[_Node],
               outputs: list[tuple[str, int]]) -> list[_Node]:
    """The order steps are emitted, hence run: depth-first post-order from the outputs, so
    that each value is computed close to its use and few are alive at once; then, for
    validation only, the nodes no output needs (planning drops them)."""
    by_key = {n.key: n for n in graph}
    order: list[_Node] = []
    done: set[int] = set()
    for _, root in outputs:
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            key, k = stack.pop()
            if key in done or key not in by_key:
                continue
            node = by_key[key]
            refs = [v for is_ref, v in node.args if is_ref]
            while k < len(refs) and (refs[k] in done or refs[k] not in by_key):
                k += 1
            if k < len(refs):
                stack.append((key, k + 1))
                stack.append((refs[k], 0))
                continue
            done.add(key)
            order.append(node)
    order.extend(n for n in topo if n.key not in done)
    return order


def _check_backward(program: Program, inputs: Mapping[str, TensorSpec],
                    grad_outputs: Mapping[str, TensorSpec], errors: _Errors) -> list[str]:
    """The outputs the backward starts from; reports what /backward cannot do."""
    if not any(t.requires_grad for t in inputs.values()):
        errors.add(BackwardError("nothing to differentiate: no input has requires_grad: true",
                                 loc=("inputs",)))
        return []
    names = dict(program.outputs)
    for name, tspec in grad_outputs.items():
        if name not in names:
            errors.add(BackwardError(f"grad_outputs names {quoted(name)}, which is not an "
                                     "output", node=name, loc=("grad_outputs", name)))
            continue
        meta = program.metas[names[name]]
        if tuple(tspec.shape) != meta.shape:
            errors.add(BackwardError(
                f"grad_outputs[{quoted(name)}] has shape {fmt(tspec.shape)} but the output "
                f"has shape {fmt(meta.shape)}", node=name, loc=("grad_outputs", name)))
    roots = []
    for name, slot in program.outputs:
        if not program.requires_grad[slot]:
            continue  # returned, but adds nothing to the gradients
        meta = program.metas[slot]
        if name not in grad_outputs and numel(meta.shape) != 1:
            errors.add(BackwardError(
                f"output {quoted(name)} has shape {fmt(meta.shape)}: only a one-element output "
                f"gets the implicit gradient 1; give grad_outputs[{quoted(name)}]",
                node=name, loc=("grad_outputs", name)))
            continue
        roots.append(name)
    if not roots and not errors.items:
        errors.add(BackwardError(
            "no output depends on an input with requires_grad: true; nothing to differentiate",
            loc=("graph", "outputs")))
    return roots
