"""Hardening benchmark (not a test): bounded load against real `gradserve serve` processes
on loopback, printing one table of /healthz latency, statuses, RSS and CPU figures against
the hardening targets.

Phases (each at most 2 minutes; every loop is bounded in count and time):

1. warm-up      the first 50 requests of the soak mix; RSS of a fresh server and after them
2. soak         16 clients send the mix (seed examples, a 256x256 MLP loss as base64, no_grad,
                expr graphs, invalid requests) for --soak-seconds; every answer is checked
2m. soak with   the same, with 200 idle connections, 20 senders trickling a byte a second
    misbehaving and uploads cut halfway beside it: the seed requests' p50, and every 503
    clients     matched to the admission queue's counters in /metrics
3. heavy        16 clients send ~2 s matmul chains for 10 s while /healthz is probed
4. flood        64 such clients for 10 s (most should get 503)
5. compile      a 100k-node chain of `add` nodes while /healthz is probed
6. connections  30 senders trickling a request at 1 byte/s and 500 idle connections: how many
                the server still holds open after 15 s and 30 s
7. CPU bomb     (a separate server per request, GRADSERVE_REQUEST_TIMEOUT_S=1) an einsum and a
                6144x6144 matmul: status, wall time, CPU-seconds burnt after the deadline
8. large bodies (a separate server, 1 GiB budgets) 8 concurrent 57 MB JSON-list bodies, and 16
                chunked 66 MiB uploads that must end in 413: peak RSS against the budget
9. after load   RSS of the main server 10 s after its last phase (run right after phase 6,
                before 7 and 8, which use their own servers)

/healthz is probed every 20 ms by a separate process (so that the load generator's own work
does not show up as server latency), each probe on a new connection, as an orchestrator
probes. RSS is summed over the server's whole process tree, sampled every 50 ms.

    python3 -m bench.bench_hardening [--phases 1,2,3] [--quick] [--soak-seconds 60]
                                     [--json PATH] [--env KEY=VALUE ...] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from bench.harness import (
    HOST,
    PHASE_LIMIT_S,
    Conn,
    GiB,
    MiB,
    Sampler,
    TreeMonitor,
    close_all,
    command_line,
    percentile,
    revision,
    trickle,
    watch,
)
from bench.workloads import (
    BOMBS,
    HEAVY_SUM,
    INVALID,
    JSON_HEADERS,
    MLP_GRAPH,
    big_list_body,
    chain_body,
    heavy_body,
    mlp_case,
    seed_body,
)
from gradserve.client.http import AsyncClient, GradserveHTTPError
from tests.support.server import ROOT, free_port

HEALTHZ_TARGET_S = 0.050
PROBE_INTERVAL_S = 0.020
PROBE_TIMEOUT_S = 5.0  # a probe slower than this counts as a timeout, at this latency
PROBE_MAX_S = 150.0  # the prober exits by itself after this, whatever the parent does

# The main server (phases 1-6, 9): node and compute limits high enough for phases 3-5,
# so that they measure responsiveness rather than a refusal.
MAIN_ENV = {"GRADSERVE_MAX_NODES": "200000", "GRADSERVE_COMPUTE_BUDGET": "1e15"}
BOMB_ENV = {
    "GRADSERVE_REQUEST_TIMEOUT_S": "1",
    "GRADSERVE_MEMORY_BUDGET_BYTES": str(4 * GiB),
    "GRADSERVE_NO_GRAD_MEMORY_BUDGET_BYTES": str(4 * GiB),
    "GRADSERVE_INFLIGHT_MEMORY_BYTES": str(8 * GiB),
    "GRADSERVE_COMPUTE_BUDGET": "1e15",
}
BODY_BUDGET = 1 * GiB
BODY_ENV = {
    "GRADSERVE_INFLIGHT_MEMORY_BYTES": str(BODY_BUDGET),
    "GRADSERVE_MEMORY_BUDGET_BYTES": str(BODY_BUDGET),
    "GRADSERVE_NO_GRAD_MEMORY_BUDGET_BYTES": str(BODY_BUDGET),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def raise_nofile() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit: phase 6 holds 530+ sockets at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


_SERVERS: list[Server] = []
_ACCESS_LINE = re.compile(r'HTTP/[0-9.]+" [0-9]{3} ')


class ServerError(RuntimeError):
    pass


class Server:
    """`gradserve serve` (this checkout) on a free loopback port, in its own process group."""

    def __init__(self, name: str, env: Mapping[str, str], log_dir: Path, root: Path) -> None:
        self.name = name
        self.env = dict(env)
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(self.port)],
            cwd=root,  # `-m` puts the cwd first on sys.path: that tree's service and engine
            env={**os.environ, "PYTHONPATH": str(root), **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one group to kill, orphans included
        )
        _SERVERS.append(self)
        self.monitor = TreeMonitor(self.proc.pid)
        self.sampler: Sampler | None = None
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited (rc={self.proc.returncode}):\n" + self.log_tail()
                )
            with suppress(httpx.HTTPError):
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    self.sampler = Sampler(self.monitor)
                    return
            time.sleep(0.1)
        self.stop(graceful=False)
        raise ServerError(f"{self.name} not ready after {timeout:.0f} s:\n" + self.log_tail())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return httpx.get(self.base + "/healthz", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the server's log, access-log lines left out."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join([t for t in text if not _ACCESS_LINE.search(t)][-lines:])

    def stop(self, graceful: bool = True) -> int | None:
        if self.sampler is not None:
            self.sampler.stop()
        leftovers = self.monitor.processes()[1:]
        if self.proc.poll() is None and graceful:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        # Whatever is left (a stuck process, a pool worker): kill it, by id.
        for p in [*leftovers, *self.monitor.processes()]:
            with suppress(psutil.Error):
                p.kill()
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()
        if self in _SERVERS:
            _SERVERS.remove(self)
        return self.proc.returncode


def start_server(ctx: Ctx, name: str, env: Mapping[str, str]) -> Server:
    env = {**env, **ctx.env}
    log(f"starting {name} server ({' '.join(f'{k}={v}' for k, v in env.items()) or 'defaults'})")
    server = Server(name, env, ctx.log_dir, ctx.server_root)
    server.wait_ready()
    time.sleep(0.5)  # let startup allocations settle before the fresh RSS is read
    return server


# ---------------------------------------------------------------- the /healthz prober
def _probe_once(port: int, timeout: float) -> str:
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(request)
            data = b""
            while True:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
                if len(data) > 65536:
                    break
        parts = data.split(b" ", 2)
        return parts[1].decode() if len(parts) > 1 and data.startswith(b"HTTP/") else "garbled"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error:{type(exc).__name__}"


def _probe_child(port: int, interval: float, timeout: float, conn: Connection) -> None:
    """Runs in its own process: probe until the parent says stop (or PROBE_MAX_S)."""
    conn.send("ready")
    samples: list[tuple[float, float, str]] = []
    start = next_at = time.monotonic()
    while time.monotonic() - start < PROBE_MAX_S and len(samples) < 20000:
        if conn.poll():
            break
        now = time.monotonic()
        if now < next_at:
            time.sleep(min(next_at - now, interval))
            continue
        # A slow probe delays the next one; probes never pile up to catch up.
        next_at = max(next_at + interval, now)
        t0 = time.perf_counter()
        outcome = _probe_once(port, timeout)
        latency = timeout if outcome == "timeout" else time.perf_counter() - t0
        samples.append((now - start, latency, outcome))
    conn.send(samples)


@dataclass
class ProbeStats:
    n: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, samples: Sequence[tuple[float, float, str]]) -> ProbeStats:
        # Timeouts count, at the timeout; refused or reset connections have no latency.
        lat = [s[1] * 1000 for s in samples if not s[2].startswith("error")]
        outcomes = dict(Counter(s[2] for s in samples))
        if not lat:
            return cls(n=len(samples), outcomes=outcomes)
        return cls(len(samples), percentile(lat, 0.5), percentile(lat, 0.99), max(lat), outcomes)

    def cell(self) -> str:
        if self.p99_ms is None:
            return f"no answer ({self.n} probes)"
        text = f"{self.p50_ms:.1f} / {self.p99_ms:.1f} / {self.max_ms:.0f}"
        bad = {k: v for k, v in self.outcomes.items() if k != "200"}
        if bad:
            text += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(bad.items())) + ")"
        return text


class Prober:
    """/healthz every PROBE_INTERVAL_S from a separate process, on a new connection each."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stats = ProbeStats()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_probe_child,
            args=(port, PROBE_INTERVAL_S, PROBE_TIMEOUT_S, child),
            daemon=True,
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(30):
            self._kill()
            raise RuntimeError("the /healthz prober did not start")
        self._conn.recv()

    def stop(self) -> ProbeStats:
        samples: list[tuple[float, float, str]] = []
        with suppress(OSError, EOFError):
            self._conn.send("stop")
            if self._conn.poll(PROBE_TIMEOUT_S + 5):
                samples = self._conn.recv()
        self._kill()
        self.stats = ProbeStats.of(samples)
        return self.stats

    def _kill(self) -> None:
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()


@contextmanager
def probing(port: int, res: PhaseResult) -> Iterator[Prober]:
    prober = Prober(port)
    try:
        yield prober
    finally:
        res.probe = prober.stop()


# ---------------------------------------------------------------- results
@dataclass
class Check:
    figure: str
    value: str
    target: str = ""
    passed: bool | None = None


@dataclass
class PhaseResult:
    key: str
    title: str
    probe: ProbeStats | None = None
    probe_target: bool = True  # whether /healthz p99 has the < 50 ms target here
    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: int | None = None  # 5xx other than 503
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def check(
        self, figure: str, value: str, target: str = "", passed: bool | None = None, raw: Any = None
    ) -> None:
        self.checks.append(Check(figure, value, target, passed))
        self.figures[figure] = raw if raw is not None else value

    def count(self, status: int | str) -> None:
        self.statuses[str(status)] += 1
        if isinstance(status, int) and status >= 500 and status != 503:
            self.server_errors = (self.server_errors or 0) + 1


def status_cell(statuses: Mapping[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(statuses.items())) or "-"


def verdict(passed: bool | None) -> str:
    return "-" if passed is None else ("PASS" if passed else "MISS")


def close(name: str, got: Any, want: Any, rtol: float) -> str | None:
    """None when `got` matches `want` to rtol of want's largest magnitude."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if g.shape != w.shape:
        return f"{name}: shape {g.shape} != {w.shape}"
    scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-12)
    err = float(np.max(np.abs(g - w))) if w.size else 0.0
    return None if err <= rtol * scale else f"{name}: off by {err:.3g} (scale {scale:.3g})"


@dataclass
class Outcome:
    status: int | None  # None: no HTTP answer
    expect: int
    wrong: str | None = None  # why the result is wrong (checked only when status == expect)


class Mix:
    """The soak mix: every answer's status is checked, and valid results against NumPy."""

    KINDS = (
        ("seed_op", 18),
        ("seed_expr", 18),
        ("nograd_seed", 14),
        ("mlp_backward", 12),
        ("mlp_nograd", 6),
        ("expr_chain", 12),
        ("expr_softmax", 8),
        ("invalid", 12),
    )

    def __init__(self, http: httpx.AsyncClient, gs: AsyncClient) -> None:
        self.http = http
        self.gs = gs
        rng = np.random.default_rng(0)
        self.cases = [mlp_case(rng) for _ in range(6)]
        self.latencies: dict[str, list[float]] = {}  # kind -> seconds of its 200 answers

    async def run(
        self, res: PhaseResult, concurrency: int, max_requests: int, seconds: float
    ) -> None:
        names = [k for k, _ in self.KINDS]
        weights = [w for _, w in self.KINDS]
        end = time.monotonic() + seconds
        issued = 0
        res.server_errors = res.server_errors or 0
        wrong = Counter[str]()

        async def worker(i: int) -> None:
            nonlocal issued
            rng = random.Random(i)
            while issued < max_requests and time.monotonic() < end:
                issued += 1
                kind = rng.choices(names, weights)[0]
                t0 = time.perf_counter()
                try:
                    out = await getattr(self, kind)(rng)
                    if out.status == 200:
                        self.latencies.setdefault(kind, []).append(time.perf_counter() - t0)
                except httpx.HTTPError as exc:
                    out = Outcome(None, 0, f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # a malformed answer: a wrong result, not a crash
                    out = Outcome(0, 0, f"{type(exc).__name__}: {exc}")
                self._record(res, kind, out, wrong)
                if out.status is None:
                    await asyncio.sleep(0.2)  # the server may be gone: do not spin
                elif out.status == 503:
                    # A short pause rather than Retry-After's 1 s: the pressure stays, but
                    # the mix is not drowned in instant refusals.
                    await asyncio.sleep(rng.uniform(0.02, 0.1))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        res.figures["requests"] = issued

    @staticmethod
    def _record(res: PhaseResult, kind: str, out: Outcome, wrong: Counter[str]) -> None:
        res.count(out.status if out.status is not None else "err")
        f = res.figures
        if out.status is None:
            f["transport_errors"] = f.get("transport_errors", 0) + 1
            why = out.wrong
        elif out.status == 503:
            return  # deliberate: slots or in-flight memory full
        elif out.status != out.expect:
            f["wrong_status"] = f.get("wrong_status", 0) + 1
            why = f"status {out.status}, expected {out.expect}"
        elif out.wrong:
            f["wrong_results"] = f.get("wrong_results", 0) + 1
            why = out.wrong
        else:
            return
        wrong[kind] += 1
        if wrong[kind] <= 2:  # a few examples per kind, for the notes
            res.notes.append(f"{kind}: {why}")

    async def _post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.http.post(path, content=orjson.dumps(body), headers=JSON_HEADERS)
        return r.status_code, orjson.loads(r.content) if r.status_code == 200 else None

    async def _seed(self, rng: random.Random, form: str) -> Outcome:
        x, y = float(rng.randint(-8, 8)), float(rng.randint(-8, 8))
        status, d = await self._post("/backward", seed_body(x, y, form))
        if status != 200:
            return Outcome(status, 200)
        got = (d["outputs"]["z"]["data"], d["gradients"]["x"]["data"], d["gradients"]["y"]["data"])
        want = (x * x - y * y, 2 * x, -2 * y)
        return Outcome(200, 200, None if got == want else f"({x}, {y}): {got} != {want}")

    async def seed_op(self, rng: random.Random) -> Outcome:
        return await self._seed(rng, "op")

    async def seed_expr(self, rng: random.Random) -> Outcome:
        return await self._seed(rng, "expr")

    async def nograd_seed(self, rng: random.Random) -> Outcome:
        a = [float(rng.randint(-20, 20)) for _ in range(3)]
        status, d = await self._post(
            "/forward",
            {
                "graph": {"nodes": [{"id": "B", "expr": "A ** 2 + 16"}], "outputs": ["B", "A"]},
                "inputs": {"A": {"data": a, "requires_grad": True}},
                "no_grad": True,
            },
        )
        if status != 200:
            return Outcome(status, 200)
        b, out_a = d["outputs"]["B"], d["outputs"]["A"]
        ok = (
            b["data"] == [v * v + 16 for v in a]
            and b["requires_grad"] is False
            and b["grad_fn"] is None
            and out_a["requires_grad"] is True
            and not d.get("gradients")
        )
        return Outcome(200, 200, None if ok else f"A={a}: {d['outputs']}")

    async def mlp_backward(self, rng: random.Random) -> Outcome:
        case = rng.choice(self.cases)
        try:
            r = await self.gs.backward(MLP_GRAPH, case.inputs, requires_grad=["w1", "w2"])
        except GradserveHTTPError as exc:
            return Outcome(exc.status, 200)
        assert r.gradients is not None
        wrong = (
            close("loss", r.outputs["loss"], case.loss, 1e-4)
            or close("grad w1", r.gradients["w1"], case.gw1, 1e-3)
            or close("grad w2", r.gradients["w2"], case.gw2, 1e-3)
        )
        return Outcome(200, 200, wrong)

    async def mlp_nograd(self, rng: random.Random) -> Outcome:
        case = rng.choice(self.cases)
        try:
            r = await self.gs.forward(MLP_GRAPH, case.inputs, no_grad=True)
        except GradserveHTTPError as exc:
            return Outcome(exc.status, 200)
        return Outcome(200, 200, close("loss", r.outputs["loss"], case.loss, 1e-4))

    async def expr_chain(self, rng: random.Random) -> Outcome:
        x = np.array([rng.uniform(-2, 2) for _ in range(16)])
        y = np.array([rng.uniform(-2, 2) for _ in range(16)])
        status, d = await self._post(
            "/backward",
            {
                "graph": {
                    "nodes": [
                        {"id": "a", "expr": "sin(x) * y + exp(-x)"},
                        {"id": "s", "expr": "sum(a ** 2)"},
                    ],
                    "outputs": ["s"],
                },
                "inputs": {
                    n: {"data": v.tolist(), "dtype": "float64", "requires_grad": True}
                    for n, v in (("x", x), ("y", y))
                },
            },
        )
        if status != 200:
            return Outcome(status, 200)
        a = np.sin(x) * y + np.exp(-x)
        wrong = (
            close("s", d["outputs"]["s"]["data"], np.sum(a**2), 1e-9)
            or close(
                "grad x", d["gradients"]["x"]["data"], 2 * a * (np.cos(x) * y - np.exp(-x)), 1e-9
            )
            or close("grad y", d["gradients"]["y"]["data"], 2 * a * np.sin(x), 1e-9)
        )
        return Outcome(200, 200, wrong)

    async def expr_softmax(self, rng: random.Random) -> Outcome:
        x = np.array([rng.uniform(-5, 5) for _ in range(32)])
        status, d = await self._post(
            "/forward",
            {
                "graph": {
                    "nodes": [
                        {"id": "p", "expr": "softmax(x, dim=0)"},
                        {"id": "l", "expr": "logsumexp(x, dim=0)"},
                    ],
                    "outputs": ["p", "l"],
                },
                "inputs": {"x": {"data": x.tolist(), "dtype": "float64"}},
            },
        )
        if status != 200:
            return Outcome(status, 200)
        e = np.exp(x - x.max())
        wrong = close("softmax", d["outputs"]["p"]["data"], e / e.sum(), 1e-9) or close(
            "logsumexp", d["outputs"]["l"]["data"], x.max() + np.log(e.sum()), 1e-9
        )
        return Outcome(200, 200, wrong)

    async def invalid(self, rng: random.Random) -> Outcome:
        _, method, path, body, headers, expect = rng.choice(INVALID)
        r = await self.http.request(method, path, content=body or None, headers=headers)
        return Outcome(r.status_code, expect)


async def timed_post(
    http: httpx.AsyncClient, path: str, body: bytes, timeout: float
) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = await http.post(path, content=body, headers=JSON_HEADERS, timeout=timeout)
    return r, time.perf_counter() - t0


async def calibrate(ctx: Ctx, res: PhaseResult) -> int:
    """Matmuls per heavy request so that one alone computes for ~2 s on this machine."""
    if ctx.heavy_matmuls:
        return ctx.heavy_matmuls
    times: dict[int, float] = {}
    for k in (1, 5):
        r, dt = await timed_post(ctx.http, "/forward", heavy_body(k), 60)
        if r.status_code != 200:
            raise RuntimeError(
                f"calibration request ({k} matmuls) got {r.status_code}: {r.text[:300]}"
            )
        times[k] = dt
    per = max((times[5] - times[1]) / 4, 1e-3)
    fixed = max(times[1] - per, 0.0)
    ctx.heavy_matmuls = max(1, min(200, round((2.0 - fixed) / per)))
    res.notes.append(
        f"calibration: {per * 1000:.0f} ms per 2048x2048 matmul, "
        f"{fixed * 1000:.0f} ms fixed: {ctx.heavy_matmuls} matmuls per request"
    )
    return ctx.heavy_matmuls


async def heavy_load(ctx: Ctx, res: PhaseResult, clients: int, seconds: float) -> None:
    """`clients` loops of heavy requests for `seconds` (a 503 waits its Retry-After, at most
    1 s); /healthz is probed during the window; then the requests still running finish."""
    k = await calibrate(ctx, res)
    body = heavy_body(k)
    wrong = 0
    latencies: list[float] = []
    t_start = time.monotonic()
    end = t_start + seconds

    async def client() -> None:
        nonlocal wrong
        for _ in range(10_000):
            if time.monotonic() >= end:
                return
            try:
                r, dt = await timed_post(ctx.http, "/forward", body, 100)
            except httpx.HTTPError:
                res.count("err")
                await asyncio.sleep(0.2)
                continue
            res.count(r.status_code)
            if r.status_code == 200:
                latencies.append(dt)
                if orjson.loads(r.content)["outputs"]["s"]["data"] != HEAVY_SUM:
                    wrong += 1
            elif r.status_code == 503:
                with suppress(ValueError):
                    await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), 1.0))
            else:
                await asyncio.sleep(0.1)

    res.server_errors = 0
    with probing(ctx.server.port, res):
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(seconds)
    drained = True
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
    except TimeoutError:
        drained = False
        res.notes.append("requests still running 90 s after the window: abandoned")
    res.figures.update(matmuls=k, wrong_results=wrong)
    if latencies:
        res.figures["latency_200_p50_s"] = round(percentile(latencies, 0.5), 2)
        res.notes.append(
            f"200s took {percentile(latencies, 0.5):.1f} s (p50), "
            f"{max(latencies):.1f} s (max); wrong results: {wrong}"
        )
    res.figures["drained"] = drained
    res.check("peak RSS", mib(ctx.server.sampler.peak(t_start) if ctx.server.sampler else None))


# ---------------------------------------------------------------- phases on the main server
@dataclass
class Ctx:
    args: argparse.Namespace
    log_dir: Path
    server_root: Path
    env: dict[str, str]
    quick: bool
    concurrency: int
    server: Server = None  # type: ignore[assignment]
    http: httpx.AsyncClient = None  # type: ignore[assignment]
    gs: AsyncClient = None  # type: ignore[assignment]
    mix: Mix = None  # type: ignore[assignment]
    heavy_matmuls: int = 0
    fresh_rss: int | None = None
    warm_rss: int | None = None
    restarts: list[str] = field(default_factory=list)
    last_main_load: float = 0.0
    extra: list[PhaseResult] = field(default_factory=list)  # rows a phase adds (8b)
    # This process and its children (servers, probers): to tell our CPU from others'.
    me: TreeMonitor = field(default_factory=lambda: TreeMonitor(os.getpid()))


async def ensure_main(ctx: Ctx) -> None:
    """The main server, started (or restarted, if it died or hangs) with its clients."""
    if ctx.server is not None and ctx.server.alive() and ctx.server.healthy():
        return
    if ctx.server is not None:
        why = (
            f"exited rc={ctx.server.proc.returncode}"
            if not ctx.server.alive()
            else "stopped answering /healthz"
        )
        ctx.restarts.append(why)
        log(f"main server {why}; restarting it\n{ctx.server.log_tail()}")
        ctx.server.stop(graceful=False)
        await close_clients(ctx)
    ctx.server = await asyncio.to_thread(start_server, ctx, "main", MAIN_ENV)
    ctx.fresh_rss = ctx.server.monitor.rss()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    ctx.http = httpx.AsyncClient(
        base_url=ctx.server.base, timeout=httpx.Timeout(60, connect=10), limits=limits
    )
    ctx.gs = AsyncClient(ctx.server.base, timeout=60, retries=0)  # (it counts the 503s)
    ctx.mix = ctx.mix or Mix(ctx.http, ctx.gs)
    ctx.mix.http, ctx.mix.gs = ctx.http, ctx.gs


async def close_clients(ctx: Ctx) -> None:
    for c in (ctx.http, ctx.gs):
        if c is not None:
            with suppress(Exception):
                await asyncio.wait_for(c.aclose(), 5)


async def phase_warmup(ctx: Ctx, res: PhaseResult) -> None:
    res.check("RSS fresh server", mib(ctx.fresh_rss), raw=ctx.fresh_rss)
    await ctx.mix.run(res, ctx.concurrency, 50, 60)
    await asyncio.sleep(0.5)
    ctx.warm_rss = ctx.server.monitor.rss()
    res.check("RSS after warm-up", mib(ctx.warm_rss), raw=ctx.warm_rss)
    mix_checks(res)


def mix_checks(res: PhaseResult) -> None:
    f = res.figures
    res.check(
        "5xx other than 503",
        str(res.server_errors or 0),
        "0",
        not res.server_errors,
        raw=res.server_errors or 0,
    )
    bad = f.get("wrong_results", 0) + f.get("wrong_status", 0)
    res.check(
        "wrong results / wrong statuses",
        f"{f.get('wrong_results', 0)} / {f.get('wrong_status', 0)}",
        "0 / 0",
        bad == 0,
    )
    if f.get("transport_errors"):
        res.check("transport errors", str(f["transport_errors"]), "0", False)


async def phase_soak(ctx: Ctx, res: PhaseResult) -> None:
    seconds = ctx.args.soak_seconds
    t0 = time.monotonic()
    with probing(ctx.server.port, res):
        await ctx.mix.run(res, ctx.concurrency, 5_000_000, seconds)
    res.figures["rps"] = round(res.figures.get("requests", 0) / max(seconds, 1e-9), 1)
    mix_checks(res)
    peak = ctx.server.sampler.peak(t0) if ctx.server.sampler else None
    res.check("RSS under load (peak)", mib(peak), raw=peak)
    res.check("requests / s", str(res.figures["rps"]))


SEED_P50_TARGET_S = 0.010
# 503s that come from admission (a reason of gradserve_rejections_total): the queue's
# bounds, a full in-flight memory, or (without a queue) full slots.
ADMISSION_503 = ("queue_full", "queue_timeout", "concurrency", "inflight_memory")


async def phase_soak_misbehaving(ctx: Ctx, res: PhaseResult) -> None:
    """The soak mix with misbehaving clients beside it: 200 idle connections, 20 senders
    trickling a request at a byte a second, and uploads that stop halfway and hang up."""
    seconds = ctx.args.soak_seconds
    before = await rejections(ctx)
    mix_before = Counter({k: len(v) for k, v in ctx.mix.latencies.items()})
    conns: list[Conn] = []
    tasks: list[asyncio.Task[Any]] = []
    body = orjson.dumps(seed_body(2.0, 3.0, "expr"))
    request = (
        b"POST /backward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    end = time.monotonic() + seconds
    cut = Counter[str]()

    async def cut_uploads() -> None:
        half = request[: len(request) - len(body) // 2]
        for _ in range(100_000):
            if time.monotonic() >= end:
                return
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(HOST, ctx.server.port), 5
                )
                writer.write(half)
                await writer.drain()
                writer.close()
                cut["sent"] += 1
            except (OSError, TimeoutError):
                cut["failed"] += 1
            await asyncio.sleep(0.05)

    with probing(ctx.server.port, res):
        try:
            for kind, n in (("idle", 200), ("slow", 20)):
                for _ in range(n):
                    with suppress(OSError, TimeoutError):
                        reader, writer = await asyncio.wait_for(
                            asyncio.open_connection(HOST, ctx.server.port), 10
                        )
                        conn = Conn(kind, writer)
                        conns.append(conn)
                        tasks.append(asyncio.create_task(watch(conn, reader)))
            tasks += [
                asyncio.create_task(trickle(c, request, end)) for c in conns if c.kind == "slow"
            ]
            tasks.append(asyncio.create_task(cut_uploads()))
            await ctx.mix.run(res, ctx.concurrency, 5_000_000, seconds)
        finally:
            await close_all(conns, tasks)
    mix_checks(res)
    seeds = [
        s
        for kind in ("seed_op", "seed_expr")
        for s in ctx.mix.latencies.get(kind, [])[mix_before[kind] :]
    ]
    if seeds:
        p50 = float(np.percentile(seeds, 50))
        res.check(
            "seed p50",
            f"{p50 * 1000:.1f} ms",
            f"<= {SEED_P50_TARGET_S * 1000:.0f} ms",
            p50 <= SEED_P50_TARGET_S,
            raw=round(p50 * 1000, 2),
        )
    after = await rejections(ctx)
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in ADMISSION_503}
    seen = res.statuses.get("503", 0)
    queue = counted["queue_full"] + counted["queue_timeout"]
    res.check(
        "503s / counted by the queue's bounds",
        f"{seen} / {queue:.0f} ({', '.join(f'{k} {v:.0f}' for k, v in counted.items() if v)})",
        "equal",
        seen == queue,
    )
    res.notes.append(
        f"uploads cut short: {dict(cut)}; idle and slow connections: "
        f"{sum(c.kind == 'idle' for c in conns)} and "
        f"{sum(c.kind == 'slow' for c in conns)}"
    )


async def rejections(ctx: Ctx) -> dict[str, float]:
    """gradserve_rejections_total by reason, from the server's /metrics."""
    text = (await ctx.http.get("/metrics")).text
    out = {}
    for m in re.finditer(
        r'^gradserve_rejections_total\{reason="([^"]+)"\} (\S+)$', text, re.MULTILINE
    ):
        out[m.group(1)] = float(m.group(2))
    return out


async def phase_heavy(ctx: Ctx, res: PhaseResult) -> None:
    await heavy_load(ctx, res, 16, 5 if ctx.quick else 10)


async def phase_flood(ctx: Ctx, res: PhaseResult) -> None:
    await heavy_load(ctx, res, 64, 5 if ctx.quick else 10)
    ok, busy = res.statuses.get("200", 0), res.statuses.get("503", 0)
    other = sum(res.statuses.values()) - ok - busy
    res.check(
        "200 / 503 / other",
        f"{ok} / {busy} / {other}",
        "mostly 503, no other",
        busy > ok and other == 0,
    )


async def phase_compile(ctx: Ctx, res: PhaseResult) -> None:
    nodes = 100_000
    body = chain_body(nodes)
    want = float(nodes + 1)
    res.server_errors = 0
    times: list[float] = []
    wrong = 0
    with probing(ctx.server.port, res):
        await asyncio.sleep(0.5)  # a baseline of probes before the request
        for _ in range(1 if ctx.quick else 3):
            try:
                r, dt = await timed_post(ctx.http, "/backward", body, 100)
            except httpx.HTTPError as exc:
                res.count("err")
                res.notes.append(f"compile request: {type(exc).__name__}: {exc}")
                continue
            res.count(r.status_code)
            times.append(dt)
            if r.status_code == 200:
                d = orjson.loads(r.content)
                got = (d["outputs"][f"n{nodes}"]["data"], d["gradients"]["x"]["data"])
                wrong += got != (want, want)
            else:
                res.notes.append(f"compile request: {r.status_code} {r.text[:200]}")
        await asyncio.sleep(0.5)
    res.check("body", mib(len(body)))
    res.check(
        "request time",
        ", ".join(f"{t:.2f} s" for t in times) or "-",
        raw=[round(t, 3) for t in times],
    )
    res.check("wrong results", str(wrong), "0", wrong == 0)


async def phase_connections(ctx: Ctx, res: PhaseResult) -> None:
    slow_n, idle_n = 30, 500
    checkpoints = (15.0,) if ctx.quick else (15.0, 30.0)
    body = orjson.dumps(seed_body(2.0, 3.0, "expr"))
    request = (
        b"POST /backward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    conns: list[Conn] = []
    tasks: list[asyncio.Task[Any]] = []
    failed = Counter[str]()
    gate = asyncio.Semaphore(64)

    async def open_one(kind: str) -> None:
        async with gate:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(HOST, ctx.server.port), 10
                )
            except (OSError, TimeoutError) as exc:
                failed[type(exc).__name__] += 1
                return
        conn = Conn(kind, writer)
        conns.append(conn)
        tasks.append(asyncio.create_task(watch(conn, reader)))

    with probing(ctx.server.port, res):
        try:
            await asyncio.gather(
                *(open_one("slow") for _ in range(slow_n)),
                *(open_one("idle") for _ in range(idle_n)),
            )
            t0 = time.monotonic()
            end = t0 + checkpoints[-1] + 1
            tasks += [
                asyncio.create_task(trickle(c, request, end)) for c in conns if c.kind == "slow"
            ]
            log(f"  {len(conns)} connections open ({dict(failed) or 'none failed'})")
            for at in checkpoints:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                for kind, n in (("idle", idle_n), ("slow", slow_n)):
                    still = sum(1 for c in conns if c.kind == kind and c.closed_at is None)
                    res.check(
                        f"{kind} open after {at:.0f} s",
                        f"{still} of {n}",
                        "0",
                        still == 0,
                        raw=still,
                    )
        finally:
            await close_all(conns, tasks)
    if failed:
        res.notes.append(f"connections that failed to open: {dict(failed)}")
    answers = Counter(
        c.answer.split(b" ", 2)[1].decode(errors="replace")
        for c in conns
        if c.answer.startswith(b"HTTP/")
    )
    if answers:
        res.notes.append(f"answers the server sent on those connections: {dict(answers)}")
    res.figures["answers"] = dict(answers)


async def phase_after(ctx: Ctx, res: PhaseResult) -> None:
    wait = ctx.last_main_load + 10 - time.monotonic()
    await asyncio.sleep(max(0.0, wait))
    rss = ctx.server.monitor.rss()
    res.figures["seconds_after_last_load"] = round(time.monotonic() - ctx.last_main_load, 1)
    res.check("RSS after load", mib(rss), raw=rss)
    if ctx.warm_rss:
        res.check(
            "vs after warm-up",
            f"{rss / ctx.warm_rss:.2f}x",
            "≤ 1.20x",
            rss <= 1.2 * ctx.warm_rss,
            raw=round(rss / ctx.warm_rss, 3),
        )
    if ctx.fresh_rss:
        res.check(
            "vs fresh server",
            f"{rss / ctx.fresh_rss:.2f}x",
            "< 2x",
            rss < 2 * ctx.fresh_rss,
            raw=round(rss / ctx.fresh_rss, 3),
        )
    if ctx.restarts:
        res.notes.append(
            "the main server was restarted during the run: the warm-up figure "
            "is of an earlier process"
        )


BOMB_TIMEOUT_S = 1.0


async def phase_bomb(ctx: Ctx, res: PhaseResult) -> None:
    _, expr = BOMBS[res.key]
    body = orjson.dumps(
        {
            "graph": {"nodes": [{"id": "z", "expr": expr}], "outputs": ["z"]},
            "inputs": {},
            "no_grad": True,
        }
    )
    answer_timeout = 20.0 if ctx.quick else 60.0
    server = await asyncio.to_thread(start_server, ctx, f"bomb{res.key}", BOMB_ENV)
    try:
        async with httpx.AsyncClient(base_url=server.base) as http:
            await asyncio.sleep(1.0)
            cpu0 = server.monitor.cpu_seconds()
            t0 = time.monotonic()
            post = asyncio.create_task(timed_post(http, "/forward", body, answer_timeout))
            await asyncio.sleep(BOMB_TIMEOUT_S)
            cpu_deadline = server.monitor.cpu_seconds()
            try:
                r, wall = await post
                status: str = str(r.status_code)
                res.statuses[status] += 1  # a 504 here is the answer wanted
            except httpx.TimeoutException:
                wall, status = time.monotonic() - t0, f"no answer in {answer_timeout:.0f} s"
                res.statuses["none"] += 1
            except httpx.HTTPError as exc:
                wall, status = time.monotonic() - t0, f"{type(exc).__name__}"
                res.statuses["err"] += 1
            await asyncio.sleep(3.0)
            cpu_end = server.monitor.cpu_seconds()
            if not server.alive():
                res.check("server", f"died (rc={server.proc.returncode})", "alive", False)
    finally:
        server.stop(graceful=False)
    after = cpu_end - cpu_deadline
    if res.key == "7b" and status == "504" and cpu_end - cpu0 < 2 * BOMB_TIMEOUT_S:
        res.notes.append(
            "a quick 504 with little CPU: the deadline may have passed at the check "
            "between nodes, before the matmul started (the two 302 MB `full`s take "
            "about 0.5-1 s here); such a run does not exercise the matmul"
        )
    # The issue accepts a correct cheap answer too (an einsum on a cheaper contraction
    # path): a 200 within the limit and its CPU bound is checked by the rows below.
    cheap = status == "200" and wall <= BOMB_TIMEOUT_S
    res.check(
        "status",
        status,
        "504, a 4xx refusal, or a correct answer within the limit",
        status == "504" or cheap or (status.isdigit() and 400 <= int(status) < 500),
    )
    res.check(
        "wall time to the answer",
        f"{wall:.2f} s",
        f"≤ {BOMB_TIMEOUT_S + 1:.0f} s",
        wall <= BOMB_TIMEOUT_S + 1,
        raw=round(wall, 3),
    )
    res.check(
        "CPU-s total (to answer + 3 s)", f"{cpu_end - cpu0:.2f}", raw=round(cpu_end - cpu0, 3)
    )
    res.check("CPU-s after the deadline", f"{after:.2f}", "≤ 1", after <= 1.0, raw=round(after, 3))


async def chunked_upload(port: int, total: int, timeout: float) -> str:
    """POST /forward with a chunked body of `total` bytes (1 MiB chunks), stopping when the
    server answers; the answer's status, or why there is none."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
    first = b'{"graph":{"nodes":[{"id":"s","expr":"sum(x)"}],"outputs":["s"]},"inputs":{"x":['
    chunk = b"0.5," * (MiB // 4)

    async def send() -> None:
        writer.write(
            b"POST /forward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sent = 0
        while sent < total:
            piece = first if sent == 0 else chunk[: total - sent]
            writer.write(b"%x\r\n" % len(piece))
            writer.write(piece)
            writer.write(b"\r\n")
            await writer.drain()
            sent += len(piece)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    sender = asyncio.create_task(send())
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split(b" ", 2)
        return parts[1].decode() if line.startswith(b"HTTP/") and len(parts) > 1 else "closed"
    except TimeoutError:
        return "no answer"
    except (ConnectionError, OSError) as exc:
        return type(exc).__name__
    finally:
        sender.cancel()
        with suppress(asyncio.CancelledError, ConnectionError, OSError):
            await sender
        writer.close()


async def phase_bodies(ctx: Ctx, res: PhaseResult) -> None:
    """8a: 8 concurrent ~57 MB JSON-list bodies. 8b (recorded in its own row): 16 concurrent
    chunked 66 MiB uploads. One server with 1 GiB budgets for both."""
    body, want = await asyncio.to_thread(big_list_body, 5_000_000)
    server = await asyncio.to_thread(start_server, ctx, "bodies", BODY_ENV)
    other = PhaseResult("8b", "chunked 66 MiB uploads x16 (413)")
    ctx.extra.append(other)
    limit = BODY_BUDGET + 256 * MiB
    try:
        fresh = server.monitor.rss()
        res.check("RSS fresh server", mib(fresh), raw=fresh)
        res.check("body", f"{len(body) / 1e6:.0f} MB", raw=len(body))
        res.server_errors = 0
        wrong = 0
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=server.base, timeout=100) as http:

            async def one() -> None:
                nonlocal wrong
                try:
                    r, _ = await timed_post(http, "/forward", body, 100)
                except httpx.HTTPError as exc:
                    res.count("err")
                    res.notes.append(f"{type(exc).__name__}: {exc}")
                    return
                res.count(r.status_code)
                if r.status_code == 200:
                    got = orjson.loads(r.content)["outputs"]["s"]["data"]
                    wrong += close("s", got, want, 1e-4) is not None

            await asyncio.gather(*(one() for _ in range(8)))
        await asyncio.sleep(0.5)
        peak = server.sampler.peak(t0) if server.sampler else None
        res.check("wall time", f"{time.monotonic() - t0:.1f} s")
        res.check("wrong results", str(wrong), "0", wrong == 0)
        res.check(
            "peak RSS",
            mib(peak),
            f"≤ {mib(limit)} (budget + 256 MiB)",
            peak is not None and peak <= limit,
            raw=peak,
        )

        # 8b
        other.server_errors = 0
        t1 = time.monotonic()
        statuses = await asyncio.gather(
            *(chunked_upload(server.port, 66 * MiB, 60) for _ in range(16)), return_exceptions=True
        )
        for s in statuses:
            other.count(
                int(s)
                if isinstance(s, str) and s.isdigit()
                else (type(s).__name__ if isinstance(s, BaseException) else s)
            )
        await asyncio.sleep(0.5)
        peak = server.sampler.peak(t1) if server.sampler else None
        got = other.statuses.get("413", 0)
        other.check("413s", f"{got} of 16", "16", got == 16, raw=got)
        other.check("wall time", f"{time.monotonic() - t1:.1f} s")
        other.check(
            "peak RSS",
            mib(peak),
            f"≤ {mib(limit)} (budget + 256 MiB)",
            peak is not None and peak <= limit,
            raw=peak,
        )
        if not server.alive():
            other.check("server", f"died (rc={server.proc.returncode})", "alive", False)
    finally:
        server.stop(graceful=False)


# ---------------------------------------------------------------- running and reporting
PHASES: dict[str, tuple[str, Callable[[Ctx, PhaseResult], Awaitable[None]], bool]] = {
    # key: (title, function, on the main server)
    "1": ("warm-up (first 50 of the mix)", phase_warmup, True),
    "2": ("soak mix", phase_soak, True),
    "2m": ("soak mix, misbehaving clients beside it", phase_soak_misbehaving, True),
    "3": ("heavy x16", phase_heavy, True),
    "4": ("flood x64", phase_flood, True),
    "5": ("compile 100k nodes", phase_compile, True),
    "6": ("connections (30 slow, 500 idle)", phase_connections, True),
    "9": ("after load (+10 s)", phase_after, True),
    "7a": ("CPU bomb: " + BOMBS["7a"][0], phase_bomb, False),
    "7b": ("CPU bomb: " + BOMBS["7b"][0], phase_bomb, False),
    "8": ("large bodies 57 MB x8", phase_bodies, False),
}


async def run_phase(ctx: Ctx, key: str) -> PhaseResult:
    title, fn, on_main = PHASES[key]
    res = PhaseResult("8a" if key == "8" else key, title)
    res.probe_target = key in {"2", "2m", "3", "4", "5", "6"}
    log(f"phase {res.key}: {title}")
    t0 = time.monotonic()
    busy0, ours0 = machine_busy(), ctx.me.cpu_seconds()
    try:
        if on_main:
            await ensure_main(ctx)
        await asyncio.wait_for(fn(ctx, res), ctx.args.phase_limit)
    except TimeoutError:
        res.error = f"timed out after {ctx.args.phase_limit:.0f} s"
    except Exception as exc:
        first, _, rest = str(exc).partition("\n")
        res.error = f"{type(exc).__name__}: {first[:200]}"
        if rest:
            res.notes.append(rest[-1500:].replace("\n", " | "))
        traceback.print_exc()
    res.seconds = time.monotonic() - t0
    # These machines are shared: CPU that other processes used during the phase is noise.
    other = max(0.0, (machine_busy() - busy0) - (ctx.me.cpu_seconds() - ours0))
    share = other / max(res.seconds * (os.cpu_count() or 1), 1e-9)
    res.figures["other_processes_cpu_s"] = round(other, 1)
    res.notes.append(
        f"other processes on the machine used {other:.1f} CPU-s during the "
        f"phase ({share:.0%} of its {os.cpu_count()} CPUs over {res.seconds:.0f} s)"
    )
    if on_main and ctx.server is not None:
        ctx.last_main_load = time.monotonic()
        if not ctx.server.alive():
            rc = ctx.server.proc.returncode
            res.check("main server", f"died (rc={rc})", "alive", False, raw=rc)
            res.notes.append(
                f"the main server died (rc={rc}); its log ends: "
                + ctx.server.log_tail(5).replace("\n", " | ")
            )
    if res.probe is not None and res.probe_target and res.probe.p99_ms is not None:
        res.checks.insert(
            0,
            Check(
                "/healthz p99",
                f"{res.probe.p99_ms:.1f} ms",
                f"< {HEALTHZ_TARGET_S * 1000:.0f} ms",
                res.probe.p99_ms < HEALTHZ_TARGET_S * 1000,
            ),
        )
    log(f"phase {res.key} done in {res.seconds:.0f} s" + (f": {res.error}" if res.error else ""))
    return res


def table(results: Sequence[PhaseResult]) -> str:
    header = [
        "phase",
        "/healthz p50 / p99 / max ms",
        "statuses",
        "5xx≠503",
        "figure",
        "value",
        "target",
        "result",
    ]
    rows: list[list[str]] = []
    for r in results:
        first = [
            f"{r.key} {r.title}",
            r.probe.cell() if r.probe else "-",
            status_cell(r.statuses),
            "-" if r.server_errors is None else str(r.server_errors),
        ]
        checks = list(r.checks)
        if r.error:
            checks.append(Check("ERROR", r.error[:80], "", False))
        for i, c in enumerate(checks or [Check("-", "-")]):
            rows.append(
                (first if i == 0 else ["", "", "", ""])
                + [c.figure, c.value, c.target, verdict(c.passed)]
            )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows]
    return "\n".join(out)


def machine_busy() -> float:
    """CPU-seconds all processes on the machine have used since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command_line(__doc__)
    p.add_argument(
        "--phases",
        default="1,2,3,4,5,6,7,8,9",
        help="comma-separated phases to run (7 is 7a and 7b; default all)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="shorter windows: soak 15 s, heavy and flood 5 s, one compile "
        "request, connections checked at 15 s only, 20 s answer limit in 7",
    )
    p.add_argument(
        "--soak-seconds",
        type=float,
        default=None,
        help="soak duration (default 60, 15 with --quick; at most 110)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="soak-mix clients (default 16)")
    p.add_argument(
        "--heavy-matmuls",
        type=int,
        default=0,
        help="matmuls per heavy request (default: calibrated to ~2 s)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every server (repeatable)",
    )
    p.add_argument(
        "--phase-limit",
        type=float,
        default=PHASE_LIMIT_S,
        help=f"seconds a phase may take before it is cut off (at most {PHASE_LIMIT_S:.0f})",
    )
    p.add_argument("--label", default="", help="what is measured, for the header")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a new temp dir)")
    p.add_argument(
        "--server-root",
        type=Path,
        default=ROOT,
        help="source tree the servers run from (default: this repository; e.g. "
        "an export of another commit: git archive REV | tar -x -C DIR)",
    )
    args = p.parse_args(argv)
    if args.smoke:  # every phase, at the quick windows: a 2 s soak, one matmul a heavy request
        args.quick, args.soak_seconds, args.heavy_matmuls = True, 2.0, 1
    if args.soak_seconds is None:
        args.soak_seconds = 15.0 if args.quick else 60.0
    args.soak_seconds = max(1.0, min(args.soak_seconds, 110.0))
    args.phase_limit = max(1.0, min(args.phase_limit, PHASE_LIMIT_S))
    return args


def selected_keys(spec: str) -> list[str]:
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    if "7" in wanted:
        wanted |= {"7a", "7b"}
    unknown = wanted - set(PHASES) - {"7"}
    if unknown:
        raise SystemExit(f"unknown phases: {sorted(unknown)}")
    # Execution order: the main server's phases (9 right after them), then 7 and 8.
    return [k for k in PHASES if k in wanted]


async def main_async(args: argparse.Namespace) -> list[PhaseResult]:
    env = dict(kv.split("=", 1) for kv in args.env)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-hardening-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(
        args=args,
        log_dir=log_dir,
        server_root=args.server_root.resolve(),
        env=env,
        quick=args.quick,
        concurrency=args.concurrency,
    )
    log(f"server logs in {log_dir}")
    results: list[PhaseResult] = []
    keys = selected_keys(args.phases)
    try:
        for key in keys:
            results.append(await run_phase(ctx, key))
            results += ctx.extra
            ctx.extra = []
            later_on_main = any(PHASES[k][2] for k in keys[keys.index(key) + 1 :])
            if ctx.server is not None and not later_on_main:
                # The main server is done: free its memory and CPU for phases 7 and 8.
                await close_clients(ctx)
                ctx.server.stop()
                ctx.server = None  # type: ignore[assignment]
    finally:
        await close_clients(ctx)
        for s in list(_SERVERS):
            s.stop(graceful=False)
    order = {
        k: i
        for i, k in enumerate(["1", "2", "2m", "3", "4", "5", "6", "7a", "7b", "8a", "8b", "9"])
    }
    return sorted(results, key=lambda r: order.get(r.key, 99))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    nofile = raise_nofile()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.monotonic()
    try:
        results = asyncio.run(main_async(args))
    finally:
        for s in list(_SERVERS):  # interrupted: leave no server behind
            s.stop(graceful=False)
    root = args.server_root.resolve()
    server = f"git {revision()}" if root == ROOT else f"servers from {root}"
    head = (
        f"gradserve hardening bench{': ' + args.label if args.label else ''}, {started}, "
        f"{server}, "
        f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / GiB:.0f} GiB, "
        f"Python {platform.python_version()}, RLIMIT_NOFILE {nofile[0]}, "
        f"{'quick' if args.quick else 'full'} run, {time.monotonic() - t0:.0f} s"
        + (f", extra env {' '.join(args.env)}" if args.env else "")
    )
    print(head)
    print(table(results))
    notes = [(r.key, n) for r in results for n in r.notes]
    if notes:
        print("\nnotes:")
        for key, n in notes:
            print(f"  [{key}] {n}")
    if args.json:
        args.json.write_text(
            orjson.dumps(
                {
                    "header": head,
                    "phases": [{**asdict(r), "statuses": dict(r.statuses)} for r in results],
                },
                option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS,
            ).decode()
        )
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
