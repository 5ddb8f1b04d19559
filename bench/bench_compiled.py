"""Compiled-graph benchmark: gradserve in-process against hand-written NumPy and PyTorch eager.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/bench_compiled.py [--quick]

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

import argparse
import functools
import gc
import itertools
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch
except ImportError:  # PyTorch comes with the test extra
    torch = None  # type: ignore[assignment]

Arrays = dict[str, np.ndarray]
Graph = dict[str, Any]


# ================================================================ the gradserve adapter
# Every call into gradserve is in this class: its API is being rewritten; re-point here.


class Gradserve:
    """gradserve in-process: compile a JSON graph once, run it many times, with
    `engine.graph.compile_graph` and `engine.graph.execute` as service/compute.py calls
    them (NumPy arrays in and out). `run_graph` is the path of a client that just sends a
    graph: the service's key (a hash of the canonical graph, and the inputs' specs), the
    service's program cache, compile on a miss, then run."""

    def __init__(self) -> None:
        from gradserve.engine import graph as eg
        from gradserve.service.programs import ProgramCache
        from gradserve.wire.graph_id import graph_key

        self._graph = eg
        self._graph_key = graph_key
        self._cache = ProgramCache(256 << 20)  # the service's default bound

    def compile(
        self,
        graph: Graph,
        inputs: Arrays,
        requires_grad: list[str],
        grad_outputs: Arrays | None = None,
        no_grad: bool = False,
    ) -> Any:
        eg = self._graph
        spec = eg.GraphSpec(
            nodes=[
                eg.NodeSpec(
                    id=n["id"],
                    op=n.get("op"),
                    args=n.get("args", ()),
                    attrs=n.get("attrs", {}),
                    expr=n.get("expr"),
                )
                for n in graph["nodes"]
            ],
            outputs=graph["outputs"],
        )
        wanted = frozenset(() if no_grad else requires_grad)
        specs = {k: eg.TensorSpec(a.shape, a.dtype.name, k in wanted) for k, a in inputs.items()}
        go_specs = (
            None
            if grad_outputs is None
            else {k: eg.TensorSpec(a.shape, a.dtype.name) for k, a in grad_outputs.items()}
        )
        return eg.compile_graph(
            spec, specs, no_grad=no_grad, backward=not no_grad, grad_outputs=go_specs
        )

    def run(
        self, program: Any, inputs: Arrays, grad_outputs: Arrays | None = None
    ) -> tuple[Arrays, Arrays, dict[str, Any]]:
        """(outputs, gradients, meta): NumPy arrays in and out."""
        r = self._graph.execute(program, inputs, grad_outputs=grad_outputs)
        outputs = {k: np.asarray(a) for k, a in r.outputs.items()}
        gradients = {k: np.asarray(a) for k, a in (r.gradients or {}).items()}
        meta = {
            "nodes": r.nodes,
            "peak_bytes": r.peak_bytes,
            "planned_peak_bytes": r.planned_peak_bytes,
            "timings_ms": r.timings_ms,
        }
        return outputs, gradients, meta

    def run_graph(
        self,
        graph: Graph,
        inputs: Arrays,
        requires_grad: list[str],
        grad_outputs: Arrays | None = None,
        no_grad: bool = False,
    ) -> tuple[Arrays, Arrays, dict[str, Any]]:
        """Compile only on a cache miss, keyed as the service keys programs."""
        key = (
            self._graph_key(graph),
            tuple((k, a.shape, a.dtype.str, k in requires_grad) for k, a in inputs.items()),
            None
            if grad_outputs is None
            else tuple((k, a.shape, a.dtype.str) for k, a in grad_outputs.items()),
            no_grad,
        )
        program = self._cache.get(key)
        if program is None:
            program = self.compile(graph, inputs, requires_grad, grad_outputs, no_grad)
            self._cache.put(key, program)
        return self.run(program, inputs, grad_outputs)


# ================================================================ workloads

Impl = Callable[[Arrays], tuple[np.ndarray, Arrays]]  # inputs -> (value, gradients)


@dataclass(eq=False)
class Workload:
    name: str
    graph: Graph
    inputs: Arrays  # what gradserve gets
    wrt: list[str]  # inputs that get a gradient (none under no_grad)
    output: str  # the graph output compared with the baselines' value
    numpy: Impl | None = None
    torch: Impl | None = None
    baseline_inputs: Arrays | None = None  # what the baselines get, when it differs
    grad_outputs: Arrays | None = None
    no_grad: bool = False
    per: int = 1  # report time per this many ops (1: per call)
    unit: str = "ms"
    gs_gradients: Callable[[Arrays], Arrays] | None = None  # gradserve's names -> baselines'

    @property
    def base_inputs(self) -> Arrays:
        return self.inputs if self.baseline_inputs is None else self.baseline_inputs


def op(id_: str, name: str, *args: str | float, **attrs: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"id": id_, "op": name, "args": list(args)}
    if attrs:
        node["attrs"] = attrs
    return node


def ex(id_: str, text: str) -> dict[str, Any]:
    return {"id": id_, "expr": text}


def salted(graph: Graph, salt: int, input_name: str) -> Graph:
    """The same computation as a different graph: one node that no output needs (it is
    validated, never run) with a constant that changes per call."""
    nodes = [*graph["nodes"], op("cold_salt", "mul", input_name, float(salt))]
    return {"nodes": nodes, "outputs": graph["outputs"]}


def input_names(nodes: list[dict[str, Any]]) -> set[str]:
    """Every name a graph's nodes read (node ids too), string literals left out."""
    names: set[str] = set()
    for n in nodes:
        if "op" in n:
            names.update(a for a in n.get("args", ()) if isinstance(a, str))
        else:
            names.update(re.findall(r"[A-Za-z_]\w*", re.sub(r'"[^"]*"', "", n["expr"])))
    return names


def torch_impl(fn: Callable[[dict[str, Any]], Any], wrt: list[str]) -> Impl:
    """Forward + backward in PyTorch eager; NumPy arrays in and out (shared, no copies)."""

    def run(inputs: Arrays) -> tuple[np.ndarray, Arrays]:
        t: dict[str, Any] = {k: torch.from_numpy(a) for k, a in inputs.items()}
        for k in wrt:
            t[k].requires_grad_(True)
        out = fn(t)
        out.backward()
        return out.detach().numpy(), {k: t[k].grad.numpy() for k in wrt}

    return run


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact, and no overflow for large |x|


# ---------------------------------------------------------------- 1. recurrent cell


def recurrent_graph(steps: int, one: float = 1.0) -> Graph:
    """a = x_t @ w + h @ u + b; h = sigmoid(a + one) * h + sigmoid(a) * tanh(a);
    loss = sum(h * h). 11 op nodes a step, 2 for the loss."""
    nodes, h = [], "h0"
    for t in range(steps):
        nodes += [
            op(f"xw{t}", "matmul", f"x{t}", "w"),
            op(f"hu{t}", "matmul", h, "u"),
            op(f"s{t}", "add", f"xw{t}", f"hu{t}"),
            op(f"a{t}", "add", f"s{t}", "b"),
            op(f"a1_{t}", "add", f"a{t}", one),
            op(f"f{t}", "sigmoid", f"a1_{t}"),
            op(f"fh{t}", "mul", f"f{t}", h),
            op(f"g{t}", "sigmoid", f"a{t}"),
            op(f"c{t}", "tanh", f"a{t}"),
            op(f"gc{t}", "mul", f"g{t}", f"c{t}"),
            op(f"h{t + 1}", "add", f"fh{t}", f"gc{t}"),
        ]
        h = f"h{t + 1}"
    nodes += [op("hh", "mul", h, h), op("loss", "sum", "hh")]
    return {"nodes": nodes, "outputs": ["loss"]}


def recurrent_data(steps: int = 24, batch: int = 4, width: int = 16) -> Arrays:
    rng = np.random.default_rng(1)
    f32 = np.float32
    return {
        "xs": rng.standard_normal((steps, batch, width)).astype(f32),
        "w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(f32),
        "u": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(f32),
        "b": (rng.standard_normal(width) * 0.1).astype(f32),
        "h0": (rng.standard_normal((batch, width)) * 0.5).astype(f32),
    }


def recurrent_numpy(d: Arrays) -> tuple[np.ndarray, Arrays]:
    xs, w, u, b, h = d["xs"], d["w"], d["u"], d["b"], d["h0"]
    steps, _, width = xs.shape
    # The input projections of all steps in one matmul, forward and backward.
    pre = (xs.reshape(-1, width) @ w).reshape(xs.shape) + b
    hs = np.empty_like(xs)
    fs, gs, cs = [], [], []
    for t in range(steps):
        a = pre[t] + h @ u
        f, g, c = _sigmoid(a + 1), _sigmoid(a), np.tanh(a)
        hs[t] = h
        fs.append(f)
        gs.append(g)
        cs.append(c)
        h = f * h + g * c
    loss = np.sum(h * h)
    dh = 2 * h
    das = np.empty_like(xs)
    for t in reversed(range(steps)):
        f, g, c = fs[t], gs[t], cs[t]
        da = dh * (hs[t] * f * (1 - f) + c * g * (1 - g) + g * (1 - c * c))
        das[t] = da
        dh = dh * f + da @ u.T
    flat = das.reshape(-1, width)
    return loss, {
        "w": xs.reshape(-1, width).T @ flat,
        "u": hs.reshape(-1, width).T @ flat,
        "b": flat.sum(0),
        "h0": dh,
        "xs": das @ w.T,
    }


def recurrent_torch(t: dict[str, Any]) -> Any:
    xs, w, u, b, h = t["xs"], t["w"], t["u"], t["b"], t["h0"]
    for step in range(xs.shape[0]):
        a = xs[step] @ w + h @ u + b
        h = torch.sigmoid(a + 1) * h + torch.sigmoid(a) * torch.tanh(a)
    return torch.sum(h * h)


def recurrent_inputs(d: Arrays) -> Arrays:
    """gradserve's inputs: each step its own input x_t (a view of xs)."""
    return {f"x{t}": d["xs"][t] for t in range(len(d["xs"]))} | {
        k: d[k] for k in ("w", "u", "b", "h0")
    }


def recurrent_cell(steps: int = 24, batch: int = 4, width: int = 16) -> Workload:
    d = recurrent_data(steps, batch, width)
    wrt = [*(f"x{t}" for t in range(steps)), "w", "u", "b", "h0"]

    def gradients(g: Arrays) -> Arrays:
        return {k: g[k] for k in ("w", "u", "b", "h0")} | {
            "xs": np.stack([g[f"x{t}"] for t in range(steps)])
        }

    return Workload(
        f"recurrent cell {steps} steps, {batch}x{width} f32",
        recurrent_graph(steps),
        recurrent_inputs(d),
        wrt,
        "loss",
        numpy=recurrent_numpy,
        torch=torch_impl(recurrent_torch, ["xs", "w", "u", "b", "h0"]) if torch else None,
        baseline_inputs=d,
        gs_gradients=gradients,
    )


# ---------------------------------------------------------------- 2a. GradBench gmm


def _multigammaln(a: float, p: int) -> float:
    return p * (p - 1) / 4 * math.log(math.pi) + sum(
        math.lgamma(a + (1 - j) / 2) for j in range(1, p + 1)
    )


def gmm(d: int = 10, k: int = 25, n: int = 1000) -> Workload:
    """GradBench's gmm objective (ADBench's): alphas (k), means (k, d), icf (k, d + d(d-1)/2)
    (log-diagonal, then the strict lower triangle column by column), x (n, d); Wishart prior
    gamma = 1, m = 0 as in GradBench's data; the log Wishart prior added, as GradBench
    defines it (ADBench subtracted it). Gradients w.r.t. alphas, means, icf."""
    rng = np.random.default_rng(2)
    nl = d * (d - 1) // 2
    rows = np.array([i for j in range(d) for i in range(j + 1, d)], dtype=np.int64)
    cols = np.array([j for j in range(d) for _ in range(j + 1, d)], dtype=np.int64)
    tri = np.zeros((d, d), np.int64)
    tri[rows, cols] = d + np.arange(nl)  # where L[i, j] lives in icf (0: not in L)
    inputs = {
        "alphas": rng.standard_normal(k),
        "means": rng.random((k, d)),
        "icf": rng.standard_normal((k, d + nl)) * 0.5,
        "x": rng.random((n, d)),
        "tri_idx": tri.ravel(),
        "tri_mask": (tri > 0).astype(np.float64).ravel(),
    }
    gamma, m = 1.0, 0
    nw = d + m + 1
    const = -n * d * 0.5 * math.log(2 * math.pi) + k * (
        nw * d * math.log(gamma / math.sqrt(2)) - _multigammaln(0.5 * nw, d)
    )
    half_g2 = 0.5 * gamma * gamma
    graph = {
        "nodes": [
            ex("q", f"slice(icf, dim=1, start=0, stop={d})"),
            ex("l", f"slice(icf, dim=1, start={d})"),
            ex("Q", "exp(q)"),
            ex("sum_qs", "sum(q, dim=1)"),
            ex(
                "L", f"reshape(index_select(icf, tri_idx, dim=1) * tri_mask, shape=[{k}, {d}, {d}])"
            ),
            ex("xc", "unsqueeze(x, dim=1) - means"),
            ex("Lx", 'Q * xc + einsum("kij,nkj->nki", L, xc)'),
            ex("inner", "alphas + sum_qs - 0.5 * sum(Lx * Lx, dim=2)"),
            ex(
                "prior",
                f"-sum({half_g2!r} * (sum(Q * Q, dim=1) + sum(l * l, dim=1)) - {m} * sum_qs)",
            ),
            ex(
                "loss",
                f"{const!r} + sum(logsumexp(inner, dim=1)) - {n} * logsumexp(alphas, dim=0)"
                " + prior",
            ),
        ],
        "outputs": ["loss"],
    }

    def numpy_gmm(a: Arrays) -> tuple[np.ndarray, Arrays]:
        alphas, means, icf, x = a["alphas"], a["means"], a["icf"], a["x"]
        q, lo = icf[:, :d], icf[:, d:]
        Q = np.exp(q)
        L = np.zeros((k, d, d))
        L[:, rows, cols] = lo
        xc = x[:, None, :] - means
        Lx = Q * xc + np.einsum("kij,nkj->nki", L, xc)
        inner = alphas + q.sum(1) - 0.5 * np.sum(Lx * Lx, 2)
        mx = inner.max(1, keepdims=True)
        e = np.exp(inner - mx)
        se = e.sum(1, keepdims=True)
        am = alphas.max()
        ea = np.exp(alphas - am)
        sa = ea.sum()
        value = (
            const
            + np.sum(np.log(se) + mx)
            - n * (np.log(sa) + am)
            - half_g2 * (np.sum(Q * Q) + np.sum(lo * lo))
            + m * q.sum()
        )
        P = e / se  # d value / d inner
        dsum_qs = P.sum(0)
        dLx = -P[:, :, None] * Lx
        dQ = np.einsum("nkd,nkd->kd", dLx, xc) - 2 * half_g2 * Q
        dL = np.einsum("nki,nkj->kij", dLx, xc)
        dxc = Q * dLx + np.einsum("kij,nki->nkj", L, dLx)
        dicf = np.empty_like(icf)
        dicf[:, :d] = dQ * Q + (dsum_qs + m)[:, None]
        dicf[:, d:] = dL[:, rows, cols] - 2 * half_g2 * lo
        return np.asarray(value), {
            "alphas": dsum_qs - n * ea / sa,
            "means": -dxc.sum(0),
            "icf": dicf,
        }

    def torch_gmm(t: dict[str, Any]) -> Any:  # GradBench's PyTorch gmm_objective, vectorised
        alphas, means, icf, x = t["alphas"], t["means"], t["icf"], t["x"]
        q = icf[:, :d]
        Q = torch.exp(q)
        sum_qs = torch.sum(q, 1)
        L = (icf[:, t["tri_idx"]] * t["tri_mask"]).reshape(k, d, d)
        xc = x[:, None, :] - means
        Lx = Q * xc + torch.einsum("kij,nkj->nki", L, xc)
        inner = alphas + sum_qs - 0.5 * torch.sum(Lx**2, 2)
        prior = -torch.sum(
            half_g2 * (torch.sum(Q**2, 1) + torch.sum(icf[:, d:] ** 2, 1)) - m * sum_qs
        )
        return const + torch.sum(torch.logsumexp(inner, 1)) - n * torch.logsumexp(alphas, 0) + prior

    wrt = ["alphas", "means", "icf"]
    return Workload(
        f"gmm d={d} k={k} n={n} f64",
        graph,
        inputs,
        wrt,
        "loss",
        numpy=numpy_gmm,
        torch=torch_impl(torch_gmm, wrt) if torch else None,
    )


# ---------------------------------------------------------------- 2b. GradBench lstm


def lstm(layers: int = 2, hidden: int = 14, seq: int = 10) -> Workload:
    """GradBench's lstm objective (ADBench's): main_params (2l, 4b), extra_params (3, b),
    state (2l, b), sequence (c, b); gates = cat(x, h, x, h) * W + B, forget, input, output
    gates sigmoid, change tanh; prediction x * w2[1] + w2[2]; loss -mean of
    ygold * (ypred - log(sum(exp(ypred)) + 2)) over the c - 1 steps. Unrolled."""
    rng = np.random.default_rng(3)
    b, c = hidden, seq
    inputs = {
        "main_params": rng.uniform(-1, 1, (2 * layers, 4 * b)),
        "extra_params": rng.uniform(-1, 1, (3, b)),
        "state": rng.uniform(-1, 1, (2 * layers, b)),
        "sequence": rng.uniform(-1, 1, (c, b)),
    }

    def row(name: str, r: int, width: int) -> dict[str, Any]:
        return ex(
            f"{name}{r}", f"reshape(slice({name}, dim=0, start={r}, stop={r + 1}), shape=[{width}])"
        )

    nodes = [row("main_params", r, 4 * b) for r in range(2 * layers)]
    nodes += [row("extra_params", r, b) for r in range(3)]
    nodes += [row("state", r, b) for r in range(2 * layers)]
    nodes += [row("sequence", r, b) for r in range(c)]
    hs = [f"state{2 * i}" for i in range(layers)]
    cs = [f"state{2 * i + 1}" for i in range(layers)]
    total = ""
    for t in range(c - 1):
        x = f"x{t}"
        nodes.append(ex(x, f"sequence{t} * extra_params0"))
        for i in range(layers):
            g, s, ch, h, cl = f"g{i}_{t}", f"s{i}_{t}", f"ch{i}_{t}", hs[i], cs[i]
            nodes += [
                ex(g, f"cat({x}, {h}, {x}, {h}) * main_params{2 * i} + main_params{2 * i + 1}"),
                ex(s, f"sigmoid(slice({g}, dim=0, start=0, stop={3 * b}))"),
                ex(ch, f"tanh(slice({g}, dim=0, start={3 * b}))"),
                ex(
                    f"c{i}_{t}",
                    f"{cl} * slice({s}, dim=0, start=0, stop={b})"
                    f" + slice({s}, dim=0, start={b}, stop={2 * b}) * {ch}",
                ),
                ex(f"h{i}_{t}", f"slice({s}, dim=0, start={2 * b}, stop={3 * b}) * tanh(c{i}_{t})"),
            ]
            hs[i], cs[i], x = f"h{i}_{t}", f"c{i}_{t}", f"h{i}_{t}"
        nodes += [
            ex(f"yp{t}", f"{x} * extra_params1 + extra_params2"),
            ex(f"yn{t}", f"yp{t} - log(sum(exp(yp{t})) + 2)"),
            ex(f"tot{t}", f"{total}sum(sequence{t + 1} * yn{t})"),
        ]
        total = f"tot{t} + "
    nodes.append(ex("loss", f"-tot{c - 2} / {(c - 1) * b}"))
    graph = {"nodes": nodes, "outputs": ["loss"]}

    def numpy_lstm(a: Arrays) -> tuple[np.ndarray, Arrays]:
        M, E, S, sq = a["main_params"], a["extra_params"], a["state"], a["sequence"]
        h = [S[2 * i] for i in range(layers)]
        cl = [S[2 * i + 1] for i in range(layers)]
        tape = []
        total = 0.0
        for t in range(c - 1):
            x = sq[t] * E[0]
            cells = []
            for i in range(layers):
                cat = np.concatenate((x, h[i], x, h[i]))
                g = cat * M[2 * i] + M[2 * i + 1]
                s, ch = _sigmoid(g[: 3 * b]), np.tanh(g[3 * b :])
                cn = cl[i] * s[:b] + s[b : 2 * b] * ch
                th = np.tanh(cn)
                cells.append((cat, cl[i], s, ch, th))
                cl[i], h[i] = cn, s[2 * b :] * th
                x = h[i]
            yp = x * E[1] + E[2]
            ey = np.exp(yp)
            se = ey.sum() + 2
            total += np.sum(sq[t + 1] * (yp - np.log(se)))
            tape.append((x, ey, se, cells))
        count = (c - 1) * b
        dM, dE = np.zeros_like(M), np.zeros_like(E)
        dh = [np.zeros(b) for _ in range(layers)]
        dc = [np.zeros(b) for _ in range(layers)]
        for t in reversed(range(c - 1)):
            xtop, ey, se, cells = tape[t]
            dyn = sq[t + 1] * (-1.0 / count)
            dyp = dyn - dyn.sum() * ey / se
            dE[1] += dyp * xtop
            dE[2] += dyp
            dx = dyp * E[1]
            for i in reversed(range(layers)):
                cat, cprev, s, ch, th = cells[i]
                dhn = dx + dh[i]
                dcn = dhn * s[2 * b :] * (1 - th * th) + dc[i]
                ds = np.concatenate((dcn * cprev, dcn * ch, dhn * th))
                dg = np.concatenate((ds * s * (1 - s), dcn * s[b : 2 * b] * (1 - ch * ch)))
                dM[2 * i] += dg * cat
                dM[2 * i + 1] += dg
                dcat = dg * M[2 * i]
                dx = dcat[:b] + dcat[2 * b : 3 * b]
                dh[i] = dcat[b : 2 * b] + dcat[3 * b :]
                dc[i] = dcn * s[:b]
            dE[0] += dx * sq[t]
        return np.asarray(-total / count), {"main_params": dM, "extra_params": dE}

    def torch_lstm(a: dict[str, Any]) -> Any:
        M, E, S, sq = a["main_params"], a["extra_params"], a["state"], a["sequence"]
        h = [S[2 * i] for i in range(layers)]
        cl = [S[2 * i + 1] for i in range(layers)]
        total: Any = 0
        for t in range(c - 1):
            x = sq[t] * E[0]
            for i in range(layers):
                g = torch.cat((x, h[i], x, h[i])) * M[2 * i] + M[2 * i + 1]
                s, ch = torch.sigmoid(g[: 3 * b]), torch.tanh(g[3 * b :])
                cl[i] = cl[i] * s[:b] + s[b : 2 * b] * ch
                h[i] = s[2 * b :] * torch.tanh(cl[i])
                x = h[i]
            yp = x * E[1] + E[2]
            total = total + torch.sum(sq[t + 1] * (yp - torch.log(torch.sum(torch.exp(yp)) + 2)))
        return -total / ((c - 1) * b)

    wrt = ["main_params", "extra_params"]
    return Workload(
        f"lstm l={layers} b={hidden} c={seq} f64",
        graph,
        inputs,
        wrt,
        "loss",
        numpy=numpy_lstm,
        torch=torch_impl(torch_lstm, wrt) if torch else None,
    )


# ---------------------------------------------------------------- 2c. GradBench ba


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a0, a1, a2 = a[:, 0], a[:, 1], a[:, 2]
    b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
    return np.stack((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0), axis=1)


def ba(n_cams: int = 16, n_points: int = 256, n_obs: int = 512) -> Workload:
    """GradBench's ba (ADBench's): camera = rotation (Rodrigues, 3), centre (3), focal (1),
    principal point (2), radial distortion (2); reprojection error w * (project(cam, X) - feat)
    and weight error 1 - w^2 per observation. GradBench asks for the sparse Jacobian of
    those residuals; here the gradient of their sum of squares (what Gauss-Newton
    minimises), vectorised over observations, w.r.t. cams, X and w."""
    rng = np.random.default_rng(4)
    p = n_obs
    cams = np.empty((n_cams, 11))
    cams[:, 0:3] = rng.normal(0, 0.3, (n_cams, 3))  # theta > 0: Rodrigues' general branch
    cams[:, 3:6] = rng.normal(0, 0.5, (n_cams, 3)) + np.array([0.0, 0.0, -10.0])  # in front
    cams[:, 6] = rng.uniform(0.8, 1.2, n_cams)
    cams[:, 7:9] = rng.normal(0, 0.01, (n_cams, 2))
    cams[:, 9:11] = rng.normal(0, [0.05, 0.005], (n_cams, 2))
    inputs = {
        "cams": cams,
        "X": rng.normal(0, 1, (n_points, 3)),
        "w": rng.uniform(0.5, 1.5, p),
        "feats": rng.normal(0, 0.1, (p, 2)),
        "cam_idx": np.arange(p, dtype=np.int64) % n_cams,  # GradBench cycles both
        "pt_idx": np.arange(p, dtype=np.int64) % n_points,
    }

    def sl(x: str, a: int, b: int) -> str:
        return f"slice({x}, dim=1, start={a}, stop={b})"

    graph = {
        "nodes": [
            ex("cam", "index_select(cams, cam_idx, dim=0)"),
            ex("pt", "index_select(X, pt_idx, dim=0)"),
            ex("rot", sl("cam", 0, 3)),
            ex("Xc", f"pt - {sl('cam', 3, 6)}"),
            ex("theta", "sqrt(sum(rot * rot, dim=1, keepdim=True))"),
            ex("cost", "cos(theta)"),
            ex("axis", "rot / theta"),
            ex(
                "Xcam",
                "Xc * cost + cross(axis, Xc, dim=1) * sin(theta)"
                " + axis * (sum(axis * Xc, dim=1, keepdim=True) * (1 - cost))",
            ),
            ex("proj", f"{sl('Xcam', 0, 2)} / {sl('Xcam', 2, 3)}"),
            ex("rsq", "sum(proj * proj, dim=1, keepdim=True)"),
            ex("distort", f"1 + {sl('cam', 9, 10)} * rsq + {sl('cam', 10, 11)} * rsq * rsq"),
            ex(
                "err",
                f"unsqueeze(w, dim=1) * (proj * distort * {sl('cam', 6, 7)}"
                f" + {sl('cam', 7, 9)} - feats)",
            ),
            ex("werr", "1 - w * w"),
            ex("loss", "sum(err * err) + sum(werr * werr)"),
        ],
        "outputs": ["loss"],
    }

    def numpy_ba(a: Arrays) -> tuple[np.ndarray, Arrays]:
        ci, pi, w = a["cam_idx"], a["pt_idx"], a["w"]
        cam, pt = a["cams"][ci], a["X"][pi]
        rot, f, x0, k1, k2 = cam[:, 0:3], cam[:, 6:7], cam[:, 7:9], cam[:, 9:10], cam[:, 10:11]
        Xc = pt - cam[:, 3:6]
        sqt = np.sum(rot * rot, 1, keepdims=True)
        th = np.sqrt(sqt)
        ct, st = np.cos(th), np.sin(th)
        ax = rot / th
        axX = _cross(ax, Xc)
        dot = np.sum(ax * Xc, 1, keepdims=True)
        tmp = dot * (1 - ct)
        Xcam = Xc * ct + axX * st + ax * tmp
        z = Xcam[:, 2:3]
        proj = Xcam[:, 0:2] / z
        rsq = np.sum(proj * proj, 1, keepdims=True)
        dist = 1 + k1 * rsq + k2 * rsq * rsq
        r = proj * dist * f + x0 - a["feats"]
        err = w[:, None] * r
        werr = 1 - w * w
        value = np.sum(err * err) + np.sum(werr * werr)
        # backward
        derr = 2 * err
        dw = np.sum(derr * r, 1) - 4 * werr * w
        dr = derr * w[:, None]
        df = np.sum(dr * proj * dist, 1, keepdims=True)
        dpd = dr * f  # d / d(proj * dist)
        dproj = dpd * dist
        ddist = np.sum(dpd * proj, 1, keepdims=True)
        dproj += 2 * proj * (ddist * (k1 + 2 * k2 * rsq))
        dXcam = np.empty_like(Xcam)
        dXcam[:, 0:2] = dproj / z
        dXcam[:, 2:3] = -np.sum(dproj * proj, 1, keepdims=True) / z
        dXc = dXcam * ct
        dct = np.sum(dXcam * Xc, 1, keepdims=True)
        dst = np.sum(dXcam * axX, 1, keepdims=True)
        dtmp = np.sum(dXcam * ax, 1, keepdims=True)
        daxX = dXcam * st
        dct -= dtmp * dot
        ddot = dtmp * (1 - ct)
        dax = dXcam * tmp + ddot * Xc + _cross(Xc, daxX)
        dXc += ddot * ax + _cross(daxX, ax)
        dth = -np.sum(dax * rot, 1, keepdims=True) / sqt - dct * st + dst * ct
        drot = dax / th + rot * (dth / th)
        dcam = np.concatenate((drot, -dXc, df, dr, ddist * rsq, ddist * rsq * rsq), axis=1)
        dcams = np.zeros_like(a["cams"])
        np.add.at(dcams, ci, dcam)
        dX = np.zeros_like(a["X"])
        np.add.at(dX, pi, dXc)
        return np.asarray(value), {"cams": dcams, "X": dX, "w": dw}

    def torch_ba(t: dict[str, Any]) -> Any:  # GradBench's PyTorch ba_objective, vectorised
        w = t["w"]
        cam, pt = t["cams"][t["cam_idx"]], t["X"][t["pt_idx"]]
        rot = cam[:, 0:3]
        Xc = pt - cam[:, 3:6]
        theta = torch.sqrt(torch.sum(rot**2, 1, keepdim=True))
        cost = torch.cos(theta)
        ax = rot / theta
        Xcam = (
            Xc * cost
            + torch.linalg.cross(ax, Xc, dim=1) * torch.sin(theta)
            + ax * (torch.sum(ax * Xc, 1, keepdim=True) * (1 - cost))
        )
        proj = Xcam[:, 0:2] / Xcam[:, 2:3]
        rsq = torch.sum(proj**2, 1, keepdim=True)
        dist = 1 + cam[:, 9:10] * rsq + cam[:, 10:11] * rsq * rsq
        err = w[:, None] * (proj * dist * cam[:, 6:7] + cam[:, 7:9] - t["feats"])
        return torch.sum(err**2) + torch.sum((1 - w**2) ** 2)

    wrt = ["cams", "X", "w"]
    return Workload(
        f"ba {n_cams} cams {n_points} pts {p} obs f64",
        graph,
        inputs,
        wrt,
        "loss",
        numpy=numpy_ba,
        torch=torch_impl(torch_ba, wrt) if torch else None,
    )


# ------------------------------------------------------- 3. tests/engine/test_objectives.py
# Copied as JSON dicts rather than imported: that module imports engine.graph's current
# types, which are being rewritten; this script's only tie to gradserve is the adapter.
# tests/project/test_bench_smoke.py checks that the copies still match.


def objectives_data() -> Arrays:
    rng = np.random.default_rng(42)  # the same draws, in the same order, as the tests' _data
    return {
        "X": rng.standard_normal((16, 5)),
        "w": rng.standard_normal(5) * 0.3,
        "b": rng.standard_normal(()),
        "y": np.where(rng.standard_normal(16) > 0, 1.0, -1.0),
        "W1": rng.standard_normal((5, 8)) * 0.4,
        "b1": rng.standard_normal(8) * 0.1,
        "W2": rng.standard_normal((8, 3)) * 0.4,
        "onehot": np.eye(3)[rng.integers(0, 3, 16)],
        "labels": rng.integers(0, 3, (16, 1)),
        "Q": rng.standard_normal((2, 4, 6)),
        "K": rng.standard_normal((2, 4, 6)),
        "V": rng.standard_normal((2, 4, 6)),
        "gamma": rng.uniform(0.5, 1.5, 5),
        "beta": rng.standard_normal(5) * 0.1,
        "A": rng.standard_normal((4, 4)) + 4 * np.eye(4),
        "t": rng.standard_normal(4),
    }


def _objectives_torch() -> dict[str, Callable[[dict[str, Any]], Any]]:
    F = torch.nn.functional
    return {
        "least-squares": lambda d: torch.mean((d["X"] @ d["w"] + d["b"] - d["y"]) ** 2),
        "logistic-regression-l2": lambda d: (
            torch.mean(F.softplus(-d["y"] * (d["X"] @ d["w"] + d["b"])))
            + 0.01 * torch.sum(d["w"] * d["w"])
        ),
        "mlp-cross-entropy": lambda d: F.cross_entropy(
            torch.relu(d["X"] @ d["W1"] + d["b1"]) @ d["W2"], d["onehot"].argmax(dim=1)
        ),
        "nll-by-gather": lambda d: (
            -torch.mean(
                torch.gather(
                    torch.log_softmax(torch.tanh(d["X"] @ d["W1"]) @ d["W2"], dim=-1),
                    1,
                    d["labels"],
                )
            )
        ),
        "attention": lambda d: torch.sum(
            (torch.softmax(d["Q"] @ d["K"].transpose(-2, -1) / 2.449489742783178, dim=-1) @ d["V"])
            ** 2
        ),
        "layer-norm": lambda d: torch.sum(
            F.layer_norm(d["X"], (5,), d["gamma"], d["beta"], eps=1e-5) ** 3
        ),
        "logsumexp-softmax-margin": lambda d: torch.mean(
            torch.logsumexp(d["X"] @ d["W1"], dim=1) - torch.amax(d["X"] @ d["W1"], dim=1)
        ),
        "linear-system": lambda d: (
            torch.sum(torch.linalg.solve(d["A"], d["t"]) ** 2)
            + torch.log(torch.abs(torch.linalg.det(d["A"])))
            + torch.sum(torch.inverse(d["A"]) * d["A"])
        ),
        "huber-with-where-and-clamp": lambda d: (
            F.huber_loss(d["X"] @ d["w"] - 0.5, torch.zeros(16, dtype=torch.float64))
            + torch.sum(torch.clamp(d["w"], -0.2, 0.2) ** 2)
        ),
        "einsum-bilinear": lambda d: (
            torch.sum(torch.einsum("bi,ij,bj->b", d["X"], d["W1"] @ d["W1"].T, d["X"]) ** 2) / 100.0
        ),
    }


# name -> (graph nodes, output, differentiable inputs)
OBJECTIVES: dict[str, tuple[list[dict[str, Any]], str, list[str]]] = {
    "least-squares": ([ex("loss", "mean((X @ w + b - y) ** 2)")], "loss", ["w", "b"]),
    "logistic-regression-l2": (
        [
            ex("margin", "-y * (X @ w + b)"),
            ex("loss", "mean(softplus(margin)) + 0.01 * sum(w * w)"),
        ],
        "loss",
        ["w", "b"],
    ),
    "mlp-cross-entropy": (
        [
            ex("h", "relu(X @ W1 + b1)"),
            ex("logits", "h @ W2"),
            ex("loss", "-mean(sum(onehot * log_softmax(logits, dim=1), dim=1))"),
        ],
        "loss",
        ["W1", "b1", "W2"],
    ),
    "nll-by-gather": (
        [
            ex("logp", "log_softmax(tanh(X @ W1) @ W2, dim=-1)"),
            op("picked", "gather", "logp", "labels", dim=1),
            ex("loss", "-mean(picked)"),
        ],
        "loss",
        ["W1", "W2"],
    ),
    "attention": (
        [
            ex("scores", "Q @ transpose(K, dim0=-2, dim1=-1) / 2.449489742783178"),
            ex("out", "softmax(scores, dim=-1) @ V"),
            ex("loss", "sum(out * out)"),
        ],
        "loss",
        ["Q", "K", "V"],
    ),
    "layer-norm": (
        [
            ex("mu", "mean(X, dim=-1, keepdim=True)"),
            ex("var", "var(X, dim=-1, keepdim=True, correction=0)"),
            ex("n", "(X - mu) / sqrt(var + 1e-5) * gamma + beta"),
            ex("loss", "sum(n ** 3)"),
        ],
        "loss",
        ["X", "gamma", "beta"],
    ),
    "logsumexp-softmax-margin": (
        [ex("s", "X @ W1"), ex("loss", "mean(logsumexp(s, dim=1) - max(s, dim=1))")],
        "loss",
        ["W1"],
    ),
    "linear-system": (
        [ex("x", "solve(A, t)"), ex("loss", "sum(x * x) + log(abs(det(A))) + sum(inv(A) * A)")],
        "loss",
        ["A", "t"],
    ),
    "huber-with-where-and-clamp": (
        [
            ex("r", "X @ w - 0.5"),
            ex(
                "loss",
                "mean(where(abs(r) < 1.0, 0.5 * r ** 2, abs(r) - 0.5))"
                " + sum(clamp(w, min=-0.2, max=0.2) ** 2)",
            ),
        ],
        "loss",
        ["w"],
    ),
    "einsum-bilinear": (
        [
            ex(
                "loss",
                'sum(einsum("bi,ij,bj->b", X, W1 @ transpose(W1, dim0=0, dim1=1), X) ** 2) / 100.0',
            )
        ],
        "loss",
        ["W1"],
    ),
}


def objectives() -> list[Workload]:
    data = objectives_data()
    refs = _objectives_torch() if torch else {}
    out = []
    for name, (nodes, output, wrt) in OBJECTIVES.items():
        words = input_names(nodes)
        inputs = {k: v for k, v in data.items() if k in words}  # what a client would send
        out.append(
            Workload(
                f"objective {name}",
                {"nodes": nodes, "outputs": [output]},
                inputs,
                wrt,
                output,
                torch=torch_impl(refs[name], wrt) if torch else None,
            )
        )
    return out


# ---------------------------------------------------------------- 4. scalar chain


def scalar_chain(n: int = 1000) -> Workload:
    nodes, prev = [], "x"
    for i in range(n // 2):
        nodes.append(op(f"m{i}", "mul", prev, 1.0001))
        nodes.append(
            op(f"n{i}", "add", f"m{i}", 0.5) if i % 2 else op(f"n{i}", "sub", f"m{i}", 0.25)
        )
        prev = f"n{i}"

    def torch_chain(t: dict[str, Any]) -> Any:
        y = t["x"]
        for i in range(n // 2):
            y = y * 1.0001
            y = y + 0.5 if i % 2 else y - 0.25
        return y

    return Workload(
        f"scalar chain {n} ops 0-d f32",
        {"nodes": nodes, "outputs": [prev]},
        {"x": np.array(0.5, np.float32)},
        ["x"],
        prev,
        torch=torch_impl(torch_chain, ["x"]) if torch else None,
        per=n,
        unit="µs/op",
    )


# ---------------------------------------------------------------- 5, 6. elementwise chains

CHAIN16: list[tuple[str, float | None]] = [
    ("sin", None),
    ("mul", 0.5),
    ("tanh", None),
    ("exp", None),
    ("add", 1.0),
    ("log", None),
    ("reciprocal", None),
    ("square", None),
    ("cos", None),
    ("mul", 2.0),
    ("exp", None),
    ("sqrt", None),
    ("sub", 1.0),
    ("tanh", None),
    ("sin", None),
    ("mul", 3.0),
]
_NP_OPS: dict[str, Callable[..., np.ndarray]] = {
    "sin": np.sin,
    "tanh": np.tanh,
    "exp": np.exp,
    "log": np.log,
    "cos": np.cos,
    "sqrt": np.sqrt,
    "reciprocal": np.reciprocal,
    "square": np.square,
    "mul": np.multiply,
    "add": np.add,
    "sub": np.subtract,
}


def chain_graph(ops: list[tuple[str, float | None]]) -> Graph:
    nodes, prev = [], "x"
    for i, (name, k) in enumerate(ops):
        nodes.append(op(f"e{i}", name, prev) if k is None else op(f"e{i}", name, prev, k))
        prev = f"e{i}"
    return {"nodes": nodes, "outputs": [prev]}


def numpy_chain16_forward(d: Arrays) -> tuple[np.ndarray, Arrays]:
    x = d["x"]
    h = np.sin(x) * 0.5
    h = np.exp(np.tanh(h)) + 1.0
    h = 1.0 / np.log(h)
    h = np.cos(h * h) * 2.0
    h = np.sqrt(np.exp(h)) - 1.0
    return np.sin(np.tanh(h)) * 3.0, {}


def numpy_chain16(d: Arrays) -> tuple[np.ndarray, Arrays]:
    x = d["x"]
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
    g = d["gout"] * 3.0
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
    return h16, {"x": g * np.cos(x)}


def _count(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def elementwise_chain(size: int, grad: bool) -> Workload:
    x = np.random.default_rng(5).uniform(-1, 1, size)
    graph = chain_graph(CHAIN16)
    name = f"16-op chain {_count(size)} f64 ({x.nbytes / 2**20:.3g} MB)"
    if not grad:
        return Workload(
            f"{name}, no_grad",
            graph,
            {"x": x},
            [],
            "e15",
            numpy=numpy_chain16_forward,
            no_grad=True,
        )
    gout = np.ones(size)
    return Workload(
        f"{name}, fwd+bwd",
        graph,
        {"x": x},
        ["x"],
        "e15",
        numpy=numpy_chain16,
        baseline_inputs={"x": x, "gout": gout},
        grad_outputs={"e15": gout},
    )


def peak_chain(size: int) -> Workload:
    ops = CHAIN16 + CHAIN16

    def numpy_forward(d: Arrays) -> tuple[np.ndarray, Arrays]:
        h = d["x"]
        for name, k in ops:
            h = _NP_OPS[name](h) if k is None else _NP_OPS[name](h, k)
        return h, {}

    return Workload(
        f"32-op chain {_count(size)} f64, no_grad peak",
        chain_graph(ops),
        {"x": np.random.default_rng(6).uniform(-1, 1, size)},
        [],
        "e31",
        numpy=numpy_forward,
        no_grad=True,
    )


# ---------------------------------------------------------------- 7. 30k-node unrolled graph


def unrolled(steps: int = 10_000, width: int = 8) -> Workload:
    """h = tanh(h * w + x), unrolled: 3 op nodes a step, and a sum."""
    nodes, h = [], "h0"
    for t in range(steps):
        nodes += [
            op(f"p{t}", "mul", h, "w"),
            op(f"q{t}", "add", f"p{t}", "x"),
            op(f"h{t + 1}", "tanh", f"q{t}"),
        ]
        h = f"h{t + 1}"
    nodes.append(op("loss", "sum", h))
    rng = np.random.default_rng(7)
    inputs = {
        "h0": rng.uniform(-1, 1, width),
        "w": rng.uniform(0.5, 1.0, width),
        "x": rng.uniform(-0.5, 0.5, width),
    }

    def torch_unrolled(t: dict[str, Any]) -> Any:
        h = t["h0"]
        for _ in range(steps):
            h = torch.tanh(h * t["w"] + t["x"])
        return torch.sum(h)

    wrt = ["h0", "w", "x"]
    return Workload(
        f"unrolled recurrence {steps} steps, width {width} f64",
        {"nodes": nodes, "outputs": ["loss"]},
        inputs,
        wrt,
        "loss",
        torch=torch_impl(torch_unrolled, wrt) if torch else None,
    )


def small_workloads() -> list[Workload]:
    """Every workload at a size for the smoke test (correctness only)."""
    return [
        recurrent_cell(),
        recurrent_cell(3, 2, 5),
        gmm(3, 4, 20),
        gmm(2, 5, 50),
        lstm(2, 5, 4),
        ba(3, 8, 12),
        *objectives(),
        scalar_chain(20),
        elementwise_chain(1000, grad=False),
        elementwise_chain(1000, grad=True),
        peak_chain(1000),
        unrolled(30, 4),
    ]


# ================================================================ correctness


def run_gradserve(
    w: Workload, gs: Gradserve, compiled: Any = None
) -> tuple[np.ndarray, Arrays, dict[str, Any]]:
    if compiled is None:
        compiled = gs.compile(w.graph, w.inputs, w.wrt, w.grad_outputs, w.no_grad)
    outputs, grads, meta = gs.run(compiled, w.inputs, w.grad_outputs)
    if w.gs_gradients is not None:
        grads = w.gs_gradients(grads)
    return outputs[w.output], grads, meta


def check(w: Workload, gs: Gradserve) -> dict[str, Any]:
    """All implementations agree on the value and the gradients, or AssertionError.
    Returns gradserve's meta."""
    value, grads, meta = run_gradserve(w, gs)
    results = {"gradserve": (value, grads)}
    for name, impl in (("numpy", w.numpy), ("torch", w.torch)):
        if impl is not None:
            results[name] = impl(w.base_inputs)
    ref_name = "torch" if "torch" in results else "numpy"
    if ref_name not in results:
        return meta
    ref_value, ref_grads = results[ref_name]
    rtol = 1e-4 if np.asarray(ref_value).dtype == np.float32 else 1e-8
    for name, (v, g) in results.items():
        if name == ref_name:
            continue
        _close(v, ref_value, rtol, f"{w.name}: value, {name} vs {ref_name}")
        if set(g) != set(ref_grads):
            raise AssertionError(
                f"{w.name}: {name} has gradients {sorted(g)}, {ref_name} {sorted(ref_grads)}"
            )
        for k in ref_grads:
            _close(g[k], ref_grads[k], rtol, f"{w.name}: gradient {k!r}, {name} vs {ref_name}")
    return meta


def _close(actual: Any, expected: Any, rtol: float, what: str) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != {e.shape}")
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    # Relative to each element, with an absolute floor at the tensor's scale: sums of
    # float32 terms in another order differ by about eps * (the largest term).
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)


# ================================================================ timing


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(
    fns: dict[str, Callable[[], object]], rounds: int, budget_s: float
) -> dict[str, list[float]]:
    """Per contender, one median per round; each round runs every contender in turn.
    Callers warm the contenders up first (the correctness check does)."""
    repeats = {k: max(1, min(2000, int(budget_s / max(_timed(fn), 1e-9)))) for k, fn in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        gc.collect()
        for k, fn in fns.items():
            samples[k].append(statistics.median(_timed(fn) for _ in range(repeats[k])))
    return samples


def _ratio(samples: dict[str, list[float]], a: str, b: str) -> float | None:
    if a not in samples or b not in samples:
        return None
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


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


def _salt_input(w: Workload) -> str:
    return next(k for k, a in w.inputs.items() if a.dtype.kind == "f")


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
    first = _salt_input(w)
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
        "warm/numpy": _ratio(s, "warm", "numpy"),
        "warm/torch": _ratio(s, "warm", "torch"),
        "cold/warm": _ratio(s, "cold", "warm"),
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
    first = _salt_input(w)
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
    repeat = _ratio(s, "repeat", "exec")
    row = Row(
        w.name + f" [{meta['nodes']} nodes]",
        "ms",
        med["exec"],
        med["first"],
        med["compile"] / 1e3 / meta["nodes"] * 1e6,
        other=f"repeat {med['repeat']:.0f} ms = {repeat:.2f}x exec",
    )
    row.ratios = {"cold/warm": _ratio(s, "first", "exec")}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds: seconds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="", help="run workloads whose name contains this")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    if torch is None:
        raise SystemExit("PyTorch is needed (pip install -e '.[test]')")
    torch.set_num_threads(args.torch_threads)
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    budget = 0.01 if quick else 0.12  # seconds per contender per round
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
