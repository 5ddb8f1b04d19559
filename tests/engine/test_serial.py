"""Stored programs (engine.graph.serial): a program loaded from its bytes is the program
compiled (the same steps, plan, run tuples and kernels; bit for bit the same results,
peaks, response fields, errors, /plan and DOT), for every op sample on every path and the
graphs of the transforms' and objectives' tests; and damaged bytes are a CorruptProgram."""

from __future__ import annotations

import contextlib
import inspect
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness import Gradserve
from bench.workloads import Workload, small_workloads
from gradserve.engine.errors import BackwardError, Cancelled, GradserveError
from gradserve.engine.graph import BodySpec, GraphSpec, NodeSpec, TensorSpec, compile_graph, serial
from gradserve.engine.graph.checkpoint import checkpoint_every
from gradserve.engine.graph.executor import BINARY_INTO, UNARY_INTO, bind, execute
from gradserve.engine.graph.ir import Program
from gradserve.engine.graph.scan import SCAN
from gradserve.engine.graph.serial import (
    FORMAT_VERSION,
    MAGIC,
    CorruptProgram,
    Unstorable,
    dump_program,
    load_program,
)
from gradserve.engine.ops import OPS
from gradserve.service.plan_view import planned_steps, program_dot
from tests.engine import test_objectives, test_transforms
from tests.support.op_samples import Sample
from tests.support.ops import is_float_array, op_cases
from tests.support.serial import (
    CHECKS,
    checked_by,
    corrupt,
    frame,
    round_trip,
    run_both,
    same,
    split,
)

# ---------------------------------------------------------------- the same program


# ---------------------------------------------------------------- every op sample


def _sample_graph(name: str, sample: Sample) -> tuple[GraphSpec, dict[str, np.ndarray], list[str]]:
    """One node of the op on the sample's arrays (floats in float64) and literals; the
    inputs the op differentiates."""
    args: list[Any] = []
    arrays: dict[str, np.ndarray] = {}
    wrt = []
    for i, a in enumerate(sample.args):
        if isinstance(a, np.ndarray):
            arrays[f"a{i}"] = a.astype("float64") if is_float_array(a) else a
            args.append(f"a{i}")
            if is_float_array(a) and OPS[name].arg_differentiable(i):
                wrt.append(f"a{i}")
        else:
            args.append(a)
    return GraphSpec([NodeSpec("out", name, args, sample.attrs)], ["out"]), arrays, wrt


def _specs(arrays: dict[str, np.ndarray], wrt: Sequence[str] = ()) -> dict[str, TensorSpec]:
    return {k: TensorSpec(a.shape, str(a.dtype), k in wrt) for k, a in arrays.items()}


@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_every_op_sample_loads_as_compiled_on_every_path(name: str, sample: Sample) -> None:
    spec, arrays, wrt = _sample_graph(name, sample)
    paths: list[dict[str, Any]] = [{"no_grad": True}, {}]
    forward = compile_graph(spec, _specs(arrays, wrt))
    out = forward.metas[dict(forward.outputs)["out"]]
    upstream = {"out": np.random.default_rng(3).standard_normal(out.shape).astype(out.dtype)}
    if wrt and forward.requires_grad[dict(forward.outputs)["out"]]:
        paths.append({"backward": True, "grad_outputs": upstream})
    for path in paths:
        grad_outputs = path.pop("grad_outputs", None)
        try:
            fresh = compile_graph(
                spec,
                _specs(arrays, wrt),
                **path,
                grad_outputs=grad_outputs and _specs(grad_outputs),
            )
        except BackwardError:
            continue  # (an output that nothing differentiable flows into)
        loaded = round_trip(fresh)
        run_both(fresh, loaded, arrays, grad_outputs=grad_outputs, verify=True)


# ---------------------------------------------------------------- the transforms' graphs


class _Twins:
    """`compile_graph` and `execute` for another test module: each program compiled is
    dumped, loaded and checked against itself, and the test gets the loaded one; each run
    of it runs the compiled one too, and the two must agree bit for bit."""

    def __init__(self) -> None:
        self.compiled: dict[int, tuple[Program, Program]] = {}
        self.loaded = 0

    def compile_graph(self, *args: Any, **kw: Any) -> Program:
        fresh = compile_graph(*args, **kw)
        loaded = round_trip(fresh)
        self.compiled[id(loaded)] = (fresh, loaded)
        self.loaded += 1
        return loaded

    def execute(self, program: Program, inputs: Any, **kw: Any) -> Any:
        fresh, _ = self.compiled[id(program)]
        return run_both(fresh, program, dict(inputs), **kw)


@pytest.fixture
def twins(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Twins]:
    twins = _Twins()
    for module in (test_transforms, test_objectives):
        monkeypatch.setattr(module, "compile_graph", twins.compile_graph)
        monkeypatch.setattr(module, "execute", twins.execute)
    yield twins


def _tests(module: Any, needs_backend: bool) -> list[str]:
    return [
        name
        for name, fn in vars(module).items()
        if name.startswith("test_")
        and ("backend_name" in inspect.signature(fn).parameters) == needs_backend
    ]


@pytest.mark.parametrize("name", _tests(test_transforms, needs_backend=False))
def test_transform_graphs_load_as_compiled(name: str, twins: _Twins) -> None:
    """grad, jvp, scans, nested and differentiated scans: each test of
    tests/engine/test_transforms.py, with every program it compiles stored and loaded."""
    getattr(test_transforms, name)()


@pytest.mark.parametrize("name", _tests(test_transforms, needs_backend=True))
def test_transform_graphs_load_as_compiled_on_each_backend(
    name: str, backend_name: str, twins: _Twins
) -> None:
    getattr(test_transforms, name)(backend_name)
    assert twins.loaded


@pytest.mark.parametrize("name", sorted(test_objectives.OBJECTIVES))
def test_objectives_load_as_compiled(name: str, twins: _Twins) -> None:
    test_objectives.test_objective_matches_torch(name)
    assert twins.loaded == 1


# ---------------------------------------------------------------- the benchmark's workloads

WORKLOADS = small_workloads()


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_the_benchmark_workloads_load_as_compiled(workload: Workload) -> None:
    w = workload
    fresh = Gradserve().compile(w.graph, w.inputs, w.wrt, w.grad_outputs, w.no_grad)
    run_both(fresh, round_trip(fresh), w.inputs, grad_outputs=w.grad_outputs)


def test_steps_that_write_into_a_dead_buffer() -> None:
    """Large enough for the planner to let ufuncs write into their operands' buffers."""
    spec = GraphSpec(
        [
            NodeSpec("a", expr="sin(x) * 2.0"),
            NodeSpec("b", expr="exp(-a) + a"),
            NodeSpec("loss", expr="sum(b * b)"),
        ],
        ["loss"],
    )
    arrays = {"x": np.linspace(-1, 1, 64 * 64).reshape(64, 64)}
    fresh = compile_graph(spec, _specs(arrays, ["x"]), backward=True)
    codes = {run[0] for run in fresh.run.forward + fresh.run.backward}
    assert {UNARY_INTO, BINARY_INTO} <= codes
    run_both(fresh, round_trip(fresh), arrays)


def test_literals_that_json_cannot_hold_load_as_compiled() -> None:
    """Non-finite floats and -0.0 among a program's literals (stored tagged, or by bits)."""
    spec = GraphSpec(
        [
            NodeSpec("a", "mul", ["x", float("inf")]),
            NodeSpec("b", "add", ["x", float("nan")]),
            NodeSpec("c", "mul", ["x", -0.0]),
            NodeSpec("d", "mul", ["x", 0.0]),
            NodeSpec("loss", expr="sum(a + b + c + d)"),
        ],
        ["loss"],
    )
    arrays = {"x": np.linspace(-1, 1, 6)}
    fresh = compile_graph(spec, _specs(arrays, ["x"]), backward=True)
    run_both(fresh, round_trip(fresh), arrays)


# ---------------------------------------------------------------- errors while running


def _loop_graph(index: str) -> GraphSpec:
    body = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[
            NodeSpec("p", "gather", ["h", index], {"dim": 0}),
            NodeSpec("h2", expr="tanh(h * x + sum(p) * 0.5)"),
        ],
        next={"h": "h2"},
    )
    return GraphSpec(
        [
            NodeSpec("loop", "scan", ["h0", "xs"], body=body, results={"hs": "h2"}),
            NodeSpec("d", "detach", ["hs"]),
            NodeSpec("loss", expr="sum(hs * hs) + sum(d)"),
        ],
        ["loss"],
    )


LOOP_INPUTS = {
    "h0": np.linspace(-1, 1, 3),
    "xs": np.linspace(0.5, 1, 12).reshape(4, 3),
    "i": np.array([2, 0]),
}


def _loop_program(**kw: Any) -> Program:
    specs = _specs(LOOP_INPUTS, ["h0", "xs"])
    return compile_graph(_loop_graph("i"), specs, **kw)


@pytest.mark.parametrize("path", [{"no_grad": True}, {}, {"backward": True}])
def test_an_error_names_the_node_and_op_the_compiled_program_names(path: dict[str, Any]) -> None:
    fresh = _loop_program(**path)
    loaded = round_trip(fresh)
    run_both(fresh, loaded, LOOP_INPUTS)  # (good indices: the same results)
    bad = {**LOOP_INPUTS, "i": np.array([2, 7])}
    with pytest.raises(GradserveError) as info:
        run_both(fresh, loaded, bad)  # (and the same error, from inside the loop's body)
    assert (info.value.node, info.value.op) == ("p", "gather")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        run_both(fresh, loaded, LOOP_INPUTS, cancel=cancel)


# ---------------------------------------------------------------- values, bytes, refusals


def test_values_keep_their_exact_types() -> None:
    """Literals and attributes: bool, int and float apart, -0.0, NaN and infinities,
    integers past 64 bits, tuples and lists, None, strings, dicts."""
    from gradserve.engine.graph.serial import _decode, _encode

    values = [
        True,
        0,
        1,
        -0.0,
        0.0,
        float("nan"),
        float("inf"),
        -float("inf"),
        1e-310,
        2**70,
        -(2**63),
        None,
        "s",
        [1, [2.0, (3,)]],
        (),
        {"a": (1, None), 2: [False]},
    ]
    for v in values:
        assert same(_decode(orjson.loads(orjson.dumps(_encode(v)))), v), v
    nan = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    assert struct.pack("<d", _decode(_encode(nan))) == struct.pack("<d", nan)  # (its payload)
    with pytest.raises(Unstorable):
        _encode({1, 2})


def test_what_the_format_cannot_express_is_unstorable() -> None:
    program = _loop_program(backward=True)
    step = next(s for s in program.steps if s.op is not SCAN and s.attrs)
    step.attrs = {**step.attrs, "extra": object()}
    with pytest.raises(Unstorable):
        dump_program(program)


def test_a_loaded_program_keeps_no_reference_to_the_buffer_it_came_from() -> None:
    data = bytearray(dump_program(_loop_program(backward=True)))
    view = memoryview(data)
    loaded = load_program(view)
    view.release()
    data[:] = bytes(len(data))  # (a store reusing the memory)
    run_both(_loop_program(backward=True), loaded, LOOP_INPUTS)


# ---------------------------------------------------------------- damage


@pytest.fixture(scope="module")
def small() -> bytes:
    """A small program with a loop, a literal, a detach and a backward."""
    data = dump_program(_loop_program(backward=True))
    assert frame(*split(data)) == data
    return data


def test_every_truncation_and_an_extension_are_corrupt(small: bytes) -> None:
    for length in range(len(small)):
        corrupt(small[:length])
    corrupt(small + b"\0")
    corrupt(b"")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_flipped_bytes_are_corrupt(small: bytes, data: st.DataObject) -> None:
    damaged = bytearray(small)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(small) - 1))
        damaged[at] ^= data.draw(st.integers(1, 255))
    if bytes(damaged) != small:
        corrupt(bytes(damaged))


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _replace(header: Any, path: tuple[Any, ...], value: Any) -> Any:
    header = orjson.loads(orjson.dumps(header))  # (a copy)
    inner = header
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return header


def test_a_header_with_a_value_of_no_type_it_takes_is_corrupt(small: bytes) -> None:
    """Every leaf of the header replaced by an object with an unknown tag (JSON objects are
    never plain values): each is a CorruptProgram, with a matching checksum."""
    header, columns = split(small)
    for path in _leaves(header):
        corrupt(frame(_replace(header, path, {"?": 1}), columns))


def _loads_or_corrupt(data: bytes) -> None:
    """CorruptProgram, or a program that plans, draws and runs (or refuses the inputs) like
    any other: never another exception. Checked step by step or a column at a time, the
    verdict is the same, and so is the program."""
    loaded = []
    for how in CHECKS:
        with checked_by(how):
            try:
                loaded.append(load_program(data))
            except CorruptProgram:
                continue
        program = loaded[-1]
        planned_steps(program)
        program_dot(program, 1 << 30)
        with contextlib.suppress(GradserveError):
            execute(program, LOOP_INPUTS)
    assert len(loaded) in (0, len(CHECKS))
    assert len({dump_program(program) for program in loaded}) <= 1


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_header_value_loads_or_is_corrupt(small: bytes, data: st.DataObject) -> None:
    header, columns = split(small)
    path = data.draw(st.sampled_from(list(_leaves(header))))
    value = data.draw(
        st.sampled_from(
            [
                None,
                True,
                False,
                0,
                1,
                -1,
                2,
                7,
                10**6,
                2**40,
                -(2**63),
                0.5,
                float("1e308"),
                "",
                "x",
                "scan",
                "float64",
                [],
                [0],
                [1, 2],
            ]
        )
    )
    _loads_or_corrupt(frame(_replace(header, path, value), columns))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_garbage_in_the_columns_loads_or_is_corrupt(small: bytes, data: st.DataObject) -> None:
    header, columns = split(small)
    damaged = bytearray(columns)
    at = data.draw(st.integers(0, len(columns) - 1))
    garbage = data.draw(st.binary(min_size=1, max_size=16))
    damaged[at : at + len(garbage)] = garbage
    _loads_or_corrupt(frame(header, bytes(damaged[: len(columns)])))


def test_the_columns_all_garbage_is_corrupt(small: bytes) -> None:
    header, columns = split(small)
    rng = np.random.default_rng(5)
    for _ in range(50):
        corrupt(frame(header, rng.integers(0, 256, len(columns), np.uint8).tobytes()))


def _header_of(small: bytes, change: Callable[[Any], None]) -> bytes:
    header, columns = split(small)
    change(header)
    return frame(header, columns)


def _format_of(header: Any, column: int, fmt: str) -> None:
    """Column `column` of the top program read in another format (the same size)."""
    table = header["programs"][0]["columns"]
    assert struct.calcsize(table[0][column]) == struct.calcsize(fmt)
    table[0] = table[0][:column] + fmt + table[0][column + 1 :]


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h["signatures"][0].__setitem__(0, "no_such_op"),
        lambda h: h["kinds"].__setitem__(0, "sideways"),
        lambda h: h["metas"].__setitem__(0, [[-1], "float64", False]),
        lambda h: h["metas"].__setitem__(0, [[3], "float128", False]),
        lambda h: h["programs"][0]["columns"][2].__setitem__(3, 10**9),
        lambda h: _format_of(h, 3, "?"),
        lambda h: _format_of(h, 3, "b"),
        lambda h: h["programs"][0]["outputs"].__setitem__(0, ["loss", 10**6]),
        lambda h: h["programs"][0].__setitem__("no_grad", 1),
        lambda h: h["programs"][0]["loops"][0].__setitem__(1, 0),
        lambda h: h["programs"][2]["body"]["closures"].__setitem__(1, 0),
        lambda h: h["programs"][0]["loops"][1][2].__setitem__(
            0, h["programs"][0]["loops"][0][2][0]
        ),
        lambda h: h["programs"][1]["outputs"].pop(),
        lambda h: h["programs"].append(h["programs"][1]),
        lambda h: h["signatures"][0][4].append([[], "float64", False]),
        lambda h: h["signatures"][0][4].append(2.5),
        lambda h: h["signatures"].append(h["signatures"][0]),
        lambda h: h.__setitem__("programs", []),
        lambda h: h.pop("metas"),
    ],
    ids=[
        "unknown op",
        "unknown kind",
        "negative dim",
        "unknown dtype",
        "column past the end",
        "column dtype",
        "column signed",
        "output slot",
        "flag type",
        "loop into itself",
        "a body's closure not its input",
        "a loop's result twice",
        "a body's result not its output",
        "body twice",
        "signature arity",
        "a literal more",
        "a signature no step has",
        "no program",
        "no metas",
    ],
)
def test_a_header_that_is_wrong_is_corrupt(small: bytes, change: Callable[[Any], None]) -> None:
    corrupt(_header_of(small, change))


@pytest.fixture(scope="module")
def checkpointed() -> bytes:
    """The small program with its loop checkpointed every 2 steps."""
    program = _loop_program(backward=True)
    assert checkpoint_every(program, 2, ufuncs=True)
    program.run = bind(program)
    return dump_program(program)


def _body_of(header: Any, record: int) -> Any:
    return header["programs"][record]["body"]


@pytest.mark.parametrize(
    "change",
    [
        lambda h: _body_of(h, 2).__setitem__("shifted", [[2, 0]]),
        lambda h: _body_of(h, 2).__setitem__("shifted", [[9, 1]]),
        lambda h: _body_of(h, 2).__setitem__("shifted", [[2]]),
    ],
    ids=["shifted onto another meta", "shifted past the sequences", "shifted not a pair"],
)
def test_a_shifted_sequence_that_is_wrong_is_corrupt(
    small: bytes, change: Callable[[Any], None]
) -> None:
    corrupt(_header_of(small, change))


@pytest.mark.parametrize(
    "change",
    [
        lambda h: _body_of(h, 2).__setitem__("replay", -1),
        lambda h: _body_of(h, 2).__setitem__("replay", 14),
        lambda h: _body_of(h, 2).__setitem__("replay", True),
        lambda h: _body_of(h, 1).__setitem__("every", 0),
        lambda h: _body_of(h, 1).__setitem__("every", 3),
        lambda h: _body_of(h, 1).__setitem__("every", 5),
        lambda h: _body_of(h, 1)["replayed"].pop(),
        lambda h: _body_of(h, 2).__setitem__("shifted", [[0, 0]]),
        lambda h: _body_of(h, 2).__setitem__("reverse", False),
    ],
    ids=[
        "no replay",
        "replays itself",
        "replay not an int",
        "no segments",
        "other segments",
        "segments past the end",
        "a value not replayed",
        "shifted too",
        "the same way",
    ],
)
def test_a_checkpointed_loop_that_is_wrong_is_corrupt(
    checkpointed: bytes, change: Callable[[Any], None]
) -> None:
    load_program(checkpointed)
    corrupt(_header_of(checkpointed, change))


def _column(header: Any, record: int, name: str) -> tuple[int, str, int]:
    """Where column `name` of program `record` starts among the columns, its format and
    its count."""
    formats, at, counts = header["programs"][record]["columns"]
    for fmt, count, column in zip(formats, counts, serial._COLUMNS, strict=True):
        if column == name:
            return at, fmt, count
        at += count * struct.calcsize(fmt)
        at += -at % 8
    raise KeyError(name)


def test_a_step_that_frees_a_slot_twice_is_corrupt(small: bytes) -> None:
    """(Twice at one step: a column at a time, the step a slot goes at is the same.)"""
    header, columns = split(small)
    for record in range(len(header["programs"])):
        counts = _ints_of(header, columns, record, "nfrees")
        if max(counts) < 2:
            continue
        first = sum(counts[: counts.index(max(counts))])
        at, fmt, _ = _column(header, record, "frees")
        size = struct.calcsize(fmt)
        damaged = bytearray(columns)
        damaged[at + size * (first + 1) : at + size * (first + 2)] = columns[
            at + size * first : at + size * (first + 1)
        ]
        corrupt(frame(header, bytes(damaged)))
        return
    raise AssertionError("no step frees two slots")


def test_reading_a_result_the_loop_does_not_make_is_corrupt(small: bytes) -> None:
    """A loop writes only the results its body is planned for (`wanted`): its first result
    here (the final carry, of the meta of the slot the last step reads last) is never
    written, and a step that reads it is corrupt."""
    header, columns = split(small)
    step, body, _ = header["programs"][0]["loops"][0]
    assert header["programs"][body]["body"]["wanted"][0] is False
    unmade = _ints_of(header, columns, 0, "out")[step]
    slots = _ints_of(header, columns, 0, "slots")
    metas = _ints_of(header, columns, 0, "meta")
    assert metas[slots[-1]] == metas[unmade] and slots[-1] != unmade
    at, fmt, count = _column(header, 0, "slots")
    damaged = bytearray(columns)
    struct.pack_into(f"<{fmt}", damaged, at + struct.calcsize(fmt) * (count - 1), unmade)
    corrupt(frame(header, bytes(damaged)))


def _ints_of(header: Any, columns: bytes, record: int, name: str) -> list[int]:
    at, fmt, count = _column(header, record, name)
    return list(struct.unpack_from(f"<{count}{fmt}", columns, at))


def test_a_signature_that_is_not_text_is_corrupt(small: bytes) -> None:
    header, columns = split(small)
    signatures = [orjson.dumps(s).decode() for s in header["signatures"]]
    for value in (header["signatures"][0], None, 0):
        text = orjson.dumps({**header, "signatures": [value, *signatures[1:]]})
        rest = struct.pack("<I", len(text)) + text + bytes(-(4 + len(text)) % 8) + columns
        corrupt(struct.pack("<8sIIQ", MAGIC, FORMAT_VERSION, zlib.crc32(rest), len(rest)) + rest)


def test_another_format_version_or_magic_is_corrupt(small: bytes) -> None:
    corrupt(small[:8] + struct.pack("<I", FORMAT_VERSION + 1) + small[12:])
    corrupt(b"X" + small[1:])
