"""Samples for matmul, einsum, transpose, permute, det, inv, solve, cross."""

from typing import Any

import numpy as np

from gradserve.engine.errors import ArityError, AttributeError_, DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, ints, randn


def well_conditioned(*shape: int) -> np.ndarray:
    """Random square matrices plus 3 I: far from singular."""
    return randn(*shape) + 3.0 * np.eye(shape[-1])


SAMPLES = {
    "matmul": [
        Sample([randn(3, 4), randn(4, 2)], id="matrices"),
        Sample([randn(4), randn(4)], id="dot"),
        Sample([randn(3, 4), randn(4)], id="matrix-vector"),
        Sample([randn(4), randn(4, 2)], id="vector-matrix"),
        Sample([randn(2, 3, 4), randn(4, 5)], id="batch-matrix"),
        Sample([randn(3, 4), randn(2, 4, 5)], id="matrix-batch"),
        Sample([randn(2, 1, 3, 4), randn(5, 4, 2)], id="batch-broadcast"),
        Sample([randn(2, 3, 4), randn(4)], id="batch-vector"),
        Sample([randn(4), randn(2, 4, 3)], id="vector-batch"),
        Sample([randn(1, 1), randn(1, 3)], id="size-1"),
        Sample([ints(-3, 3, 2, 3), ints(-3, 3, 3, 2)], grad=False, id="int"),
        Sample([randn(3, 0), randn(0)], id="empty-vector"),
        Sample([randn(0), randn(0, 2)], id="empty-vector-first"),
    ],
    "einsum": [
        Sample([randn(3, 4), randn(4, 2)], {"equation": "ij,jk->ik"}, id="matmul"),
        Sample([randn(3), randn(4)], {"equation": "i,j"}, id="outer-implicit"),
        Sample([randn(2, 3, 4), randn(2, 4, 5)], {"equation": "bij,bjk->bik"}, id="batched"),
        Sample([randn(3, 4)], {"equation": "ij->"}, id="sum-all"),
        Sample([randn(3, 4)], {"equation": "ij->j"}, id="sum-rows"),
        Sample([randn(3, 3)], {"equation": "ii->i"}, id="diagonal"),
        Sample([randn(3, 3)], {"equation": "ii"}, id="trace"),
        Sample([randn(2, 3, 4)], {"equation": "...ij->...ji"}, id="ellipsis"),
        Sample([randn(2, 3, 4), randn(4)], {"equation": "...j,j->..."}, id="ellipsis-vector"),
        Sample([randn(3, 4), randn(4, 5), randn(5)], {"equation": "ij,jk,k->i"}, id="three"),
        Sample([randn(1, 4), randn(3, 4)], {"equation": "ij,ij->ij"}, id="broadcast"),
        Sample([randn(), randn(3)], {"equation": ",i->i"}, id="scalar"),
        Sample([ints(-3, 3, 2, 3), ints(-3, 3, 3)], {"equation": "ij,j->i"}, grad=False, id="int"),
        # Size-1 dims broadcast against the other operand; their gradient is summed.
        Sample([randn(3), randn(1)], {"equation": "i,i->"}, id="broadcast-contracted"),
        Sample([randn(1, 3), randn(1)], {"equation": "ij,j->i"}, id="broadcast-size-1"),
        Sample(
            [randn(2, 1, 3), randn(1, 2)],
            {"equation": "...ij,...jk->...ik"},
            id="broadcast-ellipsis",
        ),
        # One operand summing integers gives int64 (as sum); mixed dtypes multiply.
        Sample(
            [ints(-3, 3, 3, 3).astype(np.int32)], {"equation": "ij->j"}, grad=False, id="int32-sum"
        ),
        Sample(
            [np.array([[True, False], [True, True]])],
            {"equation": "ij->"},
            grad=False,
            id="bool-sum",
        ),
        Sample([randn(2, 3), ints(-3, 3, 3)], {"equation": "ij,j->ij"}, id="mixed-dtypes"),
        # Three operands contract left to right, as PyTorch: infinities land where its do.
        Sample(
            [
                np.array([[-3.0], [-np.inf]]),
                np.array([[1.475, 1.365]]),
                np.array([[0.341, -0.444, 0.628], [-0.372, -0.375, 0.348]]),
            ],
            {"equation": "ab,bc,cd->ad"},
            grad=False,
            id="three-left-to-right",
        ),
    ],
    "transpose": [
        Sample([randn(3, 4)], {"dim0": 0, "dim1": 1}, id="matrix"),
        Sample([randn(2, 3, 4)], {"dim0": -1, "dim1": 0}, id="negative"),
        Sample([randn(2, 3)], {"dim0": 1, "dim1": 1}, id="same"),
        Sample([randn()], {"dim0": 0, "dim1": -1}, id="scalar"),
        Sample([ints(0, 5, 2, 3)], {"dim0": 0, "dim1": 1}, grad=False, id="int"),
    ],
    "permute": [
        Sample([randn(2, 3, 4)], {"dims": [2, 0, 1]}, id="rotate"),
        Sample([randn(2, 3, 4)], {"dims": [-1, 1, -3]}, id="negative"),
        Sample([randn(1, 3)], {"dims": [1, 0]}, id="size-1"),
        Sample([randn()], {"dims": []}, id="scalar"),
        Sample([ints(0, 5, 2, 3)], {"dims": [1, 0]}, grad=False, id="int"),
    ],
    "det": [
        Sample([well_conditioned(3, 3)], id="matrix"),
        Sample([well_conditioned(2, 4, 4)], id="batch"),
        Sample([well_conditioned(1, 1)], id="1x1"),
        # det exactly 0: PyTorch's gradient is 0 there (no error from inverting).
        Sample([np.array([[1.0, 2.0], [2.0, 4.0]])], fd=False, id="singular"),
        # Second order at a zero matrix: ours is the exact 0 (the cofactor matrix's
        # derivative); PyTorch's SVD path gives NaN there.
        Sample(
            [np.stack([np.zeros((2, 2)), well_conditioned(2, 2)])],
            fd=False,
            second_order=False,
            id="singular-in-batch",
        ),
    ],
    "inv": [
        Sample([well_conditioned(3, 3)], id="matrix"),
        Sample([well_conditioned(2, 3, 3)], id="batch"),
    ],
    "solve": [
        Sample([well_conditioned(3, 3), randn(3, 2)], id="matrix"),
        Sample([well_conditioned(3, 3), randn(3)], id="vector"),
        Sample([well_conditioned(2, 3, 3), randn(2, 3)], id="batched-vectors"),
        Sample([well_conditioned(2, 3, 3), randn(3)], id="vector-broadcast"),
        Sample([well_conditioned(2, 3, 3), randn(3, 4)], id="matrix-broadcast"),
        Sample([well_conditioned(3, 3), randn(2, 3, 1)], id="batched-b"),
    ],
    "cross": [
        Sample([randn(3), randn(3)], id="vectors"),
        Sample([randn(4, 3), randn(4, 3)], id="rows"),
        Sample([randn(4, 3), randn(1, 3)], id="broadcast"),
        Sample([randn(3, 5), randn(3, 1)], {"dim": 0}, id="dim0"),
        Sample([randn(2, 3, 4), randn(2, 3, 4)], {"dim": -2}, id="negative"),
        Sample([ints(-3, 3, 2, 3), ints(-3, 3, 2, 3)], grad=False, id="int"),
    ],
}


def _einsum_left_to_right(torch: Any, equation: str, ops: tuple[Any, ...]) -> Any:
    """torch.einsum in PyTorch's own order, as gradserve's einsum contracts: with opt_einsum
    installed (jax brings it) PyTorch would take opt_einsum's order instead."""
    with torch.backends.opt_einsum.flags(enabled=False):
        return torch.einsum(equation, *ops)


TORCH = {
    "matmul": lambda torch, a, b: torch.matmul(a, b),
    "einsum": lambda torch, *ops, equation: _einsum_left_to_right(torch, equation, ops),
    "transpose": lambda torch, x, dim0, dim1: torch.transpose(x, dim0, dim1),
    "permute": lambda torch, x, dims: torch.permute(x, dims),
    "det": lambda torch, a: torch.linalg.det(a),
    "inv": lambda torch, a: torch.linalg.inv(a),
    "solve": lambda torch, a, b: torch.linalg.solve(a, b),
    "cross": lambda torch, a, b, dim=-1: torch.linalg.cross(a, b, dim=dim),
}

ERRORS = {
    "matmul": [
        ErrorSample(
            [randn(3, 4), randn(5, 2)],
            {},
            ShapeError,
            r"matmul: shapes \(3, 4\) and \(5, 2\) do not match$",
        ),
        ErrorSample([randn(3), randn(4)], {}, ShapeError, r"shapes \(3,\) and \(4,\) do not"),
        ErrorSample([randn(2, 3, 4), randn(3, 4, 5)], {}, ShapeError, r"batch dims"),
        ErrorSample([randn(3), 2.0], {}, ShapeError, r"tensors, not numbers"),
        ErrorSample([randn(2, 2), randn(2, 2).astype(np.float32)], {}, DTypeError, r"same dtype"),
        ErrorSample([randn(2, 2)], {}, ArityError, r"takes 2 tensor argument"),
        ErrorSample([np.array([[True]]), np.array([[True]])], {}, DTypeError, r"bool tensors"),
    ],
    "einsum": [
        ErrorSample(
            [randn(3, 4), randn(5, 2)],
            {"equation": "ij,jk->ik"},
            ShapeError,
            r"subscript 'j' has size 5",
        ),
        ErrorSample(
            [randn(3, 4)], {"equation": "ij,jk->ik"}, ShapeError, r"2 operand\(s\) but 1 were given"
        ),
        ErrorSample([randn(3, 4)], {"equation": "ijk->i"}, ShapeError, r"name 3 dims"),
        ErrorSample([randn(3, 4)], {"equation": "ij->k"}, ShapeError, r"'k' appears in no"),
        ErrorSample([randn(3, 4)], {"equation": "i1->i"}, ShapeError, r"use letters"),
        ErrorSample([randn(3, 4)], {}, AttributeError_, r"missing required attribute 'equation'"),
        ErrorSample([randn(3, 4)], {"equation": 3}, AttributeError_, r"'equation' must be str"),
        ErrorSample([randn(3), 2.0], {"equation": "i,->i"}, ShapeError, r"tensors, not numbers"),
        ErrorSample(
            [np.array([True, False]), np.array([True, True])],
            {"equation": "i,i->"},
            DTypeError,
            r"cannot contract bool",
        ),
    ],
    "transpose": [
        ErrorSample([randn(3, 4)], {"dim0": 0, "dim1": 2}, ShapeError, r"dim 2 is out of range"),
        ErrorSample([randn(3, 4)], {"dim0": 0}, AttributeError_, r"missing required .*'dim1'"),
        ErrorSample(
            [randn(3, 4)], {"dim0": 0, "dim1": [1]}, AttributeError_, r"'dim1' must be int"
        ),
    ],
    "permute": [
        ErrorSample([randn(3, 4)], {"dims": [0]}, ShapeError, r"each of the tensor's 2"),
        ErrorSample([randn(3, 4)], {"dims": [0, -2]}, ShapeError, r"repeat a dimension"),
        ErrorSample([randn(3, 4)], {"dims": [0, 2]}, ShapeError, r"dim 2 is out of range"),
        ErrorSample([randn(3, 4)], {"dims": 1}, AttributeError_, r"'dims' must be ints"),
    ],
    "det": [
        ErrorSample([randn(3, 4)], {}, ShapeError, r"square matrices, but they are 3 by 4"),
        ErrorSample([randn(3)], {}, ShapeError, r"at least 2 dimensions"),
        ErrorSample([ints(0, 3, 2, 2)], {}, DTypeError, r"floating point"),
    ],
    "inv": [
        ErrorSample([randn(2, 3)], {}, ShapeError, r"square matrices, but they are 2 by 3"),
        ErrorSample([ints(0, 3, 2, 2)], {}, DTypeError, r"floating point"),
    ],
    "solve": [
        ErrorSample([randn(3, 3), randn(4)], {}, ShapeError, r"shapes \(3, 3\) and \(4,\)"),
        ErrorSample([randn(3, 3), randn(4, 2)], {}, ShapeError, r"do not match"),
        ErrorSample([randn(3, 2), randn(3)], {}, ShapeError, r"square matrices"),
        ErrorSample([randn(3, 3), randn(3).astype(np.float32)], {}, DTypeError, r"same dtype"),
        ErrorSample([randn(3, 3), 1.0], {}, ShapeError, r"tensors, not numbers"),
        ErrorSample([ints(0, 3, 2, 2), ints(0, 3, 2)], {}, DTypeError, r"floating point"),
    ],
    "cross": [
        ErrorSample([randn(4), randn(4)], {}, ShapeError, r"must have size 3"),
        ErrorSample([randn(2, 3), randn(3)], {}, ShapeError, r"same number of dimensions"),
        ErrorSample([randn(2, 3), randn(4, 3)], {}, ShapeError, r"cannot be broadcast"),
        ErrorSample([randn(3), randn(3)], {"dim": 1}, ShapeError, r"dim 1 is out of range"),
        ErrorSample([randn(3), randn(3).astype(np.float32)], {}, DTypeError, r"same dtype"),
    ],
}
