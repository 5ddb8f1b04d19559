"""Builds gradserve, with the graph compiler's hottest modules compiled by mypyc.

pyproject.toml has the package's metadata; this file only adds the extension modules.
`pip install .`, `pip install -e .` and the Docker image compile ENGINE_NATIVE to C with
mypyc (mypy is a build requirement; a C compiler and the Python headers are needed): the
same code, about a quarter fewer instructions a node compiled. They are the modules
that build, differentiate and plan a program; not the IR's own types (engine/graph/ir.py,
scan.py) nor the executor, whose objects other code makes and inspects.

    GRADSERVE_NO_MYPYC=1 pip install .   # pure Python: nothing compiled, no C compiler

Where there is no C compiler or no Python headers, the build says so and is pure Python.

engine/graph/_native.py records the hash of each compiled module's source (written here,
in engine/graph/_native.json); at run time a module whose source no longer matches (an
editable install edited since) is imported from its source instead, with a warning.
GRADSERVE_PURE_PYTHON=1 at run time imports them all from source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent
ENGINE_NATIVE = ["autodiff", "builder", "compiler", "facts", "plan"]  # in engine/graph


def native_modules() -> list[Any]:
    record = ROOT / "engine" / "graph" / "_native.json"
    record.unlink(missing_ok=True)
    if os.environ.get("GRADSERVE_NO_MYPYC", "") not in ("", "0"):
        return []
    missing = [
        what
        for what, there in (
            ("a C compiler", shutil.which(os.environ.get("CC", "cc"))),
            ("the Python headers", (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()),
        )
        if not there
    ]
    if missing:
        print(
            f"gradserve: {' and '.join(missing)} not found: the graph compiler is not "
            "compiled (pure Python, about a fifth slower)",
            file=sys.stderr,
        )
        return []
    from mypyc.build import mypycify

    # Through gradserve/engine (a link to engine/): mypyc names a module by its path, and
    # these are gradserve.engine.graph.*.
    paths = [f"gradserve/engine/graph/{name}.py" for name in ENGINE_NATIVE]
    record.write_text(
        json.dumps(
            {
                name: hashlib.sha256((ROOT / path).read_bytes()).hexdigest()
                for name, path in zip(ENGINE_NATIVE, paths, strict=True)
            },
            indent=1,
        )
        + "\n"
    )
    # Without the project's mypy configuration (its pydantic plugin is not in the build's
    # environment), and without the dependencies' types: mypyc reads this code's own. The
    # modules they import are read silently: what mypy says of them (under mypy 2.x, the
    # client's use of an orjson newer than the build machine's own) must not fail a build.
    return mypycify(
        [
            "--config-file",
            os.devnull,
            "--ignore-missing-imports",
            "--follow-imports=silent",
            *paths,
        ],
        opt_level="3",
        # their shared library, inside the package: one top-level name installed
        group_name="gradserve.engine.graph.compiled",
    )


setup(ext_modules=native_modules())
