"""Shared by the tests (from tests/test_docker.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


BASE_IMAGE = os.environ.get("GRADSERVE_TEST_BASE_IMAGE", "")


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
