"""Reverse mode as a transformation of the program (as JAX's `linearize`/`transpose`).

`vjp` walks the forward steps backwards and, for each step that a cotangent reaches and
that depends on a differentiated value, calls the op's VJP rules on the emitting
namespace (`engine.graph.builder`): they append the backward's steps to the same program.
A gradient that reaches a value from several uses is summed in the order the uses are
met; each is summed back to its value's shape and cast to its dtype, as the eager
backward does (`engine.autograd.Node._conform`).

Nothing here looks at data, so the derived steps are planned and priced with the
forward, and the result can be differentiated again (a Hessian-vector product is `vjp`
of a program that already holds a `vjp`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from gradserve.engine.dtypes import FLOATS
from gradserve.engine.graph.builder import Builder, Memo, Sym, derived
from gradserve.engine.graph.facts import Facts, facts_of
from gradserve.engine.graph.ir import BACKWARD, Lit, Step
from gradserve.engine.graph.scan import SCAN, Body, emit_scan, stacked
from gradserve.engine.ops import OPS
from gradserve.engine.ops.registry import Meta, OpDef
from gradserve.engine.shapes import sum_to_shape


def active_slots(b: Builder, steps: Iterable[Step], wrt: Iterable[int]) -> set[int]:
    """The slots that depend on `wrt` through differentiable arguments: PyTorch's
    requires_grad, propagated statically."""
    active = set(wrt)
    metas = b.metas
    for step in steps:
        op = step.op
        if op is SCAN:
            active.update(_scan_active(b, step, active)[1])
            continue
        if op.vjp is None or metas[step.out].dtype not in FLOATS:
            continue
        mask = op.diff_mask
        for i, a in enumerate(step.args):
            if type(a) is int and a in active and (mask is None or mask[i]):
                active.add(step.out)
                break
    return active


def vjp(
    b: Builder,
    steps: Sequence[Step],
    cotangents: Sequence[tuple[int, Sym]],
    wrt: Sequence[int],
    *,
    create_graph: bool = False,
    kind: str = BACKWARD,
    active: set[int] | None = None,
) -> list[Sym | None]:
    """The vector-Jacobian product of `steps` (a prefix of `b.steps`, in run order): for
    each slot in `wrt`, the sum over `cotangents` (slot, upstream gradient) of
    gradientᵀ · ∂slot_value/∂wrt, or None where no cotangent reaches it. `create_graph`:
    the emitted backward will itself be differentiated (PyTorch's grad mode during
    backward; some VJPs answer differently then, as PyTorch's do). `kind`: what the emitted
    steps are (the request's own backward, or the derivative that a node asks for).
    `active`: `active_slots(b, steps, wrt)`, where the caller has it already."""
    if active is None:
        active = active_slots(b, steps, wrt)
    found = _derive(b, steps, cotangents, active, set(wrt), create_graph, kind)
    return [found.get(s) for s in wrt]


def vjp_all(
    b: Builder,
    steps: Sequence[Step],
    cotangents: Sequence[tuple[int, Sym]],
    *,
    create_graph: bool = False,
    kind: str = BACKWARD,
) -> dict[int, Sym]:
    """The cotangent of every floating value that a cotangent reaches, by slot: what one
    derivation gives every `grad` over the same target (dead-code elimination then drops
    the ones no one uses)."""
    floating = {s for s, m in enumerate(b.metas) if m.dtype in FLOATS}
    return _derive(b, steps, cotangents, floating, floating, create_graph, kind)


def _derive(
    b: Builder,
    steps: Sequence[Step],
    cotangents: Sequence[tuple[int, Sym]],
    active: set[int],
    wanted: set[int],
    create_graph: bool,
    kind: str,
) -> dict[int, Sym]:
    # Cotangents are held as slots (a Sym is made only for the ones a VJP rule reads).
    captured: dict[int, int] = {}
    pending: dict[int, int] = {}
    syms = b.syms
    with derived(b, create_graph=create_graph, kind=kind):
        for slot, seed in cotangents:
            if slot in active:
                _accumulate(b, pending, slot, seed.slot)
        for step in reversed(steps):
            if step.op is SCAN:
                cts = [pending.pop(o, None) for o in step.outs]
                if any(g is not None for g in cts):
                    captured.update(
                        (o, g)
                        for o, g in zip(step.outs, cts, strict=True)
                        if g is not None and o in wanted
                    )
                    b.origin = step.origin
                    for slot, sym in _scan_vjp(
                        b, step, [None if g is None else syms[g] for g in cts], active, pending
                    ):
                        _accumulate(b, pending, slot, sym.slot)
                continue
            out = step.out
            g = pending.pop(out, None)
            if g is None:
                continue
            if out in wanted:
                captured[out] = g
            b.origin = step.origin
            for slot, grad in _step_vjp(b, step, g, active):
                _accumulate(b, pending, slot, grad)
    captured.update((s, g) for s, g in pending.items() if s in wanted)
    return {s: syms[g] for s, g in captured.items()}


def _scan_active(b: Builder, step: Step, active: set[int]) -> tuple[set[int], list[int]]:
    """For a scan step: the body slots that depend on a differentiated value (a carry is
    one when its initial value is, or when its next value depends on one at some step),
    and the step's results that do."""
    body: Body = step.attrs["body"]
    bb, metas = body.b, body.b.metas
    inner_wrt = {
        inner
        for inner, outer in zip(body.inputs, step.args, strict=True)
        if outer in active and metas[inner].dtype in FLOATS
    }
    while True:
        inner = active_slots(bb, body.steps, inner_wrt)
        more = {
            c
            for c, n in zip(body.carries, body.nexts, strict=True)
            if n in inner and c not in inner_wrt and metas[c].dtype in FLOATS
        }
        if not more:
            break
        inner_wrt |= more
    nc = len(body.carries)
    outs = [o for o, c in zip(step.outs, body.carries, strict=False) if c in inner_wrt]
    outs += [o for o, y in zip(step.outs[nc:], body.ys, strict=True) if y in inner]
    return inner_wrt, outs


def _scan_vjp(
    b: Builder,
    step: Step,
    cts: list[Sym | None],
    active: set[int],
    pending: dict[int, int],
) -> list[tuple[int, Sym]]:
    """The VJP of a scan step: a scan the other way over the VJP of its body, emitted on
    `b` (engine.graph.scan). Its carries are the carries' cotangents and a running sum of
    each closure's, which starts from the closure's cotangent so far (taken from
    `pending`): the sum is then in the order an unrolled loop's backward meets its terms,
    the same bits (engine.graph.rolling); per step it reads the results' cotangents, the
    sequences, and the body values the VJP needs (stacked by this step as extra
    results)."""
    body: Body = step.attrs["body"]
    assert not body.shifted and body.replay is None, "a loop derived to run once"
    bb = body.b
    nc, nx = len(body.carries), len(body.xs)
    args: tuple[int, ...] = step.slots
    wanted_args = [a in active and b.metas[a].dtype in FLOATS for a in args]
    if not any(wanted_args):
        return []
    inner_wrt, _ = _scan_active(b, step, {a for a, w in zip(args, wanted_args, strict=True) if w})
    inner = active_slots(bb, body.steps, inner_wrt)
    first = len(bb.steps)
    ct_carries = {k: bb.value(bb.metas[c]) for k, c in enumerate(body.carries) if c in inner_wrt}
    ct_ys = {
        j: bb.value(bb.metas[y])
        for j, y in enumerate(body.ys)
        if cts[nc + j] is not None and y in inner
    }
    found = _derive(
        bb,
        body.steps,
        [
            *((body.nexts[k], g) for k, g in ct_carries.items()),
            *((body.ys[j], g) for j, g in ct_ys.items()),
        ],
        inner,
        inner_wrt,
        b.create_graph,
        b.kind,
    )
    closures = [i for i in range(len(body.closures)) if wanted_args[nc + nx + i]]
    xs = [i for i in range(nx) if wanted_args[nc + i]]
    with derived(bb, create_graph=b.create_graph, kind=b.kind):
        sums = {i: bb.value(bb.metas[body.closures[i]]) for i in closures}
        nexts = [
            found[c] if c in found else bb.zeros_like(bb.syms[c])
            for c in (body.carries[k] for k in ct_carries)
        ]
        nexts += [
            sums[i] + found[body.closures[i]] if body.closures[i] in found else sums[i]
            for i in closures
        ]
        ys = [
            found[body.xs[i]] if body.xs[i] in found else bb.zeros_like(bb.syms[body.xs[i]])
            for i in xs
        ]
    steps = bb.steps[first:]
    # What the VJP reads of the forward: a sequence's slice and a closure are given as
    # they are; any other value (a carry, a value the body computed) is stacked.
    computed = {o for st in body.steps for o in st.outs} | set(body.carries)
    made_here = {st.out for st in steps}
    reads = list(dict.fromkeys(a for st in steps for a in st.slots if a not in made_here))
    residuals = [a for a in reads if a in computed]
    read_xs = [i for i, x in enumerate(body.xs) if x in reads]
    read_closures = [i for i, z in enumerate(body.closures) if z in reads]
    # A carry whose next value is stacked too is read from that stack, one step back
    # (engine.graph.scan): where this loop runs once (its own VJP would need the shift
    # transposed).
    shifts = {} if b.create_graph else _shifts(body, residuals)
    syms = b.syms
    closure_args = [syms[args[nc + nx + i]] for i in read_closures]
    shifted: list[tuple[int, int]] = []
    first_x = len(ct_ys)
    for n, slot in enumerate(residuals):
        if slot in shifts:
            shifted.append((first_x + n, len(closure_args)))
            closure_args.append(syms[args[body.carries.index(slot)]])
    reverse = Body(
        b=bb,
        steps=steps,
        carries=[*(g.slot for g in ct_carries.values()), *(g.slot for g in sums.values())],
        xs=[*(g.slot for g in ct_ys.values()), *residuals, *(body.xs[i] for i in read_xs)],
        closures=[
            *(body.closures[i] for i in read_closures),
            *(bb.value(bb.metas[slot]).slot for slot in residuals if slot in shifts),
        ],
        nexts=[g.slot for g in nexts],
        ys=[g.slot for g in ys],
        length=body.length,
        reverse=not body.reverse,
        shifted=shifted,
        vjp_of=None if b.create_graph else step,
    )
    inits = [cts[k] if cts[k] is not None else b.zeros_like(syms[step.outs[k]]) for k in ct_carries]
    for i in closures:
        outer = args[nc + nx + i]
        so_far = pending.get(outer)
        if so_far is not None and b.metas[so_far] == b.metas[outer] and outer not in args[:nc]:
            inits.append(syms[pending.pop(outer)])
        else:
            inits.append(b.zeros_like(syms[outer]))
    sequences = [cts[nc + j] for j in ct_ys]
    sequences += stacked(b, step, [shifts.get(slot, slot) for slot in residuals])
    sequences += [syms[args[nc + i]] for i in read_xs]
    outs = emit_scan(b, reverse, inits, sequences, closure_args)  # type: ignore[arg-type]
    grads: list[tuple[int, Sym]] = []
    for k, out in zip(ct_carries, outs, strict=False):
        if wanted_args[k]:
            grads.append((args[k], out))
    grads += [
        (args[nc + nx + i], out) for i, out in zip(closures, outs[len(ct_carries) :], strict=False)
    ]
    grads += [
        (args[nc + i], out)
        for i, out in zip(xs, outs[len(ct_carries) + len(closures) :], strict=True)
    ]
    return grads


def _shifts(body: Body, residuals: list[int]) -> dict[int, int]:
    """The residuals that are a carry whose next value (a value the body makes) is
    stacked too, as a residual or a result: carry slot -> that value's slot."""
    made = {o for st in body.steps for o in st.outs}
    wanted = set(residuals) | set(body.ys)
    return {
        c: n
        for c, n in zip(body.carries, body.nexts, strict=True)
        if c in residuals and n in wanted and n in made
    }


def _accumulate(b: Builder, pending: dict[int, int], slot: int, g: int) -> None:
    old = pending.get(slot)
    pending[slot] = g if old is None else b.emit_args(_ADD, [old, g], {})


_ADD = OPS["add"]


class _Template(NamedTuple):
    """The steps one VJP emitted, with each argument as an index into the values a replay
    has: the ones it was given (the upstream gradient, the step's slots, its result), then
    the slots it makes (the k-th step makes the k-th), then the number literals it made,
    then the step's own arguments (a literal of the step that the VJP passes on is the
    replayed step's own: constant lifting, engine.graph.lifting, finds a literal's uses by
    its value object); and each active argument's gradient so."""

    steps: tuple[tuple[OpDef, tuple[int, ...], dict[str, Any], str, Facts | None], ...]
    metas: tuple[Meta, ...]  # of the new slots
    literals: tuple[Lit, ...]
    grads: tuple[tuple[int, int], ...]  # (argument slot's index in step.args, value index)


# A step's VJP emits the same steps whenever its op, arguments' metas (and which of them
# are the same value), literals, attributes and upstream gradient's meta are the same: an
# unrolled loop's steps are differentiated once and the template replayed. (The step's
# facts stand for its op, metas, literals and attributes: engine.graph.facts.)
_TEMPLATES = Memo(1 << 13)


def _step_vjp(b: Builder, step: Step, g: int, active: set[int]) -> list[tuple[int, int]]:
    """(argument slot, the slot of its gradient) for each active argument of `step`, whose
    result's cotangent is slot `g`."""
    args = step.args
    metas = b.metas
    facts = b.facts.get(step)
    if facts is None:
        facts = b.facts[step] = facts_of(step, metas)
    if len(args) == 2 and facts.slots_only:  # (the most, and the key of each is its own)
        a0, a1 = args
        key: tuple[Any, ...] = (
            facts,
            metas[g],
            b.create_graph,
            b.kind,
            a0 in active,
            a1 in active,
            a0 == a1,
        )
    else:
        key = (
            facts,
            metas[g],
            b.create_graph,
            b.kind,
            *[(a in active, args.index(a)) for a in args if type(a) is int],
        )
    template = _TEMPLATES.get(key)
    if template is None:
        given: list[int] = [g, *step.slots, step.out]
        first_slot, first_step = len(metas), len(b.steps)
        grads = _emit_vjp(b, step, b.syms[g], active)
        template = _record(b, first_slot, first_step, given, grads, args)
        if template is not None:
            _TEMPLATES.remember(key, template)
        return [(slot, grad.slot) for slot, grad in grads]
    slot = base = len(metas)
    metas.extend(template.metas)
    values = [
        g,
        *(args if facts.slots_only else step.slots),
        step.out,  # (what it was given)
        *range(base, len(metas)),
        *template.literals,
        *args,
    ]
    value = values.__getitem__
    steps, known, origin = b.steps, b.facts, b.origin
    for op, refs, attrs, kind, facts in template.steps:
        new = Step(op, tuple(map(value, refs)), attrs, slot, kind, origin)
        steps.append(new)
        if facts is not None:
            known[new] = facts
        slot += 1
    return [(args[i], values[r]) for i, r in template.grads]  # type: ignore[misc]


def _record(
    b: Builder,
    first_slot: int,
    first_step: int,
    given: list[int],
    grads: list[tuple[int, Sym]],
    args: tuple[Any, ...],
) -> _Template | None:
    """The template of the steps just emitted, or None if one reads a value it was not
    given (it would not replay elsewhere)."""
    made = len(b.metas) - first_slot
    literals: list[Lit] = []
    own = {id(a.value): i for i, a in enumerate(args) if type(a) is Lit}
    mine = 1 << 30  # (a reference to the step's own argument, until the literals are counted)

    def code(a: Any) -> int:
        if type(a) is Lit:
            i = own.get(id(a.value))
            if i is not None:
                return mine + i
            literals.append(a)
            return len(given) + made + len(literals) - 1
        if a >= first_slot:
            return len(given) + a - first_slot
        return given.index(a)

    emitted = b.steps[first_step:]
    if [s.out for s in emitted] != list(range(first_slot, len(b.metas))):
        return None  # (a slot made without a step, or a step out of order: not replayable)
    try:
        coded = [
            (s.op, [code(a) for a in s.args], s.attrs, s.kind, b.facts.get(s)) for s in emitted
        ]
        codes = tuple((args.index(slot), code(g.slot)) for slot, g in grads)
    except ValueError:
        return None
    first_own = len(given) + made + len(literals)
    steps = tuple(
        (op, tuple([c - mine + first_own if c >= mine else c for c in refs]), attrs, kind, facts)
        for op, refs, attrs, kind, facts in coded
    )
    return _Template(steps, tuple(b.metas[first_slot:]), tuple(literals), codes)


def _emit_vjp(b: Builder, step: Step, g: Sym, active: set[int]) -> list[tuple[int, Sym]]:
    op = step.op
    args = step.args
    saved: list[Any] = []
    for i in op.save_index:
        if i < 0:
            saved.append(b.syms[step.out])
        elif op.variadic:
            saved.append(tuple(b.arg(a) for a in args))
        else:
            saved.append(b.arg(args[i]))
    metas = b.metas
    out: list[tuple[int, Sym]] = []
    if op.variadic:
        grads = op.vjp(b, g, *saved, **step.attrs)  # type: ignore[operator,misc]
        for a, grad in zip(args, grads, strict=True):
            if type(a) is int and a in active and grad is not None:
                out.append((a, _conform(b, grad, metas[a])))
        return out
    for i, a in enumerate(args):
        rule = op.vjp[i]  # type: ignore[index]
        if type(a) is int and a in active and rule is not None:
            grad = rule(b, g, *saved, **step.attrs)
            if grad is not None:
                out.append((a, _conform(b, grad, metas[a])))
    return out


def _conform(b: Builder, g: Sym, meta: Meta) -> Sym:
    """A gradient summed back to its value's shape and cast to its dtype."""
    if g.shape != meta.shape:
        g = sum_to_shape(b, g, meta.shape)
    if g.dtype != meta.dtype:
        g = b.call("cast", g, dtype=meta.dtype)
    return g
