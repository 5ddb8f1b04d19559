"""Samples for the elementwise group."""

import numpy as np

from gradserve.engine.errors import ArityError, AttributeError_, DTypeError
from tests.support.op_samples import ErrorSample, Sample, pos, randn


def _away_from_zero(*shape: int) -> np.ndarray:
    x = randn(*shape)
    return np.where(np.abs(x) < 0.1, 0.5, x)


_UNARY = {
    "abs": _away_from_zero,
    "sign": randn,
    "exp": randn,
    "log": pos,
    "log1p": pos,
    "expm1": randn,
    "sqrt": pos,
    "square": randn,
    "reciprocal": pos,
    "sin": randn,
    "cos": randn,
    "tanh": randn,
    "sigmoid": randn,
    "relu": _away_from_zero,
    "softplus": randn,
}

SAMPLES = {
    name: [
        Sample([make()], id="scalar"),
        Sample([make(3, 4)], id="matrix"),
        Sample([make(2, 1, 3)], id="3d"),
    ]
    for name, make in _UNARY.items()
}
SAMPLES["tan"] = [
    Sample([np.array(0.3)], id="scalar"),
    Sample([np.random.default_rng(3).uniform(-1.2, 1.2, (3, 4))], id="matrix"),
]
SAMPLES["sigmoid"].append(Sample([np.array([-300.0, 0.0, 300.0])], id="extremes"))
SAMPLES["softplus"].append(Sample([np.array([-30.0, 0.0, 19.0, 25.0])], id="threshold"))
SAMPLES["exp"].append(Sample([np.arange(6).reshape(2, 3)], grad=False, id="int-to-float"))
SAMPLES["abs"].append(Sample([np.array([-2, 0, 3])], grad=False, id="int"))
SAMPLES["relu"].append(Sample([np.array([-1.0, 0.0, 2.0])], fd=False, id="kink"))
SAMPLES["abs"].append(Sample([np.array([-1.0, 0.0, 2.0])], fd=False, id="kink"))
SAMPLES["clamp"] = [
    Sample([randn(3, 4)], {"min": -0.5, "max": 0.5}, id="both"),
    Sample([randn(5)], {"min": 0.0}, id="min"),
    Sample([randn(5)], {"max": 0.1}, id="max"),
    Sample(
        [np.array([-1.0, 0.0, 0.5, 1.0, 2.0])], {"min": 0.0, "max": 1.0}, fd=False, id="at-bounds"
    ),
    Sample([np.arange(-3, 4)], {"min": -1, "max": 2}, grad=False, id="int"),
    # PyTorch promotes the tensor with its bounds: bool with int bounds gives int64.
    Sample([np.array([True, False])], {"min": 0, "max": 2}, grad=False, id="bool-int-bounds"),
    Sample([np.arange(-3, 4).astype(np.int32)], {"min": 1}, grad=False, id="int32"),
    Sample([np.array([-1.0, np.nan, 2.0])], {"min": 0.0}, fd=False, id="nan"),
]
# PyTorch: sign(NaN) is 0; sign of bool is bool; relu keeps NaN; square of bool is int64.
SAMPLES["sign"].append(Sample([np.array([1.0, np.nan, -np.inf, 0.0])], fd=False, id="nan"))
SAMPLES["sign"].append(Sample([np.array([True, False])], grad=False, id="bool"))
SAMPLES["relu"].append(Sample([np.array([np.nan, -1.0, 2.0])], fd=False, id="nan"))
SAMPLES["abs"].append(Sample([np.array([np.nan, -1.0, 2.0])], fd=False, id="nan"))
SAMPLES["square"].append(Sample([np.array([True, False])], grad=False, id="bool"))

TORCH = {name: (lambda n: lambda torch, x: getattr(torch, n)(x))(name) for name in _UNARY}
TORCH["tan"] = lambda torch, x: torch.tan(x)
TORCH["softplus"] = lambda torch, x: torch.nn.functional.softplus(x)
TORCH["clamp"] = lambda torch, x, **kw: torch.clamp(x, **kw)

ERRORS = {
    name: [ErrorSample([randn(2), randn(2)], {}, ArityError, r"takes 1 tensor argument")]
    for name in [*_UNARY, "tan"]
}
# Dtypes PyTorch's kernels lack.
ERRORS["abs"].append(ErrorSample([np.array([True])], {}, DTypeError, r"abs needs a non-bool"))
ERRORS["relu"].append(ErrorSample([np.array([True])], {}, DTypeError, r"relu needs a non-bool"))
ERRORS["softplus"].append(
    ErrorSample(
        [np.array([1, 2])], {}, DTypeError, r"softplus needs a floating point input, got int64"
    )
)
ERRORS["clamp"] = [
    ErrorSample([np.array([True])], {"min": True}, DTypeError, r"bool tensors with bool bounds"),
    ErrorSample([randn(2)], {}, AttributeError_, r"at least one of 'min' or 'max'"),
    ErrorSample([randn(2)], {"low": 1.0}, AttributeError_, r"unknown attribute 'low'"),
    ErrorSample([randn(2)], {"min": "a"}, AttributeError_, r"'min' must be number"),
]
