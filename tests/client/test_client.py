"""The Python client (client/http.py) against a real `gradserve serve` on loopback:
binary, base64 and JSON bodies each way, every dtype exactly (0-d and empty too), mixed
requests, read-only views, graphs sent once by id (and sent again on a miss), retries, and
the async client. Requests pass through a recording transport, which forwards them as
they are (a binary body's parts included) and can answer some itself (a 409, a 503).

Every loop here is bounded; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from gradserve.client.http import (
    BINARY_HEADER,
    GRAPH_ID_MISSES,
    GRAPH_UNKNOWN,
    AsyncClient,
    Client,
    GradserveHTTPError,
    Result,
)
from gradserve.wire.graph_id import GRAPH_HEADER, canonical_graph, graph_key
from tests.support.server import Server, start_server, stop_server

pytestmark = pytest.mark.integration

DTYPES = ["float16", "float32", "float64", "int32", "int64", "bool"]
SHAPES = [(), (0,), (2, 0, 3), (3, 4), (70,)]
IDENTITY = {"nodes": [], "outputs": ["x"]}  # an input named as an output: sent back as it is
# Request forms: every tensor as raw bytes, as base64, as JSON; and the default thresholds.
REQUESTS: dict[str, dict[str, Any]] = {
    "binary": {"binary_threshold": 0},
    "base64": {"binary_threshold": None, "base64_threshold": 0},
    "json": {"binary_threshold": None, "base64_threshold": None},
}
ENCODINGS = ["json", "base64", "binary"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("client-server"))
    yield s
    stop_server(s)


# ------------------------------------------------------------------ a recording transport
@dataclass
class Sent:
    """One request as it went out: its headers, and its body's chunks as written."""

    path: str
    headers: httpx.Headers
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def binary(self) -> bool:
        return BINARY_HEADER in self.headers

    @property
    def header(self) -> dict[str, Any]:
        """The JSON request (a binary body's header)."""
        body = self.body
        n = int(self.headers[BINARY_HEADER]) if self.binary else len(body)
        return orjson.loads(body[:n])  # type: ignore[no-any-return]

    @property
    def tail(self) -> bytes:
        return self.body[int(self.headers[BINARY_HEADER]) :] if self.binary else b""


class _Tap(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A request body passed through chunk by chunk, each chunk recorded."""

    def __init__(self, stream: Any, sent: Sent) -> None:
        self.stream, self.sent = stream, sent

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.stream:
            self.sent.chunks.append(bytes(chunk))
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.sent.chunks.append(bytes(chunk))
            yield chunk


class _Recording:
    """Records requests and routes them to `target` (a server's base URL, which a test may
    change: the client's own URL is a placeholder). `busy`: answer that many requests 503
    (Retry-After: 0); `refuse_ids`: answer 409 graph-unknown to every request by graph_id."""

    def __init__(self, target: str) -> None:
        self.target = httpx.URL(target)
        self.sent: list[Sent] = []
        self.statuses: list[int] = []
        self.busy = 0
        self.refuse_ids = False

    def _route(self, request: httpx.Request) -> Sent:
        sent = Sent(request.url.path, request.headers)
        self.sent.append(sent)
        request.url = request.url.copy_with(
            scheme=self.target.scheme, host=self.target.host, port=self.target.port
        )
        request.stream = _Tap(request.stream, sent)
        return sent

    def _answer(self, request: httpx.Request, sent: Sent) -> httpx.Response | None:
        """A response of our own, with the request read (and recorded), or None."""
        if self.busy:
            self.busy -= 1
            return httpx.Response(
                503,
                headers={"Retry-After": "0"},
                request=request,
                json={
                    "type": "urn:gradserve:problem:overloaded",
                    "title": "Server busy",
                    "status": 503,
                    "detail": "",
                },
            )
        if self.refuse_ids and "graph_id" in sent.header:
            return httpx.Response(
                409,
                request=request,
                json={
                    "type": GRAPH_UNKNOWN,
                    "title": "Graph unknown",
                    "status": 409,
                    "detail": "not here",
                },
            )
        return None

    def _done(self, response: httpx.Response) -> httpx.Response:
        self.statuses.append(response.status_code)
        return response


class Recorder(_Recording, httpx.BaseTransport):
    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        sent = self._route(request)
        if self.busy or self.refuse_ids:
            sent.chunks = [request.read()]  # (its parts, if any, recorded as one)
            request.stream = httpx.ByteStream(sent.chunks[0])  # (forwarded untapped)
            answer = self._answer(request, sent)
            if answer is not None:
                return self._done(answer)
        return self._done(self.inner.handle_request(request))

    def close(self) -> None:
        self.inner.close()


class AsyncRecorder(_Recording, httpx.AsyncBaseTransport):
    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = self._route(request)
        if self.busy or self.refuse_ids:
            sent.chunks = [await request.aread()]
            request.stream = httpx.ByteStream(sent.chunks[0])
            answer = self._answer(request, sent)
            if answer is not None:
                return self._done(answer)
        return self._done(await self.inner.handle_async_request(request))

    async def aclose(self) -> None:
        await self.inner.aclose()


def client(server: Server, **options: Any) -> tuple[Client, Recorder]:
    recorder = Recorder(server.base)
    return Client("http://gradserve.test", transport=recorder, **options), recorder


# ------------------------------------------------------------------ helpers
def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values that test exactness: each dtype's extremes, and for floats NaN, both
    infinities, -0.0 and the smallest subnormal."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bool":
        flat = rng.integers(0, 2, n).astype(bool)
    elif dtype.startswith("int"):
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        flat[:2] = [info.min, info.max][:n]
    else:
        info = np.finfo(dtype)
        flat = (rng.standard_normal(n) * 1e3).astype(dtype)
        specials = np.array(
            [np.nan, np.inf, -np.inf, -0.0, info.max, info.smallest_subnormal, info.min],
            dtype=dtype,
        )
        flat[: len(specials)] = specials[:n]
    return flat.reshape(shape)


def assert_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    if want.dtype.kind == "f":
        # Bit for bit: NaN, the infinities and -0.0 included.
        np.testing.assert_array_equal(got.view(f"u{want.itemsize}"), want.view(f"u{want.itemsize}"))
    else:
        np.testing.assert_array_equal(got, want)


def root(array: np.ndarray) -> Any:
    """What an array's memory belongs to, past any chain of views."""
    base: Any = array
    for _ in range(32):
        if isinstance(base, memoryview):  # a view on part of a buffer: that buffer's
            base = base.obj
        elif not isinstance(base, np.ndarray) or base.base is None:
            return base
        else:
            base = base.base
    raise AssertionError("a chain of views longer than 32")


def assert_arrays_of(result: Result, encoding: str) -> None:
    """Binary: read-only views on the response body (one and the same bytes object);
    base64 and JSON: writable arrays of their own."""
    arrays = [*result.outputs.values(), *(result.gradients or {}).values()]
    if encoding == "binary":
        bodies = {id(root(a)) for a in arrays}
        assert len(bodies) == 1 and isinstance(root(arrays[0]), bytes)
        for a in arrays:
            assert a.flags.writeable is False and a.base is not None
            with pytest.raises(ValueError, match="read-only"):
                a[...] = 0
            copy = a.copy()
            assert copy.flags.writeable and copy.flags.aligned
            copy[...] = 0
    else:
        for a in arrays:
            assert a.flags.writeable
            a[...] = 0  # (and the response's other arrays are unaffected: their own)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("request_form", list(REQUESTS))
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_shape(
    server: Server, dtype: str, encoding: str, request_form: str
) -> None:
    gs, rec = client(server, encoding=encoding, **REQUESTS[request_form])
    with gs:
        for k, shape in enumerate(SHAPES):
            x = sample(dtype, shape, seed=k)
            r = gs.forward(IDENTITY, {"x": x})
            assert_exact(r.outputs["x"], x)
            assert r.requires_grad == {"x": False} and r.gradients is None
            sent = rec.sent[-1]
            tensor = sent.header["inputs"]["x"]
            assert sent.header["encoding"] == encoding
            if request_form == "binary":
                assert sent.binary and sent.headers["content-type"] == "application/octet-stream"
                assert tensor["binary_data_size"] == x.nbytes and "data" not in tensor
                assert sent.tail == np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()
            else:
                assert not sent.binary and sent.headers["content-type"] == "application/json"
                assert ("b64" if request_form == "base64" else "data") in tensor
            assert_arrays_of(r, encoding)


def test_defaults_mix_binary_and_json_in_one_request(server: Server) -> None:
    """Default thresholds: 64 elements or more as raw bytes, smaller ones as JSON data in
    the same header; nothing large enough: plain JSON."""
    x = np.arange(100, dtype=np.float32) - 50  # binary
    w = np.array([2.0, -1.0, 0.5], np.float32)  # JSON
    n = np.arange(64, dtype=np.int64).reshape(8, 8)  # binary (exactly the threshold)
    k = np.array(3, np.int32)  # JSON, 0-d
    graph = {
        "nodes": [{"id": "y", "expr": "x * 2"}, {"id": "s", "expr": "sum(w) + 1"}],
        "outputs": ["y", "s", "n", "k"],
    }
    gs, rec = client(server)
    with gs:
        assert gs.binary_threshold == 64 and gs.encoding == "binary"
        r = gs.forward(graph, {"x": x, "w": w, "n": n, "k": k})
        sent = rec.sent[-1]
        inputs = sent.header["inputs"]
        assert sent.binary and set(inputs["x"]) == {"dtype", "shape", "binary_data_size"}
        assert inputs["n"]["binary_data_size"] == n.nbytes
        assert inputs["w"]["data"] == [2.0, -1.0, 0.5] and inputs["k"]["data"] == 3
        assert sent.tail == x.tobytes() + n.tobytes()  # in the order the header lists them
        assert int(sent.headers["content-length"]) == len(sent.body)
        assert "transfer-encoding" not in sent.headers
        assert_exact(r.outputs["y"], x * 2)
        assert_exact(r.outputs["s"], np.array(2.5, np.float32))
        assert_exact(r.outputs["n"], n)
        assert_exact(r.outputs["k"], k)
        assert_arrays_of(r, "binary")

        small = gs.forward(graph, {"x": x[:5], "w": w, "n": n[:2], "k": k})
        assert not rec.sent[-1].binary
        assert rec.sent[-1].headers["content-type"] == "application/json"
        assert_exact(small.outputs["y"], x[:5] * 2)


def test_backward_with_binary_gradients_and_grad_outputs(server: Server) -> None:
    """Inputs and grad_outputs as raw bytes (grad_outputs' after the inputs'), a scalar as
    JSON; gradients come back as views on the response. Integer-valued floats: exact."""
    x = np.arange(-50, 50, dtype=np.float64)
    w = np.arange(100, dtype=np.float64) % 7 - 3
    s = np.array(2.0)
    g = np.arange(100, dtype=np.float64) % 5 - 2
    graph = {"nodes": [{"id": "y", "expr": "x * w * s"}], "outputs": ["y"]}
    gs, rec = client(server)
    with gs:
        r = gs.backward(
            graph, {"x": x, "w": w, "s": s}, grad_outputs={"y": g}, requires_grad=["x", "s"]
        )
        sent = rec.sent[-1]
        assert sent.header["grad_outputs"]["y"]["binary_data_size"] == g.nbytes
        assert sent.header["inputs"]["s"] == {
            "dtype": "float64",
            "shape": [],
            "data": 2.0,
            "requires_grad": True,
        }
        assert sent.tail == x.tobytes() + w.tobytes() + g.tobytes()
        assert r.grad_fn["y"] == "MulBackward" and r.requires_grad == {"y": True}
        assert r.gradients is not None and set(r.gradients) == {"x", "s"}
        assert_exact(r.outputs["y"], x * w * 2)
        assert_exact(r.gradients["x"], g * w * 2)
        assert_exact(r.gradients["s"], np.array((g * x * w).sum()))
        assert_arrays_of(r, "binary")

        # The same through base64 and JSON responses, from a non-contiguous, big-endian x.
        for encoding in ("base64", "json"):
            with Client(server.base, encoding=encoding) as other:
                xb = np.repeat(x, 2).astype(">f8")[::2]
                assert not xb.flags.c_contiguous
                r2 = other.backward(
                    graph,
                    {"x": xb, "w": w, "s": s},
                    grad_outputs={"y": g},
                    requires_grad=["x", "s"],
                )
                assert r2.gradients is not None
                assert_exact(r2.gradients["x"], g * w * 2)
                assert_arrays_of(r2, encoding)


def test_large_binary_body_goes_as_parts(server: Server) -> None:
    """A body of 64 KiB or more is written as its parts (the header, then each array's
    own bytes), with a Content-Length, not chunked."""
    x = np.linspace(-1, 1, 100_000, dtype=np.float32)
    y = np.arange(50_000, dtype=np.int32)
    graph = {"nodes": [{"id": "z", "expr": "x * 3"}], "outputs": ["z", "y"]}
    gs, rec = client(server)
    with gs:
        r = gs.forward(graph, {"x": x, "y": y}, no_grad=True)
        sent = rec.sent[-1]
        assert [len(c) for c in sent.chunks][1:] == [x.nbytes, y.nbytes]
        assert int(sent.headers["content-length"]) == len(sent.body)
        assert "transfer-encoding" not in sent.headers
        assert_exact(r.outputs["z"], x * 3)
        assert_exact(r.outputs["y"], y)
        assert_arrays_of(r, "binary")


def test_errors_raise_with_the_problem(server: Server) -> None:
    gs, _ = client(server)
    with gs, pytest.raises(GradserveHTTPError) as info:
        gs.forward(
            {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}], "outputs": ["z"]},
            {"a": np.ones((30, 4)), "b": np.ones((5, 20))},
        )
    err = info.value
    assert err.status == 422 and err.type == "urn:gradserve:problem:shape-mismatch"
    assert err.node == "z" and err.request_id and err.errors
    assert err.detail == "node 'z' (matmul): shapes (30, 4) and (5, 20) do not match"
    with pytest.raises(ValueError, match="encoding"):
        Client(server.base, encoding="msgpack")


def test_base64_threshold_alone_keeps_the_earlier_requests(server: Server) -> None:
    x = np.arange(2000, dtype=np.float32)
    gs, rec = client(server, base64_threshold=1000, encoding="base64")
    with gs:
        assert gs.binary_threshold is None
        r = gs.forward(IDENTITY, {"x": x})
        assert not rec.sent[-1].binary and "b64" in rec.sent[-1].header["inputs"]["x"]
        assert_exact(r.outputs["x"], x)
        gs.forward(IDENTITY, {"x": x[:999]})
        assert "data" in rec.sent[-1].header["inputs"]["x"]


# ------------------------------------------------------------------ graphs sent once
def test_graph_sent_once_then_by_id(server: Server) -> None:
    graph = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
    gs, rec = client(server)
    with gs:
        first = gs.backward(graph, {"x": 2.0, "y": 3.0})
        assert "graph" in rec.sent[-1].header and "graph_id" not in rec.sent[-1].header
        graph_id = first.meta["graph_id"]
        for i in range(3):
            again = gs.backward(graph, {"x": 2.0 + i, "y": 3.0})
            header = rec.sent[-1].header
            assert header.get("graph_id") == graph_id and "graph" not in header
            assert again.meta["graph_id"] == graph_id
            assert again.outputs["z"].item() == (2.0 + i) ** 2 - 9
            assert again.gradients is not None and again.gradients["x"].item() == 2 * (2 + i)
        # The same graph with its keys in another order is the same graph.
        gs.backward(
            {"outputs": ["z"], "nodes": [{"expr": "(x + y) * (x - y)", "id": "z"}]},
            {"x": 1.0, "y": 1.0},
        )
        assert rec.sent[-1].header.get("graph_id") == graph_id
        # Another graph is sent in full.
        gs.forward(
            {"nodes": [{"id": "z", "expr": "x + y"}], "outputs": ["z"]}, {"x": 1.0, "y": 1.0}
        )
        assert "graph" in rec.sent[-1].header
    assert rec.statuses == [200] * len(rec.sent)

    off, rec_off = client(server, reuse_graphs=False)
    with off:
        for _ in range(2):
            off.backward(graph, {"x": 2.0, "y": 3.0})
    assert all("graph" in s.header and "graph_id" not in s.header for s in rec_off.sent)


# Graphs whose numbers, keys and text a canonical form must keep exactly as the server
# reads them: float digits, a NumPy float32 (written with its own shortest digits), big
# and negative ints, exponents, unicode ids, keys in any order.
ROUTED_GRAPHS = [
    {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
    {
        "outputs": ["s"],
        "nodes": [
            {"attrs": {"value": 0.1, "shape": [1]}, "op": "full", "id": "c"},
            {"id": "p", "op": "mul", "args": ["x", "c"]},
            {"id": "q", "op": "mul", "args": ["p", 1e-7]},
            {"id": "r", "op": "add", "args": ["q", np.float32(1 / 3)]},
            {"id": "ζ", "op": "add", "args": ["r", -9007199254740993]},
            {"id": "s", "op": "add", "args": ["ζ", 1e16]},
        ],
    },
]


def test_every_compute_request_names_its_graph_as_the_server_does(server: Server) -> None:
    """X-Gradserve-Graph, on every /forward and /backward (graph sent in full or by id,
    JSON or binary body, with reuse_graphs on or off, sync or async) is the graph_id the
    server gives the graph; the client's other requests carry none."""
    x = np.float32(1.5)
    for options in ({}, {"reuse_graphs": False}, {"binary_threshold": 1}):
        gs, rec = client(server, **options)
        with gs:
            for graph in ROUTED_GRAPHS:
                inputs = {"x": x, "y": np.float32(3)}
                for _ in range(2):
                    served = gs.forward(graph, inputs).meta["graph_id"]
                    assert rec.sent[-1].headers[GRAPH_HEADER] == served, options
                    assert gs.backward(graph, inputs).meta["graph_id"] == served
                    assert rec.sent[-1].headers[GRAPH_HEADER] == served, options
                assert served == graph_key(orjson.loads(canonical_graph(graph)))
            gs.ops()
            assert GRAPH_HEADER not in rec.sent[-1].headers
        assert rec.statuses == [200] * len(rec.sent)
        if options.get("reuse_graphs") is None:  # by id from the second request
            assert "graph_id" in rec.sent[-2].header and "graph" not in rec.sent[-2].header

    async def run() -> None:
        rec = AsyncRecorder(server.base)
        async with AsyncClient("http://gradserve.test", transport=rec) as gs:
            for graph in ROUTED_GRAPHS:
                for _ in range(2):
                    served = (await gs.forward(graph, {"x": x, "y": 1.0})).meta["graph_id"]
                    assert rec.sent[-1].headers[GRAPH_HEADER] == served

    asyncio.run(run())


def test_graph_unknown_resends_the_graph(server: Server, tmp_path: Path) -> None:
    """Another server (as after a restart) does not hold the id: 409, then the request
    again with the graph, transparently; then the id again."""
    graph = {"nodes": [{"id": "y", "expr": "x * 2 + 1"}], "outputs": ["y"]}
    x = np.arange(100, dtype=np.float32)
    gs, rec = client(server)
    other = start_server(tmp_path)
    try:
        with gs:
            graph_id = gs.forward(graph, {"x": x}).meta["graph_id"]
            rec.target = httpx.URL(other.base)
            r = gs.forward(graph, {"x": x})
            assert rec.statuses[-2:] == [409, 200]
            assert rec.sent[-2].header["graph_id"] == graph_id
            assert "graph" in rec.sent[-1].header and "graph_id" not in rec.sent[-1].header
            assert rec.sent[-1].tail == rec.sent[-2].tail == x.tobytes()
            assert_exact(r.outputs["y"], x * 2 + 1)
            assert r.meta["graph_id"] == graph_id  # (the id is the graph's, on any server)
            again = gs.forward(graph, {"x": x})
            assert rec.statuses[-1] == 200 and rec.sent[-1].header["graph_id"] == graph_id
            assert_exact(again.outputs["y"], x * 2 + 1)
    finally:
        stop_server(other)


def test_an_id_that_keeps_missing_is_given_up(server: Server) -> None:
    graph = {"nodes": [{"id": "y", "expr": "x - 1"}], "outputs": ["y"]}
    gs, rec = client(server)
    with gs:
        gs.forward(graph, {"x": 1.0})
        rec.refuse_ids = True
        for _ in range(GRAPH_ID_MISSES):
            assert gs.forward(graph, {"x": 5.0}).outputs["y"].item() == 4.0
        assert rec.statuses == [200] + [409, 200] * GRAPH_ID_MISSES
        gs.forward(graph, {"x": 5.0})  # now in full at once
        assert rec.statuses[-1] == 200 and "graph" in rec.sent[-1].header


def test_503_is_retried_with_the_same_body(server: Server) -> None:
    x = np.arange(20_000, dtype=np.float64)  # 160 KB: the parts path
    graph = {"nodes": [{"id": "y", "expr": "x + 1"}], "outputs": ["y"]}
    gs, rec = client(server, retries=2)
    with gs:
        rec.busy = 2
        r = gs.forward(graph, {"x": x})
        assert rec.statuses == [503, 503, 200]
        assert len({s.body for s in rec.sent}) == 1
        assert_exact(r.outputs["y"], x + 1)
        rec.busy = 3
        with pytest.raises(GradserveHTTPError) as info:
            gs.forward(graph, {"x": x})
        assert info.value.status == 503


# ------------------------------------------------------------------ the async client
def test_async_client(server: Server, tmp_path: Path) -> None:
    graph = {"nodes": [{"id": "y", "expr": "x * w"}], "outputs": ["y"]}
    x = np.arange(-100, 100, dtype=np.float32)
    w = np.array(3.0, np.float32)
    g = np.ones(200, np.float32)

    async def run(other: Server) -> None:
        rec = AsyncRecorder(server.base)
        async with AsyncClient("http://gradserve.test", transport=rec, retries=1) as gs:
            r = await gs.backward(graph, {"x": x, "w": w}, grad_outputs={"y": g})
            sent = rec.sent[-1]
            assert sent.binary and sent.tail == x.tobytes() + g.tobytes()
            assert sent.header["inputs"]["w"]["data"] == 3.0 and "graph" in sent.header
            assert r.gradients is not None
            assert_exact(r.outputs["y"], x * 3)
            assert_exact(r.gradients["x"], np.full(200, 3, np.float32))
            assert_exact(r.gradients["w"], np.array(x.sum(), np.float32))
            assert_arrays_of(r, "binary")

            # By id, concurrently; a 503 retried; then a miss on another server.
            results = await asyncio.gather(
                *(gs.forward(graph, {"x": x + i, "w": w}) for i in range(4))
            )
            for i, ri in enumerate(results):
                assert_exact(ri.outputs["y"], (x + i) * 3)
            assert all(s.header.get("graph_id") == r.meta["graph_id"] for s in rec.sent[1:])
            rec.busy = 1
            big = np.arange(30_000, dtype=np.float32)  # the parts path, sent twice
            fresh = {"nodes": [{"id": "y", "expr": "x * w + 0"}], "outputs": ["y"]}
            rb = await gs.forward(fresh, {"x": big, "w": w})
            assert rec.statuses[-2:] == [503, 200] and rec.sent[-1].body == rec.sent[-2].body
            assert_exact(rb.outputs["y"], big * 3)
            rec.target = httpx.URL(other.base)
            rm = await gs.forward(graph, {"x": x, "w": w})
            assert rec.statuses[-2:] == [409, 200] and "graph" in rec.sent[-1].header
            assert_exact(rm.outputs["y"], x * 3)
            for dtype in DTYPES:
                v = sample(dtype, (3, 5))
                assert_exact((await gs.forward(IDENTITY, {"x": v})).outputs["x"], v)
            with pytest.raises(GradserveHTTPError) as info:
                await gs.forward(graph, {"x": x, "w": np.ones(3, np.float32)})
            assert info.value.status == 422 and info.value.request_id
        async with AsyncClient(other.base, encoding="json", binary_threshold=0) as gj:
            rj = await gj.forward(IDENTITY, {"x": sample("float16", (0, 2))})
            assert_exact(rj.outputs["x"], sample("float16", (0, 2)))
            assert_arrays_of(rj, "json")

    other = start_server(tmp_path)
    try:
        asyncio.run(run(other))
    finally:
        stop_server(other)


def test_detect_anomaly_is_an_argument_of_both_calls(server: Server) -> None:
    graph = {"nodes": [{"id": "z", "expr": "sqrt(x) * 0"}], "outputs": ["z"]}
    with Client(server.base) as client:
        plain = client.backward(graph, {"x": np.array(0.0)})
        assert plain.gradients is not None and np.isnan(plain.gradients["x"])
        with pytest.raises(GradserveHTTPError) as info:
            client.backward(graph, {"x": np.array(0.0)}, detect_anomaly=True)
        with pytest.raises(GradserveHTTPError) as forward:
            client.forward(
                {"nodes": [{"id": "l", "expr": "log(x)"}], "outputs": ["l"]},
                {"x": np.array([-1.0])},
                detect_anomaly=True,
            )
    problem = info.value.problem
    assert (info.value.status, info.value.node, problem["phase"], problem["op"]) == (
        422,
        "z",
        "backward",
        "sqrt",
    )
    assert forward.value.type.endswith(":non-finite") and forward.value.problem["op"] == "log"
