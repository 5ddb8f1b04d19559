"""The Tensor, the top layer of the engine: an array on a device, plus what autograd needs
(requires_grad, grad, grad_fn), and every op of the catalog as its method or operator.

Nothing in the engine imports this module (as tinygrad puts `Tensor` on top): the op
registry, the backends and the autograd core below it work on arrays and nodes. Running
an op on Tensors (`apply`: promotion, the forward, recording a Node) and the backward
pass's Tensor side (`backward`, `grad`, leaves' `.grad`) live here for that reason.

The methods and operators made from the registry are written out in the class, between
the markers, by `python -m gradserve.engine.codegen` (tests/engine/test_codegen.py fails
when they drift from the registry), so that type checkers see them: `x + y` and `x.sum()`
are typed.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeAlias

import numpy as np

from gradserve.engine.autograd import Node, raw_namespace, run_backward
from gradserve.engine.backends import Backend, default_backend, get_backend
from gradserve.engine.errors import (
    BackwardError,
    DTypeError,
    GradserveError,
    ShapeError,
    TensorDataError,
)
from gradserve.engine.grad_mode import _grad_enabled
from gradserve.engine.rules import (
    DTYPES,
    FLOATS,
    INT64_MAX,
    INT64_MIN,
    OPS,
    Meta,
    OpDef,
    check_dtype,
    fmt,
    is_number,
    literal_meta,
    promoted_dtype,
    scalar_dtype,
)

Number = builtins.bool | builtins.int | builtins.float
# What check_dtype reads: "float32", np.float32, float. A declared alias, because mypyc's
# build (setup.py) type-checks without NumPy installed, where `np.dtype` is Any.
DTypeLike: TypeAlias = str | type | np.dtype[Any]
_NUMBER = (int, float, bool)
_NO_ATTRS: dict[str, Any] = {}


def _operator(name: str, reflected: bool) -> Callable[[Tensor, Tensor | float], Tensor]:
    """`Tensor.__mul__` and friends. The common cases (a tensor of the same dtype and
    device, or a Python float with a float tensor) need no promotion: they skip `apply`'s
    general path, which is most of the per-op cost on small tensors."""
    op = OPS[name]
    forward = op.forward
    float_result = op.float_result
    # Ops with their own argument checks (sub refuses bool) take `apply`'s one path, so
    # that `x - y` and `engine.sub(x, y)` can never disagree.
    checked = op.check_args is not None

    def method(self: Tensor, other: Tensor | float) -> Tensor:
        backend = self._backend
        data = self.data
        kind = type(other)
        if kind is Tensor:
            fast = (
                other._backend is backend  # type: ignore[union-attr]
                and other.data.dtype is data.dtype  # type: ignore[union-attr]
                and (not float_result or data.dtype in backend.float_dtypes)
            )
            other_raw = other.data  # type: ignore[union-attr]
        else:
            if not isinstance(other, _NUMBER):
                return NotImplemented  # type: ignore[no-any-return]
            fast = kind is float and data.dtype in backend.float_dtypes
            other_raw = other
        args = (other, self) if reflected else (self, other)
        if fast and not checked:
            try:
                out = (
                    forward(backend.xp, other_raw, data)
                    if reflected
                    else forward(backend.xp, data, other_raw)
                )
            except (ValueError, TypeError, ArithmeticError):
                return apply(op, args, _NO_ATTRS)  # raises the op's own error
            return wrap(
                op,
                args,
                _NO_ATTRS,
                out,
                backend,
                self.requires_grad or (kind is Tensor and other.requires_grad),  # type: ignore[union-attr]
            )
        return apply(op, args, _NO_ATTRS)

    method.__name__ = method.__qualname__ = f"__{'r' if reflected else ''}{name}__"
    return method


class Tensor:
    """A value in the graph. Leaves are made by `tensor()`; every op result records the
    op that made it in `grad_fn` (when grad mode is on and an input requires grad)."""

    __slots__ = ("__weakref__", "_backend", "data", "grad", "grad_fn", "requires_grad")
    __hash__ = object.__hash__  # `==` builds an `eq` op, as in PyTorch; hashing stays by identity

    data: Any
    requires_grad: builtins.bool
    grad: Tensor | None
    grad_fn: Node | None

    def __init__(
        self,
        data: Any,
        backend: Backend,
        requires_grad: builtins.bool = False,
        grad_fn: Node | None = None,
    ) -> None:
        self.data = data
        self._backend = backend
        self.requires_grad = requires_grad
        self.grad_fn = grad_fn
        self.grad = None

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[builtins.int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> str:
        return self._backend.dtype_name(self.data)

    @property
    def device(self) -> str:
        return self._backend.device

    @property
    def ndim(self) -> builtins.int:
        return len(self.data.shape)

    def dim(self) -> builtins.int:
        return self.ndim

    @property
    def is_leaf(self) -> builtins.bool:
        return self.grad_fn is None

    @property
    def nbytes(self) -> builtins.int:
        return builtins.int(self.data.nbytes)

    def numel(self) -> builtins.int:
        out = 1
        for n in self.data.shape:
            out *= n
        return out

    def size(self, dim: builtins.int | None = None) -> tuple[builtins.int, ...] | builtins.int:
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> builtins.int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ------------------------------------------------------------ conversions
    def numpy(self) -> np.ndarray:
        """The value as a NumPy array on the host (a copy for device tensors)."""
        return np.asarray(self._backend.to_host(self.data))

    def item(self) -> Number:
        if self.numel() != 1:
            raise ValueError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
        return self.numpy().reshape(()).item()  # type: ignore[no-any-return]

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __bool__(self) -> builtins.bool:
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return builtins.bool(self.item())

    def __float__(self) -> builtins.float:
        return builtins.float(self.item())

    def __int__(self) -> builtins.int:
        return builtins.int(self.item())

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

    def requires_grad_(self, requires_grad: builtins.bool = True) -> Tensor:
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
        retain_graph: builtins.bool | None = None,
        create_graph: builtins.bool = False,
    ) -> None:
        backward([self], None if gradient is None else [gradient], retain_graph, create_graph)

    def to(self, device: str | None = None, dtype: DTypeLike | None = None) -> Tensor:
        out = self
        if dtype is not None:
            out = apply(OPS["cast"], (out,), {"dtype": check_dtype(dtype)})
        if device is not None and get_backend(device) is not out._backend:
            target = get_backend(device)
            host = out._backend.to_host(out.data)
            out = Tensor(target.from_host(host), target, requires_grad=out.requires_grad)
        return out

    # ------------------------------------------------------------ PyTorch's spellings
    def __pos__(self) -> Tensor:
        return self

    def __getitem__(self, key: Any) -> Tensor:
        """Basic indexing with ints, slices (positive steps) and `...`, through the `slice`
        and `squeeze` ops, so gradients flow as they do in PyTorch."""
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = key.index(Ellipsis)
            fill = (builtins.slice(None),) * (self.ndim - len(key) + 1)
            key = key[:at] + fill + key[at + 1 :]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for a tensor of {self.ndim} dimension(s)")
        out, dim = self, 0
        for k in key:
            if isinstance(k, builtins.slice):
                if k != builtins.slice(None):
                    out = out.slice(dim, k.start or 0, k.stop, 1 if k.step is None else k.step)
                dim += 1
            elif isinstance(k, builtins.int) and not isinstance(k, builtins.bool):
                size = out.shape[dim]
                if not -size <= k < size:
                    raise IndexError(
                        f"index {k} is out of bounds for dimension {dim} with size {size}"
                    )
                out = out.slice(dim, k % size, k % size + 1).squeeze(dim)
            else:
                raise TypeError(
                    f"unsupported index {k!r}: use ints, slices and ...; for tensor "
                    "indices use index_select or gather"
                )
        return out

    @property
    def T(self) -> Tensor:
        return self.permute(list(range(self.ndim))[::-1])

    def view(self, shape: builtins.int | Sequence[builtins.int], *sizes: builtins.int) -> Tensor:
        return self.reshape(shape, *sizes)

    def float(self) -> Tensor:
        return self.cast("float32")

    def double(self) -> Tensor:
        return self.cast("float64")

    def half(self) -> Tensor:
        return self.cast("float16")

    def int(self) -> Tensor:
        return self.cast("int32")

    def long(self) -> Tensor:
        return self.cast("int64")

    def bool(self) -> Tensor:
        return self.cast("bool")

    # ---- generated by `python -m gradserve.engine.codegen` from the op registry: do not edit ----
    __add__ = _operator("add", reflected=False)
    __sub__ = _operator("sub", reflected=False)
    __mul__ = _operator("mul", reflected=False)
    __truediv__ = _operator("div", reflected=False)
    __pow__ = _operator("pow", reflected=False)
    __matmul__ = _operator("matmul", reflected=False)
    __radd__ = _operator("add", reflected=True)
    __rsub__ = _operator("sub", reflected=True)
    __rmul__ = _operator("mul", reflected=True)
    __rtruediv__ = _operator("div", reflected=True)
    __rpow__ = _operator("pow", reflected=True)
    __rmatmul__ = _operator("matmul", reflected=True)
    __lt__ = _operator("lt", reflected=False)
    __le__ = _operator("le", reflected=False)
    __gt__ = _operator("gt", reflected=False)
    __ge__ = _operator("ge", reflected=False)
    __eq__ = _operator("eq", reflected=False)  # type: ignore[assignment]
    __ne__ = _operator("ne", reflected=False)  # type: ignore[assignment]

    def __neg__(self) -> Tensor:
        return apply(OPS["neg"], (self,), _NO_ATTRS)

    def __abs__(self) -> Tensor:
        return apply(OPS["abs"], (self,), _NO_ATTRS)

    def sub(self, other: Tensor | builtins.float) -> Tensor:
        """a - b, broadcasting (not on bool, as in PyTorch)."""
        return call("sub", (self, other), _NO_ATTRS)

    def add(self, other: Tensor | builtins.float) -> Tensor:
        """a + b, broadcasting."""
        return call("add", (self, other), _NO_ATTRS)

    def mul(self, other: Tensor | builtins.float) -> Tensor:
        """a * b, broadcasting."""
        return call("mul", (self, other), _NO_ATTRS)

    def div(self, other: Tensor | builtins.float) -> Tensor:
        """a / b, true division (integers give float32)."""
        return call("div", (self, other), _NO_ATTRS)

    def pow(self, exponent: Tensor | builtins.float) -> Tensor:
        """a ** b; d/da at exponent 0 is 0, d/db at a=0 (b>=0) is 0 (PyTorch)."""
        return call("pow", (self, exponent), _NO_ATTRS)

    def maximum(self, other: Tensor | builtins.float) -> Tensor:
        """Elementwise max; ties give half the gradient to each side."""
        return call("maximum", (self, other), _NO_ATTRS)

    def minimum(self, other: Tensor | builtins.float) -> Tensor:
        """Elementwise min; ties give half the gradient to each side."""
        return call("minimum", (self, other), _NO_ATTRS)

    def neg(self) -> Tensor:
        """-x (not on bool, as in PyTorch)."""
        return call("neg", (self,), _NO_ATTRS)

    def eq(self, other: Tensor | builtins.float) -> Tensor:
        """a == b elementwise (bool; not differentiable)."""
        return call("eq", (self, other), _NO_ATTRS)

    def ne(self, other: Tensor | builtins.float) -> Tensor:
        """a != b elementwise (bool; not differentiable)."""
        return call("ne", (self, other), _NO_ATTRS)

    def lt(self, other: Tensor | builtins.float) -> Tensor:
        """a < b elementwise (bool; not differentiable)."""
        return call("lt", (self, other), _NO_ATTRS)

    def le(self, other: Tensor | builtins.float) -> Tensor:
        """a <= b elementwise (bool; not differentiable)."""
        return call("le", (self, other), _NO_ATTRS)

    def gt(self, other: Tensor | builtins.float) -> Tensor:
        """a > b elementwise (bool; not differentiable)."""
        return call("gt", (self, other), _NO_ATTRS)

    def ge(self, other: Tensor | builtins.float) -> Tensor:
        """a >= b elementwise (bool; not differentiable)."""
        return call("ge", (self, other), _NO_ATTRS)

    def where(self, input: Tensor | builtins.float, other: Tensor | builtins.float) -> Tensor:
        """condition ? input : other, broadcasting; the gradient goes to the chosen side."""
        return call("where", (self, input, other), _NO_ATTRS)

    def cast(self, dtype: DTypeLike) -> Tensor:
        """Convert to another dtype; the gradient is cast back (floats only)."""
        return call("cast", (self,), {"dtype": dtype})

    def abs(self) -> Tensor:
        """|x|; the gradient at 0 is 0 (PyTorch); not on bool."""
        return call("abs", (self,), _NO_ATTRS)

    def sign(self) -> Tensor:
        """-1, 0 or 1 (0 at NaN, as PyTorch); its gradient is 0 everywhere."""
        return call("sign", (self,), _NO_ATTRS)

    def exp(self) -> Tensor:
        """e ** x."""
        return call("exp", (self,), _NO_ATTRS)

    def log(self) -> Tensor:
        """Natural logarithm."""
        return call("log", (self,), _NO_ATTRS)

    def log1p(self) -> Tensor:
        """log(1 + x), accurate near 0."""
        return call("log1p", (self,), _NO_ATTRS)

    def expm1(self) -> Tensor:
        """exp(x) - 1, accurate near 0."""
        return call("expm1", (self,), _NO_ATTRS)

    def sqrt(self) -> Tensor:
        """Square root."""
        return call("sqrt", (self,), _NO_ATTRS)

    def square(self) -> Tensor:
        """x * x (bool gives int64, as PyTorch)."""
        return call("square", (self,), _NO_ATTRS)

    def reciprocal(self) -> Tensor:
        """1 / x."""
        return call("reciprocal", (self,), _NO_ATTRS)

    def sin(self) -> Tensor:
        """Sine."""
        return call("sin", (self,), _NO_ATTRS)

    def cos(self) -> Tensor:
        """Cosine."""
        return call("cos", (self,), _NO_ATTRS)

    def tan(self) -> Tensor:
        """Tangent."""
        return call("tan", (self,), _NO_ATTRS)

    def tanh(self) -> Tensor:
        """Hyperbolic tangent."""
        return call("tanh", (self,), _NO_ATTRS)

    def sigmoid(self) -> Tensor:
        """1 / (1 + exp(-x)), as PyTorch computes it."""
        return call("sigmoid", (self,), _NO_ATTRS)

    def relu(self) -> Tensor:
        """max(x, 0); NaN stays NaN; the gradient at 0 is 0 (PyTorch); not on bool."""
        return call("relu", (self,), _NO_ATTRS)

    def softplus(self) -> Tensor:
        """log(1 + exp(x)), stable; x itself above 20 (PyTorch's threshold); floating point inputs
        only, as PyTorch."""
        return call("softplus", (self,), _NO_ATTRS)

    def clamp(
        self,
        *,
        min: builtins.float | None = None,
        max: builtins.float | None = None,
    ) -> Tensor:
        """Limit x to [min, max]; at a bound the gradient passes (PyTorch)."""
        return call("clamp", (self,), {"min": min, "max": max})

    def slice(
        self,
        dim: builtins.int,
        start: builtins.int = 0,
        stop: builtins.int | None = None,
        step: builtins.int = 1,
    ) -> Tensor:
        """Python slicing x[start:stop:step] on one dim (step > 0; bounds clamped)."""
        return call("slice", (self,), {"dim": dim, "start": start, "stop": stop, "step": step})

    def index_select(self, dim: builtins.int, index: Tensor | builtins.float) -> Tensor:
        """The entries at an int index (0-d or 1-d) along `dim`, as torch.index_select."""
        return call("index_select", (self, index), {"dim": dim})

    def gather(self, dim: builtins.int, index: Tensor | builtins.float) -> Tensor:
        """`out[i][j] = input[index[i][j]][j]` along `dim`, as torch.gather (repeated indices sum
        their gradients)."""
        return call("gather", (self, index), {"dim": dim})

    def scatter_add(
        self,
        dim: builtins.int,
        index: Tensor | builtins.float,
        src: Tensor | builtins.float,
    ) -> Tensor:
        """input with src added at index along `dim` (repeats accumulate), as
        torch.Tensor.scatter_add."""
        return call("scatter_add", (self, index, src), {"dim": dim})

    def matmul(self, other: Tensor | builtins.float) -> Tensor:
        """Matrix product as torch.matmul: 1-D operands are vectors, batch dims broadcast; both
        operands must have one dtype."""
        return call("matmul", (self, other), _NO_ATTRS)

    def transpose(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """Swap two dims."""
        return call("transpose", (self,), {"dim0": dim0, "dim1": dim1})

    def permute(self, dims: builtins.int | Sequence[builtins.int], *sizes: builtins.int) -> Tensor:
        """Reorder all dims."""
        return call("permute", (self,), {"dims": spread(dims, sizes)})

    def det(self) -> Tensor:
        """Determinant of (batches of) square matrices; the gradient needs A invertible."""
        return call("det", (self,), _NO_ATTRS)

    def inv(self) -> Tensor:
        """Inverse of (batches of) square matrices."""
        return call("inv", (self,), _NO_ATTRS)

    def solve(self, B: Tensor | builtins.float) -> Tensor:
        """X with A X = B, as torch.linalg.solve (B: matrices, or vectors shaped like A without its
        last dim, or 1-D)."""
        return call("solve", (self, B), _NO_ATTRS)

    def cross(self, other: Tensor | builtins.float, dim: builtins.int = -1) -> Tensor:
        """Cross product of 3-vectors along `dim`, as torch.linalg.cross (batch dims broadcast)."""
        return call("cross", (self, other), {"dim": dim})

    def sum(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """Sum over dims (integers sum as int64)."""
        return call("sum", (self,), {"dim": dim, "keepdim": keepdim})

    def mean(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """Mean over dims (floating point inputs only)."""
        return call("mean", (self,), {"dim": dim, "keepdim": keepdim})

    def prod(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """Product over dims (integers as int64); exact gradient at zeros, no result / x."""
        return call("prod", (self,), {"dim": dim, "keepdim": keepdim})

    def max(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """Max over dims (values only). max(x, dim=int) sends the gradient to the first max, as
        PyTorch's indices; over a list or all dims ties share it evenly."""
        return call("max", (self,), {"dim": dim, "keepdim": keepdim})

    def min(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """Min over dims (values only). min(x, dim=int) sends the gradient to the first min, as
        PyTorch's indices; over a list or all dims ties share it evenly."""
        return call("min", (self,), {"dim": dim, "keepdim": keepdim})

    def logsumexp(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
    ) -> Tensor:
        """log(sum(exp(x))) over dims, stable (shifted by the max); ints give float32."""
        return call("logsumexp", (self,), {"dim": dim, "keepdim": keepdim})

    def var(
        self,
        dim: builtins.int | Sequence[builtins.int] | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.float = 1,
    ) -> Tensor:
        """Variance over dims with `correction` (1: unbiased), floating point inputs only."""
        return call("var", (self,), {"dim": dim, "keepdim": keepdim, "correction": correction})

    def cumsum(self, dim: builtins.int) -> Tensor:
        """Inclusive cumulative sum along `dim` (integers as int64)."""
        return call("cumsum", (self,), {"dim": dim})

    def softmax(self, dim: builtins.int) -> Tensor:
        """exp(x) / sum(exp(x)) along `dim`, stable (shifted by the max)."""
        return call("softmax", (self,), {"dim": dim})

    def log_softmax(self, dim: builtins.int) -> Tensor:
        """x - logsumexp(x) along `dim`, stable (shifted by the max)."""
        return call("log_softmax", (self,), {"dim": dim})

    def reshape(self, shape: builtins.int | Sequence[builtins.int], *sizes: builtins.int) -> Tensor:
        """Same elements in a new shape (one dim may be -1)."""
        return call("reshape", (self,), {"shape": spread(shape, sizes)})

    def expand(self, shape: builtins.int | Sequence[builtins.int], *sizes: builtins.int) -> Tensor:
        """Broadcast to a larger shape (-1 keeps a dim); the gradient is summed back."""
        return call("expand", (self,), {"shape": spread(shape, sizes)})

    def squeeze(self, dim: builtins.int | Sequence[builtins.int] | None = None) -> Tensor:
        """Remove size-1 dims: the named ones (int or list; dims of another size are kept), or all
        when dim is absent."""
        return call("squeeze", (self,), {"dim": dim})

    def unsqueeze(self, dim: builtins.int) -> Tensor:
        """Insert a size-1 dim at `dim` (in [-ndim-1, ndim])."""
        return call("unsqueeze", (self,), {"dim": dim})

    def flatten(self, start_dim: builtins.int = 0, end_dim: builtins.int = -1) -> Tensor:
        """Merge dims start_dim..end_dim into one (a 0-d tensor becomes shape (1,))."""
        return call("flatten", (self,), {"start_dim": start_dim, "end_dim": end_dim})

    # ---- end of generated code ----


def _check_requires_grad(requires_grad: builtins.bool, dtype: str) -> None:
    if requires_grad and dtype not in FLOATS:
        raise DTypeError(f"only floating point tensors can require gradients, got {dtype}")


def tensor(
    data: Any,
    dtype: DTypeLike | None = None,
    requires_grad: builtins.bool = False,
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
    array: np.ndarray, requires_grad: builtins.bool = False, device: str = "cpu"
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


# ---------------------------------------------------------------- running an op


def call(name: str, tensors: Sequence[Any], attrs: dict[str, Any]) -> Tensor:
    """An op called from Python (a generated function or method): its attributes bound."""
    op = OPS[name]
    if op.variadic:
        op.check_arity(len(tensors))
    return apply(op, tensors, op.bind_attrs(attrs))


def spread(shape: Any, more: tuple[builtins.int, ...]) -> Any:
    """PyTorch's varargs sizes: `x.reshape(2, 3)`, `x.permute(1, 0)`, `zeros(2, 3)`."""
    return [shape, *more] if more else shape


def meta_of(value: Tensor | builtins.float) -> Meta:
    if isinstance(value, Tensor):
        return Meta(value.shape, value.dtype)
    return literal_meta(value)


def _device_mismatch(op: OpDef, a: Backend, b: Backend) -> ShapeError:
    return ShapeError(
        f"expected all tensors on one device, got {a.device} and {b.device}", op=op.name
    )


def _not_a_tensor(op: OpDef, value: Any) -> DTypeError:
    return DTypeError(
        f"arguments must be tensors or numbers, got {type(value).__name__}", op=op.name
    )


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
        if (
            not is_number(a)
            and (
                (not is_number(b) and a.dtype is b.dtype)
                or (is_number(b) and a.dtype in backend.float_dtypes)
            )
            and (not op.float_result or a.dtype in backend.float_dtypes)
        ):
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

    This is the engine's hot path, so it avoids work on the common case (tensors of one
    dtype): shape rules run only to explain a failure, and promotion only on mixed dtypes.
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


def wrap(
    op: OpDef,
    args: Sequence[Any],
    attrs: dict[str, Any],
    out: Any,
    backend: Backend,
    any_requires_grad: builtins.bool,
) -> Tensor:
    """The result Tensor of an op, recording its Node when the graph needs it: one input
    edge per argument whose gradient is needed (a differentiable argument that requires
    grad), with the shape and dtype that gradient is summed and cast back to."""
    if (
        any_requires_grad
        and op.vjp is not None
        and out.dtype in backend.float_dtypes
        and _grad_enabled.get()
    ):
        mask = op.diff_mask
        if mask is None:
            inputs = [
                (a.grad_fn or a, a.data.shape, a.data.dtype)
                if type(a) is Tensor and a.requires_grad
                else None
                for a in args
            ]
        else:
            inputs = [
                (a.grad_fn or a, a.data.shape, a.data.dtype)
                if type(a) is Tensor and a.requires_grad and mask[i]
                else None
                for i, a in enumerate(args)
            ]
            if not any(inp is not None for inp in inputs):
                return Tensor(out, backend)
        # The node saves input Tensors or numbers and the raw result (not the result
        # Tensor, which would be a reference cycle through its own grad_fn).
        node = Node(op, inputs, op.pick_saved(args, out), attrs, backend)
        return Tensor(out, backend, True, node)
    return Tensor(out, backend)


# ---------------------------------------------------------------- the backward pass


def _unpack_tensors(node: Node) -> list[Any]:
    """The saved values for a differentiable backward: the argument Tensors themselves,
    and the result rebuilt with this node as grad_fn (as PyTorch does)."""
    assert node.saved is not None
    return [
        Tensor(v, node.backend, True, node) if i < 0 else v
        for i, v in zip(node.op.save_index, node.saved, strict=True)
    ]


def _tensor_namespace() -> SimpleNamespace:
    """F for create_graph: every op on Tensors, recorded, so VJPs are differentiable."""

    def op_fn(op: OpDef) -> Callable[..., Tensor]:
        return lambda *xs, **attrs: apply(op, xs, op.bind_attrs(attrs))

    ns = SimpleNamespace(**{name: op_fn(op) for name, op in OPS.items()})
    ns.zeros_like = lambda x: Tensor(x._backend.xp.zeros_like(x.data), x._backend)
    ns.ones_like = lambda x: Tensor(x._backend.xp.ones_like(x.data), x._backend)
    ns.dtype_of = lambda x: x.dtype
    ns.unpack = _unpack_tensors
    ns.create_graph = True  # the VJPs' own ops are recorded: the backward is differentiable
    return ns


F_TENSOR = _tensor_namespace()


def _as_grad(value: Any, like: Tensor, create_graph: builtins.bool) -> Any:
    """An upstream gradient given by the caller, checked and in the output's dtype."""
    t = value if isinstance(value, Tensor) else tensor(value, device=like.device)
    if t.shape != like.shape:
        raise BackwardError(
            f"gradient has shape {fmt(t.shape)} but the output has shape {fmt(like.shape)}"
        )
    if t.dtype != like.dtype:
        t = t.to(dtype=like.dtype)
    return t if create_graph else t.data


def _implicit_grad(output: Tensor, create_graph: builtins.bool) -> Any:
    if output.numel() != 1:
        raise BackwardError("grad can be implicitly created only for scalar outputs")
    ones = output._backend.xp.ones(output.data.shape, dtype=output.data.dtype)
    return Tensor(ones, output._backend) if create_graph else ones


def _run(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Any] | None,
    retain_graph: builtins.bool,
    create_graph: builtins.bool,
    capture: Sequence[Tensor] | None = None,
    check: Callable[[], None] | None = None,
) -> dict[builtins.int, Any]:
    """The pass from these outputs. With `capture`, the gradients of those tensors are
    returned (by id) instead of accumulated into leaves' `.grad`."""
    if grad_outputs is not None and len(grad_outputs) != len(outputs):
        raise BackwardError(f"got {len(grad_outputs)} gradients for {len(outputs)} outputs")
    roots: dict[Any, Any] = {}
    for k, out in enumerate(outputs):
        if not out.requires_grad:
            raise BackwardError(
                f"element {k} of tensors does not require grad and does not have a grad_fn"
            )
        given = None if grad_outputs is None else grad_outputs[k]
        g = (
            _implicit_grad(out, create_graph)
            if given is None
            else _as_grad(given, out, create_graph)
        )
        key = out.grad_fn if out.grad_fn is not None else out
        roots[key] = g if key not in roots else roots[key] + g
    F = F_TENSOR if create_graph else raw_namespace(outputs[0]._backend)
    # For grad(): the node (or leaf) whose incoming gradient is each captured tensor's.
    wanted = {id(t.grad_fn if t.grad_fn is not None else t): id(t) for t in capture or ()}

    def accumulate(leaf: Tensor, g: Any) -> None:
        """Leaf `.grad` accumulates across backward calls, as in PyTorch."""
        if not create_graph:
            g = Tensor(g if leaf.grad is None else leaf.grad.data + g, leaf._backend)
        elif leaf.grad is not None:
            g = leaf.grad + g
        leaf.grad = g

    return run_backward(
        roots,
        F,
        retain_graph,
        create_graph,
        None if capture is not None else accumulate,
        wanted,
        check,
    )


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    retain_graph: builtins.bool | None = None,
    create_graph: builtins.bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """`torch.autograd.backward`: accumulate d(Σ outputs·grads)/d(leaf) into each leaf's
    `.grad`. `check` runs before each node (a deadline)."""
    outs = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if grad_tensors is not None and not isinstance(grad_tensors, (list, tuple)):
        grad_tensors = [grad_tensors]
    retain = create_graph if retain_graph is None else retain_graph
    _run(outs, grad_tensors, builtins.bool(retain), create_graph, check=check)


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Any = None,
    retain_graph: builtins.bool | None = None,
    create_graph: builtins.bool = False,
    allow_unused: builtins.bool = False,
) -> tuple[Tensor | None, ...]:
    """`torch.autograd.grad`: the gradients of `outputs` with respect to `inputs`."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is not None and not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    for i, t in enumerate(ins):
        if not t.requires_grad:
            raise BackwardError(
                f"One of the differentiated Tensors (input {i}) does not require grad"
            )
    retain = create_graph if retain_graph is None else retain_graph
    found = _run(outs, grad_outputs, builtins.bool(retain), create_graph, capture=ins)
    result: list[Tensor | None] = []
    for i, t in enumerate(ins):
        g = found.get(id(t))
        if g is None:
            if not allow_unused:
                raise BackwardError(
                    f"One of the differentiated Tensors (input {i}) appears to not have been "
                    "used in the graph. Set allow_unused=True if this is the desired behavior."
                )
            result.append(None)
        else:
            result.append(g if isinstance(g, Tensor) else Tensor(g, t._backend))
    return tuple(result)
