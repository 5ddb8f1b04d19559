"""Reverse mode: the recorded Node, and the iterative backward pass.

The pass never recurses (a 100,000-node chain works): it counts each node's
consumers, runs a node once all of them have sent their gradient, drops each
gradient as soon as it is consumed, and frees saved values unless asked to
retain the graph.

As in PyTorch, a node's edges point at the *nodes* that made its inputs (or at
leaf tensors), never at intermediate tensors: an intermediate stays alive only
while something saved it for backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from engine.errors import BackwardError
from engine.grad_mode import enable_grad
from engine.shapes import fmt, sum_to_shape
from engine.tensor import Tensor

if TYPE_CHECKING:
    from engine.backends import Backend
    from engine.ops.registry import OpDef

_FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time."
)

Edge = Any  # a Node, or a leaf Tensor that requires grad
Input = tuple[Edge, tuple[int, ...], Any]  # an edge, and the input's shape and dtype


class Node:
    """`grad_fn` of a tensor: the op that made it, its input edges and what its VJP reads."""

    __slots__ = ("__weakref__", "attrs", "backend", "inputs", "op", "saved")

    def __init__(
        self, op: OpDef, args: Sequence[Any], attrs: dict[str, Any], out: Any, backend: Backend
    ) -> None:
        self.op = op
        self.attrs = attrs
        self.backend = backend
        mask = op.diff_mask
        # Per argument: (edge, shape, dtype) when its gradient is needed, else None. The
        # shape and dtype are what that gradient is summed and cast back to.
        if mask is None:
            self.inputs: list[Input | None] = [
                (a.grad_fn or a, a.data.shape, a.data.dtype)
                if type(a) is Tensor and a.requires_grad else None
                for a in args
            ]
        else:
            self.inputs = [
                (a.grad_fn or a, a.data.shape, a.data.dtype)
                if type(a) is Tensor and a.requires_grad and mask[i] else None
                for i, a in enumerate(args)
            ]
        # What the VJP reads: input Tensors or numbers, and the raw result (not the result
        # Tensor, which would be a reference cycle through its own grad_fn).
        self.saved: tuple[Any, ...] | None = op.pick_saved(args, out)

    @property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(None if inp is None else inp[0] for inp in self.inputs)

    @property
    def recorded(self) -> bool:
        """False when no differentiable argument requires grad: nothing to record."""
        return any(inp is not None for inp in self.inputs)

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
        saved: Sequence[Any] | None = self.saved
        if saved is None:
            if op.save:
                raise BackwardError(_FREED_MESSAGE, op=op.name)
            saved = ()
        elif create_graph:
            saved = [self._saved_tensor(v, j) for j, v in enumerate(saved)]
        elif op.variadic:
            saved = [_raw(v) for v in saved]
        else:
            saved = [v.data if type(v) is Tensor else v for v in saved]
        attrs = self.attrs
        if op.variadic:
            raw_grads = op.vjp(F, grad, *saved, **attrs)  # type: ignore[operator,misc]
            return [None if inp is None or g is None else self._conform(g, inp, F, create_graph)
                    for g, inp in zip(raw_grads, self.inputs, strict=True)]
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
            if g.data.dtype != dtype:
                g = F.cast(g, dtype=self.backend.name_of(dtype))
        elif g.dtype != dtype:
            xp = self.backend.xp
            g = xp.astype(xp.asarray(g), dtype)
        return g

    def _saved_tensor(self, value: Any, j: int) -> Any:
        if self.op.save_index[j] < 0:
            # The result of this very node: PyTorch rebuilds it with this node as grad_fn.
            return Tensor(value, self.backend, requires_grad=True, grad_fn=self)
        return value


def _raw(value: Any) -> Any:
    """A saved value as a plain backward reads it: arrays, not Tensors."""
    if isinstance(value, tuple):
        return tuple(_raw(v) for v in value)
    return value.data if hasattr(value, "_backend") else value


def _as_grad(value: Any, like: Tensor, create_graph: bool) -> Any:
    """An upstream gradient given by the caller, checked and in the output's dtype."""
    from engine.tensor import tensor

    t = value if isinstance(value, Tensor) else tensor(value, device=like.device)
    if t.shape != like.shape:
        raise BackwardError(
            f"gradient has shape {fmt(t.shape)} but the output has shape {fmt(like.shape)}"
        )
    if t.dtype != like.dtype:
        t = t.to(dtype=like.dtype)
    return t if create_graph else t.data


def _implicit_grad(output: Tensor, create_graph: bool) -> Any:
    if output.numel() != 1:
        raise BackwardError("grad can be implicitly created only for scalar outputs")
    ones = output._backend.xp.ones(output.data.shape, dtype=output.data.dtype)
    if create_graph:

        return Tensor(ones, output._backend)
    return ones


def run_backward(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Any] | None,
    retain_graph: bool,
    create_graph: bool,
    capture: Sequence[Tensor] | None = None,
    check: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """The core pass. With `capture`, the gradients of those tensors are returned (by id)
    instead of accumulated into leaves' `.grad`. `check` runs before each node (a deadline)."""
    if grad_outputs is not None and len(grad_outputs) != len(outputs):
        raise BackwardError(f"got {len(grad_outputs)} gradients for {len(outputs)} outputs")
    grads: dict[Any, Any] = {}
    roots: list[Any] = []
    for k, out in enumerate(outputs):
        if not out.requires_grad:
            raise BackwardError(
                f"element {k} of tensors does not require grad and does not have a grad_fn"
            )
        given = None if grad_outputs is None else grad_outputs[k]
        g = (_implicit_grad(out, create_graph) if given is None
             else _as_grad(given, out, create_graph))
        key = out.grad_fn if out.grad_fn is not None else out
        grads[key] = g if key not in grads else grads[key] + g
        roots.append(key)
    roots = list(dict.fromkeys(roots))

    F = _namespaces.tensor if create_graph else _namespaces.raw(outputs[0]._backend)
    # For grad(): the node (or leaf) whose incoming gradient is each captured tensor's.
    wanted = {id(t.grad_fn if t.grad_fn is not None else t): id(t) for t in capture or ()}
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

    def deliver(leaf: Tensor, g: Any) -> None:
        if capture is not None:
            if id(leaf) in wanted:
                key = wanted[id(leaf)]
                results[key] = results[key] + g if key in results else g
            return
        _accumulate_leaf(leaf, g, create_graph)

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


class _Namespaces:
    """The two F namespaces, imported on first use (the op registry imports this module)."""

    def __getattr__(self, name: str) -> Any:
        from engine.ops.functional import F_TENSOR, raw_namespace

        self.tensor = F_TENSOR
        self.raw = raw_namespace
        return getattr(self, name)


_namespaces = _Namespaces()


def _skip(node: Node, deps: dict[Node, int], pending: dict[Any, Any], ready: list[Node],
          retain_graph: bool) -> None:
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


def _accumulate_leaf(leaf: Tensor, g: Any, create_graph: bool) -> None:
    """Leaf `.grad` accumulates across backward calls, as in PyTorch."""

    if not create_graph:
        g = Tensor(g if leaf.grad is None else leaf.grad.data + g, leaf._backend)
    elif leaf.grad is not None:
        g = leaf.grad + g
    leaf.grad = g


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """`torch.autograd.backward`: accumulate d(Σ outputs·grads)/d(leaf) into each leaf's `.grad`."""

    outs = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if grad_tensors is not None and not isinstance(grad_tensors, (list, tuple)):
        grad_tensors = [grad_tensors]
    retain = create_graph if retain_graph is None else retain_graph
    run_backward(outs, grad_tensors, bool(retain), create_graph, check=check)


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[Tensor | None, ...]:
    """`torch.autograd.grad`: the gradients of `outputs` with respect to `inputs`."""

    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is not None and not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    for i, t in enumerate(ins):
        if not t.requires_grad:
            raise BackwardError(f"One of the differentiated Tensors (input {i}) does not "
                                "require grad")
    retain = create_graph if retain_graph is None else retain_graph
    found = run_backward(outs, grad_outputs, bool(retain), create_graph, capture=ins)
    result: list[Tensor | None] = []
    for i, t in enumerate(ins):
        g = found.get(id(t))
        if g is None:
            if not allow_unused:
                raise BackwardError(
                    f"One of the differentiated Tensors (input {i}) appears to not have been "
                    "used in the graph. Set allow_unused=True if this is the desired behavior."
                )
            result.append(None)
        else:
            result.append(g if isinstance(g, Tensor) else Tensor(g, t._backend))
    return tuple(result)
