"""Shape ops: reshape, expand, squeeze, unsqueeze, flatten, cat, stack."""

from __future__ import annotations

from typing import Any

from engine.errors import ShapeError
from engine.ops.registry import Attr, Meta, OpDef, register
from engine.shapes import fmt, numel, sum_to_shape


def reshape_target(shape: tuple[int, ...], target: Any) -> tuple[int, ...]:
    """PyTorch's reshape rule: one -1 is inferred; the element count must match."""
    target = [target] if isinstance(target, int) else list(target)
    unknown = [i for i, n in enumerate(target) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in target):
        raise ShapeError(f"invalid shape {target}: only one dimension can be -1, and none < -1")
    total = numel(shape)
    if unknown:
        rest = numel([n for n in target if n != -1])
        if rest == 0 or total % rest:
            raise ShapeError(f"shape {target} is invalid for input of size {total}")
        target[unknown[0]] = total // rest
    if numel(target) != total:
        raise ShapeError(f"shape {target} is invalid for input of size {total}")
    return tuple(target)


def expand_target(shape: tuple[int, ...], target: Any) -> tuple[int, ...]:
    """PyTorch's expand rule: -1 keeps a dim; size-1 dims broadcast; new dims go in front."""
    target = [target] if isinstance(target, int) else list(target)
    if len(target) < len(shape):
        raise ShapeError(
            f"the expanded size {fmt(target)} must have at least as many dims as {fmt(shape)}"
        )
    lead = len(target) - len(shape)
    out = []
    for i, n in enumerate(target):
        if i < lead:
            if n < 0:
                raise ShapeError(f"expanded size {n} is not allowed in a new leading dim")
            out.append(n)
            continue
        have = shape[i - lead]
        if n == -1:
            out.append(have)
        elif have == n or have == 1:
            out.append(n)
        else:
            raise ShapeError(
                f"the expanded size {n} must match the existing size {have} at dim {i} "
                f"(target {fmt(target)}, input {fmt(shape)})"
            )
    return tuple(out)


register(
    OpDef(
        name="reshape", group="shape", doc="Same elements in a new shape (one dim may be -1).",
        args=("input",),
        forward=lambda xp, x, *, shape: xp.reshape(x, reshape_target(tuple(x.shape), shape)),
        infer=lambda metas, *, shape: Meta(reshape_target(metas[0].shape, shape), metas[0].dtype),
        vjp=(lambda F, g, x, *, shape: F.reshape(g, shape=list(x.shape)),),
        save=("input",), attrs={"shape": Attr("shape", doc="the new shape")},
        positional_attrs=("shape",),
    ),
    OpDef(
        name="expand", group="shape",
        doc="Broadcast to a larger shape (-1 keeps a dim); the gradient is summed back.",
        args=("input",),
        forward=lambda xp, x, *, shape: xp.broadcast_to(x, expand_target(tuple(x.shape), shape)),
        infer=lambda metas, *, shape: Meta(expand_target(metas[0].shape, shape), metas[0].dtype),
        vjp=(lambda F, g, x, *, shape: sum_to_shape(F, g, tuple(x.shape)),),
        save=("input",), attrs={"shape": Attr("shape", doc="the target shape")},
        positional_attrs=("shape",),
    ),
)
