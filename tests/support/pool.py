"""Shared by the tests (from tests/service/test_pool.py)."""

from __future__ import annotations

from typing import Any


def worker_body(k: float = 1.0, n: int = 5000) -> dict[str, Any]:
    """A cheap request with a body over 16 KiB: it computes in a worker."""
    return {
        "graph": {"nodes": [{"id": "s", "expr": f"sum(x * {k})"}], "outputs": ["s"]},
        "inputs": {"x": [1.0] * n},
        "no_grad": True,
    }
