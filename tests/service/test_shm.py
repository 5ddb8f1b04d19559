"""A server killed before it could clean up leaves its shared memory behind (its own
directories, the segments of requests in flight); the next server to start sweeps what no
live server holds, and nothing else."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from gradserve.service import shm
from gradserve.service.shm import OWNER, SHM_DIR, own_directory, state_dir, sweep_orphans
from tests.support.server import start_server, stop_server

needs_shm = pytest.mark.skipif(state_dir() != SHM_DIR, reason="no writable /dev/shm here")


def _dead_pid() -> int:
    """A pid no process has now: a child that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@needs_shm
def test_what_a_dead_server_left_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    dead = _dead_pid()
    # A dead server's: its directories (their owner files held by no one) and segments.
    orphans = [
        Path(SHM_DIR) / f"gradserve-{dead}-test",
        Path(SHM_DIR) / f"gradserve-programs-{dead}-test",
    ]
    for path in orphans:
        path.mkdir()
        (path / OWNER).write_bytes(b"")
        (path / "ledger").write_bytes(b"\0" * 64)
    segments = [Path(SHM_DIR) / f"gs{dead}-7", Path(SHM_DIR) / f"gs{dead}-7o"]
    for path in segments:
        path.write_bytes(b"x")
    # A live server's (this process's own): held, so kept, and so are its segments.
    live, held = own_directory("programs")
    live_segment = Path(SHM_DIR) / f"gs{os.getpid()}-99"
    live_segment.write_bytes(b"x")
    # Not ours to judge: a directory of the same shape without an owner file.
    foreign = Path(SHM_DIR) / f"gradserve-{dead}-foreign"
    foreign.mkdir()
    try:
        assert sweep_orphans() >= len(orphans) + len(segments)
        assert not any(p.exists() for p in [*orphans, *segments])
        assert Path(live).is_dir() and live_segment.exists() and foreign.is_dir()
    finally:
        os.close(held)
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(foreign, ignore_errors=True)
        live_segment.unlink(missing_ok=True)
    assert sweep_orphans() == 0  # (nothing left of ours: a second sweep finds nothing)


@needs_shm
def test_a_server_killed_mid_request_is_swept_by_the_next(tmp_path: Path) -> None:
    """A real server killed (SIGKILL: no clean-up) while a 4 MB binary request is in a
    worker: its ledger directory, its program store and the request's segment stay in
    /dev/shm until the next server starts, which removes them and serves."""
    first = start_server(tmp_path)
    pid = first.proc.pid
    mine = lambda: sorted(
        p.name
        for p in Path(SHM_DIR).iterdir()
        if p.name.startswith((f"gradserve-{pid}-", f"gradserve-programs-{pid}-", f"gs{pid}-"))
    )
    try:
        x = np.ones(1 << 20, np.float32)  # 4 MiB: the body goes into a segment
        header = (
            b'{"graph": {"nodes": [{"id": "s", "expr": "sum(x * x)"}], "outputs": ["s"]},'
            b' "inputs": {"x": {"binary_data_size": %d, "dtype": "float32", '
            b'"shape": [%d]}}, "no_grad": true}' % (x.nbytes, x.size)
        )
        r = httpx.post(
            first.base + "/forward",
            content=header + x.tobytes(),
            timeout=30,
            headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )
        assert r.status_code == 200 and r.json()["outputs"]["s"]["data"] == x.size
        left = mine()
        assert any(n.startswith(f"gradserve-{pid}-") for n in left), left
        assert any(n.startswith(f"gradserve-programs-{pid}-") for n in left), left
        segment = Path(SHM_DIR) / f"gs{pid}-12345"  # (one a request had in flight)
        segment.write_bytes(b"x")
        first.proc.send_signal(signal.SIGKILL)  # (its workers die with it: PDEATHSIG)
        first.proc.wait(timeout=20)
        assert mine(), "a killed server leaves its shared memory behind"
        second = start_server(tmp_path)
        try:
            assert mine() == [], mine()
            r = httpx.post(
                second.base + "/backward",
                timeout=30,
                json={
                    "graph": {
                        "nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}],
                        "outputs": ["z"],
                    },
                    "inputs": {
                        "x": {"data": 2.0, "requires_grad": True},
                        "y": {"data": 3.0, "requires_grad": True},
                    },
                },
            )
            assert r.json()["gradients"]["x"]["data"] == 4.0
        finally:
            stop_server(second)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()


def test_the_names_it_reads_are_the_names_it_makes() -> None:
    path, held = own_directory("")
    try:
        name = Path(path).name
        assert shm._DIRECTORY.match(name) and shm._DIRECTORY.match(name)[1] == str(os.getpid())
        assert shm._owner_alive(os.path.join(path, OWNER)) is True
    finally:
        os.close(held)
    assert shm._owner_alive(os.path.join(path, OWNER)) is False
    shutil.rmtree(path)
    assert shm._SEGMENT.match("gs123-4") and shm._SEGMENT.match("gs123-4o")
    assert not shm._SEGMENT.match("gs123-4x") and not shm._SEGMENT.match("psm_123")
