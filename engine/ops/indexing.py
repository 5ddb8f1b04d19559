"""Indexing ops: slice, index_select, gather, scatter_add (PyTorch's semantics)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from gradserve.engine.dtypes import INTS
from gradserve.engine.errors import AttributeError_, DTypeError, ShapeError
from gradserve.engine.ops.common import is_number
from gradserve.engine.ops.registry import Attr, Meta, OpDef, register
from gradserve.engine.shapes import fmt, normalize_dim, numel

# ---------------------------------------------------------------- helpers


def _check_index_dtype(dtype: str, what: str = "index") -> None:
    if dtype not in INTS:
        raise DTypeError(f"{what} must be an integer tensor (int32 or int64), got {dtype}")


def _check_index(xp: Any, index: Any, size: int, dim: int) -> None:
    """The runtime half of the index checks: integer dtype, every value in [0, size)."""
    if not xp.isdtype(index.dtype, "integral"):
        raise DTypeError(f"index must be an integer tensor (int32 or int64), got {index.dtype}")
    if numel(index.shape):
        _in_range(int(xp.min(index)), int(xp.max(index)), size, dim)


def _defer_index_check(xp: Any, index: Any, size: int, dim: int) -> None:
    """`_check_index` in the XLA tier, which cannot read the index while it runs: the
    range check runs on the host after the run (inside a loop, on every iteration's least
    and greatest index at once; the dtype is the shape rule's)."""
    if numel(index.shape):
        xp.defer(IndexRange(size, dim), xp.min(index), xp.max(index))


@dataclass(frozen=True)
class IndexRange:
    """The range check of an index, on its least and greatest values: data, so that an
    executable that defers it can be stored and loaded again (engine.graph.xla)."""

    size: int
    dim: int

    def __call__(self, low: Any, high: Any) -> None:
        _in_range(int(low.min()), int(high.max()), self.size, self.dim)


def _in_range(low: int, high: int, size: int, dim: int) -> None:
    # Negative indices are refused, as PyTorch does (NumPy would wrap them).
    for bad in (low, high):
        if not 0 <= bad < size:
            raise ShapeError(f"index {bad} is out of bounds for dim {dim} with size {size}")


def _literal_error(op: str, arg: str) -> DTypeError:
    return DTypeError(f"{arg} must be a tensor, not a number literal (as in PyTorch)", op=op)


def _tensor_args(op: str, names: tuple[str, ...]) -> tuple[Any, Any]:
    """(check_args, infer wrapper) that refuse a number literal in any argument: PyTorch's
    index_select, gather and scatter_add take tensors only, and an op's forward reads
    `.shape` and `.ndim` of each."""

    def check_args(xp: Any, *values: Any) -> None:
        for name, v in zip(names, values, strict=True):
            if is_number(v):
                raise _literal_error(op, name)

    def tensors_only(rule: Any) -> Any:
        def infer(metas: list[Meta], **attrs: Any) -> Meta:
            for name, m in zip(names, metas, strict=True):
                if m.literal:
                    raise _literal_error(op, name)
            return rule(metas, **attrs)

        return infer

    return check_args, tensors_only


_INDEX_SELECT = _tensor_args("index_select", ("input", "index"))
_GATHER = _tensor_args("gather", ("input", "index"))
_SCATTER_ADD = _tensor_args("scatter_add", ("input", "index", "src"))


def _as_1d(xp: Any, a: Any) -> Any:
    """0-d operands work as shape (1,): the array API's take and scatter want a dim."""
    return xp.reshape(a, (1,)) if a.ndim == 0 else a


def _leading(shape: tuple[int, ...], limit: tuple[int, ...], dim: int) -> tuple[slice, ...]:
    """The index tuple that cuts `shape` to `limit` in every dim but `dim`."""
    return tuple(slice(None) if d == dim else slice(0, n) for d, n in enumerate(limit))


def _pad_to(F: Any, g: Any, like: Any) -> Any:
    """`g` with zeros appended at the end of each dim up to `like`'s shape."""
    for d, n in enumerate(like.shape):
        have = g.shape[d]
        if have < n:
            block = _cut(F, F.slice(like, dim=d, start=have, stop=n, step=1), tuple(g.shape), d)
            g = F.cat(g, F.zeros_like(block), dim=d)
    return g


def _cut(F: Any, a: Any, shape: tuple[int, ...], skip: int) -> Any:
    """`a` cut to `shape` in every dim but `skip`."""
    for d, n in enumerate(shape):
        if d != skip and a.shape[d] != n:
            a = F.slice(a, dim=d, start=0, stop=n, step=1)
    return a


# ---------------------------------------------------------------- slice


def slice_range(
    shape: tuple[int, ...], dim: int, start: int, stop: int | None, step: int
) -> tuple[int, int, int, int]:
    """(dim, start, stop, length) of Python slicing on one dim, bounds clamped."""
    if not shape:
        raise ShapeError("cannot slice a 0-d tensor")
    if step <= 0:
        raise AttributeError_(f"step must be positive, got {step}", loc=("attrs", "step"))
    d = normalize_dim(dim, len(shape))
    begin, end, _ = slice(start, stop, step).indices(shape[d])
    return d, begin, end, len(range(begin, end, step))


def _slice(xp: Any, x: Any, *, dim: int, start: int, stop: int | None, step: int) -> Any:
    d, begin, end, _ = slice_range(tuple(x.shape), dim, start, stop, step)
    return x[(slice(None),) * d + (slice(begin, end, step),) + (slice(None),) * (x.ndim - d - 1)]


def _slice_infer(metas: list[Meta], *, dim: int, start: int, stop: int | None, step: int) -> Meta:
    shape = metas[0].shape
    d, _, _, length = slice_range(shape, dim, start, stop, step)
    return Meta((*shape[:d], length, *shape[d + 1 :]), metas[0].dtype)


def _slice_vjp(F: Any, g: Any, x: Any, *, dim: int, start: int, stop: int | None, step: int) -> Any:
    shape = tuple(x.shape)
    d, begin, _, length = slice_range(shape, dim, start, stop, step)
    if length == 0:
        return F.zeros_like(x)
    if step > 1:
        # Interleave step - 1 zeros after each element, then drop the trailing ones.
        g = F.unsqueeze(g, dim=d + 1)
        gap = list(g.shape)
        gap[d + 1] = step - 1
        g = F.cat(g, F.zeros_like(F.expand(g, shape=gap)), dim=d + 1)
        g = F.flatten(g, start_dim=d, end_dim=d + 1)
        g = F.slice(g, dim=d, start=0, stop=(length - 1) * step + 1, step=1)
    span = (length - 1) * step + 1
    parts = []
    if begin > 0:
        parts.append(F.zeros_like(F.slice(x, dim=d, start=0, stop=begin, step=1)))
    parts.append(g)
    if begin + span < shape[d]:
        parts.append(F.zeros_like(F.slice(x, dim=d, start=begin + span, stop=None, step=1)))
    return F.cat(*parts, dim=d) if len(parts) > 1 else g


# ---------------------------------------------------------------- index_select


def _index_select_infer(metas: list[Meta], *, dim: int) -> Meta:
    x, index = metas
    _check_index_dtype(index.dtype)
    if len(index.shape) > 1:
        raise ShapeError(f"index_select: index must be 0-d or 1-d, got shape {fmt(index.shape)}")
    d = normalize_dim(dim, len(x.shape))
    if not x.shape:
        if numel(index.shape) != 1:
            raise ShapeError(
                f"index_select: index into a 0-d tensor must have 1 value, got {fmt(index.shape)}"
            )
        return Meta((), x.dtype)
    return Meta((*x.shape[:d], numel(index.shape), *x.shape[d + 1 :]), x.dtype)


def _index_select(xp: Any, x: Any, index: Any, *, dim: int, check: Any = _check_index) -> Any:
    """index_select's forward, the index checked by `check` (`_check_index` or, in the XLA
    tier, `_defer_index_check`)."""
    d = normalize_dim(dim, x.ndim)
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 0-d or 1-d, got shape {fmt(index.shape)}")
    check(xp, index, x.shape[d] if x.ndim else 1, dim)
    if x.ndim == 0:
        return xp.reshape(xp.take(_as_1d(xp, x), _as_1d(xp, index), axis=0), ())
    return xp.take(x, _as_1d(xp, index), axis=d)


def _index_select_vjp(F: Any, g: Any, x: Any, index: Any, *, dim: int) -> Any:
    if not x.shape:
        return g
    d = normalize_dim(dim, len(x.shape))
    # Scatter the rows back, with the index broadcast over the gradient's other dims.
    line = [1] * len(g.shape)
    line[d] = g.shape[d]
    index = F.expand(F.reshape(index, shape=line), shape=list(g.shape))
    return F.scatter_add(F.zeros_like(x), index, g, dim=d)


# ---------------------------------------------------------------- gather, scatter_add


def _gather_shapes(op: str, x: tuple[int, ...], index: tuple[int, ...], dim: int) -> int:
    if len(index) != len(x):
        raise ShapeError(
            f"{op}: index must have as many dims as the input, got {fmt(index)} and {fmt(x)}"
        )
    d = normalize_dim(dim, len(x))
    if any(i != d and n > m for i, (n, m) in enumerate(zip(index, x, strict=True))):
        raise ShapeError(
            f"{op}: index {fmt(index)} must be no larger than the input {fmt(x)} "
            f"apart from dim {dim}"
        )
    return d


def _gather_infer(metas: list[Meta], *, dim: int) -> Meta:
    x, index = metas
    _check_index_dtype(index.dtype)
    _gather_shapes("gather", x.shape, index.shape, dim)
    return Meta(index.shape, x.dtype)


def _gather(xp: Any, x: Any, index: Any, *, dim: int, check: Any = _check_index) -> Any:
    """gather's forward, the index checked by `check` (as `_index_select`'s)."""
    d = _gather_shapes("gather", tuple(x.shape), tuple(index.shape), dim)
    check(xp, index, x.shape[d] if x.ndim else 1, dim)
    if x.ndim == 0:
        return xp.reshape(_as_1d(xp, x)[_as_1d(xp, index)], ())
    # Torch's index may be smaller than the input in the other dims: cut the input to it.
    x = x[_leading(tuple(x.shape), tuple(index.shape), d)]
    return xp.take_along_axis(x, index, axis=d)


def _gather_vjp(F: Any, g: Any, x: Any, index: Any, *, dim: int) -> Any:
    return F.scatter_add(F.zeros_like(x), index, g, dim=dim)


def _scatter_add_shapes(
    x: tuple[int, ...], index: tuple[int, ...], src: tuple[int, ...], dim: int
) -> int:
    d = _gather_shapes("scatter_add", x, index, dim)
    if len(src) != len(index) or any(n > m for n, m in zip(index, src, strict=True)):
        raise ShapeError(
            f"scatter_add: index {fmt(index)} must be no larger than src {fmt(src)} in every dim"
        )
    return d


def _scatter_add_infer(metas: list[Meta], *, dim: int) -> Meta:
    x, index, src = metas
    _check_index_dtype(index.dtype)
    _scatter_add_shapes(x.shape, index.shape, src.shape, dim)
    if src.dtype != x.dtype:
        raise DTypeError(f"scatter_add: src must have the input's dtype {x.dtype}, got {src.dtype}")
    return Meta(x.shape, x.dtype)


def _scatter_add(
    xp: Any, x: Any, index: Any, src: Any, *, dim: int, check: Any = _check_index
) -> Any:
    """scatter_add's forward, the index checked by `check` (as `_index_select`'s)."""
    d = _scatter_add_shapes(tuple(x.shape), tuple(index.shape), tuple(src.shape), dim)
    if src.dtype != x.dtype:
        raise DTypeError(f"scatter_add: src must have the input's dtype {x.dtype}, got {src.dtype}")
    check(xp, index, x.shape[d] if x.ndim else 1, dim)
    if x.ndim == 0:
        out = xp.scatter_add(_as_1d(xp, x), 0, _as_1d(xp, index), _as_1d(xp, src))
        return xp.reshape(out, ())
    return xp.scatter_add(x, d, index, src)


def _scatter_add_src_vjp(F: Any, g: Any, index: Any, src: Any, *, dim: int) -> Any:
    # Entries of src beyond the index's extent are not read: their gradient is 0.
    return _pad_to(F, F.gather(g, index, dim=dim), src)


_INDEX_DIM = Attr("int", doc="the dim the index runs along")

register(
    OpDef(
        name="slice",
        group="indexing",
        doc="Python slicing x[start:stop:step] on one dim (step > 0; bounds clamped).",
        args=("input",),
        views_input=True,
        forward=_slice,
        infer=_slice_infer,
        vjp=(_slice_vjp,),
        save=("input",),
        attrs={
            "dim": Attr("int", doc="the dim to slice"),
            "start": Attr("int", 0, doc="first index (negative counts from the end)"),
            "stop": Attr("int", None, doc="end, exclusive (null: the end)", nullable=True),
            "step": Attr("int", 1, doc="stride, positive"),
        },
        positional_attrs=("dim", "start", "stop", "step"),
    ),
    OpDef(
        name="index_select",
        group="indexing",
        doc="The entries at an int index (0-d or 1-d) along `dim`, as torch.index_select.",
        args=("input", "index"),
        forward=_index_select,
        lower=partial(_index_select, check=_defer_index_check),
        infer=_INDEX_SELECT[1](_index_select_infer),
        check_args=_INDEX_SELECT[0],
        vjp=(_index_select_vjp, None),
        save=("input", "index"),
        attrs={"dim": _INDEX_DIM},
        call_order=("input", "dim", "index"),
    ),
    OpDef(
        name="gather",
        group="indexing",
        doc="`out[i][j] = input[index[i][j]][j]` along `dim`, as torch.gather "
        "(repeated indices sum their gradients).",
        args=("input", "index"),
        forward=_gather,
        lower=partial(_gather, check=_defer_index_check),
        infer=_GATHER[1](_gather_infer),
        check_args=_GATHER[0],
        vjp=(_gather_vjp, None),
        save=("input", "index"),
        attrs={"dim": _INDEX_DIM},
        call_order=("input", "dim", "index"),
    ),
    OpDef(
        name="scatter_add",
        group="indexing",
        doc="input with src added at index along `dim` (repeats accumulate), "
        "as torch.Tensor.scatter_add.",
        args=("input", "index", "src"),
        forward=_scatter_add,
        lower=partial(_scatter_add, check=_defer_index_check),
        infer=_SCATTER_ADD[1](_scatter_add_infer),
        check_args=_SCATTER_ADD[0],
        vjp=(lambda F, g, index, src, *, dim: g, None, _scatter_add_src_vjp),
        save=("index", "src"),
        attrs={"dim": _INDEX_DIM},
        call_order=("input", "dim", "index", "src"),
    ),
)
