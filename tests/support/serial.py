"""Shared by the tests (from tests/engine/test_serial.py)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest

from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import serial
from gradserve.engine.graph.executor import LOOP, Bound, Run, execute
from gradserve.engine.graph.ir import Lit, Program, Step
from gradserve.engine.graph.scan import SCAN, Body
from gradserve.engine.graph.serial import (
    FORMAT_VERSION,
    MAGIC,
    CorruptProgram,
    dump_program,
    load_program,
)
from gradserve.service.encode import encode_result
from gradserve.service.plan_view import planned_steps, program_dot


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (floats by their bits)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is Lit:
        return same(a.value, b.value)
    return bool(a == b)


_FIELDS = (
    "metas",
    "inputs",
    "grad_inputs",
    "outputs",
    "gradients",
    "requires_grad",
    "grad_fn",
    "no_grad",
    "backward",
    "held",
    "frees",
    "reuse",
    "ufunc",
    "nodes",
    "planned_peak_bytes",
    "flops",
    "bytes_moved",
    "cost_by_node",
    "step_costs",
    "recompute_cost",
    "peak_without_recompute",
    "plan_ms",
    "estimated_bytes",
    "compute_cost",
)


def assert_same_program(fresh: Program, loaded: Program) -> None:
    """Every field, step and loop body, and the run tuples with their kernels."""
    for name in _FIELDS:
        assert same(getattr(loaded, name), getattr(fresh, name)), name
    assert len(loaded.steps) == len(fresh.steps)
    for i, (a, b) in enumerate(zip(fresh.steps, loaded.steps, strict=True)):
        assert_same_step(a, b, i)
    assert list(loaded.steps[1:3]) == list(loaded.steps)[1:3]  # (slices of the lazy steps)
    if fresh.run is None:
        assert loaded.run is None
    else:
        assert_same_bound(fresh.run, loaded.run)


def assert_same_step(a: Step, b: Step, i: int) -> None:
    assert b.op is a.op, i
    for name in ("args", "out", "kind", "origin", "more"):
        assert same(getattr(b, name), getattr(a, name)), (i, name)
    if a.op is SCAN:
        assert list(b.attrs) == ["body"]
        assert_same_body(a.attrs["body"], b.attrs["body"])
    else:
        assert same(b.attrs, a.attrs), i


def assert_same_body(a: Body, b: Body) -> None:
    for name in (
        "carries",
        "xs",
        "closures",
        "nexts",
        "ys",
        "length",
        "reverse",
        "wanted",
        "shifted",
        "every",
        "replayed",
    ):
        assert same(getattr(b, name), getattr(a, name)), name
    assert (a.replay is None) == (b.replay is None)
    if a.replay is not None and b.replay is not None:
        assert same(b.replay.replayed, a.replay.replayed)
    assert a.program is not None and b.program is not None
    assert_same_program(a.program, b.program)


def assert_same_bound(a: Bound, b: Bound) -> None:
    assert b.backend is a.backend and same(b.given, a.given)
    assert len(b.forward) == len(a.forward) and len(b.backward) == len(a.backward)
    assert_same_runs(a.forward + a.backward, b.forward + b.backward)


def assert_same_runs(fresh: list[Run], loaded: list[Run]) -> None:
    for i, (a, b) in enumerate(zip(fresh, loaded, strict=True)):
        assert same(b[0], a[0]) and same(b[2:5], a[2:5]) and same(b[6], a[6]), (i, a, b)
        if a[0] == LOOP:
            x, y = a[5], b[5]
            for name in ("args", "ys", "kept", "results"):
                assert same(getattr(y, name), getattr(x, name)), (i, name)
            assert (x.replay is None) == (y.replay is None), i
            for inner, loaded_inner in ((x.inner, y.inner), (x.replay, y.replay)):
                if inner is None:
                    continue
                for name in ("sources", "sizes", "given", "distinct"):
                    assert same(getattr(loaded_inner, name), getattr(inner, name)), (i, name)
                assert_same_runs(inner.bound, loaded_inner.bound)
            continue
        assert same(b[5], a[5]) and same_kernel(a[1], b[1]), (i, a, b)


def same_kernel(a: Any, b: Any) -> bool:
    """The same kernel: the memo's own (its key is the step's signature), or one made the
    same way (a NaN literal is a key of its own, and the memo may have been cleared)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, functools.partial):
        return (
            same_kernel(a.func, b.func)
            and len(a.args) == len(b.args)
            and all(map(_same_part, a.args, b.args))
            and list(a.keywords) == list(b.keywords)
            and all(_same_part(a.keywords[k], b.keywords[k]) for k in a.keywords)
        )
    if inspect.isfunction(a):
        cells = zip(a.__closure__ or (), b.__closure__ or (), strict=True)
        return a.__code__ is b.__code__ and all(
            _same_part(x.cell_contents, y.cell_contents) for x, y in cells
        )
    return False


def _same_part(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if callable(a) and not isinstance(a, type):
        return same_kernel(a, b)
    return same(a, b)


# The loader checks a small program step by step in Python and a large one a column at a
# time with NumPy (the largest sharing one int object per slot): tests load every program
# both ways, whatever its size.
CHECKS = ("steps", "columns")


@contextlib.contextmanager
def checked_by(how: str) -> Iterator[None]:
    saved = serial.SMALL, serial._SHARED_INTS
    serial.SMALL, serial._SHARED_INTS = (1 << 62, 1 << 62) if how == "steps" else (-1, 0)
    try:
        yield
    finally:
        serial.SMALL, serial._SHARED_INTS = saved


def round_trip(program: Program) -> Program:
    data = dump_program(program)
    loaded = load_program(data)
    assert_same_program(program, loaded)
    for how in CHECKS:
        with checked_by(how):
            assert_same_program(program, load_program(data))
    assert dump_program(loaded) == data  # (dump, load, dump: the same bytes)
    assert planned_steps(loaded) == planned_steps(program)
    assert program_dot(loaded, 1 << 30) == program_dot(program, 1 << 30)
    return loaded


def run_both(fresh: Program, loaded: Program, inputs: dict[str, Any], **kw: Any) -> Any:
    """`execute` on both: the same error, or bit for bit the same results, peaks and
    response; the loaded program's result."""
    try:
        expected = execute(fresh, inputs, **kw)
    except GradserveError as err:
        with pytest.raises(type(err)) as info:
            execute(loaded, inputs, **kw)
        assert (str(info.value), info.value.node, info.value.op) == (str(err), err.node, err.op)
        raise info.value from None
    got = execute(loaded, inputs, **kw)
    for name in ("outputs", "gradients"):
        a, b = getattr(expected, name), getattr(got, name)
        assert (a is None) == (b is None) and list(a or {}) == list(b or {}), name
        for k in a or {}:
            x, y = np.asarray(a[k]), np.asarray(b[k])
            assert (x.dtype, x.shape) == (y.dtype, y.shape), (name, k)
            assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), k
    for name in ("peak_bytes", "planned_peak_bytes", "nodes"):
        assert getattr(got, name) == getattr(expected, name), name
    assert _response(fresh, expected) == _response(loaded, got)
    return got


def _response(program: Program, result: Any) -> Any:
    """The response body /forward or /backward would send, without its timings."""
    reply = encode_result(
        program,
        result,
        device="cpu",
        no_grad=program.no_grad,
        encoding="json",
        graph_id="g",
        source="store",
        tier="off",
    )
    body = orjson.loads(b"".join(bytes(p) for p in reply.parts))
    del body["meta"]["timings_ms"]
    return body


def split(data: bytes) -> tuple[Any, bytes]:
    """The header (each signature's JSON text parsed, so that damage reaches inside it) and
    the columns."""
    (size,) = struct.unpack_from("<I", data, 24)
    base = 28 + size + (-(4 + size) % 8)
    header = orjson.loads(data[28 : 28 + size])
    header["signatures"] = [orjson.loads(text) for text in header["signatures"]]
    return header, data[base:]


def frame(header: Any, columns: bytes) -> bytes:
    """Bytes of the format around `header` and `columns`, with a checksum that matches."""
    if isinstance(header, dict) and isinstance(header.get("signatures"), list):
        header = {**header, "signatures": [orjson.dumps(s).decode() for s in header["signatures"]]}
    text = orjson.dumps(header)
    rest = struct.pack("<I", len(text)) + text + bytes(-(4 + len(text)) % 8) + columns
    return struct.pack("<8sIIQ", MAGIC, FORMAT_VERSION, zlib.crc32(rest), len(rest)) + rest


def corrupt(data: bytes | memoryview) -> None:
    for how in CHECKS:
        with checked_by(how), pytest.raises(CorruptProgram):
            load_program(data)
