"""Reductions (`dim`: int, list, or None for all; `keepdim`), `cumsum`, and normalisation."""

from __future__ import annotations

import math
from typing import Any

from gradserve.engine.dtypes import DEFAULT_FLOAT, DEFAULT_INT, FLOATS, INTS, bool_
from gradserve.engine.errors import DTypeError
from gradserve.engine.ops.registry import Attr, Meta, OpDef, register
from gradserve.engine.shapes import (
    expand_reduced,
    normalize_dim,
    normalize_dims,
    numel,
    reduced_shape,
)

DIM = Attr("int|ints", None, "dim or dims to reduce; all when absent", nullable=True)
KEEPDIM = Attr("bool", False, "keep reduced dims as size 1")


def _axes(x: Any, dim: Any) -> tuple[int, ...]:
    return normalize_dims(dim, len(x.shape))


def reduction_infer(dtype_rule: Any = None) -> Any:
    def infer(metas: list[Meta], *, dim: Any, keepdim: bool, **_: Any) -> Meta:
        (m,) = metas
        dims = normalize_dims(dim, len(m.shape))
        dtype = dtype_rule(m.dtype) if dtype_rule else m.dtype
        return Meta(reduced_shape(m.shape, dims, keepdim), dtype)

    return infer


def _sum_dtype(dtype: str) -> str:
    return DEFAULT_INT if dtype in INTS or dtype == bool_ else dtype  # PyTorch sums ints as int64


def _float_only(name: str) -> Any:
    def rule(dtype: str) -> str:
        if dtype not in FLOATS:
            raise DTypeError(f"{name} needs a floating point input, got {dtype}")
        return dtype

    return rule


def _to_float(dtype: str) -> str:
    return dtype if dtype in FLOATS else DEFAULT_FLOAT


def _check_float(xp: Any, name: str, x: Any) -> None:
    """The forward's dtype check (shape rules run only to explain a failure)."""
    if not xp.isdtype(x.dtype, "real floating"):
        _float_only(name)(str(x.dtype))


def _sum(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    axes = _axes(x, dim)
    if x.dtype == xp.bool:
        x = xp.astype(x, xp.int64)  # the array API sums numbers only
    out_dtype = xp.int64 if xp.isdtype(x.dtype, "integral") else None
    return xp.sum(x, axis=axes, keepdims=keepdim, dtype=out_dtype)


def _sum_kernel(backend: Any, metas: list[Meta], *, dim: Any, keepdim: bool) -> Any:
    """A floating sum over axes fixed in advance (NumPy's sum is its add.reduce)."""
    if metas[0].dtype not in FLOATS:
        return None
    axes = normalize_dims(dim, len(metas[0].shape))
    reduce = getattr(getattr(backend.ufuncs, "add", None), "reduce", None)
    if reduce is not None:
        return lambda x: reduce(x, axis=axes, keepdims=keepdim)
    total = backend.xp.sum
    return lambda x: total(x, axis=axes, keepdims=keepdim)


def _sum_vjp(F: Any, g: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    return expand_reduced(F, g, shape, normalize_dims(dim, len(shape)), keepdim)


def _mean(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    _check_float(xp, "mean", x)
    return xp.mean(x, axis=_axes(x, dim), keepdims=keepdim)


def _mean_kernel(backend: Any, metas: list[Meta], *, dim: Any, keepdim: bool) -> Any:
    """NumPy's mean is its add.reduce divided by the count (float16 aside, which it sums in
    float32): the same, without its Python bookkeeping on every call."""
    m = metas[0]
    reduce = getattr(getattr(backend.ufuncs, "add", None), "reduce", None)
    if reduce is None or m.dtype not in ("float32", "float64"):
        return None
    axes = normalize_dims(dim, len(m.shape))
    count = numel([m.shape[d] for d in axes])
    divide = backend.ufuncs.divide
    return lambda x: divide(reduce(x, axis=axes, keepdims=keepdim), count)


def _mean_vjp(F: Any, g: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    dims = normalize_dims(dim, len(shape))
    count = numel([shape[d] for d in dims])
    return expand_reduced(F, g / count, shape, dims, keepdim)


def _keep(F: Any, t: Any, shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool) -> Any:
    """A reduction's output (or its gradient) with the reduced dims kept as size 1."""
    return t if keepdim else F.reshape(t, shape=list(reduced_shape(shape, dims, True)))


def _prod(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    axes = _axes(x, dim)
    if x.dtype == xp.bool:
        x = xp.astype(x, xp.int64)
    out_dtype = xp.int64 if xp.isdtype(x.dtype, "integral") else None
    return xp.prod(x, axis=axes, keepdims=keepdim, dtype=out_dtype)


def _prod_vjp(F: Any, g: Any, x: Any, result: Any, *, dim: Any, keepdim: bool) -> Any:
    """PyTorch's prod_backward: result / x when the input has no zero; otherwise the
    product of the others from exclusive cumulative products (no division), which is also
    right to differentiate again; with several zeros over all dims, when the backward is
    not itself differentiated, zeros (as there). Both are computed and the data selects
    (no look at the data on the host): the quotient divides by x with its zeros replaced
    by 1, so that the branch not taken holds no NaN that a second derivative could pick up."""
    shape = tuple(x.shape)
    if not shape:
        return g
    dims = normalize_dims(dim, len(shape))
    if not keepdim:
        g = _keep(F, g, shape, dims, keepdim)
        result = _keep(F, result, shape, dims, keepdim)
    if not numel(shape):
        return g * (result / x)
    zero = x == 0
    zeros = F.sum(zero)
    quotient = g * (result / F.where(zero, 1.0, x))
    grad = F.where(zeros == 0, quotient, g * _others_product(F, x, shape, dims))
    if dim is None and not F.create_graph:
        grad = F.where(zeros > 1, 0.0, grad)
    return grad


def _others_product(F: Any, x: Any, shape: tuple[int, ...], dims: tuple[int, ...]) -> Any:
    """For each element, the product of the other elements of its reduced slice."""
    # The reduced dims moved to the end and merged into one: the products of the others.
    keep = [d for d in range(len(shape)) if d not in dims]
    order = keep + list(dims)
    moved = F.permute(x, dims=order) if order != list(range(len(shape))) else x
    flat = F.reshape(moved, shape=[*(shape[d] for d in keep), numel([shape[d] for d in dims])])
    others = _products_of_others(F, flat, len(keep))
    others = F.reshape(others, shape=[shape[d] for d in order])
    if order != list(range(len(shape))):
        others = F.permute(others, dims=[order.index(d) for d in range(len(shape))])
    return others


def _scan_product(F: Any, x: Any, d: int, n: int, reverse: bool) -> Any:
    """Inclusive cumulative product along `d` (from the end when `reverse`), by doubling:
    log2(n) steps of slices, concatenation and products, so it is differentiable again."""
    out, step = x, 1
    while step < n:
        ones = F.ones_like(F.slice(out, dim=d, start=0, stop=step, step=1))
        if reverse:
            shifted = F.cat(F.slice(out, dim=d, start=step, stop=n, step=1), ones, dim=d)
        else:
            shifted = F.cat(ones, F.slice(out, dim=d, start=0, stop=n - step, step=1), dim=d)
        out = out * shifted
        step *= 2
    return out


def _products_of_others(F: Any, x: Any, d: int) -> Any:
    """For each entry along `d`, the product of all the other entries (PyTorch's
    prod_safe_zeros_backward: exclusive products from the front times from the back)."""
    n = x.shape[d]
    if n <= 1:
        return F.ones_like(x)
    one = F.ones_like(F.slice(x, dim=d, start=0, stop=1, step=1))
    front = F.cat(one, F.slice(x, dim=d, start=0, stop=n - 1, step=1), dim=d)
    back = F.cat(F.slice(x, dim=d, start=1, stop=n, step=1), one, dim=d)
    return _scan_product(F, front, d, n, False) * _scan_product(F, back, d, n, True)


def _extreme(name: str) -> Any:
    def forward(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
        return getattr(xp, name)(x, axis=_axes(x, dim), keepdims=keepdim)

    return forward


def _extreme_vjp(F: Any, g: Any, x: Any, result: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    dims = normalize_dims(dim, len(shape))
    g = _keep(F, g, shape, dims, keepdim)
    r = _keep(F, result, shape, dims, keepdim)
    hit = x == r
    if isinstance(dim, int):
        # PyTorch: max(x, dim) sends the gradient to the index it returns: the first max,
        # or the first NaN, which is what it returns where there is one.
        hit = F.where(r != r, x != x, hit)
        first = F.where(hit, F.cumsum(hit, dim=dim), 0) == 1
        return F.where(first, g, 0.0)
    if dim is None and not keepdim:
        # torch.max(x): ties (or the NaNs, when the result is NaN) share it evenly.
        hit = F.where(r != r, x != x, hit)
        count = F.sum(F.cast(hit, dtype=F.dtype_of(g)))
        return F.where(hit, g / count, 0.0)
    # torch.amax/amin: ties share it evenly; a slice with a NaN matches nothing and
    # gets NaN (grad / 0 * 0), as there.
    mask = F.cast(hit, dtype=F.dtype_of(g))
    count = F.sum(mask, dim=list(dims), keepdim=True)
    return (g / count) * mask


def _cumsum(xp: Any, x: Any, *, dim: int) -> Any:
    axis = normalize_dim(dim, len(x.shape))
    if xp.isdtype(x.dtype, "integral") or x.dtype == xp.bool:
        x = xp.astype(x, xp.int64)  # PyTorch accumulates integers as int64
    if len(x.shape) == 0:
        return x
    return xp.cumulative_sum(x, axis=axis)


def _cumsum_vjp(F: Any, g: Any, *, dim: int) -> Any:
    # The reversed cumulative sum: total - (inclusive prefix sum) + the element itself.
    return F.sum(g, dim=dim, keepdim=True) - F.cumsum(g, dim=dim) + g


def _cumsum_infer(metas: list[Meta], *, dim: int) -> Meta:
    (m,) = metas
    normalize_dim(dim, len(m.shape))
    return Meta(m.shape, _sum_dtype(m.dtype))


def _empty_axis(x: Any, axes: tuple[int, ...]) -> bool:
    return any(x.shape[a] == 0 for a in axes)


def _logsumexp(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    axes = _axes(x, dim)
    if _empty_axis(x, axes):  # log(0): -inf, as PyTorch (the max of nothing is undefined)
        return xp.full(reduced_shape(tuple(x.shape), axes, keepdim), -math.inf, dtype=x.dtype)
    top = xp.max(x, axis=axes, keepdims=True)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))  # all -inf stays -inf, not NaN
    out = xp.log(xp.sum(xp.exp(x - top), axis=axes, keepdims=True)) + top
    return out if keepdim else xp.reshape(out, reduced_shape(tuple(x.shape), axes, False))


def _logsumexp_vjp(F: Any, g: Any, x: Any, result: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    dims = normalize_dims(dim, len(shape))
    # softmax(x) as exp(x - logsumexp): never overflows, since x <= logsumexp.
    return _keep(F, g, shape, dims, keepdim) * F.exp(x - _keep(F, result, shape, dims, keepdim))


def _var(xp: Any, x: Any, *, dim: Any, keepdim: bool, correction: float) -> Any:
    """Spelt out (NumPy's own steps: the mean, the squared deviations, their sum over
    max(0, count - correction)), so that every backend gives PyTorch's answer at no
    degrees of freedom, inf or NaN (CuPy's var gives NaN for inf)."""
    _check_float(xp, "var", x)
    axes = _axes(x, dim)
    count = numel([x.shape[a] for a in axes])
    deviation = x - xp.mean(x, axis=axes, keepdims=True)
    squares = xp.sum(deviation * deviation, axis=axes, keepdims=keepdim)
    return squares / max(count - correction, 0)


def _var_vjp(F: Any, g: Any, x: Any, *, dim: Any, keepdim: bool, correction: float) -> Any:
    # PyTorch's var_backward, including its answer where the degrees of freedom are <= 0.
    shape = tuple(x.shape)
    dims = normalize_dims(dim, len(shape))
    if not shape or dim is None:
        dof = numel(shape) - correction
        mean = F.mean(x, dim=list(dims), keepdim=True) if shape else x
        if dof <= 0:
            return g * F.where(x == mean, math.nan, math.inf)
        return (2.0 / dof) * g * (x - mean)
    dof = numel([shape[d] for d in dims]) - correction
    factor = 2.0 / dof if dof else math.inf
    centred = x - F.mean(x, dim=list(dims), keepdim=True)
    return factor * _keep(F, g, shape, dims, keepdim) * centred


def _softmax(xp: Any, x: Any, *, dim: int) -> Any:
    _check_float(xp, "softmax", x)
    axes = _axes(x, dim)
    if numel(x.shape) == 0:
        return xp.zeros_like(x)
    e = xp.exp(x - xp.max(x, axis=axes, keepdims=True))  # shifted by the max: no overflow
    return e / xp.sum(e, axis=axes, keepdims=True)


def _log_softmax(xp: Any, x: Any, *, dim: int) -> Any:
    _check_float(xp, "log_softmax", x)
    axes = _axes(x, dim)
    if numel(x.shape) == 0:
        return xp.zeros_like(x)
    shifted = x - xp.max(x, axis=axes, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axes, keepdims=True))


def _softmax_vjp(F: Any, g: Any, result: Any, *, dim: int) -> Any:
    return result * (g - F.sum(g * result, dim=dim, keepdim=True))


def _log_softmax_vjp(F: Any, g: Any, result: Any, *, dim: int) -> Any:
    return g - F.exp(result) * F.sum(g, dim=dim, keepdim=True)


def _normalisation_infer(name: str) -> Any:
    def infer(metas: list[Meta], *, dim: int) -> Meta:
        (m,) = metas
        normalize_dim(dim, len(m.shape))
        return Meta(m.shape, _float_only(name)(m.dtype))

    return infer


def _reduction(
    name: str, doc: str, forward: Any, vjp: Any, save: tuple[str, ...], infer: Any, **extra: Any
) -> OpDef:
    attrs = {"dim": DIM, "keepdim": KEEPDIM, **extra.pop("attrs", {})}
    return OpDef(
        name=name,
        group="reductions",
        doc=doc,
        args=("input",),
        forward=forward,
        infer=infer,
        vjp=(vjp,),
        save=save,
        attrs=attrs,
        positional_attrs=("dim", "keepdim"),
        **extra,
    )


def _normalisation(name: str, doc: str, forward: Any, vjp: Any) -> OpDef:
    return OpDef(
        name=name,
        group="normalisation",
        doc=doc,
        args=("input",),
        forward=forward,
        infer=_normalisation_infer(name),
        vjp=(vjp,),
        save=("result",),
        attrs={"dim": Attr("int", doc="the dim to normalise over")},
        positional_attrs=("dim",),
    )


register(
    OpDef(
        name="sum",
        group="reductions",
        doc="Sum over dims (integers sum as int64).",
        args=("input",),
        forward=_sum,
        infer=reduction_infer(_sum_dtype),
        vjp=(_sum_vjp,),
        save=("input",),
        attrs={"dim": DIM, "keepdim": KEEPDIM},
        kernel=_sum_kernel,
        positional_attrs=("dim", "keepdim"),
    ),
    OpDef(
        name="mean",
        group="reductions",
        doc="Mean over dims (floating point inputs only).",
        args=("input",),
        forward=_mean,
        infer=reduction_infer(_float_only("mean")),
        vjp=(_mean_vjp,),
        save=("input",),
        attrs={"dim": DIM, "keepdim": KEEPDIM},
        kernel=_mean_kernel,
        positional_attrs=("dim", "keepdim"),
    ),
    _reduction(
        "prod",
        "Product over dims (integers as int64); exact gradient at zeros, no result / x.",
        _prod,
        _prod_vjp,
        ("input", "result"),
        reduction_infer(_sum_dtype),
    ),
    _reduction(
        "max",
        "Max over dims (values only). max(x, dim=int) sends the gradient to the first "
        "max, as PyTorch's indices; over a list or all dims ties share it evenly.",
        _extreme("max"),
        _extreme_vjp,
        ("input", "result"),
        reduction_infer(),
    ),
    _reduction(
        "min",
        "Min over dims (values only). min(x, dim=int) sends the gradient to the first "
        "min, as PyTorch's indices; over a list or all dims ties share it evenly.",
        _extreme("min"),
        _extreme_vjp,
        ("input", "result"),
        reduction_infer(),
    ),
    _reduction(
        "logsumexp",
        "log(sum(exp(x))) over dims, stable (shifted by the max); ints give float32.",
        _logsumexp,
        _logsumexp_vjp,
        ("input", "result"),
        reduction_infer(_to_float),
        float_result=True,
    ),
    _reduction(
        "var",
        "Variance over dims with `correction` (1: unbiased), floating point inputs only.",
        _var,
        _var_vjp,
        ("input",),
        reduction_infer(_float_only("var")),
        attrs={"correction": Attr("number", 1, "subtracted from the count (Bessel's 1)")},
    ),
    OpDef(
        name="cumsum",
        group="reductions",
        doc="Inclusive cumulative sum along `dim` (integers as int64).",
        args=("input",),
        views_input=True,
        forward=_cumsum,
        infer=_cumsum_infer,
        vjp=(_cumsum_vjp,),
        attrs={"dim": Attr("int", doc="the dim to accumulate along")},
        positional_attrs=("dim",),
    ),
    _normalisation(
        "softmax",
        "exp(x) / sum(exp(x)) along `dim`, stable (shifted by the max).",
        _softmax,
        _softmax_vjp,
    ),
    _normalisation(
        "log_softmax",
        "x - logsumexp(x) along `dim`, stable (shifted by the max).",
        _log_softmax,
        _log_softmax_vjp,
    ),
)
