"""The README and the documentation site (mkdocs.yml, docs/): the README is the site's home
page, the site builds with `mkdocs build --strict` and loads nothing from elsewhere, the
configuration page lists every setting, and the examples run and print what they say."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.bench_service import free_port, server_process

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def expected_prints(block: str) -> list[str]:
    """What each `print(...)` line of an example says it prints: its trailing comment, or
    else the comment line under it."""
    lines = block.splitlines()
    expected = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        trailing = line.partition("  # ")[2]
        if trailing:
            expected.append(trailing)
        else:
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            assert following.startswith("# "), f"the print has no comment saying what: {line}"
            expected.append(following[2:])
    return expected


def test_the_readme_is_the_home_page() -> None:
    readme = README.read_text()
    home = re.sub(r"\]\(([a-z-]+\.(?:md|png))\)", r"](docs/\1)", (DOCS / "index.md").read_text())
    assert readme == home, "README.md is docs/index.md with its links from the top folder"
    assert len(readme.splitlines()) <= README_MAX_LINES
    # The two set-up commands open it: the service, then the test suite.
    commands = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert commands is not None
    serve, test = commands.group(1).splitlines()
    assert "gradserve serve" in serve and "pytest" in test


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(re.findall(r": ([\w-]+\.md)$", nav, re.M))


def test_the_site_builds_strict_and_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    html = {p: p.read_text(errors="replace") for p in site.rglob("*.html")}
    assert len(html) >= 15
    # Nothing fetched from elsewhere: no stylesheet, script, font or image off the site.
    for page, text in html.items():
        remote = re.findall(r'(?:src|href)="(https?://[^"]+)"', text)
        loaded = [u for u in remote if re.search(r"\.(css|js|woff2?|ttf|png|svg)(\?|$)", u)]
        assert not loaded, f"{page.relative_to(site)} loads {loaded}"
        assert "fonts.googleapis" not in text
    # The configuration page's table, made from the settings.
    from gradserve.service.settings import Settings

    config = (site / "configuration.html").read_text()
    missing = [n for n in Settings.model_fields if f"GRADSERVE_{n.upper()}" not in config]
    assert not missing, f"settings missing from the configuration page: {missing}"
    # The API reference, from the docstrings.
    reference = (site / "reference.html").read_text()
    for name in (
        "client.http.Client",
        "client.trace.trace",
        "engine._tensor.Tensor",
        "engine.grad_mode.no_grad",
        "engine.gradcheck.gradcheck",
    ):
        assert f'id="gradserve.{name}"' in reference, name


def test_the_settings_table_says_every_default() -> None:
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from settings_table import settings_table  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    table = settings_table()
    assert "| `GRADSERVE_MAX_BODY_BYTES` | `67108864` (64 MiB) |" in table
    assert "| `GRADSERVE_COMPUTE_WORKERS` | unset |" in table
    assert "| `GRADSERVE_BODY_MIN_RATE_BYTES_S` | `65536` (64 KiB/s) |" in table
    assert "| `GRADSERVE_COMPUTE_BUDGET` | `5e+12` |" in table
    assert "| `GRADSERVE_API_KEYS` | empty |" in table


def test_the_engine_example_runs() -> None:
    blocks = [b for b in python_blocks(DOCS / "engine.md") if "import gradserve.engine" in b]
    assert blocks, "the engine page has no example"
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, "docs/engine.md", "exec"), namespace)  # our own docs
        assert namespace["z"].item() == -5.0  # type: ignore[attr-defined]
        assert namespace["x"].grad.item() == 4.0  # type: ignore[attr-defined]
        assert namespace["b"].tolist() == [41.0]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def live_server() -> object:
    port = free_port()
    argv = [sys.executable, "-m", "gradserve.service.cli", "serve", "--port", str(port)]
    with server_process(argv, port, ready="/readyz", start_s=90) as (base, _):
        yield base


@pytest.mark.parametrize("page", ["index.md", "getting-started.md"])
def test_the_client_example_prints_what_it_says(page: str, live_server: str) -> None:
    (block,) = [b for b in python_blocks(DOCS / page) if "Client(" in b]
    code = block.replace("http://127.0.0.1:8000", live_server)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs/{page}", "exec"), {})  # our own docs, against our server
    assert out.getvalue().splitlines() == expected_prints(block)


CURL_JSON = re.compile(
    r"curl -s '?localhost:8000(/[a-z]+)'? -H 'Content-Type: application/json' -d '(.*?)'\n"
    r"((?:# [^\n]*\n)*)",
    re.S,
)


def curl_examples() -> list[tuple[str, str, str, dict[str, object]]]:
    """Every `curl ... -d '<JSON>'` of the README and the site: (page, path, what the
    comment under it says, the body)."""
    found = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for path, body, comment in CURL_JSON.findall(page.read_text()):
            found.append((page.name, path, comment, json.loads(body)))
    return found


def leaves(value: object, out: dict[str, list[object]], skip: str = "timings_ms") -> None:
    """Every key of a JSON answer, at any depth, with its values."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key != skip:
                out.setdefault(key, []).append(inner)
                leaves(inner, out)
    elif isinstance(value, list):
        for inner in value:
            leaves(inner, out)


def test_the_curl_examples_answer_what_they_say(live_server: str) -> None:
    examples = curl_examples()
    assert len(examples) >= 6
    checked = 0
    with httpx.Client(base_url=live_server, timeout=60) as client:
        for page, path, comment, body in examples:
            r = client.post(path, json=body)
            assert r.status_code == 200, (page, path, r.text)
            answer: dict[str, list[object]] = {}
            leaves(r.json(), answer)
            # A number the comment gives as "key": value is the answer's (where the key
            # appears once in it).
            for key, said in re.findall(r'"(\w+)":\s*(-?[0-9][0-9.e+-]*)', comment):
                if len(answer.get(key, ())) == 1:
                    assert answer[key][0] == float(said), (page, path, key)
                    checked += 1
    assert checked >= 5
