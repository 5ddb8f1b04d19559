"""The repository stands alone: nothing in it points at files outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["gradserve", "engine", "service", "client", "wire", "tests", "bench", "docs", "openapi"]
TOP_LEVEL = [
    "README.md",
    "mkdocs.yml",
    "Dockerfile",
    "docker-compose.yml",
    "pyproject.toml",
    ".dockerignore",
]
SUFFIXES = {".py", ".md", ".json", ".toml", ".yml", ".yaml", ".txt", ".sh", ""}
# Design notes kept outside the repository, and the directory next to it.
OUTSIDE = re.compile(r"\bDESIGN\b|\bPITFALLS\b|\.\./shared\b")


def _files() -> list[Path]:
    found = [ROOT / name for name in TOP_LEVEL if (ROOT / name).is_file()]
    for top in SOURCES:
        found += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    return sorted(found)


def test_nothing_points_outside_the_repository() -> None:
    # `.ci/run` is the one exception: it asks the CI environment for a base image where
    # that environment provides one.
    offenders = []
    for path in _files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_package_links_to_the_folders_beside_it() -> None:
    """gradserve/engine, service, client and wire are links to the folders beside them."""
    links = {
        p.relative_to(ROOT): p.resolve() for p in (ROOT / "gradserve").iterdir() if p.is_symlink()
    }
    assert links == {
        Path("gradserve") / name: ROOT / name for name in ("engine", "service", "client", "wire")
    }


def test_the_contract_is_in_the_repository() -> None:
    contract = (ROOT / "docs" / "contract.md").read_text()
    for must in [
        "POST /forward",
        "urn:gradserve:problem:",
        "GRADSERVE_MAX_BODY_BYTES",
        '"NaN"',
        "`expr` syntax",
        "`meta`",
    ]:
        assert must in contract
