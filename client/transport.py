"""The sync client's HTTP/1.1 transport for plain `http://`: a request in one write, its
response read with as few reads as it takes.

httpx's default transport (httpcore and h11) writes a request's head and each part of its
body separately and parses the response in Python event by event: some 0.5 ms a request on
loopback (a 1 ms round trip where a socket alone takes 0.5), twice what a small request
computes on the server, and the server is woken once per write. Here the head and every
body part go in one `sendmsg` (the parts as they lie, no joined copy), and the response's
head is parsed from the first read. Everything above the transport stays httpx's (URLs,
headers, timeouts, proxies from the environment, `httpx.Response`), and its errors are
httpx's, so the client's retries read them as they read httpcore's.

It speaks what the service and a balancer in front of it answer: `Content-Length` bodies,
chunked ones, and bodies that end with the connection; keep-alive connections, one per
thread at a time, pooled per host (a connection the server has closed while idle is
dropped before it is reused). `Client` sends `https://`, and what the environment's
proxies take, through httpx's own transport.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterable

import httpx

READ_BYTES = 65536  # a read's most bytes while the head is awaited, or a body of unknown length
IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)
IDLE_PER_HOST = 8  # keep-alive connections kept idle per host

# A response as read: status, reason phrase, headers, body, whether the connection may
# carry another request.
_Exchanged = tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]


class Http11Transport(httpx.BaseTransport):
    """HTTP/1.1 over plain TCP with keep-alive connections; see the module's docstring."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not spoken here: {url}")
        timeouts = request.extensions.get("timeout", {})
        address = (url.host, url.port or 80)
        connection = self._take(address, timeouts.get("connect"))
        try:
            status, reason, headers, body, reusable = connection.exchange(request, timeouts)
        except BaseException:
            connection.close()
            raise
        if reusable:
            self._give_back(address, connection)
        else:
            connection.close()
        return httpx.Response(
            status,
            headers=headers,
            stream=httpx.ByteStream(body),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _take(self, address: tuple[str, int], timeout: float | None) -> _Connection:
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                connection = idle.pop()
                if connection.usable():
                    return connection
                connection.close()
        return _Connection.open(address, timeout)

    def _give_back(self, address: tuple[str, int], connection: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < IDLE_PER_HOST:
                idle.append(connection)
                return
        connection.close()


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def open(cls, address: tuple[str, int], timeout: float | None) -> _Connection:
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "the connection timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    def usable(self) -> bool:
        """False when the server has closed this idle connection (or sent on it unasked)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        self.sock.close()

    def exchange(self, request: httpx.Request, timeouts: dict[str, float | None]) -> _Exchanged:
        """Send `request`, read its response: (status, reason, headers, body, whether the
        connection may carry another request)."""
        parts, close_after = _request_parts(request)
        self.sock.settimeout(timeouts.get("write"))
        try:
            _send_all(self.sock, parts)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "the request timed out being sent") from exc
        except OSError as exc:
            # The server may have answered before the whole body came (a 413, a 408) and
            # closed: that answer is the response, if it can be read (as httpcore does).
            try:
                return self._response(request, timeouts)
            except httpx.TransportError:
                raise httpx.WriteError(str(exc)) from exc
        status, reason, headers, body, reusable = self._response(request, timeouts)
        return status, reason, headers, body, reusable and not close_after

    def _response(self, request: httpx.Request, timeouts: dict[str, float | None]) -> _Exchanged:
        self.sock.settimeout(timeouts.get("read"))
        reader = _Reader(self.sock)
        while True:
            status, reason, version, headers = reader.head()
            if status >= 200 or status == 101:
                break  # (a 1xx before the response: skipped)
        fields = {k.lower(): v for k, v in headers}
        connection = fields.get(b"connection", b"").lower()
        reusable = (
            b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
        )
        if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, reason, headers, b"", reusable
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            return status, reason, headers, reader.chunked(), reusable
        length = fields.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                raise httpx.RemoteProtocolError(f"a bad Content-Length: {length!r}") from None
            return status, reason, headers, reader.exactly(size), reusable
        return status, reason, headers, reader.until_closed(), False


def _request_parts(request: httpx.Request) -> tuple[list[bytes | memoryview], bool]:
    """The request's head and body parts, as they will be written; and whether the
    connection closes after it (the caller asked so)."""
    url = request.url
    target = url.raw_path  # path and query, as sent
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), target)]
    chunked = close_after = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif lower == b"connection" and b"close" in value.lower():
            close_after = True
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    head = b"".join(lines)
    stream = request.stream
    assert isinstance(stream, Iterable)  # (a sync client's request)
    body: list[bytes | memoryview] = [part for part in stream if len(part)]
    if chunked:
        framed: list[bytes | memoryview] = []
        for part in body:
            framed += [b"%x\r\n" % memoryview(part).nbytes, part, b"\r\n"]
        body = [*framed, b"0\r\n\r\n"]
    if body and isinstance(body[0], bytes) and len(body[0]) < READ_BYTES:
        return [head + body[0], *body[1:]], close_after  # (a small body: one buffer)
    return [head, *body], close_after


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Write every part, in as few sendmsg calls as the kernel takes them."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:IOV_MAX])
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class _Reader:
    """A response read from a socket: what one read brought beyond what was asked is kept
    for the next ask."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _recv(self, at_least: int = 1) -> bytes:
        try:
            data = self.sock.recv(max(READ_BYTES, at_least))
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "the response timed out") from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc)) from exc
        return data

    def head(self) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        """The status, reason phrase, HTTP version and headers of the next response head."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            data = self._recv()
            if not data:
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response."
                    if not self.buffer
                    else "Server disconnected in the middle of a response's head."
                )
            self.buffer += data
        raw = bytes(self.buffer[:end])
        del self.buffer[: end + 4]
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
        return int(code), reason, version, headers

    def exactly(self, size: int) -> bytes:
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
            try:
                n = self.sock.recv_into(view[at:])
            except TimeoutError as exc:
                raise httpx.ReadTimeout(str(exc) or "the response timed out") from exc
            except OSError as exc:
                raise httpx.ReadError(str(exc)) from exc
            if not n:
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body: "
                    f"received {at} bytes, expected {size}"
                )
            at += n
        return bytes(body)

    def line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            data = self._recv()
            if not data:
                raise httpx.RemoteProtocolError("peer closed connection in a chunked body")
            self.buffer += data
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def chunked(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            size_text = self.line().partition(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise httpx.RemoteProtocolError(f"a bad chunk size: {size_text!r}") from None
            if size == 0:
                while self.line():  # (trailers, up to the blank line)
                    pass
                return b"".join(chunks)
            chunks.append(self.exactly(size))
            if self.line():
                raise httpx.RemoteProtocolError("a chunk longer than its size")

    def until_closed(self) -> bytes:
        chunks = [bytes(self.buffer)]
        self.buffer.clear()
        while data := self._recv():
            chunks.append(data)
        return b"".join(chunks)
