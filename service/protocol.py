"""uvicorn's HTTP protocol with the connection limits uvicorn lacks.

uvicorn times out an idle keep-alive connection, but nothing else: a client that connects
and never sends, or sends its request a byte a second, holds a connection (a file
descriptor) forever, and nothing caps how many connections are open. These subclasses of
uvicorn's two protocol classes (`GradserveProtocol` is the one uvicorn's "auto" would
pick) add, per worker process:

- a head deadline: a request head must be complete `header_timeout_s` after the
  connection opened or the previous response finished;
- a body rate: the body must be complete `body_timeout_s` after the head, extended by one
  second per `body_min_rate_bytes_s` bytes received (mod_reqtimeout's
  `body=10,MinRate=...`): past the first `body_timeout_s`, it must keep up that rate;
- on either timeout: a 408 problem (when no response has started), one info line, and
  the connection is closed;
- a cap of `max_connections` open connections. At the cap, a new connection first takes
  the place of the one that has waited longest (at least `EVICT_AFTER_S`) for a request
  without sending a byte of one, as nginx reuses idle keep-alive connections; failing
  that, `PROBE_RESERVE` more connections may each ask `/healthz` or `/readyz` once (so
  probes still answer while the cap is full of busy connections), anything else on them
  gets a 503, and past the reserve a new connection gets a canned 503 problem at once;
- readiness false from the moment uvicorn's shutdown begins (see `_Guard._on_shutdown`).

A 408 or 503 written by the protocol half-closes the connection and drops what the client
still sends for up to `LINGER_S`, so the client reads the answer rather than a reset.
The deadlines are checked by one timer per server, once a second (`TICK_S`), over all its
connections: a request pays for a byte counter, a few attribute reads and a dict insert
and delete, not for timers. The app hands its settings, metrics and clock (the deadlines'
and the timer's, service/clock.py) over in the lifespan state (`POLICY_STATE`).

Why a subclass of uvicorn's protocol, and not uvicorn's own options: uvicorn has no
request-head timeout (only the keep-alive one), and its `--limit-concurrency` answers a
plain-text 503 without Retry-After. With only uvicorn's options, a user who runs
`gradserve serve` without HAProxy in front (docker/) would be unprotected against slow
clients. So the subclass stays, but uvicorn is touched in one place only:

- `_Uvicorn`, the adapter (the first section below), is the only code that reads, writes,
  calls or overrides anything of uvicorn's protocol classes, of a request's cycle, of its
  flow control and of the server's state; `UVICORN_ATTRIBUTES` lists each of them. It turns
  uvicorn's calls into the policy's hooks (`_on_open`, `_on_data`, ...) and answers the
  policy's questions (`_uv_idle`, `_uv_reading_body`, ...).
- `_Guard`, the policy (deadlines, cap, eviction, probes, draining), reads uvicorn only
  through the adapter.
- uvicorn is pinned to one version in pyproject.toml (the `server` extra), and
  tests/service/test_uvicorn_contract.py checks every entry of `UVICORN_ATTRIBUTES` on the
  installed uvicorn (that it exists, its kind, the parameters of each overridden method,
  and the behaviour the policy relies on), and that no code outside the adapter touches
  them. The pin and the contract test go together: bump uvicorn, run that test, and fix
  the adapter (only) where it fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any, Literal

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gradserve.service.clock import SYSTEM_CLOCK, Clock, Timer
from gradserve.service.errors import SERVICE_PROBLEMS, problem_body
from gradserve.service.middleware import PROBE_PATHS, TIMED_OUT, loggable
from gradserve.service.settings import Settings

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows: the cap is taken as it is
    resource = None  # type: ignore[assignment]

log = logging.getLogger("gradserve.connections")


# ------------------------------------------------------------------------------ the uvicorn adapter
@dataclass(frozen=True)
class UvicornAttribute:
    """One thing of uvicorn's private surface that `_Uvicorn` touches; the contract test
    (tests/service/test_uvicorn_contract.py) checks each on the installed uvicorn."""

    # Whose: "protocol" (either protocol class, or its instance for a connection), "cycle"
    # (a request's `RequestResponseCycle`), "flow" (a connection's `FlowControl`) or
    # "server_state" (the server's `ServerState`).
    owner: Literal["protocol", "cycle", "flow", "server_state"]
    name: str
    # What the adapter does with it, one or more of: "override" (a method it overrides,
    # calling uvicorn's own), "read" (reads it, perhaps to call a method of the value) and
    # "write" (assigns it).
    use: str
    # A method's parameter names after `self`; None for a value.
    params: tuple[str, ...] | None = None
    # A value's kind: what `isinstance` finds it to be once a request head has arrived on
    # a connection (None: anything but None; the cycle's class differs between the two).
    kind: type | tuple[type, ...] | None = None


UVICORN_ATTRIBUTES: tuple[UvicornAttribute, ...] = (
    # Overridden (each calls uvicorn's own): how uvicorn creates a connection's protocol
    # (server.py's create_protocol, by keyword), and the events the policy hooks into.
    UvicornAttribute(
        "protocol", "__init__", "override", ("config", "server_state", "app_state", "_loop")
    ),
    UvicornAttribute("protocol", "connection_made", "override", ("transport",)),
    UvicornAttribute("protocol", "connection_lost", "override", ("exc",)),
    UvicornAttribute("protocol", "data_received", "override", ("data",)),
    UvicornAttribute("protocol", "on_response_complete", "override", ()),
    UvicornAttribute("protocol", "shutdown", "override", ()),
    # A connection's state. `app` is read for each request head, so replacing it changes
    # what serves the next request (the probe reserve, draining).
    UvicornAttribute("protocol", "app", "read, write", kind=Callable),  # type: ignore[arg-type]
    UvicornAttribute("protocol", "app_state", "read", kind=dict),
    UvicornAttribute("protocol", "server_state", "read", kind=ServerState),
    UvicornAttribute("protocol", "transport", "read", kind=asyncio.Transport),
    UvicornAttribute("protocol", "flow", "read", kind=FlowControl),
    UvicornAttribute("protocol", "cycle", "read"),  # None until the first request head
    UvicornAttribute("protocol", "client", "read", kind=(tuple, type(None))),
    UvicornAttribute("protocol", "tasks", "read", kind=set),  # the server's request tasks
    # The current request.
    UvicornAttribute("cycle", "response_complete", "read", kind=bool),
    UvicornAttribute("cycle", "more_body", "read", kind=bool),
    UvicornAttribute("cycle", "response_started", "read", kind=bool),
    UvicornAttribute("cycle", "scope", "read", kind=dict),
    UvicornAttribute("cycle", "disconnected", "write", kind=bool),
    UvicornAttribute("cycle", "message_event", "read", kind=asyncio.Event),  # set()
    # Reading paused: the app is not reading the body (its buffer is full).
    UvicornAttribute("flow", "read_paused", "read", kind=bool),
    # The server's.
    UvicornAttribute("server_state", "connections", "read", kind=set),
    UvicornAttribute("server_state", "default_headers", "read", kind=list),
)


class _UvicornHTTP(asyncio.Protocol):
    """What `_Uvicorn` uses of uvicorn's protocol classes (for the type checker only)."""

    app: Any
    app_state: dict[str, Any]
    server_state: ServerState
    transport: asyncio.Transport
    flow: FlowControl
    cycle: Any
    client: tuple[str, int] | None
    tasks: set[asyncio.Task[None]]

    def on_response_complete(self) -> None: ...
    def shutdown(self) -> None: ...


if TYPE_CHECKING:
    _Base = _UvicornHTTP
else:
    _Base = asyncio.Protocol


class _Uvicorn(_Base):
    """The adapter: the only code that touches uvicorn's private protocol surface (the
    entries of `UVICORN_ATTRIBUTES`), placed between the policy (`_Guard`) and either of
    uvicorn's protocol classes in the method resolution order.

    uvicorn's calls become the policy's hooks (`_on_...`, no-ops here); the policy asks
    about the connection and its request with the `_uv_...` methods. The request itself is
    handed to the policy as an opaque token (`_uv_request`), compared only by identity."""

    # -- uvicorn's methods, overridden: uvicorn's own runs, and the policy's hook around it
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_init()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._on_open()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._on_lost()

    def data_received(self, data: bytes) -> None:
        size = len(data)
        if self._on_data(size):
            super().data_received(data)
            self._on_parsed(size, self.cycle)

    def on_response_complete(self) -> None:
        self._on_response_complete()
        super().on_response_complete()  # may start a pipelined request
        if self.cycle.response_complete and not self.transport.is_closing():
            self._on_idle()

    def shutdown(self) -> None:
        if self._on_shutdown():
            super().shutdown()

    # -- the policy's hooks
    def _on_init(self) -> None:
        """The protocol was created (for a connection about to be made)."""

    def _on_open(self) -> None:
        """The connection was made."""

    def _on_lost(self) -> None:
        """The connection was lost (closed by either side)."""

    def _on_data(self, size: int) -> bool:
        """`size` bytes arrived; False drops them (uvicorn does not see them)."""
        return True

    def _on_parsed(self, size: int, request: object) -> None:
        """uvicorn has parsed the `size` bytes; `request` is the current request now."""

    def _on_response_complete(self) -> None:
        """A response is complete (before uvicorn starts a pipelined request, if any)."""

    def _on_idle(self) -> None:
        """After a response: no pipelined request started, and the connection is open."""

    def _on_shutdown(self) -> bool:
        """The server's graceful shutdown began; False keeps uvicorn's from running (it
        closes an idle connection, and closes a busy one after its response)."""
        return True

    # -- what the policy asks uvicorn
    def _uv_lifespan_state(self, key: str) -> Any:
        """The lifespan state's value for `key` (None if none)."""
        return self.app_state.get(key)

    def _uv_server(self) -> object:
        """The server, as an opaque key (one for each uvicorn server)."""
        return self.server_state

    def _uv_transport(self) -> asyncio.Transport:
        """The connection's transport (used through asyncio's public interface)."""
        return self.transport

    def _uv_client(self) -> tuple[str, int] | None:
        return self.client

    def _uv_default_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers uvicorn puts on every response (date, server)."""
        return self.server_state.default_headers

    def _uv_served(self) -> bool:
        """Still one of the server's HTTP connections (False once handed over to a
        WebSocket protocol)."""
        return self in self.server_state.connections

    def _uv_requests_running(self) -> bool:
        """Any request still running on the server (any connection)."""
        return bool(self.tasks)

    def _uv_wrap_app(self, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        """Serve this connection's next requests with `wrap(app)`."""
        self.app = wrap(self.app)

    def _uv_request(self) -> object:
        """The current request (None before the first head), an opaque token: a new one
        at each request head."""
        return self.cycle

    def _uv_idle(self) -> bool:
        """No request, or its response is complete: waiting for a request head."""
        return self.cycle is None or self.cycle.response_complete

    def _uv_reading_body(self) -> bool:
        """Of a request that is not idle: its body is still coming, no response has
        started, and the app is not behind on it (reading is not paused)."""
        return (
            self.cycle.more_body and not self.cycle.response_started and not self.flow.read_paused
        )

    def _uv_request_scope(self) -> Scope:
        """The current request's ASGI scope."""
        return self.cycle.scope

    def _uv_abandon_request(self) -> None:
        """The current request's app sees a disconnect, and nothing more it sends reaches
        the socket."""
        self.cycle.disconnected = True
        self.cycle.message_event.set()


# The lifespan state key under which the app hands its `ConnectionPolicy` to the protocol.
POLICY_STATE = "gradserve.connection_policy"
# Connections past the cap that may still serve one probe each: liveness and readiness
# probes and a load balancer's check, with room to spare.
PROBE_RESERVE = 8
# How often the deadlines are checked; during a shutdown, how often idle connections are
# looked at (they close once no request is left running).
TICK_S = 1.0
DRAIN_TICK_S = 0.1
# A refused or timed-out connection is half-closed (our FIN after the answer) and what the
# client still sends is read and dropped for up to this long (1 to 2 s, at the tick), so
# the client reads the answer rather than a reset (closing a socket with unread input
# sends RST at once, and the peer may drop the answer it has not read yet).
LINGER_S = 1.0
# At most this many connections linger at once; past it they are closed at once.
LINGER_MAX = 64
# File descriptors kept for everything but connections: the listening socket, log
# files, pipes, the event loop's own, imports; and per compute slot, its worker process's
# pipes and sentinel and the shared memory of its body and response.
FD_MARGIN = 64
FDS_PER_SLOT = 8
# A refusal summary is logged at most this often while connections are being refused.
REFUSAL_LOG_S = 10.0
# At the cap, a connection that has waited this long for a request, without sending a byte
# of one, may be closed to make room for a new one (not sooner: it had no time to send).
EVICT_AFTER_S = 1.0


@dataclass(frozen=True)
class ConnectionPolicy:
    """What the protocol enforces, and where it reports (set up in the app's lifespan)."""

    header_timeout_s: float
    body_timeout_s: float
    body_min_rate_bytes_s: int
    max_connections: int  # the effective cap: the setting, or less if file descriptors are short
    count: Callable[[str], None] = lambda reason: None  # a rejection, by metrics reason
    drain: Callable[[], None] = lambda: None  # shutdown began: readiness goes false
    clock: Clock = SYSTEM_CLOCK  # the deadlines' and the watchdog's

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        count: Callable[[str], None] = lambda reason: None,
        drain: Callable[[], None] = lambda: None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> ConnectionPolicy:
        """The policy for `settings`, with the cap fitted to the open-file limit."""
        return cls(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            body_min_rate_bytes_s=settings.body_min_rate_bytes_s,
            max_connections=fit_open_file_limit(
                settings.max_connections, slots=settings.max_concurrency
            ),
            count=count,
            drain=drain,
            clock=clock,
        )


@cache
def _fallback_policy() -> ConnectionPolicy:
    # An app without our lifespan (or lifespan off): the limits still hold, unreported.
    return ConnectionPolicy.from_settings(Settings())


def fit_open_file_limit(max_connections: int, *, slots: int = 0) -> int:
    """Raise the soft RLIMIT_NOFILE as far as `max_connections` needs (up to the hard
    limit), besides what is open now and what `slots` compute slots may open, and return
    the cap that fits under it: `max_connections`, or less (with a warning) when even the
    hard limit is too low."""
    if resource is None:
        return max_connections
    in_use = _open_fds()
    overhead = in_use + FD_MARGIN + FDS_PER_SLOT * slots + PROBE_RESERVE + LINGER_MAX
    need = max_connections + overhead
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. a container that forbids raising it
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    cap = max(1, soft - overhead)
    log.warning(
        "GRADSERVE_MAX_CONNECTIONS=%d does not fit under the open-file limit (soft %d, "
        "hard %s; %d open, %d kept for files, workers, probes and closing connections): "
        "serving at most %d connections; raise the limit (ulimit -n) to allow more",
        max_connections,
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        in_use,
        overhead - in_use,
        cap,
    )
    return cap


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs (macOS): assume a few dozen
        return 32


# ------------------------------------------------------------------------------ responses
def _response(
    status: int,
    reason: bytes,
    body: bytes,
    rid: str,
    server: list[tuple[bytes, bytes]],
    extra: bytes = b"",
) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with uvicorn's default
    headers (`server`: date and server) as on every other response."""
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, reason),
            *(b"%s: %s\r\n" % header for header in server),
            b"content-type: application/problem+json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: ",
            rid.encode(),
            b"\r\n",
            extra,
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def _timeout_response(rid: str, detail: str, server: list[tuple[bytes, bytes]]) -> bytes:
    body = problem_body(408, "request-timeout", "Request timeout", detail, request_id=rid)
    return _response(408, b"Request Timeout", body, rid, server)


_OVERLOADED_STATUS, _OVERLOADED_TITLE = SERVICE_PROBLEMS["overloaded"]
_TOO_MANY = "the server has too many open connections; retry shortly"


def _refusal_response(rid: str, server: list[tuple[bytes, bytes]]) -> bytes:
    body = problem_body(
        _OVERLOADED_STATUS, "overloaded", _OVERLOADED_TITLE, _TOO_MANY, request_id=rid
    )
    return _response(
        _OVERLOADED_STATUS, b"Service Unavailable", body, rid, server, b"retry-after: 1\r\n"
    )


def _closing(app: ASGIApp) -> ASGIApp:
    """`app`, with `Connection: close` on its responses: uvicorn closes after them."""

    async def closing(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        await app(scope, receive, send_closing)

    return closing


def _probes_only(app: ASGIApp, policy: ConnectionPolicy) -> ASGIApp:
    """For a connection in the probe reserve: the health routes, else the 503."""
    closing = _closing(app)

    async def probes_only(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBE_PATHS:
            policy.count("connections")
            rid = os.urandom(16).hex()
            body = problem_body(
                _OVERLOADED_STATUS, "overloaded", _OVERLOADED_TITLE, _TOO_MANY, request_id=rid
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": _OVERLOADED_STATUS,
                    "headers": [
                        (b"content-type", b"application/problem+json"),
                        (b"content-length", b"%d" % len(body)),
                        (b"x-request-id", rid.encode()),
                        (b"retry-after", b"1"),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await closing(scope, receive, send)

    return probes_only


# ------------------------------------------------------------------------------ the watchdog
class _Watchdog:
    """One per server: the connection counts, the connections waiting for a request, and
    the timer that checks the deadlines (on `clock`, the first connection's policy's)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.members: set[_Guard] = set()
        # Admitted connections waiting for a request with no byte of it yet (just opened,
        # or idle after a response), oldest first: the ones closed to make room at the cap.
        self.waiting: dict[_Guard, None] = {}
        self.admitted = 0  # connections served (within the cap, or in the probe reserve)
        self.lingering = 0
        self.draining = False
        self.cap = 0
        self.refused = 0  # since the last summary line
        self.evicted = 0  # likewise
        self.logged_at = -REFUSAL_LOG_S
        self._timer: Timer | None = None

    def add(self, conn: _Guard) -> None:
        self.members.add(conn)
        if self._timer is None:
            self._timer = self.clock.call_later(TICK_S, self._sweep)

    def make_room(self, now: float) -> bool:
        """Close the connection that has waited longest for a request without sending a
        byte of one (as nginx reuses idle keep-alive connections when it runs out), so that
        idle connections cannot keep anyone else out. False if none has waited
        `EVICT_AFTER_S`."""
        oldest = next(iter(self.waiting), None)  # insertion order is `_idle_since` order
        if oldest is None or now - oldest._idle_since < EVICT_AFTER_S:
            return False
        oldest.evict()
        self.evicted += 1
        return True

    def drain(self) -> None:
        if not self.draining:
            self.draining = True
            if self._timer is not None:  # look at idle connections sooner from now on
                self._timer.cancel()
            self._timer = self.clock.call_later(DRAIN_TICK_S, self._sweep)

    def _sweep(self) -> None:
        now = self.clock.now()
        for conn in list(self.members):
            conn.check(now)
        if (self.refused or self.evicted) and now - self.logged_at >= REFUSAL_LOG_S:
            log.warning(
                "at the cap of %d open connections: closed %d idle connection(s) to make "
                "room, refused %d connection(s)",
                self.cap,
                self.evicted,
                self.refused,
            )
            self.refused = self.evicted = 0
            self.logged_at = now
        self._timer = (
            self.clock.call_later(DRAIN_TICK_S if self.draining else TICK_S, self._sweep)
            if self.members
            else None
        )


# Keyed by the server (`_Uvicorn._uv_server`).
_watchdogs: weakref.WeakKeyDictionary[object, _Watchdog] = weakref.WeakKeyDictionary()


def _watchdog(server: object, clock: Clock) -> _Watchdog:
    dog = _watchdogs.get(server)
    if dog is None:
        dog = _watchdogs[server] = _Watchdog(clock)
    return dog


# ------------------------------------------------------------------------------ the policy
class _Guard(_Uvicorn):
    """The limits, on top of either uvicorn protocol class (see the module docstring):
    uvicorn is read and driven only through the adapter (`_Uvicorn`)."""

    # -- the adapter's hooks
    def _on_init(self) -> None:
        self._policy: ConnectionPolicy = self._uv_lifespan_state(POLICY_STATE) or _fallback_policy()
        self._dog = _watchdog(self._uv_server(), self._policy.clock)
        self._admitted = False
        self._waiting = False  # in `_dog.waiting`
        self._closing = False  # answered and half-closed: input is dropped
        self._linger_until = 0.0
        self._draining = False  # idle at shutdown, kept open while other requests run
        self._received = 0  # bytes, head and body, on this connection
        self._idle_since = 0.0  # when the current request head could begin
        self._request_seen: object = None  # the request whose body deadline is set
        self._body_since = 0.0
        self._body_base = 0  # `_received` when its head was complete

    def _on_open(self) -> None:
        dog = self._dog
        dog.cap = cap = self._policy.max_connections
        dog.add(self)
        self._idle_since = now = self._dog.clock.now()
        if dog.admitted >= cap and not dog.make_room(now):
            if dog.admitted >= cap + PROBE_RESERVE:
                self._policy.count("connections")
                dog.refused += 1
                self._finish(_refusal_response(os.urandom(16).hex(), self._uv_default_headers()))
                return
            self._uv_wrap_app(partial(_probes_only, policy=self._policy))
        dog.admitted += 1
        self._admitted = True
        self._wait()

    def _on_lost(self) -> None:
        self._dog.members.discard(self)
        self._leave()
        if self._linger_until:
            self._linger_until = 0.0
            self._dog.lingering -= 1

    def _on_data(self, size: int) -> bool:
        if self._closing:
            return False
        if self._waiting:
            self._waiting = False
            del self._dog.waiting[self]
        self._received += size
        return True

    def _on_parsed(self, size: int, request: object) -> None:
        if request is not self._request_seen:  # a request head was completed
            self._request_seen = request
            self._body_since = self._dog.clock.now()
            self._body_base = self._received - size

    def _on_response_complete(self) -> None:
        self._idle_since = self._dog.clock.now()

    def _on_idle(self) -> None:
        self._wait()  # waiting for the next request

    def _on_shutdown(self) -> bool:
        """uvicorn's shutdown has begun: it has stopped accepting connections, and now
        closes each idle one and lets each busy one finish its request. Readiness goes
        false here, and an idle keep-alive connection stays open while other requests still
        run, so a request on it (a load balancer's readiness check on its pooled
        connection) is answered, with `Connection: close`, rather than refused."""
        self._policy.drain()
        self._dog.drain()
        if self._closing:  # already answered: its lingering ends now
            self._uv_transport().close()
            return False
        if self._uv_idle() and self._uv_requests_running():
            self._draining = True
            self._unwait()  # not to be evicted: it is on its way out
            self._uv_wrap_app(_closing)
            return False
        return True

    # -- bookkeeping
    def _wait(self) -> None:
        if self._admitted and not self._waiting and not self._draining:
            self._waiting = True
            self._dog.waiting[self] = None

    def _unwait(self) -> None:
        if self._waiting:
            self._waiting = False
            del self._dog.waiting[self]

    def _leave(self) -> None:
        """No longer counted against the cap (closed, or about to be)."""
        self._unwait()
        if self._admitted:
            self._admitted = False
            self._dog.admitted -= 1

    def evict(self) -> None:
        """Closed to make room for a new connection (see `_Watchdog.make_room`)."""
        self._leave()
        self._closing = True
        self._uv_transport().close()

    # -- the deadlines, checked by the watchdog
    def check(self, now: float) -> None:
        if not self._uv_served():  # handed over to a WebSocket protocol
            self._dog.members.discard(self)
            self._leave()
            return
        if self._closing:
            if now >= self._linger_until:
                self._uv_transport().close()
            return
        request = self._uv_request()
        if request is not self._request_seen:  # a pipelined request started
            self._request_seen = request
            self._body_since, self._body_base = now, self._received
        if self._uv_idle():
            if self._draining and not self._uv_requests_running():
                self._uv_transport().close()
            elif now - self._idle_since >= self._policy.header_timeout_s:
                self._time_out(None, "the request head")
        elif self._uv_reading_body():
            p = self._policy
            allowed = p.body_timeout_s
            if p.body_min_rate_bytes_s:
                allowed += (self._received - self._body_base) / p.body_min_rate_bytes_s
            if now - self._body_since >= allowed:
                self._time_out(self._uv_request_scope(), "the request body")

    def _time_out(self, scope: Scope | None, what: str) -> None:
        """Answer 408 and close: the head did not arrive in time (`scope` None), or the
        body of the request with `scope` did not."""
        self._policy.count("request_timeout")
        state = scope.get("state", {}) if scope is not None else {}
        rid = state.get("request_id") or os.urandom(16).hex()
        peer = self._uv_client()
        client = f"{peer[0]}:{peer[1]}" if peer else "-"
        if scope is None:
            detail = f"{what} did not arrive within {self._policy.header_timeout_s:g} s"
            where = ""
        else:
            rate = self._policy.body_min_rate_bytes_s
            detail = (
                f"{what} did not arrive in time (within {self._policy.body_timeout_s:g} "
                f"s, and then at {rate} bytes/s or more)"
            )
            where = f' "{loggable(scope["method"])} {loggable(scope["path"])}"'
            # The app is waiting for the body: it sees a disconnect, and the middleware,
            # finding this mark, counts a 408 rather than a client that went away.
            state[TIMED_OUT] = True
            self._uv_abandon_request()  # nothing more from the app reaches the socket
        log.info("%s %s%s request timeout: %s; answered 408", rid, loggable(client), where, detail)
        self._finish(_timeout_response(rid, detail, self._uv_default_headers()))

    def _finish(self, response: bytes) -> None:
        """Send `response` and close: half-close and linger, so it is read, not reset."""
        self._leave()
        transport = self._uv_transport()
        transport.write(response)
        self._closing = True
        dog = self._dog
        if not transport.can_write_eof() or dog.lingering >= LINGER_MAX:
            transport.close()
            return
        transport.write_eof()
        self._linger_until = self._dog.clock.now() + LINGER_S
        dog.lingering += 1


class HttpToolsGuard(_Guard, HttpToolsProtocol):
    """uvicorn's httptools protocol, with the limits."""


class H11Guard(_Guard, H11Protocol):
    """uvicorn's h11 protocol, with the limits."""


def _auto() -> type[asyncio.Protocol]:
    # As uvicorn's "auto": httptools when it is installed.
    try:
        import httptools  # noqa: F401
    except ImportError:  # pragma: no cover
        return H11Guard
    return HttpToolsGuard


GradserveProtocol: type[asyncio.Protocol] = _auto()
