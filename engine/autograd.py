"""Reverse mode's core: the recorded Node, the F namespace on raw arrays, and the
iterative backward pass over nodes.

This layer knows arrays and nodes, never Tensors: the Tensor layer above
(engine/_tensor.py) records a Node for each op it runs, hands the pass its roots, and
says what becomes of a leaf's gradient. So imports flow one way, Tensor on top.

The pass never recurses (a 100,000-node chain works): it counts each node's
consumers, runs a node once all of them have sent their gradient, drops each
gradient as soon as it is consumed, and frees saved values unless asked to
retain the graph.

As in PyTorch, a node's edges point at the *nodes* that made its inputs (or at
leaf tensors), never at intermediate tensors: an intermediate stays alive only
while something saved it for backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

from gradserve.engine.backends import Backend
from gradserve.engine.errors import BackwardError
from gradserve.engine.grad_mode import enable_grad
from gradserve.engine.rules import OPS, OpDef, is_number
from gradserve.engine.shapes import sum_to_shape

_FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time."
)

Edge = Any  # a Node, or a leaf that requires grad (opaque here: only the layer above reads it)
Input = tuple[Edge, tuple[int, ...], Any]  # an edge, and the input's shape and dtype


class Node:
    """`grad_fn` of a tensor: the op that made it, its input edges and what its VJP reads.

    `inputs` holds, per argument, (edge, shape, dtype) when its gradient is needed, else
    None: the shape and dtype are what that gradient is summed and cast back to. `saved`
    holds the op's arguments (tensors or numbers) and its raw result, as `op.save` names
    them; the namespace F of a backward decides how they are read (`F.unpack`)."""

    __slots__ = ("__weakref__", "attrs", "backend", "inputs", "op", "saved")

    def __init__(
        self,
        op: OpDef,
        inputs: list[Input | None],
        saved: tuple[Any, ...],
        attrs: dict[str, Any],
        backend: Backend,
    ) -> None:
        self.op = op
        self.inputs = inputs
        self.saved: tuple[Any, ...] | None = saved
        self.attrs = attrs
        self.backend = backend

    @property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(None if inp is None else inp[0] for inp in self.inputs)

    def name(self) -> str:
        return self.op.grad_fn_name

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        return tuple((e, 0) for e in self.edges)

    def __repr__(self) -> str:
        return f"<{self.name()}>"

    def release(self) -> None:
        self.saved = None

    def apply(self, grad: Any, F: Any, create_graph: bool) -> list[Any]:
        """The input gradients for `grad`, each summed to its input's shape and dtype."""
        op = self.op
        if self.saved is None:
            if op.save:
                raise BackwardError(_FREED_MESSAGE, op=op.name)
            saved: Sequence[Any] = ()
        else:
            saved = F.unpack(self)
        attrs = self.attrs
        if op.variadic:
            raw_grads = op.vjp(F, grad, *saved, **attrs)  # type: ignore[operator,misc]
            return [
                None if inp is None or g is None else self._conform(g, inp, F, create_graph)
                for g, inp in zip(raw_grads, self.inputs, strict=True)
            ]
        vjps = op.vjp
        grads: list[Any] = []
        for i, inp in enumerate(self.inputs):
            if inp is None:
                grads.append(None)
                continue
            g = vjps[i](F, grad, *saved, **attrs)  # type: ignore[index,misc]
            if g is not None and (g.shape != inp[1] or g.dtype is not inp[2]):
                g = self._conform(g, inp, F, create_graph)
            grads.append(g)
        return grads

    def _conform(self, g: Any, inp: Input, F: Any, create_graph: bool) -> Any:
        """Sum a gradient back to its input's shape and cast it to the input's dtype."""
        _, shape, dtype = inp
        if g.shape != shape:
            g = sum_to_shape(F, g, shape)
        if create_graph:
            name = self.backend.name_of(dtype)
            if F.dtype_of(g) != name:
                g = F.cast(g, dtype=name)
        elif g.dtype != dtype:
            xp = self.backend.xp
            g = xp.astype(xp.asarray(g), dtype)
        return g


def _raw(value: Any) -> Any:
    """An argument a node saved, as a plain backward reads it: the array of a tensor, a
    number as it is (the arguments of an op are tensors or Python numbers)."""
    return value if is_number(value) else value.data


def _unpack_raw(node: Node) -> list[Any]:
    """The saved values as arrays: a tensor argument's array, the raw result as it is."""
    assert node.saved is not None
    if node.op.variadic:  # its one argument name stands for the tuple of all operands
        return [
            v if i < 0 else tuple(_raw(x) for x in v)
            for i, v in zip(node.op.save_index, node.saved, strict=True)
        ]
    return [v if i < 0 else _raw(v) for i, v in zip(node.op.save_index, node.saved, strict=True)]


@functools.cache
def raw_namespace(backend: Backend) -> SimpleNamespace:
    """F for a plain backward: every op's forward on raw arrays, recording nothing."""
    xp = backend.xp

    def op_fn(op: OpDef) -> Callable[..., Any]:
        forward, defaults = op.forward, op.defaults
        if not op.attrs:
            return lambda *xs: forward(xp, *xs)
        return lambda *xs, **attrs: forward(xp, *xs, **{**defaults, **attrs})

    ns = SimpleNamespace(**{name: op_fn(op) for name, op in OPS.items()})
    ns.zeros_like = xp.zeros_like
    ns.ones_like = xp.ones_like
    ns.dtype_of = backend.dtype_name
    ns.unpack = _unpack_raw
    ns.create_graph = False
    return ns


def run_backward(
    roots: Mapping[Edge, Any],
    F: Any,
    retain_graph: bool,
    create_graph: bool,
    accumulate: Callable[[Edge, Any], None] | None,
    wanted: Mapping[int, int],
    check: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """The pass from `roots` (each node or leaf, with its incoming gradient) on namespace F.

    A leaf's gradient goes to `accumulate`; with `accumulate` None, the gradients reaching
    the edges whose ids `wanted` maps to a key are returned by that key instead. `check`
    runs before each node (a deadline)."""
    grads = dict(roots)
    results: dict[int, Any] = {}

    # Count, for each node, the edges pointing at it from nodes reachable from the roots.
    deps: dict[Node, int] = {r: 0 for r in roots if type(r) is Node}
    stack = list(deps)
    while stack:
        for inp in stack.pop().inputs:
            if inp is not None and type(nxt := inp[0]) is Node:
                count = deps.get(nxt)
                if count is None:
                    deps[nxt] = 1
                    stack.append(nxt)
                else:
                    deps[nxt] = count + 1

    def deliver(leaf: Edge, g: Any) -> None:
        if accumulate is not None:
            accumulate(leaf, g)
        elif id(leaf) in wanted:
            key = wanted[id(leaf)]
            results[key] = results[key] + g if key in results else g

    # With create_graph the pass itself is recorded; otherwise it runs on raw arrays, which
    # record nothing whatever the grad mode.
    with enable_grad() if create_graph else nullcontext():
        for leaf in [r for r in roots if type(r) is not Node]:
            deliver(leaf, grads.pop(leaf))
        ready = [r for r in roots if type(r) is Node and deps[r] == 0]
        while ready:
            if check is not None:
                check()
            node = ready.pop()
            grad = grads.pop(node)
            if wanted and id(node) in wanted:
                results[wanted[id(node)]] = grad
            in_grads = node.apply(grad, F, create_graph)
            del grad
            if not retain_graph:
                node.saved = None
            for inp, g in zip(node.inputs, in_grads, strict=True):
                if inp is None:
                    continue
                nxt = inp[0]
                if type(nxt) is not Node:
                    if g is not None:
                        deliver(nxt, g)
                    continue
                if g is not None:
                    old = grads.get(nxt)
                    grads[nxt] = g if old is None else old + g
                left = deps[nxt] - 1
                deps[nxt] = left
                if left == 0:
                    if nxt in grads:
                        ready.append(nxt)
                    else:
                        _skip(nxt, deps, grads, ready, retain_graph)
    return results


def _skip(
    node: Node,
    deps: dict[Node, int],
    pending: dict[Any, Any],
    ready: list[Node],
    retain_graph: bool,
) -> None:
    """A node that received no gradient still releases its consumers' counts."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not retain_graph:
            n.release()
        for nxt in n.edges:
            if type(nxt) is Node:
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    (ready if nxt in pending else stack).append(nxt)
