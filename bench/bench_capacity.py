"""Capacity benchmark (not a test): what one replica serves and holds, and what HAProxy in
front of several adds; prints one table, the figures to size replicas (and an HPA) from.

gradserve runs as local processes (`python -m gradserve.service.cli serve`, this checkout), each
with the settings of a replica of docker-compose.yml's "lb" profile (2 GiB in flight, 4
requests at once, 1 GiB budgets); HAProxy runs from its image (docker/haproxy, built here
unless --haproxy-image names one) with `docker run --network host` and its own
haproxy.cfg, its ports and the per-replica cap given by environment. Everything is on the
loopback; the load generator shares the machine's cores with the servers (say so when
you quote the figures).

Phases (each at most 2 minutes; every measurement bounded in requests and seconds):

1. replica, GRADSERVE_WORKERS=1, then 2 (a fresh server each), hit directly with as many
   keep-alive connections as it admits at once (4 per worker: no 503 by design):
   - seed: the seed example (POST /backward, 140 B, computed in the front process);
   - cell: the recurrent cell of bench/workloads.py (24 steps, 266 nodes, forward and
     backward, every gradient; a 55 KB JSON body, computed by a worker; warm: the same
     graph every request, its program cached);
   - budget: 4 clients of no_grad requests that each plan 512 MiB (a 64M-element float32
     chain made in the server: `full`, `exp`, `*`, `sum`): four admitted at once fill
     the replica's 2 GiB in flight, the replica at its memory budget.
   requests/s, p50 and p99 of the 200s, other statuses counted; the RSS (summed) and
   PSS of the server's process tree idle after a warm-up, and its peak RSS during each
   load (sampled every 20 ms); the CPU time of the servers, of HAProxy and of the load
   generator per request (what sizes a replica by cores, whatever the machine).
2. HAProxy: 1 replica behind it against 3 (GRADSERVE_WORKERS=1 each), seed and cell, with
   16 connections (HAProxy queues what the replicas do not admit at once). The same
   client against the 1 replica directly is the first phase's row.

    python3 -m bench.bench_capacity [--seconds 10] [--rounds 3] [--phases replica,lb]
                                    [--haproxy-image TAG] [--base-image TAG] [--json PATH]
                                    [--smoke]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from bench.harness import HOST, PHASE_LIMIT_S, GiB, MiB, Sampler, TreeMonitor, command_line, stack
from bench.workloads import SEED, cell_bodies
from tests.support.server import ROOT, free_port, serving

WARMUP_S = 1.0
SAMPLE_INTERVAL_S = 0.02
CONCURRENCY_PER_WORKER = 4  # the replica's GRADSERVE_MAX_CONCURRENCY
LB_CONNECTIONS = 16
HAPROXY_TAG = "gradserve-haproxy:bench"

# A replica of docker-compose.yml's "lb" profile.
REPLICA_ENV = {
    "GRADSERVE_HOST": HOST,
    "GRADSERVE_LOG_LEVEL": "warning",
    "GRADSERVE_DEFAULT_DEVICE": "cpu",
    "GRADSERVE_MAX_BODY_BYTES": str(64 * MiB),
    "GRADSERVE_INFLIGHT_MEMORY_BYTES": str(2 * GiB),
    "GRADSERVE_MEMORY_BUDGET_BYTES": str(1 * GiB),
    "GRADSERVE_NO_GRAD_MEMORY_BUDGET_BYTES": str(1 * GiB),
    "GRADSERVE_MAX_CONCURRENCY": str(CONCURRENCY_PER_WORKER),
}

BUDGET_ELEMENTS = 64 * 2**20  # float32: 256 MiB a tensor
BUDGET = orjson.dumps(
    {
        "graph": {
            "nodes": [
                {"id": "a", "expr": f"full(shape=[{BUDGET_ELEMENTS}], value=0.001)"},
                {"id": "b", "expr": "exp(a) * a"},
                {"id": "out", "expr": "sum(b)"},
            ],
            "outputs": ["out"],
        },
        "inputs": {},
        "no_grad": True,
    }
)


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# ------------------------------------------------------------------------------ load


@dataclass
class Measured:
    requests: int = 0  # answered 200
    seconds: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    statuses: dict[str, int] = field(default_factory=dict)  # other than 200, and errors
    peak_rss: int = 0  # of the servers' process trees, summed, during the load
    server_cpu_ms: float = float("nan")  # CPU of the replicas' trees per 200, ms
    proxy_cpu_ms: float = float("nan")  # CPU of HAProxy per 200, ms
    client_cpu_ms: float = float("nan")  # CPU of this load generator per 200, ms

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def _connection(
    port: int,
    request: bytes,
    stop_at: float,
    max_count: int,
    latencies: list[float],
    statuses: Counter[str],
) -> None:
    reader = writer = None
    done = 0
    try:
        while done < max_count and time.monotonic() < stop_at:
            if writer is None:
                reader, writer = await asyncio.open_connection(HOST, port)
            assert reader is not None
            t0 = time.perf_counter()
            try:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                statuses[type(e).__name__] += 1
                writer.close()
                reader = writer = None
                await asyncio.sleep(0.01)
                continue
            status = int(head.split(b" ", 2)[1])
            length, close = 0, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            await reader.readexactly(length)
            done += 1
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                statuses[str(status)] += 1
                if status == 503:
                    await asyncio.sleep(0.05)  # a client would wait (Retry-After)
            if close:
                writer.close()
                reader = writer = None
    finally:
        if writer is not None:
            writer.close()


def load(
    port: int,
    body: bytes,
    connections: int,
    seconds: float,
    max_requests: int,
    trees: list[int] | None = None,
    proxy: list[int] | None = None,
) -> Measured:
    """`connections` keep-alive connections sending POST /forward or /backward for
    `seconds` at most and `max_requests` in all at most, after a warm-up; the peak RSS
    of the process trees rooted at `trees` meanwhile, and the CPU time of those trees,
    of the `proxy` trees and of this process, per request answered 200."""
    path = "/forward" if b'"no_grad":true' in body else "/backward"
    request = _request(path, body)

    async def run(duration: float, count: int) -> tuple[list[float], Counter[str], float]:
        latencies: list[float] = []
        statuses: Counter[str] = Counter()
        stop_at = time.monotonic() + duration
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                _connection(
                    port, request, stop_at, max(count // connections, 1), latencies, statuses
                )
                for _ in range(connections)
            )
        )
        return latencies, statuses, time.perf_counter() - t0

    asyncio.run(run(WARMUP_S, max_requests))
    servers, proxies = TreeMonitor(*trees or []), TreeMonitor(*proxy or [])
    sampler = Sampler(servers, SAMPLE_INTERVAL_S)
    t0 = time.monotonic()
    cpu0 = (servers.cpu_seconds(), proxies.cpu_seconds(), time.process_time())
    try:
        latencies, statuses, elapsed = asyncio.run(run(seconds, max_requests))
    finally:
        sampler.stop()
    cpu1 = (servers.cpu_seconds(), proxies.cpu_seconds(), time.process_time())
    n = max(len(latencies), 1)
    server_ms, proxy_ms, client_ms = ((b - a) * 1000 / n for a, b in zip(cpu0, cpu1, strict=True))
    ms = np.array(latencies) * 1000
    return Measured(
        requests=len(latencies),
        seconds=elapsed,
        p50_ms=float(np.percentile(ms, 50)) if len(ms) else float("nan"),
        p99_ms=float(np.percentile(ms, 99)) if len(ms) else float("nan"),
        statuses=dict(statuses),
        peak_rss=max(sampler.peak(t0) or 0, servers.rss()),
        server_cpu_ms=server_ms,
        proxy_cpu_ms=proxy_ms if proxy else float("nan"),
        client_cpu_ms=client_ms,
    )


# ---------------------------------------------------------------------------- memory


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS summed, PSS summed) over a process and its descendants, in bytes."""
    rss = pss = 0
    for p in TreeMonitor(pid).processes():
        with suppress(psutil.Error):
            full = p.memory_full_info()
            rss += full.rss
            pss += getattr(full, "pss", 0)
    return rss, pss


# --------------------------------------------------------------------------- servers


@contextmanager
def replica(port: int, workers: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {**REPLICA_ENV, "GRADSERVE_PORT": str(port), "GRADSERVE_WORKERS": str(workers)}
    with serving([sys.executable, "-m", "gradserve.service.cli", "serve"], port=port, env=env) as s:
        yield s.proc


def build_haproxy(base_image: str) -> str:
    subprocess.run(
        [
            "docker",
            "build",
            "-q",
            "--network",
            "host",
            "--build-arg",
            f"BASE_IMAGE={base_image}",
            "-t",
            HAPROXY_TAG,
            str(ROOT / "docker" / "haproxy"),
        ],
        check=True,
        timeout=900,
        capture_output=True,
    )
    return HAPROXY_TAG


@contextmanager
def haproxy(
    image: str, port: int, stats_port: int, replica_ports: list[int], server_maxconn: int
) -> Iterator[str]:
    """HAProxy from its image, in front of the replicas listening on `replica_ports`;
    the config's three servers that have no replica point at free ports (DOWN)."""
    spare = [free_port() for _ in range(3 - len(replica_ports))]
    ports = [*replica_ports, *spare]
    name = f"gradserve-bench-haproxy-{uuid.uuid4().hex[:8]}"
    env = {
        "GRADSERVE_LB_PORT": port,
        "GRADSERVE_LB_STATS_PORT": stats_port,
        "GRADSERVE_LB_SERVER_MAXCONN": server_maxconn,
        **{f"GRADSERVE_LB_API{i}_PORT": p for i, p in enumerate(ports, 1)},
    }
    args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
    subprocess.run(
        ["docker", "run", "-d", "--rm", "--network", "host", "--name", name, *args, image],
        check=True,
        timeout=60,
        capture_output=True,
    )
    try:
        want = {f"api-{i}": "UP" if i <= len(replica_ports) else "DOWN" for i in range(1, 4)}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with suppress(httpx.HTTPError):
                rows = httpx.get(f"http://{HOST}:{stats_port}/stats;csv", timeout=2).text
                status = {
                    r.split(",")[1]: r.split(",")[17]
                    for r in rows.splitlines()
                    if r.startswith("replicas,api-")
                }
                if status == want:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"HAProxy's replicas not {want} within 30 s")
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", name], timeout=60, capture_output=True)


def container_pid(name: str) -> int:
    """The container's first process, as this host sees it (its tree is HAProxy's)."""
    out = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Pid}}", name],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout.strip())


def container_memory(name: str) -> str:
    out = subprocess.run(
        ["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip().split(" / ")[0]


# ---------------------------------------------------------------------------- phases


def phase_replica(workers: int, seconds: float, rounds: int) -> dict[str, Any]:
    port = free_port()
    conns = CONCURRENCY_PER_WORKER * workers
    warm_cell, _, _ = cell_bodies()
    t_phase = time.monotonic()
    out: dict[str, Any] = {"workers": workers, "connections": conns}
    with replica(port, workers) as proc:
        # Warm-up: every process compiles the cell once (its program cached after).
        load(port, warm_cell, conns, 2.0, 400)
        time.sleep(1.0)
        out["idle_rss"], out["idle_pss"] = tree_memory(proc.pid)
        per = min(seconds, (PHASE_LIMIT_S - 30) / (2 * rounds + 1))
        for name, body, cap in (("seed", SEED, 20_000), ("cell", warm_cell, 5_000)):
            out[name] = _best(
                [load(port, body, conns, per, cap, [proc.pid]) for _ in range(rounds)]
            )
        # At its budget: each request plans 512 MiB; 2 GiB in flight admits four.
        out["budget"] = load(port, BUDGET, CONCURRENCY_PER_WORKER, per, 200, [proc.pid])
        out["budget_planned"] = _planned(port)
    out["seconds"] = time.monotonic() - t_phase
    return out


def _planned(port: int) -> int:
    r = httpx.post(
        f"http://{HOST}:{port}/forward",
        content=BUDGET,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    return int(r.json()["meta"]["planned_peak_bytes"]) if r.status_code == 200 else -1


def _best(rows: list[Measured]) -> Measured:
    """The round of median throughput (noise on a shared machine is one-sided)."""
    return sorted(rows, key=lambda m: m.rps)[len(rows) // 2]


def phase_lb(image: str, replicas: int, seconds: float, rounds: int) -> dict[str, Any]:
    ports = [free_port() for _ in range(replicas)]
    lb_port, stats_port = free_port(), free_port()
    warm_cell, _, _ = cell_bodies()
    t_phase = time.monotonic()
    out: dict[str, Any] = {"replicas": replicas, "connections": LB_CONNECTIONS}
    with (
        _all(ports) as procs,
        haproxy(image, lb_port, stats_port, ports, CONCURRENCY_PER_WORKER) as name,
    ):
        pids, proxy = [p.pid for p in procs], [container_pid(name)]
        load(lb_port, warm_cell, LB_CONNECTIONS, 2.0, 400)  # every replica compiles it
        per = min(seconds, (PHASE_LIMIT_S - 30) / (2 * rounds))
        for wl, body, cap in (("seed", SEED, 20_000), ("cell", warm_cell, 5_000)):
            out[wl] = _best(
                [load(lb_port, body, LB_CONNECTIONS, per, cap, pids, proxy) for _ in range(rounds)]
            )
        out["haproxy_mem"] = container_memory(name)
    out["seconds"] = time.monotonic() - t_phase
    return out


@contextmanager
def _all(ports: list[int]) -> Iterator[list[subprocess.Popen[bytes]]]:
    from contextlib import ExitStack

    with ExitStack() as stack_:
        yield [stack_.enter_context(replica(p, 1)) for p in ports]


# ----------------------------------------------------------------------------- print


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def _cpu(m: Measured) -> str:
    proxy = "–" if m.proxy_cpu_ms != m.proxy_cpu_ms else f"{m.proxy_cpu_ms:.3f}"
    return f"{m.server_cpu_ms:.3f}, {proxy}, {m.client_cpu_ms:.3f}"


def _others(m: Measured) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(m.statuses.items())) or "–"


def report(results: dict[str, Any]) -> None:
    print(
        f"\ncapacity: loopback, {os.cpu_count()} CPUs (shared by the load generator, "
        f"one asyncio process, and every server), {stack()}; replicas as in "
        "docker-compose.yml's lb profile (2 GiB in flight, 4 at once, 1 GiB budgets); "
        f"the median round by throughput of {results['rounds']}, each at most "
        f"{results['seconds']:.0f} s"
    )
    print(
        "\n| setup | workload | conns | req/s | p50 ms | p99 ms | not 200 | peak RSS MiB | "
        "CPU ms/req: replicas, HAProxy, client |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ph in results.get("replica", []):
        for wl in ("seed", "cell", "budget"):
            m: Measured = ph[wl]
            conns = ph["connections"] if wl != "budget" else CONCURRENCY_PER_WORKER
            print(
                f"| 1 replica, {ph['workers']} worker(s), direct | {wl} | {conns} | "
                f"{m.rps:,.1f} | {m.p50_ms:.2f} | {m.p99_ms:.2f} | {_others(m)} | "
                f"{_mib(m.peak_rss)} | {_cpu(m)} |"
            )
    for ph in results.get("lb", []):
        for wl in ("seed", "cell"):
            m = ph[wl]
            print(
                f"| {ph['replicas']} replica(s) behind HAProxy | {wl} | {ph['connections']} "
                f"| {m.rps:,.1f} | {m.p50_ms:.2f} | {m.p99_ms:.2f} | {_others(m)} | "
                f"{_mib(m.peak_rss)} | {_cpu(m)} |"
            )
    if results.get("replica"):
        print(
            "\n| replica | idle RSS MiB (summed), compute pool up | idle PSS MiB | peak RSS "
            "MiB, seed (computed in the front process; the pool keeps its minimum) / cell / at "
            "budget | budget request planned MiB |"
        )
        print("| --- | --- | --- | --- | --- |")
        for ph in results["replica"]:
            print(
                f"| {ph['workers']} worker(s) | {_mib(ph['idle_rss'])} | "
                f"{_mib(ph['idle_pss'])} | {_mib(ph['seed'].peak_rss)} / "
                f"{_mib(ph['cell'].peak_rss)} / {_mib(ph['budget'].peak_rss)} | "
                f"{_mib(ph['budget_planned'])} |"
            )
    lbs = {ph["replicas"]: ph for ph in results.get("lb", [])}
    if 1 in lbs and 3 in lbs:
        for wl in ("seed", "cell"):
            print(
                f"3 replicas / 1 behind HAProxy, {wl}: "
                f"{lbs[3][wl].rps / lbs[1][wl].rps:.2f}x requests/s"
            )
    direct = next((ph for ph in results.get("replica", []) if ph["workers"] == 1), None)
    for wl in ("seed", "cell"):
        line = [f"{wl}, per core:"]
        if direct:
            line.append(
                f"replicas ~{1000 / direct[wl].server_cpu_ms:,.0f} req/s (1 replica, "
                "1 worker, direct)"
            )
        if 3 in lbs:
            line.append(f"HAProxy ~{1000 / lbs[3][wl].proxy_cpu_ms:,.0f} req/s")
        print(" ".join(line))
    if 1 in lbs and 3 in lbs:
        print(
            "HAProxy's memory: "
            + ", ".join(f"{n} replica(s): {ph['haproxy_mem']}" for n, ph in sorted(lbs.items()))
        )
    for key in ("replica", "lb"):
        for ph in results.get(key, []):
            assert ph["seconds"] <= PHASE_LIMIT_S, (key, ph["seconds"])


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help="at most this long a measurement (each phase stays under 2 min)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phases", default="replica,lb")
    parser.add_argument(
        "--haproxy-image",
        default="",
        help="an image built from docker/haproxy (default: build one)",
    )
    parser.add_argument(
        "--base-image", default=os.environ.get("GRADSERVE_TEST_BASE_IMAGE", "python:3.11-slim")
    )
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    if phases - {"replica", "lb"}:
        parser.error(f"unknown phases: {', '.join(sorted(phases - {'replica', 'lb'}))}")
    workers = (1, 2)
    if args.smoke:  # one replica of one worker, briefly; no image to build
        args.seconds, args.rounds, phases, workers = 0.5, 1, {"replica"}, (1,)
    results: dict[str, Any] = {"rounds": args.rounds, "seconds": args.seconds}
    if "replica" in phases:
        results["replica"] = [phase_replica(w, args.seconds, args.rounds) for w in workers]
    if "lb" in phases:
        if shutil.which("docker") is None:
            print("no docker CLI: the HAProxy phase is skipped", file=sys.stderr)
        else:
            image = args.haproxy_image or build_haproxy(args.base_image)
            results["lb"] = [phase_lb(image, n, args.seconds, args.rounds) for n in (1, 3)]
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, default=lambda o: asdict(o), indent=1))


if __name__ == "__main__":
    main()
