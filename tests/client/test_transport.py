"""The client's HTTP/1.1 transport (client/transport.py) against scripted servers on
loopback: how it frames requests and reads responses (lengths, chunks, closes), when it
reuses a connection, and which httpx error each failure is (the client's retries read
them). The client's own tests run through it against the real service."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gradserve import AsyncClient, Client
from gradserve.client.transport import IOV_MAX, AsyncHttp11Transport, Http11Transport

Handler = Callable[[socket.socket, "Script"], None]


class Script:
    """A server on 127.0.0.1 that hands each connection it accepts to `handler` in a thread
    of its own; it counts connections and keeps the requests it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            with contextlib.suppress(OSError):  # (a client gone: the test says what it saw)
                self.handler(conn, self)

    def close(self) -> None:
        self.listener.close()


Scripts = Callable[[Handler], Script]


def read_request(conn: socket.socket, script: Script, buffer: bytearray) -> bool:
    """One request off `conn` into script.requests (its body by Content-Length, or
    chunked); False when the client closed the connection."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return False
        buffer += data
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end])
    del buffer[: end + 4]
    fields = dict(
        (k.strip().lower(), v.strip())
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
    )
    if fields.get(b"transfer-encoding") == b"chunked":
        body = bytearray()
        while True:
            while b"\r\n" not in buffer:
                buffer += conn.recv(65536)
            line_end = buffer.index(b"\r\n")
            size = int(buffer[:line_end], 16)
            del buffer[: line_end + 2]
            while len(buffer) < size + 2:
                buffer += conn.recv(65536)
            body += buffer[:size]
            del buffer[: size + 2]
            if size == 0:
                break
    else:
        size = int(fields.get(b"content-length", b"0"))
        while len(buffer) < size:
            buffer += conn.recv(65536)
        body = buffer[:size]
        del buffer[:size]
    script.requests.append((head, bytes(body)))
    return True


def answering(*responses: bytes, then_close: bool = False) -> Handler:
    """A handler that answers each request on a connection with the next response (the
    last one repeated), keeping the connection open unless `then_close`."""

    def handler(conn: socket.socket, script: Script) -> None:
        buffer = bytearray()
        n = 0
        while read_request(conn, script, buffer):
            conn.sendall(responses[min(n, len(responses) - 1)])
            n += 1
            if then_close:
                return

    return handler


def ok(body: bytes = b"hello", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.fixture
def scripts() -> Iterator[Scripts]:
    made: list[Script] = []

    def make(handler: Handler) -> Script:
        made.append(Script(handler))
        return made[-1]

    yield make
    for script in made:
        script.close()


class AsyncAsSync:
    """An httpx.AsyncClient on AsyncHttp11Transport, called as the sync client is (each call
    run on an event loop of its own), so that every test below holds for both."""

    def __init__(self, timeout: float) -> None:
        self.runner = asyncio.Runner()
        self.client = httpx.AsyncClient(transport=AsyncHttp11Transport(), timeout=timeout)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        content = kwargs.get("content")
        if content is not None and not isinstance(content, bytes):
            kwargs["content"] = _async_parts(list(content))
        return self.runner.run(self.client.request(method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def head(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("HEAD", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    def close(self) -> None:
        self.runner.run(self.client.aclose())
        self.runner.close()


async def _async_parts(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def make_client(kind: str, timeout: float = 5.0) -> Any:
    """A client on the sync or the async transport."""
    if kind == "sync":
        return httpx.Client(transport=Http11Transport(), timeout=timeout)
    return AsyncAsSync(timeout)


@pytest.fixture(params=["sync", "async"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    c = make_client(request.param)
    yield c
    c.close()


# ------------------------------------------------------------------ responses
def test_a_response_by_length_and_its_connection_kept(scripts: Scripts, client: Any) -> None:
    script = scripts(answering(ok(b"first"), ok(b"second", b"X-Thing: a b\r\n")))
    first = client.post(script.url + "/a?q=1", content=b"abc")
    second = client.get(script.url + "/b")
    assert (first.status_code, first.content, first.reason_phrase) == (200, b"first", "OK")
    assert second.content == b"second" and second.headers["x-thing"] == "a b"
    assert script.accepted == 1  # kept alive
    (head_a, body_a), (head_b, body_b) = script.requests
    assert head_a.startswith(b"POST /a?q=1 HTTP/1.1\r\n") and body_a == b"abc"
    assert b"\r\ncontent-length: 3" in head_a.lower()
    assert head_b.startswith(b"GET /b HTTP/1.1\r\n") and body_b == b""


def test_a_chunked_response_with_extensions_and_trailers(scripts: Scripts, client: Any) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1\r\n,\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    script = scripts(answering(chunked, ok(b"after")))
    assert client.get(script.url).content == b"hello, world"
    assert client.get(script.url).content == b"after"  # the connection read to its end
    assert script.accepted == 1


def test_a_body_that_ends_with_the_connection(scripts: Scripts, client: Any) -> None:
    script = scripts(answering(b"HTTP/1.1 200 OK\r\n\r\nall of it", then_close=True))
    assert client.get(script.url).content == b"all of it"
    assert client.get(script.url).content == b"all of it"
    assert script.accepted == 2  # not reused: it ended


@pytest.mark.parametrize(
    "answer",
    [ok(b"x", b"Connection: close\r\n"), b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx"],
)
def test_connection_close_and_http_1_0_are_not_reused(
    scripts: Scripts, client: Any, answer: bytes
) -> None:
    script = scripts(answering(answer))
    assert [client.get(script.url).content for _ in range(3)] == [b"x"] * 3
    assert script.accepted == 3


def test_no_body_for_head_204_and_304_and_an_interim_100_skipped(
    scripts: Scripts, client: Any
) -> None:
    script = scripts(
        answering(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",  # HEAD: the length of a GET
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"final"),
        )
    )
    assert client.head(script.url).content == b""
    assert client.delete(script.url).status_code == 204
    assert client.get(script.url).status_code == 304
    final = client.get(script.url)
    assert (final.status_code, final.content) == (200, b"final")
    assert script.accepted == 1  # each read exactly to its end


def test_an_idle_connection_the_server_closed_is_not_reused(scripts: Scripts, client: Any) -> None:
    closed = threading.Event()

    def once(conn: socket.socket, script: Script) -> None:
        if read_request(conn, script, bytearray()):
            conn.sendall(ok(b"%d" % script.accepted))
        conn.close()
        closed.set()

    script = scripts(once)  # answers one request a connection, then closes it
    assert client.get(script.url).content == b"1"
    assert closed.wait(5)
    assert client.get(script.url).content == b"2"  # no error: a new connection


# ------------------------------------------------------------------ requests
def test_a_body_of_many_parts_and_a_large_one_arrives_whole(scripts: Scripts, client: Any) -> None:
    script = scripts(answering(ok()))
    parts = [bytes([i % 251]) * (i % 7 + 1) for i in range(IOV_MAX * 2 + 5)]
    big = bytes(range(256)) * 40_000  # 10 MB: sendmsg writes it in pieces
    joined = b"".join(parts)
    headers = {"Content-Length": str(len(joined))}
    assert client.post(script.url, content=iter(parts), headers=headers).status_code == 200
    assert client.post(script.url, content=big).status_code == 200
    assert [body for _, body in script.requests] == [joined, big]


def test_a_body_of_unknown_length_goes_chunked(scripts: Scripts, client: Any) -> None:
    script = scripts(answering(ok()))
    client.post(script.url, content=iter([b"ab", b"", b"cde"]))
    head, body = script.requests[0]
    assert b"transfer-encoding: chunked" in head.lower() and body == b"abcde"


def test_an_answer_before_the_body_is_all_sent_is_the_response(
    scripts: Scripts, client: Any
) -> None:
    def refuse(conn: socket.socket, script: Script) -> None:
        while b"\r\n\r\n" not in conn.recv(65536):
            pass
        conn.sendall(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\n\r\nbig")
        conn.shutdown(socket.SHUT_WR)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    script = scripts(refuse)
    response = client.post(script.url, content=b"x" * (64 << 20))
    assert (response.status_code, response.content) == (413, b"big")


def echo(conn: socket.socket, script: Script) -> None:
    """Answers each request with its own body."""
    buffer = bytearray()
    while read_request(conn, script, buffer):
        conn.sendall(ok(script.requests[-1][1]))


EXPECTED = [[b"%d-%d" % (i, j) for j in range(20)] for i in range(8)]


def test_threads_share_the_transport_each_on_a_connection_of_its_own(scripts: Scripts) -> None:
    script = scripts(echo)
    with make_client("sync") as client:

        def calls(i: int) -> list[bytes]:
            return [client.post(script.url, content=b"%d-%d" % (i, j)).content for j in range(20)]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(calls, range(8)))
    assert answers == EXPECTED
    assert script.accepted <= 8


def test_tasks_share_the_async_transport_each_on_a_connection_of_its_own(scripts: Scripts) -> None:
    script = scripts(echo)

    async def main() -> list[list[bytes]]:
        async with httpx.AsyncClient(transport=AsyncHttp11Transport()) as client:

            async def calls(i: int) -> list[bytes]:
                return [
                    (await client.post(script.url, content=b"%d-%d" % (i, j))).content
                    for j in range(20)
                ]

            return list(await asyncio.gather(*(calls(i) for i in range(8))))

    assert asyncio.run(main()) == EXPECTED
    assert script.accepted <= 8


# ------------------------------------------------------------------ failures, as httpx's
def test_nothing_listening_is_a_connect_error(client: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "without sending a response"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "in the middle of a response's head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "received 3 bytes, expected 10"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "complete message"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1 response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "a bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "a bad header line"),
    ],
)
def test_a_broken_response_is_a_remote_protocol_error(
    scripts: Scripts, client: Any, answer: bytes, message: str
) -> None:
    def broken(conn: socket.socket, script: Script) -> None:
        read_request(conn, script, bytearray())
        conn.sendall(answer)

    script = scripts(broken)
    with pytest.raises(httpx.RemoteProtocolError, match=message):
        client.get(script.url)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_slow_answer_is_a_read_timeout(scripts: Scripts, kind: str) -> None:
    gate = threading.Event()

    def slow(conn: socket.socket, script: Script) -> None:
        read_request(conn, script, bytearray())
        gate.wait(5)

    script = scripts(slow)
    client = make_client(kind, timeout=0.2)
    with pytest.raises(httpx.ReadTimeout):
        client.get(script.url)
    gate.set()
    client.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_only_plain_http_is_spoken(kind: str) -> None:
    client = make_client(kind)
    with pytest.raises(httpx.UnsupportedProtocol, match="'https'"):
        client.get("https://127.0.0.1:1/")
    client.close()


# ------------------------------------------------------------------ the client on it
LISTING = ok(
    b'{"tensors": [], "quota_bytes": 0, "used_bytes": 0}', b"Content-Type: application/json\r\n"
)


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def _listings(kind: str, url: str, **options: Any) -> list[dict[str, Any]]:
    """GET /tensors twice with a Client, or an AsyncClient."""
    if kind == "sync":
        with Client(url, retries=0, **options) as gs:
            return [gs.tensors(), gs.tensors()]

    async def twice() -> list[dict[str, Any]]:
        async with AsyncClient(url, retries=0, **options) as gs:
            return [await gs.tensors(), await gs.tensors()]

    return asyncio.run(twice())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_client_sends_its_headers_straight_to_the_server(
    scripts: Scripts, no_proxies: pytest.MonkeyPatch, kind: str
) -> None:
    server = scripts(answering(LISTING))
    assert [t["quota_bytes"] for t in _listings(kind, server.url + "/prefix", api_key="k-1")] == [
        0,
        0,
    ]
    assert server.accepted == 1
    head = server.requests[0][0].lower()
    assert head.startswith(b"get /prefix/tensors http/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:%d\r\n" % server.port in head
    assert b"\r\nx-api-key: k-1\r\n" in head
    assert b"\r\nx-gradserve-tensors: " in head  # (the affinity header, once)
    assert head.count(b"\r\naccept:") == 1


@pytest.mark.parametrize(
    ("variable", "kind"),
    [
        ("HTTP_PROXY", "sync"),
        ("http_proxy", "sync"),
        ("ALL_PROXY", "sync"),
        ("HTTP_PROXY", "async"),
    ],
)
def test_a_proxy_of_the_environment_is_used_unless_no_proxy_says_not(
    scripts: Scripts, no_proxies: pytest.MonkeyPatch, variable: str, kind: str
) -> None:
    proxy, server = scripts(answering(LISTING)), scripts(answering(LISTING))
    no_proxies.setenv(variable, proxy.url)
    _listings(kind, server.url)
    assert [len(proxy.requests), len(server.requests)] == [2, 0]
    assert proxy.requests[0][0].startswith(b"GET %s/tensors HTTP/1.1" % server.url.encode())
    no_proxies.setenv("NO_PROXY", "127.0.0.1")
    _listings(kind, server.url)
    assert [len(proxy.requests), len(server.requests)] == [2, 2]
