"""Shared by the tests (from tests/e2e/test_integration_service.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    base: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(tmp: Path, preexec_fn: Callable[[], None] | None = None, **env: str) -> Server:
    port = free_port()
    log = tmp / f"server-{port}.log"
    with log.open("wb") as out:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(port)],
            cwd=ROOT,
            # One BLAS thread: the long computation leaves a core to the event loop.
            env={
                **os.environ,
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                **env,
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,  # e.g. a lower open-file limit (service/test_connections.py)
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return Server(base, port, proc, log)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not become ready:\n{log.read_text()}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait(timeout=10)


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
