"""Which form of the graph compiler's hottest modules is imported: compiled by mypyc at
install time (setup.py), or their Python source.

The compiled ones are used when all of them are installed and each was built from the
source next to it (the hashes that setup.py recorded in _native.json): an editable
install whose sources were edited since its build imports the sources, with a warning,
rather than run code that is no longer there. GRADSERVE_PURE_PYTHON=1 imports the
sources in any case (the tests run the compiler both ways). Imported by engine.graph
before any of them; the modules are one group, all compiled or none.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

MODULES = ("autodiff", "builder", "compiler", "facts", "plan")  # setup.py's ENGINE_NATIVE
HERE = Path(__file__).resolve().parent
PACKAGE = __name__.rpartition(".")[0]


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the modules' Python source ahead of their compiled form."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, HERE / f"{name}.py")


def _compiled() -> str | None:
    """Why the compiled modules cannot be used (None: they can), or "" where there are
    none."""
    found = [m for m in MODULES if any(HERE.glob(f"{m}.*.so")) or any(HERE.glob(f"{m}.*.pyd"))]
    if not found:
        return ""
    try:
        built = json.loads((HERE / "_native.json").read_text())
    except (OSError, ValueError):
        return "their build left no record of its sources (_native.json)"
    stale = [
        m
        for m in MODULES
        if m not in found
        or built.get(m) != hashlib.sha256((HERE / f"{m}.py").read_bytes()).hexdigest()
    ]
    if stale:
        return f"{', '.join(stale)} changed since they were compiled (reinstall to compile them)"
    return None


def _choose() -> bool:
    if os.environ.get("GRADSERVE_PURE_PYTHON", "") not in ("", "0"):
        sys.meta_path.insert(0, _Sources())
        return False
    why = _compiled()
    if why is None:
        return True
    if why:
        warnings.warn(
            f"gradserve.engine.graph: running the compiler from its Python source: {why}",
            RuntimeWarning,
            stacklevel=3,
        )
        sys.meta_path.insert(0, _Sources())
    return False


NATIVE = _choose()  # whether the compiled modules are the ones imported
