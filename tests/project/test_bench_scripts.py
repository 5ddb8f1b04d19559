"""No benchmark script rots unseen (bench_compile once failed at import, and nothing
noticed): each answers --help here, and runs end to end at its smallest size (`--smoke`)
in CI. The scripts are thin: what they share is bench.workloads and bench.harness, and the
server launcher is tests/support/server.py; no script imports another one."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))
SHARED = {"bench.workloads", "bench.harness"}
SMOKE_LIMIT_S = 600  # the longest, bench_hardening's, takes ~1.5 min on 2 shared cores


def bench_imports(path: Path) -> set[str]:
    """The bench modules `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "bench":
                names |= {f"bench.{a.name}" for a in node.names}
            else:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n == "bench" or n.startswith("bench.")}


def test_there_are_scripts() -> None:
    assert len(SCRIPTS) >= 16, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_imports_another(script: str) -> None:
    imported = bench_imports(ROOT / "bench" / f"{script}.py")
    assert imported <= SHARED, f"{script} imports {sorted(imported - SHARED)}"


def test_the_library_does_not_import_the_scripts() -> None:
    for module in SHARED:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert bench_imports(path) <= SHARED, module


def test_tests_import_the_library_not_the_scripts() -> None:
    """Tests use bench.workloads and bench.harness (and bench.record, which runs scripts as
    commands); only the bench's own test (test_bench_smoke.py, which checks what each
    script computes) imports scripts."""
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in {"test_bench_smoke.py", Path(__file__).name}:
            continue
        imported = bench_imports(path)
        allowed = SHARED | {"bench.record"}
        assert imported <= allowed, f"{path.relative_to(ROOT)} imports {sorted(imported)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each imports, and its `main(argv)` builds its command line, --smoke on it."""
    module = importlib.import_module(f"bench.{script}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--smoke" in out


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_LIMIT_S + 30)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_at_its_smallest_size(script: str) -> None:
    """`python3 -m bench.<script> --smoke`, as a user runs it: every part once, on tiny
    inputs (the figures mean nothing); it exits 0 and prints its table."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", "--smoke"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=SMOKE_LIMIT_S,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "|" in done.stdout or "µs" in done.stdout or "ms" in done.stdout, done.stdout[-3000:]
