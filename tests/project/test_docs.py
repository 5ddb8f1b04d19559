"""The README and the documentation site (mkdocs.yml, docs/): the README is the site's home
page, the site builds with `mkdocs build --strict` and loads nothing from elsewhere, the
configuration page lists every setting, and the examples run and print what they say.

Every fenced code block of the README and of docs/*.md is collected (`code_blocks`), and
each is either executed here against one live `gradserve serve` (python, shell and JSON
blocks: what they print or answer checked against what the page says), or listed in
`NOT_RUN` with the reason and with what can be checked of it offline (the repository's
files it names). A block that is neither fails `test_every_block_is_run_or_listed`."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.support.server import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# ------------------------------------------------------------------------ the code blocks

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    page: str  # from the repository root: "README.md", "docs/client.md"
    line: int  # of the opening fence
    lang: str
    text: str  # dedented, as a reader would copy it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks() -> list[Block]:
    """Every fenced code block of the README and of the site, in page order."""
    blocks = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            body = textwrap.dedent(m["body"])
            blocks.append(Block(str(page.relative_to(ROOT)), line, m["lang"], body))
    return blocks


BLOCKS = code_blocks()


def python_blocks(page: Path) -> list[str]:
    name = str(page.relative_to(ROOT))
    return [b.text for b in BLOCKS if b.page == name and b.lang == "python"]


def expected_prints(block: str) -> list[str]:
    """What each `print(...)` of an example says it prints: the comment after its closing
    parenthesis, or else the comment line under it. `...` in it stands for anything."""
    lines = block.splitlines()
    calls = [
        node
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if node.func.id == "print"
    ]
    expected = []
    for call in sorted(calls, key=lambda c: c.lineno):
        assert call.end_lineno is not None and call.end_col_offset is not None
        rest = lines[call.end_lineno - 1][call.end_col_offset :].strip()
        following = lines[call.end_lineno].strip() if call.end_lineno < len(lines) else ""
        said = rest if rest.startswith("# ") else following
        assert said.startswith("# "), f"the print has no comment saying what: line {call.lineno}"
        expected.append(said[2:])
    return expected


def says(said: str, actual: str) -> bool:
    """Whether `actual` is what `said` says, `...` standing for anything."""
    pattern = ".*".join(re.escape(part) for part in said.split("..."))
    return re.fullmatch(pattern, actual, re.S) is not None


def at(block: Block, needle: str) -> bool:
    return needle in block.text


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


# --------------------------------------------------- the blocks that do not run here, and why


def repository_names_exist(text: str) -> None:
    """The repository's files, the extras and the settings a command names exist."""
    named = re.findall(r"(?<![\w/.])((?:bench|deploy|docker|openapi|tests)/[\w./-]*\w)", text)
    named += [f"bench/{script}.py" for script in re.findall(r"-m bench\.(\w+)", text)]
    for path in named:
        assert (ROOT / path).exists(), f"no {path} in the repository"
    extras = PYPROJECT["project"]["optional-dependencies"]
    for group in re.findall(r"\.\[([\w,]+)\]", text):
        assert set(group.split(",")) <= set(extras), f"no such extra: .[{group}]"
    from gradserve.service.settings import Settings

    known = {f"GRADSERVE_{n.upper()}" for n in Settings.model_fields}
    for source in ["docker-compose.yml", *named]:
        if (ROOT / source).is_file():
            known |= set(re.findall(r"\bGRADSERVE_\w+", (ROOT / source).read_text()))
    unknown = set(re.findall(r"\bGRADSERVE_\w+", text)) - known
    assert not unknown, f"variables nothing reads: {sorted(unknown)}"


def serves_as_the_tests_do(text: str) -> None:
    """`gradserve serve` is the console script; the live server here runs its module."""
    repository_names_exist(text)
    assert PYPROJECT["project"]["scripts"]["gradserve"] == "gradserve.service.cli:main"
    assert "gradserve serve" in text


def generates_the_client_as_its_test_does(text: str) -> None:
    """The page's `openapi-python-client generate` is tests/service/test_openapi_tools.py's
    (which also turns the generator's post hooks off, with `--config`)."""
    from gradserve.service.cli import OPENAPI_PATH

    repository_names_exist(text)
    (command,) = [ln for ln in text.splitlines() if ln.startswith("openapi-python-client ")]
    words = shlex.split(command)[1:]
    assert words[0] == "generate"
    options = dict(zip(words[1::2], words[2::2], strict=True))
    source = (ROOT / "tests" / "service" / "test_openapi_tools.py").read_text()
    tree = ast.parse(source)
    (argv,) = [
        n.elts
        for n in ast.walk(tree)
        if isinstance(n, ast.List)
        if any(isinstance(e, ast.Constant) and e.value == "openapi_python_client" for e in n.elts)
    ]
    test = [e.value if isinstance(e, ast.Constant) else None for e in argv]
    assert test[test.index("openapi_python_client") + 1] == "generate"
    assert set(options) <= set(test), f"{sorted(options)} against {test}"
    assert options["--meta"] == test[test.index("--meta") + 1]
    assert options["--path"] == str(OPENAPI_PATH)
    constants = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert options["--output-path"] == constants["CLIENT_PACKAGE"]
    # The Python of the comment under it is what that test calls.
    for call in ("api.compute.backward", ".sync(client=", "models.BackwardRequest.from_dict("):
        assert call in text and call in source, call


def runs_as_the_bench_takes_it(text: str) -> None:
    repository_names_exist(text)
    bench = (ROOT / "bench" / "bench_capacity.py").read_text()
    for option, value in re.findall(r"(--[\w-]+) (\w+)", text):
        assert f'add_argument("{option}"' in bench, option
        assert f'"{value}"' in bench, value


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return services


def builds_and_runs_the_images_compose_names(text: str) -> None:
    """The Dockerfile takes the build arguments; the tags and shared memory are compose's."""
    repository_names_exist(text)
    dockerfile = (ROOT / "Dockerfile").read_text()
    for arg in re.findall(r"--build-arg (\w+)=", text):
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.M), arg
    services = compose_services()
    images = {s["image"] for s in services.values()}
    for tag in re.findall(r"-t (\S+)", text):
        assert tag in images, f"{tag} is not an image of docker-compose.yml"
    for size, tag in re.findall(r"--shm-size=(\S+) (\S+)", text):
        assert {s.get("shm_size") for s in services.values() if s["image"] == tag} == {size}
    for port in re.findall(r"-p \d+:(\d+)", text):
        assert f"GRADSERVE_PORT={port}" in dockerfile, f"the image does not serve on {port}"


def runs_what_compose_defines(text: str) -> None:
    """Each `docker compose [--profile P] up ... SERVICE` names a service of that profile;
    the ports it is then reached on are compose's defaults."""
    repository_names_exist(text)
    services = compose_services()
    compose = (ROOT / "docker-compose.yml").read_text()
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if "compose" not in words:
            continue
        profile = words[words.index("--profile") + 1] if "--profile" in words else None
        assert profile is None or any(profile in s.get("profiles", []) for s in services.values())
        for name in [w for w in words[words.index("up") + 1 :] if not w.startswith("-")]:
            assert name in services, name
            assert services[name].get("profiles", [profile]) == [profile], (name, profile)
    for port in re.findall(r"curl -s localhost:(\d+)/", text):
        assert f":-{port}}}" in compose, f"port {port} is no default of docker-compose.yml"


def deploys_the_manifests(text: str) -> None:
    """The manifests, the image line the `sed` rewrites, the Secret the Deployment reads,
    and the names `kubectl` waits on and forwards to."""
    repository_names_exist(text)
    for old, path in re.findall(r"sed 's#([^#]+)#[^#]*#' (\S+)", text):
        assert old in (ROOT / path).read_text(), (old, path)
    manifests = [
        doc
        for path in sorted((ROOT / "deploy").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    names = {(doc["kind"].lower(), doc["metadata"]["name"]) for doc in manifests}
    for kind, name in re.findall(r"\b(deployment|service)/([\w-]+)", text):
        assert (kind, name) in names, f"{kind}/{name}"
    deployment = (ROOT / "deploy" / "deployment.yaml").read_text()
    for name, key in re.findall(r"create secret generic ([\w-]+) --from-literal=(\w+)=", text):
        assert f"name: {name}" in deployment and f"key: {key}" in deployment, (name, key)
    (service,) = [
        d for d in manifests if (d["kind"], d["metadata"]["name"]) == ("Service", "gradserve")
    ]
    for port in re.findall(r"port-forward service/gradserve \d+:(\d+)", text):
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def run_by_the_other_languages_test(text: str) -> None:
    """tests/e2e/test_other_languages.py (slow, with Node and npm) runs the page's examples
    from the page itself: the TypeScript and the generated Python client, type-checked
    strictly, and the curl commands, each against a live server, their answers checked."""
    repository_names_exist(text)
    test = (ROOT / "tests" / "e2e" / "test_other_languages.py").read_text()
    assert '"docs" / "other-languages.md"' in test


@dataclass(frozen=True)
class NotRun:
    reason: str
    check: Callable[[str], None]  # what can be checked of it here, offline


SETUP = NotRun(
    "installs the package and starts a server that runs until stopped (the live server here "
    "is `gradserve serve`'s module) or runs the whole suite",
    serves_as_the_tests_do,
)
NOT_RUN: dict[tuple[str, str], NotRun] = {
    ("README.md", "gradserve serve"): SETUP,
    ("docs/index.md", "gradserve serve"): SETUP,
    ("docs/getting-started.md", "gradserve serve"): SETUP,
    ("docs/http-api.md", "openapi-python-client generate"): NotRun(
        "pip installs from PyPI; tests/service/test_openapi_tools.py (slow) generates the "
        "client from openapi/openapi.json with the same options and runs the seed with it",
        generates_the_client_as_its_test_does,
    ),
    **{
        ("docs/other-languages.md", needle): NotRun(
            "needs Node, npm and packages from their registries, and a generated client; "
            "tests/e2e/test_other_languages.py runs it, from this page",
            run_by_the_other_languages_test,
        )
        for needle in (
            "npm install openapi-fetch",
            "import createClient",
            "curl -s 'localhost:8000/plan?format=dot'",
            "pip install openapi-python-client",
            "from gradserve_openapi_client import",
        )
    },
    ("docs/operations.md", "bench.bench_capacity"): NotRun(
        "a benchmark of minutes, with Docker and HAProxy; tests/project/test_bench_smoke.py "
        "runs its load generator against one replica",
        runs_as_the_bench_takes_it,
    ),
    ("docs/deployment.md", "docker build -t gradserve:cpu ."): NotRun(
        "needs a Docker daemon (and a GPU with the NVIDIA Container Toolkit); "
        "tests/e2e/test_docker.py builds the image and runs it, on host networking and a "
        "free port rather than these flags",
        builds_and_runs_the_images_compose_names,
    ),
    ("docs/deployment.md", "docker compose up --build"): NotRun(
        "needs a Docker daemon and compose (and a GPU); tests/e2e/test_docker.py validates "
        "docker-compose.yml with each of its profiles",
        runs_what_compose_defines,
    ),
    ("docs/deployment.md", "--profile lb up"): NotRun(
        "needs a Docker daemon and compose; tests/e2e/test_balancer.py runs the same profile "
        "and service (`--profile lb up -d haproxy`, on images it built before: --no-build)",
        runs_what_compose_defines,
    ),
    ("docs/deployment.md", "kubectl apply"): NotRun(
        "needs a registry and a Kubernetes cluster; tests/e2e/test_deploy.py validates the "
        "manifests offline against the Kubernetes schemas",
        deploys_the_manifests,
    ),
}


# ------------------------------------------------- what the blocks answer, and what they say

CURL_JSON = re.compile(
    r"curl -s '?localhost:8000(/[a-z]+)'? -H 'Content-Type: application/json' -d '(.*?)'\n"
    r"((?:# [^\n]*\n)*)",
    re.S,
)
VOLATILE = {"timings_ms", "program", "tier", "tier_reason", "request_id"}  # shown, not fixed


def is_request(value: object) -> bool:
    return isinstance(value, dict) and ("graph" in value or "graph_id" in value)


def path_of(request: dict[str, Any]) -> str:
    """Where a request body goes: `path` is /plan's, `no_grad` /forward's."""
    return "/plan" if "path" in request else "/forward" if request.get("no_grad") else "/backward"


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


def shows(shown: object, live: object, where: str = "") -> None:
    """`shown` (a page's JSON) is `live` (an answer): the same keys at every depth, the same
    values but for VOLATILE keys' (timings, where the program came from), `...` in a string
    standing for anything."""
    if isinstance(shown, dict):
        assert isinstance(live, dict), f"{where}: {live!r}"
        assert set(shown) == set(live), f"{where}: {sorted(shown)} shown, {sorted(live)} answered"
        for key in shown:
            if key not in VOLATILE:
                shows(shown[key], live[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(live, list) and len(shown) == len(live), f"{where}: {live!r}"
        for i, (s, v) in enumerate(zip(shown, live, strict=True)):
            shows(s, v, f"{where}[{i}]")
    elif isinstance(shown, str) and "..." in shown:
        assert isinstance(live, str) and says(shown, live), f"{where}: {shown!r}, {live!r}"
    else:
        assert shown == live and type(shown) is type(live), f"{where}: {shown!r}, {live!r}"


def includes(live: object, shown: dict[str, Any], where: str) -> None:
    assert isinstance(live, dict), f"{where}: {live!r}"
    for key, value in shown.items():
        shows(value, live.get(key), f"{where}.{key}")


VARIANT = re.compile(r' with "(\w+)": (\S+): (\d{3}) ([a-z-]+)(?:, "(.*)")?$')
LITERAL = r'-?\d[\d.e+-]*|true|false|null|"[^"]*"'


def check_comment(
    comment: str, answer: Any, request: tuple[str, dict[str, Any]], client: httpx.Client
) -> int:
    """Check what the comment under a curl says of its answer; return how many statements
    were checked. Read: `"key": value` (a key found once in the answer, at any depth),
    `"key":[{...}, ... N steps` (its first element and its length), `z = -5.0; gradients
    x = 4.0` (outputs' and gradients' data), `B: {...}` (an output), `meta.key: a, b` (its
    keys), `A still requires grad`, `no gradients`, and `with "key": value: 422 slug,
    "detail"` (the same request with that field: its problem)."""
    said = " ".join(line[1:].strip() for line in comment.splitlines())
    checked = 0
    variant = VARIANT.search(said)
    if variant:
        said = said[: variant.start()]
        key, value, status, slug, detail = variant.groups()
        path, body = request
        r = client.post(path, json={**body, key: json.loads(value)})
        assert r.status_code == int(status), r.text
        assert r.json()["type"] == f"urn:gradserve:problem:{slug}", r.text
        assert detail is None or says(detail, r.json()["detail"]), r.text
        checked += 1
    found: dict[str, list[object]] = {}
    leaves(answer, found)
    once = {key: values[0] for key, values in found.items() if len(values) == 1}
    for key, value in re.findall(rf'"(\w+)":\s*({LITERAL})(?=[,}}\s]|$)', said):
        if key in once:
            shows(json.loads(value), once[key], key)
            checked += 1
    for key, first in re.findall(r'"(\w+)":\s*\[(\{[^{}]*\})', said):
        includes(once[key][0], json.loads(first), f"{key}[0]")  # type: ignore[index]
        steps = re.search(r"\.\.\. (\d+) steps", said)
        if steps:
            assert len(once[key]) == int(steps[1]), f"{key}: {len(once[key])} steps"  # type: ignore[arg-type]
        checked += 1
    for clause in (c.strip() for c in said.split(";")):
        pairs = re.fullmatch(r"(gradients )?(\w+ = -?[\d.]+(?:, \w+ = -?[\d.]+)*)", clause)
        if pairs:
            section = "gradients" if pairs[1] else "outputs"
            for name, value in re.findall(r"(\w+) = (-?[\d.]+)", pairs[2]):
                assert answer[section][name]["data"] == float(value), (section, name)
                checked += 1
        named = re.fullmatch(r"(\w+): (\{.*\})", clause)
        if named and named[1] in answer.get("outputs", {}):
            includes(answer["outputs"][named[1]], json.loads(named[2]), named[1])
            checked += 1
        keys = re.fullmatch(r"meta\.(\w+): (\w+(?:, \w+)*)", clause)
        if keys:
            assert set(answer["meta"][keys[1]]) == set(keys[2].split(", ")), clause
            checked += 1
        grad = re.fullmatch(r"(\w+) still requires grad", clause)
        if grad:
            assert answer["outputs"][grad[1]]["requires_grad"] is True, clause
            checked += 1
        if clause == "no gradients":
            assert "gradients" not in answer, clause
            checked += 1
    return checked


def check_binary_answer(folder: Path, comment: str) -> None:
    """`headers.txt: Inference-Header-Content-Length: H; answer.bin: H bytes of JSON, then
    y's bytes`: y = x * 2 + 1 of x.bin, framed as the header says."""
    assert "answer.bin: H bytes of JSON, then y's bytes" in comment, comment
    headers = (folder / "headers.txt").read_text()
    framed = re.search(r"(?im)^inference-header-content-length: (\d+)\s*$", headers)
    assert framed is not None, headers
    answer = (folder / "answer.bin").read_bytes()
    head, tail = answer[: int(framed[1])], answer[int(framed[1]) :]
    y = json.loads(head)["outputs"]["y"]
    assert (y["dtype"], y["binary_data_size"]) == ("float32", len(tail)), y
    x = np.fromfile(folder / "x.bin", dtype="<f4")
    assert np.array_equal(np.frombuffer(tail, dtype="<f4").reshape(y["shape"]), x * 2 + 1)


def run_shell(block: Block, base: str, folder: Path) -> list[tuple[int, str]]:
    """Run a shell block with bash in `folder`, against `base`; every curl's status and
    body, in order."""
    script = block.text
    if block.lang == "console":
        script = "\n".join(ln[2:] for ln in script.splitlines() if ln.startswith("$ "))
    script = script.replace("localhost:8000", base.removeprefix("http://"))
    wrapper = "curl() { command curl -w '\\nHTTP %{http_code}\\n' \"$@\"; }\n"
    bin_dir = str(Path(sys.executable).parent)  # `python3` is this interpreter
    result = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + wrapper + script],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    parts = re.split(r"\nHTTP (\d{3})\n", result.stdout)
    assert parts[-1] == "", result.stdout[-2000:]
    return [(int(code), body) for body, code in zip(parts[0:-1:2], parts[1::2], strict=True)]


def run_python(block: Block, base: str) -> tuple[list[str], dict[str, Any]]:
    """Run a python block in this process, against `base`: what it printed, its names."""
    code = block.text.replace("http://127.0.0.1:8000", base)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, block.id, "exec"), namespace)  # our own docs, against our server
    return out.getvalue().splitlines(), namespace


def block_at(page: str, needle: str) -> Block:
    (block,) = [b for b in BLOCKS if b.page == page and needle in b.text]
    return block


def request_above(block: Block) -> tuple[str, dict[str, Any]]:
    """The last request shown above a block on its page: a curl's body, or a JSON body."""
    found = None
    for b in BLOCKS:
        if b.page == block.page and b.line < block.line:
            if b.lang in SHELL:
                for m in CURL_JSON.finditer(b.text):
                    found = (m[1], json.loads(m[2]))
            elif b.lang == "json" and is_request(value := json.loads(b.text)):
                found = (path_of(value), value)
    assert found is not None, f"no request above {block.id}"
    return found


# (the failing call of docs/client.md's first example: a (3, 4) @ (5, 2) matmul)
MATMUL = {
    "graph": {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}], "outputs": ["z"]},
    "inputs": {"a": np.ones((3, 4)).tolist(), "b": np.ones((5, 2)).tolist()},
}


def the_answer_above(shown: Any, block: Block, base: str, client: httpx.Client) -> None:
    path, body = request_above(block)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    shows(shown, r.json())


def the_shape_mismatch_problem(shown: Any, block: Block, base: str, client: httpx.Client) -> None:
    r = client.post("/forward", json=MATMUL)
    assert r.status_code == shown["status"] == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    shows(shown, r.json())


def what_the_example_above_prints(
    shown: Any, block: Block, base: str, client: httpx.Client
) -> None:
    python = [b for b in BLOCKS if b.page == block.page and b.lang == "python"]
    (above,) = [b for b in python if b.line < block.line][-1:]
    printed, _ = run_python(above, base)
    dicts = [v for v in map(literal, printed) if isinstance(v, dict)]
    assert shown in dicts, printed


def literal(line: str) -> object:
    with contextlib.suppress(ValueError, SyntaxError):
        return ast.literal_eval(line)
    return None


def the_rnn_scan_node(shown: Any, block: Block, base: str, client: httpx.Client) -> None:
    """The node of the transforms' page's RNN, and what docs/client.md's `rnn` traces to."""
    from gradserve import trace

    rnn = json.loads(block_at("docs/transforms.md", '"op": "scan"').text)
    assert shown == next(n for n in rnn["graph"]["nodes"] if n.get("op") == "scan")
    _, names = run_python(block_at("docs/client.md", "def rnn("), base)
    shapes = {
        name: (np.asarray(v["data"] if isinstance(v, dict) else v).shape, "float32")
        for name, v in rnn["inputs"].items()
    }
    (traced,) = [n for n in trace(names["rnn"], **shapes)["nodes"] if n.get("op") == "scan"]
    assert (traced["body"], traced["results"]) == (shown["body"], shown["results"])


def the_per_sample_vmap_node(shown: Any, block: Block, base: str, client: httpx.Client) -> None:
    """The contract's vmap node, posted with the transforms' page's inputs: the per-sample
    gradients, their sum and their clipped sum, as NumPy computes them."""
    example = json.loads(block_at("docs/transforms.md", '"C2"').text)
    outputs = ["G1", "L", "S1", "C1"]
    answer = client.post(
        "/forward",
        json={**example, "graph": {"nodes": [shown], "outputs": outputs}},
    ).json()
    want = per_sample_reference(inputs_of(example))
    for name in outputs:
        np.testing.assert_allclose(data(answer, name), want[name], rtol=1e-5, atol=1e-6)


JSON_CHECKS: dict[tuple[str, str], Callable[[Any, Block, str, httpx.Client], None]] = {
    ("docs/http-api.md", '"grad_fn":"MulBackward"'): the_answer_above,
    ("docs/contract.md", '"outputs": {'): the_answer_above,
    ("docs/http-api.md", "problem:shape-mismatch"): the_shape_mismatch_problem,
    ("docs/contract.md", "problem:shape-mismatch"): the_shape_mismatch_problem,
    ("docs/contract.md", '"op": "scan"'): the_rnn_scan_node,
    ("docs/contract.md", '"op": "vmap"'): the_per_sample_vmap_node,
    ("docs/client.md", '"relu(X @ W1 + b1)"'): what_the_example_above_prints,
}


def inputs_of(body: dict[str, Any]) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(v["data"] if isinstance(v, dict) else v, dtype=np.float64)
        for name, v in body["inputs"].items()
    }


def data(answer: dict[str, Any], name: str) -> np.ndarray:
    return np.asarray(answer["outputs"][name]["data"])


def is_the_hessian_vector_product(body: dict[str, Any], answer: dict[str, Any], _: Any) -> None:
    w, x, v = (inputs_of(body)[k] for k in "wxv")
    np.testing.assert_allclose(data(answer, "g"), np.exp(w) * x + w * w, rtol=1e-5)
    np.testing.assert_allclose(data(answer, "hv"), (np.exp(w) * x + 2 * w) * v, rtol=1e-5)


def is_the_newton_step(body: dict[str, Any], answer: dict[str, Any], _: Any) -> None:
    a, b, w = (inputs_of(body)[k] for k in "Abw")
    g = a.T @ (a @ w - b) + w**3
    h = a.T @ a + np.diag(3 * w**2)
    np.testing.assert_allclose(data(answer, "w_next"), w - np.linalg.solve(h, g), rtol=1e-5)


def is_the_jacobian(body: dict[str, Any], answer: dict[str, Any], _: Any) -> None:
    m, x = (inputs_of(body)[k] for k in "Mx")
    t = np.tanh(m @ x)
    jacobian = (1 - t**2)[:, None] * m * x.sum() + t[:, None]
    np.testing.assert_allclose(data(answer, "J"), jacobian, rtol=1e-5, atol=1e-6)


def per_sample_reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The transforms' page's per-sample gradients, by hand in NumPy: each sample's
    gradients of sum((tanh(x W1) W2 - y)²), their sum, and Opacus's clipped sums."""
    X, Y, w1, w2 = (inputs[k] for k in ("X", "Y", "w1", "w2"))
    h = np.tanh(X @ w1)
    r = 2 * (h @ w2 - Y)
    g2 = np.einsum("ij,ik->ijk", h, r)
    g1 = np.einsum("ij,ik->ijk", X, (r @ w2.T) * (1 - h**2))
    norms = np.sqrt((g1**2).sum((1, 2)) + (g2**2).sum((1, 2)))
    factor = np.minimum(1.0 / (norms + 1e-6), 1.0)
    return {
        "L": ((h @ w2 - Y) ** 2).sum(1),
        "G1": g1,
        "S1": g1.sum(0),
        "C1": np.einsum("i,ijk->jk", factor, g1),
        "C2": np.einsum("i,ijk->jk", factor, g2),
    }


def is_the_clipped_per_sample_gradient(
    body: dict[str, Any], answer: dict[str, Any], _: Any
) -> None:
    want = per_sample_reference(inputs_of(body))
    for name in ("L", "S1", "C1", "C2"):
        np.testing.assert_allclose(data(answer, name), want[name], rtol=1e-5, atol=1e-6)


def is_the_jacobian_and_the_hessian(body: dict[str, Any], answer: dict[str, Any], _: Any) -> None:
    m, x = (inputs_of(body)[k] for k in "Mx")
    t = np.tanh(m @ x)
    jacobian = (1 - t**2)[:, None] * m * x.sum() + t[:, None]
    np.testing.assert_allclose(data(answer, "Jy"), jacobian, rtol=1e-5, atol=1e-6)
    p = np.exp(x) / np.exp(x).sum()
    np.testing.assert_allclose(data(answer, "H"), np.diag(p) - np.outer(p, p), atol=1e-6)


def is_the_scan_unrolled(body: dict[str, Any], answer: dict[str, Any], client: Any) -> None:
    scan = json.loads(block_at("docs/transforms.md", '"op": "scan"').text)
    looped = client.post("/backward", json=scan).json()
    np.testing.assert_allclose(data(answer, "loss"), data(looped, "loss"), rtol=1e-6)
    for name in ("w", "u"):
        got, want = answer["gradients"][name]["data"], looped["gradients"][name]["data"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


REQUEST_CHECKS: dict[tuple[str, str], Callable[[dict[str, Any], dict[str, Any], Any], None]] = {
    ("docs/transforms.md", '"hv"'): is_the_hessian_vector_product,
    ("docs/transforms.md", '"w_next"'): is_the_newton_step,
    ("docs/transforms.md", '"id": "J"'): is_the_jacobian,
    ("docs/transforms.md", '"x0"'): is_the_scan_unrolled,
    ("docs/transforms.md", '"C2"'): is_the_clipped_per_sample_gradient,
    ("docs/transforms.md", '"Jy"'): is_the_jacobian_and_the_hessian,
}


def listed(table: dict[tuple[str, str], Any], block: Block) -> Any:
    found = [v for (page, needle), v in table.items() if page == block.page and at(block, needle)]
    return found[0] if found else None


def how(block: Block) -> str:
    """How this suite runs a block ('' if it does not know it)."""
    if (not_run := listed(NOT_RUN, block)) is not None:
        return f"not run: {not_run.reason}"
    if block.lang == "python":
        return "python: run, its prints checked"
    if block.lang in SHELL and "localhost:8000" in block.text:
        return "shell: run with bash, its answers checked"
    if block.lang == "json":
        if (check := listed(JSON_CHECKS, block)) is not None:
            return f"json: checked as {check.__name__}"
        if is_request(json.loads(block.text)):
            return "json: a request, posted"
    return ""


def of(kind: str) -> list[Any]:
    return [pytest.param(b, id=b.id) for b in BLOCKS if how(b).startswith(kind)]


def test_every_block_is_run_or_listed() -> None:
    """Each block of the README and the site is run below, or listed in NOT_RUN with its
    reason; every entry of the tables names exactly one block."""
    unknown = [b.id for b in BLOCKS if not how(b)]
    assert not unknown, f"code blocks neither run nor listed in NOT_RUN: {unknown}"
    for table in (NOT_RUN, JSON_CHECKS, REQUEST_CHECKS):
        for page, needle in table:
            matching = [b.id for b in BLOCKS if b.page == page and at(b, needle)]
            assert len(matching) == 1, f"{page} {needle!r} names {matching}"
    assert {b.lang for b in BLOCKS} <= {"python", "json", "ts", *SHELL}, {b.lang for b in BLOCKS}
    assert len(BLOCKS) >= 30 and len(of("not run")) <= 15  # (a fence the pattern misses)


@pytest.mark.parametrize("block", of("not run"))
def test_what_a_block_not_run_names_is_the_repository(block: Block) -> None:
    listed(NOT_RUN, block).check(block.text)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_server(tmp_path_factory.mktemp("docs-server"))
    try:
        yield server.base
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def live_client(live_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server, timeout=60) as client:
        yield client


def test_the_engine_example_runs() -> None:
    blocks = [b for b in python_blocks(DOCS / "engine.md") if "import gradserve.engine" in b]
    assert blocks, "the engine page has no example"
    for block in blocks:
        namespace: dict[str, object] = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "docs/engine.md", "exec"), namespace)  # our own docs
        assert namespace["z"].item() == -5.0  # type: ignore[attr-defined]
        assert namespace["x"].grad.item() == 4.0  # type: ignore[attr-defined]
        assert namespace["b"].tolist() == [41.0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("block", of("python"))
def test_the_python_examples_print_what_they_say(block: Block, live_server: str) -> None:
    printed, _ = run_python(block, live_server)
    expected = expected_prints(block.text)
    assert len(printed) == len(expected), printed
    for actual, said in zip(printed, expected, strict=True):
        assert says(said, actual), f"printed {actual!r}, the page says {said!r}"


@pytest.mark.parametrize("block", of("shell"))
def test_the_shell_examples_answer_what_they_say(
    block: Block, live_server: str, live_client: httpx.Client, tmp_path: Path
) -> None:
    answers = run_shell(block, live_server, tmp_path)
    calls = [m.start() for m in re.finditer(r"\bcurl -s\b", block.text)]
    assert len(answers) == len(calls), answers
    by_start = {m.start(): m for m in CURL_JSON.finditer(block.text)}
    for start, (status, body) in zip(calls, answers, strict=True):
        m = by_start.get(start)
        comment = m[3] if m else block.text[start:].partition("\n#")[2]
        said = re.match(r"# (\d{3}) ", comment)
        assert status == (int(said[1]) if said else 200), body[:2000]
        if m is None:  # a binary body: its answer is in files
            check_binary_answer(tmp_path, comment)
            continue
        request = (m[1], json.loads(m[2]))
        checked = check_comment(comment, json.loads(body), request, live_client)
        assert checked or not comment, f"nothing checked of what it says: {comment}"


@pytest.mark.parametrize("block", of("json"))
def test_the_json_examples_answer_what_they_say(
    block: Block, live_server: str, live_client: httpx.Client
) -> None:
    value = json.loads(block.text)
    check = listed(JSON_CHECKS, block)
    if check is not None:
        check(value, block, live_server, live_client)
        return
    r = live_client.post(path_of(value), json=value)
    assert r.status_code == 200, r.text
    if (stated := listed(REQUEST_CHECKS, block)) is not None:
        stated(value, r.json(), live_client)
