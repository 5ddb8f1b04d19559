"""dtype names and PyTorch's type promotion (`torch.result_type`).

dtypes are plain strings ("float32"), the same on every backend; a backend
maps a name to its own dtype object.
"""

from __future__ import annotations

from typing import Final

from gradserve.engine.errors import DTypeError

float16: Final = "float16"
float32: Final = "float32"
float64: Final = "float64"
int32: Final = "int32"
int64: Final = "int64"
bool_: Final = "bool"

DTYPES: Final = (float16, float32, float64, int32, int64, bool_)
FLOATS: Final = frozenset({float16, float32, float64})
INTS: Final = frozenset({int32, int64})
ITEMSIZE: Final = {float16: 2, float32: 4, float64: 8, int32: 4, int64: 8, bool_: 1}

DEFAULT_FLOAT: Final = float32
DEFAULT_INT: Final = int64

# bool < integers < floats; within a category the wider type wins (PyTorch's lattice,
# which differs from NumPy's: int64 + float16 is float16, not float64).
_CATEGORY: Final = {bool_: 0, int32: 1, int64: 1, float16: 2, float32: 2, float64: 2}
_RANK: Final = {bool_: 0, int32: 1, int64: 2, float16: 3, float32: 4, float64: 5}

Scalar = bool | int | float


_PYTHON_TYPES: Final = {float: float64, int: int64, bool: bool_}  # as torch reads them


def check_dtype(name: object) -> str:
    """Canonical dtype name, from a name ("float32", "torch.float32"), a NumPy dtype or
    scalar type, or a Python type (float, int, bool)."""
    if isinstance(name, type):
        if name in _PYTHON_TYPES:
            return _PYTHON_TYPES[name]
        name = getattr(name, "__name__", name)
    text = getattr(name, "name", None) or str(name)
    text = text.removeprefix("torch.").removeprefix("numpy.")
    if text in DTYPES:
        return text
    raise DTypeError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")


def promote_types(a: str, b: str) -> str:
    """`torch.promote_types` for the dtypes gradserve supports."""
    if a == b:
        return a
    return a if _RANK[a] >= _RANK[b] else b


def scalar_dtype(value: Scalar) -> str:
    """The dtype PyTorch gives a Python number: bool, int64, or the default float."""
    if isinstance(value, bool):
        return bool_
    if isinstance(value, int):
        return int64
    return DEFAULT_FLOAT


def _combine(higher: str | None, lower: str | None) -> str | None:
    """PyTorch's `combine_categories`: a lower-priority group only matters if it is of a
    higher category (a float 0-d tensor or literal lifts an integer tensor to float)."""
    if higher is None:
        return lower
    if lower is None or _CATEGORY[higher] >= _CATEGORY[lower]:
        return higher
    return promote_types(higher, lower)


def result_type(dims: list[str], zero_dims: list[str], literals: list[Scalar]) -> str:
    """`torch.result_type` over dimensioned tensors, 0-d tensors and Python numbers."""

    def promote_all(names: list[str]) -> str | None:
        out: str | None = None
        for name in names:
            out = name if out is None else promote_types(out, name)
        return out

    wrapped = promote_all([scalar_dtype(v) for v in literals])
    out = _combine(promote_all(dims), _combine(promote_all(zero_dims), wrapped))
    if out is None:
        raise DTypeError("no operands to promote")
    return out
