"""Compiled programs as bytes, for a program store that any process loads from quickly.

`dump_program(program)` writes a planned program as data only: no pickle, no code. Ops are
named (the registry's, and `scan`), values keep their exact Python types, and kernels are
not stored: `load_program(data, device)` binds them again through the executor's own memo
of kernels by signature, once per distinct signature (`executor.kernel_of`). A store that
someone else can write can give wrong programs, but never run code in the service.

The layout, little-endian:

    prefix   magic (8 bytes), FORMAT_VERSION (u32), CRC-32 of the rest (u32), length of
             the rest (u64)
    header   its length (u32), then JSON: the tables (op names, step kinds, names, metas,
             literals, attribute sets, kernel signatures) and one record per program (the
             program, then its loops' bodies, each after the program it is in), with the
             record's scalars and where its columns lie
    columns  8-byte aligned integer arrays, each in the narrowest dtype its values fit:
             per step its op, kind, origin, attributes, result, reuse, ufunc, cost, kernel
             signature, and its arguments, extra results and frees (counts, then the values
             flat); per slot its meta, requires_grad and grad_fn; the held slots

Loading checks, before anything is built: the length and the checksum; the type of every
header value; every index against its table; the data flow (each slot written once, read
after it is written and before it is freed; a buffer reused only from a dead argument);
each step against its kernel's signature, and each signature's result against its op's
shape rule; each attribute set against its op's declaration; each loop body against its
step. Whatever is wrong raises CorruptProgram, never another exception. (A checksum that
matches is no proof of origin: someone who can write the store can write a consistent
program that computes something else, but nothing that runs code or loads half-formed.)

The run tuples are built from the columns with NumPy, with the decisions `executor._run`
makes (tests hold the two equal). The Step objects, which only /plan, errors and loop
bodies read, are decoded when first read, and so are the per-slot and per-step lists that
a run does not read.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast, overload

import numpy as np
import orjson

from engine.backends import Backend, get_backend
from engine.dtypes import ITEMSIZE
from engine.graph.builder import Builder
from engine.graph.executor import (
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
    _run,
    given_of,
    kernel_of,
)
from engine.graph.ir import BACKWARD, BYTE_COST, CAST, CONSTANT, DERIVED, NODE, Lit, Program, Step
from engine.graph.scan import SCAN, Body
from engine.ops import OPS
from engine.ops.registry import Meta, OpDef, bind_attributes, literal_meta

FORMAT_VERSION = 1
MAGIC = b"GSPROG\r\n"
_PREFIX = struct.Struct("<8sIIQ")  # magic, version, CRC-32 and length of what follows
_U32 = struct.Struct("<I")
_KINDS = frozenset({NODE, CAST, CONSTANT, BACKWARD, DERIVED})
_INT64 = (-(2**63), 2**63 - 1)
# A step's code by how many slots it reads (0, 1, 2, more), when it runs a kernel of its own.
_BY_SLOTS = np.array([NULLARY, UNARY, BINARY, NARY])
# By step code: whether its run tuple names its first slot (a0), and its last (a1).
_READS_FIRST = np.zeros(8, bool)
_READS_FIRST[[UNARY, BINARY, ALIAS, UNARY_INTO, BINARY_INTO]] = True
_READS_LAST = np.zeros(8, bool)
_READS_LAST[[BINARY, UNARY_INTO, BINARY_INTO]] = True
# The narrowest dtype first: a column takes the first that holds its values.
_DTYPES = tuple(np.dtype(d) for d in ("<u1", "<i1", "<u2", "<i2", "<u4", "<i4", "<i8"))
_DTYPE_NAMES = {d.str: d for d in _DTYPES}


# A program's columns, in the order they are written (the top program's also "kernel").
_COLUMNS = ("op", "kind", "origin", "attrs", "out", "nargs", "args", "nmore", "more", "reuse",
            "ufunc", "cost", "nfrees", "frees", "meta", "requires_grad", "grad_fn", "held")
_TOP_COLUMNS = frozenset({*_COLUMNS, "kernel"})


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
        (tag, inner), = data.items()
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
    try:
        header = orjson.dumps({
            "ops": writer.op_names, "kinds": writer.kind_names, "names": writer.name_list,
            "metas": writer.meta_list, "literals": writer.literal_list,
            "attrs": writer.attrs_list, "kernels": writer.kernel_list,
            "programs": writer.records,
        })
    except TypeError as exc:  # (a name or a value orjson refuses)
        raise Unstorable(str(exc)) from None
    columns = b"".join(writer.columns)
    head = _U32.pack(len(header)) + header
    rest = head + bytes(-len(head) % 8) + columns
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(rest), len(rest)) + rest


class _Writer:
    """The tables shared by a program and its loops' bodies, and the columns written."""

    def __init__(self) -> None:
        self.op_names: list[str] = []
        self.ops: dict[int, int] = {}  # id(OpDef) -> index
        self.kind_names: list[str] = []
        self.kinds: dict[str, int] = {}
        self.name_list: list[str | None] = [None]
        self.names: dict[str | None, int] = {None: 0}
        self.meta_list: list[list[Any]] = []
        self.metas: dict[Meta, int] = {}
        self.literal_list: list[Any] = []
        self.literals: dict[tuple[type, Any], int] = {}
        self.literal_ids: dict[int, int] = {}  # id(Lit) -> index (Lits are often shared)
        self.attrs_list: list[Any] = []
        self.attrs: dict[bytes, int] = {}
        self.attrs_ids: dict[int, int] = {}  # id(dict) -> index (attrs are often shared)
        self.kernel_list: list[list[Any]] = []
        self.kernels: dict[tuple[Any, ...], int] = {}
        self.records: list[dict[str, Any]] = []
        self.columns: list[bytes] = []
        self.size = 0

    def column(self, values: Sequence[int]) -> list[Any]:
        """Write `values` in the narrowest dtype that holds them; (dtype, offset, count)."""
        try:
            array = np.asarray(values, dtype=np.int64)
        except OverflowError:
            raise Unstorable("an integer past 64 bits in a column") from None
        lo, hi = (int(array.min()), int(array.max())) if len(array) else (0, 0)
        dtype = next(d for d in _DTYPES
                     if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max)
        data = array.astype(dtype).tobytes()
        offset = self.size
        self.columns.append(data + bytes(-len(data) % 8))
        self.size += len(self.columns[-1])
        return [dtype.str, offset, len(array)]

    def op(self, op: OpDef) -> int:
        index = self.ops.get(id(op))
        if index is None:
            if op is not SCAN and OPS.get(op.name) is not op:
                raise Unstorable(f"op {op.name!r} is not the registry's")
            index = self.ops[id(op)] = len(self.op_names)
            self.op_names.append(op.name)
        return index

    def meta(self, meta: Meta) -> int:
        index = self.metas.get(meta)
        if index is None:
            shape, dtype, literal = meta
            if (type(shape) is not tuple or any(type(d) is not int or d < 0 for d in shape)
                    or dtype not in ITEMSIZE or type(literal) is not bool):
                raise Unstorable(f"a meta of other types: {meta!r}")
            index = self.metas[meta] = len(self.meta_list)
            self.meta_list.append([list(shape), dtype, literal])
        return index

    def name(self, name: str | None) -> int:
        index = self.names.get(name)
        if index is None:
            if type(name) is not str:
                raise Unstorable(f"a name that is not a string: {name!r:.60}")
            index = self.names[name] = len(self.name_list)
            self.name_list.append(name)
        return index

    def literal(self, lit: Lit) -> int:
        index = self.literal_ids.get(id(lit))
        if index is None:
            value = lit.value
            if type(value) not in (bool, int, float):
                raise Unstorable(f"a literal of type {type(value).__name__}")
            key = _literal_key(value)
            index = self.literals.get(key)
            if index is None:
                index = self.literals[key] = len(self.literal_list)
                self.literal_list.append(_encode(value))
            self.literal_ids[id(lit)] = index
        return index

    def attributes(self, attrs: dict[str, Any]) -> int:
        index = self.attrs_ids.get(id(attrs))
        if index is None:
            if type(attrs) is not dict or any(type(k) is not str for k in attrs):
                raise Unstorable(f"attributes that are not a dict by name: {attrs!r:.60}")
            encoded = {k: _encode(v) for k, v in attrs.items()}
            key = orjson.dumps(encoded)
            index = self.attrs.get(key)
            if index is None:
                index = self.attrs[key] = len(self.attrs_list)
                self.attrs_list.append(encoded)
            self.attrs_ids[id(attrs)] = index
        return index

    def kind(self, kind: str) -> int:
        index = self.kinds.get(kind)
        if index is None:
            if kind not in _KINDS:
                raise Unstorable(f"a step of kind {kind!r}")
            index = self.kinds[kind] = len(self.kind_names)
            self.kind_names.append(kind)
        return index

    def program(self, program: Program, body: Body | None) -> int:
        """Write `program` (and the bodies of its loops after it); its record's index."""
        index = len(self.records)
        record: dict[str, Any] = {}
        self.records.append(record)
        steps = program.steps
        n = len(steps)
        if not (len(program.frees) == len(program.reuse) == len(program.ufunc)
                == len(program.step_costs) == n):
            raise Unstorable("the program is not planned")
        slot_metas = [self.meta(m) for m in program.metas]
        ops: list[int] = []
        kinds: list[int] = []
        origins: list[int] = []
        attrs: list[int] = []
        outs: list[int] = []
        nargs: list[int] = []
        args: list[int] = []
        nmore: list[int] = []
        more: list[int] = []
        scans: list[list[int]] = []
        kernels: list[int] = []
        top = body is None
        ufunc, reuse = program.ufunc, program.reuse
        for i, step in enumerate(steps):
            op = step.op
            ops.append(self.op(op))
            kinds.append(self.kind(step.kind))
            origins.append(self.name(step.origin))
            outs.append(step.out)
            codes = [a if type(a) is int else -1 - self.literal(a)  # type: ignore[arg-type]
                     for a in step.args]
            nargs.append(len(codes))
            args += codes
            nmore.append(len(step.more))
            more += step.more
            if op is SCAN:
                attrs.append(-1)
                scans.append([i, -1])  # (the body's record comes after this one)
                kernels.append(-1)
                continue
            attrs.append(self.attributes(step.attrs))
            if top:
                kernels.append(-1 if op.returns_input else self.kernel(
                    ops[-1], attrs[-1], ufunc[i], reuse[i] >= 0,
                    [c if c < 0 else slot_metas[c] for c in codes]))
        frees = program.frees
        columns: dict[str, Sequence[int]] = {
            "op": ops, "kind": kinds, "origin": origins, "attrs": attrs, "out": outs,
            "nargs": nargs, "args": args, "nmore": nmore, "more": more,
            "reuse": reuse, "ufunc": [bool(u) for u in ufunc], "cost": program.step_costs,
            "nfrees": [len(f) for f in frees], "frees": list(itertools.chain(*frees)),
            "meta": slot_metas, "requires_grad": [bool(r) for r in program.requires_grad],
            "grad_fn": [self.name(g) for g in program.grad_fn], "held": sorted(program.held),
        }
        if top:
            columns["kernel"] = kernels
        record["columns"] = {name: self.column(values) for name, values in columns.items()}
        if any(type(v) is not bool for v in (*program.ufunc, *program.requires_grad,
                                             program.no_grad, program.backward)):
            raise Unstorable("a flag that is not a bool")
        if type(program.plan_ms) is not float:
            raise Unstorable("plan_ms is not a float")
        if program.cost_by_node != _cost_by_node([s.origin for s in steps], program.step_costs):
            raise Unstorable("cost_by_node is not the steps' costs by origin")
        record.update(
            inputs=_pairs(program.inputs.items()), grad_inputs=_pairs(program.grad_inputs.items()),
            outputs=_pairs(program.outputs), gradients=_pairs(program.gradients),
            no_grad=program.no_grad, backward=program.backward, nodes=_encode(program.nodes),
            planned_peak_bytes=_encode(program.planned_peak_bytes),
            flops=_encode(program.flops), bytes_moved=_encode(program.bytes_moved),
            plan_ms=program.plan_ms)
        if body is not None:
            record["body"] = {
                "carries": body.carries, "xs": body.xs, "closures": body.closures,
                "nexts": body.nexts, "ys": body.ys, "length": body.length,
                "reverse": body.reverse, "wanted": body.wanted}
        for scan in scans:
            inner: Body = steps[scan[0]].attrs["body"]
            if inner.program is None:
                raise Unstorable("a loop whose body is not planned")
            scan[1] = self.program(inner.program, inner)
        record["scans"] = scans
        return index

    def kernel(self, op: int, attrs: int, ufunc: bool, into: bool, args: list[int]) -> int:
        """A kernel signature's index: the op, attributes, how it runs, and per argument
        its meta or literal (the executor's key, but for the backend)."""
        key = (op, attrs, ufunc, into, *args)
        index = self.kernels.get(key)
        if index is None:
            index = self.kernels[key] = len(self.kernel_list)
            self.kernel_list.append([op, attrs, bool(ufunc), bool(into), args])
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
        with _no_cycles():
            return _Reader(raw).load(backend)
    except CorruptProgram:
        raise
    except Exception as exc:  # whatever the damage, the caller gets one kind of error
        raise CorruptProgram(f"not a valid program: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _no_cycles() -> Iterator[None]:
    """No cycle collection while a load makes its objects: a large program is a hundred
    thousand tuples, none of them in a cycle, and each collection would walk them all."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check(ok: Any, what: str) -> None:
    if not ok:
        raise CorruptProgram(what)


def _typed(value: Any, kind: type, what: str) -> Any:
    _check(type(value) is kind, f"{what} is not a {kind.__name__}")
    return value


def _typed_list(value: Any, kind: type, what: str) -> list[Any]:
    _check(type(value) is list and all(type(v) is kind for v in value),
           f"{what} is not a list of {kind.__name__}")
    return cast(list[Any], value)


def _within(array: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Every value of `array` in [lo, hi)."""
    if len(array):
        _check(((lo <= 0 and array.dtype.kind == "u") or int(array.min()) >= lo)
               and int(array.max()) < hi, f"{what} out of range")


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
        self._items: list[Step | None] = [None] * len(columns.op)
        self._columns = columns
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
            item = self._items[i] = self._columns.step(i)
        return item

    def __iter__(self) -> Iterator[Step]:
        return iter(self._all())

    def _all(self) -> list[Step]:
        if not self._whole:
            decoded = self._columns.steps()
            self._items = [old or new for old, new in zip(self._items, decoded, strict=True)]
            self._whole = True
        return cast(list[Step], self._items)


class _StepColumns:
    """A program's step columns (checked), and the Step objects they hold: the compiler's
    lists of Python values, with the tables' ops, Lits and attribute dicts."""

    def __init__(self, reader: _Reader, op: np.ndarray, kind: np.ndarray, origin: np.ndarray,
                 attrs: np.ndarray, out: np.ndarray, nargs: np.ndarray, args: np.ndarray,
                 arg_ends: np.ndarray, nmore: np.ndarray, more: np.ndarray,
                 more_ends: np.ndarray, loops: dict[int, dict[str, Any]]) -> None:
        self.ops, self.kinds, self.names = reader.ops, reader.kinds, reader.names
        self.literals, self.attr_list, self.loops = reader.literals, reader.attrs, loops
        self.op, self.kind, self.origin, self.attrs, self.out = op, kind, origin, attrs, out
        self.nargs, self.args, self.arg_ends = nargs, args, arg_ends
        self.nmore, self.more, self.more_ends = nmore, more, more_ends

    def step(self, i: int) -> Step:
        literals = self.literals
        end = self.arg_ends.item(i)
        args = tuple([a if a >= 0 else literals[-1 - a]
                      for a in self.args[end - self.nargs.item(i):end].tolist()])
        end = self.more_ends.item(i)
        more = tuple(self.more[end - self.nmore.item(i):end].tolist())
        a = self.attrs.item(i)
        return Step(self.ops[self.op.item(i)], args,
                    self.attr_list[a] if a >= 0 else self.loops[i], self.out.item(i),
                    self.kinds[self.kind.item(i)], self.names[self.origin.item(i)], more)

    def steps(self) -> list[Step]:
        with _no_cycles():
            return self._steps()

    def _steps(self) -> list[Step]:
        literals, attr_list, loops = self.literals, self.attr_list, self.loops
        flat = [a if a >= 0 else literals[-1 - a] for a in self.args.tolist()]
        counts = self.nargs.tolist()
        args = [tuple(flat[e - c:e])
                for c, e in zip(counts, itertools.accumulate(counts), strict=True)]
        more = _tuples(self.nmore, self.more) if len(self.more) else [()] * len(counts)
        attrs = [attr_list[a] if a >= 0 else loops[i]
                 for i, a in enumerate(self.attrs.tolist())]
        ops, kinds, names = self.ops, self.kinds, self.names
        return list(map(Step, [ops[o] for o in self.op.tolist()], args, attrs,
                        self.out.tolist(), [kinds[k] for k in self.kind.tolist()],
                        [names[o] for o in self.origin.tolist()], more))


def _tuples(counts: np.ndarray, flat: np.ndarray) -> list[tuple[int, ...]]:
    """Row i of a ragged array (`counts[i]` values of `flat`, in order) as a tuple. The rows
    of one length are made together, zipping their columns (in C), then put in row order."""
    if len(counts) <= 256:  # (a few rows: slicing them costs less than the NumPy calls)
        row_values = flat.tolist()
        return [tuple(row_values[e - c:e])
                for c, e in zip(counts.tolist(), itertools.accumulate(counts.tolist()),
                                strict=True)]
    ends = np.cumsum(counts, dtype=np.int64)
    starts = ends - counts
    pool: list[tuple[int, ...]] = [()]
    where = np.zeros(len(counts), np.int64)  # per row, its tuple's place in the pool
    sizes = np.bincount(counts)
    values: list[int] | None = None
    for k in np.flatnonzero(sizes[1:]).tolist():
        k += 1
        rows = counts == k
        where[rows] = np.arange(len(pool), len(pool) + sizes[k])
        firsts = starts[rows]
        if k <= 4:
            pool += zip(*[flat[firsts + j].tolist() for j in range(k)], strict=True)
        else:
            values = flat.tolist() if values is None else values
            pool += [tuple(values[f:f + k]) for f in firsts.tolist()]
    return _objects(pool).take(where).tolist()  # type: ignore[no-any-return]


def _objects(items: list[Any]) -> np.ndarray:
    """`items` as a NumPy array of objects (to gather from in C)."""
    return np.fromiter(items, object, len(items))


class _Flow:
    """A program's data flow, from its columns, checked: each slot is written once (by a
    step, or given), read after it is written and not after it is freed, freed at most once
    and never if it is kept (given, a result, held). Also per step the slots it reads."""

    def __init__(self, n: int, nslots: int, out: np.ndarray, nargs: np.ndarray,
                 args: np.ndarray, nmore: np.ndarray, more: np.ndarray, nfrees: np.ndarray,
                 frees: np.ndarray, given: np.ndarray, kept: np.ndarray) -> None:
        steps = np.arange(n)
        self.arg_step = arg_step = np.repeat(steps, nargs.astype(np.intp))  # per argument
        self.is_slot = is_slot = args >= 0
        self.literals = literals = not is_slot.all()
        self.slots = slots = (args[is_slot] if literals else args).astype(np.int64)
        read_at = arg_step[is_slot] if literals else arg_step
        self.nslots = np.bincount(read_at, minlength=n) if literals else nargs.astype(np.int64)
        self.ends = ends = np.cumsum(self.nslots)
        has = self.nslots > 0
        self.first = np.zeros(n, np.int64)  # the first slot each step reads, and the last
        self.last = np.zeros(n, np.int64)
        self.first[has] = slots[(ends - self.nslots)[has]]
        self.last[has] = slots[ends[has] - 1]

        written = np.concatenate([np.unique(given), out, more]).astype(np.intp)
        _check((np.bincount(written, minlength=nslots) <= 1).all(), "a slot written twice")
        made = np.full(nslots, n, np.int64)  # the step that writes each slot (-1: given)
        made[given] = -1
        made[out] = steps
        made[more] = np.repeat(steps, nmore.astype(np.intp))
        _check((made[slots] < read_at).all(), "a slot read before it is written")
        free_at = np.repeat(steps, nfrees.astype(np.intp))
        _check((np.bincount(frees.astype(np.intp), minlength=nslots) <= 1).all(),
               "a slot freed twice")
        self.freed = freed = np.full(nslots, n, np.int64)  # the step after which it goes
        freed[frees] = free_at
        _check((made[frees] <= free_at).all() and (read_at <= freed[slots]).all(),
               "a slot read after it is freed")
        _check((freed[kept] == n).all() and (made[kept] < n).all(),
               "a result freed, or never made")


def _distinct(codes: np.ndarray) -> list[int]:
    """The distinct values of `codes` (non-negative), in order."""
    if len(codes) and int(codes.max()) < 1 << 20:
        return np.flatnonzero(np.bincount(codes)).tolist()  # type: ignore[no-any-return]
    return np.unique(codes).tolist()  # type: ignore[no-any-return]


class _Reader:
    """One stored program's bytes, checked, and the tables they share."""

    def __init__(self, raw: bytes) -> None:
        _check(len(raw) >= _PREFIX.size, f"truncated: {len(raw)} bytes")
        magic, version, crc, length = _PREFIX.unpack_from(raw)
        _check(magic == MAGIC, "not a stored program")
        _check(version == FORMAT_VERSION,
               f"format version {version}; this build reads {FORMAT_VERSION}")
        _check(len(raw) - _PREFIX.size == length,
               f"truncated or extended: {len(raw) - _PREFIX.size} bytes after the prefix, "
               f"not {length}")
        view = memoryview(raw)[_PREFIX.size:]
        _check(zlib.crc32(view) == crc, "the checksum does not match")
        _check(length >= _U32.size, "truncated header")
        (size,) = _U32.unpack_from(view)
        _check(_U32.size + size <= length, "the header runs past the end")
        header = _typed(orjson.loads(view[_U32.size:_U32.size + size]), dict, "the header")
        self.raw = raw
        self.base = _PREFIX.size + _U32.size + size + (-(_U32.size + size) % 8)
        self.ops = [self._op(name) for name in _typed_list(header["ops"], str, "ops")]
        self.is_scan = np.array([op is SCAN for op in self.ops], bool)
        self.returns_input = np.array([op.returns_input for op in self.ops], bool)
        self.kinds = _typed_list(header["kinds"], str, "kinds")
        _check(set(self.kinds) <= _KINDS, "an unknown step kind")
        names = _typed(header["names"], list, "names")
        _check(names[:1] == [None] and set(map(type, names[1:])) <= {str}, "bad names")
        self.names: list[str | None] = names
        self.metas = [self._meta(m) for m in _typed(header["metas"], list, "metas")]
        self.meta_index = {m: i for i, m in enumerate(self.metas)}
        _check(len(self.meta_index) == len(self.metas), "a meta twice")
        self.literals = [self._literal(v) for v in _typed(header["literals"], list, "literals")]
        self.attrs = [self._attrs(a) for a in _typed(header["attrs"], list, "attrs")]
        self.kernels = _typed(header["kernels"], list, "kernels")
        self.records = _typed_list(header["programs"], dict, "programs")
        _check(self.records, "no program")
        self.claimed = {0}

    @staticmethod
    def _op(name: str) -> OpDef:
        op = SCAN if name == SCAN.name else OPS.get(name)
        _check(op is not None, f"unknown op {name!r}")
        return cast(OpDef, op)

    @staticmethod
    def _meta(data: Any) -> Meta:
        _check(type(data) is list and len(data) == 3, "a meta is not [shape, dtype, literal]")
        shape, dtype, literal = data
        _check(type(shape) is list and all(type(d) is int and d >= 0 for d in shape),
               "a meta's shape")
        _check(dtype in ITEMSIZE and type(literal) is bool, "a meta's dtype or flag")
        return Meta(tuple(shape), dtype, literal)

    @staticmethod
    def _literal(data: Any) -> Lit:
        value = _decode(data)
        _check(type(value) in (bool, int, float), "a literal that is not a number")
        return Lit(value)

    @staticmethod
    def _attrs(data: Any) -> dict[str, Any]:
        _check(type(data) is dict, "attributes are not a dict")
        return {k: _decode(v) for k, v in data.items()}

    def columns(self, record: dict[str, Any], top: bool) -> dict[str, np.ndarray]:
        """A record's columns, each checked to lie within the bytes."""
        specs = _typed(record["columns"], dict, "columns")
        _check(specs.keys() == (_TOP_COLUMNS if top else set(_COLUMNS)), "the columns")
        out = {}
        for name, spec in specs.items():
            _check(type(spec) is list and len(spec) == 3, f"column {name!r}")
            dtype, offset, count = _DTYPE_NAMES.get(spec[0]), spec[1], spec[2]
            _check(dtype is not None and type(offset) is int and type(count) is int
                   and offset >= 0 and count >= 0
                   and self.base + offset + count * cast(np.dtype, dtype).itemsize
                   <= len(self.raw), f"column {name!r}")
            out[name] = np.frombuffer(self.raw, dtype, count, self.base + offset)
        return out

    def load(self, backend: Backend) -> Program:
        program = self.program(0, None)
        _check(len(self.claimed) == len(self.records), "a body no loop runs")
        program.run = self.bind(program, backend)
        return program

    def program(self, index: int, body: dict[str, Any] | None) -> _Loaded:
        """Program `index` (and the bodies of its loops), checked; without its run."""
        record = self.records[index]
        _check((body is None) == ("body" not in record), "a body where none belongs")
        columns = self.columns(record, index == 0)
        (op, kind, origin, attrs, out, nargs, args, nmore, more, reuse, ufunc, cost, nfrees,
         frees, meta, requires_grad, grad_fn, held) = (columns[name] for name in _COLUMNS)
        n, nslots = len(op), len(meta)
        for name, array in (("kind", kind), ("origin", origin), ("attrs", attrs),
                            ("out", out), ("reuse", reuse), ("ufunc", ufunc), ("cost", cost),
                            ("nargs", nargs), ("nmore", nmore), ("nfrees", nfrees)):
            _check(len(array) == n, f"column {name!r} has {len(array)} rows, not {n}")
        for name, array, counts in (("args", args, nargs), ("more", more, nmore),
                                    ("frees", frees, nfrees)):
            _check(int(counts.sum(dtype=np.int64)) == len(array), f"column {name!r}: counts")
        # (requires_grad and grad_fn cover the slots there were before the backward, and
        # a body has neither)
        _check(len(requires_grad) == len(grad_fn) <= nslots, "per-slot columns")
        _within(op, 0, len(self.ops), "an op")
        _within(kind, 0, len(self.kinds), "a kind")
        _within(origin, 0, len(self.names), "an origin")
        _within(grad_fn, 0, len(self.names), "a grad_fn")
        _within(meta, 0, len(self.metas), "a meta")
        _within(args, -len(self.literals), nslots, "an argument")
        for name, array in (("out", out), ("more", more), ("frees", frees), ("held", held)):
            _within(array, 0, nslots, f"a slot of {name!r}")
        _within(reuse, -1, nslots, "a reused slot")
        _within(ufunc, 0, 2, "a ufunc flag")
        _within(requires_grad, 0, 2, "a requires_grad flag")
        is_scan = self.is_scan[op]
        _check(np.array_equal(attrs < 0, is_scan), "a loop's attributes")
        _within(attrs, -1, len(self.attrs), "attributes")
        self._check_attrs(op, attrs)

        inputs = self._pairs(record["inputs"], nslots)
        grad_inputs = self._pairs(record["grad_inputs"], nslots)
        outputs = self._pairs(record["outputs"], nslots)
        gradients = self._pairs(record["gradients"], nslots)
        given = np.array([s for _, s in (*inputs, *grad_inputs)], np.int64)
        kept = np.concatenate([given, held, np.array([s for _, s in (*outputs, *gradients)],
                                                     np.int64)])
        flow = _Flow(n, nslots, out, nargs, args, nmore, more, nfrees, frees, given, kept)
        into = np.flatnonzero(reuse >= 0)
        reused = reuse[into].astype(np.int64)
        _check(np.array_equal(flow.freed[reused], into)
               and ((reused == flow.first[into]) | (reused == flow.last[into])).all()
               and np.array_equal(meta[reused], meta[out[into]]),
               "a step writes into a buffer that is not its dead argument's")

        metas = self.metas
        slot_metas = [metas[m] for m in meta.tolist()]
        step_frees = _tuples(nfrees, frees)
        p = _Loaded.__new__(_Loaded)
        p.__dict__.update(
            metas=slot_metas, inputs=dict(inputs), grad_inputs=dict(grad_inputs),
            outputs=outputs, gradients=gradients,
            no_grad=_typed(record["no_grad"], bool, "no_grad"),
            backward=_typed(record["backward"], bool, "backward"),
            held=set(held.tolist()),
            frees=step_frees,
            nodes=_typed(_decode(record["nodes"]), int, "nodes"),
            planned_peak_bytes=_typed(_decode(record["planned_peak_bytes"]), int,
                                      "planned_peak_bytes"),
            flops=_typed(_decode(record["flops"]), int, "flops"),
            bytes_moved=_typed(_decode(record["bytes_moved"]), int, "bytes_moved"),
            plan_ms=_typed(record["plan_ms"], float, "plan_ms"),
            run=None,
        )
        _check(int(cost.sum(dtype=np.int64)) == p.flops + BYTE_COST * p.bytes_moved,
               "the steps' costs are not the program's")
        if index == 0:
            self.flow, self.top = flow, columns
        if len(grad_fn):
            _check(all(slot < len(grad_fn) for _, slot in p.outputs), "an output's flags")
        names = self.names
        p._lazy = {
            "requires_grad": lambda: requires_grad.astype(bool).tolist(),
            "grad_fn": lambda: [names[g] for g in grad_fn.tolist()],
            "reuse": reuse.tolist, "ufunc": lambda: ufunc.astype(bool).tolist(),
            "step_costs": cost.tolist,
            "cost_by_node": lambda: _cost_by_node([names[o] for o in origin.tolist()],
                                                  cost.tolist()),
        }

        # The loops: each scan step's body is a record of its own, after this one.
        scans = _typed_list(record["scans"], list, "scans")
        _check([s[:1] for s in scans] == [[i] for i in np.flatnonzero(is_scan).tolist()],
               "the loops")
        arg_ends = np.cumsum(nargs, dtype=np.int64)
        more_ends = np.cumsum(nmore, dtype=np.int64)
        scan_attrs: dict[int, dict[str, Any]] = {}
        for scan in scans:
            _check(len(scan) == 2 and type(scan[1]) is int
                   and index < scan[1] < len(self.records) and scan[1] not in self.claimed,
                   "a loop's body")
            i, inner = scan
            self.claimed.add(inner)
            spec = _typed(self.records[inner].get("body"), dict, "a body")
            loop = self.program(inner, spec)
            step_args = args[arg_ends[i] - nargs[i]:arg_ends[i]]
            _check((step_args >= 0).all(), "a loop's argument that is a literal")
            outs = [int(out[i]), *more[more_ends[i] - nmore[i]:more_ends[i]].tolist()]
            scan_attrs[i] = {"body": self._body(
                spec, loop, [slot_metas[a] for a in step_args.tolist()],
                [slot_metas[o] for o in outs])}

        p.steps = cast(list[Step], _Steps(_StepColumns(  # (a Sequence: see _Steps)
            self, op, kind, origin, attrs, out, nargs, args, arg_ends, nmore, more, more_ends,
            scan_attrs)))
        return p

    def _check_attrs(self, op: np.ndarray, attrs: np.ndarray) -> None:
        """Each step's attributes are ones its op takes (the registry's own checks)."""
        width = len(self.attrs) + 1
        for code in _distinct(op.astype(np.int64) * width + attrs.astype(np.int64) + 1):
            o, a = divmod(code, width)
            if a:  # (0: a loop's step, which has its body instead)
                opdef = self.ops[o]
                bind_attributes(opdef.name, opdef.attrs, opdef.defaults, self.attrs[a - 1])

    @staticmethod
    def _pairs(data: Any, nslots: int) -> list[tuple[str, int]]:
        _check(type(data) is list and all(
            type(pair) is list and len(pair) == 2 and type(pair[0]) is str
            and type(pair[1]) is int and 0 <= pair[1] < nslots for pair in data),
            "names and slots")
        return [(name, slot) for name, slot in data]

    def _body(self, spec: dict[str, Any], program: _Loaded, args: list[Meta],
              outs: list[Meta]) -> Body:
        """A loop's Body around its planned `program`, checked against its scan step (the
        metas of its arguments and results): what the loop allocates is what they say."""
        metas = program.metas
        lists = {key: _typed_list(spec[key], int, key)
                 for key in ("carries", "xs", "closures", "nexts", "ys")}
        for key, slots in lists.items():
            _check(all(0 <= s < len(metas) for s in slots), f"a body's {key}")
        length = _typed(spec["length"], int, "a body's length")
        wanted = _typed_list(spec["wanted"], bool, "a body's wanted")
        carries, xs, closures, nexts, ys = lists.values()
        nc, nx = len(carries), len(xs)

        def stacked(slot: int) -> Meta:
            return Meta((length, *metas[slot].shape), metas[slot].dtype)

        _check(length >= 0 and len(nexts) == nc and len(wanted) == len(outs) == nc + len(ys)
               and len(args) == nc + nx + len(closures)
               and [metas[s] for s in carries] == args[:nc] == outs[:nc]
               and [metas[s] for s in nexts] == args[:nc]
               and [stacked(s) for s in xs] == args[nc:nc + nx]
               and [metas[s] for s in closures] == args[nc + nx:]
               and [stacked(s) for s in ys] == outs[nc:], "a loop's body does not fit its step")
        b = Builder()
        b.metas = metas
        return Body(b=b, steps=program.steps, length=length, wanted=wanted,
                    reverse=_typed(spec["reverse"], bool, "a body's reverse"),
                    program=program, **lists)

    def bind(self, p: _Loaded, backend: Backend) -> Bound:
        """The run of the top program: its run tuples made from the columns with the
        decisions `executor._run` makes, its kernels one per signature."""
        op, kind, attrs, out, reuse, ufunc, nargs, args, kernel, meta = (
            self.top[name] for name in ("op", "kind", "attrs", "out", "reuse", "ufunc",
                                        "nargs", "args", "kernel", "meta"))
        n = len(op)
        _check(len(kernel) == n, "column 'kernel'")
        _within(kernel, -1, len(self.kernels), "a kernel")
        alias, loop = self.returns_input[op], self.is_scan[op]
        into = reuse >= 0
        runs_kernel = kernel >= 0
        _check(np.array_equal(runs_kernel, ~(alias | loop)), "a step without its kernel")
        flow = self.flow
        arg_step, is_slot = flow.arg_step, flow.is_slot
        starts = np.cumsum(nargs, dtype=np.int64) - nargs

        # Each step of a kernel has the kernel's signature: its op, attributes, how it runs,
        # and per argument a slot's meta or a literal (-1 - its number).
        table = [self._signature(k) for k in self.kernels]
        has_kernel = np.flatnonzero(runs_kernel)
        rep = np.full(len(table), -1, np.int64)  # a step of each kernel
        rep[kernel[has_kernel]] = has_kernel
        _check((rep >= 0).all(), "a kernel no step runs")
        if table:
            sig = np.array([t[:5] for t in table], np.int64)
            sig_args = np.array([a for t in table for a in t[5]] or [0], np.int64)
            sig_start = np.cumsum(sig[:, 4]) - sig[:, 4]
            every = len(has_kernel) == n
            pick = slice(None) if every else has_kernel
            _check(all(np.array_equal(sig[:, j][kernel[pick]], column[pick])
                       for j, column in enumerate((op, attrs, ufunc, into, nargs))),
                   "a step is not its kernel's")
            codes = np.where(is_slot, meta[np.where(is_slot, args, 0)], args) \
                if flow.literals else meta[args]
            theirs = sig_args.take((sig_start[kernel] - starts)[arg_step] + np.arange(len(args)),
                                   mode="clip")
            same = codes == theirs
            _check((same if every else same | ~runs_kernel[arg_step]).all(),
                   "a step's arguments are not its kernel's")
            # ... and the meta its op's shape rule gives for that signature.
            made = np.array([self.meta_index.get(self._inferred(t), -1) for t in table])
            _check(np.array_equal(made[kernel[pick]], meta[out[pick]]), "a step's result meta")
        _check(np.array_equal(meta[out[alias]], meta[self.flow.first[alias]]),
               "a step's result meta")  # (a step that returns its argument)

        # executor._run: its code, and the slots its run tuple names.
        nslots, has = flow.nslots, flow.nslots > 0
        _check(has[alias | into].all(), "a step that reads nothing")
        code = _BY_SLOTS[np.minimum(nslots, 3)]
        code[into] = np.where(nslots[into] == 1, UNARY_INTO, BINARY_INTO)
        code[loop] = LOOP
        code[alias] = ALIAS
        a0 = np.where(_READS_FIRST[code], flow.first, 0)
        a1 = np.where(_READS_LAST[code], flow.last, 0)

        # The kernels: one per signature, made for one of its steps as binding makes it.
        ufuncs = backend.ufuncs is not None
        steps = p.steps
        fns = _objects([*(kernel_of(steps[i], p, backend, bool(ufunc[i]) and ufuncs,
                                    bool(into[i])) for i in rep.tolist()),
                        None])  # (kernel -1: a step that runs without one)
        rest: list[Any] = [None] * n
        for i, r in zip(np.flatnonzero(into).tolist(), reuse[into].tolist(), strict=True):
            rest[i] = r
        for i in np.flatnonzero(code == NARY).tolist():
            rest[i] = tuple(flow.slots[flow.ends[i] - nslots[i]:flow.ends[i]].tolist())
        frees = p.frees
        runs: list[Run] = list(zip(code.tolist(), fns.take(kernel).tolist(),
                                   out.tolist(), a0.tolist(), a1.tolist(), rest, frees,
                                   strict=True))
        for i in np.flatnonzero(loop).tolist():
            runs[i] = _run(steps[i], p, backend, False, -1, frees[i])
        kinds = self.kinds
        backward = np.flatnonzero(kind == (kinds.index(BACKWARD) if BACKWARD in kinds
                                           else len(kinds)))
        split = int(backward[0]) if len(backward) else n
        return Bound(backend, runs[:split], runs[split:], given_of(p))

    def _inferred(self, signature: tuple[int, int, bool, bool, int, list[int]]) -> Meta:
        """The meta a kernel signature's shape rule gives (its indices are checked: they
        are its steps')."""
        op, attrs, _, _, _, args = signature
        metas = [self.metas[a] if a >= 0 else literal_meta(self.literals[-1 - a].value)
                 for a in args]
        return self.ops[op].infer(metas, **self.attrs[attrs])

    def _signature(self, data: Any) -> tuple[int, int, bool, bool, int, list[int]]:
        """A kernel signature: (op, attributes, ufunc, into, argument count, arguments)."""
        _check(type(data) is list and len(data) == 5, "a kernel signature")
        op, attrs, ufunc, into, args = data
        _check(type(op) is int and type(attrs) is int and type(ufunc) is bool
               and type(into) is bool, "a kernel signature")
        args = _typed_list(args, int, "a kernel's arguments")
        return op, attrs, ufunc, into, len(args), args
