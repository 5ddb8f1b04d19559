"""Compiled programs as bytes, for a program store that any process loads from quickly.

`dump_program(program)` writes a planned program as data only: no pickle, no code. Ops are
named (the registry's, and `scan`), values keep their exact Python types, and kernels are
not stored: `load_program(data, device)` binds them again through the executor's own memo
of kernels by signature, once per distinct signature (`executor.kernel_of`). A store that
someone else can write can give wrong programs, but never run code in the service.

A step is stored as its signature, the slots it reads and writes, and what the plan says
of it. A signature is a JSON text of its own: the step's op and attributes, whether it
runs as a ufunc and into a dead argument's buffer, and per argument the meta of the slot
it reads or the literal it is given. Everything a step's run tuple and kernel depend on
but its slots is in its signature: the loader decides and checks that once per signature
(a process remembers each text it has checked, with its kernel), and per step only
compares columns.

The layout, little-endian:

    prefix   magic (8 bytes), FORMAT_VERSION (u32), CRC-32 of the rest (u32), length of
             the rest (u64)
    header   its length (u32), then JSON: the step kinds, the names as one string (their
             lengths a column), the metas, the signatures (texts), and one record per
             program (the program, then its loops' bodies, each after the program it is
             in) with the program's scalars, its loops, and its table of columns
    columns  tables of 8-byte aligned integer columns, each in the narrowest dtype its
             values fit (unsigned but for the costs): per step its signature, kind, origin,
             result, reused slot + 1, cost, and the slots it reads and frees (the counts of
             frees, then the values flat; the counts of reads are its signature's); per
             slot its meta, requires_grad and grad_fn; the held slots

Loading checks, before anything is built: the length and the checksum; the type of every
header value; every index against its table; the data flow (each slot written once, read
after it is written and before it is freed, freed at most once; a loop writes only the
results its body is planned for; a buffer reused only from a dead argument); each step
against its signature (the metas of the slots it reads and of its result); per signature,
its result against its op's shape rule and its attributes against the op's declaration;
each loop body against its step and its program; the steps' costs against the program's
(all of them, and the recompute steps'). Whatever is wrong raises CorruptProgram,
never another exception. (A checksum that matches is no proof of origin: someone who can
write the store can write a consistent program that computes something else, but nothing
that runs code or loads half-formed.)

A program of up to SMALL steps is checked step by step in Python, a larger one a column at
a time with NumPy: the same checks (tests load every program both ways, and fuzz them
against each other), as NumPy's cost per call is most of a small program's load. The run
tuples are built with the decisions `executor._run` makes (tests hold the two equal), a
loop body's too (handed to `executor._Loop`). The Step objects, which only /plan, errors
and loop bodies read, are decoded when first read, and so are the names and the per-slot
and per-step lists that a run does not read.

The cycle collector is off while a load makes its objects: about two containers a step
(its run tuple and the tuple of slots it frees), none in a cycle. Its caller pays for them
later: the collector's first pass walks them all (about 10 ms for 100,000 steps; it then
untracks the frees), and every full collection walks the run tuples again (they hold the
kernels). A process that keeps the program should keep the collector off from the load
until its answer is sent, then run `gc.collect(1)` (that first pass, and the request's own
garbage) and `gc.freeze()` (the program out of every later collection; it is still freed
when dropped, as nothing in it is in a cycle).
"""

from __future__ import annotations

import gc
import itertools
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast, overload

import numpy as np
import orjson

from gradserve.engine.backends import Backend, get_backend
from gradserve.engine.dtypes import ITEMSIZE
from gradserve.engine.graph.builder import Builder, Memo
from gradserve.engine.graph.executor import (
    ALIAS,
    BINARY,
    BINARY_INTO,
    LOOP,
    NARY,
    NULLARY,
    UNARY,
    UNARY_INTO,
    Bound,
    Run,
    _Loop,
    given_of,
    kernel_of,
)
from gradserve.engine.graph.ir import (
    BACKWARD,
    BYTE_COST,
    CAST,
    CONSTANT,
    DERIVED,
    NODE,
    RECOMPUTE,
    Lit,
    Program,
    Step,
)
from gradserve.engine.graph.scan import SCAN, Body
from gradserve.engine.ops import OPS
from gradserve.engine.ops.registry import Meta, OpDef, bind_attributes, literal_meta

FORMAT_VERSION = 4  # 4: a body's unrolled_nodes
MAGIC = b"GSPROG\r\n"
_PREFIX = struct.Struct("<8sIIQ")  # magic, version, CRC-32 and length of what follows
_U32 = struct.Struct("<I")
_KINDS = frozenset({NODE, CAST, CONSTANT, BACKWARD, DERIVED, RECOMPUTE})
# The kinds that run after the forward (engine.graph.executor.Bound).
_LATER = (BACKWARD, RECOMPUTE)
_INT64 = (-(2**63), 2**63 - 1)
# A column's dtype, by its struct format (little-endian), the narrowest first: a column takes
# the first that holds its values. A small program's columns are read as memoryviews of
# these formats (native: little-endian only, see SMALL).
_DTYPES = {f: np.dtype("<" + f) for f in "BbHhIiq"}
_ITEMSIZES = {f: d.itemsize for f, d in _DTYPES.items()}
# Every column but the costs holds counts or indices, unsigned (reused slots are stored + 1).
_UNSIGNED = frozenset("BHI")
# A large program of this many slots or more shares one int object per slot (_Flow.ints).
_SHARED_INTS = 1 << 15
# Programs of up to this many steps are checked in Python (see the module's docstring): the
# loads of the two ways cost the same at about 100 steps (callgrind, unrolled recurrences).
SMALL = 96 if sys.byteorder == "little" else -1
# By step code: whether its run tuple names the first slot it reads (a0), and the last (a1).
_READS_FIRST = frozenset({UNARY, BINARY, ALIAS, UNARY_INTO, BINARY_INTO})
_READS_LAST = frozenset({BINARY, UNARY_INTO, BINARY_INTO})

# A loop body's lists of slots (engine.graph.scan.Body).
_BODY_LISTS = ("carries", "xs", "closures", "nexts", "ys", "replayed")
# A program's columns, in the order they are written: per step, then flat, then per slot.
_COLUMNS = (
    "signature",
    "kind",
    "origin",
    "out",
    "reuse",
    "cost",
    "nfrees",
    "slots",
    "frees",
    "meta",
    "requires_grad",
    "grad_fn",
    "held",
)

# A column: a small program's as a list of ints, a large one's as an integer array.
Column = Any


class CorruptProgram(Exception):
    """The bytes are not a whole program of this format: truncated, damaged, of another
    format version, or naming what this build does not have."""


class Unstorable(Exception):
    """The program holds something the format cannot express (it is then not stored)."""


# ------------------------------------------------------------------ values


def _encode(value: Any) -> Any:
    """A value of an attribute or literal as JSON that keeps its exact type: a tuple,
    a dict, a non-finite float (by its bits) and an int past 64 bits are tagged objects
    (JSON objects are never values otherwise)."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if _INT64[0] <= value <= _INT64[1] else {"i": str(value)}
    if kind is float:
        return value if math.isfinite(value) else {"f": struct.pack("<d", value).hex()}
    if kind is list:
        return [_encode(v) for v in value]
    if kind is tuple:
        return {"t": [_encode(v) for v in value]}
    if kind is dict:
        return {"d": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise Unstorable(f"a value of type {kind.__name__} cannot be stored: {value!r:.60}")


def _decode(data: Any) -> Any:
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [_decode(v) for v in data]
    if kind is dict and len(data) == 1:
        ((tag, inner),) = data.items()
        if tag == "i" and type(inner) is str:
            return int(inner)
        if tag == "f" and type(inner) is str and len(inner) == 16:
            return struct.unpack("<d", bytes.fromhex(inner))[0]
        if tag == "t" and type(inner) is list:
            return tuple(_decode(v) for v in inner)
        if tag == "d" and type(inner) is list:
            return {_decode(k): _decode(v) for k, v in inner}
    raise CorruptProgram(f"not a stored value: {data!r:.60}")


def _literal_key(value: Any) -> tuple[type, Any]:
    """Literals are kept once per type and bit pattern (-0.0 is not 0.0, nor 0)."""
    return type(value), struct.pack("<d", value) if type(value) is float else value


# ------------------------------------------------------------------ dump


def dump_program(program: Program) -> bytes:
    """`program` (compiled and planned) as bytes; raises Unstorable if it holds something
    the format cannot express."""
    writer = _Writer()
    writer.program(program, None)
    name_lengths = writer.table([len(name) for name in writer.name_list])
    try:
        header = orjson.dumps(
            {
                "kinds": writer.kind_names,
                "names": "".join(writer.name_list),
                "name_lengths": name_lengths,
                "metas": writer.meta_list,
                "signatures": writer.signature_list,
                "programs": writer.records,
            }
        )
    except TypeError as exc:  # (a name or a value orjson refuses)
        raise Unstorable(str(exc)) from None
    columns = b"".join(writer.columns)
    head = _U32.pack(len(header)) + header
    rest = head + bytes(-len(head) % 8) + columns
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(rest), len(rest)) + rest


class _Writer:
    """The tables shared by a program and its loops' bodies, and the columns written."""

    def __init__(self) -> None:
        self.kind_names: list[str] = []
        self.kinds: dict[str, int] = {}
        self.name_list: list[str] = []  # (name i + 1: name 0 is None)
        self.names: dict[str | None, int] = {None: 0}
        self.meta_list: list[list[Any]] = []
        self.metas: dict[Meta, int] = {}
        self.literals: dict[int, Any] = {}  # id(Lit) -> its value as stored (Lits are shared)
        self.attrs: dict[int, Any] = {}  # id(dict) -> attributes as stored (and shared)
        self.signature_list: list[str] = []
        self.signatures: dict[tuple[Any, ...], int] = {}
        self.records: list[dict[str, Any]] = []
        self.columns: list[bytes] = []
        self.size = 0

    def table(self, *columns: Sequence[int], signed: int = -1) -> list[Any]:
        """Write `columns` one after another, each in the narrowest dtype that holds its
        values and 8-byte aligned: (their formats, where they start, their counts). Only
        column `signed` may hold a negative value or one past 32 bits (as load reads)."""
        offset, formats = self.size, ""
        for i, values in enumerate(columns):
            try:
                array = np.asarray(values, dtype=np.int64)
            except OverflowError:
                raise Unstorable("an integer past 64 bits in a column") from None
            lo, hi = (int(array.min()), int(array.max())) if len(array) else (0, 0)
            fmt = next(
                f for f, d in _DTYPES.items() if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max
            )
            if fmt not in _UNSIGNED and i != signed:
                raise Unstorable(f"a count or an index out of range: {lo}..{hi}")
            data = array.astype(_DTYPES[fmt]).tobytes()
            self.columns.append(data + bytes(-len(data) % 8))
            self.size += len(self.columns[-1])
            formats += fmt
        return [formats, offset, [len(values) for values in columns]]

    def meta(self, meta: Meta) -> int:
        index = self.metas.get(meta)
        if index is None:
            shape, dtype, literal = meta
            if (
                type(shape) is not tuple
                or any(type(d) is not int or d < 0 for d in shape)
                or dtype not in ITEMSIZE
                or type(literal) is not bool
            ):
                raise Unstorable(f"a meta of other types: {meta!r}")
            index = self.metas[meta] = len(self.meta_list)
            self.meta_list.append([list(shape), dtype, literal])
        return index

    def name(self, name: str | None) -> int:
        index = self.names.get(name)
        if index is None:
            if type(name) is not str:
                raise Unstorable(f"a name that is not a string: {name!r:.60}")
            self.name_list.append(name)
            index = self.names[name] = len(self.name_list)
        return index

    def literal(self, lit: Lit) -> Any:
        stored = self.literals.get(id(lit))
        if stored is None:
            value = lit.value
            if type(value) not in (bool, int, float):
                raise Unstorable(f"a literal of type {type(value).__name__}")
            stored = self.literals[id(lit)] = (_literal_key(value), _encode(value))
        return stored

    def attributes(self, attrs: dict[str, Any]) -> Any:
        stored = self.attrs.get(id(attrs))
        if stored is None:
            if type(attrs) is not dict or any(type(k) is not str for k in attrs):
                raise Unstorable(f"attributes that are not a dict by name: {attrs!r:.60}")
            encoded = {k: _encode(v) for k, v in attrs.items()}
            stored = self.attrs[id(attrs)] = (orjson.dumps(encoded), encoded)
        return stored

    def kind(self, kind: str) -> int:
        index = self.kinds.get(kind)
        if index is None:
            if kind not in _KINDS:
                raise Unstorable(f"a step of kind {kind!r}")
            index = self.kinds[kind] = len(self.kind_names)
            self.kind_names.append(kind)
        return index

    def signature(
        self, step: Step, ufunc: bool, into: bool, slot_metas: list[int], slots: list[int]
    ) -> int:
        """The index of `step`'s signature: JSON text of its op, attributes (None for a
        loop's step, which has its body instead), how it runs, and per argument the meta of
        the slot it reads or the literal; the slots it reads go on `slots`."""
        op = step.op
        attrs = None if op is SCAN else self.attributes(step.attrs)
        key: list[Any] = [op, attrs and attrs[0], ufunc, into]
        for a in step.args:
            if type(a) is int:
                slots.append(a)
                key.append(slot_metas[a])
            else:
                key.append(self.literal(a)[0])  # type: ignore[arg-type]
        index = self.signatures.get(signature := tuple(key))
        if index is None:
            if op is not SCAN and OPS.get(op.name) is not op:
                raise Unstorable(f"op {op.name!r} is not the registry's")
            index = self.signatures[signature] = len(self.signature_list)
            self.signature_list.append(
                orjson.dumps(
                    [
                        op.name,
                        attrs and attrs[1],
                        ufunc,
                        into,
                        [
                            self.meta_list[slot_metas[a]] if type(a) is int else self.literal(a)[1]  # type: ignore[arg-type]
                            for a in step.args
                        ],
                    ]
                ).decode()
            )
        return index

    def program(self, program: Program, body: Body | None, replay: int = -1) -> int:
        """Write `program` (and the bodies of its loops after it); its record's index.
        `replay`: a checkpointed reverse loop's body's, the place of the loop it replays."""
        index = len(self.records)
        record: dict[str, Any] = {}
        self.records.append(record)
        steps = program.steps
        n = len(steps)
        if not (
            len(program.frees)
            == len(program.reuse)
            == len(program.ufunc)
            == len(program.step_costs)
            == n
        ):
            raise Unstorable("the program is not planned")
        if any(
            type(v) is not bool
            for v in (*program.ufunc, *program.requires_grad, program.no_grad, program.backward)
        ):
            raise Unstorable("a flag that is not a bool")
        slot_metas = [self.meta(m) for m in program.metas]
        signatures: list[int] = []
        kinds: list[int] = []
        origins: list[int] = []
        outs: list[int] = []
        slots: list[int] = []
        loops: list[list[Any]] = []
        ufunc, reuse = program.ufunc, program.reuse
        for i, step in enumerate(steps):
            if step.op is SCAN:
                loops.append([i, -1, list(step.more)])  # (the body's record comes after)
            elif step.more:
                raise Unstorable("a step that is not a loop writes several slots")
            signatures.append(self.signature(step, ufunc[i], reuse[i] >= 0, slot_metas, slots))
            kinds.append(self.kind(step.kind))
            origins.append(self.name(step.origin))
            outs.append(step.out)
        frees = program.frees
        record["columns"] = self.table(
            signatures,
            kinds,
            origins,
            outs,
            [r + 1 for r in reuse],
            program.step_costs,
            [len(f) for f in frees],
            slots,
            list(itertools.chain(*frees)),
            slot_metas,
            program.requires_grad,
            [self.name(g) for g in program.grad_fn],
            sorted(program.held),
            signed=_COLUMNS.index("cost"),
        )
        if type(program.plan_ms) is not float:
            raise Unstorable("plan_ms is not a float")
        if program.cost_by_node != _cost_by_node([s.origin for s in steps], program.step_costs):
            raise Unstorable("cost_by_node is not the steps' costs by origin")
        record.update(
            inputs=_pairs(program.inputs.items()),
            grad_inputs=_pairs(program.grad_inputs.items()),
            outputs=_pairs(program.outputs),
            gradients=_pairs(program.gradients),
            no_grad=program.no_grad,
            backward=program.backward,
            nodes=_encode(program.nodes),
            planned_peak_bytes=_encode(program.planned_peak_bytes),
            flops=_encode(program.flops),
            bytes_moved=_encode(program.bytes_moved),
            recompute_cost=_encode(program.recompute_cost),
            peak_without_recompute=_encode(program.peak_without_recompute),
            plan_ms=program.plan_ms,
            vmap_chunks=program.vmap_chunks,
            vmap_budgeted=program.vmap_budgeted,
            index_ordered=program.index_ordered,
        )
        if body is not None:
            record["body"] = {
                "carries": body.carries,
                "xs": body.xs,
                "closures": body.closures,
                "nexts": body.nexts,
                "ys": body.ys,
                "length": body.length,
                "reverse": body.reverse,
                "wanted": body.wanted,
                "shifted": [list(pair) for pair in body.shifted],
                "every": body.every,
                "replayed": body.replayed,
                "unrolled_nodes": body.unrolled_nodes,
                "replay": replay,
            }
        for loop in loops:
            inner: Body = steps[loop[0]].attrs["body"]
            if inner.program is None:
                raise Unstorable("a loop whose body is not planned")
            # (a checkpointed reverse loop names the loop it replays by its step's place)
            at = (
                -1
                if inner.replay is None
                else next((i for i, _, _ in loops if steps[i].attrs["body"] is inner.replay), None)
            )
            if at is None:
                raise Unstorable("a loop that replays a loop of another program")
            loop[1] = self.program(inner.program, inner, at)
        record["loops"] = loops
        return index


def _pairs(pairs: Iterable[tuple[str, int]]) -> list[list[Any]]:
    out = [[name, slot] for name, slot in pairs]
    if any(type(name) is not str or type(slot) is not int for name, slot in out):
        raise Unstorable("a name or a slot of another type")
    return out


def _cost_by_node(origins: Sequence[str | None], costs: Sequence[int]) -> dict[str, int]:
    """The planner's cost by the node each step serves (engine.graph.plan._price)."""
    by_node: dict[str, int] = {}
    for origin, cost in zip(origins, costs, strict=True):
        key = origin or "<graph>"
        by_node[key] = by_node.get(key, 0) + cost
    return by_node


# ------------------------------------------------------------------ load


def load_program(data: bytes | memoryview, device: str = "cpu") -> Program:
    """The program `data` holds, bound for `device`; raises CorruptProgram for anything
    that is not a whole program of this format. It keeps no reference to `data` (a view of
    shared memory may be reused once it returns)."""
    backend = get_backend(device)
    raw = bytes(data)  # (no copy of bytes; a view is copied before it is checked)
    try:
        with _NoCycles():
            return _Reader(raw, backend).load()
    except CorruptProgram:
        raise
    except Exception as exc:  # whatever the damage, the caller gets one kind of error
        raise CorruptProgram(f"not a valid program: {type(exc).__name__}: {exc}") from exc


def _check(ok: Any, what: str) -> None:
    if not ok:
        raise CorruptProgram(what)


def _typed(value: Any, kind: type, what: str) -> Any:
    _check(type(value) is kind, f"{what} is not a {kind.__name__}")
    return value


def _within(values: Column, hi: int, what: str) -> None:
    """Every value (unsigned) below `hi`."""
    if len(values) and (max(values) if isinstance(values, list) else int(values.max())) >= hi:
        raise CorruptProgram(f"{what} out of range")


def _total(values: Column) -> int:
    return sum(values) if isinstance(values, list) else int(values.sum(dtype=np.int64))


def _ints(values: Column) -> list[int]:
    return values if isinstance(values, list) else values.tolist()  # type: ignore[no-any-return]


def _meta(data: Any) -> Meta:
    if type(data) is not list or len(data) != 3:
        raise CorruptProgram("a meta is not [shape, dtype, literal]")
    shape, dtype, literal = data
    if type(shape) is not list or dtype not in ITEMSIZE or type(literal) is not bool:
        raise CorruptProgram("a meta")
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptProgram("a meta's shape")
    return Meta(tuple(shape), dtype, literal)


def _slots(value: Any, count: int, what: str) -> list[int]:
    """`value`, checked: a list of slots (below `count`)."""
    if type(value) is not list:
        raise CorruptProgram(f"{what} is not a list")
    for s in value:
        if type(s) is not int or not 0 <= s < count:
            raise CorruptProgram(f"{what}: not a slot")
    return value


def _literal(data: Any) -> Lit:
    value = _decode(data)
    _check(type(value) in (bool, int, float), "a literal that is not a number")
    return Lit(value)


class _Signature:
    """A step signature's JSON text, decoded and checked: its op, attributes, how it runs,
    its arguments (per slot it reads, None; a literal otherwise) and the metas of the slots
    it reads; attributes its op takes; its result's meta (None: a loop's, whose body is
    checked against its step instead); the run tuple's code; its kernels by how they are
    bound (backend, ufunc), as `executor.kernel_of` made them. Shared by every program
    loaded with that text (see _SIGNATURES)."""

    __slots__ = (
        "attrs",
        "code",
        "into",
        "kernels",
        "metas",
        "nslots",
        "op",
        "out",
        "template",
        "ufunc",
    )

    def __init__(self, text: str) -> None:
        data = orjson.loads(text)
        _check(type(data) is list and len(data) == 5, "a signature")
        name, attrs, ufunc, into, args = data
        found = SCAN if name == SCAN.name else OPS.get(name) if type(name) is str else None
        _check(
            found is not None and type(ufunc) is bool and type(into) is bool and type(args) is list,
            "a signature",
        )
        self.op = op = cast(OpDef, found)
        self.ufunc, self.into = ufunc, into
        self.metas = [_meta(a) for a in args if type(a) is list]
        self.template = [None if type(a) is list else _literal(a) for a in args]
        self.nslots = k = len(self.metas)
        self.kernels: dict[tuple[Backend, bool], Any] = {}
        self.out: Meta | None = None
        if op is SCAN:
            _check(attrs is None and k == len(args) and not into, "a loop's signature")
            self.attrs: dict[str, Any] = {}  # (a loop's step has its body instead)
            self.code = LOOP
            return
        _check(type(attrs) is dict, "a signature's attributes")
        _check(k or not (into or op.returns_input), "a step that reads nothing")
        self.attrs = {key: _decode(value) for key, value in attrs.items()}
        bind_attributes(op.name, op.attrs, op.defaults, self.attrs)
        if op.returns_input:
            self.code, self.out = ALIAS, self.metas[0]
            return
        self.code = (
            (UNARY_INTO if k == 1 else BINARY_INTO)
            if into
            else (NULLARY, UNARY, BINARY, NARY)[min(k, 3)]
        )
        metas = iter(self.metas)
        self.out = op.infer(
            [next(metas) if t is None else literal_meta(t.value) for t in self.template],
            **self.attrs,
        )

    def args(self, slots: list[int]) -> tuple[Any, ...]:
        """A step's arguments, from the slots it reads."""
        if len(slots) == len(self.template):
            return tuple(slots)
        it = iter(slots)
        return tuple(next(it) if t is None else t for t in self.template)


# Signatures by their text, checked: loads of programs that share signatures decode and
# check each once, and bind its kernel once.
_SIGNATURES = Memo(1 << 12)


def _signature(text: Any) -> _Signature:
    known = _SIGNATURES.get(text) if type(text) is str else None
    if known is None:
        _check(type(text) is str, "a signature is not a string")
        known = _SIGNATURES.remember(text, _Signature(text))
    return cast(_Signature, known)


class _Signatures:
    """A program's signatures as arrays (metas as indices of its table), to gather from by
    step: the checks of large programs."""

    def __init__(self, signatures: list[_Signature], meta_index: dict[Meta, int]) -> None:
        metas = [[meta_index[m] for m in s.metas] for s in signatures]
        self.nslots = np.array([s.nslots for s in signatures], np.intp)
        self.start = np.cumsum(self.nslots) - self.nslots  # (of its metas in `metas`)
        self.metas = np.array([m for ms in metas for m in ms] or [0], np.int32)
        # (the metas of the first and last slot read; -1: none, as the reads of a step
        # that reads nothing are the placeholder slot, of meta -1: see _Flow.of_arrays)
        self.first_meta = np.array([ms[0] if ms else -1 for ms in metas], np.int32)
        self.last_meta = np.array([ms[-1] if ms else -1 for ms in metas], np.int32)
        self.out = np.array(
            [-1 if s.out is None else meta_index[s.out] for s in signatures], np.int32
        )
        self.into = np.array([s.into for s in signatures], bool)
        self.code = np.array([s.code for s in signatures], np.intp)
        self.first = np.array([s.code in _READS_FIRST for s in signatures], bool)
        self.last = np.array([s.code in _READS_LAST for s in signatures], bool)
        self.rest = np.array([s.code in (NARY, UNARY_INTO, BINARY_INTO) for s in signatures], bool)
        self.loop = np.array([s.code == LOOP for s in signatures], bool)
        self.loops, self.intos = bool(self.loop.any()), bool(self.into.any())


class _Names:
    """The names table (origins, grad_fn), kept as one string and split when first read."""

    def __init__(self, text: str, lengths: Column) -> None:
        self.text, self.lengths = text, lengths
        self.count = 1 + len(lengths)
        self._list: list[str | None] | None = None

    def list(self) -> list[str | None]:
        if self._list is None:
            text, lengths = self.text, _ints(self.lengths)
            self._list = [
                None,
                *(
                    text[end - k : end]
                    for k, end in zip(lengths, itertools.accumulate(lengths), strict=True)
                ),
            ]
        return self._list

    def get(self, index: int) -> str | None:
        """Name `index`, without splitting them all."""
        if not index:
            return None
        if self._list is not None:
            return self._list[index]
        end = _total(self.lengths[:index])
        return self.text[end - int(self.lengths[index - 1]) : end]


class _Reader:
    """One stored program's bytes, checked, and the tables they share."""

    def __init__(self, raw: bytes, backend: Backend) -> None:
        if len(raw) < _PREFIX.size:
            raise CorruptProgram(f"truncated: {len(raw)} bytes")
        magic, version, crc, length = _PREFIX.unpack_from(raw)
        _check(magic == MAGIC, "not a stored program")
        if version != FORMAT_VERSION:
            raise CorruptProgram(f"format version {version}; this build reads {FORMAT_VERSION}")
        if len(raw) - _PREFIX.size != length:
            raise CorruptProgram(
                f"truncated or extended: {len(raw) - _PREFIX.size} bytes after "
                f"the prefix, not {length}"
            )
        self.view = memoryview(raw)
        _check(zlib.crc32(self.view[_PREFIX.size :]) == crc, "the checksum does not match")
        _check(length >= _U32.size, "truncated header")
        (size,) = _U32.unpack_from(raw, _PREFIX.size)
        _check(_U32.size + size <= length, "the header runs past the end")
        start = _PREFIX.size + _U32.size
        header = orjson.loads(self.view[start : start + size])
        _check(type(header) is dict, "the header is not a dict")
        self.raw, self.backend = raw, backend
        self.base = start + size + (-(_U32.size + size) % 8)
        self.kinds = kinds = header["kinds"]
        _check(type(kinds) is list and set(kinds) <= _KINDS, "an unknown step kind")
        (lengths,) = self.columns(header["name_lengths"], ("name_lengths",))
        text = header["names"]
        _check(type(text) is str and _total(lengths) == len(text), "the names' lengths")
        self.names = _Names(text, lengths)
        metas = header["metas"]
        _check(type(metas) is list, "metas")
        self.metas = [_meta(m) for m in metas]
        self.meta_index = {m: i for i, m in enumerate(self.metas)}
        _check(len(self.meta_index) == len(self.metas), "a meta twice")
        signatures = header["signatures"]
        _check(type(signatures) is list, "signatures")
        self.signatures = [_signature(signature) for signature in signatures]
        self.loops = any(g.code == LOOP for g in self.signatures)
        self._arrays: _Signatures | None = None
        self.records = records = header["programs"]
        _check(
            type(records) is list and records and all(type(r) is dict for r in records), "programs"
        )
        self.claimed = {0}
        self.used: set[int] = set()  # the signatures some step has

    def arrays(self) -> _Signatures:
        if self._arrays is None:
            self._arrays = _Signatures(self.signatures, self.meta_index)
        return self._arrays

    def columns(self, spec: Any, names: tuple[str, ...], signed: int = -1) -> list[Column]:
        """The columns of a table (their formats, where the first starts, their counts: see
        _Writer.table), each within the bytes: lists if the first has at most SMALL
        values, else arrays. Only column `signed` may be of a signed dtype."""
        _check(type(spec) is list and len(spec) == 3, "a table of columns")
        formats, offset, counts = spec
        _check(
            type(formats) is str
            and len(formats) == len(names)
            and type(offset) is int
            and offset >= 0
            and type(counts) is list
            and len(counts) == len(names)
            and _UNSIGNED.issuperset(
                formats[:signed] + formats[signed + 1 :] if signed >= 0 else formats
            ),
            "a table of columns",
        )
        raw, base = self.raw, self.base
        starts = []
        at = end = base + offset
        for fmt, count in zip(formats, counts, strict=True):
            size = _ITEMSIZES.get(fmt)
            if size is None or type(count) is not int or count < 0:
                raise CorruptProgram("a column")
            at = end + (base - end) % 8
            starts.append(at)
            end = at + count * size
        _check(end <= len(raw), "a column runs past the end")
        if counts[0] > SMALL:
            return [
                np.frombuffer(raw, _DTYPES[fmt], count, start)
                for fmt, count, start in zip(formats, counts, starts, strict=True)
            ]
        first = starts[0]
        values = list(raw[first:end])  # (a small program's bytes: most of its columns)
        view = self.view
        return [
            values[start - first : start - first + count]
            if fmt == "B"
            else view[start : start + count * _ITEMSIZES[fmt]].cast(fmt).tolist()
            for fmt, count, start in zip(formats, counts, starts, strict=True)
        ]

    def load(self) -> Program:
        program, runs = self.program(0, None)
        _check(len(self.claimed) == len(self.records), "a body no loop runs")
        _check(len(self.used) == len(self.signatures), "a signature no step has")
        forward, backward = runs
        program.run = Bound(self.backend, forward, backward, given_of(program))
        return program

    def program(self, index: int, body: dict[str, Any] | None) -> tuple[_Loaded, list[list[Run]]]:
        """Program `index` (and the bodies of its loops), checked, and its run tuples: the
        top program's forward and backward (its run), a body's all in one."""
        record = self.records[index]
        _check((body is None) == ("body" not in record), "a body where none belongs")
        (
            sig,
            kind,
            origin,
            out,
            reuse,
            cost,
            nfrees,
            slots,
            frees,
            meta,
            requires_grad,
            grad_fn,
            held,
        ) = self.columns(record["columns"], _COLUMNS, _COLUMNS.index("cost"))
        small = type(sig) is list
        n, nslots = len(sig), len(meta)
        # (requires_grad and grad_fn cover the slots there were before the backward, and
        # a body has neither)
        _check(
            len(kind) == len(origin) == len(out) == len(reuse) == len(cost) == len(nfrees) == n
            and len(requires_grad) == len(grad_fn) <= nslots
            and _total(nfrees) == len(frees),
            "the columns' lengths",
        )
        signatures = self.signatures
        if small:  # (its lists bound the indices the load reads: see _Flow)
            _check(not n or max(kind) < len(self.kinds), "a kind out of range")
            _check(
                not origin + grad_fn or max(origin + grad_fn) < self.names.count,
                "a name out of range",
            )
            _check(not requires_grad or max(requires_grad) < 2, "a requires_grad flag")
        else:
            _within(kind, len(self.kinds), "a kind")
            _within(origin, self.names.count, "an origin")
            _within(grad_fn, self.names.count, "a grad_fn")
            _within(requires_grad, 2, "a requires_grad flag")
            _within(sig, len(signatures), "a signature")
            _within(meta, len(self.metas), "a meta")
            for name, column in (
                ("out", out),
                ("slots", slots),
                ("frees", frees),
                ("held", held),
                ("reuse", reuse),
            ):
                _within(column, nslots + (name == "reuse"), f"a slot of {name!r}")

        inputs = self._pairs(record["inputs"], nslots)
        grad_inputs = self._pairs(record["grad_inputs"], nslots)
        outputs = self._pairs(record["outputs"], nslots)
        gradients = self._pairs(record["gradients"], nslots)
        given = [s for _, s in (*inputs, *grad_inputs)]
        kept = [*given, *_ints(held), *(s for _, s in (*outputs, *gradients))]
        # The loops: each scan step's body is a record of its own, after this one.
        loops = record["loops"]
        _check(type(loops) is list, "the loops")
        for loop in loops:
            _check(
                type(loop) is list
                and len(loop) == 3
                and type(loop[0]) is int
                and type(loop[1]) is int,
                "a loop",
            )
            _slots(loop[2], nslots, "a loop's results")
        if not self.loops:
            scans = []
        elif small:
            scans = [i for i, s in enumerate(sig) if signatures[s].code == LOOP]
        else:
            scans = np.flatnonzero(self.arrays().loop.take(sig)).tolist()
        _check([loop[0] for loop in loops] == scans, "the loops")
        more = {i: results for i, _, results in loops if results}
        # (a loop writes only the results its body is planned for: the others are never
        # written, and so never read)
        unwanted: dict[int, list[int]] = {}
        for i, inner, results in loops:
            _check(index < inner < len(self.records), "a loop's body")
            wanted = self.records[inner].get("body", {}).get("wanted")
            _check(
                type(wanted) is list
                and len(wanted) == 1 + len(results)
                and all(type(w) is bool for w in wanted),
                "a body's wanted",
            )
            unwanted[i] = [
                w for w, want in zip((int(out[i]), *results), wanted, strict=True) if not want
            ]
        metas = self.metas
        if small:
            slot_metas = [metas[m] for m in meta]
            flow = _Flow(
                signatures,
                n,
                nslots,
                sig,
                out,
                reuse,
                nfrees,
                slots,
                frees,
                meta,
                slot_metas,
                given,
                kept,
                more,
                unwanted,
            )
        else:
            flow = _Flow.of_arrays(
                self.arrays(),
                n,
                nslots,
                sig,
                out,
                reuse,
                nfrees,
                slots,
                frees,
                meta,
                given,
                kept,
                more,
                unwanted,
            )
            slot_metas = _objects(metas).take(meta).tolist()
        self.used.update(flow.rep)
        no_grad, backward, plan_ms = record["no_grad"], record["backward"], record["plan_ms"]
        chunks, budgeted = record.get("vmap_chunks", {}), record.get("vmap_budgeted", False)
        ordered = record.get("index_ordered", False)
        _check(
            type(chunks) is dict
            and all(type(k) is str and type(v) is int and v > 0 for k, v in chunks.items())
            and type(budgeted) is bool
            and type(ordered) is bool,
            "a program's vmap chunks",
        )
        nodes, peak, flops, moved, recomputed, unrecomputed = (
            _decode(record[key])
            for key in (
                "nodes",
                "planned_peak_bytes",
                "flops",
                "bytes_moved",
                "recompute_cost",
                "peak_without_recompute",
            )
        )
        _check(
            type(no_grad) is bool
            and type(backward) is bool
            and type(plan_ms) is float
            and all(type(v) is int for v in (nodes, peak, flops, moved, recomputed, unrecomputed)),
            "a program's scalars",
        )
        _check(_total(cost) == flops + BYTE_COST * moved, "the steps' costs are not the program's")
        # (The recompute steps' costs, plus what checkpointed loops replay, within their
        # steps' costs: the total's.)
        _check(
            self.recomputed(kind, cost) <= recomputed <= _total(cost),
            "the recompute steps' costs are not the program's",
        )
        p = _Loaded.__new__(_Loaded)
        p.__dict__.update(
            metas=slot_metas,
            inputs=dict(inputs),
            grad_inputs=dict(grad_inputs),
            outputs=outputs,
            gradients=gradients,
            no_grad=no_grad,
            backward=backward,
            held=set(_ints(held)),
            frees=flow.frees,
            nodes=nodes,
            planned_peak_bytes=peak,
            flops=flops,
            bytes_moved=moved,
            recompute_cost=recomputed,
            peak_without_recompute=unrecomputed,
            plan_ms=plan_ms,
            vmap_chunks=chunks,
            vmap_budgeted=budgeted,
            index_ordered=ordered,
            run=None,
        )
        if len(grad_fn):
            _check(all(slot < len(grad_fn) for _, slot in p.outputs), "an output's flags")
        names = self.names
        p._lazy = {
            "requires_grad": lambda: list(map(bool, _ints(requires_grad))),
            "grad_fn": lambda: list(map(names.list().__getitem__, _ints(grad_fn))),
            "reuse": lambda: [r - 1 for r in _ints(reuse)],
            "step_costs": lambda: _ints(cost),
            "ufunc": lambda: [signatures[s].ufunc for s in _ints(sig)],
            "cost_by_node": lambda: _cost_by_node(
                list(map(names.list().__getitem__, _ints(origin))), _ints(cost)
            ),
        }

        bodies: dict[int, tuple[dict[str, Any], tuple[int, ...]]] = {}
        body_runs: dict[int, list[Run]] = {}
        replays: dict[int, int] = {}  # a checkpointed reverse loop's place -> its replay's
        for i, inner, results in loops:
            _check(index < inner < len(self.records) and inner not in self.claimed, "a loop's body")
            self.claimed.add(inner)
            spec = _typed(self.records[inner].get("body"), dict, "a body")
            at = spec.get("replay")
            _check(type(at) is int and (at == -1 or at in bodies), "a loop's replay")
            if at >= 0:
                replays[i] = at
            loop, (body_runs[i],) = self.program(inner, spec)
            start = int(flow.starts[i])
            reads = _ints(slots[start : start + signatures[int(sig[i])].nslots])
            bodies[i] = (
                {
                    "body": self._body(
                        spec,
                        loop,
                        [slot_metas[a] for a in reads],
                        [slot_metas[o] for o in (int(out[i]), *results)],
                        bodies[at][0]["body"] if at >= 0 else None,
                    )
                },
                tuple(results),
            )
        p.steps = cast(
            list[Step],
            _Steps(
                _StepColumns(  # (a Sequence: see _Steps)
                    self, sig, kind, origin, out, slots, flow.starts, bodies
                )
            ),
        )
        return p, self.bind(
            p, sig, out, reuse, slots, kind if body is None else None, flow, body_runs, replays
        )

    def recomputed(self, kind: Column, cost: Column) -> int:
        """The cost of the steps of kind RECOMPUTE (a program's recompute_cost adds its
        checkpointed loops' replays)."""
        if RECOMPUTE not in self.kinds:
            return 0
        code = self.kinds.index(RECOMPUTE)
        if isinstance(kind, list):
            return sum(c for k, c in zip(kind, cost, strict=True) if k == code)
        return int(cost[kind == code].sum(dtype=np.int64))

    @staticmethod
    def _pairs(data: Any, nslots: int) -> list[tuple[str, int]]:
        """`data`, checked: a list of [name, slot] pairs."""
        _check(type(data) is list, "names and slots")
        pairs = []
        for pair in data:
            if type(pair) is not list or len(pair) != 2:
                raise CorruptProgram("names and slots")
            name, slot = pair
            if type(name) is not str or type(slot) is not int or not 0 <= slot < nslots:
                raise CorruptProgram("names and slots")
            pairs.append((name, slot))
        return pairs

    def _body(
        self,
        spec: dict[str, Any],
        program: _Loaded,
        args: list[Meta],
        outs: list[Meta],
        replay: Body | None,
    ) -> Body:
        """A loop's Body around its planned `program`, checked against its scan step (the
        metas of its arguments and results) and, a checkpointed reverse loop's, against the
        loop it replays (`replay`): what the loop allocates is what they say."""
        metas = program.metas
        carries, xs, closures, nexts, ys, replayed = [
            _slots(spec[key], len(metas), key) for key in _BODY_LISTS
        ]
        length, wanted, every = spec["length"], spec["wanted"], spec["every"]
        # (wanted: checked with the loop)
        _check(
            type(length) is int
            and length >= 0
            and type(every) is int
            and 0 <= every <= length
            and (every > 0 or not replayed),
            "a body's length",
        )
        pairs = _typed(spec["shifted"], list, "a body's shifted")
        for pair in pairs:
            _check(
                type(pair) is list
                and len(pair) == 2
                and type(pair[0]) is int
                and type(pair[1]) is int
                and 0 <= pair[0] < len(xs)
                and 0 <= pair[1] < len(closures)
                and metas[xs[pair[0]]] == metas[closures[pair[1]]],
                "a body's shifted",
            )
        b = Builder()
        b.metas = metas
        body = Body(
            b=b,
            steps=program.steps,
            carries=carries,
            xs=xs,
            closures=closures,
            nexts=nexts,
            ys=ys,
            length=length,
            reverse=_typed(spec["reverse"], bool, "a body's reverse"),
            unrolled_nodes=_typed(spec["unrolled_nodes"], int, "a body's unrolled nodes"),
            shifted=[(i, j) for i, j in pairs],
            every=every,
            replayed=replayed,
            replay=replay,
            wanted=wanted,
            program=program,
        )

        def stacked(meta: Meta, rows: int) -> Meta:
            return Meta((rows, *meta.shape), meta.dtype)

        want_args = [
            *(metas[s] for s in carries),
            *(stacked(metas[s], length) for s in xs),
            *(metas[s] for s in closures),
        ]
        want_outs = [*(metas[s] for s in carries), *(stacked(metas[s], length) for s in ys)]
        if every:
            want_outs += [stacked(metas[s], body.segments) for s in carries]
            want_outs += [stacked(metas[s], body.every) for s in body.buffered()]
        if replay is not None:
            # (the loop it replays is a checkpointed forward loop over the same steps, the
            # other way, whose replayed values this body's program is given, of its metas)
            forward = cast(_Loaded, replay.program).metas
            _check(
                replay.every > 0
                and replay.length == length
                and replay.reverse != body.reverse
                and not pairs
                and all(r < len(metas) and metas[r] == forward[r] for r in replay.replayed),
                "a loop's replay",
            )
            want_args += [stacked(forward[s], replay.segments) for s in replay.carries]
            want_args += [stacked(forward[s], replay.every) for s in replay.buffered()]
            want_args += [stacked(forward[s], length) for s in replay.xs]
            want_args += [forward[s] for s in replay.closures]
        _check(
            len(nexts) == len(carries)
            and len(wanted) == len(outs)
            and [metas[s] for s in nexts] == want_args[: len(carries)]
            and args == want_args
            and outs == want_outs,
            "a loop's body does not fit its step",
        )
        # (the loop gives the body's program its carries, slices, closures and replayed
        # values, and reads back its next carries, the results it stacks and the values it
        # replays: exactly its inputs and outputs)
        nc = len(carries)
        _check(
            list(program.inputs.values()) == body.inputs
            and not program.grad_inputs
            and [s for _, s in program.outputs]
            == [*nexts, *(y for y, want in zip(ys, wanted[nc:], strict=False) if want), *replayed],
            "a loop's body does not fit its program",
        )
        return body

    def bind(
        self,
        p: _Loaded,
        sig: Column,
        out: Column,
        reuse: Column,
        slots: Column,
        kind: Column | None,
        flow: _Flow,
        body_runs: dict[int, list[Run]],
        replays: dict[int, int],
    ) -> list[list[Run]]:
        """A program's run tuples, with the decisions `executor._run` makes (and its loops'
        bodies' runs, as `executor._bind` makes them, a checkpointed reverse loop's with
        its replay's), its kernels one per signature: forward and backward by `kind` (the
        top program's), else all in one."""

        def loop(i: int) -> _Loop:
            return _Loop(
                p.steps[i], backend, body_runs[i], body_runs[replays[i]] if i in replays else None
            )

        backend, signatures = self.backend, self.signatures
        ufuncs = backend.ufuncs is not None
        columns = cast(_Steps, p.steps).columns
        fns: list[Any] = [None] * len(signatures)  # (None: a step that runs without one)
        for s, i in flow.rep.items():
            g = signatures[s]
            if g.code not in (ALIAS, LOOP):
                how = (backend, g.ufunc and ufuncs)
                fn = g.kernels.get(how)
                if fn is None:
                    fn = g.kernels[how] = kernel_of(columns.step(i), p, *how, g.into)
                fns[s] = fn
        later = [self.kinds.index(k) for k in _LATER if k in self.kinds]
        frees, starts, n = flow.frees, flow.starts, len(sig)
        if type(sig) is list:
            runs: list[Run] = []
            first, last = flow.first, flow.last
            for i, s in enumerate(sig):
                g = signatures[s]
                code = g.code
                if code == LOOP:
                    runs.append((LOOP, None, out[i], 0, 0, loop(i), frees[i]))
                    continue
                runs.append(
                    (
                        code,
                        fns[s],
                        out[i],
                        first[i] if code in _READS_FIRST else 0,
                        last[i] if code in _READS_LAST else 0,
                        reuse[i] - 1
                        if code >= UNARY_INTO
                        else tuple(slots[starts[i] : starts[i] + g.nslots])
                        if code == NARY
                        else None,
                        frees[i],
                    )
                )
            if kind is None:
                return [runs]
            split = next((i for i, k in enumerate(kind) if k in later), n)
            return [runs[:split], runs[split:]]
        arrays = self.arrays()
        sig = flow.sig
        codes: list[int] = arrays.code.take(sig).tolist()  # type: ignore[assignment]
        rest: list[Any] = [None] * n
        for i in np.flatnonzero(arrays.rest.take(sig)).tolist():
            rest[i] = (
                int(reuse[i]) - 1
                if codes[i] >= UNARY_INTO
                else tuple(slots[starts[i] : starts[i] + signatures[int(sig[i])].nslots].tolist())
            )
        split = n  # (the first step of the backward)
        if kind is not None and later:
            at = np.flatnonzero(np.isin(kind, later))
            split = int(at[0]) if len(at) else n
        ints = flow.ints
        tuples = zip(
            codes,
            _objects(fns).take(sig).tolist(),
            ints(out),
            ints(np.where(arrays.first.take(sig), flow.first, 0)),
            ints(np.where(arrays.last.take(sig), flow.last, 0)),
            rest,
            frees,
            strict=True,
        )
        parts = [list(itertools.islice(tuples, split)), list(tuples)]
        for i in np.flatnonzero(arrays.loop.take(sig)).tolist() if arrays.loops else ():
            part = int(i >= split)
            parts[part][i - split * part] = (LOOP, None, int(out[i]), 0, 0, loop(i), frees[i])
        return parts if kind is not None else parts[:1]


_BAD_READ = "a slot read before it is written, after it is freed, or not of its signature's meta"


class _Flow:
    """A program's data flow, from its columns, checked: each slot is written once (by a
    step, or given), read after it is written and not after it is freed, freed at most once
    and never if it is kept (given, a result, held); each step reads slots of its
    signature's metas and writes its result's; a step writes into a buffer only where its
    signature says, and then into its first or last argument's, freed there, of the result's
    meta. Per step: the tuple of slots it frees, where its slots start in the flat column,
    the first and last slot it reads; per signature used, a step that has it (`rep`).

    `_Flow(...)` checks a small program's lists step by step, `_Flow.of_arrays` a large
    one's arrays a column at a time: the same checks."""

    frees: list[tuple[int, ...]]
    starts: Column
    first: Column
    last: Column
    rep: dict[int, int]
    sig: np.ndarray  # (a large program's signatures, as indices)
    pool: np.ndarray | None  # (and one int object per slot, to share: see ints)

    def __init__(
        self,
        signatures: list[_Signature],
        n: int,
        nslots: int,
        sig: list[int],
        out: list[int],
        reuse: list[int],
        nfrees: list[int],
        slots: list[int],
        frees: list[int],
        meta: list[int],
        metas: list[Meta],
        given: list[int],
        kept: list[int],
        more: dict[int, list[int]],
        unwanted: dict[int, list[int]],
    ) -> None:
        # (an index past the end of a list it indexes is an IndexError: a CorruptProgram)
        made = [n] * nslots  # the step that writes each slot (-1: given; n: none)
        freed = [n] * nslots  # the step after which it goes (n: never)
        for s in given:
            made[s] = -1
        empty: tuple[int, ...] = ()
        self.frees = step_frees = [empty] * n
        self.starts = starts = [0] * n
        self.first = first = [0] * n
        self.last = last = [0] * n
        at = taken = 0
        for i, s in enumerate(sig):
            g = signatures[s]
            starts[i] = at
            if g.nslots:
                a = first[i] = slots[at]
                if made[a] >= i or freed[a] != n or metas[a] != g.metas[0]:
                    raise CorruptProgram(_BAD_READ)
                for j in range(1, g.nslots):
                    a = slots[at + j]
                    if made[a] >= i or freed[a] != n or metas[a] != g.metas[j]:
                        raise CorruptProgram(_BAD_READ)
                last[i] = a
                at += g.nslots
            o = out[i]
            if made[o] != n:
                raise CorruptProgram("a slot written twice")
            made[o] = i
            if metas[o] != g.out and g.code != LOOP:
                raise CorruptProgram("a step's result meta")
            if more and i in more:
                for w in more[i]:
                    if made[w] != n:
                        raise CorruptProgram("a slot written twice")
                    made[w] = i
            if unwanted and i in unwanted:
                for w in unwanted[i]:
                    made[w] = n + 1  # (never written: never read, nor written again)
            count = nfrees[i]
            if count:
                gone = frees[taken : taken + count]
                taken += count
                for f in gone:
                    if freed[f] != n or made[f] > i:
                        raise CorruptProgram("a slot freed twice, or before it is written")
                    freed[f] = i
                step_frees[i] = tuple(gone)
            r = reuse[i] - 1
            if (r >= 0 or g.into) and not (
                g.into
                and r >= 0
                and freed[r] == i
                and (r == first[i] or r == last[i])
                and meta[r] == meta[o]
            ):
                raise CorruptProgram("a step writes into a buffer that is not its dead argument's")
        _check(at == len(slots), "column 'slots': counts")
        _check(all(freed[s] == n and made[s] < n for s in kept), "a result freed, or never made")
        self.rep = dict(zip(sig, range(n), strict=True))  # (the last step of each signature)

    def ints(self, slots: np.ndarray) -> list[int]:
        """A large program's `slots` as ints. Past _SHARED_INTS slots, one int object per
        slot serves every run tuple and frees tuple that names it: megabytes fewer to
        allocate, fault in and free, for what taking from the pool costs."""
        return slots.tolist() if self.pool is None else self.pool.take(slots).tolist()

    @classmethod
    def of_arrays(
        cls,
        arrays: _Signatures,
        n: int,
        nslots: int,
        sig: np.ndarray,
        out: np.ndarray,
        reuse: np.ndarray,
        nfrees: np.ndarray,
        slots: np.ndarray,
        frees: np.ndarray,
        meta: np.ndarray,
        given: list[int],
        kept: list[int],
        more: dict[int, list[int]],
        unwanted: dict[int, list[int]],
    ) -> _Flow:
        self = cls.__new__(cls)
        self.sig = sig = sig.astype(np.intp)
        counts = arrays.nslots.take(sig)  # (an index past a table is an IndexError here)
        ends = counts.cumsum()
        total = int(ends[-1]) if n else 0
        _check(len(slots) == total, "column 'slots': counts")
        self.starts = starts = ends - counts
        steps = np.arange(n, dtype=np.int32)  # (steps and slots below 2**31: half the bytes)
        # Per step, the first and the last slot it reads (for one that reads none, slot
        # `nslots`: given, never freed, of meta -1, as its signature's first and last).
        reads = np.empty(total + 1, np.intp)
        reads[:total] = slots
        reads[total] = nslots
        at = np.empty((2, n), np.intp)
        at[0] = starts
        np.subtract(ends, 1, out=at[1])
        at[:, np.flatnonzero(counts == 0)] = total
        first_last = reads.take(at)
        self.first, self.last = first, last = first_last
        metas = np.empty(nslots + 1, np.int32)
        metas[:nslots] = meta
        metas[nslots] = -1

        o, gone = out.astype(np.intp), frees.astype(np.intp)
        made = np.empty(nslots + 1, np.int32)  # the step that writes each slot (-1: given)
        made.fill(n)  # (n: none)
        made[given] = -1
        made[nslots] = -1
        made[o] = steps
        if more:  # (a loop step's results: none twice, nor its first result)
            results = np.array([s for slots in more.values() for s in slots], np.intp)
            made[results] = np.array([i for i, slots in more.items() for _ in slots], np.intp)
            _check(np.bincount(np.concatenate([o, results])).max() <= 1, "a slot written twice")
        _check((made[given] == -1).all() and (made.take(o) == steps).all(), "a slot written twice")
        made[[w for slots in unwanted.values() for w in slots]] = n  # (never written)
        free_at = np.repeat(steps, nfrees)
        freed = np.empty(nslots + 1, np.int32)  # the step after which it goes
        freed.fill(n)  # (n: never)
        freed[gone] = free_at
        _check(
            not len(gone) or (np.bincount(gone).max() <= 1 and (made.take(gone) <= free_at).all()),
            "a slot freed twice, or before it is written",
        )
        _check((freed[kept] == n).all() and (made[kept] < n).all(), "a result freed, or never made")
        # The first and last slot each step reads, by step; the others (where a step reads
        # more than two), by slot read.
        _check(
            (made.take(first_last) < steps).all() and (freed.take(first_last) >= steps).all(),
            "a slot read before it is written, or after it is freed",
        )
        _check(
            (metas.take(first) == arrays.first_meta.take(sig)).all()
            and (metas.take(last) == arrays.last_meta.take(sig)).all(),
            "a step's arguments are not its signature's",
        )
        if total and int(counts.max()) > 2:
            read = reads[:total]
            read_at = np.repeat(steps, counts)  # per slot read, the step that reads it
            position = np.repeat(arrays.start.take(sig) - starts, counts) + np.arange(total)
            _check(
                (made.take(read) < read_at).all() and (freed.take(read) >= read_at).all(),
                "a slot read before it is written, or after it is freed",
            )
            _check(
                (metas.take(read) == arrays.metas.take(position)).all(),
                "a step's arguments are not its signature's",
            )
        result = metas.take(o)
        same = result == arrays.out.take(sig)
        _check(
            (same | arrays.loop.take(sig) if arrays.loops else same).all(), "a step's result meta"
        )
        if arrays.intos:
            _check(
                ((reuse > 0) == arrays.into.take(sig)).all(),
                "a step writes into a buffer that is not its dead argument's",
            )
            into = np.flatnonzero(reuse)
            r = reuse[into].astype(np.intp) - 1
            _check(
                (freed.take(r) == into).all()
                and ((r == first[into]) | (r == last[into])).all()
                and (metas.take(r) == result[into]).all(),
                "a step writes into a buffer that is not its dead argument's",
            )
        else:
            _check(
                not n or int(reuse.max()) == 0,
                "a step writes into a buffer that is not its dead argument's",
            )
        rep = np.full(len(arrays.nslots), -1)
        rep[sig] = steps
        used = np.flatnonzero(rep >= 0)
        self.rep = dict(zip(used.tolist(), rep[used].tolist(), strict=True))
        self.pool = np.arange(nslots + 1).astype(object) if nslots >= _SHARED_INTS else None
        self.frees = _tuples(nfrees, gone if self.pool is None else self.pool.take(gone))
        return self


class _Loaded(Program):
    """A loaded program. The lists a run does not read (per slot: requires_grad and
    grad_fn; per step: reuse, ufunc and costs; cost_by_node) are decoded when first read,
    then kept as plain attributes."""

    _lazy: dict[str, Callable[[], Any]]

    def __getattr__(self, name: str) -> Any:  # (only for attributes not set yet)
        make = self.__dict__.get("_lazy", {}).get(name)
        if make is None:
            raise AttributeError(name)
        return self.__dict__.setdefault(name, make())


class _Steps(Sequence[Step]):
    """A loaded program's steps, each decoded when first read (all of them when iterated):
    a program runs from its run tuples, and only /plan, errors and loops read its steps."""

    def __init__(self, columns: _StepColumns) -> None:
        self._items: list[Step | None] = [None] * len(columns.sig)
        self.columns = columns
        self._whole = not self._items

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> Step: ...

    @overload
    def __getitem__(self, index: slice) -> list[Step]: ...

    def __getitem__(self, index: int | slice) -> Step | list[Step]:
        if isinstance(index, slice):
            return self._all()[index]
        item = self._items[index]  # (an IndexError as a list's)
        if item is None:
            i = index % len(self._items)
            item = self._items[i] = self.columns.step(i)
        return item

    def __iter__(self) -> Iterator[Step]:
        return iter(self._all())

    def _all(self) -> list[Step]:
        if not self._whole:
            with _NoCycles():
                decoded = self.columns.steps()
            self._items = [old or new for old, new in zip(self._items, decoded, strict=True)]
            self._whole = True
        return cast(list[Step], self._items)


class _StepColumns:
    """A program's step columns (checked), and the Step objects they hold: the compiler's
    values, with the tables' ops, Lits and attribute dicts."""

    def __init__(
        self,
        reader: _Reader,
        sig: Column,
        kind: Column,
        origin: Column,
        out: Column,
        slots: Column,
        starts: Column,
        loops: dict[int, tuple[dict[str, Any], tuple[int, ...]]],
    ) -> None:
        self.signatures, self.kinds, self.names = reader.signatures, reader.kinds, reader.names
        self.sig, self.kind, self.origin, self.out = sig, kind, origin, out
        self.slots, self.starts, self.loops = slots, starts, loops

    def step(self, i: int) -> Step:
        g = self.signatures[int(self.sig[i])]
        start = int(self.starts[i])
        attrs, more = self.loops.get(i) or (g.attrs, ())
        return Step(
            g.op,
            g.args(_ints(self.slots[start : start + g.nslots])),
            attrs,
            int(self.out[i]),
            self.kinds[int(self.kind[i])],
            self.names.get(int(self.origin[i])),
            more,
        )

    def steps(self) -> list[Step]:
        signatures, slots = self.signatures, _ints(self.slots)
        of = [signatures[s] for s in _ints(self.sig)]
        args = [
            g.args(slots[start : start + g.nslots])
            for g, start in zip(of, _ints(self.starts), strict=True)
        ]
        attrs = [g.attrs for g in of]
        more: list[tuple[int, ...]] = [()] * len(of)
        for i, (loop_attrs, results) in self.loops.items():
            attrs[i], more[i] = loop_attrs, results
        kinds, names = self.kinds, self.names.list()
        return list(
            map(
                Step,
                [g.op for g in of],
                args,
                attrs,
                _ints(self.out),
                [kinds[k] for k in _ints(self.kind)],
                [names[o] for o in _ints(self.origin)],
                more,
            )
        )


class _NoCycles:
    """No cycle collection while a load makes its objects (see the module's docstring)."""

    def __enter__(self) -> None:
        self.collecting = gc.isenabled()
        gc.disable()

    def __exit__(self, *_: object) -> None:
        if self.collecting:
            gc.enable()


def _tuples(counts: np.ndarray, flat: np.ndarray) -> list[tuple[Any, ...]]:
    """Row i of a ragged array (`counts[i]` objects of `flat`, in order) as a tuple. The rows
    of one length are made together, zipping their columns (in C), and put in their places
    in an array of empty tuples."""
    rows = np.empty(len(counts), object)
    rows.fill(())
    starts = np.cumsum(counts, dtype=np.intp) - counts
    values: list[Any] | None = None
    for k in np.flatnonzero(np.bincount(counts)[1:]).tolist():
        k += 1
        at = np.flatnonzero(counts == k)
        firsts = starts[at]
        if k <= 4:
            made: Iterable[tuple[Any, ...]] = zip(
                *[flat[firsts + j].tolist() for j in range(k)], strict=True
            )
        else:
            values = flat.tolist() if values is None else values
            made = (tuple(values[f : f + k]) for f in firsts.tolist())
        rows[at] = np.fromiter(made, object, len(at))
    return rows.tolist()  # type: ignore[no-any-return]


def _objects(items: list[Any]) -> np.ndarray:
    """`items` as a NumPy array of objects (to gather from in C)."""
    return np.fromiter(items, object, len(items))
