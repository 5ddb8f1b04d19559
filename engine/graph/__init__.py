"""JSON graphs compiled into programs: validation, `expr` parsing, reverse mode as a
transformation, memory and compute planning, and a flat executor.

The service maps its wire schemas onto these types and calls two functions:

    program = compile_graph(spec, input_specs, limits=..., no_grad=..., backward=...,
                            grad_outputs=..., device=...)
    result = execute(program, input_arrays, grad_outputs=..., deadline=..., cancel=...)

`compile_graph` validates everything, derives the backward steps from the ops' VJPs,
plans memory and cost and binds kernels, before anything is allocated; it raises
`ValidationErrors` (every problem found, each with its node and field),
`MemoryBudgetError` or `ComputeBudgetError`. `execute` runs the program's steps on arrays
of its device and returns outputs, gradients, the measured peak bytes and timings.

The compiler's hottest modules are compiled by mypyc when the package is installed
(setup.py); `NATIVE` says whether those are the ones imported (engine.graph._native).
"""

from gradserve.engine.graph._native import NATIVE  # (first: which form of the compiler to import)
from gradserve.engine.graph.compiler import check_budgets, compile_graph
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import Program
from gradserve.engine.graph.spec import (
    BodySpec,
    GraphLike,
    GraphSpec,
    Limits,
    MapBodySpec,
    NodeSpec,
    RunResult,
    TensorSpec,
)

__all__ = [
    "NATIVE",
    "BodySpec",
    "GraphLike",
    "GraphSpec",
    "Limits",
    "MapBodySpec",
    "NodeSpec",
    "Program",
    "RunResult",
    "TensorSpec",
    "check_budgets",
    "compile_graph",
    "execute",
]
