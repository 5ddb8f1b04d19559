"""The admission queue (service/admission.py): a request that finds every compute slot
busy waits for one, first come first served, within the queue's bound, its wait's bound
and its own deadline.

The apps run in process on ASGI, their time on a `ManualClock` (service/clock.py): a test
moves it, and asserts what was answered before and after, rather than time a wait. Every
loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from gradserve.engine.errors import DeadlineExceeded
from gradserve.service.admission import Admission
from gradserve.service.clock import ManualClock
from gradserve.service.errors import ProblemError
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings
from tests.support.in_process import serving
from tests.support.pool import worker_body
from tests.support.problems import assert_problem, strict_json
from tests.support.seeds import SEED_OP

pytestmark = pytest.mark.anyio


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


async def _hold_the_slot(app: FastAPI) -> int:
    """The only compute slot, taken as a long computation would hold it."""
    admission = app.state.front.admission
    slot: int = await admission.enter(admission.clock.now() + 60)
    return slot


async def _until_queued(c: httpx.AsyncClient, n: int) -> None:
    for _ in range(500):
        if _metric((await c.get("/metrics")).text, "gradserve_queue_length") == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never queued")


async def _answered_at(c: httpx.AsyncClient, clock: ManualClock, seconds: float) -> httpx.Response:
    """A request sent with the only slot held: unanswered when the clock is 0.01 s short of
    `seconds`, answered when it gets there."""
    waiting = asyncio.create_task(c.post("/forward", json=worker_body()))
    await _until_queued(c, 1)
    clock.advance(seconds - 0.01)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    clock.advance(0.01)
    return await asyncio.wait_for(waiting, 30)


async def test_a_request_waits_in_turn_and_a_full_queue_is_503_while_healthz_answers() -> None:
    """With the clock still, the third request is refused and the probes answer: neither
    waited for any timer. Then 1.5 s pass with the two in the queue, and it drains in
    order, each having waited exactly that."""
    clock = ManualClock()
    async with serving(clock, max_concurrency=1, max_queue_size=2) as (c, app):
        admission = app.state.front.admission
        slot = await _hold_the_slot(app)
        done: list[int] = []

        async def send(k: int) -> httpx.Response:
            r = await c.post("/forward", json=worker_body(float(k)))
            done.append(k)
            return r

        first = asyncio.create_task(send(1))
        await _until_queued(c, 1)
        second = asyncio.create_task(send(2))
        await _until_queued(c, 2)
        # The queue is full: refused at once, and the probes still answer.
        r = await c.post("/forward", json=worker_body(3.0))
        assert_problem(r, 503, "overloaded", "the queue's bound")
        assert r.headers["retry-after"] == "1"
        for _ in range(5):
            assert (await c.get("/healthz")).json() == {"status": "ok"}
        assert (await c.get("/readyz")).status_code == 200
        clock.advance(1.5)  # (within the queue's wait bound and the requests' deadline)
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()

        admission.leave(slot)  # the long computation ends: the queue drains in order
        one, two = await first, await second
        assert one.status_code == two.status_code == 200
        assert one.json()["outputs"]["s"]["data"] == 5000 * 1.0
        assert two.json()["outputs"]["s"]["data"] == 5000 * 2.0
        assert done == [1, 2]
        metrics = (await c.get("/metrics")).text
        assert _metric(metrics, "gradserve_queue_length") == 0
        assert _metric(metrics, "gradserve_queue_wait_seconds_count") == 2
        assert _metric(metrics, "gradserve_queue_wait_seconds_sum") == 2 * 1.5
        assert _metric(metrics, 'gradserve_rejections_total{reason="queue_full"}') == 1
        assert _metric(metrics, 'gradserve_rejections_total{reason="queue_timeout"}') == 0
        assert admission.active == 0


async def test_a_request_that_waits_its_bound_gets_503_with_retry_after() -> None:
    """Refused when the clock reaches the wait's bound (0.3 s), not before."""
    clock = ManualClock()
    async with serving(clock, max_concurrency=1, queue_timeout_s=0.3) as (c, app):
        await _hold_the_slot(app)
        r = await _answered_at(c, clock, 0.3)
        assert_problem(r, 503, "overloaded", "no compute slot came free within 0.3 s")
        assert r.headers["retry-after"] == "1"
        metrics = (await c.get("/metrics")).text
        assert _metric(metrics, 'gradserve_rejections_total{reason="queue_timeout"}') == 1
        assert _metric(metrics, "gradserve_queue_wait_seconds_count") == 1
        assert _metric(metrics, "gradserve_queue_wait_seconds_sum") == pytest.approx(0.3)
        assert _metric(metrics, "gradserve_queue_length") == 0


async def test_a_request_queued_past_its_deadline_gets_504() -> None:
    """Answered 504 when the clock reaches the request's deadline (0.5 s), not before."""
    clock = ManualClock()
    async with serving(clock, max_concurrency=1, request_timeout_s=0.5) as (c, app):
        await _hold_the_slot(app)
        r = await _answered_at(c, clock, 0.5)
        assert_problem(r, 504, "timeout", "waiting for a compute slot")
        metrics = (await c.get("/metrics")).text
        assert _metric(metrics, 'gradserve_rejections_total{reason="timeout"}') == 1
        assert _metric(metrics, 'gradserve_rejections_total{reason="queue_timeout"}') == 0
        assert _metric(metrics, "gradserve_queue_length") == 0


async def test_the_queue_is_first_come_first_served_and_loses_no_slot() -> None:
    admission = Admission(Settings(max_concurrency=1, max_queue_size=8), Metrics())
    deadline = time.monotonic() + 30
    slot = await admission.enter(deadline)
    order: list[int] = []

    async def wait(k: int) -> None:
        got = await admission.enter(deadline)
        order.append(k)
        await asyncio.sleep(0.01)
        admission.leave(got)

    waiting = []
    for k in range(6):
        waiting.append(asyncio.create_task(wait(k)))
        await asyncio.sleep(0)  # (each in the queue before the next)
    cancelled = asyncio.create_task(wait(99))
    await asyncio.sleep(0)
    cancelled.cancel()  # a request gone while it waited leaves its place
    admission.leave(slot)
    await asyncio.gather(*waiting)
    assert order == list(range(6))
    assert admission.active == 0 and not admission._queue
    # A waiter handed a slot as it is cancelled passes the slot on.
    slot = await admission.enter(deadline)
    one = asyncio.create_task(admission.enter(deadline))
    two = asyncio.create_task(admission.enter(deadline))
    await asyncio.sleep(0)
    admission.leave(slot)  # to `one`, which is cancelled before it runs
    one.cancel()
    assert await two == slot
    admission.leave(slot)
    assert admission.active == 0


async def test_the_queue_bounds_and_deadlines_directly() -> None:
    clock = ManualClock()
    admission = Admission(
        Settings(max_concurrency=1, max_queue_size=1, queue_timeout_s=5, request_timeout_s=0.2),
        Metrics(),
        clock,
    )
    await admission.enter(clock.now() + 30)
    waiter = asyncio.create_task(admission.enter(clock.now() + 0.2))
    await asyncio.sleep(0)
    with pytest.raises(ProblemError, match="queue's bound"):
        await admission.enter(clock.now() + 30)
    clock.advance(0.2)
    with pytest.raises(DeadlineExceeded, match="waiting for a compute slot"):
        await waiter
    with pytest.raises(DeadlineExceeded):  # a deadline already past: no wait at all
        await admission.enter(clock.now() - 1)


async def test_16_clients_on_8_slots_all_wait_their_turn() -> None:
    """The soak's shape: 16 requests at once computing in workers, 8 slots, the default
    queue: every one is answered, none refused."""
    async with serving(max_concurrency=8) as (c, app):
        replies = await asyncio.gather(
            *(c.post("/forward", json=worker_body(float(k))) for k in range(16))
        )
        assert [r.status_code for r in replies] == [200] * 16
        assert [r.json()["outputs"]["s"]["data"] for r in replies] == [
            5000.0 * k for k in range(16)
        ]
        metrics = (await c.get("/metrics")).text
        assert _metric(metrics, "gradserve_queue_wait_seconds_count") >= 1
        for reason in ("queue_full", "queue_timeout", "timeout", "inflight_memory"):
            assert _metric(metrics, f'gradserve_rejections_total{{reason="{reason}"}}') == 0
        assert app.state.front.admission.active == 0


async def test_a_client_that_hangs_up_while_queued_leaves_the_queue() -> None:
    """Its place in the queue goes at once (not when a slot would have come to it), and it
    is counted as a client that closed the request."""
    async with serving(max_concurrency=1, max_queue_size=2) as (c, app):
        runner = app.state.front
        slot = await _hold_the_slot(app)
        body = json.dumps(worker_body()).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        hang_up = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await hang_up.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(runner.serve("forward", receive, len(body), "r-gone"))
        await _until_queued(c, 1)
        hang_up.set()
        with pytest.raises(ClientDisconnect):
            await task
        await _until_queued(c, 0)
        runner.admission.leave(slot)
        assert runner.admission.active == 0
        assert strict_json(await c.post("/backward", json=SEED_OP))["outputs"]["z"]["data"] == -5.0


async def test_a_small_request_never_waits_behind_the_queue() -> None:
    """The fast lane: a small request that the front process computes itself takes no
    compute slot, so it is answered while every slot is busy and others queue, with the
    clock still: it waited for nothing."""
    clock = ManualClock()
    async with serving(clock, max_concurrency=1, max_queue_size=2) as (c, app):
        slot = await _hold_the_slot(app)
        queued = [
            asyncio.create_task(c.post("/forward", json=worker_body(float(k)))) for k in (1, 2)
        ]
        await _until_queued(c, 2)
        for _ in range(5):
            r = await c.post("/backward", json=SEED_OP)
            assert strict_json(r)["outputs"]["z"]["data"] == -5.0
        assert not any(t.done() for t in queued)
        app.state.front.admission.leave(slot)
        assert [(await t).json()["outputs"]["s"]["data"] for t in queued] == [5000.0, 10000.0]
