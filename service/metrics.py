"""Prometheus metrics, one registry per app (so apps built in tests never collide).

`labels()` costs a dict lookup under a lock on every call; the hot path instead keeps the
label children it has used (per route, method and status; per path; per reason), so a
request pays for the increments alone.

Several front processes (`gradserve serve --workers N`, N > 1) share one server's figures
through prometheus-client's multiprocess mode: `gradserve serve` makes a directory for
PROMETHEUS_MULTIPROC_DIR before uvicorn starts its workers (service/cli.py), every value is
written to a file of its process there, and a scrape of any process sums the files of all.
Counters and histograms of a process that died stay in the sums (they never go backwards);
gauges are summed over the live processes only. A gauge read from a callback at scrape time
cannot work so (the scrape runs in one process): each process instead publishes its own
gauges every second and at the scrape it answers (`Metrics.track`, `Metrics.publish`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

if TYPE_CHECKING:
    from gradserve.service.compute import Stats

log = logging.getLogger("gradserve")

# Request latency from 0.5 ms (a scalar graph) to a minute (the default time limit).
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
# Measured over predicted: from a hundredth to a hundred times.
_RATIO_BUCKETS = (0.01, 0.03, 0.1, 0.3, 0.5, 0.8, 1.25, 2, 3.3, 10, 33, 100)
# Tensor memory per request, 1 KiB to 16 GiB in powers of 4.
_BYTES_BUCKETS = tuple(float(1024 * 4**i) for i in range(13))

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Methods counted by name; any other (a client may send any token) is counted as "other",
# so requests cannot grow the label sets, as unknown paths cannot (they are "<unmatched>").
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The most (route, method, status) children kept; past it, `labels()` is asked each time.
_MAX_CACHED = 1024

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How often a process publishes its gauges in multiprocess mode (other processes' gauges
# in a scrape are at most this old; the answering process's are read at the scrape).
PUBLISH_INTERVAL_S = 1.0
# A file of a "live" gauge mode: gauge_livesum_<pid>.db and the like.
_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


def multiprocess_dir() -> str | None:
    """The directory every process of this server writes its values to, or None when the
    process keeps its figures to itself (one front process). prometheus-client chooses at
    import whether values go to files: if the variable came later, they do not."""
    path = os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower())
    if not path or prometheus_values.ValueClass is prometheus_values.MutexValue:
        return None
    return path


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by uvicorn's supervisor, does
    not); in doubt, alive: its gauges then stay until a later scrape."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the number now
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # no /proc (not Linux), or it has just gone: the next scrape sees it
        return True
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def sweep_dead(path: str) -> list[int]:
    """Remove the live-gauge files of processes that no longer run (a uvicorn worker that
    was killed, and replaced by its supervisor, has no chance to): their gauges leave the
    sums, while their counters and histograms stay. The pids swept."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    pids = {int(m.group(1)) for m in map(_LIVE_GAUGE_FILE.fullmatch, names) if m}
    dead = sorted(pid for pid in pids if not _alive(pid))
    for pid in dead:
        # Another process's scrape may be removing the same files: each try starts over
        # with what is left.
        for _ in range(3):
            try:
                mark_process_dead(pid, path)
                break
            except FileNotFoundError:
                continue
    return dead


class RequestChildren(NamedTuple):
    """The label children one (route, method, status) updates."""

    requests: Any
    latency: Any
    bytes_out: Any


class Metrics:
    def __init__(self) -> None:
        # Where the processes of a server with several front processes write their values
        # (PROMETHEUS_MULTIPROC_DIR); None, one front process: scrapes read this registry,
        # and gauges are read from their callbacks at the scrape.
        self.multiproc_dir = multiprocess_dir()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._published: list[tuple[Gauge, Callable[[], float]]] = []
        self._scrape_registry: CollectorRegistry | None = None
        if self.multiproc_dir is not None:
            self._scrape_registry = CollectorRegistry()
            MultiProcessCollector(self._scrape_registry, self.multiproc_dir)
        # Gauges in multiprocess mode (ignored otherwise): "livesum" for all of them, since
        # each is a per-process amount whose server-wide figure is the sum over the front
        # processes (requests, computations, queued requests, workers, reserved bytes and
        # cached bytes of each add up), and a dead process holds none of them any more
        # ("live": its file goes).
        self.requests = Counter(
            "gradserve_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "gradserve_request_duration_seconds",
            "HTTP request latency",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "gradserve_requests_in_flight",
            "HTTP requests being handled",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.bytes_in = Counter(
            "gradserve_request_bytes", "request body bytes received", ["route"], registry=r
        )
        self.bytes_out = Counter(
            "gradserve_response_bytes", "response body bytes sent", ["route"], registry=r
        )
        self.planned_peak = Histogram(
            "gradserve_planned_peak_bytes",
            "planned peak tensor memory of admitted computations",
            ["path"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.measured_peak = Histogram(
            "gradserve_peak_bytes",
            "measured peak tensor memory of finished computations",
            ["path"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.computing = Gauge(
            "gradserve_computations_in_flight",
            "computations admitted and running",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.reserved_bytes = Gauge(
            "gradserve_inflight_planned_bytes",
            "planned bytes reserved by running computations",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cache_evictions = Counter(
            "gradserve_program_cache_evictions",
            "compiled programs evicted from a program cache (every process's)",
            registry=r,
        )
        self.graph_evictions = Counter(
            "gradserve_graph_cache_evictions",
            "graphs evicted from a graph-id cache (every process's): a later request by "
            "that id gets 409 graph-unknown",
            registry=r,
        )
        self.cache_bytes = Gauge(
            "gradserve_program_cache_bytes",
            "estimated bytes of the compiled programs cached, summed over the processes",
            registry=r,
            multiprocess_mode="livesum",
        )
        # Where each computation's program came from, and what finding it cost; by the role
        # of the process that computed: the front process (its fast lane) or a worker.
        self.compiles = Counter(
            "gradserve_compiles",
            "graphs compiled into programs, by the role of the process "
            "that compiled: front (its fast lane) or worker",
            ["role"],
            registry=r,
        )
        self.program_lookups = Counter(
            "gradserve_program_lookups",
            "programs looked up by computations, by where they were found: process (its "
            "memory), store (loaded from the host's program store), lifted (a miss that took "
            "the program of a graph differing only in float literals) or compiled (a miss); "
            "and by the role of the process that looked: front or worker",
            ["source", "role"],
            registry=r,
        )
        self.lookups = {
            (source, role): self.program_lookups.labels(source, role)
            for source in ("process", "store", "lifted", "compiled")
            for role in ROLES
        }
        self.compiled = {role: self.compiles.labels(role) for role in ROLES}
        self.compile_seconds = Histogram(
            "gradserve_program_compile_seconds",
            "time to compile a program",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # The native tier (service/tier.py): which tier answered each run, and the lowerings.
        self.tier_runs = Counter(
            "gradserve_tier_runs",
            "program runs by the tier that ran them: interpreter or xla",
            ["tier"],
            registry=r,
        )
        self.xla_lowerings = Counter(
            "gradserve_xla_lowerings",
            "programs the lowering process lowered to XLA (once "
            "per host), by outcome: xla (an executable in the store) or refused",
            ["outcome"],
            registry=r,
        )
        self.xla_loads = Counter(
            "gradserve_xla_loads",
            "XLA executables loaded from the store by the processes that run them",
            registry=r,
        )
        self.tier_predictions = Histogram(
            "gradserve_tier_prediction_ratio",
            "the native tier's cost model: what was "
            "measured over what was predicted, by what: interpreted (a program's first "
            "interpreted run), xla (its fastest of its first lowered runs), compile",
            ["what"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.xla_compile_seconds = Histogram(
            "gradserve_xla_compile_seconds",
            "time XLA took to compile a program, in the host's lowering process",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.load_seconds = Histogram(
            "gradserve_program_load_seconds",
            "time to load a program from the store",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_bytes = Gauge(
            "gradserve_program_store_bytes",
            "bytes of the entries in the program store "
            "(one store for the host's processes: the largest figure any of them saw)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.store_evictions = Counter(
            "gradserve_program_store_evictions",
            "entries evicted from the program store to keep it within its bound",
            registry=r,
        )
        self.store_damaged = Counter(
            "gradserve_program_store_damaged",
            "program store entries found damaged (truncated, garbage, half-written), deleted "
            "and compiled again",
            registry=r,
        )
        # Tensors held by id (service/tensors.py), per API key (its tenant id's first 12
        # hex digits, "anonymous" with keys off: as many labels as the server has keys). One
        # store for the host: the largest figure any process saw.
        self.tensors_held = Gauge(
            "gradserve_tensors_held",
            "tensors held by id, per API key",
            ["key"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.tensor_bytes = Gauge(
            "gradserve_tensor_bytes",
            "bytes of tensor data held by id, per API key (each key's quota bounds it)",
            ["key"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.tensor_evictions = Counter(
            "gradserve_tensor_evictions",
            "held tensors evicted, least recently used first, to fit a key's quota: a later "
            "request naming one gets 409 tensor-unknown",
            registry=r,
        )
        self.tensor_unknown = Counter(
            "gradserve_tensor_unknown",
            "requests answered 409 tensor-unknown (an id evicted, deleted, never held, or "
            "another key's)",
            registry=r,
        )
        # What refreshes the tensor gauges at a scrape: (per key: tensors, bytes), and the
        # evictions the front process made since it last said (None: no tensor store).
        self.tensor_usage: Callable[[], tuple[dict[str, tuple[int, int]], int]] | None = None
        self.queue_length = Gauge(
            "gradserve_queue_length",
            "requests waiting for a compute slot",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "gradserve_queue_wait_seconds",
            "how long requests that found every compute slot "
            "busy waited for one (admitted, or refused at the queue's bound or deadline)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_workers = Gauge(
            "gradserve_compute_workers",
            "compute worker processes alive (starting, warm, or leaving)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.worker_exits = Counter(
            "gradserve_compute_worker_exits",
            "compute worker processes gone, by reason: rss "
            "(recycled), idle (above the minimum), killed (its request's deadline or hang-up), "
            "died",
            ["reason"],
            registry=r,
        )
        self.rejections = Counter(
            "gradserve_rejections", "requests refused, by reason", ["reason"], registry=r
        )
        # Every reason exists from the start, so dashboards see zeros rather than gaps.
        self.rejected = {reason: self.rejections.labels(reason) for reason in REJECTION_REASONS}
        self._peak_children: dict[str, tuple[Any, Any]] = {}
        self._request_children: dict[tuple[str, str, int], RequestChildren] = {}
        self._bytes_in_children: dict[str, Any] = {}

    def request_children(self, route: str, method: str, status: int) -> RequestChildren:
        """The children for one request's labels: made once, then looked up (a plain dict
        read, safe without a lock under the GIL; a race only makes the same child twice)."""
        key = (route, method, status)
        children = self._request_children.get(key)
        if children is None:
            children = RequestChildren(
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route, method),
                self.bytes_out.labels(route),
            )
            if len(self._request_children) < _MAX_CACHED:
                self._request_children[key] = children
        return children

    def bytes_in_of(self, route: str) -> Any:
        """The request-bytes child of a route; made on the first request with a body."""
        child = self._bytes_in_children.get(route)
        if child is None:
            child = self.bytes_in.labels(route)
            if len(self._bytes_in_children) < _MAX_CACHED:
                self._bytes_in_children[route] = child
        return child

    def peak_children(self, path: str) -> tuple[Any, Any]:
        """(planned, measured) peak-bytes children of a compute path ("grad", "no_grad");
        made on first use, so /metrics shows a path once it has run."""
        children = self._peak_children.get(path)
        if children is None:
            children = (self.planned_peak.labels(path), self.measured_peak.labels(path))
            self._peak_children[path] = children
        return children

    def observe(self, stats: Stats) -> None:
        """A computation's figures (wherever it ran: workers keep no metrics of their
        own)."""
        planned, measured = self.peak_children(stats.path)
        if stats.planned_peak_bytes is not None and stats.kind != "plan":
            planned.observe(stats.planned_peak_bytes)
        if stats.peak_bytes is not None:
            measured.observe(stats.peak_bytes)
        if stats.rejected is not None:
            self.rejected[stats.rejected].inc()
        if stats.cache_evictions:
            self.cache_evictions.inc(stats.cache_evictions)
        if stats.graph_evictions:
            self.graph_evictions.inc(stats.graph_evictions)
        if stats.program is not None:
            self.lookups[(stats.program, stats.role)].inc()
        if stats.compile_ms is not None and stats.program != "lifted":
            self.compiled[stats.role].inc()
            self.compile_seconds.observe(stats.compile_ms / 1000)
        if stats.load_ms is not None:
            self.load_seconds.observe(stats.load_ms / 1000)
        if stats.tier is not None:
            self.tier_runs.labels(stats.tier).inc()
        for key in stats.loads:
            self.xla_loads.inc()
            log.info(
                "program %s runs in the native tier in compute worker %s from now on",
                key,
                stats.pid,
            )
        for what, predicted, measured in stats.predictions:
            if predicted > 0:
                self.tier_predictions.labels(what).observe(measured / predicted)
        if stats.store_evictions:
            self.store_evictions.inc(stats.store_evictions)
        if stats.store_damaged:
            self.store_damaged.inc(stats.store_damaged)
        if stats.tensor_evictions:
            self.tensor_evictions.inc(stats.tensor_evictions)

    def lowered(
        self, key: str, refused: str | None, compile_ms: float, predicted_ms: float
    ) -> None:
        """What the lowering process did with a program."""
        if refused is None:
            self.xla_lowerings.labels("xla").inc()
            self.xla_compile_seconds.observe(compile_ms / 1000)
            if predicted_ms > 0:
                self.tier_predictions.labels("compile").observe(compile_ms / predicted_ms)
            log.info(
                "program %s lowered to XLA in %.0f ms (predicted %.0f ms)",
                key,
                compile_ms,
                predicted_ms,
            )
        else:
            self.xla_lowerings.labels("refused").inc()
            log.info("program %s stays interpreted: %s", key, refused)

    def track(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """`gauge` shows what `read` returns: read at the scrape (one front process: nothing
        on the hot path), or published by this process (several: see `publish`)."""
        if self.multiproc_dir is None:
            gauge.set_function(read)
        else:
            self._published.append((gauge, read))

    def publish(self) -> None:
        """This process's tracked gauges into its files (multiprocess mode), for any
        process's scrape to sum."""
        for gauge, read in self._published:
            gauge.set(read())
        self._tensors()

    def _tensors(self) -> None:
        """The tensor gauges, read from the store (every key's directory listed: a few
        microseconds a tensor), and the front process's own evictions."""
        if self.tensor_usage is None:
            return
        usage, evictions = self.tensor_usage()
        if evictions:
            self.tensor_evictions.inc(evictions)
        for key, (count, nbytes) in usage.items():
            label = key[:12]
            self.tensors_held.labels(label).set(count)
            self.tensor_bytes.labels(label).set(nbytes)

    async def publish_forever(self, interval: float = PUBLISH_INTERVAL_S) -> None:
        """Publish now and then, for the life of the app (multiprocess mode only)."""
        if self.multiproc_dir is None:
            return
        while True:
            self.publish()
            await asyncio.sleep(interval)

    def sweep(self) -> list[int]:
        """Drop dead processes' gauges (multiprocess mode): the pids swept."""
        return [] if self.multiproc_dir is None else sweep_dead(self.multiproc_dir)

    def retire(self) -> None:
        """At this process's end: its gauges leave the sums (counters and histograms stay)."""
        if self.multiproc_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                mark_process_dead(os.getpid(), self.multiproc_dir)

    def render(self) -> bytes:
        if self._scrape_registry is None:
            self._tensors()
            return generate_latest(self.registry)
        self.publish()
        self.sweep()
        return generate_latest(self._scrape_registry)


ROLES = ("front", "worker")  # the process that computed
REJECTION_REASONS = (
    "queue_full",  # 503: all compute slots busy, and the queue for them full
    "queue_timeout",  # 503: no compute slot came free within GRADSERVE_QUEUE_TIMEOUT_S
    "inflight_memory",  # 503: the in-flight memory budget is full (body, parse or plan)
    "memory_budget",  # 422: the plan is over the per-request budget
    "compute_budget",  # 422: the plan's compute cost is over the budget
    "body_size",  # 413
    "unauthorized",  # 401
    "timeout",  # 504 (also when a request's deadline passes while it waits for a slot)
    "connections",  # 503: over the open-connection cap (service/protocol.py)
    "request_timeout",  # 408: the request head or body came too slowly (service/protocol.py)
)
