"""Shared by the tests (from tests/engine/test_xla.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from gradserve.engine.errors import Cancelled, DeadlineExceeded
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.xla import NotLowerable, lower

# What imports this needs the tier, and skips without jax (as tests/engine/test_xla.py does).
jax = pytest.importorskip("jax")

# The semantic tests compare values, not memory: XLA may hold them in any bytes.
UNBOUNDED = 1 << 60


TOLERANCE = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3}


def assert_equivalent(
    got: Any, expected: Any, what: str = "", tolerance: Mapping[str, float] = TOLERANCE
) -> None:
    """Shape and dtype exact; floats to the dtype's tolerance (relative, and absolute for
    values that cancel: XLA sums in another order), NaN and inf where the interpreter has
    them; everything else exact."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype), what
    tol = tolerance.get(expected.dtype.name)
    if tol is None:
        np.testing.assert_array_equal(got, expected, err_msg=what)
    else:
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, equal_nan=True, err_msg=what)


def assert_same_run(got: Any, expected: Any, tolerance: Mapping[str, float] = TOLERANCE) -> None:
    """Two results of one program (RunResults) agree: outputs and gradients."""
    assert got.outputs.keys() == expected.outputs.keys()
    for name, value in expected.outputs.items():
        assert_equivalent(got.outputs[name], value, f"output {name!r}", tolerance)
    assert (got.gradients is None) == (expected.gradients is None)
    for name, value in (expected.gradients or {}).items():
        assert_equivalent(got.gradients[name], value, f"gradient {name!r}", tolerance)


def interpreter_then_tier(lowered: dict[int, Any]) -> Any:
    """`execute` as the suites call it, checked: the interpreter runs the program, then its
    lowering (cached in `lowered` by program) runs it twice with the same inputs: both runs
    equal the interpreter's, and each other, bit for bit; an error of the interpreter's is
    the tier's too. A refusal is allowed for a checkpointed loop (by design: the
    interpreter alone answers it), or for a program the interpreter fails too (the error
    is what the service answers)."""

    def both(
        program: Any,
        inputs: Mapping[str, Any],
        *,
        grad_outputs: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> Any:
        backend = program.run.backend
        host = {k: np.asarray(backend.to_host(a)) for k, a in inputs.items()}
        host_grads = (
            None
            if grad_outputs is None
            else {k: np.asarray(backend.to_host(a)) for k, a in grad_outputs.items()}
        )
        if id(program) not in lowered:
            try:
                lowered[id(program)] = (program, lower(program, budget=UNBOUNDED))
            except NotLowerable as refused:
                lowered[id(program)] = (program, refused)
        tier = lowered[id(program)][1]
        if isinstance(tier, NotLowerable):
            result = execute(program, inputs, grad_outputs=grad_outputs, **kw)
            assert "checkpointed loop" in str(tier), tier
            return result
        try:
            result = execute(program, inputs, grad_outputs=grad_outputs, **kw)
        except (DeadlineExceeded, Cancelled):
            raise  # (the run's time, not its values: the service kills the tier's likewise)
        except Exception as err:
            with pytest.raises(type(err)):
                tier.run(host, host_grads)
            raise
        first, second = tier.run(host, host_grads), tier.run(host, host_grads)
        interpreted = type(result)(**{**vars(result)})
        interpreted.outputs = {k: np.asarray(backend.to_host(v)) for k, v in result.outputs.items()}
        if result.gradients is not None:
            interpreted.gradients = {
                k: np.asarray(backend.to_host(v)) for k, v in result.gradients.items()
            }
        assert_same_run(first, interpreted)
        for name, value in first.outputs.items():
            assert value.tobytes() == second.outputs[name].tobytes()
        for name, value in (first.gradients or {}).items():
            assert value.tobytes() == second.gradients[name].tobytes()  # type: ignore[index]
        return result

    return both
