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

    def enter(self) -> None:
        """Take a compute slot (on the event loop) or refuse with 503."""
        if self.active >= self.max_concurrency:
            self.metrics.rejections.labels("concurrency").inc()
            raise _busy(f"all {self.max_concurrency} compute slots are busy; retry shortly")
        self.active += 1
        self.metrics.computing.inc()

    def leave(self) -> None:
        self.active -= 1
        self.metrics.computing.dec()

    @contextmanager
    def reserve(self, planned_bytes: int) -> Iterator[None]:
        """Hold `planned_bytes` of the in-flight budget while a computation runs."""
        with self._lock:
            if self.reserved + planned_bytes > self.inflight_bytes:
                self.metrics.rejections.labels("inflight_memory").inc()
                raise _busy(
                    f"this request plans {planned_bytes} bytes and {self.reserved} of the "
                    f"server's {self.inflight_bytes} in-flight bytes are taken; retry shortly",
                    planned_bytes=planned_bytes,
                )
            self.reserved += planned_bytes
            self.metrics.reserved_bytes.set(self.reserved)
        try:
            yield
        finally:
            with self._lock:
                self.reserved -= planned_bytes
                self.metrics.reserved_bytes.set(self.reserved)


def _busy(detail: str, **extra: Any) -> ProblemError:
    return ProblemError(
        "overloaded", detail, headers={"Retry-After": str(RETRY_AFTER_S)}, **extra
    )
