"""Shared by the tests (from tests/engine/test_ops.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

try:
    import torch
except ImportError:  # (the test extra has it; the tests that need it say so)
    torch = None

import gradserve.engine as engine
from gradserve.engine._tensor import apply
from gradserve.engine.ops import OPS
from tests.support.op_samples import SAMPLES, Sample


def op_cases(only_grad: bool = False, finite_differences: bool = False) -> list[Any]:
    out = []
    for name, samples in sorted(SAMPLES.items()):
        for k, s in enumerate(samples):
            if only_grad and not (s.grad and OPS[name].differentiable):
                continue
            if finite_differences and not s.fd:
                continue
            out.append(pytest.param(name, s, id=f"{name}-{s.id or k}"))
    return out


def is_float_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind == "f"


def engine_args(name: str, s: Sample, dtype: str, grad: bool) -> list[Any]:
    op = OPS[name]
    return [
        engine.tensor(
            a,
            dtype=dtype if is_float_array(a) else None,
            requires_grad=grad and is_float_array(a) and op.arg_differentiable(i),
        )
        if isinstance(a, np.ndarray)
        else a
        for i, a in enumerate(s.args)
    ]


def torch_args(name: str, s: Sample, dtype: str, grad: bool) -> list[Any]:
    op = OPS[name]
    return [
        torch.tensor(
            a,
            dtype=getattr(torch, dtype) if is_float_array(a) else None,
            requires_grad=grad and is_float_array(a) and op.arg_differentiable(i),
        )
        if isinstance(a, np.ndarray)
        else a
        for i, a in enumerate(s.args)
    ]


def run(name: str, args: list[Any], attrs: dict[str, Any]) -> engine.Tensor:
    op = OPS[name]
    return apply(op, args, op.bind_attrs(attrs))
