"""Arithmetic: add, sub, mul, div, pow, neg, maximum, minimum (broadcasting, promoting)."""

from __future__ import annotations

import math
from typing import Any

from gradserve.engine.errors import DTypeError
from gradserve.engine.ops.common import as_array, binary, elementwise_infer, is_number, unary
from gradserve.engine.ops.registry import Meta, register


def _pow_input_grad(F: Any, g: Any, a: Any, b: Any, result: Any) -> Any:
    # PyTorch's pow_backward: exponent 0 gives 0, even at a=0 (grouping as there, so that
    # infinities and second derivatives come out the same).
    if is_number(b):
        return F.zeros_like(g) if b == 0 else g * (b * a ** (b - 1))
    return F.where(b == 0, 0.0, g * (b * a ** (b - 1)))


def _pow_exponent_grad(F: Any, g: Any, a: Any, b: Any, result: Any) -> Any:
    # PyTorch's pow_backward_exponent: the log term is 0 where a == 0 and b >= 0.
    if is_number(a):
        if a == 0:
            return g * F.where(b >= 0, 0.0, result * -math.inf)
        return g * (result * (math.log(a) if a > 0 else math.nan))
    return g * F.where(F.where(a == 0, b >= 0, False), 0.0, result * F.log(a))


_NEGATIVE_INT_POWER = "Integers to negative integer powers are not allowed"


def _power(xp: Any, a: Any, b: Any, integer_powers: Any) -> Any:
    """a ** b with PyTorch's special cases: integer tensors to negative tensor powers give
    1, -1 or 0 (`integer_powers`; a negative literal power is an error), bool only to a
    bool literal power, and literal powers 0.5 and -0.5 as sqrt and rsqrt (so sqrt(-inf)
    is NaN)."""
    arr = b if is_number(a) else a
    if type(b) is float and xp.isdtype(arr.dtype, "real floating"):
        if b == 0.5:
            return xp.sqrt(a)
        if b == -0.5:
            return 1.0 / xp.sqrt(a)
        return a**b
    if arr.dtype == xp.bool:
        if isinstance(b, bool):
            return a if b else xp.ones_like(a)
        raise DTypeError(_BOOL_POW)
    if not xp.isdtype(arr.dtype, "integral"):
        return a**b
    if is_number(b):
        if b < 0:
            raise DTypeError(_NEGATIVE_INT_POWER)
        return a**b
    return integer_powers(xp, as_array(xp, a, b), b)


def _pow(xp: Any, a: Any, b: Any) -> Any:
    return _power(xp, a, b, _integer_powers_if_any_negative)


def _pow_lowering(xp: Any, a: Any, b: Any) -> Any:
    """The XLA tier's: it cannot look at the exponents first, so it always selects."""
    return _power(xp, a, b, _integer_powers)


def _integer_powers_if_any_negative(xp: Any, a: Any, b: Any) -> Any:
    """The interpreter's: plain a ** b when no exponent is negative (which it can see)."""
    return a**b if not xp.any(b < 0) else _integer_powers(xp, a, b)


def _integer_powers(xp: Any, a: Any, b: Any) -> Any:
    """Integer tensors to integer tensor powers, negative ones as PyTorch: 1 ** n is 1,
    (-1) ** n is 1 or -1 by n's parity, and any other base gives 0."""
    negative = b < 0
    zero = xp.zeros_like(b)
    out = a ** xp.where(negative, zero, b)
    one = xp.ones_like(out)
    odd = xp.where(b % 2 == 0, one, -one)
    special = xp.where(a == 1, one, xp.where(a == -1, odd, xp.zeros_like(out)))
    return xp.where(negative, special, out)


_BOOL_POW = "pow is not implemented for bool tensors (except to a literal bool power)"


def _pow_infer(metas: list[Meta]) -> Meta:
    out = elementwise_infer()(metas)
    if out.dtype == "bool" and not metas[1].literal:
        raise DTypeError(_BOOL_POW)
    return out


def _scalar_opmath(fn: Any) -> Any:
    """PyTorch computes a float16 tensor with a Python float in float32 and rounds once
    (0 * 1e10 is 0, not NaN from 1e10 rounding to inf first)."""

    def forward(xp: Any, a: Any, b: Any) -> Any:
        # Of the supported dtypes only float16 is 2 bytes wide (a cheap test on a hot path).
        if type(b) is float and getattr(a.dtype, "itemsize", 0) == 2:
            return xp.astype(fn(xp.astype(a, xp.float32), b), a.dtype)
        if type(a) is float and getattr(b.dtype, "itemsize", 0) == 2:
            return xp.astype(fn(a, xp.astype(b, xp.float32)), b.dtype)
        return fn(a, b)

    return forward


_BOOL_MINUS = (
    "the `-` operator on a bool tensor is not supported; to invert a mask, "
    "use logical ops (e.g. eq(mask, false))"
)


def _reject_bool(xp: Any, *values: Any) -> None:
    if any(isinstance(v, bool) or (not is_number(v) and v.dtype == xp.bool) for v in values):
        raise DTypeError(_BOOL_MINUS)


def _no_bool_infer(rule: Any) -> Any:
    def infer(metas: list[Meta], **attrs: Any) -> Meta:
        if any(m.dtype == "bool" for m in metas):
            raise DTypeError(_BOOL_MINUS)
        return rule(metas, **attrs)

    return infer


def _negate_rule(metas: list[Meta]) -> Meta:
    return Meta(metas[0].shape, metas[0].dtype)


def _max_vjp(lose: Any) -> Any:
    # PyTorch: a tie sends half the gradient to each side; only the losing side gets 0, so
    # with a NaN (no side loses) both get the whole gradient.
    return lambda F, g, a, b: F.where(lose(a, b), 0.0, F.where(a == b, g * 0.5, g))


register(
    binary(
        "sub",
        "a - b, broadcasting (not on bool, as in PyTorch).",
        lambda xp, a, b: a - b,
        (lambda F, g: g, lambda F, g: -g),
        infer=_no_bool_infer(elementwise_infer()),
        check_args=_reject_bool,
        ufunc="subtract",
    ),
    binary(
        "add",
        "a + b, broadcasting.",
        lambda xp, a, b: a + b,
        (lambda F, g: g, lambda F, g: g),
        ufunc="add",
    ),
    binary(
        "mul",
        "a * b, broadcasting.",
        _scalar_opmath(lambda a, b: a * b),
        (lambda F, g, a, b: g * b, lambda F, g, a, b: g * a),
        save=("input", "other"),
        ufunc="multiply",
    ),
    binary(
        "div",
        "a / b, true division (integers give float32).",
        _scalar_opmath(lambda a, b: a / b),
        (lambda F, g, a, b: g / b, lambda F, g, a, b: -g * ((a / b) / b)),
        save=("input", "other"),
        float_result=True,
        ufunc="divide",
    ),
    binary(
        "pow",
        "a ** b; d/da at exponent 0 is 0, d/db at a=0 (b>=0) is 0 (PyTorch).",
        _pow,
        (_pow_input_grad, _pow_exponent_grad),
        views_input=True,
        save=("input", "exponent", "result"),
        args=("input", "exponent"),
        infer=_pow_infer,
        lower=_pow_lowering,
        lifts_literals=False,
    ),
    binary(
        "maximum",
        "Elementwise max; ties give half the gradient to each side.",
        lambda xp, a, b: xp.maximum(as_array(xp, a, b), as_array(xp, b, a)),
        (_max_vjp(lambda a, b: a < b), _max_vjp(lambda a, b: a > b)),
        save=("input", "other"),
        ufunc="maximum",
    ),
    binary(
        "minimum",
        "Elementwise min; ties give half the gradient to each side.",
        lambda xp, a, b: xp.minimum(as_array(xp, a, b), as_array(xp, b, a)),
        (_max_vjp(lambda a, b: a > b), _max_vjp(lambda a, b: a < b)),
        save=("input", "other"),
        ufunc="minimum",
    ),
    unary(
        "neg",
        "-x (not on bool, as in PyTorch).",
        lambda xp, x: -x,
        lambda F, g: -g,
        save=(),
        group="arithmetic",
        infer=_no_bool_infer(_negate_rule),
        check_args=_reject_bool,
        ufunc="negative",
    ),
)
