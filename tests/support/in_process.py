"""gradserve in process: the app with its lifespan run, and an httpx client that calls it
over ASGI (no socket), for the API tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from gradserve.service.app import create_app
from gradserve.service.settings import Settings


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """`async with serving(**settings) as (client, app)`: an app made with these settings,
    started. The client waits up to 60 s: some requests compute for seconds in a worker.
    The start-up may take 60 s too: the first app of a test process starts the forkserver
    its compute workers fork from (a second or two on a loaded machine)."""
    app = create_app(Settings(**settings))
    async with (
        LifespanManager(app, startup_timeout=60) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(manager.app), base_url="http://test", timeout=60
        ) as client,
    ):
        yield client, app
