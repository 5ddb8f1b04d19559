"""The compute path in the front process: admission, the body, and where it computes.

A request takes a compute slot and reserves its body's bytes in the in-flight memory
before a byte of the body is read (its `Content-Length`, or each chunk as it arrives),
then what parsing it will take. A tiny request (a small body whose program is cached, or
small enough to compile at once, and cheap to run) computes right here on the event
loop, where a process hop would cost more than the work. Every other request goes to a
worker process (service/workers.py) with its deadline; the worker reserves the program's
planned bytes in the same in-flight memory before running it. If the client hangs up
while a worker computes, the worker is stopped.

A request that finds no free slot waits for one in a bounded queue (service/admission.py);
one that finds no memory gets 503 at once with `Retry-After`, so that a client can back off
or go to another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from gradserve.engine.errors import DeadlineExceeded, GradserveError
from gradserve.service.admission import Admission
from gradserve.service.compute import (
    MODELS,
    PLANS,
    WARM_UP,
    Compute,
    Handoff,
    Located,
    Reply,
    Stats,
    warm_up,
)
from gradserve.service.errors import ProblemError
from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings
from gradserve.service.workers import (
    SHM_MIN_BYTES,
    GradserveTimeout,
    Pool,
    Task,
    WorkerDied,
    create_segment,
    open_payload,
    overloaded,
    pack,
    payload_head,
    state_dir,
    trim_memory,
    unlink,
)

log = logging.getLogger("gradserve")

# What computes on the event loop: a small body, a graph that compiles at once, a run
# that costs about a millisecond at most (cost units: engine.graph.ir.Program).
INLINE_MAX_BODY_BYTES = 16 * 1024
INLINE_MAX_COMPILE_NODES = 64
INLINE_MAX_COST = 10_000_000
# A body's graph is located (its bytes hashed, to choose the worker that holds it) up to
# this size of JSON, on the event loop: ~2 ms at most.
LOCATE_MAX_BYTES = 4 << 20

# Parsing a body takes memory beyond its bytes: per JSON value a Python object and a
# list slot, per object its dict and model, and per graph node its compiled steps.
# Measured (tracemalloc): 32 bytes a number in a list, ~820 an input object, ~900 a
# graph node; these bounds stay above them.
PARSE_BYTES_PER_COMMA = 48
PARSE_BYTES_PER_BRACKET = 64
PARSE_BYTES_PER_OBJECT = 2048
TRIM_AFTER_BODY_BYTES = 8 << 20  # the front process gives memory back after such a body
ANSWER_HEADER_ROOM = 64 << 10


def parse_reservation(body: bytes, header_length: int | None = None) -> int:
    """The bytes a body holds in flight while it is parsed, decoded and compiled (a binary
    body's tail is decoded into views on it: only its JSON header is parsed)."""
    if header_length is not None:
        return len(body) + parse_reservation(body[:header_length])
    return (2 * len(body) + PARSE_BYTES_PER_COMMA * body.count(b",")
            + PARSE_BYTES_PER_BRACKET * body.count(b"[")
            + PARSE_BYTES_PER_OBJECT * body.count(b"{"))


class Runner:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        # The program store: the directory named, or one of this server's own (removed
        # when it stops) in shared memory where the host has it. Every process of the
        # server (the workers too, through these settings) opens the same one.
        self._own_store: str | None = None
        if settings.program_store_dir is None and settings.program_store_bytes:
            self._own_store = tempfile.mkdtemp(prefix="gradserve-programs-", dir=state_dir())
            settings = settings.model_copy(update={"program_store_dir": self._own_store})
        self.settings = settings
        self.metrics = metrics
        self.compute = Compute(settings)
        # Writes to the store leave the event loop: they follow the answer.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gradserve-store")
        self.admission = Admission(settings, metrics)
        # One line of the ledger more than the compute slots (0 .. max_concurrency - 1): the
        # front process's own, for the small requests it computes itself.
        self.pool = Pool(settings, settings.max_concurrency + 1, metrics)
        self.front = settings.max_concurrency
        self.ledger = self.pool.ledger
        self._worker_cache_bytes: dict[int, int] = {}  # worker pid -> its cache's bytes
        metrics.track(metrics.reserved_bytes, self.ledger.total)
        metrics.track(
            metrics.cache_bytes,
            lambda: self.compute.programs.memory.bytes + sum(self._worker_cache_bytes.values()))
        store = self.compute.programs.store
        if store is not None:
            metrics.track(metrics.store_bytes, store.total_bytes)

    def warm_up(self, body: bytes = WARM_UP) -> None:
        """One small request end to end in the front process, off the books."""
        warm_up(self.settings, body)

    async def start(self) -> None:
        """Warm up this process and start the compute workers, warm, side by side."""
        await asyncio.gather(asyncio.to_thread(self.warm_up), self.pool.start())

    def close(self) -> None:
        self.pool.close()
        self._writer.shutdown(wait=True)
        if self._own_store is not None:
            shutil.rmtree(self._own_store, ignore_errors=True)

    def _flush(self) -> None:
        """What this process's computations left for the store, written off the loop."""
        if self.compute.programs.pending():
            self._writer.submit(self.compute.programs.flush)

    async def housekeeping(self) -> None:
        """Retire idle workers and replace lost ones, now and then (runs for the life of
        the app)."""
        while True:
            await asyncio.sleep(1.0)
            self.pool.housekeeping()
            for pid in self._worker_cache_bytes.keys() - self.pool.pids():
                del self._worker_cache_bytes[pid]

    # ------------------------------------------------------------------ a request
    async def serve(self, kind: str, receive: Receive, declared: int | None,
                    request_id: str, header_length: int | None = None,
                    tenant: str | None = None) -> Reply:
        """The response body of one compute request ("forward", "backward" or a plan);
        `header_length`: the body is binary, with a JSON header of that many bytes;
        `tenant`: the API key's id (None with keys off)."""
        deadline = time.monotonic() + self.settings.request_timeout_s
        # The body is held in flight from its first byte, on the bodies' line of the
        # ledger: an upload takes memory but no compute slot (a slow client holds none).
        body_bytes = 0
        name = self.pool.segment()
        try:
            if declared:
                self._grow_bodies(declared)
                body_bytes = declared
            direct = None
            if header_length is not None and declared and declared >= SHM_MIN_BYTES:
                # A large binary body goes straight into shared memory as it arrives: this
                # process never holds it, and the worker decodes views on it.
                direct = await self._read_into_segment(receive, declared, name)
            if direct is not None:
                assert declared is not None and header_length is not None
                body: bytes = b""
                reservation = declared + parse_reservation(payload_head(direct, header_length))
            else:
                body, counted = await self._read_body(receive, declared)
                body_bytes = max(body_bytes, counted)
                reservation = parse_reservation(body, header_length)
            handoff = None
            if direct is None and len(body) <= INLINE_MAX_BODY_BYTES:
                # The fast lane: a small request is prepared, and when it is cheap computed,
                # right here, on the front process's own line of the ledger (one at a time:
                # `_inline` runs on the event loop without a pause). It takes no compute
                # slot, so it never waits in the queue behind requests that compute in
                # workers; one that must go to a worker queues for a slot like them.
                self.ledger.shrink(self.ledger.bodies, body_bytes)
                body_bytes = 0
                try:
                    self._hold(self.front, reservation, refuse_at_limit=True)
                    content = self._inline(kind, body, deadline, header_length, tenant)
                finally:
                    self.ledger.release(self.front)
                if isinstance(content, Reply):
                    return content
                handoff = content  # prepared here, to run in a worker: no second parse
                self._grow_bodies(reservation)  # (what it holds while it waits for a slot)
                body_bytes = reservation
            slot = self.admission.take()
            if slot is None:  # in turn; a client that hangs up meanwhile leaves the queue
                slot = await _until_disconnect(self.admission.enter(deadline), receive)
            try:
                self.ledger.shrink(self.ledger.bodies, body_bytes)
                body_bytes = 0
                self._hold(slot, reservation, refuse_at_limit=True)
                large = len(body) >= TRIM_AFTER_BODY_BYTES
                located = Located(None, None if handoff is None else handoff.graph_id)
                if handoff is None and kind not in PLANS:
                    header = payload_head(direct, header_length) if direct is not None \
                        and header_length is not None else body[:header_length]
                    if len(header) <= LOCATE_MAX_BYTES:  # (a scan and a hash: ~1 ms a MB)
                        located = self.compute.locate(header)
                payload = direct or (b"" if handoff is not None else pack(body, name))
                del body  # a large body is in shared memory now: this process keeps no copy
                try:
                    return await self._in_worker(kind, payload, name, slot, deadline, receive,
                                                 request_id, header_length, tenant, handoff,
                                                 located)
                finally:
                    if large:
                        trim_memory()
            finally:
                self.ledger.release(slot)
                self.admission.leave(slot)
        except BaseException:
            unlink(name)
            raise
        finally:
            if body_bytes:
                self.ledger.shrink(self.ledger.bodies, body_bytes)

    async def _read_into_segment(self, receive: Receive, size: int, name: str
                                 ) -> tuple[str, int] | None:
        """The body written into a new shared memory segment as it arrives (its
        `Content-Length` is `size`), or None, having read nothing, if /dev/shm has no room."""
        # (With room for an answer's JSON header, longer than the request's, so that the
        # worker can write an answer of the body's size back into the same segment.)
        shm = create_segment(name, size + ANSWER_HEADER_ROOM)
        if shm is None:
            return None
        buf = memoryview(shm.buf)  # type: ignore[arg-type]
        at = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    if at + len(chunk) > size:
                        raise ProblemError("bad-request", "the body is longer than its "
                                           f"Content-Length ({size} bytes)")
                    buf[at:at + len(chunk)] = chunk
                    at += len(chunk)
                    if not message.get("more_body", False):
                        break
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()
            if at != size:
                raise ProblemError("bad-request", f"the body ended after {at} of its "
                                   f"Content-Length's {size} bytes")
        finally:
            buf.release()
            shm.close()
        return (name, size)

    def _grow_bodies(self, nbytes: int) -> None:
        if not self.ledger.grow(self.ledger.bodies, nbytes):
            self.metrics.rejected["inflight_memory"].inc()
            raise overloaded(nbytes, self.ledger)

    def _hold(self, slot: int, nbytes: int, refuse_at_limit: bool = False) -> None:
        """Reserve `nbytes` for `slot` in the in-flight memory, or refuse: 503 when it may
        fit later, 413 when it never can."""
        if refuse_at_limit and nbytes > self.ledger.limit:
            raise ProblemError(
                "body-too-large",
                f"parsing this body would hold about {nbytes} bytes, more than the server's "
                f"in-flight memory ({self.ledger.limit}); send large tensors as base64",
            )
        if not self.ledger.reserve(slot, nbytes):
            self.metrics.rejected["inflight_memory"].inc()
            raise overloaded(nbytes, self.ledger)

    async def _read_body(self, receive: Receive, declared: int | None) -> tuple[bytes, int]:
        """The whole body, and the bytes counted for it on the bodies' line: one without a
        `Content-Length` is counted as it arrives."""
        chunks: list[bytes] = []
        received = counted = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    if chunk:
                        chunks.append(chunk)
                        received += len(chunk)
                        if declared is None:
                            self._grow_bodies(len(chunk))
                            counted += len(chunk)
                    if not message.get("more_body", False):
                        break
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()
        except BaseException:
            if counted:
                self.ledger.shrink(self.ledger.bodies, counted)
            raise
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), counted

    def _inline(self, kind: str, body: bytes, deadline: float, header_length: int | None,
                tenant: str | None) -> Reply | Handoff | None:
        """Compute a small request here when its program is known, or small enough to
        compile at once, and cheap to run; else hand it, prepared, to a worker (None: a
        plan that a worker must make)."""
        if kind in PLANS:
            try:
                return self.compute.plan(body, dot=kind == "plan-dot",
                                         max_nodes=INLINE_MAX_COMPILE_NODES, tenant=tenant)
            finally:
                self._flush()
        stats = Stats()
        try:
            p = self.compute.prepare(body, MODELS[kind], stats, header_length, tenant)
            if p.program is None:
                graph = self.compute.known_graph(p)  # (None: by id; a worker may hold it)
                if graph is None or len(graph.nodes) > INLINE_MAX_COMPILE_NODES:
                    return self.compute.handoff(p)
                self.compute.compile(p)
            assert p.program is not None
            if p.program.compute_cost > INLINE_MAX_COST:
                self.compute.check_budgets(p)  # (a 422 is answered here)
                return self.compute.handoff(p)
            held = self.ledger.held(self.front)

            def reserve(nbytes: int) -> None:
                self._hold(self.front, held + nbytes)

            return self.compute.execute(p, deadline, reserve, None)
        finally:
            self._count(stats)
            self._flush()

    async def _in_worker(self, kind: str, payload: Any, name: str, slot: int, deadline: float,
                         receive: Receive, request_id: str, header_length: int | None,
                         tenant: str | None, handoff: Handoff | None, located: Located
                         ) -> Reply:
        task = Task(kind=kind, body=payload, slot=slot, held=self.ledger.held(slot),
                    deadline=deadline, out_name=name + "o", request_id=request_id,
                    header_length=header_length, tenant=tenant, handoff=handoff,
                    affinity=located.graph_id, raw_key=located.raw_key)
        del payload
        done = False
        try:
            status, reply, stats = await _until_disconnect(self.pool.submit(task), receive)
            done = True
        except GradserveTimeout:
            self.metrics.rejected["timeout"].inc()
            elapsed = self.settings.request_timeout_s - (deadline - time.monotonic())
            raise DeadlineExceeded(
                f"the request ran past its time limit of {self.settings.request_timeout_s} s "
                f"({elapsed:.2f} s); its computation was stopped") from None
        except WorkerDied as exc:
            log.error("request %s: %s", request_id, exc)
            raise ProblemError("internal", f"{exc}; the request was not completed") from None
        finally:
            if not done:
                unlink(name)  # (the front process owns every segment's end)
        try:
            if handoff is not None:
                stats.program = None  # (the front process counted this request's lookup)
            self._count(stats)
            if status == "problem":
                raise ProblemError.from_wire(reply)
            content, binary_header, media_type = reply
            if isinstance(content, bytes):
                return Reply([content], binary_header, media_type=media_type)
            # Sent from the worker's segment (the body's own, or a new one) as it lies; it
            # goes once the reply is sent.
            view, release = open_payload(content)
            return Reply([view], binary_header, media_type=media_type, release=release)
        finally:
            unlink(name)
            unlink(name + "o")

    def _count(self, stats: Stats) -> None:
        """A computation's figures into the metrics (workers keep none of their own)."""
        planned, measured = self.metrics.peak_children(stats.path)
        if stats.planned_peak_bytes is not None:
            planned.observe(stats.planned_peak_bytes)
        if stats.peak_bytes is not None:
            measured.observe(stats.peak_bytes)
        if stats.rejected is not None:
            self.metrics.rejected[stats.rejected].inc()
        if stats.cache_evictions:
            self.metrics.cache_evictions.inc(stats.cache_evictions)
        if stats.graph_evictions:
            self.metrics.graph_evictions.inc(stats.graph_evictions)
        if stats.program is not None:
            self.metrics.lookups[stats.program].inc()
        if stats.compile_ms is not None:
            self.metrics.compiles.inc()
            self.metrics.compile_seconds.observe(stats.compile_ms / 1000)
        if stats.load_ms is not None:
            self.metrics.load_seconds.observe(stats.load_ms / 1000)
        if not stats.pid:  # (a worker's own store figures and lowerings come in its stats)
            stats.store_evictions, stats.store_damaged = self.compute.programs.changes()
            stats.lowerings = self.compute.tier.ended()
        if stats.tier is not None:
            self.metrics.tier_runs.labels(stats.tier).inc()
        for key, refused, compile_ms in stats.lowerings:
            where = f"compute worker {stats.pid}" if stats.pid else "the front process"
            if refused is None:
                self.metrics.xla_lowerings.labels("xla").inc()
                self.metrics.xla_compile_seconds.observe(compile_ms / 1000)
                log.info("program %s runs in the native tier in %s from now on (XLA compiled "
                         "it in %.0f ms)", key, where, compile_ms)
            else:
                self.metrics.xla_lowerings.labels("refused").inc()
                log.info("program %s stays interpreted in %s: %s", key, where, refused)
        if stats.store_evictions:
            self.metrics.store_evictions.inc(stats.store_evictions)
        if stats.store_damaged:
            self.metrics.store_damaged.inc(stats.store_damaged)
        if stats.pid:
            self._worker_cache_bytes[stats.pid] = stats.cache_bytes


async def _until_disconnect(work: Any, receive: Receive) -> Any:
    """Await `work`; if the client disconnects first, cancel it (which stops its worker)
    and raise ClientDisconnect."""
    job = asyncio.ensure_future(work)
    listener: asyncio.Future[Message] = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait({job, listener}, return_when=asyncio.FIRST_COMPLETED)
        if job in done:
            return job.result()
        if listener.result()["type"] == "http.disconnect":
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, GradserveError, Exception):
                await job
            raise ClientDisconnect()
        return await job  # (a stray message: keep waiting for the work)
    finally:
        listener.cancel()
        if not job.done():
            job.cancel()
