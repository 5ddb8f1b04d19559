"""Builders for the common op shapes (elementwise unary and binary), and small helpers."""

from __future__ import annotations

from typing import Any

from gradserve.engine.dtypes import DEFAULT_FLOAT, DTYPES, FLOATS
from gradserve.engine.ops.registry import VJP, Attr, Meta, OpDef, promoted_dtype
from gradserve.engine.shapes import broadcast_shapes

_NUMBER = (int, float, bool)


def is_number(v: Any) -> bool:
    """A Python number literal. By exact type: NumPy's float64 scalar (the value of a 0-d
    float64 tensor) subclasses float but is a tensor value, not a weak literal."""
    return type(v) in _NUMBER


def dtype_name(xp: Any, dtype: Any) -> str:
    """The gradserve name ("int64") of a backend dtype object (str() of one is not portable:
    array-api-strict spells it "array_api_strict.int64")."""
    for name in DTYPES:
        if dtype == getattr(xp, name, None):
            return name
    return str(dtype)


def as_array(xp: Any, value: Any, like: Any) -> Any:
    """A Python number as a 0-d array of `like`'s dtype (for calls that want arrays)."""
    if is_number(value):
        return xp.asarray(value, dtype=like.dtype)
    return value


def elementwise_infer(float_result: bool = False, result_dtype: str | None = None) -> Any:
    """The shape rule of an elementwise op: broadcast shapes, promoted dtype."""

    def infer(metas: list[Meta], **attrs: Any) -> Meta:
        shape = broadcast_shapes(*(m.shape for m in metas))
        return Meta(shape, result_dtype or promoted_dtype(metas, float_result))

    return infer


def unary(
    name: str,
    doc: str,
    forward: Any,
    vjp: VJP | None,
    save: tuple[str, ...] = ("input",),
    *,
    float_result: bool = False,
    group: str = "elementwise",
    attrs: dict[str, Attr] | None = None,
    infer: Any = None,
    check_args: Any = None,
    ufunc: str | None = None,
    views_input: bool = False,
    kernel: Any = None,
) -> OpDef:
    return OpDef(
        name=name,
        group=group,
        doc=doc,
        args=("input",),
        forward=forward,
        infer=infer or _unary_infer(float_result),
        vjp=(vjp,) if vjp is not None else None,
        save=save if vjp is not None else (),
        attrs=attrs or {},
        float_result=float_result,
        check_args=check_args,
        ufunc=ufunc,
        views_input=views_input,
        kernel=kernel,
    )


def _unary_infer(float_result: bool) -> Any:
    def infer(metas: list[Meta], **attrs: Any) -> Meta:
        (m,) = metas
        dtype = m.dtype
        if float_result and dtype not in FLOATS:
            dtype = DEFAULT_FLOAT
        return Meta(m.shape, dtype)

    return infer


def binary(
    name: str,
    doc: str,
    forward: Any,
    vjps: tuple[VJP | None, VJP | None] | None,
    save: tuple[str, ...] = (),
    *,
    float_result: bool = False,
    group: str = "arithmetic",
    result_dtype: str | None = None,
    args: tuple[str, str] = ("input", "other"),
    infer: Any = None,
    check_args: Any = None,
    ufunc: str | None = None,
    views_input: bool = False,
    lower: Any = None,
    lifts_literals: bool = True,
) -> OpDef:
    return OpDef(
        name=name,
        group=group,
        doc=doc,
        args=args,
        forward=forward,
        infer=infer or elementwise_infer(float_result, result_dtype),
        vjp=vjps,
        save=save,
        promote=(0, 1),
        float_result=float_result,
        check_args=check_args,
        ufunc=ufunc,
        views_input=views_input,
        lower=lower,
        lifts_literals=lifts_literals,
    )
