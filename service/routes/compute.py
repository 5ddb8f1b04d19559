"""POST /forward, POST /backward and POST /plan.

Each is a plain ASGI endpoint (`ComputeEndpoint`): it reads the raw body itself (the front
process's compute path parses it once, where it runs, with the contract's statuses:
service/front.py) and sends the answer's bytes as they lie. A POST reaches it through
`ComputeDoor`, just inside the Gateway, not through FastAPI's middleware stack and router:
their seven layers (each wrapping `send`) cost more per request than the seed example's
compute, and a repeat sent to a worker spends nothing else in this process. Other methods
on these paths go on to the router, which holds the same routes, for its 405. Since
FastAPI does not document a plain route, `operations` describes the three for the OpenAPI
document (service/app.py puts them in it, with the app's body limit).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gradserve.engine.errors import GradserveError
from gradserve.service.errors import ProblemError, error_response
from gradserve.service.front import Front
from gradserve.service.middleware import TENANT
from gradserve.service.request import framing_problem
from gradserve.service.routes.explorer import EXAMPLES
from gradserve.service.schemas import schema_ref
from gradserve.wire.binary import BINARY_HEADER, FramingError, header_length_of

_OCTETS = (b"content-type", b"application/octet-stream")
_BINARY_HEADER = BINARY_HEADER.lower().encode()
SEND_BYTES = 1 << 20  # a response's large parts go out in slices of this size


class ComputeEndpoint:
    """The ASGI endpoint of one compute route: "forward", "backward" or "plan"."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        try:
            header_length = header_length_of(_header(headers, _BINARY_HEADER))
        except FramingError as err:
            raise framing_problem(err) from None
        check_content_type(_header(headers, b"content-type"), binary=header_length is not None)
        front: Front = scope["app"].state.front
        kind = _kind(self.kind, scope.get("query_string", b""))
        state = scope.get("state", {})
        reply = await front.serve(
            kind,
            receive,
            _content_length(headers),
            state.get("request_id", "-"),
            header_length,
            state.get(TENANT),
        )
        start = (
            [(b"content-type", reply.media_type.encode())]
            if reply.header_length is None
            else [_OCTETS, (_BINARY_HEADER, b"%d" % reply.header_length)]
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*start, (b"content-length", b"%d" % reply.nbytes)],
            }
        )
        try:
            # Each tensor's bytes as they lie (no joined copy), in slices, so that the
            # server's write buffer (which copies what the socket does not take at once)
            # stays small.
            pieces = [
                part[at : at + SEND_BYTES] if isinstance(part, memoryview) else part
                for part in reply.parts
                for at in (
                    range(0, len(part), SEND_BYTES) if isinstance(part, memoryview) else (0,)
                )
            ]
            for k, piece in enumerate(pieces):
                await send(
                    {"type": "http.response.body", "body": piece, "more_body": k < len(pieces) - 1}
                )
        finally:
            if reply.release is not None:
                reply.release()


class ComputeRoute(Route):
    """A Starlette route that names itself in the scope, as FastAPI's do: the metrics and
    the access log label a request by its route's path (service/middleware.py)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child


ROUTES = [
    ComputeRoute(f"/{kind}", ComputeEndpoint(kind), methods=["POST"], name=kind)
    for kind in ("forward", "backward", "plan")
]


class ComputeDoor:
    """POST /forward, /backward and /plan straight to their endpoints, their errors
    answered as the app's handlers answer them; everything else to `app` (the rest of the
    FastAPI app's stack)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.routes = {route.path: route for route in ROUTES}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # (what the metrics and the access log name it by)
        try:
            await route.app(scope, receive, send)
        except (ProblemError, GradserveError) as exc:
            # (Raised before the answer starts: after it, only the socket can fail.)
            if isinstance(exc, ProblemError) and exc.slug == "tensor-unknown":
                scope["app"].state.metrics.tensor_unknown.inc()
            response = error_response(exc, scope.get("state", {}).get("request_id"))
            await response(scope, receive, send)


def _kind(kind: str, query: bytes) -> str:
    """The request's kind: /plan's `?format=dot` asks for Graphviz DOT."""
    if kind != "plan" or not query:
        return kind
    # keep_blank_values: `format=` is neither json nor dot, as the document's enum says
    formats = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("format", ["json"])
    if formats[-1] not in ("json", "dot"):
        raise ProblemError(
            "bad-request",
            f"format must be json or dot, not {formats[-1][:32]!r}",
            errors=[{"loc": ["query", "format"], "msg": "json or dot"}],
        )
    return "plan-dot" if formats[-1] == "dot" else kind


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header `name` (lower case), as Starlette's `headers.get` gives it."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The declared body length (the Gateway has refused one that is not a number)."""
    value = _header(headers, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


def check_content_type(value: str | None, binary: bool = False) -> None:
    """JSON types; and for a binary body (Inference-Header-Content-Length), also
    application/octet-stream, as Triton takes it."""
    if value is None:
        return  # a body without a content type is read as JSON
    media = value.partition(";")[0].strip().lower()
    structured = media.startswith("application/") and media.endswith("+json")
    if binary and media == "application/octet-stream":
        return
    if media != "application/json" and not structured:
        raise ProblemError(
            "unsupported-media-type",
            f"the body must be application/json (or, with Inference-Header-Content-Length, "
            f"application/octet-stream), not {media or 'an empty content type'}",
        )


# ------------------------------------------------------------------ the OpenAPI document


def problem_responses(max_body_bytes: int) -> dict[str, dict[str, Any]]:
    """The compute routes' problem answers, by status (413 with the server's body limit)."""
    return {
        str(status): problem_answer(why)
        for status, why in {
            400: "The body is not strict JSON (bare NaN and Infinity included), is empty, or "
            "is nested too deeply; or a binary body's sizes do not add up",
            401: "An API key is required",
            413: f"The body is larger than the limit ({max_body_bytes} bytes)",
            409: "graph_id names a graph this server does not hold (graph-unknown): send the "
            "graph itself; or a tensor_id names a tensor it does not hold for this key "
            "(tensor-unknown): upload it again",
            415: "The body is not JSON (or, with Inference-Header-Content-Length, octet-stream)",
            422: "Invalid request, graph, tensor data, memory plan over budget, or a keep over "
            "the tensor quota",
            503: "The server is at its concurrency or in-flight memory limit (see Retry-After)",
            507: "The tensor store cannot be written, for a keep (tensor-store-unavailable)",
            504: "The request ran past its time limit",
        }.items()
    }


def problem_answer(why: str) -> dict[str, Any]:
    """An answer of the document's: a problem, for the reason `why`."""
    return {
        "description": why,
        "content": {"application/problem+json": {"schema": schema_ref("Problem")}},
    }


BINARY_BODY = (
    "A binary body (the Open Inference Protocol's binary tensor extension): the JSON request "
    "as its header, then the raw little-endian bytes of every tensor that gives "
    "`binary_data_size` instead of `data` or `b64`, one after another in the order they "
    "appear in the header. The `Inference-Header-Content-Length` header gives the JSON "
    'header\'s length. With `"encoding": "binary"` the response is framed the same '
    "way (`application/octet-stream`, the same header)."
)
_BINARY_SCHEMA = {"type": "string", "format": "binary", "description": BINARY_BODY}
# A 200's other media types, each answered only when the request asks for it (a field of
# its body, a query parameter): kept out of the response's `content`, where a generated
# client would type every JSON answer as JSON-or-string (openapi-fetch's `data`). Each says
# what asks for it.
ASKED_FOR = "x-gradserve-asked-for"


def _examples(*names: str) -> dict[str, Any]:
    """The explorer's examples (the contract's seed examples among them) as a body's: /docs
    offers them, and schemathesis sends them and checks their answers."""
    return {name: {"summary": EXAMPLES[name][0], "value": EXAMPLES[name][1]} for name in names}


def _compute(
    kind: str,
    summary: str,
    request: str,
    response: str,
    examples: tuple[str, ...],
    max_body_bytes: int,
) -> dict[str, Any]:
    return {
        "tags": ["compute"],
        "summary": summary,
        "operationId": kind,
        "responses": {
            "200": {
                "description": 'Outputs (and gradients). With `"encoding": "binary"` the '
                "answer is a binary body instead (application/octet-stream: "
                f"`{ASKED_FOR}`)",
                "content": {"application/json": {"schema": schema_ref(response)}},
                ASKED_FOR: {
                    "application/octet-stream": {
                        "schema": _BINARY_SCHEMA,
                        "when": "encoding binary",
                    }
                },
            },
            **problem_responses(max_body_bytes),
        },
        "parameters": [
            {
                "name": BINARY_HEADER,
                "in": "header",
                "required": False,
                # ASCII digits: anything else is a 400 malformed-body. At least 1: an empty
                # JSON request is a 400 malformed-json. At most the body limit: the JSON request
                # lies within the body, and a longer body is a 413 (a longer length, a 400
                # malformed-body).
                "schema": {
                    "type": "integer",
                    "format": "int64",
                    "minimum": 1,
                    "maximum": max_body_bytes,
                },
                "description": "Present: the body is binary (application/octet-stream, or a "
                "JSON type), and this is the length in bytes of the JSON request "
                "at its start, which the raw bytes of its `binary_data_size` "
                "tensors follow, in order, to the body's end. A value that is not "
                "a count, a length past the body, or a tail of another size is a "
                "400 malformed-body; a length that ends the JSON request "
                "elsewhere (an empty one included) is a 400 malformed-json. "
                "Absent: the body is the JSON request alone (`binary_data_size` "
                "is then a 400 malformed-body)",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": schema_ref(request),
                    "examples": _examples(*examples),
                },
                "application/octet-stream": {"schema": _BINARY_SCHEMA},
            },
        },
    }


def operations(max_body_bytes: int) -> dict[str, dict[str, Any]]:
    """The three operations, as the OpenAPI document describes them on a server whose body
    limit is `max_body_bytes` (the `max_body_bytes` setting). Their schemas are the wire
    models of service/schemas.py, which service/app.py registers."""
    return {
        "/forward": {
            "post": _compute(
                "forward",
                "Evaluate a graph (no_grad: the inference-only path)",
                "ForwardRequest",
                "ForwardResponse",
                ("seed-no-grad",),
                max_body_bytes,
            )
        },
        "/backward": {
            "post": _compute(
                "backward",
                "Evaluate a graph and back-propagate: outputs and gradients",
                "BackwardRequest",
                "BackwardResponse",
                ("seed", "seed-expr", "mlp"),
                max_body_bytes,
            )
        },
        "/plan": {
            "post": {
                "tags": ["compute"],
                "summary": "Plan a request without its data: memory, cost and admission, step by "
                "step",
                "operationId": "plan",
                "parameters": [
                    {
                        "name": "format",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["json", "dot"]},
                    }
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": schema_ref("PlanRequest"),
                            "examples": _examples("seed", "seed-expr", "mlp"),
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "The plan. With `?format=dot`, Graphviz DOT of the "
                        f"program instead (text/vnd.graphviz: `{ASKED_FOR}`)",
                        "content": {"application/json": {"schema": schema_ref("PlanResponse")}},
                        ASKED_FOR: {
                            "text/vnd.graphviz": {
                                "schema": {"type": "string"},
                                "when": "format dot",
                            }
                        },
                    },
                    **problem_responses(max_body_bytes),
                },
            }
        },
    }
