"""Service benchmark (not a test): prints a table.

1. Latency and throughput of the seed example (docs/contract.md; POST /backward) at
   concurrency 1 and 16, against a trivial FastAPI endpoint (the framework's floor) served
   by the same uvicorn setup in the same run. The load client is a minimal keep-alive
   HTTP/1.1 client on asyncio streams, so that client overhead does not hide server time.
2. A 4M-element float32 tensor through POST /forward (`x * 2`, no_grad) with the Python
   client: base64 against JSON lists, end to end.
3. The recurrent cell of bench/workloads.py (24 steps, batch 4, width 16, float32, forward +
   backward, gradients of every input) at concurrency 1: POST /backward against the FastAPI
   + PyTorch endpoint a user would write for it (JSON lists in, torch forward and backward,
   JSON lists out), served by the same uvicorn setup. gradserve warm (the same graph every
   request: its compiled program is cached) and cold (the constant of `a + 1` changes per
   request, so every request compiles a new graph). Both sides send the same input data
   as JSON lists and answer with the loss and every gradient as JSON lists.
4. The wire (its own servers, each with one compute worker, GRADSERVE_COMPUTE_WORKERS=1,
   and limits raised for big bodies): a 4M-element float32 round trip through POST
   /forward (`y = x * 2 + 1`, no_grad), from encode to a NumPy array, with one raw
   keep-alive HTTP/1.1 client (a blocking socket; the same code for every encoding):
   binary bodies against JSON lists and base64, and against the floor, a bare ASGI app
   that echoes the same bytes, served by the same uvicorn setup; a 30k-node graph sent by
   `graph_id` against the full graph; and the peak RSS of the server's whole process tree
   (front and workers, sampled every 3 ms, and each process's VmHWM) during a 256 MiB
   binary request.

5. The Python client: the seed example's round trip (POST /backward, JSON, sequential)
   through `gradserve.Client` and `AsyncClient` on their own HTTP/1.1 transports
   (client/transport.py), through both on httpx's transports (what they used before), and
   through a plain `httpx.Client` posting the same body, against the floor of a raw
   keep-alive socket (bench.harness.RawClient), in the same rounds.

Loopback only; every run is bounded in count and time. Each figure is the median over
`--rounds` rounds. Each round measures the floor and then the seed example back to back,
and the ratio is the median of the rounds' ratios: on a shared machine the load drifts
between rounds, and a ratio of two medians taken minutes apart would measure the drift.
uvicorn serves both with the same HTTP parser and event loop (httptools and uvloop where
installed, else h11 and asyncio); the header says which.

    python3 -m bench.bench_service [--rounds 3] [--requests 2000] [--cell-requests 200]
                                  [--parts seed,tensor,cell,wire,client] [--smoke]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64

from bench.harness import (
    Parts,
    RawClient,
    Response,
    cell_rounds,
    check_cell,
    command_line,
    http_latency,
    stack,
)
from bench.workloads import CELL_STEPS, SEED, TORCH_APP, cell_bodies, unrolled
from gradserve import AsyncClient, Client
from tests.support.server import free_port, serving

FLOOR_APP = """
from fastapi import FastAPI
app = FastAPI()

@app.post("/floor")
async def floor() -> dict[str, bool]:
    return {"ok": True}
"""


def paired(
    rounds: int, floor_port: int, gs_port: int, total: int, concurrency: int
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(floor medians, seed medians, median of the per-round p50 ratios)."""
    floors, seeds = [], []
    for _ in range(rounds):
        floors.append(http_latency(floor_port, "/floor", SEED, total, concurrency))
        seeds.append(http_latency(gs_port, "/backward", SEED, total, concurrency))
    ratio = statistics.median(s[0] / f[0] for f, s in zip(floors, seeds, strict=True))

    def med(rows: list[tuple[float, float, float]]) -> tuple[float, ...]:
        return tuple(statistics.median(col) for col in zip(*rows, strict=True))

    return med(floors), med(seeds), ratio


def client_rounds(port: int, rounds: int, requests: int) -> dict[str, tuple[float, float]]:
    """Per way of sending the seed: (median over rounds of its p50 ms, median of the
    rounds' p50 ratios against the raw socket's)."""
    base = f"http://127.0.0.1:{port}"
    seed = orjson.loads(SEED)
    graph, inputs = seed["graph"], {k: v["data"] for k, v in seed["inputs"].items()}
    wrt = [k for k, v in seed["inputs"].items() if v.get("requires_grad")]
    headers = [("Content-Type", "application/json")]

    def timed(call: Any) -> float:
        for _ in range(20):
            call()
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    def timed_async(gs: AsyncClient) -> float:
        async def run() -> float:
            async with gs:
                for _ in range(20):
                    await gs.backward(graph, inputs, requires_grad=wrt)
                times = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    await gs.backward(graph, inputs, requires_grad=wrt)
                    times.append((time.perf_counter() - t0) * 1000)
                return statistics.median(times)

        return asyncio.run(run())

    samples: dict[str, list[float]] = {k: [] for k in CLIENT_WAYS}
    for _ in range(rounds):
        with RawClient(port) as raw:
            samples["raw"].append(timed(lambda: raw.post("/backward", [SEED], headers)))
        with Client(base) as gs:
            samples["client"].append(timed(lambda: gs.backward(graph, inputs, requires_grad=wrt)))
        samples["async"].append(timed_async(AsyncClient(base)))
        with Client(base, transport=httpx.HTTPTransport()) as gs:
            samples["client-httpx"].append(
                timed(lambda: gs.backward(graph, inputs, requires_grad=wrt))
            )
        samples["async-httpx"].append(
            timed_async(AsyncClient(base, transport=httpx.AsyncHTTPTransport()))
        )
        with httpx.Client(base_url=base) as hx:
            samples["httpx"].append(
                timed(lambda: hx.post("/backward", content=SEED, headers=dict(headers)))
            )
    return {
        k: (
            statistics.median(v),
            statistics.median(a / r for a, r in zip(v, samples["raw"], strict=True)),
        )
        for k, v in samples.items()
    }


CLIENT_WAYS = {
    "raw": "a raw keep-alive socket (the floor)",
    "client": "gradserve.Client (its own transport)",
    "async": "gradserve.AsyncClient (its own transport)",
    "client-httpx": "gradserve.Client on httpx's transport",
    "async-httpx": "gradserve.AsyncClient on httpx's transport",
    "httpx": "httpx.Client, the same body",
}


def print_clients(clients: dict[str, tuple[float, float]], rounds: int, requests: int) -> None:
    print(
        f"\nthe seed example's round trip by client (POST /backward, sequential); median of "
        f"{rounds} rounds of {requests} requests; loopback"
    )
    print(f"{'client':<42} | {'p50 ms':>7} | {'vs raw socket':>13}")
    print("-" * 68)
    for key, label in CLIENT_WAYS.items():
        p50, ratio = clients[key]
        print(f"{label:<42} | {p50:7.3f} | {ratio:12.2f}x")


def big_tensor(base: str, rounds: int) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal(4_000_000).astype(np.float32)
    graph = {"nodes": [{"id": "y", "expr": "x * 2"}], "outputs": ["y"]}
    from gradserve.client.http import Client  # (here: the wire part does not depend on it)

    times: dict[str, float] = {}
    for name, threshold, encoding in [("base64", 0, "base64"), ("json", 1 << 62, "json")]:
        with Client(
            base, base64_threshold=threshold, encoding=encoding, timeout=120, retries=0
        ) as c:
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                result = c.forward(graph, {"x": x}, no_grad=True)
                samples.append(time.perf_counter() - t0)
                np.testing.assert_array_equal(result.outputs["y"], x * 2)
            times[name] = statistics.median(samples) * 1000
    return times


# ------------------------------------------------------------------ 4. the wire

WIRE_GRAPH = {"nodes": [{"id": "y", "expr": "x * 2 + 1"}], "outputs": ["y"]}
WIRE_SHAPE = (2000, 2000)  # 4M float32: nested lists for the JSON contender
FAST_REPS = 3  # requests per round for every contender but JSON lists (one)
CHAIN_STEPS, CHAIN_WIDTH = 10_000, 512  # bench.workloads.unrolled: 30,001 op nodes
CHAIN_REPS = 4  # requests per round, each way
RSS_ELEMENTS = 64 * 2**20  # 256 MiB of float32
RSS_INTERVAL_S = 0.003
# service/placement.py's NEW_MAX_DOCUMENT_BYTES: a body this small may compute in the front
# process (its fast lane), which finds a graph a worker holds in the program store.
INLINE_MAX_BODY = 16 * 1024
GiB = 1024**3
# One compute worker, so that a graph_id is held by the process that answers; and limits
# raised for a 256 MiB body.
WIRE_ENV = {
    "GRADSERVE_COMPUTE_WORKERS": "1",
    "GRADSERVE_MAX_BODY_BYTES": str(1 * GiB),
    "GRADSERVE_MEMORY_BUDGET_BYTES": str(4 * GiB),
    "GRADSERVE_NO_GRAD_MEMORY_BUDGET_BYTES": str(4 * GiB),
    "GRADSERVE_INFLIGHT_MEMORY_BYTES": str(12 * GiB),
}
# The floor of the wire: the body read and sent back as it came (the same bytes, both
# ways, with the binary header), by a bare ASGI app served by the same uvicorn setup.
ECHO_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    headers = [(b"content-type", b"application/octet-stream"),
               (b"content-length", b"%d" % len(body))]
    headers += [(k, v) for k, v in scope["headers"] if k == b"inference-header-content-length"]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
"""


def encode_tensor_request(x: np.ndarray, encoding: str) -> tuple[Parts, list[tuple[str, str]]]:
    """The POST /forward body of `y = x * 2 + 1` (no_grad), and its headers: binary (a
    JSON header, then x's bytes as they lie), base64, or JSON lists (orjson's numpy
    serializer, the fastest way to write them)."""
    request: dict[str, Any] = {"graph": WIRE_GRAPH, "no_grad": True, "encoding": encoding}
    spec = {"dtype": "float32", "shape": list(x.shape)}
    if encoding == "binary":
        request["inputs"] = {"x": {**spec, "binary_data_size": x.nbytes}}
        header = orjson.dumps(request)
        return [header, memoryview(np.ascontiguousarray(x, "<f4")).cast("B")], [
            ("Content-Type", "application/octet-stream"),
            ("Inference-Header-Content-Length", str(len(header))),
        ]
    if encoding == "base64":
        request["inputs"] = {"x": {**spec, "b64": pybase64.b64encode(x).decode("ascii")}}
        return [orjson.dumps(request)], [("Content-Type", "application/json")]
    request["inputs"] = {"x": {**spec, "data": x}}
    return [orjson.dumps(request, option=orjson.OPT_SERIALIZE_NUMPY)], [
        ("Content-Type", "application/json")
    ]


def decode_tensor_response(response: Response, section: str, name: str) -> np.ndarray:
    """Tensor `name` of `section` ("outputs"; "inputs" for the echo) as a NumPy array:
    a view on the body of a binary response, else from base64 or JSON lists."""
    status, fields, body = response
    if status != 200:
        raise RuntimeError(f"status {status}: {bytes(body[:400])!r}")
    header_length = fields.get("inference-header-content-length")
    if header_length is None:
        tensor = orjson.loads(memoryview(body))[section][name]
        if "b64" in tensor:
            raw = pybase64.b64decode(tensor["b64"], validate=True)
            return np.frombuffer(raw, "<" + np.dtype(tensor["dtype"]).str[1:]).reshape(
                tensor["shape"]
            )
        return np.array(tensor["data"], dtype=tensor["dtype"])
    n = int(header_length)
    doc = orjson.loads(memoryview(body)[:n])
    offset = n
    for where, tensors in doc.items():  # the tail: in the order the header lists them
        if where not in ("inputs", "grad_outputs", "outputs", "gradients"):
            continue
        for key, tensor in tensors.items():
            size = tensor.get("binary_data_size")
            if size is None:
                continue
            if (where, key) == (section, name):
                dtype = np.dtype(tensor["dtype"]).newbyteorder("<")
                return np.frombuffer(body, dtype, size // dtype.itemsize, offset).reshape(
                    tensor["shape"]
                )
            offset += size
    raise KeyError((section, name))


def round_trip(
    client: RawClient,
    path: str,
    x: np.ndarray,
    encoding: str,
    section: str = "outputs",
    name: str = "y",
) -> np.ndarray:
    """What is timed: encode, POST, decode."""
    parts, headers = encode_tensor_request(x, encoding)
    return decode_tensor_response(client.post(path, parts, headers), section, name)


def wire_tensor(
    gs_port: int, echo_port: int, rounds: int, shape: tuple[int, ...] = WIRE_SHAPE
) -> dict[str, Any]:
    """Per contender the median over rounds of its per-round median ms, and the medians of
    the per-round ratios; the request and response sizes."""
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    want = x * np.float32(2) + np.float32(1)
    with RawClient(gs_port) as gs, RawClient(echo_port) as echo:
        contenders: dict[str, tuple[RawClient, str, str, str, str, np.ndarray]] = {
            "floor": (echo, "/echo", "binary", "inputs", "x", x),
            "binary": (gs, "/forward", "binary", "outputs", "y", want),
            "base64": (gs, "/forward", "base64", "outputs", "y", want),
            "json": (gs, "/forward", "json", "outputs", "y", want),
        }
        sizes = {}
        for key, (client, path, encoding, section, name, expected) in contenders.items():
            got = round_trip(client, path, x, encoding, section, name)  # (and a warm-up)
            np.testing.assert_array_equal(got, expected, err_msg=key)
            sizes[key] = client.sent
            del got
        samples: dict[str, list[float]] = {k: [] for k in contenders}
        for r in range(rounds):
            order = list(contenders)[r % 4 :] + list(contenders)[: r % 4]
            times: dict[str, list[float]] = {k: [] for k in contenders}
            for rep in range(FAST_REPS):
                for key in order:
                    if key == "json" and rep:
                        continue
                    client, path, encoding, section, name, _ = contenders[key]
                    t0 = time.perf_counter()
                    round_trip(client, path, x, encoding, section, name)
                    times[key].append(time.perf_counter() - t0)
            for key, values in times.items():
                samples[key].append(statistics.median(values) * 1000)

    def ratio(a: str, b: str) -> float:
        return statistics.median(p / q for p, q in zip(samples[a], samples[b], strict=True))

    return {
        "ms": {k: statistics.median(v) for k, v in samples.items()},
        "json/binary": ratio("json", "binary"),
        "base64/binary": ratio("base64", "binary"),
        "binary/floor": ratio("binary", "floor"),
        "sent": sizes,
        "elements": int(x.size),
        "payload": int(x.nbytes),
    }


def _chain_inputs(width: int) -> dict[str, Any]:
    data = unrolled(1, width).inputs  # (the inputs do not depend on the steps)
    return {
        k: {"data": v.tolist(), "dtype": "float64", "requires_grad": True} for k, v in data.items()
    }


def wire_graph(
    gs_port: int, rounds: int, steps: int = CHAIN_STEPS, width: int = CHAIN_WIDTH
) -> dict[str, Any]:
    """POST /backward of an unrolled recurrence (3 nodes a step), the graph sent in full
    against by its graph_id, once a first full request has registered it."""
    w = unrolled(steps, width)
    inputs = _chain_inputs(width)
    headers = [("Content-Type", "application/json")]
    full = orjson.dumps({"graph": w.graph, "inputs": inputs})
    h = w.inputs["h0"]
    for _ in range(steps):
        h = np.tanh(h * w.inputs["w"] + w.inputs["x"])
    loss = float(h.sum())
    with RawClient(gs_port) as client:
        t0 = time.perf_counter()
        status, _, body = client.post("/backward", [full], headers)
        first_ms = (time.perf_counter() - t0) * 1000
        if status != 200:
            raise RuntimeError(f"status {status}: {bytes(body[:400])!r}")
        first = orjson.loads(memoryview(body))
        graph_id = first["meta"]["graph_id"]
        by_id = orjson.dumps({"graph_id": graph_id, "inputs": inputs})
        # A small body by id (the same graph, width-8 inputs), which the front process did
        # not see: placed by what the worker reported of the graph. Recorded, not required.
        tiny = orjson.dumps({"graph_id": graph_id, "inputs": _chain_inputs(8)})
        probe = client.post("/backward", [tiny], headers)[0]

        registrations = 0

        def post(body: bytes) -> dict[str, Any]:
            nonlocal registrations
            status, _, content = client.post("/backward", [body], headers)
            if status == 409 and body is by_id:  # the worker was replaced: register again
                registrations += 1
                post(full)
                status, _, content = client.post("/backward", [body], headers)
            if status != 200:
                raise RuntimeError(f"status {status}: {bytes(content[:400])!r}")
            return orjson.loads(memoryview(content))

        again = post(by_id)
        for doc in (first, again):
            np.testing.assert_allclose(doc["outputs"]["loss"]["data"], loss, rtol=1e-9)
        assert again["gradients"] == first["gradients"], "by id: other gradients"
        sent = {"full": len(full), "id": len(by_id)}
        for key, body in (("full", full), ("id", by_id)):
            client.post("/backward", [body], headers)
            sent[key] = client.sent
        samples: dict[str, list[float]] = {"full": [], "id": []}
        for r in range(rounds):
            order = ["full", "id"] if r % 2 == 0 else ["id", "full"]
            times: dict[str, list[float]] = {"full": [], "id": []}
            for _ in range(CHAIN_REPS):
                for key in order:
                    t0 = time.perf_counter()
                    post(full if key == "full" else by_id)
                    times[key].append(time.perf_counter() - t0)
            for key, values in times.items():
                samples[key].append(statistics.median(values) * 1000)
    return {
        "ms": {k: statistics.median(v) for k, v in samples.items()},
        "saved_ms": statistics.median(
            f - i for f, i in zip(samples["full"], samples["id"], strict=True)
        ),
        "first_ms": first_ms,
        "sent": sent,
        "nodes": first["meta"]["nodes"],
        "graph_nodes": len(w.graph["nodes"]),
        "width": width,
        "probe": (len(tiny), probe),
        "registrations": registrations,
    }


def _peak_rss(pid: int) -> int:
    """A process's peak RSS (VmHWM) since it started or since `_reset_peak`, in bytes."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak(pid: int) -> bool:
    """Reset a process's VmHWM to its RSS now (Linux: clear_refs 5); whether it could."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_kb(pid: int) -> tuple[int, int, int] | None:
    """(RssAnon, RssFile, RssShmem) of a process, in bytes; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith((b"RssAnon:", b"RssFile:", b"RssShmem:")):
            key, value = line.split(b":", 1)
            values[key] = int(value.split()[0]) * 1024
    return values.get(b"RssAnon", 0), values.get(b"RssFile", 0), values.get(b"RssShmem", 0)


def _pss(pid: int) -> int:
    """A process's proportional set size (each shared page divided among the processes
    that map it), in bytes; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Samples, every `interval` s, the RSS of a process (the front) and of all its
    descendants (the forkserver, the workers, the resource tracker), split into anonymous,
    file and shared-memory pages, and the bytes of the front's segments in /dev/shm (a
    segment no process maps is in no RSS)."""

    def __init__(self, pid: int, interval: float = RSS_INTERVAL_S) -> None:
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.prefix = f"gs{pid}-"
        self.halt = threading.Event()
        self.samples: list[tuple[float, tuple[int, int, int], tuple[int, int, int], int]] = []
        self.pss: list[int] = []  # the tree's PSS, per sample

    def sample(self) -> tuple[float, tuple[int, int, int], tuple[int, int, int], int]:
        front = _status_kb(self.root.pid) or (0, 0, 0)
        kids = [0, 0, 0]
        pss = _pss(self.root.pid)
        for child in self.root.children(recursive=True):
            for k, v in enumerate(_status_kb(child.pid) or (0, 0, 0)):
                kids[k] += v
            pss += _pss(child.pid)
        self.pss.append(pss)
        shm = 0
        with os.scandir("/dev/shm") as entries:
            for entry in entries:
                if entry.name.startswith(self.prefix):
                    with suppress(OSError):
                        shm += entry.stat().st_blocks * 512
        return time.perf_counter(), front, (kids[0], kids[1], kids[2]), shm

    def pids(self) -> list[int]:
        return [self.root.pid, *(c.pid for c in self.root.children(recursive=True))]

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append(self.sample())
            time.sleep(self.interval)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.samples.append(self.sample())


def wire_rss(port: int, pid: int, rounds: int, elements: int = RSS_ELEMENTS) -> dict[str, Any]:
    """Per round: the tree's RSS before a binary request of `elements` float32 (`x * 2 +
    1`, answer binary), and sampled during it; medians over rounds."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(elements, dtype=np.float32)
    want = x * np.float32(2) + np.float32(1)
    small = x[: 1 << 16]  # 256 KB: computed by the worker (this starts the pool)
    rows = []
    with RawClient(port, timeout=300) as client:
        for r in range(rounds):
            np.testing.assert_array_equal(
                round_trip(client, "/forward", small, "binary"), want[: 1 << 16]
            )
            time.sleep(0.5)
            sampler = TreeSampler(pid)
            before = [sampler.sample() for _ in range(5)]
            pids = sampler.pids()
            reset = all([_reset_peak(p) for p in pids])
            sampler.start()
            t0 = time.perf_counter()
            got = round_trip(client, "/forward", x, "binary")
            seconds = time.perf_counter() - t0
            sampler.stop()
            hwm = [_peak_rss(p) for p in pids]
            if sampler.pids() != pids:
                reset = False  # a process came or went: its VmHWM says nothing
            if r == 0:
                np.testing.assert_array_equal(got, want)
            del got
            s = sampler.samples
            total = [sum(f) + sum(k) for _, f, k, _ in s]
            at = int(np.argmax(total))
            gaps = np.diff([t for t, *_ in s])
            rows.append(
                {
                    "pss_before": statistics.median(sampler.pss[:5]),
                    "pss_peak": max(sampler.pss[5:]),
                    "before": statistics.median(sum(f) + sum(k) for _, f, k, _ in before),
                    "before_front": statistics.median(sum(f) for _, f, _, _ in before),
                    "peak": total[at],
                    "peak_front": sum(s[at][1]),
                    "peak_kids": sum(s[at][2]),
                    "peak_anon": s[at][1][0] + s[at][2][0],
                    "peak_shmem": s[at][1][2] + s[at][2][2],
                    "max_front": max(sum(f) for _, f, _, _ in s),
                    "max_kids": max(sum(k) for _, _, k, _ in s),
                    "max_segments": max(m for *_, m in s),
                    "ms": seconds * 1000,
                    "samples": len(s),
                    "max_gap_ms": float(gaps.max()) * 1000,
                    # Each process's own peak, summed: at least the tree's peak (those of the
                    # processes need not coincide); None where VmHWM could not be reset.
                    "hwm_sum": sum(hwm) if reset else None,
                    "hwm_front": hwm[0] if reset else None,
                }
            )
    out = {
        k: None
        if any(row[k] is None for row in rows)
        else statistics.median(row[k] for row in rows)
        for k in rows[0]
    }
    out["payload"] = int(x.nbytes)
    return out


def wire(
    rounds: int,
    shape: tuple[int, ...] = WIRE_SHAPE,
    steps: int = CHAIN_STEPS,
    width: int = CHAIN_WIDTH,
    rss_elements: int = RSS_ELEMENTS,
) -> dict[str, Any]:
    """The wire part, with its own servers: the figures of `print_wire`."""
    app_dir = Path(tempfile.mkdtemp(prefix="gradserve-echo-"))
    (app_dir / "echo_app.py").write_text(ECHO_APP)
    gs_port, echo_port, rss_port = free_port(), free_port(), free_port()
    echo_argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "echo_app:app",
        "--port",
        str(echo_port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--app-dir",
        str(app_dir),
    ]

    def gs_argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gradserve.service.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]

    out: dict[str, Any] = {"env": WIRE_ENV}
    with serving(gs_argv(gs_port), port=gs_port, env=WIRE_ENV, ready="/"):
        with serving(echo_argv, port=echo_port, ready="/"):
            out["tensor"] = wire_tensor(gs_port, echo_port, rounds, shape)
        out["graph"] = wire_graph(gs_port, rounds, steps, width)
    # A fresh server for the RSS: its heap has seen nothing larger before.
    with serving(gs_argv(rss_port), port=rss_port, env=WIRE_ENV, ready="/") as rss_server:
        out["rss"] = wire_rss(rss_port, rss_server.pid, rounds, rss_elements)
    return out


WIRE_TARGETS = (
    "targets: 4M float32 round trip, binary >= 20x faster than JSON lists and "
    ">= 1.5x faster than base64, <= 1.3x the echo floor;\n         256 MiB binary "
    "request: peak RSS of the server's process tree <= 2.5x the payload (256 "
    "MiB)"
)


def print_wire(w: dict[str, Any], rounds: int) -> None:
    t, g, m = w["tensor"], w["graph"], w["rss"]
    mb, mib = 1e6, 2**20
    env = " ".join(f"{k}={v}" for k, v in w["env"].items())
    print(
        f"\nthe wire: POST /forward `y = x * 2 + 1` (expr), no_grad, {t['elements']:,} "
        f"float32 in {t['payload'] / mb:.0f} MB; one raw keep-alive HTTP/1.1 client (a "
        f"blocking socket, the same code for every encoding), timed from encode to a NumPy "
        f"array; loopback, {os.cpu_count()} CPUs, {stack()}; median of {rounds} rounds, "
        f"contenders interleaved ({FAST_REPS} requests a round each, JSON lists 1)"
    )
    print(f"servers: {env}")
    print(WIRE_TARGETS)

    def met(ok: bool) -> str:
        return "yes" if ok else "MISS"

    ms = t["ms"]
    n = f"{t['elements']:,}"
    rows = [
        (
            f"{n} f32 round trip: binary vs JSON lists, ms",
            f"{ms['binary']:.1f}",
            f"{ms['json']:.0f} (JSON lists)",
            f"{t['json/binary']:.1f}x faster",
            ">= 20x",
            met(t["json/binary"] >= 20),
        ),
        (
            f"{n} f32 round trip: binary vs base64, ms",
            f"{ms['binary']:.1f}",
            f"{ms['base64']:.1f} (base64)",
            f"{t['base64/binary']:.2f}x faster",
            ">= 1.5x",
            met(t["base64/binary"] >= 1.5),
        ),
        (
            f"{n} f32 round trip: binary vs echo floor, ms",
            f"{ms['binary']:.1f}",
            f"{ms['floor']:.1f} (ASGI echo)",
            f"{t['binary/floor']:.2f}x",
            "<= 1.3x",
            met(t["binary/floor"] <= 1.3),
        ),
        (
            f"{g['graph_nodes']:,}-node graph: by graph_id vs full, ms",
            f"{g['ms']['id']:.1f}",
            f"{g['ms']['full']:.1f} (full graph)",
            f"-{g['saved_ms']:.1f} ms, -{(g['sent']['full'] - g['sent']['id']) / mb:.2f} MB",
            "-",
            "-",
        ),
        (
            f"{m['payload'] / mib:.0f} MiB binary request: peak RSS of the tree, MiB",
            f"{m['peak'] / mib:.0f}",
            f"{m['payload'] / mib:.0f} (payload)",
            f"{m['peak'] / m['payload']:.2f}x",
            "<= 2.5x",
            met(m["peak"] / m["payload"] <= 2.5),
        ),
        (
            f"{m['payload'] / mib:.0f} MiB binary request: peak PSS of the tree, MiB",
            f"{m['pss_peak'] / mib:.0f}",
            f"{m['payload'] / mib:.0f} (payload)",
            f"{m['pss_peak'] / m['payload']:.2f}x",
            "<= 2.5x",
            met(m["pss_peak"] / m["payload"] <= 2.5),
        ),
    ]
    head = ("measurement", "gradserve", "baseline", "ratio", "target", "met")
    widths = [max(len(str(row[k])) for row in (head, *rows)) for k in range(6)]
    print(" | ".join(f"{h:<{w_}}" for h, w_ in zip(head, widths, strict=True)))
    print("-+-".join("-" * w_ for w_ in widths))
    for row in rows:
        print(
            " | ".join(
                f"{c:<{w_}}" if k == 0 else f"{c:>{w_}}"
                for k, (c, w_) in enumerate(zip(row, widths, strict=True))
            )
        )
    sent = t["sent"]
    print(
        f"- {n} float32, bytes sent a request: binary {sent['binary'] / mb:.2f} MB, base64 "
        f"{sent['base64'] / mb:.2f} MB, JSON lists {sent['json'] / mb:.2f} MB, echo "
        f"{sent['floor'] / mb:.2f} MB (and as much back); ms: floor {ms['floor']:.1f}, "
        f"binary {ms['binary']:.1f}, base64 {ms['base64']:.1f}, JSON lists {ms['json']:.0f}"
    )
    print(
        f"- graph: POST /backward of bench.workloads' unrolled recurrence "
        f"({g['graph_nodes']:,} op nodes), gradients of its 3 inputs of width "
        f"{g['width']} float64, sent as JSON lists; one compute worker, so the id is held "
        f"by the process that answers; "
        f"first full request (compile) {g['first_ms']:.0f} ms; then {CHAIN_REPS} requests "
        f"each way a round; bytes sent {g['sent']['full']:,} full vs {g['sent']['id']:,} "
        f"by id; re-registrations {g['registrations']}"
    )
    size, status = g["probe"]
    print(
        f"- graph_id in a body of {size:,} bytes (<= {INLINE_MAX_BODY // 1024} KiB), the "
        f"graph sent to a worker before, got {status}"
        + (" graph-unknown although the worker holds the graph" if status == 409 else "")
    )
    hwm = (
        "could not be reset"
        if m["hwm_sum"] is None
        else f"{m['hwm_sum'] / mib:.0f} MiB ({m['hwm_sum'] / m['payload']:.2f}x; front "
        f"{m['hwm_front'] / mib:.0f})"
    )
    print(
        f"- RSS of the tree (the front and all its descendants: the forkserver, the worker, "
        f"the resource tracker), sampled every {RSS_INTERVAL_S * 1000:.0f} ms: before the "
        f"request {m['before'] / mib:.0f} MiB (front {m['before_front'] / mib:.0f}); at the "
        f"peak front {m['peak_front'] / mib:.0f} + the others {m['peak_kids'] / mib:.0f} MiB "
        f"(anonymous {m['peak_anon'] / mib:.0f}, shared memory {m['peak_shmem'] / mib:.0f});"
        f" the peak less the RSS before {(m['peak'] - m['before']) / m['payload']:.2f}x the "
        f"payload; the front's own peak {m['max_front'] / mib:.0f} MiB, the others' "
        f"{m['max_kids'] / mib:.0f}; /dev/shm segments at most "
        f"{m['max_segments'] / mib:.0f} MiB (in RSS too while mapped); the processes' own "
        f"peaks (VmHWM) summed {hwm}; request {m['ms']:.0f} ms, {m['samples']:.0f} "
        f"samples, largest gap {m['max_gap_ms']:.1f} ms"
    )
    print(
        f"- PSS of the tree (each page shared by several processes, as the libraries, the "
        f"forkserver's copy-on-write heap and a segment mapped by two, counted once, "
        f"divided among them; the RSS sum counts it in each): before the request "
        f"{m['pss_before'] / mib:.0f} MiB, at its peak {m['pss_peak'] / mib:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--cell-requests",
        type=int,
        default=200,
        help="requests per measurement of the recurrent cell",
    )
    parser.add_argument(
        "--parts",
        default="seed,tensor,cell,wire,client",
        help="comma-separated: seed, tensor, cell, wire, client",
    )
    args = parser.parse_args(argv)
    if args.smoke:  # every part, one round of a few requests
        args.rounds, args.requests, args.cell_requests = 1, 50, 5
    parts = set(args.parts.split(","))
    unknown = parts - {"seed", "tensor", "cell", "wire", "client"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")

    floor_dir = Path(tempfile.mkdtemp(prefix="gradserve-floor-"))
    (floor_dir / "floor_app.py").write_text(FLOOR_APP)
    (floor_dir / "torch_app.py").write_text(TORCH_APP)
    gs_port, floor_port, torch_port = free_port(), free_port(), free_port()
    gs_argv = [
        sys.executable,
        "-m",
        "gradserve.service.cli",
        "serve",
        "--port",
        str(gs_port),
        "--log-level",
        "warning",
    ]
    floor_argv, torch_argv = (
        [
            sys.executable,
            "-m",
            "uvicorn",
            f"{app}:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--app-dir",
            str(floor_dir),
        ]
        for app, port in (("floor_app", floor_port), ("torch_app", torch_port))
    )

    rows = []
    tensor: dict[str, float] = {}
    cell: dict[str, tuple[float, ...]] = {}
    clients: dict[str, tuple[float, float]] = {}
    # 16 slots: at concurrency 16 the default 8 would answer some requests 503 (by design).
    gs_env = {"GRADSERVE_MAX_CONCURRENCY": "16"}
    if parts & {"seed", "tensor", "cell", "client"}:
        with serving(gs_argv, port=gs_port, env=gs_env, ready="/") as gs_server:
            base = gs_server.base
            if "seed" in parts:
                with serving(floor_argv, port=floor_port, ready="/"):
                    for conc in (1, 16):
                        rows.append(
                            (conc, *paired(args.rounds, floor_port, gs_port, args.requests, conc))
                        )
            if "tensor" in parts:
                tensor = big_tensor(base, args.rounds)
            if "cell" in parts:
                with serving(torch_argv, port=torch_port, ready="/") as peer:
                    torch_base = peer.base
                    warm, _, torch_body = cell_bodies()
                    check_cell(base, torch_base, warm, torch_body)
                    cell = cell_rounds(args.rounds, gs_port, torch_port, args.cell_requests)
            if "client" in parts:
                clients = client_rounds(gs_port, args.rounds, min(args.requests, 1000))
    wired = wire(args.rounds) if "wire" in parts else None

    if rows:
        print_seed(rows, args.rounds, args.requests)
    if tensor:
        print(
            f"\n4M float32 through POST /forward (x * 2, no_grad), client end to end, median "
            f"of {args.rounds}"
        )
        print(f"  base64: {tensor['base64']:8.1f} ms")
        print(
            f"  json:   {tensor['json']:8.1f} ms   ({tensor['json'] / tensor['base64']:.1f}x "
            "slower)"
        )
    if cell:
        print_cell(cell, args.rounds, args.cell_requests)
    if wired:
        print_wire(wired, args.rounds)
    if clients:
        print_clients(clients, args.rounds, min(args.requests, 1000))


def print_cell(cell: dict[str, tuple[float, ...]], rounds: int, requests: int) -> None:
    print(
        f"\nrecurrent cell ({CELL_STEPS} steps, batch 4, width 16, float32, forward + "
        f"backward, every gradient), concurrency 1, JSON lists both ways; median of {rounds} "
        f"rounds of {requests} requests; loopback; {stack()}"
    )
    print(
        f"{'endpoint':<42} | {'p50 ms':>7} | {'p99 ms':>7} | {'req/s':>6} | "
        f"{'p50 vs FastAPI+PyTorch (target <= 0.5)':>39}"
    )
    print("-" * 112)
    for key, label in (
        ("torch", "FastAPI + PyTorch eager, POST /cell"),
        ("warm", "gradserve POST /backward, warm"),
        ("cold", "gradserve POST /backward, new constant (lifted)"),
        ("compiled", "gradserve POST /backward, new id (compiled)"),
    ):
        p50, p99, rps = cell[key]
        ratio = (
            ""
            if key == "torch"
            else f"{cell[key + '/torch'][0]:.2f}x"
            + ("" if cell[key + "/torch"][0] <= 0.5 else "  MISS")
        )
        print(f"{label:<42} | {p50:7.2f} | {p99:7.2f} | {rps:6.0f} | {ratio:>39}")


def print_seed(rows: list, rounds: int, requests: int) -> None:
    print(
        f"\nseed example (POST /backward) vs trivial FastAPI endpoint; median of "
        f"{rounds} rounds of {requests} requests; loopback, {os.cpu_count()} CPUs;"
        f" GRADSERVE_MAX_CONCURRENCY=16; {stack()}"
    )
    print(
        f"{'conc':>4} | {'endpoint':<10} | {'p50 ms':>7} | {'p99 ms':>7} | {'req/s':>8} |"
        f" {'p50 vs floor':>12}"
    )
    print("-" * 66)
    for conc, floor, seed, ratio in rows:
        print(f"{conc:>4} | {'floor':<10} | {floor[0]:7.3f} | {floor[1]:7.3f} | {floor[2]:8.0f} |")
        print(
            f"{conc:>4} | {'seed':<10} | {seed[0]:7.3f} | {seed[1]:7.3f} | {seed[2]:8.0f} |"
            f" {ratio:11.2f}x"
        )


if __name__ == "__main__":
    main()
