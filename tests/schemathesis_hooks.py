"""Schemathesis hooks (tests/schemathesis.toml loads them) for what the OpenAPI document
cannot express, each with its reason: the binary header framed as the document says in
words, and the kinds of failure a run drops. Every other failure, of every check, stands."""

from __future__ import annotations

from typing import Any

import orjson
import requests
import schemathesis
from pydantic import BaseModel, ValidationError
from schemathesis.core.failures import Failure
from schemathesis.core.transport import Response
from schemathesis.generation.case import Case
from schemathesis.generation.modes import GenerationMode
from schemathesis.hooks import HookContext
from schemathesis.openapi.checks import RejectedPositiveData

from gradserve.client.http import BINARY_HEADER
from gradserve.service import schemas
from gradserve.service.errors import TYPE_PREFIX


@schemathesis.hook
def before_call(context: HookContext, case: Case, **kwargs: Any) -> None:
    """Frame a schema-valid JSON body sent with the binary header as the document says: the
    header's value is the body's length (no tensor's bytes follow). The document cannot tie
    the two, so the count generated is any count, and the case would be refused for its
    framing alone; framed, it tests the rest of the request. Negative cases stay as
    generated. The length is of the body as the transport spells it (requests' `json=`); a
    count that still misses is a framing refusal, which `binary_framing` drops."""
    if (case.headers is None or BINARY_HEADER not in case.headers or case.meta is None
            or case.meta.generation.mode is not GenerationMode.POSITIVE
            or not (case.media_type or "").startswith("application/json")
            or not isinstance(case.body, dict | list)):
        return
    case.headers[BINARY_HEADER] = str(len(requests.compat.json.dumps(case.body).encode()))


@schemathesis.hook
def filter_failure(context: HookContext, failure: Failure, case: Case,
                   response: Response) -> bool:
    """Keep a failure unless it is a schema-valid request refused for one of the reasons
    below."""
    if not isinstance(failure, RejectedPositiveData):
        return True
    return not (binary_framing(response) or refused_for_its_meaning(case, response)
                or integer_spelled_as_float(case, response))


def binary_framing(response: Response) -> bool:
    """Excluded: a schema-valid body refused for its binary framing. The document describes
    the framing in words and leaves it outside what it models: no schema can tie a header's
    value or a `binary_data_size` to the body's bytes (`Inference-Header-Content-Length` is
    the length of the JSON request at the body's start, and the bytes after it are the
    `binary_data_size` tensors', in order), nor make the header required for one content
    type only. So: 400 malformed-body for sizes that do not add up, or `binary_data_size`
    in a body without the header (a header that is not a count stays a failure: the
    document says it is one); 400 malformed-json where the header, or an octet-stream body,
    puts the JSON request's end elsewhere than the body's (a JSON body framed exactly by
    its header must parse); 415 for octet-stream without the header."""
    sent = _sent_header(response, BINARY_HEADER)
    octets = (_sent_header(response, "Content-Type") or "").startswith("application/octet-stream")
    if response.status_code == 415:
        return octets and sent is None
    if response.status_code != 400 or not (sent is None or _is_count(sent)):
        return False
    problem = _problem_type(response)
    return problem == TYPE_PREFIX + "malformed-body" or (
        problem == TYPE_PREFIX + "malformed-json" and (
            octets or (sent is not None and int(sent) != len(_body(response)))))


def _sent_header(response: Response, name: str) -> str | None:
    value = response.request.headers.get(name)
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _is_count(value: str) -> bool:
    """ASCII digits, as the server reads the header (str.isdigit() alone takes "²")."""
    count = value.strip()
    return count.isascii() and count.isdigit()


def refused_for_its_meaning(case: Case, response: Response) -> bool:
    """Excluded: a body that the wire models accept, refused with 422. The document is
    generated from those models; beyond them the server checks what only the op catalog,
    the host and the graph's own hash can say, which no JSON Schema can: names that resolve,
    ops that exist and their arity and attributes, expr syntax, shapes and dtypes that
    agree, tensor data that fills its shape, a device this host has, the budgets, and a
    `graph_id` that is the sent graph's. A body the models refuse but the document allows
    is the looseness this run looks for, and stays a failure."""
    return response.status_code == 422 and _models_accept(case, orjson.loads(_body(response)))


def integer_spelled_as_float(case: Case, response: Response) -> bool:
    """Excluded: a body refused with 422 only because an integer is written as a whole float
    (`"shape": [2.0]`). JSON Schema's `integer` is any number without a fractional part, so
    `2.0` is one, and schemathesis sends such spellings on purpose; the server reads
    integers strictly, as written (as it refuses `"2"`), and a document cannot tell the two
    spellings of one number apart."""
    if response.status_code != 422:
        return False
    body = orjson.loads(_body(response))
    return not _models_accept(case, body) and _models_accept(case, _whole_floats_as_ints(body))


def _models_accept(case: Case, body: Any) -> bool:
    try:
        _request_model(case).model_validate(body)
    except ValidationError:
        return False
    return True


def _request_model(case: Case) -> type[BaseModel]:
    """The wire model the operation's JSON body is documented by (`#/components/schemas/X`)."""
    body = case.operation.definition.raw["requestBody"]["content"]["application/json"]
    model: type[BaseModel] = getattr(schemas, body["schema"]["$ref"].rpartition("/")[2])
    return model


def _whole_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _body(response: Response) -> bytes:
    body: Any = response.request.body or b""
    return body.encode() if isinstance(body, str) else bytes(body)


def _problem_type(response: Response) -> str | None:
    try:
        problem = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    return problem.get("type") if isinstance(problem, dict) else None
