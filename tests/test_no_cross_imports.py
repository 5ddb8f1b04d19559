"""No test module imports another test module: what tests share lives in tests/support/
(the server launcher, problem assertions, op samples, objectives, programs), so that a test
module can be moved, renamed or deleted without breaking another."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(("." * node.level) + node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module named by string: importorskip, importlib.import_module
            names += re.findall(r"^tests\.test_\w+$", node.value)
    return names


def is_test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lstrip(".").startswith("test_")


def test_no_test_module_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): bad
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()  # (which names test modules, as samples)
        and (bad := [n for n in imported_modules(path) if is_test_module(n)])
    }
    assert not offenders, f"import from tests/support/ instead: {offenders}"


def test_the_guard_sees_an_import(tmp_path: Path) -> None:
    source = tmp_path / "test_x.py"
    source.write_text('import pytest\nmod = pytest.importorskip("tests.test_ops")\n')
    assert imported_modules(source) == ["pytest", "tests.test_ops"]
    assert is_test_module("tests.test_ops") and is_test_module(".test_ops")
    assert not is_test_module("tests.support.ops") and not is_test_module("pytest")
