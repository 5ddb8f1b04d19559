"""Programs that stay compiled (benchmark, not a test): prints one table against the
targets of the issue, every figure measured as a user runs gradserve, over HTTP against
`gradserve serve` with its defaults, on loopback.

1. repeats   the 30,000- and 3,000-node chains (bench.workloads.unrolled, width 8, float64,
             fwd+bwd): the first request, then repeats sent in full from two clients at
             once (so that both compute workers answer some: one holds the program, the
             other loads it from the store), then by graph_id. "plan" is the server's
             meta.timings_ms.plan (finding the graph and the program, parsing, decoding)
             against its forward + backward.
2. cold      the 3,000-node chain, warm, then its first request after 60 s idle
             (--idle-seconds), after its worker was recycled (a server that recycles a
             worker after every task: GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES=0), and
             after a restart of a server with a persistent store
             (GRADSERVE_PROGRAM_STORE_DIR), each against a warm request's round trip on a
             server with the defaults, every request on a new connection.
3. compile   in process: compile_graph's µs a node on the chains and the recurrent cell
             (the kernel, shape and VJP memos warm from other graphs, never this one), and
             a store load of each program against its compile.
4. cell      the recurrent cell (24 steps) with a new constant every request (a new graph:
             define-by-run), over HTTP, against the FastAPI + PyTorch script a user would
             write (bench.workloads.TORCH_APP), in the same run.
5. soak      bench_hardening's soak mix at concurrency 16 with misbehaving clients beside it
             (200 idle connections, slow senders, uploads cut short): /healthz p99, the seed
             requests' p50, unexpected 5xx, and every 503 matched to the admission queue's
             counters; then the server's RSS 10 s after the load against after its warm-up.

Loopback only; every loop is bounded in count and time.

    python3 -m bench.bench_programs [--parts repeats,cold,compile,cell,soak] [--rounds 5]
                                    [--idle-seconds 60] [--soak-seconds 30] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil

from bench.harness import RawClient, Report, cell_rounds, check_cell, command_line
from bench.workloads import TORCH_APP, cell_bodies, recurrent_cell, unrolled
from tests.support.server import ROOT, free_port, serving

JSON = [("Content-Type", "application/json")]


# ---------------------------------------------------------------- servers and requests


def chain_bodies(steps: int) -> tuple[bytes, Callable[[str], bytes], float]:
    """The unrolled chain of `steps` steps (3 nodes a step): its body in full, a body by
    id, and its loss, to check every answer."""
    w = unrolled(steps)
    inputs = {
        k: {"data": v.tolist(), "dtype": "float64", "requires_grad": True}
        for k, v in w.inputs.items()
    }
    h = w.inputs["h0"]
    for _ in range(steps):
        h = np.tanh(h * w.inputs["w"] + w.inputs["x"])
    full = orjson.dumps({"graph": w.graph, "inputs": inputs})
    return (
        full,
        lambda graph_id: orjson.dumps({"graph_id": graph_id, "inputs": inputs}),
        float(h.sum()),
    )


@dataclass
class Answer:
    ms: float  # round trip
    meta: dict[str, Any]

    @property
    def plan(self) -> float:
        return float(self.meta["timings_ms"]["plan"])

    @property
    def run(self) -> float:
        t = self.meta["timings_ms"]
        return float(t["forward"] + t.get("backward", 0.0))


def post(client: RawClient, body: bytes, loss: float, path: str = "/backward") -> Answer:
    t0 = time.perf_counter()
    status, _, content = client.post(path, [body], JSON)
    ms = (time.perf_counter() - t0) * 1000
    if status != 200:
        raise RuntimeError(f"status {status}: {bytes(content[:300])!r}")
    doc = orjson.loads(memoryview(content))
    got = doc["outputs"]["loss"]["data"]
    if not np.isclose(got, loss, rtol=1e-9):
        raise RuntimeError(f"wrong loss {got} (want {loss})")
    return Answer(ms, doc["meta"])


def two_clients(port: int, body: bytes, loss: float, each: int) -> list[Answer]:
    """`each` requests from each of two clients at once (both compute workers answer)."""
    answers: list[Answer] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            with RawClient(port) as c:
                for _ in range(each):
                    answers.append(post(c, body, loss))
        except BaseException as exc:  # (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return answers


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------- 1. repeats


def chain_name(steps: int) -> str:
    return f"{3 * steps:,}-node chain"


def part_repeats(report: Report, rounds: int, chains: tuple[int, int]) -> None:
    for steps in chains:
        name = chain_name(steps)
        full, by_id, loss = chain_bodies(steps)
        with serving() as server, RawClient(server.port) as c:
            first = post(c, full, loss)
            report.add(
                "repeats",
                f"{name}: first request (compiles)",
                f"{first.ms:.0f} ms (plan {first.plan:.0f}, run {first.run:.0f})",
            )
            answers = two_clients(server.port, full, loss, rounds)
            graph_id = first.meta["graph_id"]
            ids = two_clients(server.port, by_id(graph_id), loss, rounds)
        runs = [a.run for a in answers + ids]
        for label, group, target in (("sent in full", answers, 0.1), ("by graph_id", ids, 0.05)):
            sources = sorted({a.meta["program"] for a in group})
            for source in sources:
                picked = [a for a in group if a.meta["program"] == source]
                ratio = _med([a.plan / a.run for a in picked])
                report.add(
                    "repeats",
                    f"{name} {label}, program from {source} ({len(picked)} requests)",
                    f"plan {_med([a.plan for a in picked]):.1f} ms, run "
                    f"{_med([a.run for a in picked]):.1f} ms: {ratio:.3f}x",
                    f"plan <= {target}x run",
                    ratio <= target,
                )
        report.notes.append(
            f"{name}: {len(full) / 1e6:.2f} MB in full; fwd+bwd median {_med(runs):.1f} ms"
        )


# ---------------------------------------------------------------- 2. cold starts


def _warm(c: RawClient, body: bytes, loss: float, n: int) -> float:
    return _med([post(c, body, loss).ms for _ in range(n)])


def part_cold(report: Report, rounds: int, idle_seconds: float, steps: int) -> None:
    """Each figure against two references on a server with the defaults: a warm request
    (back to back), and a warm request after a 1.5 s pause, which shows what a pause costs
    this machine whatever the server does (caches and clocks of a shared VM). Every request
    is on a new connection (a kept-alive one does not outlive the server's 10 s header
    timeout)."""
    full, _, loss = chain_bodies(steps)
    n = max(rounds, 5)

    def fresh(port: int, pause: float = 0.0) -> Answer:
        time.sleep(pause)
        with RawClient(port) as c:
            return post(c, full, loss)

    with serving() as server:
        port = server.port
        fresh(port)
        warm = _med([fresh(port).ms for _ in range(n)])
        paused = _med([fresh(port, 1.5).ms for _ in range(n)])
        report.add(
            "cold",
            f"{chain_name(steps)}, warm round trip (back to back / after a 1.5 s pause)",
            f"{warm:.1f} ms / {paused:.1f} ms",
        )
        time.sleep(idle_seconds)
        idle = fresh(port)

    def row(figure: str, after: Answer) -> None:
        report.add(
            "cold",
            figure,
            f"{after.ms:.1f} ms: {after.ms / warm:.2f}x warm, "
            f"{after.ms / paused:.2f}x paused (program from {after.meta['program']})",
            "<= 1.2x warm",
            after.ms <= 1.2 * warm,
        )

    row(f"first request after {idle_seconds:.0f} s idle", idle)
    # Every task recycles its worker (no RSS growth allowed): the replacement starts first,
    # takes over the programs, and the old worker exits once it is warm; each request here
    # comes after a pause long enough for that, and finds only the new worker.
    with serving(env={"GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES": "0"}) as server:
        port = server.port
        fresh(port)
        after = sorted((fresh(port, 1.5) for _ in range(n)), key=lambda a: a.ms)
    row(f"first request after its worker was recycled (median of {n})", after[n // 2])
    store = tempfile.mkdtemp(prefix="bench-programs-store-")
    try:
        env = {"GRADSERVE_PROGRAM_STORE_DIR": store}
        with serving(env=env) as server:
            port = server.port
            fresh(port)
            fresh(port)  # (a cheap program is stored at its second use)
            time.sleep(2.0)  # (the store's writes follow the answers, when idle)
        with serving(env=env) as server:
            port = server.port
            row("first request after a restart with a persistent store", fresh(port))
    finally:
        shutil.rmtree(store, ignore_errors=True)


# ---------------------------------------------------------------- 3. compile and load


def part_compile(report: Report, rounds: int, chains: tuple[int, int]) -> None:
    from gradserve.engine.graph import TensorSpec, compile_graph
    from gradserve.engine.graph.serial import dump_program, load_program
    from gradserve.service.schemas import Graph

    workloads = [
        *((chain_name(steps), unrolled(steps), 10.0) for steps in chains),
        ("recurrent cell", recurrent_cell(), 5.0),
    ]
    # Memos warm from other graphs (as a server's are): compile a salted copy first.
    for _, w, _ in workloads:
        salted = {
            "nodes": [
                *w.graph["nodes"],
                {"id": "salt", "op": "mul", "args": [next(iter(w.inputs)), 3.25]},
            ],
            "outputs": w.graph["outputs"],
        }
        compile_graph(Graph.model_validate(salted), _specs(w, TensorSpec), backward=True)
    for name, w, target in workloads:
        spec = Graph.model_validate(w.graph)
        specs = _specs(w, TensorSpec)
        nodes = len(w.graph["nodes"])
        compile_ms, load_ms = [], []
        program = None
        for _ in range(rounds):
            t0 = time.perf_counter()
            program = compile_graph(spec, specs, backward=True)
            compile_ms.append((time.perf_counter() - t0) * 1000)
            data = dump_program(program)
            t0 = time.perf_counter()
            load_program(data, "cpu")
            load_ms.append((time.perf_counter() - t0) * 1000)
        per_node = _med(compile_ms) * 1000 / nodes
        report.add(
            "compile",
            f"{name} ({nodes} nodes, {len(program.steps)} steps)",
            f"{per_node:.1f} µs/node ({_med(compile_ms):.1f} ms)",
            f"<= {target:.0f} µs/node",
            per_node <= target,
        )
        ratio = _med(compile_ms) / _med(load_ms)
        report.add(
            "compile",
            f"{name}: load from the store",
            f"{_med(load_ms):.2f} ms ({ratio:.0f}x faster than compiling)",
            ">= 10x",
            ratio >= 10,
        )


def _specs(w: Any, spec: Any) -> dict[str, Any]:
    return {
        k: spec(np.asarray(v).shape, str(np.asarray(v).dtype), k in w.wrt)
        for k, v in w.inputs.items()
    }


# ---------------------------------------------------------------- 4. the cell


def part_cell(report: Report, rounds: int, requests: int) -> None:
    apps = Path(tempfile.mkdtemp(prefix="bench-programs-torch-"))
    (apps / "torch_app.py").write_text(TORCH_APP)
    torch_port = free_port()
    torch_argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "torch_app:app",
        "--port",
        str(torch_port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--app-dir",
        str(apps),
    ]
    try:
        with serving() as server, serving(torch_argv, port=torch_port, ready="/") as peer:
            port, tb = server.port, peer.base
            warm, _, torch_body = cell_bodies()
            check_cell(f"http://127.0.0.1:{port}", tb, warm, torch_body)
            cell = cell_rounds(rounds, port, torch_port, requests)
    finally:
        shutil.rmtree(apps, ignore_errors=True)
    ratio = cell["cold/torch"][0]
    report.add("cell", "FastAPI + PyTorch script, p50", f"{cell['torch'][0]:.2f} ms")
    report.add(
        "cell",
        "gradserve, a new constant each request (lifted), p50",
        f"{cell['cold'][0]:.2f} ms ({ratio:.2f}x the script)",
        "<= 0.5x",
        ratio <= 0.5,
    )
    report.add(
        "cell",
        "gradserve, a new node id each request (compiled), p50",
        f"{cell['compiled'][0]:.2f} ms ({cell['compiled/torch'][0]:.2f}x the script)",
    )
    report.add(
        "cell",
        "gradserve, the same graph each request, p50",
        f"{cell['warm'][0]:.2f} ms ({cell['warm/torch'][0]:.2f}x the script)",
    )


# ---------------------------------------------------------------- 5. soak


def part_soak(report: Report, soak_seconds: float) -> None:
    out = Path(tempfile.mkdtemp(prefix="bench-programs-soak-")) / "soak.json"
    argv = ["--phases", "1,2m,9", "--soak-seconds", str(soak_seconds), "--json", str(out)]
    # The hardening benchmark's own run, as a user would start it: its JSON is the record.
    subprocess.run([sys.executable, "-m", "bench.bench_hardening", *argv], check=True, cwd=ROOT)
    phases = {p["key"]: p for p in orjson.loads(out.read_bytes())["phases"]}
    for key, title in (("2m", "soak, misbehaving clients beside it"), ("9", "after load")):
        phase = phases.get(key)
        if phase is None:
            report.add("soak", title, "did not run", "", False)
            continue
        for check in phase["checks"]:
            report.add(
                "soak",
                f"{title}: {check['figure']}",
                check["value"],
                check["target"],
                check["passed"],
            )
        if phase.get("error"):
            report.add("soak", f"{title}: error", phase["error"], "", False)


# ---------------------------------------------------------------- main

PARTS: dict[str, Callable[[Report, argparse.Namespace], None]] = {
    "repeats": lambda r, a: part_repeats(r, a.rounds, a.chains),
    "cold": lambda r, a: part_cold(r, a.rounds, a.idle_seconds, a.chains[-1]),
    "compile": lambda r, a: part_compile(r, a.rounds, a.chains),
    "cell": lambda r, a: part_cell(r, a.rounds, a.cell_requests),
    "soak": lambda r, a: part_soak(r, a.soak_seconds),
}


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cell-requests", type=int, default=100)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--soak-seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    args.chains = (10_000, 1_000)  # steps: the 30,000- and 3,000-node chains
    if args.smoke:
        args.chains, args.rounds, args.cell_requests = (300, 100), 1, 5
        args.idle_seconds, args.soak_seconds = 0.5, 2.0
    parts = [s for s in args.parts.split(",") if s]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    report = Report()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.monotonic()
    for part in parts:
        print(f"[bench_programs] {part} ...", file=sys.stderr, flush=True)
        try:
            PARTS[part](report, args)
        except Exception as exc:  # a part that fails is reported, and the others still run
            report.error(part, exc)
    report.print(
        f"gradserve programs bench, {started}, {os.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"{time.monotonic() - t0:.0f} s, rounds {args.rounds}"
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    asyncio.get_event_loop_policy()  # (bench_hardening runs its own loops)
    sys.exit(main())
