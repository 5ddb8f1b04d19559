"""dtype and graph ops (cast, detach) and constants (zeros, ones, full, eye, arange)."""

from __future__ import annotations

from typing import Any

from engine.dtypes import FLOATS
from engine.ops.registry import Attr, Meta, OpDef, register


def _cast_vjp(F: Any, g: Any, x: Any, *, dtype: str) -> Any:
    return F.cast(g, dtype=F.dtype_of(x))


register(
    OpDef(
        name="cast", group="dtype and graph",
        doc="Convert to another dtype; the gradient is cast back (floats only).",
        args=("input",),
        forward=lambda xp, x, *, dtype: xp.astype(x, getattr(xp, dtype)),
        infer=lambda metas, *, dtype: Meta(metas[0].shape, dtype),
        vjp=(_cast_vjp,), save=("input",),
        attrs={"dtype": Attr("dtype", doc="the target dtype")},
        positional_attrs=("dtype",),
    ),
    OpDef(
        name="detach", group="dtype and graph",
        doc="The same value, cut from the graph: no gradient flows through it.",
        args=("input",), forward=lambda xp, x: x,
        infer=lambda metas: Meta(metas[0].shape, metas[0].dtype),
    ),
)

__all__ = ["FLOATS"]
