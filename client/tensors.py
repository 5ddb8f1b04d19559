"""Tensors held on the server, as the client names them: `TensorRef` (an id, with the
shape and dtype it stands for) and `Parameter` (a handle on a value held on the server
that training steps move along).

    >>> with Client() as gs:
    ...     w = gs.put(np.zeros((32, 10), np.float32))    # TensorRef: uploaded once
    ...     r = gs.forward(graph, {"w": w, "x": batch}, keep=["w_next"])
    ...     w = r.kept["w_next"]                            # held there; no data came back

A ref made by `put` keeps the array it was made from (no copy), so that the client can
upload it again when the server answers 409 tensor-unknown (an eviction, a restart);
a ref of a kept result has no local value, and a 409 naming it is raised.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradserve.wire.tensor_id import ID_CHARS


@dataclass(frozen=True)
class TensorRef:
    """A tensor held on the server: its content-addressed id, shape and dtype, and (for an
    upload) the local array it holds (`value`; not part of its identity)."""

    tensor_id: str
    shape: tuple[int, ...]
    dtype: str
    value: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def wire(self, requires_grad: bool) -> dict[str, Any]:
        """The request's input naming it."""
        out: dict[str, Any] = {"tensor_id": self.tensor_id}
        if requires_grad:
            out["requires_grad"] = True
        return out

    @classmethod
    def of(cls, entry: dict[str, Any], value: np.ndarray | None = None) -> TensorRef:
        """From the server's `{tensor_id, shape, dtype}`."""
        return cls(entry["tensor_id"], tuple(entry["shape"]), entry["dtype"], value)


class Parameter:
    """A value held on the server, by id: pass it as an input (by name) of `forward` or
    `backward`, traced or not. When the function's outputs include one of the same name
    (`{"w": w - lr * grad(loss, w), ...}`), that output is kept on the server and the
    handle moves to it: a training step sends the batch alone, and the parameters stay
    where they are used."""

    def __init__(self, ref: TensorRef) -> None:
        self.ref = ref

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape

    @property
    def dtype(self) -> str:
        return self.ref.dtype

    def __repr__(self) -> str:
        return f"Parameter({self.ref.tensor_id}, shape={self.shape}, dtype={self.dtype})"


Held = TensorRef | Parameter


def ref_of(value: Held) -> TensorRef:
    return value.ref if isinstance(value, Parameter) else value


def affinity_of(api_key: str | None, given: str | None) -> str:
    """The value of the routing header (wire.tensor_id.TENSOR_HEADER): 32 hex digits of the
    affinity given, else of the API key (a key's tensors meet on one replica), else a
    random one (this client's own)."""
    seed = given if given is not None else api_key
    if seed is None:
        return secrets.token_hex(ID_CHARS // 2)
    return hashlib.blake2b(seed.encode(), digest_size=ID_CHARS // 2).hexdigest()
