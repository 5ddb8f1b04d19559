"""The planner: dead-code elimination, liveness, buffer reuse, the memory peak and the cost,
all over the one list of steps (forward and derived backward), before anything runs.

Memory is counted per slot: a step adds its result's bytes (unless it writes into the
buffer of an operand that dies there, or returns its input itself, as `detach` does), and
a slot's bytes go when its last reader has run. The request's inputs, its outputs and
gradients, and (on the grad path of /forward) the values the recorded graph saves are
held to the end. The executor counts the same way, from the arrays it really holds, so
the planned peak equals the measured one when the shape rules are right (tests hold both
to it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from gradserve.engine.graph.facts import Facts, facts_of, size_of
from gradserve.engine.graph.ir import BYTE_COST, NODE, RECOMPUTE, Program, Step
from gradserve.engine.graph.scan import OUTER, SCAN, Body, carry_sources, replay_cost

# A buffer is worth taking over from 32 KiB: below, NumPy's allocator hands out recycled
# small blocks for less than the `out=` argument costs to pass.
REUSE_MIN_BYTES = 32 << 10


def plan(
    program: Program,
    *,
    ufuncs: bool,
    record: bool = False,
    facts: Mapping[Step, Facts] | None = None,
) -> None:
    """Plan `program` in place. `ufuncs`: the backend has ufuncs that write into a given
    buffer. `record`: a forward with grad recording, which holds what its graph saves.
    `facts`: the steps' facts where their emitter knew them (engine.graph.facts)."""
    metas = program.metas
    kept, needed, loops = _needed(program)
    program.steps = kept
    transient = {i: _plan_body(kept[i], needed, ufuncs) for i in loops}
    given = {*program.inputs.values(), *program.grad_inputs.values()}
    held = {*given, *(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    if record:
        program.held = _saved(program, kept)
    held |= program.held

    # Liveness: each slot's last reader, and the slots a result may share memory with.
    known = facts or {}
    per_step: list[Facts | None] = [known.get(step) for step in kept]  # None for a loop
    end = len(kept)
    last_use: dict[int, int] = {}
    root: dict[int, int] = {}  # a slot that is another's very array (detach) -> that slot
    viewed: set[int] = set()  # slots that some result may share memory with
    nodes = 0
    for i, step in enumerate(kept):
        args = step.args
        f = per_step[i]
        if f is None:
            if step.op is SCAN:
                body = step.attrs["body"]
                nodes += body.unrolled_nodes or body.program.nodes
                for a in args:
                    last_use[a] = i  # type: ignore[index]
                viewed.update(args)  # type: ignore[arg-type]
                continue
            f = per_step[i] = facts_of(step, metas)
        if step.kind == NODE:
            nodes += 1
        if f.slots_only:
            for a in args:
                last_use[a] = i  # type: ignore[index]
        else:
            for a in args:
                if type(a) is int:
                    last_use[a] = i
        if f.views_input:
            viewed.update(a for a in args if type(a) is int)  # type: ignore[misc]
            if f.returns_input:
                base: int = args[0]  # type: ignore[assignment]
                root[step.out] = root.get(base, base)
    program.nodes = nodes
    for slot in held:
        last_use[slot] = end
    for alias, base in root.items():  # an array lives while any slot holding it does
        last_use[base] = max(last_use.get(base, -1), last_use.get(alias, -1))
    frees: list[tuple[int, ...]] = [()] * end
    for slot, i in last_use.items():
        if i < end:
            frees[i] = (*frees[i], slot)

    # Memory, step by step, and the cost.
    program.ufunc = ufunc = [ufuncs and f is not None and f.ufunc for f in per_step]
    fresh: set[int] = set()  # slots whose buffer a ufunc made and nothing else shares
    reuse = [-1] * end
    counted = [0] * len(metas)  # the bytes a slot releases when it is freed
    live = 0
    for slot in given:
        counted[slot] = size_of(metas[slot])
        live += counted[slot]
    peak = live
    flops = moved = recomputed = 0
    recomputes = False
    by_node: dict[str, int] = {}
    step_costs = []
    for i, step in enumerate(kept):
        f = per_step[i]
        if f is None:  # a loop: what it holds while it runs, then its results
            peak = max(peak, live + transient[i])
            for slot in step.outs:
                if slot in needed:
                    counted[slot] = size_of(metas[slot])
                    live += counted[slot]
            peak = max(peak, live)
            step_flops, step_bytes = step.op.cost(  # type: ignore[misc]
                [metas[a] for a in step.args],  # type: ignore[index]
                metas[step.out],
                **step.attrs,
            )
            cost = step_flops + BYTE_COST * step_bytes
            replay_flops, replay_bytes = replay_cost(step.attrs["body"])
            if replay_flops or replay_bytes:  # (a checkpointed loop runs segments again)
                recomputes = True
                recomputed += replay_flops + BYTE_COST * replay_bytes
        else:
            if not f.returns_input:  # (which adds no bytes: it is its input's array)
                out = step.out
                size = f.size
                r = -1
                if ufunc[i] and size >= REUSE_MIN_BYTES:  # (never 0-d: a scalar, no buffer)
                    meta = metas[out]
                    for a in step.args:
                        if (
                            type(a) is int
                            and a in fresh
                            and last_use.get(a) == i
                            and a not in held
                            and metas[a] == meta
                        ):
                            r = a
                            break
                    if out not in viewed:
                        fresh.add(out)
                if r >= 0:
                    reuse[i] = r
                    counted[out], counted[r] = counted[r], 0
                else:
                    counted[out] = size
                    live += size
                    if live > peak:
                        peak = live
            step_flops, step_bytes, cost = f.flops, f.bytes, f.cost
        for slot in frees[i]:
            live -= counted[slot]
            counted[slot] = 0
        flops += step_flops
        moved += step_bytes
        step_costs.append(cost)
        if step.kind == RECOMPUTE:
            recomputes = True
            recomputed += cost
        key = step.origin or "<graph>"
        by_node[key] = by_node.get(key, 0) + cost
    program.frees = frees
    program.reuse = reuse
    program.planned_peak_bytes = peak
    program.flops, program.bytes_moved, program.cost_by_node = flops, moved, by_node
    program.step_costs = step_costs
    program.recompute_cost = recomputed
    if not recomputes:  # (a rematerialized program keeps the figure from before: remat)
        program.peak_without_recompute = peak


def _needed(program: Program) -> tuple[list[Step], set[Any], list[int]]:
    """The steps the outputs and gradients need, in run order (dead code eliminated), the
    slots they need (with their literals, which no slot equals), and where the loops
    are among them."""
    needed: set[Any] = {*(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    kept = []
    loops = []
    for step in reversed(program.steps):
        if step.out in needed or (step.more and not needed.isdisjoint(step.more)):
            kept.append(step)
            needed.update(step.args)
            if step.op is SCAN:
                loops.append(len(kept) - 1)
    kept.reverse()
    return kept, needed, [len(kept) - 1 - i for i in reversed(loops)]


def _plan_body(step: Step, needed: set[int], ufuncs: bool) -> int:
    """Plan a scan step's body for the results the program uses; returns what the step
    holds while it runs: the stacked results, the body's peak beyond its inputs, and
    the carries the body made at the step before; a checkpointed reverse loop, the most
    of that and of what it holds while it replays a segment (the executor counts the
    same)."""
    body: Body = step.attrs["body"]
    body.wanted = [slot in needed for slot in step.outs]
    nc, ny = len(body.carries), len(body.ys)
    stacked = body.wanted[nc : nc + ny]
    program = Program(
        metas=body.b.metas,
        steps=body.steps,
        inputs={f"in{k}": slot for k, slot in enumerate(body.inputs)},
        grad_inputs={},
        outputs=[
            *((f"next{k}", slot) for k, slot in enumerate(body.nexts)),
            *((f"y{k}", slot) for k, slot in enumerate(body.ys) if stacked[k]),
            *((f"replayed{k}", slot) for k, slot in enumerate(body.replayed)),
        ],
        gradients=[],
        requires_grad=[],
        grad_fn=[],
        no_grad=True,
        backward=False,
    )
    plan(program, ufuncs=ufuncs, facts=body.b.facts)
    body.program = program
    metas = body.b.metas
    stacks = (
        sum(size_of(metas[y]) for y, want in zip(body.ys, stacked, strict=True) if want)
        * body.length
    )
    if body.every:
        kept = body.wanted[nc + ny :]
        stacks += body.segments * sum(
            size_of(metas[c]) for c, want in zip(body.carries, kept[:nc], strict=True) if want
        )
        stacks += body.every * sum(
            size_of(metas[r]) for r, want in zip(body.buffered(), kept[nc:], strict=True) if want
        )
    if body.length == 0:
        return stacks
    made = _made_by_step(body, program)
    held = _beyond_inputs(body, program) + _worst(made, 0, body.length)
    replay = body.replay
    if replay is not None and replay.segments > 1:
        # While it replays a segment (all but the last): its own carries as they are then,
        # the replay's carries and its peak.
        forward = replay.program
        assert forward is not None, "a replay is planned before its reverse loop"
        replayed = _made_by_step(replay, forward)
        starts = [replay.start(j) for j in range(replay.segments)]
        held = max(
            held,
            _beyond_inputs(replay, forward)
            + max(
                _at(made, body.length - end) + _worst(replayed, 0, end - start)
                for start, end in itertools.pairwise(starts)
            ),
        )
    return stacks + held


def _beyond_inputs(body: Body, program: Program) -> int:
    """A body's planned peak beyond the inputs it is given."""
    metas = body.b.metas
    return program.planned_peak_bytes - sum(size_of(metas[s]) for s in body.inputs)


def _made_by_step(body: Body, program: Program) -> tuple[list[int], int]:
    """The bytes of the carries that the body made and holds into each step (none into the
    first), by step until the pattern repeats (a carry may also be an input passed on, or
    a value made some steps before and passed from carry to carry), and the step from
    which it repeats (`_at`)."""
    sources, roots = carry_sources(body, program)
    metas = body.b.metas
    # Each carry holds an outer array (None) or one the body made: (root slot, steps ago).
    state: tuple[tuple[int, int] | None, ...] = (None,) * len(body.carries)
    seen = {state: 0}
    made = [0]
    for _ in range(body.length):
        new: list[tuple[int, int] | None] = []
        for source, slot in zip(sources, roots, strict=True):
            if source >= 0:
                held = state[source]
                new.append(None if held is None else (held[0], held[1] + 1))
            else:
                new.append(None if source == OUTER else (slot, 0))
        state = tuple(new)
        if state in seen:
            return made, seen[state]
        seen[state] = len(made)
        made.append(sum(size_of(metas[r]) for r, _ in {h for h in state if h}))
    return made, len(made) - 1


def _at(made: tuple[list[int], int], step: int) -> int:
    """What `_made_by_step` says is held into `step`."""
    values, start = made
    if step < len(values):
        return values[step]
    return values[start + (step - start) % (len(values) - start)]


def _worst(made: tuple[list[int], int], first: int, end: int) -> int:
    """The most that `_made_by_step` says is held into a step of first..end-1."""
    values, start = made
    # (past len(values) + the period, the values repeat)
    end = min(end, 2 * len(values) - start)
    return max((_at(made, step) for step in range(first, end)), default=0)


def _saved(program: Program, steps: list[Step]) -> set[int]:
    """What a recorded forward's graph keeps for a backward that may follow (PyTorch keeps
    it while the outputs live): each recorded step's saved arguments and result."""
    held: set[int] = set()
    rg = program.requires_grad
    for step in steps:
        if not any(rg[o] for o in step.outs):
            continue
        op = step.op
        if op is SCAN:  # (its VJP reads its arguments, and values of its body)
            held.update(step.slots)
            continue
        for i in op.save_index:
            if i < 0:
                held.add(step.out)
            elif op.variadic:
                held.update(a for a in step.args if type(a) is int)  # type: ignore[misc]
            elif type(step.args[i]) is int:
                held.add(step.args[i])  # type: ignore[arg-type]
    return held
