"""The contract between the edge adapter and the installed uvicorn.

service/protocol.py subclasses uvicorn's two HTTP protocol classes, and its adapter
(`_Uvicorn`) reads, writes and overrides what uvicorn keeps private; `UVICORN_ATTRIBUTES`
lists each. These tests check, on the installed uvicorn (pinned in pyproject.toml; bump both
together), that each entry exists with its kind and parameters, and that it behaves as the
policy relies on; and, by reading the module's source, that the adapter declares everything
it touches and that nothing outside it touches uvicorn. Everything runs in process, on
fake transports: no socket is opened.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import tomllib
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gradserve.service import protocol
from gradserve.service.protocol import UVICORN_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(protocol.__file__).read_text()

PROTOCOLS = [HttpToolsProtocol, H11Protocol]
ADAPTER = "_Uvicorn"
NAMES = {entry.name for entry in UVICORN_ATTRIBUTES}
OVERRIDES = {e.name for e in UVICORN_ATTRIBUTES if e.owner == "protocol" and e.use == "override"}
# The values held by a connection's protocol whose own attributes the adapter reads.
NESTED = {e.owner for e in UVICORN_ATTRIBUTES} - {"protocol"}

App = Callable[
    [
        dict[str, Any],
        Callable[[], Awaitable[dict[str, Any]]],
        Callable[[dict[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]


# ----------------------------------------------------------------------------- helpers
class FakeTransport(asyncio.Transport):
    """A connection's transport that keeps what is written, as a socket's would send it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True
        self.eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True


def _connection(cls: type, app: App) -> tuple[Any, FakeTransport, ServerState]:
    """A connection made on a protocol of class `cls` serving `app`, created as uvicorn's
    server creates it (server.py, `create_protocol`: by keyword); call in a running loop."""
    config = uvicorn.Config(
        app, http=cls, ws="none", lifespan="off", log_config=None, access_log=False
    )
    config.load()
    state = ServerState()
    conn = cls(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport, state


async def _until(condition: Callable[[], bool], seconds: float = 5) -> None:
    """Let the loop run (the request's task) until `condition` holds."""

    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(wait(), seconds)


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, then answers it."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _post(length: int) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


# ----------------------------------------------------------------------------- the pin
def test_the_installed_uvicorn_is_the_pinned_one() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [
        r
        for r in project["optional-dependencies"]["server"]
        if r.replace(" ", "").startswith(("uvicorn=", "uvicorn>", "uvicorn<", "uvicorn~"))
    ]
    assert pins == [f"uvicorn=={version('uvicorn')}"], (
        "the adapter is checked against the installed uvicorn: pin that version "
        "(pyproject.toml, the server extra), and run this test after any bump",
        pins,
    )


# ----------------------------------------------------------------------------- the entries
@pytest.mark.parametrize("cls", PROTOCOLS)
def test_each_entry_exists_with_its_kind(cls: type) -> None:
    async def run() -> None:
        conn, transport, state = _connection(cls, _echo)
        assert conn.cycle is None  # no request yet
        conn.data_received(_post(10) + b"01234")  # a head, and half the body
        owners = {"protocol": conn, "cycle": conn.cycle, "flow": conn.flow, "server_state": state}
        for entry in UVICORN_ATTRIBUTES:
            if entry.params is not None:  # a method the adapter overrides
                method = getattr(cls, entry.name, None)
                assert callable(method), entry
                assert any(
                    entry.name in vars(k)
                    for k in cls.__mro__
                    if k.__module__.startswith("uvicorn.")
                ), (entry, "not uvicorn's own")
                params = list(inspect.signature(method).parameters)
                assert params[0] == "self" and tuple(params[1:]) == entry.params, (entry, params)
                continue
            owner = owners[entry.owner]
            assert hasattr(owner, entry.name), entry
            value = getattr(owner, entry.name)
            if entry.kind is None:
                assert value is not None, entry
            else:
                assert isinstance(value, entry.kind), (entry, type(value))
        assert conn.transport is transport
        conn.data_received(b"56789")
        await _until(lambda: conn.cycle.response_complete)

    asyncio.run(run())


# ----------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("cls", PROTOCOLS)
def test_a_connection_is_one_of_the_servers_until_it_is_lost(cls: type) -> None:
    async def run() -> None:
        conn, _, state = _connection(cls, _echo)
        assert state.connections == {conn}
        assert conn.tasks is state.tasks  # the server's request tasks, all connections'
        conn.connection_lost(None)
        assert state.connections == set()

    asyncio.run(run())


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_a_request_cycle_follows_its_request(cls: type) -> None:
    completed: list[bool] = []

    class Recording(cls):  # type: ignore[misc, valid-type]
        def on_response_complete(self) -> None:
            completed.append(self.cycle.response_complete)
            super().on_response_complete()

    async def run() -> None:
        conn, transport, state = _connection(Recording, _echo)
        conn.data_received(_post(10)[:20])  # a head begun: no request yet
        assert conn.cycle is None
        conn.data_received(_post(10)[20:] + b"01234")
        first = conn.cycle
        assert first is not None and first.scope["method"] == "POST"
        assert first.scope["path"] == "/echo"
        assert first.more_body and not first.response_started and not first.response_complete
        assert len(state.tasks) == 1  # the request runs, as a task of the server's
        await asyncio.sleep(0.01)
        assert first.more_body and not first.response_started  # the app waits for the rest
        conn.data_received(b"56789")
        assert not first.more_body  # the body is complete
        await _until(lambda: first.response_complete)
        assert first.response_started and completed == [True]
        assert transport.written.startswith(b"HTTP/1.1 200 ")
        assert transport.written.endswith(b"0123456789")
        await _until(lambda: not state.tasks)
        conn.data_received(GET)  # the next request: a new cycle
        assert conn.cycle is not first and conn.cycle is not None
        await _until(lambda: conn.cycle.response_complete)
        assert completed == [True, True] and not transport.closed

    asyncio.run(run())


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_the_app_is_read_at_each_request_head(cls: type) -> None:
    # The probe reserve and draining replace `app` on a connection that is open.
    async def no_content(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def run() -> None:
        conn, transport, _ = _connection(cls, _echo)
        conn.app = no_content
        conn.data_received(GET)
        await _until(lambda: conn.cycle.response_complete)
        assert transport.written.startswith(b"HTTP/1.1 204 ")

    asyncio.run(run())


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_reading_pauses_while_the_app_is_behind_on_the_body(cls: type) -> None:
    # The body deadline does not run against a client while the app is not reading.
    release = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()
        await _echo(scope, receive, send)

    async def run() -> None:
        conn, transport, _ = _connection(cls, slow)
        assert conn.flow.read_paused is False
        conn.data_received(_post(200_000))
        for _ in range(10):  # 100 kB, more than uvicorn keeps unread
            conn.data_received(b"x" * 10_000)
        cycle = conn.cycle
        assert cycle.more_body and not cycle.response_started
        assert conn.flow.read_paused is True and not transport.reading
        release.set()
        await _until(lambda: not conn.flow.read_paused)  # the app reads: reading resumes
        assert transport.reading

    asyncio.run(run())


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_an_abandoned_request_sees_a_disconnect_and_sends_nothing(cls: type) -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})

    async def run() -> None:
        conn, transport, state = _connection(cls, app)
        conn.data_received(_post(10) + b"01")
        await _until(lambda: seen == ["http.request"])
        cycle = conn.cycle
        cycle.disconnected = True  # what the adapter's `_uv_abandon_request` does
        cycle.message_event.set()
        await _until(lambda: not state.tasks)
        assert seen == ["http.request", "http.disconnect"]
        assert transport.written == b""  # nothing the app sent reached the socket

    asyncio.run(run())


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_shutdown_closes_an_idle_connection_and_lets_a_busy_one_finish(cls: type) -> None:
    async def run() -> None:
        idle, idle_transport, _ = _connection(cls, _echo)
        idle.shutdown()
        assert idle_transport.closed
        busy, transport, _ = _connection(cls, _echo)
        busy.data_received(_post(10) + b"01234")
        busy.shutdown()
        assert not transport.closed
        busy.data_received(b"56789")
        await _until(lambda: busy.cycle.response_complete)
        assert transport.written.startswith(b"HTTP/1.1 200 ") and transport.closed

    asyncio.run(run())


# ----------------------------------------------------------------------------- the source
def _nodes(tree: ast.AST) -> Iterator[tuple[str | None, ast.AST]]:
    """Each node, with the name of the innermost class it is in (None: none)."""

    def visit(node: ast.AST, cls: str | None) -> Iterator[tuple[str | None, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            yield cls, child
            yield from visit(child, child.name if isinstance(child, ast.ClassDef) else cls)

    yield from visit(tree, None)


def _protocol_classes() -> set[str]:
    """The module's classes that are connection protocols (through the adapter)."""
    return {
        name
        for name, value in vars(protocol).items()
        if isinstance(value, type)
        and issubclass(value, protocol._Uvicorn)
        and value is not protocol._Uvicorn
    }


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_super(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _outside_the_adapter(tree: ast.AST, protocols: set[str]) -> list[str]:
    """Where code outside the adapter touches a name of uvicorn's that the adapter
    declares: `x.<name>` for any `x` (but `self.<name>` in a class that is no protocol: its
    own attribute), a protocol's method that overrides uvicorn's, `super()` in a protocol,
    and getattr and friends with such a name."""
    found = []
    for cls, node in _nodes(tree):
        if cls == ADAPTER:
            continue
        in_protocol = cls in protocols
        line = getattr(node, "lineno", "?")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in NAMES
            and (in_protocol or not _is_self(node.value))
        ):
            found.append(f"line {line}: {ast.unparse(node)}")
        elif (
            in_protocol
            and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (node.name in NAMES)
        ):
            found.append(f"line {line}: def {node.name} (overrides uvicorn's)")
        elif in_protocol and _is_super(node):
            found.append(f"line {line}: super() (reaches uvicorn's methods)")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr", "delattr"}
            and any(isinstance(a, ast.Constant) and a.value in NAMES for a in node.args)
        ):
            found.append(f"line {line}: {ast.unparse(node)}")
    return found


def _adapter_uses(tree: ast.AST) -> dict[tuple[str, str], set[str]]:
    """What the adapter does with each name of uvicorn's: {(owner, name): uses}."""
    [adapter] = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == ADAPTER]
    own = set(vars(protocol._Uvicorn)) - NAMES
    uses: dict[tuple[str, str], set[str]] = defaultdict(set)
    for fn in adapter.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if fn.name not in own:  # an override of uvicorn's method
            uses["protocol", fn.name].add("override")
        aliases = {  # a local name for a value held by the protocol: `cycle = self.cycle`
            target.id: value.attr
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign)
            for target, value in [(node.targets[0], node.value)]
            if isinstance(target, ast.Name)
            and isinstance(value, ast.Attribute)
            and _is_self(value.value)
            and value.attr in NESTED
        }
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute):
                continue
            use = "write" if isinstance(node.ctx, ast.Store | ast.Del) else "read"
            value = node.value
            if _is_self(value) and node.attr not in own:
                uses["protocol", node.attr].add(use)
            elif _is_super(value):
                assert node.attr == fn.name, f"{fn.name} calls uvicorn's {node.attr}"
                uses["protocol", node.attr].add("override")
            elif (
                isinstance(value, ast.Attribute)
                and _is_self(value.value)
                and (value.attr in NESTED)
            ):
                uses[value.attr, node.attr].add(use)
            elif isinstance(value, ast.Name) and value.id in aliases:
                uses[aliases[value.id], node.attr].add(use)
    return dict(uses)


def test_nothing_outside_the_adapter_touches_uvicorn() -> None:
    protocols = _protocol_classes()
    assert {"_Guard", "HttpToolsGuard", "H11Guard"} <= protocols
    found = _outside_the_adapter(ast.parse(SOURCE), protocols)
    assert not found, (
        "service/protocol.py touches uvicorn outside its adapter (`_Uvicorn`): "
        "go through an `_uv_...` method or an `_on_...` hook",
        found,
    )


def test_the_check_finds_what_it_looks_for() -> None:
    leaky = ast.parse(
        "class _Guard(_Uvicorn):\n"
        "    def connection_made(self, transport):\n"
        "        super().connection_made(transport)\n"
        "    def check(self, now):\n"
        "        return self.cycle.more_body or getattr(self, 'flow')\n"
        "class _Watchdog:\n"
        "    def sweep(self, conn):\n"
        "        return self.loop, conn.transport\n"
    )
    found = _outside_the_adapter(leaky, {"_Guard"})
    assert [f.split(":", 1)[1].strip() for f in found] == [
        "def connection_made (overrides uvicorn's)",
        "super().connection_made",
        "super() (reaches uvicorn's methods)",
        "self.cycle.more_body",
        "self.cycle",
        "getattr(self, 'flow')",
        "conn.transport",  # but not the watchdog's own `self.loop`
    ]


def test_the_adapter_declares_all_it_touches_and_nothing_more() -> None:
    uses = _adapter_uses(ast.parse(SOURCE))
    declared = {(e.owner, e.name): set(e.use.split(", ")) for e in UVICORN_ATTRIBUTES}
    assert len(declared) == len(UVICORN_ATTRIBUTES), "an entry is declared twice"
    assert uses == declared
    for entry in UVICORN_ATTRIBUTES:  # a method's parameters are given, a value's are not
        assert (entry.params is not None) == (entry.use == "override"), entry
    # The type checker's view of uvicorn's classes declares nothing the adapter does not.
    stub = set(protocol._UvicornHTTP.__annotations__)
    stub |= {k for k, v in vars(protocol._UvicornHTTP).items() if inspect.isfunction(v)}
    assert stub <= {e.name for e in UVICORN_ATTRIBUTES if e.owner == "protocol"}


def test_the_guard_classes_put_the_adapter_between_policy_and_uvicorn() -> None:
    for guard, base in [
        (protocol.HttpToolsGuard, HttpToolsProtocol),
        (protocol.H11Guard, H11Protocol),
    ]:
        mro = guard.__mro__
        assert mro.index(protocol._Guard) < mro.index(protocol._Uvicorn) < mro.index(base)
    assert protocol.GradserveProtocol in (protocol.HttpToolsGuard, protocol.H11Guard)


@pytest.mark.parametrize("cls", PROTOCOLS)
def test_no_name_of_ours_shadows_one_of_uvicorns(cls: type) -> None:
    # The adapter and the policy live on uvicorn's own instance: a name they add (a method,
    # an attribute) that uvicorn also uses would silently break one or the other.
    tree = ast.parse(SOURCE)
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in {ADAPTER, "_Guard"}:
            ours |= set(vars(getattr(protocol, node.name)))
            ours |= {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and _is_self(n.value)
            }
    ours = {n for n in ours if not (n.startswith("__") and n.endswith("__"))} - NAMES

    async def uvicorns() -> set[str]:
        conn, _, _ = _connection(cls, _echo)
        conn.data_received(_post(10) + b"0123456789")  # what a request sets, too
        await _until(lambda: conn.cycle.response_complete)
        conn.connection_lost(None)
        return set(dir(cls)) | set(vars(conn))

    assert ours and not ours & asyncio.run(uvicorns())
