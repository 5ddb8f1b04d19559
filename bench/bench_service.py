"""Service benchmark (not a test): prints a table.

1. Latency and throughput of the seed example (docs/contract.md; POST /backward) at
   concurrency 1 and 16, against a trivial FastAPI endpoint (the framework's floor) served
   by the same uvicorn setup in the same run. The load client is a minimal keep-alive
   HTTP/1.1 client on asyncio streams, so that client overhead does not hide server time.
2. A 4M-element float32 tensor through POST /forward (`x * 2`, no_grad) with the Python
   client: base64 against JSON lists, end to end.
3. The recurrent cell of bench_compiled.py (24 steps, batch 4, width 16, float32, forward +
   backward, gradients of every input) at concurrency 1: POST /backward against the FastAPI
   + PyTorch endpoint a user would write for it (JSON lists in, torch forward and backward,
   JSON lists out), served by the same uvicorn setup. gradserve warm (the same graph every
   request: its compiled program is cached) and cold (the constant of `a + 1` changes per
   request, so every request compiles a new graph). Both sides send the same input data
   as JSON lists and answer with the loss and every gradient as JSON lists.

Loopback only; every run is bounded in count and time. Each figure is the median over
`--rounds` rounds. Each round measures the floor and then the seed example back to back,
and the ratio is the median of the rounds' ratios: on a shared machine the load drifts
between rounds, and a ratio of two medians taken minutes apart would measure the drift.
uvicorn serves both with the same HTTP parser and event loop (httptools and uvloop where
installed, else h11 and asyncio); the header says which.

    python bench/bench_service.py [--rounds 3] [--requests 2000] [--cell-requests 200]
                                  [--parts seed,tensor,cell]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_compiled import recurrent_data, recurrent_graph, recurrent_numpy  # noqa: E402
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
# The script a user would write to serve the recurrent cell with PyTorch (bench_compiled's
# workload 1). A plain `def`: FastAPI runs it in its thread pool, as gradserve runs a graph
# of this size in a worker thread.
TORCH_APP = """
import torch
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class CellIn(BaseModel):
    xs: list[list[list[float]]]
    w: list[list[float]]
    u: list[list[float]]
    b: list[float]
    h0: list[list[float]]


@app.post("/cell")
def cell(req: CellIn) -> dict:
    xs = torch.tensor(req.xs, requires_grad=True)
    w = torch.tensor(req.w, requires_grad=True)
    u = torch.tensor(req.u, requires_grad=True)
    b = torch.tensor(req.b, requires_grad=True)
    h0 = torch.tensor(req.h0, requires_grad=True)
    h = h0
    for t in range(xs.shape[0]):
        a = xs[t] @ w + h @ u + b
        h = torch.sigmoid(a + 1) * h + torch.sigmoid(a) * torch.tanh(a)
    loss = torch.sum(h * h)
    loss.backward()
    grads = {"xs": xs.grad, "w": w.grad, "u": u.grad, "b": b.grad, "h0": h0.grad}
    return {"loss": loss.item(), "gradients": {k: g.tolist() for k, g in grads.items()}}
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


async def _connection(port: int, requests: Iterator[bytes], count: int, stop_at: float,
                      latencies: list[float]) -> None:
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


async def _load(port: int, path: str, body: bytes | Iterator[bytes], total: int,
                concurrency: int) -> tuple[list[float], float]:
    """`body`: one body for every request, or an iterator with a body per request."""
    if isinstance(body, bytes):
        requests: Iterator[bytes] = itertools.repeat(_request(path, body))
    else:
        requests = (_request(path, b) for b in body)
    latencies: list[float] = []
    stop_at = time.monotonic() + MAX_SECONDS_PER_RUN
    t0 = time.perf_counter()
    await asyncio.gather(*(
        _connection(port, requests, total // concurrency, stop_at, latencies)
        for _ in range(concurrency)
    ))
    return latencies, time.perf_counter() - t0


def measure(port: int, path: str, body: bytes | Iterator[bytes], total: int, concurrency: int,
            warmup: int = 200) -> tuple[float, float, float]:
    asyncio.run(_load(port, path, body, min(total, warmup), concurrency))
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


# ------------------------------------------------------------------ 3. the recurrent cell

CELL_STEPS = 24


def _lists(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: a.tolist() for k, a in arrays.items()}


def cell_bodies() -> tuple[bytes, Iterable[bytes], bytes]:
    """(gradserve warm body, gradserve cold bodies: a new graph each, PyTorch app body);
    the same float32 data in all of them, as JSON lists."""
    data = recurrent_data(CELL_STEPS)
    lists = _lists(data)
    inputs = {f"x{t}": {"data": lists["xs"][t], "requires_grad": True}
              for t in range(CELL_STEPS)}
    inputs |= {k: {"data": lists[k], "requires_grad": True} for k in ("w", "u", "b", "h0")}

    def gradserve(one: float) -> bytes:
        return orjson.dumps({"graph": recurrent_graph(CELL_STEPS, one), "inputs": inputs})

    # A constant that differs in every request (1 + k / 2**20), so each is a graph the
    # service has not seen; the math stays that of the warm graph to float32 precision.
    cold = (gradserve(1.0 + k * 2.0**-20) for k in itertools.count(1))
    return gradserve(1.0), cold, orjson.dumps(lists)


def check_cell(gs_base: str, torch_base: str, gs_body: bytes, torch_body: bytes) -> None:
    """Both endpoints agree with bench_compiled's hand-written NumPy cell, or raise."""
    loss, grads = recurrent_numpy(recurrent_data(CELL_STEPS))
    r = httpx.post(gs_base + "/backward", content=gs_body, timeout=60,
                   headers={"Content-Type": "application/json"})
    r.raise_for_status()
    gs = orjson.loads(r.content)
    gs_grads = {k: np.array(gs["gradients"][k]["data"]) for k in ("w", "u", "b", "h0")}
    gs_grads["xs"] = np.stack([gs["gradients"][f"x{t}"]["data"] for t in range(CELL_STEPS)])
    r = httpx.post(torch_base + "/cell", content=torch_body, timeout=60,
                   headers={"Content-Type": "application/json"})
    r.raise_for_status()
    pt = orjson.loads(r.content)
    pt_grads = {k: np.array(v) for k, v in pt["gradients"].items()}
    for name, value, got in (("gradserve", gs["outputs"]["loss"]["data"], gs_grads),
                             ("FastAPI+PyTorch", pt["loss"], pt_grads)):
        np.testing.assert_allclose(value, loss, rtol=1e-4, err_msg=f"{name}: loss")
        assert set(got) == set(grads), (name, sorted(got))
        for k, g in grads.items():
            np.testing.assert_allclose(got[k], g, rtol=1e-4, atol=1e-4 * np.abs(g).max(),
                                       err_msg=f"{name}: gradient {k}")


def cell_rounds(rounds: int, gs_port: int, torch_port: int, total: int
                ) -> dict[str, tuple[float, ...]]:
    """Per endpoint, the medians over rounds of (p50, p99, req/s); and the medians of the
    per-round p50 ratios against FastAPI + PyTorch."""
    warm, cold, torch_body = cell_bodies()
    samples: dict[str, list[tuple[float, float, float]]] = {"torch": [], "warm": [], "cold": []}
    for _ in range(rounds):
        samples["torch"].append(measure(torch_port, "/cell", torch_body, total, 1, warmup=20))
        samples["warm"].append(measure(gs_port, "/backward", warm, total, 1, warmup=20))
        samples["cold"].append(measure(gs_port, "/backward", iter(cold), total, 1, warmup=20))
    out: dict[str, tuple[float, ...]] = {
        k: tuple(statistics.median(col) for col in zip(*v, strict=True))
        for k, v in samples.items()}
    for k in ("warm", "cold"):
        out[k + "/torch"] = (statistics.median(
            s[0] / t[0] for s, t in zip(samples[k], samples["torch"], strict=True)),)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--cell-requests", type=int, default=200,
                        help="requests per measurement of the recurrent cell")
    parser.add_argument("--parts", default="seed,tensor,cell",
                        help="comma-separated: seed, tensor, cell")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    floor_dir = Path(tempfile.mkdtemp(prefix="gradserve-floor-"))
    (floor_dir / "floor_app.py").write_text(FLOOR_APP)
    (floor_dir / "torch_app.py").write_text(TORCH_APP)
    gs_port, floor_port, torch_port = free_port(), free_port(), free_port()
    gs_argv = [sys.executable, "-m", "service.cli", "serve", "--port", str(gs_port),
               "--log-level", "warning"]
    floor_argv, torch_argv = (
        [sys.executable, "-m", "uvicorn", f"{app}:app", "--port", str(port), "--log-level",
         "warning", "--no-access-log", "--app-dir", str(floor_dir)]
        for app, port in (("floor_app", floor_port), ("torch_app", torch_port)))

    rows = []
    tensor: dict[str, float] = {}
    cell: dict[str, tuple[float, ...]] = {}
    # 16 slots: at concurrency 16 the default 8 would answer some requests 503 (by design).
    gs_env = {"GRADSERVE_MAX_CONCURRENCY": "16"}
    with server(gs_argv, gs_port, gs_env) as base:
        if "seed" in parts:
            with server(floor_argv, floor_port):
                for conc in (1, 16):
                    rows.append((conc, *paired(args.rounds, floor_port, gs_port, args.requests,
                                               conc)))
        if "tensor" in parts:
            tensor = big_tensor(base, args.rounds)
        if "cell" in parts:
            with server(torch_argv, torch_port) as torch_base:
                warm, _, torch_body = cell_bodies()
                check_cell(base, torch_base, warm, torch_body)
                cell = cell_rounds(args.rounds, gs_port, torch_port, args.cell_requests)

    if rows:
        print_seed(rows, args.rounds, args.requests)
    if tensor:
        print(f"\n4M float32 through POST /forward (x * 2, no_grad), client end to end, median "
              f"of {args.rounds}")
        print(f"  base64: {tensor['base64']:8.1f} ms")
        print(f"  json:   {tensor['json']:8.1f} ms   ({tensor['json'] / tensor['base64']:.1f}x "
              "slower)")
    if cell:
        print_cell(cell, args.rounds, args.cell_requests)


def print_cell(cell: dict[str, tuple[float, ...]], rounds: int, requests: int) -> None:
    print(f"\nrecurrent cell ({CELL_STEPS} steps, batch 4, width 16, float32, forward + "
          f"backward, every gradient), concurrency 1, JSON lists both ways; median of {rounds} "
          f"rounds of {requests} requests; loopback; {stack()}")
    print(f"{'endpoint':<42} | {'p50 ms':>7} | {'p99 ms':>7} | {'req/s':>6} | "
          f"{'p50 vs FastAPI+PyTorch (target <= 0.5)':>39}")
    print("-" * 112)
    for key, label in (("torch", "FastAPI + PyTorch eager, POST /cell"),
                       ("warm", "gradserve POST /backward, warm"),
                       ("cold", "gradserve POST /backward, cold (new graph)")):
        p50, p99, rps = cell[key]
        ratio = "" if key == "torch" else f"{cell[key + '/torch'][0]:.2f}x" + (
            "" if cell[key + "/torch"][0] <= 0.5 else "  MISS")
        print(f"{label:<42} | {p50:7.2f} | {p99:7.2f} | {rps:6.0f} | {ratio:>39}")


def print_seed(rows: list, rounds: int, requests: int) -> None:
    print(f"\nseed example (POST /backward) vs trivial FastAPI endpoint; median of "
          f"{rounds} rounds of {requests} requests; loopback, {os.cpu_count()} CPUs;"
          f" GRADSERVE_MAX_CONCURRENCY=16; {stack()}")
    print(f"{'conc':>4} | {'endpoint':<10} | {'p50 ms':>7} | {'p99 ms':>7} | {'req/s':>8} |"
          f" {'p50 vs floor':>12}")
    print("-" * 66)
    for conc, floor, seed, ratio in rows:
        print(f"{conc:>4} | {'floor':<10} | {floor[0]:7.3f} | {floor[1]:7.3f} | {floor[2]:8.0f} |")
        print(f"{conc:>4} | {'seed':<10} | {seed[0]:7.3f} | {seed[1]:7.3f} | {seed[2]:8.0f} |"
              f" {ratio:11.2f}x")


if __name__ == "__main__":
    main()
