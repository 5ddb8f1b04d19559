"""The native tier (XLA through JAX) against the interpreter, JAX itself, hand-written
NumPy and the FastAPI + PyTorch script: one table, side by side, in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/bench_xla.py [--quick]

In process (a program compiled once; the timed call is its execution, NumPy in and out):

  interp  gradserve's flat interpreter (engine.graph.execute);
  xla     the same program lowered by gradserve.engine.graph.xla and compiled by XLA: the
          forward and gradserve's own derived backward, one executable;
  jax     the same function written for JAX and differentiated by it,
          `jax.jit(jax.value_and_grad(f))` (or `jax.jit(f)` where the derivatives are
          inside the function), waited for (`block_until_ready`), as GradBench's JAX tool
          is made to wait;
  numpy   hand-written NumPy (forward, and backward by the chain rule), where there is one.

Workloads: a 1,000-step RNN `scan` (`h = 0.95 h + 0.05 tanh(x + 1.1 h)`, 4 values),
bench_compiled's 24-step recurrent cell, GradBench-style lse, llsq and ode (written as its
JAX tool writes them), GradBench's kmeans as its eval asks for it (`dir`: the gradient
over the Hessian's diagonal, both inside one forward program) and gmm, and a nested
derivative like GradBench's saddle. Over HTTP
(`--http`): least squares 1024×128 and logsumexp on 10⁵ against the FastAPI + PyTorch
script a user would write, each server alone with its defaults, gradserve through its
client (binary bodies) and the script with JSON lists, as each one's user sends them: the
wire is most of that difference, the tier little of it.

Medians over interleaved rounds; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_compiled import Gradserve, _ratio, _timed, measure, recurrent_cell
from bench.bench_compiled import _close as close
from bench.bench_compiled import gmm as gmm_workload
from bench.bench_remat import ode_graph

try:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.scipy.special import logsumexp, multigammaln
except ImportError:  # the xla extra (and the test extra) brings it
    jax = None  # type: ignore[assignment]

Arrays = dict[str, np.ndarray]
Graph = dict[str, Any]


@dataclass(eq=False)
class Case:
    """One workload: the graph and its inputs for gradserve, and the same function for
    JAX (arguments in `wrt` order, then the rest) and, where written, NumPy. With `wrt`
    empty the derivatives are inside the graph (`grad`, `jvp` nodes): gradserve runs a
    forward program, and the JAX function is jitted as it is, its own derivatives
    inside."""

    name: str
    graph: Graph
    inputs: Arrays
    wrt: list[str]
    output: str
    jax_fn: Callable[..., Any] | None = None  # (*inputs in `order`) -> scalar
    order: list[str] | None = None  # the JAX function's arguments, by input name
    numpy: Callable[[Arrays], tuple[Any, Arrays]] | None = None
    numpy_inputs: Arrays | None = None
    gradbench: bool = False  # one of the target's GradBench evaluations (the summary)


# ---------------------------------------------------------------- workloads


def rnn_scan(steps: int = 1000, width: int = 4) -> Case:
    rng = np.random.default_rng(0)
    graph = {"nodes": [
        {"id": "loop", "op": "scan", "args": ["h0", "xs"], "attrs": {"length": steps},
         "body": {"carry": ["h"], "xs": ["x"],
                  "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}],
                  "next": {"h": "h2"}},
         "results": {"hT": "h"}},
        {"id": "loss", "expr": "sum(hT)"}], "outputs": ["loss"]}
    inputs = {"h0": rng.standard_normal(width), "xs": rng.standard_normal((steps, width))}

    def f(h0: Any, xs: Any) -> Any:
        def body(h: Any, x: Any) -> tuple[Any, None]:
            return 0.95 * h + 0.05 * jnp.tanh(x + 1.1 * h), None

        return jnp.sum(lax.scan(body, h0, xs)[0])

    return Case(f"RNN scan, {steps} steps x {width} f64", graph, inputs, ["h0", "xs"],
                "loss", f, ["h0", "xs"])


def lse(n: int = 100_000) -> Case:
    """GradBench's lse: logsumexp of a vector, as its JAX tool writes it (max-shifted)."""
    x = np.random.default_rng(1).standard_normal(n)

    def f(x: Any) -> Any:
        m = jnp.max(x)
        return m + jnp.log(jnp.sum(jnp.exp(x - m)))

    graph = {"nodes": [{"id": "m", "expr": "max(x)"},
                       {"id": "out", "expr": "m + log(sum(exp(x - m)))"}], "outputs": ["out"]}
    return Case(f"GradBench lse, n={n:,}", graph, {"x": x}, ["x"], "out", f, ["x"],
                gradbench=True)


def llsq(n: int = 1024, m: int = 128) -> Case:
    """GradBench's llsq: fit of sign(t) by a degree-(m-1) polynomial at n points of [-1, 1]:
    0.5 * sum((sign(t) - T @ x)^2), T the points' powers (given, like GradBench's data)."""
    t = -1.0 + 2.0 * np.arange(n) / (n - 1)
    powers = t[:, None] ** np.arange(m)
    x = np.random.default_rng(2).standard_normal(m) / m

    def f(x: Any, T: Any, s: Any) -> Any:
        return 0.5 * jnp.sum((s - T @ x) ** 2)

    graph = {"nodes": [{"id": "out", "expr": "0.5 * sum((s - T @ x) ** 2)"}],
             "outputs": ["out"]}
    return Case(f"GradBench llsq, {n}x{m}", graph, {"x": x, "T": powers, "s": np.sign(t)},
                ["x"], "out", f, ["x", "T", "s"], gradbench=True)


def ode(n: int = 1000, s: int = 100) -> Case:
    """GradBench's ode (bench_remat's graph: RK4 as a scan)."""
    x = np.random.default_rng(3).uniform(0.0, 1.0, n)
    h = 2.0 / s

    def f(x: Any) -> Any:
        first = jnp.arange(n) == 0

        def fy(y: Any) -> Any:
            return jnp.where(first, x, x * jnp.roll(y, 1))

        def step(y: Any, _: Any) -> tuple[Any, None]:
            k1 = fy(y)
            k2 = fy(y + h / 2 * k1)
            k3 = fy(y + h / 2 * k2)
            k4 = fy(y + h * k3)
            return y + h / 6 * (k1 + ((2 * k2) + (2 * k3) + k4)), None

        return lax.scan(step, jnp.zeros(n), None, length=s)[0][-1]

    m = np.zeros(n)
    m[0] = 1.0
    return Case(f"GradBench ode, n={n:,}, s={s}", ode_graph(n, s), {"x": x, "m": m}, ["x"],
                "out", f, ["x"], gradbench=True)


def kmeans(n: int = 1000, k: int = 100, d: int = 8) -> Case:
    """GradBench's kmeans as its eval asks for it (`dir`): the Newton direction J / H of
    the cost (each point's squared distance to its nearest centroid, summed), J its
    gradient with respect to the centroids and H the Hessian's diagonal, as GradBench's
    JAX tool computes it: the JVP of the gradient along ones, exact because the Hessian is
    diagonal (2 * the centroid's count in every coordinate). One forward program, the
    derivatives inside; the data as GradBench's eval makes it (uniform points, the last k
    of them the centroids: none empty)."""
    points = np.random.default_rng(5).random((n, d))
    centroids = points[-k:].copy()

    # GradBench's JAX tool (gradbench/tools/jax/kmeans.py), as it writes it.
    def costfun(points: Any, centers: Any) -> Any:
        def all_pairs_norm(a: Any, b: Any) -> Any:
            a_sqr = jnp.sum(a**2, 1)[None, :]
            b_sqr = jnp.sum(b**2, 1)[:, None]
            diff = jnp.matmul(a, b.T).T
            return a_sqr + b_sqr - 2 * diff

        dists = all_pairs_norm(points, centers)
        min_dist = jnp.min(dists, axis=0)
        return min_dist.sum()

    def dir(points: Any, centroids: Any) -> Any:
        f_diff = jax.grad(lambda cs: costfun(points, cs))
        d, hes = jax.jvp(f_diff, [centroids], [jnp.ones(shape=centroids.shape)])
        return d / hes

    graph = {"nodes": [
        {"id": "dist", "expr": "unsqueeze(sum(P * P, dim=1), dim=1) + unsqueeze(sum(C * C, "
                               "dim=1), dim=0) - 2 * (P @ transpose(C, dim0=0, dim1=1))"},
        {"id": "cost", "expr": "sum(min(dist, dim=1))"},
        {"id": "J", "expr": "grad(cost, C)"},
        {"id": "ones", "op": "ones", "attrs": {"shape": [k, d], "dtype": "float64"}},
        {"id": "H", "expr": "jvp(J, C, ones)"},
        {"id": "out", "expr": "J / H"}], "outputs": ["out"]}

    def closed_form(a: Arrays) -> tuple[np.ndarray, Arrays]:
        """J = 2 sum(c - p) over each centroid's points, H = 2 * their count."""
        P, C = a["P"], a["C"]
        nearest = np.argmin(((P[:, None, :] - C[None, :, :]) ** 2).sum(2), axis=1)
        J = np.zeros_like(C)
        np.add.at(J, nearest, 2 * (C[nearest] - P))
        H = 2 * np.bincount(nearest, minlength=len(C)).astype(C.dtype)
        return J / H[:, None], {}

    return Case(f"GradBench kmeans dir, n={n:,}, k={k}, d={d}", graph,
                {"P": points, "C": centroids}, [], "out", dir, ["P", "C"], closed_form,
                gradbench=True)


# GradBench's JAX tool's gmm objective (gradbench/tools/jax/gmm_objective.py), as it
# writes it.
def log_wishart_prior(*, k: int, p: int, gamma: float, m: int, sum_qs: Any, Qdiags: Any,
                      l: Any) -> Any:  # noqa: E741 (GradBench's name)
    n = p + m + 1
    out = jnp.sum(
        0.5 * gamma * gamma * (jnp.sum(Qdiags**2, axis=1) + jnp.sum(l**2, axis=1))
        - m * sum_qs
    )
    C = n * p * (jnp.log(gamma / math.sqrt(2)))
    return -out + k * (C - multigammaln(0.5 * n, p))


def gmm_objective(*, d: int, k: int, n: int, x: Any, m: int, gamma: float, alpha: Any,
                  mu: Any, q: Any, l: Any) -> Any:  # noqa: E741 (GradBench's name)
    Qdiags = jnp.exp(q)
    sum_qs = jnp.sum(q, axis=1)

    cols = jnp.repeat(
        jnp.arange(d - 1),
        jnp.arange(d - 1, 0, -1),
        total_repeat_length=d * (d - 1) // 2,
    )
    rows = jnp.concatenate([jnp.arange(c + 1, d) for c in range(d - 1)])
    Ls = jnp.zeros((k, d, d), dtype=l.dtype).at[:, rows, cols].set(l)

    xcentered = x[:, None, :] - mu[None, ...]
    Lxcentered = Qdiags * xcentered + jnp.einsum("ijk,mik->mij", Ls, xcentered)
    sqsum_Lxcentered = jnp.sum(Lxcentered**2, axis=2)
    inner_term = alpha + sum_qs - 0.5 * sqsum_Lxcentered
    slse = jnp.sum(logsumexp(inner_term, axis=1))

    CONSTANT = -n * d * 0.5 * math.log(2 * math.pi)
    return (
        CONSTANT
        + slse
        - n * logsumexp(alpha, axis=0)
        + log_wishart_prior(
            k=k, p=d, gamma=gamma, m=m, sum_qs=sum_qs, Qdiags=Qdiags, l=l
        )
    )


def gmm(d: int = 10, k: int = 25, n: int = 1000) -> Case:
    """GradBench's gmm: the gradient of the log posterior with respect to alpha, mu and
    the precisions' parameters; bench_compiled's graph (q and l one input, icf, as
    ADBench has them) and GradBench's JAX objective (gamma = 1, m = 0, as there), given
    icf's two parts."""
    w = gmm_workload(d, k, n)

    def f(alphas: Any, means: Any, icf: Any, x: Any) -> Any:
        return gmm_objective(d=d, k=k, n=n, x=x, m=0, gamma=1.0, alpha=alphas, mu=means,
                             q=icf[:, :d], l=icf[:, d:])

    return Case(f"GradBench gmm, d={d}, k={k}, n={n:,}", w.graph, w.inputs, w.wrt, w.output,
                f, [*w.wrt, "x"], gradbench=True)


def saddle(steps: int = 100) -> Case:
    """A nested derivative like GradBench's saddle: an inner gradient ascent on y (a
    `grad` inside a `scan`) inside an objective of x, differentiated with respect to x."""
    rng = np.random.default_rng(4)
    graph = {"nodes": [
        {"id": "ascent", "op": "scan", "args": ["y0"], "attrs": {"length": steps},
         "body": {"carry": ["y"], "xs": [], "nodes": [
             {"id": "inner", "expr": "sum(x * y) - sum(y * y) - sum(y ** 4) / 10"},
             {"id": "y2", "expr": "y + 0.1 * grad(inner, y)"}], "next": {"y": "y2"}},
         "results": {"y_star": "y"}},
        {"id": "outer", "expr": "sum(x * x) + sum(x * y_star) + sum(y_star ** 2)"}],
        "outputs": ["outer"]}

    def f(x: Any, y0: Any) -> Any:
        def step(y: Any, _: Any) -> tuple[Any, None]:
            inner = jax.grad(lambda y: jnp.sum(x * y) - jnp.sum(y * y) - jnp.sum(y**4) / 10)
            return y + 0.1 * inner(y), None

        y = lax.scan(step, y0, None, length=steps)[0]
        return jnp.sum(x * x) + jnp.sum(x * y) + jnp.sum(y**2)

    return Case(f"nested grad (saddle-like), {steps} inner steps", graph,
                {"x": rng.standard_normal(2), "y0": rng.standard_normal(2)}, ["x"], "outer",
                f, ["x", "y0"])


def cell() -> Case:
    w = recurrent_cell()
    return Case(w.name, w.graph, w.inputs, w.wrt, w.output, numpy=w.numpy,
                numpy_inputs=w.baseline_inputs)


# ---------------------------------------------------------------- running


def compile_program(c: Case) -> Any:
    """As the service compiles a /backward request: its wire schema, then the compiler."""
    from gradserve.engine.graph import TensorSpec, compile_graph
    from gradserve.service.compute import graph_spec
    from gradserve.service.schemas import Graph

    specs = {k: TensorSpec(a.shape, a.dtype.name, k in c.wrt) for k, a in c.inputs.items()}
    return compile_graph(graph_spec(Graph.model_validate(c.graph)), specs,
                         backward=bool(c.wrt))


@dataclass
class Row:
    name: str
    ms: dict[str, float]  # contender -> median ms
    ratios: dict[str, float | None]  # "xla/interp", "xla/jax", "xla/numpy"
    compile_ms: dict[str, float]  # "xla" (gradserve's lowering), "jax"
    note: str = ""
    gradbench: bool = False
    served: str = "interp"  # what the service would run: "xla" if lowered and faster
    served_jax: float | None = None  # its time over JAX's (median of per-round ratios)


def _close(a: Any, b: Any, what: str) -> None:
    """Equal to summation order (bench_compiled's check): 1e-9 of the tensor's scale in
    float64, 1e-5 in float32 (XLA sums and multiplies in its own order)."""
    a, b = np.asarray(a), np.asarray(b)
    close(a, b, 1e-5 if np.float32 in (a.dtype, b.dtype) else 1e-9, what)


def bench_case(c: Case, gs: Gradserve, rounds: int, budget_s: float) -> Row:
    from gradserve.engine.graph import xla

    program = compile_program(c)
    value, grads, _ = gs.run(program, c.inputs)
    fns: dict[str, Callable[[], object]] = {"interp": lambda: gs.run(program, c.inputs)}
    compile_ms: dict[str, float] = {}
    note = ""
    try:
        t = time.perf_counter()
        lowered = xla.lower(program)
        compile_ms["xla"] = (time.perf_counter() - t) * 1e3
    except xla.NotLowerable as e:
        lowered, note = None, f"stays interpreted: {e}"
    if lowered is not None:
        r = lowered.run(c.inputs)
        _close(r.outputs[c.output], value[c.output], f"{c.name}: xla value")
        for k in c.wrt:
            _close(r.gradients[k], grads[k], f"{c.name}: xla gradient {k}")
        fns["xla"] = lambda: lowered.run(c.inputs)
    if c.jax_fn is not None and jax is not None:
        order = c.order or c.wrt
        jitted = jax.jit(jax.value_and_grad(c.jax_fn, argnums=tuple(range(len(c.wrt))))
                         if c.wrt else c.jax_fn)
        args = [c.inputs[k] for k in order]
        t = time.perf_counter()
        v, g = jax.block_until_ready(jitted(*args)) if c.wrt else (
            jax.block_until_ready(jitted(*args)), ())
        compile_ms["jax"] = (time.perf_counter() - t) * 1e3
        _close(v, value[c.output], f"{c.name}: jax value")
        for k, gk in zip(c.wrt, g, strict=True):
            _close(gk, grads[k], f"{c.name}: jax gradient {k}")
        fns["jax"] = lambda: jax.block_until_ready(jitted(*args))
    if c.numpy is not None:
        numpy_fn = c.numpy
        if c.numpy_inputs is None:  # (on other inputs, its own workload checks it)
            _close(numpy_fn(c.inputs)[0], value[c.output], f"{c.name}: numpy value")
        fns["numpy"] = lambda: numpy_fn(c.numpy_inputs or c.inputs)
    samples = measure(fns, rounds, budget_s)
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    # As the service decides (service/tier.py): the lowered program while it is faster.
    served = "xla" if "xla" in ms and ms["xla"] < ms["interp"] else "interp"
    return Row(c.name, ms,
               {f"xla/{b}": _ratio(samples, "xla", b) for b in ("interp", "jax", "numpy")},
               compile_ms, note, c.gradbench, served, _ratio(samples, served, "jax"))


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    cols = ["interp", "xla", "jax", "numpy"]
    print("| workload | " + " | ".join(f"{c} ms" for c in cols)
          + " | xla/interp | xla/jax | xla/numpy | xla compile ms | jax compile ms |")
    print("|" + " --- |" * (len(cols) + 6))
    for r in rows:
        print(f"| {r.name} | " + " | ".join(_f(r.ms.get(c)) for c in cols) + " | "
              + " | ".join(_f(r.ratios[k]) for k in ("xla/interp", "xla/jax", "xla/numpy"))
              + f" | {_f(r.compile_ms.get('xla'))} | {_f(r.compile_ms.get('jax'))} |")
    for r in rows:
        if r.note:
            print(f"- {r.name}: {r.note}")
    target = [r for r in rows if r.gradbench and r.served_jax is not None]
    if target:
        print("\nGradBench evaluations, what the service runs (XLA when lowered and faster "
              "than the interpreter) against JAX (target: geometric mean <= 1.5x):")
        for r in target:
            print(f"- {r.name}: {r.served}, {r.served_jax:.2f}x JAX")
        mean = math.exp(statistics.fmean(math.log(r.served_jax) for r in target))
        print(f"- geometric mean: {mean:.2f}x JAX")


# ---------------------------------------------------------------- over HTTP

# The script a user would write to serve the two objectives with PyTorch: JSON lists in,
# forward and backward, JSON lists out; PyTorch with its default threads (every core).
TORCH_APP = """
import torch
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class Llsq(BaseModel):
    x: list[float]
    T: list[list[float]]
    s: list[float]


class Lse(BaseModel):
    x: list[float]


@app.post("/llsq")
def llsq(req: Llsq) -> dict:
    x = torch.tensor(req.x, dtype=torch.float64, requires_grad=True)
    T = torch.tensor(req.T, dtype=torch.float64)
    s = torch.tensor(req.s, dtype=torch.float64)
    out = 0.5 * torch.sum((s - T @ x) ** 2)
    out.backward()
    return {"out": out.item(), "x": x.grad.tolist()}


@app.post("/lse")
def lse(req: Lse) -> dict:
    x = torch.tensor(req.x, dtype=torch.float64, requires_grad=True)
    out = torch.logsumexp(x, dim=0)
    out.backward()
    return {"out": out.item(), "x": x.grad.tolist()}
"""


def http_rows(rounds: int, requests: int, quick: bool) -> list[tuple[str, float, float, str]]:
    """(workload, gradserve p50 ms, FastAPI+PyTorch p50 ms, the tier that answered in the
    end): each server
    alone, with its defaults; gradserve through its client (binary bodies), the script
    through httpx with JSON lists, as each one's user sends them."""
    import tempfile

    import httpx
    import orjson

    from bench.bench_service import free_port, server
    from gradserve import Client

    app_dir = Path(tempfile.mkdtemp(prefix="gradserve-xla-bench-"))
    (app_dir / "torch_app.py").write_text(TORCH_APP)
    cases = [llsq(*((256, 32) if quick else (1024, 128))), lse(10_000 if quick else 100_000)]
    gs_port, torch_port = free_port(), free_port()
    gs_argv = [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(gs_port),
               "--log-level", "warning"]
    torch_argv = [sys.executable, "-m", "uvicorn", "torch_app:app", "--port", str(torch_port),
                  "--log-level", "warning", "--no-access-log", "--app-dir", str(app_dir)]
    rows = []
    with server(gs_argv, gs_port) as gs_base, server(torch_argv, torch_port) as torch_base, \
            Client(gs_base, timeout=60) as gs, httpx.Client(timeout=60) as http:
        for c in cases:
            path = "/llsq" if "llsq" in c.name else "/lse"
            body = orjson.dumps({k: a.tolist() for k, a in c.inputs.items()},
                                option=orjson.OPT_SERIALIZE_NUMPY)

            def via_gradserve(c: Case = c) -> Any:
                return gs.backward(c.graph, c.inputs, requires_grad=c.wrt)

            def via_torch(path: str = path, body: bytes = body) -> Any:
                r = http.post(torch_base + path, content=body,
                              headers={"Content-Type": "application/json"})
                r.raise_for_status()
                return r.json()

            # Until the program has tiered up (bounded), and both agree with each other.
            deadline = time.monotonic() + 60
            r = via_gradserve()
            while r.meta.get("tier") != "xla" and time.monotonic() < deadline:
                time.sleep(0.05)
                r = via_gradserve()
            t = via_torch()
            _close(r.outputs[c.output], t["out"], f"{c.name}: over HTTP")
            _close(r.gradients["x"], np.array(t["x"]), f"{c.name}: gradient over HTTP")
            samples: dict[str, list[float]] = {"gradserve": [], "torch": []}
            for _ in range(rounds):
                for name, fn in (("gradserve", via_gradserve), ("torch", via_torch)):
                    samples[name].append(statistics.median(
                        _timed(fn) for _ in range(requests)))
            last = via_gradserve().meta  # (the tier keeps a program only where it is faster)
            tier = last.get("tier", "?") + (f" ({last['tier_reason']})"
                                            if last.get("tier_reason") else "")
            rows.append((c.name, statistics.median(samples["gradserve"]) * 1e3,
                         statistics.median(samples["torch"]) * 1e3, tier))
    return rows


def print_http(rows: list[tuple[str, float, float, str]], rounds: int) -> None:
    print(f"\nover HTTP, one request at a time, each server alone with its defaults; medians of "
          f"{rounds} rounds (target: gradserve <= 0.7x the FastAPI + PyTorch script)")
    print("| workload | gradserve ms | FastAPI+PyTorch ms | ratio | gradserve's tier |")
    print("| --- | --- | --- | --- | --- |")
    for name, gs_ms, torch_ms, tier in rows:
        print(f"| {name} | {gs_ms:.3g} | {torch_ms:.3g} | {gs_ms / torch_ms:.2f} | {tier} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="")
    parser.add_argument("--http", action="store_true", help="also the HTTP comparison")
    parser.add_argument("--requests", type=int, default=20, help="per round, over HTTP")
    args = parser.parse_args()
    if jax is None:
        raise SystemExit("JAX is needed (pip install -e '.[test]' or '.[xla]')")
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    budget = 0.02 if quick else 0.15
    gs = Gradserve()
    cases = [rnn_scan(100 if quick else 1000), cell(), lse(10_000 if quick else 100_000),
             llsq(*((256, 32) if quick else (1024, 128))),
             kmeans(*((100, 10, 4) if quick else (1000, 100, 8))),
             gmm(*((4, 5, 100) if quick else (10, 25, 1000))),
             ode(*((100, 10) if quick else
                                                                   (1000, 100))),
             saddle(10 if quick else 100)]
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    rows = []
    for c in cases:
        if args.only in c.name:
            t = time.perf_counter()
            rows.append(bench_case(c, gs, rounds, budget))
            print(f"  {c.name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    print_table(rows, f"\nthe native tier in process: medians of {rounds} interleaved rounds; "
                      f"JAX {jax.__version__} on {jax.devices()[0].platform}, "
                      f"{platform.python_version()}, NumPy {np.__version__}; "
                      f"{time.perf_counter() - started:.0f} s{'; --quick' if quick else ''}")
    if args.http:
        print_http(http_rows(rounds, args.requests, quick), rounds)


if __name__ == "__main__":
    main()
