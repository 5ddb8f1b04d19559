"""The FastAPI application: `create_app(settings)`; nothing is built at import."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRouter
from fastapi_offline import FastAPIOffline
from pydantic.json_schema import models_json_schema

from gradserve.engine.backends import parse_device
from gradserve.service.clock import SYSTEM_CLOCK, Clock
from gradserve.service.errors import install_handlers
from gradserve.service.front import Front
from gradserve.service.metrics import Metrics
from gradserve.service.middleware import PROBE_PATHS, Gateway
from gradserve.service.protocol import POLICY_STATE, ConnectionPolicy
from gradserve.service.routes import catalog, explorer, health, operation_id, tensors
from gradserve.service.routes.compute import ROUTES as COMPUTE_ROUTES
from gradserve.service.routes.compute import ComputeDoor, operations, problem_answer
from gradserve.service.schemas import (
    TENSOR_SCALAR_SCHEMA,
    BackwardRequest,
    BackwardResponse,
    DevicesResponse,
    ForwardRequest,
    ForwardResponse,
    Health,
    OpsResponse,
    PlanRequest,
    PlanResponse,
    Problem,
    TensorUpload,
    WireJsonSchema,
    with_body_limit,
)
from gradserve.service.settings import Settings, get_settings

log = logging.getLogger("gradserve")

DESCRIPTION = (
    "Gradient computation over JSON expression graphs, with PyTorch's autograd semantics. "
    "Errors are application/problem+json (RFC 9457)."
)


def _version() -> str:
    try:
        return version("gradserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    settings: Settings = app.state.settings
    parse_device(settings.default_device)  # fail at startup, not on the first request
    front: Front = app.state.front
    # The seed example, run once at startup so the first request pays for no lazy import;
    # and the compute workers, started and warm before the server says it is ready.
    await front.start()
    metrics: Metrics = app.state.metrics

    def drain() -> None:
        # Called by the HTTP protocol as soon as the server's shutdown begins (once per
        # open connection): /readyz answers 503 from then on.
        if app.state.ready:
            app.state.ready = False
            log.info("shutting down: /readyz now answers 503 while requests drain")

    # The connection limits, for the HTTP protocol: handed over in the lifespan state,
    # which uvicorn gives every connection of this server.
    policy = ConnectionPolicy.from_settings(
        settings,
        count=lambda reason: metrics.rejected[reason].inc(),
        drain=drain,
        clock=front.clock,
    )
    housekeeping = asyncio.create_task(front.housekeeping())
    # Several front processes (`--workers N`): this one's gauges, published for any
    # process's scrape, and the gauges of any that died before it (a replaced worker's).
    metrics.sweep()
    publisher = asyncio.create_task(metrics.publish_forever())
    # What exists now (the app, its routes, the imported modules) lives as long as the
    # process: out of the cycle collector's sight, which then scans only what requests make.
    gc.freeze()
    app.state.ready = True
    log.info("gradserve ready (default device %s)", parse_device(settings.default_device))
    try:
        yield {POLICY_STATE: policy}
    finally:
        app.state.ready = False
        housekeeping.cancel()
        publisher.cancel()
        await anyio.to_thread.run_sync(front.close)
        metrics.retire()


def create_app(settings: Settings | None = None, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    """The app for `settings` (None: from the environment). Its deadlines, waits and idle
    times run on `clock` (service/clock.py): the host's monotonic clock unless a test
    gives its own."""
    settings = settings or get_settings()
    metrics = Metrics()
    app = FastAPIOffline(
        title="gradserve",
        version=_version(),
        description=DESCRIPTION,
        docs_url="/docs",
        redoc_url=None,
        lifespan=_lifespan,
        generate_unique_id_function=operation_id,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.front = Front(settings, metrics, clock)
    app.state.ready = False
    install_handlers(app)
    app.router.routes.extend(COMPUTE_ROUTES)  # (for the 405 of a method other than POST)
    _add_routes(app, catalog.router)
    _add_routes(app, health.router)
    _add_routes(app, explorer.router)
    _add_routes(app, tensors.router)
    # Every HTTP request goes through the Gateway first (request id, key, body limit,
    # metrics, access log), and a compute POST then straight to its endpoint: FastAPI's
    # own stack serves the rest (service/routes/compute.py says why).
    fastapi_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: Gateway(  # type: ignore[method-assign]
        ComputeDoor(fastapi_stack()),
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        api_keys=[k.get_secret_value() for k in settings.api_keys],
        open_paths=explorer.PAGE_PATHS,
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_routes(app: FastAPI, router: APIRouter) -> None:
    """Put a router's routes on the app's own router. `include_router` keeps the router
    nested (FastAPI >= 0.16x), and every request then walks it: about 10 us a request on
    these machines, more than some requests' compute. Our routers have no prefix or
    dependencies of their own to apply, and each sets the operation ids itself."""
    app.router.routes.extend(router.routes)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document of its routes, plus the compute routes, which are plain ASGI
    endpoints (service/routes/compute.py), with every model written as the client
    generators read it (`WireJsonSchema`), with the bounds that are this app's settings
    (the body limit), and the API keys (required where the server has keys)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema(
            [
                (ForwardRequest, "validation"),
                (BackwardRequest, "validation"),
                (PlanRequest, "validation"),
                (TensorUpload, "validation"),
                (ForwardResponse, "serialization"),
                (BackwardResponse, "serialization"),
                (PlanResponse, "serialization"),
                (Problem, "serialization"),
                (OpsResponse, "serialization"),
                (DevicesResponse, "serialization"),
                (Health, "serialization"),
            ],
            ref_template="#/components/schemas/{model}",
            schema_generator=WireJsonSchema,
        )
        settings: Settings = app.state.settings
        schema["paths"] = {**operations(settings.max_body_bytes), **schema["paths"]}
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(
            with_body_limit(defs["$defs"], settings.max_body_bytes),
            TensorScalar=TENSOR_SCALAR_SCHEMA,
        )
        components["securitySchemes"] = SECURITY_SCHEMES
        keyed = bool(settings.api_keys)
        for path, methods in schema["paths"].items():
            if path in PROBE_PATHS:
                continue
            for operation in methods.values():
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
                if not keyed:  # (this server asks for no key: anonymous too)
                    operation["security"].append({})
                operation["responses"].setdefault("401", UNAUTHORIZED)
        app.openapi_schema = schema
    return app.openapi_schema


# An API key, as the Gateway reads it (service/middleware.py): either header.
SECURITY_SCHEMES = {
    "bearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "`Authorization: Bearer KEY`, with one of the server's API keys",
    },
    "apiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": "`X-API-Key: KEY`, the same keys",
    },
}
UNAUTHORIZED = problem_answer(
    "An API key is required (the server has keys, and none valid was sent)"
)


def app_from_env() -> FastAPI:
    """The factory `gradserve serve` gives uvicorn (each worker builds its own app)."""
    return create_app(Settings())
