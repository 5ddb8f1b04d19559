"""Prometheus metrics, one registry per app (so apps built in tests never collide).

`labels()` costs a dict lookup under a lock on every call; the hot path instead keeps the
label children it has used (per route, method and status; per path; per reason), so a
request pays for the increments alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Request latency from 0.5 ms (a scalar graph) to a minute (the default time limit).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)
# Tensor memory per request, 1 KiB to 16 GiB in powers of 4.
_BYTES_BUCKETS = tuple(float(1024 * 4**i) for i in range(13))

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Methods counted by name; any other (a client may send any token) is counted as "other",
# so requests cannot grow the label sets, as unknown paths cannot (they are "<unmatched>").
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The most (route, method, status) children kept; past it, `labels()` is asked each time.
_MAX_CACHED = 1024


class RequestChildren(NamedTuple):
    """The label children one (route, method, status) updates."""

    requests: Any
    latency: Any
    bytes_out: Any


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gradserve_requests", "HTTP requests by route, method and status",
            ["route", "method", "status"], registry=r,
        )
        self.latency = Histogram(
            "gradserve_request_duration_seconds", "HTTP request latency",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "gradserve_requests_in_flight", "HTTP requests being handled", registry=r
        )
        self.bytes_in = Counter(
            "gradserve_request_bytes", "request body bytes received", ["route"], registry=r
        )
        self.bytes_out = Counter(
            "gradserve_response_bytes", "response body bytes sent", ["route"], registry=r
        )
        self.planned_peak = Histogram(
            "gradserve_planned_peak_bytes", "planned peak tensor memory of admitted computations",
            ["path"], buckets=_BYTES_BUCKETS, registry=r,
        )
        self.measured_peak = Histogram(
            "gradserve_peak_bytes", "measured peak tensor memory of finished computations",
            ["path"], buckets=_BYTES_BUCKETS, registry=r,
        )
        self.computing = Gauge(
            "gradserve_computations_in_flight", "computations admitted and running", registry=r
        )
        self.reserved_bytes = Gauge(
            "gradserve_inflight_planned_bytes",
            "planned bytes reserved by running computations", registry=r,
        )
        self.cache_evictions = Counter(
            "gradserve_program_cache_evictions",
            "compiled programs evicted from a program cache (every process's)", registry=r,
        )
        self.graph_evictions = Counter(
            "gradserve_graph_cache_evictions",
            "graphs evicted from a graph-id cache (every process's): a later request by "
            "that id gets 409 graph-unknown", registry=r,
        )
        self.cache_bytes = Gauge(
            "gradserve_program_cache_bytes",
            "estimated bytes of the compiled programs cached, summed over the processes",
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


REJECTION_REASONS = (
    "concurrency",  # 503: all compute slots busy
    "inflight_memory",  # 503: the in-flight memory budget is full (body, parse or plan)
    "memory_budget",  # 422: the plan is over the per-request budget
    "compute_budget",  # 422: the plan's compute cost is over the budget
    "body_size",  # 413
    "unauthorized",  # 401
    "timeout",  # 504
    "connections",  # 503: over the open-connection cap (service/protocol.py)
    "request_timeout",  # 408: the request head or body came too slowly (service/protocol.py)
)
