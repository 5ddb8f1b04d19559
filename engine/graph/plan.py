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

from engine.dtypes import ITEMSIZE
from engine.graph.ir import BYTE_COST, NODE, Program, Step
from engine.graph.scan import OUTER, SCAN, Body, carry_sources
from engine.ops.registry import Meta, literal_meta
from engine.shapes import numel

# Result dtypes that compiled programs compute with the backend's ufuncs directly (the
# others, float16 above all, keep the ops' own forwards: PyTorch computes float16 with
# float literals in float32).
UFUNC_DTYPES = frozenset({"float32", "float64"})
# A buffer is worth taking over from 32 KiB: below, NumPy's allocator hands out recycled
# small blocks for less than the `out=` argument costs to pass.
REUSE_MIN_BYTES = 32 << 10


def uses_ufunc(step: Step, metas: list[Meta]) -> bool:
    """Whether `step` runs as a backend ufunc on operands of its result's dtype."""
    if step.op.ufunc is None:
        return False
    dtype = metas[step.out].dtype
    if dtype not in UFUNC_DTYPES:
        return False
    return all(metas[a].dtype == dtype for a in step.args if type(a) is int)


def plan(program: Program, *, ufuncs: bool, record: bool = False) -> None:
    """Plan `program` in place. `ufuncs`: the backend has ufuncs that write into a given
    buffer. `record`: a forward with grad recording, which holds what its graph saves."""
    metas = program.metas
    kept, needed = _needed(program)
    program.steps = kept
    transient: dict[int, int] = {}  # scan step index -> what it holds while it runs
    for i, step in enumerate(kept):
        if step.op is SCAN:
            transient[i] = _plan_body(step, needed, ufuncs)
    program.nodes = sum(_nodes(step) for step in kept)
    given = {*program.inputs.values(), *program.grad_inputs.values()}
    held = {*given, *(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    if record:
        program.held = _saved(program, kept)
    held |= program.held

    end = len(kept)
    last_use: dict[int, int] = {}
    root: dict[int, int] = {}  # a slot that is another's very array (detach) -> that slot
    viewed: set[int] = set()  # slots that some result may share memory with
    for i, step in enumerate(kept):
        for a in step.args:
            if type(a) is int:
                last_use[a] = i
        op = step.op
        if op.views_input:
            viewed.update(a for a in step.args if type(a) is int)  # type: ignore[misc]
            if op.returns_input:
                base = step.args[0]
                root[step.out] = root.get(base, base)  # type: ignore[arg-type]
    for slot in held:
        last_use[slot] = end
    for alias, base in root.items():  # an array lives while any slot holding it does
        last_use[base] = max(last_use.get(base, -1), last_use.get(alias, -1))
    frees: list[list[int]] = [[] for _ in kept]
    for slot, i in last_use.items():
        if i < end:
            frees[i].append(slot)

    numels = [numel(m.shape) for m in metas]
    sizes = [n * ITEMSIZE[m.dtype] for n, m in zip(numels, metas, strict=True)]
    program.ufunc = ufunc = [ufuncs and uses_ufunc(step, metas) for step in kept]
    fresh: set[int] = set()  # slots whose buffer a ufunc made and nothing else shares
    reuse = [-1] * end
    counted = [0] * len(metas)  # the bytes a slot releases when it is freed
    live = 0
    for slot in given:
        counted[slot] = sizes[slot]
        live += sizes[slot]
    peak = live
    for i, step in enumerate(kept):
        out = step.out
        if i in transient:  # a loop: what it holds while it runs, then its results
            peak = max(peak, live + transient[i])
            for slot in step.outs:
                if slot in needed:
                    counted[slot] = sizes[slot]
                    live += sizes[slot]
            peak = max(peak, live)
        elif not step.op.returns_input:  # (which adds no bytes: it is its input's array)
            r = -1
            if ufunc[i] and sizes[out] >= REUSE_MIN_BYTES:  # (never 0-d: a scalar, no buffer)
                meta = metas[out]
                for a in step.args:
                    if (type(a) is int and a in fresh and last_use.get(a) == i
                            and a not in held and metas[a] == meta):
                        r = a
                        break
                if out not in viewed:
                    fresh.add(out)
            if r >= 0:
                reuse[i] = r
                counted[out], counted[r] = counted[r], 0
            else:
                counted[out] = sizes[out]
                live += sizes[out]
                if live > peak:
                    peak = live
        for slot in frees[i]:
            live -= counted[slot]
            counted[slot] = 0
    program.frees = [tuple(f) for f in frees]
    program.reuse = reuse
    program.planned_peak_bytes = peak
    _price(program, numels, sizes)


def _needed(program: Program) -> tuple[list[Step], set[int]]:
    """The steps the outputs and gradients need, in run order (dead code eliminated), and
    the slots they need."""
    needed = {*(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    kept = []
    for step in reversed(program.steps):
        if step.out in needed or (step.more and not needed.isdisjoint(step.more)):
            kept.append(step)
            needed.update(a for a in step.args if type(a) is int)  # type: ignore[misc]
    kept.reverse()
    return kept, needed


def _nodes(step: Step) -> int:
    """The client's op nodes a step runs: itself, or a loop's body nodes (counted once)."""
    if step.op is SCAN:
        body: Body = step.attrs["body"]
        return body.program.nodes  # type: ignore[union-attr]
    return 1 if step.kind == NODE else 0


def _plan_body(step: Step, needed: set[int], ufuncs: bool) -> int:
    """Plan a scan step's body for the results the program uses; returns what the step
    holds while it runs: the stacked results, the body's peak beyond its inputs, and
    the carries the body made at the step before (the executor counts the same)."""
    body: Body = step.attrs["body"]
    body.wanted = [slot in needed for slot in step.outs]
    stacked = body.wanted[len(body.carries):]
    program = Program(
        metas=body.b.metas, steps=body.steps,
        inputs={f"in{k}": slot for k, slot in enumerate(body.inputs)}, grad_inputs={},
        outputs=[*((f"next{k}", slot) for k, slot in enumerate(body.nexts)),
                 *((f"y{k}", slot) for k, slot in enumerate(body.ys) if stacked[k])],
        gradients=[], requires_grad=[], grad_fn=[], no_grad=True, backward=False)
    plan(program, ufuncs=ufuncs)
    body.program = program
    metas = body.b.metas
    stacks = sum(_bytes(metas[y]) for y, want in zip(body.ys, stacked, strict=True)
                 if want) * body.length
    if body.length == 0:
        return stacks
    beyond_inputs = program.planned_peak_bytes - sum(_bytes(metas[s]) for s in body.inputs)
    return stacks + beyond_inputs + _made_carries(body, program)


def _made_carries(body: Body, program: Program) -> int:
    """The most bytes of carries that the body made at one step and the next step holds
    (a carry may also be an input passed on, or a value made some steps before and passed
    from carry to carry): simulated step by step until the pattern repeats."""
    sources, roots = carry_sources(body, program)
    metas = body.b.metas
    # Each carry holds an outer array (None) or one the body made: (root slot, steps ago).
    state: tuple[tuple[int, int] | None, ...] = (None,) * len(body.carries)
    seen = {state}
    worst = 0
    for _ in range(body.length - 1):
        new: list[tuple[int, int] | None] = []
        for source, slot in zip(sources, roots, strict=True):
            if source >= 0:
                held = state[source]
                new.append(None if held is None else (held[0], held[1] + 1))
            else:
                new.append(None if source == OUTER else (slot, 0))
        state = tuple(new)
        worst = max(worst, sum(_bytes(metas[r]) for r, _ in {h for h in state if h}))
        if state in seen:
            break
        seen.add(state)
    return worst


def _bytes(meta: Meta) -> int:
    return numel(meta.shape) * ITEMSIZE[meta.dtype]


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


def _price(program: Program, numels: list[int], sizes: list[int]) -> None:
    """The static cost of every step, in total and by the client node it serves."""
    metas = program.metas
    flops = moved = 0
    by_node: dict[str, int] = {}
    per_step = []
    for step in program.steps:
        op = step.op
        if op.cost is None:  # the default rule, from the sizes already known
            out = step.out
            f, b = numels[out], sizes[out]
            for a in step.args:
                if type(a) is int:
                    f += numels[a]
                    b += sizes[a]
        else:
            args = [metas[a] if type(a) is int else literal_meta(a.value)  # type: ignore[union-attr]
                    for a in step.args]
            f, b = op.cost(args, metas[step.out], **step.attrs)
        flops += f
        moved += b
        per_step.append(f + BYTE_COST * b)
        key = step.origin or "<graph>"
        by_node[key] = by_node.get(key, 0) + f + BYTE_COST * b
    program.flops, program.bytes_moved, program.cost_by_node = flops, moved, by_node
    program.step_costs = per_step
