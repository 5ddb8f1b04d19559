"""Graph benchmark (issue: graph IR and executor). Prints one table.

    python3 bench/bench_graph.py

Validation + planning (`compile_graph`: ids, references, arity, attributes, shape and
dtype inference, cycle check, execution order, memory plan) per node on a 10,000-node
graph, next to the executor's per-node cost (forward + backward) on the same scalar
graph, in the same run. Medians of interleaved repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine
from engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph, execute

NODES = 10_000


def scalar_graph(n: int) -> GraphSpec:
    """A chain with a side branch every few nodes: binary and unary ops on scalars."""
    ops = [("mul", 1.0001), ("add", 0.5), ("tanh", None), ("sub", "x"), ("mul", "y")]
    nodes = [NodeSpec("n0", "add", ["x", "y"])]
    for i in range(1, n):
        op, other = ops[i % len(ops)]
        args = [f"n{i - 1}"] if other is None else [f"n{i - 1}", other]
        nodes.append(NodeSpec(f"n{i}", op, args))
    return GraphSpec(nodes=nodes, outputs=[f"n{n - 1}"])


def main() -> None:
    spec = scalar_graph(NODES)
    inputs = {"x": TensorSpec((), "float32", True), "y": TensorSpec((), "float32", True)}

    def validate_and_plan() -> None:
        compile_graph(spec, inputs, backward=True)

    program = compile_graph(spec, inputs, backward=True)

    def run() -> None:
        tensors = {"x": engine.tensor(0.1, requires_grad=True),
                   "y": engine.tensor(0.2, requires_grad=True)}
        execute(program, tensors)

    samples: dict[str, list[float]] = {"plan": [], "run": []}
    for _ in range(7):
        for name, fn in (("plan", validate_and_plan), ("run", run)):
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    plan = statistics.median(samples["plan"]) / NODES * 1e6
    run_cost = statistics.median(samples["run"]) / NODES * 1e6
    print(f"{'per node, 10,000-node scalar graph':44s} {'us/node':>8s}")
    print(f"{'validation + planning (compile_graph)':44s} {plan:8.2f}")
    print(f"{'execution, forward + backward (execute)':44s} {run_cost:8.2f}")
    print(f"{'ratio (target <= 0.20)':44s} {plan / run_cost:8.2f}")


if __name__ == "__main__":
    main()
