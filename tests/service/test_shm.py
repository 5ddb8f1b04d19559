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
    segments = [Path(SHM_DIR) / f"gs{dead}-{n}" for n in ("7", "7o", "0s")]  # (a spare too)
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
    assert shm._SEGMENT.match("gs123-4s")  # (a spare: shm.Spares)
    assert not shm._SEGMENT.match("gs123-4x") and not shm._SEGMENT.match("psm_123")


@needs_shm
def test_a_body_segment_done_with_is_kept_for_the_next_body() -> None:
    """Spares: a segment given back is renamed and kept; a body it fits within twice takes
    it (the same file, cut to the body's size, its pages already there); one too small or
    too large does not; past SPARES they are removed; clear removes the kept ones."""
    spares = shm.Spares()
    size = shm.SHM_MIN_BYTES
    names = [f"gs{os.getpid()}-test{k}" for k in range(shm.SPARES + 2)]
    try:
        first = shm.Segment(names[0], 2 * size)
        first.buf[:4] = b"body"
        first.close()
        inode = os.stat(os.path.join(SHM_DIR, names[0])).st_ino
        spares.give(names[0])
        assert not os.path.exists(os.path.join(SHM_DIR, names[0])) and spares.bytes == 2 * size
        assert spares.take(names[1], size // 2) is None  # (2 MiB kept for 0.5 MiB: too large)
        assert spares.take(names[1], 3 * size) is None  # (too small)
        taken = spares.take(names[1], size + 1)
        assert taken is not None and taken.size == size + 1 and spares.bytes == 0
        assert os.stat(os.path.join(SHM_DIR, names[1])).st_ino == inode
        assert bytes(taken.buf[:4]) == b"body"  # (a body overwrites what it was)
        taken.close()
        for name in names[1:]:  # at most SPARES kept; the others removed
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                shm.Segment(name, size).close()
            spares.give(name)
        assert len(spares._kept) == shm.SPARES
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        kept = [n for _, n in spares._kept]
        assert all(shm._SEGMENT.match(n) for n in kept)  # (swept if the server dies)
        spares.clear()
        assert spares.bytes == 0 and not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in kept)
        small = shm.Segment(names[0], 4096)
        small.close()
        spares.give(names[0])  # (below SHM_MIN_BYTES: never a body's segment, removed)
        assert spares.bytes == 0 and not os.path.exists(os.path.join(SHM_DIR, names[0]))
    finally:
        spares.clear()
        for name in names:
            shm.unlink(name)


@needs_shm
def test_large_binary_bodies_one_after_another_answer_their_own_values(tmp_path: Path) -> None:
    """Bodies of 1 and 2 MiB in turn through a real server (their segments kept and taken
    again): each answer is its own body's, not a former one's."""
    server = start_server(tmp_path)
    try:
        rng = np.random.default_rng(4)
        for n in (1 << 17, 1 << 18, 1 << 17, 1 << 18, 1 << 17):
            x = rng.standard_normal(n)
            head = (
                b'{"graph": {"nodes": [{"id": "y", "expr": "sum(x * 2.0)"}], "outputs": ["y"]},'
                b' "inputs": {"x": {"dtype": "float64", "shape": [%d], "binary_data_size": %d}}}'
                % (n, x.nbytes)
            )
            r = httpx.post(
                server.base + "/forward",
                content=head + x.tobytes(),
                headers={
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(len(head)),
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["outputs"]["y"]["data"], 2 * x.sum(), rtol=1e-12)
    finally:
        stop_server(server)


# A process that keeps freed memory reuses a task's pages for the next task; by default
# glibc gives them back (the heap's top past its trim threshold) and the next task faults
# every page in again.
_FAULTS = """
import resource, sys
import numpy as np
from gradserve.service import shm
if sys.argv[1] == "keep":
    shm.keep_freed_memory()
def faults_of_a_task():  # six 8 MiB arrays alive at once, as a computation's temporaries
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.ones(1 << 20) for _ in range(6)]
    del arrays
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_task()  # (the first one faults in either case)
print(min(faults_of_a_task() for _ in range(3)))
"""


@pytest.mark.parametrize(
    ("policy", "at_least", "at_most"), [("keep", 0, 100), ("default", 1000, None)]
)
def test_a_worker_keeps_freed_memory_for_the_next_task(
    policy: str, at_least: int, at_most: int | None
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, policy], capture_output=True, text=True, check=True
    )
    faults = int(out.stdout)
    assert faults >= at_least  # (48 MiB is 12,288 pages; the default gives most back)
    assert at_most is None or faults <= at_most
