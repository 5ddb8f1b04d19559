"""The one graph validator: the wire models (service/schemas.py) accept and refuse exactly
what the contract says a graph is (docs/contract.md, "Request"), and what they accept is
what the compiler compiles, with no copy in between.

The contract's rules are written out here once more, as an oracle independent of pydantic
(`contract_accepts`), and hypothesis sends the models graphs that are well-formed, wrong
in any field, or one change away from well-formed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph
from gradserve.engine.graph.spec import BodySpec
from gradserve.service.schemas import Graph
from tests.support.seeds import SEED_EXPR, SEED_NO_GRAD, SEED_OP

_NODE_KEYS = {"id", "op", "args", "attrs", "expr", "body", "results"}
_BODY_KEYS = {"carry", "xs", "nodes", "next"}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _names(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def contract_accepts(graph: Any) -> bool:
    """A graph as the contract describes it: an object of `nodes` (a list, default empty)
    and `outputs` (at least one name); unknown fields refused at every level; types
    strict (a number is not a string, 1 is not true)."""
    if not isinstance(graph, dict) or not graph.keys() <= {"nodes", "outputs"}:
        return False
    outputs = graph.get("outputs")
    return _strings(outputs) and len(outputs) > 0 and _nodes_ok(graph.get("nodes", []))


def _nodes_ok(nodes: Any) -> bool:
    return isinstance(nodes, list) and all(_node_ok(n) for n in nodes)


def _node_ok(node: Any) -> bool:
    """A node: a non-empty `id`; `op` (with `args`, node ids, names or numbers, and
    `attrs`, an object) or an infix `expr` (without them); a `scan` op has, and only it
    has, a `body` and `results` (new id -> name). Absent and null are the same."""
    if not isinstance(node, dict) or not node.keys() <= _NODE_KEYS:
        return False
    nid = node.get("id")
    if not isinstance(nid, str) or not nid or not _utf8(nid):
        return False
    op, expr = node.get("op"), node.get("expr")
    if (op is None) == (expr is None) or not isinstance(op if expr is None else expr, str):
        return False
    args, attrs = node.get("args"), node.get("attrs")
    if expr is not None and (args is not None or attrs is not None):
        return False
    if args is not None and not (
        isinstance(args, list) and all(isinstance(a, str | bool | int | float) for a in args)
    ):
        return False
    if attrs is not None and not (isinstance(attrs, dict) and _strings(list(attrs))):
        return False
    body, results = node.get("body"), node.get("results")
    if (op == "scan") != (body is not None) or (op == "scan") != (results is not None):
        return False
    if body is None:
        return True
    return (
        _names(results)
        and isinstance(body, dict)
        and body.keys() <= _BODY_KEYS
        and _strings(body.get("carry"))
        and _strings(body.get("xs", []))
        and _names(body.get("next"))
        and _nodes_ok(body.get("nodes", []))
    )


def model_accepts(graph: Any) -> bool:
    try:
        Graph.model_validate(graph)
    except ValidationError:
        return False
    return True


# ------------------------------------------------------------------ JSON values
# What a JSON parser makes (jiter also makes inf of 1e999, and ints past 64 bits).
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False),
    st.just(math.inf),
    st.text(max_size=4),
    st.sampled_from(["", "x", "add", "scan", "h", "ｘ", "\ud800", "a\ud800"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
names = st.sampled_from(["x", "y", "h", "h2", "n0", "n1", "out", "é", "", "\ud800"])
numbers = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False),
    st.just(math.inf),
)
name_lists = st.lists(names, max_size=3)
name_maps = st.dictionaries(names, names, max_size=3)
_ABSENT = object()


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its own type, else any JSON value, or absent."""
    return st.one_of(*[strategy] * 12, json_values, st.just(_ABSENT))


def _dict(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not _ABSENT}


@st.composite
def nodes(draw: st.DrawFn, depth: int = 0) -> Any:
    """A node dict: well-formed, or wrong in any field or combination of fields."""
    kind = draw(st.sampled_from(["op", "op", "op", "expr", "scan", "scan", "any"]))
    if kind == "any":
        return draw(json_values)
    node = {"id": draw(maybe(names))}
    if kind == "op":
        node |= _dict(
            op=draw(maybe(st.sampled_from(["add", "mul", "tanh", "nope"]))),
            args=draw(maybe(st.lists(st.one_of(names, numbers), max_size=3))),
            attrs=draw(maybe(st.dictionaries(names, json_values, max_size=2))),
        )
    elif kind == "expr":
        node |= _dict(
            expr=draw(maybe(st.sampled_from(["x + 1", "tanh(h)", ""]))),
            args=draw(st.sampled_from([_ABSENT, _ABSENT, None, [], ["x"]])),
            attrs=draw(st.sampled_from([_ABSENT, _ABSENT, None, {}])),
        )
    else:
        inner = st.lists(nodes(depth + 1), max_size=2) if depth < 2 else st.just([])
        body = _dict(
            carry=draw(maybe(name_lists)),
            xs=draw(maybe(name_lists)),
            nodes=draw(maybe(inner)),
            next=draw(maybe(name_maps)),
            **({"extra": 1} if draw(st.integers(0, 9)) == 0 else {}),
        )
        node |= _dict(
            op="scan",
            args=draw(maybe(st.lists(names, max_size=2))),
            body=draw(maybe(st.just(body))),
            results=draw(maybe(name_maps)),
        )
    if draw(st.integers(0, 19)) == 0:  # a field no node has, or a field taken away
        node[draw(st.sampled_from(["ids", "Op", "output"]))] = 1
    if draw(st.integers(0, 19)) == 0 and node:
        node.pop(draw(st.sampled_from(sorted(node))))
    if draw(st.integers(0, 19)) == 0:  # null where a field may be absent
        node[draw(st.sampled_from(["op", "expr", "args", "attrs", "body", "results"]))] = None
    return node


graphs = st.builds(
    lambda n, o, extra: _dict(nodes=n, outputs=o, **extra),
    maybe(st.lists(nodes(), max_size=4)),
    maybe(st.lists(names, min_size=1, max_size=2)),
    st.sampled_from([{}, {}, {}, {"inputs": {}}]),
)


@settings(max_examples=1500, deadline=None)
@given(graphs)
def test_the_models_accept_exactly_what_the_contract_says(graph: Any) -> None:
    assert model_accepts(graph) == contract_accepts(graph), graph


@st.composite
def valid_nodes(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    ident = draw(st.text(min_size=1, max_size=5).filter(lambda s: s.isprintable()))
    kind = draw(st.sampled_from(["op", "expr", "scan"] if depth < 2 else ["op", "expr"]))
    if kind == "op":
        return _dict(
            id=ident,
            op=draw(st.text(max_size=5)),
            args=draw(
                st.sampled_from([_ABSENT, None])
                | st.lists(
                    st.one_of(
                        st.text(max_size=3),
                        st.booleans(),
                        st.integers(),
                        st.floats(allow_nan=False),
                    ),
                    max_size=3,
                )
            ),
            attrs=draw(
                st.sampled_from([_ABSENT, None])
                | st.dictionaries(st.text(max_size=3), json_values, max_size=2)
            ),
        )
    if kind == "expr":
        return {"id": ident, "expr": draw(st.text(max_size=8))}
    body = _dict(
        carry=draw(name_lists),
        xs=draw(st.just(_ABSENT) | name_lists),
        nodes=draw(st.just(_ABSENT) | st.lists(valid_nodes(depth + 1), max_size=2)),
        next=draw(name_maps),
    )
    return {
        "id": ident,
        "op": "scan",
        "args": draw(st.lists(names, max_size=2)),
        "body": body,
        "results": draw(name_maps),
    }


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
    graph = {
        "nodes": draw(st.lists(valid_nodes(), min_size=1, max_size=3)),
        "outputs": draw(st.lists(st.text(max_size=3), min_size=1, max_size=2)),
    }
    assert contract_accepts(graph) or any(  # (well-formed but for a lone surrogate)
        not _utf8(str(c)) for c in _containers(graph)
    )
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
            target[
                draw(
                    st.sampled_from(
                        [
                            "id",
                            "op",
                            "args",
                            "attrs",
                            "expr",
                            "body",
                            "results",
                            "carry",
                            "xs",
                            "next",
                            "nodes",
                            "x",
                        ]
                    )
                )
            ] = draw(json_values)
    else:
        index = draw(st.integers(0, len(target) - 1))
        if how == "remove":
            del target[index]
        else:
            target[index] = draw(json_values)
    return graph


@settings(max_examples=1500, deadline=None)
@given(mutated())
def test_one_change_away_from_well_formed_the_models_still_follow_the_contract(graph: Any) -> None:
    assert model_accepts(graph) == contract_accepts(graph), graph


@settings(max_examples=300, deadline=None)
@given(st.lists(valid_nodes(), max_size=5), st.lists(st.text(max_size=4), min_size=1, max_size=3))
def test_every_well_formed_graph_is_accepted(node_list: list[Any], outputs: list[str]) -> None:
    graph = {"nodes": node_list, "outputs": outputs}
    assert model_accepts(graph) == contract_accepts(graph)


def test_the_oracle_refuses_what_it_should() -> None:
    # (so that the agreement above cannot come from an oracle that accepts everything)
    ok = {"nodes": [{"id": "z", "expr": "x + 1"}], "outputs": ["z"]}
    assert contract_accepts(ok) and model_accepts(ok)
    for bad in [
        {"nodes": [{"id": "z", "expr": "x + 1"}], "outputs": []},
        {"nodes": [{"id": "", "expr": "x + 1"}], "outputs": ["z"]},
        {"nodes": [{"id": "z", "expr": "x", "args": ["x"]}], "outputs": ["z"]},
        {"nodes": [{"id": "z", "op": "add", "expr": "x"}], "outputs": ["z"]},
        {"nodes": [{"id": "z", "op": "add", "args": [None]}], "outputs": ["z"]},
        {"nodes": [{"id": "z", "op": "add", "body": {}}], "outputs": ["z"]},
        {
            "nodes": [{"id": "z", "op": "scan", "body": {"carry": []}, "results": {}}],
            "outputs": ["z"],
        },
        {"nodes": [{"id": "z", "op": "add", "extra": 1}], "outputs": ["z"]},
        {"nodes": [{"id": 1, "op": "add"}], "outputs": ["z"]},
    ]:
        assert not contract_accepts(bad) and not model_accepts(bad), bad


# ------------------------------------------------------------------ what it accepts compiles
def _workload_graphs() -> list[dict[str, Any]]:
    from bench.workloads import small_workloads

    return [w.graph for w in small_workloads()]


def _spec(graph: dict[str, Any]) -> GraphSpec:
    """The engine's own spec of a graph, built from its JSON by hand."""

    def node(n: dict[str, Any]) -> NodeSpec:
        body = n.get("body")
        return NodeSpec(
            id=n["id"],
            op=n.get("op"),
            args=n.get("args") or (),
            attrs=n.get("attrs") or {},
            expr=n.get("expr"),
            results=n.get("results"),
            body=None
            if body is None
            else BodySpec(
                carry=body["carry"],
                xs=body.get("xs", []),
                nodes=[node(b) for b in body.get("nodes", [])],
                next=body["next"],
            ),
        )

    return GraphSpec(nodes=[node(n) for n in graph.get("nodes", [])], outputs=graph["outputs"])


@pytest.mark.parametrize("request_body", [SEED_OP, SEED_EXPR, SEED_NO_GRAD])
def test_the_validated_seed_compiles_as_the_engines_own_spec(request_body: Any) -> None:
    graph = request_body["graph"]
    inputs = {
        n: TensorSpec(
            np.shape(v["data"] if isinstance(v, dict) else v),
            "float32",
            isinstance(v, dict) and v.get("requires_grad", False),
        )
        for n, v in request_body["inputs"].items()
    }
    backward = any(t.requires_grad for t in inputs.values())
    a = compile_graph(Graph.model_validate(graph), inputs, backward=backward)
    b = compile_graph(_spec(graph), inputs, backward=backward)
    assert [(s.op.name, s.args.__repr__(), s.kind) for s in a.steps] == [
        (s.op.name, s.args.__repr__(), s.kind) for s in b.steps
    ]
    assert a.planned_peak_bytes == b.planned_peak_bytes and a.grad_fn == b.grad_fn


@pytest.mark.parametrize("graph", _workload_graphs(), ids=lambda g: str(len(g["nodes"])))
def test_the_benchmark_graphs_validate(graph: dict[str, Any]) -> None:
    assert model_accepts(graph) and contract_accepts(graph)
