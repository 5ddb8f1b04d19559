"""A compute worker process: it takes a `Task` (a request's body as it was sent, with its
deadline and compute slot), runs it in one pass (service/compute.py), and sends back one
`Report`, whose `Outcome` is the answer (a response body, or a problem) with the
computation's figures.

Workers fork from a forkserver that has already imported the engine (service/pool.py), run
at a lower priority than the front process, spread their threads over their share of the
cores, and give their free memory back to the system after large tasks and when idle.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from gradserve.engine.errors import GradserveError
from gradserve.service.compute import Compute, Stats, warm_up
from gradserve.service.errors import ProblemError, as_problem
from gradserve.service.ledger import Ledger, overloaded
from gradserve.service.settings import Settings
from gradserve.service.shm import (
    KEPT_FREE_BYTES,
    Payload,
    Segment,
    keep_freed_memory,
    pack,
    trim_memory,
)
from gradserve.service.tier import CPUS

# A task that planned more than the allocator keeps gives its free memory back after; a
# smaller one leaves it to the next (its pages already faulted in) until the worker idles.
TRIM_AFTER_BYTES = KEPT_FREE_BYTES
TRIM_IDLE_S = 1.0  # a worker idle this long gives its free memory back (once)
WORKER_NICENESS = 10  # below the front process, whose event loop answers health checks
FULL_COLLECTION_EVERY = 64  # tasks between two full collections under continuous load
# A worker that takes over another's programs, or starts a server, loads them for at most
# this long before it says it is ready (its predecessor, if any, serves meanwhile).
PRELOAD_S = 2.0


@dataclass(frozen=True)
class Task:
    """A request for a worker, as it was sent: its kind, its body (bytes, or a shared
    memory segment), and what the front process knows of it."""

    kind: str  # "forward", "backward", "plan" or "plan-dot"
    body: Payload
    slot: int  # the compute slot, in the ledger
    held: int  # bytes the front process reserved for the body
    deadline: float  # time.monotonic() (one clock for all processes of a host)
    out_name: str  # the shared memory segment a large response goes into
    request_id: str
    header_length: int | None = None  # a binary body's JSON header's length
    tenant: str | None = None  # the API key's id (service/middleware.py)
    raw_key: str | None = None  # its graph's bytes' key, hashed by the front process


@dataclass(frozen=True)
class Outcome:
    """A computation's answer: the response body (bytes, or the shared memory segment it
    was written into) with its binary header's length and media type, or the problem;
    and its figures."""

    stats: Stats
    body: Payload | None = None
    header_length: int | None = None
    media_type: str = "application/json"
    problem: ProblemError | None = None


# What the front process may send a worker besides a Task: to exit (once idle), or to
# write what it holds to the program store now (it is about to be replaced).
# What else than a task a worker's pipe brings: exit; write what it holds to the store; load
# XLA (jax) now, while a lowering it may soon run compiles (tier.Tier.prepare).
EXIT, STORE, PREPARE = None, "store", "prepare"


@dataclass(frozen=True)
class Report:
    """What a worker sends the front process, with its RSS (by which the pool recycles
    it): that it is ready ("ready"), a task's outcome ("outcome"), the traceback of a task
    that failed unexpectedly ("failure"), or that it has written what it holds to the
    store ("stored")."""

    kind: str
    rss: int
    outcome: Outcome | None = None
    failure: str | None = None
    loads_ms: tuple[float, ...] = ()  # ready: the programs it loaded first, and how long


_compute: Compute | None = None
_ledger: Ledger | None = None


def worker_main(
    conn: Connection,
    settings_json: str,
    ledger_path: str,
    slots: int,
    limit: int,
    preload: tuple[str, ...] | None,
) -> None:
    """A worker process: warm up, say so, then run the tasks its pipe brings until told to
    stop (None) or the front process is gone.

    What a task leaves behind is dealt with after its answer is sent, not on its request's
    path: the program store's writes, and the cycle collector, which is off while a task
    runs (a program loaded or compiled is a hundred thousand new objects, which the
    collector would otherwise walk in the middle of the next request)."""
    compute = _start(settings_json, ledger_path, slots, limit)
    loads: tuple[float, ...] = ()
    if preload != ():
        loads = compute.programs.preload(preload, PRELOAD_S)
        gc.collect()  # (what the loads made is walked once here, not in a request)
    report = Report("ready", _rss(), loads_ms=loads)
    tasks = 0
    try:
        while True:
            conn.send(report)
            if tasks:
                _after_reply(compute, tasks, waiting=conn.poll(0))
            if not conn.poll(TRIM_IDLE_S):
                compute.programs.flush()  # idle: what was left for the store,
                gc.collect()  # a full collection, and what it frees goes back
                trim_memory()
            task = conn.recv()
            if task is EXIT:
                return
            if task == STORE:
                compute.programs.store_held()
                report = Report("stored", _rss())
                continue
            if task == PREPARE:
                compute.tier.prepare()
                report = Report("prepared", _rss())
                continue
            tasks += 1
            gc.disable()
            try:
                report = Report("outcome", _rss(), outcome=run_task(task))
            except Exception:
                report = Report("failure", _rss(), failure=traceback.format_exc())
    except (EOFError, OSError):  # the front process is gone
        return


def _after_reply(compute: Compute, tasks: int, waiting: bool) -> None:
    """After a task's answer is sent: write what it left for the store, unless the next
    task is already waiting (then when idle), and collect (the young generations each
    time; everything now and then, and when idle)."""
    if not waiting and compute.programs.pending():
        compute.programs.flush()
    gc.enable()
    gc.collect(2 if tasks % FULL_COLLECTION_EVERY == 0 else 1)


def _start(settings_json: str, ledger_path: str, slots: int, limit: int) -> Compute:
    """Leave Ctrl-C to the front process (it reaches the whole process group), die with the
    forkserver (which exits with the front process), step aside for the front process, keep
    freed memory for the next task, and warm up."""
    global _compute, _ledger
    keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    settings = Settings.model_validate_json(settings_json)
    _compute = Compute(settings, role="worker")
    _ledger = Ledger(ledger_path, slots, limit)
    warm_up(settings)
    gc.freeze()  # the imported engine, out of the cycle collector's sight
    return _compute


def _rss() -> int:
    """This process's resident set size in bytes (0 where /proc has no statm)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def run_task(task: Task) -> Outcome:
    """A request's computation in this worker, with its reservation in the shared ledger."""
    assert _compute is not None and _ledger is not None
    compute, ledger = _compute, _ledger
    stats = Stats()

    def reserve(nbytes: int) -> None:
        if not ledger.reserve(task.slot, task.held + nbytes):
            stats.rejected = "inflight_memory"
            raise overloaded(nbytes, ledger)

    share_cores(
        task.slot, ledger.busy(compute.settings.max_concurrency), compute.settings.max_concurrency
    )
    segment = None
    if isinstance(task.body, bytes):
        body: bytes | memoryview = task.body
    else:  # a large body, read where it lies (a binary one's tensors view it)
        name, size = task.body
        segment = Segment(name)
        body = segment.buf[:size]
    try:
        try:
            reply = compute.serve(
                task.kind,
                body,
                task.header_length,
                task.tenant,
                task.deadline,
                reserve,
                stats,
                raw_key=task.raw_key,
            )
        finally:
            del body  # (the arrays viewing it went with the computation)
        # The answer goes into the body's own segment when it fits there (its pages are
        # already the process's: no second payload of memory, no fresh pages to fault in).
        payload = pack(reply.parts, task.out_name, into=segment)
        outcome = Outcome(stats, payload, reply.header_length, reply.media_type)
        del reply
    except ProblemError as err:
        outcome = Outcome(stats, problem=err)
    except GradserveError as err:
        outcome = Outcome(stats, problem=as_problem(err))
    finally:
        if segment is not None:
            with contextlib.suppress(BufferError):  # (else it goes with the last view)
                segment.close()
        if (stats.planned_peak_bytes or 0) >= TRIM_AFTER_BYTES:
            trim_memory()
        stats.pid = os.getpid()
        compute.report(stats)
    return outcome


_cores: tuple[set[int], list[str]] = (set(CPUS), [])  # this worker's share, its threads


def share_cores(slot: int, busy: list[int], compute_slots: int) -> None:
    """Let this worker's threads (XLA's thread pool, the interpreter's BLAS) run on its
    share of the cores (`cores_for`) for a task on `slot`. The share is the worker's CPU
    affinity, every thread's, which the kernel enforces: a pool of more threads than its
    cores runs them in turn on those cores. It is fixed for the task: one that starts
    alone keeps its cores when others arrive."""
    global _cores
    cores = cores_for(slot, busy, compute_slots, CPUS)
    try:
        threads = os.listdir("/proc/self/task")  # (XLA starts its pool on its first compile)
    except OSError:
        return
    if (cores, threads) == _cores:
        return
    _cores = (cores, threads)
    for tid in threads:
        with contextlib.suppress(OSError):  # (a thread that has just exited)
            os.sched_setaffinity(int(tid), cores)


def cores_for(slot: int, busy: list[int], compute_slots: int, cpus: tuple[int, ...]) -> set[int]:
    """A task's share of `cpus`: the cores over the compute slots busy now (`busy`, its own
    `slot` included), and never more cores than the compute slots free with its own. Alone
    on an idle machine, every core; under load, one. Side by side with the other busy
    slots' shares, by its rank among them."""
    count = max(1, min(len(cpus) // max(len(busy), 1), compute_slots - len(busy) + 1))
    rank = busy.index(slot) if slot in busy else 0
    return {cpus[(rank * count + i) % len(cpus)] for i in range(count)}


_libc_name = ctypes.util.find_library("c")
_prctl = getattr(ctypes.CDLL(_libc_name), "prctl", None) if _libc_name else None  # (Linux)
PR_SET_PDEATHSIG = 1  # prctl(2): a signal this process gets when its parent exits
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
