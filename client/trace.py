"""Tracing Python functions into gradserve graphs, PyTorch-style.

    >>> from gradserve.client.trace import F, trace
    >>> def model(X, w, b, y):
    ...     margin = -y * (X @ w + b)
    ...     loss = F.softplus(margin).mean() + 0.01 * (w * w).sum()
    ...     return {"loss": loss}
    >>> graph = trace(model, X=((16, 5), "float64"), w=np.zeros(5), b=((), "float64"),
    ...               y=((16,), "float64"))
    {"nodes": [{"id": "margin", "expr": "-y * (X @ w + b)"},
               {"id": "loss", "expr": "mean(softplus(margin)) + 0.01 * sum(w * w)"}],
     "outputs": ["loss"]}

`trace(fn, **specs)` calls `fn` once on symbolic tensors (`TracedTensor`), one
per spec, and returns the graph JSON of what it computed. A spec is a `(shape, dtype)` pair,
an object with `shape` and `dtype` (a NumPy array, a `TensorSpec`), or example data (a
number, a nested list: its NumPy shape and dtype, as the client would send it). `fn` gets
the inputs by name when its signature takes them so, else in the specs' order.

Everything is driven by the op catalog: by default the standard one (engine.rules'
`catalog_ops()`, what a gradserve server of this version lists; no server is asked), else the
one passed as `trace(fn, ops_catalog, **specs)` (`GET /ops`'s JSON, its list of ops, or a
`Catalog`), as `Client.trace` passes its server's: a server with another catalog gets
other functions. A symbolic tensor has
PyTorch's operators (`+ - * / ** @`, unary `-`, `abs()`, comparisons), a method for every
op that takes a tensor (`x.sum(1)`, `x.sum(dim=1, keepdim=True)`, `x.transpose(0, 1)`,
`x.reshape(2, 3)`, `x.gather(1, idx)`, `x.clamp(min=0)`), `x.T`, `x.mT`, `x.view`, `x.t()`,
`x.float()`/`double()`/`long()`/..., `x.to(dtype)`, indexing with ints, slices, `None`,
`...` and a 1-d integer tensor (through `slice`, `squeeze`, `unsqueeze` and
`index_select`), iteration over dim 0, and `x.shape`, `x.dtype` (a string), `x.ndim`,
`x.size()`, `x.dim()`, `x.numel()`, `len(x)`. `F` is the functional namespace (as `torch`
and `torch.nn.functional`): every catalog op by name (`F.softmax(x, dim=-1)`, `F.relu(x)`,
`F.where(c, a, b)`, `F.stack([a, b], 1)`, `F.einsum("ij,jk->ik", a, b)`,
`F.gather(x, 1, idx)`, `F.zeros(2, 3)`), a few PyTorch spellings of them (`inverse`,
`clip`, `concat`, `amax`, ...), and `grad`, `jvp`, `scan`. An op the catalog lacks is an
AttributeError naming it. Calls follow PyTorch's signatures: tensors first, then the
attributes positionally in the catalog's order or by keyword; where an op takes several
tensors and a required `dim`, `dim` comes second (`gather(input, dim, index)`); a variadic
op takes a list (`cat([a, b], dim=1)`) or the tensors as arguments, and its string
attribute first (`einsum(equation, *operands)`); sizes may be spread (`x.reshape(2, 3)`,
`zeros(2, 3)`).

Derivatives and loops: `grad(target, wrt, v=None)` (a list of `wrt` gives a tuple),
`jvp(y, x, t)` and `scan(body, init, xs=(), length=None)` become `grad`, `jvp` and `scan`
nodes. `scan` is jax.lax.scan's: `body(carry, x) -> (new_carry, y)`, where `carry` has the
structure of `init` (one tensor or number, or a tuple or list of them) and `x` that of `xs`
(one tensor, a tuple or list of tensors sliced on dim 0, or None without sequences); `y` is
a tensor, a tuple or list of them, or None. It returns `(final_carry, ys)`, `ys` stacked on
a new dim 0. The body is traced once, into the node's body; what it reads of the outer
function becomes a reference to the outer value.

Python runs once, at trace time: its `if`s and loops unroll on shapes, which are static.
What needs data raises `TraceError` saying why: `bool(x)` (an `if`, `while`, `and`/`or`,
`not` or `assert` on a tensor), `float(x)`, `int(x)`, `range(x)`, `x.item()`,
`x.tolist()`, `x.numpy()`, NumPy arrays inside the function (pass them as inputs), boolean
masks, item assignment, non-finite literals (JSON has no such numbers). Write data-dependent
choices with `where` (or `maximum`, `minimum`, `clamp`) and loops with `scan`.

Readable graphs. Names come from the function's variables: while `fn` (and any Python
function it calls, outside the standard library and site-packages) runs, the tracer looks
at its local variables line by line (a trace function, chained to a debugger's or
coverage's), and the first variable a value is bound to names it (`h`, then `h_1`, `h_2`
when a loop rebinds `h`); a variable of the frame nearer `fn` wins over one of a helper it
calls, and a list's `hs_0`, `hs_1` name only elements no variable names. Outputs are named
by the keys of a returned dict, else `out` (one tensor) or `out0`, `out1`, ... (a tuple or
list); an output name is reserved before any variable's. A scan is named after its body
function, its results after the variables they are unpacked into; a value no variable
names gets its op's name (`tanh_1`; a carry's next value `h_next`).

Every named value, every value used more than once or from a scan body, every output, and
every `wrt`, scan argument and scan result is a node; the rest is inlined into its user's
`expr` (`tanh(x @ w + h @ u + b)`), so that a line of math is one node. An expression
that grows past 24 nested ops or 1,000 characters is cut into nodes. Number literals stay
literals; an input name that is not an identifier makes its users op-form nodes.

Shapes and dtypes are the engine's own: each op's shape rule (`infer`), type promotion
and attribute binding, from engine.rules, which imports nothing heavy and never the eager
engine (Tensor, autograd); a rule changed there changes here. An op another catalog adds
gets the broadcasting rule if its group is elementwise, arithmetic or comparison. Where a
shape is not known (an op without a rule, or arguments that do not fit it), `.shape` and
`.dtype` raise TraceError saying why; the graph is still built, and the server validates
it.
"""

from __future__ import annotations

import builtins
import difflib
import inspect
import itertools
import json
import keyword
import math
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np

from gradserve.client.catalog import (
    ALIASES,
    TRANSFORMS,
    Catalog,
    OpInfo,
    as_catalog,
    standard_catalog,
)
from gradserve.engine.errors import DTypeError, GradserveError
from gradserve.engine.rules import (
    DTYPES,
    OPS,
    Meta,
    OpDef,
    Shape,
    check_dtype,
    elementwise_infer,
    fmt,
    literal_meta,
    numel,
)
from gradserve.wire.dtypes import wire_dtype

__all__ = [
    "Catalog",
    "F",
    "Functional",
    "Spec",
    "TraceError",
    "TracedTensor",
    "grad",
    "hessian",
    "jacfwd",
    "jacobian",
    "jacrev",
    "jvp",
    "scan",
    "spec_of",
    "standard_catalog",
    "trace",
    "vmap",
]

# Past these an inlined expression is cut into nodes (the server's limits are 100 and
# 10,000; a line of math is far shorter).
MAX_INLINE_DEPTH = 24
MAX_INLINE_CHARS = 1000
_MAX_EXPR_CHARS = 8000  # longer: the node is written in op form

Number = bool | int | float
Value = Any  # a TracedTensor or a Number


class TraceError(RuntimeError):
    """What a traced function cannot do: read data, or use the graph out of its scope."""


def _data_error(what: str) -> TraceError:
    return TraceError(
        f"{what} needs the value of a traced tensor, which is not known while tracing: the "
        "function runs once, on shapes and dtypes only, and Python's control flow unrolls "
        "then. Make data-dependent choices with where(cond, a, b) (or maximum, minimum, "
        "clamp), and loops with scan(body, init, xs)"
    )


# ------------------------------------------------------------------ specs and dtypes


def dtype_name(value: Any) -> str:
    """A dtype's gradserve name as the engine reads one (`check_dtype`: "float32",
    "torch.float32", a NumPy dtype or scalar type, float as float64), or any spelling
    NumPy reads ("np.float32", "f4"); otherwise a TypeError, as Python's own."""
    try:
        return check_dtype(value.removeprefix("np.") if isinstance(value, str) else value)
    except DTypeError:
        pass
    try:
        name = np.dtype(value).name
    except (TypeError, ValueError):
        name = ""
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {value!r}: gradserve has {', '.join(DTYPES)}")
    return name


@dataclass(frozen=True)
class Spec:
    """An input's shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


def _is_shape(v: Any) -> bool:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return True
    return isinstance(v, (tuple, list)) and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in v
    )


def spec_of(value: Any) -> Spec:
    """A Spec from a `(shape, dtype)` pair, an object with `shape` and `dtype`, or example
    data (what `np.asarray` makes of it, in the dtype the client sends it as)."""
    if isinstance(value, Spec):
        return value
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and _is_shape(value[0])
        and isinstance(value[1], (str, np.dtype, type))
    ):
        shape = (value[0],) if not isinstance(value[0], (tuple, list)) else value[0]
        return Spec(tuple(int(n) for n in shape), dtype_name(value[1]))
    if not isinstance(value, (np.ndarray, np.generic)):
        found, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if found is not None and dtype is not None:
            return Spec(tuple(int(n) for n in found), dtype_name(dtype))
    array = np.asarray(value)
    return Spec(tuple(array.shape), wire_dtype(array.dtype))


# ------------------------------------------------------------------ shape and dtype rules


def _transform_rule(output: int) -> Callable[[list[Meta]], Meta]:
    """`grad` is `wrt`'s shape and dtype, `jvp` the output's (the compiler checks the rest)."""
    return lambda metas, **attrs: metas[output]


def _jacobian_rule(metas: list[Meta], mode: str = "auto") -> Meta:
    """output.shape + input.shape: in reverse mode the input's dtype (rows are gradients),
    in forward mode the output's (columns are JVPs), as jacrev and jacfwd."""
    output, inp = metas[0], metas[1]
    if mode == "auto":
        mode = "fwd" if numel(inp.shape) < numel(output.shape) else "rev"
    return Meta((*output.shape, *inp.shape), inp.dtype if mode == "rev" else output.dtype)


def _hessian_rule(metas: list[Meta]) -> Meta:
    return Meta((*metas[1].shape, *metas[1].shape), metas[1].dtype)


_TRANSFORM_RULES = {
    "grad": _transform_rule(1),
    "jvp": _transform_rule(0),
    "jacobian": _jacobian_rule,
    "hessian": _hessian_rule,
}
# The transforms whose second argument is differentiated against: a node, not inlined.
_WRT_TRANSFORMS = ("grad", "jvp", "jacobian", "hessian")
# An op of another catalog, unknown to this engine, gets its group's broadcasting rule.
_GROUP_RULES = {
    "elementwise": elementwise_infer(),
    "arithmetic": elementwise_infer(),
    "comparison": elementwise_infer(result_dtype="bool"),
}


# ------------------------------------------------------------------ symbolic tensors


class _Scope:
    """The graph's top level, or a scan body."""

    __slots__ = ("parent",)

    def __init__(self, parent: _Scope | None) -> None:
        self.parent = parent

    def sees(self, other: _Scope) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            if scope is other:
                return True
            scope = scope.parent
        return False


class _Trace:
    """One call of `trace`: its catalog, values in creation order, and the current scope."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.root = _Scope(None)
        self.scope = self.root
        self.items: list[TracedTensor | _ScanRecord] = []
        self.open = True

    def add(self, item: TracedTensor | _ScanRecord) -> None:
        self.items.append(item)


_LOCAL = threading.local()


def _stack() -> list[_Trace]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack  # type: ignore[no-any-return]


def _active() -> _Trace:
    stack = _stack()
    if not stack:
        raise TraceError(
            "no trace is in progress: call this inside a function passed to "
            "trace() (or Client.trace, forward, backward)"
        )
    return stack[-1]


def _binary(op: str, reflected: bool) -> Callable[[TracedTensor, Any], TracedTensor]:
    """A binary operator of TracedTensor: the catalog's op of that name."""

    def method(self: TracedTensor, other: Any) -> TracedTensor:
        if not isinstance(other, TracedTensor):
            try:
                other = _literal(other)
            except _NotOperand:
                return NotImplemented  # type: ignore[no-any-return]
        info = self._trace.catalog.resolve(op)
        if info is None:
            raise self._trace.catalog.missing(op, "TracedTensor")
        args = [other, self] if reflected else [self, other]
        return _apply(info, args, {})

    return method


def _cast_method(dtype: str) -> Callable[[TracedTensor], TracedTensor]:
    def method(self: TracedTensor) -> TracedTensor:
        return self._method("cast", dtype=dtype)

    return method


class TracedTensor:
    """A symbolic tensor: a value of the graph being traced, with its static shape and
    dtype where the tracer knows them. See the module's docstring for what it supports."""

    __slots__ = (
        "__weakref__",
        "_args",
        "_attrs",
        "_dtype",
        "_id",
        "_kind",
        "_name",
        "_op",
        "_rank",
        "_ref",
        "_scope",
        "_seq",
        "_shape",
        "_trace",
        "_why",
    )
    __array_ufunc__ = None  # NumPy defers to our reflected operators
    __hash__ = object.__hash__  # `==` builds an `eq` op, as in PyTorch

    _trace: _Trace
    _scope: _Scope
    _kind: str  # input, op, carry, x (scan body slices), result (of a scan)
    _op: str | None
    _args: list[Any]
    _attrs: dict[str, Any]
    _shape: Shape | None
    _dtype: str | None
    _why: str
    _ref: Any  # an input's name; a scan result's or body placeholder's (record, index)
    _name: str | None  # the first variable it was bound to
    _rank: tuple[int, int]  # of _name: (a list's element, frames below the traced function)
    _id: str | None  # its id in the graph, once built
    _seq: int

    def __init__(
        self,
        trace: _Trace,
        kind: str,
        *,
        op: str | None = None,
        args: list[Any] | None = None,
        attrs: dict[str, Any] | None = None,
        shape: Shape | None = None,
        dtype: str | None = None,
        why: str = "",
        ref: Any = None,
    ) -> None:
        self._trace, self._scope, self._kind = trace, trace.scope, kind
        self._op, self._args, self._attrs = op, args or [], attrs or {}
        self._shape, self._dtype, self._why = shape, dtype, why
        self._ref, self._name, self._id = ref, None, ref if kind == "input" else None
        self._rank = (2, 0)
        self._seq = len(trace.items)
        trace.add(self)

    # ------------------------------------------------------------ static facts
    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            raise TraceError(
                f"the shape of {self._describe()} is not known to the tracer: "
                f"{self._why or 'no shape rule'} (the server checks shapes)"
            )
        return self._shape

    @property
    def dtype(self) -> str:
        if self._dtype is None:
            raise TraceError(
                f"the dtype of {self._describe()} is not known to the tracer: "
                f"{self._why or 'no dtype rule'}"
            )
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self) -> Iterator[TracedTensor]:
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        for i in range(self.shape[0]):
            yield self[i]

    def _describe(self) -> str:
        if self._kind == "input":
            return f"input {self._ref!r}"
        if self._kind == "op":
            return f"the result of {self._op}" + (f" ({self._name!r})" if self._name else "")
        return f"a scan {'result' if self._kind == 'result' else 'body value'}"

    def __repr__(self) -> str:
        shape = "?" if self._shape is None else list(self._shape)
        name = self._id or self._name
        what = f"{self._kind} {name!r}" if name else self._op or self._kind
        return f"TracedTensor({what}, shape={shape}, dtype={self._dtype or '?'})"

    # ------------------------------------------------------------ what needs data
    def __bool__(self) -> bool:
        raise _data_error(
            "bool(tensor) (an `if`, `while`, `and`/`or`, `not` or `assert` on a "
            "tensor, or a builtin max/min/sorted over tensors)"
        )

    def __float__(self) -> float:
        raise _data_error("float(tensor)")

    def __int__(self) -> int:
        raise _data_error("int(tensor)")

    def __index__(self) -> int:
        raise _data_error("using a tensor as a Python int (range(), an index, a size)")

    def __complex__(self) -> complex:
        raise _data_error("complex(tensor)")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _data_error("converting a tensor to a NumPy array")

    def item(self) -> Any:
        raise _data_error("tensor.item()")

    def tolist(self) -> Any:
        raise _data_error("tensor.tolist()")

    def numpy(self) -> Any:
        raise _data_error("tensor.numpy()")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TraceError(
            "tensors of a traced graph are immutable: build the new value with "
            "where, scatter_add or cat instead of assigning into one"
        )

    # ------------------------------------------------------------ methods from the catalog
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        catalog = self._trace.catalog
        op = catalog.resolve(name)
        if op is None or not op.args or op.variadic:
            if op is None and name not in TRANSFORMS and (name in OPS or name in ALIASES):
                raise catalog.missing(name, "TracedTensor")
            close = difflib.get_close_matches(name, [*dir(type(self)), *_methods(catalog)], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(
                f"'TracedTensor' object has no attribute {name!r}{hint}", name=name
            )
        return lambda *args, **kwargs: _call(op, args, kwargs, self_value=self)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_methods(self._trace.catalog)})

    def _op_named(self, name: str) -> OpInfo:
        op = self._trace.catalog.resolve(name)
        if op is None:
            raise self._trace.catalog.missing(name, "TracedTensor")
        return op

    def _method(self, name: str, *args: Any, **kwargs: Any) -> TracedTensor:
        return _call(self._op_named(name), args, kwargs, self_value=self)

    @property
    def T(self) -> TracedTensor:
        if self.ndim == 2:
            return self._method("transpose", 0, 1)
        return self._method("permute", list(range(self.ndim))[::-1])

    @property
    def mT(self) -> TracedTensor:
        return self._method("transpose", -2, -1)

    def t(self) -> TracedTensor:
        return self if self.ndim < 2 else self._method("transpose", 0, 1)

    def view(self, *shape: Any) -> TracedTensor:
        return self._method("reshape", *shape)

    def contiguous(self) -> TracedTensor:
        return self

    def narrow(self, dim: int, start: int, length: int) -> TracedTensor:
        return self._method("slice", dim=dim, start=start, stop=start + length)

    def to(self, dtype: Any = None, *args: Any, **kwargs: Any) -> TracedTensor:
        dtype = kwargs.pop("dtype", dtype)
        if dtype is None or (isinstance(dtype, str) and dtype.startswith(("cpu", "cuda"))):
            return self  # a device: the request's `device` says where it runs
        return self._method("cast", dtype=dtype_name(dtype))

    # ------------------------------------------------------------ indexing
    def __getitem__(self, key: Any) -> TracedTensor:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = key.index(Ellipsis)
            used = sum(1 for k in key if k is not None and k is not Ellipsis)
            key = key[:at] + (builtins.slice(None),) * (self.ndim - used) + key[at + 1 :]
        out, dim, drop = self, 0, []
        for k in key:
            if k is None:
                out = out._method("unsqueeze", dim)
                dim += 1
            elif isinstance(k, builtins.slice):
                if k != builtins.slice(None):
                    step = 1 if k.step is None else _python_int(k.step, "a slice step")
                    if step <= 0:
                        raise ValueError("slice steps must be positive (as in PyTorch)")
                    attrs: dict[str, Any] = {"dim": dim}
                    if k.start is not None:
                        attrs["start"] = _python_int(k.start, "a slice bound")
                    if k.stop is not None:
                        attrs["stop"] = _python_int(k.stop, "a slice bound")
                    if step != 1:
                        attrs["step"] = step
                    out = out._method("slice", **attrs)
                dim += 1
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                k = int(k)
                if self._shape is not None and out._shape is not None and dim < len(out._shape):
                    size = out._shape[dim]
                    if not -size <= k < size:
                        raise IndexError(
                            f"index {k} is out of bounds for dimension {dim} with size {size}"
                        )
                stop = None if k == -1 else k + 1
                out = out._method(
                    "slice", dim=dim, start=k, **({} if stop is None else {"stop": stop})
                )
                drop.append(dim)
                dim += 1
            elif isinstance(k, TracedTensor):
                if k._dtype == "bool":
                    raise _data_error("indexing with a boolean mask (its result's shape)")
                out = out._method("index_select", dim, k)
                dim += 1
            else:
                raise TypeError(
                    f"unsupported index {k!r}: use ints, slices, None, ... or a "
                    "1-d integer tensor; gather and index_select take more"
                )
        if drop:
            out = out._method("squeeze", drop[0] if len(drop) == 1 else drop)
        return out

    # ------------------------------------------------------------ operators
    __add__ = _binary("add", False)
    __radd__ = _binary("add", True)
    __sub__ = _binary("sub", False)
    __rsub__ = _binary("sub", True)
    __mul__ = _binary("mul", False)
    __rmul__ = _binary("mul", True)
    __truediv__ = _binary("div", False)
    __rtruediv__ = _binary("div", True)
    __pow__ = _binary("pow", False)
    __rpow__ = _binary("pow", True)
    __matmul__ = _binary("matmul", False)
    __rmatmul__ = _binary("matmul", True)
    __lt__ = _binary("lt", False)
    __le__ = _binary("le", False)
    __gt__ = _binary("gt", False)
    __ge__ = _binary("ge", False)
    __eq__ = _binary("eq", False)  # type: ignore[assignment]
    __ne__ = _binary("ne", False)  # type: ignore[assignment]

    def __neg__(self) -> TracedTensor:
        return self._method("neg")

    def __pos__(self) -> TracedTensor:
        return self

    def __abs__(self) -> TracedTensor:
        return self._method("abs")

    # PyTorch's casts (last: below them, `float`, `int` and `bool` name these in the class)
    float = _cast_method("float32")
    double = _cast_method("float64")
    half = _cast_method("float16")
    int = _cast_method("int32")
    long = _cast_method("int64")
    bool = _cast_method("bool")


def _python_int(value: Any, what: str) -> int:
    if isinstance(value, TracedTensor):
        raise _data_error(f"a tensor as {what}")
    return int(value)


def _methods(catalog: Catalog) -> list[str]:
    return [
        n
        for n in catalog.names()
        if (op := catalog.resolve(n)) is not None and op.args and not op.variadic
    ]


# ------------------------------------------------------------------ calls


class _NotOperand(Exception):
    pass


def _literal(value: Any) -> Number:
    """A Python number from a number-like value; NumPy arrays of more than one element are
    refused (a graph holds no constant arrays)."""
    if isinstance(value, (np.ndarray, np.generic)):
        if value.size != 1 or value.ndim > 0:
            raise TraceError(
                f"a NumPy array of shape {list(value.shape)} inside a traced function: a graph "
                "holds no constant arrays; pass it as an input (or build it with zeros, ones, "
                "full, eye or arange)"
            )
        value = value.item()
    if isinstance(value, (bool, int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise TraceError(
                f"the number {value} cannot be a literal of a graph (JSON has no "
                "such number): pass it as an input tensor"
            )
        return value
    raise _NotOperand(value)


def _operand(value: Any, what: str) -> Value:
    if isinstance(value, TracedTensor):
        return value
    try:
        return _literal(value)
    except _NotOperand:
        raise TypeError(
            f"{what} must be a tensor or a number, not {type(value).__name__}"
        ) from None


def _attr_value(op: OpInfo, key: str, value: Any) -> Any:
    if isinstance(value, TracedTensor):
        raise TraceError(
            f"{op.name}: attribute {key!r} must be a Python value, not a traced "
            "tensor (attributes are static: a tensor's value is not known while "
            "tracing)"
        )
    kind = op.attrs[key].type.split("|")[0]
    if value is None:
        return None
    if kind == "dtype":
        return dtype_name(value)
    if isinstance(value, (tuple, list)):
        return [_attr_value(op, key, v) for v in value]
    if isinstance(value, (np.generic, np.ndarray, float)):
        return _literal(value)
    return value


def _call(
    op: OpInfo,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    self_value: TracedTensor | None = None,
) -> TracedTensor:
    """A PyTorch-style call of `op` (a method's `self` in `self_value`)."""
    if op.variadic:
        tensors, attrs = _bind_variadic(op, list(args), dict(kwargs))
    else:
        tensors, attrs = _bind(op, list(args), dict(kwargs), self_value)
    for key in attrs:
        if key not in op.attrs:
            known = ", ".join(op.attrs) or "none"
            close = difflib.get_close_matches(key, list(op.attrs), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"{op.name}() got an unexpected keyword argument {key!r}{hint} "
                f"({op.name} takes: {known})"
            )
    bound = {}
    for key, value in attrs.items():
        value = _attr_value(op, key, value)
        default = op.attrs[key].default
        if not op.attrs[key].required and value == default and type(value) is type(default):
            continue  # the catalog's default: left out
        bound[key] = value
    missing = [k for k, a in op.attrs.items() if a.required and k not in bound]
    if missing:
        raise TypeError(f"{op.name}() missing required argument(s): {', '.join(missing)}")
    return _apply(op, [_operand(t, f"{op.name}'s tensor argument") for t in tensors], bound)


def _bind(
    op: OpInfo, args: list[Any], kwargs: dict[str, Any], self_value: TracedTensor | None
) -> tuple[list[Any], dict[str, Any]]:
    order = op.order
    named: dict[str, Any] = {}
    if self_value is not None:
        named[op.self_arg] = self_value
    # Positionals fill the slots not given by keyword (`gather(x, idx, dim=1)` as in expr).
    free = [n for n in order if n not in named and n not in kwargs]
    tensors_given = sum(1 for n in free[: len(args)] if n in op.args)
    attrs_first = [n for n in order if n in op.attrs][:1]
    if (
        attrs_first
        and order == (*op.args, *op.attrs)
        and op.attrs[attrs_first[0]].type.split("|")[0] in ("shape", "ints")
    ):
        sizes = args[tensors_given:]
        if len(sizes) > 1 and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in sizes
        ):
            args = [*args[:tensors_given], [int(n) for n in sizes]]
    if len(args) > len(free):
        raise TypeError(
            f"{op.name}() takes at most {len(free)} positional argument(s) "
            f"({', '.join(free)}), got {len(args)}"
        )
    named.update(zip(free, args, strict=False))
    for key, value in kwargs.items():
        if key in named:
            raise TypeError(f"{op.name}() got multiple values for argument {key!r}")
        named[key] = value
    tensors = []
    for name in op.args:
        if name not in named:
            raise TypeError(f"{op.name}() missing tensor argument {name!r}")
        tensors.append(named.pop(name))
    return tensors, named


def _bind_variadic(
    op: OpInfo, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    attrs: dict[str, Any] = {}
    lead = op.lead_attr
    if lead is not None and args and isinstance(args[0], str):
        attrs[lead] = args.pop(0)
    seq_name = op.args[0] if op.args else "tensors"
    tensors: list[Any]
    if seq_name in kwargs:
        tensors = list(kwargs.pop(seq_name))
    elif args and isinstance(args[0], (list, tuple)):
        tensors = list(args.pop(0))
    else:
        tensors = []
        while args and isinstance(args[0], TracedTensor):
            tensors.append(args.pop(0))
    rest = [k for k in op.attrs if k != lead and k not in attrs]
    if len(args) > len(rest):
        raise TypeError(
            f"{op.name}() takes the tensors and then at most {len(rest)} "
            f"argument(s) ({', '.join(rest)}), got {len(args)} more"
        )
    attrs.update(zip(rest, args, strict=False))
    for key, value in kwargs.items():
        if key in attrs:
            raise TypeError(f"{op.name}() got multiple values for argument {key!r}")
        attrs[key] = value
    if not tensors:
        raise TypeError(f"{op.name}() needs at least one tensor")
    return tensors, attrs


def _meta(value: Value) -> Meta | None:
    if isinstance(value, TracedTensor):
        if value._shape is None or value._dtype is None:
            return None
        return Meta(value._shape, value._dtype)
    return literal_meta(value)


def _infer(
    op: OpInfo, args: list[Value], attrs: dict[str, Any]
) -> tuple[Shape | None, str | None, str]:
    """The op's static shape and dtype by the engine's own rule: its `infer` over the
    arguments' metas, with the attributes bound as the engine binds them (defaults
    filled, dtypes canonical). Where there is no answer, why."""
    known: OpDef | None = OPS.get(op.name)
    rule = (
        _TRANSFORM_RULES.get(op.name)
        if op.group == "transforms"
        else (known.infer if known is not None else _GROUP_RULES.get(op.group))
    )
    if rule is None:
        return None, None, f"op {op.name!r} has no shape rule in the tracer"
    metas = [m for m in map(_meta, args) if m is not None]
    if len(metas) != len(args):
        return None, None, f"an argument of {op.name} has an unknown shape"
    try:
        if known is not None and op.group != "transforms":
            known.check_arity(len(metas))
            attrs = known.bind_attrs(attrs)
        meta = rule(metas, **attrs)
    except GradserveError as exc:
        return None, None, f"{op.name}: {exc.message}"
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
        return None, None, f"{op.name}: {exc}"
    return tuple(int(n) for n in meta.shape), meta.dtype, ""


def _check_visible(trace: _Trace, values: Sequence[Any], what: str) -> None:
    for v in values:
        if not isinstance(v, TracedTensor):
            continue
        if v._trace is not trace:
            raise TraceError(
                f"{what}: a tensor of another trace (one that has finished, or "
                "an enclosing one): use only the tensors this trace made"
            )
        if not trace.scope.sees(v._scope):
            raise TraceError(
                f"{what}: a value computed inside a scan body is used outside "
                "it; return it from the body (as a carry or a y) instead"
            )


def _apply(op: OpInfo, args: list[Value], attrs: dict[str, Any]) -> TracedTensor:
    trace = _active()
    _check_visible(trace, args, op.name)
    shape, dtype, why = _infer(op, args, attrs)
    return TracedTensor(
        trace, "op", op=op.name, args=args, attrs=attrs, shape=shape, dtype=dtype, why=why
    )


# ------------------------------------------------------------------ F, grad, jvp, scan


class Functional:
    """The functional namespace (as `torch` and `torch.nn.functional`) of a catalog: every
    op by name, with PyTorch's signatures, and `grad`, `jvp`, `scan`. `Functional(catalog)`
    binds one; `service.trace.F` uses the catalog of the trace in progress; a client's `F`
    is its server's."""

    def __init__(self, catalog: Any = None) -> None:
        self._source = catalog

    def _catalog(self) -> Catalog:
        source = self._source
        if source is None:
            return _active().catalog
        if callable(source) and not isinstance(source, Catalog):
            source = source()
        if not isinstance(source, Catalog):
            source = self._source = Catalog(source)
        return source

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        catalog = self._catalog()
        if name in TRANSFORMS and name in catalog.transforms:
            return _HELPERS[name]
        op = catalog.resolve(name)
        if op is None:
            raise catalog.missing(name, "F")

        def function(*args: Any, **kwargs: Any) -> TracedTensor:
            return _call(op, args, kwargs)

        function.__name__ = function.__qualname__ = name
        function.__doc__ = op.doc
        return function

    def __dir__(self) -> list[str]:
        try:
            return self._catalog().names()
        except TraceError:
            return []

    def __repr__(self) -> str:
        return "<gradserve functional namespace>"


F = Functional()


def _transform(name: str) -> OpInfo:
    trace = _active()
    if name not in trace.catalog.transforms:
        raise trace.catalog.missing(name, "F")
    return OpInfo(name, "transforms", (), False, {}, True, "")


def _tensor(value: Any, what: str) -> TracedTensor:
    if not isinstance(value, TracedTensor):
        raise TypeError(f"{what} must be a traced tensor, not {type(value).__name__}")
    return value


def grad(target: TracedTensor, wrt: Any, v: Any = None) -> Any:
    """torch.autograd.grad(target, wrt, v, create_graph=True) as a `grad` node: `wrt`'s shape
    and dtype (a list or tuple of tensors gives a tuple); without `v` the target must have
    one element."""
    if isinstance(wrt, (list, tuple)):
        return tuple(grad(target, w, v) for w in wrt)
    op = _transform("grad")
    args: list[Value] = [_tensor(target, "grad's target"), _tensor(wrt, "grad's wrt")]
    if v is not None:
        args.append(_operand(v, "grad's v"))
    return _apply(op, args, {})


def jvp(y: TracedTensor, x: TracedTensor, t: Any) -> TracedTensor:
    """∂y/∂x · t (forward mode) as a `jvp` node: `y`'s shape and dtype; `t` of `x`'s."""
    op = _transform("jvp")
    return _apply(op, [_tensor(y, "jvp's y"), _tensor(x, "jvp's x"), _operand(t, "jvp's t")], {})


def jacobian(y: Any, x: Any = None, mode: str = "auto", *, argnums: int = 0) -> Any:
    """∂y/∂x as a `jacobian` node: shape y.shape + x.shape. `mode`: "rev" (jacrev),
    "fwd" (jacfwd) or "auto" (forward when x has fewer elements than y).

    Also torch.func's spelling: `jacobian(fn, argnums=0)` is a function that calls `fn`
    and takes the Jacobian of its result with respect to argument `argnums`."""
    if callable(y) and not isinstance(y, TracedTensor):
        fn = y
        return lambda *args: jacobian(fn(*args), args[argnums], mode)
    if mode not in ("rev", "fwd", "auto"):
        raise ValueError(f"mode must be 'rev', 'fwd' or 'auto', got {mode!r}")
    op = _transform("jacobian")
    args: list[Value] = [_tensor(y, "jacobian's y"), _tensor(x, "jacobian's x")]
    return _apply(op, args, {"mode": mode} if mode != "auto" else {})


def jacrev(fn: Callable[..., Any], argnums: int = 0) -> Callable[..., Any]:
    """torch.func.jacrev: `jacobian(fn, argnums, mode="rev")`."""
    return jacobian(fn, mode="rev", argnums=argnums)  # type: ignore[no-any-return]


def jacfwd(fn: Callable[..., Any], argnums: int = 0) -> Callable[..., Any]:
    """torch.func.jacfwd: `jacobian(fn, argnums, mode="fwd")`."""
    return jacobian(fn, mode="fwd", argnums=argnums)  # type: ignore[no-any-return]


def hessian(y: Any, x: Any = None, *, argnums: int = 0) -> Any:
    """The Hessian of a one-element `y` with respect to `x` as a `hessian` node: shape
    x.shape + x.shape (forward over reverse). As torch.func spells it, `hessian(fn,
    argnums=0)` is a function of `fn`'s arguments."""
    if callable(y) and not isinstance(y, TracedTensor):
        fn = y
        return lambda *args: hessian(fn(*args), args[argnums])
    op = _transform("hessian")
    return _apply(op, [_tensor(y, "hessian's y"), _tensor(x, "hessian's x")], {})


class _ScanRecord:
    """A scan node in the making: its arguments, its body's placeholders and results (a
    vmap node too: no carries, its arguments the sequences, `mapped` its in_axes and
    chunk_size)."""

    def __init__(
        self,
        trace: _Trace,
        name: str,
        inits: list[Value],
        seqs: list[TracedTensor],
        length: int | None,
    ) -> None:
        self.scope = trace.scope
        self.body = _Scope(trace.scope)
        self.name = name
        self.inits, self.seqs, self.length = inits, seqs, length
        self.carries: list[TracedTensor] = []
        self.xs: list[TracedTensor] = []
        self.nexts: list[Value] = []
        self.ys: list[Value] = []
        self.results: list[TracedTensor] = []
        self.mapped: tuple[list[int], int | None] | None = None
        self.id: str | None = None
        self.seq = len(trace.items)
        trace.add(self)


def _flat(value: Any) -> tuple[list[Any], bool]:
    if isinstance(value, (tuple, list)):
        return list(value), True
    return [value], False


def _pack(values: list[Any], many: bool, like: Any) -> Any:
    if not many:
        return values[0]
    return list(values) if isinstance(like, list) else tuple(values)


def scan(
    body: Callable[[Any, Any], Any], init: Any, xs: Any = (), length: int | None = None
) -> tuple[Any, Any]:
    """jax.lax.scan as a `scan` node: `body(carry, x) -> (new_carry, y)` is traced once.

    `init`: a tensor or number, or a tuple or list of them; `carry` has its structure.
    `xs`: a tensor, a tuple or list of tensors (sliced on dim 0: `x` has that structure), or
    `()`/None for none (then `x` is None and `length` is required). `y`: a tensor, a tuple
    or list of tensors, or None. Returns `(final_carry, ys)`, each y stacked on a new dim 0.
    """
    trace = _active()
    _transform("scan")
    inits_in, many_carries = _flat(init)
    inits = [_operand(v, "a scan's initial carry") for v in inits_in]
    seqs_in, many_xs = ([], False) if xs is None else _flat(xs)
    seqs = [_tensor(s, "a scan's xs") for s in seqs_in]
    _check_visible(trace, [*inits, *seqs], "scan")
    if not inits:
        raise TypeError("scan needs at least one carry")
    steps = length
    for s in seqs:
        if s._shape is not None:
            if not s._shape:
                raise TraceError("scan: a 0-d tensor cannot be a sequence (xs are sliced on dim 0)")
            if steps is not None and s._shape[0] != steps:
                raise TraceError(f"scan: xs of {s._shape[0]} steps, but length {steps}")
            steps = s._shape[0]
    if not seqs and length is None:
        raise TraceError("scan without xs needs length= (the number of steps)")
    name = getattr(body, "__name__", "scan")
    record = _ScanRecord(trace, name if name.isidentifier() else "scan", inits, seqs, length)
    outer = trace.scope
    trace.scope = record.body
    try:
        for i, v in enumerate(inits):
            meta = _meta(v)
            record.carries.append(
                TracedTensor(
                    trace,
                    "carry",
                    ref=(record, i),
                    shape=None if meta is None else meta.shape,
                    dtype=None if meta is None else meta.dtype,
                    why="the initial carry's shape is unknown",
                )
            )
        for j, s in enumerate(seqs):
            record.xs.append(
                TracedTensor(
                    trace,
                    "x",
                    ref=(record, j),
                    shape=None if s._shape is None else s._shape[1:],
                    dtype=s._dtype,
                    why="its sequence's shape is unknown",
                )
            )
        carry = _pack(record.carries, many_carries, init)
        x = None if not seqs else _pack(record.xs, many_xs, xs)
        out = body(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TraceError(
                f"scan's body must return (new_carry, y), got {type(out).__name__}"
                " (return (carry, None) when there is no y)"
            )
        new, ys = out
        nexts, many_new = _flat(new)
        if many_new != many_carries or len(nexts) != len(inits):
            raise TraceError(
                f"scan's body returned a carry of another structure than init "
                f"({len(nexts)} value(s) for {len(inits)})"
            )
        record.nexts = [_operand(v, "a scan's new carry") for v in nexts]
        ys_list, many_ys = ([], False) if ys is None else _flat(ys)
        record.ys = [_operand(v, "a scan's y") for v in ys_list]
        _check_visible(trace, [*record.nexts, *record.ys], "scan's body")
    finally:
        trace.scope = outer
    for i, (carry_value, new_value) in enumerate(zip(record.carries, record.nexts, strict=True)):
        before, after = _meta(carry_value), _meta(new_value)
        if before is not None and after is not None and before[:2] != after[:2]:
            raise TraceError(
                f"scan: carry {i} is {fmt(before.shape)} {before.dtype} but the body's new "
                f"value is {fmt(after.shape)} {after.dtype}: a carry keeps its shape and dtype "
                "(cast the initial value, or the new one)"
            )
    finals = [
        TracedTensor(
            trace, "result", ref=(record, "carry", i), shape=c._shape, dtype=c._dtype, why=c._why
        )
        for i, c in enumerate(record.carries)
    ]
    stacked = []
    for j, y in enumerate(record.ys):
        meta = _meta(y)
        shape = None if meta is None or steps is None else (steps, *meta.shape)
        stacked.append(
            TracedTensor(
                trace,
                "result",
                ref=(record, "y", j),
                shape=shape,
                dtype=None if meta is None else meta.dtype,
                why="a y's shape or the step count is unknown",
            )
        )
    record.results = [*finals, *stacked]
    ys_out = None if ys is None else _pack(stacked, many_ys, ys)
    return _pack(finals, many_carries, init), ys_out


def vmap(
    fn: Callable[..., Any],
    in_axes: int | Sequence[int] = 0,
    *,
    in_dims: int | Sequence[int] | None = None,
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """torch.func.vmap as a `vmap` node: `vmap(fn, in_axes)(*tensors)` maps `fn` over dim
    `in_axes` of each tensor (one int for all, or one per tensor; `in_dims` is torch's
    name for it). `fn` is traced once on one slice of each; what it reads of the outer
    function is the same for every index. It returns a tensor, a tuple or list of tensors
    (or numbers), each stacked on a new dim 0. `chunk_size`: indices computed at once
    (None: as the server's memory budget allows)."""
    axes_given = in_axes if in_dims is None else in_dims

    def mapped(*args: Any) -> Any:
        trace = _active()
        _transform("vmap")
        seqs = [_tensor(a, "a vmap's argument") for a in args]
        if not seqs:
            raise TypeError("vmap needs at least one tensor to map over")
        _check_visible(trace, seqs, "vmap")
        axes = (
            [int(axes_given)] * len(seqs)
            if isinstance(axes_given, int)
            else [int(a) for a in axes_given]
        )
        if len(axes) != len(seqs):
            raise TraceError(f"vmap: {len(axes)} in_axes for {len(seqs)} arguments")
        size = None
        slices: list[Shape | None] = []
        for j, (s, axis) in enumerate(zip(seqs, axes, strict=True)):
            if s._shape is None:
                slices.append(None)
                continue
            if not -len(s._shape) <= axis < len(s._shape):
                raise TraceError(
                    f"vmap: in_axes {axis} of argument {j}, which has {len(s._shape)} dims"
                )
            axis %= len(s._shape)
            if size is not None and s._shape[axis] != size:
                raise TraceError(
                    f"vmap: argument {j} has {s._shape[axis]} along its mapped dim, "
                    f"but argument 0 has {size}"
                )
            size = s._shape[axis]
            slices.append((*s._shape[:axis], *s._shape[axis + 1 :]))
        name = getattr(fn, "__name__", "vmap")
        record = _ScanRecord(trace, name if name.isidentifier() else "vmap", [], seqs, None)
        record.mapped = (axes, chunk_size)
        outer = trace.scope
        trace.scope = record.body
        try:
            for j, (s, shape) in enumerate(zip(seqs, slices, strict=True)):
                record.xs.append(
                    TracedTensor(
                        trace,
                        "x",
                        ref=(record, j),
                        shape=shape,
                        dtype=s._dtype,
                        why="its argument's shape is unknown",
                    )
                )
            out = fn(*record.xs)
            ys_list, many = _flat(out)
            record.ys = [_operand(v, "a vmap's result") for v in ys_list]
            _check_visible(trace, record.ys, "vmap's function")
        finally:
            trace.scope = outer
        stacked = []
        for j, y in enumerate(record.ys):
            meta = _meta(y)
            stacked.append(
                TracedTensor(
                    trace,
                    "result",
                    ref=(record, "y", j),
                    shape=None if meta is None or size is None else (size, *meta.shape),
                    dtype=None if meta is None else meta.dtype,
                    why="a result's shape or the batch size is unknown",
                )
            )
        record.results = stacked
        return _pack(stacked, many, out)

    return mapped


_HELPERS: dict[str, Callable[..., Any]] = {
    "grad": grad,
    "jvp": jvp,
    "scan": scan,
    "vmap": vmap,
    "jacobian": jacobian,
    "hessian": hessian,
}


# ------------------------------------------------------------------ names from variables


def _library_paths() -> tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            paths.add(os.path.realpath(path) + os.sep)
    paths.update(
        os.path.realpath(p) + os.sep
        for p in sys.path
        if "site-packages" in p or "dist-packages" in p
    )
    return tuple(paths)


_LIBRARIES = _library_paths()
_THIS_FILE = os.path.realpath(__file__)


class _Namer:
    """Names values after the local variables of the traced code, line by line (a trace
    function: chained to any that is already set, as a debugger's or coverage's). A name
    from the frame nearer the traced function wins (`h1 = dense(x)` names the result `h1`,
    not the `out` of `dense`); a variable's name wins over a list's (`hs_0`); else the
    first one stays."""

    def __init__(self, trace: _Trace) -> None:
        self.trace = trace
        self.user_files: dict[str, bool | None] = {}
        self.previous: Any = None
        self.lists: dict[tuple[int, str], tuple[int, int]] = {}  # (frame, var): (list, seen)

    def __enter__(self) -> _Namer:
        self.previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _user(self, filename: str) -> bool | None:
        """True for the user's code, False for a library's, None for this module's."""
        if filename not in self.user_files:
            path = os.path.realpath(filename) if os.path.isabs(filename) else filename
            self.user_files[filename] = (
                None
                if path == _THIS_FILE
                else not (path.startswith(_LIBRARIES) or filename.startswith("<frozen"))
            )
        return self.user_files[filename]

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        inner = self.previous(frame, event, arg) if self.previous is not None else None
        if not self._user(frame.f_code.co_filename):
            return inner
        depth, up = 0, frame.f_back  # user frames between this one and the tracer's
        while up is not None and self._user(up.f_code.co_filename) is not None:
            depth, up = depth + (self._user(up.f_code.co_filename) is True), up.f_back

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal inner
            if inner is not None:
                inner = inner(frame, event, arg)
            if event in ("line", "return"):
                self.name_locals(frame, depth)
            return local

        return local

    def name_locals(self, frame: FrameType, depth: int) -> None:
        for name, value in frame.f_locals.items():
            if name.startswith("_") or not name.isidentifier():
                continue
            if isinstance(value, TracedTensor):
                self._name(value, name, (0, depth))
            elif isinstance(value, (list, tuple)):
                key = (id(frame), name)
                known, seen = self.lists.get(key, (0, 0))
                start = seen if known == id(value) and seen <= len(value) else 0
                for i in range(start, len(value)):
                    item = value[i]
                    if isinstance(item, TracedTensor):
                        self._name(item, f"{name}_{i}", (1, depth))
                self.lists[key] = (id(value), len(value))

    def _name(self, value: TracedTensor, name: str, rank: tuple[int, int]) -> None:
        if value._trace is not self.trace or value._kind == "input":
            return
        if value._name is None or rank < value._rank:
            value._name, value._rank = name, rank


# ------------------------------------------------------------------ trace


def trace(fn: Callable[..., Any], ops_catalog: Any = None, /, **specs: Any) -> dict[str, Any]:
    """The graph JSON (`{"nodes": [...], "outputs": [...]}`) of `fn` called on symbolic
    inputs, one per spec (see the module's docstring), on `ops_catalog` or else the
    standard catalog."""
    catalog = standard_catalog() if ops_catalog is None else as_catalog(ops_catalog)
    t = _Trace(catalog)
    inputs: dict[str, TracedTensor] = {}
    for name, spec in specs.items():
        s = spec_of(spec)
        inputs[name] = TracedTensor(t, "input", ref=name, shape=s.shape, dtype=s.dtype)
    _stack().append(t)
    try:
        call = _binder(fn, inputs)
        with _Namer(t):
            result = call()
    finally:
        _stack().pop()
        t.open = False
    return _Builder(t, _outputs(result)).build()


def _binder(fn: Callable[..., Any], inputs: dict[str, TracedTensor]) -> Callable[[], Any]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return lambda: fn(**inputs)
    try:
        signature.bind(**inputs)
        return lambda: fn(**inputs)
    except TypeError:
        pass
    try:
        signature.bind(*inputs.values())
    except TypeError as exc:
        raise TypeError(
            f"trace: cannot call {getattr(fn, '__name__', fn)!r} with the inputs "
            f"{list(inputs)} by name or in order: {exc}"
        ) from None
    return lambda: fn(*inputs.values())


def _outputs(result: Any) -> list[tuple[str, TracedTensor]]:
    if isinstance(result, TracedTensor):
        pairs = [("out", result)]
    elif isinstance(result, Mapping):
        pairs = list(result.items())
        for key, _ in pairs:
            if not isinstance(key, str) or not key:
                raise TraceError(f"output names must be non-empty strings, got {key!r}")
    elif isinstance(result, (tuple, list)):
        pairs = [(f"out{i}", v) for i, v in enumerate(result)]
    else:
        raise TraceError(
            "the traced function must return a tensor, a tuple or list of "
            f"tensors, or a dict of them, not {type(result).__name__}"
        )
    if not pairs:
        raise TraceError("the traced function returned no outputs")
    for key, value in pairs:
        if not isinstance(value, TracedTensor):
            raise TraceError(
                f"output {key!r} is a {type(value).__name__}, not a traced tensor "
                "(a graph's outputs are values it computes)"
            )
        if value._scope.parent is not None:
            raise TraceError(
                f"output {key!r} is a value computed inside a scan body; return "
                "it from the body (as a carry or a y) instead"
            )
    return pairs


def _identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


_INFIX = {
    "add": ("+", 4),
    "sub": ("-", 4),
    "mul": ("*", 5),
    "div": ("/", 5),
    "matmul": ("@", 5),
    "pow": ("**", 7),
    "lt": ("<", 3),
    "le": ("<=", 3),
    "gt": (">", 3),
    "ge": (">=", 3),
    "eq": ("==", 3),
    "ne": ("!=", 3),
}
_ATOM, _UNARY = 9, 6


def _number_text(value: Number) -> tuple[str, int]:
    text = repr(value)
    return text, _UNARY if text.startswith("-") else _ATOM


def _attr_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_attr_text(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # (a Python string literal too)
    return repr(value)


class _Builder:
    """The graph of a finished trace: which values are nodes, their ids, their exprs."""

    def __init__(self, trace: _Trace, outputs: list[tuple[str, TracedTensor]]) -> None:
        self.trace = trace
        self.outputs = outputs
        self.taken: set[str] = set()
        self.counters: dict[str, Iterator[int]] = {}
        self.materialized: set[int] = set()
        self.op_form: set[int] = set()
        self.next_of: dict[int, tuple[_ScanRecord, int]] = {}  # body value -> its carry

    # -------------------------------------------------------- what is live, what is a node
    def _live(self) -> tuple[set[int], set[int], set[tuple[int, int]]]:
        """Live values (by id()), live scans, and live (scan, y index) pairs."""
        values: set[int] = set()
        scans: set[int] = set()
        ys: set[tuple[int, int]] = set()
        todo: list[Any] = [v for _, v in self.outputs]
        while todo:
            v = todo.pop()
            if not isinstance(v, TracedTensor) or id(v) in values:
                continue
            values.add(id(v))
            if v._kind == "op":
                todo.extend(v._args)
            elif v._kind == "result":
                record, what, i = v._ref
                if what == "y":
                    ys.add((id(record), i))
                    todo.append(record.ys[i])
                if id(record) not in scans:
                    scans.add(id(record))
                    todo.extend(
                        [*record.inits, *record.seqs, *record.nexts, *record.carries, *record.xs]
                    )
        return values, scans, ys

    def _decide(self, live: set[int], scans: set[int], live_ys: set[tuple[int, int]]) -> None:
        uses: dict[int, int] = {}
        force = self.materialized
        items = [
            i
            for i in self.trace.items
            if (id(i) in live if isinstance(i, TracedTensor) else id(i) in scans)
        ]
        self.items = items
        for item in items:
            if isinstance(item, _ScanRecord):
                for i, v in enumerate(item.nexts):
                    if isinstance(v, TracedTensor) and v._scope is item.body:
                        self.next_of.setdefault(id(v), (item, i))
                refs = [
                    *item.inits,
                    *item.seqs,
                    *item.nexts,
                    *(y for j, y in enumerate(item.ys) if (id(item), j) in live_ys),
                ]
                force.update(id(v) for v in refs if isinstance(v, TracedTensor))
                continue
            if item._kind != "op":
                force.add(id(item))
                continue
            name_ok = _identifier(item._op or "")
            for k, a in enumerate(item._args):
                if not isinstance(a, TracedTensor):
                    continue
                uses[id(a)] = uses.get(id(a), 0) + 1
                if a._scope is not item._scope or (item._op in _WRT_TRANSFORMS and k == 1):
                    force.add(id(a))
                if a._kind == "input" and not _identifier(a._ref):
                    name_ok = False
            if not name_ok:  # a name an expr cannot hold: a node in op form
                self.op_form.add(id(item))
                force.add(id(item))
                force.update(id(a) for a in item._args if isinstance(a, TracedTensor))
        force.update(id(v) for _, v in self.outputs)
        for item in items:
            if isinstance(item, TracedTensor) and (
                item._name is not None or uses.get(id(item), 0) > 1
            ):
                force.add(id(item))
        # Cut expressions that grow too deep or long.
        depth: dict[int, int] = {}
        size: dict[int, int] = {}
        for item in items:
            if not isinstance(item, TracedTensor) or item._kind != "op":
                continue
            kids = [a for a in item._args if isinstance(a, TracedTensor)]
            inline = [a for a in kids if id(a) not in force]

            def measure(
                inline: list[TracedTensor] = inline,
                kids: list[TracedTensor] = kids,
                item: TracedTensor = item,
            ) -> tuple[int, int]:
                d = 1 + max((depth[id(a)] for a in inline), default=0)
                s = (
                    len(item._op or "")
                    + 4
                    + 12 * len(kids)
                    + 16 * len(item._attrs)
                    + sum(size[id(a)] for a in inline)
                )
                return d, s

            d, s = measure()
            if d > MAX_INLINE_DEPTH or s > MAX_INLINE_CHARS:
                force.update(id(a) for a in inline)
                d, s = measure([])
            if s > _MAX_EXPR_CHARS:
                self.op_form.add(id(item))
                force.add(id(item))
            depth[id(item)], size[id(item)] = d, s

    # -------------------------------------------------------- ids
    def _unique(self, base: str, numbered: bool = False) -> str:
        if not numbered and base not in self.taken:
            self.taken.add(base)
            return base
        counter = self.counters.setdefault(base, itertools.count(1))
        while True:
            name = f"{base}_{next(counter)}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def _assign_ids(self) -> list[dict[str, Any]]:
        """Ids for every node; returns the alias nodes that some outputs need."""
        inputs = [i for i in self.trace.items if isinstance(i, TracedTensor) and i._kind == "input"]
        self.taken.update(i._ref for i in inputs)
        aliases: list[dict[str, Any]] = []
        self.output_ids: list[str] = []
        for key, value in self.outputs:
            if value._kind == "input" and key == value._ref:
                self.output_ids.append(key)
                continue
            if key in self.taken:
                raise TraceError(
                    f"output {key!r} has the name of an input or of another "
                    "output: return it under another name"
                )
            self.taken.add(key)
            self.output_ids.append(key)
            if value._kind != "input" and value._id is None and _identifier(key):
                value._id = key
            else:
                aliases.append({"key": key, "value": value})
        for item in self.items:
            if isinstance(item, _ScanRecord):
                item.id = self._unique(item.name)
                continue
            if item._id is not None or id(item) not in self.materialized:
                continue
            if item._name is not None:
                item._id = self._unique(item._name)
                continue
            if item._kind == "carry":
                base = "carry"
            elif item._kind == "x":
                base = "x"
            elif item._kind == "result":
                record, what, i = item._ref
                source = record.carries[i] if what == "carry" else record.ys[i]
                stem = source._id if isinstance(source, TracedTensor) and source._id else what
                base = f"{stem}_last" if what == "carry" else f"{stem}_all"
            elif id(item) in self.next_of:  # a carry's next value
                record, i = self.next_of[id(item)]
                base = f"{record.carries[i]._id}_next"
            elif item._op in _WRT_TRANSFORMS:
                wrt = item._args[1]
                base = f"{item._op}_{wrt._id}" if wrt._id else item._op or "v"
            else:
                base = item._op or "v"
            item._id = self._unique(base, numbered=item._kind == "op" and item._op == base)
        return aliases

    # -------------------------------------------------------- rendering
    def _text(self, value: Value) -> tuple[str, int]:
        if not isinstance(value, TracedTensor):
            return _number_text(value)
        if id(value) in self.materialized:
            assert value._id is not None
            return value._id, _ATOM
        return self._expr(value)

    def _expr(self, v: TracedTensor) -> tuple[str, int]:
        op = v._op or ""
        args = v._args
        if op in _INFIX and len(args) == 2 and not v._attrs:
            symbol, prec = _INFIX[op]
            (left, lp), (right, rp) = self._text(args[0]), self._text(args[1])
            if op == "pow":
                left = f"({left})" if lp <= prec else left
                right = f"({right})" if rp < _UNARY else right
            elif prec == 3:
                left = f"({left})" if lp <= prec else left
                right = f"({right})" if rp <= prec else right
            else:
                left = f"({left})" if lp < prec else left
                right = f"({right})" if rp <= prec else right
            return f"{left} {symbol} {right}", prec
        if op == "neg" and len(args) == 1 and not v._attrs:
            text, prec = self._text(args[0])
            return "-" + (f"({text})" if prec < _UNARY or text.startswith("-") else text), _UNARY
        parts = []
        info = self.trace.catalog.ops.get(op)
        attrs = dict(v._attrs)
        lead = info.lead_attr if info is not None else None
        if lead is not None and lead in attrs:
            parts.append(_attr_text(attrs.pop(lead)))
        parts.extend(self._text(a)[0] for a in args)
        parts.extend(f"{k}={_attr_text(x)}" for k, x in attrs.items())
        return f"{op}({', '.join(parts)})", _ATOM

    def _ref(self, value: Value) -> Any:
        if isinstance(value, TracedTensor):
            assert value._id is not None, value
            return value._id
        return value

    def _node(self, v: TracedTensor) -> dict[str, Any]:
        assert v._id is not None
        if id(v) in self.op_form:
            node: dict[str, Any] = {
                "id": v._id,
                "op": v._op,
                "args": [self._ref(a) for a in v._args],
            }
            if v._attrs:
                node["attrs"] = dict(v._attrs)
            return node
        return {"id": v._id, "expr": self._expr(v)[0]}

    def build(self) -> dict[str, Any]:
        live, scans, live_ys = self._live()
        self._decide(live, scans, live_ys)
        aliases = self._assign_ids()
        top: list[dict[str, Any]] = []
        bodies: dict[int, list[dict[str, Any]]] = {id(self.trace.root): top}
        for item in self.items:
            if isinstance(item, _ScanRecord):
                nodes: list[dict[str, Any]] = []
                bodies[id(item.body)] = nodes
                bodies[id(item.scope)].append(self._scan(item, nodes, live_ys))
            elif item._kind == "op" and id(item) in self.materialized:
                bodies[id(item._scope)].append(self._node(item))
        for alias in aliases:
            value = alias["value"]
            top.append({"id": alias["key"], "expr": value._id or value._ref})
        return {"nodes": top, "outputs": list(self.output_ids)}

    def _scan(
        self, record: _ScanRecord, nodes: list[dict[str, Any]], live_ys: set[tuple[int, int]]
    ) -> dict[str, Any]:
        carries = [c._id for c in record.carries]
        nexts = {}
        for carry, value in zip(carries, record.nexts, strict=True):
            if isinstance(value, TracedTensor):
                nexts[carry] = value._id
            else:  # a number: a constant of the body
                const = self._unique(f"{carry}_next")
                nodes.append({"id": const, "expr": _number_text(value)[0]})
                nexts[carry] = const
        results: dict[str, str] = {}
        for result in record.results:
            _, what, i = result._ref
            if result._id is None:
                continue  # not used
            if what == "carry":
                results[result._id] = carries[i]  # type: ignore[assignment]
                continue
            y = record.ys[i]
            if isinstance(y, TracedTensor) and y._kind == "op" and y._scope is record.body:
                results[result._id] = y._id  # type: ignore[assignment]
            else:  # a carry, a slice, an outer value or a number: an alias in the body
                alias = self._unique(f"{result._id}_step")
                nodes.append(
                    {
                        "id": alias,
                        "expr": self._ref(y) if isinstance(y, TracedTensor) else _number_text(y)[0],
                    }
                )
                results[result._id] = alias
        if record.mapped is not None:
            axes, chunk_size = record.mapped
            return {
                "id": record.id,
                "op": "vmap",
                "args": [self._ref(v) for v in record.seqs],
                "body": {"in": [x._id for x in record.xs], "nodes": nodes},
                "results": results,
                "attrs": {"in_axes": axes, "chunk_size": chunk_size},
            }
        node: dict[str, Any] = {
            "id": record.id,
            "op": "scan",
            "args": [self._ref(v) for v in (*record.inits, *record.seqs)],
            "body": {
                "carry": carries,
                "xs": [x._id for x in record.xs],
                "nodes": nodes,
                "next": nexts,
            },
            "results": results,
        }
        if record.length is not None or not record.seqs:
            node["attrs"] = {"length": record.length}
        return node
