"""/metrics with several front processes (`gradserve serve --workers N`): every scrape, in
whichever process answers it, sums the figures of all of them (prometheus-client's
multiprocess mode, service/metrics.py), also after a worker is killed and replaced.

Every loop here is bounded in count and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gradserve.service.cli import metrics_directory
from gradserve.service.metrics import MULTIPROC_ENV, Metrics
from tests.support.server import Server, seed, start_server, stop_server

ROUTE = "/backward"
WORKERS = 4
BATCH = 400
SCRAPES = 12


# ---------------------------------------------------------------- helpers


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _route_total(samples: dict[str, list[tuple[dict[str, str], float]]]) -> float:
    return sum(
        v
        for labels, v in samples.get("gradserve_requests_total", [])
        if labels.get("route") == ROUTE
    )


def _scrape(base: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    # A new connection each time, so that the scrapes land on different processes.
    r = httpx.get(base + "/metrics", headers={"Connection": "close"}, timeout=10)
    assert r.status_code == 200, r.text
    return _families(r.text)


def _send(base: str, n: int) -> None:
    """`n` requests to ROUTE, 8 at a time, each on its own connection (so the processes
    share them); every one must succeed."""
    body = seed()

    def one(_: int) -> int:
        return httpx.post(
            base + ROUTE, json=body, headers={"Connection": "close"}, timeout=30
        ).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(n)))
    assert codes == [200] * n


def _front_processes(server: Server) -> list[psutil.Process]:
    """The uvicorn workers: the spawned children of the server (not its resource tracker)."""
    out = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmdline:
            out.append(child)
    return out


def _wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float = 60,
    state: Callable[[], object] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} {state()}")


def _per_process(directory: str, pid: int) -> float:
    """ROUTE's requests counted by one process, from its own file."""
    path = os.path.join(directory, f"counter_{pid}.db")
    if not os.path.exists(path):
        return 0.0
    total = 0.0
    for metric in MultiProcessCollector.merge([path], accumulate=False):
        for s in metric.samples:
            if s.name == "gradserve_requests_total" and s.labels.get("route") == ROUTE:
                total += s.value
    return total


def _files_up(directory: str, pids: list[int]) -> bool:
    return all(os.path.exists(os.path.join(directory, f"counter_{p}.db")) for p in pids)


@pytest.fixture
def workers_server(tmp_path: Path) -> Iterator[Server]:
    s = start_server(tmp_path, GRADSERVE_WORKERS=str(WORKERS))
    try:
        yield s
    finally:
        stop_server(s)


# ---------------------------------------------------------------- a real server


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.timing
def test_every_scrape_sums_all_workers_and_survives_a_killed_one(workers_server: Server) -> None:
    server = workers_server
    started = time.monotonic()
    _wait_for(f"{WORKERS} front processes", lambda: len(_front_processes(server)) == WORKERS)
    fronts = _front_processes(server)
    directory = fronts[0].environ().get(MULTIPROC_ENV)
    # The directory is the server's own, made before the workers started: under /dev/shm
    # where it is writable, else the temporary directory.
    assert directory and os.path.basename(directory).startswith("gradserve-metrics-")
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    assert os.path.dirname(directory) == ("/dev/shm" if shm else tempfile.gettempdir())
    assert all(p.environ().get(MULTIPROC_ENV) == directory for p in fronts)
    _wait_for("every worker's metrics", lambda: _files_up(directory, [p.pid for p in fronts]))

    sent = 0
    seen: list[float] = []

    def scrape_all() -> None:
        for _ in range(SCRAPES):
            total = _route_total(_scrape(server.base))
            seen.append(total)
            assert total == sent, (total, sent, seen)

    scrape_all()  # zero, from every process
    _send(server.base, BATCH)
    sent += BATCH
    scrape_all()
    # The requests were shared out, so one process's own figures could not have added up.
    counts = {p.pid: _per_process(directory, p.pid) for p in fronts}
    assert sum(counts.values()) == BATCH
    served = [pid for pid, n in counts.items() if n]
    assert len(served) >= 2, counts

    # SIGKILL a worker that counted some of them: uvicorn's supervisor replaces it; its
    # counters stay in the sums, its live gauges go.
    victim = max(served, key=lambda pid: counts[pid])
    os.kill(victim, signal.SIGKILL)
    before = {p.pid for p in fronts}

    def replaced() -> bool:
        now = [p.pid for p in _front_processes(server)]
        return (
            len(now) == WORKERS
            and victim not in now
            and len(set(now) - before) == 1
            and _files_up(directory, now)
        )

    # A spawned worker imports the service before it counts: slow on a loaded machine.
    _wait_for(
        "a replacement worker",
        replaced,
        timeout=150,
        state=lambda: (
            victim,
            sorted(before),
            [p.pid for p in _front_processes(server)],
            sorted(os.listdir(directory)),
        ),
    )
    scrape_all()  # still the first batch, victim's share included
    assert os.path.exists(os.path.join(directory, f"counter_{victim}.db"))
    assert not [
        f for f in os.listdir(directory) if f.startswith("gauge_") and f.endswith(f"_{victim}.db")
    ]

    _send(server.base, BATCH)
    sent += BATCH
    scrape_all()
    assert seen == sorted(seen)  # never backwards
    assert seen[-1] == 2 * BATCH

    # Gauges are summed over the live processes, as each last published them (at most a
    # second ago): with nothing running, only this scrape is in flight.
    time.sleep(1.5)
    samples = _scrape(server.base)
    assert samples["gradserve_requests_in_flight"] == [({}, 1.0)]
    assert samples["gradserve_computations_in_flight"] == [({}, 0.0)]
    assert samples["gradserve_inflight_planned_bytes"] == [({}, 0.0)]
    assert time.monotonic() - started < 330

    assert stop_server(server) == 0
    assert not os.path.exists(directory)  # the server's own directory goes with it


@pytest.mark.integration
def test_a_directory_the_user_chose_is_used_and_kept(tmp_path: Path) -> None:
    directory = tmp_path / "prometheus"
    server = start_server(tmp_path, GRADSERVE_WORKERS="2", PROMETHEUS_MULTIPROC_DIR=str(directory))
    try:
        _wait_for("2 front processes", lambda: len(_front_processes(server)) == 2)
        _wait_for(
            "their metrics",
            lambda: _files_up(str(directory), [p.pid for p in _front_processes(server)]),
        )
        _send(server.base, 40)
        for _ in range(6):
            assert _route_total(_scrape(server.base)) == 40
    finally:
        assert stop_server(server) == 0
    assert directory.is_dir()
    assert any(f.name.startswith("counter_") for f in directory.iterdir())
    assert not any(f.name.startswith("gauge_") for f in directory.iterdir())  # all retired


# ---------------------------------------------------------------- in process


def test_metrics_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.delenv(MULTIPROC_ENV.lower(), raising=False)
    with metrics_directory(1) as d:  # one worker: its own registry, as before
        assert d is None and MULTIPROC_ENV not in os.environ
    with metrics_directory(3) as d:
        assert d is not None and os.path.isdir(d) and os.environ[MULTIPROC_ENV] == d
    assert not os.path.exists(d) and MULTIPROC_ENV not in os.environ
    mine = tmp_path / "mine"
    monkeypatch.setenv(MULTIPROC_ENV, str(mine))
    for workers in (1, 3):
        with metrics_directory(workers) as d:
            assert d == str(mine) and mine.is_dir()
        assert mine.is_dir() and os.environ[MULTIPROC_ENV] == str(mine)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not psutil.pid_exists(proc.pid)
    return proc.pid


def test_multiprocess_metrics_in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two "processes" in this one (values written under another pid's name): a scrape sums
    both; once the other is dead its gauges leave the sums and its counters stay."""
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    other = _dead_pid()  # a pid that ran and is gone: as a killed worker's
    monkeypatch.setattr(
        prometheus_values, "ValueClass", prometheus_values.MultiProcessValue(lambda: other)
    )
    dead = Metrics()
    assert dead.multiproc_dir == str(tmp_path)
    dead.request_children(ROUTE, "POST", 200).requests.inc(3)
    dead.track(dead.in_flight, lambda: 5)
    dead.publish()
    assert (tmp_path / f"gauge_livesum_{other}.db").exists()

    monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.MultiProcessValue())
    live = Metrics()
    live.request_children(ROUTE, "POST", 200).requests.inc(2)
    live.track(live.in_flight, lambda: 1)
    live.track(live.computing, lambda: 0)
    samples = _families(live.render().decode())
    assert _route_total(samples) == 5
    assert samples["gradserve_requests_in_flight"] == [({}, 1.0)]  # the dead one's 5 went
    assert not (tmp_path / f"gauge_livesum_{other}.db").exists()
    assert (tmp_path / f"counter_{other}.db").exists()
    live.retire()
    assert not (tmp_path / f"gauge_livesum_{os.getpid()}.db").exists()


def test_one_process_keeps_its_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.delenv(MULTIPROC_ENV.lower(), raising=False)
    m = Metrics()
    assert m.multiproc_dir is None
    m.track(m.in_flight, lambda: 7)  # read at the scrape, nothing published
    assert ({}, 7.0) in _families(m.render().decode())["gradserve_requests_in_flight"]
