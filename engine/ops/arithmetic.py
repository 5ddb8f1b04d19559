"""Arithmetic: add, sub, mul, div, pow, neg, maximum, minimum (broadcasting, promoting)."""

from __future__ import annotations

import math
from typing import Any

from engine.errors import DTypeError
from engine.ops.common import as_array, binary, elementwise_infer, is_number, unary
from engine.ops.registry import Meta, register


def _pow_input_grad(F: Any, g: Any, a: Any, b: Any, result: Any) -> Any:
    if is_number(b):
        return F.zeros_like(g) if b == 0 else g * b * a ** (b - 1)
    return F.where(b == 0, 0.0, g * b * a ** (b - 1))  # PyTorch: exponent 0 gives 0, even at a=0


def _pow_exponent_grad(F: Any, g: Any, a: Any, b: Any, result: Any) -> Any:
    if is_number(a):
        # A literal base: log(a) is a constant; a=0 follows the tensor rule below.
        return g * result * math.log(a) if a > 0 else g * result * (0.0 if a == 0 else math.nan)
    # PyTorch: at a=0 with b>=0 the log term is taken as 0, not NaN.
    return F.where((a == 0) & (b >= 0), 0.0, g * result * F.log(a))


_BOOL_MINUS = ("the `-` operator on a bool tensor is not supported; to invert a mask, "
               "use logical ops (e.g. eq(mask, false))")


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


def _max_vjp(pick: Any) -> Any:
    # PyTorch: a tie sends half the gradient to each side.
    return lambda F, g, a, b: F.where(a == b, g * 0.5, F.where(pick(a, b), g, 0.0))


register(
    binary("sub", "a - b, broadcasting (not on bool, as in PyTorch).",
           lambda xp, a, b: a - b, (lambda F, g: g, lambda F, g: -g),
           infer=_no_bool_infer(elementwise_infer()), check_args=_reject_bool),
    binary("add", "a + b, broadcasting.", lambda xp, a, b: a + b,
           (lambda F, g: g, lambda F, g: g)),
    binary("mul", "a * b, broadcasting.", lambda xp, a, b: a * b,
           (lambda F, g, a, b: g * b, lambda F, g, a, b: g * a), save=("input", "other")),
    binary("div", "a / b, true division (integers give float32).", lambda xp, a, b: a / b,
           (lambda F, g, a, b: g / b, lambda F, g, a, b: -g * a / (b * b)),
           save=("input", "other"), float_result=True),
    binary("pow", "a ** b; d/da at exponent 0 is 0, d/db at a=0 (b>=0) is 0 (PyTorch).",
           lambda xp, a, b: a ** b, (_pow_input_grad, _pow_exponent_grad),
           save=("input", "exponent", "result"), args=("input", "exponent")),
    binary("maximum", "Elementwise max; ties give half the gradient to each side.",
           lambda xp, a, b: xp.maximum(as_array(xp, a, b), as_array(xp, b, a)),
           (_max_vjp(lambda a, b: a > b), _max_vjp(lambda a, b: b > a)),
           save=("input", "other")),
    binary("minimum", "Elementwise min; ties give half the gradient to each side.",
           lambda xp, a, b: xp.minimum(as_array(xp, a, b), as_array(xp, b, a)),
           (_max_vjp(lambda a, b: a < b), _max_vjp(lambda a, b: b < a)),
           save=("input", "other")),
    unary("neg", "-x (not on bool, as in PyTorch).", lambda xp, x: -x, lambda F, g: -g,
          save=(), group="arithmetic", infer=_no_bool_infer(_negate_rule),
          check_args=_reject_bool),
)
