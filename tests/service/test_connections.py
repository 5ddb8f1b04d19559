"""Connection hardening: head and body deadlines, the connection cap, client disconnects,
log lines a client cannot forge, HEAD on the health routes, and the graceful shutdown.

The first tests run in process (the middleware on ASGI; uvicorn in a thread, with each of
the two protocol classes); those marked `integration` drive a real `gradserve serve`
process. Every loop is bounded in count and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from gradserve.service import protocol
from gradserve.service.app import create_app
from gradserve.service.clock import SYSTEM_CLOCK, Clock, ManualClock
from gradserve.service.middleware import TIMED_OUT, loggable
from gradserve.service.protocol import GradserveProtocol, H11Guard, HttpToolsGuard
from gradserve.service.settings import Settings
from tests.support.server import Server, start_server, stop_server

PROBLEM = "application/problem+json"


# ----------------------------------------------------------------------------- helpers
def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends until it closes the connection (or `seconds` pass)."""
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:  # a reset after the answer: what was read stands
            break
        if not chunk:
            break
        data += chunk
    return data


# A request head that never ends, and a body that never ends (JSON allows the spaces).
TRICKLED_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
TRICKLED_BODY = b" " * 1000


def _trickle(
    socks: list[socket.socket], payloads: list[bytes], seconds: float, every: float = 0.2
) -> list[bytes]:
    """Send one byte of its payload a tick on each socket until the server answers (or
    `seconds` pass); return each socket's answer."""
    answers = [b""] * len(socks)
    done = [False] * len(socks)
    deadline = time.monotonic() + seconds
    for tick in range(int(seconds / every) + 1):
        if all(done) or time.monotonic() >= deadline:
            break
        for i, s in enumerate(socks):
            if not done[i]:
                try:
                    s.send(payloads[i][tick : tick + 1])
                except OSError:
                    done[i] = True
        waiting = [s for i, s in enumerate(socks) if not done[i]]
        for s in _readable(waiting, every):
            i = socks.index(s)
            answers[i] = _read_all(s, 2)
            done[i] = True
    return answers


def _readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets with something to read, waiting up to `timeout` for one (poll: a test
    process may hold descriptors past select's 1,024 by the time this runs)."""
    if not socks:
        return []
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(timeout * 1000)]


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _problem_type(response: bytes) -> str:
    match = re.search(rb'"type":"urn:gradserve:problem:([a-z-]+)"', response)
    return match.group(1).decode() if match else ""


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


SLOW_HEAD = b"POST /forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
SLOW_BODY = SLOW_HEAD + b"Content-Length: 100000\r\n\r\n{"


# ----------------------------------------------------------------------------- log lines
@pytest.mark.parametrize(
    ("raw", "logged"),
    [
        ("/healthz", "/healthz"),
        ("/ops/é", "/ops/é"),
        ("/x\r\nERROR: forged\x1b[31m", "/x\\x0d\\x0aERROR: forged\\x1b[31m"),
        ("/a\\x1b", "/a\\\\x1b"),  # a backslash typed by the client cannot pass as an escape
        ('/"GET / HTTP/1.1" 200', "/\\x22GET / HTTP/1.1\\x22 200"),
        ("/\x7f\x85\u202e\u2028\U000e0001", "/\\x7f\\x85\\u202e\\u2028\\U000e0001"),
    ],
)
def test_loggable_escapes_what_could_forge_a_line(raw: str, logged: str) -> None:
    assert loggable(raw) == logged


# ----------------------------------------------------------------------------- middleware
def _http_scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers or [],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


async def _call(app: FastAPI, scope: dict, receive: Any) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_client_that_leaves_mid_upload_is_499_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = create_app(Settings())
    messages = iter(
        [
            {"type": "http.request", "body": b'{"graph"', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict:
        return next(messages)

    scope = _http_scope("POST", "/forward", [(b"x-request-id", b"left-early")])
    with caplog.at_level(logging.INFO):
        sent = asyncio.run(_call(app, scope, receive))
    assert sent == []  # nothing is sent to a client that is gone
    metrics = app.state.metrics.render().decode()
    assert 'gradserve_requests_total{method="POST",route="/forward",status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    lines = [r.getMessage() for r in caplog.records if r.name == "gradserve.access"]
    assert lines == [lines[0]] and lines[0].startswith("left-early ") and '" 499 ' in lines[0]


def test_a_request_timed_out_by_the_protocol_counts_as_408() -> None:
    app = create_app(Settings())
    scope = _http_scope("POST", "/forward")

    async def receive() -> dict:
        scope["state"][TIMED_OUT] = True  # what the protocol does, then disconnects
        return {"type": "http.disconnect"}

    assert asyncio.run(_call(app, scope, receive)) == []
    metrics = app.state.metrics.render().decode()
    assert 'gradserve_requests_total{method="POST",route="/forward",status="408"} 1.0' in metrics


def test_a_request_cancelled_at_shutdown_gets_503_cancelled() -> None:
    # uvicorn cancels the request tasks still running when the graceful shutdown runs out.
    app = create_app(Settings())

    async def run() -> list[dict]:
        sent: list[dict] = []
        waiting = asyncio.Event()

        async def receive() -> dict:
            waiting.set()
            await asyncio.Event().wait()  # the body never comes
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            sent.append(message)

        task = asyncio.create_task(app(_http_scope("POST", "/forward"), receive, send))
        await asyncio.wait_for(waiting.wait(), 5)
        task.cancel()
        await asyncio.wait_for(task, 5)  # ends normally: the 503 was the answer
        return sent

    start, body = asyncio.run(run())
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"content-type"] == PROBLEM.encode() and headers[b"retry-after"] == b"1"
    assert b'"type":"urn:gradserve:problem:cancelled"' in body["body"]


def test_head_on_the_health_routes_answers_as_get() -> None:
    app = create_app(Settings())

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    for path, status in [("/healthz", 200), ("/readyz", 503)]:  # the lifespan has not run
        get = asyncio.run(_call(app, _http_scope("GET", path), receive))
        head = asyncio.run(_call(app, _http_scope("HEAD", path), receive))
        assert get[0]["status"] == head[0]["status"] == status

        def same(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
            return {k: v for k, v in headers if k != b"x-request-id"}

        assert same(get[0]["headers"]) == same(head[0]["headers"])
    metrics = app.state.metrics.render().decode()
    assert 'gradserve_response_bytes_total{route="/healthz"} 15.0' in metrics  # GET's body only


# ----------------------------------------------------------------------------- open files
def test_the_open_file_limit_is_raised_to_what_the_cap_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = {"now": (256, 100_000)}
    monkeypatch.setattr(protocol, "_open_fds", lambda: 20)
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    assert protocol.fit_open_file_limit(512, slots=8) == 512
    overhead = (
        20
        + protocol.FD_MARGIN
        + 8 * protocol.FDS_PER_SLOT
        + protocol.PROBE_RESERVE
        + protocol.LINGER_MAX
    )
    assert limits["now"] == (512 + overhead, 100_000)


def test_a_cap_over_the_open_file_limit_is_lowered_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(protocol, "_open_fds", lambda: 20)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (256, 300))

    def refuse(*_: Any) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", lambda _, value: None)
    overhead = 20 + protocol.FD_MARGIN + protocol.PROBE_RESERVE + protocol.LINGER_MAX
    with caplog.at_level(logging.WARNING, logger="gradserve.connections"):
        assert protocol.fit_open_file_limit(512) == 300 - overhead  # raised to the hard limit
        monkeypatch.setattr(resource, "setrlimit", refuse)
        assert protocol.fit_open_file_limit(512) == 256 - overhead  # could not be raised
    text = caplog.text
    assert "GRADSERVE_MAX_CONNECTIONS=512 does not fit" in text
    assert f"serving at most {300 - overhead} connections" in text
    assert "could not raise the open-file limit" in text


# ----------------------------------------------------------------------------- in process
def test_uvicorn_takes_the_protocol_class() -> None:
    config = uvicorn.Config(create_app(Settings()), http=GradserveProtocol)
    config.load()
    assert config.http_protocol_class is GradserveProtocol is HttpToolsGuard


def _until_watched(clock: ManualClock, n: int) -> None:
    """Until the watchdog of the server on `clock` holds `n` connections (each accepted, its
    deadlines set on the clock), waiting at most 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        dogs = [d for d in list(protocol._watchdogs.values()) if d.clock is clock]
        if dogs and len(dogs[0].members) == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server never held {n} connections")


def _until_heads_parsed(clock: ManualClock, n: int) -> None:
    """Until `n` connections of the server on `clock` have a request head parsed (their
    body deadline set, on the clock as it is now), waiting at most 10 s: a loaded machine
    may parse a head only after the test has moved the clock on, and set it later."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        dogs = [d for d in list(protocol._watchdogs.values()) if d.clock is clock]
        if dogs and sum(m._request_seen is not None for m in list(dogs[0].members)) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server never parsed {n} request heads")


@contextmanager
def _serve_in_thread(
    http: type, clock: Clock = SYSTEM_CLOCK, **settings: Any
) -> Iterator[tuple[int, FastAPI]]:
    """A uvicorn server with `http` as its protocol, in a thread of this process, its time
    on `clock`."""
    app = create_app(Settings(**settings), clock)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=http,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("http", [HttpToolsGuard, H11Guard])
def test_idle_and_slow_connections_are_answered_408_and_closed(http: type) -> None:
    """On the server's clock (a `ManualClock`): idle connections, heads and bodies sent a
    byte at a time, all past their 0.5 s deadlines when the watchdog looks, at its 1 s
    tick, are answered 408 and closed; none was before it looked."""
    clock = ManualClock()
    with _serve_in_thread(http, clock, header_timeout_s=0.5, body_timeout_s=0.5) as (port, _):
        idle = [_connect(port) for _ in range(5)]
        head = [_connect(port) for _ in range(3)]
        body = [_connect(port) for _ in range(3)]
        for s in body:
            s.sendall(SLOW_BODY)
        trickled = head + body
        payloads = [TRICKLED_HEAD] * 3 + [TRICKLED_BODY] * 3
        _until_watched(clock, 11)
        _until_heads_parsed(clock, 3)
        for tick in range(4):  # a byte each 0.2 s: still sending, for 0.8 s
            for s, payload in zip(trickled, payloads, strict=True):
                s.sendall(payload[tick : tick + 1])
            clock.advance(0.2)
        assert _readable(idle + trickled, 0.2) == [], "answered before the watchdog looked"
        clock.advance(0.2)  # the tick: every deadline is past
        answers = [_read_all(s, 5) for s in idle + trickled]
        for s in idle + trickled:
            s.close()
        for answer in answers:
            assert _status(answer) == 408 and _problem_type(answer) == "request-timeout", answer
            assert b"content-type: application/problem+json" in answer
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert client.get("/healthz").status_code == 200
            metrics = client.get("/metrics").text
        assert _metric(metrics, 'gradserve_rejections_total{reason="request_timeout"}') == 11
        assert (
            _metric(
                metrics, 'gradserve_requests_total{method="POST",route="/forward",status="408"}'
            )
            == 3
        )


# A request head begun and not finished: a busy connection, until the head deadline.
BEGUN = b"GET /healthz HTTP/1.1\r\n"


@pytest.mark.parametrize("http", [HttpToolsGuard, H11Guard])
def test_past_the_cap_only_probes_are_served_then_everything_is_refused(http: type) -> None:
    with _serve_in_thread(http, max_connections=4) as (port, _):
        base = f"http://127.0.0.1:{port}"
        held = [_connect(port) for _ in range(4)]  # the cap, busy
        for s in held:
            s.sendall(BEGUN)
        time.sleep(0.1)
        # The probe reserve: a probe is served (and its connection closed after it), and
        # anything else is refused.
        r = httpx.get(base + "/healthz", timeout=5)
        assert r.status_code == 200 and r.headers["connection"] == "close"
        assert httpx.head(base + "/readyz", timeout=5).status_code == 200
        busy = httpx.post(base + "/forward", json={}, timeout=5)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["type"] == "urn:gradserve:problem:overloaded"
        reserve = [_connect(port) for _ in range(protocol.PROBE_RESERVE)]
        for s in reserve:
            s.sendall(BEGUN)
        held += reserve
        time.sleep(0.1)
        with _connect(port) as s:  # refused as it opens: the answer comes unasked
            refused = _read_all(s, 5)
        assert _status(refused) == 503 and _problem_type(refused) == "overloaded"
        assert b"retry-after: 1" in refused and b"connection: close" in refused
        r = httpx.get(base + "/healthz", timeout=5)  # an HTTP client reads it too
        assert r.status_code == 503
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the server has seen the closes
            metrics = httpx.get(base + "/metrics", timeout=5)
            if metrics.status_code == 200:
                break
            time.sleep(0.05)
        assert metrics.status_code == 200
        assert _metric(metrics.text, 'gradserve_rejections_total{reason="connections"}') == 3


@pytest.mark.parametrize("http", [HttpToolsGuard, H11Guard])
def test_at_the_cap_the_longest_idle_connection_makes_room(http: type) -> None:
    with _serve_in_thread(http, max_connections=4) as (port, _):
        idle = []
        for _ in range(4):  # the cap, each waiting for a request that never comes
            idle.append(_connect(port))
            time.sleep(0.02)
        time.sleep(protocol.EVICT_AFTER_S + 0.1)  # long enough to be closed for a newcomer
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert r.status_code == 200 and "connection" not in r.headers  # a regular connection
        assert _read_all(idle[0], 2) == b""  # the oldest was closed, without an answer
        for s in idle[1:]:
            s.settimeout(0.05)
            with pytest.raises(TimeoutError):  # the others are still open
                s.recv(1)
        for s in idle:
            s.close()


# ----------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Room for every connection and a compute slot for every slow upload (a slot is taken
    # before the body is read), so that each is refused for being slow and nothing else.
    s = start_server(
        tmp_path_factory.mktemp("connections"),
        GRADSERVE_HEADER_TIMEOUT_S="1",
        GRADSERVE_BODY_TIMEOUT_S="1",
        GRADSERVE_MAX_CONNECTIONS="1024",
        GRADSERVE_MAX_CONCURRENCY="32",
    )
    yield s
    stop_server(s)


def _log_has(server: Server, text: str, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if text in server.log_text():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.integration
@pytest.mark.timing
def test_30_slow_senders_and_500_idle_connections_are_closed(server: Server) -> None:
    before = httpx.get(server.base + "/metrics", timeout=10).text
    t0 = time.monotonic()
    idle = [_connect(server.port) for _ in range(500)]
    head = [_connect(server.port) for _ in range(15)]  # a byte of head at a time
    body = [_connect(server.port) for _ in range(15)]  # a byte of body at a time
    for s in body:
        s.sendall(SLOW_BODY)
    answers = _trickle(head + body, [TRICKLED_HEAD] * 15 + [TRICKLED_BODY] * 15, seconds=8)
    answers += [_read_all(s, 5) for s in idle]
    elapsed = time.monotonic() - t0
    for s in idle + head + body:
        s.close()
    others = [a[:400] for a in answers if _status(a) != 408]
    assert not others, others[:3]
    assert elapsed < 6, elapsed
    metrics = httpx.get(server.base + "/metrics", timeout=10).text
    key = 'gradserve_rejections_total{reason="request_timeout"}'
    assert _metric(metrics, key) - _metric(before, key) == 530
    assert "Traceback" not in server.log_text()


@pytest.mark.integration
def test_20_uploads_cut_mid_body_are_499_not_500(server: Server) -> None:
    key = 'gradserve_requests_total{method="POST",route="/forward",status="499"}'
    before = _metric(httpx.get(server.base + "/metrics", timeout=10).text, key)
    for i in range(20):
        with _connect(server.port) as s:
            s.sendall(
                SLOW_HEAD
                + f"X-Request-ID: cut-{i}\r\nContent-Length: 100000\r\n\r\n".encode()
                + b'{"graph": '
                + b" " * 5000
            )
            time.sleep(0.01)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        metrics = httpx.get(server.base + "/metrics", timeout=10).text
        if _metric(metrics, key) - before >= 20:
            break
        time.sleep(0.05)
    assert _metric(metrics, key) - before == 20
    assert 'status="500"' not in metrics
    assert _log_has(server, "cut-19 ")
    log = server.log_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert all(
        re.search(rf'cut-{i} 127\.0\.0\.1:\d+ "POST /forward HTTP/1.1" 499 ', log)
        for i in range(20)
    )


@pytest.mark.integration
def test_a_client_cannot_forge_log_lines(server: Server) -> None:
    with _connect(server.port) as s:
        s.sendall(
            b"GET /x%0d%0aERROR:%20forged%1b%5b31m HTTP/1.1\r\nHost: x\r\n"
            b"X-Request-ID: forge-1\r\nConnection: close\r\n\r\n"
        )
        assert _status(_read_all(s, 5)) == 404
    # The client address, which uvicorn takes from X-Forwarded-For when the peer is a
    # trusted proxy (127.0.0.1 by default); the parser lets C1 bytes through (CSI, NEL).
    with _connect(server.port) as s:
        s.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-ID: forge-2\r\n"
            b"X-Forwarded-For: 10.0.0.1\x9b2J\x85x\r\nConnection: close\r\n\r\n"
        )
        assert _status(_read_all(s, 5)) == 200
    assert _log_has(server, "forge-2")
    log = server.log_text()
    assert '"GET /x\\x0d\\x0aERROR: forged\\x1b[31m HTTP/1.1" 404' in log
    assert "forge-2 10.0.0.1\\x9b2J\\x85x:0 " in log
    assert not {"\x1b", "\r", "\x9b", "\x85"} & set(log)
    assert not [line for line in log.splitlines() if line.startswith("ERROR: forged")]


@pytest.mark.integration
def test_head_on_the_health_routes_over_http(server: Server) -> None:
    with httpx.Client(base_url=server.base, timeout=10) as client:  # one connection
        for path in ["/healthz", "/readyz"]:
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code == 200
            assert head.content == b""
            for name in ["content-type", "content-length"]:
                assert head.headers[name] == get.headers[name]
        assert client.get("/healthz").json() == {"status": "ok"}  # no stray body before it


@pytest.mark.integration
def test_a_low_open_file_limit_lowers_the_cap(tmp_path: Path) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    s = start_server(tmp_path, preexec_fn=low_limit)
    try:
        assert _log_has(s, "GRADSERVE_MAX_CONNECTIONS=512 does not fit under the open-file")
        assert httpx.get(s.base + "/healthz", timeout=10).status_code == 200
    finally:
        stop_server(s)


def _long_graph(matmuls: int) -> dict[str, Any]:
    # A no_grad chain of 1000x1000 matmuls: seconds of BLAS work in a worker thread.
    nodes = [{"id": "a", "op": "full", "attrs": {"shape": [1000, 1000], "value": 0.001}}]
    nodes += [
        {"id": f"m{i}", "op": "matmul", "args": [f"m{i - 1}" if i else "a", "a"]}
        for i in range(matmuls)
    ]
    return {"graph": {"nodes": nodes, "outputs": [f"m{matmuls - 1}"]}, "no_grad": True}


@pytest.mark.integration
@pytest.mark.timing
def test_sigterm_drains_readiness_and_cuts_off_with_503(tmp_path: Path) -> None:
    s = start_server(tmp_path, GRADSERVE_GRACEFUL_SHUTDOWN_S="1", GRADSERVE_COMPUTE_BUDGET="1e15")
    result: dict[str, httpx.Response | BaseException] = {}

    def slow() -> None:
        try:
            result["slow"] = httpx.post(s.base + "/forward", json=_long_graph(400), timeout=60)
        except BaseException as exc:
            result["slow"] = exc

    try:
        with httpx.Client(base_url=s.base, timeout=10) as pooled:  # a kept-alive connection
            assert pooled.get("/readyz").status_code == 200
            thread = threading.Thread(target=slow)
            thread.start()
            for _ in range(200):  # until the computation is admitted and running
                if "gradserve_computations_in_flight 1.0" in pooled.get("/metrics").text:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the long computation never started")
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert _log_has(s, "Shutting down")
            # Readiness is false at once; the pooled connection is answered, then closed.
            ready = pooled.get("/readyz")
            assert ready.status_code == 503 and ready.headers["connection"] == "close"
            assert ready.json()["type"] == "urn:gradserve:problem:not-ready"
            thread.join(30)
        cut = result["slow"]
        assert isinstance(cut, httpx.Response), cut
        assert time.monotonic() - t0 < 10  # cut off at the grace, not run to its end
        assert cut.status_code == 503 and cut.headers["content-type"] == PROBLEM, cut.text
        assert cut.json()["type"] == "urn:gradserve:problem:cancelled"
        assert s.proc.wait(timeout=20) in (0, -signal.SIGTERM)
        log = s.log_text()
        assert "Traceback" not in log and "Finished server process" in log
        assert '"POST /forward HTTP/1.1" 503 ' in log
    finally:
        stop_server(s)
