"""The compiled form of a graph: one list of steps over value slots, forward and backward.

A slot holds one array while a program runs; its Meta (shape and dtype) is known before
anything runs. A step applies one op of the registry to slots and number literals and
writes one new slot (a loop, `scan`, writes several: engine.graph.scan). The backward
pass is more steps of the same kind, derived from the forward ones
(`engine.graph.autodiff`), so that one liveness analysis plans the memory of the whole
run, and one cost rule per op prices it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradserve.engine.ops.registry import Meta, OpDef


class Lit:
    """A number literal among a step's arguments (slots are plain ints)."""

    __slots__ = ("value",)

    def __init__(self, value: bool | int | float) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


Arg = int | Lit

# What a step is there for: a node of the client's graph (after `expr` expansion), a cast
# that type promotion inserted before an op, a constant, a step of the request's derived
# backward, or a step of a derivative a node asks for (`grad`, `jvp`: part of the forward).
NODE, CAST, CONSTANT, BACKWARD, DERIVED = "node", "cast", "constant", "backward", "derived"
# A forward step run again in the backward, so that its value need not be kept from the
# forward (engine.graph.remat): the same op, arguments and attributes, into a slot of its own.
RECOMPUTE = "recompute"

# A byte read or written costs about as much time as this many floating-point operations
# (memory moves ~10 GB/s per core where arithmetic runs ~100 GFLOP/s): cost units are
# flop-equivalents, so that the budget bounds time whether an op is compute- or memory-bound.
BYTE_COST = 8


@dataclass(slots=True, eq=False)
class Step:
    op: OpDef
    args: tuple[Arg, ...]
    attrs: dict[str, Any]
    out: int
    kind: str
    origin: str | None  # the client's node id it serves (errors, and cost by node)
    more: tuple[int, ...] = ()  # the slots it writes after `out` (a `scan` step's results)

    @property
    def outs(self) -> tuple[int, ...]:
        return (self.out, *self.more) if self.more else (self.out,)

    @property
    def slots(self) -> tuple[int, ...]:
        """The slots it reads, in argument order."""
        return tuple(a for a in self.args if type(a) is int)


@dataclass(eq=False)
class Program:
    """A validated graph with its derived backward, planned and ready to bind and run."""

    metas: list[Meta]  # per slot
    steps: list[Step]  # in run order; after planning, only the steps that are needed
    inputs: dict[str, int]  # input name -> slot (the request's inputs)
    grad_inputs: dict[str, int]  # grad_outputs name -> slot (given upstream gradients)
    outputs: list[tuple[str, int]]  # (name, slot); names are unique
    gradients: list[tuple[str, int]]  # input name -> slot of its gradient (/backward)
    requires_grad: list[bool]  # per slot, as PyTorch would report it
    grad_fn: list[str | None]  # per slot: the `grad_fn` name an output would report
    no_grad: bool
    backward: bool
    held: set[int] = field(default_factory=set)  # slots kept to the end of the run
    # Filled in by the planner (engine.graph.plan):
    frees: list[tuple[int, ...]] = field(default_factory=list)  # per step: slots last used
    reuse: list[int] = field(default_factory=list)  # per step: slot whose buffer it writes, or -1
    ufunc: list[bool] = field(default_factory=list)  # per step: runs as the backend's ufunc
    nodes: int = 0  # op nodes of the client's graph that run (after `expr` expansion)
    planned_peak_bytes: int = 0
    flops: int = 0
    bytes_moved: int = 0
    cost_by_node: dict[str, int] = field(default_factory=dict)
    step_costs: list[int] = field(default_factory=list)  # per step, in cost units
    # Cost units of the work done again to fit the memory budget: the RECOMPUTE steps, and
    # the forward segments checkpointed loops replay (inside compute_cost).
    recompute_cost: int = 0
    # The planned peak before any recomputation (engine.graph.remat); without it, the peak.
    peak_without_recompute: int = 0
    plan_ms: float = 0.0
    # Per vmap node, the indices it computes at once (its chunk_size, or the planner's);
    # and whether a vmap leaves its chunks to the planner (they follow the memory budget).
    vmap_chunks: dict[str, int] = field(default_factory=dict)
    vmap_budgeted: bool = False
    # A vmap's reduction adds index after index, whatever the chunks: the XLA tier, whose
    # sums keep no order, leaves the program to the interpreter.
    index_ordered: bool = False
    lifted: bool = False  # another program's, with new float literals (engine.graph.lifting)
    # Counted when first asked (engine.graph.scan's executed_steps and compiled_steps, and
    # compiler.rolled_fraction): a lifted program shares its template's counts (the same
    # steps; only how much of it rolls may differ with its literals, a prediction's figure).
    executed_count: int | None = None
    compiled_count: int | None = None
    rolled_fraction: float | None = None
    run: Any = None  # the steps bound to a backend's kernels (engine.graph.executor.Bound)

    @property
    def estimated_bytes(self) -> int:
        """What the program itself takes in memory (measured: ~370 bytes a step with its
        kernel tuple, the metas shared), for caches bounded by bytes."""
        return 400 * len(self.steps) + 64 * len(self.metas) + 4096

    @property
    def compute_cost(self) -> int:
        """Cost units (flop-equivalents): floating-point operations, plus BYTE_COST per byte
        read or written."""
        return self.flops + BYTE_COST * self.bytes_moved
