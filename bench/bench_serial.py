"""Stored programs (engine.graph.serial): dump and load against compile.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 -m bench.bench_serial [--quick]

Prints one table. For each workload: the program's steps and bytes; the time to compile it
(a cold compile: a new graph each call, so that no memo of the compiler hits), to dump it,
and to load it (checks, kernels bound, run tuples built: ready to run), in a process that
has loaded programs with the same step signatures ("load": their checks and kernels
remembered) and in one that has not ("cold": engine.graph.serial's memo of signatures
cleared before each load; the executor's memo of kernels stays warm, as in a worker that
has run programs); load per step; compile/load (target: >= 10x); the cycle collector's
first pass over the loaded program (`gc.collect(1)` right after the load, the program
kept), which the load leaves to its caller. Also what the two checksums the format could
use take over the same bytes (CRC-32, which it uses, and BLAKE2b-128).

Workloads: bench/workloads.py's unrolled recurrence (1,000 and 10,000 steps: 3 op
nodes a step, fwd+bwd) and its 24-step recurrent cell; bench/workloads.py's RNN as
one `scan` node (64 steps, fwd+bwd: a program, its loop body and the body's VJP); the seed
example `(x + y) * (x - y)` on scalars, fwd+bwd.

Medians over interleaved rounds; ratios are medians of per-round ratios (these machines
are shared and noisy). A timed call drops what it made (a compiled or a loaded program)
before its time is read, alike for both, and the cycle collector runs as it would.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import Gradserve, command_line, compile_json, measure, median_ratio
from bench.workloads import Workload, op, recurrent_cell, rnn_data, rnn_scan, salt_input, unrolled
from gradserve.engine.graph import serial
from gradserve.engine.graph.serial import dump_program, load_program


def workloads(quick: bool) -> dict[str, Callable[[float], Any]]:
    """Per workload, a compile of a new graph (its salt: an unused node's constant)."""
    gs = Gradserve()
    out: dict[str, Callable[[float], Any]] = {}
    for w in (
        [unrolled(100), recurrent_cell()]
        if quick
        else [unrolled(1000), unrolled(10_000), recurrent_cell()]
    ):

        def compile_(salt: float, w: Workload = w) -> Any:
            graph = {
                **w.graph,
                "nodes": [*w.graph["nodes"], op("salt", "mul", salt_input(w), salt)],
            }
            return gs.compile(graph, w.inputs, w.wrt, w.grad_outputs, w.no_grad)

        out[w.name] = compile_
    d = rnn_data(64)
    out["RNN 64 steps as one scan, fwd+bwd"] = lambda salt: compile_json(
        rnn_scan(salt), d, ["w", "u", "b", "h0"], backward=True
    )
    scalars = {"x": np.float64(2.0), "y": np.float64(3.0)}
    out["seed (x + y) * (x - y), fwd+bwd"] = lambda salt: compile_json(
        {
            "nodes": [
                {"id": "z", "expr": "(x + y) * (x - y)"},
                {"id": "salt", "expr": f"x * {salt}"},
            ],
            "outputs": ["z"],
        },
        scalars,
        ["x", "y"],
        backward=True,
    )
    return out


def load_cold(data: bytes) -> Any:
    serial._SIGNATURES.clear()
    return load_program(data)


def first_collection(data: bytes, rounds: int) -> float:
    """The median time of the cycle collector's pass over a program just loaded (kept)."""
    spent = []
    for _ in range(rounds):
        gc.collect()
        program = load_program(data)
        started = time.perf_counter()
        gc.collect(1)
        spent.append(time.perf_counter() - started)
        del program
    return statistics.median(spent)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    args.quick |= args.smoke
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 7)
    salt = (i * 1e-3 for i in itertools.count(1))
    rows = []
    for name, compile_ in workloads(args.quick).items():
        program = compile_(next(salt))
        data = dump_program(program)
        load_program(data)  # (the memo of kernels warm, as in a worker that runs programs)
        samples = measure(
            {
                "compile": lambda compile_=compile_: compile_(next(salt)),
                "dump": lambda program=program: dump_program(program),
                "load": lambda data=data: load_program(data),
                "cold": lambda data=data: load_cold(data),
                "crc32": lambda data=data: zlib.crc32(data),
                "blake2b": lambda data=data: hashlib.blake2b(data, digest_size=16).digest(),
            },
            rounds,
            budget_s=0.2,
        )
        ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        steps = len(program.steps)
        rows.append(
            [
                name,
                f"{steps:,}",
                f"{len(data):,}",
                f"{ms['compile']:.2f}",
                f"{ms['dump']:.2f}",
                f"{ms['load']:.3f}",
                f"{ms['cold']:.3f}",
                f"{ms['load'] * 1e6 / steps:.0f}",
                f"{median_ratio(samples, 'compile', 'load'):.1f}x",
                f"{first_collection(data, rounds) * 1e3:.3f}",
                f"{ms['crc32']:.3f}",
                f"{ms['blake2b']:.3f}",
            ]
        )
    cols = [
        "workload",
        "steps",
        "bytes",
        "compile ms",
        "dump ms",
        "load ms",
        "cold ms",
        "load ns/step",
        "compile/load",
        "GC pass ms",
        "CRC-32 ms",
        "BLAKE2b ms",
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print(f"Python {sys.version.split()[0]}; target: compile/load >= 10x")
    print(" | ".join(c.ljust(widths[i]) for i, c in enumerate(cols)).rstrip())
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(
            " | ".join(
                v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(r)
            ).rstrip()
        )


if __name__ == "__main__":
    main()
