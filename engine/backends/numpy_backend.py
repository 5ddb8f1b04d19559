"""The CPU backend: NumPy 2, whose main namespace follows the array API standard."""

from __future__ import annotations

import numpy as np

from gradserve.engine.backends.base import Array, Backend, namespace_with


def _scatter_add(x: Array, dim: int, index: Array, src: Array) -> Array:
    out = x.copy()
    # Unbuffered add: repeated indices accumulate, as torch.scatter_add does.
    grid = list(np.indices(index.shape, sparse=True))
    grid[dim] = index
    np.add.at(out, tuple(grid), src[tuple(slice(0, n) for n in index.shape)])
    return out


def make_numpy_backend() -> Backend:
    xp = namespace_with(
        np,
        # Path optimisation: two-operand contractions go to BLAS where they can.
        einsum=lambda eq, *ops: np.einsum(eq, *ops, optimize=True),
        scatter_add=_scatter_add,
    )
    # A graph run on the CPU computes as PyTorch does: inf and NaN results without
    # RuntimeWarnings (NumPy's error state is per context, so this touches no other code).
    return Backend(
        device="cpu",
        xp=xp,
        to_host=np.asarray,
        from_host=lambda a: a,
        activate=lambda: np.errstate(all="ignore"),
        ufuncs=np,
    )
