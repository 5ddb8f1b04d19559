"""Shared by the tests (from tests/service/test_recompute_http.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

N, STEPS = 1000, 60  # h_i = sin(h_{i-1}) * 0.999 over N float64 values, STEPS steps


def chain(n: int = N, steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    nodes = [{"id": f"h{i}", "expr": f"sin(h{i - 1}) * 0.999"} for i in range(1, steps + 1)]
    nodes.append({"id": "loss", "op": "sum", "args": [f"h{steps}"]})
    x = np.linspace(-1.0, 1.0, n)
    return {
        "graph": {"nodes": nodes, "outputs": ["loss"]},
        "inputs": {"h0": {"data": x.tolist(), "dtype": "float64", "requires_grad": True}},
        **extra,
    }
