"""The one launcher of real servers, for the tests and the benchmarks alike: `gradserve
serve` of a checkout (this one by default) on a free loopback port, or any other server
command (a benchmark's peer script), ready when its ready path answers below 500."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
# One BLAS thread: a long computation leaves a core to the event loop (2-core machines).
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_ACCESS_LINE = re.compile(r'HTTP/[0-9.]+" [0-9]{3} ')


class ServerError(RuntimeError):
    """A server that exited or did not become ready; the message ends with its log."""


@dataclass(eq=False)
class Server:
    base: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path | None  # where its stdout and stderr go (None: nowhere)
    name: str = "gradserve"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return "" if self.log is None else self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of its log, access-log lines left out."""
        with suppress(OSError):
            text = self.log_text().splitlines()
            return "\n".join([t for t in text if not _ACCESS_LINE.search(t)][-lines:])
        return ""

    def stop(self, graceful: bool = True) -> int:
        """SIGTERM and a wait (kill if it lingers), then whatever it left behind (a stuck
        worker, an orphan of its process group) is killed too; its exit status."""
        leftovers: list[psutil.Process] = []
        with suppress(psutil.Error):
            leftovers = psutil.Process(self.proc.pid).children(recursive=True)
        if self.alive() and graceful:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        if self.alive():
            self.proc.kill()
        for p in leftovers:
            with suppress(psutil.Error):
                p.kill()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    argv: Sequence[str] | None = None,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    root: Path = ROOT,
    log: Path | None = None,
    ready: str = "/readyz",
    start_s: float = 120.0,
    name: str = "gradserve",
    preexec_fn: Callable[[], None] | None = None,
) -> Server:
    """`gradserve serve --port PORT` of the checkout `root` (its own sources first on the
    path), or `argv` (which must listen on `port`), with `env` over this environment; in a
    session of its own, so that a signal to the test runner does not reach it."""
    port = port or free_port()
    if argv is None:
        argv = [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(port)]
    full_env = {**os.environ, **({"PYTHONPATH": str(root)} if root != ROOT else {}), **(env or {})}
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    try:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(
            list(argv),
            cwd=root,  # `-m` puts the cwd first on sys.path: that tree's code
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,  # e.g. a lower open-file limit (service/test_connections.py)
            start_new_session=True,
        )
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]
    server = Server(f"http://127.0.0.1:{port}", port, proc, log, name)
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerError(f"{name} exited (rc={proc.returncode}):\n{server.log_tail(40)}")
        with suppress(httpx.TransportError):
            if httpx.get(server.base + ready, timeout=2).status_code < 500:
                return server
        time.sleep(0.1)
    server.stop(graceful=False)
    raise ServerError(f"{name} not ready after {start_s:.0f} s:\n{server.log_tail(40)}")


@contextmanager
def serving(argv: Sequence[str] | None = None, **options: object) -> Iterator[Server]:
    """`launch`, stopped on the way out."""
    server = launch(argv, **options)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


def start_server(tmp: Path, preexec_fn: Callable[[], None] | None = None, **env: str) -> Server:
    """The tests' server: this checkout, one BLAS thread, its log in `tmp`."""
    port = free_port()
    return launch(
        port=port,
        env={**ONE_BLAS_THREAD, **env},
        log=tmp / f"server-{port}.log",
        preexec_fn=preexec_fn,
    )


def stop_server(server: Server) -> int:
    return server.stop()


def seed(x: float = 2.0, y: float = 3.0, form: str = "expr") -> dict:
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
