"""The graph compiler's hottest modules, compiled by mypyc at install time (setup.py), and
their Python source: which one is imported (engine/graph/_native.py), and the compiled-
program tests run against the source too, in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradserve.engine.graph as engine_graph
from gradserve.engine.graph import _native, compiler

ROOT = Path(__file__).resolve().parents[2]


def test_the_modules_imported_are_the_ones_engine_graph_says() -> None:
    assert compiler.__file__ is not None
    assert compiler.__file__.endswith(".py") != engine_graph.NATIVE


@pytest.mark.skipif(
    not engine_graph.NATIVE,
    reason="the compiler runs from its source here: this whole run is the pure-Python one",
)
def test_the_compiled_program_tests_pass_on_the_python_source() -> None:
    tests = [
        "tests/engine/test_program_identity.py",
        "tests/engine/test_graph.py",
        "tests/engine/test_transforms.py",
        "tests/engine/test_compiled.py",
        "tests/engine/test_messages.py",
    ]
    check = (
        "import gradserve.engine.graph as g, gradserve.engine.graph.compiler as c; "
        "assert not g.NATIVE and c.__file__.endswith('.py')"
    )
    env = {**os.environ, "GRADSERVE_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, check=True, timeout=60)
    result = subprocess.run(
        # (-n0: in that one process; this suite already runs one per core)
        [sys.executable, "-m", "pytest", "-q", "-x", "-n0", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _package(tmp_path: Path, compiled: list[str], recorded: dict[str, str]) -> Path:
    """A stand-in engine/graph: the sources, the compiled files named, the record."""
    for name in _native.MODULES:
        (tmp_path / f"{name}.py").write_text(f"# {name}\n")
    for name in compiled:
        (tmp_path / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / "_native.json").write_text(json.dumps(recorded))
    return tmp_path


def _hashes(path: Path) -> dict[str, str]:
    return {m: hashlib.sha256((path / f"{m}.py").read_bytes()).hexdigest() for m in _native.MODULES}


def test_compiled_modules_built_from_the_sources_next_to_them_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "HERE", tmp_path)
    _package(tmp_path, list(_native.MODULES), {})
    (tmp_path / "_native.json").write_text(json.dumps(_hashes(tmp_path)))
    assert _native._compiled() is None
    (tmp_path / "plan.py").write_text("# plan, edited since\n")
    assert _native._compiled() == (
        "plan changed since they were compiled (reinstall to compile them)"
    )


def test_some_compiled_or_none_recorded_means_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "HERE", tmp_path)
    _package(tmp_path, [], {})
    assert _native._compiled() == ""  # (none compiled: nothing to say)
    (tmp_path / "builder.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / "_native.json").write_text(json.dumps(_hashes(tmp_path)))
    assert _native._compiled() == (
        "autodiff, compiler, facts, plan changed since they were "
        "compiled (reinstall to compile them)"
    )
    for name in _native.MODULES:
        (tmp_path / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / "_native.json").unlink()
    assert _native._compiled() == "their build left no record of its sources (_native.json)"
