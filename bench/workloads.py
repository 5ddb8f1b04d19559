"""What the benchmarks measure, in one place: the GradBench-shaped objectives (gmm, lstm,
ba, the tests' objectives), the recurrent cell, the unrolled chains, the loops, the
hardening mix's request bodies and the FastAPI + PyTorch peer script, each with the
hand-written NumPy or PyTorch reference that checks it."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from gradserve.engine.graph import GraphSpec, NodeSpec
from gradserve.engine.graph.spec import BodySpec

try:
    import torch
except ImportError:  # PyTorch comes with the test extra
    torch = None  # type: ignore[assignment]

Arrays = dict[str, np.ndarray]
Graph = dict[str, Any]
Impl = Callable[[Arrays], tuple[np.ndarray, Arrays]]  # inputs -> (value, gradients)
JSON_HEADERS = {"Content-Type": "application/json"}


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


def lse(n: int = 100_000) -> Workload:
    """GradBench's lse: logsumexp of a vector and its gradient."""
    x = np.random.default_rng(5).standard_normal(n)
    graph = {"nodes": [ex("loss", "logsumexp(x, dim=0)")], "outputs": ["loss"]}
    return Workload(
        f"lse n={n:,} f64",
        graph,
        {"x": x},
        ["x"],
        "loss",
        torch=torch_impl(lambda t: torch.logsumexp(t["x"], 0), ["x"]) if torch else None,
    )


def llsq(rows: int = 1024, cols: int = 128) -> Workload:
    """GradBench's llsq: 0.5 * |s - T x|^2 for the fit of sign(t) by a polynomial of degree
    cols - 1 at `rows` points of [-1, 1] (T their powers, given as GradBench's data is);
    the gradient with respect to x."""
    t = -1.0 + 2.0 * np.arange(rows) / (rows - 1)
    inputs = {
        "x": np.random.default_rng(6).standard_normal(cols) / cols,
        "T": t[:, None] ** np.arange(cols),
        "s": np.sign(t),
    }
    graph = {"nodes": [ex("loss", "0.5 * sum((s - T @ x) ** 2)")], "outputs": ["loss"]}
    return Workload(
        f"llsq {rows}x{cols} f64",
        graph,
        inputs,
        ["x"],
        "loss",
        torch=(
            torch_impl(lambda a: 0.5 * torch.sum((a["s"] - a["T"] @ a["x"]) ** 2), ["x"])
            if torch
            else None
        ),
    )


def kmeans(n: int = 1000, k: int = 100, d: int = 8) -> Workload:
    """GradBench's kmeans cost (each point's squared distance to its nearest centroid,
    summed; the distances as its tools write them, through one matmul) and its gradient
    with respect to the centroids; the data as its eval makes it (uniform points, the last
    k of them the centroids)."""
    points = np.random.default_rng(7).random((n, d))
    graph = {
        "nodes": [
            ex(
                "dist",
                "unsqueeze(sum(P * P, dim=1), dim=1) + unsqueeze(sum(C * C, dim=1), dim=0)"
                " - 2 * (P @ transpose(C, dim0=0, dim1=1))",
            ),
            ex("loss", "sum(min(dist, dim=1))"),
        ],
        "outputs": ["loss"],
    }

    def torch_kmeans(a: dict[str, Any]) -> Any:
        P, C = a["P"], a["C"]
        dist = torch.sum(P * P, 1)[:, None] + torch.sum(C * C, 1)[None, :] - 2 * (P @ C.T)
        return torch.sum(torch.min(dist, 1).values)

    return Workload(
        f"kmeans n={n:,} k={k} d={d} f64",
        graph,
        {"P": points, "C": points[-k:].copy()},
        ["C"],
        "loss",
        torch=torch_impl(torch_kmeans, ["C"]) if torch else None,
    )


def det(ell: int = 64) -> Workload:
    """GradBench's det: the determinant of an ell x ell matrix and its gradient."""
    A = np.random.default_rng(8).standard_normal((ell, ell)) + 2 * np.eye(ell)
    graph = {"nodes": [ex("loss", "det(A)")], "outputs": ["loss"]}
    return Workload(
        f"det {ell}x{ell} f64",
        graph,
        {"A": A},
        ["A"],
        "loss",
        torch=torch_impl(lambda a: torch.linalg.det(a["A"]), ["A"]) if torch else None,
    )


# The user's pattern (bench.bench_objectives): GradBench's objectives at two sizes each, as
# a user sends them; the FastAPI + PyTorch script (OBJECTIVES_APP) serves the same ones.
def user_objectives(smoke: bool = False) -> dict[str, Workload]:
    """slug -> workload: lse, gmm, least squares, k-means, determinant, LSTM and bundle
    adjustment, sizes S and M (`smoke`: tiny ones)."""
    if smoke:
        sizes: dict[str, Callable[[], Workload]] = {
            "lse-S": lambda: lse(100),
            "gmm-S": lambda: gmm(2, 3, 20),
            "llsq-S": lambda: llsq(16, 4),
            "kmeans-S": lambda: kmeans(50, 5, 3),
            "det-S": lambda: det(4),
            "lstm-S": lambda: lstm(1, 3, 3),
            "ba-S": lambda: ba(4, 16, 32),
        }
    else:
        sizes = {
            "lse-S": lambda: lse(1_000),
            "lse-M": lambda: lse(100_000),
            "gmm-S": lambda: gmm(2, 5, 1000),
            "gmm-M": lambda: gmm(10, 25, 1000),
            "llsq-S": lambda: llsq(128, 16),
            "llsq-M": lambda: llsq(1024, 128),
            "kmeans-S": lambda: kmeans(1000, 10, 8),
            "kmeans-M": lambda: kmeans(10_000, 100, 8),
            "det-S": lambda: det(8),
            "det-M": lambda: det(64),
            "lstm-S": lambda: lstm(2, 14, 10),
            "lstm-M": lambda: lstm(2, 14, 50),
            "ba-S": lambda: ba(16, 256, 512),
            "ba-M": lambda: ba(128, 2048, 8192),
        }
    return {slug: make() for slug, make in sizes.items()}


# The script a competent engineer writes to serve those objectives with PyTorch: strict JSON
# in and out with orjson (NumPy arrays written as they lie), torch on the CPU, each
# objective's code its own (bench.workloads' PyTorch references), computed on the event
# loop (no thread hop for work of milliseconds). GRADSERVE_BENCH_SMOKE picks the sizes.
OBJECTIVES_APP = """
import os

import numpy as np
import orjson
from fastapi import FastAPI, Request, Response

from bench.workloads import user_objectives

app = FastAPI()
WORKLOADS = user_objectives(smoke=os.environ.get("GRADSERVE_BENCH_SMOKE") == "1")


@app.post("/{slug}")
async def objective(slug: str, request: Request) -> Response:
    w = WORKLOADS[slug]
    sent = orjson.loads(await request.body())
    arrays = {k: np.asarray(v, dtype=w.inputs[k].dtype) for k, v in sent.items()}
    value, gradients = w.torch(arrays)
    return Response(
        orjson.dumps(
            {"value": float(value), "gradients": gradients}, option=orjson.OPT_SERIALIZE_NUMPY
        ),
        media_type="application/json",
    )
"""


# tests/engine/test_objectives.py's objectives, copied as JSON dicts rather than imported
# (the bench's only tie to gradserve is the wire form and the adapter in bench.harness);
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


def objectives_torch() -> dict[str, Callable[[dict[str, Any]], Any]]:
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
    refs = objectives_torch() if torch else {}
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


def salt_input(w: Workload) -> str:
    return next(k for k, a in w.inputs.items() if a.dtype.kind == "f")


SEED = orjson.dumps(
    {
        "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
        "inputs": {
            "x": {"data": 2.0, "requires_grad": True},
            "y": {"data": 3.0, "requires_grad": True},
        },
    }
)


# The script a user would write to serve the recurrent cell with PyTorch (bench.workloads'
# workload 1). A plain `def`: FastAPI runs it in its thread pool, as gradserve runs a graph
# of this size in a worker thread.
TORCH_APP = """
import torch
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class CellIn(BaseModel):
    xs: list[list[list[float]]]
    w: list[list[float]]
    u: list[list[float]]
    b: list[float]
    h0: list[list[float]]


@app.post("/cell")
def cell(req: CellIn) -> dict:
    xs = torch.tensor(req.xs, requires_grad=True)
    w = torch.tensor(req.w, requires_grad=True)
    u = torch.tensor(req.u, requires_grad=True)
    b = torch.tensor(req.b, requires_grad=True)
    h0 = torch.tensor(req.h0, requires_grad=True)
    h = h0
    for t in range(xs.shape[0]):
        a = xs[t] @ w + h @ u + b
        h = torch.sigmoid(a + 1) * h + torch.sigmoid(a) * torch.tanh(a)
    loss = torch.sum(h * h)
    loss.backward()
    grads = {"xs": xs.grad, "w": w.grad, "u": u.grad, "b": b.grad, "h0": h0.grad}
    return {"loss": loss.item(), "gradients": {k: g.tolist() for k, g in grads.items()}}
"""


CELL_STEPS = 24


def _lists(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: a.tolist() for k, a in arrays.items()}


def cell_bodies() -> tuple[bytes, Iterable[bytes], bytes]:
    """(gradserve warm body, gradserve cold bodies: a new graph each, PyTorch app body);
    the same float32 data in all of them, as JSON lists. A cold body's new graph differs
    in one float literal, so that the service lifts it into the program of the last
    (engine.graph.lifting); `renamed_cell_bodies` are new graphs it compiles."""
    data = recurrent_data(CELL_STEPS)
    lists = _lists(data)
    inputs = {f"x{t}": {"data": lists["xs"][t], "requires_grad": True} for t in range(CELL_STEPS)}
    inputs |= {k: {"data": lists[k], "requires_grad": True} for k in ("w", "u", "b", "h0")}

    def gradserve(one: float) -> bytes:
        return orjson.dumps({"graph": recurrent_graph(CELL_STEPS, one), "inputs": inputs})

    # A constant that differs in every request (1 + k / 2**20), so each is a graph the
    # service has not seen; the math stays that of the warm graph to float32 precision.
    cold = (gradserve(1.0 + k * 2.0**-20) for k in itertools.count(1))
    return gradserve(1.0), cold, orjson.dumps(lists)


def renamed_cell_bodies() -> Iterable[bytes]:
    """The cell as a new graph each request that no program of another can serve: its loss
    node named anew (an id is part of a graph's shape), so that each is compiled."""
    warm = orjson.loads(cell_bodies()[0])
    for k in itertools.count(1):
        nodes = warm["graph"]["nodes"]
        nodes[-1]["id"] = f"loss_{k}"
        warm["graph"]["outputs"] = [f"loss_{k}"]
        yield orjson.dumps(warm)


# ---------------------------------------------------------------- the soak mix
def seed_body(x: float, y: float, form: str) -> dict[str, Any]:
    nodes = (
        [{"id": "z", "expr": "(x + y) * (x - y)"}]
        if form == "expr"
        else [
            {"id": "s", "op": "add", "args": ["x", "y"]},
            {"id": "d", "op": "sub", "args": ["x", "y"]},
            {"id": "z", "op": "mul", "args": ["s", "d"]},
        ]
    )
    return {
        "graph": {"nodes": nodes, "outputs": ["z"]},
        "inputs": {
            "x": {"data": x, "requires_grad": True},
            "y": {"data": y, "requires_grad": True},
        },
    }


MLP_GRAPH = {
    "nodes": [{"id": "loss", "expr": "mean((tanh(x @ w1) @ w2 - t) ** 2)"}],
    "outputs": ["loss"],
}


@dataclass
class MlpCase:
    inputs: dict[str, np.ndarray]
    loss: float
    gw1: np.ndarray
    gw2: np.ndarray


def mlp_case(rng: np.random.Generator) -> MlpCase:
    """Float32 inputs with 256x256 weights; the reference in float64."""
    x = rng.standard_normal((32, 256)).astype(np.float32)
    w1 = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
    w2 = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
    t = (rng.standard_normal((32, 256)) / 10).astype(np.float32)
    x64, w164, w264, t64 = (a.astype(np.float64) for a in (x, w1, w2, t))
    h = np.tanh(x64 @ w164)
    r = h @ w264 - t64
    dp = 2 * r / r.size
    gw2 = h.T @ dp
    gw1 = x64.T @ ((dp @ w264.T) * (1 - h**2))
    return MlpCase({"x": x, "w1": w1, "w2": w2, "t": t}, float(np.mean(r**2)), gw1, gw2)


# (name, method, path, body, headers, expected status)
INVALID: list[tuple[str, str, str, bytes, dict[str, str], int]] = [
    (
        "unknown-op",
        "POST",
        "/backward",
        orjson.dumps(
            {
                "graph": {
                    "nodes": [{"id": "z", "op": "frobnicate", "args": ["x"]}],
                    "outputs": ["z"],
                },
                "inputs": {"x": {"data": 1.0, "requires_grad": True}},
            }
        ),
        JSON_HEADERS,
        422,
    ),
    (
        "shape-mismatch",
        "POST",
        "/forward",
        orjson.dumps(
            {
                "graph": {
                    "nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}],
                    "outputs": ["z"],
                },
                "inputs": {
                    "a": {"data": [0.0] * 12, "shape": [3, 4]},
                    "b": {"data": [0.0] * 10, "shape": [5, 2]},
                },
            }
        ),
        JSON_HEADERS,
        422,
    ),
    ("malformed-json", "POST", "/backward", b'{"graph": {"nodes": [', JSON_HEADERS, 400),
    (
        "no_grad-on-backward",
        "POST",
        "/backward",
        orjson.dumps({**seed_body(2.0, 3.0, "expr"), "no_grad": True}),
        JSON_HEADERS,
        422,
    ),
    (
        "media-type",
        "POST",
        "/forward",
        orjson.dumps(seed_body(2.0, 3.0, "expr")),
        {"Content-Type": "text/plain"},
        415,
    ),
    (
        "cycle",
        "POST",
        "/backward",
        orjson.dumps(
            {
                "graph": {
                    "nodes": [
                        {"id": "a", "op": "add", "args": ["b", "x"]},
                        {"id": "b", "op": "add", "args": ["a", "x"]},
                    ],
                    "outputs": ["a"],
                },
                "inputs": {"x": {"data": 1.0, "requires_grad": True}},
            }
        ),
        JSON_HEADERS,
        422,
    ),
    (
        "expr-attribute",
        "POST",
        "/forward",
        orjson.dumps(
            {
                "graph": {"nodes": [{"id": "z", "expr": "x.__class__"}], "outputs": ["z"]},
                "inputs": {"x": 1.0},
            }
        ),
        JSON_HEADERS,
        422,
    ),
    ("method", "GET", "/forward", b"", {}, 405),
]


# ---------------------------------------------------------------- heavy requests
def heavy_body(matmuls: int) -> bytes:
    """A chain of 2048x2048 float64 matmuls, no_grad. Every entry stays exactly 2**-11
    (2048 * 2**-22), so the sum is exactly 2048."""
    nodes: list[dict[str, Any]] = [
        {
            "id": "a",
            "op": "full",
            "attrs": {"shape": [2048, 2048], "value": 2.0**-11, "dtype": "float64"},
        }
    ]
    prev = "a"
    for i in range(1, matmuls + 1):
        nodes.append({"id": f"m{i}", "op": "matmul", "args": [prev, "a"]})
        prev = f"m{i}"
    nodes.append({"id": "s", "op": "sum", "args": [prev]})
    return orjson.dumps(
        {"graph": {"nodes": nodes, "outputs": ["s"]}, "inputs": {}, "no_grad": True}
    )


HEAVY_SUM = 2048.0


def chain_body(nodes: int) -> bytes:
    """n1 = x + x, n_k = n_{k-1} + x: the output is (nodes + 1) * x."""
    spec = [{"id": "n1", "op": "add", "args": ["x", "x"]}]
    spec += [{"id": f"n{i}", "op": "add", "args": [f"n{i - 1}", "x"]} for i in range(2, nodes + 1)]
    return orjson.dumps(
        {
            "graph": {"nodes": spec, "outputs": [f"n{nodes}"]},
            "inputs": {"x": {"data": 1.0, "requires_grad": True}},
        }
    )


# ---------------------------------------------------------------- phases with own servers
BOMBS = {
    "7a": (
        "einsum 'i,j->' over 400000 x 400000",
        "einsum('i,j->', full(shape=[400000], value=1.0), full(shape=[400000], value=1.0))",
    ),
    "7b": (
        "6144x6144 float64 matmul",
        'matmul(full(shape=[6144,6144], value=1.0, dtype="float64"), '
        'full(shape=[6144,6144], value=1.0, dtype="float64"))',
    ),
}


def big_list_body(n: int) -> tuple[bytes, float]:
    """`sum(x * 2)` over a JSON list of n floats with 9 decimals (~12 bytes each)."""
    x = np.round(np.random.default_rng(1).uniform(0.1, 1.0, n), 9)
    body = (
        b'{"graph":{"nodes":[{"id":"s","expr":"sum(x * 2)"}],"outputs":["s"]},'
        b'"inputs":{"x":'
        + orjson.dumps(x, option=orjson.OPT_SERIALIZE_NUMPY)
        + b'},"no_grad":true}'
    )
    return body, 2 * float(np.sum(x.astype(np.float32), dtype=np.float64))


CELL = "tanh({x} @ w + {h} @ u + b)"


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


# ---------------------------------------------------------------- 2. HVP on the objectives
def hvp_graph(nodes: list[dict[str, Any]], output: str, wrt: list[str]) -> dict[str, Any]:
    grads = [ex(f"g_{w}", f"grad({output}, {w})") for w in wrt]
    dot = " + ".join(f"sum(g_{w} * v_{w})" for w in wrt)
    hvs = [ex(f"hv_{w}", f"grad(dot, {w})") for w in wrt]
    return {"nodes": [*nodes, *grads, ex("dot", dot), *hvs], "outputs": [f"hv_{w}" for w in wrt]}


def chain_spec(steps: int) -> GraphSpec:
    nodes = [NodeSpec(f"h{i}", expr=f"sin(h{i - 1}) * 0.999") for i in range(1, steps + 1)]
    nodes.append(NodeSpec("loss", "sum", [f"h{steps}"]))
    return GraphSpec(nodes, ["loss"])


def chain_numpy(x: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """The chain's loss and gradient by hand, in NumPy."""
    h, g = x, np.ones_like(x)
    hs = []
    for _ in range(steps):
        hs.append(h)
        h = np.sin(h) * 0.999
    for h_prev in reversed(hs):
        g = g * 0.999 * np.cos(h_prev)
    return float(h.sum()), g


def rnn_spec(steps: int) -> GraphSpec:
    """The issue's loop: h = 0.95 h + 0.05 tanh(x + 1.1 h), x read by every step."""
    body = BodySpec(
        carry=["h"],
        xs=[],
        nodes=[NodeSpec("h2", expr="0.95 * h + 0.05 * tanh(x + 1.1 * h)")],
        next={"h": "h2"},
    )
    return GraphSpec(
        [
            NodeSpec("loop", "scan", ["h0"], {"length": steps}, body=body, results={"hT": "h"}),
            NodeSpec("loss", "sum", ["hT"]),
        ],
        ["loss"],
    )


def ode_graph(n: int, s: int) -> dict[str, Any]:
    """GradBench's ode (its JAX tool's definition): y' = f(y), f(y)_i = x_0 for i = 0 and
    x_i * y_{i-1} after, from y = 0 over tf = 2 in s RK4 steps (a scan); the output is the
    last component of the final state. `m` is the one-hot of component 0 (where(i == 0,
    ...) as arithmetic: x * (m + (1 - m) * roll(y, 1)), the same values)."""
    h = 2.0 / s

    def f(name: str, v: str) -> dict[str, Any]:
        roll = f"cat(slice({v}, dim=0, start={n - 1}), slice({v}, dim=0, stop={n - 1}))"
        return {"id": name, "expr": f"x * (m + (1.0 - m) * {roll})"}

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
    return {
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
            {"id": "out", "expr": f"sum(slice(yT, dim=0, start={n - 1}))"},
        ],
        "outputs": ["out"],
    }


def ode_torch(x: np.ndarray, s: int) -> tuple[float, np.ndarray]:
    import torch

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    i0 = torch.arange(len(x)) == 0
    h = 2.0 / s

    def f(y: Any) -> Any:
        return torch.where(i0, xt, xt * torch.roll(y, 1))

    y = torch.zeros_like(xt)
    for _ in range(s):
        k1 = f(y)
        k2 = f(y + h / 2 * k1)
        k3 = f(y + h / 2 * k2)
        k4 = f(y + h * k3)
        y = y + h / 6 * (k1 + ((2 * k2) + (2 * k3) + k4))
    y[-1].backward()
    return float(y[-1].detach()), xt.grad.numpy()  # type: ignore[union-attr]


# ------------------------------------------------------------------ the rows
def mlp_graph() -> dict[str, Any]:
    return {
        "nodes": [
            {"id": "h", "expr": "tanh(x @ w1)"},
            {"id": "loss", "expr": "sum((h @ w2 - y) ** 2)"},
        ],
        "outputs": ["loss"],
    }


def costly_graph() -> dict[str, Any]:
    """70 layers of tanh(h @ a + x) on a 256x256 matrix the graph makes itself: ~8 G cost
    units from a body of a few KB (its cost is the program's, not its data's)."""
    nodes = [{"id": "a", "expr": "full(shape=[256, 256], value=0.01)"}]
    nodes += [
        {"id": f"m{i}", "expr": f"tanh({f'm{i - 1}' if i else 'a'} @ a + x)"} for i in range(70)
    ]
    return {"nodes": [*nodes, {"id": "loss", "expr": "sum(m69)"}], "outputs": ["loss"]}
