"""JSON graphs: specs, validation, `expr` parsing, memory planning and execution.

The service maps its wire schemas onto these types and calls two functions:

    program = compile_graph(spec, input_specs, limits=..., no_grad=..., backward=...,
                            grad_outputs=...)
    result = execute(program, input_tensors, grad_outputs=..., deadline=...)

`compile_graph` validates everything and plans memory before anything is
allocated; it raises `ValidationErrors` (every problem found, each with its
node and field) or `MemoryBudgetError`. `execute` runs the planned program on
engine tensors and returns outputs, gradients, measured peak bytes and timings.
"""

from engine.graph.compiler import compile_graph
from engine.graph.executor import execute
from engine.graph.program import Program
from engine.graph.spec import GraphSpec, Limits, NodeSpec, RunResult, TensorSpec

__all__ = [
    "GraphSpec",
    "Limits",
    "NodeSpec",
    "Program",
    "RunResult",
    "TensorSpec",
    "compile_graph",
    "execute",
]
