"""The native tier over HTTP, against live servers: a program whose runs would pay for its
compile tiers up in the lowering process, off the request path, and answers the same; a
one-off long loop is lowered before its first run; the front process's tiny requests stay
interpreted; a program the lowering refuses stays interpreted and says why; the tier
switched off, or jax absent, never tiers; a deadline passed in an XLA execution kills the
worker as in the interpreter; and a second server on the same store loads the executables
the first left there, lowering nothing again."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gradserve.engine.graph import xla
from gradserve.service.worker import cores_for
from tests.support.server import Server, start_server, stop_server

pytestmark = pytest.mark.integration

needs_jax = pytest.mark.skipif(not xla.available(), reason="jax is not importable here")
TIER_UP_S = 120  # (a compile on a loaded 2-core machine, after jax's import)


def seed(x: float = 2.0, y: float = 3.0) -> dict[str, Any]:
    """The contract's seed in float64: answered in the front process (a tiny request)."""
    return {
        "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
        "inputs": {
            "x": {"data": x, "dtype": "float64", "requires_grad": True},
            "y": {"data": y, "dtype": "float64", "requires_grad": True},
        },
    }


def rnn(steps: int = 1000) -> dict[str, Any]:
    """A scan RNN, h = 0.95 h + 0.05 tanh(x + 1.1 h) on 4 values, fwd+bwd: with 1,000
    steps ~13,000 steps executed (~11 ms interpreted), computed in a worker; its predicted
    saving in XLA (~10 ms a run) pays for its compile (~200 ms) after ~20 runs."""
    rng = np.random.default_rng(0)
    body = {
        "carry": ["h"],
        "xs": ["x"],
        "next": {"h": "h2"},
        "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}],
    }
    return {
        "graph": {
            "nodes": [
                {
                    "id": "rnn",
                    "op": "scan",
                    "args": ["h0", "xs"],
                    "body": body,
                    "results": {"h_end": "h"},
                },
                {"id": "loss", "expr": "sum(h_end * h_end)"},
            ],
            "outputs": ["loss"],
        },
        "inputs": {
            "h0": {"data": rng.normal(size=4).tolist(), "dtype": "float64", "requires_grad": True},
            "xs": {
                "data": rng.normal(size=(steps, 4)).tolist(),
                "dtype": "float64",
                "requires_grad": True,
            },
        },
    }


NOT_LOWERED = "sin"  # (in the servers here: tests/hooks/sitecustomize.py)


def long_loop(steps: int = 200_000) -> dict[str, Any]:
    """A loop of `steps` over 4 values and no sequences (a small body: GradBench's
    descents), differentiated in its parameter `a`: ~3 s interpreted, so its first run
    alone pays for a compile."""
    body = {
        "carry": ["h"],
        "next": {"h": "h2"},
        "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(1.1 * h + a)"}],
    }
    return {
        "graph": {
            "nodes": [
                {
                    "id": "rnn",
                    "op": "scan",
                    "args": ["h0"],
                    "body": body,
                    "results": {"h_end": "h"},
                    "attrs": {"length": steps},
                },
                {"id": "loss", "expr": "sum(h_end * h_end)"},
            ],
            "outputs": ["loss"],
        },
        "inputs": {
            "h0": {"data": [0.1, 0.2, 0.3, 0.4], "dtype": "float64", "requires_grad": True},
            "a": {"data": 0.3, "dtype": "float64", "requires_grad": True},
        },
    }


def refused() -> dict[str, Any]:
    """A program with an op that has no lowering (`sin`, in the 1,000-step loop: a program
    whose runs would pay for a compile)."""
    body = rnn(1000)
    body["graph"]["nodes"][0]["body"]["nodes"][0]["expr"] = "0.95 * h + 0.05 * sin(x + h)"
    return body


def post(server: Server, body: dict[str, Any], path: str = "/backward") -> dict[str, Any]:
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def until_xla(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The first answer of the native tier (each request before it interpreted)."""
    deadline = time.monotonic() + TIER_UP_S
    while time.monotonic() < deadline:
        got = post(server, body)
        if got["meta"]["tier"] == "xla":
            return got
        assert got["meta"]["tier_reason"].startswith(("cold: ", "compiling: ")), got["meta"]
        time.sleep(0.05)
    raise AssertionError(f"no tier-up in {TIER_UP_S} s:\n{server.log_text()[-3000:]}")


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same outputs and gradients, to a relative 1e-12 (float64)."""
    for part in ("outputs", "gradients"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            x, y = a[part][name], b[part][name]
            assert (x["dtype"], x["shape"]) == (y["dtype"], y["shape"])
            np.testing.assert_allclose(
                np.asarray(x["data"]), np.asarray(y["data"]), rtol=1e-12, atol=0
            )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("tier"),
        GRADSERVE_MAX_BODY_BYTES=str(1 << 20),
        GRADSERVE_TEST_NOT_LOWERED=NOT_LOWERED,
    )
    yield s
    stop_server(s)


@needs_jax
def test_a_program_tiers_up_once_its_runs_would_have_paid(server: Server) -> None:
    """Each interpreted run says what XLA would save and after how many runs the compile
    pays; at that run the lowering is asked for (that run still interpreted), and once
    the lowering process has stored the executable the worker loads it and answers the
    same."""
    body = rnn(1000)
    first = post(server, body)
    assert first["meta"]["tier"] == "interpreter"
    found = re.fullmatch(
        r"cold: XLA would save ~[\d.]+ ms a run; lowered once it has run "
        r"(\d+) times \(a ~\d+ ms compile\)",
        first["meta"]["tier_reason"],
    )
    assert found, first["meta"]
    assert 2 <= int(found[1]) <= 200
    tiered = until_xla(server, body)
    assert tiered["meta"]["tier_reason"] is None
    assert_same(first, tiered)
    again = post(server, body)
    assert again["meta"]["tier"] == "xla"
    assert_same(first, again)


@needs_jax
def test_a_one_off_long_loop_is_lowered_before_its_first_run(server: Server) -> None:
    """Its predicted saving on one run (seconds) exceeds the compile and a first load:
    the worker asks the lowering process for it and waits, and the first answer is XLA's.
    The answer is the interpreter's (float64, to 1e-12)."""
    body = long_loop()
    got = post(server, body)
    assert (got["meta"]["tier"], got["meta"]["tier_reason"]) == ("xla", None), got["meta"]
    from gradserve.engine.graph import TensorSpec, compile_graph, execute
    from gradserve.service.schemas import Graph

    program = compile_graph(
        Graph.model_validate(body["graph"]),
        {"h0": TensorSpec((4,), "float64", True), "a": TensorSpec((), "float64", True)},
        backward=True,
    )
    local = execute(program, {"h0": np.array([0.1, 0.2, 0.3, 0.4]), "a": np.array(0.3)})
    np.testing.assert_allclose(got["outputs"]["loss"]["data"], local.outputs["loss"], rtol=1e-12)
    assert abs(float(local.gradients["a"])) > 0.1
    np.testing.assert_allclose(
        got["gradients"]["a"]["data"], local.gradients["a"], rtol=1e-9
    )  # (a sum of 200,000 terms, XLA's and NumPy's)


def unrolled_chain(steps: int = 400) -> dict[str, Any]:
    """A recurrence as define-by-run records it: one node a step."""
    nodes = [{"id": f"h{i}", "expr": f"tanh(h{i - 1} * w + x) * 0.5"} for i in range(1, steps + 1)]
    return {
        "graph": {
            "nodes": [*nodes, {"id": "loss", "op": "sum", "args": [f"h{steps}"]}],
            "outputs": ["loss"],
        },
        "inputs": {
            name: {
                "data": list(np.linspace(-1, 1, 64) + k),
                "dtype": "float64",
                "requires_grad": True,
            }
            for k, name in enumerate(("h0", "w", "x"))
        },
    }


@needs_jax
def test_an_unrolled_chain_is_predicted_and_lowered_as_a_loop(server: Server) -> None:
    """The 400-step chain (some 4,800 steps with its backward): its compile is predicted
    for the loop XLA compiles (one step), not for 4,800 steps (~10 s); it tiers up, within
    the plan, and answers as the interpreter did."""
    body = unrolled_chain()
    first = post(server, body)
    assert first["meta"]["tier"] == "interpreter"
    found = re.search(r"\(a ~(\d+) ms compile\)", first["meta"]["tier_reason"] or "")
    assert found and int(found[1]) < 1000, first["meta"]
    tiered = until_xla(server, body)
    assert_same(first, tiered)
    assert tiered["meta"]["peak_bytes"] <= tiered["meta"]["planned_peak_bytes"] + 4096
    assert tiered["meta"]["nodes"] == first["meta"]["nodes"] == 4 * 400 + 1  # (after expr)


def test_the_front_process_keeps_tiny_programs_interpreted(server: Server) -> None:
    """The seed runs in the front process's fast lane, which never loads XLA."""
    metas = [post(server, seed())["meta"] for _ in range(5)]
    assert {(m["tier"], m["tier_reason"]) for m in metas} == {
        ("interpreter", "fast lane: interpreted (the front process does not load XLA)")
    }


@needs_jax
def test_an_op_without_a_lowering_stays_interpreted_and_says_why(server: Server) -> None:
    reasons = []
    deadline = time.monotonic() + TIER_UP_S
    while time.monotonic() < deadline:
        meta = post(server, refused())["meta"]
        assert meta["tier"] == "interpreter"
        reasons.append(meta["tier_reason"])
        if not reasons[-1].startswith(("cold: ", "compiling: ")):
            break
        time.sleep(0.05)
    assert reasons[-1] == f"op {NOT_LOWERED!r} has no lowering", reasons
    assert post(server, refused())["meta"]["tier_reason"] == reasons[-1]  # (not retried)


def test_off_never_tiers(tmp_path: Path) -> None:
    s = start_server(tmp_path, GRADSERVE_XLA="off", GRADSERVE_MAX_BODY_BYTES=str(1 << 20))
    try:
        metas = [
            post(s, body)["meta"]
            for body in (seed(), rnn(1000), long_loop(20_000))
            for _ in range(3)
        ]
        assert {(m["tier"], m["tier_reason"]) for m in metas} == {("interpreter", "off")}
    finally:
        stop_server(s)


def test_without_jax_everything_works_interpreted(tmp_path: Path) -> None:
    s = start_server(tmp_path, GRADSERVE_TEST_NO_JAX="1", GRADSERVE_MAX_BODY_BYTES=str(1 << 20))
    try:
        for body in (rnn(1000), refused(), long_loop(20_000)):
            for _ in range(3):
                meta = post(s, body)["meta"]
                assert (meta["tier"], meta["tier_reason"]) == ("interpreter", "unavailable")
    finally:
        stop_server(s)


@needs_jax
@pytest.mark.timing
def test_a_deadline_during_an_xla_execution_kills_the_worker(tmp_path: Path) -> None:
    """The worker of a lowered program that runs past the deadline is killed, as one of
    the interpreter is: 504, and the server keeps answering (the next request, on a new
    worker, is interpreted: the tier is per process)."""
    s = start_server(
        tmp_path,
        GRADSERVE_TEST_SLOW_XLA="30",
        GRADSERVE_REQUEST_TIMEOUT_S="5",
        GRADSERVE_MAX_BODY_BYTES=str(1 << 20),
        GRADSERVE_COMPUTE_WORKERS="1",
    )
    try:
        body = rnn()
        deadline = time.monotonic() + TIER_UP_S
        while True:  # interpreted (~20 ms) until the tier is swapped in, then 30 s: killed
            assert time.monotonic() < deadline, s.log_text()[-3000:]
            started = time.monotonic()
            r = httpx.post(s.base + "/backward", json=body, timeout=60)
            if r.status_code != 200:
                break
            assert r.json()["meta"]["tier"] == "interpreter"
            time.sleep(0.05)
        assert r.status_code == 504, r.text
        assert r.json()["type"] == "urn:gradserve:problem:timeout"
        assert time.monotonic() - started < 29  # (stopped at the deadline, not after 30 s)
        assert httpx.get(s.base + "/healthz", timeout=5).status_code == 200
        after = httpx.post(s.base + "/backward", json=body, timeout=60)
        assert after.status_code in (200, 504), after.text  # (answered: lowered or not)
    finally:
        stop_server(s)


@needs_jax
def test_a_second_server_loads_the_executables_from_the_store(tmp_path: Path) -> None:
    """Two servers in turn on one store directory: the first lowers the program once (its
    lowering process), the second lowers nothing and answers its first request in XLA,
    from the executable the first left in the store."""
    env = {
        "GRADSERVE_PROGRAM_STORE_DIR": str(tmp_path / "store"),
        "GRADSERVE_MAX_BODY_BYTES": str(1 << 20),
    }
    metas, lowerings = [], []
    for name in ("first", "second"):
        os.makedirs(tmp_path / name)
        s = start_server(tmp_path / name, **env)
        try:
            metas.append(post(s, long_loop())["meta"])
            # On a loaded machine the first server's (niced) lowering can outlast the
            # worker's wait: its request is interpreted, and the executable lands later.
            until = time.monotonic() + 120
            while name == "first" and time.monotonic() < until:
                if _counter(s, "gradserve_xla_lowerings_total", 'outcome="xla"'):
                    break
                time.sleep(0.5)
            lowerings.append(_counter(s, "gradserve_xla_lowerings_total", 'outcome="xla"'))
        finally:
            stop_server(s)
    first, second = metas
    assert first["tier"] == "xla" or first["tier_reason"].startswith("compiling"), first
    assert second["tier"] == "xla", second
    assert lowerings == [1, 0]


def _counter(server: Server, name: str, labels: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    found = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def test_a_task_shares_the_cores() -> None:
    """Alone, every core; with others, its share, side by side; never more cores than
    the compute slots free with its own."""
    cpus = (0, 1, 2, 3)
    assert cores_for(2, [2], 8, cpus) == {0, 1, 2, 3}
    assert cores_for(0, [0, 5], 8, cpus) == {0, 1}
    assert cores_for(5, [0, 5], 8, cpus) == {2, 3}
    assert len(cores_for(1, [0, 1, 2, 3, 4], 8, cpus)) == 1
    assert cores_for(0, [0], 2, cpus) == {0, 1}  # (2 slots, 1 busy: 2 cores at most)
    assert cores_for(0, [0, 1], 2, cpus) == {0}
