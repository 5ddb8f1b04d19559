"""The compiled form of a graph: steps in execution order, and what the planner knows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.ops.registry import Meta, OpDef


@dataclass(slots=True, eq=False)
class Step:
    """One op node, resolved: its value slot, op, arguments and bound attributes."""

    id: str  # the node id (generated for the inner nodes of an `expr`)
    origin: str  # the client's node id, for error messages
    index: int  # position of the client's node in `graph.nodes`, for error locations
    slot: int
    op: OpDef
    args: list[tuple[bool, Any]]  # (True, slot) for a value, (False, number) for a literal
    attrs: dict[str, Any]
    meta: Meta | None = None
    requires_grad: bool = False
    frees: tuple[int, ...] = ()  # slots whose last use is this step


@dataclass(eq=False)
class Program:
    """A validated, planned graph, ready for `execute`."""

    steps: list[Step]  # in execution order: only what the outputs need
    input_slots: dict[str, int]
    outputs: list[tuple[str, int]]  # (name, slot); names are unique
    metas: list[Meta | None]  # per slot
    requires_grad: list[bool]  # per slot
    no_grad: bool
    backward: bool
    roots: list[str] = field(default_factory=list)  # outputs the backward pass starts from
    grad_inputs: list[str] = field(default_factory=list)  # inputs that get a gradient
    planned_peak_bytes: int = 0
    plan_ms: float = 0.0

    @property
    def nodes(self) -> int:
        return len(self.steps)
