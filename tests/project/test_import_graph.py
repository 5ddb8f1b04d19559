"""Imports flow one way: the import graph of the packages, read statically from their
source, has no cycle.

Every import statement counts, at module level and inside functions alike (a lazy import
that closes a cycle is still a cycle: it is how the old engine tied tensor, autograd and
the op dispatch together), except those under `if TYPE_CHECKING:`, which never run.
An import of `a.b.c` is an edge to `a.b.c` alone: that Python runs the packages `a` and
`a.b` first is not an edge, or every package whose `__init__` imports its own submodules
would be a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The packages walked: the module name of each, and the folder that holds its source.
PACKAGES = {
    "gradserve": ROOT / "gradserve",
    "gradserve.engine": ROOT / "engine",
    "gradserve.service": ROOT / "service",
    "gradserve.client": ROOT / "client",
    "gradserve.wire": ROOT / "wire",
}


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the packages."""
    out: dict[str, Path] = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that can run (not under `if TYPE_CHECKING:`)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]
) -> set[str]:
    """The modules of the packages that an import statement imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        # `from pkg import sub` imports the submodule pkg.sub; `from mod import name`, mod.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return {n for n in names if n in known}


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set().union(
            *(_targets(module, is_package, n, known) for n in _imports(tree))
        ) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as the list of its modules, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_packages_import_without_a_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50
    assert graph["gradserve.engine._tensor"] >= {
        "gradserve.engine.autograd",
        "gradserve.engine.rules",
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_walk_finds_a_cycle_where_there_is_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start`'s modules (it and its submodules) can import."""
    todo = [m for m in graph if m == start or m.startswith(start + ".")]
    seen = set(todo)
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


# The eager engine: Tensor, autograd and what only they import (the rules under them are
# shared: the tracer computes shapes with them).
EAGER = ("gradserve.engine._tensor", "gradserve.engine.autograd", "gradserve.engine.functions")


def _within(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


def test_the_client_imports_neither_the_service_nor_the_eager_engine() -> None:
    found = reachable(import_graph(), "gradserve.client")
    assert not _within(found, "gradserve.service")
    assert not {m for m in found if m.startswith(EAGER)}
    assert "gradserve.wire.binary" in found  # (and the wire format, shared)


def test_the_service_never_imports_the_client() -> None:
    found = reachable(import_graph(), "gradserve.service")
    assert not _within(found, "gradserve.client")
    assert "gradserve.wire.graph_id" in found


def test_the_wire_format_imports_neither_side() -> None:
    found = reachable(import_graph(), "gradserve.wire")
    assert not _within(found, "gradserve.service") | _within(found, "gradserve.client")
    assert not {m for m in found if m.startswith(EAGER)}


def test_the_guards_see_an_import_that_crosses() -> None:
    graph = {
        "gradserve.client.x": {"gradserve.wire.y"},
        "gradserve.wire.y": {"gradserve.service.z"},
        "gradserve.service.z": set(),
    }
    assert "gradserve.service.z" in reachable(graph, "gradserve.client")
