"""Prometheus metrics, one registry per app (so apps built in tests never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Request latency from 0.5 ms (a scalar graph) to a minute (the default time limit).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)
# Tensor memory per request, 1 KiB to 16 GiB in powers of 4.
_BYTES_BUCKETS = tuple(float(1024 * 4**i) for i in range(13))

CONTENT_TYPE = CONTENT_TYPE_LATEST


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
        self.rejections = Counter(
            "gradserve_rejections", "requests refused, by reason", ["reason"], registry=r
        )
        # Every reason exists from the start, so dashboards see zeros rather than gaps.
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


REJECTION_REASONS = (
    "concurrency",  # 503: all compute slots busy
    "inflight_memory",  # 503: the in-flight memory budget is full
    "memory_budget",  # 422: the plan is over the per-request budget
    "body_size",  # 413
    "unauthorized",  # 401
    "timeout",  # 504
)
