"""GET /explorer: a page to look at a request, served by the service itself and offline.

The page (service/static/explorer/: plain HTML, CSS and JavaScript, nothing vendored)
plans a request with POST /plan and draws its program (the forward and backward steps,
with the shapes on the edges), its memory timeline against the budget and its most
expensive steps; it runs the request with POST /forward or /backward and shows the outputs,
gradients and timings as text, and a problem on the node that caused it.

Everything it loads comes from this service: the Content-Security-Policy allows 'self'
only (no inline script or style), so a page that tried to reach anything else would be
refused by the browser. None of these routes is part of the API: they are left out of
the OpenAPI document.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gradserve.service.routes import operation_id

STATIC = Path(__file__).resolve().parent.parent / "static" / "explorer"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

# The page's own files, by name, with their media types: nothing else is served.
ASSETS = {
    "explorer.js": "text/javascript; charset=utf-8",
    "explorer.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# The page, its files and its examples: data-free, so served without an API key (the
# Gateway's open paths) while everything the page asks of the API needs one.
PAGE_PATHS = frozenset(
    {"/explorer", "/explorer/examples.json", *(f"/explorer/{name}" for name in ASSETS)}
)

# The examples the page offers (`/explorer?example=NAME`): the contract's seed examples
# (docs/contract.md; tests/support/seeds.py has the same bodies) and a small least-squares MLP.
_SEED_INPUTS = {
    "x": {"data": 2.0, "requires_grad": True},
    "y": {"data": 3.0, "requires_grad": True},
}
EXAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "seed": (
        "z = (x + y) * (x - y), op form (/backward)",
        {
            "graph": {
                "nodes": [
                    {"id": "s", "op": "add", "args": ["x", "y"]},
                    {"id": "d", "op": "sub", "args": ["x", "y"]},
                    {"id": "z", "op": "mul", "args": ["s", "d"]},
                ],
                "outputs": ["z"],
            },
            "inputs": _SEED_INPUTS,
            "device": "cpu",
        },
    ),
    "seed-expr": (
        "z = (x + y) * (x - y), expr form (/backward)",
        {
            "graph": {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]},
            "inputs": _SEED_INPUTS,
        },
    ),
    "seed-no-grad": (
        "B = A ** 2 + 16 under no_grad (/forward)",
        {
            "graph": {"nodes": [{"id": "B", "expr": "A ** 2 + 16"}], "outputs": ["B", "A"]},
            "inputs": {"A": {"data": [5.0], "requires_grad": True}},
            "no_grad": True,
        },
    ),
    "mlp": (
        "a two-layer MLP's squared error (/backward)",
        {
            "graph": {
                "nodes": [
                    {"id": "h", "expr": "tanh(x @ w1)"},
                    {"id": "p", "expr": "h @ w2"},
                    {"id": "loss", "expr": "mean((p - t) ** 2)"},
                ],
                "outputs": ["loss"],
            },
            "inputs": {
                "x": {
                    "data": [
                        [0.5, -1.0, 2.0],
                        [1.5, 0.25, -0.5],
                        [0.0, 1.0, 1.0],
                        [-2.0, 0.5, 0.75],
                    ]
                },
                "w1": {
                    "data": [[0.1, -0.2, 0.3, 0.4], [0.5, 0.6, -0.7, 0.8], [-0.9, 1.0, 0.1, -0.2]],
                    "requires_grad": True,
                },
                "w2": {"data": [[0.3], [-0.1], [0.2], [0.5]], "requires_grad": True},
                "t": {"data": [[1.0], [0.0], [0.5], [-1.0]]},
            },
        },
    ),
}

router = APIRouter(tags=["explorer"], generate_unique_id_function=operation_id)


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/explorer", include_in_schema=False)
async def explorer() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@cache
def _examples_body() -> bytes:
    # Each body as JSON text, written here: a float stays a float (2.0, not 2, which the
    # service would read as an int64), whatever the browser's JSON does with numbers.
    return json.dumps(
        {name: {"title": title, "text": pretty(body)} for name, (title, body) in EXAMPLES.items()}
    ).encode()


def pretty(value: Any, indent: int = 0, column: int = 0, width: int = 80) -> str:
    """JSON with a member a line, indented by two, where it does not fit on its line
    (`column`: where it starts on that line)."""
    flat = json.dumps(value)
    if column + len(flat) <= width or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: " for k in value]
        items = [
            head + pretty(v, indent + 2, len(head) + 1, width)
            for head, v in zip(items, value.values(), strict=True)
        ]
    else:
        items = [pad + pretty(v, indent + 2, len(pad) + 1, width) for v in value]
    left, right = "{}" if isinstance(value, dict) else "[]"
    return left + "\n" + ",\n".join(items) + "\n" + " " * indent + right


@router.get("/explorer/examples.json", include_in_schema=False)
async def explorer_examples() -> Response:
    return Response(_examples_body(), media_type="application/json", headers=_HEADERS)


@router.get("/explorer/{name}", include_in_schema=False)
async def explorer_asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404)
    return Response(_read(name), media_type=media_type, headers=_HEADERS)
