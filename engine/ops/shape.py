"""Shape ops: reshape, expand, squeeze, unsqueeze, flatten, cat, stack."""

from __future__ import annotations

from typing import Any

from gradserve.engine.errors import ShapeError
from gradserve.engine.ops.registry import Attr, Meta, OpDef, promoted_dtype, register
from gradserve.engine.shapes import fmt, normalize_dim, normalize_dims, numel, sum_to_shape


def reshape_target(shape: tuple[int, ...], target: Any) -> tuple[int, ...]:
    """PyTorch's reshape rule: one -1 is inferred; the element count must match."""
    target = [target] if isinstance(target, int) else list(target)
    unknown = [i for i, n in enumerate(target) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in target):
        raise ShapeError(f"invalid shape {target}: only one dimension can be -1, and none < -1")
    total = numel(shape)
    if unknown:
        rest = numel([n for n in target if n != -1])
        if rest == 0 or total % rest:
            raise ShapeError(f"shape {target} is invalid for input of size {total}")
        target[unknown[0]] = total // rest
    if numel(target) != total:
        raise ShapeError(f"shape {target} is invalid for input of size {total}")
    return tuple(target)


def expand_target(shape: tuple[int, ...], target: Any) -> tuple[int, ...]:
    """PyTorch's expand rule: -1 keeps a dim; size-1 dims broadcast; new dims go in front."""
    target = [target] if isinstance(target, int) else list(target)
    if len(target) < len(shape):
        raise ShapeError(
            f"the expanded size {fmt(target)} must have at least as many dims as {fmt(shape)}"
        )
    lead = len(target) - len(shape)
    out = []
    for i, n in enumerate(target):
        if i < lead:
            if n < 0:
                raise ShapeError(f"expanded size {n} is not allowed in a new leading dim")
            out.append(n)
            continue
        have = shape[i - lead]
        if n == -1:
            out.append(have)
        elif have == n or have == 1:
            out.append(n)
        else:
            raise ShapeError(
                f"the expanded size {n} must match the existing size {have} at dim {i} "
                f"(target {fmt(target)}, input {fmt(shape)})"
            )
    return tuple(out)


def _fixed_shape(fn_name: str, target_of: Any) -> Any:
    """A kernel calling the namespace's `fn_name` with a target shape worked out once."""

    def kernel(backend: Any, metas: list[Meta], *, shape: Any) -> Any:
        fn, target = getattr(backend.xp, fn_name), target_of(metas[0].shape, shape)
        return lambda x: fn(x, target)

    return kernel


register(
    OpDef(
        name="reshape",
        group="shape",
        doc="Same elements in a new shape (one dim may be -1).",
        args=("input",),
        views_input=True,
        forward=lambda xp, x, *, shape: xp.reshape(x, reshape_target(tuple(x.shape), shape)),
        infer=lambda metas, *, shape: Meta(reshape_target(metas[0].shape, shape), metas[0].dtype),
        vjp=(lambda F, g, x, *, shape: F.reshape(g, shape=list(x.shape)),),
        save=("input",),
        attrs={"shape": Attr("shape", doc="the new shape")},
        positional_attrs=("shape",),
        kernel=_fixed_shape("reshape", reshape_target),
    ),
    OpDef(
        name="expand",
        group="shape",
        doc="Broadcast to a larger shape (-1 keeps a dim); the gradient is summed back.",
        args=("input",),
        views_input=True,
        forward=lambda xp, x, *, shape: xp.broadcast_to(x, expand_target(tuple(x.shape), shape)),
        infer=lambda metas, *, shape: Meta(expand_target(metas[0].shape, shape), metas[0].dtype),
        vjp=(lambda F, g, x, *, shape: sum_to_shape(F, g, tuple(x.shape)),),
        save=("input",),
        attrs={"shape": Attr("shape", doc="the target shape")},
        positional_attrs=("shape",),
        kernel=_fixed_shape("broadcast_to", expand_target),
    ),
)


# ---------------------------------------------------------------- squeeze, unsqueeze, flatten


def squeeze_dims(shape: tuple[int, ...], dim: int | list[int] | None) -> tuple[int, ...]:
    """The dims squeeze removes: the named ones (all when None) that have size 1, as in
    PyTorch, where squeezing a dim of another size is a no-op and `dim=[]` squeezes none."""
    if isinstance(dim, list) and not dim:
        return ()
    return tuple(d for d in normalize_dims(dim, len(shape)) if shape[d] == 1)


def _squeeze_shape(shape: tuple[int, ...], dim: int | list[int] | None) -> tuple[int, ...]:
    dims = squeeze_dims(shape, dim)
    return tuple(n for i, n in enumerate(shape) if i not in dims)


def _squeeze(xp: Any, x: Any, *, dim: int | list[int] | None) -> Any:
    dims = squeeze_dims(tuple(x.shape), dim)
    return xp.squeeze(x, axis=dims) if dims else x


def unsqueeze_dim(ndim: int, dim: int) -> int:
    """The new dim's index in the result: PyTorch accepts [-ndim - 1, ndim]."""
    if not -ndim - 1 <= dim <= ndim:
        raise ShapeError(
            f"dim {dim} is out of range for unsqueeze of a tensor of {ndim} dimension(s) "
            f"(expected in [{-ndim - 1}, {ndim}])"
        )
    return dim % (ndim + 1)


def _unsqueeze_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    d = unsqueeze_dim(len(shape), dim)
    return (*shape[:d], 1, *shape[d:])


def flatten_shape(shape: tuple[int, ...], start_dim: int, end_dim: int) -> tuple[int, ...]:
    """PyTorch's flatten: dims start_dim..end_dim merged into one; a 0-d tensor becomes (1,)."""
    start, end = normalize_dim(start_dim, len(shape)), normalize_dim(end_dim, len(shape))
    if start > end:
        raise ShapeError(
            f"start_dim {start_dim} comes after end_dim {end_dim} for shape {fmt(shape)}"
        )
    if not shape:
        return (1,)
    return (*shape[:start], numel(shape[start : end + 1]), *shape[end + 1 :])


# ---------------------------------------------------------------- cat, stack


def _operand_shapes(op: str, metas: list[Meta]) -> list[tuple[int, ...]]:
    for k, m in enumerate(metas):
        if m.literal:
            raise ShapeError(f"{op}: operand {k} is a number, expected a tensor")
    return [m.shape for m in metas]


def _skipped(shape: tuple[int, ...]) -> bool:
    """PyTorch's legacy rule: cat skips 1-d empty tensors (shape (0,)) whatever the others."""
    return shape == (0,)


def _cat_infer(metas: list[Meta], *, dim: int) -> Meta:
    shapes = _operand_shapes("cat", metas)
    for k, s in enumerate(shapes):
        if not s:
            raise ShapeError(f"zero-dimensional tensor (at position {k}) cannot be concatenated")
    kept = [s for s in shapes if not _skipped(s)]
    if not kept:
        return Meta((0,), promoted_dtype(metas))
    first = kept[0]
    d = normalize_dim(dim, len(first))
    for s in kept[1:]:
        if len(s) != len(first) or any(s[i] != n for i, n in enumerate(first) if i != d):
            raise ShapeError(
                f"tensors must have the same shape except in dim {dim}, "
                f"got {fmt(first)} and {fmt(s)}"
            )
    out = list(first)
    out[d] = sum(s[d] for s in kept)
    return Meta(tuple(out), promoted_dtype(metas))


def _cat(xp: Any, *xs: Any, dim: int) -> Any:
    for k, x in enumerate(xs):
        if type(x) in (int, float, bool):
            raise ShapeError(f"cat: operand {k} is a number, expected a tensor")
        if x.ndim == 0:
            raise ShapeError(f"zero-dimensional tensor (at position {k}) cannot be concatenated")
    kept = [x for x in xs if not _skipped(tuple(x.shape))]
    if len(kept) < len(xs):
        if not kept:
            return xs[0] if len(xs) == 1 else xp.concat(xs, axis=0)
        if len(kept) == 1:
            normalize_dim(dim, kept[0].ndim)
            return xp.asarray(kept[0], copy=True)
    return xp.concat(kept, axis=dim)


def _cat_vjp(F: Any, g: Any, tensors: tuple[Any, ...], *, dim: int) -> list[Any]:
    grads, start = [], 0
    for t in tensors:
        if _skipped(tuple(t.shape)):
            grads.append(F.zeros_like(t))
            continue
        d = normalize_dim(dim, len(g.shape))
        stop = start + t.shape[d]
        grads.append(F.slice(g, dim=d, start=start, stop=stop, step=1))
        start = stop
    return grads


def _stack_infer(metas: list[Meta], *, dim: int) -> Meta:
    shapes = _operand_shapes("stack", metas)
    first = shapes[0]
    for k, s in enumerate(shapes[1:], start=1):
        if s != first:
            raise ShapeError(
                f"stack expects each tensor to be equal size, but got {fmt(first)} at entry 0 "
                f"and {fmt(s)} at entry {k}"
            )
    d = unsqueeze_dim(len(first), dim)
    return Meta((*first[:d], len(metas), *first[d:]), promoted_dtype(metas))


def _stack(xp: Any, *xs: Any, dim: int) -> Any:
    for k, x in enumerate(xs):
        if type(x) in (int, float, bool):
            raise ShapeError(f"stack: operand {k} is a number, expected a tensor")
    return xp.stack(xs, axis=unsqueeze_dim(xs[0].ndim, dim))


def _stack_vjp(F: Any, g: Any, *, dim: int) -> list[Any]:
    d = normalize_dim(dim, len(g.shape))
    # One slice per operand: the stacked dim's size is the operand count.
    return [
        F.squeeze(F.slice(g, dim=d, start=i, stop=i + 1, step=1), dim=d) for i in range(g.shape[d])
    ]


def _to_shape_vjp(F: Any, g: Any, x: Any, **attrs: Any) -> Any:
    return F.reshape(g, shape=list(x.shape))


_DIM = Attr("int", 0, doc="the dim to join along")

register(
    OpDef(
        name="squeeze",
        group="shape",
        doc="Remove size-1 dims: the named ones (int or list; dims of another size are kept), "
        "or all when dim is absent.",
        args=("input",),
        views_input=True,
        forward=_squeeze,
        infer=lambda metas, *, dim: Meta(_squeeze_shape(metas[0].shape, dim), metas[0].dtype),
        vjp=(_to_shape_vjp,),
        save=("input",),
        attrs={
            "dim": Attr("int|ints", None, doc="dim(s) to squeeze; all when absent", nullable=True)
        },
        positional_attrs=("dim",),
    ),
    OpDef(
        name="unsqueeze",
        group="shape",
        doc="Insert a size-1 dim at `dim` (in [-ndim-1, ndim]).",
        args=("input",),
        views_input=True,
        forward=lambda xp, x, *, dim: xp.expand_dims(x, axis=unsqueeze_dim(x.ndim, dim)),
        infer=lambda metas, *, dim: Meta(_unsqueeze_shape(metas[0].shape, dim), metas[0].dtype),
        # `dim` indexes the result, so the same dim squeezes the gradient back.
        vjp=(lambda F, g, *, dim: F.squeeze(g, dim=dim),),
        attrs={"dim": Attr("int", doc="where the new dim goes")},
        positional_attrs=("dim",),
    ),
    OpDef(
        name="flatten",
        group="shape",
        doc="Merge dims start_dim..end_dim into one (a 0-d tensor becomes shape (1,)).",
        args=("input",),
        views_input=True,
        forward=lambda xp, x, *, start_dim, end_dim: xp.reshape(
            x, flatten_shape(tuple(x.shape), start_dim, end_dim)
        ),
        infer=lambda metas, *, start_dim, end_dim: Meta(
            flatten_shape(metas[0].shape, start_dim, end_dim), metas[0].dtype
        ),
        vjp=(_to_shape_vjp,),
        save=("input",),
        attrs={
            "start_dim": Attr("int", 0, doc="first dim to merge"),
            "end_dim": Attr("int", -1, doc="last dim to merge"),
        },
        positional_attrs=("start_dim", "end_dim"),
    ),
    OpDef(
        name="cat",
        group="shape",
        doc="Concatenate tensors along an existing dim (dtypes promoted; no 0-d operands).",
        args=("tensors",),
        views_input=True,
        variadic=True,
        promote="all",
        forward=_cat,
        infer=_cat_infer,
        vjp=_cat_vjp,
        save=("tensors",),
        attrs={"dim": _DIM},
        call_order=("tensors", "dim"),
    ),
    OpDef(
        name="stack",
        group="shape",
        doc="Join equal-shaped tensors along a new dim (dtypes promoted).",
        args=("tensors",),
        variadic=True,
        promote="all",
        forward=_stack,
        infer=_stack_infer,
        vjp=_stack_vjp,
        attrs={"dim": Attr("int", 0, doc="where the new dim goes")},
        call_order=("tensors", "dim"),
    ),
)
