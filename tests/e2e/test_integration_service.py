"""A real `gradserve serve` process on a loopback port, driven over HTTP.

Every loop here is bounded in count and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from gradserve.client.http import Client, GradserveHTTPError
from tests.support.server import Server, seed, start_server, stop_server

pytestmark = pytest.mark.integration

MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("server"),
        GRADSERVE_MAX_BODY_BYTES=str(MAX_BODY),
        GRADSERVE_MAX_CONCURRENCY="32",
    )
    yield s
    stop_server(s)


def no_grad_seed(a: float = 5.0) -> dict:
    return {
        "graph": {"nodes": [{"id": "B", "expr": "A ** 2 + 16"}], "outputs": ["B"]},
        "inputs": {"A": {"data": [a], "requires_grad": True}},
        "no_grad": True,
    }


def assert_good(base: str) -> None:
    assert httpx.get(base + "/healthz", timeout=10).json() == {"status": "ok"}
    r = httpx.post(base + "/backward", json=seed(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["gradients"]["x"]["data"] == 4.0


@pytest.mark.parametrize("form", ["op", "expr"])
def test_seed_examples(server: Server, form: str) -> None:
    r = httpx.post(server.base + "/backward", json=seed(form=form), timeout=30)
    out = r.json()
    assert out["outputs"]["z"]["data"] == -5.0 and out["outputs"]["z"]["grad_fn"] == "MulBackward"
    assert (out["gradients"]["x"]["data"], out["gradients"]["y"]["data"]) == (4.0, -6.0)
    b = httpx.post(server.base + "/forward", json=no_grad_seed(), timeout=30).json()["outputs"]["B"]
    assert (b["data"], b["requires_grad"], b["grad_fn"]) == ([41.0], False, None)


def test_python_client(server: Server) -> None:
    graph = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
    with Client(server.base) as gs:
        r = gs.backward(graph, {"x": 2.0, "y": 3.0})
        assert (r.outputs["z"].item(), r.gradients["x"].item(), r.gradients["y"].item()) == (
            -5.0,
            4.0,
            -6.0,
        )
        assert r.grad_fn == {"z": "MulBackward"} and r.meta["nodes"] == 3
        # A large tensor goes as base64 (the body stays small enough for this server).
        x = np.linspace(-1, 1, 50_000, dtype=np.float32)
        big = gs.forward(
            {"nodes": [{"id": "y", "expr": "x * 2"}], "outputs": ["y"]}, {"x": x}, no_grad=True
        )
        np.testing.assert_array_equal(big.outputs["y"], x * 2)
        assert big.outputs["y"].dtype == np.float32 and big.requires_grad == {"y": False}
        with pytest.raises(GradserveHTTPError) as info:
            gs.forward(
                {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}], "outputs": ["z"]},
                {"a": np.ones((3, 4)), "b": np.ones((5, 2))},
            )
        err = info.value
        assert err.status == 422 and err.node == "z" and err.request_id
        assert err.detail == "node 'z' (matmul): shapes (3, 4) and (5, 2) do not match"


def test_32_concurrent_mixed_requests(server: Server) -> None:
    """Grad and no_grad requests at once, tiny and large: every answer is its own."""

    async def one(client: httpx.AsyncClient, i: int) -> None:
        if i % 2:
            r = await client.post("/backward", json=seed(x=float(i), y=1.0))
            out = r.json()
            assert out["outputs"]["z"]["data"] == i * i - 1
            assert out["outputs"]["z"]["grad_fn"] == "MulBackward"
            assert out["gradients"]["x"]["data"] == 2 * i
        elif i % 4 == 0:
            r = await client.post("/forward", json=no_grad_seed(float(i)))
            b = r.json()["outputs"]["B"]
            assert (b["data"], b["requires_grad"], b["grad_fn"]) == ([i * i + 16.0], False, None)
        else:  # a larger body: the worker-thread path, with grad recorded
            body = {
                "graph": {"nodes": [{"id": "s", "expr": "sum(x * x)"}], "outputs": ["s"]},
                "inputs": {"x": {"data": [float(i)] * 4000, "requires_grad": True}},
            }
            out = (await client.post("/forward", json=body)).json()["outputs"]["s"]
            assert out["data"] == 4000 * i * i
            assert (out["requires_grad"], out["grad_fn"]) == (True, "SumBackward")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(32)))

    asyncio.run(run())
    assert_good(server.base)


def test_healthz_stays_fast_during_a_long_computation(server: Server) -> None:
    # A no_grad chain of 120 1000x1000 matmuls: seconds of BLAS work in a worker thread.
    nodes = [{"id": "a", "op": "full", "attrs": {"shape": [1000, 1000], "value": 0.001}}]
    nodes += [
        {"id": f"m{i}", "op": "matmul", "args": [f"m{i - 1}" if i else "a", "a"]}
        for i in range(120)
    ]
    body = {"graph": {"nodes": nodes, "outputs": ["m119"]}, "no_grad": True}

    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            long = asyncio.create_task(client.post("/forward", json=body))
            for _ in range(200):  # wait until the computation is admitted and running
                metrics = (await client.get("/metrics")).text
                if "gradserve_computations_in_flight 1.0" in metrics:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the long computation never started")
            probes = []
            for _ in range(5):
                t0 = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                probes.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            assert not long.done(), "the computation was too short to test against"
            assert (await long).status_code == 200
            return probes

    probes = asyncio.run(run())
    # The median, so that one scheduler hiccup on a shared machine does not fail the test.
    assert statistics.median(probes) < 0.100, probes


def test_oversize_bodies_are_refused(server: Server) -> None:
    # Declared: refused from the headers alone, nothing of the body is sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 ") and b"application/problem+json" in head

    # Chunked: refused once it crosses the limit, while the client is still sending.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
        reply = b""
        sock.settimeout(0.05)
        for _ in range(4 * MAX_BODY // (64 * 1024)):  # up to 4x the limit, then give up
            try:
                sock.sendall(chunk)
                reply = sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:  # the server closed the connection after answering
                break
            if reply:
                break
        sock.settimeout(5)
        if not reply:
            reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert_good(server.base)


BAD_REQUESTS: list[tuple[str, bytes, int]] = [
    ("/forward", b"", 400),
    ("/forward", b"{not json", 400),
    ("/forward", b"[" * 100_000, 400),
    ("/forward", b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": "bad"}}', 422),
    (
        "/backward",
        b'{"graph": {"nodes": [{"id": "z", "expr": "' + b"(" * 5000 + b'"}], "outputs": ["z"]}}',
        422,
    ),
    (
        "/forward",
        b'{"graph": {"nodes": [{"id": "z", "expr": "__import__(\'os\').system(\'id\')"}'
        b'], "outputs": ["z"]}}',
        422,
    ),
    (
        "/forward",
        b'{"graph": {"nodes": [{"id": "z", "op": "reshape", "args": ["x"], "attrs":'
        b' {"shape": [-5]}}], "outputs": ["z"]}, "inputs": {"x": [1.0]}}',
        422,
    ),
    (
        "/forward",
        b'{"graph": {"nodes": [{"id": "z", "op": "ones", "attrs": {"shape": '
        b'[100000, 100000, 100000]}}], "outputs": ["z"]}}',
        422,
    ),
    (
        "/backward",
        b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": {"b64": "!!!!",'
        b' "dtype": "float32", "shape": [1]}}}',
        422,
    ),
]


@pytest.mark.parametrize("path, body, status", BAD_REQUESTS)
def test_healthy_after_bad_input(server: Server, path: str, body: bytes, status: int) -> None:
    r = httpx.post(
        server.base + path,
        content=body,
        timeout=30,
        headers={"Content-Type": "application/json", "X-Request-ID": "bad-input-1"},
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert "Traceback" not in r.text
    assert_good(server.base)


def test_request_id_in_the_server_log(server: Server) -> None:
    httpx.get(server.base + "/healthz", headers={"X-Request-ID": "find-me-in-the-log"})
    deadline = time.monotonic() + 5
    while "find-me-in-the-log" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "find-me-in-the-log 127.0.0.1" in server.log_text()


def test_sigterm_shuts_down_cleanly(tmp_path: Path) -> None:
    s = start_server(tmp_path)
    assert_good(s.base)
    s.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status says
    # why it stopped (143 in a shell, as `docker stop` expects).
    assert s.proc.wait(timeout=20) in (0, -signal.SIGTERM)
    log = s.log_text()
    assert "Application shutdown complete" in log and "Finished server process" in log
    assert "Traceback" not in log
