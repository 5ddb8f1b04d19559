"""The floor of a front process on this machine: an ASGI app that reads a request's body
and answers `{}`, served by uvicorn as gradserve is (httptools, the asyncio loop). Its CPU
time per request, at a given spacing between requests, is what any uvicorn front costs
before it does anything (bench/bench_pipeline.py reads the front's figure against it).

    python3 -m uvicorn bench.empty_app:app --port N
"""

from __future__ import annotations

from typing import Any

EMPTY = [(b"content-type", b"application/json"), (b"content-length", b"2")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": EMPTY})
    await send({"type": "http.response.body", "body": b"{}"})
