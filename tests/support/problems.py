"""Shared by the tests (from tests/service/test_service_api.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

PROBLEM = "application/problem+json"


def strict_json(response: httpx.Response) -> Any:
    """Parse as RFC 8259 JSON: a bare NaN or Infinity token fails."""

    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict JSON token {token} in the response")

    return json.loads(response.content, parse_constant=refuse)


def assert_problem(
    response: httpx.Response, status: int, slug: str, detail: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = strict_json(response)
    assert body["type"] == f"urn:gradserve:problem:{slug}"
    assert body["status"] == status
    assert body["title"] and body["detail"]
    assert body["request_id"] == response.headers["x-request-id"]
    assert "Traceback" not in response.text
    if detail is not None:
        assert detail in body["detail"], body["detail"]
    return body  # type: ignore[no-any-return]
