"""Samples for cast, detach and the constants: zeros, ones, full, eye, arange."""

from typing import Any

import numpy as np

from gradserve.engine.errors import ArityError, AttributeError_, DTypeError, ShapeError
from tests.support.op_samples import ErrorSample, Sample, randn


def _dtype(torch: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """Attributes with the dtype name as a torch dtype, for the reference calls."""
    if kw.get("dtype") is not None:
        return {**kw, "dtype": getattr(torch, kw["dtype"])}
    return {k: v for k, v in kw.items() if v is not None}


SAMPLES = {
    "cast": [
        # float32 rounding is far above the finite-difference step: compared with torch only.
        Sample([randn(3, 4)], {"dtype": "float32"}, fd=False, id="to-float32"),
        Sample([randn(2, 3)], {"dtype": "float64"}, id="same"),
        Sample([randn()], {"dtype": "float32"}, fd=False, id="scalar"),
        Sample([np.array([-1.7, 0.0, 2.9])], {"dtype": "int64"}, grad=False, id="to-int"),
        Sample([np.array([0.0, 0.5, 2.0])], {"dtype": "bool"}, grad=False, id="to-bool"),
        Sample([np.array([1, 2, 3])], {"dtype": "float32"}, grad=False, id="int-to-float"),
        Sample([np.array([1, 2**40])], {"dtype": "int32"}, grad=False, id="int-narrowing"),
    ],
    "detach": [
        Sample([randn(2, 3)], id="matrix"),
        Sample([randn()], id="scalar"),
        Sample([np.array([1, 2])], id="int"),
    ],
    "zeros": [
        Sample([], {"shape": [2, 3]}, id="default"),
        Sample([], {"shape": 4, "dtype": "int64"}, id="int-shape"),
        Sample([], {"shape": [], "dtype": "float64"}, id="scalar"),
        Sample([], {"shape": [2, 0], "dtype": "bool"}, id="empty"),
    ],
    "ones": [
        Sample([], {"shape": [3, 1]}, id="default"),
        Sample([], {"shape": [2], "dtype": "int32"}, id="int32"),
        Sample([], {"shape": [], "dtype": "bool"}, id="scalar"),
    ],
    "full": [
        Sample([], {"shape": [2, 3], "value": 1.5}, id="float"),
        Sample([], {"shape": [2], "value": 7}, id="int"),
        Sample([], {"shape": [2, 2], "value": True}, id="bool"),
        Sample([], {"shape": [], "value": -2.5, "dtype": "float64"}, id="scalar"),
        Sample([], {"shape": [3], "value": 2.9, "dtype": "int64"}, id="truncate"),
        Sample([], {"shape": [3], "value": 2, "dtype": "float32"}, id="int-to-float"),
    ],
    "eye": [
        Sample([], {"n": 3}, id="square"),
        Sample([], {"n": 2, "m": 4}, id="wide"),
        Sample([], {"n": 3, "m": 1, "dtype": "int64"}, id="tall-int"),
        Sample([], {"n": 0}, id="empty"),
    ],
    "arange": [
        Sample([], {"end": 5}, id="end-only"),
        Sample([], {"start": 5}, id="one-bound"),
        Sample([], {"start": 2, "end": 11, "step": 3}, id="step"),
        Sample([], {"start": 0, "end": 1, "step": 0.1}, id="float-step"),
        Sample([], {"start": 1.5, "end": 4}, id="float-start"),
        Sample([], {"start": 5, "end": 0, "step": -1.5}, id="negative-step"),
        Sample([], {"start": 3, "end": 3}, id="empty"),
        Sample([], {"start": 0.5, "end": 3, "dtype": "int64"}, id="float-to-int"),
        Sample([], {"start": -2, "end": 2, "dtype": "float64"}, id="int-to-float64"),
        # int64: bounds and step truncated first (PyTorch's kernel), so 0..2.5 is [0, 1].
        Sample([], {"start": 0, "end": 2.5, "dtype": "int64"}, id="int64-truncated-end"),
        Sample(
            [], {"start": -1.5, "end": 10, "step": 3, "dtype": "int64"}, id="int64-truncated-start"
        ),
        # Other integer dtypes count from the values as given, by the truncated step.
        Sample([], {"start": 0, "end": 2.5, "dtype": "int32"}, id="int32-length"),
        Sample([], {"start": 0.9, "end": 3.9, "step": 0.9, "dtype": "int32"}, id="int32-zero-step"),
    ],
}


def _arange(torch: Any, start: Any = None, end: Any = None, step: Any = 1, **kw: Any) -> Any:
    bounds = (start,) if end is None else (0 if start is None else start, end, step)
    return torch.arange(*bounds, **_dtype(torch, kw))


TORCH = {
    "cast": lambda torch, x, dtype: x.to(getattr(torch, dtype)),
    "detach": lambda torch, x: x.detach(),
    "zeros": lambda torch, shape, **kw: torch.zeros(shape, **_dtype(torch, kw)),
    "ones": lambda torch, shape, **kw: torch.ones(shape, **_dtype(torch, kw)),
    "full": lambda torch, shape, value, **kw: torch.full(
        [shape] if isinstance(shape, int) else shape, value, **_dtype(torch, kw)
    ),
    "eye": lambda torch, n, **kw: torch.eye(
        n, *([kw.pop("m")] if "m" in kw else []), **_dtype(torch, kw)
    ),
    "arange": _arange,
}

ERRORS = {
    "cast": [
        ErrorSample([randn(2)], {"dtype": "float8"}, DTypeError, r"unknown dtype 'float8'"),
        ErrorSample([randn(2)], {}, AttributeError_, r"missing required attribute 'dtype'"),
    ],
    "detach": [
        ErrorSample([randn(2), randn(2)], {}, ArityError, r"takes 1 tensor argument"),
    ],
    "zeros": [
        ErrorSample([], {"shape": [2, -1]}, ShapeError, r"negative size -1"),
        ErrorSample([], {"shape": "2x3"}, AttributeError_, r"'shape' must be shape"),
        ErrorSample([], {"shape": [2], "dtype": "complex64"}, DTypeError, r"unknown dtype"),
    ],
    "ones": [
        ErrorSample([], {"shape": [-3]}, ShapeError, r"negative size -3"),
        ErrorSample([], {}, AttributeError_, r"missing required attribute 'shape'"),
    ],
    "full": [
        ErrorSample([], {"shape": [2]}, AttributeError_, r"missing required attribute 'value'"),
        ErrorSample([], {"shape": [2], "value": "one"}, AttributeError_, r"'value' must be"),
        ErrorSample([], {"shape": [-2], "value": 1.0}, ShapeError, r"negative size -2"),
        ErrorSample(
            [],
            {"shape": [2], "value": 70000, "dtype": "float16"},
            DTypeError,
            r"cannot be converted to float16 without overflow",
        ),
        ErrorSample([], {"shape": [2], "value": 1e40}, DTypeError, r"to float32 without overflow"),
        ErrorSample(
            [],
            {"shape": [2], "value": 2**40, "dtype": "int32"},
            DTypeError,
            r"to int32 without overflow",
        ),
    ],
    "eye": [
        ErrorSample([], {"n": -1}, ShapeError, r"n must be >= 0, got -1"),
        ErrorSample([], {"n": 2, "m": -2}, ShapeError, r"m must be >= 0, got -2"),
        ErrorSample([], {"n": 2.5}, AttributeError_, r"'n' must be int"),
    ],
    "arange": [
        ErrorSample([], {"end": 5, "step": 0}, AttributeError_, r"step must be nonzero"),
        ErrorSample([], {"start": 5, "end": 0}, AttributeError_, r"inconsistent with step sign"),
        ErrorSample([], {}, AttributeError_, r"missing required attribute 'end'"),
        ErrorSample([], {"end": 3, "dtype": "bool"}, DTypeError, r"bool"),
        ErrorSample(
            [],
            {"start": 0, "end": 2.5, "step": 0.5, "dtype": "int64"},
            AttributeError_,
            r"step must be nonzero",
        ),
        ErrorSample(
            [],
            {"start": 0.1, "end": 0.001, "step": 2, "dtype": "int64"},
            AttributeError_,
            r"inconsistent with step sign",
        ),
        # (end - start) / step overflows to infinity (found by fuzzing the service).
        ErrorSample([], {"end": 1e308, "step": 1e-308}, AttributeError_, r"too many values"),
        ErrorSample([], {"start": -1e308, "end": 1e308}, AttributeError_, r"too many values"),
        # Integer attributes past int64 are refused when attributes are bound.
        ErrorSample(
            [],
            {"end": 10**400, "dtype": "float32"},
            AttributeError_,
            r"'end' is outside the int64 range",
        ),
        ErrorSample(
            [],
            {"start": 2**70, "end": 2**70 + 3},
            AttributeError_,
            r"'start' is outside the int64 range",
        ),
        ErrorSample(
            [],
            {"end": 1e19, "dtype": "int32"},
            AttributeError_,
            r"end 1e\+19 is out of the range of int64",
        ),
    ],
}
