"""User code as the README writes it: the engine's Python API, the client and tracing.

It is type-checked, not run (tests/project/test_typing.py runs mypy, strict, over it): every line
here is one a user writes, and each `assert_type` says what a type checker must see. Where
the README leaves an Optional unchecked (`x.grad.item()`), this file checks it, as strict
user code must.
"""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np

import gradserve.engine as ge
from gradserve import (
    AsyncClient,
    Client,
    F,
    GradserveHTTPError,
    Result,
    TracedTensor,
    grad,
    scan,
    trace,
)

# ---------------------------------------------------------------- the engine
x = ge.tensor(2.0, requires_grad=True)
y = ge.tensor(3.0, requires_grad=True)
z = (x + y) * (x - y)
z.backward()
assert z.grad_fn is not None and x.grad is not None and y.grad is not None
print(z.item(), z.grad_fn.name(), x.grad.item(), y.grad.item())
assert_type(z, ge.Tensor)
assert_type(x.sum(), ge.Tensor)
assert_type(2 * x - 1.5, ge.Tensor)
assert_type(x == y, ge.Tensor)

a = ge.tensor([5.0], requires_grad=True)
with ge.no_grad():
    b = a**2 + 16

w = ge.tensor([[0.5, -1.0], [2.0, 0.1]], dtype="float64", requires_grad=True)
loss = ge.mean(ge.softmax(w @ w, dim=1) ** 2)
(g,) = ge.grad(loss, w, create_graph=True)
v = ge.ones(shape=[2, 2], dtype="float64")
assert g is not None
(hvp,) = ge.grad(g, w, grad_outputs=v)
assert ge.gradcheck(lambda w: ge.logsumexp(w @ w, dim=0), [w])
assert_type(w.sum(dim=1, keepdim=True).exp().T[0], ge.Tensor)
assert_type(ge.cat([w, w], dim=0).reshape(2, 4).float(), ge.Tensor)


# ---------------------------------------------------------------- the client, tracing
def seed(x: TracedTensor, y: TracedTensor) -> dict[str, TracedTensor]:
    return {"z": (x + y) * (x - y)}


def model(
    X: TracedTensor, W1: TracedTensor, b1: TracedTensor, W2: TracedTensor, onehot: TracedTensor
) -> dict[str, Any]:
    h = F.relu(X @ W1 + b1)
    logits = h @ W2
    loss = -(onehot * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
    return {"loss": loss, "g": grad(loss, W1)}


def rnn(
    h0: TracedTensor, xs: TracedTensor, w: TracedTensor, u: TracedTensor, b: TracedTensor
) -> dict[str, Any]:
    def cell(h: TracedTensor, x: TracedTensor) -> tuple[TracedTensor, TracedTensor]:
        h2 = F.tanh(x @ w + h @ u + b)
        return h2, h2

    h_last, hs = scan(cell, h0, xs)
    return {"loss": (h_last * h_last).sum() + hs.sum() / 10}


graph = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
with Client("http://127.0.0.1:8000") as gs:
    print(gs.trace(seed, x=((), "float32"), y=((), "float32")))
    r = gs.backward(seed, {"x": 2.0, "y": 3.0})
    print(r.outputs["z"], r.gradients["x"], r.gradients["y"], r.grad_fn["z"])
    assert_type(r.gradients["x"], np.ndarray)

    X, onehot = np.random.randn(16, 5), np.eye(3)[np.random.randint(0, 3, 16)]
    W1, b1, W2 = np.random.randn(5, 8), np.zeros(8), np.random.randn(8, 3)
    r = gs.backward(
        model,
        {"X": X, "W1": W1, "b1": b1, "W2": W2, "onehot": onehot},
        requires_grad=["W1", "b1", "W2"],
        grad_outputs={"g": np.zeros((5, 8))},
    )
    print(r.outputs["loss"], r.gradients["W2"].shape, r.meta["peak_bytes"])

    f: Result = gs.forward(graph, {"x": 2.0, "y": 3.0}, no_grad=True)
    print(f.outputs["z"], f.gradients)
    try:
        gs.forward(
            {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}], "outputs": ["z"]},
            {"a": np.ones((3, 4)), "b": np.ones((5, 2))},
        )
    except GradserveHTTPError as e:
        print(e.status, e.type, e.node, e.detail)

# Without a server: the standard catalog.
traced = trace(
    rnn,
    h0=((4,), "float32"),
    xs=((7, 3), "float32"),
    w=((3, 4), "float32"),
    u=((4, 4), "float32"),
    b=((4,), "float32"),
)
assert_type(traced, dict[str, Any])
print(traced["nodes"])


async def main() -> None:
    async with AsyncClient("http://127.0.0.1:8000") as ags:
        r = await ags.backward(graph, {"x": 2.0, "y": 3.0})
        assert_type(r.gradients["x"], np.ndarray)
