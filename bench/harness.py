"""How the benchmarks measure: the in-process adapter to the engine, the agreement check,
timers and medians, the table, the process tree's RSS and CPU, and a raw HTTP/1.1 client."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import math
import os
import select
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from bench.workloads import (
    CELL_STEPS,
    Arrays,
    Graph,
    Workload,
    cell_bodies,
    recurrent_data,
    recurrent_numpy,
    renamed_cell_bodies,
)
from gradserve.engine.graph import TensorSpec, compile_graph, execute
from gradserve.service.schemas import Graph as GraphModel
from tests.support.server import Server

try:
    import torch
except ImportError:  # PyTorch comes with the test extra
    torch = None  # type: ignore[assignment]

Parts = list[bytes | memoryview]
Response = tuple[int, dict[str, str], np.ndarray]  # status, headers (lower case), body
HOST = "127.0.0.1"
MiB = 1 << 20
GiB = 1 << 30
PHASE_LIMIT_S = 120.0
SAMPLE_INTERVAL_S = 0.05


class Gradserve:
    """gradserve in-process: compile a JSON graph once, run it many times, with
    `engine.graph.compile_graph` and `engine.graph.execute` as service/compute.py calls
    them (NumPy arrays in and out). `run_graph` is the path of a client that just sends a
    graph: the service's key (a hash of the canonical graph, and the inputs' specs), the
    service's program cache, compile on a miss, then run."""

    def __init__(self) -> None:
        from gradserve.engine import graph as eg
        from gradserve.service.programs import ProgramCache
        from gradserve.wire.graph_id import graph_key

        self._graph = eg
        self._graph_key = graph_key
        self._cache = ProgramCache(256 << 20)  # the service's default bound

    def compile(
        self,
        graph: Graph,
        inputs: Arrays,
        requires_grad: list[str],
        grad_outputs: Arrays | None = None,
        no_grad: bool = False,
    ) -> Any:
        eg = self._graph
        spec = eg.GraphSpec(
            nodes=[
                eg.NodeSpec(
                    id=n["id"],
                    op=n.get("op"),
                    args=n.get("args", ()),
                    attrs=n.get("attrs", {}),
                    expr=n.get("expr"),
                )
                for n in graph["nodes"]
            ],
            outputs=graph["outputs"],
        )
        wanted = frozenset(() if no_grad else requires_grad)
        specs = {k: eg.TensorSpec(a.shape, a.dtype.name, k in wanted) for k, a in inputs.items()}
        go_specs = (
            None
            if grad_outputs is None
            else {k: eg.TensorSpec(a.shape, a.dtype.name) for k, a in grad_outputs.items()}
        )
        return eg.compile_graph(
            spec, specs, no_grad=no_grad, backward=not no_grad, grad_outputs=go_specs
        )

    def run(
        self, program: Any, inputs: Arrays, grad_outputs: Arrays | None = None
    ) -> tuple[Arrays, Arrays, dict[str, Any]]:
        """(outputs, gradients, meta): NumPy arrays in and out."""
        r = self._graph.execute(program, inputs, grad_outputs=grad_outputs)
        outputs = {k: np.asarray(a) for k, a in r.outputs.items()}
        gradients = {k: np.asarray(a) for k, a in (r.gradients or {}).items()}
        meta = {
            "nodes": r.nodes,
            "peak_bytes": r.peak_bytes,
            "planned_peak_bytes": r.planned_peak_bytes,
            "timings_ms": r.timings_ms,
        }
        return outputs, gradients, meta

    def run_graph(
        self,
        graph: Graph,
        inputs: Arrays,
        requires_grad: list[str],
        grad_outputs: Arrays | None = None,
        no_grad: bool = False,
    ) -> tuple[Arrays, Arrays, dict[str, Any]]:
        """Compile only on a cache miss, keyed as the service keys programs."""
        key = (
            self._graph_key(graph),
            tuple((k, a.shape, a.dtype.str, k in requires_grad) for k, a in inputs.items()),
            None
            if grad_outputs is None
            else tuple((k, a.shape, a.dtype.str) for k, a in grad_outputs.items()),
            no_grad,
        )
        program = self._cache.get(key)
        if program is None:
            program = self.compile(graph, inputs, requires_grad, grad_outputs, no_grad)
            self._cache.put(key, program)
        return self.run(program, inputs, grad_outputs)


def run_gradserve(
    w: Workload, gs: Gradserve, compiled: Any = None
) -> tuple[np.ndarray, Arrays, dict[str, Any]]:
    if compiled is None:
        compiled = gs.compile(w.graph, w.inputs, w.wrt, w.grad_outputs, w.no_grad)
    outputs, grads, meta = gs.run(compiled, w.inputs, w.grad_outputs)
    if w.gs_gradients is not None:
        grads = w.gs_gradients(grads)
    return outputs[w.output], grads, meta


def check(w: Workload, gs: Gradserve) -> dict[str, Any]:
    """All implementations agree on the value and the gradients, or AssertionError.
    Returns gradserve's meta."""
    value, grads, meta = run_gradserve(w, gs)
    results = {"gradserve": (value, grads)}
    for name, impl in (("numpy", w.numpy), ("torch", w.torch)):
        if impl is not None:
            results[name] = impl(w.base_inputs)
    ref_name = "torch" if "torch" in results else "numpy"
    if ref_name not in results:
        return meta
    ref_value, ref_grads = results[ref_name]
    rtol = 1e-4 if np.asarray(ref_value).dtype == np.float32 else 1e-8
    for name, (v, g) in results.items():
        if name == ref_name:
            continue
        close_to(v, ref_value, rtol, f"{w.name}: value, {name} vs {ref_name}")
        if set(g) != set(ref_grads):
            raise AssertionError(
                f"{w.name}: {name} has gradients {sorted(g)}, {ref_name} {sorted(ref_grads)}"
            )
        for k in ref_grads:
            close_to(g[k], ref_grads[k], rtol, f"{w.name}: gradient {k!r}, {name} vs {ref_name}")
    return meta


def close_to(actual: Any, expected: Any, rtol: float, what: str) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != {e.shape}")
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    # Relative to each element, with an absolute floor at the tensor's scale: sums of
    # float32 terms in another order differ by about eps * (the largest term).
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)


def time_once(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(
    fns: dict[str, Callable[[], object]], rounds: int, budget_s: float
) -> dict[str, list[float]]:
    """Per contender, one median per round; each round runs every contender in turn.
    Callers warm the contenders up first (the correctness check does)."""
    repeats = {
        k: max(1, min(2000, int(budget_s / max(time_once(fn), 1e-9)))) for k, fn in fns.items()
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        gc.collect()
        for k, fn in fns.items():
            samples[k].append(statistics.median(time_once(fn) for _ in range(repeats[k])))
    return samples


def median_ratio(samples: dict[str, list[float]], a: str, b: str) -> float | None:
    if a not in samples or b not in samples:
        return None
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


def stack() -> str:
    """The HTTP parser and event loop uvicorn picks by default ("auto")."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {http} + {loop}"


MAX_SECONDS_PER_RUN = 30.0


async def _connection(
    port: int, requests: Iterator[bytes], count: int, stop_at: float, latencies: list[float]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(count):
            if time.monotonic() > stop_at:
                break
            request = next(requests)
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"status {status}")
    finally:
        writer.close()


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _load(
    port: int, path: str, body: bytes | Iterator[bytes], total: int, concurrency: int
) -> tuple[list[float], float]:
    """`body`: one body for every request, or an iterator with a body per request."""
    if isinstance(body, bytes):
        requests: Iterator[bytes] = itertools.repeat(_request(path, body))
    else:
        requests = (_request(path, b) for b in body)
    latencies: list[float] = []
    stop_at = time.monotonic() + MAX_SECONDS_PER_RUN
    t0 = time.perf_counter()
    await asyncio.gather(
        *(
            _connection(port, requests, total // concurrency, stop_at, latencies)
            for _ in range(concurrency)
        )
    )
    return latencies, time.perf_counter() - t0


def http_latency(
    port: int,
    path: str,
    body: bytes | Iterator[bytes],
    total: int,
    concurrency: int,
    warmup: int = 200,
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) of `total` POSTs to `path` from `concurrency` keep-alive
    connections (at most MAX_SECONDS_PER_RUN), after `warmup` of them."""
    asyncio.run(_load(port, path, body, min(total, warmup), concurrency))
    latencies, seconds = asyncio.run(_load(port, path, body, total, concurrency))
    ms = np.array(latencies) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(ms) / seconds


def check_cell(gs_base: str, torch_base: str, gs_body: bytes, torch_body: bytes) -> None:
    """Both endpoints agree with bench.workloads' hand-written NumPy cell, or raise."""
    loss, grads = recurrent_numpy(recurrent_data(CELL_STEPS))
    r = httpx.post(
        gs_base + "/backward",
        content=gs_body,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    r.raise_for_status()
    gs = orjson.loads(r.content)
    gs_grads = {k: np.array(gs["gradients"][k]["data"]) for k in ("w", "u", "b", "h0")}
    gs_grads["xs"] = np.stack([gs["gradients"][f"x{t}"]["data"] for t in range(CELL_STEPS)])
    r = httpx.post(
        torch_base + "/cell",
        content=torch_body,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    r.raise_for_status()
    pt = orjson.loads(r.content)
    pt_grads = {k: np.array(v) for k, v in pt["gradients"].items()}
    for name, value, got in (
        ("gradserve", gs["outputs"]["loss"]["data"], gs_grads),
        ("FastAPI+PyTorch", pt["loss"], pt_grads),
    ):
        np.testing.assert_allclose(value, loss, rtol=1e-4, err_msg=f"{name}: loss")
        assert set(got) == set(grads), (name, sorted(got))
        for k, g in grads.items():
            np.testing.assert_allclose(
                got[k], g, rtol=1e-4, atol=1e-4 * np.abs(g).max(), err_msg=f"{name}: gradient {k}"
            )


def cell_rounds(
    rounds: int, gs_port: int, torch_port: int, total: int
) -> dict[str, tuple[float, ...]]:
    """Per endpoint, the medians over rounds of (p50, p99, req/s); and the medians of the
    per-round p50 ratios against FastAPI + PyTorch."""
    warm, cold, torch_body = cell_bodies()
    renamed = renamed_cell_bodies()
    samples: dict[str, list[tuple[float, float, float]]] = {
        "torch": [],
        "warm": [],
        "cold": [],
        "compiled": [],
    }
    for _ in range(rounds):
        samples["torch"].append(http_latency(torch_port, "/cell", torch_body, total, 1, warmup=20))
        samples["warm"].append(http_latency(gs_port, "/backward", warm, total, 1, warmup=20))
        samples["cold"].append(http_latency(gs_port, "/backward", iter(cold), total, 1, warmup=20))
        samples["compiled"].append(
            http_latency(gs_port, "/backward", iter(renamed), total, 1, warmup=20)
        )
    out: dict[str, tuple[float, ...]] = {
        k: tuple(statistics.median(col) for col in zip(*v, strict=True)) for k, v in samples.items()
    }
    for k in ("warm", "cold", "compiled"):
        out[k + "/torch"] = (
            statistics.median(
                s[0] / t[0] for s, t in zip(samples[k], samples["torch"], strict=True)
            ),
        )
    return out


class RawClient:
    """A minimal blocking HTTP/1.1 client on one keep-alive socket: the head, then each
    part of the body as it lies (no joined copy); the response body read straight into one
    buffer of its Content-Length (uninitialised: `bytearray(n)` would zero it first, with
    the GIL held)."""

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self.port, self.timeout = port, timeout
        self.sock = self._connect()
        self.sent = 0  # bytes of the last request, head included

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _closed_by_server(self) -> bool:
        """Whether the server has closed this idle keep-alive connection (uvicorn closes
        one after 5 s by default), as an HTTP client checks before reusing one."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def post(self, path: str, parts: Parts, headers: Sequence[tuple[str, str]] = ()) -> Response:
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        head = "".join(
            [
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n",
                *(f"{k}: {v}\r\n" for k, v in headers),
                "\r\n",
            ]
        ).encode()
        self.sent = len(head) + length
        if self._closed_by_server():
            self.sock.close()
            self.sock = self._connect()
        try:
            self.sock.sendall(head)
            for view in views:
                self.sock.sendall(view)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The server answered before the body was all sent (a 408 for a body that came
            # too slowly, a 413, a 503) and closed: that answer is the response, if it can
            # still be read. The connection is spent either way.
            try:
                return self._response(early=True)
            except OSError:
                raise ConnectionError(
                    f"the server closed the connection while {path}'s body was being sent, "
                    "and no answer could be read"
                ) from exc
        return self._response()

    def _response(self, early: bool = False) -> Response:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(
                    "the server closed the connection"
                    + (" before the body was all sent" if early else "")
                )
            data += chunk
        raw_head, _, rest = data.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "content-length" not in fields:
            raise RuntimeError(f"no Content-Length in the response ({lines[0]})")
        body = np.empty(int(fields["content-length"]), np.uint8)
        view = memoryview(body)
        view[: len(rest)] = rest
        at = len(rest)
        while at < len(body):
            n = self.sock.recv_into(view[at:])
            if not n:
                raise ConnectionError("the server closed the connection mid-body")
            at += n
        return status, fields, body


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ---------------------------------------------------------------- the server's process tree
class TreeMonitor:
    """RSS and CPU time of processes (one or several roots) and all their descendants.

    CPU: a descendant that exits takes its CPU time with it, unless its parent reaps it
    (then the time moves into the parent's children_user/children_system). So the total is
    the live processes' own times plus the larger of two views of the dead ones: the live
    processes' children_* fields, and the last times read of each descendant seen alive (the
    latter also covers one orphaned and reaped by init). Call `poll` often (the Sampler
    does) so that short-lived workers are seen.
    """

    def __init__(self, *pids: int) -> None:
        self.roots = [psutil.Process(pid) for pid in pids]
        self._lock = threading.Lock()
        self._own: dict[tuple[int, float], float] = {}  # (pid, create_time) -> user+system
        self._alive: set[tuple[int, float]] = set()
        self._children_now = 0.0
        self._children_base: float | None = None

    def processes(self) -> list[psutil.Process]:
        out = []
        for root in self.roots:
            with suppress(psutil.Error):
                out += [root, *root.children(recursive=True)]
        return out

    def rss(self) -> int:
        total = 0
        for p in self.processes():
            with suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def poll(self) -> None:
        alive: set[tuple[int, float]] = set()
        own: dict[tuple[int, float], float] = {}
        children = 0.0
        for p in self.processes():
            try:
                key = (p.pid, p.create_time())
                t = p.cpu_times()
            except psutil.Error:
                continue
            alive.add(key)
            own[key] = t.user + t.system
            children += t.children_user + t.children_system
        with self._lock:
            self._own.update(own)
            self._alive = alive
            self._children_now = children
            if self._children_base is None:
                self._children_base = children

    def cpu_seconds(self) -> float:
        self.poll()
        with self._lock:
            live = sum(v for k, v in self._own.items() if k in self._alive)
            dead = sum(v for k, v in self._own.items() if k not in self._alive)
            base = self._children_base or 0.0
            return live + max(self._children_now, base + dead)


class Sampler:
    """A thread that samples the tree's RSS (and polls its CPU) every `interval` s."""

    def __init__(self, monitor: TreeMonitor, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.monitor = monitor
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        for _ in range(int(3600 / self.interval)):  # bounded: at most an hour
            if self._stop.wait(self.interval):
                return
            with suppress(Exception):
                self.monitor.poll()
                self.samples.append((time.monotonic(), self.monitor.rss()))

    def peak(self, since: float, until: float | None = None) -> int | None:
        until = until if until is not None else time.monotonic()
        values = [r for t, r in list(self.samples) if since <= t <= until]
        return max(values) if values else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


@dataclass
class Conn:
    kind: str
    writer: asyncio.StreamWriter
    closed_at: float | None = None
    answer: bytes = b""


async def watch(conn: Conn, reader: asyncio.StreamReader) -> None:
    """Until the server closes the connection (EOF or reset)."""
    try:
        for _ in range(1000):
            data = await reader.read(65536)
            if not data:
                break
            conn.answer += data[: 200 - len(conn.answer)]
    except (ConnectionError, OSError):
        pass
    if conn.closed_at is None:
        conn.closed_at = time.monotonic()


async def close_all(conns: list[Conn], tasks: list[asyncio.Task[Any]]) -> None:
    """Close the connections a phase opened, and end its tasks on them."""
    for c in conns:
        c.writer.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def trickle(conn: Conn, data: bytes, end: float) -> None:
    """One byte a second until the data is sent, the server closes, or `end`."""
    try:
        for b in data:
            if conn.closed_at is not None or time.monotonic() >= end:
                return
            conn.writer.write(bytes([b]))
            await conn.writer.drain()
            await asyncio.sleep(1.0)
    except (ConnectionError, OSError):
        if conn.closed_at is None:
            conn.closed_at = time.monotonic()


def compile_json(graph: dict[str, Any], inputs: Arrays, wrt: list[str], *, backward: bool) -> Any:
    """The service's path from a JSON graph: the wire model, the engine's spec, compile."""
    spec = GraphModel.model_validate(graph)
    specs = {k: TensorSpec(a.shape, a.dtype.name, k in wrt) for k, a in inputs.items()}
    return compile_graph(spec, specs, backward=backward, no_grad=not backward)


def run(program: Any, inputs: Arrays) -> Any:
    return execute(program, inputs)


def thread_cpu_s(pid: int) -> float:
    """A process's CPU time so far, all its threads: each thread's schedstat (nanoseconds,
    where psutil's clock ticks are 10 ms). The process's own schedstat is its main
    thread's alone: a front's, without the threads that read the workers' replies."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with (
            contextlib.suppress(FileNotFoundError),
            open(f"/proc/{pid}/task/{thread}/schedstat") as f,
        ):
            total += int(f.read().split()[0])
    return total / 1e9


def count(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with `prefix` (label sets, in any order)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def role(text: str, metric: str, who: str) -> float | None:
    """A counter of `who` ("front" or "worker"): None where the server has no role label."""
    lines = [
        line
        for line in text.splitlines()
        if line.startswith(metric + "{") or line.startswith(metric + " ")
    ]
    if not any("role=" in line for line in lines):
        return None
    return count("\n".join(line for line in lines if f'role="{who}"' in line), metric)


def p50(times: list[float]) -> float:
    return statistics.median(times) * 1000


@dataclass
class Row:
    part: str
    figure: str
    value: str
    target: str = ""
    passed: bool | None = None


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(
        self, part: str, figure: str, value: str, target: str = "", passed: bool | None = None
    ) -> None:
        self.rows.append(Row(part, figure, value, target, passed))

    def error(self, part: str, exc: Exception) -> None:
        """A part that raised: reported as its row, so that the others still run."""
        self.add(part, "ERROR", f"{type(exc).__name__}: {str(exc)[:160]}", "", False)

    @property
    def failed(self) -> bool:
        """Whether a part raised (the script then exits 1)."""
        return any(r.figure == "ERROR" for r in self.rows)

    def print(self, header: str) -> None:
        print(header)
        cols = ["part", "figure", "value", "target", "result"]
        cells = [
            [
                r.part,
                r.figure,
                r.value,
                r.target,
                "-" if r.passed is None else ("PASS" if r.passed else "MISS"),
            ]
            for r in self.rows
        ]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        line = lambda cs: (
            "| " + " | ".join(c.ljust(w) for c, w in zip(cs, widths, strict=True)) + " |"
        )
        print(line(cols))
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row in cells:
            print(line(row))
        for note in self.notes:
            print(f"  note: {note}")


def metrics(server: Server) -> str:
    """A server's /metrics, as Prometheus text."""
    return httpx.get(server.base + "/metrics", timeout=30).text


def compile_request(graph: Graph, inputs: Arrays, wrt: Collection[str], device: str = "cpu") -> Any:
    """As the service compiles a request: its wire schema, then the compiler; a backward
    program when `wrt` names inputs to differentiate, else a forward one."""
    from gradserve.engine.graph import TensorSpec, compile_graph

    specs = {k: TensorSpec(a.shape, a.dtype.name, k in wrt) for k, a in inputs.items()}
    return compile_graph(GraphModel.model_validate(graph), specs, backward=bool(wrt), device=device)


def command_line(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring for --help, and --smoke, which every script
    has (tests/project/test_bench_smoke.py runs each so)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest size: every part once on tiny inputs, to show that the script "
        "runs end to end (its figures mean nothing)",
    )
    return parser


def revision() -> str:
    """The checkout's commit, marked when its tracked files have changes; "unknown" where
    git cannot say."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} with changes" if dirty else head
