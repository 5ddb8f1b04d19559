"""Derivatives, loops and maps as nodes of a graph: `grad`, `jvp`, `scan`, `vmap`,
`jacobian` and `hessian`.

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
- `vmap` emits its body once, for one index, on slots that no step writes, then the body's
  batched form (engine.graph.batching), in chunks when it asks for them; the one-index
  steps are dropped. A reduction over the mapped dim adds index after index (the chunk
  before as its first row), so that chunks never change its bits.
- `jacobian` is a `vmap` of a `grad` (rev: one row per output element, its upstream
  gradient a row of the identity) or of a `jvp` (fwd: one column per input element), as
  torch.func's jacrev and jacfwd; `hessian` is the forward-mode Jacobian of the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gradserve.engine.dtypes import FLOATS
from gradserve.engine.errors import BackwardError, DTypeError, ShapeError
from gradserve.engine.graph.autodiff import vjp, vjp_all
from gradserve.engine.graph.batching import batch_steps, drop_replaced
from gradserve.engine.graph.builder import Builder, Sym, derived
from gradserve.engine.graph.ir import DERIVED
from gradserve.engine.ops.registry import Meta
from gradserve.engine.shapes import fmt, numel

# ‖wᵢ‖₂ + CLIP_EPS divides max_norm in a clipped sum, as Opacus clips.
CLIP_EPS = 1e-6


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


def emit_map(
    b: Builder,
    start: int,
    holders: dict[int, Sym],
    results: Sequence[tuple[str | None, int, float, list[int]]],
    size: int,
    chunk: int,
) -> list[Sym]:
    """The results of a vmap whose body, for one index, is `b`'s steps from `start` on:
    `holders` maps each body input's slot to its mapped argument (the mapped dim first);
    each result is (reduction or None, body slot, max_norm, norm_of body slots)."""
    parts: list[list[Sym]] = [[] for _ in results]
    totals: list[Sym | None] = [None] * len(results)
    body = b.steps[start:]
    replaced: set[int] = set()
    for lo in range(0, size, chunk):
        n = min(chunk, size - lo)
        batched = {
            slot: x if n == size else b.call("slice", x, dim=0, start=lo, stop=lo + n, step=1)
            for slot, x in holders.items()
        }
        batched = batch_steps(b, body, batched, n)
        replaced.update(batched)

        def value(slot: int, n: int = n, batched: dict[int, Sym] = batched) -> Sym:
            found = batched.get(slot)
            if found is not None:
                return found
            one = b.syms[slot]  # the same for every index
            return b.call("expand", one, shape=[n, *one.shape])

        for k, (reduce, slot, max_norm, norm_of) in enumerate(results):
            v = value(slot)
            if reduce is None:
                parts[k].append(v)
                continue
            if reduce == "clip_sum":
                v = v * _clip_factors(b, [value(s) for s in norm_of], max_norm, v.ndim)
            totals[k] = _accumulate(b, totals[k], v)
    drop_replaced(b, start, replaced)
    outs = []
    for k, (reduce, *_) in enumerate(results):
        if reduce is None:
            outs.append(parts[k][0] if len(parts[k]) == 1 else b.call("cat", *parts[k], dim=0))
        else:
            total = totals[k]
            assert total is not None
            outs.append(total / size if reduce == "mean" else total)
    return outs


def _clip_factors(b: Builder, values: list[Sym], max_norm: float, rank: int) -> Sym:
    """Per index, min(1, max_norm / (‖wᵢ‖₂ + 1e-6)) with ‖wᵢ‖₂ the norm of its values of
    every one of `values` together; shaped to multiply a batched value of `rank` dims."""
    squares = [
        b.call("sum", w * w, dim=list(range(1, w.ndim))) if w.ndim > 1 else w * w for w in values
    ]
    total = squares[0]
    for sq in squares[1:]:
        total = total + sq
    factor = b.call("clamp", max_norm / (b.call("sqrt", total) + CLIP_EPS), max=1.0)
    return b.call("reshape", factor, shape=[factor.shape[0], *([1] * (rank - 1))])


def _accumulate(b: Builder, total: Sym | None, values: Sym) -> Sym:
    """`total` plus each row of `values` in turn (zeros before the first chunk), so that
    the sum is the same, bit for bit, however the rows are chunked. The rows, after the
    total, are one contiguous array: NumPy sums its dim 0 row after row when a row has
    several float32 or float64 elements (its pairwise summation runs along a row); a
    cumsum, always in order, adds one-element rows (and float16 ones)."""
    if values.dtype not in FLOATS:
        raise DTypeError(f"a vmap reduction needs floating-point values, got {values.dtype}")
    one = values.shape[1:]
    if total is None:
        total = b.call("zeros", shape=list(one), dtype=values.dtype)
    rows = b.call("cat", b.call("unsqueeze", total, dim=0), values, dim=0)
    if numel(one) > 1 and values.dtype in ("float32", "float64"):
        return b.call("sum", rows, dim=0)
    n = rows.shape[0]
    last = b.call("slice", b.call("cumsum", rows, dim=0), dim=0, start=n - 1, stop=n, step=1)
    return b.call("reshape", last, shape=list(one))


def emit_jacobian(
    b: Builder,
    derivations: Derivations,
    args: Sequence[Any],
    mode: str,
    chunk_of: Callable[[int], int],
) -> Sym:
    """`chunk_of(n)`: how many of the n rows (rev) or columns (fwd) are computed at once."""
    output, inp = _tensors(args, ("output", "input"))
    _floating(output, "output")
    _floating(inp, "input")
    rows, cols = numel(output.shape), numel(inp.shape)
    if mode == "auto":
        mode = "fwd" if cols < rows else "rev"
    start = len(b.steps)
    with derived(b, create_graph=True, kind=DERIVED):
        if mode == "rev":  # row i: the gradient of output element i
            holder = b.value(Meta(output.shape, output.dtype))
            one = emit_grad(b, derivations, [output, inp, holder])
        else:  # column j: the derivative along input element j
            holder = b.value(Meta(inp.shape, inp.dtype))
            one = emit_jvp(b, [output, inp, holder])
        n = numel(holder.shape)
        chunk = chunk_of(n)
        body = b.steps[start:]
        parts: list[Sym] = []
        replaced: set[int] = set()
        for lo in range(0, n, chunk):
            c = min(chunk, n - lo)
            basis = b.call("eye", n=c, m=n - lo, dtype=holder.dtype)  # rows lo .. lo + c
            if lo:
                zeros = b.call("zeros", shape=[c, lo], dtype=holder.dtype)
                basis = b.call("cat", zeros, basis, dim=1)
            basis = b.call("reshape", basis, shape=[c, *holder.shape])
            batched = batch_steps(b, body, {holder.slot: basis}, c)
            replaced.update(batched)
            found = batched.get(one.slot)
            parts.append(
                found if found is not None else b.call("expand", one, shape=[c, *one.shape])
            )
        drop_replaced(b, start, replaced)
        stacked = parts[0] if len(parts) == 1 else b.call("cat", *parts, dim=0)
        if mode == "rev":
            return b.call("reshape", stacked, shape=[*output.shape, *inp.shape])
        flat = b.call("reshape", stacked, shape=[cols, rows])
        return b.call(
            "reshape", b.call("transpose", flat, dim0=0, dim1=1), shape=[*output.shape, *inp.shape]
        )


def emit_hessian(
    b: Builder, derivations: Derivations, args: Sequence[Any], chunk_of: Callable[[int], int]
) -> Sym:
    output, inp = _tensors(args, ("output", "input"))
    if numel(output.shape) != 1:
        raise BackwardError(
            f"the output has shape {fmt(output.shape)}: a Hessian is of a one-element output"
        )
    gradient = emit_grad(b, derivations, [output, inp])
    return emit_jacobian(b, derivations, [gradient, inp], "fwd", chunk_of)


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
