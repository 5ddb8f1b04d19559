"""Reductions (`dim`: int, list, or None for all; `keepdim`) and normalisation."""

from __future__ import annotations

from typing import Any

from engine.dtypes import DEFAULT_INT, FLOATS, INTS, bool_
from engine.errors import DTypeError
from engine.ops.registry import Attr, Meta, OpDef, register
from engine.shapes import expand_reduced, normalize_dims, numel, reduced_shape

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


def _sum(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    axes = _axes(x, dim)
    out_dtype = None
    if xp.isdtype(x.dtype, "integral") or x.dtype == xp.bool:
        out_dtype = xp.int64
    return xp.sum(x, axis=axes, keepdims=keepdim, dtype=out_dtype)


def _sum_vjp(F: Any, g: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    return expand_reduced(F, g, shape, normalize_dims(dim, len(shape)), keepdim)


def _mean(xp: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    return xp.mean(x, axis=_axes(x, dim), keepdims=keepdim)


def _mean_vjp(F: Any, g: Any, x: Any, *, dim: Any, keepdim: bool) -> Any:
    shape = tuple(x.shape)
    dims = normalize_dims(dim, len(shape))
    count = numel([shape[d] for d in dims])
    return expand_reduced(F, g / count, shape, dims, keepdim)


register(
    OpDef(
        name="sum", group="reductions", doc="Sum over dims (integers sum as int64).",
        args=("input",), forward=_sum, infer=reduction_infer(_sum_dtype),
        vjp=(_sum_vjp,), save=("input",), attrs={"dim": DIM, "keepdim": KEEPDIM},
        positional_attrs=("dim", "keepdim"),
    ),
    OpDef(
        name="mean", group="reductions", doc="Mean over dims (floating point inputs only).",
        args=("input",), forward=_mean, infer=reduction_infer(_float_only("mean")),
        vjp=(_mean_vjp,), save=("input",), attrs={"dim": DIM, "keepdim": KEEPDIM},
        positional_attrs=("dim", "keepdim"),
    ),
)
