"""Shape helpers shared by the ops' shape rules and VJPs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradserve.engine.errors import ShapeError

Shape = tuple[int, ...]


def fmt(shape: Sequence[int]) -> str:
    """A shape as PyTorch users read it: (3, 4), (3,), ()."""
    return str(tuple(shape))


def broadcast_shapes(*shapes: Shape) -> Shape:
    """NumPy/PyTorch broadcasting; a mismatch names all the shapes."""
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, start=ndim - len(shape)):
            if n == out[i] or n == 1:
                continue
            if out[i] == 1:
                out[i] = n
                continue
            listed = " and ".join(fmt(s) for s in shapes)
            raise ShapeError(f"shapes {listed} cannot be broadcast together")
    return tuple(out)


def normalize_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim as an index in [0, ndim); a 0-d tensor accepts 0 and -1."""
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise ShapeError(
            f"dim {dim} is out of range for a tensor of {ndim} dimension(s) "
            f"(expected in [{-bound}, {bound - 1}])"
        )
    return dim % bound


def normalize_dims(dim: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """The dims a reduction covers: all when `dim` is None, sorted, without repeats."""
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims and ndim > 0:
        return tuple(range(ndim))  # PyTorch reduces over all dims for dim=[]
    out = sorted({normalize_dim(d, ndim) for d in dims})
    if len(out) != len(dims):
        raise ShapeError(f"dim {list(dims)} names a dimension more than once")
    return tuple(d for d in out if d < ndim)


def reduced_shape(shape: Shape, dims: tuple[int, ...], keepdim: bool) -> Shape:
    if keepdim:
        return tuple(1 if i in dims else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in dims)


def numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def sum_to_shape(F: Any, grad: Any, shape: Shape) -> Any:
    """Sum a broadcast gradient back to an input's shape (the reverse of broadcasting)."""
    gshape = tuple(grad.shape)
    if gshape == shape:
        return grad
    lead = len(gshape) - len(shape)
    ones = [i + lead for i, n in enumerate(shape) if n == 1 and gshape[i + lead] != 1]
    if not ones:  # only leading dims were added: one sum gives the shape
        return F.sum(grad, dim=list(range(lead)))
    grad = F.sum(grad, dim=list(range(lead)) + ones, keepdim=True)
    return F.reshape(grad, shape=list(shape))


def expand_reduced(F: Any, grad: Any, shape: Shape, dims: tuple[int, ...], keepdim: bool) -> Any:
    """Broadcast a reduction's gradient back over the reduced dims of `shape`."""
    if not keepdim:
        grad = F.reshape(grad, shape=list(reduced_shape(shape, dims, True)))
    return F.expand(grad, shape=list(shape))
