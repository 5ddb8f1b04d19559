"""Elementwise math. Stable forms for sigmoid and softplus; kinks follow PyTorch."""

from __future__ import annotations

from typing import Any

from gradserve.engine.dtypes import FLOATS, bool_
from gradserve.engine.errors import AttributeError_, DTypeError
from gradserve.engine.ops.common import dtype_name, is_number, unary
from gradserve.engine.ops.registry import Attr, Meta, promoted_dtype, register


def _refuse(name: str, kinds: str) -> tuple[Any, Any]:
    """A check of the argument as given and a shape rule that refuse the dtypes PyTorch's
    kernel lacks: `kinds` "bool" refuses bool tensors, "float" anything not floating."""

    def bad(dtype: str) -> bool:
        return dtype == bool_ if kinds == "bool" else dtype not in FLOATS

    def message(dtype: str) -> str:
        need = "a non-bool" if kinds == "bool" else "a floating point"
        return f"{name} needs {need} input, got {dtype}"

    def check(xp: Any, x: Any) -> None:
        if not is_number(x) and bad(dtype_name(xp, x.dtype)):
            raise DTypeError(message(dtype_name(xp, x.dtype)))

    def infer(metas: list[Meta], **attrs: Any) -> Meta:
        (m,) = metas
        if bad(m.dtype):
            raise DTypeError(message(m.dtype))
        return Meta(m.shape, m.dtype)

    return check, infer


def _relu_vjp(F: Any, g: Any, r: Any) -> Any:
    # PyTorch's threshold_backward: the gradient passes where the result is not <= 0 (NaN
    # included). When the backward is itself differentiated it depends on the result with
    # derivative 0 (so a second grad gives zeros, as there, not "does not require grad"):
    # sign(r) * 0 is exactly 0.
    zero = F.sign(r) * 0.0 if F.create_graph else 0.0
    return F.where(r <= 0, zero, g)


def _sign(xp: Any, x: Any) -> Any:
    if x.dtype == xp.bool:
        return x  # PyTorch: sign of a bool tensor is itself
    out = xp.sign(x)
    if xp.isdtype(x.dtype, "real floating"):
        out = xp.where(xp.isnan(x), xp.zeros_like(out), out)  # PyTorch: sign(NaN) is 0
    return out


def _square(xp: Any, x: Any) -> Any:
    if x.dtype == xp.bool:
        x = xp.astype(x, xp.int64)  # PyTorch squares bool as pow(x, 2): int64
    return x * x


def _square_infer(metas: list[Meta]) -> Meta:
    (m,) = metas
    return Meta(m.shape, "int64" if m.dtype == bool_ else m.dtype)


def _sigmoid(xp: Any, x: Any) -> Any:
    # PyTorch's formula: exp(-x) may overflow to inf for very negative x, and then the
    # result is exactly 0, as there.
    return 1.0 / (1.0 + xp.exp(-x))


def _sigmoid_kernel(backend: Any, metas: list[Meta]) -> Any:
    """The same four operations, in one buffer."""
    uf = backend.ufuncs
    if uf is None or metas[0].dtype not in ("float32", "float64") or not metas[0].shape:
        return None  # (a 0-d result is a NumPy scalar: no buffer to write into)
    one = backend.xp.asarray(1.0, dtype=backend.dtype(metas[0].dtype))

    def sigmoid(x: Any) -> Any:
        t = uf.negative(x)
        uf.exp(t, out=t)
        uf.add(one, t, out=t)
        return uf.divide(one, t, out=t)

    return sigmoid


_SOFTPLUS_THRESHOLD = 20.0  # PyTorch's default: above it softplus(x) is x


def _softplus(xp: Any, x: Any) -> Any:
    stable = xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))
    return xp.where(x > _SOFTPLUS_THRESHOLD, x, stable)


def _clamp_bounds(lo: Any, hi: Any) -> None:
    if lo is None and hi is None:
        raise AttributeError_("at least one of 'min' or 'max' must be given", loc=("attrs",))


def _clamp_dtype(dtype: str, lo: Any, hi: Any) -> str:
    """torch.result_type of the tensor and its bounds (weak literals); bool is refused."""
    lits = [
        Meta(
            (),
            "bool" if isinstance(v, bool) else "float32" if isinstance(v, float) else "int64",
            True,
        )
        for v in (lo, hi)
        if v is not None
    ]
    out = promoted_dtype([Meta((1,), dtype), *lits])
    if out == bool_:
        raise DTypeError("clamp is not supported on bool tensors with bool bounds")
    return out


def _clamp(xp: Any, x: Any, *, min: Any, max: Any) -> Any:
    _clamp_bounds(min, max)
    if not (
        xp.isdtype(x.dtype, "real floating")
        and not isinstance(min, bool)
        and not isinstance(max, bool)
    ):
        target = getattr(xp, _clamp_dtype(dtype_name(xp, x.dtype), min, max))
        if x.dtype != target:
            x = xp.astype(x, target)  # a float bound promotes an integer tensor, and so on
    out = x
    if min is not None:
        out = xp.maximum(out, xp.asarray(min, dtype=x.dtype))
    if max is not None:
        out = xp.minimum(out, xp.asarray(max, dtype=x.dtype))  # PyTorch: max wins if min > max
    return out


def _clamp_infer(metas: list[Meta], *, min: Any, max: Any) -> Meta:
    (m,) = metas
    _clamp_bounds(min, max)
    return Meta(m.shape, _clamp_dtype(m.dtype, min, max))


def _clamp_vjp(F: Any, g: Any, x: Any, *, min: Any, max: Any) -> Any:
    inside = None
    if min is not None:
        inside = x >= min
    if max is not None:
        inside = (x <= max) if inside is None else F.where(inside, x <= max, False)
    return F.where(inside, g, 0.0)  # at a bound the gradient passes (PyTorch)


_ABS = _refuse("abs", "bool")
_RELU = _refuse("relu", "bool")
_SOFTPLUS = _refuse("softplus", "float")

register(
    unary(
        "abs",
        "|x|; the gradient at 0 is 0 (PyTorch); not on bool.",
        lambda xp, x: xp.abs(x),
        lambda F, g, x: g * F.sign(x),
        check_args=_ABS[0],
        infer=_ABS[1],
        ufunc="absolute",
    ),
    unary(
        "sign",
        "-1, 0 or 1 (0 at NaN, as PyTorch); its gradient is 0 everywhere.",
        _sign,
        lambda F, g: F.zeros_like(g),
        save=(),
        views_input=True,
    ),
    unary(
        "exp",
        "e ** x.",
        lambda xp, x: xp.exp(x),
        lambda F, g, r: g * r,
        save=("result",),
        float_result=True,
        ufunc="exp",
    ),
    unary(
        "log",
        "Natural logarithm.",
        lambda xp, x: xp.log(x),
        lambda F, g, x: g / x,
        float_result=True,
        ufunc="log",
    ),
    unary(
        "log1p",
        "log(1 + x), accurate near 0.",
        lambda xp, x: xp.log1p(x),
        lambda F, g, x: g / (x + 1.0),
        float_result=True,
        ufunc="log1p",
    ),
    unary(
        "expm1",
        "exp(x) - 1, accurate near 0.",
        lambda xp, x: xp.expm1(x),
        lambda F, g, r: g * (r + 1.0),
        save=("result",),
        float_result=True,
        ufunc="expm1",
    ),
    unary(
        "sqrt",
        "Square root.",
        lambda xp, x: xp.sqrt(x),
        lambda F, g, r: g / (2.0 * r),
        save=("result",),
        float_result=True,
        ufunc="sqrt",
    ),
    unary(
        "square",
        "x * x (bool gives int64, as PyTorch).",
        _square,
        lambda F, g, x: g * (2.0 * x),
        infer=_square_infer,
    ),
    unary(
        "reciprocal",
        "1 / x.",
        lambda xp, x: 1.0 / x,
        lambda F, g, r: -g * r * r,
        save=("result",),
        float_result=True,
    ),
    unary(
        "sin",
        "Sine.",
        lambda xp, x: xp.sin(x),
        lambda F, g, x: g * F.cos(x),
        float_result=True,
        ufunc="sin",
    ),
    unary(
        "cos",
        "Cosine.",
        lambda xp, x: xp.cos(x),
        lambda F, g, x: -g * F.sin(x),
        float_result=True,
        ufunc="cos",
    ),
    unary(
        "tan",
        "Tangent.",
        lambda xp, x: xp.tan(x),
        lambda F, g, r: g * (1.0 + r * r),
        save=("result",),
        float_result=True,
        ufunc="tan",
    ),
    unary(
        "tanh",
        "Hyperbolic tangent.",
        lambda xp, x: xp.tanh(x),
        lambda F, g, r: g * (1.0 - r * r),
        save=("result",),
        float_result=True,
        ufunc="tanh",
    ),
    unary(
        "sigmoid",
        "1 / (1 + exp(-x)), as PyTorch computes it.",
        _sigmoid,
        lambda F, g, r: g * r * (1.0 - r),
        save=("result",),
        float_result=True,
        kernel=_sigmoid_kernel,
    ),
    unary(
        "relu",
        "max(x, 0); NaN stays NaN; the gradient at 0 is 0 (PyTorch); not on bool.",
        lambda xp, x: xp.where(x <= 0, xp.zeros_like(x), x),
        _relu_vjp,
        save=("result",),
        check_args=_RELU[0],
        infer=_RELU[1],
    ),
    unary(
        "softplus",
        "log(1 + exp(x)), stable; x itself above 20 (PyTorch's threshold); "
        "floating point inputs only, as PyTorch.",
        _softplus,
        lambda F, g, x: F.where(x > _SOFTPLUS_THRESHOLD, g, g * F.sigmoid(x)),
        check_args=_SOFTPLUS[0],
        infer=_SOFTPLUS[1],
    ),
    unary(
        "clamp",
        "Limit x to [min, max]; at a bound the gradient passes (PyTorch).",
        _clamp,
        _clamp_vjp,
        attrs={
            "min": Attr("number", None, "lower bound", nullable=True),
            "max": Attr("number", None, "upper bound", nullable=True),
        },
        infer=_clamp_infer,
    ),
)
