"""POST /plan with specs only (not a test): prints a table.

A server on loopback plans requests whose inputs are specs of 10^6-element float32 tensors
(no data sent): the seed-like graph `sum((a + b) * (a - b))` on 2 inputs, and a 2-layer MLP
with its loss on 4, each on the backward path. For each: the median and p90 of the round
trip over `--requests` requests (a new graph per request, so that every one compiles: a
`+ k` salt), and the server's RSS (front process and descendants) before and after, which
would grow by the tensors' bytes if they were allocated. Target: median < 50 ms.

    python3 -m bench.bench_plan [--requests 60]
"""

from __future__ import annotations

import statistics
import sys
import time

import httpx

from bench.harness import TreeMonitor, command_line
from tests.support.server import free_port, serving

N = 1_000_000


def spec(*shape: int) -> dict[str, object]:
    return {"shape": list(shape), "dtype": "float32", "requires_grad": True}


def workloads(salt: int) -> dict[str, dict[str, object]]:
    return {
        "sum((a + b) * (a - b)), a and b of 10^6": {
            "graph": {
                "nodes": [{"id": "z", "expr": f"sum((a + b) * (a - b)) + {salt}"}],
                "outputs": ["z"],
            },
            "inputs": {"a": spec(N), "b": spec(N)},
            "path": "backward",
        },
        "MLP 1000x1000 (10^6 weights), batch 1000": {
            "graph": {
                "nodes": [
                    {"id": "h", "expr": "relu(x @ w1)"},
                    {"id": "y", "expr": "h @ w2"},
                    {"id": "loss", "expr": f"mean((y - t) ** 2) + {salt}"},
                ],
                "outputs": ["loss"],
            },
            "inputs": {
                "x": spec(1000, 1000),
                "w1": spec(1000, 1000),
                "w2": spec(1000, 1000),
                "t": spec(1000, 1000),
            },
            "path": "backward",
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests = 2
    port = free_port()
    env = {"GRADSERVE_PORT": str(port), "GRADSERVE_LOG_LEVEL": "warning"}
    argv = [sys.executable, "-m", "gradserve.service.cli", "serve"]
    with (
        serving(argv, port=port, env=env) as server,
        httpx.Client(base_url=server.base, timeout=60) as client,
    ):
        tree = TreeMonitor(server.pid)
        for body in workloads(0).values():  # warm: imports, the worker pool
            client.post("/plan", json=body).raise_for_status()
        rows = []
        for k, name in enumerate(workloads(0)):
            before = tree.rss()
            times = []
            for i in range(args.requests):
                body = workloads(1 + i + k * args.requests)[name]
                t = time.perf_counter()
                r = client.post("/plan", json=body)
                times.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
            after = tree.rss()
            plan = r.json()
            times.sort()
            rows.append(
                (
                    name,
                    statistics.median(times),
                    times[int(0.9 * len(times))],
                    plan["planned_peak_bytes"],
                    (after - before) / 2**20,
                )
            )
    print(
        f"POST /plan, specs only, a new graph each request, {args.requests} requests; "
        "target: median < 50 ms"
    )
    print("workload | median ms | p90 ms | planned peak MB | server RSS growth MiB | target")
    print("---|---|---|---|---|---")
    for name, median, p90, peak, growth in rows:
        print(
            f"{name} | {median:.1f} | {p90:.1f} | {peak / 1e6:.0f} | {growth:+.1f} | "
            f"{'met' if median < 50 else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
