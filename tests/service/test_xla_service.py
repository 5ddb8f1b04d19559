"""Every graph of the service suites (the API, binary bodies, transforms and recomputation
over HTTP and the fuzzed op nodes, served in process) run twice through the XLA tier: each
of those tests runs here again, and every program the front process executes for it is also
lowered and run twice with the same inputs, against the interpreter
(test_xla.interpreter_then_tier).

The tier's own policy (hot programs only, never small ones, demotion when slower) is
bypassed: every program is lowered, whatever its size or count. Requests computed in a
compute worker (another process: large bodies) are not seen here; the module checks at its
end that it saw a floor of programs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gradserve.engine.graph.xla import NotLowerable
from tests.service import (
    test_binary,
    test_recompute_http,
    test_service_api,
    test_service_fuzz,
    test_transforms_http,
)
from tests.support.portal import app_portal  # noqa: F401 (the `portal_client` fixture)
from tests.support.xla import interpreter_then_tier  # (skips this module, as it, without jax)

pytestmark = pytest.mark.anyio

SUITES = (
    test_service_api,
    test_binary,
    test_transforms_http,
    test_recompute_http,
    test_service_fuzz,
)

# A run of this module sees 358 distinct programs, and lowers all but 2 (a checkpointed
# loop; a `full` the interpreter refuses too). A floor, so that a change that moved the
# suites' requests out of this process fails here rather than checking nothing.
AT_LEAST_PROGRAMS = 100


def _suite_tests() -> dict[str, Any]:
    return {
        f"{name}_twice_through_the_tier": fn
        for module in SUITES
        for name, fn in vars(module).items()
        if name.startswith("test_") and callable(fn)
    }


globals().update(_suite_tests())

_lowered: dict[int, Any] = {}  # every program checked, over the module (kept alive: ids)


@pytest.fixture(autouse=True)
def tier_too(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The service's `execute` (the interpreter, as the compute path calls it) is
    `interpreter_then_tier`'s, in this process."""
    from gradserve.service import compute

    monkeypatch.setattr(compute, "execute", interpreter_then_tier(_lowered))
    yield


@pytest.fixture(autouse=True, scope="module")
def most_programs_were_seen() -> Iterator[None]:
    yield
    lowered = sum(not isinstance(tier, NotLowerable) for _, tier in _lowered.values())
    assert lowered >= AT_LEAST_PROGRAMS, (
        f"only {lowered} programs went through the tier ({len(_lowered)} seen)"
    )
