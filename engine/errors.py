"""One error hierarchy for everything a caller can get wrong.

Each error carries where it happened (`node`, `op`, and for tensor data a
`loc` path) so the service can point at the exact place in a request.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence
from typing import Any


def quoted(name: str, limit: int = 64) -> str:
    """`repr(name)` for a message; a name longer than `limit` is cut there and its length
    given, so that a megabyte-long id does not make a megabyte-long message."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}...({len(name)} characters)"


def did_you_mean(name: object, candidates: Collection[str]) -> str:
    """`" (did you mean 'logsumexp'?)"` for the candidate closest to `name`, if one is
    close; "" otherwise (and for more candidates than are worth comparing)."""
    if not isinstance(name, str) or len(candidates) > 5000:
        return ""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {quoted(close[0])}?)" if close else ""


class GradserveError(Exception):
    """Base class: a message plus the node and op it concerns."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        op: str | None = None,
        loc: Sequence[str | int] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.node = node
        self.op = op
        self.loc = tuple(loc) if loc is not None else None

    def __str__(self) -> str:
        if self.node is not None:
            where = f"node {quoted(self.node)}" + (f" ({self.op})" if self.op else "")
            return f"{where}: {self.message}"
        if self.op is not None:
            return f"{self.op}: {self.message}"
        return self.message

    def at(self, node: str | None = None, op: str | None = None) -> GradserveError:
        """Fill in the location if it is not known yet; returns self for `raise e.at(...)`."""
        if self.node is None:
            self.node = node
        if self.op is None:
            self.op = op
        return self


class GraphError(GradserveError):
    """A structural problem: duplicate ids, unknown references, cycles, outputs."""


class UnknownOpError(GraphError):
    """An op name that is not in the catalog."""


class ArityError(GraphError):
    """Wrong number of tensor arguments for an op."""


class AttributeError_(GraphError):
    """A missing, unknown or ill-typed attribute."""


class ExprError(GraphError):
    """An `expr` string that the whitelisting parser refuses."""


class ShapeError(GradserveError):
    """Shapes that do not fit an op's shape rule."""


class DTypeError(GradserveError):
    """A dtype an op does not accept, or requires_grad on a non-float tensor."""


class TensorDataError(GradserveError):
    """Tensor data that does not match its declared shape or dtype."""


class DeviceUnavailableError(GradserveError):
    """A device that this host cannot run on; the message lists the available ones."""


class BackwardError(GradserveError):
    """Backward misuse: freed graph, non-scalar without gradient, nothing requires grad."""


class MemoryBudgetError(GradserveError):
    """The planned peak memory of a run is over its budget."""

    def __init__(self, message: str, *, planned_bytes: int, budget_bytes: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.planned_bytes = planned_bytes
        self.budget_bytes = budget_bytes


class ComputeBudgetError(GradserveError):
    """The static cost of a run (forward and backward) is over its budget."""

    def __init__(self, message: str, *, cost: int, budget: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.cost = cost
        self.budget = budget


class NonFiniteError(GradserveError):
    """With detect_anomaly: a step made NaN or infinite values from finite inputs. `node`
    is the graph node (a backward step's: the forward node it differentiates), `op` the
    primitive (a backward step's: the forward primitive whose derivative it computes),
    `phase` "forward" or "backward", `count` how many values of its result."""

    def __init__(self, message: str, *, phase: str, count: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.phase = phase
        self.count = count


class DeadlineExceeded(GradserveError):
    """The run went past its time limit; it was stopped between two nodes."""


class Cancelled(GradserveError):
    """The run was cancelled from outside (the server is shutting down); it stopped between
    two nodes."""


class ValidationErrors(GradserveError):
    """Several errors found in one pass; `errors` holds each with its location."""

    def __init__(self, errors: Sequence[GradserveError]) -> None:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(first.message + more, node=first.node, op=first.op, loc=first.loc)
        self.errors = list(errors)
