"""No test module imports another test module: what tests share lives in tests/support/
(the server launcher, problem assertions, op samples, objectives, programs, fixtures), so
that a test module can be moved, renamed or deleted without breaking another.

The one exception is a replay: a module whose tests are another module's tests, run again
through another path (checkpointed, stored and loaded, rematerialised, lowered to XLA). It
imports the modules it replays, and only those; `REPLAYS` names each pair, and the guard
fails on a pair that no longer imports (so the list cannot outlive its reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

REPLAYS = {  # (paths under tests/)
    "engine/test_checkpoint.py": {"test_transforms"},
    "engine/test_remat.py": {"test_objectives", "test_transforms"},
    "engine/test_rolling.py": {"test_compiled", "test_transforms"},
    "engine/test_serial.py": {"test_objectives", "test_transforms"},
    "engine/test_xla.py": {"test_compiled", "test_objectives", "test_transforms"},
    "service/test_xla_service.py": {
        "test_binary",
        "test_recompute_http",
        "test_service_api",
        "test_service_fuzz",
        "test_transforms_http",
    },
}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ("." * node.level) + (node.module or "")
            if module:
                names.append(module)
            # `from tests import test_x` (or `from . import test_x`) imports the module test_x
            names += [f"{module}.{alias.name}".lstrip(".") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module named by string: importorskip, importlib.import_module
            names += re.findall(r"^tests\.(?:\w+\.)*test_\w+$", node.value)
    return names


def is_test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lstrip(".").startswith("test_")


def imported_test_modules(path: Path) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n in imported_modules(path) if is_test_module(n)}


def test_no_test_module_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): bad
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()  # (which names test modules, as samples)
        and (
            bad := imported_test_modules(path)
            - REPLAYS.get(path.relative_to(TESTS).as_posix(), set())
        )
    }
    assert not offenders, f"import from tests/support/ instead: {offenders}"


def test_every_replay_still_imports_what_it_replays() -> None:
    stale = {
        name: replayed - imported_test_modules(TESTS / name)
        for name, replayed in REPLAYS.items()
        if replayed - imported_test_modules(TESTS / name)
    }
    assert not stale, f"no longer replayed: drop them from REPLAYS: {stale}"
    # (a replay and what it replays test the same part of the code: one folder)
    elsewhere = {
        name: module
        for name, replayed in REPLAYS.items()
        for module in replayed
        if not (TESTS / name).with_name(f"{module}.py").is_file()
    }
    assert not elsewhere, f"a replay outside the folder of what it replays: {elsewhere}"


def test_the_guard_sees_an_import(tmp_path: Path) -> None:
    source = tmp_path / "test_x.py"
    source.write_text(
        'import pytest\nmod = pytest.importorskip("tests.engine.test_ops")\n'
        "from tests.support import seeds\nfrom tests.service import test_pool\n"
        "from . import test_plan\n"
    )
    assert {
        "pytest",
        "tests.engine.test_ops",
        "tests.support.seeds",
        "tests.service.test_pool",
        "test_plan",
    } <= set(imported_modules(source))
    assert imported_test_modules(source) == {"test_ops", "test_pool", "test_plan"}
    assert is_test_module("tests.engine.test_ops") and is_test_module(".test_ops")
    assert not is_test_module("tests.support.ops") and not is_test_module("pytest")
