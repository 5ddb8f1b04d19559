"""A CPU backend on array-api-strict, which rejects anything outside the array API
standard: running the op suite on it shows the engine uses only portable calls (and
so that the CuPy path is not broken by a NumPy-only call), without a GPU."""

from __future__ import annotations

import math
from typing import Any

import array_api_strict as xps
import numpy as np

from gradserve.engine.backends.base import Backend, namespace_with


def _via_numpy(fn: Any) -> Any:
    """einsum and scatter_add are outside the standard: every backend brings its own."""

    def call(*args: Any) -> Any:
        host = [np.from_dlpack(a) if hasattr(a, "__dlpack__") else a for a in args]
        return xps.asarray(np.array(fn(*host), order="C"))  # keeps 0-d results 0-d

    return call


def make_strict_backend() -> Backend:
    from gradserve.engine.backends.numpy_backend import _scatter_add

    xp = namespace_with(
        xps,
        einsum=_via_numpy(lambda eq, *ops: np.einsum(eq, *ops)),
        scatter_add=_via_numpy(_scatter_add),
    )
    return Backend(
        nbytes=lambda a: math.prod(a.shape) * np.dtype(str(a.dtype).rpartition(".")[2]).itemsize,
        device="cpu",
        xp=xp,
        to_host=lambda a: np.from_dlpack(a).copy() if hasattr(a, "__dlpack__") else np.asarray(a),
        from_host=lambda a: xps.asarray(a),
    )
