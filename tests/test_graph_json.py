"""gradserve.service.graph_json: a graph's JSON straight into a GraphSpec, exactly where the wire
models would accept it and give the same spec; None everywhere else (pydantic then says
what is wrong).

Besides these tests, tests/conftest.py checks every graph that the wire models accept
during the whole test suite (in-process requests) against the same function."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gradserve.engine.graph.spec import NodeSpec
from gradserve.service.compute import graph_spec
from gradserve.service.graph_json import MAX_SCAN_DEPTH, graph_spec_from_json
from gradserve.service.schemas import Graph
from tests.seeds import SEED_EXPR, SEED_NO_GRAD, SEED_OP


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (1, 1.0 and True differ; NaN is
    itself)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def pydantic_spec(graph: Any) -> Any:
    """What the service makes of a graph without the fast path (None: refused)."""
    try:
        return graph_spec(Graph.model_validate(graph))
    except ValidationError:
        return None


def check(graph: Any) -> Any:
    """The fast path never says more than pydantic: where it gives a spec, pydantic
    accepts the graph and gives the same one. Returns the fast spec."""
    fast = graph_spec_from_json(graph)
    if fast is not None:
        slow = pydantic_spec(graph)
        assert slow is not None, graph
        assert same(fast, slow), (fast, slow)
    return fast


# ------------------------------------------------------------------ JSON values
# What a JSON parser makes (jiter also makes inf of 1e999, and ints past 64 bits).
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**80, 2**80),
                    st.floats(allow_nan=False), st.just(math.inf), st.text(max_size=4),
                    st.sampled_from(["", "x", "add", "scan", "h", "ｘ", "\ud800", "a\ud800"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)
names = st.sampled_from(["x", "y", "h", "h2", "n0", "n1", "out", "é", "x", "y", "h", "n0",
                         "", "\ud800"])
numbers = st.one_of(st.booleans(), st.integers(), st.integers(-2**80, 2**80),
                    st.floats(allow_nan=False), st.just(math.inf))
name_lists = st.lists(names, max_size=3)
name_maps = st.dictionaries(names, names, max_size=3)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its own type, else any JSON value, or absent."""
    return st.one_of(*[strategy] * 12, json_values, st.just(_ABSENT))


_ABSENT = object()


def _dict(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not _ABSENT}


@st.composite
def nodes(draw: st.DrawFn, depth: int = 0) -> Any:
    """A node dict: well-formed, or wrong in any field or combination of fields."""
    kind = draw(st.sampled_from(["op", "op", "op", "expr", "scan", "scan", "scan", "any"]))
    if kind == "any":
        return draw(json_values)
    node = {"id": draw(maybe(names))}
    if kind == "op":
        node |= _dict(op=draw(maybe(st.sampled_from(["add", "mul", "tanh", "nope"]))),
                      args=draw(maybe(st.lists(st.one_of(names, numbers), max_size=3))),
                      attrs=draw(maybe(st.dictionaries(names, json_values, max_size=2))))
    elif kind == "expr":
        node |= _dict(expr=draw(maybe(st.sampled_from(["x + 1", "tanh(h)", ""]))),
                      args=draw(st.sampled_from([_ABSENT, _ABSENT, None, [], ["x"]])),
                      attrs=draw(st.sampled_from([_ABSENT, _ABSENT, None, {}])))
    else:
        inner = st.lists(nodes(depth + 1), max_size=2) if depth < 2 else st.just([])
        body = _dict(carry=draw(maybe(name_lists)), xs=draw(maybe(name_lists)),
                     nodes=draw(maybe(inner)), next=draw(maybe(name_maps)),
                     **({"extra": 1} if draw(st.integers(0, 9)) == 0 else {}))
        node |= _dict(op="scan", args=draw(maybe(st.lists(names, max_size=2))),
                      body=draw(maybe(st.just(body))), results=draw(maybe(name_maps)))
    if draw(st.integers(0, 19)) == 0:  # a field no node has, or a field taken away
        node[draw(st.sampled_from(["ids", "Op", "output"]))] = 1
    if draw(st.integers(0, 19)) == 0 and node:
        node.pop(draw(st.sampled_from(sorted(node))))
    if draw(st.integers(0, 19)) == 0:  # null where a field may be absent
        node[draw(st.sampled_from(["op", "expr", "args", "attrs", "body", "results"]))] = None
    return node


graphs = st.builds(lambda n, o, extra: _dict(nodes=n, outputs=o, **extra),
                   maybe(st.lists(nodes(), max_size=4)),
                   maybe(st.lists(names, min_size=1, max_size=2)),
                   st.sampled_from([{}, {}, {}, {"inputs": {}}]))


@settings(max_examples=1500, deadline=None)
@given(graphs)
def test_a_spec_only_where_pydantic_gives_the_same_and_none_only_where_it_refuses(
        graph: Any) -> None:
    fast = check(graph)
    if fast is None:  # (plain JSON, scans nested a few deep: nothing else to leave to it)
        assert pydantic_spec(graph) is None, graph


# ------------------------------------------------------------------ well-formed graphs
@st.composite
def valid_nodes(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    ident = draw(st.text(min_size=1, max_size=5).filter(lambda s: s.isprintable()))
    kind = draw(st.sampled_from(["op", "expr", "scan"] if depth < 2 else ["op", "expr"]))
    if kind == "op":
        return _dict(id=ident, op=draw(st.text(max_size=5)),
                     args=draw(st.sampled_from([_ABSENT, None]) | st.lists(
                         st.one_of(st.text(max_size=3), st.booleans(), st.integers(),
                                   st.floats(allow_nan=False)), max_size=3)),
                     attrs=draw(st.sampled_from([_ABSENT, None]) | st.dictionaries(
                         st.text(max_size=3), json_values, max_size=2)))
    if kind == "expr":
        return {"id": ident, "expr": draw(st.text(max_size=8))}
    body = _dict(carry=draw(name_lists), xs=draw(st.just(_ABSENT) | name_lists),
                 nodes=draw(st.just(_ABSENT) | st.lists(valid_nodes(depth + 1), max_size=2)),
                 next=draw(name_maps))
    return {"id": ident, "op": "scan", "args": draw(st.lists(names, max_size=2)),
            "body": body, "results": draw(name_maps)}


@settings(max_examples=500, deadline=None)
@given(st.lists(valid_nodes(), max_size=5), st.lists(st.text(max_size=4), min_size=1,
                                                     max_size=3))
def test_every_well_formed_graph_goes_the_fast_way(node_list: list[Any],
                                                   outputs: list[str]) -> None:
    assert check({"nodes": node_list, "outputs": outputs}) is not None


def _containers(value: Any) -> list[Any]:
    """Every dict and list inside `value`, itself included."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            found.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed graph with one thing changed: a value replaced by any JSON value, a
    key or an item taken away, or a key added."""
    graph = {"nodes": draw(st.lists(valid_nodes(), min_size=1, max_size=3)),
             "outputs": draw(st.lists(st.text(max_size=3), min_size=1, max_size=2))}
    target = draw(st.sampled_from(_containers(graph)))
    if not target:
        return graph
    how = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
    if isinstance(target, dict):
        key = draw(st.sampled_from(sorted(target)))
        if how == "replace":
            target[key] = draw(json_values)
        elif how == "remove":
            del target[key]
        else:
            target[draw(st.sampled_from(["id", "op", "args", "attrs", "expr", "body",
                                         "results", "carry", "xs", "next", "nodes", "x"]))] \
                = draw(json_values)
    else:
        index = draw(st.integers(0, len(target) - 1))
        if how == "remove":
            del target[index]
        else:
            target[index] = draw(json_values)
    return graph


@settings(max_examples=1500, deadline=None)
@given(mutated())
def test_a_graph_one_change_away_from_well_formed_goes_the_way_pydantic_says(
        graph: Any) -> None:
    fast = check(graph)
    if fast is None:
        assert pydantic_spec(graph) is None, graph


def _workload_graphs() -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import bench_compiled
    finally:
        sys.path.pop(0)
    return [w.graph for w in bench_compiled.small_workloads()]


@pytest.mark.parametrize("graph", [SEED_OP["graph"], SEED_EXPR["graph"], SEED_NO_GRAD["graph"],
                                   *_workload_graphs()])
def test_the_seeds_and_the_benchmark_graphs_go_the_fast_way(graph: dict[str, Any]) -> None:
    assert check(graph) is not None


# ------------------------------------------------------------------ left to pydantic
def _scan(node: dict[str, Any], name: str) -> dict[str, Any]:
    return {"id": name, "op": "scan", "args": [], "results": {},
            "body": {"carry": [], "nodes": [node], "next": {}}}


def test_scans_nested_very_deep_are_left_to_pydantic() -> None:
    node: dict[str, Any] = {"id": "n", "op": "add", "args": ["x"]}
    for depth in range(MAX_SCAN_DEPTH):
        node = _scan(node, f"s{depth}")
    assert check({"nodes": [node], "outputs": ["n"]}) is not None
    assert graph_spec_from_json({"nodes": [_scan(node, "top")], "outputs": ["n"]}) is None


@pytest.mark.parametrize("graph", [
    {"nodes": [{"id": "a", "op": "add", "args": ("x",)}], "outputs": ["a"]},  # a tuple
    {"nodes": [{"id": "a", "op": "add"}], "outputs": ("a",)},
    {"nodes": [type("D", (dict,), {})(id="a", op="add")], "outputs": ["a"]},
    {"nodes": [{"id": "a", "op": type("S", (str,), {})("add")}], "outputs": ["a"]},
    {"nodes": [{"id": "a", "op": "add", "args": [type("I", (int,), {})(1)]}], "outputs": ["a"]},
    [("nodes", []), ("outputs", ["a"])],
])
def test_what_a_json_parser_never_makes_is_left_to_pydantic(graph: Any) -> None:
    assert graph_spec_from_json(graph) is None


def test_a_node_spec_is_what_its_constructor_makes() -> None:
    node = {"id": "a", "op": "add", "args": ["x", 1], "attrs": {"k": [1]}}
    fast = graph_spec_from_json({"nodes": [node], "outputs": ["a"]})
    assert fast is not None
    (spec,) = fast.nodes
    made = NodeSpec(id="a", op="add", args=["x", 1], attrs={"k": [1]})
    assert vars(spec) == vars(made) and list(vars(spec)) == list(vars(made))
    assert spec == made and repr(spec) == repr(made) and type(spec) is NodeSpec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.op = "mul"  # type: ignore[misc]


def test_more_nodes_than_the_caller_takes_are_left_to_it() -> None:
    graph = {"nodes": [{"id": f"n{k}", "op": "add"} for k in range(3)], "outputs": ["n0"]}
    assert graph_spec_from_json(graph, max_nodes=3) is not None
    assert graph_spec_from_json(graph, max_nodes=2) is None


def test_a_lone_surrogate_in_an_id_is_refused_as_pydantic_refuses_it() -> None:
    graph = {"nodes": [{"id": "a\ud800", "op": "add"}], "outputs": ["a\ud800"]}
    assert graph_spec_from_json(graph) is None and pydantic_spec(graph) is None
    graph = {"nodes": [{"id": "a", "op": "add", "args": ["\ud800"]}], "outputs": ["\ud800"]}
    assert check(graph) is not None  # (elsewhere, a string is taken as it is)
