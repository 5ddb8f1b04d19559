"""Engine benchmarks (issue: engine core). Prints one table; run it, don't time it in tests.

    python3 -m bench.bench_engine            # unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE first

(a) Per-op overhead, forward + backward, on a chain of 1,000 scalar ops and on the seed
    graph z = (x + y) * (x - y), against PyTorch eager on the CPU (same run, interleaved).
(b) A chain of 16 elementwise ops on 1M float64 elements, forward + backward, against the
    same chain written by hand in NumPy (forward, then the backward by the chain rule).
Medians of interleaved repeats, because these machines are shared and noisy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import gradserve.engine as engine
from bench.harness import command_line

try:
    import torch
except ImportError:  # the comparison needs the test extra
    torch = None


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, rounds: int = 5
) -> dict[str, float]:
    """Medians over rounds that alternate the contenders, so drift hits both alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_time(fn, repeats))
    return {k: statistics.median(v) for k, v in samples.items()}


# ------------------------------------------------------------------ (a) per-op overhead

CHAIN = 1000


def scalar_chain(lib: Any) -> None:
    x = lib.tensor(0.5, requires_grad=True)
    y = x
    for i in range(CHAIN // 2):
        y = y * 1.0001
        y = y + 0.5 if i % 2 else y - 0.25
    y.backward()


def seed_graph(lib: Any) -> None:
    x = lib.tensor(2.0, requires_grad=True)
    y = lib.tensor(3.0, requires_grad=True)
    z = (x + y) * (x - y)
    z.backward()


# ------------------------------------------------------------------ (b) large elementwise

N = 1_000_000


def engine_chain(x_np: np.ndarray) -> np.ndarray:
    x = engine.tensor(x_np, requires_grad=True)
    h = engine.sin(x) * 0.5
    h = engine.exp(engine.tanh(h)) + 1.0
    h = engine.reciprocal(engine.log(h))
    h = engine.cos(engine.square(h)) * 2.0
    h = engine.sqrt(engine.exp(h)) - 1.0
    h = engine.sin(engine.tanh(h)) * 3.0
    h.backward(engine.tensor(np.ones(x_np.shape)))
    return x.grad.numpy()


def numpy_chain(x: np.ndarray) -> np.ndarray:
    h1 = np.sin(x)
    h2 = h1 * 0.5
    h3 = np.tanh(h2)
    h4 = np.exp(h3)
    h5 = h4 + 1.0
    h6 = np.log(h5)
    h7 = 1.0 / h6
    h8 = h7 * h7
    h9 = np.cos(h8)
    h10 = h9 * 2.0
    h11 = np.exp(h10)
    h12 = np.sqrt(h11)
    h13 = h12 - 1.0
    h14 = np.tanh(h13)
    h15 = np.sin(h14)
    h16 = h15 * 3.0
    g = np.ones_like(h16) * 3.0
    g = g * np.cos(h14)
    g = g * (1.0 - h14 * h14)
    g = g / (2.0 * h12)
    g = g * h11
    g = g * 2.0
    g = g * -np.sin(h8)
    g = g * 2.0 * h7
    g = g * -(h7 * h7)
    g = g / h5
    g = g * h4
    g = g * (1.0 - h3 * h3)
    g = g * 0.5
    return g * np.cos(x)


def main(argv: list[str] | None = None) -> None:
    args = command_line(__doc__).parse_args(argv)
    repeats = 1 if args.smoke else None
    rows = []
    if torch is not None:
        torch.set_num_threads(1)
        t = interleaved(
            {"engine": lambda: scalar_chain(engine), "torch": lambda: scalar_chain(torch)},
            repeats=repeats or 5,
        )
        rows.append(
            (
                "scalar chain, 1,000 ops, fwd+bwd (us/op)",
                t["engine"] / CHAIN * 1e6,
                t["torch"] / CHAIN * 1e6,
                "PyTorch eager",
                0.5,
            )
        )
        t = interleaved(
            {"engine": lambda: seed_graph(engine), "torch": lambda: seed_graph(torch)},
            repeats=repeats or 200,
        )
        rows.append(
            (
                "seed graph, 3 ops, fwd+bwd (us/op)",
                t["engine"] / 3 * 1e6,
                t["torch"] / 3 * 1e6,
                "PyTorch eager",
                0.5,
            )
        )
    x = np.random.default_rng(0).uniform(-1, 1, 1000 if args.smoke else N)
    np.testing.assert_allclose(engine_chain(x), numpy_chain(x), rtol=1e-9)
    t = interleaved(
        {"engine": lambda: engine_chain(x), "numpy": lambda: numpy_chain(x)}, repeats=repeats or 3
    )
    rows.append(
        (
            "16 elementwise ops, 1M float64, fwd+bwd (ms)",
            t["engine"] * 1e3,
            t["numpy"] * 1e3,
            "hand-written NumPy",
            1.10,
        )
    )

    print(
        f"{'benchmark':48s} {'gradserve':>10s} {'baseline':>10s} {'ratio':>7s} "
        f"{'target':>7s}  baseline"
    )
    for name, ours, base, label, target in rows:
        ratio = ours / base
        print(
            f"{name:48s} {ours:10.2f} {base:10.2f} {ratio:7.2f} {'<=' + str(target):>7s}  {label}"
        )


if __name__ == "__main__":
    main()
