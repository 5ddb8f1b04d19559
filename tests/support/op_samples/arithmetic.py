"""Samples for add, sub, mul, div, pow, neg, maximum, minimum."""

import numpy as np

from gradserve.engine.errors import DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, pos, randn

_BROADCAST = [
    Sample([randn(), randn()], id="scalars"),
    Sample([randn(3, 4), randn(3, 4)], id="same"),
    Sample([randn(3, 1), randn(1, 4)], id="broadcast"),
    Sample([randn(2, 3, 4), randn(4)], id="rank"),
    Sample([randn(3), 2.5], id="literal"),
    Sample([1.5, randn(2, 2)], id="literal-first"),
]
_BAD_BROADCAST = [ErrorSample([randn(3), randn(4)], {}, ShapeError, r"shapes \(3,\) and \(4,\)")]

SAMPLES = {
    "add": _BROADCAST,
    "sub": _BROADCAST,
    "mul": _BROADCAST,
    "div": [
        Sample([randn(3, 4), pos(3, 4)], id="same"),
        Sample([randn(3, 1), pos(1, 4)], id="broadcast"),
        Sample([randn(3), 4.0], id="literal"),
        Sample([np.arange(6).reshape(2, 3), np.array([2, 4, 5])], grad=False, id="ints"),
    ],
    "pow": [
        Sample([pos(3, 4), randn(3, 4)], id="tensors"),
        Sample([randn(3, 4), 2], id="square"),
        Sample([pos(2, 3), 0.5], id="root"),
        Sample([2.0, randn(3)], id="literal-base"),
        Sample([pos(3, 1), randn(1, 2)], id="broadcast"),
        Sample([np.array([0.0, 1.0, 2.0]), 0], id="zero-exponent"),
        # Integer tensors to negative tensor powers: 1, -1 or 0, as PyTorch (no error).
        Sample(
            [np.array([-3, 1, -1, -1, 2, 0]), np.array([-3, -2, -3, -2, -1, 2])],
            grad=False,
            id="int-negative-exponent",
        ),
        Sample([-3, np.array([-3, -2, 2], dtype=np.int32)], grad=False, id="int-literal-base"),
        Sample([np.array([True, False]), True], grad=False, id="bool-to-bool-literal"),
        Sample([np.array([True, False]), 2], grad=False, id="bool-to-int"),
        # A literal base 0: the exponent's gradient is 0 for b >= 0, -inf * g below.
        Sample([0.0, np.array([-1.0, 0.5, 2.0])], fd=False, id="zero-literal-base"),
        # Literal powers 0.5 and -0.5 are sqrt and rsqrt in PyTorch: sqrt(-inf) is NaN.
        Sample([np.array([-np.inf, 4.0, 0.0]), 0.5], grad=False, id="sqrt-special"),
        Sample([np.array([-np.inf, 4.0, 1.0]), -0.5], grad=False, id="rsqrt-special"),
    ],
    "neg": [Sample([randn()], id="scalar"), Sample([randn(2, 3)], id="matrix")],
    "maximum": [
        Sample([randn(3, 4), randn(3, 4)], id="same"),
        Sample([randn(3, 1), randn(1, 4)], id="broadcast"),
        Sample([np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 5.0])], fd=False, id="tie"),
        # NaN propagates, and with a NaN neither side loses: both get the whole gradient.
        Sample([np.array([np.nan, 2.0, 3.0]), np.array([1.0, np.nan, 5.0])], fd=False, id="nan"),
    ],
    "minimum": [
        Sample([randn(3, 4), randn(3, 4)], id="same"),
        Sample([randn(2, 1), randn(3)], id="broadcast"),
        Sample([np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 5.0])], fd=False, id="tie"),
        Sample([np.array([np.nan, 2.0, 3.0]), np.array([1.0, np.nan, 5.0])], fd=False, id="nan"),
    ],
}

TORCH = {
    # Operators, so that a literal may stand on either side, as in the samples.
    "add": lambda torch, a, b: a + b,
    "sub": lambda torch, a, b: a - b,
    "mul": lambda torch, a, b: a * b,
    "div": lambda torch, a, b: a / b,
    "pow": lambda torch, a, b: a**b,
    "neg": lambda torch, a: torch.neg(a),
    "maximum": lambda torch, a, b: torch.maximum(a, b),
    "minimum": lambda torch, a, b: torch.minimum(a, b),
}

ERRORS = {
    name: _BAD_BROADCAST for name in ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
}
ERRORS["neg"] = [
    ErrorSample([randn(2), randn(2)], {}, Exception, r"takes 1 tensor argument"),
    ErrorSample([np.array([True, False])], {}, DTypeError, r"`-` operator on a bool tensor"),
]
ERRORS["sub"] = [
    *_BAD_BROADCAST,
    ErrorSample([np.array([True]), randn(1)], {}, DTypeError, r"`-` operator on a bool tensor"),
    ErrorSample([randn(2), True], {}, DTypeError, r"`-` operator on a bool tensor"),
]
ERRORS["pow"] = [
    *_BAD_BROADCAST,
    ErrorSample([np.array([1, 2]), -1], {}, DTypeError, r"negative integer powers"),
    ErrorSample([np.array([True]), np.array([True])], {}, DTypeError, r"pow is not implemented"),
]
