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

from engine.dtypes import FLOATS
from engine.graph.builder import Builder, Memo, Sym, derived
from engine.graph.ir import Lit, Step
from engine.ops.registry import Meta, OpDef
from engine.shapes import sum_to_shape


def active_slots(b: Builder, steps: Iterable[Step], wrt: Iterable[int]) -> set[int]:
    """The slots that depend on `wrt` through differentiable arguments: PyTorch's
    requires_grad, propagated statically."""
    active = set(wrt)
    metas = b.metas
    for step in steps:
        op = step.op
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
) -> list[Sym | None]:
    """The vector-Jacobian product of `steps` (a prefix of `b.steps`, in run order): for
    each slot in `wrt`, the sum over `cotangents` (slot, upstream gradient) of
    gradientᵀ · ∂slot_value/∂wrt, or None where no cotangent reaches it. `create_graph`:
    the emitted backward will itself be differentiated (PyTorch's grad mode during
    backward; some VJPs answer differently then, as PyTorch's do)."""
    active = active_slots(b, steps, wrt)
    wanted = set(wrt)
    captured: dict[int, Sym] = {}
    pending: dict[int, Sym] = {}
    with derived(b, create_graph=create_graph):
        for slot, g in cotangents:
            if slot in active:
                _accumulate(b, pending, slot, g)
        for step in reversed(steps):
            if step.out not in pending:
                continue
            g = pending.pop(step.out)
            if step.out in wanted:
                captured[step.out] = g
            b.origin = step.origin
            for slot, grad in _step_vjp(b, step, g, active):
                _accumulate(b, pending, slot, grad)
    captured.update((s, g) for s, g in pending.items() if s in wanted)
    return [captured.get(s) for s in wrt]


def _accumulate(b: Builder, pending: dict[int, Sym], slot: int, g: Sym) -> None:
    old = pending.get(slot)
    pending[slot] = g if old is None else b.call("add", old, g)


class _Template(NamedTuple):
    """The steps one VJP emitted, with their slots relative: a new slot as its offset from
    the first slot the VJP made (>= 0), a value it was given as -1 - its place among the
    upstream gradient and the saved values; and each active argument's gradient so."""

    steps: tuple[tuple[OpDef, tuple[Any, ...], dict[str, Any], Meta, str], ...]
    grads: tuple[tuple[int, int], ...]  # (argument slot's index in step.args, slot code)


# A step's VJP emits the same steps whenever its op, arguments' metas (and which of them
# are the same value), literals, attributes and upstream gradient's meta are the same: an
# unrolled loop's steps are differentiated once and the template replayed.
_TEMPLATES = Memo(1 << 13)


def _step_vjp(b: Builder, step: Step, g: Sym, active: set[int]) -> list[tuple[int, Sym]]:
    """(argument slot, its gradient) for each active argument of `step`."""
    args = step.args
    metas = b.metas
    key = (step.op, g.meta, b.create_graph,
           *[(metas[a], a in active, args.index(a)) if type(a) is int
             else (type(a.value), a.value) for a in args],  # type: ignore[union-attr]
           *[tuple(v) if type(v) is list else v for v in step.attrs.values()])
    given = [g.slot, *_saved_slots(step), step.out]
    template = _TEMPLATES.get(key)
    if template is None:
        first_slot, first_step = len(metas), len(b.steps)
        grads = _emit_vjp(b, step, g, active)
        template = _record(b, first_slot, first_step, given, grads, args)
        if template is not None:
            _TEMPLATES.remember(key, template)
        return grads
    base = len(metas)
    syms = b.syms
    for op, refs, attrs, meta, kind in template.steps:
        step_args = tuple([r if type(r) is Lit else (base + r if r >= 0 else given[-1 - r])
                           for r in refs])
        slot = b.value(meta).slot
        b.steps.append(Step(op, step_args, attrs, slot, kind, b.origin))
    return [(args[i], syms[base + r if r >= 0 else given[-1 - r]])  # type: ignore[misc]
            for i, r in template.grads]


def _saved_slots(step: Step) -> list[int]:
    return [a for a in step.args if type(a) is int]  # type: ignore[misc]


def _record(b: Builder, first_slot: int, first_step: int, given: list[int],
            grads: list[tuple[int, Sym]], args: tuple[Any, ...]) -> _Template | None:
    """The template of the steps just emitted, or None if one reads a value it was not
    given (it would not replay elsewhere)."""

    def code(slot: int) -> int:
        if slot >= first_slot:
            return slot - first_slot
        return -1 - given.index(slot)

    try:
        steps = tuple((s.op, tuple([a if type(a) is Lit else code(a)  # type: ignore[arg-type]
                                    for a in s.args]), s.attrs, b.metas[s.out], s.kind)
                      for s in b.steps[first_step:])
        codes = tuple((args.index(slot), code(g.slot)) for slot, g in grads)
    except ValueError:
        return None
    return _Template(steps, codes)


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
