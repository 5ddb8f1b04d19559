"""The third namespace `F`: ops that emit IR steps with static metadata instead of computing.

VJPs are written once against a namespace `F` (engine.ops.registry). On a plain backward
`F` computes on arrays; with `create_graph` it records on Tensors; here it appends steps
to a program under construction, each with its shape and dtype inferred by the op's own
rule. So reverse mode is a transformation of the program: the backward is more steps of
the same kind, planned and priced with the forward.

`Sym` is a value of the program being built: a slot with its shape and dtype. It has
PyTorch's operators, so that VJPs read the same on all three namespaces, and it refuses to
be read as a Python number: the program is built before there is any data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gradserve.engine.dtypes import DEFAULT_FLOAT, FLOATS, scalar_dtype
from gradserve.engine.errors import GradserveError
from gradserve.engine.graph.facts import Facts, attr_values, facts_of, literal_key
from gradserve.engine.graph.ir import BACKWARD, CAST, CONSTANT, NODE, Arg, Lit, Step
from gradserve.engine.ops.registry import OPS, Meta, OpDef, literal_meta, promoted_dtype

Value = Any  # a Sym, or a Python number (a weak literal)

# Ops that are the identity when their result has their input's meta: a derived backward
# emits them freely (`sum_to_shape`, a cast back to the input's dtype), and they are
# dropped when there is nothing to do. (Not permute or transpose: a square matrix keeps
# its shape when transposed.)
_IDENTITY_WHEN_SAME_META = frozenset({"cast", "reshape", "expand", "squeeze", "flatten"})


class DataDependent(GradserveError):
    """A program was asked for a value that only exists once it runs."""


class Sym:
    """A value of the program being built."""

    __slots__ = ("b", "dtype", "meta", "shape", "slot")
    __hash__ = object.__hash__  # `==` builds an `eq` step, as on Tensors

    def __init__(self, b: Builder, slot: int, meta: Meta) -> None:
        self.b = b
        self.slot = slot
        self.meta = meta
        self.shape = meta.shape
        self.dtype = meta.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Sym(slot={self.slot}, shape={self.shape}, dtype={self.dtype})"

    def __add__(self, o: Value) -> Sym:
        return self.b.call("add", self, o)

    def __radd__(self, o: Value) -> Sym:
        return self.b.call("add", o, self)

    def __sub__(self, o: Value) -> Sym:
        return self.b.call("sub", self, o)

    def __rsub__(self, o: Value) -> Sym:
        return self.b.call("sub", o, self)

    def __mul__(self, o: Value) -> Sym:
        return self.b.call("mul", self, o)

    def __rmul__(self, o: Value) -> Sym:
        return self.b.call("mul", o, self)

    def __truediv__(self, o: Value) -> Sym:
        return self.b.call("div", self, o)

    def __rtruediv__(self, o: Value) -> Sym:
        return self.b.call("div", o, self)

    def __pow__(self, o: Value) -> Sym:
        return self.b.call("pow", self, o)

    def __rpow__(self, o: Value) -> Sym:
        return self.b.call("pow", o, self)

    def __matmul__(self, o: Value) -> Sym:
        return self.b.call("matmul", self, o)

    def __neg__(self) -> Sym:
        return self.b.call("neg", self)

    def __pos__(self) -> Sym:
        return self

    def __lt__(self, o: Value) -> Sym:
        return self.b.call("lt", self, o)

    def __le__(self, o: Value) -> Sym:
        return self.b.call("le", self, o)

    def __gt__(self, o: Value) -> Sym:
        return self.b.call("gt", self, o)

    def __ge__(self, o: Value) -> Sym:
        return self.b.call("ge", self, o)

    def __eq__(self, o: Value) -> Sym:  # type: ignore[override]
        return self.b.call("eq", self, o)

    def __ne__(self, o: Value) -> Sym:  # type: ignore[override]
        return self.b.call("ne", self, o)

    def _data(self) -> NoReturn:
        raise DataDependent(
            "a value of a graph cannot be read while the graph is compiled; "
            "the decision must depend on shapes, dtypes or attributes only"
        )

    # (one method each: mypyc compiles no chained assignment in a class body)
    def __bool__(self) -> bool:
        self._data()

    def __int__(self) -> int:
        self._data()

    def __float__(self) -> float:
        self._data()

    def __index__(self) -> int:
        self._data()


class Builder:
    """A program under construction, and the namespace `F` that emits into it.

    `origin` is the client node the next steps serve (for errors and costs); `kind` what
    they are; `create_graph` tells VJPs whether the backward they emit will itself be
    differentiated (PyTorch's GradMode during backward); `simplify` drops identity steps
    (on for derived steps only: a client's own `reshape` to the same shape is a node and
    keeps its grad_fn).
    """

    def __init__(self) -> None:
        self.metas: list[Meta] = []
        self.steps: list[Step] = []
        self.syms = _Syms(self)
        self.origin: str | None = None
        self.kind = NODE
        self.create_graph = False
        self.simplify = False
        self.facts: dict[Step, Facts] = {}  # per step emitted here (engine.graph.facts)
        self._calls: dict[str, Callable[..., Sym]] = {}

    # ------------------------------------------------------------------ values
    def value(self, meta: Meta) -> Sym:
        """A new slot that no step writes (an input of the program)."""
        slot = len(self.metas)
        self.metas.append(meta)
        sym = self.syms[slot] = Sym(self, slot, meta)
        return sym

    def arg(self, a: Arg) -> Value:
        """A step argument as a VJP reads it: the Sym of a slot, or the literal's number."""
        return self.syms[a] if type(a) is int else a.value  # type: ignore[union-attr]

    def constant(self, value: bool | int | float, dtype: str) -> Sym:
        """A 0-d constant (a literal that must be a tensor: an op on literals only)."""
        kind, self.kind = self.kind, CONSTANT
        try:
            return self.emit(OPS["full"], [], {"shape": [], "value": value, "dtype": dtype})
        finally:
            self.kind = kind

    # ------------------------------------------------------------------ emitting
    def emit(self, op: OpDef, args: Sequence[Value], attrs: dict[str, Any]) -> Sym:
        """Append one step of `op`, with type promotion made explicit (cast steps), as
        `engine._tensor.apply` promotes at run time. `attrs` must be complete (bound).
        Raises the op's GradserveError when its shape rule refuses the arguments.

        What the shape rule and promotion decide depends only on the op, the arguments'
        metas and literal values, and the attributes: it is remembered by that signature,
        so a graph that repeats a layer (an unrolled loop) works it out once."""
        if attrs:
            key = (
                op,
                *[a.meta if type(a) is Sym else literal_key(a) for a in args],
                *attr_values(attrs),
            )
        else:
            key = (op, *[a.meta if type(a) is Sym else literal_key(a) for a in args])
        decided = _DECISIONS.get(key)
        if decided is None:
            if args and not any(type(a) is Sym for a in args):
                return self._on_literals(op, list(args), attrs)
            decided = _DECISIONS.remember(key, _decide(op, args, attrs))
        out, casts, same_meta, facts = decided
        if same_meta and self.simplify:
            return args[0]  # type: ignore[no-any-return]
        if casts:
            values = list(args)
            for i, dtype in casts:
                values[i] = self._cast(values[i], dtype)
            args = values
        step_args: tuple[Arg, ...] = tuple([v.slot if type(v) is Sym else Lit(v) for v in args])
        metas = self.metas
        slot = len(metas)
        metas.append(out)
        sym = self.syms[slot] = Sym(self, slot, out)
        step = Step(op, step_args, attrs, slot, self.kind, self.origin)
        self.steps.append(step)
        if facts is None:  # (the same for every step the decision emits)
            facts = decided[3] = facts_of(step, metas)
        self.facts[step] = facts
        return sym

    def emit_args(self, op: OpDef, args: list[int | Lit], attrs: dict[str, Any]) -> int:
        """`emit` with a step's arguments (slots and literals), as the slot of its result:
        made without a Sym where the decision is known and inserts no cast."""
        metas = self.metas
        sig = [
            metas[a] if type(a) is int else literal_key(a.value)  # type: ignore[union-attr]
            for a in args
        ]
        decided = _DECISIONS.get((op, *sig, *attr_values(attrs)) if attrs else (op, *sig))
        if decided is None or decided[1] or decided[3] is None or (decided[2] and self.simplify):
            return self.emit(op, self.values(args), attrs).slot
        slot = len(metas)
        metas.append(decided[0])
        step = Step(op, tuple(args), attrs, slot, self.kind, self.origin)
        self.steps.append(step)
        self.facts[step] = decided[3]
        return slot

    def values(self, args: list[int | Lit]) -> list[Value]:
        """Step arguments as `emit` takes them: Syms and numbers."""
        syms = self.syms
        return [syms[a] if type(a) is int else a.value for a in args]  # type: ignore[union-attr]

    def _on_literals(self, op: OpDef, values: list[Value], attrs: dict[str, Any]) -> Sym:
        """An op on number literals alone: the literals become 0-d constants first."""
        metas = [literal_meta(v) for v in values]
        op.infer(metas, **attrs)  # the op's own error, before any constant is emitted
        self._materialize(op, values, metas)
        return self.emit(op, values, attrs)

    def _cast(self, v: Sym, dtype: str) -> Sym:
        kind, self.kind = self.kind, CAST if self.kind == NODE else self.kind
        try:
            return self.emit(OPS["cast"], [v], {"dtype": dtype})
        finally:
            self.kind = kind

    def _materialize(self, op: OpDef, values: list[Value], metas: list[Meta]) -> None:
        """An op on number literals alone computes on 0-d tensors, as `apply` does: the
        first literal in its own default dtype, the promoted ones in their common dtype."""
        promoted: Sequence[int] = ()
        target = None
        if op.promote:
            promoted = op.promoted(len(values))
            target = promoted_dtype([metas[i] for i in promoted], op.float_result)
        for i, v in enumerate(values):
            if i in promoted:
                values[i] = self.constant(v, target)  # type: ignore[arg-type]
            elif i == 0:
                dtype = scalar_dtype(v)
                if op.float_result and dtype not in FLOATS:
                    dtype = DEFAULT_FLOAT
                values[i] = self.constant(v, dtype)

    # ------------------------------------------------------------------ the namespace F
    def call(self, name: str, *args: Value, **attrs: Any) -> Sym:
        """`F.<name>(...)` as VJPs call it: attributes by keyword, defaults filled in."""
        op = OPS[name]
        return self.emit(op, args, {**op.defaults, **attrs} if op.attrs else attrs)

    def __getattr__(self, name: str) -> Callable[..., Sym]:
        if name not in OPS:
            raise AttributeError(name)
        fn = self._calls.get(name)
        if fn is None:
            fn = self._calls[name] = lambda *args, **attrs: self.call(name, *args, **attrs)
        return fn

    def zeros_like(self, x: Sym) -> Sym:
        return self.call("zeros", shape=list(x.shape), dtype=x.dtype)

    def ones_like(self, x: Sym) -> Sym:
        return self.call("ones", shape=list(x.shape), dtype=x.dtype)

    @staticmethod
    def dtype_of(x: Sym) -> str:
        return x.dtype


class _Syms(dict[int, Sym]):
    """The Sym of each slot of a Builder, made when first asked for (a replayed VJP
    template makes slots that nothing reads as a Sym)."""

    __slots__ = ("b",)

    def __init__(self, b: Builder) -> None:
        super().__init__()
        self.b = b

    def __missing__(self, slot: int) -> Sym:
        sym = self[slot] = Sym(self.b, slot, self.b.metas[slot])
        return sym


class Memo(dict[Any, Any]):
    """Decisions remembered by signature, forgotten all at once past `limit` entries (the
    signatures that matter repeat within a graph and across the graphs of one client)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: Any, value: Any) -> Any:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


# (op, argument metas and literals, attributes) -> [result meta, casts, result == input
# meta, the facts of the step it emits (once one is)]
_DECISIONS = Memo(1 << 14)


def _decide(op: OpDef, args: Sequence[Value], attrs: dict[str, Any]) -> list[Any]:
    """The shape rule's result, the casts that type promotion inserts (argument index and
    dtype), whether the result has the first argument's meta, and a place for the facts
    of the step (engine.graph.facts)."""
    metas = [a.meta if type(a) is Sym else literal_meta(a) for a in args]
    out = op.infer(metas, **attrs)
    casts: list[tuple[int, str]] = []
    if op.promote:
        promoted = op.promoted(len(args))
        target = promoted_dtype([metas[i] for i in promoted], op.float_result)
        casts = [(i, target) for i in promoted if type(args[i]) is Sym and metas[i].dtype != target]
    elif op.float_result:
        casts = [
            (i, DEFAULT_FLOAT)
            for i, a in enumerate(args)
            if type(a) is Sym and a.dtype not in FLOATS
        ]
    same = op.name in _IDENTITY_WHEN_SAME_META and out == metas[0]
    return [out, tuple(casts), same, None]


def derived(b: Builder, *, create_graph: bool, kind: str = BACKWARD) -> _Derived:
    """`with derived(b, create_graph=...)`: emit the steps of a derivative (of `kind`,
    identity steps dropped)."""
    return _Derived(b, create_graph, kind)


class _Derived:
    def __init__(self, b: Builder, create_graph: bool, kind: str) -> None:
        self.b, self.create_graph, self.kind = b, create_graph, kind

    def __enter__(self) -> Builder:
        b = self.b
        self.saved = (b.kind, b.origin, b.create_graph, b.simplify)
        b.kind, b.create_graph, b.simplify = self.kind, self.create_graph, True
        return b

    def __exit__(self, *exc: object) -> None:
        b = self.b
        b.kind, b.origin, b.create_graph, b.simplify = self.saved
