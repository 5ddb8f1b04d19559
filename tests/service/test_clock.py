"""The service's injected clock (service/clock.py): a `ManualClock` runs its timers when a
test advances it, in order, and the admission queue's bounds and deadlines run on it, so
that their tests assert on what happened at which time rather than wait it out."""

from __future__ import annotations

import asyncio

import pytest

from gradserve.engine.errors import DeadlineExceeded
from gradserve.service.admission import Admission
from gradserve.service.clock import ManualClock
from gradserve.service.errors import ProblemError
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings

pytestmark = pytest.mark.anyio


def test_timers_run_in_order_at_their_time_when_advanced() -> None:
    clock = ManualClock(start=100.0)
    ran: list[tuple[str, float]] = []
    clock.call_later(2.0, lambda: ran.append(("b", clock.now())))
    clock.call_later(1.0, lambda: ran.append(("a", clock.now())))
    cancelled = clock.call_later(1.5, lambda: ran.append(("never", clock.now())))
    cancelled.cancel()
    assert clock.pending() == [101.0, 102.0]
    clock.advance(1.2)
    assert ran == [("a", 101.0)] and clock.now() == pytest.approx(101.2)
    clock.advance(5.0)
    assert ran == [("a", 101.0), ("b", 102.0)] and clock.pending() == []
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)


def test_advancing_in_steps_reaches_a_timer_that_float_sums_fall_short_of() -> None:
    clock = ManualClock()  # (on the monotonic scale, where 0.29 + 0.01 < 0.3)
    ran: list[float] = []
    clock.call_later(0.3, lambda: ran.append(clock.now()))
    clock.advance(0.29)
    assert ran == []
    clock.advance(0.01)
    assert len(ran) == 1 and clock.pending() == []


async def test_wait_returns_at_its_timeout_or_when_the_future_is_done() -> None:
    clock = ManualClock(start=0.0)
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(clock.wait(future, 3.0))
    await asyncio.sleep(0)
    clock.advance(2.9)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(0.1)
    await waiting
    assert not future.done()  # (left as it is)
    waiting = asyncio.create_task(clock.wait(future, 3.0))
    await asyncio.sleep(0)
    future.set_result(1)
    await waiting
    assert clock.now() == 3.0


async def test_the_queue_refuses_at_its_bound_and_its_deadline_on_the_clock() -> None:
    clock = ManualClock(start=0.0)
    metrics = Metrics()
    settings = Settings(max_concurrency=1, max_queue_size=2, queue_timeout_s=0.3)
    admission = Admission(settings, metrics, clock)
    await admission.enter(clock.now() + 60)  # the only slot
    bounded = asyncio.create_task(admission.enter(clock.now() + 60))
    deadline = asyncio.create_task(admission.enter(clock.now() + 0.2))
    await asyncio.sleep(0)
    clock.advance(0.2)  # the second one's deadline: 504, with the time it waited
    with pytest.raises(DeadlineExceeded, match="waiting for a compute slot"):
        await deadline
    await asyncio.sleep(0)
    assert not bounded.done()
    clock.advance(0.1)  # the first one's wait reaches the queue's bound: 503
    with pytest.raises(ProblemError) as refused:
        await bounded
    assert refused.value.status == 503 and "0.3 s" in refused.value.detail
    assert metrics.rejected["queue_timeout"]._value.get() == 1  # type: ignore[attr-defined]
    assert metrics.rejected["timeout"]._value.get() == 1  # type: ignore[attr-defined]
    assert not admission._queue and admission.active == 1
