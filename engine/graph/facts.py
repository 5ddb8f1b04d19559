"""What a step's signature decides, worked out once per signature.

A step's op, its arguments' metas and number literals, and its attributes (its
signature) fix whether it runs as the backend's ufunc, its cost, and its kernel. A graph
repeats few signatures (an unrolled loop repeats one layer's), so these are worked out
when the first step of a signature is emitted, remembered with the decision or VJP
template that emits it (engine.graph.builder, engine.graph.autodiff), and shared by every
step that has it: the planner and the binder read them instead of working them out step
by step. A step that comes without them (a program assembled elsewhere) gets them from
`facts_of`, the same rules.
"""

from __future__ import annotations

import math
from typing import Any

from gradserve.engine.dtypes import ITEMSIZE
from gradserve.engine.graph.ir import BYTE_COST, Step
from gradserve.engine.ops.registry import Meta, OpDef, literal_meta
from gradserve.engine.shapes import numel

# Result dtypes that compiled programs compute with the backend's ufuncs directly (the
# others, float16 above all, keep the ops' own forwards: PyTorch computes float16 with
# float literals in float32).
UFUNC_DTYPES = frozenset({"float32", "float64"})


class Facts:
    """A signature's facts: `sig` is what the kernel memo keys a step by after its op
    (each argument's meta, or a literal's type and value, then the attribute values);
    `slots_only`: no argument is a literal (the step's args are its slots); `size`: its
    result's bytes; `ufunc`: it runs as a backend ufunc on operands of its result's
    dtype; `cost` in cost units, from `flops` and `bytes`; its op's `returns_input` and
    `views_input`; `kernels`: per backend, its kernels by (ufunc, into) as 2 * ufunc +
    into (filled in by the binder)."""

    __slots__ = (
        "bytes",
        "cost",
        "flops",
        "kernels",
        "returns_input",
        "sig",
        "size",
        "slots_only",
        "ufunc",
        "views_input",
    )

    def __init__(
        self,
        op: OpDef,
        sig: tuple[Any, ...],
        slots_only: bool,
        size: int,
        ufunc: bool,
        flops: int,
        bytes_: int,
    ) -> None:
        self.sig = sig
        self.slots_only = slots_only
        self.size = size
        self.ufunc = ufunc
        self.returns_input = op.returns_input
        self.views_input = op.views_input
        self.flops = flops
        self.bytes = bytes_
        self.cost = flops + BYTE_COST * bytes_
        self.kernels: dict[Any, list[Any]] = {}


def literal_key(value: Any) -> tuple[Any, ...]:
    """A number literal as the memo keys hold it: its type and value, and a float's sign as
    well (0.0 == -0.0, but `x * -0.0` is not `x * 0.0`: the signs of its zeros differ)."""
    if type(value) is float:
        return (float, value, math.copysign(1.0, value))
    return (type(value), value)


def attr_values(attrs: dict[str, Any]) -> tuple[Any, ...]:
    """The attribute values as memo keys hold them (lists as tuples)."""
    return tuple([tuple(v) if type(v) is list else v for v in attrs.values()])


def facts_of(step: Step, metas: list[Meta]) -> Facts:
    """The facts of `step` (not a loop), from its op's rules."""
    op, args = step.op, step.args
    sig = (
        *[
            metas[a] if type(a) is int else literal_key(a.value)  # type: ignore[union-attr]
            for a in args
        ],
        *attr_values(step.attrs),
    )
    slots = [a for a in args if type(a) is int]
    out = metas[step.out]
    dtype = out.dtype
    ufunc = (
        op.ufunc is not None
        and dtype in UFUNC_DTYPES
        and all(metas[a].dtype == dtype for a in slots)
    )  # type: ignore[index]
    if op.cost is None:  # one operation per element, each byte read or written once
        flops, bytes_ = numel(out.shape), size_of(out)
        for a in slots:
            flops += numel(metas[a].shape)  # type: ignore[index]
            bytes_ += size_of(metas[a])  # type: ignore[index]
    else:
        flops, bytes_ = op.cost(
            [
                metas[a] if type(a) is int else literal_meta(a.value)  # type: ignore[union-attr]
                for a in args
            ],
            out,
            **step.attrs,
        )
    return Facts(op, sig, len(slots) == len(args), size_of(out), ufunc, flops, bytes_)


_SIZES: dict[Meta, int] = {}


def size_of(meta: Meta) -> int:
    """The bytes of a value with this meta (remembered: a program's values share few)."""
    size = _SIZES.get(meta)
    if size is None:
        if len(_SIZES) >= 1 << 14:
            _SIZES.clear()
        size = _SIZES[meta] = numel(meta.shape) * ITEMSIZE[meta.dtype]
    return size
