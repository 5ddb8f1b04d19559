"""GET /ops and GET /devices: what a client can ask for."""

from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from gradserve.engine.backends import available_devices, parse_device
from gradserve.engine.rules import catalog_ops
from gradserve.service.codec import dumps
from gradserve.service.deps import SettingsDep
from gradserve.service.routes import operation_id
from gradserve.service.schemas import DevicesResponse, OpsResponse

router = APIRouter(tags=["catalog"], generate_unique_id_function=operation_id)


@router.get("/ops", summary="The op catalog", response_model=OpsResponse)
async def ops() -> Response:
    return Response(_ops_body(), media_type="application/json")


@cache  # the registry is fixed once the engine is imported: encode it once
def _ops_body() -> bytes:
    return dumps({"ops": catalog_ops()})


@router.get(
    "/devices",
    summary="The devices this host can run on",
    response_model=DevicesResponse,
    response_model_exclude_none=True,
)
async def devices(settings: SettingsDep) -> dict[str, Any]:
    listed: list[dict[str, Any]] = []
    for name in available_devices():
        if name == "cpu":
            listed.append({"name": "cpu", "kind": "cpu"})
        else:
            # CuPy is there: cuda:N listed
            from gradserve.engine.backends.cupy_backend import device_info

            listed.append({"name": name, "kind": "cuda", **device_info(int(name.split(":")[1]))})
    return {"default": parse_device(settings.default_device), "devices": listed}
