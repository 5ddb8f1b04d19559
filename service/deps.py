"""Typed dependencies: what handlers get from the app they run in."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gradserve.service.metrics import Metrics
from gradserve.service.settings import Settings


# async: a sync dependency would cost a thread hop per request.
async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
