"""POST /forward and POST /backward.

Both routes are `ComputeRoute`s: FastAPI still matches them, documents them and renders
their errors (every exception reaches the app's handlers), but a request skips FastAPI's
per-request machinery (a `Request`, two exit stacks, dependency solving, a `Response`),
which costs more than the seed example's compute. The handler reads the raw body, hands it
to the runner (which parses it once, with the contract's statuses) and sends the bytes back.
The endpoint functions below do the same through FastAPI's own path, and are what the
OpenAPI document describes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gradserve.service.compute import BINARY_HEADER
from gradserve.service.deps import runner_of
from gradserve.service.errors import ProblemError
from gradserve.service.middleware import TENANT
from gradserve.service.routes import operation_id
from gradserve.service.routes.explorer import EXAMPLES
from gradserve.service.runner import Runner
from gradserve.service.schemas import (
    BackwardRequest,
    BackwardResponse,
    ForwardRequest,
    ForwardResponse,
    PlanResponse,
)

_BINARY_HEADER = (b"content-type", b"application/octet-stream")
SEND_BYTES = 1 << 20  # a response's large parts go out in slices of this size
F = TypeVar("F", bound=Callable[..., Any])


class ComputeRoute(APIRoute):
    """A POST route whose body the runner parses: matched and documented by FastAPI,
    served by `handle` without FastAPI's per-request machinery."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.kind: str = endpoint.request_kind  # type: ignore[attr-defined]
        self._allow = ", ".join(self.methods or ())

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            raise HTTPException(status_code=405, headers={"Allow": self._allow})
        headers = scope["headers"]
        header_length = _binary_header_length(headers)
        _check_content_type(_header(headers, b"content-type"), binary=header_length is not None)
        runner: Runner = scope["app"].state.runner
        kind = _kind(self.kind, scope.get("query_string", b""))
        state = scope.get("state", {})
        reply = await runner.serve(kind, receive, _content_length(headers),
                                   state.get("request_id", "-"), header_length,
                                   state.get(TENANT))
        start = [(b"content-type", reply.media_type.encode())] \
            if reply.header_length is None else [
                _BINARY_HEADER, (BINARY_HEADER.encode(), b"%d" % reply.header_length)]
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [*start, (b"content-length", b"%d" % reply.nbytes)],
        })
        try:
            # Each tensor's bytes as they lie (no joined copy), in slices, so that the
            # server's write buffer (which copies what the socket does not take at once)
            # stays small.
            pieces = [part[at:at + SEND_BYTES] if isinstance(part, memoryview) else part
                      for part in reply.parts
                      for at in (range(0, len(part), SEND_BYTES) if isinstance(part, memoryview)
                                 else (0,))]
            for k, piece in enumerate(pieces):
                await send({"type": "http.response.body", "body": piece,
                            "more_body": k < len(pieces) - 1})
        finally:
            if reply.release is not None:
                reply.release()


def _kind(kind: str, query: bytes) -> str:
    """The request's kind: /plan's `?format=dot` asks for Graphviz DOT."""
    if kind != "plan" or not query:
        return kind
    # keep_blank_values: `format=` is neither json nor dot, as the document's enum says
    formats = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("format", ["json"])
    if formats[-1] not in ("json", "dot"):
        raise ProblemError("bad-request", f"format must be json or dot, not {formats[-1][:32]!r}",
                           errors=[{"loc": ["query", "format"], "msg": "json or dot"}])
    return "plan-dot" if formats[-1] == "dot" else kind


def parses(kind: str) -> Callable[[F], F]:
    """Mark an endpoint with the kind of request its `ComputeRoute` serves."""

    def mark(endpoint: F) -> F:
        endpoint.request_kind = kind  # type: ignore[attr-defined]
        return endpoint

    return mark


router = APIRouter(
    tags=["compute"], route_class=ComputeRoute, generate_unique_id_function=operation_id
)

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": why, "content": {"application/problem+json": {
        "schema": {"$ref": "#/components/schemas/Problem"}}}}
    for status, why in {
        400: "The body is not strict JSON (bare NaN and Infinity included), is empty, or is "
             "nested too deeply; or a binary body's sizes do not add up",
        401: "An API key is required",
        413: "The body is larger than the limit",
        409: "graph_id names a graph this server does not hold (graph-unknown): send the "
             "graph itself",
        415: "The body is not JSON (or, with Inference-Header-Content-Length, octet-stream)",
        422: "Invalid request, graph, tensor data, or memory plan over budget",
        503: "The server is at its concurrency or in-flight memory limit (see Retry-After)",
        504: "The request ran past its time limit",
    }.items()
}


BINARY_BODY = (
    "A binary body (the Open Inference Protocol's binary tensor extension): the JSON request "
    "as its header, then the raw little-endian bytes of every tensor that gives "
    "`binary_data_size` instead of `data` or `b64`, one after another in the order they "
    "appear in the header. The `Inference-Header-Content-Length` header gives the JSON "
    "header's length. With `\"encoding\": \"binary\"` the response is framed the same "
    "way (`application/octet-stream`, the same header).")


RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Outputs (and gradients); with encoding binary, framed as a binary "
                         "body", "content": {"application/octet-stream": {
                             "schema": {"type": "string", "format": "binary",
                                        "description": BINARY_BODY}}}},
    **PROBLEM_RESPONSES,
}


def _examples(*names: str) -> dict[str, Any]:
    """The explorer's examples (the contract's seed examples among them) as a body's: /docs
    offers them, and schemathesis sends them and checks their answers."""
    return {name: {"summary": EXAMPLES[name][0], "value": EXAMPLES[name][1]} for name in names}


def _body_schema(model: type, *examples: str) -> dict[str, Any]:
    # The body is parsed by hand (once, by pydantic-core, with the contract's statuses), so
    # FastAPI cannot see it: describe it here. The schema itself is registered in app.py.
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref, "examples": _examples(*examples)},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary", "description": BINARY_BODY}},
        }},
        "parameters": [{
            "name": "Inference-Header-Content-Length", "in": "header", "required": False,
            # ASCII digits (int64): anything else is a 400 malformed-body
            "schema": {"type": "integer", "format": "int64", "minimum": 0},
            "description": "Present: the body is binary (application/octet-stream, or a "
                           "JSON type), and this is the length in bytes of the JSON request "
                           "at its start, which the raw bytes of its `binary_data_size` "
                           "tensors follow, in order, to the body's end. A value that is not "
                           "a count, a length past the body, or a tail of another size is a "
                           "400 malformed-body; a length that ends the JSON request "
                           "elsewhere is a 400 malformed-json. Absent: the body is the JSON "
                           "request alone (`binary_data_size` is then a 400 malformed-body)",
        }],
    }


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


def _check_content_type(value: str | None, binary: bool = False) -> None:
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


def _binary_header_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """Inference-Header-Content-Length: the body is a JSON header of that many bytes, then
    the raw bytes of the tensors that give `binary_data_size`."""
    value = _header(headers, BINARY_HEADER.encode())
    if value is None:
        return None
    count = value.strip()
    # ASCII digits only: str.isdigit() also takes "²" (a latin-1 header byte), which int()
    # does not.
    if not (count.isascii() and count.isdigit()):
        raise ProblemError(
            "malformed-body", f"Inference-Header-Content-Length must be a byte count, not "
            f"{value[:64]!r}", errors=[{"loc": ["headers", BINARY_HEADER], "msg": "not a count"}])
    return int(count)


@router.post(
    "/forward",
    summary="Evaluate a graph (no_grad: the inference-only path)",
    response_model=ForwardResponse,
    responses=RESPONSES,
    openapi_extra=_body_schema(ForwardRequest, "seed-no-grad"),
)
@parses("forward")
async def forward(request: Request) -> Response:
    # What the OpenAPI document describes; requests are served by ComputeRoute.handle.
    return await _serve(request, "forward")


@router.post(
    "/backward",
    summary="Evaluate a graph and back-propagate: outputs and gradients",
    response_model=BackwardResponse,
    responses=RESPONSES,
    openapi_extra=_body_schema(BackwardRequest, "seed", "seed-expr", "mlp"),
)
@parses("backward")
async def backward(request: Request) -> Response:
    return await _serve(request, "backward")


@router.post(
    "/plan",
    summary="Plan a request without its data: memory, cost and admission, step by step",
    response_model=PlanResponse,
    responses={200: {"description": "The plan; with ?format=dot, Graphviz DOT of the "
                                    "program", "content": {"text/vnd.graphviz": {
                                        "schema": {"type": "string"}}}},
               **PROBLEM_RESPONSES},
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/PlanRequest"},
            "examples": _examples("seed", "seed-expr", "mlp")}}},
        "parameters": [{"name": "format", "in": "query", "required": False,
                        "schema": {"type": "string", "enum": ["json", "dot"]}}],
    },
)
@parses("plan")
async def plan(request: Request) -> Response:
    return await _serve(request, "plan")


async def _serve(request: Request, kind: str) -> Response:
    header_length = _binary_header_length(request.scope["headers"])
    _check_content_type(request.headers.get("content-type"), binary=header_length is not None)
    kind = _kind(kind, request.scope.get("query_string", b""))
    state = request.scope.get("state", {})
    reply = await runner_of(request).serve(
        kind, request.receive, _content_length(request.scope["headers"]),
        state.get("request_id", "-"), header_length, state.get(TENANT))
    try:
        content = b"".join(reply.parts)
    finally:
        if reply.release is not None:
            reply.release()
    if reply.header_length is None:
        return Response(content, media_type=reply.media_type)
    return Response(content, media_type="application/octet-stream",
                    headers={BINARY_HEADER: str(reply.header_length)})
