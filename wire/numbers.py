"""Tensor data as strict JSON (RFC 8259), written by orjson.

JSON has no NaN or infinities: they travel as the strings "NaN", "Infinity" and
"-Infinity". orjson writes a NumPy array with the shortest digits that read back to its
own dtype (float32's, not float64's), and writes every non-finite value as `null` (it
cannot be told otherwise): an array that holds one takes the slower path that puts the
right string in each `null`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_data(array: np.ndarray) -> Any:
    """An array as a value orjson writes as strict JSON data: nested numbers (a number for
    a 0-d array), non-finite values as their strings."""
    if array.ndim == 0:
        value = array[()]  # a NumPy scalar: orjson writes it with its own dtype's digits
        if array.dtype.kind == "f" and not math.isfinite(value):
            return _nonfinite_fragment(array)
        return value
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return _nonfinite_fragment(array)
    return np.ascontiguousarray(array)


def _nonfinite_fragment(array: np.ndarray) -> orjson.Fragment:
    """orjson writes every non-finite value as `null`, and nothing else as `null` in a
    numeric array: put the right string in each `null`, in row-major order."""
    flat = np.ascontiguousarray(array.reshape(-1) if array.ndim == 0 else array)
    parts = dumps(flat).split(b"null")
    bad = flat[~np.isfinite(flat)]
    names = np.where(np.isnan(bad), b'"NaN"', np.where(bad > 0, b'"Infinity"', b'"-Infinity"'))
    pieces: list[bytes] = [b""] * (2 * len(parts) - 1)
    pieces[0::2] = parts
    pieces[1::2] = names.tolist()
    text = b"".join(pieces)
    return orjson.Fragment(text[1:-1] if array.ndim == 0 else text)


def dumps(content: Any) -> bytes:
    """A document as strict JSON; NumPy arrays and scalars as `json_data` leaves them."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
