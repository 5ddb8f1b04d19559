"""Issue 18's loop workload: a 10,000-step scan RNN, h = 0.95 h + 0.05 tanh(x_t + 1.1 h)
over a 64x64 float64 state, whose stacked residuals (a tanh result a step, 328 MB) are
10x the memory budget. Compiled for /backward under that budget (checkpointed: the
planner's k, recomputing the forward body) and with a budget large enough for the plain
loop; both run, their gradients compared bit for bit, their peaks planned and measured.

    python3 -m bench.bench_scan_checkpoint [--steps N] [--repeat R]
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from bench.harness import command_line
from gradserve.engine.graph import BodySpec, GraphSpec, Limits, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import Program
from gradserve.engine.graph.scan import SCAN, replay_cost
from gradserve.engine.graph.spec import RunResult


def rnn() -> GraphSpec:
    body = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[NodeSpec("h2", expr="0.95 * h + 0.05 * tanh(x + 1.1 * h)")],
        next={"h": "h2"},
    )
    return GraphSpec(
        [
            NodeSpec("rnn", op="scan", args=["h0", "xs"], body=body, results={"h_end": "h"}),
            NodeSpec("loss", expr="sum(h_end * h_end)"),
        ],
        ["loss"],
    )


def timed(
    programs: list[Program], arrays: dict[str, np.ndarray], repeat: int
) -> list[tuple[float, RunResult]]:
    """Per program, the median time of `repeat` runs (interleaved) and a result."""
    times: list[list[float]] = [[] for _ in programs]
    results: list[RunResult] = []
    for _ in range(repeat):
        results = []
        for program, took in zip(programs, times, strict=True):
            started = time.perf_counter()
            results.append(execute(program, arrays))
            took.append(time.perf_counter() - started)
    return [(statistics.median(t), r) for t, r in zip(times, results, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeat = 2000, 1
    rng = np.random.default_rng(0)
    arrays = {
        "h0": rng.standard_normal((64, 64)) * 0.1,
        "xs": rng.standard_normal((args.steps, 64)) * 0.1,
    }
    inputs = {k: TensorSpec(a.shape, "float64", True) for k, a in arrays.items()}
    residuals = args.steps * 64 * 64 * 8
    budget = residuals // 10
    spec = rnn()
    started = time.perf_counter()
    plain = compile_graph(
        spec, inputs, backward=True, limits=Limits(memory_budget_bytes=4 * residuals)
    )
    plain_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    fitted = compile_graph(spec, inputs, backward=True, limits=Limits(memory_budget_bytes=budget))
    fitted_ms = (time.perf_counter() - started) * 1000
    forward, reverse = (s.attrs["body"] for s in fitted.steps if s.op is SCAN)
    flops, moved = replay_cost(reverse)
    (plain_s, plain_result), (fitted_s, fitted_result) = timed([plain, fitted], arrays, args.repeat)
    assert plain_result.gradients is not None and fitted_result.gradients is not None
    for name in arrays:
        assert plain_result.gradients[name].tobytes() == fitted_result.gradients[name].tobytes()
    print(
        f"steps {args.steps}; stacked residuals {residuals / 1e6:.1f} MB; "
        f"budget {budget / 1e6:.1f} MB"
    )
    for label, program, result, seconds, ms in (
        ("plain", plain, plain_result, plain_s, plain_ms),
        ("checkpointed", fitted, fitted_result, fitted_s, fitted_ms),
    ):
        print(
            f"{label:>13}: planned peak {program.planned_peak_bytes / 1e6:7.1f} MB, "
            f"measured {result.peak_bytes / 1e6:7.1f} MB; "
            f"cost {program.compute_cost:.3g}; compile {ms:.0f} ms; run {seconds:.3f} s"
        )
    print(
        f"k = {forward.every} ({forward.segments} segments); replayed "
        f"{forward.length - forward.every} steps, cost {flops + 8 * moved:.3g}; "
        f"time {fitted_s / plain_s:.2f}x the plain loop's; gradients the same bit for bit"
    )


if __name__ == "__main__":
    main()
