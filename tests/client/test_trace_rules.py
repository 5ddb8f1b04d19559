"""The tracer's static shapes and dtypes are the compiler's: walking the registry, every
sample (and error sample) of every op is traced (on the standard catalog, as `trace`
does without a server) and compiled, and the traced value's shape and dtype are the
program's, or both refuse. No PyTorch needed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradserve.client.trace import F, TracedTensor, TraceError, trace
from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import TensorSpec, compile_graph
from gradserve.engine.ops import OPS
from gradserve.service.schemas import Graph
from tests.support.op_samples import ERRORS, SAMPLES


def _cases() -> list[Any]:
    """Every op of the registry, each of its samples and error samples, with its float
    arrays in float64 and in float32 (promotion with literals differs between them)."""
    out = []
    for name in OPS:
        given = [(f"sample{k}", s.args, s.attrs) for k, s in enumerate(SAMPLES[name])]
        given += [(f"error{k}", e.args, e.attrs) for k, e in enumerate(ERRORS.get(name, []))]
        for label, args, attrs in given:
            for dtype in ("float64", "float32"):
                out.append(
                    pytest.param(
                        name,
                        args,
                        attrs,
                        dtype,
                        label.startswith("error"),
                        id=f"{name}-{label}-{dtype}",
                    )
                )
    return out


@pytest.mark.parametrize(("name", "args", "attrs", "dtype", "is_error"), _cases())
def test_traced_shapes_are_the_compilers(
    name: str, args: list[Any], attrs: dict[str, Any], dtype: str, is_error: bool
) -> None:
    arrays = {
        f"a{i}": a.astype(dtype) if a.dtype.kind == "f" else a
        for i, a in enumerate(args)
        if isinstance(a, np.ndarray)
    }
    seen: list[TracedTensor] = []

    def fn(**inputs: TracedTensor) -> Any:
        seen.append(
            getattr(F, name)(*[inputs.get(f"a{i}", a) for i, a in enumerate(args)], **attrs)
        )
        return seen[-1]

    try:
        graph = trace(fn, **{k: (a.shape, str(a.dtype)) for k, a in arrays.items()})
    except (TraceError, TypeError):
        # a call refused as it is made (as PyTorch's would be): no graph to compare, and
        # only an error sample may be refused
        assert is_error, f"the tracer refuses a valid sample of {name}"
        return
    try:
        traced: tuple[Any, str] | None = (seen[0].shape, seen[0].dtype)
    except TraceError:
        assert is_error, f"the tracer has no shape for a valid sample of {name}"
        traced = None
    specs = {k: TensorSpec(a.shape, str(a.dtype)) for k, a in arrays.items()}
    try:
        program = compile_graph(Graph.model_validate(graph), specs, no_grad=True)
    except GradserveError as exc:
        assert traced is None, f"the tracer says {traced}, the compiler refuses: {exc}"
        return
    meta = program.metas[dict(program.outputs)["out"]]
    assert traced == (meta.shape, meta.dtype), graph
