"""Routers, split by concern: compute, catalog (ops, devices), health (and metrics)."""

from __future__ import annotations

from fastapi.routing import APIRoute


def operation_id(route: APIRoute) -> str:
    # The handler's name: stable across FastAPI versions, so openapi.json does not drift.
    return route.name
