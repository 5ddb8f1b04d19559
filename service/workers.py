"""Computation in worker processes that are stopped, and replaced, at their deadline.

A request past its time limit must stop burning CPU even inside one long kernel, and a
thread cannot be interrupted inside NumPy: so requests compute in a pool of worker
processes, and a task that passes its deadline, or whose client has gone, is stopped by
killing its worker (SIGKILL), which is then replaced. The front process keeps the I/O,
admission and the tiny requests, so its event loop always answers.

- Bodies and responses of a MiB or more cross through shared memory, not pickles.
- The in-flight memory budget is one for all processes: a `Ledger` of the bytes each
  compute slot holds, in a small shared file, changed under an `flock` (the kernel
  releases it should a worker die holding it).
- Workers fork from a forkserver that has already imported the engine (a worker starts
  and warms up in ~20 ms, not a Python start), run at a lower priority than the front
  process, and give their free memory back to the system after large tasks and when idle.
- The pool is never cold: `GRADSERVE_MIN_COMPUTE_WORKERS` are started and warm before the
  server says it is ready, and stay for the life of the server; more start on demand, up to
  `GRADSERVE_COMPUTE_WORKERS`, and those above the minimum retire after
  `GRADSERVE_COMPUTE_WORKER_IDLE_S` idle. A worker whose RSS has grown by more than
  `GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES` since it was warm is recycled: its
  replacement starts first, and it keeps serving until that one is warm.
- Each worker reports what it holds in memory (a request's graph or program key): when
  several are idle, a task goes to one that holds its key.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import itertools
import logging
import mmap
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from gradserve.engine.errors import GradserveError
from gradserve.service.admission import RETRY_AFTER_S
from gradserve.service.compute import MODELS, PLANS, Compute, Handoff, Stats, warm_up
from gradserve.service.errors import ProblemError, as_problem
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings
from gradserve.service.tier import CPUS

log = logging.getLogger("gradserve.workers")

SHM_MIN_BYTES = 1 << 20  # smaller payloads go through the worker's pipe
SHM_DIR = "/dev/shm"  # where POSIX shared memory segments are files (Linux)
TRIM_AFTER_BYTES = 16 << 20  # a task that planned this much gives free memory back after
TRIM_IDLE_S = 1.0  # a worker idle this long gives its free memory back (once)
WORKER_NICENESS = 10  # below the front process, whose event loop answers health checks
AFFINITY_KEYS = 1024  # keys the pool remembers per worker, the least recently used out
# A task pickled to this much or less is written to its worker's pipe on the event loop
# (an idle worker's socket buffer takes it whole); a larger one, from a thread.
SEND_INLINE_BYTES = 64 << 10


# ---------------------------------------------------------------- the shared in-flight memory


class Ledger:
    """The bytes held in flight, shared by the front process and its workers: one int64
    per compute slot, and one (`BODIES`, after them) for the bodies still arriving, in a
    file mapped by all, read and changed under an exclusive `flock` of that file. Each
    process opens the file itself: flock excludes across open files, and is released by
    the kernel when its holder dies."""

    def __init__(self, path: str, slots: int, limit: int) -> None:
        self.path, self.slots, self.limit = path, slots, limit
        self.bodies = slots  # the line of the bodies being received
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 8 * (slots + 1))
        self._values = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, directory: str, slots: int, limit: int) -> Ledger:
        path = os.path.join(directory, "ledger")
        with open(path, "wb") as f:
            f.write(bytes(8 * (slots + 1)))
        return cls(path, slots, limit)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reserve(self, slot: int, nbytes: int) -> bool:
        """Set `slot`'s bytes to `nbytes` if all slots together stay within the limit."""
        with self._locked():
            values = self._values
            if sum(values) - values[slot] + nbytes > self.limit:
                return False
            values[slot] = nbytes
            return True

    def grow(self, line: int, nbytes: int) -> bool:
        """Add `nbytes` to `line` if all lines together stay within the limit."""
        with self._locked():
            values = self._values
            if sum(values) + nbytes > self.limit:
                return False
            values[line] += nbytes
            return True

    def shrink(self, line: int, nbytes: int) -> None:
        with self._locked():
            self._values[line] -= nbytes

    def held(self, slot: int) -> int:
        return self._values[slot]

    def release(self, slot: int) -> None:
        with self._locked():
            self._values[slot] = 0

    def total(self) -> int:
        return sum(self._values)

    def busy(self, compute_slots: int) -> list[int]:
        """The compute slots (the first `compute_slots` lines) that hold bytes now."""
        return [i for i, held in enumerate(self._values[:compute_slots]) if held]

    def close(self) -> None:
        if self._fd < 0:
            return
        self._values.release()
        self._map.close()
        os.close(self._fd)
        self._fd = -1


# ---------------------------------------------------------------- payloads


Payload = bytes | tuple[str, int]  # the bytes, or a shared memory segment's name and size


def pack(data: bytes | list[bytes | memoryview], name: str,
         into: SharedMemory | None = None) -> Payload:
    """`data` (bytes, or parts written one after another) for another process: in a
    shared memory segment `name` when it is large (whoever made `name` is not who unlinks
    it: see `unlink`), or in segment `into` if it fits there and no part lies in it."""
    parts: list[bytes | memoryview] = [data] if isinstance(data, bytes) else data
    size = sum(len(memoryview(p).cast("B")) for p in parts)
    shm: SharedMemory | None = None
    if into is not None and size >= SHM_MIN_BYTES and _fits(parts, size, into):
        shm, name = into, into.name
    elif size >= SHM_MIN_BYTES:
        shm = create_segment(name, size)
    if shm is None:  # the pipe still works
        return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
    try:
        buf = memoryview(shm.buf)  # type: ignore[arg-type]
        at = 0
        for part in parts:  # each straight into the segment: no joined copy
            raw = memoryview(part).cast("B")
            buf[at:at + len(raw)] = raw
            at += len(raw)
        del buf, raw
    finally:
        if shm is not into:
            shm.close()
    return (name, size)


def _fits(parts: list[bytes | memoryview], size: int, segment: SharedMemory) -> bool:
    """Whether `size` bytes fit in `segment` and no part views it (an output that is an
    input would be overwritten as it is copied)."""
    if size > segment.size:
        return False
    base = np.frombuffer(segment.buf, dtype=np.uint8)  # type: ignore[arg-type]
    try:
        start = base.ctypes.data
        end = start + base.nbytes
        for part in parts:
            at = np.frombuffer(part, dtype=np.uint8)
            if start < at.ctypes.data + at.nbytes and at.ctypes.data < end:
                return False
        return True
    finally:
        del base


def create_segment(name: str, size: int) -> SharedMemory | None:
    """A new shared memory segment of `size` bytes, or None if /dev/shm has no room for it
    (the caller then passes bytes through the pool's pipe)."""
    if not _shm_has_room(size):
        return None
    try:
        shm = SharedMemory(name=name, create=True, size=max(size, 1))
    except OSError:
        return None
    _untrack(shm)
    return shm


def payload_head(payload: Payload, n: int) -> bytes:
    """The first `n` bytes of a payload (a binary body's JSON header)."""
    if isinstance(payload, bytes):
        return payload[:n]
    shm = SharedMemory(name=payload[0])
    try:
        return bytes(memoryview(shm.buf)[:n])  # type: ignore[arg-type]
    finally:
        _untrack(shm)
        shm.close()


def _shm_has_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` (twice over, for another segment at the same
    time): a segment is created sparse, and writing past the room there kills the
    process with SIGBUS (Docker gives 64 MiB by default: see --shm-size)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


def unpack(payload: Payload, consume: bool = False) -> bytes:
    """The bytes of a payload; `consume`: remove its segment once read (its memory goes
    back at once; the front process's own `unlink` then finds nothing)."""
    if isinstance(payload, bytes):
        return payload
    name, size = payload
    shm = SharedMemory(name=name)
    try:
        return bytes(memoryview(shm.buf)[:size])  # type: ignore[arg-type]
    finally:
        shm.close()
        if consume:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # (which also forgets it in the resource tracker)
        else:
            _untrack(shm)


def open_payload(payload: Payload) -> tuple[bytes | memoryview, Callable[[], None]]:
    """The bytes of a payload without copying them out of their segment: a read-only view
    on it (the segment is unlinked at once; its memory goes back when the last view does,
    which may be a server's write buffer), and a function that drops this process's own
    hold on it."""
    if isinstance(payload, bytes):
        return payload, lambda: None
    name, size = payload
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    view = memoryview(mapping)

    def release() -> None:
        with contextlib.suppress(BufferError):  # (a slice still being sent holds it)
            view.release()

    return view, release


def unlink(name: str) -> None:
    """Remove segment `name` if it exists (the front process owns every segment's end, so
    that none is left behind when a worker is killed)."""
    try:
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()  # (which also forgets it in the resource tracker)


def _untrack(shm: SharedMemory) -> None:
    # Python < 3.13 registers every segment it opens with the resource tracker, which
    # would unlink segments still in use, or warn of "leaks", when a process exits.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the task, in a worker


@dataclass(frozen=True)
class Task:
    kind: str  # "forward" or "backward"
    body: Payload
    slot: int  # the compute slot, in the ledger
    held: int  # bytes the front process reserved for the body
    deadline: float  # time.monotonic() (one clock for all processes of a host)
    out_name: str  # the shared memory segment a large response goes into
    request_id: str
    header_length: int | None = None  # a binary body's JSON header's length
    tenant: str | None = None  # the API key's id (service/middleware.py)
    handoff: Handoff | None = None  # a small request the front process prepared
    # What the computation will hold in memory once done (its graph's id, when the front
    # process knows it without parsing): the pool prefers an idle worker that holds it.
    affinity: str | None = None
    raw_key: str | None = None  # its graph's bytes' key, hashed by the front process


# (status "ok", (response payload, its binary header's length, media type), stats), or
# ("problem", ProblemError.to_wire(), stats)
Reply = tuple[str, Any, Stats]

_compute: Compute | None = None
_ledger: Ledger | None = None


def _worker_main(conn: Connection, settings_json: str, ledger_path: str, slots: int,
                 limit: int, preload: tuple[str, ...] | None) -> None:
    """A worker process: warm up, say so, then run the tasks its pipe brings until told to
    stop (None) or the front process is gone. Every message to the front process carries
    this process's RSS, by which the pool recycles it.

    What a task leaves behind is dealt with after its answer is sent, not on its request's
    path: the program store's writes, and the cycle collector, which is off while a task
    runs (a program loaded or compiled is a hundred thousand new objects, which the
    collector would otherwise walk in the middle of the next request)."""
    _start_worker(settings_json, ledger_path, slots, limit)
    assert _compute is not None
    compute = _compute
    if preload != ():
        _compute.programs.preload(preload, PRELOAD_S)
        gc.collect()  # (what the loads made is walked once here, not in a request)
    message: tuple[str, Any, int] = ("ready", None, _rss())
    tasks = 0
    try:
        while True:
            conn.send(message)
            if tasks:
                _after_reply(tasks, waiting=conn.poll(0))
            if not conn.poll(TRIM_IDLE_S):
                compute.programs.flush()  # idle: what was left for the store,
                gc.collect()  # a full collection, and what it frees goes back
                trim_memory()
            task = conn.recv()
            if task is None:
                return
            tasks += 1
            gc.disable()
            try:
                message = ("reply", run_task(task), _rss())
            except Exception:
                message = ("error", traceback.format_exc(), _rss())
    except (EOFError, OSError):  # the front process is gone
        return


FULL_COLLECTION_EVERY = 64  # tasks between two full collections under continuous load
# A worker that takes over another's programs, or starts a server, loads them for at most
# this long before it says it is ready (its predecessor, if any, serves meanwhile).
PRELOAD_S = 2.0


def _after_reply(tasks: int, waiting: bool) -> None:
    """After a task's answer is sent: write what it left for the store, unless the next
    task is already waiting (then when idle), and collect (the young generations each
    time; everything now and then, and when idle)."""
    assert _compute is not None
    if not waiting and _compute.programs.pending():
        _compute.programs.flush()
    gc.enable()
    gc.collect(2 if tasks % FULL_COLLECTION_EVERY == 0 else 1)


def _start_worker(settings_json: str, ledger_path: str, slots: int, limit: int) -> None:
    """Leave Ctrl-C to the front process (it reaches the whole process group), die with the
    forkserver (which exits with the front process), step aside for the front process, and
    warm up."""
    global _compute, _ledger
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    settings = Settings.model_validate_json(settings_json)
    _compute = Compute(settings)
    _ledger = Ledger(ledger_path, slots, limit)
    warm_up(settings)
    gc.freeze()  # the imported engine, out of the cycle collector's sight


def _rss() -> int:
    """This process's resident set size in bytes (0 where /proc has no statm)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def run_task(task: Task) -> Reply:
    """A request's computation in a worker: the same `Compute` as in the front process,
    with its reservation in the shared ledger."""
    assert _compute is not None and _ledger is not None
    ledger = _ledger
    stats = Stats()

    def reserve(nbytes: int) -> None:
        if not ledger.reserve(task.slot, task.held + nbytes):
            stats.rejected = "inflight_memory"
            raise overloaded(nbytes, ledger)

    share_cores(task.slot, ledger.busy(_compute.settings.max_concurrency),
                _compute.settings.max_concurrency)
    segment = None
    if task.header_length is None or isinstance(task.body, bytes):  # (parsed from bytes)
        body: bytes | memoryview = unpack(task.body, consume=True)
    else:  # a large binary body: its tensors view it where it lies
        name, size = task.body
        segment = SharedMemory(name=name)
        _untrack(segment)
        body = memoryview(segment.buf)[:size]  # type: ignore[arg-type]
    try:
        try:
            if task.handoff is not None:
                content = _compute.run_handoff(task.handoff, task.deadline, reserve, stats)
            elif task.kind in PLANS:
                planned = _compute.plan(bytes(body), dot=task.kind == "plan-dot",
                                        tenant=task.tenant)
                assert planned is not None  # (without a node limit it always answers)
                content = planned
            else:
                content = _compute.run(body, MODELS[task.kind], task.deadline, reserve, stats,
                                       task.header_length, task.tenant, task.raw_key)
        finally:
            del body  # (the arrays viewing it went with the computation)
        # The answer goes into the body's own segment when it fits there (its pages are
        # already the process's: no second payload of memory, no fresh pages to fault in).
        reply = (pack(content.parts, task.out_name, into=segment), content.header_length,
                 content.media_type)
        del content
    except ProblemError as err:
        return "problem", err.to_wire(), stats
    except GradserveError as err:
        return "problem", as_problem(err).to_wire(), stats
    finally:
        if segment is not None:
            with contextlib.suppress(BufferError):  # (else it goes with the last view)
                segment.close()
        if (stats.planned_peak_bytes or 0) >= TRIM_AFTER_BYTES:
            trim_memory()
        stats.pid = os.getpid()
        stats.store_evictions, stats.store_damaged = _compute.programs.changes()
        stats.lowerings = _compute.tier.ended()
    # What this worker holds now: the graph the front process named, and the one it
    # found (the same, or one the front process could not know without a parse).
    stats.affinity_keys = tuple(dict.fromkeys(k for k in (task.affinity, stats.graph_id) if k))
    return "ok", reply, stats


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


def cores_for(slot: int, busy: list[int], compute_slots: int, cpus: tuple[int, ...]
              ) -> set[int]:
    """A task's share of `cpus`: the cores over the compute slots busy now (`busy`, its own
    `slot` included), and never more cores than the compute slots free with its own. Alone
    on an idle machine, every core; under load, one. Side by side with the other busy
    slots' shares, by its rank among them."""
    count = max(1, min(len(cpus) // max(len(busy), 1), compute_slots - len(busy) + 1))
    rank = busy.index(slot) if slot in busy else 0
    return {cpus[(rank * count + i) % len(cpus)] for i in range(count)}


def overloaded(nbytes: int, ledger: Ledger) -> ProblemError:
    """503: the in-flight memory has no room for `nbytes` more now."""
    return ProblemError(
        "overloaded",
        f"the server's in-flight memory is full: this request needs {nbytes} bytes and "
        f"{ledger.total()} of {ledger.limit} are taken; retry shortly",
        headers={"Retry-After": str(RETRY_AFTER_S)}, planned_bytes=nbytes,
    )


def trim_memory() -> None:
    """Give the allocator's free memory back to the system (glibc keeps freed arenas)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


_libc_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_libc_name) if _libc_name else None
_malloc_trim = getattr(_libc, "malloc_trim", None)
_prctl = getattr(_libc, "prctl", None)  # (Linux)
PR_SET_PDEATHSIG = 1  # prctl(2): a signal this process gets when its parent exits
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- the pool, in the front


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
    _CONTEXT.set_forkserver_preload(["gradserve.service.workers"])
    forkserver.ensure_running()


class _Worker:
    """A worker process as the front process sees it: its pipe, the thread that starts it
    and reads its messages (handing each to the event loop), and the pool's notes on it.
    The notes are read and changed on the event loop only."""

    def __init__(self, pool: Pool, preload: tuple[str, ...] | None = ()) -> None:
        self.pool = pool
        self.conn, child = _CONTEXT.Pipe()
        self._child = child
        self.proc = _CONTEXT.Process(target=_worker_main,
                                     args=(child, *pool.worker_args, preload),
                                     name="gradserve-compute", daemon=True)
        self.pid: int | None = None
        self.ready: asyncio.Future[bool] = pool.loop.create_future()  # warm, or failed
        self.task: asyncio.Future[Reply] | None = None  # the reply it owes
        self.keys: OrderedDict[str, None] = OrderedDict()  # what it holds (affinity)
        self.programs: OrderedDict[str, None] = OrderedDict()  # its programs' keys
        self.rss = self.warm_rss = 0  # now, and when it was warm
        self.idle_since = time.monotonic()
        self.successor: _Worker | None = None  # starting, to replace this one (RSS)
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
                self.pool.post(self.pool.on_message, self, message)
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
        self._send(ForkingPickler.dumps(None))

    def kill(self) -> None:
        """Stop it now, whatever it computes (any thread)."""
        self.exiting = True
        if self.pid is not None and not self._gone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        with self._pipe:
            self.conn.close()

    def remember(self, keys: tuple[str, ...], program: str | None) -> None:
        for held, key in [*((self.keys, k) for k in keys),
                          *(((self.programs, program),) if program else ())]:
            held[key] = None
            held.move_to_end(key)
            if len(held) > AFFINITY_KEYS:
                held.popitem(last=False)


class Pool:
    """The compute workers of one front process: at least `min_compute_workers`, started
    and warm before the server is ready and kept while it runs; more on demand, up to
    `workers_for_compute`. Used from the event loop (`start`, `submit`, `housekeeping`);
    `close` from any thread."""

    def __init__(self, settings: Settings, slots: int, metrics: Metrics) -> None:
        self.settings = settings
        self.slots = slots
        self._dir = tempfile.mkdtemp(prefix="gradserve-", dir=state_dir())
        self.ledger = Ledger.create(self._dir, slots, settings.inflight_memory_bytes)
        self.worker_args = (settings.model_dump_json(), self.ledger.path, slots,
                            settings.inflight_memory_bytes)
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
        return sum(w.ready.done() and w.ready.result() and not w.exiting
                   for w in self._workers)

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
    async def submit(self, task: Task) -> Reply:
        """Run `task` in a worker; its deadline and the caller's cancellation (a client
        gone, a shutdown) kill the worker, which is replaced."""
        await self.start()
        worker = await self._acquire(task)
        self.tasks += 1
        reply = worker.task = self.loop.create_future()
        try:
            await worker.send(task)
            remaining = task.deadline - time.monotonic()
            if remaining > 0:
                await asyncio.wait({reply}, timeout=remaining)
            if reply.done():
                return reply.result()
            raise GradserveTimeout(task.deadline)
        finally:
            if not reply.done():  # timed out, or the caller was cancelled: stop it
                worker.task = None
                reply.cancel()
                self._kill(worker)

    async def _acquire(self, task: Task) -> _Worker:
        """An idle worker (one holding the task's key if any does), or the first to be
        free, in the order tasks came; GradserveTimeout at the task's deadline."""
        worker = self._pick(task.affinity)
        if worker is not None:
            return worker
        self.waits += 1
        turn: asyncio.Future[_Worker] = self.loop.create_future()
        self._waiting.append(turn)
        self._maintain()  # (a worker more, if there is room)
        try:
            remaining = task.deadline - time.monotonic()
            if remaining > 0:
                await asyncio.wait({turn}, timeout=remaining)
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
                if key in idle[i].keys:
                    return idle.pop(i)
        return idle.pop() if idle else None

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
        worker.idle_since = time.monotonic()
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

    def on_message(self, worker: _Worker, message: tuple[str, Any, int]) -> None:
        kind, body, worker.rss = message
        if kind == "ready":
            worker.warm_rss = worker.rss
            worker.ready.set_result(True)
            self._succeed(worker)
            self._free(worker)
            return
        reply, worker.task = worker.task, None
        if kind == "reply":
            worker.remember(body[2].affinity_keys, body[2].program_key)
        if reply is None or reply.done():  # abandoned: its answer's segment is no one's
            if kind == "reply" and body[0] == "ok" and not isinstance(body[1][0], bytes):
                unlink(body[1][0][0])
        elif kind == "reply":
            reply.set_result(body)
        else:
            reply.set_exception(RuntimeError(f"the compute worker failed:\n{body}"))
        growth = worker.rss - worker.warm_rss
        if growth > self.settings.compute_worker_max_rss_growth_bytes and \
                worker.successor is None and not worker.exiting and not self._closed:
            log.info("compute worker %s holds %d MiB, %d more than when it was warm: "
                     "replacing it", worker.pid, worker.rss >> 20, growth >> 20)
            # Its successor takes over its programs (from the store) before it is ready, and
            # the graphs it holds, so that no request pays for the change.
            worker.successor = self._spawn(preload=tuple(reversed(worker.programs)))
            worker.successor.keys = worker.keys.copy()
        self._free(worker)

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
            if old.successor is worker:
                old.successor = None
        reply, worker.task = worker.task, None
        if reply is not None and not reply.done():
            reply.set_exception(WorkerDied(exitcode))
        if worker.exiting or self._closed:
            return
        self._exits["died"].inc()
        log.error("compute worker %s exited (exit code %s)%s", worker.pid, exitcode,
                  "; starting another" if warm else " before it was warm")
        if warm:  # (one that cannot start is tried again by the housekeeping, once a second)
            self._maintain()

    def housekeeping(self) -> None:
        """Once a second: workers above the minimum that have been idle for
        `compute_worker_idle_s` exit, the longest idle first; and the minimum is kept."""
        if self._closed or self._loop is None:
            return
        since = time.monotonic() - self.settings.compute_worker_idle_s
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


def state_dir() -> str | None:
    """Where a server keeps its own state (the ledger's file, its program store): shared
    memory when the host has it (it is RAM, and writable in containers whose root is
    read-only); else the temporary directory."""
    return SHM_DIR if os.access(SHM_DIR, os.W_OK) else None
