"""Shared by the tests (from tests/engine/test_remat.py)."""

from __future__ import annotations

from gradserve.engine.graph import (
    GraphSpec,
    NodeSpec,
)


def sin_chain(steps: int) -> GraphSpec:
    """The issue's chain, h_i = sin(h_{i-1}) * 0.999, ending in sum."""
    nodes, h = [], "x"
    for i in range(steps):
        nodes.append(NodeSpec(f"h{i}", expr=f"sin({h}) * 0.999"))
        h = f"h{i}"
    return GraphSpec([*nodes, NodeSpec("loss", "sum", [h])], ["loss"])
