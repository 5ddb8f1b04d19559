"""The op registry: every op is declared once, as one `OpDef`.

An OpDef holds everything about an op: its name and group, its tensor
arguments, its attributes (PyTorch names, types, defaults), a one-line doc,
the shape-and-dtype rule (`infer`), the forward on a backend namespace `xp`,
the vector-Jacobian product per argument, and which values that VJP reads
(`save`). `GET /ops`, the `expr` whitelist, graph validation and `grad_fn`
names all read this registry.

VJPs are written once against a namespace `F` that they are handed: on a
plain backward `F` runs the ops' forwards on raw arrays (cheap, records
nothing); with `create_graph=True` it is the engine's own op functions on
Tensors, so the same rule is itself differentiable.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gradserve.engine.dtypes import (
    DEFAULT_FLOAT,
    FLOATS,
    ITEMSIZE,
    Scalar,
    check_dtype,
    result_type,
)
from gradserve.engine.errors import ArityError, AttributeError_, did_you_mean
from gradserve.engine.shapes import numel

Array = Any
VJP = Callable[..., Any]


class Meta(NamedTuple):
    """What shape inference knows of a value: its shape, dtype, and whether it is a
    Python number literal (weak in type promotion)."""

    shape: tuple[int, ...]
    dtype: str
    literal: bool = False


_MISSING: Any = object()


@dataclass(frozen=True)
class Attr:
    """An attribute: its wire type, default, and an optional extra check."""

    type: str  # "int", "float", "bool", "number", "str", "dtype", "ints", "int|ints", "shape"
    default: Any = _MISSING
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    nullable: bool = False

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.type + ("|null" if self.nullable else ""),
            "default": None if self.required else self.default,
            "required": self.required,
        }


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(v: Any) -> bool:
    """An int that fits int64, as PyTorch's integer arguments must."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX


def _is_ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)


def _type_message(key: str, expected: str, value: Any) -> str:
    ints = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, int) and not isinstance(v, bool) and not _is_int(v) for v in ints):
        return f"attribute {key!r} is outside the int64 range"
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"attribute {key!r} must be {expected}, got {shown}"


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "float": lambda v: isinstance(v, float) or _is_int(v),
    "number": lambda v: isinstance(v, float) or _is_int(v) or isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dtype": lambda v: isinstance(v, str),
    "ints": _is_ints,
    "int|ints": lambda v: _is_int(v) or _is_ints(v),
    "shape": lambda v: _is_ints(v) or _is_int(v),
}


def NOT_LOWERED(*_: Any, **__: Any) -> Any:
    """`OpDef.lower` of an op the XLA tier does not compute (a marker, never called)."""
    raise AssertionError("an op marked NOT_LOWERED is never lowered")


@dataclass(eq=False)
class OpDef:
    """One op, declared once. See the module docstring."""

    name: str
    group: str
    doc: str
    args: tuple[str, ...]
    forward: Callable[..., Array]
    infer: Callable[..., Meta]
    # One VJP per argument (None: not differentiable in that argument), each
    # `(F, grad, *saved, **attrs) -> grad of that argument`. Variadic ops give one
    # function returning the list of all operands' gradients.
    vjp: tuple[VJP | None, ...] | VJP | None = None
    save: tuple[str, ...] = ()
    attrs: dict[str, Attr] = field(default_factory=dict)
    variadic: bool = False
    # Type promotion: the tensor arguments promoted to one dtype before the forward
    # (indices into args, or "all"), and whether integer inputs compute in the default float.
    promote: tuple[int, ...] | str = ()
    float_result: bool = False
    # Attributes a Python caller may also pass positionally after the tensors,
    # in PyTorch's order (`sum(x, 1)`, `transpose(x, 0, 1)`).
    positional_attrs: tuple[str, ...] = ()
    # Where the Python call order puts attributes before some tensors, as in
    # `gather(input, dim, index)`: the full positional order by name.
    call_order: tuple[str, ...] | None = None
    # The forward returns its input array itself (detach): the memory plan counts it once.
    returns_input: bool = False
    # The result may share memory with an input (a view, or the input itself): a compiled
    # program never writes into that input's buffer while the result lives.
    views_input: bool = False
    # A check of the arguments as given, before promotion casts them (`sub` refuses bool).
    check_args: Callable[..., None] | None = None
    # The static cost of one call: `cost(metas, out, **attrs) -> (flops, bytes)`, from the
    # arguments' and the result's metas. None: one operation per element read or written,
    # and every input and output byte touched once, right for elementwise ops and
    # reductions (engine.graph.plan computes it from the sizes it already has).
    cost: Callable[..., tuple[int, int]] | None = None
    # The backend ufunc that computes this op on operands already promoted to its result
    # dtype (elementwise ops): compiled programs call it directly, and may let it write
    # into the buffer of an operand that dies at this step.
    ufunc: str | None = None
    # A forward specialised on static metas, for compiled programs: `kernel(backend, metas,
    # **attrs)` returns a callable on the step's arguments (metas: None for a literal), or
    # None to use `forward`. It computes exactly what `forward` does, with the decisions
    # that depend only on shapes, dtypes and attributes made once (checks included: the
    # compiler ran the shape rule).
    kernel: Callable[..., Callable[..., Array] | None] | None = None
    # How the XLA tier (engine.graph.xla) computes this op: None, `forward` itself on the
    # tier's JAX namespace (it traces as it is); else `lower(xp, *args, **attrs)` on that
    # namespace, where the forward cannot trace (a check that reads the data) or XLA
    # computes otherwise than PyTorch; NOT_LOWERED keeps its programs on the interpreter.
    lower: Callable[..., Array] | None = None
    # Its rule and VJPs use a number literal argument only as itself, never its value
    # (`pow`'s VJP computes b - 1): a graph that differs in it may take the program of one
    # that does not, with the new value put in (engine.graph.lifting).
    lifts_literals: bool = True

    # Derived once at registration.
    grad_fn_name: str = field(init=False)
    defaults: dict[str, Any] = field(init=False)
    save_index: tuple[int, ...] = field(init=False)  # -1 = the result
    # Per argument: is it differentiable (None: all are, as for variadic ops).
    diff_mask: tuple[bool, ...] | None = field(init=False)
    _pick: Callable[[Sequence[Any]], Any] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.grad_fn_name = "".join(p.capitalize() for p in self.name.split("_")) + "Backward"
        self.defaults = {k: a.default for k, a in self.attrs.items() if not a.required}
        self.save_index = tuple(-1 if s == "result" else self.args.index(s) for s in self.save)
        mask = None
        if self.vjp is not None and not self.variadic:
            mask = tuple(f is not None for f in self.vjp)  # type: ignore[union-attr]
        self.diff_mask = None if mask is None or all(mask) else mask

        # Picks the saved values from (*args, out): index -1 is `out`.
        self._pick = operator.itemgetter(*self.save_index) if self.save_index else None

    def pick_saved(self, args: Sequence[Any], out: Any) -> tuple[Any, ...]:
        """The values named in `save`, in order (a variadic op's one argument name stands
        for the tuple of all its operands)."""
        if self.variadic:
            return tuple(out if i < 0 else tuple(args) for i in self.save_index)
        if self._pick is None:
            return ()
        picked = self._pick((*args, out))
        return picked if len(self.save_index) > 1 else (picked,)

    def promoted(self, nargs: int) -> Sequence[int]:
        """The argument positions that type promotion casts to one dtype."""
        return range(nargs) if self.promote == "all" else self.promote  # type: ignore[return-value]

    @property
    def differentiable(self) -> bool:
        if self.vjp is None:
            return False
        return self.variadic or any(f is not None for f in self.vjp)  # type: ignore[union-attr]

    def arg_differentiable(self, i: int) -> bool:
        if self.vjp is None:
            return False
        if self.variadic:
            return True
        return self.vjp[i] is not None  # type: ignore[index]

    def bind_attrs(self, given: dict[str, Any]) -> dict[str, Any]:
        """Validate attributes against the declaration and fill in defaults."""
        if not given and len(self.defaults) == len(self.attrs):
            return self.defaults
        return bind_attributes(self.name, self.attrs, self.defaults, given)

    def check_arity(self, n: int) -> None:
        if self.variadic:
            if n < 1:
                raise ArityError(f"takes at least 1 tensor argument, got {n}", op=self.name)
        elif n != len(self.args):
            names = ", ".join(self.args) or "none"
            raise ArityError(
                f"takes {len(self.args)} tensor argument(s) ({names}), got {n}", op=self.name
            )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "args": list(self.args),
            "variadic": self.variadic,
            "attrs": {k: a.describe() for k, a in self.attrs.items()},
            "differentiable": self.differentiable,
            "doc": self.doc,
        }


def bind_attributes(
    op: str, declared: dict[str, Attr], defaults: dict[str, Any], given: dict[str, Any]
) -> dict[str, Any]:
    """`given` checked against the `declared` attributes of `op`, defaults filled in."""
    for key in given:
        if key not in declared:
            known = ", ".join(declared) or "none"
            raise AttributeError_(
                f"unknown attribute {key!r}{did_you_mean(key, declared)}; {op} takes: {known}",
                op=op,
                loc=("attrs", key),
            )
    out = dict(defaults)
    for key, spec in declared.items():
        if key not in given:
            if spec.required:
                raise AttributeError_(
                    f"missing required attribute {key!r}", op=op, loc=("attrs", key)
                )
            continue
        value = given[key]
        if value is None and (spec.nullable or spec.default is None):
            out[key] = None
            continue
        if not _TYPE_CHECKS[spec.type](value):
            raise AttributeError_(_type_message(key, spec.type, value), op=op, loc=("attrs", key))
        if spec.type == "dtype":
            value = check_dtype(value)
        if isinstance(value, tuple):
            value = list(value)
        if spec.choices is not None and value not in spec.choices:
            raise AttributeError_(
                f"attribute {key!r} must be one of {list(spec.choices)}, got {value!r}",
                op=op,
                loc=("attrs", key),
            )
        out[key] = value
    return out


OPS: dict[str, OpDef] = {}


def register(*ops: OpDef) -> None:
    for op in ops:
        if op.name in OPS:
            raise ValueError(f"op {op.name!r} declared twice")
        OPS[op.name] = op


# ---------------------------------------------------------------- promotion


def promoted_dtype(metas: Sequence[Meta], float_result: bool = False) -> str:
    """The dtype an op computes in: `torch.result_type` of its operands, lifted to the
    default float for ops that only compute in floating point."""
    first = metas[0].dtype
    if first in FLOATS and all(
        m.dtype == first or (m.literal and m.dtype != "float64") for m in metas
    ):
        return first  # one float dtype, or with weak literals: nothing to promote
    dims = [m.dtype for m in metas if not m.literal and m.shape]
    zero = [m.dtype for m in metas if not m.literal and not m.shape]
    lits: list[Scalar] = [_LITERAL_OF[m.dtype] for m in metas if m.literal]
    out = result_type(dims, zero, lits)
    if float_result and out not in FLOATS:
        return DEFAULT_FLOAT
    return out


_LITERAL_OF: dict[str, Scalar] = {"bool": True, "int64": 1, "float32": 1.0}


_LITERAL_METAS = {
    bool: Meta((), "bool", True),
    int: Meta((), "int64", True),
    float: Meta((), DEFAULT_FLOAT, True),
}


def literal_meta(value: Scalar) -> Meta:
    """The Meta of a Python number literal (weak in type promotion)."""
    return _LITERAL_METAS[type(value)]


def nbytes(meta: Meta) -> int:
    """The bytes of a value with this meta."""
    return numel(meta.shape) * ITEMSIZE[meta.dtype]
