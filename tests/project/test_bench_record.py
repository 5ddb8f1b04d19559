"""The benchmarks page's figures are what the scripts printed: `bench.record` keeps a run's
output with the date and the machine, and docs/hooks/bench_results.py puts each record on
the page where it names the script; the page itself holds no table of its own."""

from __future__ import annotations

import datetime
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from bench import record

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_results", ROOT / "docs" / "hooks" / "bench_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a_run(stdout: str) -> record.Run:
    return record.Run(
        script="bench_plan",
        args=("--requests", "3"),
        stdout=stdout,
        returncode=0,
        seconds=4.2,
        started=datetime.datetime(2026, 12, 5, 14, 0, tzinfo=datetime.UTC),
        machine="a CPU, 2 cores",
        software="Python 3.11",
        environment=("OPENBLAS_CORETYPE=haswell",),
    )


def test_a_record_keeps_the_output_verbatim_under_its_facts() -> None:
    out = "table | a\n---|---\nrow | ``x``\n```\n"
    text = record.render(a_run(out))
    assert text.startswith(record.HEADER)
    assert "- **run** 2026-12-05 14:00 UTC: `python3 -m bench.bench_plan --requests 3`, 4 s" in text
    assert "- **machine** a CPU, 2 cores" in text
    assert "`OPENBLAS_CORETYPE=haswell`" in text
    # The output's own ``` cannot close the fence: it is one backtick longer.
    assert f"````text\n{out.rstrip()}\n````\n" in text


def test_the_machine_and_the_software_are_named() -> None:
    assert re.search(r"\d+ cores", record.machine())
    software = record.software()
    assert software.startswith("Python 3.") and "numpy " in software and "gradserve " in software


def test_a_run_is_saved_and_a_failed_one_keeps_the_record(tmp_path: Path) -> None:
    """A real run of the cheapest script (a server, two /plan requests), then a run that
    fails at its command line: the record of the first stays as it was."""
    assert record.main(["--results", str(tmp_path), "bench_plan", "--requests", "2"]) == 0
    saved = (tmp_path / "bench_plan.md").read_text()
    assert "`python3 -m bench.bench_plan --requests 2`" in saved
    assert "POST /plan, specs only, a new graph each request, 2 requests" in saved
    assert record.main(["--results", str(tmp_path), "bench_plan", "--no-such-flag"]) == 2
    assert (tmp_path / "bench_plan.md").read_text() == saved


def test_smoke_runs_and_unknown_scripts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench_plan", "--smoke"], ["bench_nothing"]):
        with pytest.raises(SystemExit) as exit_:
            record.main(argv)
        assert exit_.value.code == 2
    assert "--smoke run's figures mean nothing" in capsys.readouterr().err


def test_the_hook_shows_the_method_and_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = load_hook()
    monkeypatch.setattr(hook, "RESULTS", tmp_path)
    (tmp_path / "bench_plan.md").write_text(record.render(a_run("plan | 1.2 ms\n")))
    page = hook.on_page_markdown("# B\n\n{{ bench bench_plan }}\n\n{{ bench bench_serial }}\n")
    assert "{{" not in page
    assert '??? info "How `bench_plan` measures (its docstring)"' in page
    assert "POST /plan with specs only" in page  # bench_plan's docstring
    assert "plan | 1.2 ms" in page and "- **machine** a CPU, 2 cores" in page
    # A script never recorded says how to record it.
    assert "Not recorded yet" in page and "`python3 -m bench.record bench_serial`" in page
    with pytest.raises(ValueError, match=r"bench/bench_nothing\.py"):
        hook.on_page_markdown("{{ bench bench_nothing }}\n")


def test_the_page_names_every_script_once_and_types_no_figures() -> None:
    text = PAGE.read_text()
    named = re.findall(r"^\{\{ bench (\w+) \}\}$", text, re.MULTILINE)
    assert sorted(named) == record.scripts()
    tables = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    assert not tables, f"a table typed into the page: {tables[:2]}"


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("*.md")), ids=str)
def test_every_record_is_of_a_script_and_was_written_by_record(path: Path) -> None:
    assert path.stem in record.scripts()
    text = path.read_text()
    assert text.startswith(record.HEADER)
    assert f"`python3 -m bench.{path.stem}" in text and "- **machine** " in text
