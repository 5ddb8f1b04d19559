"""Compiled-graph benchmark: gradserve in-process against hand-written NumPy and PyTorch eager.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 -m bench.bench_compiled [--quick]

Prints one table. For each workload, gradserve's time is measured two ways:

  warm  the program is compiled once; the timed call is its execution alone (inputs in,
        forward + backward, outputs and gradients out as NumPy arrays);
  cold  a new graph every call (one unused node with a changing constant, so that no
        cache keyed by the graph can hit): compile + run;

and compile time per executed node is measured on its own. Baselines are forward +
backward in hand-written NumPy (backward by the chain rule) and in PyTorch eager on the
CPU. Before timing, every workload checks once that the implementations agree on the
value and every gradient, and stops with an error if they do not.

Workloads (sizes in `--quick` are smaller):
 1. recurrent cell: 24 steps, batch 4, width 16, float32; the graph takes the steps as 24
    separate inputs x0..x23 (266 op nodes); gradients w.r.t. w, u, b, h0 and every x_t.
 2. GradBench's gmm (two sizes), lstm (2 layers, hidden 14, 10-token sequence, unrolled) and
    ba (512 observations), float64 as in GradBench.
 3. the 10 objectives of tests/engine/test_objectives.py (graphs copied here as JSON dicts).
 4. a chain of 1,000 scalar mul/add ops on a 0-d float32 (µs per op).
 5. 16 elementwise ops on 8M float64 (64 MB a tensor), no_grad forward and forward+backward.
 6. the no_grad peak of 32 elementwise ops, in tensors (meta.peak_bytes / tensor bytes).
 7. a 30k-node unrolled recurrence: first compile+run, a repeated run of the same graph
    through the cached path, and that against the execution alone.

Medians over interleaved rounds (the contenders alternate within each round, and ratios
are medians of per-round ratios), because these machines are shared and noisy.
PyTorch runs with one intra-op thread unless --torch-threads says otherwise (NumPy's
elementwise ops are single-threaded too).
"""

from __future__ import annotations

import functools
import gc
import itertools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.harness import Gradserve, check, command_line, measure, median_ratio
from bench.workloads import (
    Workload,
    ba,
    elementwise_chain,
    gmm,
    lstm,
    objectives,
    peak_chain,
    recurrent_cell,
    salt_input,
    salted,
    scalar_chain,
    unrolled,
)

try:
    import torch
except ImportError:  # PyTorch comes with the test extra
    torch = None  # type: ignore[assignment]


# ================================================================ timing


@dataclass
class Row:
    name: str
    unit: str
    warm: float | None = None
    cold: float | None = None
    compile_us: float | None = None
    numpy: float | None = None
    torch: float | None = None
    ratios: dict[str, float | None] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)
    other: str = ""


def bench_workload(
    w: Workload,
    gs: Gradserve,
    rounds: int,
    budget_s: float,
    np_target: float = 1.5,
    torch_target: float | None = 0.35,
) -> Row:
    meta = check(w, gs)
    nodes = meta["nodes"]
    first = salt_input(w)
    compiled = gs.compile(w.graph, w.inputs, w.wrt, w.grad_outputs, w.no_grad)
    salt = itertools.count(1)

    def cold() -> None:
        g = salted(w.graph, next(salt), first)
        gs.run(gs.compile(g, w.inputs, w.wrt, w.grad_outputs, w.no_grad), w.inputs, w.grad_outputs)

    fns: dict[str, Callable[[], object]] = {
        "warm": lambda: gs.run(compiled, w.inputs, w.grad_outputs),
        "cold": cold,
        "compile": lambda: gs.compile(
            salted(w.graph, next(salt), first), w.inputs, w.wrt, w.grad_outputs, w.no_grad
        ),
    }
    if w.numpy is not None:
        fns["numpy"] = functools.partial(w.numpy, w.base_inputs)
    if w.torch is not None:
        fns["torch"] = functools.partial(w.torch, w.base_inputs)
    s = measure(fns, rounds, budget_s)
    scale = (1e6 if w.unit.startswith("µs") else 1e3) / w.per
    med = {k: statistics.median(v) * scale for k, v in s.items()}
    row = Row(
        w.name + (f" [{nodes} nodes]" if nodes > 1 else ""),
        w.unit,
        med["warm"],
        med["cold"],
        med["compile"] / scale / nodes * 1e6,
        med.get("numpy"),
        med.get("torch"),
    )
    row.ratios = {
        "warm/numpy": median_ratio(s, "warm", "numpy"),
        "warm/torch": median_ratio(s, "warm", "torch"),
        "cold/warm": median_ratio(s, "cold", "warm"),
    }
    targets = {"warm/numpy": np_target, "warm/torch": torch_target, "cold/warm": 2.0}
    for k, limit in targets.items():
        value = row.ratios[k]
        if value is not None and limit is not None and value > limit:
            row.misses.append(f"{k}>{limit:g}")
    if row.compile_us is not None and row.compile_us > 10:
        row.misses.append("compile>10µs")
    return row


def bench_peak(w: Workload, gs: Gradserve) -> Row:
    meta = check(w, gs)
    tensor = w.inputs["x"].nbytes
    peak, planned = meta["peak_bytes"] / tensor, meta["planned_peak_bytes"] / tensor
    row = Row(
        w.name + f" [{meta['nodes']} nodes]",
        "tensors",
        other=f"peak {peak:.2f} tensors (planned {planned:.2f})",
    )
    if peak > 3:
        row.misses.append("peak>3")
    return row


def bench_unrolled(w: Workload, gs: Gradserve, rounds: int) -> Row:
    """First run of a new graph (compile + run, through the cached path), a repeated run of
    the same graph through the cached path, and the execution alone. At most 3 rounds: a
    round is seconds long, and each call is long enough to time on its own."""
    meta = check(w, gs)
    first = salt_input(w)
    compiled = gs.compile(w.graph, w.inputs, w.wrt)
    salt = itertools.count(1)
    gs.run_graph(w.graph, w.inputs, w.wrt)  # the repeated runs follow this first one
    s = measure(
        {
            "first": lambda: gs.run_graph(salted(w.graph, next(salt), first), w.inputs, w.wrt),
            "repeat": lambda: gs.run_graph(w.graph, w.inputs, w.wrt),
            "exec": lambda: gs.run(compiled, w.inputs),
            "compile": lambda: gs.compile(salted(w.graph, next(salt), first), w.inputs, w.wrt),
        },
        min(rounds, 3),
        budget_s=0.0,
    )
    med = {k: statistics.median(v) * 1e3 for k, v in s.items()}
    repeat = median_ratio(s, "repeat", "exec")
    row = Row(
        w.name + f" [{meta['nodes']} nodes]",
        "ms",
        med["exec"],
        med["first"],
        med["compile"] / 1e3 / meta["nodes"] * 1e6,
        other=f"repeat {med['repeat']:.0f} ms = {repeat:.2f}x exec",
    )
    row.ratios = {"cold/warm": median_ratio(s, "first", "exec")}
    if repeat is not None and repeat > 1.1:
        row.misses.append("repeat/exec>1.1")
    if (row.ratios["cold/warm"] or 0) > 2:
        row.misses.append("cold/warm>2")
    if row.compile_us is not None and row.compile_us > 10:
        row.misses.append("compile>10µs")
    return row


# ================================================================ the table

TARGETS = (
    "targets: warm fwd+bwd <= 1.5x hand-written NumPy and <= 0.35x PyTorch eager; "
    "cold <= 2x warm; compile <= 10 µs/node;\n         scalar chain <= 0.3x PyTorch "
    "per op; 16-op 8M chain <= 1.0x NumPy (no_grad and grad); 32-op no_grad peak <= 3 "
    "tensors;\n         30k-node repeated run <= 1.1x its forward+backward alone"
)


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[Row], header: str) -> None:
    cols = [
        "workload",
        "unit",
        "gs warm",
        "gs cold",
        "compile µs/node",
        "NumPy",
        "PyTorch",
        "warm/NumPy",
        "warm/PyTorch",
        "cold/warm",
        "misses",
        "other",
    ]
    body = [
        [
            r.name,
            r.unit,
            _fmt(r.warm),
            _fmt(r.cold),
            _fmt(r.compile_us, ".2f"),
            _fmt(r.numpy),
            _fmt(r.torch),
            _fmt(r.ratios.get("warm/numpy"), ".2f"),
            _fmt(r.ratios.get("warm/torch"), ".2f"),
            _fmt(r.ratios.get("cold/warm"), ".2f"),
            ", ".join(r.misses) or "ok",
            r.other,
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    print(header)
    print(TARGETS)
    print(" | ".join(c.ljust(widths[i]) for i, c in enumerate(cols)).rstrip())
    print("-|-".join("-" * wd for wd in widths))
    for b in body:
        print(
            " | ".join(
                v.ljust(widths[i]) if i in (0, 1, 10, 11) else v.rjust(widths[i])
                for i, v in enumerate(b)
            ).rstrip()
        )
    missed = sum(bool(r.misses) for r in rows)
    print(f"{len(rows) - missed} of {len(rows)} rows meet every target")


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds: seconds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="", help="run workloads whose name contains this")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args(argv)
    if torch is None:
        raise SystemExit("PyTorch is needed (pip install -e '.[test]')")
    torch.set_num_threads(args.torch_threads)
    quick = args.quick or args.smoke
    rounds = args.rounds or (1 if args.smoke else 2 if quick else 5)
    budget = 0.0 if args.smoke else 0.01 if quick else 0.12  # seconds per contender per round
    big = 1 << 16 if quick else 8 << 20
    gs = Gradserve()

    plan: list[tuple[Workload, Callable[[Workload], Row]]] = []

    def standard(
        np_target: float = 1.5, torch_target: float | None = 0.35
    ) -> Callable[[Workload], Row]:
        return lambda w: bench_workload(w, gs, rounds, budget, np_target, torch_target)

    plan.append((recurrent_cell(), standard()))
    for size in [(2, 5, 100), (5, 10, 200)] if quick else [(2, 5, 1000), (10, 25, 1000)]:
        plan.append((gmm(*size), standard()))
    plan.append((lstm(2, 14, 4 if quick else 10), standard()))
    plan.append((ba(*((8, 32, 64) if quick else (16, 256, 512))), standard()))
    plan += [(w, standard()) for w in objectives()]
    plan.append((scalar_chain(), standard(torch_target=0.3)))
    for grad in (False, True):
        plan.append((elementwise_chain(big, grad), standard(np_target=1.0)))
    plan.append((peak_chain(1 << 16 if quick else 1 << 20), lambda w: bench_peak(w, gs)))
    plan.append((unrolled(1000 if quick else 10_000), lambda w: bench_unrolled(w, gs, rounds)))

    # Everything built so far (PyTorch's and FastAPI's modules, the graphs) is long-lived:
    # frozen, so a full collection does not rescan it. A gradserve process holds no PyTorch;
    # without this, each full collection costs ~90 ms here, and lands in whichever call.
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    rows = []
    for w, fn in plan:
        if args.only in w.name:
            t = time.perf_counter()
            rows.append(fn(w))
            print(f"  {w.name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    print_table(
        rows,
        f"\ngradserve in-process vs hand-written NumPy and PyTorch "
        f"{torch.__version__} eager (CPU, {args.torch_threads} thread); medians of "
        f"{rounds} interleaved rounds; {platform.python_version()}, "
        f"NumPy {np.__version__}; {time.perf_counter() - started:.0f} s"
        f"{'; --quick sizes' if quick else ''}",
    )


if __name__ == "__main__":
    main()
