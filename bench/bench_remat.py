"""Gradients that fit the memory budget (benchmark, not a test): prints one table against
the targets of the issue.

1. chain    h_i = sin(h_{i-1}) * 0.999 over 10^6 float64 values, ending in sum (the issue's
            chain): its plain planned peak, then a budget of a tenth of it. The program
            with recomputation: planned peak, measured peak, added cost, compile time; its
            run time against the plain program's (run with a budget large enough for it),
            in process, interleaved. --chain-steps (2000 by default; the plain run then
            holds ~16 GB: --time-steps runs the time comparison at a smaller length).
2. scan     a 10,000-step scan RNN, h = 0.95 h + 0.05 tanh(x_t + 1.1 h), over a state large
            enough that its stacked residuals are ~10x the budget: within the budget, time
            against the plain loop.
3. http     the chain over HTTP against `gradserve serve` (binary tensors, the client):
            /plan's figures, and a /backward with `memory_budget_bytes`, its meta, and its
            gradients against NumPy.
4. gradbench GradBench's ode (its largest: n = 10^5, s = 100 RK4 steps as a scan) and lstm
            (l = 2, c = 1024, hidden 14) over HTTP under a 256 MiB budget, against PyTorch
            (ode) and NumPy (lstm) in float64.

    python3 -m bench.bench_remat [--parts chain,scan,http,gradbench] [--chain-steps 2000]
                                 [--time-steps 600] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from bench.harness import Report, command_line
from bench.workloads import chain_numpy, chain_spec, lstm, ode_graph, ode_torch, rnn_spec
from gradserve.engine.graph import GraphSpec, Limits, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from tests.support.server import serving

N = 1_000_000


def compile_for(
    spec: GraphSpec, inputs: dict[str, TensorSpec], budget: int | None
) -> tuple[Any, float]:
    t0 = time.perf_counter()
    program = compile_graph(
        spec,
        inputs,
        backward=True,
        limits=Limits(
            memory_budget_bytes=budget, recompute=budget is not None, max_nodes=1_000_000
        ),
    )
    return program, (time.perf_counter() - t0) * 1000


def timed_runs(
    programs: dict[str, Any], arrays: dict[str, np.ndarray], rounds: int
) -> dict[str, list[float]]:
    """Each program's run, interleaved (the machine drifts between rounds)."""
    out: dict[str, list[float]] = {k: [] for k in programs}
    for _ in range(rounds):
        for name, program in programs.items():
            t0 = time.perf_counter()
            r = execute(program, arrays)
            out[name].append((time.perf_counter() - t0) * 1000)
            assert r.peak_bytes == program.planned_peak_bytes, (name, r.peak_bytes)
    return out


def part_chain(report: Report, steps: int, time_steps: int, rounds: int, n: int = N) -> None:
    x = np.linspace(-1.0, 1.0, n)
    inputs = {"h0": TensorSpec((n,), "float64", True)}
    plain, _ = compile_for(chain_spec(steps), inputs, None)
    budget = plain.planned_peak_bytes // 10
    rec, ms = compile_for(chain_spec(steps), inputs, budget)
    r = execute(rec, {"h0": x})
    report.add(
        "chain",
        f"{steps} steps on {n:,} float64: planned peak without / with "
        "recomputation (budget a tenth)",
        f"{plain.planned_peak_bytes / 2**20:.0f} MiB / {rec.planned_peak_bytes / 2**20:.0f}"
        f" MiB (budget {budget / 2**20:.0f} MiB)",
        "within the budget",
        rec.planned_peak_bytes <= budget,
    )
    report.add(
        "chain",
        "planned == measured peak",
        f"{rec.planned_peak_bytes} == {r.peak_bytes}",
        "exact",
        rec.planned_peak_bytes == r.peak_bytes,
    )
    report.add(
        "chain",
        "added cost; compile",
        f"{rec.recompute_cost / plain.compute_cost:.2f}x the plain program's cost; {ms:.0f} ms",
    )
    del plain, r
    # The time ratio, at a length whose plain program this machine can hold.
    spec = chain_spec(time_steps)
    plain, _ = compile_for(spec, inputs, None)
    rec, _ = compile_for(spec, inputs, plain.planned_peak_bytes // 10)
    times = timed_runs({"plain": plain, "recompute": rec}, {"h0": x}, rounds)
    ratio = statistics.median(times["recompute"]) / statistics.median(times["plain"])
    report.add(
        "chain",
        f"{time_steps} steps, fwd+bwd: with recomputation against without",
        f"{statistics.median(times['recompute']):.0f} ms / "
        f"{statistics.median(times['plain']):.0f} ms: {ratio:.2f}x",
        "<= 1.5x",
        ratio <= 1.5,
    )


def part_scan(report: Report, rounds: int, steps: int = 10_000, width: int = 4096) -> None:
    rng = np.random.default_rng(3)
    arrays = {"h0": rng.uniform(-1, 1, width), "x": rng.uniform(-1, 1, width)}
    inputs = {k: TensorSpec((width,), "float64", True) for k in arrays}
    plain, _ = compile_for(rnn_spec(steps), inputs, None)
    residuals = plain.planned_peak_bytes - sum(a.nbytes for a in arrays.values())
    budget = residuals // 10  # (the stacked residuals are ~10x the budget)
    rec, ms = compile_for(rnn_spec(steps), inputs, budget)
    times = timed_runs({"plain": plain, "recompute": rec}, arrays, rounds)
    ratio = statistics.median(times["recompute"]) / statistics.median(times["plain"])
    report.add(
        "scan",
        f"{steps}-step scan RNN, width {width}: planned peak without / with "
        f"checkpointing (stacked residuals {residuals / budget:.0f}x the budget)",
        f"{plain.planned_peak_bytes / 2**20:.0f} MiB / "
        f"{rec.planned_peak_bytes / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB)",
        "within the budget",
        rec.planned_peak_bytes <= budget,
    )
    report.add(
        "scan",
        "fwd+bwd with checkpointing against the plain loop",
        f"{statistics.median(times['recompute']):.0f} ms / "
        f"{statistics.median(times['plain']):.0f} ms: {ratio:.2f}x (compile {ms:.0f} ms)",
        "<= 2x",
        ratio <= 2.0,
    )


def part_http(report: Report, steps: int = 600, n: int = N) -> None:
    from gradserve.client.http import Client

    x = np.linspace(-1.0, 1.0, n)
    graph = {
        "nodes": [{"id": f"h{i}", "expr": f"sin(h{i - 1}) * 0.999"} for i in range(1, steps + 1)]
        + [{"id": "loss", "op": "sum", "args": [f"h{steps}"]}],
        "outputs": ["loss"],
    }
    env = {
        "GRADSERVE_MEMORY_BUDGET_BYTES": str(8 << 30),
        "GRADSERVE_INFLIGHT_MEMORY_BYTES": str(12 << 30),
    }
    with serving(env=env) as server, Client(server.base, timeout=600) as gs:
        body = {
            "graph": graph,
            "inputs": {"h0": {"shape": [n], "dtype": "float64", "requires_grad": True}},
        }
        plan = httpx.post(server.base + "/plan", json=body, timeout=600).json()
        budget = plan["planned_peak_bytes"] // 10
        plan = httpx.post(
            server.base + "/plan",
            json={**body, "memory_budget_bytes": budget},
            timeout=600,
        ).json()
        t0 = time.perf_counter()
        r = gs.backward(graph, {"h0": x}, requires_grad=["h0"], memory_budget_bytes=budget)
        ms = (time.perf_counter() - t0) * 1000
    _, g = chain_numpy(x, steps)
    ok = np.allclose(r.gradients["h0"], g, rtol=1e-12)
    report.add(
        "http",
        f"{steps}-step chain over HTTP, budget a tenth: /plan admitted; planned / measured peak",
        f"{plan['admitted']}; {r.meta['planned_peak_bytes']}"
        f" / {r.meta['peak_bytes']} (budget {budget})",
        "admitted, within",
        plan["admitted"] and r.meta["peak_bytes"] <= budget,
    )
    report.add(
        "http",
        "its round trip; gradients against NumPy",
        f"{ms:.0f} ms; {'equal (rtol 1e-12)' if ok else 'DIFFERENT'}",
        "",
        ok,
    )


def part_gradbench(
    report: Report, budget: int = 256 << 20, n: int = 100_000, s: int = 100, c: int = 1024
) -> None:
    """GradBench's ode (n = 100,000, s = 100: its largest) and lstm (l = 2, c = 1024,
    hidden 14: bench.workloads' GradBench lstm) over HTTP with a 256 MiB budget, checked
    against PyTorch in float64 (GradBench's own harness is not part of this repository)."""
    from gradserve.client.http import Client

    rng = np.random.default_rng(31337)
    x = rng.random(n)
    m = np.zeros(n)
    m[0] = 1.0
    env = {"GRADSERVE_MAX_NODES": "200000"}
    with serving(env=env) as server, Client(server.base, timeout=600) as gs:
        plain = gs.backward(ode_graph(n, s), {"x": x, "m": m}, requires_grad=["x"])
        r = gs.backward(
            ode_graph(n, s), {"x": x, "m": m}, requires_grad=["x"], memory_budget_bytes=budget
        )
        want, grad = ode_torch(x, s)
        ok = np.allclose(r.gradients["x"], grad, rtol=1e-10, atol=1e-14) and np.isclose(
            float(r.outputs["out"]), want, rtol=1e-12
        )
        report.add(
            "gradbench",
            f"ode n={n} s={s}: planned peak without / within 256 MiB",
            f"{plain.meta['planned_peak_bytes'] / 2**20:.0f} MiB / "
            f"{r.meta['peak_bytes'] / 2**20:.0f} MiB; gradient against PyTorch "
            f"{'equal (rtol 1e-10)' if ok else 'DIFFERENT'}",
            "validates",
            ok and r.meta["peak_bytes"] <= budget,
        )
        w = lstm(2, 14, c)
        r = gs.backward(w.graph, w.inputs, requires_grad=w.wrt, memory_budget_bytes=budget)
        loss, grads = w.numpy(w.inputs)  # type: ignore[misc]
        ok = np.isclose(float(r.outputs["loss"]), float(loss), rtol=1e-10) and all(
            np.allclose(r.gradients[k], g, rtol=1e-8, atol=1e-12) for k, g in grads.items()
        )
        report.add(
            "gradbench",
            f"lstm l=2 c={c} (hidden 14) within 256 MiB",
            f"peak {r.meta['peak_bytes'] / 2**20:.1f} MiB; loss and gradients "
            f"against NumPy {'equal' if ok else 'DIFFERENT'}",
            "validates",
            ok and r.meta["peak_bytes"] <= budget,
        )


# Each part at its size, or at the smallest (--smoke: the same code on tiny inputs).
PARTS: dict[str, Callable[[Report, argparse.Namespace], None]] = {
    "chain": lambda r, a: (
        part_chain(r, 2000, 600, 1, n=100)
        if a.smoke
        else part_chain(r, a.chain_steps, a.time_steps, a.rounds)
    ),
    "scan": lambda r, a: part_scan(r, 1, 2000, 16) if a.smoke else part_scan(r, a.rounds),
    "http": lambda r, a: part_http(r, 600, 100) if a.smoke else part_http(r),
    "gradbench": lambda r, a: (
        part_gradbench(r, n=1000, s=10, c=16) if a.smoke else part_gradbench(r)
    ),
}


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--chain-steps", type=int, default=2000)
    p.add_argument("--time-steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    report = Report()
    t0 = time.monotonic()
    for part in [s for s in args.parts.split(",") if s]:
        print(f"[bench_remat] {part} ...", file=sys.stderr, flush=True)
        try:
            PARTS[part](report, args)
        except Exception as exc:
            report.error(part, exc)
    report.print(
        f"gradserve recomputation bench, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
        f"{time.monotonic() - t0:.0f} s, rounds {args.rounds}"
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
