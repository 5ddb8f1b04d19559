"""Binary bodies: the Open Inference Protocol's binary tensor extension, both ways.

A binary body is a JSON document (its header) of `Inference-Header-Content-Length` bytes,
then the raw little-endian, row-major bytes of each tensor that gives `binary_data_size`
instead of its data, one after another in the order the header lists them (document
order). A request's tensors are under "inputs" and "grad_outputs", a response's under
"outputs" and "gradients". A response's header is padded with spaces (which JSON allows
after a document) to a multiple of 8 bytes, so that its first tensor starts aligned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gradserve.engine.errors import quoted
from gradserve.wire.dtypes import LITTLE_ENDIAN

BINARY_HEADER = "Inference-Header-Content-Length"
REQUEST_SECTIONS = ("inputs", "grad_outputs")
RESPONSE_SECTIONS = ("outputs", "gradients")
ALIGNMENT = 8

Loc = tuple[str | int, ...]


class FramingError(ValueError):
    """A binary body whose sizes do not add up; `loc` says where (a tensor's
    `binary_data_size`, the header's length, or the body), `short` what in a few words."""

    def __init__(self, message: str, loc: Loc, short: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.short = short


def split(body: bytes | memoryview, header_length: int) -> tuple[memoryview, memoryview]:
    """A binary body's JSON header and its tail, as views (no copy)."""
    view = memoryview(body)
    if not 0 <= header_length <= len(view):
        raise FramingError(
            f"{BINARY_HEADER} is {header_length}, past the body's {len(view)} bytes",
            ("headers", BINARY_HEADER.lower()),
            "past the body",
        )
    return view[:header_length], view[header_length:]


def tensor_bytes(
    header: Any, tail: memoryview | None, sections: Sequence[str]
) -> dict[tuple[str, str], memoryview]:
    """Each tensor of `sections` that gives `binary_data_size`, by (section, name): its
    bytes of the tail, in the order the header lists them. The sizes must add up to the
    tail exactly; `tail` None: the body was not binary, and no tensor may give a size."""
    found: dict[tuple[str, str], memoryview] = {}
    offset = 0
    for section, tensors in header.items() if isinstance(header, dict) else ():
        if section not in sections or not isinstance(tensors, dict):
            continue
        for name, tensor in tensors.items():
            size = tensor.get("binary_data_size") if isinstance(tensor, dict) else None
            if size is None:
                continue
            loc = (section, name, "binary_data_size")
            if tail is None:
                raise FramingError(
                    f"{section}[{quoted(name)}] has binary_data_size, but the body "
                    f"is not binary (no {BINARY_HEADER} header)",
                    loc,
                    "needs a binary body",
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise FramingError(
                    f"{section}[{quoted(name)}] has binary_data_size {size!r}, not a byte count",
                    loc,
                    "not a byte count",
                )
            if offset + size > len(tail):
                raise FramingError(
                    f"{section}[{quoted(name)}] has binary_data_size {size}, but "
                    f"the binary tail has {len(tail) - offset} bytes left",
                    loc,
                    "past the end of the body",
                )
            found[(section, name)] = tail[offset : offset + size]
            offset += size
    if tail is not None and offset != len(tail):
        raise FramingError(
            f"the binary tail has {len(tail) - offset} bytes after the last "
            f"tensor's ({offset} of {len(tail)} are given a tensor by "
            "binary_data_size)",
            ("body",),
            "bytes left over",
        )
    return found


def raw_bytes(array: np.ndarray, dtype: str | None = None) -> memoryview:
    """An array's bytes as they travel: little-endian, C order (of `dtype`, by default the
    array's own). A view on its buffer when it lies so already, else one copy."""
    le = np.ascontiguousarray(array, dtype=LITTLE_ENDIAN[dtype or array.dtype.name])
    return memoryview(le.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def byte_size(dtype: str, shape: Iterable[int]) -> int:
    """The bytes of a tensor of `dtype` and `shape`."""
    return math.prod(shape) * LITTLE_ENDIAN[dtype].itemsize


def array_of(raw: bytes | memoryview, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """The array on raw little-endian bytes of exactly its size: a read-only view (no copy)
    on a little-endian host, a byte-swapped copy elsewhere."""
    le = LITTLE_ENDIAN[dtype]
    array = np.frombuffer(raw, dtype=le).reshape(tuple(shape))
    return array if le.isnative else array.astype(le.newbyteorder("="))


def padded(header: bytes) -> bytes:
    """A response's JSON header padded with spaces, so that the tensors after it start
    aligned."""
    return header + b" " * (-len(header) % ALIGNMENT)


def header_length_of(value: str | None) -> int | None:
    """The value of the `Inference-Header-Content-Length` header: None when absent;
    FramingError when it is not a count (ASCII digits: `str.isdigit()` also takes "²",
    which `int()` does not)."""
    if value is None:
        return None
    count = value.strip()
    if not (count.isascii() and count.isdigit()):
        raise FramingError(
            f"{BINARY_HEADER} must be a byte count, not {value[:64]!r}",
            ("headers", BINARY_HEADER.lower()),
            "not a count",
        )
    return int(count)
