"""Running an op on Tensors: promotion, the forward, and recording for backward.

This is the engine's hot path, so it avoids work on the common case (tensors of one
dtype): shape rules run only to explain a failure, and promotion only on mixed dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.autograd import Node
from engine.backends import Backend, default_backend
from engine.dtypes import FLOATS, scalar_dtype
from engine.errors import DTypeError, GradserveError, ShapeError
from engine.grad_mode import _grad_enabled
from engine.ops.registry import Meta, OpDef, literal_meta, promoted_dtype
from engine.tensor import Tensor

_NUMBER = (int, float, bool)


def meta_of(value: Tensor | float | int | bool) -> Meta:
    if isinstance(value, Tensor):
        return Meta(value.shape, value.dtype)
    return literal_meta(value)


def _backend_of(op: OpDef, args: Sequence[Any]) -> Backend:
    backend: Backend | None = None
    for a in args:
        if type(a) is Tensor:
            if backend is None:
                backend = a._backend
            elif a._backend is not backend:
                raise ShapeError(
                    f"expected all tensors on one device, got {backend.device} and {a.device}",
                    op=op.name,
                )
        elif not isinstance(a, _NUMBER):
            raise DTypeError(
                f"arguments must be tensors or numbers, got {type(a).__name__}", op=op.name
            )
    return backend if backend is not None else default_backend()


def _compute_dtype(op: OpDef, args: Sequence[Any], promoted: Sequence[int]) -> str | None:
    """The dtype the promoted arguments compute in, or None if nothing needs casting."""
    first = args[promoted[0]]
    if type(first) is Tensor and len(promoted) == 2:
        second = args[promoted[1]]
        dt = first.dtype
        # The common cases: equal dtypes, or a float tensor with a Python number.
        if (type(second) is Tensor and second.dtype == dt) or (
            dt in FLOATS and isinstance(second, _NUMBER)
        ):
            return None if (dt in FLOATS or not op.float_result) else "float32"
    return promoted_dtype([meta_of(args[i]) for i in promoted], op.float_result)


def _explain(op: OpDef, args: Sequence[Any], attrs: dict[str, Any], exc: Exception) -> Exception:
    """Turn a backend failure into the op's own error, from its shape rule if it can."""
    try:
        op.infer([meta_of(a) for a in args], **attrs)
    except GradserveError as err:
        return err.at(op=op.name)
    return GradserveError(f"{type(exc).__name__}: {exc}", op=op.name)


def apply(op: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Tensor:
    """Run `op` on Tensors and numbers; record a Node when grad mode and inputs call for it.

    `attrs` must already be bound (validated, defaults filled): see `OpDef.bind_attrs`.
    """
    backend = _backend_of(op, args)
    raw = [a.data if type(a) is Tensor else a for a in args]
    if op.promote:
        promoted = range(len(args)) if op.promote == "all" else op.promote
        dt = _compute_dtype(op, args, promoted)
        if dt is not None:
            target = backend.dtype(dt)
            for i in promoted:
                a = raw[i]
                if isinstance(a, _NUMBER):
                    if not args or all(not isinstance(x, Tensor) for x in args):
                        raw[i] = backend.xp.asarray(a, dtype=target)
                elif a.dtype != target:
                    raw[i] = backend.xp.astype(a, target)
    elif op.float_result:
        for i, a in enumerate(raw):
            if not isinstance(a, _NUMBER) and backend.dtype_name(a) not in FLOATS:
                raw[i] = backend.xp.astype(a, backend.dtype("float32"))
    if not any(type(a) is Tensor for a in args) and raw and isinstance(raw[0], _NUMBER):
        # Only numbers: the first becomes a 0-d tensor of its default dtype.
        raw[0] = backend.xp.asarray(raw[0], dtype=backend.dtype(scalar_dtype(raw[0])))
    try:
        out = op.forward(backend.xp, *raw, **attrs)
    except GradserveError as err:
        raise err.at(op=op.name) from None
    except (ValueError, TypeError, IndexError, ArithmeticError, RuntimeError) as exc:
        raise _explain(op, args, attrs, exc) from None

    if op.vjp is not None and _grad_enabled.get():
        needs = [
            type(a) is Tensor and a.requires_grad and op.arg_differentiable(i)
            for i, a in enumerate(args)
        ]
        if any(needs) and backend.dtype_name(out) in FLOATS:
            node = Node(op, args, needs, attrs, out, backend)
            return Tensor(out, backend, requires_grad=True, grad_fn=node)
    return Tensor(out, backend)
