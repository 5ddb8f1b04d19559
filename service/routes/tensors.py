"""Tensors held by id (service/tensors.py): `POST /tensors` uploads one, `GET /tensors`
lists the caller's, `GET /tensors/{tensor_id}` returns one (JSON, or binary by `Accept`),
`DELETE /tensors/{tensor_id}` drops one. Each is scoped to the request's API key.

An upload is decoded, hashed and written in a thread: a 40 MB tensor takes tens of
milliseconds of that, which the event loop (every other request's) must not wait on.
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import numpy as np
from fastapi import APIRouter, Path, Request
from pydantic import ValidationError
from starlette.responses import Response

from gradserve.engine.errors import TensorDataError
from gradserve.service import codec
from gradserve.service.errors import ProblemError, pydantic_errors, schema_problem
from gradserve.service.middleware import TENANT
from gradserve.service.request import framing_problem, parse_json
from gradserve.service.routes import operation_id
from gradserve.service.routes.compute import check_content_type, problem_answer
from gradserve.service.schemas import (
    HeldTensor,
    HeldTensorData,
    HeldTensors,
    TensorUpload,
)
from gradserve.service.tensors import Pins, TensorStore, tensor_unknown
from gradserve.wire.binary import BINARY_HEADER, FramingError, header_length_of, padded, split
from gradserve.wire.numbers import dumps

router = APIRouter(tags=["tensors"], generate_unique_id_function=operation_id)

_OCTETS = "application/octet-stream"
_UNKNOWN = problem_answer(
    "This server holds no tensor of that id for the caller's API key (tensor-unknown)"
)
_BAD_ID = problem_answer("The id is not 32 hex digits (invalid-request, at path.tensor_id)")
# A path's id, checked as a request's `tensor_id` is: another form is a 422 naming it.
PathId = Annotated[
    str, Path(pattern=r"^[0-9a-f]{32}$", description="the tensor's id: 32 hex digits")
]


def _store(request: Request) -> TensorStore:
    store: TensorStore | None = request.app.state.front.compute.tensors
    if store is None:  # (a front process always has one: its own directory, or the named)
        raise ProblemError("tensor-store-unavailable", "this server holds no tensors")
    return store


def _tenant(request: Request) -> str | None:
    return request.scope.get("state", {}).get(TENANT)  # type: ignore[no-any-return]


@router.post(
    "/tensors",
    summary="Hold a tensor on the server, by its content-addressed id",
    status_code=201,
    response_model=HeldTensor,
    responses={
        200: {"description": "Held already (the same dtype, shape and bytes): nothing changed"},
        400: problem_answer("Malformed JSON, or a binary body whose sizes do not add up"),
        415: problem_answer("Neither JSON nor (with Inference-Header-Content-Length) octets"),
        422: problem_answer(
            "Invalid tensor (dtype, shape, data), or over the key's quota (tensor-quota)"
        ),
        507: problem_answer("The tensor store cannot be written (tensor-store-unavailable)"),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/TensorUpload"}},
                _OCTETS: {
                    "schema": {
                        "type": "string",
                        "format": "binary",
                        "description": "a binary body: the tensor's JSON object (with "
                        "`binary_data_size`) as a header of "
                        "Inference-Header-Content-Length bytes, then its raw bytes",
                    }
                },
            },
        }
    },
)
async def put_tensor(request: Request) -> Response:
    headers = request.headers
    try:
        header_length = header_length_of(headers.get(BINARY_HEADER))
    except FramingError as err:
        raise framing_problem(err) from None
    check_content_type(headers.get("content-type"), binary=header_length is not None)
    body = await request.body()
    store, tenant = _store(request), _tenant(request)
    held, created = await anyio.to_thread.run_sync(
        lambda: store.put(tenant, _decoded(body, header_length))
    )
    return Response(
        dumps(held.listed()), status_code=201 if created else 200, media_type="application/json"
    )


def _decoded(body: bytes, header_length: int | None) -> np.ndarray:
    """The uploaded tensor: a JSON tensor object, or a binary body's header and tail."""
    tail = None
    document: bytes | memoryview = body
    if header_length is not None:
        try:
            document, tail = split(body, header_length)
        except FramingError as err:
            raise framing_problem(err) from None
    try:
        upload = TensorUpload.model_validate(parse_json(document))
    except ValidationError as exc:
        raise schema_problem(pydantic_errors(exc)) from None
    size = upload.binary_data_size
    if (size is None) != (tail is None) or (tail is not None and size != len(tail)):
        raise framing_problem(
            FramingError(
                "binary_data_size is given without a binary body (Inference-Header-Content-Length)"
                if tail is None
                else f"binary_data_size is {size}, and the body holds {len(tail)} bytes after "
                "its header",
                ("binary_data_size",),
                "does not match the body",
            )
        )
    try:
        array = codec.decode_tensor(
            ("body",),
            data=upload.data,
            b64=upload.b64,
            binary=tail,
            dtype=upload.dtype,
            shape=upload.shape,
        )
    except TensorDataError as err:
        # (the codec names a request's tensor, `inputs 'x': ...`: here the body is the tensor)
        detail = err.message.split(": ", 1)[-1]
        raise TensorDataError(f"the tensor: {detail}", loc=list(err.loc or ())[-1:]) from None
    return array


@router.get(
    "/tensors",
    summary="The tensors held for the caller's API key, and its quota",
    response_model=HeldTensors,
)
async def list_tensors(request: Request) -> Response:
    store, tenant = _store(request), _tenant(request)

    def listing() -> dict[str, Any]:
        tensors = store.held(tenant)
        return {
            "tensors": [t.listed() for t in tensors],
            "quota_bytes": store.quota_bytes,
            "used_bytes": sum(t.nbytes for t in tensors),
        }

    return Response(dumps(await anyio.to_thread.run_sync(listing)), media_type="application/json")


@router.get(
    "/tensors/{tensor_id}",
    summary="A held tensor's value: JSON, or a binary body when Accept asks for octets",
    response_model=HeldTensorData,
    response_model_exclude_none=True,
    responses={
        200: {
            "content": {
                _OCTETS: {
                    "schema": {
                        "type": "string",
                        "format": "binary",
                        "description": "with `Accept: application/octet-stream`: the tensor's "
                        "JSON object (with `binary_data_size`) as a header of "
                        "Inference-Header-Content-Length bytes, then its raw bytes",
                    }
                }
            }
        },
        409: _UNKNOWN,
        422: _BAD_ID,
    },
)
async def get_tensor(request: Request, tensor_id: PathId) -> Response:
    store, tenant = _store(request), _tenant(request)
    binary = _OCTETS in request.headers.get("accept", "")

    def read() -> tuple[bytes, int | None]:
        pins = Pins()
        try:
            array = store.open(tenant, [(("path", "tensor_id"), tensor_id)], pins)[tensor_id]
            tail: list[memoryview] = []
            entry = {"tensor_id": tensor_id}
            entry.update(codec.encode_tensor(array, "binary" if binary else "json", tail))
            if not binary:
                return dumps(entry), None
            header = padded(dumps(entry))
            return header + b"".join(tail), len(header)
        finally:
            pins.release()

    try:
        content, header_length = await anyio.to_thread.run_sync(read)
    except ProblemError:
        request.app.state.metrics.tensor_unknown.inc()
        raise
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type=_OCTETS, headers={BINARY_HEADER: str(header_length)})


@router.delete(
    "/tensors/{tensor_id}",
    summary="Drop a held tensor (a request using it now keeps its copy)",
    status_code=204,
    response_class=Response,
    responses={409: _UNKNOWN, 422: _BAD_ID},
)
async def delete_tensor(request: Request, tensor_id: PathId) -> Response:
    store, tenant = _store(request), _tenant(request)
    if not await anyio.to_thread.run_sync(lambda: store.delete(tenant, tensor_id)):
        request.app.state.metrics.tensor_unknown.inc()
        raise tensor_unknown([(("path", "tensor_id"), tensor_id)])
    return Response(status_code=204)
