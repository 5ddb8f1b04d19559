"""dtype and graph ops (cast, detach) and constants (zeros, ones, full, eye, arange)."""

from __future__ import annotations

import math
from typing import Any

from gradserve.engine.dtypes import DEFAULT_FLOAT, DEFAULT_INT, FLOATS, INTS, Scalar, scalar_dtype
from gradserve.engine.errors import AttributeError_, DTypeError, ShapeError
from gradserve.engine.ops.registry import Attr, Meta, OpDef, register


def _cast_vjp(F: Any, g: Any, x: Any, *, dtype: str) -> Any:
    return F.cast(g, dtype=F.dtype_of(x))


def _cast_lowering(xp: Any, x: Any, *, dtype: str) -> Any:
    """The cast in the XLA tier, where XLA converts otherwise:
    - a bool tensor to floats, as a selection of ones and zeros: XLA rewrites a product
      with a converted bool as a selection (`x * float(m)` as `m ? x : 0`), which gives 0
      where x is inf or NaN, where IEEE (and PyTorch) give NaN, but keeps a selection's;
    - floats to integers: XLA saturates (and NaN gives 0), where PyTorch and NumPy on the
      CPU give the most negative integer for NaN, infinities and values out of range."""
    target = getattr(xp, dtype)
    if x.dtype == xp.bool and dtype in FLOATS:
        return xp.where(x, xp.ones(x.shape, dtype=target), xp.zeros(x.shape, dtype=target))
    if dtype in _INT_RANGE and xp.isdtype(x.dtype, "real floating"):
        low, high = _INT_RANGE[dtype]
        inside = (x >= float(low)) & (x < float(high + 1))  # (bounds exact in every float)
        return xp.where(inside, xp.astype(x, target), xp.full(x.shape, low, dtype=target))
    return xp.astype(x, target)


register(
    OpDef(
        name="cast",
        group="dtype and graph",
        doc="Convert to another dtype; the gradient is cast back (floats only).",
        args=("input",),
        forward=lambda xp, x, *, dtype: xp.astype(x, getattr(xp, dtype)),
        lower=_cast_lowering,
        infer=lambda metas, *, dtype: Meta(metas[0].shape, dtype),
        vjp=(_cast_vjp,),
        save=("input",),
        attrs={"dtype": Attr("dtype", doc="the target dtype")},
        positional_attrs=("dtype",),
    ),
    OpDef(
        name="detach",
        group="dtype and graph",
        doc="The same value, cut from the graph: no gradient flows through it.",
        args=("input",),
        forward=lambda xp, x: x,
        infer=lambda metas: Meta(metas[0].shape, metas[0].dtype),
        returns_input=True,
        views_input=True,
        cost=lambda metas, out: (0, 0),
    ),
)


# ---------------------------------------------------------------- constants


def _shape(shape: int | list[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for n in dims:
        if n < 0:
            raise ShapeError(f"shape {list(dims)} has a negative size {n}")
    return dims


def _size(name: str, n: int) -> int:
    if n < 0:
        raise ShapeError(f"{name} must be >= 0, got {n}")
    return n


_FINITE_MAX = {"float16": 65504.0, "float32": 3.4028234663852886e38, "float64": math.inf}
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _fill(value: Scalar, dtype: str, shape: tuple[int, ...] = (1,)) -> Scalar:
    """The fill value as the Python type of `dtype`, truncated as torch.full casts it; a value
    the dtype cannot hold is an error, as in PyTorch (not a silent inf or wrap-around),
    except a 0-d float16, which PyTorch fills unchecked (inf)."""
    if dtype in FLOATS:
        v = float(value)
        if math.isfinite(v) and abs(v) > _FINITE_MAX[dtype] and (shape or dtype != "float16"):
            raise DTypeError(f"value {value!r} cannot be converted to {dtype} without overflow")
        return v
    if dtype in INTS:
        if isinstance(value, float) and not math.isfinite(value):
            raise DTypeError(f"value {value!r} cannot be converted to {dtype} without overflow")
        v = int(value)
        low, high = _INT_RANGE[dtype]
        if not low <= v <= high:
            raise DTypeError(f"value {value!r} cannot be converted to {dtype} without overflow")
        return v
    return bool(value)


def _full_dtype(value: Scalar, dtype: str | None) -> str:
    return dtype or scalar_dtype(value)


def arange_spec(
    start: Scalar | None, end: Scalar | None, step: Scalar, dtype: str | None
) -> tuple[Scalar, Scalar, int, str]:
    """(start, step, length, dtype) of torch.arange: `arange(n)` is `arange(0, n)`.

    As PyTorch's kernel: for int64 the bounds and step are truncated to integers first
    (a step that truncates to 0 is an error); for other dtypes the length comes from the
    values as given, and integer dtypes count from the truncated start by the truncated
    step."""
    if end is None:
        if start is None:
            raise AttributeError_("missing required attribute 'end'", loc=("attrs", "end"))
        start, end = 0, start
    start = 0 if start is None else start
    if dtype is None:
        floating = any(isinstance(v, float) for v in (start, end, step))
        dtype = DEFAULT_FLOAT if floating else DEFAULT_INT
    if dtype == "bool":
        raise DTypeError("arange does not produce bool tensors")
    for name, v in (("start", start), ("end", end), ("step", step)):
        # isfinite of an int past the float range raises OverflowError: ints are finite.
        if isinstance(v, float) and not math.isfinite(v):
            raise AttributeError_(f"{name} must be finite, got {v}", loc=("attrs", name))
        if dtype in INTS and not -(1 << 63) <= int(v) < 1 << 63:
            raise AttributeError_(f"{name} {v} is out of the range of int64", loc=("attrs", name))
    if step == 0 or (dtype == DEFAULT_INT and int(step) == 0):
        raise AttributeError_("step must be nonzero", loc=("attrs", "step"))
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise AttributeError_(
            f"upper bound {end} and lower bound {start} inconsistent with step sign {step}",
            loc=("attrs", "step"),
        )
    if dtype == DEFAULT_INT:
        start, end, step = int(start), int(end), int(step)
        length = -((start - end) // step)  # exact ceil((end - start) / step)
    else:
        try:  # inf for e.g. end=1e308, step=1e-308; OverflowError for ints past 1e308
            count = (end - start) / step
        except OverflowError:
            count = math.inf
        if not math.isfinite(count):
            raise AttributeError_(
                f"unsupported range: {start} to {end} by step {step} has too many values",
                loc=("attrs", "step"),
            )
        length = math.ceil(count)
    if dtype in INTS:
        start, step = int(start), int(step)
    return start, step, length, dtype


def _arange(
    xp: Any, *, start: Scalar | None, end: Scalar | None, step: Scalar, dtype: str | None
) -> Any:
    start, step, length, dtype = arange_spec(start, end, step, dtype)
    if dtype in INTS:
        values = xp.arange(length, dtype=xp.int64) * step + start
        return xp.astype(values, getattr(xp, dtype))
    # Values start + i * step computed in float64 and then cast, as torch's CPU kernel does.
    values = xp.arange(length, dtype=xp.float64) * step + start
    return xp.astype(values, getattr(xp, dtype))


def _arange_infer(
    metas: list[Meta], *, start: Scalar | None, end: Scalar | None, step: Scalar, dtype: str | None
) -> Meta:
    _, _, length, dtype = arange_spec(start, end, step, dtype)
    return Meta((length,), dtype)


_SHAPE = Attr("shape", doc="the shape (an int for 1-d)")


def _filled(name: str) -> OpDef:
    """`zeros` and `ones`: the namespace's function of the same name over a shape."""
    return OpDef(
        name=name,
        group="constants",
        doc=f"A tensor of {name} (default dtype float32).",
        args=(),
        forward=lambda xp, *, shape, dtype: getattr(xp, name)(
            _shape(shape), dtype=getattr(xp, dtype)
        ),
        infer=lambda metas, *, shape, dtype: Meta(_shape(shape), dtype),
        attrs={"shape": _SHAPE, "dtype": Attr("dtype", DEFAULT_FLOAT, doc="element type")},
        positional_attrs=("shape",),
    )


register(
    _filled("zeros"),
    _filled("ones"),
    OpDef(
        name="full",
        group="constants",
        doc="A tensor filled with `value`; dtype inferred from it as torch.full does "
        "(float → float32, int → int64, bool → bool).",
        args=(),
        forward=lambda xp, *, shape, value, dtype: xp.full(
            _shape(shape),
            _fill(value, _full_dtype(value, dtype), _shape(shape)),
            dtype=getattr(xp, _full_dtype(value, dtype)),
        ),
        infer=lambda metas, *, shape, value, dtype: Meta(_shape(shape), _full_dtype(value, dtype)),
        attrs={
            "shape": _SHAPE,
            "value": Attr("number", doc="the fill value"),
            "dtype": Attr("dtype", None, doc="element type (null: from value)", nullable=True),
        },
        positional_attrs=("shape", "value"),
    ),
    OpDef(
        name="eye",
        group="constants",
        doc="The n x m identity matrix (m defaults to n; default dtype float32).",
        args=(),
        forward=lambda xp, *, n, m, dtype: xp.eye(
            _size("n", n), _size("m", n if m is None else m), dtype=getattr(xp, dtype)
        ),
        infer=lambda metas, *, n, m, dtype: Meta(
            (_size("n", n), _size("m", n if m is None else m)), dtype
        ),
        attrs={
            "n": Attr("int", doc="rows"),
            "m": Attr("int", None, doc="columns (null: n)", nullable=True),
            "dtype": Attr("dtype", DEFAULT_FLOAT, doc="element type"),
        },
        positional_attrs=("n", "m"),
    ),
    OpDef(
        name="arange",
        group="constants",
        doc="Values from start (default 0) to end, exclusive, by step, as torch.arange: "
        "arange(n) counts from 0; dtype float32 if any bound is a float, else int64.",
        args=(),
        forward=_arange,
        infer=_arange_infer,
        attrs={
            "start": Attr("number", None, doc="first value (null: 0)", nullable=True),
            "end": Attr(
                "number",
                None,
                doc="end, exclusive (with start alone, start is the end, as in arange(5))",
                nullable=True,
            ),
            "step": Attr("number", 1, doc="increment, nonzero"),
            "dtype": Attr("dtype", None, doc="element type (null: inferred)", nullable=True),
        },
        positional_attrs=("start", "end", "step"),
    ),
)
