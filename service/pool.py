"""The compute workers of a front process: worker processes that are stopped, and
replaced, at their deadline.

A request past its time limit must stop burning CPU even inside one long kernel, and a
thread cannot be interrupted inside NumPy: so requests compute in a pool of worker
processes (service/worker.py), and a task that passes its deadline, or whose client has
gone, is stopped by killing its worker (SIGKILL), which is then replaced. The front process
keeps the I/O, admission and its fast lane, so its event loop always answers.

- Workers fork from a forkserver that has already imported the engine (a worker starts
  and warms up in ~20 ms, not a Python start).
- The pool is never cold: `GRADSERVE_MIN_COMPUTE_WORKERS` are started and warm before the
  server says it is ready, and stay for the life of the server; more start on demand, up to
  `GRADSERVE_COMPUTE_WORKERS`, and those above the minimum retire after
  `GRADSERVE_COMPUTE_WORKER_IDLE_S` idle. A worker whose RSS has grown by more than
  `GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES` since it was warm is recycled: its
  replacement starts first, with its programs, and it keeps serving until that one is warm.
- Each worker's reports say which programs it holds (by program key): when several are
  idle, a task goes to one that holds the program it is expected to need.

A task's deadline and a worker's idle time run on the front process's clock
(service/clock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from typing import Any

from gradserve.service.clock import SYSTEM_CLOCK, Clock
from gradserve.service.ledger import Ledger
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings
from gradserve.service.shm import own_directory, unlink
from gradserve.service.worker import EXIT, PREPARE, STORE, Outcome, Report, Task, worker_main

log = logging.getLogger("gradserve.workers")

PROGRAMS_HELD = 1024  # program keys the pool remembers per worker, the least recently used out
# A task pickled to this much or less is written to its worker's pipe on the event loop
# (an idle worker's socket buffer takes it whole); a larger one, from a thread.
SEND_INLINE_BYTES = 64 << 10


_CONTEXT = multiprocessing.get_context("forkserver")
# One process start at a time: multiprocessing keeps its own books of a process's
# children, and each start is a short exchange with the forkserver.
_START_LOCK = threading.Lock()


def start_forkserver() -> None:
    """This process's forkserver, started once and kept for the life of the process: every
    pool of the process (every app a test suite builds, too) forks its workers from it.
    It has imported the engine (~50 MB, shared with the workers until they write), so a
    worker starts in milliseconds of CPU, not a Python start. (Each child also runs the
    main module again, as multiprocessing does: `gradserve serve`'s imports nothing more.)"""
    _CONTEXT.set_forkserver_preload(["gradserve.service.worker"])
    forkserver.ensure_running()


class _Worker:
    """A worker process as the front process sees it: its pipe, the thread that starts it
    and reads its messages (handing each to the event loop), and the pool's notes on it.
    The notes are read and changed on the event loop only."""

    def __init__(self, pool: Pool, preload: tuple[str, ...] | None = ()) -> None:
        self.pool = pool
        self.conn, child = _CONTEXT.Pipe()
        self._child = child
        self.proc = _CONTEXT.Process(
            target=worker_main,
            args=(child, *pool.worker_args, preload),
            name="gradserve-compute",
            daemon=True,
        )
        self.pid: int | None = None
        self.ready: asyncio.Future[bool] = pool.loop.create_future()  # warm, or failed
        self.task: asyncio.Future[Outcome] | None = None  # the outcome it owes
        self.programs: OrderedDict[str, None] = OrderedDict()  # the keys of those it holds
        self.rss = self.warm_rss = 0  # now, and when it was warm
        self.idle_since = pool.clock.now()
        self.successor: _Worker | None = None  # starting, to replace this one (RSS)
        self.prepared = False  # told to load XLA (a lowering was asked for)
        self.storing = False  # told to store what it holds: to be replaced once it has
        self.retired = False  # its successor is warm: it exits once free
        self.exiting = False  # told to exit, or killed: it takes no more tasks
        self._gone = False  # its end of the pipe closed: it has exited
        self._pipe = threading.Lock()  # writes to the pipe, and its close
        self.thread = threading.Thread(target=self._run, name="gradserve-worker", daemon=True)

    def _run(self) -> None:
        """Start the process, then hand each of its messages to the loop until it exits."""
        exitcode: int | None = None
        try:
            with _START_LOCK:
                if not self.exiting:
                    self.proc.start()
            self._child.close()
            if self.proc.pid is None:
                return
            self.pid = self.proc.pid
            if self.exiting:  # killed while it started
                self.kill()
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                self.pool.post(self.pool.on_report, self, message)
            self._gone = True
            self.proc.join(5)
            exitcode = self.proc.exitcode
        except Exception:
            log.exception("a compute worker failed to start")
        finally:
            self.pool.post(self.pool.on_exit, self, exitcode)

    async def send(self, task: Task) -> None:
        data = ForkingPickler.dumps(task)
        if len(data) <= SEND_INLINE_BYTES:
            self._send(data)
        else:  # the worker reads it as it is written: not on the event loop
            await asyncio.to_thread(self._send, data)

    def _send(self, data: bytes | memoryview) -> None:
        # A worker that has died fails its task when its exit is seen.
        with self._pipe, contextlib.suppress(OSError):
            self.conn.send_bytes(data)

    def stop(self) -> None:
        """Exit once idle (it is)."""
        self.exiting = True
        self._send(ForkingPickler.dumps(EXIT))

    def store(self) -> None:
        """Write what it holds to the program store, before its next task."""
        self.storing = True
        self._send(ForkingPickler.dumps(STORE))

    def prepare(self) -> None:
        """Load XLA before its next task (it is busy until it says so)."""
        self.prepared = True
        self._send(ForkingPickler.dumps(PREPARE))

    def kill(self) -> None:
        """Stop it now, whatever it computes (any thread)."""
        self.exiting = True
        if self.pid is not None and not self._gone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        with self._pipe:
            self.conn.close()

    def holds(self, program_key: str) -> None:
        programs = self.programs
        programs[program_key] = None
        programs.move_to_end(program_key)
        if len(programs) > PROGRAMS_HELD:
            programs.popitem(last=False)


class Pool:
    """The compute workers of one front process: at least `min_compute_workers`, started
    and warm before the server is ready and kept while it runs; more on demand, up to
    `workers_for_compute`. Used from the event loop (`start`, `submit`, `housekeeping`);
    `close` from any thread."""

    def __init__(
        self, settings: Settings, slots: int, metrics: Metrics, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.slots = slots
        self._dir, self._held = own_directory("")  # (held while the server runs)
        self.ledger = Ledger.create(self._dir, slots, settings.inflight_memory_bytes)
        self.worker_args = (
            settings.model_dump_json(),
            self.ledger.path,
            slots,
            settings.inflight_memory_bytes,
        )
        self.size = settings.workers_for_compute
        self.minimum = min(settings.min_compute_workers, self.size)
        self._names = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: set[_Worker] = set()  # started and not yet gone
        self._idle: list[_Worker] = []  # warm and free, the most recently freed last
        self._waiting: deque[asyncio.Future[_Worker]] = deque()  # tasks, first come first
        self._closed = False
        self.starts = 0  # worker processes started
        self.tasks = 0  # tasks sent to workers
        self.waits = 0  # tasks that found no idle worker and waited for one
        self._exits = {reason: metrics.worker_exits.labels(reason) for reason in EXITS}
        self._load_seconds = metrics.load_seconds
        metrics.track(metrics.compute_workers, lambda: len(self._workers))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def segment(self) -> str:
        """A new, unique shared memory name."""
        return f"gs{os.getpid()}-{next(self._names)}"

    def pids(self) -> set[int]:
        """The workers' process ids (those started)."""
        return {w.pid for w in self._workers if w.pid is not None}

    @property
    def warm(self) -> int:
        """Workers warm and taking tasks (busy or idle)."""
        return sum(w.ready.done() and w.ready.result() and not w.exiting for w in self._workers)

    async def start(self) -> None:
        """Start the minimum of workers and wait until they are warm (before the server
        says it is ready); raises if one cannot start."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(start_forkserver)
        # (Each takes the store's most recent programs first: a server that restarts on a
        # persistent store is warm from its first request.)
        for worker in [self._spawn(preload=None) for _ in range(self.minimum)]:
            if not await worker.ready:
                raise RuntimeError("a compute worker exited as it started (see the log)")

    # ------------------------------------------------------------ a task
    async def submit(self, task: Task, program_key: str | None = None) -> Outcome:
        """Run `task` in a worker (an idle one that holds `program_key`, if any does); its
        deadline and the caller's cancellation (a client gone, a shutdown) kill the worker,
        which is replaced."""
        await self.start()
        worker = await self._acquire(task, program_key)
        self.tasks += 1
        reply = worker.task = self.loop.create_future()
        try:
            await worker.send(task)
            remaining = task.deadline - self.clock.now()
            if remaining <= 0:
                raise GradserveTimeout(task.deadline)
            timer = self.clock.call_later(remaining, _time_out, reply, task.deadline)
            try:
                return await reply
            finally:
                timer.cancel()
        finally:
            if worker.task is reply:  # unanswered (timed out, or the caller was cancelled)
                worker.task = None
                reply.cancel()
                self._kill(worker)

    async def _acquire(self, task: Task, program_key: str | None) -> _Worker:
        """An idle worker (one holding the program if any does), or the first to be free,
        in the order tasks came; GradserveTimeout at the task's deadline."""
        worker = self._pick(program_key)
        if worker is not None:
            return worker
        self.waits += 1
        turn: asyncio.Future[_Worker] = self.loop.create_future()
        self._waiting.append(turn)
        self._maintain()  # (a worker more, if there is room)
        try:
            remaining = task.deadline - self.clock.now()
            if remaining > 0:
                await self.clock.wait(turn, remaining)
        except BaseException:
            self._give_up(turn)
            raise
        if not turn.done():
            self._give_up(turn)
            raise GradserveTimeout(task.deadline)
        return turn.result()

    def _give_up(self, turn: asyncio.Future[_Worker]) -> None:
        if turn.done():  # handed a worker as it gave up: the next task's
            self._free(turn.result())
        else:
            turn.cancel()
            self._waiting.remove(turn)

    def _pick(self, key: str | None) -> _Worker | None:
        idle = self._idle
        if key is not None:
            for i in range(len(idle) - 1, -1, -1):
                if key in idle[i].programs:
                    return idle.pop(i)
        return idle.pop() if idle else None

    def prepare_xla(self) -> None:
        """A lowering was asked for: the idle workers that have not loaded XLA load it now
        (jax's import, ~0.9 s), while it compiles, rather than at their first run of its
        executable. Each is busy meanwhile; a task takes another, or waits for one."""
        for worker in [w for w in self._idle if not w.prepared]:
            self._idle.remove(worker)
            worker.prepare()

    def _free(self, worker: _Worker) -> None:
        """`worker` is free: to the first task waiting, or idle (or gone, if retired)."""
        if worker.exiting or self._closed:
            return
        if worker.retired:
            worker.stop()
            self._exits["rss"].inc()
            return
        if self._waiting:
            self._waiting.popleft().set_result(worker)
            return
        worker.idle_since = self.clock.now()
        self._idle.append(worker)

    def _kill(self, worker: _Worker) -> None:
        worker.kill()
        self._exits["killed"].inc()
        self._maintain()  # its replacement starts now

    # ------------------------------------------------------------ the workers' lives
    def _spawn(self, preload: tuple[str, ...] | None = ()) -> _Worker:
        """A new worker; `preload`: the programs it loads from the store before it says it
        is ready (None: the store's most recent ones)."""
        worker = _Worker(self, preload)
        self._workers.add(worker)
        self.starts += 1
        worker.thread.start()
        return worker

    def _maintain(self) -> None:
        """Start workers: up to the minimum, and one for each task waiting that no worker
        starting will take, within the size."""
        if self._closed or self._loop is None:
            return
        live = [w for w in self._workers if not w.exiting and w.successor is None]
        starting = sum(not w.ready.done() for w in live)
        wanted = max(self.minimum, min(self.size, len(live) - starting + len(self._waiting)))
        for _ in range(wanted - len(live)):
            self._spawn()

    def post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` on the event loop (from a worker's thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
            self.loop.call_soon_threadsafe(callback, *args)

    def on_report(self, worker: _Worker, report: Report) -> None:
        worker.rss = report.rss
        if report.kind == "ready":
            for load_ms in report.loads_ms:  # (a worker keeps no metrics of its own)
                self._load_seconds.observe(load_ms / 1000)
            worker.warm_rss = worker.rss
            worker.ready.set_result(True)
            self._succeed(worker)
            self._free(worker)
            return
        if report.kind == "stored":
            self._replace(worker)
            return
        if report.kind == "prepared":
            worker.warm_rss = worker.rss  # (XLA's memory is not growth: it stays)
            self._free(worker)
            return
        owed, worker.task = worker.task, None
        outcome = report.outcome
        if outcome is not None and outcome.stats.program_key is not None:
            worker.holds(outcome.stats.program_key)
        if owed is None or owed.done():  # abandoned: its answer's segment is no one's
            if (
                outcome is not None
                and outcome.body is not None
                and not isinstance(outcome.body, bytes)
            ):
                unlink(outcome.body[0])
        elif outcome is not None:
            owed.set_result(outcome)
        else:
            owed.set_exception(RuntimeError(f"the compute worker failed:\n{report.failure}"))
        growth = worker.rss - worker.warm_rss
        if (
            growth > self.settings.compute_worker_max_rss_growth_bytes
            and not worker.storing
            and not worker.exiting
            and not self._closed
        ):
            log.info(
                "compute worker %s holds %d MiB, %d more than when it was warm: replacing it",
                worker.pid,
                worker.rss >> 20,
                growth >> 20,
            )
            worker.store()  # (then `_replace`, when it says it has)
        self._free(worker)

    def _replace(self, worker: _Worker) -> None:
        """Start the successor of a worker that has stored what it holds: it loads its
        programs from the store before it is ready (none is compiled twice on the host,
        and no request pays for the change); the old one serves until then."""
        if worker.successor is None and not worker.exiting and not self._closed:
            worker.successor = self._spawn(preload=tuple(reversed(worker.programs)))
            worker.successor.programs = worker.programs.copy()

    def _succeed(self, successor: _Worker) -> None:
        """A worker is warm: the worker it replaces exits, now if idle, else once free."""
        for old in self._workers:
            if old.successor is successor:
                old.retired = True
                if old in self._idle:
                    self._idle.remove(old)
                    self._free(old)

    def on_exit(self, worker: _Worker, exitcode: int | None) -> None:
        self._workers.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        worker.close()
        warm = worker.ready.done()
        if not warm:
            worker.ready.set_result(False)
        for old in self._workers:  # its predecessor, if it had one, stays on
            if old.successor is worker:  # (it will be replaced again after its next task)
                old.successor, old.storing = None, False
        reply, worker.task = worker.task, None
        if reply is not None and not reply.done():
            reply.set_exception(WorkerDied(exitcode))
        if worker.exiting or self._closed:
            return
        self._exits["died"].inc()
        log.error(
            "compute worker %s exited (exit code %s)%s",
            worker.pid,
            exitcode,
            "; starting another" if warm else " before it was warm",
        )
        if warm:  # (one that cannot start is tried again by the housekeeping, once a second)
            self._maintain()

    def housekeeping(self) -> None:
        """Once a second: workers above the minimum that have been idle for
        `compute_worker_idle_s` exit, the longest idle first; and the minimum is kept."""
        if self._closed or self._loop is None:
            return
        since = self.clock.now() - self.settings.compute_worker_idle_s
        above = sum(not w.exiting and w.successor is None for w in self._workers) - self.minimum
        for worker in list(self._idle):  # (the longest idle first)
            if above <= 0 or worker.idle_since > since:
                break
            if worker.successor is None:  # (one being replaced goes when that one is warm)
                self._idle.remove(worker)
                worker.stop()
                self._exits["idle"].inc()
                above -= 1
        self._maintain()

    def close(self) -> None:
        self._closed = True
        workers = list(self._workers)
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.thread.join(timeout=10)
            worker.close()
        self.ledger.close()
        os.close(self._held)
        shutil.rmtree(self._dir, ignore_errors=True)


EXITS = ("rss", "idle", "killed", "died")  # why compute workers went (the metrics' reasons)


class GradserveTimeout(Exception):
    def __init__(self, deadline: float) -> None:
        super().__init__("the request ran past its time limit")
        self.deadline = deadline


class WorkerDied(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"the worker computing this request died (exit code {exitcode})")
        self.exitcode = exitcode


def _time_out(reply: asyncio.Future[Outcome], deadline: float) -> None:
    if not reply.done():
        reply.set_exception(GradserveTimeout(deadline))
