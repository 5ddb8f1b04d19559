"""Shared by the tests (from tests/engine/test_checkpoint.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradserve.engine.graph import BodySpec, GraphSpec, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.checkpoint import checkpoint_every
from gradserve.engine.graph.compiler import _backend_ufuncs
from gradserve.engine.graph.executor import bind
from gradserve.engine.graph.ir import Program

RNG = np.random.default_rng(18)


def specs(arrays: Mapping[str, np.ndarray], wrt: Sequence[str]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(a.shape, str(a.dtype), k in wrt) for k, a in arrays.items()}


def forced(spec: GraphSpec, inputs: Mapping[str, TensorSpec], every: int, **kw: Any) -> Program:
    """`spec` compiled with each loop that may be checkpointed every `every` steps."""
    program = compile_graph(spec, inputs, **kw)
    assert checkpoint_every(program, every, ufuncs=_backend_ufuncs("cpu"))
    program.run = bind(program)
    return program


def rnn(last_only: bool, carries: int = 1) -> GraphSpec:
    """An RNN over xs with `carries` states (each the next one's input), its loss on the
    final states only or on the stacked ones too."""
    names = [f"h{i}" for i in range(carries)]
    nodes = [
        NodeSpec(f"n{i}", expr=f"tanh(x @ w + {h} @ u + {names[i - 1]} * 0.5 + b)")
        for i, h in enumerate(names)
    ]
    body = BodySpec(
        carry=names, xs=["x"], nodes=nodes, next={h: f"n{i}" for i, h in enumerate(names)}
    )
    results = {f"{h}_end": h for h in names} | {"ns": "n0"}
    loss = " + ".join(f"sum({h}_end * {h}_end)" for h in names)
    if not last_only:
        loss += " + sum(ns * ns)"
    return GraphSpec(
        [
            NodeSpec(
                "rnn", op="scan", args=[*(f"{h}0" for h in names), "xs"], body=body, results=results
            ),
            NodeSpec("loss", expr=loss),
        ],
        ["loss"],
    )


def rnn_arrays(
    steps: int, carries: int = 1, batch: int = 2, d: int = 3, h: int = 4
) -> dict[str, np.ndarray]:
    return {
        "xs": RNG.standard_normal((steps, batch, d)),
        "w": RNG.standard_normal((d, h)),
        "u": RNG.standard_normal((h, h)) * 0.5,
        "b": RNG.standard_normal(h),
        **{f"h{i}0": RNG.standard_normal((batch, h)) for i in range(carries)},
    }
