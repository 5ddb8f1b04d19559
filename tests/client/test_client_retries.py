"""The client's retries (client/http.py, `Retry`) against real servers on loopback: a
refused connection until a server starts on the port, a server killed mid-request and
started again on the same port, 503 with Retry-After from a busy server, and what is not
retried (4xx, 500, 504, a read timeout), the 409 resend, the attempt limit and the
deadline. Attempts pass through a tap transport that records each one's outcome (a status,
or the transport error's name) and can answer some itself.

Every loop and wait here is bounded in count and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gradserve.client.http import (
    GRAPH_UNKNOWN,
    RETRY_ERRORS,
    AsyncClient,
    Client,
    Clock,
    GradserveHTTPError,
    Retry,
)
from gradserve.client.transport import Http11Transport
from tests.support.server import ROOT, Server, free_port, stop_server

pytestmark = pytest.mark.integration

SEED = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
Scripted = tuple[int, dict[str, str], str]  # an answer of a tap's: status, headers, type
DROPPED = {e.__name__ for e in RETRY_ERRORS}
# Quick retries for tests: many attempts, short waits, each call bounded by its deadline.
QUICK = Retry(attempts=200, deadline=30.0, backoff=0.02, max_backoff=0.2)


def _long(n: int, size: int = 2048) -> dict[str, Any]:
    """A graph that computes for seconds (a chain of `n` size x size float64 matmuls)
    and answers a scalar: the sum of the last product, 0.001 * 2.048**n * size**2 for
    size 2048."""
    full = f"full(shape=[{size}, {size}], value=0.001, dtype='float64')"
    nodes: list[dict[str, Any]] = [{"id": "a", "expr": full}]
    nodes += [
        {"id": f"m{i}", "op": "matmul", "args": [f"m{i - 1}" if i else "a", "a"]} for i in range(n)
    ]
    nodes.append({"id": "s", "expr": f"sum(m{n - 1})"})
    return {"nodes": nodes, "outputs": ["s"]}


def _long_value(n: int, size: int = 2048) -> float:
    return 0.001 * (0.001 * size) ** n * size**2


# A body large enough to compute in a worker process (an unused input).
PAD = {"pad": np.zeros(100_000, np.float32)}


# ------------------------------------------------------------------ servers on a given port
def _launch(tmp: Path, port: int, **env: str) -> Server:
    """`gradserve serve` on `port`, in a session of its own (so that it can be killed with
    its workers, as a container is); not waited for."""
    log = tmp / f"server-{port}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(port)],
            cwd=ROOT,
            env={
                **os.environ,
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                **env,
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", port, proc, log)


def _ready(server: Server, within: float = 60.0) -> Server:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{server.log_text()}")
        try:
            if httpx.get(server.base + "/readyz", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"server did not become ready:\n{server.log_text()}")


def _kill(server: Server) -> None:
    """SIGKILL to the server and every process of its session (its workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)


def _end(server: Server) -> None:
    if server.proc.poll() is None:
        stop_server(server)
    _kill(server)  # (whatever of its session is left)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    """Servers a test starts (append them): each stopped, its session killed, at the end."""
    started: list[Server] = []
    yield started
    for s in started:
        _end(s)


# ------------------------------------------------------------------ a tap on each attempt
class _Tapping:
    """Each attempt's outcome (a status, or a transport error's class name) and start
    time; `script`: answers to give instead of the server's, in order ((status, headers,
    problem type) each); `sent`: set when a request goes to the server."""

    def __init__(self, script: list[Scripted] | None = None) -> None:
        self.outcomes: list[int | str] = []
        self.times: list[float] = []
        self.bodies: list[bytes] = []
        self.script = list(script or [])
        self.sent = threading.Event()

    def _scripted(self, request: httpx.Request, body: bytes) -> httpx.Response | None:
        self.times.append(time.monotonic())
        self.bodies.append(body)
        if not self.script:
            return None
        status, headers, slug = self.script.pop(0)
        self.outcomes.append(status)
        return httpx.Response(
            status,
            headers=headers,
            request=request,
            json={"type": slug, "title": "scripted", "status": status, "detail": "scripted"},
        )

    def _forwarded(self, request: httpx.Request, body: bytes) -> None:
        request.stream = httpx.ByteStream(body)
        self.sent.set()


class Tap(_Tapping, httpx.BaseTransport):
    def __init__(self, script: list[Scripted] | None = None) -> None:
        super().__init__(script)
        self.inner = Http11Transport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        answer = self._scripted(request, body)
        if answer is not None:
            return answer
        self._forwarded(request, body)
        try:
            response = self.inner.handle_request(request)
            response.read()
        except httpx.TransportError as exc:
            self.outcomes.append(type(exc).__name__)
            raise
        self.outcomes.append(response.status_code)
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncTap(_Tapping, httpx.AsyncBaseTransport):
    def __init__(self, script: list[Scripted] | None = None) -> None:
        super().__init__(script)
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        answer = self._scripted(request, body)
        if answer is not None:
            return answer
        self._forwarded(request, body)
        try:
            response = await self.inner.handle_async_request(request)
            await response.aread()
        except httpx.TransportError as exc:
            self.outcomes.append(type(exc).__name__)
            raise
        self.outcomes.append(response.status_code)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _busy(retry_after: str | None = "0") -> Scripted:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return 503, headers, "urn:gradserve:problem:overloaded"


@pytest.fixture(scope="module")
def script_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server for the scripted tests: it answers once a tap's script has run out."""
    s = _ready(_launch(tmp_path_factory.mktemp("scripted"), free_port()))
    yield s
    _end(s)


def _scripted(
    server: Server, script: list[Scripted], retry: Retry | int, clock: Clock | None = None
) -> tuple[Client, Tap]:
    """A client whose tap answers `script` first, and then lets `server` answer (its retries
    on `clock`, when given)."""
    tap = Tap(script)
    if clock is not None:
        assert isinstance(retry, Retry)
        retry = dataclasses.replace(retry, clock=clock)
    return Client(server.base, transport=tap, retries=retry), tap


class FakeClock(Clock):
    """Time that passes only when the client waits: each wait is recorded, and added at
    once. A schedule of retries is then checked as events, without being waited out."""

    def __init__(self) -> None:
        self.t = 0.0
        self.waits: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.t += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


# ------------------------------------------------------------------ the policy itself
def test_the_policy_backs_off_with_full_jitter_and_honours_retry_after() -> None:
    fixed = Retry(backoff=0.1, max_backoff=1.0, rand=lambda: 0.5)
    assert [fixed.delay(n) for n in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert fixed.delay(0, retry_after=1.0) == 1.05  # at least Retry-After
    top = Retry(backoff=0.1, max_backoff=1.0, rand=lambda: 0.999)
    assert top.delay(10) < 1.0 and Retry(rand=lambda: 0.0).delay(5) == 0.0
    spread = {Retry().delay(2) for _ in range(50)}  # random.random: spread, within the cap
    assert len(spread) > 40 and all(0 <= d < 0.4 for d in spread)
    assert Retry().attempts == 3 and Retry().deadline is None  # (None: the client's timeout)
    with pytest.raises(ValueError):
        Retry(attempts=0)
    with pytest.raises(ValueError):
        Retry(deadline=0)
    with (
        Client("http://127.0.0.1:9") as gs,
        Client("http://127.0.0.1:9", retries=0) as off,
        Client("http://127.0.0.1:9", retries=4) as four,
    ):
        assert gs.retry == Retry() and off.retry.attempts == 1 and four.retry.attempts == 5
    with pytest.raises(TypeError):
        Client("http://127.0.0.1:9", retries=True)


def test_retry_after_as_seconds_or_a_date(script_server: Server) -> None:
    clock = FakeClock()
    at = math.ceil(time.time()) + 3  # whole seconds, as an HTTP date writes them
    date = email.utils.formatdate(at, usegmt=True)
    gs, tap = _scripted(
        script_server,
        [_busy("0.4"), _busy(date), _busy("soon"), _busy(None)],
        Retry(attempts=5, deadline=10, backoff=0.01, max_backoff=0.01, rand=lambda: 0.5),
        clock,
    )
    with gs:
        assert gs.forward(SEED, {"x": 2.0, "y": 3.0}).outputs["z"].item() == -5.0
    assert tap.outcomes == [503] * 4 + [200]
    jitter = 0.005  # 0.5 * min(0.01, 0.01 * 2**n)
    assert clock.waits[0] == pytest.approx(0.4 + jitter)  # Retry-After: 0.4
    # an HTTP date 3 to 4 s on when it was written, read after a little real time
    assert 2.0 <= clock.waits[1] - jitter <= 4.0
    assert clock.waits[2:] == [jitter, jitter]  # unreadable, or none: the backoff alone


# ------------------------------------------------------------------ what is retried
@pytest.mark.timing
def test_a_refused_connection_is_retried_until_a_server_starts(
    tmp_path: Path, servers: list[Server]
) -> None:
    port = free_port()  # nothing listens on it yet
    tap = Tap()
    with (
        Client(f"http://127.0.0.1:{port}", transport=tap, retries=QUICK) as gs,
        ThreadPoolExecutor(1) as pool,
    ):
        t0 = time.monotonic()
        call = pool.submit(gs.backward, SEED, {"x": 2.0, "y": 3.0})
        time.sleep(0.5)
        assert not call.done()  # still retrying
        servers.append(_launch(tmp_path, port))
        r = call.result(timeout=40)
        elapsed = time.monotonic() - t0
    assert r.outputs["z"].item() == -5.0 and r.gradients is not None
    assert r.gradients["x"].item() == 4.0
    assert tap.outcomes[-1] == 200 and len(tap.outcomes) >= 3
    assert set(tap.outcomes[:-1]) == {"ConnectError"}
    assert elapsed < QUICK.deadline  # type: ignore[operator]
    assert len({*tap.bodies}) == 1  # the same request each time


@pytest.mark.timing
def test_a_server_killed_mid_request_is_retried_on_its_successor(
    tmp_path: Path, servers: list[Server]
) -> None:
    """SIGKILL to a server (and its workers) while a request computes; another is
    started on the same port: the call succeeds there, within its deadline."""
    n = 6
    port = free_port()
    first = _ready(_launch(tmp_path, port, GRADSERVE_REQUEST_TIMEOUT_S="60"))
    servers.append(first)
    retry = Retry(attempts=200, deadline=60.0, backoff=0.02, max_backoff=0.2)
    tap = Tap()
    with Client(first.base, transport=tap, retries=retry) as gs, ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        call = pool.submit(gs.forward, _long(n), PAD, no_grad=True)
        assert tap.sent.wait(10)
        time.sleep(0.7)  # computing by now (seconds of it)
        assert not call.done()
        _kill(first)
        killed = time.monotonic()
        servers.append(_launch(tmp_path, port, GRADSERVE_REQUEST_TIMEOUT_S="60"))
        r = call.result(timeout=70)
        elapsed = time.monotonic() - t0
    assert tap.outcomes[0] in DROPPED, tap.outcomes  # the connection dropped mid-request
    assert tap.times[0] < killed and tap.outcomes[-1] == 200
    assert set(tap.outcomes[1:-1]) <= {"ConnectError"}  # then refused until the successor
    assert np.isclose(r.outputs["s"].item(), _long_value(n))
    assert elapsed < retry.deadline  # type: ignore[operator]
    assert len({*tap.bodies}) == 1


def test_503_waits_for_retry_after_and_504_is_not_retried(
    servers: list[Server], tmp_path: Path
) -> None:
    """One compute slot, taken by a request that runs past the 2 s time limit, and no
    queue for it: another request that needs a slot (too large for the front process's
    fast lane) gets 503 (Retry-After: 1) and is retried after a second or more until the
    slot is free; the long one gets 504, once: the same work would time out again."""
    s = _ready(
        _launch(
            tmp_path,
            free_port(),
            GRADSERVE_MAX_CONCURRENCY="1",
            GRADSERVE_MAX_QUEUE_SIZE="0",
            GRADSERVE_REQUEST_TIMEOUT_S="2",
        )
    )
    servers.append(s)
    long_tap, tap = Tap(), Tap()
    retry = Retry(attempts=20, deadline=30.0, backoff=0.02, max_backoff=0.1)
    with (
        Client(s.base, transport=long_tap, retries=retry) as slow,
        Client(s.base, transport=tap, retries=retry) as gs,
        ThreadPoolExecutor(1) as pool,
    ):
        t0 = time.monotonic()
        call = pool.submit(slow.forward, _long(40), PAD, no_grad=True)
        assert long_tap.sent.wait(10)
        time.sleep(0.3)
        r = gs.backward(SEED, {"x": 2.0, "y": 3.0, **PAD})
        with pytest.raises(GradserveHTTPError) as info:
            call.result(timeout=30)
    assert info.value.status == 504 and long_tap.outcomes == [504]
    assert r.outputs["z"].item() == -5.0
    assert tap.outcomes[0] == 503 and tap.outcomes[-1] == 200, tap.outcomes
    assert set(tap.outcomes[:-1]) == {503}
    assert all(gap >= 1.0 for gap in np.diff(tap.times)), np.diff(tap.times)  # Retry-After: 1
    assert tap.times[-1] - t0 < 2.0 + 1.0 + 1.5  # soon after the slot came free


def test_a_502_is_retried_and_a_503_past_the_deadline_is_not_waited_for(
    script_server: Server,
) -> None:
    clock = FakeClock()
    gs, tap = _scripted(
        script_server,
        [(502, {}, "about:blank"), _busy("0")],
        Retry(attempts=3, backoff=0.01, rand=lambda: 0.5),
        clock,
    )
    with gs:
        assert gs.forward(SEED, {"x": 1.0, "y": 1.0}).outputs["z"].item() == 0.0
    assert tap.outcomes == [502, 503, 200]
    assert clock.waits == [0.005, 0.01]  # the backoff, then Retry-After 0 and the backoff

    clock = FakeClock()
    gs, tap = _scripted(script_server, [_busy("5")], Retry(attempts=5, deadline=1.0), clock)
    with gs, pytest.raises(GradserveHTTPError) as info:
        gs.forward(SEED, {"x": 1.0, "y": 1.0})
    assert info.value.status == 503 and tap.outcomes == [503]
    assert clock.waits == []  # given up at once: 5 s would pass the deadline


@pytest.mark.parametrize("status", [400, 401, 404, 405, 413, 415, 422, 500, 504])
def test_no_retry_on_4xx_500_or_504(script_server: Server, status: int) -> None:
    gs, tap = _scripted(
        script_server,
        [(status, {"Retry-After": "0"}, "urn:gradserve:problem:x")],
        Retry(attempts=5, backoff=0.01),
    )
    with gs, pytest.raises(GradserveHTTPError) as info:
        gs.forward(SEED, {"x": 1.0, "y": 1.0})
    assert info.value.status == status and tap.outcomes == [status]


def test_a_real_422_is_not_retried(script_server: Server) -> None:
    tap = Tap()
    with (
        Client(script_server.base, transport=tap, retries=QUICK) as gs,
        pytest.raises(GradserveHTTPError) as info,
    ):
        gs.forward(
            {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}], "outputs": ["z"]},
            {"a": np.ones((3, 4)), "b": np.ones((5, 2))},
        )
    assert info.value.status == 422 and tap.outcomes == [422]


def test_409_resends_the_graph_once_and_that_resend_is_retried(script_server: Server) -> None:
    graph_unknown: Scripted = (409, {}, GRAPH_UNKNOWN)
    cases: list[tuple[Retry | int, list[Scripted], list[int | str]]] = [
        (0, [graph_unknown], [409, 200]),
        (Retry(attempts=3, backoff=0.01), [graph_unknown, _busy("0")], [409, 503, 200]),
    ]
    for retry, script, outcomes in cases:
        gs, tap = _scripted(script_server, [], retry)
        with gs:
            graph = {"nodes": [{"id": "y", "expr": f"x * {len(script)}"}], "outputs": ["y"]}
            gs.forward(graph, {"x": 1.0})
            tap.script, tap.outcomes, tap.bodies = list(script), [], []
            assert gs.forward(graph, {"x": 2.0}).outputs["y"].item() == 2.0 * len(script)
        assert tap.outcomes == outcomes
        assert b'"graph_id"' in tap.bodies[0]
        assert all(b'"graph"' in b and b'"graph_id"' not in b for b in tap.bodies[1:])


# ------------------------------------------------------------------ limits
def test_the_attempt_limit_then_the_last_error() -> None:
    port = free_port()
    tap = Tap()
    with (
        Client(
            f"http://127.0.0.1:{port}",
            transport=tap,
            retries=Retry(attempts=3, deadline=10, backoff=0.01),
        ) as gs,
        pytest.raises(httpx.ConnectError) as info,
    ):
        gs.forward(SEED, {"x": 1.0, "y": 1.0})
    assert tap.outcomes == ["ConnectError"] * 3
    assert "gave up after 3 attempt(s)" in "".join(getattr(info.value, "__notes__", []))
    off = Tap()
    with (
        Client(f"http://127.0.0.1:{port}", transport=off, retries=0) as gs,
        pytest.raises(httpx.ConnectError),
    ):
        gs.ops()
    assert off.outcomes == ["ConnectError"]


def test_refused_connections_are_retried_on_the_backoff_until_the_deadline() -> None:
    """Refused connections: attempts on the backoff's schedule until the next would start
    past the deadline, then the last error, saying how many attempts were made."""
    clock = FakeClock()
    retry = Retry(attempts=10_000, deadline=1.0, backoff=0.02, max_backoff=0.1, rand=lambda: 0.75)
    tap = Tap()
    with (
        Client(
            f"http://127.0.0.1:{free_port()}",
            transport=tap,
            retries=dataclasses.replace(retry, clock=clock),
        ) as gs,
        pytest.raises(httpx.ConnectError) as info,
    ):
        gs.forward(SEED, {"x": 1.0, "y": 1.0})
    # 0.75 * min(0.1, 0.02 * 2**n): 0.015, 0.03, 0.06, then 0.075 while the sum stays
    # under 1 s (0.105 + 11 * 0.075 = 0.93; one more would end at 1.005)
    assert clock.waits == pytest.approx([0.015, 0.03, 0.06] + [0.075] * 11)
    assert tap.outcomes == ["ConnectError"] * 15
    assert "gave up after 15 attempt(s) in 0.93 s" in " ".join(info.value.__notes__)


@pytest.mark.timing
def test_the_deadline_cuts_an_attempt_in_flight() -> None:
    """A server that accepts and never answers: the attempt in flight is cut at the
    deadline (a read timeout, not retried). httpx's own timeout: real time."""
    retry = Retry(attempts=10_000, deadline=1.0, backoff=0.02, max_backoff=0.1)
    with socket.socket() as mute:  # listens, never accepts: connects, and no answer comes
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        tap = Tap()
        t0 = time.monotonic()
        with (
            Client(f"http://127.0.0.1:{mute.getsockname()[1]}", transport=tap, retries=retry) as gs,
            pytest.raises(httpx.ReadTimeout),
        ):
            gs.forward(SEED, {"x": 1.0, "y": 1.0})
        elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 1.0 + 0.3, elapsed
    assert tap.outcomes == ["ReadTimeout"]


# ------------------------------------------------------------------ the async client
@pytest.mark.timing
def test_async_retries(tmp_path: Path, servers: list[Server]) -> None:
    port = free_port()

    async def run() -> None:
        tap = AsyncTap()
        async with AsyncClient(f"http://127.0.0.1:{port}", transport=tap, retries=QUICK) as gs:
            call = asyncio.ensure_future(gs.backward(SEED, {"x": 2.0, "y": 3.0}))
            await asyncio.sleep(0.5)
            assert not call.done()
            servers.append(await asyncio.to_thread(_launch, tmp_path, port))
            r = await asyncio.wait_for(call, 40)
            assert r.outputs["z"].item() == -5.0
            assert tap.outcomes[-1] == 200 and set(tap.outcomes[:-1]) == {"ConnectError"}
            assert len(tap.outcomes) >= 3

            # A 503 and a 502 retried; a 422 and a 500 not; ops() retried too.
            big = np.arange(30_000, dtype=np.float32)  # a binary body in parts, sent again
            tap.script, tap.outcomes = [_busy("0"), (502, {}, "about:blank")], []
            rb = await gs.forward(
                {"nodes": [{"id": "y", "expr": "x + 1"}], "outputs": ["y"]}, {"x": big}
            )
            assert tap.outcomes == [503, 502, 200] and len({*tap.bodies[-3:]}) == 1
            np.testing.assert_array_equal(rb.outputs["y"], big + 1)
            for status in (422, 500):
                tap.script, tap.outcomes = [(status, {}, "urn:gradserve:problem:x")], []
                with pytest.raises(GradserveHTTPError):
                    await gs.forward(SEED, {"x": 1.0, "y": 1.0})
                assert tap.outcomes == [status]
            tap.script, tap.outcomes = [_busy("0")], []
            assert [op["name"] for op in await gs.ops()][:1]
            assert tap.outcomes == [503, 200]

        # The deadline: refused until it passes, then the last error (on the async waits).
        dead, clock = AsyncTap(), FakeClock()
        retry = Retry(
            attempts=10_000, deadline=1.0, backoff=0.02, max_backoff=0.1, rand=lambda: 0.75
        )
        async with AsyncClient(
            f"http://127.0.0.1:{free_port()}",
            transport=dead,
            retries=dataclasses.replace(retry, clock=clock),
        ) as gd:
            with pytest.raises(httpx.ConnectError):
                await gd.forward(SEED, {"x": 1.0, "y": 1.0})
        assert clock.waits == pytest.approx([0.015, 0.03, 0.06] + [0.075] * 11)
        assert dead.outcomes == ["ConnectError"] * 15

    asyncio.run(run())
