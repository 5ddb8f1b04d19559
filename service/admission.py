"""Admission control: a fixed number of compute slots and a budget of planned bytes for
everything in flight. Both refuse at once rather than queue, so a client sees 503 with
`Retry-After` and can back off or go to another replica (a queue would only hide load
behind growing latency)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.errors import ProblemError
from service.metrics import Metrics

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_concurrency: int, inflight_bytes: int, metrics: Metrics) -> None:
        self.max_concurrency = max_concurrency
        self.inflight_bytes = inflight_bytes
        self.metrics = metrics
        self.active = 0  # touched on the event loop only
        self.reserved = 0  # touched from worker threads, under the lock
        self._lock = threading.Lock()
        # Read when /metrics is scraped: no gauge update (and its lock) on every request.
        metrics.computing.set_function(lambda: self.active)
        metrics.reserved_bytes.set_function(lambda: self.reserved)

    def enter(self) -> None:
        """Take a compute slot (on the event loop) or refuse with 503."""
        if self.active >= self.max_concurrency:
            self.metrics.rejected["concurrency"].inc()
            raise _busy(f"all {self.max_concurrency} compute slots are busy; retry shortly")
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    def take(self, planned_bytes: int) -> None:
        """Reserve `planned_bytes` of the in-flight budget, or refuse with 503. Every
        `take` that returns is paired with a `release` of the same bytes."""
        with self._lock:
            if self.reserved + planned_bytes > self.inflight_bytes:
                self.metrics.rejected["inflight_memory"].inc()
                raise _busy(
                    f"this request plans {planned_bytes} bytes and {self.reserved} of the "
                    f"server's {self.inflight_bytes} in-flight bytes are taken; retry shortly",
                    planned_bytes=planned_bytes,
                )
            self.reserved += planned_bytes

    def release(self, planned_bytes: int) -> None:
        with self._lock:
            self.reserved -= planned_bytes

    @contextmanager
    def reserve(self, planned_bytes: int) -> Iterator[None]:
        """Hold `planned_bytes` of the in-flight budget while a computation runs."""
        self.take(planned_bytes)
        try:
            yield
        finally:
            self.release(planned_bytes)


def _busy(detail: str, **extra: Any) -> ProblemError:
    return ProblemError(
        "overloaded", detail, headers={"Retry-After": str(RETRY_AFTER_S)}, **extra
    )
