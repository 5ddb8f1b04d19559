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

from engine.graph.ir import BYTE_COST, Program, Step
from engine.ops.registry import literal_meta, nbytes

# Result dtypes that compiled programs compute with the backend's ufuncs directly (the
# others, float16 above all, keep the ops' own forwards: PyTorch computes float16 with
# float literals in float32).
UFUNC_DTYPES = frozenset({"float32", "float64"})


def uses_ufunc(step: Step, program: Program) -> bool:
    """Whether `step` runs as a backend ufunc on operands of its result's dtype."""
    if step.op.ufunc is None:
        return False
    dtype = program.metas[step.out].dtype
    return dtype in UFUNC_DTYPES and all(
        program.metas[a].dtype == dtype for a in step.args if type(a) is int)


def plan(program: Program, *, ufuncs: bool, record: bool = False) -> None:
    """Plan `program` in place. `ufuncs`: the backend has ufuncs that write into a given
    buffer. `record`: a forward with grad recording, which holds what its graph saves."""
    metas = program.metas
    kept = _needed(program)
    program.steps = kept
    held = {*program.inputs.values(), *program.grad_inputs.values(),
            *(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    if record:
        program.held = _saved(program, kept)
    held |= program.held

    end = len(kept)
    last_use: dict[int, int] = {}
    root: dict[int, int] = {}  # a slot that is another's very array (detach) -> that slot
    for i, step in enumerate(kept):
        for a in step.args:
            if type(a) is int:
                last_use[a] = i
        if step.op.returns_input:
            base = step.args[0]
            root[step.out] = root.get(base, base)  # type: ignore[arg-type]
    for slot in held:
        last_use[slot] = end
    for alias, base in root.items():  # an array lives while any slot holding it does
        last_use[base] = max(last_use.get(base, -1), last_use.get(alias, -1))

    sizes = [nbytes(m) for m in metas]
    viewed = {a for s in kept if s.op.views_input for a in s.args if type(a) is int}
    fresh: set[int] = set()  # slots whose buffer a ufunc made and nothing else shares
    frees: list[list[int]] = [[] for _ in kept]
    for slot, i in last_use.items():
        if i < end:
            frees[i].append(slot)
    reuse = [-1] * end
    counted = [0] * len(metas)  # the bytes a slot releases when it is freed
    live = sum(sizes[s] for s in {*program.inputs.values(), *program.grad_inputs.values()})
    for s in {*program.inputs.values(), *program.grad_inputs.values()}:
        counted[s] = sizes[s]
    peak = live
    for i, step in enumerate(kept):
        out = step.out
        if step.op.returns_input:
            pass  # the same array: no new bytes
        else:
            r = _reusable(step, i, program, ufuncs, fresh, viewed, held, last_use) \
                if ufuncs else -1
            if r >= 0:
                reuse[i] = r
                counted[out], counted[r] = counted[r], 0
            else:
                counted[out] = sizes[out]
                live += sizes[out]
                peak = max(peak, live)
            if ufuncs and uses_ufunc(step, program) and out not in viewed:
                fresh.add(out)
        for s in frees[i]:
            live -= counted[s]
            counted[s] = 0
    program.frees = [tuple(f) for f in frees]
    program.reuse = reuse
    program.planned_peak_bytes = peak
    _price(program)


def _needed(program: Program) -> list[Step]:
    """The steps the outputs and gradients need, in run order (dead code eliminated)."""
    needed = {*(s for _, s in program.outputs), *(s for _, s in program.gradients)}
    kept = []
    for step in reversed(program.steps):
        if step.out in needed:
            kept.append(step)
            needed.update(a for a in step.args if type(a) is int)  # type: ignore[misc]
    kept.reverse()
    return kept


def _saved(program: Program, steps: list[Step]) -> set[int]:
    """What a recorded forward's graph keeps for a backward that may follow (PyTorch keeps
    it while the outputs live): each recorded step's saved arguments and result."""
    held: set[int] = set()
    rg = program.requires_grad
    for step in steps:
        if not rg[step.out]:
            continue
        op = step.op
        for i in op.save_index:
            if i < 0:
                held.add(step.out)
            elif op.variadic:
                held.update(a for a in step.args if type(a) is int)  # type: ignore[misc]
            elif type(step.args[i]) is int:
                held.add(step.args[i])  # type: ignore[arg-type]
    return held


def _reusable(step: Step, i: int, program: Program, ufuncs: bool, fresh: set[int],
              viewed: set[int], held: set[int], last_use: dict[int, int]) -> int:
    """An operand whose buffer this ufunc step may write its result into: it dies here,
    has the result's shape and dtype, was made by a ufunc, and nothing views it."""
    meta = program.metas[step.out]
    if not meta.shape or not uses_ufunc(step, program):
        return -1  # a 0-d result is a NumPy scalar, not a buffer
    for a in step.args:
        if (type(a) is int and a in fresh and last_use.get(a) == i and a not in held
                and a not in viewed and program.metas[a] == meta):
            return a  # type: ignore[return-value]
    return -1


def _price(program: Program) -> None:
    """The static cost of every step, in total and by the client node it serves."""
    metas = program.metas
    flops = moved = 0
    by_node: dict[str, int] = {}
    for step in program.steps:
        args = [metas[a] if type(a) is int else literal_meta(a.value)  # type: ignore[union-attr]
                for a in step.args]
        f, b = step.op.static_cost(args, metas[step.out], step.attrs)
        flops += f
        moved += b
        key = step.origin or "<graph>"
        by_node[key] = by_node.get(key, 0) + f + BYTE_COST * b
    program.flops, program.bytes_moved, program.cost_by_node = flops, moved, by_node
