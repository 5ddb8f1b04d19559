"""MkDocs hook: the benchmarks page's figures, from what the scripts printed. Where the page
says `{{ bench NAME }}`, it shows how bench/NAME.py measures (its docstring, folded) and
its last record, bench/results/NAME.md (written by `python3 -m bench.record NAME`, with
the date and the machine); a script never recorded says how to record it."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
MARKER = re.compile(r"^\{\{ bench (\w+) \}\}$", re.MULTILINE)


def method(script: str) -> str:
    """The script's docstring, folded under a note (read from its source: nothing imported)."""
    doc = ast.get_docstring(ast.parse((BENCH / f"{script}.py").read_text())) or ""
    body = textwrap.indent(f"```text\n{doc}\n```", "    ")
    return f'??? info "How `{script}` measures (its docstring)"\n\n{body}\n'


def record(script: str) -> str:
    path = RESULTS / f"{script}.md"
    if path.exists():
        return path.read_text()
    return (
        '!!! note "Not recorded yet"\n\n'
        f"    Run `python3 -m bench.record {script}` (its arguments after the name) and commit\n"
        f"    `bench/results/{script}.md`: this page then shows its output, with the date\n"
        "    and the machine.\n"
    )


def section(match: re.Match[str]) -> str:
    script = match.group(1)
    if not (BENCH / f"{script}.py").exists():
        raise ValueError(f"docs/benchmarks.md names bench/{script}.py, which does not exist")
    return f"{method(script)}\n{record(script)}"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(section, markdown)
