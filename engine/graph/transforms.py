"""Derivatives and loops as nodes of a graph: `grad`, `jvp` and `scan`.

They are not ops of the registry (nothing computes them on arrays one call at a time):
the compiler expands `grad` and `jvp` into steps of the program, with the transformation
that reverse mode already is (engine/graph/autodiff.py), and a `scan` into one loop step
(engine/graph/scan.py). Their declarations (engine/rules.py, with the ops') are what
`GET /ops` lists and what `expr` may call (`grad` and `jvp`).

- `grad(target, wrt[, grad_output])` is `torch.autograd.grad(target, wrt, grad_output,
  create_graph=True)`: the derived steps are ordinary steps, so the result can be output,
  used, and differentiated again. Every `grad` node over the same target (and upstream
  gradient) shares one derivation: it computes the cotangent of every value the target
  depends on, and dead-code elimination keeps what is used.
- `jvp(output, input, tangent)` is forward mode, built on reverse mode by the double-VJP
  construction: `uᵀ ∂y/∂x` is linear in `u`, so its VJP with respect to `u`, against the
  tangent, is `∂y/∂x · t`. It needs no JVP rule per op (the VJPs are the one place), and
  is itself differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradserve.engine.dtypes import FLOATS
from gradserve.engine.errors import BackwardError, DTypeError, ShapeError
from gradserve.engine.graph.autodiff import vjp, vjp_all
from gradserve.engine.graph.builder import Builder, Sym, derived
from gradserve.engine.graph.ir import DERIVED
from gradserve.engine.shapes import fmt, numel


class Derivations:
    """The cotangents derived for each (target, upstream gradient) of a program: `grad`
    nodes over the same target share them."""

    def __init__(self) -> None:
        self._by_target: dict[tuple[int, int | None], dict[int, Sym]] = {}

    def cotangents(self, b: Builder, target: Sym, upstream: Sym | None) -> dict[int, Sym]:
        key = (target.slot, None if upstream is None else upstream.slot)
        found = self._by_target.get(key)
        if found is None:
            with derived(b, create_graph=True, kind=DERIVED):
                seed = (
                    upstream
                    if upstream is not None
                    else b.call("ones", shape=list(target.shape), dtype=target.dtype)
                )
            found = self._by_target[key] = vjp_all(
                b, list(b.steps), [(target.slot, seed)], create_graph=True, kind=DERIVED
            )
        return found


def emit_grad(b: Builder, derivations: Derivations, args: Sequence[Any]) -> Sym:
    target, wrt = _tensors(args[:2], ("target", "wrt"))
    upstream = _tensors(args[2:], ("grad_output",))[0] if len(args) > 2 else None
    _floating(target, "target")
    _floating(wrt, "wrt")
    if upstream is None:
        if numel(target.shape) != 1:
            raise BackwardError(
                f"the target has shape {fmt(target.shape)}: only a one-element target gets "
                "the implicit gradient 1; give grad_output (the third argument)"
            )
    else:
        _like(upstream, target, "grad_output", "the target")
    found = derivations.cotangents(b, target, upstream).get(wrt.slot)
    if found is None:  # the target does not depend on it
        with derived(b, create_graph=True, kind=DERIVED):
            return b.call("zeros", shape=list(wrt.shape), dtype=wrt.dtype)
    return found


def emit_jvp(b: Builder, args: Sequence[Any]) -> Sym:
    output, inp, tangent = _tensors(args, ("output", "input", "tangent"))
    _floating(output, "output")
    _floating(inp, "input")
    _like(tangent, inp, "tangent", "the input")
    steps = list(b.steps)
    with derived(b, create_graph=True, kind=DERIVED):
        # A cotangent of the output's shape that the result does not depend on (it is
        # linear in it): a step of its own, which nothing else may share.
        u = b.call("zeros", shape=list(output.shape), dtype=output.dtype)
    (pulled,) = vjp(b, steps, [(output.slot, u)], [inp.slot], create_graph=True, kind=DERIVED)
    with derived(b, create_graph=True, kind=DERIVED):
        if pulled is None:  # the output does not depend on the input
            return b.call("zeros", shape=list(output.shape), dtype=output.dtype)
        total = b.call("sum", pulled * tangent)
        seed = b.call("ones", shape=[], dtype=total.dtype)
    (pushed,) = vjp(
        b, list(b.steps), [(total.slot, seed)], [u.slot], create_graph=True, kind=DERIVED
    )
    if pushed is None:
        with derived(b, create_graph=True, kind=DERIVED):
            return b.call("zeros", shape=list(output.shape), dtype=output.dtype)
    return pushed


def _tensors(args: Sequence[Any], names: Sequence[str]) -> list[Sym]:
    for value, name in zip(args, names, strict=False):
        if type(value) is not Sym:
            raise DTypeError(f"{name} must be a tensor (a node or an input), not a number")
    return list(args)


def _floating(value: Sym, name: str) -> None:
    if value.dtype not in FLOATS:
        raise DTypeError(f"{name} must be floating point to differentiate, got {value.dtype}")


def _like(value: Sym, like: Sym, name: str, what: str) -> None:
    """`value` must have `like`'s shape and dtype: no silent casts."""
    if value.shape != like.shape:
        raise ShapeError(
            f"{name} has shape {fmt(value.shape)} but {what} has shape {fmt(like.shape)}"
        )
    if value.dtype != like.dtype:
        raise DTypeError(f"{name} has dtype {value.dtype} but {what} has dtype {like.dtype}")
