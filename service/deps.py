"""Typed dependencies: what handlers get from the app they run in."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gradserve.service.metrics import Metrics
from gradserve.service.runner import Runner
from gradserve.service.settings import Settings


def runner_of(request: Request) -> Runner:
    """The compute routes take the runner straight from the app: no dependency to solve on
    the hot path (tens of microseconds a request)."""
    return request.app.state.runner  # type: ignore[no-any-return]


# async: a sync dependency would cost a thread hop per request.
async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
