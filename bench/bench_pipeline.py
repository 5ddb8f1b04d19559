"""The compute pipeline as users drive it: over HTTP against `gradserve serve` with its
defaults, this checkout side by side with another revision's (`--baseline PATH`: a checkout
of it; build its compiled modules first, as pip does: `python setup.py build_ext --inplace`
there), in one run.

    python3 -m bench.bench_pipeline [--baseline PATH] [--rounds N] [--tier] [--smoke]

Rows:
- costly by id: a graph whose program is past the fast lane (70 layers of a 256x256 tanh
  layer, ~8 G cost units from a few KB of body) sent in full, then 20 times by `graph_id`
  (gradserve's Client, as a user calls it): what the front process compiled and looked up
  (its metrics, by role), its CPU time per repeat (all its threads, less what it spends
  idle), and the p50 of a repeat; beside it, at the same spacing between requests, the
  CPU of the front's cheapest answer (`/healthz`) and of an empty uvicorn app
  (bench/empty_app.py): a CPU that idles between requests runs each one slower, so the
  floor is read at the repeats' own pace;
- recycled: a 2-layer MLP's gradient (256x512 inputs, a 1.6 MB binary body) 21 times on
  2 workers, each replaced after every task (an RSS limit of 0): compiles on the host, and
  loads against worker starts;
- training step: a 2-layer tanh MLP (batch 256x32 -> 64 -> 10), 200 SGD steps through
  `Client.backward` with tracing, `graph_id` and binary bodies (a 53 KB body), the client
  updating the parameters; p50 step, and whether the steps after the first few hop to a
  worker (the worker role's lookups);
- seed warm, the 24-step cell warm and with a new constant each request, the 30,000-node
  chain repeated: p50 over HTTP (one keep-alive connection).

The native tier is off on every server unless `--tier` is given: it lowers a hot program
to XLA in the background of the serving processes, for seconds (the 30,000-node chain: for
minutes), the same work on either revision, and every request pays for it meanwhile (a
matter of the tier's own benchmark, bench/bench_xla.py). With `--tier`, each warm row is
first sent until the tier has decided on its program (at most a minute).

The servers run side by side, and each row alternates between them in short rounds (one
server idle while the other is measured), so that the drift of a shared machine falls on
both: the table gives each server's median, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from bench.harness import RawClient, command_line, count, metrics, p50, role, thread_cpu_s
from bench.workloads import SEED, cell_bodies, costly_graph, mlp_graph, unrolled
from gradserve import Client, F
from tests.support.server import ROOT, Server, free_port, serving

JSON = [("Content-Type", "application/json")]
REPEATS = 20


# ------------------------------------------------------------------ servers
@contextmanager
def empty_floor() -> Iterator[Server]:
    """bench/empty_app.py, served by uvicorn: what a front costs before it does anything."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "bench.empty_app:app", "--port", str(port)]
    with serving([*argv, "--no-access-log"], port=port, ready="/", name="floor") as floor:
        yield floor


def gradserve(name: str, source: Path | None, **env: str) -> AbstractContextManager[Server]:
    """`gradserve serve` of this checkout, or of the one at `source`."""
    return serving(name=name, root=source or ROOT, env=env)


def cpu_per_request(pid: int, request: Callable[[], Any], spacing_s: float) -> float:
    """A process's CPU time per request, `spacing_s` apart, less what it spends idle."""
    request()
    idle0 = thread_cpu_s(pid)
    time.sleep(1.0)
    idle = thread_cpu_s(pid) - idle0
    cpu0, t0 = thread_cpu_s(pid), time.perf_counter()
    for _ in range(REPEATS):
        request()
        time.sleep(spacing_s)
    return (thread_cpu_s(pid) - cpu0 - idle * (time.perf_counter() - t0)) / REPEATS


def costly_by_id(server: Server, floor: Server | None = None) -> dict[str, Any]:
    before = metrics(server)
    with Client(server.base) as gs:
        first = gs.backward(costly_graph(), {"x": 0.5}, requires_grad=["x"])
        idle0 = thread_cpu_s(server.pid)
        time.sleep(2.0)  # (what the front process spends when idle: housekeeping, timers)
        idle = (thread_cpu_s(server.pid) - idle0) / 2.0
        cpu0, t00, times = thread_cpu_s(server.pid), time.perf_counter(), []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            r = gs.backward(costly_graph(), {"x": 0.5}, requires_grad=["x"])
            times.append(time.perf_counter() - t0)
        cpu = (thread_cpu_s(server.pid) - cpu0 - idle * (time.perf_counter() - t00)) / REPEATS
    assert np.allclose(r.gradients["x"], first.gradients["x"], rtol=1e-4)  # (XLA may sum
    # in another order, once it has lowered the program)
    after = metrics(server)
    out = {"cost": first.meta["compute_cost"], "p50_ms": p50(times), "front_cpu_ms": cpu * 1000}
    # The floors at the same spacing between requests (a CPU that idles between them runs
    # the next one slower: caches and clocks): gradserve's cheapest answer, and an empty
    # uvicorn app's.
    spacing = statistics.median(times)
    out["healthz_cpu_ms"] = 1000 * cpu_per_request(
        server.pid, lambda: httpx.get(server.base + "/healthz"), spacing
    )
    if floor is not None:
        body = orjson.dumps({"graph_id": first.meta["graph_id"], "inputs": {"x": 0.5}})
        out["empty_cpu_ms"] = 1000 * cpu_per_request(
            floor.pid, lambda: httpx.post(floor.base + "/", content=body), spacing
        )
    for metric in ("gradserve_compiles_total", "gradserve_program_lookups_total"):
        a, b = role(after, metric, "front"), role(before, metric, "front")
        out[metric] = None if a is None or b is None else a - b
    return out


def recycled(source: Path | None) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    inputs = {
        "x": rng.standard_normal((256, 512)).astype(np.float32),
        "w1": (rng.standard_normal((512, 512)) / 23).astype(np.float32),
        "w2": (rng.standard_normal((512, 10)) / 23).astype(np.float32),
        "y": rng.standard_normal((256, 10)).astype(np.float32),
    }
    with (
        gradserve(
            "recycled",
            source,
            GRADSERVE_COMPUTE_WORKERS="2",
            GRADSERVE_MIN_COMPUTE_WORKERS="2",
            GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES="0",
        ) as server,
        Client(server.base) as gs,
    ):
        for _ in range(REPEATS + 1):
            gs.backward(mlp_graph(), inputs, requires_grad=["w1", "w2"])
        time.sleep(1.0)  # (the last replacements warm)
        text = metrics(server)
    return {
        "compiles": count(text, "gradserve_compiles_total"),
        "loads": count(text, "gradserve_program_load_seconds_count"),
        "worker_starts": 2 + count(text, 'gradserve_compute_worker_exits_total{reason="rss"'),
        "front_compiles": role(text, "gradserve_compiles_total", "front"),
    }


def training(server: Server, steps: int = 200) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    y = rng.standard_normal((256, 10)).astype(np.float32)
    params = {
        "w1": (rng.standard_normal((32, 64)) / 6).astype(np.float32),
        "w2": (rng.standard_normal((64, 10)) / 8).astype(np.float32),
    }

    def loss(x: Any, y: Any, w1: Any, w2: Any) -> Any:
        return {"loss": ((F.tanh(x @ w1) @ w2 - y) ** 2).mean()}

    times, losses = [], []
    warm_metrics = ""
    with Client(server.base) as gs:
        for step in range(steps):
            if step == 10:
                warm_metrics = metrics(server)
            t0 = time.perf_counter()
            r = gs.backward(loss, {"x": x, "y": y, **params}, requires_grad=["w1", "w2"])
            for k in params:
                params[k] = params[k] - np.float32(0.05) * r.gradients[k]
            times.append(time.perf_counter() - t0)
            losses.append(float(r.outputs["loss"]))
    text = metrics(server)
    hops = role(text, "gradserve_program_lookups_total", "worker")
    warm_hops = role(warm_metrics, "gradserve_program_lookups_total", "worker")
    return {
        "p50_ms": p50(times[10:]),
        "first_ms": times[0] * 1000,
        "loss": (losses[0], losses[-1]),
        "worker_lookups_after_warm": None
        if hops is None or warm_hops is None
        else hops - warm_hops,
    }


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


def settle(server: Server, body: bytes, limit_s: float = 60.0) -> str:
    """Send `body` until the native tier has decided on its program (lowered, or left to
    the interpreter for good): a user's steady state, not the minutes of a tier-up."""
    deadline = time.monotonic() + limit_s
    reason = "cold"
    with RawClient(server.port) as client:
        while reason in ("cold", "compiling") and time.monotonic() < deadline:
            _, _, content = client.post("/backward", [body], JSON)
            meta = orjson.loads(memoryview(content))["meta"]
            reason = "xla" if meta["tier"] == "xla" else meta["tier_reason"]
            time.sleep(0.05)
    return reason


WARM_ROWS = (
    "seed warm",
    "24-step cell warm",
    "24-step cell, a new constant each",
    "30,000-node chain repeated",
)


def warm_bodies() -> dict[str, tuple[Callable[[], bytes], int]]:
    """Each warm row's bodies, and how many a round sends (of the 30,000-node chain, a
    tenth: each is ~0.1 s)."""
    warm_cell, new_cells, _ = cell_bodies()
    chain = unrolled(10_000)
    chain_body = orjson.dumps(
        {
            "graph": chain.graph,
            "inputs": {
                k: {"data": np.asarray(v).tolist(), "dtype": "float64", "requires_grad": True}
                for k, v in chain.inputs.items()
            },
        }
    )
    return {
        "seed warm": (lambda: SEED, 10),
        "24-step cell warm": (lambda: warm_cell, 10),
        "24-step cell, a new constant each": (lambda: next(new_cells), 10),
        "30,000-node chain repeated": (lambda: chain_body, 2),
    }


# ------------------------------------------------------------------ the table
def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision")
    parser.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="rounds of the warm rows, alternating between the servers",
    )
    parser.add_argument(
        "--tier",
        action="store_true",
        help="leave the native tier on (by default off on every server)",
    )
    args = parser.parse_args(argv)
    args.others = 3
    if args.smoke:  # every row once
        args.rounds = args.others = 1
    if not args.tier:
        os.environ["GRADSERVE_XLA"] = "off"  # (the servers inherit it)
    sources: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        sources["baseline"] = args.baseline.resolve()
    results: dict[str, dict[str, list[Any]]] = {name: {} for name in sources}
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(gradserve(name, source)) for name, source in sources.items()
        }
        floor = stack.enter_context(empty_floor())
        bodies = warm_bodies()
        for row, (make, count_) in bodies.items():
            for server in servers.values():
                if "new constant" not in row and args.tier:
                    settle(server, make())
                http_p50(server, make, 3)  # (warm)
            for _ in range(args.rounds):  # (short rounds, alternating: drift hits both)
                for name, server in servers.items():
                    results[name].setdefault(row, []).append(http_p50(server, make, count_))
        for _ in range(args.others):
            for name, server in servers.items():
                results[name].setdefault("costly", []).append(costly_by_id(server, floor))
                results[name].setdefault("training", []).append(training(server))
    recycling = {name: recycled(source) for name, source in sources.items()}
    _print(results, recycling, args)


def _median(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {k: _median([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], (int, float)):
        return statistics.median(values)
    return values[-1]


def _print(
    results: dict[str, dict[str, list[Any]]], recycling: dict[str, Any], args: argparse.Namespace
) -> None:
    names = list(results)
    print(
        f"# bench_pipeline: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; the warm "
        f"rows in {args.rounds} short rounds alternating between the servers (each a p50), "
        f"the others in {args.others}; medians, and the median of the per-round ratios; "
        f"native tier {'on' if args.tier else 'off'}"
    )
    print("| row | " + " | ".join(names) + (" | ratio |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")

    def line(label: str, per_round: list[list[float]], unit: str = "ms") -> None:
        cells = [f"{statistics.median(v):.3f} {unit}" for v in per_round]
        ratio = ""
        if len(per_round) > 1:
            this, base = per_round[:2]
            ratio = f" | {statistics.median(a / b for a, b in zip(this, base, strict=True)):.2f}"
        print(f"| {label} | " + " | ".join(cells) + ratio + " |")

    for row in WARM_ROWS:
        line(f"{row}, p50", [results[n][row] for n in names])
    line(
        "costly graph by id, p50 of a repeat",
        [[r["p50_ms"] for r in results[n]["costly"]] for n in names],
    )
    line(
        "costly graph by id, front CPU a repeat",
        [[r["front_cpu_ms"] for r in results[n]["costly"]] for n in names],
    )
    line(
        "/healthz at the repeats' spacing, front CPU a request",
        [[r["healthz_cpu_ms"] for r in results[n]["costly"]] for n in names],
    )
    print(
        "| an empty uvicorn app (bench/empty_app.py) at the repeats' spacing, CPU a request | "
        + " | ".join(
            f"{statistics.median(r['empty_cpu_ms'] for r in results[n]['costly']):.3f} ms"
            for n in names
        )
        + (" | |" if len(names) > 1 else " |")
    )
    line("training step, p50", [[r["p50_ms"] for r in results[n]["training"]] for n in names])
    med = {
        n: {k: _median(v) for k, v in results[n].items() if k in ("costly", "training")}
        for n in names
    }
    for n in names:
        c, t, r = med[n]["costly"], med[n]["training"], recycling[n]
        print(
            f"- {n}: costly graph ({c['cost']:.3g} cost units): the front process compiled "
            f"{c['gradserve_compiles_total']} and looked up "
            f"{c['gradserve_program_lookups_total']} programs in {REPEATS} repeats by id "
            "(None: no role label on that revision)"
        )
        print(
            f"- {n}: training: first step {t['first_ms']:.1f} ms, loss {t['loss'][0]:.4f} -> "
            f"{t['loss'][1]:.4f}; a worker looked programs up "
            f"{t['worker_lookups_after_warm']} times after step 10"
        )
        print(
            f"- {n}: 2 workers replaced after every task: {r['compiles']:.0f} compiles on "
            f"the host ({r['front_compiles']} in the front), {r['loads']:.0f} loads for "
            f"{r['worker_starts']:.0f} worker starts"
        )


if __name__ == "__main__":
    main()
