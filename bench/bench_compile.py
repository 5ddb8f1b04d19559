"""Compile speed in process: microseconds a node, and the parse of the graph's body.

    python3 -m bench.bench_compile [--rounds N] [--workloads cell,chain3k,chain30k]

For each workload (py's recurrent cell, and the unrolled chains of 3,000 and
30,000 nodes, all compiled with backward=True and every input requiring grad), in
interleaved rounds, medians:

  compile, memos cleared  nothing remembered: the decision, VJP-template and kernel memos
                          emptied before the compile;
  compile, memos warm     a server that has compiled other graphs: the memos hold what a
                          graph of the same family left (the same computation with its
                          output under another name), never this graph;
  + deferred collection   the young-generation collection that follows a compile (the
                          collector is paused during it: engine.collector);
  parse, validate         the body parsed (service.codec.loads) and validated by the wire
                          models, which the compiler then reads as they are (no spec made
                          of them);
  key                     the graph's id (its canonical JSON hashed).

The compiler's modules are the compiled ones where the package was installed with mypyc
(engine.graph.NATIVE); GRADSERVE_PURE_PYTHON=1 runs their Python source.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # (a server has none)

import gradserve.engine.graph as eg  # noqa: E402
from bench.harness import command_line  # noqa: E402
from bench.workloads import Workload, recurrent_cell, unrolled  # noqa: E402
from gradserve.engine.graph import autodiff, builder, executor  # noqa: E402
from gradserve.service.request import parse_json  # noqa: E402
from gradserve.service.schemas import BackwardRequest, Graph  # noqa: E402
from gradserve.wire.graph_id import graph_key  # noqa: E402

WORKLOADS: dict[str, Callable[[], Workload]] = {
    "cell": recurrent_cell,
    "chain3k": lambda: unrolled(1000),
    "chain30k": lambda: unrolled(10000),
}


def clear_memos() -> None:
    builder._DECISIONS.clear()
    autodiff._TEMPLATES.clear()
    executor._KERNELS.clear()


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


def measure(w: Workload, rounds: int) -> dict[str, float]:
    specs = {
        k: eg.TensorSpec(np.asarray(a).shape, np.asarray(a).dtype.name, k in w.wrt)
        for k, a in w.inputs.items()
    }
    inputs = {
        k: {
            "data": np.asarray(a).tolist(),
            "dtype": np.asarray(a).dtype.name,
            "requires_grad": k in w.wrt,
        }
        for k, a in w.inputs.items()
    }
    salt = 0

    def body() -> bytes:  # the same computation as a new graph (its output renamed)
        nonlocal salt
        salt += 1
        nodes, (output,) = w.graph["nodes"], w.graph["outputs"]
        renamed = f"{output}_{salt}"
        graph = {
            "nodes": [n if n["id"] != output else {**n, "id": renamed} for n in nodes],
            "outputs": [renamed],
        }
        return orjson.dumps({"graph": graph, "inputs": inputs})

    def spec() -> Graph:
        graph = BackwardRequest.model_validate(parse_json(body())).graph
        assert graph is not None
        return graph

    def compile_(s: Graph) -> Any:
        return eg.compile_graph(s, specs, backward=True)

    out: dict[str, list[float]] = {}
    compile_(spec())
    for _ in range(rounds):
        s = spec()
        clear_memos()
        out.setdefault("compile, memos cleared", []).append(timed(compile_, s)[0])
        compile_(spec())  # another graph of the family
        s = spec()
        dt, program = timed(compile_, s)
        out.setdefault("compile, memos warm", []).append(dt)
        t0 = time.perf_counter()
        gc.collect(1)
        out.setdefault("+ deferred collection", []).append(time.perf_counter() - t0)
        del program
        raw = body()
        dt, data = timed(parse_json, raw)
        out.setdefault("parse", []).append(dt)
        dt, _ = timed(BackwardRequest.model_validate, data)
        out.setdefault("validate", []).append(dt)
        out.setdefault("key", []).append(timed(graph_key, data["graph"])[0])
    nodes = len(w.graph["nodes"])
    return {k: statistics.median(v) * 1e6 / nodes for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.workloads = 1, "cell"
    print(
        f"compiler: {'compiled (mypyc)' if getattr(eg, 'NATIVE', False) else 'Python'}; "
        f"µs a node, medians of {args.rounds} rounds"
    )
    for name in args.workloads.split(","):
        w = WORKLOADS[name]()
        figures = measure(w, args.rounds)
        print(
            f"{name} ({len(w.graph['nodes'])} nodes): "
            + "  ".join(f"{k} {v:.2f}" for k, v in figures.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
