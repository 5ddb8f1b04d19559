"""The compute worker pool (service/pool.py): never cold, recycled by RSS with the
replacement first, workers killed at a deadline or from outside replaced, and tasks sent
to the worker that holds their key.

The apps run in process on ASGI; their workers are real processes. Every loop is bounded
in count and time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from gradserve.engine.graph import xla
from gradserve.service.app import create_app
from gradserve.service.clock import ManualClock
from gradserve.service.compute import WARM_UP
from gradserve.service.metrics import Metrics
from gradserve.service.pool import Pool, _Worker
from gradserve.service.settings import Settings
from gradserve.service.worker import Report, Task
from tests.support.in_process import serving
from tests.support.pool import worker_body
from tests.support.problems import assert_problem

pytestmark = pytest.mark.anyio


async def _until(what: str, check: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _served_by(app: Any) -> set[int]:
    """The workers that have answered (their pids), from what the runner counted."""
    return set(app.state.front._worker_cache_bytes)


# ---------------------------------------------------------------- never cold


async def test_readiness_waits_for_a_warm_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """/readyz says ready only once a worker is warm: with the worker's "ready" held back
    0.3 s, every 200 comes with a warm worker, and the probes before it are 503."""
    on_report = Pool.on_report

    def late(pool: Pool, worker: _Worker, report: Report) -> None:
        if report.kind == "ready":
            pool.loop.call_later(0.3, on_report, pool, worker, report)
        else:
            on_report(pool, worker, report)

    monkeypatch.setattr(Pool, "on_report", late)
    app = create_app(Settings())
    pool = app.state.front.pool
    seen: list[tuple[int, int]] = []
    manager = LifespanManager(app, startup_timeout=60)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        starting = asyncio.create_task(manager.__aenter__())
        while not starting.done():
            seen.append(((await c.get("/readyz")).status_code, pool.warm))
            await asyncio.sleep(0.01)
        await starting
        try:
            seen.append(((await c.get("/readyz")).status_code, pool.warm))
            assert seen[-1] == (200, 1) and pool.starts == 1
            assert [s for s, _ in seen].count(503) >= 5, seen  # (0.3 s of probes)
            assert all(warm >= 1 for status, warm in seen if status == 200), seen
        finally:
            await manager.__aexit__(None, None, None)


async def test_idle_workers_retire_down_to_the_minimum_and_it_stays_warm() -> None:
    """Two workers under load; idle on the app's clock (a `ManualClock`) for less than the
    idle time, both stay; for the idle time, the one above the minimum exits and the other
    stays, however long the clock then runs on: the first request after that starts no
    process and waits for none."""
    clock = ManualClock()
    async with serving(clock, compute_workers=2, compute_worker_idle_s=0.5) as (c, app):
        pool = app.state.front.pool
        assert pool.warm == 1 and pool.starts == 1
        replies = await asyncio.gather(*(c.post("/forward", json=worker_body(k)) for k in range(6)))
        assert [r.status_code for r in replies] == [200] * 6
        await _until("a second worker, warm and idle", lambda: len(pool._idle) == 2)
        clock.advance(0.4)
        pool.housekeeping()  # (the app's own runs once a second)
        assert len(pool.pids()) == 2
        clock.advance(0.1)
        pool.housekeeping()
        await _until("the one above the minimum to exit", lambda: len(pool.pids()) == 1)
        assert pool.warm == 1
        kept = pool.pids()
        clock.advance(1.5)  # idle for three times the idle time: still there
        pool.housekeeping()
        assert pool.pids() == kept
        starts, waits = pool.starts, pool.waits
        r = await c.post("/forward", json=worker_body(9.0))
        assert r.status_code == 200 and r.json()["outputs"]["s"]["data"] == 45000.0
        assert (pool.starts, pool.waits) == (starts, waits), "the request started a worker"
        assert pool.pids() == kept
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_compute_worker_exits_total{reason="idle"} 1.0' in metrics
        assert "gradserve_compute_workers 1.0" in metrics


# ---------------------------------------------------------------- recycling by RSS


async def test_a_worker_over_its_rss_limit_is_replaced_after_its_replacement_is_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every worker says it has grown by a GiB with each answer, so each is recycled after
    a task: its replacement is warm before it exits (and it exits cleanly, not killed); no
    request fails or waits."""
    events: list[tuple[str, int | None, int | None]] = []
    on_report, on_exit = Pool.on_report, Pool.on_exit

    def seen_report(pool: Pool, worker: _Worker, report: Report) -> None:
        if report.kind == "ready":
            events.append(("ready", worker.pid, None))
        else:
            report = dataclasses.replace(report, rss=report.rss + (1 << 30))
        on_report(pool, worker, report)

    def seen_exit(pool: Pool, worker: _Worker, exitcode: int | None) -> None:
        events.append(("exit", worker.pid, exitcode))
        on_exit(pool, worker, exitcode)

    monkeypatch.setattr(Pool, "on_report", seen_report)
    monkeypatch.setattr(Pool, "on_exit", seen_exit)
    async with serving(compute_workers=2) as (c, app):
        pool = app.state.front.pool
        for k in range(8):
            r = await c.post("/forward", json=worker_body(float(k)))
            assert r.status_code == 200 and r.json()["outputs"]["s"]["data"] == 5000.0 * k
            await asyncio.sleep(0.05)
        await _until("the last replacement", lambda: pool.warm == 1 and len(pool.pids()) == 1)
        assert pool.waits == 0, "a request waited for a worker to start"
        exits = [e for e in events if e[0] == "exit"]
        assert len(exits) >= 3, events
        warm: set[int | None] = set()
        for kind, pid, exitcode in events:
            if kind == "ready":
                warm.add(pid)
            else:
                assert exitcode == 0, events  # told to exit, not killed
                warm.discard(pid)
                assert warm, f"{pid} exited with no warm worker left: {events}"
        assert len(_served_by(app)) >= 3  # the requests went to the new workers
        metrics = (await c.get("/metrics")).text
        assert f'gradserve_compute_worker_exits_total{{reason="rss"}} {len(exits)}.0' in metrics


# ---------------------------------------------------------------- workers lost


async def test_a_worker_killed_from_outside_is_replaced() -> None:
    async with serving() as (c, app):
        pool = app.state.front.pool
        (victim,) = pool.pids()
        os.kill(victim, signal.SIGKILL)  # idle: no request sees it
        await _until("a replacement", lambda: pool.warm == 1 and pool.pids() - {victim})
        starts = pool.starts
        r = await c.post("/forward", json=worker_body(2.0))
        assert r.status_code == 200 and r.json()["outputs"]["s"]["data"] == 10000.0
        assert pool.starts == starts and victim not in _served_by(app)

        # Killed while it computes: that request is a 500 (logged), the next one is served.
        long = {
            "graph": {
                "nodes": [
                    {"id": "a", "expr": "full(shape=[1024, 1024], value=0.001, dtype='float64')"},
                    *(
                        {"id": f"m{i}", "op": "matmul", "args": [f"m{i - 1}" if i else "a", "a"]}
                        for i in range(200)
                    ),
                ],
                "outputs": ["m199"],
            },
            "no_grad": True,
            "inputs": {f"pad{i}": 0.0 for i in range(2000)},
        }
        computing = asyncio.create_task(c.post("/forward", json=long))
        await _until("the long request in a worker", lambda: pool.tasks == 2)
        (busy,) = pool.pids()
        await asyncio.sleep(0.3)
        os.kill(busy, signal.SIGKILL)
        assert_problem(await computing, 500, "internal", "the worker computing this request died")
        await _until("a replacement", lambda: pool.warm == 1 and pool.pids() - {busy})
        r = await c.post("/forward", json=worker_body(3.0))
        assert r.status_code == 200 and r.json()["outputs"]["s"]["data"] == 15000.0
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_compute_worker_exits_total{reason="died"} 2.0' in metrics
        assert app.state.front.ledger.total() == 0


async def test_a_worker_past_the_deadline_is_killed_and_replaced() -> None:
    async with serving(request_timeout_s=1.0) as (c, app):
        pool = app.state.front.pool
        (first,) = pool.pids()
        long = {
            "graph": {
                "nodes": [
                    {"id": "a", "expr": "full(shape=[2048, 2048], value=0.001, dtype='float64')"},
                    *(
                        {"id": f"m{i}", "op": "matmul", "args": [f"m{i - 1}" if i else "a", "a"]}
                        for i in range(40)
                    ),
                ],
                "outputs": ["m39"],
            },
            "no_grad": True,
            "inputs": {f"pad{i}": 0.0 for i in range(2000)},
        }
        assert_problem(await c.post("/forward", json=long), 504, "timeout", "was stopped")
        await _until("a replacement", lambda: pool.warm == 1 and pool.pids() - {first})
        r = await c.post("/forward", json=worker_body(1.0))
        assert r.status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_compute_worker_exits_total{reason="killed"} 1.0' in metrics
        assert 'gradserve_compute_worker_exits_total{reason="died"} 0.0' in metrics


# ---------------------------------------------------------------- affinity


# Two programs: the seed, and the seed with one more op (another graph, another program).
BODIES = {"a": WARM_UP, "b": WARM_UP.replace(b"(x + y) * (x - y)", b"(x + y) * (x - y) + 0")}


def _task(pool: Pool, which: str, slot: int) -> Task:
    return Task(
        kind="backward",
        body=BODIES[which],
        slot=slot,
        held=0,
        deadline=time.monotonic() + 30,
        out_name=pool.segment() + "o",
        request_id=f"affinity-{which}",
    )


async def test_a_program_goes_to_the_idle_worker_that_holds_it() -> None:
    """Two warm workers hold one program each (their reports say which): every later
    task for a program goes to its holder, whichever worker was freed last; a task for a
    program no one holds goes to either."""
    settings = Settings(compute_workers=2, min_compute_workers=2)
    pool = Pool(settings, settings.max_concurrency, Metrics())
    try:
        await pool.start()
        assert pool.warm == 2
        # Each worker said what it holds when warm (a CPU worker: ~45 MiB).
        assert all(16 << 20 < w.warm_rss < 256 << 20 for w in pool._workers)
        a, b = await asyncio.gather(
            pool.submit(_task(pool, "a", 0)), pool.submit(_task(pool, "b", 1))
        )
        keys = {"a": a.stats.program_key, "b": b.stats.program_key}
        holder = {"a": a.stats.pid, "b": b.stats.pid}
        assert holder["a"] != holder["b"] and None not in keys.values() != keys["b"]
        for which in "abbaab":
            outcome = await pool.submit(_task(pool, which, 0), keys[which])
            assert outcome.problem is None and isinstance(outcome.body, bytes)
            assert json.loads(outcome.body)["outputs"]["z"]["data"] == -5.0
            assert outcome.stats.pid == holder[which], (which, outcome.stats.pid, holder)
        outcome = await pool.submit(_task(pool, "a", 0), "a key no worker holds")
        assert outcome.stats.pid in holder.values() and pool.waits == 0
    finally:
        await asyncio.to_thread(pool.close)


async def test_a_lowering_asked_for_has_the_idle_workers_load_xla_meanwhile(
    tmp_path: Path,
) -> None:
    """pool.prepare_xla: each idle worker that has not loaded XLA is told to (jax's
    import, where it is installed), is busy until it says it has (a task meanwhile waits,
    then runs), and is told once; its memory then is what it holds warm (XLA's is not
    growth)."""
    settings = Settings(
        compute_workers=2, min_compute_workers=2, program_store_dir=str(tmp_path / "store")
    )
    pool = Pool(settings, settings.max_concurrency, Metrics())
    try:
        await pool.start()
        before = {w.pid: w.warm_rss for w in pool._workers}
        pool.prepare_xla()
        assert pool._idle == [] and all(w.prepared for w in pool._workers)
        outcome = await pool.submit(_task(pool, "a", 0))  # (waits for one of them)
        assert json.loads(outcome.body)["outputs"]["z"]["data"] == -5.0  # type: ignore[arg-type]
        await _until("both prepared and idle", lambda: len(pool._idle) == 2)
        after = {w.pid: w.warm_rss for w in pool._workers}
        if xla.available():  # (jax's modules and XLA's client: ~100 MiB)
            assert all(after[pid] > before[pid] + (30 << 20) for pid in before), (before, after)
        pool.prepare_xla()  # (none is told twice)
        assert len(pool._idle) == 2
    finally:
        await asyncio.to_thread(pool.close)
