"""The Tensor: an array on a device, plus what autograd needs (requires_grad, grad, grad_fn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from engine.backends import Backend, get_backend
from engine.dtypes import DTYPES, FLOATS, check_dtype
from engine.errors import DTypeError, TensorDataError

if TYPE_CHECKING:
    from engine.autograd import Node


class Tensor:
    """A value in the graph. Leaves are made by `tensor()`; every op result records the
    op that made it in `grad_fn` (when grad mode is on and an input requires grad)."""

    __slots__ = ("__weakref__", "_backend", "data", "grad", "grad_fn", "requires_grad")
    __hash__ = object.__hash__  # `==` builds an `eq` op, as in PyTorch; hashing stays by identity

    data: Any
    requires_grad: bool
    grad: Tensor | None
    grad_fn: Node | None

    def __init__(
        self,
        data: Any,
        backend: Backend,
        requires_grad: bool = False,
        grad_fn: Node | None = None,
    ) -> None:
        self.data = data
        self._backend = backend
        self.requires_grad = requires_grad
        self.grad_fn = grad_fn
        self.grad = None

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> str:
        return self._backend.dtype_name(self.data)

    @property
    def device(self) -> str:
        return self._backend.device

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def dim(self) -> int:
        return self.ndim

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def numel(self) -> int:
        out = 1
        for n in self.data.shape:
            out *= n
        return out

    def size(self, dim: int | None = None) -> tuple[int, ...] | int:
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ------------------------------------------------------------ conversions
    def numpy(self) -> np.ndarray:
        """The value as a NumPy array on the host (a copy for device tensors)."""
        return np.asarray(self._backend.to_host(self.data))

    def item(self) -> bool | int | float:
        if self.numel() != 1:
            raise ValueError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
        return self.numpy().reshape(()).item()  # type: ignore[no-any-return]

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __repr__(self) -> str:
        """PyTorch's layout: `tensor([1., 2.], dtype=float64, grad_fn=<MulBackward>)`."""
        text = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = "" if self.dtype in ("float32", "int64", "bool") else f", dtype={self.dtype}"
        if self.device != "cpu":
            extra += f", device='{self.device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{self.grad_fn.name()}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({text}{extra})"

    # ------------------------------------------------------------ autograd
    def detach(self) -> Tensor:
        """The same value, cut from the graph (shares memory, as in PyTorch)."""
        return Tensor(self.data, self._backend)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if not self.is_leaf:
            raise RuntimeError(
                "you can only change requires_grad flags of leaf variables; "
                "use .detach() for a non-leaf"
            )
        _check_requires_grad(requires_grad, self.dtype)
        self.requires_grad = requires_grad
        return self

    def backward(
        self,
        gradient: Tensor | Any | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
    ) -> None:
        from engine.autograd import backward

        backward([self], None if gradient is None else [gradient], retain_graph, create_graph)

    def to(self, device: str | None = None, dtype: str | None = None) -> Tensor:
        out = self
        if dtype is not None:
            from engine.ops import OPS
            from engine.ops.dispatch import apply

            out = apply(OPS["cast"], (out,), {"dtype": check_dtype(dtype)})
        if device is not None and get_backend(device) is not out._backend:
            target = get_backend(device)
            host = out._backend.to_host(out.data)
            out = Tensor(target.from_host(host), target, requires_grad=out.requires_grad)
        return out


def _check_requires_grad(requires_grad: bool, dtype: str) -> None:
    if requires_grad and dtype not in FLOATS:
        raise DTypeError(f"only floating point tensors can require gradients, got {dtype}")


def tensor(
    data: Any,
    dtype: Any = None,
    requires_grad: bool = False,
    device: str = "cpu",
) -> Tensor:
    """A new leaf tensor, as `torch.tensor`: floats default to float32, ints to int64."""
    backend = get_backend(device)
    host = data.numpy() if isinstance(data, Tensor) else _host_array(data)
    name = check_dtype(dtype) if dtype is not None else _default_dtype(data, host)
    _check_requires_grad(requires_grad, name)
    host = np.array(host, dtype=name, order="C")  # a copy, as torch.tensor makes
    return Tensor(backend.from_host(host), backend, requires_grad=requires_grad)


def from_numpy(
    array: np.ndarray, requires_grad: bool = False, device: str = "cpu"
) -> Tensor:
    """A leaf tensor over a NumPy array, as `torch.from_numpy`: on the CPU it shares the
    array's memory (no copy); on a GPU it is uploaded."""
    name = _NUMPY_NAMES.get(array.dtype)
    if name is None:
        raise DTypeError(f"unsupported dtype {array.dtype}; expected one of {', '.join(DTYPES)}")
    _check_requires_grad(requires_grad, name)
    backend = get_backend(device)
    return Tensor(backend.from_host(array), backend, requires_grad=requires_grad)


_NUMPY_NAMES = {np.dtype(name): name for name in DTYPES}


def _host_array(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    try:
        out = np.asarray(data)
    except ValueError as exc:
        raise TensorDataError(f"ragged or malformed tensor data: {exc}") from None
    if out.dtype == object or out.dtype.kind not in "biuf":
        raise TensorDataError(f"tensor data must be numbers, got {out.dtype} data")
    return out


def _default_dtype(data: Any, host: np.ndarray) -> str:
    """torch.tensor's rule: NumPy data keeps its dtype; Python numbers give bool, int64 or
    the default float32."""
    if hasattr(data, "dtype") and host.dtype in _NUMPY_NAMES:
        return _NUMPY_NAMES[host.dtype]
    kind = host.dtype.kind
    if kind == "b":
        return "bool"
    return "int64" if kind in "iu" else "float32"
