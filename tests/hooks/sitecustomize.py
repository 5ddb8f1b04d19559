"""Run by every Python process started with this folder on PYTHONPATH (the servers the
tests start, their forkserver and compute workers): what the environment asks of it.

- GRADSERVE_TEST_NO_JAX=1: `jax` cannot be imported, as where it is not installed (CI's
  second run of the suite, and the tests of a server without the native tier);
- GRADSERVE_TEST_SLOW_XLA=<seconds>: every lowered program sleeps that long before it runs
  (a deadline that passes during an XLA execution);
- GRADSERVE_TEST_NOT_LOWERED=<op>: that op has no lowering (its programs stay interpreted,
  whatever the lowering covers today).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time
from typing import Any


class NoJax(importlib.abc.MetaPathFinder):
    """Refuses `jax` and `jaxlib` (and their submodules) as an absent package is refused."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] in ("jax", "jaxlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def install_no_jax() -> None:
    if not any(isinstance(f, NoJax) for f in sys.meta_path):
        sys.meta_path.insert(0, NoJax())


def _slow_xla(seconds: float) -> None:
    from gradserve.engine.graph import xla

    run = xla.Lowered.run

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return run(self, *args, **kwargs)

    xla.Lowered.run = slow  # type: ignore[method-assign]


def _not_lowered(name: str) -> None:
    from gradserve.engine.ops import OPS
    from gradserve.engine.ops.registry import NOT_LOWERED

    OPS[name].lower = NOT_LOWERED


if os.environ.get("GRADSERVE_TEST_NO_JAX") == "1":
    install_no_jax()
if os.environ.get("GRADSERVE_TEST_SLOW_XLA"):
    _slow_xla(float(os.environ["GRADSERVE_TEST_SLOW_XLA"]))
if os.environ.get("GRADSERVE_TEST_NOT_LOWERED"):
    _not_lowered(os.environ["GRADSERVE_TEST_NOT_LOWERED"])
