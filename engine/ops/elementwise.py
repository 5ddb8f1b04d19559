"""Elementwise math. Stable forms for sigmoid and softplus; kinks follow PyTorch."""

from __future__ import annotations

from typing import Any

from engine.errors import AttributeError_
from engine.ops.common import unary
from engine.ops.registry import Attr, Meta, promoted_dtype, register


def _sigmoid(xp: Any, x: Any) -> Any:
    e = xp.exp(-xp.abs(x))  # never overflows: exp of a non-positive number
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


_SOFTPLUS_THRESHOLD = 20.0  # PyTorch's default: above it softplus(x) is x


def _softplus(xp: Any, x: Any) -> Any:
    stable = xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))
    return xp.where(x > _SOFTPLUS_THRESHOLD, x, stable)


def _clamp_bounds(lo: Any, hi: Any) -> None:
    if lo is None and hi is None:
        raise AttributeError_("at least one of 'min' or 'max' must be given", loc=("attrs",))


def _clamp(xp: Any, x: Any, *, min: Any, max: Any) -> Any:
    _clamp_bounds(min, max)
    float_bound = isinstance(min, float) or isinstance(max, float)
    if float_bound and (xp.isdtype(x.dtype, "integral") or x.dtype == xp.bool):
        x = xp.astype(x, xp.float32)  # a float bound promotes an integer tensor
    out = x
    if min is not None:
        out = xp.maximum(out, xp.asarray(min, dtype=x.dtype))
    if max is not None:
        out = xp.minimum(out, xp.asarray(max, dtype=x.dtype))  # PyTorch: max wins if min > max
    return out


def _clamp_infer(metas: list[Meta], *, min: Any, max: Any) -> Meta:
    (m,) = metas
    _clamp_bounds(min, max)
    lits = [Meta((), "float32" if isinstance(v, float) else "int64", True)
            for v in (min, max) if v is not None]
    return Meta(m.shape, promoted_dtype([m, *lits]))


def _clamp_vjp(F: Any, g: Any, x: Any, *, min: Any, max: Any) -> Any:
    inside = None
    if min is not None:
        inside = x >= min
    if max is not None:
        inside = (x <= max) if inside is None else inside & (x <= max)
    return F.where(inside, g, 0.0)  # at a bound the gradient passes (PyTorch)


register(
    unary("abs", "|x|; the gradient at 0 is 0 (PyTorch).", lambda xp, x: xp.abs(x),
          lambda F, g, x: g * F.sign(x)),
    unary("sign", "-1, 0 or 1; its gradient is 0 everywhere.", lambda xp, x: xp.sign(x),
          lambda F, g: F.zeros_like(g), save=()),
    unary("exp", "e ** x.", lambda xp, x: xp.exp(x), lambda F, g, r: g * r,
          save=("result",), float_result=True),
    unary("log", "Natural logarithm.", lambda xp, x: xp.log(x), lambda F, g, x: g / x,
          float_result=True),
    unary("log1p", "log(1 + x), accurate near 0.", lambda xp, x: xp.log1p(x),
          lambda F, g, x: g / (x + 1.0), float_result=True),
    unary("expm1", "exp(x) - 1, accurate near 0.", lambda xp, x: xp.expm1(x),
          lambda F, g, r: g * (r + 1.0), save=("result",), float_result=True),
    unary("sqrt", "Square root.", lambda xp, x: xp.sqrt(x), lambda F, g, r: g / (2.0 * r),
          save=("result",), float_result=True),
    unary("square", "x * x.", lambda xp, x: x * x, lambda F, g, x: g * 2.0 * x),
    unary("reciprocal", "1 / x.", lambda xp, x: 1.0 / x, lambda F, g, r: -g * r * r,
          save=("result",), float_result=True),
    unary("sin", "Sine.", lambda xp, x: xp.sin(x), lambda F, g, x: g * F.cos(x),
          float_result=True),
    unary("cos", "Cosine.", lambda xp, x: xp.cos(x), lambda F, g, x: -g * F.sin(x),
          float_result=True),
    unary("tan", "Tangent.", lambda xp, x: xp.tan(x), lambda F, g, r: g * (1.0 + r * r),
          save=("result",), float_result=True),
    unary("tanh", "Hyperbolic tangent.", lambda xp, x: xp.tanh(x),
          lambda F, g, r: g * (1.0 - r * r), save=("result",), float_result=True),
    unary("sigmoid", "1 / (1 + exp(-x)), stable for large |x|.", _sigmoid,
          lambda F, g, r: g * r * (1.0 - r), save=("result",), float_result=True),
    unary("relu", "max(x, 0); the gradient at 0 is 0 (PyTorch).",
          lambda xp, x: xp.where(x > 0, x, xp.zeros_like(x)),
          lambda F, g, r: F.where(r > 0, g, 0.0), save=("result",)),
    unary("softplus", "log(1 + exp(x)), stable; x itself above 20 (PyTorch's threshold).",
          _softplus,
          lambda F, g, x: F.where(x > _SOFTPLUS_THRESHOLD, g, g * F.sigmoid(x)),
          float_result=True),
    unary("clamp", "Limit x to [min, max]; at a bound the gradient passes (PyTorch).",
          _clamp, _clamp_vjp,
          attrs={"min": Attr("number", None, "lower bound", nullable=True),
                 "max": Attr("number", None, "upper bound", nullable=True)},
          infer=_clamp_infer),
)
