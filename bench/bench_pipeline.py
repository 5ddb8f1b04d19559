"""The compute pipeline as users drive it: over HTTP against `gradserve serve` with its
defaults, this checkout side by side with another revision's (`--baseline PATH`: a checkout
of it; build its compiled modules first, as pip does: `python setup.py build_ext --inplace`
there), in one run.

    python3 bench/bench_pipeline.py [--baseline PATH] [--rounds N]

Rows:
- costly by id: a graph whose program is past the fast lane (a 2-layer MLP's gradient,
  256x512 inputs: ~0.4 G cost units, a 1.6 MB binary body) sent in full, then 20 times by
  `graph_id` (gradserve's Client, as a user calls it): what the front process compiled and
  looked up (its metrics, by role), its CPU time per repeat, and the p50 of a repeat;
- recycled: the same on 2 workers, each replaced after every task (an RSS limit of 0):
  compiles on the host, and loads against worker starts;
- training step: a 2-layer tanh MLP (batch 256x32 -> 64 -> 10), 200 SGD steps through
  `Client.backward` with tracing, `graph_id` and binary bodies (a 53 KB body), the client
  updating the parameters; p50 step, and whether the steps after the first few hop to a
  worker (the worker role's lookups);
- seed warm, the 24-step cell warm and with a new constant each request, the 30,000-node
  chain repeated: p50 over HTTP (one keep-alive connection).

Each server runs alone on the machine while it is measured; rounds alternate between them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_compiled import unrolled  # noqa: E402
from bench.bench_service import RawClient, cell_bodies, free_port, server_process  # noqa: E402
from gradserve import Client, F  # noqa: E402

SEED = orjson.dumps({
    "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
    "inputs": {"x": {"data": 2.0, "requires_grad": True},
               "y": {"data": 3.0, "requires_grad": True}}})
JSON = [("Content-Type", "application/json")]
REPEATS = 20


# ------------------------------------------------------------------ servers
class Server:
    """A running `gradserve serve` (this checkout, or the one at `source`)."""

    def __init__(self, name: str, base: str, port: int, proc: Any) -> None:
        self.name, self.base, self.port, self.pid = name, base, port, proc.pid

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=30).text

    def cpu_s(self) -> float:
        times = psutil.Process(self.pid).cpu_times()
        return float(times.user + times.system)


@contextmanager
def serving(name: str, source: Path | None, **env: str) -> Iterator[Server]:
    port = free_port()
    extra = {"PYTHONPATH": str(source)} if source is not None else {}
    with server_process([sys.executable, "-m", "gradserve.service.cli", "serve", "--port",
                         str(port)], port, env={**extra, **env}, ready="/readyz",
                        start_s=60, cwd=source or ROOT) as (base, proc):
        yield Server(name, base, port, proc)


def count(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with `prefix` (label sets, in any order)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def role(text: str, metric: str, who: str) -> float | None:
    """A counter of `who` ("front" or "worker"): None where the server has no role label."""
    lines = [line for line in text.splitlines() if line.startswith(metric + "{")
             or line.startswith(metric + " ")]
    if not any("role=" in line for line in lines):
        return None
    return count("\n".join(line for line in lines if f'role="{who}"' in line), metric)


def p50(times: list[float]) -> float:
    return statistics.median(times) * 1000


# ------------------------------------------------------------------ the rows
def mlp_graph() -> dict[str, Any]:
    return {"nodes": [{"id": "h", "expr": "tanh(x @ w1)"},
                      {"id": "loss", "expr": "sum((h @ w2 - y) ** 2)"}], "outputs": ["loss"]}


def costly_by_id(server: Server) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((256, 512)).astype(np.float32),
              "w1": (rng.standard_normal((512, 512)) / 23).astype(np.float32),
              "w2": (rng.standard_normal((512, 10)) / 23).astype(np.float32),
              "y": rng.standard_normal((256, 10)).astype(np.float32)}
    before = server.metrics()
    with Client(server.base) as gs:
        first = gs.backward(mlp_graph(), inputs, requires_grad=["w1", "w2"])
        cpu0, times = server.cpu_s(), []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            r = gs.backward(mlp_graph(), inputs, requires_grad=["w1", "w2"])
            times.append(time.perf_counter() - t0)
        cpu = (server.cpu_s() - cpu0) / REPEATS
    assert np.allclose(r.gradients["w1"], first.gradients["w1"])
    after = server.metrics()
    out = {"cost": first.meta["compute_cost"], "p50_ms": p50(times), "front_cpu_ms": cpu * 1000}
    for metric in ("gradserve_compiles_total", "gradserve_program_lookups_total"):
        a, b = role(after, metric, "front"), role(before, metric, "front")
        out[metric] = None if a is None or b is None else a - b
    return out


def recycled(source: Path | None) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((256, 512)).astype(np.float32),
              "w1": (rng.standard_normal((512, 512)) / 23).astype(np.float32),
              "w2": (rng.standard_normal((512, 10)) / 23).astype(np.float32),
              "y": rng.standard_normal((256, 10)).astype(np.float32)}
    with serving("recycled", source, GRADSERVE_COMPUTE_WORKERS="2",
                 GRADSERVE_MIN_COMPUTE_WORKERS="2",
                 GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES="0") as server, \
            Client(server.base) as gs:
        for _ in range(REPEATS + 1):
            gs.backward(mlp_graph(), inputs, requires_grad=["w1", "w2"])
        time.sleep(1.0)  # (the last replacements warm)
        text = server.metrics()
    return {"compiles": count(text, "gradserve_compiles_total"),
            "loads": count(text, "gradserve_program_load_seconds_count"),
            "worker_starts": 2 + count(text, 'gradserve_compute_worker_exits_total{reason="rss"'),
            "front_compiles": role(text, "gradserve_compiles_total", "front")}


def training(server: Server, steps: int = 200) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    y = rng.standard_normal((256, 10)).astype(np.float32)
    params = {"w1": (rng.standard_normal((32, 64)) / 6).astype(np.float32),
              "w2": (rng.standard_normal((64, 10)) / 8).astype(np.float32)}

    def loss(x: Any, y: Any, w1: Any, w2: Any) -> Any:
        return {"loss": ((F.tanh(x @ w1) @ w2 - y) ** 2).mean()}

    times, losses = [], []
    warm_metrics = ""
    with Client(server.base) as gs:
        for step in range(steps):
            if step == 10:
                warm_metrics = server.metrics()
            t0 = time.perf_counter()
            r = gs.backward(loss, {"x": x, "y": y, **params}, requires_grad=["w1", "w2"])
            for k in params:
                params[k] = params[k] - np.float32(0.05) * r.gradients[k]
            times.append(time.perf_counter() - t0)
            losses.append(float(r.outputs["loss"]))
    text = server.metrics()
    hops = role(text, "gradserve_program_lookups_total", "worker")
    warm_hops = role(warm_metrics, "gradserve_program_lookups_total", "worker")
    return {"p50_ms": p50(times[10:]), "first_ms": times[0] * 1000,
            "loss": (losses[0], losses[-1]),
            "worker_lookups_after_warm": None if hops is None or warm_hops is None
            else hops - warm_hops}


def http_p50(server: Server, bodies: Callable[[], bytes], n: int) -> float:
    times = []
    with RawClient(server.port) as client:
        for _ in range(n):
            body = bodies()
            t0 = time.perf_counter()
            status, _, content = client.post("/backward", [body], JSON)
            times.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{server.name}: {status} {bytes(content[:300])!r}")
    return p50(times)


def warm_rows(server: Server, n: int) -> dict[str, float]:
    warm_cell, new_cells, _ = cell_bodies()
    chain = unrolled(10_000)
    chain_body = orjson.dumps({"graph": chain.graph, "inputs": {
        k: {"data": np.asarray(v).tolist(), "dtype": "float64", "requires_grad": True}
        for k, v in chain.inputs.items()}})
    rows = {}
    for name, make, count_ in (
            ("seed warm", lambda: SEED, n),
            ("24-step cell warm", lambda: warm_cell, n),
            ("24-step cell, a new constant each", lambda: next(new_cells), n),
            ("30,000-node chain repeated", lambda: chain_body, max(3, n // 10))):
        http_p50(server, make, 2)  # (warm)
        rows[name] = http_p50(server, make, count_)
    return rows


# ------------------------------------------------------------------ the table
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60, help="a round's requests a row")
    args = parser.parse_args()
    sources: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        sources["baseline"] = args.baseline.resolve()
    results: dict[str, dict[str, list[Any]]] = {name: {} for name in sources}
    for _ in range(args.rounds):
        for name, source in sources.items():
            with serving(name, source) as server:
                for key, value in itertools.chain(
                        warm_rows(server, args.requests).items(),
                        (("costly", costly_by_id(server)),),
                        (("training", training(server)),)):
                    results[name].setdefault(key, []).append(value)
    recycling = {name: recycled(source) for name, source in sources.items()}
    _print(results, recycling, args)


def _median(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {k: _median([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], (int, float)):
        return statistics.median(values)
    return values[-1]


def _print(results: dict[str, dict[str, list[Any]]], recycling: dict[str, Any],
           args: argparse.Namespace) -> None:
    names = list(results)
    print(f"# bench_pipeline: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
          f"medians of {args.rounds} rounds ({args.requests} requests a row a round)")
    print("| row | " + " | ".join(names) + (" | ratio |" if len(names) > 1 else ""))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    med = {n: {k: _median(v) for k, v in results[n].items()} for n in names}

    def line(label: str, values: list[float], unit: str = "ms") -> None:
        cells = [f"{v:.3f} {unit}" if v is not None else "-" for v in values]
        ratio = (f" | {values[0] / values[1]:.2f}" if len(values) > 1 and values[1] else
                 (" | -" if len(values) > 1 else ""))
        print(f"| {label} | " + " | ".join(cells) + ratio + " |")

    for row in ("seed warm", "24-step cell warm", "24-step cell, a new constant each",
                "30,000-node chain repeated"):
        line(f"{row}, p50", [med[n][row] for n in names])
    line("costly graph by id, p50 of a repeat", [med[n]["costly"]["p50_ms"] for n in names])
    line("costly graph by id, front CPU a repeat",
         [med[n]["costly"]["front_cpu_ms"] for n in names])
    line("training step, p50", [med[n]["training"]["p50_ms"] for n in names])
    for n in names:
        c, t, r = med[n]["costly"], med[n]["training"], recycling[n]
        print(f"- {n}: costly graph ({c['cost']:.3g} cost units): the front process compiled "
              f"{c['gradserve_compiles_total']} and looked up "
              f"{c['gradserve_program_lookups_total']} programs in {REPEATS} repeats by id "
              "(None: no role label on that revision)")
        print(f"- {n}: training: first step {t['first_ms']:.1f} ms, loss {t['loss'][0]:.4f} -> "
              f"{t['loss'][1]:.4f}; a worker looked programs up "
              f"{t['worker_lookups_after_warm']} times after step 10")
        print(f"- {n}: 2 workers replaced after every task: {r['compiles']:.0f} compiles on "
              f"the host ({r['front_compiles']} in the front), {r['loads']:.0f} loads for "
              f"{r['worker_starts']:.0f} worker starts")


if __name__ == "__main__":
    main()
