"""bench/gradbench_tool.py, the GradBench tool that answers with gradserve, as GradBench's
intermediary drives it: a process that reads GradBench's messages on stdin and answers on
stdout, each evaluation's runs sent to a live server. Every module's every function
answers what GradBench's definition says, checked against NumPy or PyTorch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.server import ROOT, Server, start_server, stop_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("gradbench-tool"))
    yield s
    stop_server(s)


def _answers(server: Server, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool's answer to each message, one process for them all."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.gradbench_tool", "--url", server.base],
        input="".join(json.dumps(m) + "\n" for m in messages),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert [a["id"] for a in answers] == [m["id"] for m in messages]
    return answers


def _close(actual: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            _close(actual[k], expected[k])
        return
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape
    np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12 * max(1.0, float(np.abs(e).max())))


RNG = np.random.default_rng(7)
X = RNG.random(50)
N_LLSQ, X_LLSQ = 40, RNG.random(6)
POINTS = RNG.random((60, 3))
D, K, N = 3, 4, 25
GMM = {
    "d": D,
    "k": K,
    "n": N,
    "x": RNG.normal(size=(N, D)).tolist(),
    "m": 2,
    "gamma": 0.7,
    "alpha": RNG.normal(size=K).tolist(),
    "mu": RNG.uniform(size=(K, D)).tolist(),
    "q": RNG.normal(size=(K, D)).tolist(),
    "l": RNG.normal(size=(K, D * (D - 1) // 2)).tolist(),
}
X_ODE, S_ODE = RNG.random(8), 7
A = RNG.random(9)


def _llsq(x: Any) -> Any:
    t = -1.0 + 2.0 * torch.arange(N_LLSQ, dtype=torch.float64) / (N_LLSQ - 1)
    T = t[:, None] ** torch.arange(len(X_LLSQ), dtype=torch.float64)
    return 0.5 * torch.sum((torch.sign(t) - T @ x) ** 2)


def _gmm(alpha: Any, mu: Any, q: Any, l: Any) -> Any:  # noqa: E741 (GradBench's name)
    """GradBench's gmm objective, written out (its JAX tool's gmm_objective, in torch)."""
    x = torch.tensor(GMM["x"], dtype=torch.float64)
    m, gamma = GMM["m"], GMM["gamma"]
    Q = torch.exp(q)
    L = torch.zeros(K, D, D, dtype=torch.float64)
    rows, cols = np.tril_indices(D, -1, D)
    order = np.lexsort((rows, cols))  # column by column
    L = L.index_put(
        (torch.arange(K)[:, None], torch.tensor(rows[order]), torch.tensor(cols[order])), l
    )
    xc = x[:, None, :] - mu[None]
    Lx = Q * xc + torch.einsum("kij,nkj->nki", L, xc)
    inner = alpha + q.sum(1) - 0.5 * (Lx**2).sum(2)
    n_w = D + m + 1
    prior = -torch.sum(0.5 * gamma**2 * ((Q**2).sum(1) + (l**2).sum(1)) - m * q.sum(1))
    multigammaln = D * (D - 1) / 4 * math.log(math.pi) + sum(
        math.lgamma(0.5 * n_w + (1 - j) / 2) for j in range(1, D + 1)
    )
    const = K * (n_w * D * math.log(gamma / math.sqrt(2)) - multigammaln)
    return (
        -N * D * 0.5 * math.log(2 * math.pi)
        + torch.logsumexp(inner, 1).sum()
        - N * torch.logsumexp(alpha, 0)
        + prior
        + const
    )


def _ode(x: Any) -> Any:
    y, h = torch.zeros_like(x), 2.0 / S_ODE

    def f(v: Any) -> Any:
        return torch.cat([x[:1], x[1:] * v[:-1]])

    for _ in range(S_ODE):
        k1 = f(y)
        k2 = f(y + h / 2 * k1)
        k3 = f(y + h / 2 * k2)
        k4 = f(y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y


def _torch_grad(fn: Any, *args: np.ndarray) -> list[np.ndarray]:
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in args]
    fn(*ts).backward()
    return [t.grad.numpy() for t in ts]  # type: ignore[union-attr]


def _kmeans() -> tuple[float, np.ndarray]:
    C = POINTS[-5:]
    d2 = ((POINTS[:, None, :] - C[None]) ** 2).sum(2)
    nearest = d2.argmin(1)
    J = np.zeros_like(C)
    np.add.at(J, nearest, 2 * (C[nearest] - POINTS))
    H = 2 * np.bincount(nearest, minlength=len(C))[:, None]
    return float(d2.min(1).sum()), J / H


def _cases() -> list[tuple[str, str, dict[str, Any], Any]]:
    """(module, function, input, GradBench's output)."""
    cost, direction = _kmeans()
    g = _torch_grad(_gmm, *(np.array(GMM[k]) for k in ("alpha", "mu", "q", "l")))
    At = A.reshape(3, 3)
    return [
        ("lse", "primal", {"x": X.tolist()}, float(np.log(np.exp(X).sum()))),
        ("lse", "gradient", {"x": X.tolist()}, np.exp(X) / np.exp(X).sum()),
        ("llsq", "primal", {"x": X_LLSQ.tolist(), "n": N_LLSQ}, float(_llsq(torch.tensor(X_LLSQ)))),
        ("llsq", "gradient", {"x": X_LLSQ.tolist(), "n": N_LLSQ}, _torch_grad(_llsq, X_LLSQ)[0]),
        ("kmeans", "cost", {"points": POINTS.tolist(), "centroids": POINTS[-5:].tolist()}, cost),
        (
            "kmeans",
            "dir",
            {"points": POINTS.tolist(), "centroids": POINTS[-5:].tolist()},
            direction,
        ),
        (
            "gmm",
            "objective",
            GMM,
            float(
                _gmm(
                    *(torch.tensor(GMM[k], dtype=torch.float64) for k in ("alpha", "mu", "q", "l"))
                )
            ),
        ),
        ("gmm", "jacobian", GMM, dict(zip(("alpha", "mu", "q", "l"), g, strict=True))),
        ("ode", "primal", {"x": X_ODE.tolist(), "s": S_ODE}, _ode(torch.tensor(X_ODE)).numpy()),
        (
            "ode",
            "gradient",
            {"x": X_ODE.tolist(), "s": S_ODE},
            _torch_grad(lambda x: _ode(x)[-1], X_ODE)[0],
        ),
        ("det", "primal", {"A": A.tolist(), "ell": 3}, float(np.linalg.det(At))),
        (
            "det",
            "gradient",
            {"A": A.tolist(), "ell": 3},
            (np.linalg.det(At) * np.linalg.inv(At).T).ravel(),
        ),
    ]


def test_every_module_answers_gradbenchs_definition(server: Server) -> None:
    cases = _cases()
    messages: list[dict[str, Any]] = [{"id": 0, "kind": "start", "eval": "lse"}]
    messages += [
        {"id": 1 + k, "kind": "define", "module": m}
        for k, m in enumerate(["lse", "llsq", "kmeans", "gmm", "ode", "det"])
    ]
    first = len(messages)
    messages += [
        {
            "id": first + k,
            "kind": "evaluate",
            "module": module,
            "function": function,
            "input": {**input, "min_runs": 2, "min_seconds": 0},
        }
        for k, (module, function, input, _) in enumerate(cases)
    ]
    answers = _answers(server, messages)
    assert answers[0]["tool"] == "gradserve"
    assert all(a["success"] for a in answers[1:first])
    for (module, function, _, expected), answer in zip(cases, answers[first:], strict=True):
        assert answer["success"], (module, function, answer)
        _close(answer["output"], expected)
        names = [t["name"] for t in answer["timings"]]
        assert names == ["evaluate", "prepare", "http"] * 2, names  # (two runs)
        assert all(t["nanoseconds"] >= 0 for t in answer["timings"])


def test_a_module_it_does_not_have_is_refused_and_an_error_is_an_answer(server: Server) -> None:
    answers = _answers(
        server,
        [
            {"id": 0, "kind": "define", "module": "ht"},
            {
                "id": 1,
                "kind": "evaluate",
                "module": "det",
                "function": "primal",
                "input": {"A": [1.0, 2.0, 3.0], "ell": 2},  # (3 values for a 2 x 2)
            },
        ],
    )
    assert answers[0] == {
        "id": 0,
        "success": False,
        "error": "gradserve's tool has no module 'ht'",
    }
    assert not answers[1]["success"] and "HTTP 422" in answers[1]["error"]
