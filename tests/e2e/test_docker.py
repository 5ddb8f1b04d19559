"""The Docker image, built from this checkout and run as a container.

The image is built once for this module (`docker build --network host --build-arg
BASE_IMAGE=$GRADSERVE_TEST_BASE_IMAGE`) and run with host networking on a free
loopback port. The tests skip where no base image is given or no Docker daemon
answers; in CI (`CI=true`) with a base image given, a missing daemon or tool fails
them instead. `.ci/run` sets `GRADSERVE_TEST_BASE_IMAGE` where the CI environment provides
a local base image.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.docker import (
    ROOT,
    _run,
    build_image,  # noqa: F401 (the `image` fixture: built once for this module)
    compose_command,
    docker,
    unavailable,
)
from tests.support.seeds import SEED_NO_GRAD, SEED_OP

# The first test also builds the image: dependencies come from PyPI on a cold cache.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

READY_TIMEOUT_S = 60
STOP_LIMIT_S = 10


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Container:
    id: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        proc = docker("logs", "--tail", "200", self.id, check=False)
        return proc.stdout + proc.stderr

    def state(self, template: str) -> str:
        return docker("inspect", "-f", template, self.id).stdout.strip()


def _start(image: str, *extra: str) -> Container:
    port = _free_port()
    proc = docker(
        "run",
        "-d",
        "--network",
        "host",
        "--name",
        f"gradserve-test-{uuid.uuid4().hex[:12]}",
        # Loopback only: with host networking the image's 0.0.0.0 would bind every interface.
        "-e",
        "GRADSERVE_HOST=127.0.0.1",
        "-e",
        f"GRADSERVE_PORT={port}",
        # Run the image's own HEALTHCHECK command every second instead of every 30 s.
        "--health-interval",
        "1s",
        "--health-start-period",
        "30s",
        *extra,
        image,
    )
    return Container(proc.stdout.strip(), port)


def _wait_ready(c: Container) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        if c.state("{{.State.Running}}") != "true":
            pytest.fail(f"the container exited ({c.state('{{.State.ExitCode}}')}):\n{c.logs()}")
        try:
            r = httpx.get(f"{c.url}/readyz", timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.25)
    pytest.fail(f"/readyz not 200 within {READY_TIMEOUT_S} s (last: {last}):\n{c.logs()}")


def _remove(c: Container) -> None:
    docker("rm", "-f", "-v", c.id, check=False)


@pytest.fixture(scope="module")
def server(image: str) -> Iterator[Container]:
    """One container serving the API for the checks that do not stop it."""
    c = _start(image)
    try:
        _wait_ready(c)
        yield c
    finally:
        _remove(c)


def _post(c: Container, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{c.url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def test_backward_seed_example(server: Container) -> None:
    data = _post(server, "/backward", SEED_OP)
    z = data["outputs"]["z"]
    assert (z["data"], z["shape"], z["dtype"]) == (-5.0, [], "float32")
    assert z["requires_grad"] is True
    assert z["grad_fn"] == "MulBackward"
    assert data["gradients"]["x"]["data"] == 4.0
    assert data["gradients"]["y"]["data"] == -6.0
    assert data["meta"]["device"] == "cpu"


def test_forward_no_grad_seed_example(server: Container) -> None:
    data = _post(server, "/forward", SEED_NO_GRAD)
    b, a = data["outputs"]["B"], data["outputs"]["A"]
    assert (b["data"], b["shape"], b["dtype"]) == ([41.0], [1], "float32")
    assert b["requires_grad"] is False
    assert b["grad_fn"] is None
    assert a["requires_grad"] is True  # the input itself still requires grad
    assert "gradients" not in data
    assert data["meta"]["no_grad"] is True


def test_discovery_and_docs_served_from_the_image(server: Container) -> None:
    r = httpx.get(f"{server.url}/devices", timeout=10)
    assert r.status_code == 200, r.text
    assert "cpu" in [d["name"] for d in r.json()["devices"]]
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    # The docs page and its assets come from the installed wheel, not from a CDN.
    assert httpx.get(f"{server.url}/openapi.json", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/docs", timeout=10).status_code == 200


def test_healthcheck_reports_healthy(server: Container) -> None:
    deadline = time.monotonic() + 45
    status = ""
    while time.monotonic() < deadline:
        status = server.state("{{.State.Health.Status}}")
        if status == "healthy":
            return
        assert status != "unhealthy", server.state("{{json .State.Health}}")
        time.sleep(0.5)
    health = server.state("{{json .State.Health}}")
    pytest.fail(f"HEALTHCHECK status {status!r} after 45 s: {health}")


def test_runs_as_non_root(server: Container) -> None:
    assert docker("exec", server.id, "id", "-u").stdout.strip() != "0"
    # The server process itself (PID 1), not only `docker exec`'s default user.
    status = docker("exec", server.id, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert "0" not in uids, status
    cmdline = docker("exec", server.id, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert any(part.endswith("gradserve") for part in cmdline), cmdline


def test_image_configuration(image: str) -> None:
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", image).stdout)
    assert config["User"] not in ("", "0", "root", "0:0")
    assert "GRADSERVE_HOST=0.0.0.0" in config["Env"]
    assert "8000/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["gradserve"]
    assert config["Cmd"] == ["serve"]
    assert config["StopSignal"] == "SIGTERM"
    assert config["Healthcheck"]["Test"][0] == "CMD"


def test_image_has_no_build_tools_pip_or_torch(image: str) -> None:
    script = (
        "import importlib.util, sys;"
        "print(sys.prefix, [m for m in ('pip', 'setuptools', 'torch', 'pytest')"
        " if importlib.util.find_spec(m)])"
    )
    out = docker(
        "run", "--rm", "--network", "host", "--entrypoint", "python3", image, "-c", script
    ).stdout.strip()
    assert out == "/opt/venv []", out
    tools = docker(
        "run",
        "--rm",
        "--network",
        "host",
        "--entrypoint",
        "sh",
        image,
        "-c",
        "for t in gcc cc g++ make; do command -v $t; done; true",
    ).stdout
    assert tools.strip() == "", f"compilers in the runtime image: {tools}"
    assert "serve" in docker("run", "--rm", "--network", "host", image, "--help").stdout


@pytest.mark.timing
def test_docker_stop_ends_it_cleanly_within_10s(image: str) -> None:
    # The hardened settings of docker-compose.yml, to show the image runs under them.
    c = _start(
        image,
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/home/gradserve:uid=10001,gid=10001,mode=0700",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges:true",
    )
    try:
        _wait_ready(c)
        t0 = time.monotonic()
        # Docker would SIGKILL after 30 s; the limit under test is 10 s, with SIGTERM alone.
        docker("stop", "-t", "30", c.id, timeout=60)
        elapsed = time.monotonic() - t0
        logs = c.logs()
        assert c.state("{{.State.Running}}") == "false"
        assert elapsed < STOP_LIMIT_S, f"docker stop took {elapsed:.1f} s\n{logs}"
        # 0: it handled SIGTERM and exited; 137 or 143 would mean it was killed.
        assert c.state("{{.State.ExitCode}}") == "0", logs
    finally:
        _remove(c)


def _long_request(n: int) -> dict[str, Any]:
    """A no_grad chain of n 2000x2000 matmuls (~16 GFLOP each) with a scalar result."""
    nodes = [{"id": "m0", "expr": "full(shape=[2000, 2000], value=0.0005)"}]
    nodes += [{"id": f"m{i}", "expr": f"m{i - 1} @ m0"} for i in range(1, n)]
    nodes.append({"id": "out", "expr": f"sum(m{n - 1})"})
    return {"graph": {"nodes": nodes, "outputs": ["out"]}, "inputs": {}, "no_grad": True}


@pytest.mark.timing
def test_docker_stop_with_a_request_in_flight(image: str) -> None:
    # A long request the compute budget lets through: the shutdown is what stops it.
    c = _start(
        image, "-e", "GRADSERVE_REQUEST_TIMEOUT_S=600", "-e", "GRADSERVE_COMPUTE_BUDGET=1e16"
    )
    outcome: list[str] = []

    def client() -> None:
        try:
            r = httpx.post(f"{c.url}/forward", json=_long_request(1000), timeout=120)
            outcome.append(f"{r.status_code} {r.text[:300]}")
        except httpx.HTTPError as e:
            outcome.append(repr(e))

    try:
        _wait_ready(c)
        worker = threading.Thread(target=client, daemon=True)
        worker.start()
        time.sleep(2)
        assert worker.is_alive(), f"the request finished before the stop: {outcome}"
        t0 = time.monotonic()
        docker("stop", "-t", "30", c.id, timeout=60)
        elapsed = time.monotonic() - t0
        worker.join(timeout=30)
        logs = c.logs()
        assert elapsed < STOP_LIMIT_S, f"docker stop took {elapsed:.1f} s ({outcome})\n{logs}"
        assert c.state("{{.State.ExitCode}}") == "0", logs
        assert not worker.is_alive(), "the client is still waiting after the server stopped"
    finally:
        _remove(c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", [None, "gpu", "lb"])
def test_compose_file_validates(profile: str | None) -> None:
    compose = compose_command()
    if compose is None:
        unavailable("neither docker-compose nor the docker compose plugin is installed")
        return
    args = [*compose, "-f", str(ROOT / "docker-compose.yml")]
    if profile:
        args += ["--profile", profile]
    _run([*args, "config", "--quiet"], timeout=60)
    services = _run([*args, "config", "--services"], timeout=60).stdout.split()
    assert "api" in services
    if profile == "gpu":
        assert "api-gpu" in services
    if profile == "lb":  # tests/e2e/test_balancer.py runs it
        assert {"api-1", "api-2", "api-3", "haproxy"} <= set(services)
        config = _run([*args, "config"], timeout=60).stdout
        # Host networking throughout (a bridge-less daemon), and nothing published.
        assert config.count("network_mode: host") == 4, config
