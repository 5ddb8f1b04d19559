"""Where a process finds a compiled program: its own memory, then the host's program store
(service/store.py), and only then the compiler; and where it finds the graph a program
comes from, by the graph's bytes as sent or by its id.

The keys:

- the raw key hashes a graph's bytes exactly as the client sent them (found in the body
  without parsing it: service/request.py `open_envelope`). Its alias entry gives the
  graph's id, so a repeat costs a hash, not a parse and a validation;
- the graph id (`graph_key`) hashes the graph's canonical JSON (keys sorted, no
  whitespace): the id clients see and send back;
- the program key hashes the graph id with what the compiler depends on besides the graph:
  the inputs' and upstream gradients' specs, the path, the device.

All three are taken under a namespace: the version key (gradserve's version, its source,
the op catalog, the device's array library) and the request limits that decide whether a
graph is valid. A program holds no budget: those are checked against it on every use, so
one program serves requests and plans under any budget.

Ids are scoped to tenants: with API keys on, a graph id resolves only for a key that has
sent the graph itself (a grant entry records it), while the programs and graphs below the
ids are shared, being functions of the graph alone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gradserve.engine.backends import get_backend
from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import GraphLike, Program
from gradserve.engine.graph.scan import executed_steps
from gradserve.engine.graph.serial import CorruptProgram, Unstorable, dump_program, load_program
from gradserve.service.settings import Settings
from gradserve.service.store import Store, entry_name, version_key
from gradserve.wire.graph_id import is_graph_id

ALIASES = 8192  # raw keys remembered per process (each ~150 bytes)
EVICT_BEFORE = 0.9  # a preload stops where it would start evicting what it loaded
# A program that took this long to compile is written to the store at once; a cheaper one
# at its second use (its dump and write cost about half its compile: a one-off graph, as
# define-by-run clients send, would pay them for nothing).
STORE_AT_ONCE_MS = 10.0
PENDING = 64  # writes a busy process keeps for its next idle moment
GRANTS = 8192  # (tenant, graph) grants remembered per process


@dataclass
class Found:
    """What a lookup found: the program, and where ("process", "store" or None: a miss),
    with the time a load from the store took."""

    program: Program | None
    source: str | None
    load_ms: float = 0.0


def program_meta(program: Program, device: str) -> dict[str, Any]:
    """What a stored program's entry records beside it: read without loading it."""
    return {
        "device": device,
        "cost": program.compute_cost,
        "peak": program.planned_peak_bytes,
        "steps": executed_steps(program),
    }


class Programs:
    """A process's programs and graphs, over the host's store (none: memory only)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.memory = ProgramCache(settings.program_cache_bytes)
        self.graphs = GraphCache(settings.graph_cache_bytes)
        self._aliases = Lru(ALIASES)  # raw key -> graph id
        self._grants = Lru(GRANTS)  # grant entry name -> True
        self._unstored = Lru(ALIASES)  # program key -> its device: compiled once, cheaply
        s = settings
        self._limits = (
            f"{s.max_nodes},{s.expr_max_chars},{s.expr_max_depth},{s.max_inputs},{s.max_id_chars}"
        )
        self.store = (
            None
            if s.program_store_dir is None or not s.program_store_bytes
            else Store(s.program_store_dir, s.program_store_bytes, self.namespace("cpu"))
        )
        self._raw_prefix = f"{self.namespace('cpu')}\x00".encode()
        self._pending: list[tuple[str, Callable[[], bytes], dict[str, Any]]] = []
        self._reported = (0, 0)  # the store's evictions and damaged entries, last reported
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ keys
    def namespace(self, device: str) -> str:
        return _namespace(_array_library(device), self._limits)

    def raw_key(self, raw: bytes | memoryview) -> str:
        """The key of a graph's bytes as sent: SHA-256 (128 bits of it), collision-resistant
        as a key that grants an id must be, and twice BLAKE2b's speed where the CPU has SHA
        instructions (~0.5 ms a MB); the hash is the whole cost of a repeat's graph."""
        h = hashlib.sha256(self._raw_prefix)
        h.update(raw)
        return h.hexdigest()[:32]

    def program_key(
        self,
        graph_id: str,
        specs: bytes,
        no_grad: bool,
        backward: bool,
        device: str,
        budget: int | None = None,
    ) -> str:
        """The program's key, from the inputs' and upstream gradients' `spec_json`;
        `budget`: the memory budget it was planned for, where that shapes it (a backward
        that may recompute)."""
        return entry_name(
            "p",
            self.namespace(device),
            graph_id,
            specs,
            f"{int(no_grad)}{int(backward)}",
            device,
            "" if budget is None else f"recompute<={budget}",
        )[2:]

    # ------------------------------------------------------------------ graphs and ids
    def alias(self, raw_key: str) -> str | None:
        """The graph id of a graph's bytes seen before (by this process or any other)."""
        graph_id = self._aliases.get(raw_key)
        if graph_id is None and self.store is not None:
            found = self.store.get(f"a-{raw_key}")
            if found is not None:
                graph_id = bytes(found[0]).decode("ascii", "replace")
                self._aliases.put(raw_key, graph_id)
        return graph_id

    def remember_graph(
        self, graph_id: str, graph: GraphLike | None, canonical: bytes, raw_key: str | None
    ) -> int:
        """A graph just validated: held by id (and by its raw key), here and in the store
        (`graph` None: held as its canonical JSON, validated when it is first needed).
        Returns how many graphs the process's cache evicted for it."""
        evicted = self.graphs.put(graph_id, canonical if graph is None else graph)
        if evicted >= 0 and self.store is not None and not self._stored(f"g-{graph_id}"):
            self.store.put(f"g-{graph_id}", canonical)  # (now: the next request may need it)
        if raw_key is not None and self._aliases.get(raw_key) is None:
            self._aliases.put(raw_key, graph_id)
            if self.store is not None:
                self.store.put(f"a-{raw_key}", graph_id.encode())
        return max(evicted, 0)

    def graph(self, graph_id: str, parse: Callable[[bytes], GraphLike]) -> GraphLike | None:
        """The graph with this id, held here or in the store (`parse` makes the store's
        canonical JSON a GraphLike), or None."""
        graph = self.graphs.get(graph_id)
        if isinstance(graph, bytes):  # (held as its canonical JSON)
            graph = parse(graph)
            self.graphs.replace(graph_id, graph)
        elif graph is None and self.store is not None and is_graph_id(graph_id):
            found = self.store.get(f"g-{graph_id}")
            if found is not None:
                graph = parse(bytes(found[0]))
                self.graphs.put(graph_id, graph)
        return graph

    def granted(self, tenant: str | None, graph_id: str) -> bool:
        """Whether `tenant` may use `graph_id` (always, with API keys off)."""
        if tenant is None:
            return True
        name = _grant_name(tenant, graph_id)
        if self._grants.get(name):
            return True
        if self.store is not None and self.store.get(name) is not None:
            self._grants.put(name, True)
            return True
        return False

    def grant(self, tenant: str | None, graph_id: str) -> None:
        """`tenant` sent the graph itself: its id is theirs to use from now on."""
        if tenant is None:
            return
        name = _grant_name(tenant, graph_id)
        if not self._grants.get(name):
            self._grants.put(name, True)
            if self.store is not None and self.store.get(name) is None:
                self.store.put(name, b"")

    # ------------------------------------------------------------------ programs
    def find(self, key: str, device: str) -> Found:
        """The program of `key`: from this process's memory, else from the store (loaded,
        and kept in memory), else a miss."""
        program = self.memory.get(key)
        if program is not None:
            device_of = self._unstored.pop(key, None)
            if device_of is not None:  # its second use: worth keeping for the others
                self._store_program(key, program, device_of)
            return Found(program, "process")
        if self.store is not None:
            started = time.perf_counter()
            found = self.store.get(f"p-{key}")
            if found is not None:
                try:
                    program = load_program(found[0], device)
                except CorruptProgram:
                    self.store.discard(f"p-{key}")  # (whole, its CRC right, and still wrong)
                else:
                    self.memory.put(key, program)
                    return Found(program, "store", (time.perf_counter() - started) * 1000)
        return Found(None, None)

    def remember(self, key: str, program: Program, device: str, compile_ms: float) -> int:
        """A program just compiled: kept in memory; written to the store after the answer
        when compiling it again would cost another process STORE_AT_ONCE_MS or more, and
        else at its second use (a graph that changes with every request, define-by-run,
        is not written at all). Returns how many programs the memory evicted for it."""
        evicted = self.memory.put(key, program)
        if compile_ms >= STORE_AT_ONCE_MS:
            self._store_program(key, program, device)
        elif self.store is not None:
            self._unstored.put(key, device)
        return evicted

    def _store_program(self, key: str, program: Program, device: str) -> None:
        self._defer(f"p-{key}", lambda: dump_program(program), program_meta(program, device))

    def store_held(self) -> None:
        """Write every program this process holds that the store lacks (those compiled
        once, cheaply, and waiting for their second use), now: a worker that is being
        replaced does, so that its successor loads them rather than compiling them again."""
        for key, device in list(self._unstored.items()):
            program = self.memory.get(key)
            if program is not None:
                self._store_program(key, program, device)
        self._unstored.clear()
        self.flush()

    def preload(self, keys: Sequence[str] | None, seconds: float) -> tuple[float, ...]:
        """Load programs from the store into memory before this process takes work:
        `keys` (those of a worker it replaces, the most recent first), or None: the store's
        most recently written or used. Within `seconds`, and the memory's bound; the time
        each load took, in ms."""
        if self.store is None:
            return ()
        deadline = time.monotonic() + seconds
        names = [f"p-{k}" for k in keys] if keys is not None else self.store.recent("p", 256)
        loads: list[float] = []
        for name in names:
            if (
                time.monotonic() > deadline
                or self.memory.bytes >= EVICT_BEFORE * self.memory.max_bytes
            ):
                break
            meta = self.store.meta(name)  # (None: gone, or another version's)
            device = meta.get("device") if meta else None
            if isinstance(device, str):
                with contextlib.suppress(GradserveError):  # (a device this host lacks)
                    found = self.find(name[2:], device)
                    if found.source == "store":
                        loads.append(found.load_ms)
        return tuple(loads)

    # ------------------------------------------------------------------ writing
    def _defer(
        self, name: str, payload: Callable[[], bytes], meta: dict[str, Any] | None = None
    ) -> None:
        if self.store is not None:
            with self._lock:
                self._pending.append((name, payload, meta or {}))
                if len(self._pending) > PENDING:  # (busy, never idle: the oldest waits no
                    del self._pending[0]  # longer; its program stays in memory)

    def changes(self) -> tuple[int, int]:
        """The store's evictions and damaged entries seen by this process since it was
        last asked (for the front process's metrics)."""
        if self.store is None:
            return 0, 0
        with self._lock:
            evictions, damaged = self.store.evictions, self.store.damaged
            before, self._reported = self._reported, (evictions, damaged)
        return evictions - before[0], damaged - before[1]

    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Write what the last requests left for the store (called after their answers,
        off the request path)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for entry in pending:
            self._write(*entry)

    def _write(self, name: str, payload: Callable[[], bytes], meta: dict[str, Any]) -> None:
        assert self.store is not None
        try:
            data = payload()
        except Unstorable:
            return  # (a program the format cannot express stays in memory only)
        self.store.put(name, data, meta)

    def _stored(self, name: str) -> bool:
        return self.store is not None and self.store.meta(name) is not None


# ---------------------------------------------------------------- process-wide caches


class ProgramCache:
    """Compiled programs by their key, bounded by their estimated bytes, least recently
    used first out. A Program is read-only to `execute`, so one serves many threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[Hashable, Program] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Program | None:
        with self._lock:
            program = self._items.get(key)
            if program is not None:
                self._items.move_to_end(key)
            return program

    def put(self, key: Hashable, program: Program) -> int:
        """Keep `program` (unless it alone is over the bound); returns how many were
        evicted to make room."""
        size = program.estimated_bytes
        if size > self.max_bytes:
            return 0
        evicted = 0
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.estimated_bytes
            self._items[key] = program
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self.bytes -= gone.estimated_bytes
                evicted += 1
            self.evictions += evicted
        return evicted

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class GraphCache:
    """Graphs by id, as the compiler takes them, bounded by an estimate of their bytes,
    least recently used first out (the store below keeps them for every process)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[GraphLike | bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, graph_id: str) -> GraphLike | bytes | None:
        with self._lock:
            item = self._items.get(graph_id)
            if item is None:
                return None
            self._items.move_to_end(graph_id)
            return item[0]

    def put(self, graph_id: str, graph: GraphLike | bytes) -> int:
        """Hold `graph` (or its canonical JSON; unless it alone is over the bound); returns
        how many were evicted to make room, or -1 when it was held already."""
        with self._lock:
            if graph_id in self._items:
                self._items.move_to_end(graph_id)
                return -1
            return self._hold(graph_id, graph)

    def replace(self, graph_id: str, graph: GraphLike) -> None:
        """A graph held as its canonical JSON, now parsed."""
        with self._lock:
            item = self._items.pop(graph_id, None)
            if item is not None:
                self.bytes -= item[1]
            self._hold(graph_id, graph)

    def _hold(self, graph_id: str, graph: GraphLike | bytes) -> int:
        size = len(graph) if isinstance(graph, bytes) else graph_bytes(graph)
        if size > self.max_bytes:
            return 0
        self._items[graph_id] = (graph, size)
        self.bytes += size
        evicted = 0
        while self.bytes > self.max_bytes:
            _, (_, gone) = self._items.popitem(last=False)
            self.bytes -= gone
            evicted += 1
        return evicted

    def __len__(self) -> int:
        return len(self._items)


def graph_bytes(graph: GraphLike) -> int:
    """What a held graph takes, bounded: 600 bytes a node (measured with tracemalloc: 370 a
    node on the 30,000-node chain, 420 on the recurrent cell, its NodeSpecs with their args
    and attrs; a loop body's nodes count too)."""
    return 600 * (1 + count_nodes(graph.nodes))


def count_nodes(nodes: Any) -> int:
    """A graph's nodes, a loop body's included."""
    return sum(1 + (count_nodes(n.body.nodes) if n.body is not None else 0) for n in nodes)


class Lru(OrderedDict[Any, Any]):
    """A dict bounded to `limit` items, least recently used out (thread-safe enough for
    hints: a lost update is a miss)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        if value is not default:
            with contextlib.suppress(KeyError):
                self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        if len(self) > self.limit:
            with contextlib.suppress(KeyError):
                self.popitem(last=False)


def _grant_name(tenant: str, graph_id: str) -> str:
    return entry_name("t", tenant, graph_id)


def spec_json(inputs: Hashable, grad_outputs: Hashable) -> bytes:
    """`_spec_key` tuples of the inputs and upstream gradients as a program key holds them."""
    return orjson.dumps([_specs_json(inputs), _specs_json(grad_outputs)])


def _specs_json(specs: Any) -> Any:
    """`_spec_key` tuples (name, shape, numpy dtype, requires_grad) as JSON values."""
    if specs is None:
        return None
    return [[name, list(shape), dtype.name, rg] for name, shape, dtype, rg in specs]


def _array_library(device: str) -> str:
    """The array library that runs a device's programs, with its version (not remembered:
    tests swap the CPU's namespace)."""
    xp = get_backend(device).xp
    name = getattr(xp, "__name__", type(xp).__name__)
    return f"{name} {getattr(xp, '__version__', '')}"


@functools.lru_cache(maxsize=64)
def _namespace(library: str, limits: str) -> str:
    return f"{version_key(library)}/{limits}"
