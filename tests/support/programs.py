"""Shared by the tests (from tests/engine/test_compiled.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradserve.engine.graph.autodiff import vjp
from gradserve.engine.graph.builder import Builder, Sym
from gradserve.engine.graph.compiler import assemble
from gradserve.engine.ops import OPS
from gradserve.engine.ops.registry import Meta
from tests.support.op_samples import Sample
from tests.support.ops import is_float_array


def _program_inputs(
    name: str, sample: Sample, dtype: str
) -> tuple[Builder, list[Any], dict[str, Sym], dict[str, np.ndarray]]:
    """A builder holding the sample's arrays as program inputs (floats in `dtype`), and the
    op's arguments: those inputs' Syms, and the literals as they are."""
    b = Builder()
    args: list[Any] = []
    syms: dict[str, Sym] = {}
    arrays: dict[str, np.ndarray] = {}
    for i, a in enumerate(sample.args):
        if isinstance(a, np.ndarray):
            array = a.astype(dtype) if is_float_array(a) else a
            sym = b.value(Meta(array.shape, str(array.dtype)))
            syms[f"a{i}"], arrays[f"a{i}"] = sym, array
            args.append(sym)
        else:
            args.append(a)
    return b, args, syms, arrays


def _differentiable(name: str, sample: Sample, syms: dict[str, Sym]) -> list[str]:
    op = OPS[name]
    return [
        k
        for k, s in syms.items()
        if s.dtype.startswith("float") and op.arg_differentiable(int(k[1:]))
    ]


def forward_program(name: str, sample: Sample, dtype: str) -> tuple[Any, dict[str, np.ndarray]]:
    """The op on the sample's arguments as a program of one step, and its inputs."""
    op = OPS[name]
    b, args, syms, arrays = _program_inputs(name, sample, dtype)
    out = b.emit(op, args, op.bind_attrs(sample.attrs))
    return assemble(b, syms, {"out": out}), arrays


def with_gradients(
    name: str, sample: Sample
) -> tuple[Any, dict[str, np.ndarray], list[str], np.ndarray]:
    """The op and its VJP with upstream `v` as one program, in float64."""
    op = OPS[name]
    b, args, syms, arrays = _program_inputs(name, sample, "float64")
    wrt = _differentiable(name, sample, syms)
    if not wrt:
        pytest.skip("no differentiable float input in this sample")
    out = b.emit(op, args, op.bind_attrs(sample.attrs))
    v = b.value(out.meta)
    grads = vjp(b, list(b.steps), [(out.slot, v)], [syms[k].slot for k in wrt])
    outputs = {"out": out, **{f"d{k}": g for k, g in zip(wrt, grads, strict=True) if g is not None}}
    program = assemble(b, {**syms, "v": v}, outputs)
    upstream = np.random.default_rng(7).standard_normal(out.shape).astype(out.dtype)
    arrays["v"] = upstream
    return program, arrays, wrt, upstream


def differentiated_twice(name: str, sample: Sample) -> tuple[Any, dict[str, np.ndarray], list[str]]:
    """d/dx ⟨∂f/∂x · v, w⟩ as a program (the derived backward differentiated again), its
    inputs, and the arguments it differentiates."""
    op = OPS[name]
    b, args, syms, arrays = _program_inputs(name, sample, "float64")
    wrt = _differentiable(name, sample, syms)
    if not wrt:
        pytest.skip("no differentiable float input in this sample")
    rng = np.random.default_rng(11)
    out = b.emit(op, args, op.bind_attrs(sample.attrs))
    v = b.value(out.meta)
    ws = {k: b.value(syms[k].meta) for k in wrt}
    firsts = vjp(b, list(b.steps), [(out.slot, v)], [syms[k].slot for k in wrt], create_graph=True)
    total: Any = b.constant(0.0, "float64")
    for k, g in zip(wrt, firsts, strict=True):
        if g is not None:
            total = total + b.call("sum", g * ws[k])
    seconds = vjp(
        b, list(b.steps), [(total.slot, b.constant(1.0, "float64"))], [syms[k].slot for k in wrt]
    )
    outputs = {f"d{k}": g for k, g in zip(wrt, seconds, strict=True) if g is not None}
    if not outputs:
        outputs = {"total": total}
    program = assemble(b, {**syms, "v": v, **{f"w{k}": w for k, w in ws.items()}}, outputs)
    arrays["v"] = rng.standard_normal(out.shape).astype(out.dtype)
    arrays.update({f"w{k}": rng.standard_normal(syms[k].shape) for k in wrt})
    return program, arrays, wrt
