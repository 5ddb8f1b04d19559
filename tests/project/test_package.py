"""One package: `pip install .` puts one import name on the path, `gradserve`, and its base
install is a client without the server.

The wheel is built once, as the Docker image builds it (setup.py's mypyc build where there
is a C compiler), from a copy of the sources that the package is made of. It is installed
with its base dependencies alone into a fresh virtual environment, which then traces and
runs the seed against a live `gradserve serve` over HTTP.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.server import Server, start_server, stop_server
from tests.support.user_code import MISTAKES, USER_CODE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DIST_INFO = "gradserve-0.1.0.dist-info"
PAGE_FILES = ["index.html", "explorer.css", "explorer.js", "favicon.svg"]
# What the `server` extra brings, by import name: none of it is in the base install.
SERVER_ONLY = (
    "fastapi",
    "uvicorn",
    "starlette",
    "pebble",
    "pydantic",
    "pydantic_settings",
    "msgspec",
    "simdjson",
    "prometheus_client",
)
# The eager engine: the client traces with the rules alone.
EAGER = ("gradserve.engine._tensor", "gradserve.engine.autograd", "gradserve.engine.functions")
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy: the build writes its record of the compiled modules
    next to their sources, which must not touch this checkout's editable install."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "_native.json")
    for package in ("engine", "service", "client", "wire"):
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    shutil.copytree(ROOT / "gradserve", src / "gradserve", symlinks=True, ignore=skip)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        cwd=tmp,
        timeout=540,
        env=PIP_ENV,
    )
    (built,) = (tmp / "dist").glob("gradserve-*.whl")
    return built


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and its base dependencies only (from the
    package index, as `pip install gradserve` would have them)."""
    venv = tmp_path_factory.mktemp("client") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True,
        timeout=540,
        env=PIP_ENV,
    )
    return python


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("server"))
    yield s
    stop_server(s)


def test_every_exported_name_is_the_one_its_module_defines() -> None:
    code = (
        "import gradserve, importlib, json; "
        "print(json.dumps([n for n in gradserve.__all__ if getattr(gradserve, n) is not "
        "getattr(importlib.import_module(gradserve._EXPORTS[n]), n)]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []
    import gradserve

    assert set(gradserve.__all__) <= set(dir(gradserve))
    with pytest.raises(AttributeError, match="no attribute 'Tensor'"):
        gradserve.Tensor  # noqa: B018  the engine's names live in gradserve.engine


def _run(python: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=python.parent,
    )  # away from this checkout


def test_the_wheel_holds_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"gradserve", DIST_INFO}
    for name in PAGE_FILES:  # the explorer page (GET /explorer) ships with the service
        assert f"gradserve/service/static/explorer/{name}" in names
    assert "gradserve/engine/ops/registry.py" in names
    assert "gradserve/py.typed" in names  # PEP 561: mypy reads the installed package's types
    # mypyc's modules and their shared library, where this machine compiled them
    assert all(name.startswith("gradserve/engine/graph/") for name in names if name.endswith(".so"))


def test_installed_it_puts_gradserve_on_the_path_and_nothing_else(client_venv: Path) -> None:
    listing = _run(
        client_venv,
        (
            "import importlib.metadata as m, importlib.util as u, json; "
            "files = m.files('gradserve'); "
            "print(json.dumps({'top': sorted({f.parts[0] for f in files if f.parts[0] != '..'}), "
            f"'server': [n for n in {SERVER_ONLY!r} if u.find_spec(n)]}}))"
        ),
    )
    assert listing.returncode == 0, listing.stderr
    found = json.loads(listing.stdout)
    assert found == {"top": ["gradserve", DIST_INFO], "server": []}

    serve = subprocess.run(
        [str(client_venv.parent / "gradserve"), "serve"], capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 2
    assert "pip install 'gradserve[server]'" in serve.stderr and "fastapi" in serve.stderr


LIGHT_CLIENT = """
import json, sys
import numpy as np
from gradserve import Client, F, trace

def seed(x, y):
    return {"z": (x + y) * (x - y)}

def loss(w):
    return {"loss": F.tanh(w @ w).sum()}

offline = trace(seed, x=((), "float32"), y=((), "float32"))  # the standard catalog
w = np.linspace(-1.0, 1.0, 256).reshape(16, 16)  # 256 elements: a binary body both ways
with Client(sys.argv[1]) as gs:
    served = gs.trace(seed, x=((), "float32"), y=((), "float32"))  # the server's catalog
    r = gs.backward(seed, {"x": 2.0, "y": 3.0})
    big = gs.backward(loss, {"w": w})
heavy = [m for m in sys.modules if m.split(".")[0] in json.loads(sys.argv[2])
         or m in json.loads(sys.argv[3])]
print(json.dumps({"offline": offline, "served": served, "z": float(r.outputs["z"]),
                  "gx": float(r.gradients["x"]), "gy": float(r.gradients["y"]),
                  "loss": float(big.outputs["loss"]), "gw": big.gradients["w"].tolist(),
                  "heavy": heavy}))
"""


def test_the_eager_engine_is_named_by_modules_that_exist() -> None:
    """EAGER names real modules: were one renamed, the client test's check that the client
    loads none of them could not fail."""
    assert [name for name in EAGER if importlib.util.find_spec(name) is None] == []


def test_the_client_alone_traces_and_runs_the_seed(client_venv: Path, server: Server) -> None:
    run = _run(client_venv, LIGHT_CLIENT, server.base, json.dumps(SERVER_ONLY), json.dumps(EAGER))
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    expected_graph = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
    assert got["offline"] == got["served"] == expected_graph
    assert (got["z"], got["gx"], got["gy"]) == (-5.0, 4.0, -6.0)
    # d/dW sum(tanh(W @ W)) = G @ W.T + W.T @ G, G = 1 - tanh(W @ W)^2, in float64
    w = np.linspace(-1.0, 1.0, 256).reshape(16, 16)
    a = np.tanh(w @ w)
    g = 1.0 - a**2
    assert got["loss"] == pytest.approx(a.sum(), rel=1e-12)
    np.testing.assert_allclose(got["gw"], g @ w.T + w.T @ g, rtol=1e-12, atol=1e-12)
    assert got["heavy"] == []


def test_user_code_type_checks_against_the_installed_wheel(
    client_venv: Path, tmp_path: Path
) -> None:
    """mypy, strict, over tests/typecheck/user_code.py and a copy with MISTAKES, with
    gradserve found in the wheel's venv alone (tests/project/test_typing.py: the checkout's). mypy
    is this environment's, pointed at the venv's interpreter; it runs away from the
    checkout, without its configuration, and with the checkout off PYTHONPATH. The mistakes
    keep it able to fail: a gradserve not found, or found untyped, is `Any` and they would
    pass unseen; and the file mypy read for `gradserve` must be the venv's."""
    code = USER_CODE.read_text()
    (tmp_path / USER_CODE.name).write_text(code)
    broken = tmp_path / "broken_user_code.py"
    broken.write_text(code + "\n" + "\n".join(MISTAKES) + "\n")
    first = code.count("\n") + 2  # the line of the first mistake
    path = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(ROOT)
    ]  # tests/hooks, the root
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    env |= {"PYTHONPATH": os.pathsep.join(path)} if path else {}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--verbose",
            "--config-file",
            os.devnull,
            "--python-executable",
            str(client_venv),
            USER_CODE.name,
            broken.name,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out, log = result.stdout, result.stderr  # the errors; --verbose's log

    assert "missing library stubs or py.typed marker" not in out, out
    assert "Cannot find implementation" not in out, out
    read = re.findall(r"^LOG: +Parsing (\S+) \(gradserve\)$", log, re.M)
    assert [Path(p).resolve() for p in read] == [
        (
            client_venv.parent.parent / "lib" / f"python{sys.version_info.major}."
            f"{sys.version_info.minor}" / "site-packages" / "gradserve" / "__init__.py"
        ).resolve()
    ], read
    errors = re.findall(r"^(.+?):(\d+): error: (.*)$", out, re.M)
    assert not [e for e in errors if Path(e[0]).name == USER_CODE.name], out
    found = {int(line): message for file, line, message in errors if Path(file).name == broken.name}
    assert set(found) == set(range(first, first + len(MISTAKES))), out
    for (line, message), expected in zip(sorted(found.items()), MISTAKES.values(), strict=True):
        assert expected in message, (line, message)
    assert result.returncode == 1, out  # errors found, and only the mistakes (above)
