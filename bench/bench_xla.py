"""The native tier (XLA through JAX) against the interpreter, JAX itself, hand-written
NumPy and the FastAPI + PyTorch script: one table, side by side, in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 -m bench.bench_xla [--quick]
        [--rounds N] [--only NAME] [--http] [--device DEV] [--smoke]

In process (a program compiled once; the timed call is its execution, NumPy in and out):

  interp  gradserve's flat interpreter (engine.graph.execute);
  xla     the same program lowered by gradserve.engine.graph.xla and compiled by XLA: the
          forward and gradserve's own derived backward, one executable;
  jax     the same function written for JAX and differentiated by it,
          `jax.jit(jax.value_and_grad(f))` (or `jax.jit(f)` where the derivatives are
          inside the function), waited for (`block_until_ready`), as GradBench's JAX tool
          is made to wait;
  numpy   hand-written NumPy (forward, and backward by the chain rule), where there is one.

Workloads: a 1,000-step RNN `scan` (`h = 0.95 h + 0.05 tanh(x + 1.1 h)`, 4 values), a
300-step chain as define-by-run records it (one node a step: lowered as a loop, and also
as it is, for its compile), bench.workloads' 24-step recurrent cell (unrolled, as a
`scan`, and as a `scan` with its inputs' projection hoisted as the hand-written NumPy
does), GradBench-style lse, llsq and
ode (written as its JAX tool writes them), GradBench's kmeans as its eval asks for it
(`dir`: the gradient over the Hessian's diagonal, both inside one forward program) and
gmm. Then GradBench's particle and saddle, whole evaluations: the client runs GradBench's
gradient descent, and each objective or gradient it asks for is one program run (server
time: their sum). Over HTTP
(`--http`): least squares 1024×128 and logsumexp on 10⁵ against the FastAPI + PyTorch
script a user would write, both started fresh with their defaults, gradserve through its
client (binary bodies) and the script with JSON lists, as each one's user sends them (the
wire is most of that difference, the tier little of it): each workload's first request,
warm, the first after --idle-seconds (60) idle, and warm with bench_hardening's
misbehaving clients beside both servers. On a device
(`--device cuda:0`, or `cpu`): the 24-step cell at batch 64×256 as the service runs it
there, against PyTorch eager on it.

Medians over interleaved rounds; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import asyncio
import gc
import math
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import (
    HOST,
    Conn,
    Gradserve,
    close_all,
    close_to,
    command_line,
    compile_request,
    measure,
    median_ratio,
    time_once,
    trickle,
    watch,
)
from bench.workloads import gmm as gmm_workload
from bench.workloads import ode_graph, recurrent_cell, recurrent_torch, seed_body
from tests.support.server import free_port, serving

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
    unrolled_too: bool = False  # also lowered as it is (roll=False): its compile and run


# ---------------------------------------------------------------- workloads


def rnn_scan(steps: int = 1000, width: int = 4) -> Case:
    rng = np.random.default_rng(0)
    graph = {
        "nodes": [
            {
                "id": "loop",
                "op": "scan",
                "args": ["h0", "xs"],
                "attrs": {"length": steps},
                "body": {
                    "carry": ["h"],
                    "xs": ["x"],
                    "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}],
                    "next": {"h": "h2"},
                },
                "results": {"hT": "h"},
            },
            {"id": "loss", "expr": "sum(hT)"},
        ],
        "outputs": ["loss"],
    }
    inputs = {"h0": rng.standard_normal(width), "xs": rng.standard_normal((steps, width))}

    def f(h0: Any, xs: Any) -> Any:
        def body(h: Any, x: Any) -> tuple[Any, None]:
            return 0.95 * h + 0.05 * jnp.tanh(x + 1.1 * h), None

        return jnp.sum(lax.scan(body, h0, xs)[0])

    return Case(
        f"RNN scan, {steps} steps x {width} f64",
        graph,
        inputs,
        ["h0", "xs"],
        "loss",
        f,
        ["h0", "xs"],
    )


def lse(n: int = 100_000) -> Case:
    """GradBench's lse: logsumexp of a vector, as its JAX tool writes it (max-shifted)."""
    x = np.random.default_rng(1).standard_normal(n)

    def f(x: Any) -> Any:
        m = jnp.max(x)
        return m + jnp.log(jnp.sum(jnp.exp(x - m)))

    graph = {
        "nodes": [{"id": "m", "expr": "max(x)"}, {"id": "out", "expr": "m + log(sum(exp(x - m)))"}],
        "outputs": ["out"],
    }
    return Case(f"GradBench lse, n={n:,}", graph, {"x": x}, ["x"], "out", f, ["x"], gradbench=True)


def llsq(n: int = 1024, m: int = 128) -> Case:
    """GradBench's llsq: fit of sign(t) by a degree-(m-1) polynomial at n points of [-1, 1]:
    0.5 * sum((sign(t) - T @ x)^2), T the points' powers (given, like GradBench's data)."""
    t = -1.0 + 2.0 * np.arange(n) / (n - 1)
    powers = t[:, None] ** np.arange(m)
    x = np.random.default_rng(2).standard_normal(m) / m

    def f(x: Any, T: Any, s: Any) -> Any:
        return 0.5 * jnp.sum((s - T @ x) ** 2)

    graph = {"nodes": [{"id": "out", "expr": "0.5 * sum((s - T @ x) ** 2)"}], "outputs": ["out"]}
    return Case(
        f"GradBench llsq, {n}x{m}",
        graph,
        {"x": x, "T": powers, "s": np.sign(t)},
        ["x"],
        "out",
        f,
        ["x", "T", "s"],
        gradbench=True,
    )


def ode(n: int = 1000, s: int = 100) -> Case:
    """GradBench's ode (bench.workloads.ode_graph: RK4 as a scan)."""
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
    return Case(
        f"GradBench ode, n={n:,}, s={s}",
        ode_graph(n, s),
        {"x": x, "m": m},
        ["x"],
        "out",
        f,
        ["x"],
        gradbench=True,
    )


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

    graph = {
        "nodes": [
            {
                "id": "dist",
                "expr": "unsqueeze(sum(P * P, dim=1), dim=1) + unsqueeze(sum(C * C, "
                "dim=1), dim=0) - 2 * (P @ transpose(C, dim0=0, dim1=1))",
            },
            {"id": "cost", "expr": "sum(min(dist, dim=1))"},
            {"id": "J", "expr": "grad(cost, C)"},
            {"id": "ones", "op": "ones", "attrs": {"shape": [k, d], "dtype": "float64"}},
            {"id": "H", "expr": "jvp(J, C, ones)"},
            {"id": "out", "expr": "J / H"},
        ],
        "outputs": ["out"],
    }

    def closed_form(a: Arrays) -> tuple[np.ndarray, Arrays]:
        """J = 2 sum(c - p) over each centroid's points, H = 2 * their count."""
        P, C = a["P"], a["C"]
        nearest = np.argmin(((P[:, None, :] - C[None, :, :]) ** 2).sum(2), axis=1)
        J = np.zeros_like(C)
        np.add.at(J, nearest, 2 * (C[nearest] - P))
        H = 2 * np.bincount(nearest, minlength=len(C)).astype(C.dtype)
        return J / H[:, None], {}

    return Case(
        f"GradBench kmeans dir, n={n:,}, k={k}, d={d}",
        graph,
        {"P": points, "C": centroids},
        [],
        "out",
        dir,
        ["P", "C"],
        closed_form,
        gradbench=True,
    )


# GradBench's JAX tool's gmm objective (gradbench/tools/jax/gmm_objective.py), as it
# writes it.
def log_wishart_prior(
    *,
    k: int,
    p: int,
    gamma: float,
    m: int,
    sum_qs: Any,
    Qdiags: Any,
    l: Any,  # noqa: E741 (GradBench's name)
) -> Any:
    n = p + m + 1
    out = jnp.sum(
        0.5 * gamma * gamma * (jnp.sum(Qdiags**2, axis=1) + jnp.sum(l**2, axis=1)) - m * sum_qs
    )
    C = n * p * (jnp.log(gamma / math.sqrt(2)))
    return -out + k * (C - multigammaln(0.5 * n, p))


def gmm_objective(
    *,
    d: int,
    k: int,
    n: int,
    x: Any,
    m: int,
    gamma: float,
    alpha: Any,
    mu: Any,
    q: Any,
    l: Any,  # noqa: E741 (GradBench's name)
) -> Any:
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
        + log_wishart_prior(k=k, p=d, gamma=gamma, m=m, sum_qs=sum_qs, Qdiags=Qdiags, l=l)
    )


def gmm(d: int = 10, k: int = 25, n: int = 1000) -> Case:
    """GradBench's gmm: the gradient of the log posterior with respect to alpha, mu and
    the precisions' parameters; bench.workloads' graph (q and l one input, icf, as
    ADBench has them) and GradBench's JAX objective (gamma = 1, m = 0, as there), given
    icf's two parts."""
    w = gmm_workload(d, k, n)

    def f(alphas: Any, means: Any, icf: Any, x: Any) -> Any:
        return gmm_objective(
            d=d, k=k, n=n, x=x, m=0, gamma=1.0, alpha=alphas, mu=means, q=icf[:, :d], l=icf[:, d:]
        )

    return Case(
        f"GradBench gmm, d={d}, k={k}, n={n:,}",
        w.graph,
        w.inputs,
        w.wrt,
        w.output,
        f,
        [*w.wrt, "x"],
        gradbench=True,
    )


def _cell_step(h: Any, a: Any) -> Any:
    return jax.nn.sigmoid(a + 1.0) * h + jax.nn.sigmoid(a) * jnp.tanh(a)


def cell(steps: int = 24, batch: int = 4, width: int = 16) -> Case:
    """bench.workloads' cell as define-by-run records it: `steps` unrolled copies of the
    step, each step's input its own tensor; JAX's contender unrolled alike."""
    w = recurrent_cell(steps, batch, width)

    def f(*args: Any) -> Any:
        xs, (wx, u, b, h) = args[:steps], args[steps:]
        for x in xs:
            h = _cell_step(h, x @ wx + h @ u + b)
        return jnp.sum(h * h)

    return Case(
        w.name, w.graph, w.inputs, w.wrt, w.output, f, numpy=w.numpy, numpy_inputs=w.baseline_inputs
    )


def chain(steps: int = 300, width: int = 8) -> Case:
    """A recurrence as define-by-run records it, one node a step: `h = tanh(h * w + x) *
    0.5`; the tier lowers it as a loop (engine.graph.rolling); JAX's contender unrolled
    alike (a Python loop under jit)."""
    rng = np.random.default_rng(2)
    nodes = [{"id": f"h{i}", "expr": f"tanh(h{i - 1} * w + x) * 0.5"} for i in range(1, steps + 1)]
    graph = {
        "nodes": [*nodes, {"id": "loss", "op": "sum", "args": [f"h{steps}"]}],
        "outputs": ["loss"],
    }
    inputs = {k: rng.standard_normal(width) for k in ("h0", "w", "x")}

    def f(h: Any, w: Any, x: Any) -> Any:
        for _ in range(steps):
            h = jnp.tanh(h * w + x) * 0.5
        return jnp.sum(h)

    return Case(
        f"chain {steps} steps x {width} f64, unrolled",
        graph,
        inputs,
        ["h0", "w", "x"],
        "loss",
        f,
        unrolled_too=True,
    )


def cell_scan(hoisted: bool, batch: int = 4, width: int = 16) -> Case:
    """The same cell written as a loop: a `scan` over its 24 steps (as `trace` records
    `scan`, or a user writes the graph); `hoisted`: the inputs' projection `xs @ w + b` of
    every step in one matmul before the loop, as the hand-written NumPy computes it. JAX's
    contender is the same loop as `lax.scan`."""
    w = recurrent_cell(24, batch, width)
    d = w.baseline_inputs
    steps, batch, width = d["xs"].shape
    step = "sigmoid(a + 1.0) * h + sigmoid(a) * tanh(a)"
    if hoisted:
        before = [
            {
                "id": "p",
                "expr": f"reshape(reshape(xs, shape=[{steps * batch}, {width}])"
                f" @ w, shape=[{steps}, {batch}, {width}]) + b",
            }
        ]
        per_step, a = ["p", "pt"], "pt + h @ u"
    else:
        before, per_step, a = [], ["xs", "x"], "x @ w + h @ u + b"
    graph = {
        "nodes": [
            *before,
            {
                "id": "loop",
                "op": "scan",
                "args": ["h0", per_step[0]],
                "body": {
                    "carry": ["h"],
                    "xs": [per_step[1]],
                    "nodes": [{"id": "a", "expr": a}, {"id": "h2", "expr": step}],
                    "next": {"h": "h2"},
                },
                "results": {"hT": "h"},
            },
            {"id": "loss", "expr": "sum(hT * hT)"},
        ],
        "outputs": ["loss"],
    }
    wrt = ["xs", "w", "u", "b", "h0"]

    def f(xs: Any, wx: Any, u: Any, b: Any, h0: Any) -> Any:
        if hoisted:
            xs = (xs.reshape(-1, width) @ wx).reshape(xs.shape) + b

        def body(h: Any, x: Any) -> tuple[Any, None]:
            return _cell_step(h, x + h @ u if hoisted else x @ wx + h @ u + b), None

        return jnp.sum(lax.scan(body, h0, xs)[0] ** 2)

    how = "a scan, input projection hoisted" if hoisted else "a scan"
    return Case(f"{w.name}, as {how}", graph, d, wrt, "loss", f, numpy=w.numpy)


# ---------------------------------------------------------------- running


def compile_program(c: Case, device: str = "cpu") -> Any:
    return compile_request(c.graph, c.inputs, c.wrt, device)


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


def assert_agree(a: Any, b: Any, what: str) -> None:
    """Equal to summation order (bench.harness' check): 1e-9 of the tensor's scale in
    float64, 1e-5 in float32 (XLA sums and multiplies in its own order)."""
    a, b = np.asarray(a), np.asarray(b)
    close_to(a, b, 1e-5 if np.float32 in (a.dtype, b.dtype) else 1e-9, what)


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
    if lowered is not None and c.unrolled_too:
        t = time.perf_counter()
        plain = xla.lower(program, roll=False)
        plain_ms = (time.perf_counter() - t) * 1e3
        fns["xla unrolled"] = lambda: plain.run(c.inputs)
        how = "rolled" if lowered.rolled else "not rolled"
        note = f"{how}; lowered as it is: compile {plain_ms:.0f} ms"
    if lowered is not None:
        r = lowered.run(c.inputs)
        assert_agree(r.outputs[c.output], value[c.output], f"{c.name}: xla value")
        for k in c.wrt:
            assert_agree(r.gradients[k], grads[k], f"{c.name}: xla gradient {k}")
        fns["xla"] = lambda: lowered.run(c.inputs)
    if c.jax_fn is not None and jax is not None:
        order = c.order or c.wrt
        jitted = jax.jit(
            jax.value_and_grad(c.jax_fn, argnums=tuple(range(len(c.wrt)))) if c.wrt else c.jax_fn
        )
        args = [c.inputs[k] for k in order]
        t = time.perf_counter()
        v, g = (
            jax.block_until_ready(jitted(*args))
            if c.wrt
            else (jax.block_until_ready(jitted(*args)), ())
        )
        compile_ms["jax"] = (time.perf_counter() - t) * 1e3
        assert_agree(v, value[c.output], f"{c.name}: jax value")
        for k, gk in zip(c.wrt, g, strict=True):
            assert_agree(gk, grads[k], f"{c.name}: jax gradient {k}")
        fns["jax"] = lambda: jax.block_until_ready(jitted(*args))
    if c.numpy is not None:
        v, g = c.numpy(c.numpy_inputs or c.inputs)
        assert_agree(v, value[c.output], f"{c.name}: numpy value")
        for k in c.wrt if g.keys() == set(c.wrt) else ():  # (else its inputs are others)
            assert_agree(g[k], grads[k], f"{c.name}: numpy gradient {k}")
        fns["numpy"] = lambda: c.numpy(c.numpy_inputs or c.inputs)
    samples = measure(fns, rounds, budget_s)
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    if "xla unrolled" in ms:
        note += f", run {ms['xla unrolled']:.3g} ms (the tier's, rolled: {ms['xla']:.3g} ms)"
    # As the service decides (service/tier.py): the lowered program while it is faster.
    served = "xla" if "xla" in ms and ms["xla"] < ms["interp"] else "interp"
    return Row(
        c.name,
        ms,
        {f"xla/{b}": median_ratio(samples, "xla", b) for b in ("interp", "jax", "numpy")},
        compile_ms,
        note,
        c.gradbench,
        served,
        median_ratio(samples, served, "jax"),
    )


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    cols = ["interp", "xla", "jax", "numpy"]
    print(
        "| workload | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | xla/interp | xla/jax | xla/numpy | xla compile ms | jax compile ms |"
    )
    print("|" + " --- |" * (len(cols) + 6))
    for r in rows:
        print(
            f"| {r.name} | "
            + " | ".join(_f(r.ms.get(c)) for c in cols)
            + " | "
            + " | ".join(_f(r.ratios[k]) for k in ("xla/interp", "xla/jax", "xla/numpy"))
            + f" | {_f(r.compile_ms.get('xla'))} | {_f(r.compile_ms.get('jax'))} |"
        )
    for r in rows:
        if r.note:
            print(f"- {r.name}: {r.note}")
    target = [r for r in rows if r.gradbench and r.served_jax is not None]
    if target:
        print(
            "\nGradBench evaluations, what the service runs (XLA when lowered and faster "
            "than the interpreter) against JAX (target: geometric mean <= 1.5x):"
        )
        for r in target:
            print(f"- {r.name}: {r.served}, {r.served_jax:.2f}x JAX")
        mean = math.exp(statistics.fmean(math.log(r.served_jax) for r in target))
        print(f"- geometric mean: {mean:.2f}x JAX")


# ---------------------------------------------------------------- GradBench's particle, saddle

# Both come from GradBench (github.com/gradbench/gradbench: evals/particle, evals/saddle,
# cpp/gradbench/gd.hpp), which took them from Pearlmutter and Siskind, "Using Programming
# Language Theory to Make Automatic Differentiation Sound and Efficient" (2008). An
# evaluation is a whole gradient descent whose objective itself holds a derivative (the
# `rr` variant: reverse mode outside and inside). The descent is the client's, as a
# GradBench tool for a service would run it: each objective or gradient it asks for is one
# program run, and the server time is the sum of those runs.

PARTICLE_W = 0.2071918746486116  # GradBench's answer from w = 0 (every variant)
SADDLE_XY = 8.246324826140356e-06  # its answer from (1, 1): each of x1, x2, y1, y2
MAX_BOUND = 1 << 16  # a loop still unfinished at this bound is an error, not a slower run


def multivariate_argmin(
    objective: Callable[[np.ndarray], float],
    gradient: Callable[[np.ndarray], np.ndarray],
    start: np.ndarray,
) -> np.ndarray:
    """GradBench's gradient descent (gd.hpp's multivariate_argmin), branch for branch: eta
    starts at 1e-5, doubles after 10 accepted steps in a row and halves (the count reset)
    at a step that would not lower the objective; it stops when the gradient's magnitude
    or a step's length is at most 1e-5."""
    x = np.array(start, dtype=np.float64)
    fx, gx = objective(x), gradient(x)
    i, eta = 0, 1e-5
    while True:
        if _magnitude(gx) <= 1e-5:
            return x
        if i == 10:
            eta, i = eta * 2, 0
            continue
        x_prime = x - eta * gx
        if _magnitude(x - x_prime) <= 1e-5:
            return x
        fx_prime = objective(x_prime)
        if fx_prime < fx:
            x, fx, gx, i = x_prime, fx_prime, gradient(x_prime), i + 1
        else:
            eta, i = eta / 2, 0


def _magnitude(v: np.ndarray) -> float:
    acc = 0.0
    for e in v.tolist():  # (gd.hpp's order: the squares summed one by one)
        acc += e * e
    return math.sqrt(acc)


def particle_graph(bound: int) -> Graph:
    """Particle's objective of w: a unit charge from x = (0, 8), v = (0.75, 0) takes Euler
    steps (dt = 0.1) in the field of unit charges at (10, 10 - w) and (10, 0), the force
    -∇ₓp a `grad` in the loop's body, until the next position's x₂ would be negative (that
    step not taken); then x₁ where the path meets x₂ = 0, squared. The loop runs `bound`
    steps, frozen (`where`) once finished, and `finished` says whether it did."""
    x2 = "squeeze(slice(xn, dim=0, start=1, stop=2), dim=0)"
    return {
        "nodes": [
            {"id": "at", "expr": "charges - by_w * w"},  # rows: (10, 10 - w), (10, 0)
            {
                "id": "euler",
                "op": "scan",
                "args": ["x0", "v0", False],
                "attrs": {"length": bound},
                "body": {
                    "carry": ["x", "v", "done"],
                    "xs": [],
                    "nodes": [
                        {"id": "d", "expr": "x - at"},
                        {"id": "p", "expr": "sum(1.0 / sqrt(sum(d * d, dim=1)))"},
                        {"id": "xn", "expr": "x + 0.1 * v"},
                        {"id": "vn", "expr": "v + 0.1 * -grad(p, x)"},
                        {"id": "stop", "expr": f"where(done, True, {x2} < 0.0)"},
                        {"id": "x_next", "expr": "where(stop, x, xn)"},
                        {"id": "v_next", "expr": "where(stop, v, vn)"},
                    ],
                    "next": {"x": "x_next", "v": "v_next", "done": "stop"},
                },
                "results": {"x_end": "x", "v_end": "v", "finished": "done"},
            },
            {
                "id": "dt_final",
                "expr": "-slice(x_end, dim=0, start=1, stop=2) "
                "/ slice(v_end, dim=0, start=1, stop=2)",
            },
            {"id": "x_final", "expr": "slice(x_end + dt_final * v_end, dim=0, start=0, stop=1)"},
            {"id": "out", "expr": "sum(x_final * x_final)"},
        ],
        "outputs": ["out", "finished"],
    }


def particle_jax(bound: int) -> Callable[[Arrays], tuple[Any, dict[str, Any]]]:
    """particle_graph's objective for JAX, step for step (the loop a masked `lax.scan`:
    JAX differentiates no `while_loop` in reverse)."""

    def f(a: Arrays) -> tuple[Any, dict[str, Any]]:
        at = a["charges"] - a["by_w"] * a["w"]

        def p(x: Any) -> Any:
            d = x - at
            return jnp.sum(1.0 / jnp.sqrt(jnp.sum(d * d, axis=1)))

        def step(carry: Any, _: Any) -> tuple[Any, None]:
            x, v, done = carry
            xn = x + 0.1 * v
            vn = v + 0.1 * -jax.grad(p)(x)
            stop = done | (xn[1] < 0.0)
            return (jnp.where(stop, x, xn), jnp.where(stop, v, vn), stop), None

        x, v, done = lax.scan(step, (a["x0"], a["v0"], False), None, length=bound)[0]
        x_final = x[0] + -x[1] / v[1] * v[0]
        return x_final * x_final, {"finished": done}

    return f


def saddle_graph(bound: int) -> Graph:
    """Saddle's objective of x: the max over y of f(x, y) = (x₁² + x₂²) - (y₁² + y₂²), by
    gd.hpp's multivariate_argmax from `start` (its argmin of -f, the gradient -∇ᵧf a `grad`
    in the loop's body): one turn of its while loop per step of a loop of `bound` steps,
    frozen once finished. Outputs f(x, y*), `finished` and y*. In the gradient program, y*
    depends on x only through comparisons, so gradserve's backward never enters the loop:
    it gives ∂f/∂x at y*, as GradBench's C++ tools compute it."""
    return {
        "nodes": [
            {"id": "fx", "expr": "sum(x * x)"},
            {"id": "f0", "expr": "fx - sum(start * start)"},
            {"id": "h0", "expr": "-f0"},
            {"id": "g0", "expr": "-grad(f0, start)"},
            {
                "id": "argmax",
                "op": "scan",
                "args": ["start", "h0", "g0", 0, "eta0", False],
                "attrs": {"length": bound},
                "body": {
                    "carry": ["y", "h", "g", "i", "eta", "done"],
                    "xs": [],
                    "nodes": [
                        # gd.hpp's branches, in its order: converged, eta doubled, a step too short
                        # (converged), a step taken, eta halved
                        {"id": "idle", "expr": "where(done, True, sqrt(sum(g * g)) <= 1e-5)"},
                        {"id": "doubling", "expr": "i == 10"},
                        {"id": "yp", "expr": "y - eta * g"},
                        {"id": "short", "expr": "sqrt(sum((y - yp) * (y - yp))) <= 1e-5"},
                        {"id": "fp", "expr": "fx - sum(yp * yp)"},
                        {"id": "better", "expr": "-fp < h"},
                        {
                            "id": "take",
                            "expr": "where(idle, False, where(doubling, False, "
                            "where(short, False, better)))",
                        },
                        {"id": "y_next", "expr": "where(take, yp, y)"},
                        {"id": "h_next", "expr": "where(take, -fp, h)"},
                        {"id": "g_next", "expr": "where(take, -grad(fp, yp), g)"},
                        {
                            "id": "i_next",
                            "expr": "where(idle, i, where(doubling, 0, "
                            "where(short, i, where(better, i + 1, 0))))",
                        },
                        {
                            "id": "eta_next",
                            "expr": "where(idle, eta, where(doubling, 2.0 * eta, "
                            "where(short, eta, where(better, eta, eta / 2.0))))",
                        },
                        {
                            "id": "done_next",
                            "expr": "where(idle, True, where(doubling, False, short))",
                        },
                    ],
                    "next": {
                        "y": "y_next",
                        "h": "h_next",
                        "g": "g_next",
                        "i": "i_next",
                        "eta": "eta_next",
                        "done": "done_next",
                    },
                },
                "results": {"y_star": "y", "finished": "done"},
            },
            {"id": "out", "expr": "fx - sum(y_star * y_star)"},
        ],
        "outputs": ["out", "finished", "y_star"],
    }


def saddle_jax(bound: int) -> Callable[[Arrays], tuple[Any, dict[str, Any]]]:
    """saddle_graph's objective for JAX, step for step."""

    def f(a: Arrays) -> tuple[Any, dict[str, Any]]:
        fx = jnp.sum(a["x"] * a["x"])

        def fxy(y: Any) -> Any:
            return fx - jnp.sum(y * y)

        def step(carry: Any, _: Any) -> tuple[Any, None]:
            y, h, g, i, eta, done = carry
            idle = done | (jnp.sqrt(jnp.sum(g * g)) <= 1e-5)
            doubling = i == 10
            yp = y - eta * g
            short = jnp.sqrt(jnp.sum((y - yp) * (y - yp))) <= 1e-5
            fp = fxy(yp)
            better = -fp < h
            take = ~idle & ~doubling & ~short & better
            i = jnp.where(
                idle, i, jnp.where(doubling, 0, jnp.where(short, i, jnp.where(better, i + 1, 0)))
            )
            eta = jnp.where(
                idle,
                eta,
                jnp.where(
                    doubling, 2.0 * eta, jnp.where(short, eta, jnp.where(better, eta, eta / 2.0))
                ),
            )
            done = idle | (~doubling & short)
            return (
                jnp.where(take, yp, y),
                jnp.where(take, -fp, h),
                jnp.where(take, -jax.grad(fxy)(yp), g),
                i,
                eta,
                done,
            ), None

        start = a["start"]
        init = (start, -fxy(start), -jax.grad(fxy)(start), jnp.int64(0), a["eta0"], False)
        y, *_, done = lax.scan(step, init, None, length=bound)[0]
        return fx - jnp.sum(y * y), {"finished": done, "y_star": y}

    return f


def _solve_particle(server: Server) -> np.ndarray:
    return multivariate_argmin(server.objective, server.gradient, np.zeros(1))


def _solve_saddle(server: Server) -> np.ndarray:
    x = multivariate_argmin(server.objective, server.gradient, np.ones(2))
    # The argmax of f(x*, y) from the same start (GradBench's second step, by the same
    # routine as the nested one) is the objective's own inner loop at x*: one more run.
    return np.concatenate([x, server.outputs(x)["y_star"]])


@dataclass(eq=False)
class Evaluation:
    """One GradBench eval: its objective's graph (by loop bound), the program's inputs
    besides the solver's point, the client's solver, the same objective for JAX, and
    GradBench's answer."""

    name: str
    graph: Callable[[int], Graph]
    point: str  # the input the solver moves (requires grad)
    start: np.ndarray
    inputs: Arrays  # the others
    solve: Callable[[Server], np.ndarray]
    jax_fn: Callable[[int], Callable[[Arrays], tuple[Any, dict[str, Any]]]]
    expected: np.ndarray
    bound: int  # the loop's first bound (doubled while too short)


def particle(bound: int = 128) -> Evaluation:
    return Evaluation(
        "GradBench particle (rr), w from 0",
        particle_graph,
        "w",
        np.zeros(1),
        {
            "charges": np.array([[10.0, 10.0], [10.0, 0.0]]),
            "by_w": np.array([[0.0, 1.0], [0.0, 0.0]]),
            "x0": np.array([0.0, 8.0]),
            "v0": np.array([0.75, 0.0]),
        },
        _solve_particle,
        particle_jax,
        np.array([PARTICLE_W]),
        bound,
    )


def saddle(bound: int = 128) -> Evaluation:
    return Evaluation(
        "GradBench saddle (rr), from (1, 1)",
        saddle_graph,
        "x",
        np.ones(2),
        {"start": np.ones(2), "eta0": np.array(1e-5)},
        _solve_saddle,
        saddle_jax,
        np.full(4, SADDLE_XY),
        bound,
    )


Run = Callable[[Arrays], tuple[Arrays, Arrays]]  # inputs -> (outputs, gradients)
Build = Callable[[Evaluation, int, bool], Run]  # (eval, loop bound, gradient?) -> its run


class Server:
    """One contender serving one eval: per loop bound an objective program (forward only)
    and a gradient one (value and gradient), built on first use; every run timed (the
    server time) and counted. A run whose loop did not finish within its bound is run
    again with the bound doubled, its programs built anew: never a truncated loop's value."""

    def __init__(self, ev: Evaluation, build: Build) -> None:
        self.ev, self._build, self.bound = ev, build, ev.bound
        self._runs: dict[tuple[int, bool], Run] = {}
        self.seconds, self.runs, self.build_seconds = 0.0, 0, 0.0

    def objective(self, point: np.ndarray) -> float:
        return float(self.outputs(point)["out"])

    def outputs(self, point: np.ndarray) -> Arrays:
        return self._run(point, False)[0]

    def gradient(self, point: np.ndarray) -> np.ndarray:
        return np.asarray(self._run(point, True)[1][self.ev.point])

    def evaluate(self) -> tuple[np.ndarray, float, int]:
        """(GradBench's output, server seconds, program runs) of one whole evaluation."""
        seconds, runs = self.seconds, self.runs
        result = self.ev.solve(self)
        return result, self.seconds - seconds, self.runs - runs

    def _run(self, point: np.ndarray, gradient: bool) -> tuple[Arrays, Arrays]:
        inputs = {**self.ev.inputs, self.ev.point: point}
        while True:
            run = self._runs.get((self.bound, gradient))
            if run is None:
                t = time.perf_counter()
                run = self._runs[self.bound, gradient] = self._build(self.ev, self.bound, gradient)
                self.build_seconds += time.perf_counter() - t
            t = time.perf_counter()
            outputs, gradients = run(inputs)
            self.seconds += time.perf_counter() - t
            self.runs += 1
            if outputs["finished"]:
                return outputs, gradients
            if self.bound >= MAX_BOUND:
                raise RuntimeError(
                    f"{self.ev.name}: the loop is unfinished after {self.bound} "
                    f"steps at {self.ev.point} = {point}"
                )
            self.bound *= 2


def compile_eval(ev: Evaluation, bound: int, gradient: bool) -> Any:
    """The objective's program (forward only), or the gradient's (the same graph, `out`
    differentiated: its other outputs need no gradient), as the service compiles them."""
    return compile_request(
        ev.graph(bound), {**ev.inputs, ev.point: ev.start}, [ev.point] if gradient else []
    )


def interpreted(gs: Gradserve) -> Build:
    def build(ev: Evaluation, bound: int, gradient: bool) -> Run:
        program = compile_eval(ev, bound, gradient)
        return lambda inputs: gs.run(program, inputs)[:2]

    return build


def lowered(ev: Evaluation, bound: int, gradient: bool) -> Run:
    from gradserve.engine.graph import xla

    program = xla.lower(compile_eval(ev, bound, gradient))

    def run(inputs: Arrays) -> tuple[Arrays, Arrays]:
        r = program.run(inputs)
        return r.outputs, r.gradients or {}

    return run


def jax_built(ev: Evaluation, bound: int, gradient: bool) -> Run:
    """JAX's own: `jax.jit` of the objective, or of its `jax.value_and_grad`, compiled
    ahead (not at the first run) and waited for."""
    f = ev.jax_fn(bound)
    example = {**ev.inputs, ev.point: ev.start}
    if not gradient:
        objective = jax.jit(f).lower(example).compile()

        def run(inputs: Arrays) -> tuple[Arrays, Arrays]:
            out, aux = jax.block_until_ready(objective(inputs))
            return {"out": out, **aux}, {}

        return run

    def of_point(p: Any, rest: Arrays) -> tuple[Any, dict[str, Any]]:
        return f({**rest, ev.point: p})

    both = (
        jax.jit(jax.value_and_grad(of_point, has_aux=True))
        .lower(ev.start, dict(ev.inputs))
        .compile()
    )

    def run_both(inputs: Arrays) -> tuple[Arrays, Arrays]:
        rest = {k: a for k, a in inputs.items() if k != ev.point}
        (out, aux), g = jax.block_until_ready(both(inputs[ev.point], rest))
        return {"out": out, **aux}, {ev.point: g}

    return run_both


@dataclass
class EvalRow:
    name: str
    ms: dict[str, float]  # contender -> median server ms of a whole evaluation
    ratios: dict[str, float | None]  # "xla/interp", "xla/jax"
    runs: int  # program runs per evaluation
    bound: int  # the loop bound it settled on
    compile_ms: dict[str, float]  # every program the contender built, summed
    note: str = ""


def bench_eval(ev: Evaluation, gs: Gradserve, rounds: int) -> EvalRow:
    """Each contender's first evaluation settles the loop bound and is checked against
    GradBench's answer (1e-9, relative, for every number); then `rounds` interleaved rounds
    of whole evaluations, each timed as the sum of its program runs."""
    from gradserve.engine.graph import xla

    builds: dict[str, Build] = {"interp": interpreted(gs), "xla": lowered}
    if jax is not None:
        builds["jax"] = jax_built
    servers = {k: Server(ev, b) for k, b in builds.items()}
    note = ""
    for k, server in list(servers.items()):
        try:
            result = server.evaluate()[0]
        except xla.NotLowerable as e:
            del servers[k]
            note = f"stays interpreted: {e}"
            continue
        np.testing.assert_allclose(
            result, ev.expected, rtol=1e-9, atol=0, err_msg=f"{ev.name}: {k}'s output"
        )
    samples: dict[str, list[float]] = {k: [] for k in servers}
    runs: set[tuple[str, int]] = set()
    for _ in range(rounds):
        gc.collect()
        for k, server in servers.items():
            _, seconds, n = server.evaluate()
            samples[k].append(seconds)
            runs.add((k, n))
    if len({n for _, n in runs}) != 1:  # (the same descent, step for step, in every tier)
        note += f" program runs differ: {sorted(runs)}"
    return EvalRow(
        ev.name,
        {k: statistics.median(v) * 1e3 for k, v in samples.items()},
        {f"xla/{b}": median_ratio(samples, "xla", b) for b in ("interp", "jax")},
        max(n for _, n in runs),
        servers["interp"].bound,
        {k: s.build_seconds * 1e3 for k, s in servers.items()},
        note.strip(),
    )


def print_evals(rows: list[EvalRow], header: str) -> None:
    print(header)
    cols = ["interp", "xla", "jax"]
    print(
        "| evaluation | " + " | ".join(f"{c} ms" for c in cols) + " | program runs | loop bound"
        " | xla/interp | xla/jax | interp compile ms | xla compile ms | jax compile ms |"
    )
    print("|" + " --- |" * (len(cols) + 8))
    for r in rows:
        print(
            f"| {r.name} | "
            + " | ".join(_f(r.ms.get(c)) for c in cols)
            + f" | {r.runs} | {r.bound} | "
            + " | ".join(_f(r.ratios[k]) for k in ("xla/interp", "xla/jax"))
            + " | "
            + " | ".join(_f(r.compile_ms.get(c)) for c in cols)
            + " |"
        )
    for r in rows:
        if r.note:
            print(f"- {r.name}: {r.note}")


# ---------------------------------------------------------------- on a device


def device_rows(device: str, rounds: int, budget_s: float) -> list[tuple[str, str, float, float]]:
    """The issue's GPU row, ready for a GPU: the 24-step cell at batch 64×256 (float32),
    forward and backward, as the service runs it on `device` (lowered for it, or by the
    interpreter there when XLA's memory is over the plan), against PyTorch eager on it;
    each answer's value and gradients copied to the host, as a service returns them. Runs
    on "cpu" too (how it is tested where there is no GPU).
    (name, what gradserve ran, gradserve ms, torch ms)."""
    import torch

    from gradserve.engine.backends import get_backend
    from gradserve.engine.graph import execute, xla

    target = torch.device(device)  # ("cpu", "cuda:N": gradserve's names are PyTorch's)
    backend = get_backend(device)
    rows = []
    for c in (cell(24, 64, 256), cell_scan(False, 64, 256), cell_scan(True, 64, 256)):
        program = compile_program(c, device)
        try:
            lowered = xla.lower(program, device)
            tier = "xla"

            def via_gradserve(lowered: Any = lowered, c: Case = c) -> tuple[Any, Any]:
                r = lowered.run(c.inputs)
                return r.outputs, r.gradients
        except xla.NotLowerable as refused:
            tier = f"interpreter ({refused.reason})"

            def via_gradserve(program: Any = program, c: Case = c) -> tuple[Any, Any]:
                r = execute(program, {k: backend.from_host(a) for k, a in c.inputs.items()})
                return (
                    {k: backend.to_host(v) for k, v in r.outputs.items()},
                    {k: backend.to_host(v) for k, v in (r.gradients or {}).items()},
                )

        base = c.numpy_inputs or c.inputs
        tensors = {k: torch.from_numpy(a).to(target) for k, a in base.items()}

        def via_torch(tensors: dict[str, Any] = tensors) -> tuple[Any, dict[str, Any]]:
            t = {k: v.detach().requires_grad_(True) for k, v in tensors.items()}
            loss = recurrent_torch(t)
            loss.backward()
            return loss.detach().cpu().numpy(), {k: v.grad.cpu().numpy() for k, v in t.items()}  # type: ignore[union-attr]

        (outputs, gradients), (value, grads) = via_gradserve(), via_torch()
        assert_agree(outputs[c.output], value, f"{c.name} on {device}: value")
        for k in grads.keys() & gradients.keys():  # (the unrolled cell's xs are 24 inputs)
            assert_agree(gradients[k], grads[k], f"{c.name} on {device}: gradient {k}")
        samples = measure({"gradserve": via_gradserve, "torch": via_torch}, rounds, budget_s)
        rows.append(
            (
                c.name,
                tier,
                statistics.median(samples["gradserve"]) * 1e3,
                statistics.median(samples["torch"]) * 1e3,
            )
        )
    return rows


def print_device(rows: list[tuple[str, str, float, float]], device: str, rounds: int) -> None:
    print(
        f"\non {device}: gradserve as the service runs it against PyTorch eager, results to "
        f"the host; medians of {rounds} interleaved rounds (target on a GPU: <= 0.5x torch)"
    )
    print("| workload | gradserve's tier | gradserve ms | PyTorch eager ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for name, tier, gs_ms, torch_ms in rows:
        print(f"| {name} | {tier} | {gs_ms:.3g} | {torch_ms:.3g} | {gs_ms / torch_ms:.2f} |")


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


@contextmanager
def misbehaving(ports: list[int], idle: int = 200, slow: int = 20) -> Iterator[None]:
    """bench_hardening's misbehaving clients beside each server on `ports`, while the body
    runs: `idle` connections that never send, and `slow` ones trickling a request at a
    byte a second (in a thread of their own, on their own event loop)."""
    import orjson

    body = orjson.dumps(seed_body(2.0, 3.0, "expr"))
    request = (
        b"POST /backward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    loop = asyncio.new_event_loop()
    conns: list[Conn] = []
    tasks: list[asyncio.Task[Any]] = []

    async def open_all() -> None:
        for port in ports:
            for kind, n in (("idle", idle), ("slow", slow)):
                for _ in range(n):
                    with suppress(OSError, TimeoutError):
                        reader, writer = await asyncio.wait_for(
                            asyncio.open_connection(HOST, port), 10
                        )
                        conn = Conn(kind, writer)
                        conns.append(conn)
                        tasks.append(asyncio.create_task(watch(conn, reader)))
                        if kind == "slow":
                            tasks.append(
                                asyncio.create_task(trickle(conn, request, time.monotonic() + 600))
                            )

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(open_all(), loop).result(timeout=120)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(close_all(conns, tasks), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


HttpRow = tuple[str, str, float, float, str]  # workload, phase, gradserve ms, torch ms, tier


def http_rows(rounds: int, requests: int, quick: bool, idle_s: float) -> list[HttpRow]:
    """Each workload's requests to two servers started fresh for this run, each with its
    defaults: gradserve through its client (binary bodies), the FastAPI + PyTorch script
    through httpx with JSON lists, as each one's user sends them. Per workload: its first
    request (a program new to the server: gradserve compiles it), warm (medians of
    `rounds` rounds of `requests`, after gradserve's tier-up), its first request after
    `idle_s` idle, and warm again with bench_hardening's misbehaving clients beside both
    servers (200 idle connections and 20 slow senders each)."""
    import tempfile

    import httpx
    import orjson

    from gradserve import Client

    app_dir = Path(tempfile.mkdtemp(prefix="gradserve-xla-bench-"))
    (app_dir / "torch_app.py").write_text(TORCH_APP)
    cases = [llsq(*((256, 32) if quick else (1024, 128))), lse(10_000 if quick else 100_000)]
    gs_port, torch_port = free_port(), free_port()
    gs_argv = [
        sys.executable,
        "-m",
        "gradserve.service.cli",
        "serve",
        "--port",
        str(gs_port),
        "--log-level",
        "warning",
    ]
    torch_argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "torch_app:app",
        "--port",
        str(torch_port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--app-dir",
        str(app_dir),
    ]
    rows: list[HttpRow] = []
    with (
        serving(gs_argv, port=gs_port, ready="/") as gs_server,
        serving(torch_argv, port=torch_port, ready="/") as peer,
        Client(gs_server.base, timeout=60) as gs,
        httpx.Client(timeout=60) as http,
    ):
        contenders = []
        for c in cases:
            path = "/llsq" if "llsq" in c.name else "/lse"
            body = orjson.dumps(
                {k: a.tolist() for k, a in c.inputs.items()}, option=orjson.OPT_SERIALIZE_NUMPY
            )

            def via_gradserve(c: Case = c) -> Any:
                return gs.backward(c.graph, c.inputs, requires_grad=c.wrt)

            def via_torch(path: str = path, body: bytes = body) -> Any:
                r = http.post(
                    peer.base + path, content=body, headers={"Content-Type": "application/json"}
                )
                r.raise_for_status()
                return r.json()

            contenders.append((c, via_gradserve, via_torch))

        def tier() -> str:  # (the tier keeps a program only where it is faster)
            meta = via_gradserve().meta
            return meta.get("tier", "?") + (
                f" ({meta['tier_reason']})" if meta.get("tier_reason") else ""
            )

        def warm(phase: str) -> None:
            for c, via_gradserve, via_torch in contenders:
                samples: dict[str, list[float]] = {"gradserve": [], "torch": []}
                for _ in range(rounds):
                    for name, fn in (("gradserve", via_gradserve), ("torch", via_torch)):
                        samples[name].append(
                            statistics.median(time_once(fn) for _ in range(requests))
                        )
                rows.append(
                    (
                        c.name,
                        phase,
                        statistics.median(samples["gradserve"]) * 1e3,
                        statistics.median(samples["torch"]) * 1e3,
                        tier(),
                    )
                )

        for c, via_gradserve, via_torch in contenders:
            rows.append(
                (
                    c.name,
                    "first request",
                    time_once(via_gradserve) * 1e3,
                    time_once(via_torch) * 1e3,
                    "interpreter (cold)",
                )
            )
            # Until the program has tiered up (bounded), and both agree with each other.
            deadline = time.monotonic() + 60
            r = via_gradserve()
            while r.meta.get("tier") != "xla" and time.monotonic() < deadline:
                time.sleep(0.05)
                r = via_gradserve()
            t = via_torch()
            assert_agree(r.outputs[c.output], t["out"], f"{c.name}: over HTTP")
            assert_agree(r.gradients["x"], np.array(t["x"]), f"{c.name}: gradient over HTTP")
        warm("warm")
        time.sleep(idle_s)
        for c, via_gradserve, via_torch in contenders:
            gs_ms, torch_ms = time_once(via_gradserve) * 1e3, time_once(via_torch) * 1e3
            rows.append((c.name, f"first after {idle_s:.0f} s idle", gs_ms, torch_ms, tier()))
        with misbehaving([gs_port, torch_port]):
            warm("warm, misbehaving clients beside")
    return rows


def print_http(rows: list[HttpRow], rounds: int) -> None:
    print(
        f"\nover HTTP, one request at a time, two servers started fresh with their defaults; "
        f"warm: medians of {rounds} rounds (target: gradserve <= 0.7x the FastAPI + PyTorch "
        f"script)"
    )
    print("| workload | when | gradserve ms | FastAPI+PyTorch ms | ratio | gradserve's tier |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, phase, gs_ms, torch_ms, tier in rows:
        print(
            f"| {name} | {phase} | {gs_ms:.3g} | {torch_ms:.3g} | {gs_ms / torch_ms:.2f} | {tier} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="")
    parser.add_argument("--http", action="store_true", help="also the HTTP comparison")
    parser.add_argument(
        "--device",
        default=None,
        help="also the cell at 64x256 on this device (cuda:0, or cpu) against PyTorch eager on it",
    )
    parser.add_argument("--requests", type=int, default=20, help="per round, over HTTP")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=60.0,
        help="over HTTP: the pause before the first request after idle",
    )
    args = parser.parse_args(argv)
    if jax is None:
        raise SystemExit("JAX is needed (pip install -e '.[test]' or '.[xla]')")
    if args.smoke:  # the quick sizes, one round, and the HTTP part briefly
        args.quick, args.rounds, args.http, args.requests, args.idle_seconds = True, 1, True, 2, 0.5
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    budget = 0.02 if quick else 0.15
    gs = Gradserve()
    cases = [
        rnn_scan(100 if quick else 1000),
        chain(50 if quick else 300),
        cell(),
        cell_scan(False),
        cell_scan(True),
        lse(10_000 if quick else 100_000),
        llsq(*((256, 32) if quick else (1024, 128))),
        kmeans(*((100, 10, 4) if quick else (1000, 100, 8))),
        gmm(*((4, 5, 100) if quick else (10, 25, 1000))),
        ode(*((100, 10) if quick else (1000, 100))),
    ]
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    rows = []
    for c in cases:
        if args.only in c.name:
            t = time.perf_counter()
            rows.append(bench_case(c, gs, rounds, budget))
            print(f"  {c.name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    print_table(
        rows,
        f"\nthe native tier in process: medians of {rounds} interleaved rounds; "
        f"JAX {jax.__version__} on {jax.devices()[0].platform}, "
        f"{platform.python_version()}, NumPy {np.__version__}; "
        f"{time.perf_counter() - started:.0f} s{'; --quick' if quick else ''}",
    )
    evals = [e for e in (particle(), saddle()) if args.only in e.name]
    if evals:
        started = time.perf_counter()
        eval_rows = []
        for e in evals:
            t = time.perf_counter()
            eval_rows.append(bench_eval(e, gs, rounds))
            print(f"  {e.name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        print_evals(
            eval_rows,
            f"\nGradBench's particle and saddle, whole evaluations (the "
            f"client's descent, each objective or gradient one program run): "
            f"server ms, medians of {rounds} interleaved rounds (target: "
            f"xla/interp <= 0.05); compile ms: every program built, "
            f"too-short bounds' included; "
            f"{time.perf_counter() - started:.0f} s",
        )
    if args.device:
        print_device(device_rows(args.device, rounds, budget), args.device, rounds)
    if args.http:
        print_http(http_rows(rounds, args.requests, quick, args.idle_seconds), rounds)


if __name__ == "__main__":
    main()
