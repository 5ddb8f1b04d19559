"""Samples for the shape group: reshape, expand, squeeze, unsqueeze, flatten, cat, stack."""

import numpy as np

from gradserve.engine.errors import ArityError, AttributeError_, ShapeError
from tests.support.op_samples import ErrorSample, Sample, randn

SAMPLES = {
    "reshape": [
        Sample([randn(3, 4)], {"shape": [4, 3]}, id="matrix"),
        Sample([randn(2, 3, 4)], {"shape": [-1, 4]}, id="infer-dim"),
        Sample([randn()], {"shape": [1, 1]}, id="scalar"),
        Sample([randn(1)], {"shape": []}, id="to-scalar"),
        Sample([np.arange(6)], {"shape": [2, 3]}, grad=False, id="int"),
    ],
    "expand": [
        Sample([randn(3, 1)], {"shape": [3, 4]}, id="size-1"),
        Sample([randn(4)], {"shape": [2, 3, 4]}, id="new-dims"),
        Sample([randn(1, 3)], {"shape": [2, -1]}, id="keep-dim"),
        Sample([randn()], {"shape": [2, 2]}, id="scalar"),
    ],
    "squeeze": [
        Sample([randn(2, 1, 3, 1)], id="all"),
        Sample([randn(2, 1, 3)], {"dim": 1}, id="int"),
        Sample([randn(2, 1, 3, 1)], {"dim": -1}, id="negative"),
        Sample([randn(2, 1, 3)], {"dim": 0}, id="not-size-1"),
        Sample([randn(1, 2, 1, 1)], {"dim": [0, -1]}, id="list"),
        Sample([randn(1, 2)], {"dim": []}, id="empty-list"),
        Sample([randn()], {"dim": 0}, id="scalar"),
        Sample([randn(1)], id="to-scalar"),
        Sample([np.arange(3).reshape(3, 1)], grad=False, id="int"),
    ],
    "unsqueeze": [
        Sample([randn(2, 3)], {"dim": 0}, id="front"),
        Sample([randn(2, 3)], {"dim": 2}, id="back"),
        Sample([randn(2, 3)], {"dim": -1}, id="negative"),
        Sample([randn(2, 3)], {"dim": -3}, id="negative-front"),
        Sample([randn()], {"dim": 0}, id="scalar"),
    ],
    "flatten": [
        Sample([randn(2, 3, 4)], id="all"),
        Sample([randn(2, 3, 4)], {"start_dim": 1}, id="from-1"),
        Sample([randn(2, 3, 4, 5)], {"start_dim": 1, "end_dim": -2}, id="middle"),
        Sample([randn(2, 3, 4)], {"start_dim": 1, "end_dim": 1}, id="one-dim"),
        Sample([randn(2, 1, 3)], {"start_dim": -2}, id="size-1"),
        Sample([randn()], id="scalar"),
    ],
    "cat": [
        Sample([randn(2, 3), randn(4, 3)], id="dim0"),
        Sample([randn(2, 3), randn(2, 1), randn(2, 2)], {"dim": 1}, id="three"),
        Sample([randn(2, 3, 1), randn(2, 3, 2)], {"dim": -1}, id="negative"),
        Sample([randn(3)], id="single"),
        Sample([randn(2, 3), randn(0, 3)], id="empty"),
        Sample([np.arange(3), randn(2)], id="promote"),
        # PyTorch skips 1-d empty operands (shape (0,)), whatever the others' shapes.
        Sample([randn(0), randn(2, 3)], {"dim": 1}, id="skips-1d-empty"),
        Sample([randn(2, 2), randn(0), randn(1, 2)], id="skips-1d-empty-middle"),
        Sample([randn(0), randn(0)], id="all-1d-empty"),
    ],
    "stack": [
        Sample([randn(2, 3), randn(2, 3)], id="dim0"),
        Sample([randn(2, 3), randn(2, 3), randn(2, 3)], {"dim": 1}, id="three"),
        Sample([randn(2, 3), randn(2, 3)], {"dim": -1}, id="negative"),
        Sample([randn(), randn()], id="scalars"),
        Sample([np.arange(2), randn(2)], id="promote"),
    ],
}

TORCH = {
    "reshape": lambda torch, x, shape: torch.reshape(x, shape),
    "expand": lambda torch, x, shape: x.expand(*shape),
    "squeeze": lambda torch, x, **kw: torch.squeeze(x, **kw),
    "unsqueeze": lambda torch, x, dim: torch.unsqueeze(x, dim),
    "flatten": lambda torch, x, **kw: torch.flatten(x, **kw),
    "cat": lambda torch, *xs, dim=0: torch.cat(xs, dim),
    "stack": lambda torch, *xs, dim=0: torch.stack(xs, dim),
}

ERRORS = {
    "reshape": [
        ErrorSample([randn(3, 4)], {"shape": [5, 2]}, ShapeError, r"invalid for input of size 12"),
        ErrorSample([randn(3, 4)], {"shape": [-1, -1]}, ShapeError, r"only one dimension"),
    ],
    "expand": [
        ErrorSample([randn(3, 2)], {"shape": [3, 4]}, ShapeError, r"must match the existing size"),
        ErrorSample([randn(3, 2)], {"shape": [2]}, ShapeError, r"at least as many dims"),
    ],
    "squeeze": [
        ErrorSample([randn(2, 1)], {"dim": 2}, ShapeError, r"dim 2 is out of range"),
        ErrorSample([randn(1, 1)], {"dim": [0, -2]}, ShapeError, r"more than once"),
        ErrorSample([randn(2, 1)], {"dim": "a"}, AttributeError_, r"'dim' must be int\|ints"),
    ],
    "unsqueeze": [
        ErrorSample([randn(2, 3)], {"dim": 3}, ShapeError, r"dim 3 is out of range.*\[-3, 2\]"),
        ErrorSample([randn(2, 3)], {}, AttributeError_, r"missing required attribute 'dim'"),
    ],
    "flatten": [
        ErrorSample(
            [randn(2, 3, 4)],
            {"start_dim": 2, "end_dim": 1},
            ShapeError,
            r"start_dim 2 comes after end_dim 1",
        ),
        ErrorSample([randn(2, 3)], {"start_dim": 2}, ShapeError, r"dim 2 is out of range"),
    ],
    "cat": [
        ErrorSample(
            [randn(2, 3), randn(2, 4)],
            {},
            ShapeError,
            r"same shape except in dim 0, got \(2, 3\) and \(2, 4\)",
        ),
        ErrorSample([randn(2, 3), randn(3)], {"dim": 0}, ShapeError, r"\(2, 3\) and \(3,\)"),
        ErrorSample([randn(2), randn(2)], {"dim": 1}, ShapeError, r"dim 1 is out of range"),
        ErrorSample(
            [np.array(1.0), np.array(2.0)],
            {},
            ShapeError,
            r"zero-dimensional tensor \(at position 0\)",
        ),
        ErrorSample([], {}, ArityError, r"at least 1 tensor"),
        ErrorSample([randn(0), randn(2, 3)], {"dim": 2}, ShapeError, r"dim 2 is out of range"),
    ],
    "stack": [
        ErrorSample(
            [randn(2, 3), randn(2, 4)],
            {},
            ShapeError,
            r"equal size, but got \(2, 3\) at entry 0 and \(2, 4\) at entry 1",
        ),
        ErrorSample([randn(2), randn(2)], {"dim": 2}, ShapeError, r"dim 2 is out of range"),
        ErrorSample([], {}, ArityError, r"at least 1 tensor"),
        ErrorSample([randn(2), 2.0], {}, ShapeError, r"operand 1 is a number"),
    ],
}
