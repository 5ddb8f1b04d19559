"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gradserve.engine.autograd import raw_namespace
from gradserve.engine.backends import set_cpu_namespace
from tests.hooks.sitecustomize import install_no_jax

# Every Python process the tests start (servers, forkservers, workers) runs
# tests/hooks/sitecustomize.py: with GRADSERVE_TEST_NO_JAX=1, none of them can import jax,
# nor can this one (CI's second run of the suite: gradserve without its `xla` extra).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).parent / "hooks"), *filter(None, [os.environ.get("PYTHONPATH")])]
)
if os.environ.get("GRADSERVE_TEST_NO_JAX") == "1":
    install_no_jax()


# The modules that build and run the Docker image share its tag, the daemon and the host's
# network: with --dist loadfile (pyproject.toml) they are one unit, run by one test process.
ONE_UNIT = {"tests/e2e/test_docker.py": "docker", "tests/e2e/test_balancer.py": "docker"}


@pytest.hookimpl(optionalhook=True)  # (a pytest-xdist hook: no error without xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_UNIT.get(path, path)

    return ByFile(config, log)


@pytest.fixture(params=["numpy", "array-api-strict"])
def backend_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on NumPy, then again on array-api-strict."""
    if request.param == "array-api-strict":
        pytest.importorskip("array_api_strict")
        from tests.support.strict_backend import make_strict_backend

        set_cpu_namespace(make_strict_backend)
    try:
        yield request.param
    finally:
        set_cpu_namespace(None)
        raw_namespace.cache_clear()


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (`pytest.mark.anyio`) run on asyncio, as uvicorn serves."""
    return "asyncio"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The app with its default settings, started, and a client calling it in process."""
    from tests.support.in_process import serving  # (here: engine-only test runs need no service)

    async with serving() as (c, _):
        yield c
