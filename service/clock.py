"""The time the service decides by: one `Clock` for the front process.

A request's deadline and its wait for a compute slot (service/front.py,
service/admission.py), a task's deadline in its worker and a worker's idle time
(service/pool.py), and the connections' head and body deadlines with the watchdog that
checks them once a second (service/protocol.py) all read the clock the app was made with
(`create_app(settings, clock=...)`), which each of them keeps as its `clock`. The default,
`SYSTEM_CLOCK`, is the host's monotonic clock with the running event loop's timers: the
service behaves as it would without one.

A test gives a `ManualClock` instead: its time moves only when the test advances it, and the
timers that come due run then, in order. The test then asserts on what happened at which
time (admitted, refused, stopped, answered 408), and waits nothing out.

A request's deadline goes with its task to a worker process (service/worker.py), which
checks it against `time.monotonic()` as it computes: a clock's `now()` is on that scale. A
`ManualClock` starts at `time.monotonic()` and only moves forward, so that a deadline it
gives a worker is never behind the worker's own clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Timer(Protocol):
    """A callback to come (`Clock.call_later`)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """The time the service decides by (see the module's docstring)."""

    def now(self) -> float:
        """Seconds, monotonic: on the host's `time.monotonic()` scale."""
        ...

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Run `callback(*args)` on the running event loop `delay` seconds from now."""
        ...

    async def wait(self, future: asyncio.Future[Any], timeout: float) -> None:
        """Return once `future` is done or `timeout` seconds have passed, whichever comes
        first; `future` is left as it is (not cancelled)."""
        ...


class SystemClock:
    """The host's monotonic clock, and the running event loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay, callback, *args)

    async def wait(self, future: asyncio.Future[Any], timeout: float) -> None:
        await asyncio.wait({future}, timeout=timeout)


SYSTEM_CLOCK = SystemClock()


@dataclass(order=True)
class _ManualTimer:
    when: float
    order: int  # (timers due at the same time run in the order they were set)
    loop: asyncio.AbstractEventLoop | None = field(compare=False)
    callback: Callable[..., object] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True

    def run(self) -> None:
        """On the loop that set it: here if that is this thread's (or it had none), else
        handed to that loop's thread, and waited for."""
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self.loop is None or self.loop is here:
            self.callback(*self.args)
            return
        ran = threading.Event()

        def run_there() -> None:
            try:
                if not self.cancelled:
                    self.callback(*self.args)
            finally:
                ran.set()

        self.loop.call_soon_threadsafe(run_there)
        if not ran.wait(10):
            raise TimeoutError(f"the event loop did not run a timer due at {self.when}")


SLACK_S = 1e-9  # (see ManualClock.advance)


class ManualClock:
    """A clock for tests, whose time moves only by `advance` (see the module's docstring).
    Its timers may be set on any event loop (a server's, in another thread): `advance`
    runs each on its own loop, and waits for it."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.monotonic() if start is None else start
        self._timers: list[_ManualTimer] = []  # a heap: the soonest first
        self._order = itertools.count()
        self._lock = threading.Lock()  # (timers are set from the loops' threads)

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> _ManualTimer:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            when = self._now + max(delay, 0.0)
            timer = _ManualTimer(when, next(self._order), loop, callback, args)
            heapq.heappush(self._timers, timer)
        return timer

    async def wait(self, future: asyncio.Future[Any], timeout: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(timeout, _wake, woken)
        try:
            await asyncio.wait({future, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            woken.cancel()

    def pending(self) -> list[float]:
        """When the timers still to run are due, the soonest first."""
        with self._lock:
            return sorted(t.when for t in self._timers if not t.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, running each timer due by then at its own time (with
        `now()` at its time), also those that the timers run set. A timer due within
        `SLACK_S` after that time runs too: advancing by 0.29 then 0.01 s reaches what was
        set 0.3 s ahead, which float sums on the monotonic scale fall short of."""
        if seconds < 0:
            raise ValueError(f"time only moves forward, not by {seconds}")
        until = self._now + seconds + SLACK_S
        while True:
            with self._lock:
                while self._timers and self._timers[0].cancelled:
                    heapq.heappop(self._timers)
                if not self._timers or self._timers[0].when > until:
                    break
                timer = heapq.heappop(self._timers)
                self._now = max(self._now, timer.when)
            timer.run()
        self._now = max(self._now, until - SLACK_S)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
