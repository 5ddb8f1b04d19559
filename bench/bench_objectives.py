"""The user's pattern (benchmark, not a test): GradBench's objectives (lse, gmm, least
squares, k-means, determinant, LSTM, bundle adjustment), sizes S and M, each as a user
sends it to `gradserve serve` with its defaults (the graph and its inputs as JSON lists,
POST /backward), against the FastAPI + PyTorch script a competent engineer would write
instead (bench.workloads.OBJECTIVES_APP: orjson both ways, torch on the CPU), side by
side in one run.

Each graph is sent once to warm up (both answers checked against each other), then
`--requests` times a round; rounds alternate between the two servers. Per row: the median
over rounds of each server's p50, and of their ratio; then the geometric mean of the
ratios (target: <= 0.5, no row over 1.0) and what the native tier did (meta.tier of the
last answer). Loopback only; bounded in count and time.

    python3 -m bench.bench_objectives [--rounds 5] [--requests 5] [--only lse-M,ba-M]
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.harness import RawClient, close_to, command_line
from bench.workloads import OBJECTIVES_APP, Workload, user_objectives
from tests.support.server import free_port, serving

JSON = [("Content-Type", "application/json")]
MAX_SECONDS = 600.0  # the whole run's bound


def gradserve_body(w: Workload) -> bytes:
    inputs = {
        k: {"data": a.tolist(), "dtype": a.dtype.name, "requires_grad": k in w.wrt}
        for k, a in w.inputs.items()
    }
    return orjson.dumps({"graph": w.graph, "inputs": inputs})


def script_body(w: Workload) -> bytes:
    return orjson.dumps({k: a.tolist() for k, a in w.inputs.items()})


def post(client: RawClient, path: str, body: bytes) -> tuple[float, Any]:
    """One request: its round trip in ms and its parsed answer (or raise)."""
    t0 = time.perf_counter()
    status, _, content = client.post(path, [body], JSON)
    ms = (time.perf_counter() - t0) * 1000
    if status != 200:
        raise RuntimeError(f"{path}: status {status}: {bytes(content[:400])!r}")
    return ms, memoryview(content)


def check(slug: str, w: Workload, ours: Any, theirs: Any) -> None:
    """gradserve's value and gradients are the script's, or raise."""
    mine, script = orjson.loads(ours), orjson.loads(theirs)
    rtol = 1e-8
    close_to(mine["outputs"][w.output]["data"], script["value"], rtol, f"{slug}: value")
    for k in w.wrt:
        close_to(
            np.asarray(mine["gradients"][k]["data"]),
            np.asarray(script["gradients"][k]),
            rtol,
            f"{slug}: gradient {k!r}",
        )


def rows(rounds: int, requests: int, workloads: dict[str, Workload], smoke: bool) -> list[dict]:
    apps = Path(tempfile.mkdtemp(prefix="bench-objectives-"))
    (apps / "objectives_app.py").write_text(OBJECTIVES_APP)
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "objectives_app:app",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--app-dir",
        str(apps),
    ]
    env = {"GRADSERVE_BENCH_SMOKE": "1" if smoke else "0"}  # (the checkout is its cwd)
    stop_at = time.monotonic() + MAX_SECONDS
    out = []
    try:
        with (
            serving() as server,
            serving(argv, port=port, ready="/docs", env=env),
            RawClient(server.port) as gs,
            RawClient(port) as pt,
        ):
            bodies = {slug: (gradserve_body(w), script_body(w)) for slug, w in workloads.items()}
            for slug, w in workloads.items():  # warm-up: the first of each, checked
                first_ms, ours = post(gs, "/backward", bodies[slug][0])
                _, theirs = post(pt, f"/{slug}", bodies[slug][1])
                check(slug, w, ours, theirs)
                out.append({"slug": slug, "first": first_ms, "ours": [], "theirs": []})
            for _ in range(rounds):
                if time.monotonic() > stop_at:
                    break
                for row in out:
                    ours_body, theirs_body = bodies[row["slug"]]
                    times = [post(gs, "/backward", ours_body) for _ in range(requests)]
                    row["ours"].append(statistics.median(t for t, _ in times))
                    row["meta"] = orjson.loads(times[-1][1])["meta"]
                    path = f"/{row['slug']}"
                    row["theirs"].append(
                        statistics.median(post(pt, path, theirs_body)[0] for _ in range(requests))
                    )
    finally:
        shutil.rmtree(apps, ignore_errors=True)
    for row in out:
        row["ratio"] = statistics.median(
            a / b for a, b in zip(row["ours"], row["theirs"], strict=True)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated row slugs (default: all)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.requests = 1, 1
    workloads = user_objectives(smoke=args.smoke)
    if args.only:
        workloads = {k: workloads[k] for k in args.only.split(",")}
    t0 = time.monotonic()
    table = rows(args.rounds, args.requests, workloads, args.smoke)
    print(
        f"\nthe objectives over HTTP, POST /backward with JSON lists against the FastAPI + "
        f"PyTorch script; each graph warmed once, then p50 of {args.requests} requests, "
        f"median of {args.rounds} rounds; {time.monotonic() - t0:.0f} s"
    )
    print("| row | workload | gradserve ms | script ms | gradserve / script | first ms | tier |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in table:
        meta = row["meta"]
        tier = meta["tier"] + (f" ({meta['tier_reason']})" if meta.get("tier_reason") else "")
        print(
            f"| {row['slug']} | {workloads[row['slug']].name} "
            f"| {statistics.median(row['ours']):.3g} | {statistics.median(row['theirs']):.3g} "
            f"| {row['ratio']:.2f} | {row['first']:.3g} | {tier} |"
        )
    ratios = [row["ratio"] for row in table]
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    worst = max(table, key=lambda row: row["ratio"])
    print(
        f"- geometric mean of gradserve / script: {geomean:.3f} (target <= 0.5: "
        f"{'met' if geomean <= 0.5 else 'MISS'}); the worst row {worst['slug']} at "
        f"{worst['ratio']:.2f} (target <= 1.0: {'met' if worst['ratio'] <= 1.0 else 'MISS'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
