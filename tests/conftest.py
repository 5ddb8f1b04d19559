"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.backends import set_cpu_namespace
from engine.ops.functional import raw_namespace


@pytest.fixture(params=["numpy", "array-api-strict"])
def backend_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on NumPy, then again on array-api-strict."""
    if request.param == "array-api-strict":
        pytest.importorskip("array_api_strict")
        from tests.strict_backend import make_strict_backend

        set_cpu_namespace(make_strict_backend)
    try:
        yield request.param
    finally:
        set_cpu_namespace(None)
        raw_namespace.cache_clear()
