"""Samples for comparisons and where."""

import numpy as np

from gradserve.engine.errors import DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, randn

_CMP = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_A = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])

SAMPLES = {
    name: [
        Sample([_A, np.array([2.0, 2.0, 2.0])], grad=False, id="broadcast"),
        Sample([_A, 2.0], grad=False, id="literal"),
        Sample([np.array([1, 2, 3]), 2.5], grad=False, id="int-vs-float"),
    ]
    for name in _CMP
}
SAMPLES["where"] = [
    Sample([randn(3, 4) > 0, randn(3, 4), randn(3, 4)], id="same"),
    Sample([randn(3, 1) > 0, randn(1, 4), randn(3, 4)], id="broadcast"),
    Sample([randn(4) > 0, randn(4), 0.0], id="literal"),
    # Two literals take PyTorch's default dtypes: float32 here, not float64.
    Sample([randn(4) > 0, 2.5, 2], grad=False, id="two-literals"),
    Sample([randn(4) > 0, 1, 2], grad=False, id="two-int-literals"),
]

TORCH = {name: (lambda n: lambda torch, a, b: getattr(torch, n)(a, b))(name) for name in _CMP}
TORCH["where"] = lambda torch, c, a, b: torch.where(c, a, b)

ERRORS = {
    name: [ErrorSample([randn(3), randn(2)], {}, ShapeError, r"cannot be broadcast")]
    for name in _CMP
}
ERRORS["where"] = [
    ErrorSample([randn(3), randn(3), randn(3)], {}, DTypeError, r"condition must be bool"),
    ErrorSample([randn(3) > 0, randn(2), randn(3)], {}, ShapeError, r"cannot be broadcast"),
]
