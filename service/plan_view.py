"""POST /plan's answer: a request's program for its path, without data, and what it would
hold and cost against the budgets, step by step; as JSON, or as Graphviz DOT."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gradserve.engine.errors import MemoryBudgetError
from gradserve.engine.graph import Program
from gradserve.engine.graph.ir import RECOMPUTE
from gradserve.service.encode import Reply, recomputation, value_bytes
from gradserve.wire.numbers import dumps

if TYPE_CHECKING:
    from gradserve.service.compute import Bounds, Compute, Stats
    from gradserve.service.request import Request


def plan_reply(
    compute: Compute, request: Request, stats: Stats, *, dot: bool, bounds: Bounds | None
) -> Reply:
    """The plan of `request` (its program found or compiled by `compute`; the errors are
    those /forward or /backward would give). A program over its memory budget even with
    recomputation is planned without it, and the answer says the smallest peak reached."""
    minimum = None
    try:
        program = compute.program(request, stats, bounds)
    except MemoryBudgetError as err:  # (the plan answers with the numbers)
        minimum = err.planned_bytes
        stats.rejected = None  # (a plan over budget is an answer, not a refusal)
        program = compute.compile(request, stats, keep=False, recompute=False)
    if dot:
        return Reply(
            [program_dot(program, request.budget).encode()],
            media_type="text/vnd.graphviz; charset=utf-8",
        )
    recompute = recomputation(program)
    if recompute is not None:  # (the explorer draws both memory timelines)
        plain = compute.compile(request, stats, keep=False, recompute=False)
        recompute["nodes_without"] = planned_steps(plain)
    compute_budget = compute.settings.compute_budget
    answer = {
        "planned_peak_bytes": program.planned_peak_bytes,
        "memory_budget_bytes": request.budget,
        "compute_cost": program.compute_cost,
        "compute_budget": compute_budget,
        "admitted": (
            program.planned_peak_bytes <= request.budget and program.compute_cost <= compute_budget
        ),
        "path": request.path,
        "graph_id": request.graph_id,
        "nodes": planned_steps(program),
        "recompute": recompute,
        "minimum_peak_bytes": minimum,
    }
    if program.vmap_chunks:
        answer["vmap_chunks"] = program.vmap_chunks
    return Reply([_dumps(answer)])


def _dumps(plan: dict[str, Any]) -> bytes:
    """orjson, or the standard library for figures past 64 bits (which orjson refuses: a
    plan of specs may describe tensors no machine could hold, whose bytes are planned
    all the same, and refused by the budgets)."""
    try:
        return dumps(plan)
    except TypeError:
        return json.dumps(plan, separators=(",", ":")).encode()


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
        out.append(
            {
                "step": i,
                "id": step.origin,
                "op": step.op.name,
                "kind": step.kind,
                "shape": list(meta.shape),
                "dtype": meta.dtype,
                "bytes": sum(value_bytes(metas[o]) for o in step.outs),
                "cost": cost,
                "freed_after": freed.get(step.out),
            }
        )
    return out


def program_dot(program: Program, budget: int) -> str:
    """Graphviz DOT of a program: its steps (forward and backward in two clusters, the
    step's op, shape and bytes, coloured by bytes) and edges from the values they read."""
    metas = program.metas
    maker = {o: i for i, step in enumerate(program.steps) for o in step.outs}
    sizes = [sum(value_bytes(metas[o]) for o in step.outs) for step in program.steps]
    biggest = max(sizes, default=0) or 1
    lines = [
        "digraph program {",
        '  rankdir=TB; node [shape=box, style="rounded,filled", '
        'fontname="Helvetica", fontsize=10];',
        f'  label="planned peak {program.planned_peak_bytes} bytes (budget {budget}), '
        f'cost {program.compute_cost}"; labelloc=t;',
    ]
    inputs = {slot: name for name, slot in program.inputs.items()}
    for slot, name in inputs.items():
        meta = metas[slot]
        lines.append(
            f'  in{slot} [label="{_dot(name)}\\n{list(meta.shape)} {meta.dtype}", '
            'shape=ellipse, fillcolor="#e8f0fe"];'
        )
    phases = {"backward": "backward", RECOMPUTE: "recompute"}  # the rest: the forward
    for phase in ("forward", "recompute", "backward"):
        ours = [
            i for i, step in enumerate(program.steps) if phases.get(step.kind, "forward") == phase
        ]
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
                f'fillcolor="#ff{shade:02x}{shade:02x}"];'
            )
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
