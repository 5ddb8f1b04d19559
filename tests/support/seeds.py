"""The two seed examples of docs/contract.md as request bodies, shared by the API,
integration and image tests."""

from __future__ import annotations

from typing import Any

SEED_OP: dict[str, Any] = {
    "graph": {
        "nodes": [
            {"id": "s", "op": "add", "args": ["x", "y"]},
            {"id": "d", "op": "sub", "args": ["x", "y"]},
            {"id": "z", "op": "mul", "args": ["s", "d"]},
        ],
        "outputs": ["z"],
    },
    "inputs": {
        "x": {"data": 2.0, "requires_grad": True},
        "y": {"data": 3.0, "requires_grad": True},
    },
    "device": "cpu",
}
SEED_EXPR: dict[str, Any] = {
    "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
    "inputs": SEED_OP["inputs"],
}
SEED_NO_GRAD: dict[str, Any] = {
    "graph": {"nodes": [{"id": "B", "expr": "A ** 2 + 16"}], "outputs": ["B", "A"]},
    "inputs": {"A": {"data": [5.0], "requires_grad": True}},
    "no_grad": True,
}
