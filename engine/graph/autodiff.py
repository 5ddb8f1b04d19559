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
from typing import Any

from engine.dtypes import FLOATS
from engine.graph.builder import Builder, Sym, derived
from engine.graph.ir import Step
from engine.ops.registry import Meta
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


def _step_vjp(b: Builder, step: Step, g: Sym, active: set[int]) -> list[tuple[int, Sym]]:
    """(argument slot, its gradient) for each active argument of `step`."""
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
