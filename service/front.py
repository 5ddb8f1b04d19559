"""The compute path in the front process: admission, the body, placement, and the answer.

A request reserves its body's bytes in the in-flight memory before a byte of the body is
read (its `Content-Length`, or each chunk as it arrives). Its body is then opened just
enough to place it (service/placement.py): the fast lane computes it here, on the event
loop, where a hop to another process would cost more than the work; every other request
takes a compute slot and goes, as it was sent, to a worker process (service/pool.py) with
its deadline, which parses and computes it in one pass and reserves its program's planned
bytes in the same in-flight memory. If the client hangs up while a worker computes, the
worker is stopped.

A request that finds no free slot waits for one in a bounded queue (service/admission.py);
one that finds no memory gets 503 at once with `Retry-After`, so that a client can back off
or go to another replica. A request's deadline is on the front's clock (service/clock.py),
which the admission queue and the worker pool share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from gradserve.engine.errors import DeadlineExceeded
from gradserve.service.admission import Admission
from gradserve.service.clock import SYSTEM_CLOCK, Clock
from gradserve.service.compute import Compute, Misplaced, Stats, warm_up
from gradserve.service.encode import Reply
from gradserve.service.errors import ProblemError
from gradserve.service.ledger import Ledger, overloaded
from gradserve.service.literals import split_numbers
from gradserve.service.lowering import Lowerer
from gradserve.service.metrics import Metrics
from gradserve.service.placement import (
    IDLE_MAX_BODY_BYTES,
    KNOWN_MAX_DOCUMENT_BYTES,
    NEW_MAX_NODES,
    Facts,
    Lane,
    Placement,
)
from gradserve.service.pool import GradserveTimeout, Pool, Task, WorkerDied
from gradserve.service.request import Envelope, open_envelope
from gradserve.service.settings import Settings
from gradserve.service.shm import (
    SHM_MIN_BYTES,
    Payload,
    Spares,
    create_segment,
    keep_freed_memory,
    open_payload,
    own_directory,
    pack,
    sweep_orphans,
    trim_memory,
    unlink,
    unpack,
)
from gradserve.service.tier import off_reason

log = logging.getLogger("gradserve")
T = TypeVar("T")

# A body's JSON document is opened (split into members, its graph's bytes hashed: ~1 ms a
# MB) on the event loop up to the size the fast lane takes (the idle lane's, when no compute
# slot is busy); a larger one goes to a worker by its size alone, which opens it (once: the
# scan is not done twice).
OPEN_MAX_BYTES = KNOWN_MAX_DOCUMENT_BYTES
TRIM_AFTER_BODY_BYTES = 8 << 20  # the front process gives memory back after such a body
COPY_OUT_BYTES = 8 << 20  # an answer in its body's segment up to this size is copied out
# A body's segment has room beyond it for the answer, which its worker writes there when it
# fits: its JSON header (longer than the request's), and for a JSON body half as much again
# (an answer's numbers may be written longer than the request's). A segment is sparse: room
# never written takes no memory.
ANSWER_HEADER_ROOM = 64 << 10

# Parsing a body takes memory beyond its bytes: per JSON value a Python object and a
# list slot, per object its dict and model, and per graph node its compiled steps.
# Measured (tracemalloc): 32 bytes a number in a list, ~820 an input object, ~900 a
# graph node; these bounds stay above them.
PARSE_BYTES_PER_COMMA = 48
PARSE_BYTES_PER_BRACKET = 64
PARSE_BYTES_PER_OBJECT = 2048


def parse_reservation(body: bytes | memoryview, header_length: int | None = None) -> int:
    """The bytes a body holds in flight while it is parsed, decoded and compiled (a binary
    body's tail is decoded into views on it: only its JSON header is parsed)."""
    if header_length is not None:
        return len(body) + parse_reservation(body[:header_length])
    # (NumPy counts a large body 5x faster than bytes.count, on a view; a small one, where
    # its calls' cost is all there is, 10x slower.)
    text = np.frombuffer(body, np.uint8) if len(body) > COUNT_WITH_NUMPY_BYTES else body
    return (
        2 * len(body)
        + PARSE_BYTES_PER_COMMA * _count(text, ",")
        + PARSE_BYTES_PER_BRACKET * _count(text, "[")
        + PARSE_BYTES_PER_OBJECT * _count(text, "{")
    )


COUNT_WITH_NUMPY_BYTES = 64 << 10


def _count(text: np.ndarray | bytes | memoryview, char: str) -> int:
    if isinstance(text, np.ndarray):
        return int(np.count_nonzero(text == ord(char)))
    return (text if isinstance(text, bytes) else bytes(text)).count(char.encode())


class Front:
    """The front process's compute path: its own computations (the fast lane), the worker
    pool, the shared in-flight memory and the admission queue."""

    def __init__(self, settings: Settings, metrics: Metrics, clock: Clock = SYSTEM_CLOCK) -> None:
        sweep_orphans()  # what servers killed before they could clean up left in /dev/shm
        # Its lanes' computations keep what they free for the next, as a worker's do; it
        # goes back once the lanes have been quiet a second (housekeeping).
        keep_freed_memory()
        self._computed_since_trim = False
        # The program store: the directory named, or one of this server's own (removed
        # when it stops) in shared memory where the host has it. Every process of the
        # server (the workers too, through these settings) opens the same one.
        self._own_store: str | None = None
        self._held = -1  # (the descriptor that holds it)
        if settings.program_store_dir is None and settings.program_store_bytes:
            self._own_store, self._held = own_directory("programs")
            settings = settings.model_copy(update={"program_store_dir": self._own_store})
        # The tensors held by id, likewise (service/tensors.py).
        self._own_tensors: str | None = None
        self._tensors_held = -1
        if settings.tensor_store_dir is None:
            self._own_tensors, self._tensors_held = own_directory("tensors")
            settings = settings.model_copy(update={"tensor_store_dir": self._own_tensors})
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.compute = Compute(settings, role="front")
        self.placement = Placement()
        # Writes to the store leave the event loop: they follow the answer.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gradserve-store")
        self.admission = Admission(settings, metrics, clock)
        # One line of the ledger more than the compute slots (0 .. max_concurrency - 1): the
        # front process's own, for the requests of its fast lane.
        self.pool = Pool(settings, settings.max_concurrency + 1, metrics, clock)
        self.spares = Spares()  # body segments done with, for the next large bodies
        # The host's lowering process (service/lowering.py): where the tier is on, jax is
        # installed, and there is a program store for it to write the executables into.
        self.lowerer = (
            None
            if off_reason(settings) is not None
            else Lowerer(settings, lambda outcome: metrics.lowered(*outcome), self.pool.post)
        )
        if self.lowerer is not None:
            self.compute.tier.on_ask = self.pool.prepare_xla
        self.front = settings.max_concurrency
        self.ledger: Ledger = self.pool.ledger
        self._worker_cache_bytes: dict[int, int] = {}  # worker pid -> its cache's bytes
        metrics.track(metrics.reserved_bytes, self.ledger.total)
        metrics.track(
            metrics.cache_bytes,
            lambda: self.compute.programs.memory.bytes + sum(self._worker_cache_bytes.values()),
        )
        store = self.compute.programs.store
        if store is not None:
            metrics.track(metrics.store_bytes, store.total_bytes)
        tensors = self.compute.tensors
        if tensors is not None:
            tensors.sweep()  # (what writers that died left half-written)
            metrics.tensor_usage = lambda: (tensors.usage(), self.compute.tensor_evictions())

    async def start(self) -> None:
        """Warm up this process and start the compute workers, warm, side by side (and the
        lowering process, where the native tier is on)."""
        await asyncio.gather(asyncio.to_thread(warm_up, self.settings), self.pool.start())
        if self.lowerer is not None:
            await asyncio.to_thread(self.lowerer.start)

    def close(self) -> None:
        if self.lowerer is not None:
            self.lowerer.close()
        self.pool.close()
        self.spares.clear()
        self._writer.shutdown(wait=True)
        for own, held in ((self._own_store, self._held), (self._own_tensors, self._tensors_held)):
            if own is not None:
                os.close(held)
                shutil.rmtree(own, ignore_errors=True)

    async def housekeeping(self) -> None:
        """Retire idle workers and replace lost ones, now and then, and give back what the
        lanes' computations freed once they have been quiet a second (runs for the life of
        the app)."""
        while True:
            computed, self._computed_since_trim = self._computed_since_trim, False
            await asyncio.sleep(1.0)
            if computed and not self._computed_since_trim:  # (a second without)
                trim_memory()
            self.pool.housekeeping()
            if self.lowerer is not None:
                await asyncio.to_thread(self.lowerer.housekeeping)
            for pid in self._worker_cache_bytes.keys() - self.pool.pids():
                del self._worker_cache_bytes[pid]

    # ------------------------------------------------------------------ a request
    async def serve(
        self,
        kind: str,
        receive: Receive,
        declared: int | None,
        request_id: str,
        header_length: int | None = None,
        tenant: str | None = None,
    ) -> Reply:
        """The response body of one compute request ("forward", "backward", "plan" or
        "plan-dot"); `header_length`: the body is binary, with a JSON header of that many
        bytes; `tenant`: the API key's id (None with keys off)."""
        deadline = self.clock.now() + self.settings.request_timeout_s
        # The body is held in flight from its first byte, on the bodies' line of the
        # ledger: an upload takes memory but no compute slot (a slow client holds none).
        body_bytes = 0
        name = self.pool.segment()
        try:
            if declared:
                self._grow_bodies(declared)
                body_bytes = declared
            direct = None
            if declared and declared >= SHM_MIN_BYTES:
                # A large body goes straight into shared memory as it arrives (into a segment
                # kept from an earlier body where one fits: its pages are there already), and
                # the worker reads it where it lies: a binary body's tensors are views on it.
                # This process keeps a copy of its JSON document only if it opens it.
                direct = await self._read_into_segment(receive, declared, name, header_length)
            document: bytes | None
            if direct is not None:
                assert declared is not None
                body: bytes = b""
                reservation, document, direct_payload = direct
                document_bytes = declared if header_length is None else min(header_length, declared)
            else:
                body, counted = await self._read_body(receive, declared)
                body_bytes = max(body_bytes, counted)
                reservation = parse_reservation(body, header_length)
                document = body if header_length is None else body[:header_length]
                document_bytes = len(document)
            envelope, facts = self._facts(
                kind, body, document, document_bytes, declared or len(body), header_length
            )
            lane = self.placement.place(facts)
            if lane.fast and direct is None:
                self.ledger.shrink(self.ledger.bodies, body_bytes)
                body_bytes = 0
                reply = self._fast(
                    kind, body, envelope, header_length, reservation, deadline, tenant, lane
                )
                if reply is not None:
                    return reply
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
                payload: Payload = direct_payload if direct is not None else pack(body, name)
                del body  # a large body is in shared memory now: no copy here
                try:
                    return await self._in_worker(
                        Task(
                            kind=kind,
                            body=payload,
                            slot=slot,
                            held=self.ledger.held(slot),
                            deadline=deadline,
                            out_name=name + "o",
                            request_id=request_id,
                            header_length=header_length,
                            tenant=tenant,
                            raw_key=None if envelope is None else envelope.raw_key,
                        ),
                        lane,
                        name,
                        receive,
                        deadline,
                        request_id,
                    )
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

    def _facts(
        self,
        kind: str,
        body: bytes,
        document: bytes | None,
        document_bytes: int,
        body_bytes: int,
        header_length: int | None,
    ) -> tuple[Envelope | None, Facts]:
        """The body's envelope (when its document is small enough to open here) and the
        facts that place it."""
        idle = self.admission.active == 0
        opened = IDLE_MAX_BODY_BYTES if idle else OPEN_MAX_BYTES
        if document is None or document_bytes > opened:
            return None, Facts(body_bytes, document_bytes, None, None, idle)
        envelope = open_envelope(
            body or document, header_length if body else None, self.compute.programs
        )
        graph_id, nodes = envelope.graph_id, None
        graph = envelope.graph_bytes
        text_key, text_here = None, False
        if graph is not None and envelope.raw_key is not None:
            graph_id = self.compute.programs.alias(envelope.raw_key)
            if graph_id is None or self.placement.known(graph_id) is None:
                text = bytes(graph)
                nodes = text.count(b'"id"')  # (a body's too: a bound, enough here)
                if nodes > NEW_MAX_NODES and self.placement.lifted_texts():
                    # Maybe a graph seen before but for its literals: read for its text
                    # (kept for the parse, should it run here).
                    split = split_numbers(text)
                    envelope = dataclasses.replace(envelope, split=split)
                    text_key = split.text_key
                    text_here = self.compute.parser.sites.seen(text_key)
        facts = Facts(body_bytes, len(document), graph_id, nodes, idle, text_key, text_here)
        return envelope, facts

    def _fast(
        self,
        kind: str,
        body: bytes,
        envelope: Envelope | None,
        header_length: int | None,
        reservation: int,
        deadline: float,
        tenant: str | None,
        lane: Lane,
    ) -> Reply | None:
        """Compute a request here, on the front process's own line of the ledger (one at a
        time: this runs on the event loop without a pause); None when its program turns
        out too costly for its lane (it then goes to a worker)."""
        stats = Stats()
        try:
            self._hold(self.front, reservation, refuse_at_limit=True)
            held = self.ledger.held(self.front)

            def reserve(nbytes: int) -> None:
                self._hold(self.front, held + nbytes)

            return self.compute.serve(
                kind,
                body,
                header_length,
                tenant,
                deadline,
                reserve,
                stats,
                envelope=envelope,
                bounds=lane.bounds,
            )
        except Misplaced:
            return None
        except ProblemError as err:  # (a graph sent by id that a worker may hold)
            if err.slug == "graph-unknown":
                return None
            raise
        finally:
            self._computed_since_trim = True
            self.ledger.release(self.front)
            self.compute.report(stats)
            self._observe(stats)
            if self.compute.programs.pending():
                self._writer.submit(self.compute.programs.flush)

    async def _read_into_segment(
        self, receive: Receive, size: int, name: str, header_length: int | None
    ) -> tuple[int, bytes | None, Payload] | None:
        """The body written into a shared memory segment as it arrives (its
        `Content-Length` is `size`; `header_length`: a binary body's JSON header's, None for
        a JSON body): what parsing it holds in flight (`parse_reservation`), a copy of its
        JSON document when it is small enough to open here (else None), and the segment; or
        None, having read nothing, if /dev/shm has no room."""
        room = size + ANSWER_HEADER_ROOM + (size // 2 if header_length is None else 0)
        segment = self.spares.take(name, room) or create_segment(name, room)
        if segment is None:
            return None
        buf = segment.buf
        at = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    if at + len(chunk) > size:
                        raise ProblemError(
                            "bad-request",
                            f"the body is longer than its Content-Length ({size} bytes)",
                        )
                    buf[at : at + len(chunk)] = chunk
                    at += len(chunk)
                    if not message.get("more_body", False):
                        break
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()
            if at != size:
                raise ProblemError(
                    "bad-request", f"the body ended after {at} of its Content-Length's {size} bytes"
                )
            if header_length is None:
                reservation = parse_reservation(buf[:size])
                document = bytes(buf[:size]) if size <= OPEN_MAX_BYTES else None
            else:
                document = bytes(buf[: min(header_length, size)])
                reservation = size + parse_reservation(document)
        finally:
            del buf
            segment.close()
        return reservation, document, (name, size)

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
        counted = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    if chunk:
                        chunks.append(chunk)
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

    async def _in_worker(
        self, task: Task, lane: Lane, name: str, receive: Receive, deadline: float, request_id: str
    ) -> Reply:
        done = False
        try:
            outcome = await _until_disconnect(self.pool.submit(task, lane.affinity), receive)
            done = True
        except GradserveTimeout:
            self.metrics.rejected["timeout"].inc()
            elapsed = self.settings.request_timeout_s - (deadline - self.clock.now())
            raise DeadlineExceeded(
                f"the request ran past its time limit of {self.settings.request_timeout_s} s "
                f"({elapsed:.2f} s); its computation was stopped"
            ) from None
        except WorkerDied as exc:
            log.error("request %s: %s", request_id, exc)
            raise ProblemError("internal", f"{exc}; the request was not completed") from None
        finally:
            if not done:  # (the front process owns every segment's end)
                unlink(name)
                unlink(name + "o")
        try:
            self._observe(outcome.stats)
            if outcome.problem is not None:
                raise outcome.problem
            answer = outcome.body
            assert answer is not None
            if not isinstance(answer, bytes) and answer[0] == name and answer[1] <= COPY_OUT_BYTES:
                # In the body's own segment: copied out, so that the segment is kept for the
                # next body (a new one's pages cost ~1 ms a MB to fault in; a copy 0.2).
                answer = unpack(answer)
            if isinstance(answer, bytes):
                return Reply([answer], outcome.header_length, media_type=outcome.media_type)
            # Sent from the worker's segment (a larger answer in the body's own, or a new
            # one) as it lies; it goes once the reply is sent.
            view, release = open_payload(answer)
            return Reply(
                [view], outcome.header_length, media_type=outcome.media_type, release=release
            )
        finally:
            if not isinstance(task.body, bytes):
                # Kept for a next body, unless the answer is in it: then open_payload has
                # unlinked it, and its pages go with the reply.
                self.spares.give(name)

    def _observe(self, stats: Stats) -> None:
        """A computation's figures: into the metrics, and the placement's facts."""
        self.placement.learn(stats)
        self.metrics.observe(stats)
        if stats.pid:
            self._worker_cache_bytes[stats.pid] = stats.cache_bytes


async def _until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`; if the client disconnects first, cancel it (which stops its worker)
    and raise ClientDisconnect. (In this task: a task of its own, and asyncio.wait, would
    cost a repeat sent to a worker more than all the rest of its placement.)"""
    task = asyncio.current_task()
    assert task is not None
    state = {"waiting": True, "gone": False}

    def on_message(listener: asyncio.Future[Message]) -> None:
        if (
            state["waiting"]
            and not listener.cancelled()
            and listener.exception() is None
            and listener.result()["type"] == "http.disconnect"
        ):
            state["gone"] = True  # (a stray message: the work goes on)
            task.cancel()

    listener: asyncio.Future[Message] = asyncio.ensure_future(receive())
    listener.add_done_callback(on_message)
    try:
        return await work
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()
        raise ClientDisconnect() from None
    finally:
        state["waiting"] = False
        listener.cancel()
