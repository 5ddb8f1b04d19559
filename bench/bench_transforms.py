"""`scan`, `grad` and `jvp` nodes: what a loop compiled once and a derivative inside the
graph cost, against the unrolled graph and PyTorch.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/bench_transforms.py [--quick]

Prints one table:

 1. An RNN cell, h = tanh(x_t @ w + h @ u + b), over 1,000 steps (batch 4, width 16,
    float32), loss = sum(h_T²), gradients w.r.t. w, u, b and h0: as one `scan` node against
    the same loop unrolled (1,000 inputs x_t, 5,000 op nodes), and against PyTorch eager.
    Compile time (a new graph each call), and fwd+bwd of the compiled program (warm).
    Targets: scan compiles >= 50x faster than the unrolled graph; its fwd+bwd is within
    1.3x of the unrolled program's.
 2. A Hessian-vector product on each of the 10 objectives of tests/engine/test_objectives.py:
    `g_i = grad(loss, w_i)`, `hv_i = grad(sum_i sum(g_i * v_i), w_i)` in the graph (a
    no_grad request: the derivatives are its values), against PyTorch's double backward
    (`torch.autograd.grad(..., create_graph=True)` then `torch.autograd.grad` again), both
    warm. Target: <= 1x PyTorch.
 3. `jvp(loss, w, t)` on the same objectives (built on reverse mode: the VJP of a VJP)
    against torch.func.jvp (PyTorch's forward mode, one JVP rule per op): no target, the
    measurement behind building `jvp` on reverse mode.

Medians over interleaved rounds; ratios are medians of per-round ratios (these machines
are shared and noisy). PyTorch runs with one intra-op thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bench_compiled import (
    OBJECTIVES,
    _objectives_torch,
    _ratio,
    ex,
    measure,
    objectives_data,
)
from gradserve.engine.graph import TensorSpec, compile_graph, execute
from gradserve.service.schemas import Graph

Arrays = dict[str, np.ndarray]
CELL = "tanh({x} @ w + {h} @ u + b)"


def compile_json(graph: dict[str, Any], inputs: Arrays, wrt: list[str], *, backward: bool) -> Any:
    """The service's path from a JSON graph: the wire model, the engine's spec, compile."""
    spec = Graph.model_validate(graph)
    specs = {k: TensorSpec(a.shape, a.dtype.name, k in wrt) for k, a in inputs.items()}
    return compile_graph(spec, specs, backward=backward, no_grad=not backward)


def run(program: Any, inputs: Arrays) -> Any:
    return execute(program, inputs)


# ---------------------------------------------------------------- 1. RNN: scan vs unrolled
def rnn_data(steps: int, batch: int = 4, width: int = 16) -> Arrays:
    rng = np.random.default_rng(0)
    f = np.float32
    return {
        "xs": rng.standard_normal((steps, batch, width)).astype(f),
        "w": (rng.standard_normal((width, width)) * 0.3).astype(f),
        "u": (rng.standard_normal((width, width)) * 0.3).astype(f),
        "b": (rng.standard_normal(width) * 0.1).astype(f),
        "h0": rng.standard_normal((batch, width)).astype(f),
    }


def rnn_scan(salt: float = 0.0) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "id": "rnn",
                "op": "scan",
                "args": ["h0", "xs"],
                "body": {
                    "carry": ["h"],
                    "xs": ["x"],
                    "nodes": [{"id": "h2", "expr": CELL.format(x="x", h="h")}],
                    "next": {"h": "h2"},
                },
                "results": {"h_last": "h"},
                "attrs": {"length": None},
            },
            ex("loss", f"sum(h_last * h_last) + {salt}"),
        ],
        "outputs": ["loss"],
    }


def rnn_unrolled(steps: int, salt: float = 0.0) -> dict[str, Any]:
    nodes, h = [], "h0"
    for t in range(steps):
        nodes.append(ex(f"h{t + 1}", CELL.format(x=f"x{t}", h=h)))
        h = f"h{t + 1}"
    nodes.append(ex("loss", f"sum({h} * {h}) + {salt}"))
    return {"nodes": nodes, "outputs": ["loss"]}


def unrolled_inputs(d: Arrays) -> Arrays:
    return {
        **{f"x{t}": x for t, x in enumerate(d["xs"])},
        **{k: v for k, v in d.items() if k != "xs"},
    }


def rnn_torch(d: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    h = d["h0"]
    for x in d["xs"]:
        h = torch.tanh(x @ d["w"] + h @ d["u"] + d["b"])
    return list(torch.autograd.grad((h * h).sum(), [d[k] for k in ("w", "u", "b", "h0")]))


RNN_WRT = ["w", "u", "b", "h0"]


def check_rnn(steps: int) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """The scan and unrolled programs and PyTorch's inputs, once the three agree on every
    gradient."""
    d = rnn_data(steps)
    wrt = RNN_WRT
    flat = unrolled_inputs(d)
    scan = compile_json(rnn_scan(), d, wrt, backward=True)
    unrolled = compile_json(rnn_unrolled(steps), flat, wrt, backward=True)
    t = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in d.items()}
    ours, theirs = run(scan, d), run(unrolled, flat)
    reference = dict(zip(wrt, rnn_torch(t), strict=True))
    for k in wrt:
        np.testing.assert_allclose(
            ours.gradients[k], theirs.gradients[k], rtol=2e-4, atol=1e-5, err_msg=k
        )
        np.testing.assert_allclose(
            ours.gradients[k], reference[k].numpy(), rtol=2e-4, atol=1e-5, err_msg=k
        )
    return scan, unrolled, t


def bench_rnn(steps: int, rounds: int) -> list[list[str]]:
    d = rnn_data(steps)
    wrt = RNN_WRT
    flat = unrolled_inputs(d)
    scan, unrolled, t = check_rnn(steps)  # the three agree before anything is timed
    salt = iter(range(1, 1 << 30))
    compiles = measure(
        {
            "scan": lambda: compile_json(rnn_scan(next(salt)), d, wrt, backward=True),
            "unrolled": lambda: compile_json(
                rnn_unrolled(steps, next(salt)), flat, wrt, backward=True
            ),
        },
        min(rounds, 3),
        budget_s=0.0,
    )
    runs = measure(
        {
            "scan": lambda: run(scan, d),
            "unrolled": lambda: run(unrolled, flat),
            "torch": lambda: rnn_torch(t),
        },
        rounds,
        budget_s=0.3,
    )
    compile_speedup = _ratio(compiles, "unrolled", "scan")
    run_ratio = _ratio(runs, "scan", "unrolled")
    ms = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
    cms = {k: statistics.median(v) * 1e3 for k, v in compiles.items()}
    return [
        [
            f"RNN {steps} steps: compile",
            "ms",
            f"{cms['scan']:.2f}",
            f"{cms['unrolled']:.0f}",
            "-",
            f"unrolled/scan {compile_speedup:.0f}x",
            "ok" if (compile_speedup or 0) >= 50 else "unrolled/scan<50x",
        ],
        [
            f"RNN {steps} steps: fwd+bwd",
            "ms",
            f"{ms['scan']:.2f}",
            f"{ms['unrolled']:.2f}",
            f"{ms['torch']:.2f}",
            f"scan/unrolled {run_ratio:.2f}x, scan/torch {_ratio(runs, 'scan', 'torch'):.2f}x",
            "ok" if (run_ratio or 9) <= 1.3 else "scan/unrolled>1.3x",
        ],
    ]


# ---------------------------------------------------------------- 2. HVP on the objectives
def hvp_graph(nodes: list[dict[str, Any]], output: str, wrt: list[str]) -> dict[str, Any]:
    grads = [ex(f"g_{w}", f"grad({output}, {w})") for w in wrt]
    dot = " + ".join(f"sum(g_{w} * v_{w})" for w in wrt)
    hvs = [ex(f"hv_{w}", f"grad(dot, {w})") for w in wrt]
    return {"nodes": [*nodes, *grads, ex("dot", dot), *hvs], "outputs": [f"hv_{w}" for w in wrt]}


def check_hvp(name: str) -> tuple[Any, Arrays, Callable[[], Any]]:
    """The HVP program of objective `name`, its inputs, and PyTorch's double backward, once
    the two agree."""
    nodes, output, wrt = OBJECTIVES[name]
    data = objectives_data()
    rng = np.random.default_rng(1)
    inputs = {**data, **{f"v_{w}": rng.standard_normal(data[w].shape) for w in wrt}}
    program = compile_json(hvp_graph(nodes, output, wrt), inputs, [], backward=False)
    t = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in data.items()}
    vs = [torch.tensor(inputs[f"v_{w}"]) for w in wrt]
    fn = _objectives_torch()[name]

    def double_backward() -> Any:
        ws = [t[w] for w in wrt]
        gs = torch.autograd.grad(fn(t), ws, create_graph=True)
        dot = sum((g * v).sum() for g, v in zip(gs, vs, strict=True))
        return torch.autograd.grad(dot, ws, allow_unused=True)

    ours = run(program, inputs).outputs
    for w, hv in zip(wrt, double_backward(), strict=True):
        expected = np.zeros_like(data[w]) if hv is None else hv.numpy()
        np.testing.assert_allclose(
            ours[f"hv_{w}"], expected, rtol=1e-8, atol=1e-10, err_msg=f"{name} {w}"
        )
    return program, inputs, double_backward


def bench_hvp(rounds: int) -> list[list[str]]:
    rows = []
    for name in OBJECTIVES:
        program, inputs, double_backward = check_hvp(name)
        s = measure(
            {"gradserve": lambda p=program, i=inputs: run(p, i), "torch": double_backward},
            rounds,
            budget_s=0.05,
        )
        ratio = _ratio(s, "gradserve", "torch")
        us = {k: statistics.median(v) * 1e6 for k, v in s.items()}
        rows.append(
            [
                f"HVP {name} [{program.nodes} nodes]",
                "µs",
                f"{us['gradserve']:.0f}",
                "-",
                f"{us['torch']:.0f}",
                f"gs/torch {ratio:.2f}x",
                "ok" if (ratio or 9) <= 1 else "gs/torch>1",
            ]
        )
    return rows


def check_jvp(name: str) -> tuple[Any, Arrays, Callable[[], Any]]:
    """`jvp(loss, w, t)` of objective `name` (w its first differentiable input), its
    inputs, and torch.func.jvp (PyTorch's forward mode, one rule per op), once they agree."""
    nodes, output, wrt = OBJECTIVES[name]
    data = objectives_data()
    w = wrt[0]
    inputs = {**data, "tangent": np.random.default_rng(2).standard_normal(data[w].shape)}
    graph = {"nodes": [*nodes, ex("pushed", f"jvp({output}, {w}, tangent)")], "outputs": ["pushed"]}
    program = compile_json(graph, inputs, [], backward=False)
    t = {k: torch.tensor(v) for k, v in data.items()}
    fn = _objectives_torch()[name]
    tangent = torch.tensor(inputs["tangent"])

    def forward_mode() -> Any:
        return torch.func.jvp(lambda x: fn({**t, w: x}), (t[w],), (tangent,))[1]

    np.testing.assert_allclose(
        run(program, inputs).outputs["pushed"],
        forward_mode().numpy(),
        rtol=1e-8,
        atol=1e-10,
        err_msg=name,
    )
    return program, inputs, forward_mode


def bench_jvp(rounds: int) -> list[list[str]]:
    rows = []
    for name in OBJECTIVES:
        program, inputs, forward_mode = check_jvp(name)
        s = measure(
            {"gradserve": lambda p=program, i=inputs: run(p, i), "torch": forward_mode},
            rounds,
            budget_s=0.05,
        )
        us = {k: statistics.median(v) * 1e6 for k, v in s.items()}
        rows.append(
            [
                f"JVP {name}",
                "µs",
                f"{us['gradserve']:.0f}",
                "-",
                f"{us['torch']:.0f}",
                f"gs/torch.func.jvp {_ratio(s, 'gradserve', 'torch'):.2f}x",
                "",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 steps, 2 rounds: seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 2 if args.quick else 5
    started = time.perf_counter()
    rows = bench_rnn(100 if args.quick else 1000, rounds) + bench_hvp(rounds)
    rows += bench_jvp(rounds)
    cols = ["workload", "unit", "gradserve", "unrolled", "PyTorch", "ratios", "targets"]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print(
        "targets: scan compiles >= 50x faster than unrolled, fwd+bwd <= 1.3x unrolled; "
        "HVP <= 1x PyTorch double backward"
    )
    print(" | ".join(c.ljust(widths[i]) for i, c in enumerate(cols)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(
            " | ".join(
                v.ljust(widths[i]) if i in (0, 1, 5, 6) else v.rjust(widths[i])
                for i, v in enumerate(r)
            )
        )
    targeted = [r for r in rows if r[-1]]
    met = sum(r[-1] == "ok" for r in targeted)
    print(
        f"{met} of {len(targeted)} rows with a target meet it "
        f"({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
