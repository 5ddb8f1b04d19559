"""docs/other-languages.md, run: clients generated from a live server's `/openapi.json` by
the tools other languages use, with their default options, type-checked strictly and run
against that server, their printed values checked against the page's comments; and the
page's curl examples.

- TypeScript: openapi-typescript and openapi-fetch (pinned, with a lock file:
  tests/e2e/typescript), `tsc --strict`, run by Node. Node and npm come from the machine
  (.ci/run installs them from Debian where they are missing); without them the test skips
  and says why, and with GRADSERVE_TEST_REQUIRE_NODE=1 (.ci/run sets it) it fails instead.
- Python: openapi-python-client (the test extra), `mypy --strict` over the example and the
  generated package.

The server has an API key, so the document's security is the one a keyed server gives, and
the examples send it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ROOT, Server, start_server, stop_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = ROOT / "docs" / "other-languages.md"
TYPESCRIPT = ROOT / "tests" / "e2e" / "typescript"
KEY = "other-languages-key"
DOCS_BASE = "localhost:8000"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("server"), GRADSERVE_API_KEYS=KEY)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def document(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The live server's document, as a user fetches it (with the key)."""
    r = httpx.get(server.base + "/openapi.json", headers={"X-API-Key": KEY}, timeout=30)
    assert r.status_code == 200, r.text
    path = tmp_path_factory.mktemp("document") / "openapi.json"
    path.write_bytes(r.content)
    return path


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", PAGE.read_text(), re.M | re.S)


def _example(language: str) -> str:
    (code,) = _blocks(language)
    return code


def _expected_output(code: str, call: str, comment: str) -> list[str]:
    """The lines the example prints, as the page says: the first comment line after each
    `call` (which may span lines)."""
    expected: list[str] = []
    pending = None
    for line in code.splitlines():
        if call in line:
            assert pending is None, f"no expected output after {pending!r}"
            pending = line
        elif pending is not None and line.strip().startswith(comment):
            expected.append(line.strip()[len(comment) :].strip())
            pending = None
    assert pending is None, f"no expected output after {pending!r}"
    assert expected, f"no {call} in the example"
    return expected


def _env(server: Server) -> dict[str, str]:
    return {**os.environ, "GS_URL": server.base, "GS_API_KEY": KEY}


def _run(argv: list[str], cwd: Path, timeout: float = 300, **kwargs: object) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-8000:]}\n{done.stderr[-8000:]}"
    return str(done.stdout)


def _node_tools() -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        why = "node and npm not found (on Debian: apt-get install nodejs npm; .ci/run does)"
        if os.environ.get("GRADSERVE_TEST_REQUIRE_NODE") == "1":
            pytest.fail(f"GRADSERVE_TEST_REQUIRE_NODE=1 but {why}")
        pytest.skip(why)
    return node, npm


def test_the_typescript_example_type_checks_strictly_and_runs(
    server: Server, document: Path, tmp_path: Path
) -> None:
    node, npm = _node_tools()
    for name in ("package.json", "package-lock.json", "tsconfig.json"):
        shutil.copy(TYPESCRIPT / name, tmp_path / name)
    _run([npm, "ci", "--no-audit", "--no-fund"], tmp_path)
    bin_ = tmp_path / "node_modules" / ".bin"
    generated = _run([str(bin_ / "openapi-typescript"), str(document), "-o", "schema.ts"], tmp_path)
    assert "warn" not in generated.lower(), generated
    code = _example("ts")
    (tmp_path / "example.ts").write_text(code)
    # tsconfig.json: strict; the compiler's output is what Node runs.
    _run([str(bin_ / "tsc"), "-p", "."], tmp_path)
    printed = _run([node, "dist/example.js"], tmp_path, env=_env(server))
    assert printed.splitlines() == _expected_output(code, "console.log(", "//")


def test_the_generated_python_client_type_checks_strictly_and_runs(
    server: Server, document: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"post_hooks": []}))  # (no ruff over the generated code)
    generated = _run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(document),
            "--config",
            str(config),
            "--meta",
            "none",
            "--output-path",
            "gradserve_openapi_client",
        ],
        tmp_path,
    )
    assert "warning" not in generated.lower(), generated
    code = _example("python")
    (tmp_path / "example.py").write_text(code)
    _run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "example.py"], tmp_path)
    printed = _run([sys.executable, "example.py"], tmp_path, env=_env(server))
    assert printed.splitlines() == _expected_output(code, "print(", "#")


def _curls() -> list[str]:
    """Each curl command of the page's curl section, with its continuation lines."""
    section = PAGE.read_text().split("## curl", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S)
    return [
        "curl " + command.split("\n#", 1)[0].strip()
        for command in re.split(r"^curl ", block, flags=re.M)
        if command.strip()
    ]


def test_the_curl_examples_answer_as_the_page_says(server: Server) -> None:
    seed, dot, problem = (
        subprocess.run(
            ["bash", "-c", command.replace(DOCS_BASE, server.base)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(server),
            check=True,
        ).stdout
        for command in _curls()
    )
    answer = json.loads(seed)
    assert (answer["outputs"]["z"]["dtype"], answer["outputs"]["z"]["data"]) == ("float32", -5.0)
    assert (answer["gradients"]["x"]["data"], answer["gradients"]["y"]["data"]) == (4.0, -6.0)
    assert dot.startswith("digraph program {"), dot
    refused = json.loads(problem)
    assert refused["status"] == 422 and refused["type"].endswith(":invalid-request"), refused
    assert "give it a floating dtype" in refused["detail"], refused
