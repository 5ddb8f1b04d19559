"""The dtype names a tensor travels under, and their bytes: little-endian, row-major."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradserve.engine.dtypes import DTYPES

__all__ = ["DTYPES", "LITTLE_ENDIAN", "dtype_name", "wire_dtype"]

# name -> its little-endian NumPy dtype: how its raw bytes lie in base64 and binary bodies
LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in DTYPES}
_NAMES = {np.dtype(name): name for name in DTYPES}


def dtype_name(array: np.ndarray) -> str:
    """An array's wire name (a lookup: `dtype.name` is computed in Python on every access);
    KeyError for a dtype that has none."""
    return _NAMES[array.dtype]


def wire_dtype(dtype: np.dtype[Any]) -> str:
    """The dtype an array travels as: its own, else float32 for floats, bool for booleans
    and int64 for the other integers (a client casts to it)."""
    if dtype.name in DTYPES:
        return dtype.name
    return "float32" if dtype.kind == "f" else "bool" if dtype.kind == "b" else "int64"
