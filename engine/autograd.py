"""Reverse mode: the recorded Node, and the iterative backward pass.

The pass never recurses (a 100,000-node chain works): it counts each node's
consumers, runs a node once all of them have sent their gradient, drops each
gradient as soon as it is consumed, and frees saved values unless asked to
retain the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import BackwardError
from engine.grad_mode import enable_grad, no_grad
from engine.memory import current_tracker
from engine.shapes import fmt, sum_to_shape

if TYPE_CHECKING:
    from engine.ops.registry import OpDef
    from engine.tensor import Tensor

_FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time."
)


class Node:
    """`grad_fn` of a tensor: the op that made it, its input edges and what its VJP reads."""

    __slots__ = ("__weakref__", "attrs", "inputs", "needs", "op", "saved", "tracker")

    def __init__(
        self, op: OpDef, args: Sequence[Any], needs: list[bool], attrs: dict[str, Any], out: Any
    ) -> None:
        self.op = op
        self.attrs = attrs
        self.needs = needs
        # Each input edge: the input Tensor (its own grad_fn is the next node) or None.
        self.inputs = tuple(a if n else None for a, n in zip(args, needs, strict=True))
        # What the VJP reads: input Tensors or numbers, and the raw result (not the result
        # Tensor, which would be a reference cycle through its own grad_fn).
        self.saved: tuple[Any, ...] | None = tuple(
            out if i < 0 else args[i] for i in op.save_index
        )
        self.tracker = current_tracker()
        if self.tracker is not None and -1 in op.save_index:
            self.tracker.retain(out)

    def name(self) -> str:
        return self.op.grad_fn_name

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        return tuple((t.grad_fn if t is not None else None, 0) for t in self.inputs)

    def __repr__(self) -> str:
        return f"<{self.name()}>"

    def release(self) -> None:
        if self.saved is None:
            return
        if self.tracker is not None and -1 in self.op.save_index:
            self.tracker.release(self.saved[self.op.save_index.index(-1)])
        self.saved = None

    def apply(self, grad: Any, F: Any, create_graph: bool) -> list[Any]:
        """The input gradients for `grad`, each summed to its input's shape and dtype."""
        op = self.op
        if self.saved is None:
            if op.save:
                raise BackwardError(_FREED_MESSAGE, op=op.name)
            saved: tuple[Any, ...] = ()
        elif create_graph:
            saved = tuple(self._saved_tensor(v, j) for j, v in enumerate(self.saved))
        else:
            saved = tuple(v.data if _is_tensor(v) else v for v in self.saved)
        if op.variadic:
            grads = list(op.vjp(F, grad, *saved, **self.attrs))  # type: ignore[operator]
        else:
            vjps = op.vjp
            grads = [
                vjps[i](F, grad, *saved, **self.attrs) if need else None  # type: ignore[index]
                for i, need in enumerate(self.needs)
            ]
        for i, (g, t) in enumerate(zip(grads, self.inputs, strict=True)):
            if t is None or g is None:
                grads[i] = None
                continue
            shape = t.shape
            if tuple(g.shape) != shape:
                g = sum_to_shape(F, g, shape)
            if create_graph:
                if g.dtype != t.dtype:
                    g = F.cast(g, dtype=t.dtype)
            elif g.dtype != t.data.dtype:
                g = t._backend.xp.astype(t._backend.xp.asarray(g), t.data.dtype)
            grads[i] = g
        return grads

    def _saved_tensor(self, value: Any, j: int) -> Any:
        from engine.tensor import Tensor

        if self.op.save_index[j] < 0:
            # The result of this very node: PyTorch rebuilds it with this node as grad_fn.
            backend = next(t for t in self.inputs if t is not None)._backend
            return Tensor(value, backend, requires_grad=True, grad_fn=self)
        return value


def _is_tensor(v: Any) -> bool:
    return hasattr(v, "_backend")


def _as_grad(value: Any, like: Tensor, create_graph: bool) -> Any:
    """An upstream gradient given by the caller, checked and in the output's dtype."""
    from engine.tensor import Tensor, tensor

    t = value if isinstance(value, Tensor) else tensor(value, device=like.device)
    if t.shape != like.shape:
        raise BackwardError(
            f"gradient has shape {fmt(t.shape)} but the output has shape {fmt(like.shape)}"
        )
    if t.dtype != like.dtype:
        t = t.to(dtype=like.dtype) if create_graph else Tensor(
            like._backend.xp.astype(t.data, like.data.dtype), like._backend
        )
    return t if create_graph else t.data


def _implicit_grad(output: Tensor, create_graph: bool) -> Any:
    if output.numel() != 1:
        raise BackwardError("grad can be implicitly created only for scalar outputs")
    xp = output._backend.xp
    ones = xp.ones(output.data.shape, dtype=output.data.dtype)
    if create_graph:
        from engine.tensor import Tensor

        return Tensor(ones, output._backend)
    return ones


def run_backward(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Any] | None,
    retain_graph: bool,
    create_graph: bool,
    capture: Sequence[Tensor] | None = None,
) -> dict[int, Any]:
    """The core pass. With `capture`, the gradients of those tensors are returned (by id)
    instead of accumulated into leaves' `.grad`."""
    from engine.ops.functional import F_TENSOR, raw_namespace

    if grad_outputs is not None and len(grad_outputs) != len(outputs):
        raise BackwardError(
            f"got {len(grad_outputs)} gradients for {len(outputs)} outputs"
        )
    # Seed: the gradient arriving at each output tensor.
    pending: dict[Any, Any] = {}  # Node or leaf Tensor -> gradient so far
    roots: list[Any] = []
    for k, out in enumerate(outputs):
        if not out.requires_grad:
            raise BackwardError(
                f"element {k} of tensors does not require grad and does not have a grad_fn"
            )
        given = None if grad_outputs is None else grad_outputs[k]
        g = _implicit_grad(out, create_graph) if given is None else _as_grad(
            given, out, create_graph
        )
        key = out.grad_fn if out.grad_fn is not None else out
        pending[key] = pending[key] + g if key in pending else g
        roots.append(key)

    F = F_TENSOR if create_graph else raw_namespace(outputs[0]._backend)
    captured = {id(t): (t.grad_fn if t.grad_fn is not None else t) for t in capture or ()}
    wanted = {id(k): tid for tid, k in captured.items()}
    results: dict[int, Any] = {}

    # Count, for each node, how many edges from reachable nodes point at it.
    deps: dict[Node, int] = {}
    stack = [r for r in roots if isinstance(r, Node)]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for t in node.inputs:
            if t is None or t.grad_fn is None:
                continue
            nxt = t.grad_fn
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)

    tracker = current_tracker()
    mode = enable_grad() if create_graph else no_grad()
    with mode:
        for g in pending.values():
            if tracker is not None and not create_graph:
                tracker.retain(g)
        ready = [r for r in dict.fromkeys(roots) if isinstance(r, Node) and deps.get(r, 0) == 0]
        for leaf in [r for r in dict.fromkeys(roots) if not isinstance(r, Node)]:
            _deliver(leaf, pending.pop(leaf), wanted, results, create_graph, tracker)
        while ready:
            node = ready.pop()
            grad = pending.pop(node)
            in_grads = node.apply(grad, F, create_graph)
            if tracker is not None and not create_graph:
                tracker.release(grad)
            if id(node) in wanted:
                results[wanted[id(node)]] = grad
            del grad
            if not retain_graph:
                node.release()
            for t, g in zip(node.inputs, in_grads, strict=True):
                if t is None:
                    continue
                nxt = t.grad_fn
                if nxt is None:  # a leaf: accumulate now
                    if g is not None:
                        _deliver(t, g, wanted, results, create_graph, tracker)
                    continue
                if g is not None:
                    if nxt in pending:
                        old = pending[nxt]
                        pending[nxt] = old + g
                        if tracker is not None and not create_graph:
                            tracker.release(old)
                            tracker.retain(pending[nxt])
                    else:
                        pending[nxt] = g
                        if tracker is not None and not create_graph:
                            tracker.retain(g)
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    if nxt in pending:
                        ready.append(nxt)
                    else:  # nothing flowed in (all None): skip, but keep walking its inputs
                        _skip(nxt, deps, pending, ready, retain_graph)
    return results


def _skip(node: Node, deps: dict[Node, int], pending: dict[Any, Any], ready: list[Node],
          retain_graph: bool) -> None:
    """A node that received no gradient still releases its consumers' counts."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not retain_graph:
            n.release()
        for t in n.inputs:
            if t is None or t.grad_fn is None:
                continue
            nxt = t.grad_fn
            deps[nxt] -= 1
            if deps[nxt] == 0:
                if nxt in pending:
                    ready.append(nxt)
                else:
                    stack.append(nxt)


def _deliver(leaf: Tensor, g: Any, wanted: dict[int, int], results: dict[int, Any],
             create_graph: bool, tracker: Any) -> None:
    """A gradient reaching a leaf: captured for `grad()`, else accumulated into `.grad`."""
    from engine.tensor import Tensor

    if wanted:
        if id(leaf) in wanted:
            key = wanted[id(leaf)]
            results[key] = results[key] + g if key in results else g
        return
    if not create_graph:
        g = Tensor(g, leaf._backend)
    leaf.grad = g if leaf.grad is None else _accumulate(leaf.grad, g, create_graph)


def _accumulate(old: Tensor, new: Tensor, create_graph: bool) -> Tensor:
    from engine.tensor import Tensor

    if create_graph:
        return old + new
    return Tensor(old.data + new.data, old._backend)


def backward(
    tensors: Sequence[Tensor],
    grad_tensors: Sequence[Any] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
) -> None:
    """`torch.autograd.backward`: accumulate d(sum of outputs·grads)/d(leaf) into `.grad`."""
    run_backward(tensors, grad_tensors, bool(create_graph if retain_graph is None else
                                             retain_graph), create_graph)


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[Tensor | None, ...]:
    """`torch.autograd.grad`: the gradients of `outputs` with respect to `inputs`."""
    from engine.tensor import Tensor

    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is not None and not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    for i, t in enumerate(ins):
        if not t.requires_grad:
            raise BackwardError(f"input {i} of grad() does not require grad")
    retain = create_graph if retain_graph is None else retain_graph
    found = run_backward(outs, grad_outputs, bool(retain), create_graph, capture=ins)
    result: list[Tensor | None] = []
    for i, t in enumerate(ins):
        g = found.get(id(t))
        if g is None:
            if not allow_unused:
                raise BackwardError(
                    f"one of the differentiated tensors (input {i}) appears to not have been "
                    "used in the graph; set allow_unused=True if this is the desired behavior"
                )
            result.append(None)
        else:
            result.append(g if isinstance(g, Tensor) else Tensor(g, t._backend))
    return tuple(result)
