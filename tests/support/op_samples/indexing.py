"""Samples for the indexing group: slice, index_select, gather, scatter_add."""

from typing import Any

import numpy as np

from gradserve.engine.errors import AttributeError_, DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, ints, randn

SAMPLES = {
    "slice": [
        Sample([randn(5, 3)], {"dim": 0, "start": 1, "stop": 4}, id="basic"),
        Sample([randn(3, 7)], {"dim": 1, "start": 1, "stop": 6, "step": 2}, id="step"),
        Sample([randn(3, 8)], {"dim": -1, "step": 3}, id="step-to-end"),
        Sample([randn(6)], {"dim": 0, "start": -3}, id="negative-start"),
        Sample([randn(6, 2)], {"dim": 0, "start": -100, "stop": -2}, id="negative-stop"),
        Sample([randn(4, 3)], {"dim": 0, "start": 2, "stop": 100}, id="clamped-stop"),
        Sample([randn(4, 3)], {"dim": 1, "start": 2, "stop": 1}, id="empty"),
        Sample([randn(4, 3)], {"dim": 0, "start": 5}, id="empty-past-end"),
        Sample([randn(2, 1, 3)], {"dim": 1}, id="size-1"),
        Sample([np.arange(10)], {"dim": 0, "start": 1, "step": 4}, grad=False, id="int"),
    ],
    "index_select": [
        Sample([randn(4, 3), ints(0, 4, 5)], {"dim": 0}, id="rows-repeated"),
        Sample([randn(2, 5, 3), np.array([4, 0, 4])], {"dim": -2}, id="negative-dim"),
        Sample([randn(3, 4), np.array(2)], {"dim": 1}, id="0d-index"),
        Sample([randn(3, 4), np.zeros(0, dtype=np.int64)], {"dim": 1}, id="empty-index"),
        Sample([randn(), np.array([0])], {"dim": 0}, id="scalar"),
        Sample([np.arange(6).reshape(2, 3), np.array([2, 2])], {"dim": 1}, grad=False, id="int"),
    ],
    "gather": [
        Sample(
            [randn(3, 4), np.array([[0, 0, 3], [1, 2, 1], [3, 3, 3]])], {"dim": 1}, id="repeated"
        ),
        Sample([randn(3, 4), np.array([[2, 0, 1, 2], [0, 0, 0, 0]])], {"dim": 0}, id="dim0"),
        Sample([randn(4, 5), np.array([[0, 4], [1, 1]])], {"dim": -1}, id="smaller-index"),
        Sample([randn(2, 3, 2), ints(0, 3, 2, 5, 2)], {"dim": 1}, id="3d-longer"),
        Sample([randn(), np.array(0)], {"dim": 0}, id="scalar"),
    ],
    "scatter_add": [
        Sample(
            [randn(3, 4), np.array([[0, 0, 3], [1, 1, 1]]), randn(2, 3)],
            {"dim": 1},
            id="accumulate",
        ),
        Sample(
            [randn(3, 2), np.array([[0, 1], [0, 0], [2, 0], [0, 2]]), randn(4, 2)],
            {"dim": 0},
            id="dim0-repeated",
        ),
        Sample([randn(2, 4), np.array([[3, 3]]), randn(2, 3)], {"dim": -1}, id="src-larger"),
        Sample([randn(), np.array(0), randn()], {"dim": 0}, id="scalar"),
        Sample(
            [np.zeros(4, dtype=np.int64), np.array([1, 1, 3]), np.array([5, 6, 7])],
            {"dim": 0},
            grad=False,
            id="int",
        ),
    ],
}


def _torch_slice(
    torch: Any, x: Any, dim: int, start: int = 0, stop: int | None = None, step: int = 1
) -> Any:
    return x[(slice(None),) * (dim % x.dim()) + (slice(start, stop, step),)]


TORCH = {
    "slice": _torch_slice,
    "index_select": lambda torch, x, index, dim: torch.index_select(x, dim, index),
    "gather": lambda torch, x, index, dim: torch.gather(x, dim, index),
    # src cut to the index's extent (all scatter_add reads): torch's own backward refuses a
    # larger src, ours gives its unread entries a zero gradient.
    "scatter_add": lambda torch, x, index, src, dim: torch.scatter_add(
        x, dim, index, src[tuple(slice(0, n) for n in index.shape)]
    ),
}

_FLOAT_INDEX = np.array([0.0, 1.0])

ERRORS = {
    "slice": [
        ErrorSample([randn(4)], {"dim": 0, "step": 0}, AttributeError_, r"step must be positive"),
        ErrorSample(
            [randn(4)], {"dim": 0, "step": -1}, AttributeError_, r"step must be positive, got -1"
        ),
        ErrorSample([randn(4)], {"dim": 1}, ShapeError, r"dim 1 is out of range"),
        ErrorSample([randn()], {"dim": 0}, ShapeError, r"cannot slice a 0-d tensor"),
    ],
    "index_select": [
        ErrorSample(
            [randn(3, 4), 1, np.array([0, 4])],
            {},
            ShapeError,
            r"index 4 is out of bounds for dim 1 with size 4",
        ),
        ErrorSample(
            [randn(3, 4), 0, np.array([-1])],
            {},
            ShapeError,
            r"index -1 is out of bounds for dim 0 with size 3",
        ),
        ErrorSample([randn(3, 4), 1, _FLOAT_INDEX], {}, DTypeError, r"integer tensor"),
        ErrorSample([randn(3, 4), 1, np.array([[0, 1]])], {}, ShapeError, r"0-d or 1-d"),
        ErrorSample([randn(3, 4), 2, np.array([0])], {}, ShapeError, r"dim 2 is out of range"),
        # Number literals (found by fuzzing the service: the forward read `.ndim` of an int).
        ErrorSample([randn(3, 4), 0, 1], {}, DTypeError, r"index must be a tensor, not a number"),
        ErrorSample([2.5, 0, np.array([0])], {}, DTypeError, r"input must be a tensor"),
    ],
    "gather": [
        ErrorSample(
            [randn(3, 4), 1, np.array([[0, 5]])],
            {},
            ShapeError,
            r"index 5 is out of bounds for dim 1 with size 4",
        ),
        ErrorSample([randn(3, 4), 1, np.array([[0.0, 1.0]])], {}, DTypeError, r"integer tensor"),
        ErrorSample(
            [randn(3, 4), 1, np.array([0, 1])],
            {},
            ShapeError,
            r"as many dims as the input, got \(2,\) and \(3, 4\)",
        ),
        ErrorSample([randn(), 0, 0], {}, DTypeError, r"index must be a tensor, not a number"),
        ErrorSample([True, 0, np.array(0)], {}, DTypeError, r"input must be a tensor"),
        ErrorSample(
            [randn(3, 4), 1, np.zeros((4, 1), dtype=np.int64)],
            {},
            ShapeError,
            r"no larger than the input \(3, 4\) apart from dim 1",
        ),
    ],
    "scatter_add": [
        ErrorSample(
            [randn(3, 4), 1, np.array([[0, 4]]), randn(1, 2)],
            {},
            ShapeError,
            r"index 4 is out of bounds for dim 1 with size 4",
        ),
        ErrorSample(
            [randn(3, 4), 1, np.array([[0.0, 1.0]]), randn(1, 2)], {}, DTypeError, r"integer tensor"
        ),
        ErrorSample(
            [randn(3, 4), 1, np.array([[0, 1, 2]]), randn(1, 2)],
            {},
            ShapeError,
            r"no larger than src \(1, 2\)",
        ),
        ErrorSample(
            [randn(3, 4), 1, np.array([[0, 1]]), np.ones((1, 2), dtype=np.int64)],
            {},
            DTypeError,
            r"src must have the input's dtype float64, got int64",
        ),
        ErrorSample([randn(), 0, np.array(0), 2.5], {}, DTypeError, r"src must be a tensor"),
        ErrorSample([randn(), 0, 0, randn()], {}, DTypeError, r"index must be a tensor"),
        ErrorSample([1.0, 0, np.array(0), 2.5], {}, DTypeError, r"input must be a tensor"),
    ],
}
