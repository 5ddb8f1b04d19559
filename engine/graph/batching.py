"""Batching: the steps of a program run for a whole batch at once (what `vmap` compiles to).

`batch_steps` takes steps already emitted for one index of a batch (their values are those
of one slice) and emits, after them, the same computation for `size` indices: every value
that depends on a batched one gets a leading dim of `size`. A step that depends on no
batched value is not touched: it runs once, as before (what JAX calls an unbatched value).
Each op has a rule that says how its batched form is written with the registry's own ops
(an elementwise op broadcasts, a reduction's dims move up by one, a matmul's operands get
batch dims); an op with no rule (index_select with a mapped index, a `scan` step) runs once
per index and its results are stacked, so every op batches, some faster than others. The
rules write ordinary steps: the batched program is planned, priced, differentiated and
lowered like any other.

The one-index steps stay behind with no reader once their batched forms exist: the caller
removes them (`drop_replaced`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradserve.engine.graph.builder import Builder, Sym
from gradserve.engine.graph.ir import Lit, Step
from gradserve.engine.ops import OPS
from gradserve.engine.ops.linalg import EINSUM_LETTERS, parse_einsum
from gradserve.engine.ops.registry import Meta

Value = Any  # a Sym or a number


def batch_steps(
    b: Builder, steps: Sequence[Step], batched: dict[int, Sym], size: int
) -> dict[int, Sym]:
    """Emit onto `b` the batched form of each of `steps` that reads a batched value;
    `batched` maps a slot of one index to its batched value (leading dim `size`), and is
    returned extended with the slots those steps write."""
    saved = b.kind, b.origin, b.simplify
    b.simplify = False  # (an identity step of one index is not one of the batch)
    try:
        for step in steps:
            reads = step.slots
            if not any(s in batched for s in reads):
                continue
            b.kind, b.origin = step.kind, step.origin
            args: list[Value] = []
            is_batched: list[bool] = []
            metas: list[Meta | None] = []
            for a in step.args:
                if type(a) is int:
                    value = batched.get(a)
                    args.append(value if value is not None else b.syms[a])
                    is_batched.append(value is not None)
                    metas.append(b.metas[a])
                else:
                    args.append(a.value)  # type: ignore[union-attr]
                    is_batched.append(False)
                    metas.append(None)
            call = _Call(step, args, is_batched, metas, b.metas[step.out], size)
            if step.op.name == "scan":
                batched.update(zip(step.outs, _per_index(b, call), strict=True))
            else:
                batched[step.out] = _RULES.get(step.op.name, _unrolled)(b, call)
    finally:
        b.kind, b.origin, b.simplify = saved
    return batched


def drop_replaced(b: Builder, start: int, replaced: set[int]) -> None:
    """Remove from `b` the steps at or after `start` that write a slot of `replaced` (the
    one-index steps whose batched forms were emitted): nothing reads them any more."""
    kept = b.steps[:start]
    for step in b.steps[start:]:
        if step.out in replaced:
            b.facts.pop(step, None)
        else:
            kept.append(step)
    b.steps[:] = kept


# ---------------------------------------------------------------- helpers


def _lift(b: Builder, x: Sym, meta: Meta, rank: int, size: int) -> Sym:
    """A batched value of one-index rank `len(meta.shape)`, with size-1 dims put after
    the batch dim so that it broadcasts as a value of `rank` dims does."""
    missing = rank - len(meta.shape)
    if missing <= 0:
        return x
    return b.call("reshape", x, shape=[size, *([1] * missing), *meta.shape])


def _full_batch(b: Builder, x: Value, meta: Meta | None, batched: bool, size: int) -> Value:
    """A value with the batch dim: an unbatched one expanded (a view, no copy)."""
    if batched or meta is None:
        return x
    return b.call("expand", x, shape=[size, *meta.shape])


def _dims(dim: int | list[int] | None, rank: int) -> list[int]:
    """One-index dims (all of them for None) as dims of the batched value."""
    if dim is None:
        return list(range(1, rank + 1))
    return [d % rank + 1 for d in ([dim] if isinstance(dim, int) else dim)]


# ---------------------------------------------------------------- rules


@dataclass(slots=True)
class _Call:
    """One step to batch: its arguments (batched values where `batched`), their one-index
    metas (None for a number), its one-index result's meta, and the batch size."""

    step: Step
    args: list[Value]
    batched: list[bool]
    metas: list[Meta | None]
    out: Meta
    size: int

    @property
    def rank(self) -> int:
        """The one-index rank of the first argument."""
        return len(self.metas[0].shape)  # type: ignore[union-attr]


def _elementwise(b: Builder, c: _Call) -> Sym:
    rank = len(c.out.shape)
    values = [
        _lift(b, a, m, rank, c.size) if batched and m is not None else a
        for a, batched, m in zip(c.args, c.batched, c.metas, strict=True)
    ]
    return b.emit(c.step.op, values, c.step.attrs)


def _reduction(b: Builder, c: _Call) -> Sym:
    if c.rank == 0:
        return _unrolled(b, c)
    dim = c.step.attrs["dim"]
    dims = _dims(dim, c.rank)
    return b.emit(
        c.step.op, c.args, {**c.step.attrs, "dim": dims[0] if isinstance(dim, int) else dims}
    )


def _along_dim(b: Builder, c: _Call) -> Sym:
    """cumsum, softmax, log_softmax, slice, and index_select with an unbatched index."""
    if c.rank == 0 or any(c.batched[1:]):
        return _unrolled(b, c)
    return b.emit(c.step.op, c.args, {**c.step.attrs, "dim": c.step.attrs["dim"] % c.rank + 1})


def _view(b: Builder, c: _Call) -> Sym:
    """reshape, squeeze, unsqueeze, flatten: the result's one-index shape, batched."""
    return b.call("reshape", c.args[0], shape=[c.size, *c.out.shape])


def _expand(b: Builder, c: _Call) -> Sym:
    x = _lift(b, c.args[0], c.metas[0], len(c.out.shape), c.size)  # type: ignore[arg-type]
    return b.call("expand", x, shape=[c.size, *c.out.shape])


def _joined(b: Builder, c: _Call) -> Sym:
    """cat and stack: every operand with the batch dim, the dim moved up. (cat skips 1-D
    empty operands, as torch.cat does: with the batch dim they would not be.)"""
    operands = list(zip(c.args, c.metas, c.batched, strict=True))
    if c.step.op.name == "stack":
        rank = len(c.out.shape)
    else:
        operands = [o for o in operands if o[1].shape != (0,)]  # type: ignore[union-attr]
        rank = len(operands[0][1].shape) if operands else 0  # type: ignore[union-attr]
        if not rank:
            return _unrolled(b, c)
    values = [_full_batch(b, a, m, f, c.size) for a, m, f in operands]
    return b.emit(c.step.op, values, {"dim": c.step.attrs["dim"] % rank + 1})


def _transpose(b: Builder, c: _Call) -> Sym:
    if c.rank == 0:
        return _unrolled(b, c)
    dim0, dim1 = (c.step.attrs[k] % c.rank + 1 for k in ("dim0", "dim1"))
    return b.call("transpose", c.args[0], dim0=dim0, dim1=dim1)


def _permute(b: Builder, c: _Call) -> Sym:
    dims = [0, *(d % c.rank + 1 for d in c.step.attrs["dims"])] if c.rank else [0]
    return b.call("permute", c.args[0], dims=dims)


def _matmul(b: Builder, c: _Call) -> Sym:
    """A vector operand is read as a matrix (a row on the left, a column on the right), as
    matmul reads it; a batched operand gets the batch dim first, then size-1 batch dims up
    to the other's, so that the batch dims broadcast as the one-index ones did."""
    x, y = c.args
    xs, ys = (m.shape for m in c.metas)  # type: ignore[union-attr]
    x2 = (1, *xs) if len(xs) == 1 else xs
    y2 = (*ys, 1) if len(ys) == 1 else ys
    rank = max(len(x2), len(y2))
    if c.batched[0]:
        x = b.call("reshape", x, shape=[c.size, *([1] * (rank - len(x2))), *x2])
    if c.batched[1]:
        y = b.call("reshape", y, shape=[c.size, *([1] * (rank - len(y2))), *y2])
    product = b.call("matmul", x, y)
    want = (c.size, *c.out.shape)
    return product if product.shape == want else b.call("reshape", product, shape=list(want))


def _einsum(b: Builder, c: _Call) -> Sym:
    shapes = [m.shape for m in c.metas]  # type: ignore[union-attr]
    subs, result, _ = parse_einsum(c.step.attrs["equation"], shapes)
    used = set("".join(subs) + result)
    letter = next(x for x in EINSUM_LETTERS if x not in used)
    terms = [letter + s if f else s for s, f in zip(subs, c.batched, strict=True)]
    return b.call("einsum", *c.args, equation=f"{','.join(terms)}->{letter}{result}")


def _solve(b: Builder, c: _Call) -> Sym:
    """One matrix and a vector or a matrix: both with the batch dim, which keeps solve's
    reading of B (a vector when it has A's shape without A's last dim)."""
    if c.rank != 2 or len(c.metas[1].shape) > 2:  # type: ignore[union-attr]
        return _unrolled(b, c)
    a, v = (
        _full_batch(b, x, m, f, c.size) for x, m, f in zip(c.args, c.metas, c.batched, strict=True)
    )
    return b.call("solve", a, v)


def _cross(b: Builder, c: _Call) -> Sym:
    """Both operands broadcast to the batched result's shape."""
    rank, want = len(c.out.shape), [c.size, *c.out.shape]
    a, v = (
        b.call("expand", _lift(b, x, m, rank, c.size) if f else x, shape=want)  # type: ignore[arg-type]
        for x, m, f in zip(c.args, c.metas, c.batched, strict=True)
    )
    return b.call("cross", a, v, dim=c.step.attrs["dim"] % rank + 1)


def _indexed(b: Builder, c: _Call) -> Sym:
    """gather and scatter_add: every operand with the batch dim (an index of one index's
    rank, as they take it), the dim moved up."""
    if c.rank == 0:
        return _unrolled(b, c)
    values = [
        _full_batch(b, a, m, f, c.size) for a, m, f in zip(c.args, c.metas, c.batched, strict=True)
    ]
    return b.emit(c.step.op, values, {"dim": c.step.attrs["dim"] % c.rank + 1})


def _as_batches(b: Builder, c: _Call) -> Sym:
    """det and inv, which take batches of matrices as they are."""
    return b.emit(c.step.op, c.args, c.step.attrs)


def _unrolled(b: Builder, c: _Call) -> Sym:
    """An op without a rule: once per index, the results stacked."""
    runs = [b.emit(c.step.op, values, c.step.attrs) for values in _index_args(b, c)]
    return b.call("stack", *runs, dim=0)


def _per_index(b: Builder, c: _Call) -> list[Sym]:
    """A step of several results (a loop): once per index, each result stacked."""
    step = c.step
    runs: list[list[Sym]] = []
    for values in _index_args(b, c):
        outs = [b.value(b.metas[o]) for o in step.outs]
        body = step.attrs["body"]
        copy = replace(body, steps=list(body.steps), ys=list(body.ys), wanted=[], program=None)
        b.steps.append(
            Step(
                step.op,
                tuple(v.slot if type(v) is Sym else Lit(v) for v in values),
                {**step.attrs, "body": copy},
                outs[0].slot,
                step.kind,
                step.origin,
                tuple(o.slot for o in outs[1:]),
            )
        )
        runs.append(outs)
    return [b.call("stack", *column, dim=0) for column in zip(*runs, strict=True)]


def _index_args(b: Builder, c: _Call) -> list[list[Value]]:
    """The arguments of each index: a batched value's slice at it, the others as they are."""
    out = []
    for i in range(c.size):
        values = []
        for a, batched, m in zip(c.args, c.batched, c.metas, strict=True):
            if batched:
                row = b.call("slice", a, dim=0, start=i, stop=i + 1, step=1)
                a = b.call("reshape", row, shape=list(m.shape))  # type: ignore[union-attr]
            values.append(a)
        out.append(values)
    return out


_RULES: dict[str, Callable[[Builder, _Call], Sym]] = {
    **dict.fromkeys(
        [
            name
            for name, op in OPS.items()
            if op.group in ("arithmetic", "comparison", "selection", "elementwise")
        ]
        + ["cast", "detach"],
        _elementwise,
    ),
    **dict.fromkeys(["sum", "mean", "prod", "max", "min", "logsumexp", "var"], _reduction),
    **dict.fromkeys(["cumsum", "softmax", "log_softmax", "slice", "index_select"], _along_dim),
    **dict.fromkeys(["reshape", "squeeze", "unsqueeze", "flatten"], _view),
    "expand": _expand,
    "cat": _joined,
    "stack": _joined,
    "transpose": _transpose,
    "permute": _permute,
    "matmul": _matmul,
    "einsum": _einsum,
    "solve": _solve,
    "cross": _cross,
    "gather": _indexed,
    "scatter_add": _indexed,
    "det": _as_batches,
    "inv": _as_batches,
}
