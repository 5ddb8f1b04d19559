"""A test that asserts on elapsed wall-clock time carries the `timing` marker, so that
what may flake on a starved machine is named, and CI runs it once (.ci/run): found
statically, as an `assert` comparing an elapsed time (a name `elapsed`, or a clock read
minus a start)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "perf_counter", "time"}


def _is_clock_read(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    )


def _is_elapsed(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "elapsed"
    return (
        isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_clock_read(node.left)
    )


def times_the_clock(test: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Assert)
        and any(
            isinstance(compare, ast.Compare)
            and any(_is_elapsed(side) for side in [compare.left, *compare.comparators])
            for compare in ast.walk(node.test)
        )
        for node in ast.walk(test)
    )


def is_marked_timing(test: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d) == "pytest.mark.timing" for d in test.decorator_list)


def unmarked(source: str) -> list[str]:
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
        and times_the_clock(node)
        and not is_marked_timing(node)
    ]


def test_every_test_that_times_the_clock_is_marked_timing() -> None:
    found = {
        str(path.relative_to(TESTS)): names
        for path in sorted(TESTS.rglob("test_*.py"))
        if path != Path(__file__).resolve() and (names := unmarked(path.read_text()))
    }
    assert not found, f"mark these @pytest.mark.timing: {found}"


def test_the_guard_sees_an_elapsed_time() -> None:
    source = (
        "import time, pytest\n"
        "def test_a():\n    t0 = time.monotonic()\n    assert time.monotonic() - t0 < 1\n"
        "def test_b():\n    elapsed = 2\n    assert 0.5 <= elapsed < 3\n"
        "@pytest.mark.timing\ndef test_c():\n    elapsed = 2\n    assert elapsed < 3\n"
        "def test_d(deadline):\n    assert time.monotonic() < deadline\n"
    )
    assert unmarked(source) == ["test_a", "test_b"]
