"""The native tier: a process's hot programs, lowered to XLA (engine/graph/xla.py) in a
background thread and swapped in when ready, while the interpreter keeps answering.

A program is hot at its `GRADSERVE_XLA_HOT_HITS`-th run in a process, or at its first
when its planned compute cost is `GRADSERVE_XLA_MIN_COST` or more; but never while its
fastest interpreted run took less than `MIN_RUN_MS` (the fastest, because a loaded machine
slows any one run): such a run has under a tenth of a millisecond to gain, little beside
a request's own ~1 ms over HTTP, for a compile (a core for 0.1-1 s) and an executable kept
in memory; and a tiny program like the seed would get slower, XLA's own call (the inputs
checked and copied in, the results out) costing ~14 µs. The run that makes it hot is
still interpreted: it only queues the program. A lowered program is also timed: if its
fastest of its first `TRIALS` runs is slower than its fastest interpreted one (one large
BLAS call, which NumPy's BLAS does faster than XLA's CPU kernels), it goes back to the
interpreter for good. One thread per process compiles the queue, one program at a time,
and exits when it is empty; the queue is bounded (a program that finds it full is queued
at a later run). A program the lowering refuses (an op without a lowering, XLA's memory
over the plan) or that fails to compile is remembered with the reason and not tried again
by this process.

XLA's executables go in the program store's directory (`xla/`, JAX's persistent
compilation cache), so that another process of the host, or a restart on a persistent
store, compiles a program it lowers again from the cache, not from scratch.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import Program, RunResult, xla
from gradserve.service.programs import Lru
from gradserve.service.settings import Settings

if TYPE_CHECKING:
    from gradserve.engine.graph.xla import Lowered

log = logging.getLogger("gradserve.tier")

QUEUE = 8  # programs waiting to be compiled, per process
LOWERED = 128  # lowered programs kept per process, the least recently used out
REMEMBERED = 8192  # programs whose hits or refusals a process remembers
CPUS = tuple(sorted(os.sched_getaffinity(0)))  # the cores the server may use (its cpuset)
XLA_STORE = "xla"  # the subdirectory of the program store that holds XLA's executables

# A program the interpreter ever ran faster than this is not lowered. Measured (2 cores,
# in process): the seed, 0.011 ms interpreted, 0.014 lowered; a 79-step program, 0.049
# and 0.016: faster, but by 0.03 ms a request.
MIN_RUN_MS = 0.1
TRIALS = 3  # runs of a lowered program timed against the interpreter's fastest

INTERPRETER, XLA = "interpreter", "xla"
# Why the interpreter answered (meta.tier_reason), besides a refusal's own reason.
OFF, UNAVAILABLE, COLD, COMPILING, SMALL = "off", "unavailable", "cold", "compiling", "small"


class Tier:
    """A process's native tier (see the module's docstring). Thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.off = OFF if settings.xla == "off" else None if _installed() else UNAVAILABLE
        # program key -> (its runs so far, its fastest interpreted run in ms)
        self._hits: Lru = Lru(REMEMBERED)
        self._refused: Lru = Lru(REMEMBERED)  # program key -> why it stays interpreted
        self._lowered: Lru = Lru(LOWERED)  # program key -> Lowered
        self._trials: Lru = Lru(LOWERED)  # program key -> its lowered runs' times, in ms
        self._queue: deque[tuple[str, Program, str]] = deque()
        self._queued: set[str] = set()  # waiting or compiling
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._ended: list[tuple[str, str | None, float]] = []  # lowerings not yet reported

    def choose(self, key: str) -> tuple[Lowered | None, str]:
        """One run of program `key`: its lowered program, or None and why the interpreter
        answers this run (COLD: not known to be hot yet; the caller then says how long the
        run took, `interpreted`)."""
        if self.off is not None:
            return None, self.off
        lowered = self._lowered.get(key)
        if lowered is not None:
            return lowered, XLA
        refused = self._refused.get(key)
        if refused is not None:
            return None, refused
        with self._lock:
            return None, COMPILING if key in self._queued else COLD

    def interpreted(self, key: str, program: Program, device: str, run_ms: float) -> str:
        """A COLD run of program `key` took `run_ms` in the interpreter: count it, and queue
        the program if that makes it hot. Returns why the interpreter answered it."""
        costly = program.compute_cost >= self.settings.xla_min_cost
        with self._lock:
            if key in self._queued:
                return COMPILING
            hits, fastest = self._hits.get(key, (0, run_ms))
            hits, fastest = hits + 1, min(fastest, run_ms)
            self._hits.put(key, (hits, fastest))
            if fastest < MIN_RUN_MS and not costly:
                return SMALL
            if (hits < self.settings.xla_hot_hits and not costly) or len(self._queue) >= QUEUE:
                return COLD
            self._queue.append((key, program, device))
            self._queued.add(key)
            if self._worker is None:
                self._worker = threading.Thread(target=self._compile_all, daemon=True,
                                                name="gradserve-xla")
                self._worker.start()
        return COMPILING

    def run(self, key: str, lowered: Lowered, inputs: Mapping[str, np.ndarray],
            grad_outputs: Mapping[str, np.ndarray] | None) -> tuple[RunResult | None, str]:
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

    def _timed(self, key: str, run_ms: float) -> None:
        """One of the first TRIALS runs of lowered program `key` took `run_ms`: after the
        last, the program goes back to the interpreter if it was faster there."""
        trials = self._trials.get(key)
        if trials is None or len(trials) >= TRIALS:
            return
        trials.append(run_ms)
        if len(trials) < TRIALS:
            return
        interpreted = self._hits.get(key, (0, float("inf")))[1]
        if min(trials) > interpreted:
            reason = (f"slower in XLA: {min(trials):.3f} ms against {interpreted:.3f} ms "
                      "interpreted")
            log.info("program %s goes back to the interpreter: %s", key, reason)
            self._lowered.pop(key, None)
            self._refused.put(key, reason)

    def _compile_all(self) -> None:
        """The background thread: compile the queue, then exit. It may use every core
        the server may (a worker narrows its threads to its share for each task: see
        service/worker.py `share_cores`): XLA sizes its thread pool, once, by the
        cores of the thread that first compiles."""
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, CPUS)
        if not xla.available():  # (installed, and broken: no tier, and no queue)
            with self._lock:
                self.off, self._worker = UNAVAILABLE, None
                self._queue.clear()
                self._queued.clear()
            return
        _use_store(self.settings.program_store_dir if self.settings.program_store_bytes
                   else None, self.settings.program_store_bytes)
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                key, program, device = self._queue.popleft()
            try:
                lowered = xla.lower(program, device)
            except xla.NotLowerable as exc:
                ended: tuple[str, str | None, float] = (key, exc.reason, 0.0)
                self._refused.put(key, exc.reason)
            except Exception as exc:  # (XLA's own errors: the program stays interpreted)
                log.exception("program %s could not be lowered", key)
                ended = (key, f"lowering failed: {type(exc).__name__}", 0.0)
                self._refused.put(key, ended[1])
            else:
                self._trials.put(key, [])
                self._lowered.put(key, lowered)
                ended = (key, None, lowered.compile_ms)
            with self._lock:
                self._queued.discard(key)
                self._ended.append(ended)
                del self._ended[:-QUEUE * 8]  # (a process that never reports keeps the last)
            del program
            _freeze_jax()

    def ended(self) -> list[tuple[str, str | None, float]]:
        """The lowerings that ended since the last call (for the front process's metrics and
        log: a worker has neither)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended


_jax_frozen = False


def _freeze_jax() -> None:
    """After a process's first lowering, what jax brought (its modules, XLA's client, their
    caches: ~80,000 objects) lives as long as the process: out of the cycle collector's
    sight, as the process's own start-up is (service/app.py, service/worker.py). Else
    every full collection walks it, ~18 ms (in the front process, on the event loop). Once:
    what later lowerings make may be garbage in cycles, for the collector to free."""
    global _jax_frozen
    if not _jax_frozen:
        _jax_frozen = True
        gc.collect()
        gc.freeze()


def _installed() -> bool:
    """Whether jax is installed, without importing it (~1 s, and its memory: a process
    imports it when a program first gets hot, in the background; `xla.available` then says
    whether it imports)."""
    try:
        return importlib.util.find_spec("jax") is not None
    except ImportError:  # (an import hook that refuses it)
        return False


_store_lock = threading.Lock()
_store_dir: str | None = None


def _use_store(directory: str | None, max_bytes: int) -> None:
    """Point JAX's persistent compilation cache at the store's `xla/`, bounded like the
    store, least recently used out; every executable is kept, however quick its compile.
    JAX's configuration is process-wide: a process's last store is the one used (one, but
    for the test suite's many in-process servers)."""
    global _store_dir
    if directory is None:
        return
    path = os.path.join(directory, XLA_STORE)
    with _store_lock:
        if _store_dir == path:
            return
        import jax
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_compilation_cache_max_size", max_bytes)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()  # (it opens the directory at its first use)
        _store_dir = path
