"""Comparisons (not differentiable, give bool) and `where` selection."""

from __future__ import annotations

from typing import Any

from gradserve.engine.dtypes import bool_
from gradserve.engine.errors import DTypeError
from gradserve.engine.ops.common import binary
from gradserve.engine.ops.registry import Meta, OpDef, literal_meta, promoted_dtype, register
from gradserve.engine.shapes import broadcast_shapes

_NUMBER = (int, float, bool)


def _compare(name: str, symbol: str, fn: Any) -> OpDef:
    return binary(
        name,
        f"a {symbol} b elementwise (bool; not differentiable).",
        fn,
        None,
        group="comparison",
        result_dtype=bool_,
    )


def _where_infer(metas: list[Meta]) -> Meta:
    cond, a, b = metas
    if cond.dtype != bool_:
        raise DTypeError(f"condition must be bool, got {cond.dtype}")
    return Meta(broadcast_shapes(cond.shape, a.shape, b.shape), promoted_dtype([a, b]))


def _where(xp: Any, cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, bool):
        cond = xp.asarray(cond)
    if cond.dtype != xp.bool:
        raise DTypeError(f"condition must be bool, got {cond.dtype}")
    if type(a) in _NUMBER and type(b) in _NUMBER:
        # Two literals: PyTorch's default dtypes (2.5 with 2 is float32, not float64).
        dtype = getattr(xp, promoted_dtype([literal_meta(a), literal_meta(b)]))
        a, b = xp.asarray(a, dtype=dtype), xp.asarray(b, dtype=dtype)
    return xp.where(cond, a, b)


register(
    _compare("eq", "==", lambda xp, a, b: a == b),
    _compare("ne", "!=", lambda xp, a, b: a != b),
    _compare("lt", "<", lambda xp, a, b: a < b),
    _compare("le", "<=", lambda xp, a, b: a <= b),
    _compare("gt", ">", lambda xp, a, b: a > b),
    _compare("ge", ">=", lambda xp, a, b: a >= b),
    OpDef(
        name="where",
        group="selection",
        doc="condition ? input : other, broadcasting; the gradient goes to the chosen side.",
        args=("condition", "input", "other"),
        forward=_where,
        infer=lambda metas: _where_infer(metas),
        vjp=(None, lambda F, g, c: F.where(c, g, 0.0), lambda F, g, c: F.where(c, 0.0, g)),
        save=("condition",),
        promote=(1, 2),
    ),
)
