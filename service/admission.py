"""Admission control: a fixed number of compute slots, and a bounded queue for them (as
Triton's queue policy: `max_queue_size`, `default_timeout_microseconds`, `timeout_action:
REJECT`). A request that finds every slot busy waits for one, first come first served,
for at most `GRADSERVE_QUEUE_TIMEOUT_S` and never past its own deadline. It gets 503 with
`Retry-After` only when the queue is full or its wait runs out, so that a client can back
off or go to another replica rather than wait behind ever longer latency; one whose
deadline passes while it waits gets 504. Each slot has a number: its line in the
in-flight memory ledger (service/ledger.py). The waits and deadlines run on the front
process's clock (service/clock.py)."""

from __future__ import annotations

import asyncio
from collections import deque

from gradserve.engine.errors import DeadlineExceeded
from gradserve.service.clock import SYSTEM_CLOCK, Clock
from gradserve.service.errors import ProblemError
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings

RETRY_AFTER_S = 1


class Admission:
    """The slots and their queue; used on the event loop only."""

    def __init__(self, settings: Settings, metrics: Metrics, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.max_concurrency = settings.max_concurrency
        self.max_queue_size = settings.max_queue_size
        self.queue_timeout_s = settings.queue_timeout_s
        self.request_timeout_s = settings.request_timeout_s
        self.metrics = metrics
        self._free = list(range(self.max_concurrency))[::-1]
        self._queue: deque[asyncio.Future[int]] = deque()  # each waiter's slot, to come
        # Read when /metrics is scraped (published each second with several front
        # processes): no gauge update (and its lock) on every request.
        metrics.track(metrics.computing, lambda: self.active)
        metrics.track(metrics.queue_length, lambda: len(self._queue))

    @property
    def active(self) -> int:
        return self.max_concurrency - len(self._free)

    def take(self) -> int | None:
        """A compute slot that is free now (its number), or None: the caller waits in turn
        with `enter`."""
        return self._free.pop() if self._free else None

    async def enter(self, deadline: float) -> int:
        """Take a compute slot (its number), waiting for one in turn if none is free; 503
        when the queue is full or the wait runs out, 504 at `deadline` (on `clock`)."""
        if self._free:
            return self._free.pop()
        if len(self._queue) >= self.max_queue_size:
            self.metrics.rejected["queue_full"].inc()
            raise _busy(
                f"all {self.max_concurrency} compute slots are busy and "
                f"{len(self._queue)} requests wait for one (the queue's bound)"
            )
        turn: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        began = self.clock.now()
        until = min(began + self.queue_timeout_s, deadline)
        try:
            if until > began:
                await self.clock.wait(turn, until - began)
        except BaseException:
            self._give_up(turn)
            raise
        finally:
            self.metrics.queue_wait.observe(self.clock.now() - began)
        if turn.done():
            return turn.result()
        self._give_up(turn)
        if deadline <= until:
            self.metrics.rejected["timeout"].inc()
            elapsed = self.request_timeout_s - (deadline - self.clock.now())
            raise DeadlineExceeded(
                f"the request ran past its time limit of {self.request_timeout_s} s "
                f"({elapsed:.2f} s) waiting for a compute slot"
            )
        self.metrics.rejected["queue_timeout"].inc()
        raise _busy(f"no compute slot came free within {self.queue_timeout_s} s")

    def leave(self, slot: int) -> None:
        """Give a slot back: to the request that has waited longest, if any."""
        if self._queue:
            self._queue.popleft().set_result(slot)
        else:
            self._free.append(slot)

    def _give_up(self, turn: asyncio.Future[int]) -> None:
        if turn.done():  # handed a slot as it gave up (cancelled): the next request's
            self.leave(turn.result())
        else:
            turn.cancel()
            self._queue.remove(turn)


def _busy(why: str) -> ProblemError:
    return ProblemError(
        "overloaded", f"{why}; retry shortly", headers={"Retry-After": str(RETRY_AFTER_S)}
    )
