"""The XLA tier (engine.graph.xla) against the interpreter: every op sample forward, backward
and second order; every graph of the compiled and transforms suites, run twice through the
tier; what it refuses (an op without a lowering, memory over the plan); and gradserve
without jax."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradserve.engine.errors import ShapeError
from gradserve.engine.graph import BodySpec, GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import RECOMPUTE
from gradserve.engine.graph.xla import BOOKKEEPING_BYTES, NotLowerable, available, lower
from gradserve.engine.ops import OPS
from gradserve.engine.ops.registry import NOT_LOWERED
from tests.engine import test_compiled, test_objectives, test_transforms
from tests.support.loops import forced, rnn, rnn_arrays, specs
from tests.support.op_samples import Sample
from tests.support.ops import op_cases
from tests.support.programs import differentiated_twice, forward_program, with_gradients
from tests.support.remat import sin_chain
from tests.support.xla import (
    UNBOUNDED,
    assert_equivalent,
    assert_same_run,
    interpreter_then_tier,
)

pytestmark = pytest.mark.slow

jax = pytest.importorskip("jax")


def through_both(
    program: Any,
    arrays: Mapping[str, np.ndarray],
    grad_outputs: Mapping[str, np.ndarray] | None = None,
) -> None:
    expected = execute(program, arrays, grad_outputs=grad_outputs)
    assert_same_run(lower(program, budget=UNBOUNDED).run(arrays, grad_outputs), expected)


# ---------------------------------------------------------------- every op sample


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_forward_through_the_tier(name: str, sample: Sample, dtype: str) -> None:
    through_both(*forward_program(name, sample, dtype))


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_gradients_through_the_tier(name: str, sample: Sample) -> None:
    program, arrays, _, _ = with_gradients(name, sample)
    through_both(program, arrays)


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_second_order_through_the_tier(name: str, sample: Sample) -> None:
    program, arrays, _ = differentiated_twice(name, sample)
    through_both(program, arrays)


def _jax_has_a_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # (no GPU backend: the CPU build of jaxlib, or no device)
        return False


# On a GPU the lowering runs XLA's GPU kernels, against the interpreter on the CPU: within
# test_cuda's tolerances (other transcendental functions, other summation orders).
CUDA_TOLERANCE = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-9}


def _cuda_cases() -> list[Any]:
    """Every op sample forward (float32 and float64), and backward and second order where
    the op has a derivative: (what, name, sample)."""
    return [
        pytest.param(what, *case.values, id=f"{what}-{case.id}")
        for what, cases in (("forward", op_cases()), ("derivatives", op_cases(only_grad=True)))
        for case in cases
    ]


@pytest.mark.cuda
@pytest.mark.skipif(
    not _jax_has_a_gpu(), reason="JAX has no GPU here (the gpu extra's jax[cuda12], on a CUDA host)"
)
@pytest.mark.parametrize(("what", "name", "sample"), _cuda_cases())
def test_the_op_samples_through_the_tier_on_cuda(what: str, name: str, sample: Sample) -> None:
    """Lowered for cuda:0, against the interpreter on the CPU."""
    runs = (
        [forward_program(name, sample, dtype) for dtype in ("float32", "float64")]
        if what == "forward"
        else [with_gradients(name, sample)[:2], differentiated_twice(name, sample)[:2]]
    )
    for program, arrays in runs:
        expected = execute(program, arrays)
        assert_same_run(
            lower(program, "cuda:0", budget=UNBOUNDED).run(arrays), expected, CUDA_TOLERANCE
        )


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("source", ["float32", "float64"])
def test_floats_out_of_an_integer_range_cast_as_on_the_interpreter(source: str, dtype: str) -> None:
    """NaN, infinities and values out of range give the most negative integer, as NumPy
    and PyTorch on the CPU (XLA saturates, and gives 0 for NaN); not among the op samples,
    as CUDA converts them otherwise."""
    values = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 2.7, -2.7, 0.0])
    spec = GraphSpec([NodeSpec("y", "cast", ["x"], {"dtype": dtype})], ["y"])
    program = compile_graph(spec, {"x": TensorSpec(values.shape, source)})
    with np.errstate(invalid="ignore"):
        through_both(program, {"x": values.astype(source)})


# ---------------------------------------------------------------- the seed, and refusals


def seed_program(n: int = 3) -> Any:
    spec = GraphSpec([NodeSpec("z", expr="(x + y) * (x - y)")], ["z"])
    vector = TensorSpec((n,), "float64", True)
    return compile_graph(
        spec,
        {"x": vector, "y": vector},
        backward=True,
        grad_outputs={"z": TensorSpec((n,), "float64")},
    )


def test_the_seed_forward_and_backward_within_the_plan() -> None:
    program = seed_program()
    lowered = lower(program)
    assert 0 < lowered.memory_bytes <= program.planned_peak_bytes
    arrays, upstream = {"x": np.arange(3.0), "y": np.ones(3)}, {"z": np.ones(3)}
    result = lowered.run(arrays, upstream)
    np.testing.assert_array_equal(result.outputs["z"], [-1.0, 0.0, 3.0])
    np.testing.assert_array_equal(result.gradients["x"], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(result.gradients["y"], [-2.0, -2.0, -2.0])
    assert result.peak_bytes == lowered.memory_bytes
    assert result.planned_peak_bytes == program.planned_peak_bytes
    # An input that is not what was compiled: the interpreter's error, word for word.
    for wrong, upstream_given in (
        ({"x": np.arange(3), "y": np.ones(3)}, upstream),
        ({"x": np.ones(4), "y": np.ones(3)}, upstream),
        (arrays, {}),
    ):
        with pytest.raises(ShapeError) as interpreted:
            execute(program, wrong, grad_outputs=upstream_given)
        with pytest.raises(ShapeError) as tiered:
            lowered.run(wrong, upstream_given)
        assert str(tiered.value) == str(interpreted.value)
        assert "as compiled; got" in str(tiered.value)


def test_memory_over_the_plan_is_refused() -> None:
    program = seed_program(1000)
    with pytest.raises(NotLowerable, match=r"memory: XLA needs \d+ bytes, the plan \d+"):
        lower(program, budget=program.planned_peak_bytes // 4)
    program.planned_peak_bytes //= 4
    with pytest.raises(NotLowerable, match="memory"):
        lower(program)


def test_an_op_without_a_lowering_keeps_its_program_interpreted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(OPS["sub"], "lower", NOT_LOWERED)
    with pytest.raises(NotLowerable, match="op 'sub' has no lowering") as info:
        lower(seed_program())
    assert info.value.reason == "op 'sub' has no lowering"


def test_a_forward_that_does_not_trace_is_refused_naming_its_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def reads_the_data(xp: Any, a: Any, b: Any) -> Any:
        return a + b if bool(xp.all(a > 0)) else a - b

    monkeypatch.setattr(OPS["add"], "lower", reads_the_data)
    with pytest.raises(NotLowerable, match="op 'add' has no lowering: its forward does not"):
        lower(seed_program())


def test_an_index_out_of_range_is_the_interpreters_error_in_a_loop_too() -> None:
    """The range check reads the index: the tier defers it to the host, after the run."""
    pick = [NodeSpec("y", "index_select", ["x", "i"], {"dim": 0})]
    body = BodySpec(
        carry=["h"],
        xs=["j"],
        nodes=[NodeSpec("r", "index_select", ["x", "j"], {"dim": 0}), NodeSpec("h2", expr="h + r")],
        next={"h": "h2"},
    )
    loop = [NodeSpec("s", op="scan", args=["h0", "i"], body=body, results={"y": "h"})]
    x = np.arange(6.0).reshape(3, 2)
    for nodes, i in ((pick, np.array([2, 0])), (loop, np.array([[2], [0]]))):
        inputs = {
            "x": TensorSpec((3, 2), "float64"),
            "i": TensorSpec(i.shape, "int64"),
            "h0": TensorSpec((1, 2), "float64"),
        }
        program = compile_graph(GraphSpec(nodes, ["y"]), inputs)
        arrays = {"x": x, "i": i, "h0": np.zeros((1, 2))}
        through_both(program, arrays)
        lowered = lower(program, budget=UNBOUNDED)
        for bad in (3, -1):
            arrays["i"] = np.where(i == 0, bad, i)
            with pytest.raises(ShapeError) as interpreted:
                execute(program, arrays)
            with pytest.raises(ShapeError) as tiered:
                lowered.run(arrays)
            assert str(tiered.value) == str(interpreted.value)
            assert (tiered.value.node, tiered.value.op) == (
                interpreted.value.node,
                interpreted.value.op,
            )


def test_recomputed_values_are_the_plans() -> None:
    """A backward over its budget recomputes forward values (engine.graph.remat): XLA
    keeps them recomputed (not merged with the forward's), and they give the same."""
    spec = sin_chain(40)
    inputs = {"x": TensorSpec((1000,), "float64", True)}
    plain = compile_graph(spec, inputs, backward=True)
    program = compile_graph(
        spec,
        inputs,
        backward=True,
        limits=Limits(memory_budget_bytes=plain.planned_peak_bytes // 3),
    )
    assert any(step.kind == RECOMPUTE for step in program.steps)
    lowered = lower(program)
    assert lowered.memory_bytes <= program.planned_peak_bytes < plain.planned_peak_bytes
    arrays = {"x": np.random.default_rng(0).standard_normal(1000)}
    assert_same_run(lowered.run(arrays), execute(program, arrays))


def test_the_recurrent_cell_tiers_up_within_the_plan() -> None:
    """bench.workloads' 24-step cell: XLA's defaults hold every term of dW and dU at once
    (79,532 bytes against a plan of 34,692); `lower` compiles it again with the memory-
    optimized scheduler and no fusion, which keeps to the plan, and it gives the same. (It
    is not rolled: its steps read an input each.)"""
    from bench.harness import compile_request
    from bench.workloads import recurrent_cell

    cell = recurrent_cell()
    program = compile_request(cell.graph, cell.inputs, cell.wrt)
    lowered = lower(program)
    assert not lowered.rolled
    assert lowered.memory_bytes <= program.planned_peak_bytes + BOOKKEEPING_BYTES
    got, expected = lowered.run(cell.inputs), execute(program, cell.inputs)
    assert_equivalent(got.outputs["loss"], expected.outputs["loss"])
    for name, value in expected.gradients.items():  # (24 steps in float32: to their scale)
        np.testing.assert_allclose(
            got.gradients[name], value, rtol=1e-5, atol=1e-5 * np.abs(value).max(), err_msg=name
        )


def test_a_long_unrolled_chain_is_compiled_as_a_loop() -> None:
    """A 200-step chain as define-by-run records it: XLA compiles one step of it, within the
    plan (its executable stored and loaded as rolled), and answers as the interpreter
    does; unrolled (`roll=False`) it compiles its 2,400 steps."""
    nodes = [NodeSpec(f"h{i}", expr=f"tanh(h{i - 1} * w + x) * 0.5") for i in range(1, 201)]
    spec = GraphSpec([*nodes, NodeSpec("loss", "sum", ["h200"])], ["loss"])
    vector = TensorSpec((8,), "float64", True)
    program = compile_graph(spec, {"h0": vector, "w": vector, "x": vector}, backward=True)
    lowered = lower(program)
    assert lowered.rolled and not lower(program, roll=False).rolled
    assert lowered.memory_bytes <= program.planned_peak_bytes + BOOKKEEPING_BYTES
    rng = np.random.default_rng(5)
    arrays = {k: rng.standard_normal(8) for k in ("h0", "w", "x")}
    expected = execute(program, arrays)
    got = lowered.run(arrays)
    np.testing.assert_allclose(got.outputs["loss"], expected.outputs["loss"], rtol=1e-12)
    for name, value in expected.gradients.items():
        np.testing.assert_allclose(got.gradients[name], value, rtol=1e-10, atol=1e-14)
    payload, meta = lowered.export()
    loaded = type(lowered).load(program, payload, meta)
    assert loaded.rolled
    np.testing.assert_array_equal(loaded.run(arrays).outputs["loss"], got.outputs["loss"])


def test_gradbenchs_gmm_tiers_up_within_the_plan() -> None:
    """bench.workloads' gmm (GradBench's medium size): with YNNPACK's reductions XLA holds
    a recomputed f64[1000,25,10] more than the plan (8,338,384 bytes against 8,130,408);
    `lower` compiles it again with XLA's own reductions, which keeps within the plan, and
    it gives the same."""
    from bench.harness import compile_request
    from bench.workloads import gmm

    w = gmm()
    program = compile_request(w.graph, w.inputs, w.wrt)
    lowered = lower(program)
    assert lowered.memory_bytes <= program.planned_peak_bytes + BOOKKEEPING_BYTES
    assert_same_run(lowered.run(w.inputs), execute(program, w.inputs))


def test_a_long_loop_does_not_scan_over_its_indices() -> None:
    """A 1,000-step loop counts its rows in the carry: an arange of the loop's length
    scanned over was 8,000 bytes beyond the plan."""
    arrays = rnn_arrays(1000)
    program = compile_graph(rnn(True), specs(arrays, list(arrays)), backward=True)
    lowered = lower(program)
    assert lowered.memory_bytes <= program.planned_peak_bytes + BOOKKEEPING_BYTES
    assert_same_run(lowered.run(arrays), execute(program, arrays))


def test_a_checkpointed_loop_is_refused() -> None:
    arrays = rnn_arrays(12)
    program = forced(rnn(False), specs(arrays, list(arrays)), 4, backward=True)
    with pytest.raises(NotLowerable, match="op 'scan': a checkpointed loop"):
        lower(program, budget=UNBOUNDED)


def test_gradserve_imports_and_runs_without_jax() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["jax"] = None  # an import of jax raises ImportError
        import numpy as np
        from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph
        from gradserve.engine.graph import xla
        from gradserve.engine.graph.executor import execute
        vector = TensorSpec((3,), "float64", True)
        program = compile_graph(GraphSpec([NodeSpec("z", expr="(x + y) * (x - y)")], ["z"]),
                                {"x": vector, "y": vector}, backward=True,
                                grad_outputs={"z": TensorSpec((3,), "float64")})
        assert not xla.available()
        try:
            xla.lower(program)
        except xla.NotLowerable as err:
            assert "jax cannot be imported" in err.reason, err.reason
        else:
            raise AssertionError("lowered without jax")
        r = execute(program, {"x": np.ones(3), "y": np.ones(3)}, grad_outputs={"z": np.ones(3)})
        assert r.gradients["x"].tolist() == [2.0, 2.0, 2.0]
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert available()


# What every worker does: load an executable another process (the lowering process)
# compiled, and run it. The LAPACK ops' kernels find LAPACK only where jax has been asked to.
_LOAD_IN_A_NEW_PROCESS = """
import pickle, sys
import numpy as np
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.xla import Lowered
from tests.support.ops import op_cases
from tests.support.programs import with_gradients
from tests.support.xla import assert_same_run
payloads = pickle.load(open(sys.argv[1], "rb"))
for case in op_cases(only_grad=True):
    name, sample = case.values
    if case.id in payloads:
        program, arrays, _, _ = with_gradients(name, sample)
        loaded = Lowered.load(program, *payloads[case.id])
        assert_same_run(loaded.run(arrays), execute(program, arrays))
print("ok", len(payloads))
"""


def test_an_executable_loaded_by_another_process_runs_the_lapack_ops(tmp_path: Path) -> None:
    """det, inv and solve (and their gradients), lowered here and loaded and run in a new
    process, as the lowering process and a worker do: the answers are the interpreter's
    (before LAPACK was looked up on load, such a worker died of SIGSEGV)."""
    payloads = {}
    for case in op_cases(only_grad=True):
        name, sample = case.values
        if name in ("det", "inv", "solve"):
            program, _, _, _ = with_gradients(name, sample)
            payloads[case.id] = lower(program, budget=UNBOUNDED).export()
    assert {k.split("-")[0] for k in payloads} == {"det", "inv", "solve"}
    (tmp_path / "payloads").write_bytes(pickle.dumps(payloads))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(tmp_path / "payloads")],
        capture_output=True,
        text=True,
        check=False,
        cwd=root,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["ok", str(len(payloads))]


# ---------------------------------------------------------------- the suites' graphs, twice


def _suite_tests() -> dict[str, Any]:
    """The whole-graph tests of the compiled, objectives and transforms suites (not the op
    samples', which run above): each runs here again with every program it executes also
    run twice through the tier (`tier_too`)."""
    per_sample = {
        "test_forward_is_the_eager_forward",
        "test_gradients_are_the_eager_gradients_and_torch",
        "test_second_order_by_differentiating_the_program_twice",
    }
    return {
        f"{name}_twice_through_the_tier": fn
        for module in (test_compiled, test_objectives, test_transforms)
        for name, fn in vars(module).items()
        if name.startswith("test_") and callable(fn) and name not in per_sample
    }


globals().update(_suite_tests())


@pytest.fixture(autouse=True)
def tier_too(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For the suites' tests: `execute` is `interpreter_then_tier`'s."""
    if request.function.__module__ == __name__:
        yield
        return
    both = interpreter_then_tier({})
    for module in (test_compiled, test_objectives, test_transforms):
        monkeypatch.setattr(module, "execute", both)
    yield
