"""A held tensor's id (`tensor_id`): content-addressed, so that the same dtype, shape and
bytes always give the same id, on the server (an upload, a kept result) and in the client
(which can name what it uploaded without asking). Also the header that routes a client's
requests to the replica that holds its tensors.

The id is the XXH3-128 of `<dtype>:<shape, comma-separated>:` and the tensor's raw
little-endian, row-major bytes, as 32 lowercase hex digits. XXH3 rather than the graph id's
BLAKE2b or SHA-256: a training step hashes every parameter it keeps, and XXH3 runs at tens
of GB/s where SHA-256 runs at ~2 (a 7 MB model: 0.2 ms against 4). It is not a
cryptographic hash, and need not be: ids resolve only for the API key that holds them, so
a collision made on purpose could only confuse its maker's own tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import xxhash

from gradserve.wire.binary import raw_bytes

# The request header a client sends with every request that names or keeps tensors (its
# value: 32 hex digits, the client's tensor affinity), which the HAProxy profile hashes
# on ahead of the graph's id: a client's tensors and the requests that use them meet on
# one replica. The service ignores it.
TENSOR_HEADER = "X-Gradserve-Tensors"
ID_CHARS = 32


def tensor_id(dtype: str, shape: Iterable[int], data: bytes | memoryview) -> str:
    """The id of a tensor of `dtype` and `shape` whose raw little-endian bytes are `data`."""
    digest = xxhash.xxh3_128(b"%s:%s:" % (dtype.encode(), ",".join(map(str, shape)).encode()))
    digest.update(data)
    return digest.hexdigest()


def id_of_array(array: np.ndarray, dtype: str) -> str:
    """The id `array` gets as a tensor of `dtype` (one of the wire's dtype names)."""
    return tensor_id(dtype, array.shape, raw_bytes(array, dtype))


def is_tensor_id(text: str) -> bool:
    """Whether `text` is an id some tensor can have (32 lowercase hex digits): anything else
    names none, and must not reach the tensor store as part of a file name."""
    return _ID.fullmatch(text) is not None


_ID = re.compile(f"[0-9a-f]{{{ID_CHARS}}}")
