"""Tensors on the wire: JSON numbers and lists, or base64 of raw little-endian bytes.

Requests and responses are strict JSON (RFC 8259): `loads` refuses the bare tokens NaN,
Infinity and -Infinity, so non-finite values travel only as the strings "NaN",
"Infinity" and "-Infinity". A request's tensors (`loads_tensors`) parse the same, but a
large array of numbers is read straight into a NumPy array (`Numbers`), never a list of
Python numbers. Decoding checks data against the declared dtype and shape and raises
`TensorDataError` with `loc` naming the input. Encoding goes through orjson, and only
arrays that hold NaN or infinities take the slower path that writes those strings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import orjson
import pybase64
import simdjson
from pydantic_core import from_json

from gradserve.engine import collector
from gradserve.engine.errors import TensorDataError, quoted
from gradserve.engine.rules import INTS
from gradserve.wire.binary import array_of, raw_bytes
from gradserve.wire.dtypes import LITTLE_ENDIAN, dtype_name
from gradserve.wire.numbers import NONFINITE, dumps, json_data

__all__ = [
    "JSONError",
    "Numbers",
    "check_shape",
    "decode_tensor",
    "dtype_name",
    "dumps",
    "encode_tensor",
    "loads",
    "loads_tensors",
]

Loc = tuple[str | int, ...]


# ------------------------------------------------------------------------ parsing
class JSONError(ValueError):
    """A body that is not strict JSON; the message says what and where."""


_AT = re.compile(r" at (line \d+ column \d+)$")  # how jiter ends its messages


def loads(body: bytes | str) -> Any:
    """Parse a request body as strict JSON, in one pass of pydantic-core's parser (jiter).

    `model_validate_json` cannot refuse the bare tokens (its parser always accepts them),
    so the body is parsed here with `allow_inf_nan=False` and then validated as Python
    data; for bodies of JSON lists that is also faster than `model_validate_json`. The
    garbage collector is paused while the parser makes its lists and dicts
    (engine.collector: 2.5 times faster on a 1.4 MB graph). orjson parses no faster then,
    and reads other numbers (integers past 64 bits as floats, 1e999 as an error).
    """
    try:
        with collector.paused():
            return from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise JSONError(_explain(body, str(exc))) from None


def _explain(body: bytes | str, message: str) -> str:
    """jiter says "expected value" at a bare NaN: say what is wrong with it instead. The
    permissive parse reads the same as the strict one up to the first bare token, so it
    fails with the same message exactly when the strict one did not stop at such a token
    (an extra parse, on refused bodies only)."""
    try:
        from_json(body)
    except ValueError as exc:
        if str(exc) == message:
            return message
    where = _AT.search(message)
    return (
        "NaN, Infinity and -Infinity are not JSON numbers"
        + (f" ({where.group(1)})" if where else "")
        + '; non-finite numbers travel as the strings "NaN", "Infinity" and "-Infinity"'
    )


class Numbers(NamedTuple):
    """A JSON array of numbers read without making a Python number of each: its values
    shaped as its nesting, float64 when any is written with a fraction or an exponent
    (kind "f"), else int64 (kind "i"), as `loads` would have read them."""

    array: np.ndarray
    kind: str


# A tensors member split into its tensors' fields, each left as raw bytes (a tensor given
# as bare data instead of an object fails it: then each tensor is split on its own).
_TENSOR_FIELDS = msgspec.json.Decoder(dict[str, dict[str, msgspec.Raw]])
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
# Arrays of numbers this long or longer are read as Numbers; shorter ones parse as fast
# as Python numbers (~200 numbers).
NUMBERS_MIN_BYTES = 4096
_NUMBER_CHARS = b"0123456789+-.eE \t\n\r"  # what a number, or the space around it, holds


def loads_tensors(raw: bytes | memoryview) -> Any:
    """A request's `inputs` or `grad_outputs` member, parsed as `loads` parses it, except
    that every large array of numbers (a tensor's `data`, or a tensor given as bare data)
    becomes `Numbers`: its numbers parsed straight into an array by simdjson, with no
    Python object for each (lse of 100,000 numbers: 9.0 -> 3.9 ms from the bytes to the
    array). Anything it does not read so (an array with a string or a boolean in it, one
    that is ragged or empty, a number too large for 64 bits) parses as `loads` does, so
    that the answer, and each error, is the one `loads` gives. A member of small tensors
    only is parsed whole, at once."""
    if len(raw) < NUMBERS_MIN_BYTES:
        return loads(bytes(raw))
    try:
        try:
            fields = _TENSOR_FIELDS.decode(raw)
        except msgspec.ValidationError:  # (a tensor given as bare data)
            tensors = _MEMBERS.decode(raw)
            if all(len(v) < NUMBERS_MIN_BYTES for v in tensors.values()):
                return loads(bytes(raw))
            return {name: _tensor(value) for name, value in tensors.items()}
    except (msgspec.DecodeError, RecursionError):
        return loads(bytes(raw))  # (which says what is wrong)
    if all(len(f.get("data", b"")) < NUMBERS_MIN_BYTES for f in fields.values()):
        return loads(bytes(raw))
    return tensors_of_fields(fields)


TensorFields = dict[str, dict[str, msgspec.Raw]]  # a tensors member split: name -> field -> raw


def tensors_of_fields(fields: TensorFields) -> Any:
    """A tensors member already split into its tensors' fields, parsed as `loads_tensors`
    parses the member: each large `data` on its own (`_data`), every other field in one
    parse (a parse each costs more than the fields' bytes: the 24-step cell's 56)."""
    large = {
        (name, key)
        for name, f in fields.items()
        for key, value in f.items()
        if key == "data" and len(value) >= NUMBERS_MIN_BYTES
    }
    small = [
        bytes(value)
        for name, f in fields.items()
        for key, value in f.items()
        if (name, key) not in large
    ]
    try:
        parsed = iter(loads(b"[%s]" % b",".join(small)))
    except JSONError:  # (each parsed on its own, to say where it is wrong as `loads` does)
        parsed = iter([loads(text) for text in small])
    return {
        name: {
            key: (_data(value) if (name, key) in large else next(parsed))
            for key, value in f.items()
        }
        for name, f in fields.items()
    }


def _tensor(raw: msgspec.Raw) -> Any:
    """One tensor of a tensors member: an object, or bare data."""
    if memoryview(raw)[:1] == b"{":
        return {
            k: (_data(v) if k == "data" else loads(bytes(v)))
            for k, v in _MEMBERS.decode(raw).items()
        }
    return _data(raw)


def _data(raw: msgspec.Raw) -> Any:
    """A tensor's data: Numbers where it is a large array of numbers, else parsed."""
    numbers = _numbers(bytes(raw)) if len(raw) >= NUMBERS_MIN_BYTES else None
    return loads(bytes(raw)) if numbers is None else numbers


def _numbers(text: bytes) -> Numbers | None:
    """A JSON array of numbers, rectangular and not empty, as Numbers; None for any other
    text (left to `loads`)."""
    kind = "f" if b"." in text or b"e" in text or b"E" in text else "i"
    try:
        doc = simdjson.Parser().parse(text)
        shape: list[int] = []
        first: Any = doc
        while isinstance(first, simdjson.Array):
            if len(first) == 0 or len(shape) == MAX_DIMS:
                return None
            shape.append(len(first))
            first = first[0]
        if not isinstance(doc, simdjson.Array):
            return None
        values = doc.as_buffer(of_type="d" if kind == "f" else "i")  # (every number, flat)
    except (ValueError, TypeError, RuntimeError):  # not a number of that kind, or too large
        return None
    # Every number is one of the buffer's, and the buffer holds as many as `shape` (an
    # empty row of a column, `[[1],[],[2]]`, has the nesting of 3 x 1). The array is that
    # rectangular `shape` if its text holds no bracket but its first (one dim), or if what
    # is left of it without its numbers is the nesting of `shape` exactly (`[[,],[,]]` for
    # 2 x 2); or, where its rows are few for its text (a matrix), if each row has its
    # length in `shape` and the text holds as many brackets as `shape` has arrays.
    if memoryview(values).nbytes // 8 != math.prod(shape):
        return None
    if len(shape) == 1:
        if text.find(b"[", 1) != -1:
            return None
    elif math.prod(shape[:-1]) * BYTES_A_ROW <= len(text):
        if not _rectangular(doc, shape):
            return None
        if text.count(b"[") != sum(math.prod(shape[:d]) for d in range(len(shape))):
            return None
    elif text.translate(None, _NUMBER_CHARS) != _nesting(shape):
        return None
    array = np.frombuffer(values, np.float64 if kind == "f" else np.int64)
    return Numbers(array.reshape(shape), kind)


BYTES_A_ROW = 64  # a row looked at costs what a translate of this many bytes does


def _rectangular(doc: Any, shape: list[int]) -> bool:
    """Whether every array of `doc` down to its last dim has its length in `shape` (each
    array at depth d < ndim - 1 holding arrays only)."""
    level = [doc]
    for d, n in enumerate(shape):
        if any(type(a) is not simdjson.Array or len(a) != n for a in level):
            return False
        if d < len(shape) - 1:
            level = [row for a in level for row in a]
    return True


def _nesting(shape: list[int]) -> bytes:
    """The brackets and commas of a JSON array of `shape` with its numbers left out."""
    text = b"[" + b"," * (shape[-1] - 1) + b"]"
    for n in reversed(shape[:-1]):
        text = b"[" + b",".join([text] * n) + b"]"
    return text


def _error(loc: Loc, field: str, message: str) -> TensorDataError:
    what = "input" if loc[0] == "inputs" else str(loc[0])
    return TensorDataError(f"{what} {quoted(str(loc[-1]))}: {message}", loc=(*loc, field))


def decode_tensor(
    loc: Loc,
    *,
    data: Any = None,
    b64: str | None = None,
    binary: memoryview | None = None,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
) -> np.ndarray:
    """A host array from one wire tensor; `loc` is e.g. ("inputs", "x"). `binary`: its
    bytes from a binary body's tail (the array is a read-only view on them)."""
    if shape is not None:
        check_shape(loc, shape, LITTLE_ENDIAN[dtype].itemsize if dtype is not None else 8)
    if binary is not None:
        return _from_raw(loc, binary, dtype, shape, "binary_data_size")
    if b64 is not None:
        return _decode_b64(loc, b64, dtype, shape)
    if type(data) is float and (dtype is None or dtype == "float32") and not shape:
        # The common scalar: a JSON float to float32 (what the general path gives it).
        return np.array(data, dtype=np.float32)
    if type(data) is Numbers:
        array = _convert(loc, data.array, data.kind, dtype)
    else:
        array = _from_json(loc, data, dtype)
    if shape is not None:
        shape = tuple(shape)
        if array.ndim == 0 and shape:
            raise _error(loc, "shape", f"a scalar cannot have shape {list(shape)}")
        if array.shape != shape:
            # A flat list with a shape; or an empty one, whose nesting cannot show every dim.
            if math.prod(shape) == array.size and (array.ndim == 1 or array.size == 0):
                array = array.reshape(shape)
            else:
                raise _error(
                    loc,
                    "shape",
                    f"data has shape {list(array.shape)} ({array.size} elements), "
                    f"which does not match shape {list(shape)}",
                )
    return array


MAX_DIMS = 64  # NumPy's limit (NPY_MAXDIMS), and PyTorch's


def check_shape(loc: Loc, shape: Sequence[int], itemsize: int) -> None:
    """A declared shape that no array can have is refused before NumPy sees it: more
    than 64 dims, or (even with a 0 among them) dims whose product overflows the bytes
    an array can address. NumPy raises ValueError for both."""
    if len(shape) > MAX_DIMS:
        raise _error(loc, "shape", f"shape has {len(shape)} dims; at most {MAX_DIMS} are supported")
    span = itemsize
    for n in shape:
        span *= max(n, 1)
        if span >= 1 << 63:
            raise _error(loc, "shape", f"shape {list(shape)} is too large for any tensor")


def _decode_b64(loc: Loc, text: str, dtype: str | None, shape: Sequence[int] | None) -> np.ndarray:
    if dtype is None:
        raise _error(loc, "dtype", "base64 data needs a dtype")
    if shape is None:
        raise _error(loc, "shape", "base64 data needs a shape")
    try:
        # validate=True: a character outside the alphabet is an error, never skipped.
        raw = pybase64.b64decode(text, validate=True)
    except ValueError as exc:
        raise _error(loc, "b64", f"invalid base64: {exc}") from None
    return _from_raw(loc, raw, dtype, shape, "b64")


def _from_raw(
    loc: Loc, raw: bytes | memoryview, dtype: str | None, shape: Sequence[int] | None, field: str
) -> np.ndarray:
    """An array on raw little-endian bytes (a view: no copy on a little-endian host)."""
    if dtype is None:
        raise _error(loc, "dtype", f"{field} needs a dtype")
    if shape is None:
        raise _error(loc, "shape", f"{field} needs a shape")
    itemsize = LITTLE_ENDIAN[dtype].itemsize
    count = math.prod(shape)
    if len(raw) != count * itemsize:
        raise _error(
            loc,
            field,
            f"{len(raw)} bytes do not hold shape {list(shape)} of {dtype} "
            f"({count * itemsize} bytes expected)",
        )
    if dtype == "bool":
        octets = np.frombuffer(raw, dtype=np.uint8)
        if octets.size and octets.max() > 1:
            raise _error(loc, field, "bool data must be bytes 0 or 1")
    return array_of(raw, dtype, shape)


def _from_json(loc: Loc, data: Any, dtype: str | None) -> np.ndarray:
    if isinstance(data, list):
        return _from_list(loc, data, dtype)
    if isinstance(data, str):
        if data not in NONFINITE:
            raise _error(loc, "data", f"expected a number, got the string {quoted(data)}")
        data = NONFINITE[data]
    if data is None or not isinstance(data, bool | int | float):
        raise _error(loc, "data", f"expected a number or a list, got {type(data).__name__}")
    return _convert(loc, np.asarray(data), _kind(data), dtype)


def _kind(value: bool | int | float) -> str:
    return "b" if isinstance(value, bool) else "i" if isinstance(value, int) else "f"


def _from_list(loc: Loc, data: list[Any], dtype: str | None) -> np.ndarray:
    # numpy finds the nesting (and a ragged list) in C; one C-level pass over the leaves'
    # types then says what they are, so a boolean mixed with numbers is never coerced. A
    # flat list is its own leaves (a list inside it is a leaf of type list: ragged).
    shape: tuple[int, ...]
    if data and not isinstance(data[0], list):
        leaves, shape = data, (len(data),)
    else:
        try:
            nested = np.array(data, dtype=object)
        except ValueError as exc:
            raise _error(loc, "data", f"ragged or malformed nested list: {exc}") from None
        leaves, shape = nested.ravel().tolist(), nested.shape
    types = set(map(type, leaves))
    if not types <= {float, int, bool, str}:
        bad = sorted(t.__name__ for t in types - {float, int, bool, str})
        what = "a ragged nested list" if "list" in bad else f"values of type {', '.join(bad)}"
        if "list" in bad and len(shape) == MAX_DIMS:
            what = f"lists nested deeper than the {MAX_DIMS} dims a tensor can have"
        raise _error(loc, "data", f"tensor data must be numbers, got {what}")
    if str in types:
        leaves = _replace_nonfinite(loc, leaves)
        types = (types - {str}) | {float}
    if bool in types and types != {bool}:
        raise _error(loc, "data", "a JSON boolean is mixed with numbers")
    if not types:  # an empty tensor: of the kind its dtype says (float without one)
        kind = "b" if dtype == "bool" else "i" if dtype in INTS else "f"
    else:
        kind = "b" if types == {bool} else "f" if float in types else "i"
    try:
        flat = np.array(leaves, dtype=np.float64 if kind == "f" else None)
    except OverflowError:
        raise _error(loc, "data", "an integer is out of the int64 range") from None
    if flat.dtype == object:
        raise _error(loc, "data", "an integer is out of the int64 range")
    return _convert(loc, flat.reshape(shape), kind, dtype)


def _replace_nonfinite(loc: Loc, leaves: list[Any]) -> list[Any]:
    out = []
    for v in leaves:  # only lists that contain strings take this path
        if isinstance(v, str):
            if v not in NONFINITE:
                raise _error(loc, "data", f"expected a number, got the string {quoted(v)}")
            v = NONFINITE[v]
        out.append(v)
    return out


def _convert(loc: Loc, array: np.ndarray, kind: str, dtype: str | None) -> np.ndarray:
    """Cast JSON data (kind b, i or f) to the declared dtype, or to PyTorch's default."""
    if dtype is None:
        dtype = {"b": "bool", "i": "int64", "f": "float32"}[kind]
    if dtype == "bool":
        if kind != "b":
            raise _error(loc, "data", "dtype bool needs JSON booleans (true, false)")
        return array.astype(np.bool_, copy=False)
    if kind == "b":
        raise _error(loc, "data", f"a JSON boolean is not valid data for dtype {dtype}")
    if dtype in INTS:
        if kind == "f":
            if not np.isfinite(array).all():
                raise _error(loc, "data", f"NaN or infinity is not valid data for dtype {dtype}")
            if (np.floor(array) != array).any():
                raise _error(loc, "data", f"a non-integral number is not valid for dtype {dtype}")
        info = np.iinfo(dtype)
        # -info.min is 2**63 (2**31): exact as a float, unlike info.max, which a float64
        # comparison rounds up to 2**63, so that 9.223372036854775807e18 would pass and wrap.
        if array.size and (array.min() < info.min or array.max() >= -info.min):
            raise _error(loc, "data", f"a value is out of the range of {dtype}")
        return array.astype(dtype)
    with np.errstate(over="ignore"):  # float16 overflow gives inf, as torch.tensor does
        return array.astype(dtype)


# ------------------------------------------------------------------------ encoding
def encode_tensor(
    array: np.ndarray, encoding: str, tail: list[memoryview] | None = None
) -> dict[str, Any]:
    """`dtype`, `shape` and `data`, `b64` or `binary_data_size` for a response; values are
    orjson-ready. With the binary encoding the array's bytes are appended to `tail` (a
    view on them: no copy of a contiguous little-endian array)."""
    name = dtype_name(array)
    out: dict[str, Any] = {"dtype": name, "shape": list(array.shape)}
    if encoding == "binary":
        assert tail is not None
        raw = raw_bytes(array, name)
        tail.append(raw)
        out["binary_data_size"] = raw.nbytes
    elif encoding == "base64":
        # Straight from the array's buffer into the document: no bytes or str copies.
        out["b64"] = orjson.Fragment(b'"%s"' % pybase64.b64encode(raw_bytes(array, name)))
    else:
        out["data"] = json_data(array)
    return out
