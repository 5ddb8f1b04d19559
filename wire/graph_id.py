"""A graph's id (`graph_id`): the BLAKE2b-128 of its canonical JSON. The service names the
graphs it holds by it; the client computes it too, to send with every compute request
(`GRAPH_HEADER`) so that a balancer can send a graph's repeats to the replica that holds
its program, before any server has seen the graph. Here, with only orjson and the
standard library, so that the client need not import the server.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

# The request header that carries the graph's id: read by the HAProxy profile
# (docker/haproxy/haproxy.cfg), never by the service.
GRAPH_HEADER = "X-Gradserve-Graph"


def canonical_graph(graph: Any) -> bytes:
    """The graph as JSON with keys sorted, no whitespace, and numbers as orjson writes
    them (shortest round-trip digits; NumPy values as those), so that neither key order
    nor spacing changes it. Parsed again and written here, it gives the same bytes: the
    id a client computes from what it sends is the id the service computes from it."""
    try:
        return orjson.dumps(graph, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # an integer past 64 bits (which compiling will refuse)
        return json.dumps(graph, sort_keys=True, separators=(",", ":")).encode()


def id_of_canonical(canonical: bytes) -> str:
    """The id of a graph given as its canonical JSON: 32 hex digits."""
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def is_graph_id(text: str) -> bool:
    """Whether `text` is an id some graph can have (32 lowercase hex digits): anything else
    names no graph, and must not reach the program store as part of a file name."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def graph_key(graph: Any) -> str:
    """The graph's id, from the graph (as parsed from JSON, or as a client holds it): the
    inputs' data and the JSON's formatting do not change it."""
    return id_of_canonical(canonical_graph(graph))
