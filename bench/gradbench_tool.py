"""A GradBench tool that answers with gradserve: it speaks GradBench's protocol (one JSON
message a line on stdin, one answer a line on stdout: start, define, evaluate) and sends
each run of an evaluation to `gradserve serve` as one HTTP request: the eval's inputs as a
gradserve graph and JSON tensors, the answer's outputs or gradients back as GradBench's
output. Each run's timings: `evaluate`, the program's run (forward and backward, as its
answer's meta.timings_ms says), as GradBench's tools time their function alone (their
inputs' conversion outside it); `prepare`, the server's parse, decode and program lookup
or compile before it (meta's `plan`); and `http`, the request's round trip on loopback
(the tensors' JSON both ways included).

    python3 -m bench.gradbench_tool --url http://127.0.0.1:8000

It runs under GradBench's own intermediary (`gradbench run --eval ... --tool "python3 -m
bench.gradbench_tool --url ..."`) or bench.bench_gradbench's relay. Modules: lse, llsq,
kmeans, gmm, ode, det."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson

from bench.harness import RawClient

JSON = [("Content-Type", "application/json")]


@dataclass(frozen=True)
class Call:
    """One evaluation as gradserve requests it: the path, the body, and the answer's parts
    that make GradBench's output."""

    path: str  # "/forward" or "/backward"
    body: bytes
    output: Callable[[dict[str, Any]], Any]


def _tensor(data: Any, requires_grad: bool = False) -> dict[str, Any]:
    return {"data": data, "dtype": "float64", "requires_grad": requires_grad}


def _value(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda answer: answer["outputs"][name]["data"]


def _gradient(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda answer: answer["gradients"][name]["data"]


def _call(
    graph: dict[str, Any], inputs: dict[str, Any], out: Callable[..., Any], grad: bool
) -> Call:
    body = orjson.dumps({"graph": graph, "inputs": inputs})
    return Call("/backward" if grad else "/forward", body, out)


def lse(function: str, input: dict[str, Any]) -> Call:
    graph = {"nodes": [{"id": "out", "expr": "logsumexp(x, dim=0)"}], "outputs": ["out"]}
    grad = function == "gradient"
    out = _gradient("x") if grad else _value("out")
    return _call(graph, {"x": _tensor(input["x"], grad)}, out, grad)


def llsq(function: str, input: dict[str, Any]) -> Call:
    """0.5 * sum_i (sign(t_i) - sum_j x_j t_i^j)^2 at n points t_i of [-1, 1] (GradBench's
    definition: the points' powers made in the graph, not sent: each the last times t, as
    its tools' cumulative product makes them)."""
    n, m = input["n"], len(input["x"])
    powers = {
        "id": "powers",
        "op": "scan",
        "args": ["ones_n"],
        "attrs": {"length": m},
        "body": {
            "carry": ["p"],
            "xs": [],
            "nodes": [{"id": "t_j", "expr": "p * 1.0"}, {"id": "p_next", "expr": "p * t"}],
            "next": {"p": "p_next"},
        },
        "results": {"P": "t_j"},  # (m, n): t_i^j
    }
    graph = {
        "nodes": [
            {"id": "t", "expr": f"-1.0 + 2.0 * arange(end={n}, dtype='float64') / {n - 1.0!r}"},
            {"id": "ones_n", "op": "ones", "attrs": {"shape": [n], "dtype": "float64"}},
            powers,
            {"id": "out", "expr": "0.5 * sum((sign(t) - x @ P) ** 2)"},
        ],
        "outputs": ["out"],
    }
    grad = function == "gradient"
    out = _gradient("x") if grad else _value("out")
    return _call(graph, {"x": _tensor(input["x"], grad)}, out, grad)


def kmeans(function: str, input: dict[str, Any]) -> Call:
    """`cost`: each point's squared distance to its nearest centroid, summed; `dir`: the
    Newton direction J / H, H the Hessian's diagonal as its JAX tool takes it (the JVP of
    the gradient along ones)."""
    k, d = len(input["centroids"]), len(input["centroids"][0])
    nodes = [
        {
            "id": "dist",
            "expr": "unsqueeze(sum(P * P, dim=1), dim=1) + unsqueeze(sum(C * C, dim=1), dim=0)"
            " - 2 * (P @ transpose(C, dim0=0, dim1=1))",
        },
        {"id": "cost", "expr": "sum(min(dist, dim=1))"},
    ]
    if function == "dir":
        nodes += [
            {"id": "J", "expr": "grad(cost, C)"},
            {"id": "ones", "op": "ones", "attrs": {"shape": [k, d], "dtype": "float64"}},
            {"id": "H", "expr": "jvp(J, C, ones)"},
            {"id": "out", "expr": "J / H"},
        ]
    output = "out" if function == "dir" else "cost"
    inputs = {"P": _tensor(input["points"]), "C": _tensor(input["centroids"])}
    return _call({"nodes": nodes, "outputs": [output]}, inputs, _value(output), False)


def gmm(function: str, input: dict[str, Any]) -> Call:
    """GradBench's gmm objective (its JAX tool's gmm_objective): alpha (k), mu (k x d), q
    (k x d: the precisions' log-diagonals), l (k x d(d-1)/2: their strict lower triangles,
    column by column), x (n x d), the Wishart prior's gamma and m; `jacobian`: its
    gradient with respect to alpha, mu, q and l."""
    d, k, n, m, gamma = input["d"], input["k"], input["n"], input["m"], input["gamma"]
    rows = [i for j in range(d) for i in range(j + 1, d)]
    cols = [j for j in range(d) for _ in range(j + 1, d)]
    where = np.zeros((d, d), np.int64)
    where[rows, cols] = 1 + np.arange(len(rows))  # 1 + l's index; 0: not in L
    n_w = d + m + 1
    multigammaln = d * (d - 1) / 4 * math.log(math.pi) + sum(
        math.lgamma(0.5 * n_w + (1 - j) / 2) for j in range(1, d + 1)
    )
    const = -n * d * 0.5 * math.log(2 * math.pi) + k * (
        n_w * d * math.log(gamma / math.sqrt(2)) - multigammaln
    )
    half_g2 = 0.5 * gamma * gamma
    padded = "cat(zeros_l, l, dim=1)"  # (index 0: the zero of every entry not in L)
    nodes = [
        {"id": "zeros_l", "op": "zeros", "attrs": {"shape": [k, 1], "dtype": "float64"}},
        {"id": "Q", "expr": "exp(q)"},
        {"id": "sum_qs", "expr": "sum(q, dim=1)"},
        {"id": "L", "expr": f"reshape(index_select({padded}, tri, dim=1), shape=[{k}, {d}, {d}])"},
        {"id": "xc", "expr": "unsqueeze(x, dim=1) - mu"},
        {"id": "Lx", "expr": 'Q * xc + einsum("kij,nkj->nki", L, xc)'},
        {"id": "inner", "expr": "alpha + sum_qs - 0.5 * sum(Lx * Lx, dim=2)"},
        {
            "id": "prior",
            "expr": f"-sum({half_g2!r} * (sum(Q * Q, dim=1) + sum(l * l, dim=1)) - {m} * sum_qs)",
        },
        {
            "id": "out",
            "expr": f"{const!r} + sum(logsumexp(inner, dim=1)) - {n} * logsumexp(alpha, dim=0)"
            " + prior",
        },
    ]
    grad = function == "jacobian"
    inputs = {name: _tensor(input[name], grad) for name in ("alpha", "mu", "q", "l")}
    inputs["x"] = _tensor(input["x"])
    inputs["tri"] = {"data": where.ravel().tolist(), "dtype": "int64"}

    def jacobian(answer: dict[str, Any]) -> dict[str, Any]:
        return {name: answer["gradients"][name]["data"] for name in ("alpha", "mu", "q", "l")}

    graph = {"nodes": nodes, "outputs": ["out"]}
    return _call(graph, inputs, jacobian if grad else _value("out"), grad)


def ode(function: str, input: dict[str, Any]) -> Call:
    """y' = f(y), f(y)_i = x_0 for i = 0 and x_i * y_{i-1} after, from y = 0 over tf = 2
    in s RK4 steps (a scan); `primal`: the final state, `gradient`: its last component's
    gradient with respect to x."""
    x, s = input["x"], input["s"]
    n = len(x)
    h = 2.0 / s

    def f(name: str, v: str) -> dict[str, Any]:
        roll = f"cat(slice({v}, dim=0, start={n - 1}), slice({v}, dim=0, stop={n - 1}))"
        return {"id": name, "expr": f"x * (first + (1.0 - first) * {roll})"}

    body = [
        f("k1", "y"),
        {"id": "a2", "expr": f"y + {h / 2!r} * k1"},
        f("k2", "a2"),
        {"id": "a3", "expr": f"y + {h / 2!r} * k2"},
        f("k3", "a3"),
        {"id": "a4", "expr": f"y + {h!r} * k3"},
        f("k4", "a4"),
        {"id": "y2", "expr": f"y + {h / 6!r} * (k1 + ((2.0 * k2) + (2.0 * k3) + k4))"},
    ]
    grad = function == "gradient"
    graph = {
        "nodes": [
            {"id": "y0", "op": "zeros", "attrs": {"shape": [n], "dtype": "float64"}},
            {
                "id": "loop",
                "op": "scan",
                "args": ["y0"],
                "attrs": {"length": s},
                "body": {"carry": ["y"], "xs": [], "nodes": body, "next": {"y": "y2"}},
                "results": {"yT": "y"},
            },
            {"id": "last", "expr": f"sum(slice(yT, dim=0, start={n - 1}))"},
        ],
        "outputs": ["last" if grad else "yT"],
    }
    first = [1.0] + [0.0] * (n - 1)
    inputs = {"x": _tensor(x, grad), "first": _tensor(first)}
    return _call(graph, inputs, _gradient("x") if grad else _value("yT"), grad)


def det(function: str, input: dict[str, Any]) -> Call:
    ell = input["ell"]
    graph = {
        "nodes": [{"id": "out", "expr": f"det(reshape(A, shape=[{ell}, {ell}]))"}],
        "outputs": ["out"],
    }
    grad = function == "gradient"
    out = _gradient("A") if grad else _value("out")
    return _call(graph, {"A": _tensor(input["A"], grad)}, out, grad)


MODULES: dict[str, Callable[[str, dict[str, Any]], Call]] = {
    "lse": lse,
    "llsq": llsq,
    "kmeans": kmeans,
    "gmm": gmm,
    "ode": ode,
    "det": det,
}


def evaluate(client: RawClient, message: dict[str, Any]) -> dict[str, Any]:
    """Runs of the evaluation, each one request, until `min_runs` and `min_seconds` (as
    GradBench's tools repeat); the output of the last, the timings of each."""
    input = message["input"]
    call = MODULES[message["module"]](message["function"], input)
    min_runs, min_seconds = input.get("min_runs", 1), input.get("min_seconds", 0)
    timings: list[dict[str, Any]] = []
    elapsed = 0.0
    answer: Any = None
    while len(timings) < 3 * min_runs or elapsed < min_seconds:
        start = time.perf_counter_ns()
        status, _, content = client.post(call.path, [call.body], JSON)
        ns = time.perf_counter_ns() - start
        if status != 200:
            return {"success": False, "error": f"HTTP {status}: {bytes(content[:2000])!r}"}
        answer = orjson.loads(memoryview(content))
        server = answer["meta"]["timings_ms"]
        run_ms = server["forward"] + server.get("backward", 0.0)
        timings.append({"name": "evaluate", "nanoseconds": round(run_ms * 1e6)})
        timings.append({"name": "prepare", "nanoseconds": round(server["plan"] * 1e6)})
        timings.append({"name": "http", "nanoseconds": ns})
        elapsed += ns / 1e9
    return {"success": True, "output": call.output(answer), "timings": timings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gradserve's address")
    args = parser.parse_args(argv)
    port = urlsplit(args.url).port or 80
    with RawClient(port) as client:
        for line in sys.stdin:
            message = json.loads(line)
            response: dict[str, Any] = {}
            if message["kind"] == "start":
                response["tool"] = "gradserve"
            elif message["kind"] == "define":
                known = message["module"] in MODULES
                response["success"] = known
                if not known:
                    response["error"] = f"gradserve's tool has no module {message['module']!r}"
            elif message["kind"] == "evaluate":
                response = evaluate(client, message)
            print(json.dumps({"id": message["id"]} | response), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
