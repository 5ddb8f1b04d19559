"""The client's HTTP/1.1 transports for plain `http://`, sync and async: a request in one
write, its response read with as few reads as it takes.

httpx's default transport (httpcore and h11) writes a request's head and each part of its
body separately and parses the response in Python event by event: some 0.5 ms a request on
loopback (a 1 ms round trip where a socket alone takes 0.5), twice what a small request
computes on the server, and the server is woken once per write. Here the head and every
body part go in one write (sync: one `sendmsg`, the parts as they lie), and the response's
head is parsed from the first read. Everything above the transport stays httpx's (URLs,
headers, timeouts, `httpx.Response`), and its errors are httpx's, so the client's retries
read them as they read httpcore's.

They speak what the service and a balancer in front of it answer: `Content-Length`
bodies, chunked ones, and bodies that end with the connection; keep-alive connections,
one per request in flight, pooled per host (a connection the server has closed while idle
is dropped before it is reused). The sync and async transports differ only in their I/O:
what a request's bytes are and how a response is framed is worked out once, below. The
clients send `https://`, and what the environment's proxies take, through httpx's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import AsyncIterable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx

READ_BYTES = 65536  # a read's most bytes while the head is awaited, or a body of unknown length
HEAD_BYTES = 1 << 20  # the longest response head read (a longer one is not HTTP we speak)
IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)
IDLE_PER_HOST = 8  # keep-alive connections kept idle per host

Address = tuple[str, int]
Timeouts = dict[str, float | None]


# ------------------------------------------------------------------ the protocol, no I/O
@dataclass(frozen=True)
class _Head:
    status: int
    reason: bytes
    version: bytes
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class _Framing:
    """How a response's body ends: "none", "length" (after `size` bytes), "chunked" or
    "close" (with the connection); and whether the connection may carry another request."""

    kind: str
    size: int
    reusable: bool


def _request_head(request: httpx.Request) -> tuple[bytes, bool, bool]:
    """The request's head, whether its body goes chunked, and whether the connection
    closes after it (the caller asked so)."""
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
    chunked = close_after = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif lower == b"connection" and b"close" in value.lower():
            close_after = True
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    return b"".join(lines), chunked, close_after


def _request_parts(
    head: bytes, body: list[bytes | memoryview], chunked: bool
) -> list[bytes | memoryview]:
    """The buffers a request is written as: its head, then its body's parts (framed as
    chunks where its length was not given); a small first part joined to the head."""
    body = [part for part in body if memoryview(part).nbytes]
    if chunked:
        framed: list[bytes | memoryview] = []
        for part in body:
            framed += [b"%x\r\n" % memoryview(part).nbytes, part, b"\r\n"]
        body = [*framed, b"0\r\n\r\n"]
    if body and isinstance(body[0], bytes) and len(body[0]) < READ_BYTES:
        return [head + body[0], *body[1:]]  # (a small body: one buffer)
    return [head, *body]


def _parse_head(raw: bytes) -> _Head:
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1 response: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise httpx.RemoteProtocolError(f"a bad header line: {line[:80]!r}")
        headers.append((name.strip(), value.strip()))
    return _Head(int(code), reason, version, headers)


def _interim(head: _Head) -> bool:
    """A 1xx before the response (skipped), but for 101 Switching Protocols."""
    return head.status < 200 and head.status != 101


def _framing(method: str, head: _Head) -> _Framing:
    fields = {k.lower(): v for k, v in head.headers}
    connection = fields.get(b"connection", b"").lower()
    reusable = (
        b"close" not in connection if head.version == b"HTTP/1.1" else b"keep-alive" in connection
    )
    if method == "HEAD" or head.status in (204, 304) or head.status < 200:
        return _Framing("none", 0, reusable)
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return _Framing("chunked", 0, reusable)
    length = fields.get(b"content-length")
    if length is None:
        return _Framing("close", 0, False)
    try:
        return _Framing("length", int(length), reusable)
    except ValueError:
        raise httpx.RemoteProtocolError(f"a bad Content-Length: {length!r}") from None


def _chunk_size(line: bytes) -> int:
    text = line.partition(b";")[0].strip()  # (chunk extensions: ignored)
    try:
        return int(text, 16)
    except ValueError:
        raise httpx.RemoteProtocolError(f"a bad chunk size: {text!r}") from None


def _response(head: _Head, body: bytes) -> httpx.Response:
    return httpx.Response(
        head.status,
        headers=head.headers,
        stream=httpx.ByteStream(body),
        extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
    )


def _unsupported(url: httpx.URL) -> httpx.UnsupportedProtocol:
    return httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not spoken here: {url}")


_NO_RESPONSE = "Server disconnected without sending a response."
_MID_HEAD = "Server disconnected in the middle of a response's head."
_MID_CHUNKS = "peer closed connection in a chunked body"


def _short_body(received: int, expected: int) -> httpx.RemoteProtocolError:
    return httpx.RemoteProtocolError(
        "peer closed connection without sending complete message body: "
        f"received {received} bytes, expected {expected}"
    )


@contextlib.contextmanager
def _raising_as(
    timeout: type[httpx.TimeoutException], error: type[httpx.TransportError], what: str
) -> Iterator[None]:
    """A socket's failures inside, as httpx's: a timeout as `timeout` (`what` timed out),
    any other as `error`."""
    try:
        yield
    except TimeoutError as exc:
        raise timeout(str(exc) or f"{what} timed out") from exc
    except OSError as exc:
        raise error(str(exc)) from exc


def _reading() -> contextlib.AbstractContextManager[None]:
    return _raising_as(httpx.ReadTimeout, httpx.ReadError, "the response")


def _connecting() -> contextlib.AbstractContextManager[None]:
    return _raising_as(httpx.ConnectTimeout, httpx.ConnectError, "the connection")


class _Pooled(Protocol):
    def usable(self) -> bool: ...

    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Pooled)


def _unread(sock: Any) -> bool:
    """Whether an idle connection's socket has nothing to read: a server that closed it
    has sent its end (or something unasked, which spoils it as much)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _usable(idle: list[_C]) -> _C | None:
    """The most recently idle connection the server has not closed, if any (those it has
    closed are dropped)."""
    while idle:
        connection = idle.pop()
        if connection.usable():
            return connection
        connection.close()
    return None


# ------------------------------------------------------------------ sync
class Http11Transport(httpx.BaseTransport):
    """HTTP/1.1 over plain TCP with keep-alive connections; see the module's docstring."""

    def __init__(self) -> None:
        self._idle: dict[Address, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise _unsupported(url)
        timeouts = request.extensions.get("timeout", {})
        address = (url.host, url.port or 80)
        connection = self._take(address, timeouts.get("connect"))
        try:
            head, body, reusable = connection.exchange(request, timeouts)
        except BaseException:
            connection.close()
            raise
        if reusable:
            self._give_back(address, connection)
        else:
            connection.close()
        return _response(head, body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _take(self, address: Address, timeout: float | None) -> _Connection:
        with self._lock:
            connection = _usable(self._idle.get(address, []))
        return connection or _Connection.open(address, timeout)

    def _give_back(self, address: Address, connection: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < IDLE_PER_HOST:
                idle.append(connection)
                return
        connection.close()


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()  # read beyond what was asked so far

    @classmethod
    def open(cls, address: Address, timeout: float | None) -> _Connection:
        with _connecting():
            sock = socket.create_connection(address, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    def usable(self) -> bool:
        """False when the server has closed this idle connection."""
        return _unread(self.sock)

    def close(self) -> None:
        self.sock.close()

    def exchange(self, request: httpx.Request, timeouts: Timeouts) -> tuple[_Head, bytes, bool]:
        """Send `request`, read its response: its head, its body, and whether the
        connection may carry another request."""
        head, chunked, close_after = _request_head(request)
        stream = request.stream
        assert isinstance(stream, Iterable)  # (a sync client's request)
        self.sock.settimeout(timeouts.get("write"))
        try:
            self._send_all(_request_parts(head, list(stream), chunked))
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "the request timed out being sent") from exc
        except OSError as exc:
            # The server may have answered before the whole body came (a 413, a 408) and
            # closed: that answer is the response, if it can be read (as httpcore does).
            try:
                return self._response(request.method, timeouts)
            except httpx.TransportError:
                raise httpx.WriteError(str(exc)) from exc
        response, body, reusable = self._response(request.method, timeouts)
        return response, body, reusable and not close_after

    def _send_all(self, parts: list[bytes | memoryview]) -> None:
        """Write every part, in as few sendmsg calls as the kernel takes them."""
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            sent = self.sock.sendmsg(views[:IOV_MAX])
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]

    def _response(self, method: str, timeouts: Timeouts) -> tuple[_Head, bytes, bool]:
        self.sock.settimeout(timeouts.get("read"))
        head = self._head()
        while _interim(head):
            head = self._head()
        framing = _framing(method, head)
        if framing.kind == "none":
            return head, b"", framing.reusable
        if framing.kind == "length":
            return head, self._exactly(framing.size), framing.reusable
        if framing.kind == "chunked":
            return head, self._chunked(), framing.reusable
        return head, self._until_closed(), False

    def _recv(self) -> bytes:
        with _reading():
            return self.sock.recv(READ_BYTES)

    def _head(self) -> _Head:
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > HEAD_BYTES:
                raise httpx.RemoteProtocolError("a response head past 1 MiB")
            data = self._recv()
            if not data:
                raise httpx.RemoteProtocolError(_MID_HEAD if self.buffer else _NO_RESPONSE)
            self.buffer += data
        raw = bytes(self.buffer[:end])
        del self.buffer[: end + 4]
        return _parse_head(raw)

    def _exactly(self, size: int) -> bytes:
        if len(self.buffer) >= size:
            data = bytes(self.buffer[:size])
            del self.buffer[:size]
            return data
        body = bytearray(size)
        view = memoryview(body)
        at = len(self.buffer)
        view[:at] = self.buffer
        self.buffer.clear()
        while at < size:
            with _reading():
                n = self.sock.recv_into(view[at:])
            if not n:
                raise _short_body(at, size)
            at += n
        return bytes(body)

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            data = self._recv()
            if not data:
                raise httpx.RemoteProtocolError(_MID_CHUNKS)
            self.buffer += data
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _chunked(self) -> bytes:
        chunks: list[bytes] = []
        while size := _chunk_size(self._line()):
            chunks.append(self._exactly(size))
            if self._line():
                raise httpx.RemoteProtocolError("a chunk longer than its size")
        while self._line():  # (trailers, up to the blank line)
            pass
        return b"".join(chunks)

    def _until_closed(self) -> bytes:
        chunks = [bytes(self.buffer)]
        self.buffer.clear()
        while data := self._recv():
            chunks.append(data)
        return b"".join(chunks)


# ------------------------------------------------------------------ async
class AsyncHttp11Transport(httpx.AsyncBaseTransport):
    """The same as Http11Transport, on asyncio streams (one event loop's)."""

    def __init__(self) -> None:
        self._idle: dict[Address, list[_AsyncConnection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise _unsupported(url)
        timeouts = request.extensions.get("timeout", {})
        address = (url.host, url.port or 80)
        connection = await self._take(address, timeouts.get("connect"))
        try:
            head, body, reusable = await connection.exchange(request, timeouts)
        except BaseException:
            connection.close()
            raise
        if reusable and not self._closed and len(self._idle.get(address, ())) < IDLE_PER_HOST:
            self._idle.setdefault(address, []).append(connection)
        else:
            connection.close()
        return _response(head, body)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    async def _take(self, address: Address, timeout: float | None) -> _AsyncConnection:
        connection = _usable(self._idle.get(address, []))
        return connection or await _AsyncConnection.open(address, timeout)


class _AsyncConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: Address, timeout: float | None) -> _AsyncConnection:
        with _connecting():
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(*address, limit=HEAD_BYTES)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    def usable(self) -> bool:
        """False when the server has closed this idle connection: seen by the loop, or
        waiting in the socket for the loop to see it."""
        if self.reader.at_eof() or self.writer.is_closing():
            return False
        sock = self.writer.get_extra_info("socket")
        return sock is None or _unread(sock)

    def close(self) -> None:
        self.writer.close()

    async def exchange(
        self, request: httpx.Request, timeouts: Timeouts
    ) -> tuple[_Head, bytes, bool]:
        head, chunked, close_after = _request_head(request)
        stream = request.stream
        body: list[bytes | memoryview] = (
            [part async for part in stream]
            if isinstance(stream, AsyncIterable)
            else list(stream)  # (a request built with its parts listed)
        )
        parts = _request_parts(head, body, chunked)
        # A body that may not fit the socket's buffers is written while the answer is read:
        # the server may answer before it has it all (a 413, a 408) and close, and asyncio
        # drops what was not read yet when a write fails.
        answer = (
            asyncio.ensure_future(self._response(request.method, timeouts))
            if sum(memoryview(p).nbytes for p in parts) > READ_BYTES
            else None
        )
        try:
            async with asyncio.timeout(timeouts.get("write")):
                self.writer.writelines(parts)
                await self.writer.drain()
        except OSError as exc:  # (the connection closed: the answer ends too)
            if answer is not None:
                with contextlib.suppress(httpx.TransportError):
                    return await answer  # (an answer before the whole body came)
            raise httpx.WriteError(str(exc)) from exc
        except BaseException as exc:
            if answer is not None:
                answer.cancel()
            if isinstance(exc, TimeoutError):
                raise httpx.WriteTimeout(str(exc) or "the request timed out being sent") from exc
            raise
        response, data, reusable = await (answer or self._response(request.method, timeouts))
        return response, data, reusable and not close_after

    async def _response(self, method: str, timeouts: Timeouts) -> tuple[_Head, bytes, bool]:
        try:
            with _reading():
                async with asyncio.timeout(timeouts.get("read")):
                    return await self._read(method)
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("a response head past 1 MiB") from None

    async def _read(self, method: str) -> tuple[_Head, bytes, bool]:
        head = await self._head()
        while _interim(head):
            head = await self._head()
        framing = _framing(method, head)
        if framing.kind == "none":
            return head, b"", framing.reusable
        if framing.kind == "length":
            return head, await self._exactly(framing.size), framing.reusable
        if framing.kind == "chunked":
            return head, await self._chunked(), framing.reusable
        return head, await self.reader.read(), False

    async def _head(self) -> _Head:
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise httpx.RemoteProtocolError(_MID_HEAD if exc.partial else _NO_RESPONSE) from None
        return _parse_head(raw[:-4])

    async def _exactly(self, size: int) -> bytes:
        try:
            return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            raise _short_body(len(exc.partial), size) from None

    async def _line(self) -> bytes:
        try:
            return (await self.reader.readuntil(b"\r\n"))[:-2]
        except asyncio.IncompleteReadError:
            raise httpx.RemoteProtocolError(_MID_CHUNKS) from None

    async def _chunked(self) -> bytes:
        chunks: list[bytes] = []
        while size := _chunk_size(await self._line()):
            chunks.append(await self._exactly(size))
            if await self._line():
                raise httpx.RemoteProtocolError("a chunk longer than its size")
        while await self._line():  # (trailers, up to the blank line)
            pass
        return b"".join(chunks)
