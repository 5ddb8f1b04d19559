"""gradserve in process: the app with its lifespan run, and an httpx client that calls it
over ASGI (no socket), for the API tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gradserve.service.app import create_app
from gradserve.service.clock import SYSTEM_CLOCK, Clock
from gradserve.service.settings import Settings


@asynccontextmanager
async def serving(
    clock: Clock = SYSTEM_CLOCK, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """`async with serving(**settings) as (client, app)`: an app made with these settings,
    started, its time on `clock` (a `ManualClock` for a test that moves it itself). The
    client waits up to 60 s of real time: some requests compute for seconds in a worker.
    The start-up may take 60 s too: the first app of a test process starts the forkserver
    its compute workers fork from (a second or two on a loaded machine)."""
    app = create_app(Settings(**settings), clock)
    async with (
        LifespanManager(_state_per_request(app), startup_timeout=60) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(manager.app), base_url="http://test", timeout=60
        ) as client,
    ):
        yield client, app


def _state_per_request(app: ASGIApp) -> ASGIApp:
    """Each request gets its own shallow copy of the lifespan's state, as the ASGI spec has
    servers do (uvicorn does): asgi_lifespan hands every request the one dict, so that
    concurrent requests would overwrite each other's request id in it."""

    async def copying(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" and "state" in scope:
            scope = {**scope, "state": dict(scope["state"])}
        await app(scope, receive, send)

    return copying
