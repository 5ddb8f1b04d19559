"""The CLI and the checked-in OpenAPI document."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gradserve.service.app import create_app
from gradserve.service.cli import main, openapi_text
from gradserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_openapi_document_has_not_drifted() -> None:
    committed = (ROOT / "openapi" / "openapi.json").read_text()
    assert openapi_text(create_app(Settings())) == committed, (
        "openapi/openapi.json is stale: run `gradserve openapi` and commit the result"
    )


def test_operation_ids_are_stable() -> None:
    spec = create_app(Settings()).openapi()
    ids = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert ids == {
        "forward",
        "backward",
        "plan",
        "ops",
        "devices",
        "healthz",
        "readyz",
        "metrics",
        "put_tensor",
        "list_tensors",
        "get_tensor",
        "delete_tensor",
    }


def test_openapi_command_writes_the_document(tmp_path: Path) -> None:
    out = tmp_path / "spec" / "openapi.json"
    assert main(["openapi", "--output", str(out)]) == 0
    assert json.loads(out.read_text()) == create_app(Settings()).openapi()


@pytest.fixture
def uvicorn_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_run(app: str, **kwargs: Any) -> None:
        seen.update(kwargs, app=app)

    monkeypatch.setattr("uvicorn.run", fake_run)
    # `serve` hands its flags to the workers through os.environ: keep that to this test.
    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("GRADSERVE_")}
    )
    return seen


def test_serve_defaults(uvicorn_run: dict[str, Any]) -> None:
    assert main(["serve"]) == 0
    assert uvicorn_run["app"] == "gradserve.service.app:app_from_env" and uvicorn_run["factory"]
    assert (uvicorn_run["host"], uvicorn_run["port"]) == ("127.0.0.1", 8000)
    assert (uvicorn_run["workers"], uvicorn_run["log_level"]) == (1, "info")
    assert uvicorn_run["access_log"] is False  # ours carries the request id
    assert "gradserve" in uvicorn_run["log_config"]["loggers"]


def test_serve_reads_env_and_flags_win(
    uvicorn_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("GRADSERVE_PORT", "9000")
    monkeypatch.setenv("GRADSERVE_LOG_LEVEL", "WARNING")
    assert main(["serve", "--port", "9100", "--workers", "2"]) == 0
    assert (uvicorn_run["host"], uvicorn_run["port"]) == ("0.0.0.0", 9100)
    assert (uvicorn_run["workers"], uvicorn_run["log_level"]) == (2, "warning")


def test_serve_refuses_bad_configuration(
    uvicorn_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("GRADSERVE_INFLIGHT_MEMORY_BYTES", "10")
    assert main(["serve"]) == 2
    assert "GRADSERVE_INFLIGHT_MEMORY_BYTES" in capsys.readouterr().err
    assert uvicorn_run == {}


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSERVE_API_KEYS", " key-one, key-two ,,")
    monkeypatch.setenv("GRADSERVE_MAX_BODY_BYTES", "1024")
    s = Settings()
    assert [k.get_secret_value() for k in s.api_keys] == ["key-one", "key-two"]
    assert s.max_body_bytes == 1024 and "key-one" not in repr(s)
    defaults = Settings(_env_file=None)
    assert defaults.no_grad_memory_budget_bytes < defaults.memory_budget_bytes
