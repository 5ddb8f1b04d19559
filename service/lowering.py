"""The lowering process: every lowering of a host's programs to XLA, one at a time, off the
serving processes (service/tier.py decides which).

A process that wants a program lowered writes the program to the store (a `p-` entry, as
any stored program) and a request file into the store's `lowering/` directory
(`LoweringQueue.request`). The lowering process claims a request (renames it to carry its
own pid), loads the program, lowers it (engine/graph/xla.py: traced and compiled by XLA,
within the program's planned memory), and writes the result into the store: the
executable (an `x-` entry: XLA's own serialisation and what loading it needs, no pickle),
or why it could not be lowered (an `r-` entry). Every process of the host then loads the
executable from there (`LoweringQueue.result`).

It runs at the lowest CPU priority (nice 19), so that a compile of seconds takes the cores
only when nothing else wants them, and within a memory bound: the front process stops it
when its RSS passes `GRADSERVE_XLA_LOWERING_MEMORY_BYTES`, and starts another (`Lowerer`).
A request whose lowering was cut off (the process killed or gone mid-way) is answered with
that reason, never tried again: the program stays interpreted, and says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson

from gradserve.engine.errors import GradserveError
from gradserve.engine.graph import Program
from gradserve.engine.graph.serial import CorruptProgram, Unstorable, dump_program, load_program
from gradserve.service.programs import Programs, program_meta
from gradserve.service.settings import Settings
from gradserve.service.store import Store

log = logging.getLogger("gradserve.tier")

QUEUE_DIR = "lowering"  # in the store's directory
POLL_S = 0.05  # how often the lowering process looks for requests
NICENESS = 19
PROCESS_NAME = "gradserve-lower"  # what ps and top show (15 bytes: the kernel's limit)
UNIMPORTABLE = "jax cannot be imported in the lowering process"
GONE = (
    "the lowering process was stopped while it lowered this program (killed, or past "
    "its memory bound)"
)


class LoweringQueue:
    """Requests for lowerings, and their results, in a program store's directory."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.directory = Path(store.directory) / QUEUE_DIR
        with contextlib.suppress(OSError):
            self.directory.mkdir(exist_ok=True)

    def request(self, key: str, program: Program, device: str, predicted_ms: float) -> bool:
        """Ask for the lowering of program `key` for `device` (written to the store first,
        unless it is there); whether the request could be made."""
        if self.store.meta(f"p-{key}") is None:
            try:
                payload = dump_program(program)
            except Unstorable:
                return False
            if not self.store.put(f"p-{key}", payload, program_meta(program, device)):
                return False
        if self.result(key) is not None:
            return True  # (done already: by another process's request)
        request = orjson.dumps({"key": key, "device": device, "predicted_ms": predicted_ms})
        temp = self.directory / f".q-{key}-{os.getpid()}"
        try:
            temp.write_bytes(request)
            os.replace(temp, self.directory / f"q-{key}")
        except OSError:
            return False
        return True

    def result(self, key: str) -> tuple[bytes | None, dict[str, Any] | str] | None:
        """The executable of `key` and what loading it needs, or (None, why it could not be
        lowered), or None while there is neither."""
        found = self.store.get(f"x-{key}")
        if found is not None:
            return bytes(found[0]), found[1]
        refused = self.store.get(f"r-{key}")
        if refused is not None:
            return None, bytes(refused[0]).decode("utf-8", "replace")
        return None

    def refuse(self, key: str, reason: str) -> None:
        self.store.put(f"r-{key}", reason.encode())


# ------------------------------------------------------------------ the process


def lowering_main(settings_json: str, conn: Connection) -> None:
    """The lowering process: lower what the queue asks, one at a time, until the front
    process is gone. Each lowering's outcome goes to the front process (its metrics and
    log) as (program key, None or why refused, compile ms, predicted ms)."""
    from gradserve.engine.graph import xla

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    _name_process(PROCESS_NAME)
    settings = Settings.model_validate_json(settings_json)
    store = Programs(settings).store
    assert store is not None, "a lowering process without a program store"
    queue = LoweringQueue(store)
    available = xla.available()
    _sweep_claims(queue)
    while True:
        if conn.poll(0):  # (the front process says stop, or is gone: EOF)
            return
        claimed = _claim(queue)
        if claimed is None:
            time.sleep(POLL_S)
            continue
        path, request = claimed
        key = str(request.get("key"))
        if available:
            outcome = _lower(xla, store, queue, key, request)
        else:
            outcome = (UNIMPORTABLE, 0.0)
            queue.refuse(key, UNIMPORTABLE)
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError, EOFError):
            conn.send((key, outcome[0], outcome[1], float(request.get("predicted_ms") or 0)))


def _lower(
    xla: Any, store: Store, queue: LoweringQueue, key: str, request: dict[str, Any]
) -> tuple[str | None, float]:
    """Lower one program; (None, compile ms), or (why not, 0)."""
    device = str(request.get("device") or "cpu")
    found = store.get(f"p-{key}")
    if found is None:
        return "its program is not in the store", 0.0
    try:
        program = load_program(found[0], device)
        lowered = xla.lower(program, device)
        payload, meta = lowered.export()
    except (CorruptProgram, GradserveError) as exc:  # (damaged, or a device not here)
        queue.refuse(key, f"not lowered: {exc}")
        return f"not lowered: {exc}", 0.0
    except xla.NotLowerable as exc:
        queue.refuse(key, exc.reason)
        return exc.reason, 0.0
    except Exception as exc:  # (XLA's own errors: the program stays interpreted)
        log.exception("program %s could not be lowered", key)
        reason = f"lowering failed: {type(exc).__name__}"
        queue.refuse(key, reason)
        return reason, 0.0
    meta["predicted_ms"] = request.get("predicted_ms")
    if not store.put(f"x-{key}", payload, meta):
        return "the program store cannot be written", 0.0
    return None, float(meta["compile_ms"])


def _claim(queue: LoweringQueue) -> tuple[Path, dict[str, Any]] | None:
    """The oldest request, claimed (renamed with this process's pid), and its contents."""
    try:
        requests = sorted(queue.directory.glob("q-*"), key=_mtime)
    except OSError:
        return None
    for path in requests:
        claimed = path.with_name(f"c-{path.name[2:]}-{os.getpid()}")
        try:
            os.replace(path, claimed)
            return claimed, orjson.loads(claimed.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
    return None


def _sweep_claims(queue: LoweringQueue) -> None:
    """Requests another lowering process claimed and did not finish (it is gone): answered
    with why, never tried again."""
    with contextlib.suppress(OSError):
        for path in queue.directory.glob("c-*"):
            key, _, pid = path.name[2:].rpartition("-")
            if pid.isdigit() and not _alive(int(pid)):
                queue.refuse(key, GONE)
                with contextlib.suppress(OSError):
                    path.unlink()


def _name_process(name: str) -> None:
    """The process's name as the kernel shows it (prctl PR_SET_NAME): a forkserver's
    children otherwise all show the forkserver's command line."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ in the front process
_CONTEXT = multiprocessing.get_context("forkserver")


class Lowerer:
    """The front process's lowering process: started with the server (where the tier is
    on, jax installed and a program store kept), kept alive, stopped past its memory
    bound, and its outcomes handed to `report` (on the event loop's thread: `post`)."""

    def __init__(self, settings: Settings, report: Any, post: Any) -> None:
        self.settings = settings
        self.report, self.post = report, post
        self.proc: Any = None
        self.conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self.starts = 0

    def start(self) -> None:
        forkserver.ensure_running()
        ours, child = _CONTEXT.Pipe()
        self.conn = ours
        self.proc = _CONTEXT.Process(
            target=lowering_main,
            args=(self.settings.model_dump_json(), child),
            name="gradserve-lowering",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.starts += 1
        self._reader = threading.Thread(
            target=self._read, args=(ours,), daemon=True, name="gradserve-lowering-reader"
        )
        self._reader.start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                return
            self.post(self.report, outcome)

    def housekeeping(self) -> None:
        """Once a second: a lowering process past its memory bound is stopped (its program
        is answered GONE by the next), and one that is gone is started again."""
        proc = self.proc
        if proc is None:
            return
        if proc.is_alive() and _rss(proc.pid) > self.settings.xla_lowering_memory_bytes:
            log.warning(
                "the lowering process holds over %d MiB: stopping it",
                self.settings.xla_lowering_memory_bytes >> 20,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
        if not proc.is_alive():
            self.close()
            self.start()

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0
