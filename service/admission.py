"""Admission control: a fixed number of compute slots, refused at once rather than queued,
so a client sees 503 with `Retry-After` and can back off or go to another replica (a queue
would only hide load behind growing latency). Each slot has a number: its line in the
in-flight memory ledger (service/workers.py)."""

from __future__ import annotations

from service.errors import ProblemError
from service.metrics import Metrics

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_concurrency: int, metrics: Metrics) -> None:
        self.max_concurrency = max_concurrency
        self.metrics = metrics
        self._free = list(range(max_concurrency))[::-1]  # touched on the event loop only
        # Read when /metrics is scraped (published each second with several front
        # processes): no gauge update (and its lock) on every request.
        metrics.track(metrics.computing, lambda: self.active)

    @property
    def active(self) -> int:
        return self.max_concurrency - len(self._free)

    def enter(self) -> int:
        """Take a compute slot (its number), or refuse with 503."""
        if not self._free:
            self.metrics.rejected["concurrency"].inc()
            raise ProblemError(
                "overloaded",
                f"all {self.max_concurrency} compute slots are busy; retry shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return self._free.pop()

    def leave(self, slot: int) -> None:
        self._free.append(slot)
