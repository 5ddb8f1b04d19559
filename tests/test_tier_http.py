"""The native tier over HTTP, against live servers: a hot program tiers up in the
background and answers the same; the requests before are interpreted, the one that makes
it hot too; a program the lowering refuses stays interpreted and says why; the tier
switched off, or jax absent, never tiers; a deadline passed in an XLA execution kills the
worker as in the interpreter; and a second server on the same store loads XLA's
executables rather than compiling them again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gradserve.engine.graph import xla
from gradserve.service.worker import cores_for
from tests.test_integration_service import Server, _start, _stop

pytestmark = pytest.mark.integration

needs_jax = pytest.mark.skipif(not xla.available(), reason="jax is not importable here")
HOT = 3
TIER_UP_S = 120  # (a compile on a loaded 2-core machine, after jax's import)


def seed(x: float = 2.0, y: float = 3.0) -> dict[str, Any]:
    """The contract's seed in float64: answered in the front process (a tiny request)."""
    return {"graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
            "inputs": {"x": {"data": x, "dtype": "float64", "requires_grad": True},
                       "y": {"data": y, "dtype": "float64", "requires_grad": True}}}


def rnn(steps: int = 1000) -> dict[str, Any]:
    """A scan RNN, h = 0.95 h + 0.05 tanh(x + 1.1 h) on 4 values, fwd+bwd: with 1,000
    steps a body too large for the front process, computed in a worker; with 100, one the
    front process computes (and still ~1 ms: a run that counts towards tiering up)."""
    rng = np.random.default_rng(0)
    body = {"carry": ["h"], "xs": ["x"], "next": {"h": "h2"},
            "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}]}
    return {"graph": {"nodes": [{"id": "rnn", "op": "scan", "args": ["h0", "xs"],
                                 "body": body, "results": {"h_end": "h"}},
                                {"id": "loss", "expr": "sum(h_end * h_end)"}],
                      "outputs": ["loss"]},
            "inputs": {"h0": {"data": rng.normal(size=4).tolist(), "dtype": "float64",
                              "requires_grad": True},
                       "xs": {"data": rng.normal(size=(steps, 4)).tolist(),
                              "dtype": "float64", "requires_grad": True}}}


NOT_LOWERED = "sin"  # (in the servers here: tests/hooks/sitecustomize.py)


def refused() -> dict[str, Any]:
    """A program with an op that has no lowering (`sin`, in a 100-step loop: a run long
    enough to count towards tiering up)."""
    body = rnn(100)
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
        assert got["meta"]["tier_reason"] == "compiling", got["meta"]
        time.sleep(0.05)
    raise AssertionError(f"no tier-up in {TIER_UP_S} s:\n{server.log_text()[-3000:]}")


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same outputs and gradients, to a relative 1e-12 (float64)."""
    for part in ("outputs", "gradients"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            x, y = a[part][name], b[part][name]
            assert (x["dtype"], x["shape"]) == (y["dtype"], y["shape"])
            np.testing.assert_allclose(np.asarray(x["data"]), np.asarray(y["data"]),
                                       rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _start(tmp_path_factory.mktemp("tier"), GRADSERVE_XLA_HOT_HITS=str(HOT),
               GRADSERVE_MAX_BODY_BYTES=str(1 << 20), GRADSERVE_TEST_NOT_LOWERED=NOT_LOWERED)
    yield s
    _stop(s)


@needs_jax
@pytest.mark.parametrize("steps", [100, 1000], ids=["front process", "worker"])
def test_a_hot_program_tiers_up_off_the_request_path(server: Server, steps: int) -> None:
    body = rnn(steps)
    first = [post(server, body) for _ in range(HOT)]
    # Cold, then the run that makes it hot: interpreted, without waiting for the compile.
    assert [m["meta"]["tier"] for m in first] == ["interpreter"] * HOT
    assert [m["meta"]["tier_reason"] for m in first] == ["cold"] * (HOT - 1) + ["compiling"]
    tiered = until_xla(server, body)
    assert tiered["meta"]["tier_reason"] is None
    assert_same(first[0], tiered)
    again = post(server, body)
    assert again["meta"]["tier"] == "xla"
    assert_same(first[0], again)


@needs_jax
def test_a_tiny_program_stays_interpreted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The seed runs in microseconds: too little to gain from a compile. It never counts
    towards tiering up, however often it comes. (Its own server, hot at the 20th run: the
    rule reads the fastest of the runs so far, and on a loaded machine the first few of a
    tiny program may all take longer than MIN_RUN_MS; the first always does, binding the
    kernels. Of 20, one is fast.)"""
    hot = 20
    tiny = _start(tmp_path_factory.mktemp("tiny"), GRADSERVE_XLA_HOT_HITS=str(hot))
    try:
        metas = [post(tiny, seed())["meta"] for _ in range(2 * hot)]
    finally:
        _stop(tiny)
    assert {m["tier"] for m in metas} == {"interpreter"}
    assert {m["tier_reason"] for m in metas} <= {"cold", "small"}
    assert metas[-1]["tier_reason"] == "small"


@needs_jax
def test_an_op_without_a_lowering_stays_interpreted_and_says_why(server: Server) -> None:
    reasons = []
    deadline = time.monotonic() + TIER_UP_S
    while time.monotonic() < deadline:
        meta = post(server, refused())["meta"]
        assert meta["tier"] == "interpreter"
        reasons.append(meta["tier_reason"])
        if reasons[-1] not in ("cold", "compiling"):
            break
        time.sleep(0.05)
    assert reasons[-1] == f"op {NOT_LOWERED!r} has no lowering", reasons
    assert post(server, refused())["meta"]["tier_reason"] == reasons[-1]  # (not retried)


def test_off_never_tiers(tmp_path: Path) -> None:
    s = _start(tmp_path, GRADSERVE_XLA="off", GRADSERVE_XLA_HOT_HITS="1",
               GRADSERVE_XLA_MIN_COST="1")
    try:
        metas = [post(s, seed())["meta"] for _ in range(4)]
        time.sleep(1)
        metas.append(post(s, seed())["meta"])
        assert {(m["tier"], m["tier_reason"]) for m in metas} == {("interpreter", "off")}
    finally:
        _stop(s)


def test_without_jax_everything_works_interpreted(tmp_path: Path) -> None:
    s = _start(tmp_path, GRADSERVE_TEST_NO_JAX="1", GRADSERVE_XLA_HOT_HITS="1")
    try:
        for body in (seed(), rnn(50), refused()):
            for _ in range(3):
                meta = post(s, body)["meta"]
                assert (meta["tier"], meta["tier_reason"]) == ("interpreter", "unavailable")
    finally:
        _stop(s)


@needs_jax
def test_a_deadline_during_an_xla_execution_kills_the_worker(tmp_path: Path) -> None:
    """The worker of a lowered program that runs past the deadline is killed, as one of
    the interpreter is: 504, and the server keeps answering (the next request, on a new
    worker, is interpreted: the tier is per process)."""
    s = _start(tmp_path, GRADSERVE_TEST_SLOW_XLA="30", GRADSERVE_REQUEST_TIMEOUT_S="5",
               GRADSERVE_XLA_HOT_HITS="1", GRADSERVE_MAX_BODY_BYTES=str(1 << 20),
               GRADSERVE_COMPUTE_WORKERS="1")
    try:
        body = rnn()
        assert post(s, body)["meta"]["tier_reason"] == "compiling"
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
        after = post(s, body)
        assert after["meta"]["tier"] == "interpreter"
    finally:
        _stop(s)


@needs_jax
def test_a_second_server_loads_the_executables_from_the_store(tmp_path: Path) -> None:
    """Two servers in turn on one store directory: the second tiers the same program up
    from XLA's executables that the first left there, compiling nothing again (the
    persistent cache gains no entry; its compile takes a fraction of the first's)."""
    store = tmp_path / "store"
    env = {"GRADSERVE_PROGRAM_STORE_DIR": str(store), "GRADSERVE_XLA_HOT_HITS": "1",
           "GRADSERVE_MAX_BODY_BYTES": str(1 << 20), "GRADSERVE_LOG_LEVEL": "info"}
    compiled = []
    entries = []
    for name in ("first", "second"):
        os.makedirs(tmp_path / name)
        s = _start(tmp_path / name, **env)
        try:
            until_xla(s, rnn())
            compiled.append(_compile_ms(s.log_text()))
        finally:
            _stop(s)
        entries.append(sorted(p.name for p in (store / "xla").iterdir()
                              if p.name.endswith("-cache")))
    assert entries[0], "the first server left no executable in the store"
    assert entries[1] == entries[0], (entries, compiled)
    assert compiled[1] < compiled[0], compiled


def _compile_ms(log: str) -> float:
    found = re.findall(r"runs in the native tier in .* from now on \(XLA compiled it in (\d+) ms",
                       log)
    assert found, log[-3000:]
    return float(found[-1])


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


class _FakeLowered:
    """A lowered program that takes `ms` a run (the tier's bookkeeping is what is tested)."""

    compile_ms = 1.0

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def run(self, inputs: Any, grad_outputs: Any) -> str:
        time.sleep(self.ms / 1000)
        return "result"


def test_a_lowered_program_slower_than_the_interpreter_goes_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After TRIALS runs, a lowered program slower than its fastest interpreted run is
    refused for good (it says why), and a faster one stays."""
    from gradserve.service import tier as tier_module
    from gradserve.service.settings import Settings

    speeds = {"slow": 20.0, "fast": 0.0}
    monkeypatch.setattr(tier_module.xla, "available", lambda: True)
    monkeypatch.setattr(tier_module.xla, "lower",
                        lambda program, device: _FakeLowered(speeds[program.name]))
    tier = tier_module.Tier(Settings(xla="auto", xla_hot_hits=1, program_store_bytes=0))
    tier.off = None  # (jax itself is not needed: `lower` is the fake above)
    program = type("Program", (), {"compute_cost": 0})
    for key in speeds:
        p = program()
        p.name = key
        assert tier.choose(key) == (None, "cold")
        assert tier.interpreted(key, p, "cpu", run_ms=5.0) == "compiling"
    deadline = time.monotonic() + 10
    while not all(tier.choose(k)[0] for k in speeds):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for key in speeds:
        for _ in range(tier_module.TRIALS):
            lowered, why = tier.choose(key)
            assert why == "xla"
            assert tier.run(key, lowered, {}, None) == ("result", "xla")
    assert tier.choose("fast")[1] == "xla"
    lowered, why = tier.choose("slow")
    assert lowered is None
    assert re.fullmatch(r"slower in XLA: 2\d\.\d{3} ms against 5\.000 ms interpreted", why), why


@needs_jax
def test_what_jax_brought_is_frozen_after_the_first_lowering() -> None:
    """A process that imports jax for its first hot program then keeps jax's objects out
    of the cycle collector's sight (else each full collection walks ~80,000 of them): in
    a fresh process, jax's module is tracked by the collector before the tier's first
    lowering ends, and no longer after it."""
    code = textwrap.dedent("""
        import gc, sys, time
        from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph
        from gradserve.service.settings import Settings
        from gradserve.service.tier import Tier

        spec = GraphSpec([NodeSpec("y", expr="sum(tanh(x) * x)")], ["y"])
        program = compile_graph(spec, {"x": TensorSpec((8,), "float64", True)}, backward=True)
        tier = Tier(Settings(xla_hot_hits=1, program_store_bytes=0))
        assert "jax" not in sys.modules
        tier.interpreted("k", program, "cpu", 1.0)
        deadline = time.monotonic() + 120
        while tier.choose("k")[0] is None or tier._worker is not None:
            assert time.monotonic() < deadline, tier.choose("k")
            time.sleep(0.05)
        assert not any(o is sys.modules["jax"] for o in gc.get_objects())
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, cwd=Path(__file__).resolve().parents[1], timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
