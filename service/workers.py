"""Computation in worker processes that are stopped, and replaced, at their deadline.

A request past its time limit must stop burning CPU even inside one long kernel, and a
thread cannot be interrupted inside NumPy: so requests compute in a pool of worker
processes (pebble), and a task that passes its deadline, or whose client has gone, is
stopped by terminating its worker (pebble starts another). The front process keeps the
I/O, admission and the tiny requests, so its event loop always answers.

- Bodies and responses of a MiB or more cross through shared memory, not pickles.
- The in-flight memory budget is one for all processes: a `Ledger` of the bytes each
  compute slot holds, in a small shared file, changed under an `flock` (the kernel
  releases it should a worker die holding it).
- Workers fork from a forkserver that has already imported the engine (a replacement
  costs milliseconds of CPU, not a Python start), die at once on SIGTERM (even inside a
  kernel), run at a lower priority than the front process, give their free memory back to
  the system after large tasks, and are recycled after a number of tasks; the whole pool
  stops when idle and starts again on demand.
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
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
from pebble import ProcessExpired, ProcessPool

from engine.errors import GradserveError
from service.admission import RETRY_AFTER_S
from service.compute import MODELS, PLANS, Compute, Handoff, Stats, warm_up
from service.errors import ProblemError, as_problem
from service.settings import Settings

log = logging.getLogger("gradserve.workers")

SHM_MIN_BYTES = 1 << 20  # smaller payloads go through the pool's pipe
SHM_DIR = "/dev/shm"  # where POSIX shared memory segments are files (Linux)
TASKS_PER_WORKER = 200  # then the worker is replaced, with whatever its heap held
IDLE_STOP_S = 10.0  # a pool with nothing to do for this long stops its workers
TRIM_AFTER_BYTES = 16 << 20  # a task that planned this much gives free memory back after
WORKER_NICENESS = 10  # below the front process, whose event loop answers health checks


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
    affinity: str | None = None  # the request's graph id, when known without parsing


# (status "ok", (response payload, its binary header's length, media type), stats), or
# ("problem", ProblemError.to_wire(), stats)
Reply = tuple[str, Any, Stats]

_compute: Compute | None = None
_ledger: Ledger | None = None


def _start_worker(settings_json: str, ledger_path: str, slots: int, limit: int) -> None:
    """The worker's initializer: die at once on SIGTERM (pebble's handler would wait for
    the kernel in progress to return), step aside for the front process, and warm up."""
    global _compute, _ledger
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    settings = Settings.model_validate_json(settings_json)
    _compute = Compute(settings)
    _ledger = Ledger(ledger_path, slots, limit)
    warm_up(settings)
    gc.freeze()  # the imported engine, out of the cycle collector's sight


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
                                       task.header_length, task.tenant)
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
        if _compute.programs.pending():  # (written while this worker waits for the next)
            threading.Thread(target=_compute.programs.flush, daemon=True).start()
    return "ok", reply, stats


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


_libc = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_libc), "malloc_trim", None) if _libc else None



# ---------------------------------------------------------------- the pool, in the front


class Pool:
    """The worker pool of one front process: started on first use, stopped when idle."""

    def __init__(self, settings: Settings, slots: int) -> None:
        self.settings = settings
        self.slots = slots
        self._dir = tempfile.mkdtemp(prefix="gradserve-", dir=state_dir())
        self.ledger = Ledger.create(self._dir, slots, settings.inflight_memory_bytes)
        self._pool: ProcessPool | None = None
        self._lock = threading.Lock()
        self._names = itertools.count()
        self.active = 0
        self._idle_since = time.monotonic()
        self.started = 0  # pools started, for tests and logs

    def segment(self) -> str:
        """A new, unique shared memory name."""
        return f"gs{os.getpid()}-{next(self._names)}"

    def _ensure(self) -> ProcessPool:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["service.workers"])
                self._pool = ProcessPool(
                    max_workers=self.settings.workers_for_compute, max_tasks=TASKS_PER_WORKER,
                    initializer=_start_worker,
                    initargs=(self.settings.model_dump_json(), self.ledger.path, self.slots,
                              self.settings.inflight_memory_bytes),
                    context=context,
                )
                self.started += 1
            return self._pool

    async def submit(self, task: Task) -> Reply:
        """Run `task` in a worker; its deadline and the caller's cancellation (a client
        gone, a shutdown) stop the worker."""
        pool = self._pool if self._pool is not None else await asyncio.to_thread(self._ensure)
        self.active += 1
        try:
            remaining = max(task.deadline - time.monotonic(), 0.001)
            future = pool.schedule(run_task, args=(task,), timeout=remaining)
            try:
                return await asyncio.wrap_future(future)  # cancelling this cancels the task
            except TimeoutError:
                raise GradserveTimeout(task.deadline) from None
            except ProcessExpired as exc:
                raise WorkerDied(exc.exitcode) from None
            except CancelledError:
                raise asyncio.CancelledError from None
        finally:
            self.active -= 1
            self._idle_since = time.monotonic()

    def stop_if_idle(self) -> bool:
        """Stop the workers when nothing has run for IDLE_STOP_S (called periodically);
        whether it did."""
        if self._pool is None or self.active or \
                time.monotonic() - self._idle_since < IDLE_STOP_S:
            return False
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return False
        pool.stop()
        pool.join(timeout=5)
        _stop_forkserver()
        log.info("stopped the idle worker pool")
        return True

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=5)
            _stop_forkserver()
        self.ledger.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _stop_forkserver() -> None:
    """Stop the forkserver too (it holds the imported engine, ~50 MB): the next pool starts
    a new one. Python exposes no public call for it; its own tests use this one, and if it
    is ever gone the server simply stays up."""
    from multiprocessing import forkserver

    with contextlib.suppress(Exception):
        forkserver._forkserver._stop()  # type: ignore[attr-defined]


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
