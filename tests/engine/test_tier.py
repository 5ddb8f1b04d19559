"""The native tier's decisions, by predicted benefit, on a table of programs; its
bookkeeping; and the lowering queue and process, against a real program store."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph, xla
from gradserve.service import tier as tier_module
from gradserve.service.lowering import GONE, LoweringQueue, lowering_main
from gradserve.service.programs import Programs
from gradserve.service.settings import Settings
from gradserve.service.tier import Tier, predict

needs_jax = pytest.mark.skipif(not xla.available(), reason="jax is not importable here")
ROOT = Path(__file__).resolve().parents[2]


def _program(expr: str, **inputs: tuple[int, ...]) -> Any:
    spec = GraphSpec([NodeSpec("y", expr=expr)], ["y"])
    return compile_graph(
        spec, {k: TensorSpec(s, "float64", True) for k, s in inputs.items()}, backward=True
    )


def _chain(n: int) -> Any:
    """40 elementwise steps on `n` values, summed, differentiated."""
    return _program("sum(" + " + ".join(f"tanh(x * {k})" for k in range(40)) + ")", x=(n,))


def _loop(steps: int) -> Any:
    """A scan RNN on 4 values, `steps` long, differentiated."""
    body = {
        "carry": ["h"],
        "xs": ["x"],
        "next": {"h": "h2"},
        "nodes": [{"id": "h2", "expr": "0.95 * h + 0.05 * tanh(x + 1.1 * h)"}],
    }
    from gradserve.service.schemas import Graph

    graph = Graph.model_validate(
        {
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
        }
    )
    return compile_graph(
        graph,
        {"h0": TensorSpec((4,), "float64", True), "xs": TensorSpec((steps, 4), "float64", True)},
        backward=True,
    )


# ------------------------------------------------------------------ the decisions
def test_the_cost_model_on_a_table_of_programs() -> None:
    """A one-off long loop pays on its first run: lowered first. A tiny program never
    pays. A large kernel (one BLAS call) saves nothing: never. A mid-sized unrolled
    program saves a little a run: by reuse."""
    loop = predict(_loop(200_000))
    assert loop.saving_ms > loop.compile_ms  # (lowered before its first run)
    tiny = predict(_program("(x + x) * x", x=()))
    assert tiny.saving_ms < tier_module.MIN_SAVING_MS
    kernel = predict(_program("sum(x @ x)", x=(1024, 1024)))
    assert kernel.saving_ms < 0  # (XLA's kernels: no faster than NumPy's BLAS)
    chain = predict(_chain(8))
    assert 0 < chain.saving_ms < chain.compile_ms  # (it pays after some runs)
    assert chain.compile_ms / chain.saving_ms < 50_000


class _Queue:
    """A lowering queue that answers at once, with a fake executable."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.done: dict[str, Any] = {}

    def request(self, key: str, program: Any, device: str, predicted_ms: float) -> bool:
        self.asked.append(key)
        self.done[key] = (
            b"exe",
            {"device": device, "compile_ms": 7.0, "predicted_ms": predicted_ms},
        )
        return True

    def result(self, key: str) -> Any:
        return self.done.get(key)


class _FakeLowered:
    """A lowered program that takes `ms` a run (the tier's bookkeeping is what is tested)."""

    compile_ms = 7.0

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def run(self, inputs: Any, grad_outputs: Any) -> str:
        time.sleep(self.ms / 1000)
        return "result"


def _tier(monkeypatch: pytest.MonkeyPatch, speeds: dict[int, float]) -> tuple[Tier, _Queue]:
    tier = Tier(Settings(xla="auto", program_store_bytes=0), role="worker")
    tier.off, tier.queue = None, _Queue()  # type: ignore[assignment]
    monkeypatch.setattr(
        xla.Lowered,
        "load",
        classmethod(lambda cls, program, payload, meta: _FakeLowered(speeds[id(program)])),
    )
    return tier, tier.queue  # type: ignore[return-value]


def test_a_program_that_pays_on_its_first_run_is_lowered_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    program = _loop(200_000)
    tier, queue = _tier(monkeypatch, {id(program): 0.0})
    lowered, why = tier.choose("loop", program, "cpu", time.monotonic() + 60)
    assert why == "xla" and lowered is not None and queue.asked == ["loop"]


def test_a_tiny_program_is_never_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    program = _program("(x + x) * x", x=())
    tier, queue = _tier(monkeypatch, {})
    for _ in range(100):
        lowered, why = tier.choose("tiny", program, "cpu", time.monotonic() + 60)
        assert lowered is None
        why = tier.interpreted("tiny", program, run_ms=0.01)
    assert why.startswith("small: ") and queue.asked == []


def test_a_program_is_lowered_once_its_runs_would_have_paid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each interpreted run says how many more it takes; at that run the lowering is asked
    for (in the background: that run is still interpreted), and a later run finds it."""
    program = _chain(8)
    tier, queue = _tier(monkeypatch, {id(program): 0.0})
    p = predict(program)
    run_ms = p.xla_ms + 1.0  # (1 ms saved a run)
    need = next(n for n in itertools.count(1) if (run_ms - p.xla_ms) * n >= p.compile_ms)
    reasons = []
    for _ in range(need + 1):
        assert tier.choose("chain", program, "cpu", time.monotonic() + 60)[0] is None
        reasons.append(tier.interpreted("chain", program, run_ms=run_ms))
        if queue.asked:
            break
    assert re.fullmatch(
        r"cold: XLA would save ~1\.000 ms a run; lowered once it has run "
        r"\d+ times \(a ~\d+ ms compile\)",
        reasons[0],
    ), reasons[0]
    assert reasons[-1].startswith("compiling: ") and len(reasons) == need
    deadline = time.monotonic() + 5
    while tier.choose("chain", program, "cpu", time.monotonic() + 60)[1] != "xla":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_program_reused_is_expected_to_be_reused_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program whose saving pays for its compile within REUSE_EXPECTED runs is asked for
    at its second run (reuse seen), not its first (which may be its only one)."""
    program = _chain(8)
    tier, queue = _tier(monkeypatch, {id(program): 0.0})
    p = predict(program)
    saving = p.compile_ms / tier_module.REUSE_EXPECTED + 0.5
    assert saving < p.compile_ms  # (not paid by one run: not lowered before the first)
    first = tier.interpreted("chain", program, run_ms=p.xla_ms + saving)
    assert queue.asked == []
    assert re.fullmatch(r"cold: .*; lowered once it has run 2 times \(a ~\d+ ms compile\)", first)
    assert tier.interpreted("chain", program, run_ms=p.xla_ms + saving).startswith("compiling: ")
    assert queue.asked == ["chain"]


def test_a_lowered_program_slower_than_the_interpreter_goes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After TRIALS runs, a lowered program slower than its fastest interpreted run is
    refused for good (it says why), and a faster one stays."""
    slow, fast = (_chain(n) for n in (8, 9))
    tier, _queue = _tier(monkeypatch, {id(slow): 20.0, id(fast): 0.0})
    for key, program in (("slow", slow), ("fast", fast)):
        tier._ask(key, program, tier._seen_of(key, program), "cpu")
        tier.interpreted(key, program, run_ms=5.0)
        deadline = time.monotonic() + 5
        while tier.choose(key, program, "cpu", time.monotonic() + 60)[1] != "xla":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(tier_module.TRIALS):
            lowered, why = tier.choose(key, program, "cpu", time.monotonic() + 60)
            assert why == "xla"
            assert tier.run(key, lowered, {}, None) == ("result", "xla")
    assert tier.choose("fast", fast, "cpu", time.monotonic() + 60)[1] == "xla"
    lowered, why = tier.choose("slow", slow, "cpu", time.monotonic() + 60)
    assert lowered is None
    assert re.fullmatch(r"slower in XLA: 2\d\.\d{3} ms against 5\.000 ms interpreted", why), why


def test_the_front_process_keeps_the_books_but_never_loads_xla(tmp_path: Path) -> None:
    """The front process's tier counts the runs of the programs its lanes run, and notes an
    executable in the store (a worker then runs the program), but loads none itself: a
    payload that is no executable at all goes unread."""
    settings = Settings(xla="auto", program_store_dir=str(tmp_path / "store"))
    store = Programs(settings).store
    assert store is not None
    tier = Tier(settings, role="front", store=store)
    if tier.off is not None:
        pytest.skip(f"the tier is {tier.off} here")
    program = _program("sum(x * 2)", x=(3,))
    assert not tier.loads
    lowered, _ = tier.choose("a" * 32, program, "cpu", time.monotonic() + 5)
    assert lowered is None and not tier.lowered("a" * 32)
    assert tier.interpreted("a" * 32, program, 0.01).startswith("small: ")  # (its books)
    meta = {"device": "cpu", "compile_ms": 1.0, "memory_bytes": 8, "checks": [], "jax": "0"}
    store.put("x-" + "e" * 32, b"never read", meta)
    assert tier.choose("e" * 32, program, "cpu", time.monotonic() + 5)[0] is None
    assert tier.lowered("e" * 32)  # (there: a worker runs it)


# ------------------------------------------------------------------ the lowering process
@pytest.fixture
def store_settings(tmp_path: Path) -> Settings:
    return Settings(program_store_dir=str(tmp_path / "store"))


def _run_lowering(settings: Settings, until: Any, timeout: float = 120) -> list[Any]:
    """Run the lowering process (in a subprocess: jax is imported there) until `until()`.
    Spawned, not from this test process's forkserver: that one was started by whichever
    test came first, in whatever state it left."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, child = context.Pipe()
    proc = context.Process(
        target=lowering_main, args=(settings.model_dump_json(), child), daemon=True
    )
    proc.start()
    child.close()
    outcomes = []
    try:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline and proc.is_alive()
            while ours.poll(0.05):
                outcomes.append(ours.recv())
        while ours.poll(0.2):
            outcomes.append(ours.recv())
    finally:
        ours.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return outcomes


@needs_jax
def test_the_lowering_process_lowers_once_and_every_process_loads_it(
    store_settings: Settings,
) -> None:
    program = _loop(50)
    programs = Programs(store_settings)
    queue = LoweringQueue(programs.store)  # type: ignore[arg-type]
    assert queue.request("k" * 32, program, "cpu", 100.0)
    outcomes = _run_lowering(store_settings, lambda: queue.result("k" * 32) is not None)
    payload, meta = queue.result("k" * 32)  # type: ignore[misc]
    assert payload and isinstance(meta, dict) and meta["device"] == "cpu"
    assert [o[:2] for o in outcomes] == [("k" * 32, None)]
    h0, xs = np.full(4, 0.5), np.linspace(-1, 1, 200).reshape(50, 4)
    lowered = xla.Lowered.load(program, payload, meta)
    from gradserve.engine.graph import execute

    ran, interpreted = lowered.run({"h0": h0, "xs": xs}), execute(program, {"h0": h0, "xs": xs})
    np.testing.assert_allclose(ran.gradients["xs"], interpreted.gradients["xs"], rtol=1e-12)
    # A second request for it is answered from the store: nothing is queued.
    assert queue.request("k" * 32, program, "cpu", 100.0)
    assert list(queue.directory.glob("q-*")) == []


def test_a_lowering_cut_off_is_answered_with_why(store_settings: Settings) -> None:
    """A request claimed by a lowering process that is gone (killed mid-lowering) is
    answered GONE by the next one, never tried again."""
    programs = Programs(store_settings)
    queue = LoweringQueue(programs.store)  # type: ignore[arg-type]
    assert queue.request("d" * 32, _program("sum(x * 2)", x=(3,)), "cpu", 100.0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # (a pid no process has)
    (request,) = queue.directory.glob("q-*")
    os.replace(request, queue.directory / f"c-{'d' * 32}-{child.pid}")
    _run_lowering(store_settings, lambda: queue.result("d" * 32) is not None)
    assert queue.result("d" * 32) == (None, GONE)


def test_a_damaged_executable_is_refused_not_served(
    store_settings: Settings, tmp_path: Path
) -> None:
    programs = Programs(store_settings)
    store = programs.store
    assert store is not None
    program = _program("sum(x * 2)", x=(3,))
    store.put(
        "x-" + "e" * 32,
        b"not an executable",
        {"device": "cpu", "compile_ms": 1.0, "memory_bytes": 8, "checks": [], "jax": "0"},
    )
    tier = Tier(
        Settings(xla="auto", program_store_dir=str(tmp_path / "store")), role="worker", store=store
    )
    if tier.off is not None:
        pytest.skip(f"the tier is {tier.off} here")
    assert tier.choose("e" * 32, program, "cpu", time.monotonic() + 5)[0] is None
    why = tier.choose("e" * 32, program, "cpu", time.monotonic() + 5)[1]
    assert why.startswith("not loaded: "), why


def test_a_store_that_cannot_be_written_keeps_the_interpreter(
    store_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (the store's writes fail, as on ENOSPC) or a queue that cannot be
    written: no lowering is asked for, and the program stays interpreted, saying why."""
    programs = Programs(store_settings)
    store = programs.store
    assert store is not None
    queue = LoweringQueue(store)
    program = _program("sum(x * 2)", x=(3,))
    monkeypatch.setattr(store, "put", lambda *args, **kwargs: False)
    assert not queue.request("f" * 32, program, "cpu", 100.0)
    monkeypatch.undo()
    (tmp_path / "not-a-directory").write_bytes(b"")
    queue.directory = tmp_path / "not-a-directory"
    assert not queue.request("f" * 32, program, "cpu", 100.0)
    tier = Tier(store_settings, role="worker", store=store)
    tier.off, tier.queue = None, queue
    tier._ask("f" * 32, program, tier._seen_of("f" * 32, program), "cpu")
    lowered, why = tier.choose("f" * 32, program, "cpu", time.monotonic() + 5)
    assert lowered is None and why == "the program store cannot be written: no lowering"


@needs_jax
def test_what_jax_brought_is_frozen_after_the_first_load() -> None:
    """A process that imports jax to load its first executable then keeps jax's objects
    out of the cycle collector's sight (else each full collection walks ~80,000 of
    them)."""
    code = textwrap.dedent("""
        import gc, sys
        from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph, xla
        from gradserve.service import tier

        spec = GraphSpec([NodeSpec("y", expr="sum(tanh(x) * x)")], ["y"])
        program = compile_graph(spec, {"x": TensorSpec((8,), "float64", True)}, backward=True)
        payload, meta = xla.lower(program).export()
        assert any(o is sys.modules["jax"] for o in gc.get_objects())
        tier._freeze_jax()
        assert not any(o is sys.modules["jax"] for o in gc.get_objects())
        print("ok")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=180,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
