"""Samples for every op of the catalog, one module per group.

Each group module defines three dicts keyed by op name:

- `SAMPLES[name]`: a list of `Sample`s — the tensor arguments (NumPy arrays or
  Python numbers) and the attributes. Float arrays become float64 tensors with
  requires_grad for the gradient checks (`grad=False` to skip those); they are
  kept inside the op's domain (positive for log, away from kinks).
- `TORCH[name]`: the same op in PyTorch, `fn(torch, *tensors, **attrs)`.
- `ERRORS[name]`: `ErrorSample`s — bad arguments with the error class and a regex
  that its message must match.

A meta-test fails when an op of the registry lacks any of the three.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradserve.engine.ops import GROUP_MODULES

RNG = np.random.default_rng(1234)


@dataclass
class Sample:
    args: list[Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    grad: bool = True  # run gradcheck and the torch gradient comparison
    fd: bool = True  # finite differences are valid here (False at a kink, e.g. relu at 0)
    second_order: bool = True  # compare the double backward with PyTorch's
    id: str = ""


@dataclass
class ErrorSample:
    args: list[Any]
    attrs: dict[str, Any]
    error: type[Exception]
    match: str


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def pos(*shape: int) -> np.ndarray:
    """Positive values, away from 0 (for log, sqrt, reciprocal)."""
    return RNG.uniform(0.5, 2.0, shape)


def ints(low: int, high: int, *shape: int) -> np.ndarray:
    return RNG.integers(low, high, shape, dtype=np.int64)


TorchFn = Callable[..., Any]


def _collect() -> tuple[dict[str, list[Sample]], dict[str, TorchFn], dict[str, list[ErrorSample]]]:
    samples: dict[str, list[Sample]] = {}
    torch_fns: dict[str, TorchFn] = {}
    errors: dict[str, list[ErrorSample]] = {}
    for group in GROUP_MODULES:
        module = importlib.import_module(f"tests.support.op_samples.{group}")
        samples.update(getattr(module, "SAMPLES", {}))
        torch_fns.update(getattr(module, "TORCH", {}))
        errors.update(getattr(module, "ERRORS", {}))
    return samples, torch_fns, errors


SAMPLES, TORCH, ERRORS = _collect()
