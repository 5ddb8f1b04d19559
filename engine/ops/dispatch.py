"""Running an op on Tensors: promotion, the forward, and recording for backward.

This is the engine's hot path, so it avoids work on the common case (tensors of one
dtype): shape rules run only to explain a failure, and promotion only on mixed dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.autograd import Node
from engine.backends import Backend, default_backend
from engine.dtypes import scalar_dtype
from engine.errors import DTypeError, GradserveError, ShapeError
from engine.grad_mode import _grad_enabled
from engine.ops.common import is_number
from engine.ops.registry import INT64_MAX, INT64_MIN, Meta, OpDef, literal_meta, promoted_dtype
from engine.tensor import Tensor

_NUMBER = (int, float, bool)


def meta_of(value: Tensor | float | int | bool) -> Meta:
    if isinstance(value, Tensor):
        return Meta(value.shape, value.dtype)
    return literal_meta(value)


def _device_mismatch(op: OpDef, a: Backend, b: Backend) -> ShapeError:
    return ShapeError(f"expected all tensors on one device, got {a.device} and {b.device}",
                      op=op.name)


def _not_a_tensor(op: OpDef, value: Any) -> DTypeError:
    return DTypeError(f"arguments must be tensors or numbers, got {type(value).__name__}",
                      op=op.name)


def _python_number(value: Any) -> Any:
    """A NumPy scalar as the Python number it stands for; anything else as it is."""
    if isinstance(value, _NUMBER) and not is_number(value):
        return value.item()  # type: ignore[union-attr]  # a NumPy scalar: it has .item()
    return value


def _promote(op: OpDef, args: Sequence[Any], raw: list[Any], backend: Backend) -> None:
    """Cast the promoted arguments to their common dtype (PyTorch's rules), in place."""
    promoted = op.promoted(len(args))
    if len(promoted) == 2:
        a, b = raw[promoted[0]], raw[promoted[1]]
        # The common cases: equal dtypes, or a float array with a Python number.
        if not is_number(a) and (
            (not is_number(b) and a.dtype is b.dtype)
            or (is_number(b) and a.dtype in backend.float_dtypes)
        ) and (not op.float_result or a.dtype in backend.float_dtypes):
            return
    target = backend.dtype(promoted_dtype([meta_of(args[i]) for i in promoted], op.float_result))
    only_numbers = not any(type(x) is Tensor for x in args)
    for i in promoted:
        a = raw[i]
        if is_number(a):
            if only_numbers:
                raw[i] = backend.xp.asarray(a, dtype=target)
        elif a.dtype != target:
            raw[i] = backend.xp.astype(a, target)


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
    backend: Backend | None = None
    any_requires_grad = False
    raw: list[Any] = []
    for a in args:
        if type(a) is Tensor:
            if backend is None:
                backend = a._backend
            elif a._backend is not backend:
                raise _device_mismatch(op, backend, a._backend)
            raw.append(a.data)
            any_requires_grad = any_requires_grad or a.requires_grad
        elif is_number(a):
            if type(a) is int and not INT64_MIN <= a <= INT64_MAX:
                raise DTypeError(f"integer literal {a} is outside the int64 range", op=op.name)
            raw.append(a)
        elif isinstance(a, _NUMBER):  # a NumPy scalar given as a number: read it as one
            return apply(op, [_python_number(x) for x in args], attrs)
        else:
            raise _not_a_tensor(op, a)
    if backend is None:
        backend = default_backend()
        if raw:  # only numbers: the first becomes a 0-d tensor of its default dtype
            raw[0] = backend.xp.asarray(raw[0], dtype=backend.dtype(scalar_dtype(raw[0])))
    if op.check_args is not None:
        try:
            op.check_args(backend.xp, *raw)
        except GradserveError as err:
            raise err.at(op=op.name) from None
    if op.promote:
        _promote(op, args, raw, backend)
    elif op.float_result:
        for i, a in enumerate(raw):
            if not is_number(a) and a.dtype not in backend.float_dtypes:
                raw[i] = backend.xp.astype(a, backend.dtype("float32"))
    try:
        out = op.forward(backend.xp, *raw, **attrs)
    except GradserveError as err:
        raise err.at(op=op.name) from None
    except (ValueError, TypeError, IndexError, ArithmeticError, RuntimeError) as exc:
        raise _explain(op, args, attrs, exc) from None

    return wrap(op, args, attrs, out, backend, any_requires_grad)


def wrap(op: OpDef, args: Sequence[Any], attrs: dict[str, Any], out: Any, backend: Backend,
         any_requires_grad: bool) -> Tensor:
    """The result Tensor of an op, recording its Node when the graph needs it."""
    if (any_requires_grad and op.vjp is not None and out.dtype in backend.float_dtypes
            and _grad_enabled.get()):
        node = Node(op, args, attrs, out, backend)
        if op.diff_mask is None or node.recorded:
            return Tensor(out, backend, True, node)
    return Tensor(out, backend)


def binary_operator(op: OpDef, reflected: bool) -> Any:
    """`Tensor.__mul__` and friends. The common cases (a tensor of the same dtype and
    device, or a Python float with a float tensor) need no promotion: they skip `apply`'s
    general path, which is most of the per-op cost on small tensors."""
    forward = op.forward
    float_result = op.float_result
    # Ops with their own argument checks (sub refuses bool) take `apply`'s one path, so
    # that `x - y` and `engine.sub(x, y)` can never disagree.
    checked = op.check_args is not None

    def method(self: Tensor, other: Any) -> Tensor:
        backend = self._backend
        data = self.data
        kind = type(other)
        if kind is Tensor:
            fast = (other._backend is backend and other.data.dtype is data.dtype
                    and (not float_result or data.dtype in backend.float_dtypes))
            other_raw = other.data
        else:
            if not isinstance(other, _NUMBER):
                return NotImplemented  # type: ignore[no-any-return]
            fast = kind is float and data.dtype in backend.float_dtypes
            other_raw = other
        args = (other, self) if reflected else (self, other)
        if fast and not checked:
            try:
                out = (forward(backend.xp, other_raw, data) if reflected
                       else forward(backend.xp, data, other_raw))
            except (ValueError, TypeError, ArithmeticError):
                return apply(op, args, _NO_ATTRS)  # raises the op's own error
            return wrap(op, args, _NO_ATTRS, out, backend,
                        self.requires_grad or (kind is Tensor and other.requires_grad))
        return apply(op, args, _NO_ATTRS)

    return method


_NO_ATTRS: dict[str, Any] = {}
