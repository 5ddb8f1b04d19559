"""The native tier as users meet it: over HTTP against `gradserve serve` with its defaults,
the tier on (`GRADSERVE_XLA=auto`, jax installed) beside the same server with it off, in
one run.

    python3 -m bench.bench_tier [--steps N] [--seconds S] [--smoke]

Rows:
- one-off long loop: a `scan` of N steps over 4 values (a small body: a GradBench descent's
  shape), fwd+bwd, sent once to a fresh server, then a second time: the tier lowers it
  before its first run (its predicted saving on that run exceeds the compile);
- the RNN that pays by reuse: a 1,000-step scan RNN (~13,000 steps executed), sent until
  the tier has lowered it (at most S seconds): the request at which it did, then its warm
  p50 on both servers;
- the seed while a program tiers up: the seed's p50 over HTTP on one connection while a
  second client sends the RNN (first seen) every 20 ms for S seconds, against the same on the server
  with the tier off (the lowering is in the lowering process, niced);
- lowerings of one program on a host: two workers, each replaced after every task (an RSS
  growth limit of 0), then a restart on the same persistent store, the long loop sent to
  each: lowerings counted by the servers' metrics (target: 1).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import orjson

from bench.harness import command_line, count, metrics
from bench.workloads import SEED
from tests.support.server import Server, serving

JSON = {"Content-Type": "application/json"}


def long_loop(steps: int) -> bytes:
    body = {
        "carry": ["h"],
        "next": {"h": "h2"},
        "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(1.1 * h + a)"}],
    }
    return orjson.dumps(
        {
            "graph": {
                "nodes": [
                    {
                        "id": "rnn",
                        "op": "scan",
                        "args": ["h0"],
                        "body": body,
                        "results": {"h_end": "h"},
                        "attrs": {"length": steps},
                    },
                    {"id": "loss", "expr": "sum(h_end * h_end)"},
                ],
                "outputs": ["loss"],
            },
            "inputs": {
                "h0": {"data": [0.1, 0.2, 0.3, 0.4], "dtype": "float64", "requires_grad": True},
                "a": {"data": 0.3, "dtype": "float64", "requires_grad": True},
            },
        }
    )


def rnn(steps: int = 1000) -> bytes:
    rng = np.random.default_rng(0)
    body = {
        "carry": ["h"],
        "xs": ["x"],
        "next": {"h": "h2"},
        "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}],
    }
    return orjson.dumps(
        {
            "graph": {
                "nodes": [
                    {
                        "id": "rnn",
                        "op": "scan",
                        "args": ["h0", "xs"],
                        "body": body,
                        "results": {"h_end": "h"},
                    },
                    {"id": "loss", "expr": "sum(h_end * h_end)"},
                ],
                "outputs": ["loss"],
            },
            "inputs": {
                "h0": {"data": rng.normal(size=4), "dtype": "float64", "requires_grad": True},
                "xs": {
                    "data": rng.normal(size=(steps, 4)),
                    "dtype": "float64",
                    "requires_grad": True,
                },
            },
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def timed(client: httpx.Client, server: Server, body: bytes) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    r = client.post(server.base + "/backward", content=body, headers=JSON, timeout=120)
    elapsed = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed, orjson.loads(r.content)["meta"]


@contextmanager
def pair(**env: str) -> Iterator[tuple[Server, Server]]:
    big = {"GRADSERVE_MAX_BODY_BYTES": str(1 << 22), **env}
    with (
        serving(name="tier on", env=big) as on,
        serving(name="tier off", env={"GRADSERVE_XLA": "off", **big}) as off,
    ):
        yield on, off


def one_off(steps: int) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {}
    with pair() as servers, httpx.Client() as client:
        for server in servers:
            rows[server.name] = [timed(client, server, long_loop(steps)) for _ in range(2)]
    return rows


def reuse(seconds: float) -> dict[str, Any]:
    body = rnn()
    out: dict[str, Any] = {}
    with pair() as (on, off), httpx.Client() as client:
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
            _, meta = timed(client, on, body)
            if meta["tier"] == "xla":
                break
        out["lowered at request"] = n if meta["tier"] == "xla" else None
        out["reason before"] = meta["tier_reason"]
        for server in (on, off):
            times = [timed(client, server, body)[0] for _ in range(20)]
            out[server.name] = statistics.median(times)
    return out


def seed_while_tiering(seconds: float) -> dict[str, float]:
    out: dict[str, float] = {}
    with pair() as servers:
        for server in servers:
            stop = threading.Event()

            def load(target: Server = server, stop: threading.Event = stop) -> None:
                with httpx.Client() as c:
                    end = time.monotonic() + seconds
                    while not stop.is_set() and time.monotonic() < end:
                        started = time.monotonic()  # (one every 20 ms on either server:
                        timed(c, target, rnn())  # the same load, lowered or not)
                        time.sleep(max(0.0, 0.02 - (time.monotonic() - started)))

            thread = threading.Thread(target=load)
            thread.start()
            times = []
            with httpx.Client() as client:
                end = time.monotonic() + seconds
                while time.monotonic() < end and len(times) < 5000:
                    times.append(timed(client, server, SEED)[0])
                    time.sleep(0.005)
            stop.set()
            thread.join()
            out[server.name] = statistics.median(times)
            out[server.name + " p99"] = float(np.percentile(times, 99))
    return out


def lowerings_on_a_host(steps: int) -> list[float]:
    store = tempfile.mkdtemp(prefix="gradserve-bench-store-")
    counts = []
    env = {
        "GRADSERVE_PROGRAM_STORE_DIR": store,
        "GRADSERVE_COMPUTE_WORKERS": "2",
        "GRADSERVE_MIN_COMPUTE_WORKERS": "2",
        "GRADSERVE_COMPUTE_WORKER_MAX_RSS_GROWTH_BYTES": "0",
        "GRADSERVE_MAX_BODY_BYTES": str(1 << 22),
    }
    for _ in range(2):  # (a restart on the same store)
        with serving(name="tier on", env=env) as server, httpx.Client() as client:
            for _ in range(4):
                timed(client, server, long_loop(steps))
            counts.append(count(metrics(server), 'gradserve_xla_lowerings_total{outcome="xla"}'))
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.smoke:  # a short loop, briefly
        args.steps, args.seconds = 2_000, 2.0
    print(f"# bench_tier: {time.strftime('%Y-%m-%d')}, long loop of {args.steps} steps")
    print("| row | tier on | tier off | on/off |")
    print("| --- | --- | --- | --- |")
    rows = one_off(args.steps)
    for k in range(2):
        (a, ma), (b, _) = rows["tier on"][k], rows["tier off"][k]
        print(
            f"| one-off long loop, request {k + 1} (ms; tier on: {ma['tier']}) "
            f"| {a:.1f} | {b:.1f} | {a / b:.3f} |"
        )
    r = reuse(args.seconds)
    print(
        f"| RNN 1,000 steps warm p50 (ms; lowered at request {r['lowered at request']}) "
        f"| {r['tier on']:.2f} | {r['tier off']:.2f} | {r['tier on'] / r['tier off']:.3f} |"
    )
    s = seed_while_tiering(args.seconds)
    print(
        f"| seed p50 while the RNN tiers up (ms) | {s['tier on']:.2f} | {s['tier off']:.2f} "
        f"| {s['tier on'] / s['tier off']:.3f} |"
    )
    print(
        f"| seed p99 meanwhile (ms) | {s['tier on p99']:.2f} | {s['tier off p99']:.2f} "
        f"| {s['tier on p99'] / s['tier off p99']:.3f} |"
    )
    counts = lowerings_on_a_host(args.steps)
    print(
        f"| lowerings of one program: 2 recycled workers, then a restart on the store "
        f"| {counts[0]:.0f}, then {counts[1]:.0f} | - | - |"
    )


if __name__ == "__main__":
    main()
