"""The callable faces of the registry: `engine.<op>(...)`, Tensor methods and operators,
and the two namespaces `F` that VJPs are written against."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from engine.backends import Backend
from engine.errors import ArityError
from engine.ops.dispatch import apply, binary_operator
from engine.ops.registry import OPS, OpDef
from engine.tensor import Tensor


def _bind_call(
    op: OpDef, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Map a PyTorch-style call onto (tensors, attributes)."""
    args = _pack_sizes(op, args)
    order = op.call_order or (*op.args, *op.positional_attrs)
    named: dict[str, Any] = {}
    tensors: list[Any] = []
    rest = list(args)
    for name in order:
        if not rest:
            break
        if name.startswith("*"):  # the operands of einsum: all remaining positionals
            tensors.extend(rest)
            rest = []
            break
        named[name] = rest.pop(0)
    if rest:
        if not op.variadic and not op.positional_attrs and not op.call_order:
            op.check_arity(len(args))
        raise ArityError(f"takes at most {len(order)} positional arguments ({', '.join(order)}), "
                         f"got {len(args)}", op=op.name)
    for key, value in kwargs.items():
        if key in named:
            raise ArityError(f"got multiple values for argument {key!r}", op=op.name)
        named[key] = value
    if op.variadic:
        seq_name = next((n for n in order if not n.startswith("*") and n not in op.attrs), None)
        if seq_name is not None and seq_name in named:
            tensors = list(named.pop(seq_name))
    else:
        for name in op.args:
            if name not in named:
                raise ArityError(f"missing tensor argument {name!r}", op=op.name)
            tensors.append(named.pop(name))
    return tensors, named  # bind_attrs reports any unknown name


def _pack_sizes(op: OpDef, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """PyTorch's varargs sizes: `x.reshape(2, 3)`, `x.permute(1, 0)`, `zeros(2, 3)`."""
    if op.variadic or op.call_order or len(op.positional_attrs) != 1:
        return args
    if op.attrs[op.positional_attrs[0]].type not in ("shape", "ints"):
        return args
    k = len(op.args)
    sizes = args[k:]
    if len(sizes) > 1 and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        return (*args[:k], list(sizes))
    return args


def make_function(op: OpDef) -> Callable[..., Tensor]:
    """The public `engine.<name>` function of an op."""

    def fn(*args: Any, **kwargs: Any) -> Tensor:
        tensors, attrs = _bind_call(op, args, kwargs)
        op.check_arity(len(tensors))
        return apply(op, tensors, op.bind_attrs(attrs))

    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = op.doc
    return fn


FUNCTIONS: dict[str, Callable[..., Tensor]] = {}


def _tensor_namespace() -> SimpleNamespace:
    """F for create_graph: every op on Tensors, recorded, so VJPs are differentiable."""

    def op_fn(op: OpDef) -> Callable[..., Tensor]:
        return lambda *xs, **attrs: apply(op, xs, op.bind_attrs(attrs))

    ns = SimpleNamespace(**{name: op_fn(op) for name, op in OPS.items()})
    ns.zeros_like = lambda x: Tensor(x._backend.xp.zeros_like(x.data), x._backend)
    ns.ones_like = lambda x: Tensor(x._backend.xp.ones_like(x.data), x._backend)
    ns.dtype_of = lambda x: x.dtype
    ns.create_graph = True  # the VJPs' own ops are recorded: the backward is differentiable
    return ns


@functools.cache
def raw_namespace(backend: Backend) -> SimpleNamespace:
    """F for a plain backward: every op's forward on raw arrays, recording nothing."""
    xp = backend.xp

    def op_fn(op: OpDef) -> Callable[..., Any]:
        forward, defaults = op.forward, op.defaults
        if not op.attrs:
            return lambda *xs: forward(xp, *xs)
        return lambda *xs, **attrs: forward(xp, *xs, **{**defaults, **attrs})

    ns = SimpleNamespace(**{name: op_fn(op) for name, op in OPS.items()})
    ns.zeros_like = xp.zeros_like
    ns.ones_like = xp.ones_like
    ns.dtype_of = backend.dtype_name
    ns.create_graph = False
    return ns


F_TENSOR = SimpleNamespace()

_OPERATORS = {
    "__add__": ("add", False), "__radd__": ("add", True),
    "__sub__": ("sub", False), "__rsub__": ("sub", True),
    "__mul__": ("mul", False), "__rmul__": ("mul", True),
    "__truediv__": ("div", False), "__rtruediv__": ("div", True),
    "__pow__": ("pow", False), "__rpow__": ("pow", True),
    "__matmul__": ("matmul", False), "__rmatmul__": ("matmul", True),
    "__lt__": ("lt", False), "__le__": ("le", False),
    "__gt__": ("gt", False), "__ge__": ("ge", False),
    "__eq__": ("eq", False), "__ne__": ("ne", False),
}


def _method(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    return lambda self, *args, **kwargs: fn(self, *args, **kwargs)


def install() -> None:
    """Build the functions and attach operators and methods to Tensor (once, at import)."""
    for name, op in OPS.items():
        FUNCTIONS[name] = make_function(op)
    F_TENSOR.__dict__.update(vars(_tensor_namespace()))
    for dunder, (name, reflected) in _OPERATORS.items():
        if name in OPS:
            setattr(Tensor, dunder, binary_operator(OPS[name], reflected))
    setattr(Tensor, "__neg__", lambda self: apply(OPS["neg"], (self,), {}))  # noqa: B010
    setattr(Tensor, "__pos__", lambda self: self)  # noqa: B010
    setattr(Tensor, "__abs__", lambda self: apply(OPS["abs"], (self,), {}))  # noqa: B010
    for name, op in OPS.items():
        if op.args and not op.variadic and not hasattr(Tensor, name):
            setattr(Tensor, name, _method(FUNCTIONS[name]))
    # PyTorch's spellings of catalog ops.
    setattr(Tensor, "__getitem__", _getitem)  # noqa: B010
    setattr(Tensor, "view", getattr(Tensor, "reshape"))  # noqa: B009, B010
    setattr(Tensor, "T", property(lambda self: FUNCTIONS["permute"](  # noqa: B010
        self, dims=list(range(self.ndim))[::-1])))
    for method, dtype in (("float", "float32"), ("double", "float64"), ("half", "float16"),
                          ("int", "int32"), ("long", "int64"), ("bool", "bool")):
        setattr(Tensor, method, lambda self, dtype=dtype: FUNCTIONS["cast"](self, dtype=dtype))


def _getitem(self: Tensor, key: Any) -> Tensor:
    """Basic indexing with ints, slices (positive steps) and `...`, through the `slice` and
    `squeeze` ops, so gradients flow as they do in PyTorch."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        at = key.index(Ellipsis)
        fill = (slice(None),) * (self.ndim - len(key) + 1)
        key = key[:at] + fill + key[at + 1:]
    if len(key) > self.ndim:
        raise IndexError(f"too many indices for a tensor of {self.ndim} dimension(s)")
    out, dim = self, 0
    for k in key:
        if isinstance(k, slice):
            if k != slice(None):
                out = FUNCTIONS["slice"](out, dim=dim, start=k.start or 0, stop=k.stop,
                                         step=1 if k.step is None else k.step)
            dim += 1
        elif isinstance(k, int) and not isinstance(k, bool):
            size = out.shape[dim]
            if not -size <= k < size:
                raise IndexError(f"index {k} is out of bounds for dimension {dim} with size {size}")
            out = FUNCTIONS["slice"](out, dim=dim, start=k % size, stop=k % size + 1)
            out = FUNCTIONS["squeeze"](out, dim=dim)
        else:
            raise TypeError(f"unsupported index {k!r}: use ints, slices and ...; for tensor "
                            "indices use index_select or gather")
    return out
