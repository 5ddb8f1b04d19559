"""Shared by the tests (from tests/engine/test_objectives.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gradserve.engine.graph import NodeSpec

torch = pytest.importorskip("torch")


F = torch.nn.functional


RNG = np.random.default_rng(42)


def objective_data() -> dict[str, np.ndarray]:
    return {
        "X": RNG.standard_normal((16, 5)),
        "w": RNG.standard_normal(5) * 0.3,
        "b": RNG.standard_normal(()),
        "y": np.where(RNG.standard_normal(16) > 0, 1.0, -1.0),
        "W1": RNG.standard_normal((5, 8)) * 0.4,
        "b1": RNG.standard_normal(8) * 0.1,
        "W2": RNG.standard_normal((8, 3)) * 0.4,
        "onehot": np.eye(3)[RNG.integers(0, 3, 16)],
        "labels": RNG.integers(0, 3, (16, 1)),
        "Q": RNG.standard_normal((2, 4, 6)),
        "K": RNG.standard_normal((2, 4, 6)),
        "V": RNG.standard_normal((2, 4, 6)),
        "gamma": RNG.uniform(0.5, 1.5, 5),
        "beta": RNG.standard_normal(5) * 0.1,
        "A": RNG.standard_normal((4, 4)) + 4 * np.eye(4),
        "t": RNG.standard_normal(4),
    }


# name -> (graph nodes, output, differentiable inputs, the same objective in torch)
OBJECTIVES: dict[str, tuple[list[NodeSpec], str, list[str], Callable[..., Any]]] = {
    "least-squares": (
        [NodeSpec("loss", expr="mean((X @ w + b - y) ** 2)")],
        "loss",
        ["w", "b"],
        lambda d: torch.mean((d["X"] @ d["w"] + d["b"] - d["y"]) ** 2),
    ),
    "logistic-regression-l2": (
        [
            NodeSpec("margin", expr="-y * (X @ w + b)"),
            NodeSpec("loss", expr="mean(softplus(margin)) + 0.01 * sum(w * w)"),
        ],
        "loss",
        ["w", "b"],
        lambda d: (
            torch.mean(F.softplus(-d["y"] * (d["X"] @ d["w"] + d["b"])))
            + 0.01 * torch.sum(d["w"] * d["w"])
        ),
    ),
    "mlp-cross-entropy": (
        [
            NodeSpec("h", expr="relu(X @ W1 + b1)"),
            NodeSpec("logits", expr="h @ W2"),
            NodeSpec("loss", expr="-mean(sum(onehot * log_softmax(logits, dim=1), dim=1))"),
        ],
        "loss",
        ["W1", "b1", "W2"],
        lambda d: F.cross_entropy(
            torch.relu(d["X"] @ d["W1"] + d["b1"]) @ d["W2"], d["onehot"].argmax(dim=1)
        ),
    ),
    "nll-by-gather": (
        [
            NodeSpec("logp", expr="log_softmax(tanh(X @ W1) @ W2, dim=-1)"),
            NodeSpec("picked", "gather", ["logp", "labels"], {"dim": 1}),
            NodeSpec("loss", expr="-mean(picked)"),
        ],
        "loss",
        ["W1", "W2"],
        lambda d: (
            -torch.mean(
                torch.gather(
                    torch.log_softmax(torch.tanh(d["X"] @ d["W1"]) @ d["W2"], dim=-1),
                    1,
                    d["labels"],
                )
            )
        ),
    ),
    "attention": (
        [
            NodeSpec("scores", expr="Q @ transpose(K, dim0=-2, dim1=-1) / 2.449489742783178"),
            NodeSpec("out", expr="softmax(scores, dim=-1) @ V"),
            NodeSpec("loss", expr="sum(out * out)"),
        ],
        "loss",
        ["Q", "K", "V"],
        lambda d: torch.sum(
            (torch.softmax(d["Q"] @ d["K"].transpose(-2, -1) / 2.449489742783178, dim=-1) @ d["V"])
            ** 2
        ),
    ),
    "layer-norm": (
        [
            NodeSpec("mu", expr="mean(X, dim=-1, keepdim=True)"),
            NodeSpec("var", expr="var(X, dim=-1, keepdim=True, correction=0)"),
            NodeSpec("n", expr="(X - mu) / sqrt(var + 1e-5) * gamma + beta"),
            NodeSpec("loss", expr="sum(n ** 3)"),
        ],
        "loss",
        ["X", "gamma", "beta"],
        lambda d: torch.sum(F.layer_norm(d["X"], (5,), d["gamma"], d["beta"], eps=1e-5) ** 3),
    ),
    "logsumexp-softmax-margin": (
        [
            NodeSpec("s", expr="X @ W1"),
            NodeSpec("loss", expr="mean(logsumexp(s, dim=1) - max(s, dim=1))"),
        ],
        "loss",
        ["W1"],
        lambda d: torch.mean(
            torch.logsumexp(d["X"] @ d["W1"], dim=1) - torch.amax(d["X"] @ d["W1"], dim=1)
        ),
    ),
    "linear-system": (
        [
            NodeSpec("x", expr="solve(A, t)"),
            NodeSpec("loss", expr="sum(x * x) + log(abs(det(A))) + sum(inv(A) * A)"),
        ],
        "loss",
        ["A", "t"],
        lambda d: (
            torch.sum(torch.linalg.solve(d["A"], d["t"]) ** 2)
            + torch.log(torch.abs(torch.linalg.det(d["A"])))
            + torch.sum(torch.inverse(d["A"]) * d["A"])
        ),
    ),
    "huber-with-where-and-clamp": (
        [
            NodeSpec("r", expr="X @ w - 0.5"),
            NodeSpec(
                "loss",
                expr="mean(where(abs(r) < 1.0, 0.5 * r ** 2, abs(r) - 0.5))"
                " + sum(clamp(w, min=-0.2, max=0.2) ** 2)",
            ),
        ],
        "loss",
        ["w"],
        lambda d: (
            F.huber_loss(d["X"] @ d["w"] - 0.5, torch.zeros(16, dtype=torch.float64))
            + torch.sum(torch.clamp(d["w"], -0.2, 0.2) ** 2)
        ),
    ),
    "einsum-bilinear": (
        [
            NodeSpec(
                "loss",
                expr='sum(einsum("bi,ij,bj->b", X, W1 @ transpose(W1, dim0=0, '
                "dim1=1), X) ** 2) / 100.0",
            )
        ],
        "loss",
        ["W1"],
        lambda d: (
            torch.sum(torch.einsum("bi,ij,bj->b", d["X"], d["W1"] @ d["W1"].T, d["X"]) ** 2) / 100.0
        ),
    ),
}
