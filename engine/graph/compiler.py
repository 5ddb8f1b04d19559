"""From a GraphSpec to a Program: validate everything, infer shapes, order, plan memory.

Nothing here allocates a tensor or recurses on graph depth. Errors are collected
(up to `Limits.max_errors`), each naming its node and field, and raised together.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from engine.dtypes import FLOATS
from engine.errors import (
    BackwardError,
    DTypeError,
    GradserveError,
    GraphError,
    MemoryBudgetError,
    UnknownOpError,
    ValidationErrors,
)
from engine.graph.expr import expand_expr
from engine.graph.plan import plan_peak_bytes
from engine.graph.program import Program, Step
from engine.graph.spec import GraphSpec, Limits, NodeSpec, TensorSpec
from engine.ops import OPS
from engine.ops.registry import INT64_MAX, INT64_MIN, Meta, literal_meta
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
) -> Program:
    """Validate and plan `spec`; raises ValidationErrors or MemoryBudgetError."""
    started = time.perf_counter()
    limits = limits or Limits()
    errors = _Errors(limits.max_errors)
    if len(spec.nodes) > limits.max_nodes:
        raise ValidationErrors([GraphError(
            f"the graph has {len(spec.nodes)} nodes; the limit is {limits.max_nodes}",
            loc=("graph", "nodes"))])

    slots: dict[str, int] = {}
    metas: list[Meta | None] = []
    requires_grad: list[bool] = []
    for name, tspec in inputs.items():
        slots[name] = len(metas)
        metas.append(Meta(tuple(tspec.shape), tspec.dtype))
        requires_grad.append(bool(tspec.requires_grad) and not no_grad)
        if tspec.requires_grad and tspec.dtype not in FLOATS:
            errors.add(GradserveError(
                f"input {name!r} has dtype {tspec.dtype}: only floating point tensors can "
                "require gradients", loc=("inputs", name, "requires_grad")))

    nodes = _check_ids(spec.nodes, slots, errors)
    raw, aliases = _expand(nodes, slots, limits, errors)
    if len(raw) > limits.max_nodes:
        errors.add(GraphError(
            f"the graph expands to {len(raw)} op nodes; the limit is {limits.max_nodes}",
            loc=("graph", "nodes")))
    errors.raise_if_any()

    for node, _, _ in raw:
        slots[node.id] = len(metas)
        metas.append(None)
        requires_grad.append(False)
    resolved = _resolve_aliases(aliases, slots, nodes, errors)
    steps = _bind(raw, slots, resolved, errors)
    errors.raise_if_any()

    order = _topological(steps, len(metas), errors)
    _infer(order, metas, requires_grad, no_grad, errors)
    outputs = _outputs(spec.outputs, slots, resolved, errors)
    errors.raise_if_any()

    program = Program(
        steps=_execution_order(steps, outputs, len(inputs)),
        input_slots={name: slots[name] for name in inputs},
        outputs=outputs,
        metas=metas,
        requires_grad=requires_grad,
        no_grad=no_grad,
        backward=backward,
    )
    if backward:
        _check_backward(program, inputs, grad_outputs or {}, errors)
        errors.raise_if_any()
    program.planned_peak_bytes = plan_peak_bytes(program)
    budget = limits.memory_budget_bytes
    if budget is not None and program.planned_peak_bytes > budget:
        path = "no_grad" if no_grad else "grad"
        raise MemoryBudgetError(
            f"the planned peak memory of this request is {program.planned_peak_bytes} bytes; "
            f"the {path} budget is {budget} bytes",
            planned_bytes=program.planned_peak_bytes, budget_bytes=budget)
    program.plan_ms = (time.perf_counter() - started) * 1000
    return program


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
            errors.add(GraphError(f"duplicate node id {nid!r}", node=nid,
                                  loc=_node_loc(index, "id")))
            continue
        if nid in inputs:
            errors.add(GraphError(f"node id {nid!r} is also the name of an input", node=nid,
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
                errors.add(GraphError(f"unknown reference {name!r}", node=start,
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
) -> list[Step]:
    """Resolve ops, references, arity and attributes."""
    steps = []
    for node, origin, index in raw:
        op = OPS.get(node.op) if isinstance(node.op, str) else None
        if op is None:
            errors.add(UnknownOpError(f"unknown op {node.op!r} (see GET /ops)", node=origin,
                                      loc=_node_loc(index, "op")))
            continue
        args: list[tuple[bool, Any]] = []
        ok = True
        for j, arg in enumerate(node.args):
            if isinstance(arg, str):
                slot = aliases.get(arg, slots.get(arg))
                if slot is None:
                    errors.add(GraphError(f"unknown reference {arg!r}", node=origin, op=op.name,
                                          loc=_node_loc(index, "args", j)))
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
            steps.append(Step(node.id, origin, index, slots[node.id], op, args, attrs))
    return steps


def _topological(steps: list[Step], nslots: int, errors: _Errors) -> list[Step]:
    """Kahn's algorithm over all steps; on a cycle, report one with its whole path."""
    by_slot = {s.slot: s for s in steps}
    indegree = {s.slot: 0 for s in steps}
    consumers: dict[int, list[Step]] = {}
    for step in steps:
        for is_ref, slot in step.args:
            if is_ref and slot in by_slot:
                indegree[step.slot] += 1
                consumers.setdefault(slot, []).append(step)
    ready = [s for s in steps if indegree[s.slot] == 0]
    order: list[Step] = []
    while ready:
        step = ready.pop()
        order.append(step)
        for consumer in consumers.get(step.slot, ()):
            indegree[consumer.slot] -= 1
            if indegree[consumer.slot] == 0:
                ready.append(consumer)
    if len(order) < len(steps):
        stuck = next(s for s in steps if indegree[s.slot] > 0)
        path: list[Step] = []
        on_path: dict[int, int] = {}
        node = stuck
        while node.slot not in on_path:  # walk unfinished producers until one repeats
            on_path[node.slot] = len(path)
            path.append(node)
            node = next(by_slot[slot] for is_ref, slot in node.args
                        if is_ref and slot in by_slot and indegree[slot] > 0)
        cycle = path[on_path[node.slot]:]
        names = [s.origin for s in reversed(cycle)]
        names = [n for k, n in enumerate(names) if k == 0 or n != names[k - 1]]
        text = " -> ".join([*names, names[0]]) if len(names) > 1 else f"{names[0]} -> {names[0]}"
        errors.add(GraphError(f"cycle: {text}", node=cycle[-1].origin,
                              loc=_node_loc(cycle[-1].index)))
        errors.raise_if_any()
    return order


def _infer(order: list[Step], metas: list[Meta | None], requires_grad: list[bool],
           no_grad: bool, errors: _Errors) -> None:
    """Static shapes and dtypes, and which values will require grad."""
    for step in order:
        arg_metas = [metas[v] if is_ref else literal_meta(v) for is_ref, v in step.args]
        if None in arg_metas:
            continue  # an upstream error was already reported
        op = step.op
        try:
            out = op.infer(arg_metas, **step.attrs)
        except GradserveError as err:
            err.at(node=step.origin, op=op.name)
            err.loc = _node_loc(step.index)
            errors.add(err)
            continue
        metas[step.slot] = step.meta = out
        if no_grad or op.vjp is None or out.dtype not in FLOATS:
            continue
        mask = op.diff_mask
        for i, (is_ref, v) in enumerate(step.args):
            if is_ref and requires_grad[v] and (mask is None or mask[i]):
                step.requires_grad = requires_grad[step.slot] = True
                break


def _outputs(names: Any, slots: dict[str, int], aliases: dict[str, int],
             errors: _Errors) -> list[tuple[str, int]]:
    if not names:
        errors.add(GraphError("graph.outputs must name at least one node or input",
                              loc=("graph", "outputs")))
    out: dict[str, int] = {}
    for k, name in enumerate(names):
        slot = aliases.get(name, slots.get(name)) if isinstance(name, str) else None
        if slot is None:
            errors.add(GraphError(f"output {name!r} is not a node id or an input name",
                                  node=name if isinstance(name, str) else None,
                                  loc=("graph", "outputs", k)))
            continue
        out[name] = slot
    return list(out.items())


def _execution_order(steps: list[Step], outputs: list[tuple[str, int]], ninputs: int) -> list[Step]:
    """Depth-first post-order from the outputs: only needed steps, each value computed close to
    its use so that few are alive at once; `frees` marks each value's last use."""
    by_slot = {s.slot: s for s in steps}
    order: list[Step] = []
    done: set[int] = set()
    for _, root in outputs:
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            slot, k = stack.pop()
            if slot in done or slot not in by_slot:
                continue
            step = by_slot[slot]
            refs = [v for is_ref, v in step.args if is_ref]
            while k < len(refs) and (refs[k] in done or refs[k] not in by_slot):
                k += 1
            if k < len(refs):
                stack.append((slot, k + 1))
                stack.append((refs[k], 0))
                continue
            done.add(slot)
            order.append(step)
    keep = {slot for _, slot in outputs}
    last_use: dict[int, Step] = {}
    for step in order:
        for is_ref, v in step.args:
            if is_ref and v >= ninputs and v not in keep:
                last_use[v] = step
    frees: dict[int, list[int]] = {}
    for slot, step in last_use.items():
        frees.setdefault(step.slot, []).append(slot)
    for step in order:
        step.frees = tuple(frees.get(step.slot, ()))
    return order


def _check_backward(program: Program, inputs: Mapping[str, TensorSpec],
                    grad_outputs: Mapping[str, TensorSpec], errors: _Errors) -> None:
    program.grad_inputs = [name for name, t in inputs.items() if t.requires_grad]
    if not program.grad_inputs:
        errors.add(BackwardError("nothing to differentiate: no input has requires_grad: true",
                                 loc=("inputs",)))
        return
    names = dict(program.outputs)
    for name, tspec in grad_outputs.items():
        if name not in names:
            errors.add(BackwardError(f"grad_outputs names {name!r}, which is not an output",
                                     node=name, loc=("grad_outputs", name)))
            continue
        meta = program.metas[names[name]]
        assert meta is not None
        if tuple(tspec.shape) != meta.shape:
            errors.add(BackwardError(
                f"grad_outputs[{name!r}] has shape {fmt(tspec.shape)} but the output has shape "
                f"{fmt(meta.shape)}", node=name, loc=("grad_outputs", name)))
    for name, slot in program.outputs:
        if not program.requires_grad[slot]:
            continue  # returned, but adds nothing to the gradients
        meta = program.metas[slot]
        assert meta is not None
        if name not in grad_outputs and numel(meta.shape) != 1:
            errors.add(BackwardError(
                f"output {name!r} has shape {fmt(meta.shape)}: only a one-element output gets "
                f"the implicit gradient 1; give grad_outputs[{name!r}]",
                node=name, loc=("grad_outputs", name)))
            continue
        program.roots.append(name)
    if not program.roots and not errors.items:
        errors.add(BackwardError(
            "no output depends on an input with requires_grad: true; nothing to differentiate",
            loc=("graph", "outputs")))
