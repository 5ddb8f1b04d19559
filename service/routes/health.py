"""Liveness, readiness and metrics: cheap, on the event loop, never behind the compute slots.

`HEAD /healthz` and `HEAD /readyz` answer as GET does (status and headers, no body); they
are left out of the OpenAPI document, as FastAPI would give each a duplicate operation id.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gradserve.service.deps import MetricsDep
from gradserve.service.errors import ProblemError
from gradserve.service.metrics import CONTENT_TYPE
from gradserve.service.routes import operation_id
from gradserve.service.schemas import Health

router = APIRouter(tags=["health"], generate_unique_id_function=operation_id)


@router.head("/healthz", include_in_schema=False)
@router.get("/healthz", summary="Liveness: the process serves HTTP", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.head("/readyz", include_in_schema=False)
@router.get(
    "/readyz",
    summary="Readiness: started and not shutting down",
    response_model=Health,
    responses={503: {"description": "Starting or shutting down"}},
)
async def readyz(request: Request) -> dict[str, str]:
    if not getattr(request.app.state, "ready", False):
        raise ProblemError("not-ready", "the service is starting or shutting down")
    return {"status": "ready"}


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}}},
)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE)
