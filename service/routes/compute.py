"""POST /forward and POST /backward."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.deps import runner_of
from service.errors import ProblemError
from service.schemas import BackwardRequest, BackwardResponse, ForwardRequest, ForwardResponse

router = APIRouter(tags=["compute"])

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": why, "content": {"application/problem+json": {
        "schema": {"$ref": "#/components/schemas/Problem"}}}}
    for status, why in {
        400: "The body is not JSON, is empty, or is nested too deeply",
        401: "An API key is required",
        413: "The body is larger than the limit",
        415: "The body is not JSON",
        422: "Invalid request, graph, tensor data, or memory plan over budget",
        503: "The server is at its concurrency or in-flight memory limit (see Retry-After)",
        504: "The request ran past its time limit",
    }.items()
}


def _body_schema(model: type) -> dict[str, Any]:
    # The body is parsed by hand (once, by pydantic-core, with DESIGN's statuses), so
    # FastAPI cannot see it: describe it here. The schema itself is registered in app.py.
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _check_content_type(request: Request) -> None:
    value = request.headers.get("content-type")
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
async def forward(request: Request) -> Response:
    _check_content_type(request)
    content = await runner_of(request).run(await request.body(), ForwardRequest)
    return Response(content, media_type="application/json")


@router.post(
    "/backward",
    summary="Evaluate a graph and back-propagate: outputs and gradients",
    response_model=BackwardResponse,
    responses=PROBLEM_RESPONSES,
    openapi_extra=_body_schema(BackwardRequest),
)
async def backward(request: Request) -> Response:
    _check_content_type(request)
    content = await runner_of(request).run(await request.body(), BackwardRequest)
    return Response(content, media_type="application/json")
