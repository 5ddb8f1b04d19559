"""One pure-ASGI middleware for what every request goes through: request id, API key,
body-size limit (declared and streamed), metrics, the access log line, and the last-resort
500. Pure ASGI rather than BaseHTTPMiddleware: it neither buffers nor wraps the body, and
costs a few microseconds per request.

Two ends that are not errors: a client that goes away (`ClientDisconnect`) is counted as
499, nginx's "client closed request", and nothing is sent; a request still running when
the server's graceful shutdown runs out (uvicorn cancels its task) gets a 503 `cancelled`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gradserve.engine.errors import Cancelled
from gradserve.service.errors import (
    ENGINE_PROBLEMS,
    PROBLEM_JSON,
    ProblemError,
    internal_error_body,
    problem_body,
)
from gradserve.service.metrics import METHODS, Metrics

access_log = logging.getLogger("gradserve.access")
error_log = logging.getLogger("gradserve.errors")

# Paths a load balancer or orchestrator probes: never behind an API key.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Set in a request's scope state: a stable, non-secret id of the API key that authorised
# it (the hex BLAKE2b-128 of the key), or None (keys off, or a path open to all).
TENANT = "tenant"
_READ_METHODS = frozenset({"GET", "HEAD"})
# An incoming id is echoed only if it is short and printable (it goes into logs and headers).
_REQUEST_ID_RE = re.compile(rb"^[A-Za-z0-9._:/+=@-]{1,128}$")
# Set in a request's scope state by the HTTP protocol (service/protocol.py) when it timed
# the request out: the app then sees a disconnect, which is counted as 408, not 499.
TIMED_OUT = "gradserve.timed_out"
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection first
_CANCELLED_STATUS, _CANCELLED_SLUG, _CANCELLED_TITLE = ENGINE_PROBLEMS[Cancelled]


def loggable(text: str) -> str:
    """`text` (anything a client chose: path, method, header) made safe for one log line:
    control characters (C0, DEL, C1) and anything else not printable become \\xNN,
    \\uNNNN or \\UNNNNNNNN, and a backslash or a double quote (which delimits the request
    in the access line) is escaped too, so a client can neither start a forged line, nor
    send terminal escapes, nor forge an escape sequence."""
    if text.isprintable() and "\\" not in text and '"' not in text:
        return text  # the usual case: one pass in C
    return "".join(_ESCAPES.get(c) or (c if c.isprintable() else _escape(c)) for c in text)


_ESCAPES = {"\\": "\\\\", '"': "\\x22"}


def _escape(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def tenant_id(api_key: str) -> str:
    """The tenant id of an API key: its hex BLAKE2b-128. Stable across restarts and
    replicas (what is scoped by it stays valid), and not the key, so it may be kept where
    keys must not be. Unsalted, it hides a weak key no better than the key's own
    strength: it stays inside the service, never sent to a client."""
    return hashlib.blake2b(api_key.encode(), digest_size=16).hexdigest()


class Gateway:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        max_body_bytes: int,
        api_keys: Sequence[str] = (),
        open_paths: Iterable[str] = (),
    ) -> None:
        """`open_paths`: paths that GET and HEAD may read without a key, besides the
        probes (the explorer's page and files, which hold no data)."""
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        # Each key with its tenant id, computed once: the id, never the key, goes further.
        self.api_keys = [(k.encode(), tenant_id(k)) for k in api_keys]
        self.open_paths = frozenset(open_paths)
        self.in_flight = 0  # on the event loop only; read when /metrics is scraped
        metrics.track(metrics.in_flight, lambda: self.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])  # later duplicates win; none we read may repeat
        raw_id = headers.get(b"x-request-id")
        # A generated id: 128 random bits as 32 hex digits (uuid4().hex's form, at a
        # quarter of its cost).
        rid = raw_id.decode() if raw_id and _REQUEST_ID_RE.match(raw_id) else os.urandom(16).hex()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state[TENANT] = None
        rid_header = (b"x-request-id", rid.encode())

        status = 500
        sent = 0
        received = 0
        started = False
        head = scope["method"] == "HEAD"  # the server sends no body, whatever the app gives

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), rid_header]
            elif message["type"] == "http.response.body" and not head:
                sent += len(message.get("body", b""))
            await send(message)

        async def receive_wrapper() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Raised inside the route's body read: no more of the body is read,
                    # and the handler for ProblemError renders the 413.
                    raise ProblemError("body-too-large", self._too_large())
            return message

        self.in_flight += 1
        try:
            refusal = self._refusal(scope, headers, state)
            if refusal is not None:
                await self._send_problem(send_wrapper, refusal, rid)
            else:
                await self.app(scope, receive_wrapper, send_wrapper)
        except ClientDisconnect:
            # The client left (mid-upload, or while its request computed), or the protocol
            # timed its body out and has answered 408 itself: either way nobody is listening.
            status = 408 if scope["state"].get(TIMED_OUT) else CLIENT_CLOSED
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when its graceful shutdown runs out
            # (and nothing else cancels a request task). Answer, and end the task here:
            # re-raised, uvicorn would log a traceback and send a plain-text 500.
            if not started:
                detail = "the server is shutting down and stopped this request; retry it"
                body = problem_body(
                    _CANCELLED_STATUS, _CANCELLED_SLUG, _CANCELLED_TITLE, detail, request_id=rid
                )
                await _send_json(
                    send_wrapper, _CANCELLED_STATUS, body, PROBLEM_JSON, {"Retry-After": "1"}
                )
        except Exception as exc:
            error_log.error("unhandled error in request %s", rid, exc_info=exc)
            if started:
                raise
            await _send_json(send_wrapper, 500, internal_error_body(rid), PROBLEM_JSON)
        finally:
            self.in_flight -= 1
            self._observe(scope, status, time.perf_counter() - start, received, sent, rid)

    def _too_large(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes"

    def _refusal(
        self, scope: Scope, headers: dict[bytes, bytes], state: dict[str, Any]
    ) -> ProblemError | None:
        if self.api_keys and self._needs_key(scope):
            state[TENANT] = self._tenant(headers)
            if state[TENANT] is None:
                return ProblemError(
                    "unauthorized",
                    "a valid API key is required: send 'Authorization: Bearer KEY' or "
                    "'X-API-Key: KEY'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return ProblemError("bad-request", "the Content-Length header is not a number")
            if int(declared) > self.max_body_bytes:
                return ProblemError("body-too-large", self._too_large())
        return None

    def _needs_key(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in PROBE_PATHS:
            return False
        return path not in self.open_paths or scope["method"] not in _READ_METHODS

    def _tenant(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant id of the key the request carries, or None: no valid key."""
        candidate = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if candidate is None and auth is not None:
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() == b"bearer":
                candidate = token.strip()
        if not candidate:
            return None
        # Compare against every key, so the time taken says nothing about which one matched.
        tenant = None
        for key, tenant_of_key in self.api_keys:
            if hmac.compare_digest(candidate, key):
                tenant = tenant_of_key
        return tenant

    async def _send_problem(self, send: Send, exc: ProblemError, rid: str) -> None:
        body = problem_body(exc.status, exc.slug, exc.title, exc.detail, request_id=rid)
        await _send_json(send, exc.status, body, PROBLEM_JSON, exc.headers)

    def _observe(
        self, scope: Scope, status: int, seconds: float, received: int, sent: int, rid: str
    ) -> None:
        route = scope.get("route")
        # The route template, never the raw path: unknown paths must not grow label sets.
        label = getattr(route, "path", None) or "<unmatched>"
        method = scope["method"]
        children = self.metrics.request_children(
            label, method if method in METHODS else "other", status
        )
        children.requests.inc()
        children.latency.observe(seconds)
        if received:
            self.metrics.bytes_in_of(label).inc(received)
        children.bytes_out.inc(sent)
        if status == 413:
            self.metrics.rejected["body_size"].inc()
        elif status == 401:
            self.metrics.rejected["unauthorized"].inc()
        if access_log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            # Everything a client chose is escaped: the path (percent-decoded by the
            # server), the method, and the client address (which uvicorn takes from
            # X-Forwarded-For when the peer is a trusted proxy). The id is checked above.
            access_log.info(
                '%s %s "%s %s HTTP/%s" %d %dB %.2fms',
                rid,
                loggable(f"{client[0]}:{client[1]}") if client else "-",
                loggable(method),
                loggable(scope["path"]),
                scope.get("http_version", "1.1"),
                status,
                sent,
                seconds * 1000,
            )


async def _send_json(
    send: Send, status: int, body: bytes, media_type: str, headers: dict[str, str] | None = None
) -> None:
    raw_headers = [
        (b"content-type", media_type.encode()),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
