"""A started app on an event loop in a thread, for synchronous tests (hypothesis's) that
drive it over httpx: test_service_fuzz's, which test_xla_service runs again."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from asgi_lifespan import LifespanManager

from gradserve.service.app import create_app
from gradserve.service.settings import Settings


@pytest.fixture(scope="module", name="portal_client")
def app_portal() -> Iterator[tuple[BlockingPortal, httpx.AsyncClient]]:
    """A started app on an event loop in a thread, for hypothesis's synchronous tests."""
    with start_blocking_portal("asyncio") as portal:

        async def start() -> tuple[LifespanManager, httpx.AsyncClient]:
            manager = LifespanManager(create_app(Settings()))
            await manager.__aenter__()
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(manager.app), base_url="http://test"
            )
            return manager, client

        manager, client = portal.call(start)
        try:
            yield portal, client
        finally:
            portal.call(client.aclose)
            portal.call(manager.__aexit__, None, None, None)
