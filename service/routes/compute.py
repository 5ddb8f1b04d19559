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

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.deps import runner_of
from service.errors import ProblemError
from service.routes import operation_id
from service.runner import Runner
from service.schemas import BackwardRequest, BackwardResponse, ForwardRequest, ForwardResponse

_JSON_HEADER = (b"content-type", b"application/json")
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
        _check_content_type(_header(headers, b"content-type"))
        runner: Runner = scope["app"].state.runner
        content = await runner.serve(self.kind, receive, _content_length(headers),
                                     scope.get("state", {}).get("request_id", "-"))
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [_JSON_HEADER, (b"content-length", b"%d" % len(content))],
        })
        await send({"type": "http.response.body", "body": content})


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
             "nested too deeply",
        401: "An API key is required",
        413: "The body is larger than the limit",
        415: "The body is not JSON",
        422: "Invalid request, graph, tensor data, or memory plan over budget",
        503: "The server is at its concurrency or in-flight memory limit (see Retry-After)",
        504: "The request ran past its time limit",
    }.items()
}


def _body_schema(model: type) -> dict[str, Any]:
    # The body is parsed by hand (once, by pydantic-core, with the contract's statuses), so
    # FastAPI cannot see it: describe it here. The schema itself is registered in app.py.
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


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


def _check_content_type(value: str | None) -> None:
    if value is None:
        return  # a body without a content type is read as JSON
    media = value.partition(";")[0].strip().lower()
    structured = media.startswith("application/") and media.endswith("+json")
    if media != "application/json" and not structured:
        raise ProblemError(
            "unsupported-media-type",
            f"the body must be application/json, not {media or 'an empty content type'}",
        )


@router.post(
    "/forward",
    summary="Evaluate a graph (no_grad: the inference-only path)",
    response_model=ForwardResponse,
    responses=PROBLEM_RESPONSES,
    openapi_extra=_body_schema(ForwardRequest),
)
@parses("forward")
async def forward(request: Request) -> Response:
    # What the OpenAPI document describes; requests are served by ComputeRoute.handle.
    return await _serve(request, "forward")


@router.post(
    "/backward",
    summary="Evaluate a graph and back-propagate: outputs and gradients",
    response_model=BackwardResponse,
    responses=PROBLEM_RESPONSES,
    openapi_extra=_body_schema(BackwardRequest),
)
@parses("backward")
async def backward(request: Request) -> Response:
    return await _serve(request, "backward")


async def _serve(request: Request, kind: str) -> Response:
    _check_content_type(request.headers.get("content-type"))
    content = await runner_of(request).serve(
        kind, request.receive, _content_length(request.scope["headers"]),
        request.scope.get("state", {}).get("request_id", "-"))
    return Response(content, media_type="application/json")
