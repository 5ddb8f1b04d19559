"""Samples for the reductions (sum, mean, prod, max, min, logsumexp, var, cumsum) and the
normalisation ops (softmax, log_softmax)."""

import numpy as np

from gradserve.engine.errors import AttributeError_, DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, ints, randn

# dim as absent, int, negative int, list; keepdim both ways; 0-d and size-1 dims.
_DIMS = [
    Sample([randn()], id="scalar"),
    Sample([randn(3, 4)], id="all"),
    Sample([randn(3, 4)], {"keepdim": True}, id="all-keepdim"),
    Sample([randn(3, 4)], {"dim": 1}, id="dim"),
    Sample([randn(2, 3, 4)], {"dim": -2, "keepdim": True}, id="negative-keepdim"),
    Sample([randn(2, 3, 4)], {"dim": [0, 2]}, id="list"),
    Sample([randn(2, 1, 3)], {"dim": [-1, 1], "keepdim": True}, id="list-keepdim"),
    Sample([randn(1, 3)], {"dim": 0}, id="size-1"),
    Sample([randn()], {"dim": 0}, id="scalar-dim"),
]
_TIES = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 0.0, 2.0], [5.0, 4.0, 3.0, 5.0]])


def _dims(x, dim):
    """PyTorch's reductions that take a tuple of dims; None means all."""
    return tuple(range(x.ndim)) if dim is None else dim


def _prod(torch, x, dim=None, keepdim=False):
    # torch.prod reduces one dim at a time; the catalog's prod also takes a list.
    if dim is None:
        out = torch.prod(x)
        return out.reshape([1] * x.ndim) if keepdim else out
    for d in sorted(
        (d % max(x.ndim, 1) for d in ([dim] if isinstance(dim, int) else dim)), reverse=True
    ):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


def _extreme(name):
    def fn(torch, x, dim=None, keepdim=False):
        if isinstance(dim, int):
            return getattr(torch, name)(x, dim, keepdim=keepdim).values
        if dim is None and not keepdim:
            return getattr(torch, name)(x)
        return getattr(torch, "a" + name)(x, dim=_dims(x, dim), keepdim=keepdim)

    return fn


def _extreme_samples():
    return [
        *_DIMS,
        Sample([_TIES], {"dim": 1}, fd=False, id="ties-dim"),
        Sample([_TIES], {"dim": 0, "keepdim": True}, fd=False, id="ties-dim0"),
        Sample([_TIES], fd=False, id="ties-all"),
        Sample([_TIES], {"dim": [1]}, fd=False, id="ties-list"),
        Sample([np.full((2, 2), 7.0)], fd=False, id="all-equal"),
        Sample([ints(-5, 5, 3, 4)], {"dim": 1}, grad=False, id="int"),
        Sample([_NANS], {"dim": 1}, fd=False, id="nan-dim"),
        Sample([_NANS], fd=False, id="nan-all"),
        Sample([_NANS], {"dim": [1]}, fd=False, id="nan-list"),
        Sample([_NANS], {"keepdim": True}, fd=False, id="nan-all-keepdim"),
    ]


_ZEROS = [
    Sample([np.array([[0.0, 2.0, 3.0], [1.5, -2.0, 0.5]])], {"dim": 1}, id="one-zero"),
    Sample([np.array([[0.0, 2.0, 0.0], [1.5, -2.0, 0.5]])], {"dim": 1}, id="two-zeros"),
    Sample([np.array([[0.0, 2.0], [3.0, 0.5]])], id="zero-all"),
    Sample([np.array([[0.0, 2.0], [0.0, 0.5]])], id="two-zeros-all"),
    Sample(
        [np.array([[0.0, 2.0, 0.0], [0.0, -2.0, 0.5]])],
        {"dim": 0, "keepdim": True},
        id="zeros-dim0",
    ),
    Sample([np.array([[0.0, 2.0, 0.0], [1.0, -2.0, 0.5]])], {"dim": [0, 1]}, id="zeros-list"),
    # PyTorch divides result / x when there is no zero: an infinite entry gets NaN.
    Sample([np.array([[np.inf, 2.0], [1.0, 3.0]])], {"dim": 1}, fd=False, id="inf"),
]
# PyTorch: max(x, dim) returns (and sends the gradient to) the first NaN; torch.max(x) shares
# it among the NaNs; amax over dims gives the whole slice NaN.
_NANS = np.array([[1.0, np.nan, 3.0, np.nan], [2.0, 5.0, 5.0, 1.0]])

SAMPLES = {
    "sum": [
        *_DIMS,
        Sample([ints(-3, 3, 2, 3)], {"dim": 0}, grad=False, id="int"),
        Sample([np.array([True, False, True])], grad=False, id="bool"),
    ],
    "mean": _DIMS,
    "prod": [
        *_DIMS,
        *_ZEROS,
        Sample([ints(-3, 3, 2, 3)], {"dim": 1}, grad=False, id="int"),
        Sample([ints(1, 4, 2, 3)], grad=False, id="int-all"),
    ],
    "max": _extreme_samples(),
    "min": _extreme_samples(),
    "logsumexp": [
        *_DIMS,
        Sample([np.array([[1e4, 1e4 - 1.0], [-1e4, 0.0]])], {"dim": 1}, id="extreme"),
        Sample(
            [np.array([[-np.inf, -np.inf], [0.0, 1.0]])], {"dim": 1}, grad=False, id="all-neg-inf"
        ),
        Sample([ints(-3, 3, 2, 3)], {"dim": 1}, grad=False, id="int"),
        Sample([np.zeros((0, 3))], {"dim": 0}, fd=False, id="empty-dim"),  # log(0) = -inf
        Sample([np.zeros((0, 3))], {"dim": 1}, id="empty-other-dim"),
    ],
    "var": [
        *(s for s in _DIMS if s.id not in ("scalar", "scalar-dim", "size-1")),
        Sample([randn(3, 4)], {"dim": 1, "correction": 0}, id="biased"),
        Sample([randn(2, 5)], {"dim": [0, 1], "correction": 2.5}, id="float-correction"),
        Sample([randn()], {"correction": 0}, id="scalar"),
        # No degrees of freedom left: NaN values, and PyTorch's NaN / inf gradients.
        Sample([randn()], {}, fd=False, id="scalar-unbiased"),
        Sample([randn(1, 3)], {"dim": 0}, fd=False, id="one-row"),
        Sample(
            [randn(2, 3)], {"dim": [0, 1], "correction": 6}, fd=False, id="correction-equals-count"
        ),
    ],
    "cumsum": [
        Sample([randn()], {"dim": 0}, id="scalar"),
        Sample([randn(3, 4)], {"dim": 1}, id="matrix"),
        Sample([randn(2, 3, 4)], {"dim": -3}, id="negative"),
        Sample([ints(-3, 3, 5)], {"dim": 0}, grad=False, id="int"),
        Sample([np.array([True, False, True])], {"dim": 0}, grad=False, id="bool"),
    ],
}
_NORMALISE = [
    Sample([randn()], {"dim": 0}, id="scalar"),
    Sample([randn(3, 4)], {"dim": 1}, id="rows"),
    Sample([randn(2, 3, 4)], {"dim": -2}, id="negative"),
    Sample([randn(3, 1)], {"dim": 1}, id="size-1"),
    Sample([np.array([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4]])], {"dim": 1}, id="extreme"),
    Sample([np.zeros((0, 3))], {"dim": 0}, id="empty"),
    Sample([np.zeros((2, 0))], {"dim": 1}, id="empty-dim"),
]
SAMPLES["softmax"] = _NORMALISE
SAMPLES["log_softmax"] = _NORMALISE

TORCH = {
    "sum": lambda torch, x, dim=None, keepdim=False: torch.sum(x, _dims(x, dim), keepdim=keepdim),
    "mean": lambda torch, x, dim=None, keepdim=False: torch.mean(x, _dims(x, dim), keepdim=keepdim),
    "prod": _prod,
    "max": _extreme("max"),
    "min": _extreme("min"),
    "logsumexp": lambda torch, x, dim=None, keepdim=False: torch.logsumexp(
        x, _dims(x, dim), keepdim=keepdim
    ),
    "var": lambda torch, x, dim=None, keepdim=False, correction=1: torch.var(
        x, _dims(x, dim), correction=correction, keepdim=keepdim
    ),
    "cumsum": lambda torch, x, dim: torch.cumsum(x, dim),
    "softmax": lambda torch, x, dim: torch.softmax(x, dim),
    "log_softmax": lambda torch, x, dim: torch.log_softmax(x, dim),
}

_BAD_DIMS = [
    ErrorSample([randn(3, 4)], {"dim": 2}, ShapeError, r"dim 2 is out of range"),
    ErrorSample([randn(3, 4)], {"dim": [0, -2]}, ShapeError, r"more than once"),
    ErrorSample([randn(3, 4)], {"dim": 1.5}, AttributeError_, r"'dim' must be int\|ints"),
    ErrorSample([randn(3, 4)], {"keepdim": 1}, AttributeError_, r"'keepdim' must be bool"),
]
_FLOAT_ONLY = ErrorSample([ints(0, 3, 2, 2)], {}, DTypeError, r"floating point")
ERRORS = {name: _BAD_DIMS for name in ("sum", "prod", "max", "min", "logsumexp")}
ERRORS["mean"] = [*_BAD_DIMS, _FLOAT_ONLY]
ERRORS["var"] = [
    *_BAD_DIMS,
    _FLOAT_ONLY,
    ErrorSample([randn(3)], {"correction": "1"}, AttributeError_, r"'correction' must be number"),
]
ERRORS["cumsum"] = [
    ErrorSample([randn(3)], {}, AttributeError_, r"missing required attribute 'dim'"),
    ErrorSample([randn(3)], {"dim": 1}, ShapeError, r"dim 1 is out of range"),
]
for _name in ("softmax", "log_softmax"):
    ERRORS[_name] = [
        ErrorSample([randn(3)], {}, AttributeError_, r"missing required attribute 'dim'"),
        ErrorSample([randn(3, 4)], {"dim": -3}, ShapeError, r"dim -3 is out of range"),
        ErrorSample([randn(3, 4)], {"dim": [0]}, AttributeError_, r"'dim' must be int"),
        ErrorSample([ints(0, 3, 2, 2)], {"dim": 0}, DTypeError, r"floating point"),
    ]
