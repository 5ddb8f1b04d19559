"""Shared by the tests (from tests/e2e/test_docker.py): the Docker helpers, and the image
fixture that test_docker and test_balancer build the image with (once for each module)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


BASE_IMAGE = os.environ.get("GRADSERVE_TEST_BASE_IMAGE", "")
TAG = "gradserve:test"
BUILD_TIMEOUT_S = 1100  # the first build: dependencies come from PyPI on a cold cache


IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> None:
    """Skip; but fail in CI, where the base image is provided and the tests must run."""
    if IN_CI and BASE_IMAGE:
        pytest.fail(f"{reason} (CI=true and GRADSERVE_TEST_BASE_IMAGE is set: must not skip)")
    pytest.skip(reason)


def _run(args: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout (tail)\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}"
        )
    return proc


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["docker", *args], timeout=timeout, check=check)


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30
        ).returncode
        == 0
    ):
        return ["docker", "compose"]
    return None


@pytest.fixture(scope="module", name="image")
def build_image() -> str:
    """Build the image once for the module; return its tag."""
    if not BASE_IMAGE:
        pytest.skip("GRADSERVE_TEST_BASE_IMAGE is not set (.ci/run sets it where it can)")
    if shutil.which("docker") is None:
        unavailable("the docker CLI is not installed")
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        unavailable("`docker info` did not answer within 30 s")
    if info.returncode != 0:
        unavailable(f"no Docker daemon answers: {info.stderr.strip()[-500:]}")
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        unavailable(f"the base image {BASE_IMAGE!r} is not present")
    docker(
        "build",
        "--network",
        "host",
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "-t",
        TAG,
        ".",
        timeout=BUILD_TIMEOUT_S,
    )
    # Earlier builds of the tag are left untagged: drop them (only gradserve's, only
    # untagged ones), so that a CI host does not fill up. The builder stages stay: cache.
    docker(
        "image",
        "prune",
        "--force",
        "--filter",
        "label=org.opencontainers.image.title=gradserve",
        check=False,
    )
    return TAG
