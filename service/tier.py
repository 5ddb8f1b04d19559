"""The native tier: programs lowered to XLA (engine/graph/xla.py), decided by their
predicted benefit, lowered once per host by the lowering process (service/lowering.py),
and loaded by every process that runs them from the program store.

A program's benefit is predicted from cheap facts of it (`predict`): its interpreted time
(the steps it executes, loop iterations included, at the interpreter's cost a step, plus
its cost units at the interpreter's rate; replaced by the fastest run it has made), its
time in XLA (one call, plus its cost units at XLA's rate), and XLA's compile time (from
its size, scaled by what this host's lowerings have taken against what was predicted).
Then, in a compute worker:

- when one run saves more than the compile (a long loop over small values: a GradBench
  descent), the program is lowered before it runs: the worker asks, waits, loads, runs;
- when it saves something, it is lowered once the runs it is expected to have yet would
  pay for the compile (reuse seen is reuse to come: as many runs again as it has had, and
  at least 8 once it has run twice: a program sent again is seldom sent only twice), in
  the background: the interpreter answers meanwhile;
- when it saves nothing worth a compile (a tiny program, a large BLAS call XLA's kernels
  do more slowly), never.

`meta.tier_reason` says which, with the figures. A lowered program's first runs are timed:
slower than its fastest interpreted run, it goes back to the interpreter for good.

The front process's tier keeps the same books of the programs its lanes run (their runs,
and asking for a lowering once they would have paid for it), but never loads XLA: a
program whose executable is in the store runs in a worker from then on
(`lowered`; the lane sends it on: compute.Misplaced).

The lowering process does every lowering of the host (niced, one at a time), writes the
executable into the program store (`x-` entries: XLA's own serialisation, no pickle) or
the reason it could not (`r-` entries), and every process loads it from there: a program
is lowered once per host, surviving recycled workers and restarts on a persistent store.
The front process never loads XLA: its lanes run programs of some milliseconds at most,
interpreted (importing jax there would cost its event loop its memory and collector).
Without a program store there is no lowering process, and no tier.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import Program, RunResult
from gradserve.engine.graph.compiler import rolled_fraction
from gradserve.engine.graph.scan import compiled_steps, executed_steps
from gradserve.service.lowering import LoweringQueue
from gradserve.service.programs import Lru
from gradserve.service.settings import Settings

if TYPE_CHECKING:
    from gradserve.engine.graph.xla import Lowered
    from gradserve.service.store import Store

log = logging.getLogger("gradserve.tier")

LOWERED = 128  # lowered programs kept per process, the least recently used out
REMEMBERED = 8192  # programs whose runs and decisions a process remembers
CPUS = tuple(sorted(os.sched_getaffinity(0)))  # the cores the server may use (its cpuset)
TRIALS = 3  # runs of a lowered program timed against the interpreter's fastest

# The cost model (measured on 2 cores here, 2026-12-02; fitted, then rounded up where a
# wrong guess costs a compile): the interpreter runs a step in ~1.2 us and ~1.5e8 cost
# units a ms (BLAS), each op reading and writing its arrays in full; XLA fuses a chain of
# ops into one kernel that reads its inputs once, so its time is not in cost units: one
# call (~0.25 ms with its arguments' checks), its flops at ~1.1e8 a ms (its CPU kernels:
# NumPy's BLAS is faster on one large matmul), and the bytes the
# program's ops move at ~1.5e8 a ms (fitted on 13 programs, 2026-12-07: GradBench's ode,
# llsq, lse, kmeans, gmm and ba, the cell, det; within 2x of the measured time but for
# one large k-means, where it is optimistic: the first runs' trial catches that). XLA
# compiles in ~150 ms plus ~2 ms a step (a 941-step recurrent cell: 6 s; a 1,000-step
# chain: 1 s).
INTERPRETER_STEP_MS = 1.2e-3
INTERPRETER_UNITS_MS = 1.5e8
XLA_CALL_MS = 0.25
XLA_STEP_MS = 5e-5
XLA_FLOPS_MS = 1.1e8
XLA_BYTES_MS = 1.5e8
COMPILE_BASE_MS = 150.0
COMPILE_STEP_MS = 2.0
LOAD_MS = 50.0  # loading a stored executable
# Programs this many steps or more are looked at for loops to roll (~1 ms for 1,000 steps)
# when their compile is predicted: below, the base of the compile is most of it.
ROLL_LOOKED_AT_STEPS = 100
JAX_IMPORT_MS = 900.0  # a process's first load imports jax (and starts XLA's client) first
# A saving under this a run is not worth an executable kept in memory, whatever the reuse.
MIN_SAVING_MS = 0.05
# Runs to come that a program run twice is expected to have at least (a loop, a benchmark's
# repetitions: a program sent again is seldom sent only twice); later, as many as it has had.
REUSE_EXPECTED = 8
# What a run costs more in a worker than in the front process's lanes (a pipe each way, two
# processes woken; measured ~0.8-1 ms here): a program that the front runs pays it once
# lowered (a worker runs it then), so its saving is counted net of it.
WORKER_HOP_MS = 1.0
# How long a worker waits for the lowering of a program that pays on its first run,
# beyond the predicted compile (the lowering process may be busy with another).
WAIT_EXTRA_S = 5.0
# How often a process looks in the store for a program's executable (a missed file open,
# ~10 us), whoever asked for it (this process, another worker, the front process's books):
# a program run every few ms runs in XLA within a few runs of its lowering.
LOOK_EVERY_S = 0.1

INTERPRETER, XLA = "interpreter", "xla"
ELSEWHERE: Any = object()  # what the front process keeps of an executable: it is there
# Why the interpreter answered (meta.tier_reason), besides a refusal's own reason and the
# decisions' texts (`reason`).
OFF, UNAVAILABLE, NO_STORE, FAST_LANE, ANOMALY = (
    "off",
    "unavailable",
    "no program store: no lowering process",
    "fast lane: interpreted (the front process does not load XLA)",
    "detect_anomaly: interpreted, every step looked at",
)


@dataclass(frozen=True)
class Prediction:
    """What a program is predicted to take: a run interpreted, a run in XLA, and XLA's
    compile, in ms."""

    interpreted_ms: float
    xla_ms: float
    compile_ms: float

    @property
    def saving_ms(self) -> float:
        return self.interpreted_ms - self.xla_ms


def predict(program: Program, compile_scale: float = 1.0) -> Prediction:
    """The cost model (see the module's docstring). XLA compiles the program with its
    unrolled loops rolled (xla.lower): a program large enough for that to matter is sized
    as rolled."""
    executed = executed_steps(program)
    cost = program.compute_cost
    compiled = compiled_steps(program)
    if compiled >= ROLL_LOOKED_AT_STEPS:
        if program.rolled_fraction is None:
            program.rolled_fraction = rolled_fraction(program)
        compiled = int(compiled * program.rolled_fraction)
    return Prediction(
        interpreted_ms=executed * INTERPRETER_STEP_MS + cost / INTERPRETER_UNITS_MS,
        xla_ms=XLA_CALL_MS
        + executed * XLA_STEP_MS
        + program.flops / XLA_FLOPS_MS
        + program.bytes_moved / XLA_BYTES_MS,
        compile_ms=(COMPILE_BASE_MS + compiled * COMPILE_STEP_MS) * compile_scale,
    )


@dataclass
class _Seen:
    """What this process knows of a program: its prediction, its interpreted runs (how
    many, the fastest), and where its lowering stands."""

    prediction: Prediction
    device: str = "cpu"
    runs: int = 0
    fastest_ms: float = float("inf")
    asked: float = 0.0  # time.monotonic() when its lowering was asked for (0: not)
    looked: float = 0.0  # when the store was last looked at for its executable


class Tier:
    """A process's native tier (see the module's docstring). Thread-safe."""

    def __init__(self, settings: Settings, role: str, store: Store | None = None) -> None:
        self.settings = settings
        self.off: str | None = off_reason(settings)
        self.loads = role != "front"  # (the front process keeps the books, and loads nothing)
        self.hop_ms = 0.0 if self.loads else WORKER_HOP_MS  # (XLA's runs are a worker's)
        # Called when this process asks for a lowering (the front process has its idle
        # workers load XLA meanwhile: Pool.prepare_xla).
        self.on_ask: Callable[[], None] | None = None
        self.queue = None if self.off is not None or store is None else LoweringQueue(store)
        self._seen: Lru = Lru(REMEMBERED)  # program key -> _Seen
        self._refused: Lru = Lru(REMEMBERED)  # program key -> why it stays interpreted
        self._lowered: Lru = Lru(LOWERED)  # program key -> Lowered
        self._trials: Lru = Lru(LOWERED)  # program key -> its lowered runs' times, in ms
        self._lock = threading.Lock()
        self._ended: list[str] = []  # programs whose executables were loaded, not yet reported
        # (what, predicted ms, measured ms) not yet reported: the model against outcomes
        self._outcomes: list[tuple[str, float, float]] = []
        self._scale = 1.0  # this host's compile times against the model's, as seen

    def lowered(self, key: str) -> bool:
        """Whether program `key` has an executable: loaded here (a worker), or seen in the
        store (the front process, which loads none: a worker runs it)."""
        return self._lowered.get(key) is not None

    # ------------------------------------------------------------------ a run
    def choose(
        self, key: str, program: Program, device: str, deadline: float
    ) -> tuple[Lowered | None, str]:
        """One run of program `key`: its lowered program, or None and why the interpreter
        answers this run. A program that pays on its first run is lowered first (this
        waits for the lowering process, within `deadline`)."""
        if self.off is not None:
            return None, self.off
        lowered = self._lowered.get(key)
        if lowered is not None and self.loads:
            return lowered, XLA
        refused = self._refused.get(key)
        if refused is not None:
            return None, refused
        seen = self._seen_of(key, program)
        seen.device = device
        if self._look(key, program, device, seen):
            return self._lowered.get(key), XLA
        p = seen.prediction
        if (
            self.loads
            and seen.runs == 0
            and not seen.asked
            and p.saving_ms > p.compile_ms + _load_ms()
        ):
            lowered = self._lower_first(key, program, device, seen, deadline)
            if lowered is not None:
                return lowered, XLA
            refused = self._refused.get(key)
            if refused is not None:
                return None, refused
        return None, self.reason(seen)

    def interpreted(self, key: str, program: Program, run_ms: float) -> str:
        """An interpreted run of `key` took `run_ms`: count it, ask for the program's
        lowering when its runs to come would pay for it, and say why the interpreter
        answered."""
        if self.off is not None:
            return self.off
        seen = self._seen_of(key, program)
        with self._lock:
            if seen.runs == 0:
                self._outcomes.append(("interpreted", seen.prediction.interpreted_ms, run_ms))
            seen.runs += 1
            seen.fastest_ms = min(seen.fastest_ms, run_ms)
        refused = self._refused.get(key)
        if refused is not None:
            return refused
        saving = seen.fastest_ms - seen.prediction.xla_ms - self.hop_ms
        if saving < MIN_SAVING_MS:
            reason = (
                f"small: XLA would save {max(saving, 0.0):.3f} ms a run at most "
                f"(interpreted in {seen.fastest_ms:.3f} ms)"
            )
            self._refused.put(key, reason)
            return reason
        if not seen.asked and saving * _runs_to_come(seen.runs) >= seen.prediction.compile_ms:
            self._ask(key, program, seen, seen.device)
        return self.reason(seen)

    def reason(self, seen: _Seen) -> str:
        """Why the interpreter answers a run of a program not lowered (yet)."""
        p = seen.prediction
        if seen.asked:
            return f"compiling: predicted {p.compile_ms:.0f} ms, in the lowering process"
        interpreted = seen.fastest_ms if seen.runs else p.interpreted_ms
        saving = interpreted - p.xla_ms - self.hop_ms
        if saving <= 0:
            return f"cold: XLA predicted no faster ({p.xla_ms:.3f} ms a run)"
        runs = 2 if saving * REUSE_EXPECTED >= p.compile_ms else int(p.compile_ms / saving) + 1
        return (
            f"cold: XLA would save ~{saving:.3f} ms a run; lowered once it has run "
            f"{runs} times (a ~{p.compile_ms:.0f} ms compile)"
        )

    def run(
        self,
        key: str,
        lowered: Lowered,
        inputs: Mapping[str, np.ndarray],
        grad_outputs: Mapping[str, np.ndarray] | None,
    ) -> tuple[RunResult | None, str]:
        """Run a lowered program: its result and XLA, or None and why, when XLA failed
        where the interpreter would not (the program is refused from now on, and the
        caller interprets it)."""
        try:
            started = time.perf_counter()
            result = lowered.run(inputs, grad_outputs)
            self._timed(key, (time.perf_counter() - started) * 1000)
            return result, XLA
        except GradserveError:  # (this request's own: the interpreter's, checked on the host)
            raise
        except Exception as exc:  # (a bug of the lowering: the interpreter answers)
            log.exception("program %s failed in the native tier; it stays interpreted", key)
            reason = f"failed in XLA: {type(exc).__name__}"
            self._lowered.pop(key, None)
            self._refused.put(key, reason)
            return None, reason

    # ------------------------------------------------------------------ lowering
    def _seen_of(self, key: str, program: Program) -> _Seen:
        seen = self._seen.get(key)
        if seen is None:
            seen = _Seen(predict(program, self._scale))
            self._seen.put(key, seen)
        return seen

    def _ask(self, key: str, program: Program, seen: _Seen, device: str) -> None:
        """Ask the lowering process for `key` (its program written to the store first:
        that is where the lowering process finds it)."""
        assert self.queue is not None
        seen.asked = time.monotonic()
        if not self.queue.request(key, program, device, seen.prediction.compile_ms):
            self._refused.put(key, "the program store cannot be written: no lowering")
        elif self.on_ask is not None:
            self.on_ask()

    def prepare(self) -> None:
        """Load XLA (import jax, ~0.9 s) ahead of a first executable to load: a lowering
        asked for compiles meanwhile, so the first run in XLA waits for neither."""
        if self.off is None and self.loads:
            from gradserve.engine.graph import xla

            if xla.available():
                _freeze_jax()

    def _look(self, key: str, program: Program, device: str, seen: _Seen) -> bool:
        """Whether the program's executable is loaded now: looked for in the store (every
        LOOK_EVERY_S), and loaded; a refusal there is remembered. (A load in the background
        would hold the GIL for its import: it is done here, once per process and program.)
        The front process loads nothing: it notes the executable as there (`lowered`)."""
        now = time.monotonic()
        if seen.looked and now - seen.looked < LOOK_EVERY_S:
            return False
        seen.looked = now
        assert self.queue is not None
        found = self.queue.result(key)
        if found is None:
            if seen.asked and now - seen.asked > 60 + 2 * seen.prediction.compile_ms / 1000:
                self._refused.put(
                    key,
                    "compiling gave no answer in the time it could take "
                    "(the lowering process is gone, or its store full?)",
                )
            return False
        return self._load(key, program, device, found)

    def _load(
        self,
        key: str,
        program: Program,
        device: str,
        found: tuple[bytes | None, dict[str, Any] | str],
    ) -> bool:
        from gradserve.engine.graph import xla

        payload, meta = found
        if payload is None or isinstance(meta, str):
            self._refused.put(key, str(meta))
            return False
        if meta.get("device") != device:
            return False
        if not self.loads:
            self._lowered.put(key, ELSEWHERE)
            return False
        try:
            lowered = xla.Lowered.load(program, payload, meta)
        except xla.NotLowerable as exc:
            self._refused.put(key, f"not loaded: {exc.reason}")
            return False
        _freeze_jax()
        seen = self._seen.get(key)
        if seen is not None and seen.asked:
            self._outcomes.append(("compile", seen.prediction.compile_ms, lowered.compile_ms))
        with self._lock:
            self._ended.append(key)
            if meta.get("predicted_ms"):
                self._scale = _blend(self._scale, lowered.compile_ms / meta["predicted_ms"])
        self._trials.put(key, [])
        self._lowered.put(key, lowered)
        return True

    def _lower_first(
        self, key: str, program: Program, device: str, seen: _Seen, deadline: float
    ) -> Lowered | None:
        """A program that pays on its first run: asked for, and waited for (the predicted
        compile and WAIT_EXTRA_S, within the request's deadline)."""
        self._ask(key, program, seen, device)
        until = min(
            deadline - 1.0, time.monotonic() + seen.prediction.compile_ms / 1000 + WAIT_EXTRA_S
        )
        assert self.queue is not None
        while time.monotonic() < until and self._refused.get(key) is None:
            found = self.queue.result(key)
            if found is not None:
                return self._lowered.get(key) if self._load(key, program, device, found) else None
            time.sleep(0.02)
        return None

    def _timed(self, key: str, run_ms: float) -> None:
        """One of the first TRIALS runs of lowered program `key` took `run_ms`: after the
        last, the program goes back to the interpreter if it was faster there."""
        trials = self._trials.get(key)
        if trials is None or len(trials) >= TRIALS:
            return
        trials.append(run_ms)
        if len(trials) < TRIALS:
            return
        seen = self._seen.get(key)
        if seen is not None:
            self._outcomes.append(("xla", seen.prediction.xla_ms, min(trials)))
        interpreted = seen.fastest_ms if seen is not None else float("inf")
        if min(trials) > interpreted:
            reason = f"slower in XLA: {min(trials):.3f} ms against {interpreted:.3f} ms interpreted"
            log.info("program %s goes back to the interpreter: %s", key, reason)
            self._lowered.pop(key, None)
            self._refused.put(key, reason)

    def ended(self) -> tuple[list[str], list[tuple[str, float, float]]]:
        """The executables loaded, and the model's predictions against what was measured,
        since the last call (for the front process's metrics and log)."""
        with self._lock:
            ended, self._ended = self._ended, []
            outcomes, self._outcomes = self._outcomes, []
        return ended, outcomes


_jax_frozen = False


def _freeze_jax() -> None:
    """After a process first imports jax (to load its first executable), what jax brought
    (its modules, XLA's client, their caches: ~80,000 objects) lives as long as the
    process: out of the cycle collector's sight, as the process's own start-up is. Else
    every full collection walks it, ~18 ms. Once: what later loads make may be garbage in
    cycles, for the collector to free."""
    global _jax_frozen
    if not _jax_frozen:
        _jax_frozen = True
        gc.collect()
        gc.freeze()


def _runs_to_come(runs: int) -> int:
    """The runs a program that has run `runs` times is expected to have yet: as many again
    (reuse seen is reuse to come), and at least REUSE_EXPECTED once it has been reused."""
    return max(runs, REUSE_EXPECTED) if runs >= 2 else runs


def _load_ms() -> float:
    """What loading an executable costs this process now: jax's import too, the first
    time."""
    return LOAD_MS + (0.0 if "jax" in sys.modules else JAX_IMPORT_MS)


def _blend(scale: float, ratio: float) -> float:
    """The compile scale moved halfway (in log terms) towards what one lowering showed."""
    ratio = min(max(ratio, 0.1), 20.0)
    return float(np.sqrt(scale * ratio))


def off_reason(settings: Settings) -> str | None:
    """Why a server with these settings has no tier (no lowering process), or None."""
    if settings.xla == "off":
        return OFF
    if not installed():
        return UNAVAILABLE
    if settings.program_store_dir is None or not settings.program_store_bytes:
        return NO_STORE
    return None


def installed() -> bool:
    """Whether jax is installed, without importing it (~1.5 s, and its memory: a process
    imports it when it first loads an executable)."""
    try:
        return importlib.util.find_spec("jax") is not None
    except ImportError:  # (an import hook that refuses it)
        return False
