"""The plain data types at the boundary between the service and the graph engine.

The compiler reads a graph through `GraphLike`: `GraphSpec` is the engine's own, and any
object with the same fields will do (the service's validated wire models: it compiles
what it validated, with no copy in between). A node may leave `args` and `attrs` out
(None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Literal = bool | int | float


class NodeLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def op(self) -> str | None: ...
    @property
    def args(self) -> Sequence[str | Literal] | None: ...
    @property
    def attrs(self) -> Mapping[str, Any] | None: ...
    @property
    def expr(self) -> str | None: ...
    @property
    def body(self) -> BodyLike | MapBodyLike | None: ...
    @property
    def results(self) -> Mapping[str, str | ReductionLike] | None: ...


class BodyLike(Protocol):
    """A `scan` node's body."""

    @property
    def carry(self) -> Sequence[str]: ...
    @property
    def xs(self) -> Sequence[str]: ...
    @property
    def nodes(self) -> Sequence[NodeLike]: ...
    @property
    def next(self) -> Mapping[str, str]: ...


class MapBodyLike(Protocol):
    """A `vmap` node's body: its slices' names (`in_`, the wire's "in") and its nodes."""

    @property
    def in_(self) -> Sequence[str]: ...
    @property
    def nodes(self) -> Sequence[NodeLike]: ...


class ReductionLike(Protocol):
    """A `vmap` result that reduces a body value over the mapped dim."""

    @property
    def of(self) -> str: ...
    @property
    def reduce(self) -> str: ...
    @property
    def max_norm(self) -> float | None: ...
    @property
    def norm_of(self) -> Sequence[str] | None: ...


class GraphLike(Protocol):
    @property
    def nodes(self) -> Sequence[NodeLike]: ...
    @property
    def outputs(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class NodeSpec:
    """One node: either an op with args and attrs, or an infix `expr` string. A `scan` or
    `vmap` node also has its `body` and the `results` it declares (new id -> carry or body
    id, or a vmap's reduction)."""

    id: str
    op: str | None = None
    args: Sequence[str | Literal] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    expr: str | None = None
    body: BodySpec | MapBodySpec | None = None
    results: Mapping[str, str | ReductionSpec] | None = None


@dataclass(frozen=True)
class BodySpec:
    """A `scan` node's loop body: the carries' and the per-step slices' names, its nodes,
    and each carry's next value."""

    carry: Sequence[str]
    xs: Sequence[str]
    nodes: Sequence[NodeSpec]
    next: Mapping[str, str]


@dataclass(frozen=True)
class MapBodySpec:
    """A `vmap` node's body: the names of its slices (the wire's "in"), and its nodes."""

    in_: Sequence[str]
    nodes: Sequence[NodeSpec]


@dataclass(frozen=True)
class ReductionSpec:
    of: str
    reduce: str
    max_norm: float | None = None
    norm_of: Sequence[str] | None = None


@dataclass(frozen=True)
class GraphSpec:
    nodes: Sequence[NodeSpec]
    outputs: Sequence[str]


@dataclass(frozen=True)
class TensorSpec:
    """What validation and planning need to know of an input (no data)."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False


@dataclass(frozen=True)
class Limits:
    max_nodes: int = 100_000
    expr_max_chars: int = 10_000
    expr_max_depth: int = 100
    max_errors: int = 20  # errors reported from one validation pass
    memory_budget_bytes: int | None = None  # for the planned peak of the path that will run
    # A backward over the memory budget recomputes forward values to fit: its loops'
    # (engine.graph.checkpoint), then the top level's (engine.graph.remat)
    recompute: bool = True
    compute_budget: float | None = None  # cost units (engine.graph.ir.Program.compute_cost)
    max_inputs: int = 10_000
    max_id_chars: int = 256  # node ids and input names
    max_loop_depth: int = 16  # scans inside scans


@dataclass
class RunResult:
    outputs: dict[str, Any]  # arrays of the program's backend
    gradients: dict[str, Any] | None  # None for a forward-only run
    peak_bytes: int  # measured by the engine's accounting
    planned_peak_bytes: int
    nodes: int  # op nodes executed, after `expr` expansion
    timings_ms: dict[str, float]  # "plan", "forward", and "backward" when it ran
