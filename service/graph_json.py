"""A graph's parsed JSON straight into the compiler's GraphSpec, without the wire models.

Validating a graph with pydantic (`service.schemas.Graph`) and then converting the models
(`service.compute.graph_spec`) costs more than compiling the graph: ~3 µs and ~1.5 µs a
node. Most graphs are valid; for them `graph_spec_from_json` checks what the models would
check, in one pass over the JSON, and builds the same GraphSpec. Where it cannot vouch
that the models would accept the graph unchanged (anything invalid, or merely unusual: a
type the JSON parser never makes, scans nested very deep), it returns None, and the
caller validates with pydantic, so that every error a client sees is pydantic's.

The spec shares the JSON's lists and dicts (the models copy them): neither side changes
them afterwards.
"""

from __future__ import annotations

from typing import Any

from gradserve.engine.graph.spec import BodySpec, GraphSpec, NodeSpec

_GRAPH_KEYS = frozenset({"nodes", "outputs"})
_NODE_KEYS = frozenset({"id", "op", "args", "attrs", "expr", "body", "results"})
_BODY_KEYS = frozenset({"carry", "xs", "nodes", "next"})
_ARGS = frozenset({str, bool, int, float})  # service.schemas.Arg, in strict mode
# Scans nested past this are left to pydantic (whose recursion guard refuses them past
# about 250; the compiler refuses past Limits.max_loop_depth, 16 by default).
MAX_SCAN_DEPTH = 64

_new, _set = object.__new__, object.__setattr__


def graph_spec_from_json(obj: Any, *, max_nodes: int | None = None) -> GraphSpec | None:
    """The GraphSpec of a graph's parsed JSON, as `graph_spec(Graph.model_validate(obj))`
    gives it, or None where pydantic must decide (invalid, or not plain JSON data).
    `max_nodes`: None as well for a graph with more nodes than this (which the caller
    refuses by its own check, before any validation)."""
    if type(obj) is not dict or not obj.keys() <= _GRAPH_KEYS:
        return None
    outputs = obj.get("outputs")
    if not _strings(outputs) or not outputs:
        return None
    nodes = obj.get("nodes", [])
    if type(nodes) is not list or (max_nodes is not None and len(nodes) > max_nodes):
        return None
    specs = _nodes(nodes, 0)
    if specs is None:
        return None
    return GraphSpec(nodes=specs, outputs=outputs)


def _nodes(nodes: list[Any], depth: int) -> list[NodeSpec] | None:
    """`service.schemas.Node` and its `_op_or_expr` check, node by node; then the spec as
    `service.compute._node_specs` makes it."""
    specs = []
    node_keys, args_types = _NODE_KEYS, _ARGS
    for node in nodes:
        if type(node) is not dict or not node.keys() <= node_keys:
            return None
        nid = node.get("id")
        if type(nid) is not str or not nid or not (nid.isascii() or _unicode(nid)):
            return None  # (min_length=1: pydantic reads the text as UTF-8)
        op, expr = node.get("op"), node.get("expr")
        if (op is None) == (expr is None) or type(op if expr is None else expr) is not str:
            return None
        args, attrs = node.get("args"), node.get("attrs")
        if args is not None:
            if expr is not None or type(args) is not list:
                return None
            for arg in args:
                if type(arg) not in args_types:
                    return None
        if attrs is not None and (expr is not None or type(attrs) is not dict
                                  or not _strings(list(attrs))):
            return None
        body, results = node.get("body"), node.get("results")
        if (op == "scan") != (body is not None) or (op == "scan") != (results is not None):
            return None
        if body is not None:
            if depth >= MAX_SCAN_DEPTH or not _names(results):
                return None
            body = _body(body, depth + 1)
            if body is None:
                return None
        spec = _new(NodeSpec)
        # What NodeSpec(...) stores, without the frozen dataclass's __setattr__ per field
        # (which would take half the time of this function).
        _set(spec, "__dict__", {"id": nid, "op": op, "args": args or (), "attrs": attrs or {},
                                "expr": expr, "body": body, "results": results})
        specs.append(spec)
    return specs


def _body(body: Any, depth: int) -> BodySpec | None:
    """`service.schemas.Body`."""
    if type(body) is not dict or not body.keys() <= _BODY_KEYS:
        return None
    carry, xs = body.get("carry"), body.get("xs", [])
    if not _strings(carry) or not _strings(xs) or not _names(body.get("next")):
        return None
    nodes = body.get("nodes", [])
    if type(nodes) is not list:
        return None
    specs = _nodes(nodes, depth)
    if specs is None:
        return None
    return BodySpec(carry=body["carry"], xs=xs, nodes=specs, next=body["next"])


def _strings(value: Any) -> bool:
    """A list of str (list[str], strict)."""
    return type(value) is list and all(type(v) is str for v in value)


def _names(value: Any) -> bool:
    """A dict of str to str (dict[str, str], strict)."""
    return (type(value) is dict and all(type(k) is str for k in value)
            and all(type(v) is str for v in value.values()))


def _unicode(text: str) -> bool:
    """Text pydantic can read as UTF-8 (a lone surrogate it refuses where a string has a
    length constraint)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
