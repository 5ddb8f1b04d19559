"""Service benchmark (not a test): prints a table.

1. Latency and throughput of DESIGN.md's seed example (POST /backward) at concurrency 1
   and 16, against a trivial FastAPI endpoint (the framework's floor) served by the same
   uvicorn setup in the same run. The load client is a minimal keep-alive HTTP/1.1 client
   on asyncio streams, so that client overhead does not hide server time.
2. A 4M-element float32 tensor through POST /forward (`x * 2`, no_grad) with the Python
   client: base64 against JSON lists, end to end.

Loopback only; every run is bounded in count and time. Each figure is the median over
`--rounds` rounds. Each round measures the floor and then the seed example back to back,
and the ratio is the median of the rounds' ratios: on a shared machine the load drifts
between rounds, and a ratio of two medians taken minutes apart would measure the drift.
uvicorn serves both with the same HTTP parser and event loop (httptools and uvloop where
installed, else h11 and asyncio); the header says which.

    python bench/bench_service.py [--rounds 3] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.client import Client  # noqa: E402

SEED = orjson.dumps({
    "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
    "inputs": {"x": {"data": 2.0, "requires_grad": True},
               "y": {"data": 3.0, "requires_grad": True}},
})
FLOOR_APP = """
from fastapi import FastAPI
app = FastAPI()

@app.post("/floor")
async def floor() -> dict[str, bool]:
    return {"ok": True}
"""
MAX_SECONDS_PER_RUN = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(argv: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[str]:
    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/docs", timeout=1).status_code in (200, 404):
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"server {argv} did not start")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)


async def _connection(port: int, request: bytes, count: int, stop_at: float,
                      latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(count):
            if time.monotonic() > stop_at:
                break
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


async def _load(port: int, path: str, body: bytes, total: int, concurrency: int
                ) -> tuple[list[float], float]:
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []
    stop_at = time.monotonic() + MAX_SECONDS_PER_RUN
    t0 = time.perf_counter()
    await asyncio.gather(*(
        _connection(port, request, total // concurrency, stop_at, latencies)
        for _ in range(concurrency)
    ))
    return latencies, time.perf_counter() - t0


def measure(port: int, path: str, body: bytes, total: int, concurrency: int
            ) -> tuple[float, float, float]:
    asyncio.run(_load(port, path, body, min(total, 200), concurrency))  # warm up
    latencies, seconds = asyncio.run(_load(port, path, body, total, concurrency))
    ms = np.array(latencies) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(ms) / seconds


def paired(rounds: int, floor_port: int, gs_port: int, total: int, concurrency: int
           ) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(floor medians, seed medians, median of the per-round p50 ratios)."""
    floors, seeds = [], []
    for _ in range(rounds):
        floors.append(measure(floor_port, "/floor", SEED, total, concurrency))
        seeds.append(measure(gs_port, "/backward", SEED, total, concurrency))
    ratio = statistics.median(s[0] / f[0] for f, s in zip(floors, seeds, strict=True))

    def med(rows: list[tuple[float, float, float]]) -> tuple[float, ...]:
        return tuple(statistics.median(col) for col in zip(*rows, strict=True))

    return med(floors), med(seeds), ratio


def stack() -> str:
    """The HTTP parser and event loop uvicorn picks by default ("auto")."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {http} + {loop}"


def big_tensor(base: str, rounds: int) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal(4_000_000).astype(np.float32)
    graph = {"nodes": [{"id": "y", "expr": "x * 2"}], "outputs": ["y"]}
    times: dict[str, float] = {}
    for name, threshold, encoding in [("base64", 0, "base64"), ("json", 1 << 62, "json")]:
        with Client(base, base64_threshold=threshold, encoding=encoding, timeout=120) as c:
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                result = c.forward(graph, {"x": x}, no_grad=True)
                samples.append(time.perf_counter() - t0)
                np.testing.assert_array_equal(result.outputs["y"], x * 2)
            times[name] = statistics.median(samples) * 1000
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()

    floor_dir = Path(tempfile.mkdtemp(prefix="gradserve-floor-"))
    (floor_dir / "floor_app.py").write_text(FLOOR_APP)
    gs_port, floor_port = free_port(), free_port()
    gs_argv = [sys.executable, "-m", "service.cli", "serve", "--port", str(gs_port),
               "--log-level", "warning"]
    floor_argv = [sys.executable, "-m", "uvicorn", "floor_app:app", "--port", str(floor_port),
                  "--log-level", "warning", "--no-access-log", "--app-dir", str(floor_dir)]

    rows = []
    # 16 slots: at concurrency 16 the default 8 would answer some requests 503 (by design).
    gs_env = {"GRADSERVE_MAX_CONCURRENCY": "16"}
    with server(gs_argv, gs_port, gs_env) as base, server(floor_argv, floor_port):
        for conc in (1, 16):
            rows.append((conc, *paired(args.rounds, floor_port, gs_port, args.requests, conc)))
        tensor = big_tensor(base, args.rounds)

    print(f"\nseed example (POST /backward) vs trivial FastAPI endpoint; median of "
          f"{args.rounds} rounds of {args.requests} requests; loopback, {os.cpu_count()} CPUs;"
          f" GRADSERVE_MAX_CONCURRENCY=16; {stack()}")
    print(f"{'conc':>4} | {'endpoint':<10} | {'p50 ms':>7} | {'p99 ms':>7} | {'req/s':>8} |"
          f" {'p50 vs floor':>12}")
    print("-" * 66)
    for conc, floor, seed, ratio in rows:
        print(f"{conc:>4} | {'floor':<10} | {floor[0]:7.3f} | {floor[1]:7.3f} | {floor[2]:8.0f} |")
        print(f"{conc:>4} | {'seed':<10} | {seed[0]:7.3f} | {seed[1]:7.3f} | {seed[2]:8.0f} |"
              f" {ratio:11.2f}x")
    print(f"\n4M float32 through POST /forward (x * 2, no_grad), client end to end, median of "
          f"{args.rounds}")
    print(f"  base64: {tensor['base64']:8.1f} ms")
    print(f"  json:   {tensor['json']:8.1f} ms   ({tensor['json'] / tensor['base64']:.1f}x slower)")


if __name__ == "__main__":
    main()
