"""Schemathesis hooks (tests/schemathesis.toml loads them) for what the OpenAPI document
cannot express, each with its reason: the binary header framed as the document says in
words, and the kinds of failure a run drops. Every other failure, of every check, stands.

The kinds are plain functions of an `Exchange` (a request and its answer), so that
tests/service/test_openapi_tools.py sorts the failures of a run without hooks by the same reasons,
read from that run's report."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import orjson
import pybase64
import requests
import schemathesis
from pydantic import BaseModel, ValidationError
from schemathesis.core.failures import Failure
from schemathesis.core.transport import Response
from schemathesis.generation.case import Case
from schemathesis.generation.modes import GenerationMode
from schemathesis.hooks import HookContext
from schemathesis.openapi.checks import RejectedPositiveData, UndefinedContentType

from gradserve.client.http import BINARY_HEADER
from gradserve.service import codec, schemas
from gradserve.service.errors import TYPE_PREFIX
from gradserve.service.routes.compute import ASKED_FOR
from gradserve.service.settings import Settings

# The body limit of the server under test: the default setting, which the checked-in
# document is generated with (it bounds the binary header and `binary_data_size` by it).
BODY_LIMIT: int = Settings.model_fields["max_body_bytes"].default


class Exchange(NamedTuple):
    """A request schemathesis sent and the server's answer, as the kinds below read them.
    (A NamedTuple: schemathesis loads this file as no module, which a dataclass needs.)"""

    operation: Mapping[str, Any]  # the operation's object in the document
    headers: Mapping[str, str]  # as sent, by lower-case name
    body: bytes  # as sent
    status: int
    content: bytes  # the answer's body
    media_type: str  # the answer's Content-Type

    @classmethod
    def of(cls, case: Case, response: Response) -> Exchange:
        body: Any = response.request.body or b""
        return cls(
            operation=case.operation.definition.raw,
            headers={
                k.lower(): v.decode("latin-1") if isinstance(v, bytes) else v
                for k, v in response.request.headers.items()
            },
            body=body.encode() if isinstance(body, str) else bytes(body),
            status=response.status_code,
            content=response.content,
            media_type=response.headers.get("content-type", [""])[0],
        )


@schemathesis.hook
def before_call(context: HookContext, case: Case, **kwargs: Any) -> None:
    """Frame a schema-valid JSON body sent with the binary header as the document says: the
    header's value is the body's length (no tensor's bytes follow). The document cannot tie
    the two, so the count generated is any count, and the case would be refused for its
    framing alone; framed, it tests the rest of the request. Negative cases stay as
    generated. The length is of the body as the transport spells it (requests' `json=`); a
    count that still misses is a framing refusal, which `binary_framing` drops."""
    if (
        case.headers is None
        or BINARY_HEADER not in case.headers
        or case.meta is None
        or case.meta.generation.mode is not GenerationMode.POSITIVE
        or not (case.media_type or "").startswith("application/json")
        or not isinstance(case.body, dict | list)
    ):
        return
    case.headers[BINARY_HEADER] = str(len(requests.compat.json.dumps(case.body).encode()))


@schemathesis.hook
def filter_failure(context: HookContext, failure: Failure, case: Case, response: Response) -> bool:
    """Keep a failure unless it is a schema-valid request refused for one of the reasons
    below, or an answer in a media type the request asked for (`asked_for`)."""
    if isinstance(failure, UndefinedContentType):
        return not asked_for(Exchange.of(case, response))
    if not isinstance(failure, RejectedPositiveData):
        return True
    return kind_of(Exchange.of(case, response)) is None


def asked_for(exchange: Exchange) -> bool:
    """Excluded: a 200 in a media type other than JSON, which a request gets only by asking
    (`POST /plan?format=dot`: Graphviz text; `"encoding": "binary"`: a binary body). The
    document describes each beside its 200 (`x-gradserve-asked-for`), not in its `content`:
    a response's content is a union to the client generators, and every JSON client's
    answer would be typed JSON-or-string. OpenAPI cannot tie a response's media type to a
    field of the request; a media type described nowhere stays a failure."""
    described = exchange.operation.get("responses", {}).get("200", {}).get(ASKED_FOR, {})
    return exchange.status == 200 and exchange.media_type.split(";")[0].strip() in described


def kind_of(exchange: Exchange) -> Callable[[Exchange], bool] | None:
    """The kind (one of `KINDS`) of a schema-valid request's refusal, if it is one of them."""
    return next((kind for kind in KINDS if kind(exchange)), None)


def binary_framing(exchange: Exchange) -> bool:
    """Excluded: a schema-valid body refused for its binary framing. The document describes
    the framing in words and leaves it outside what it models: no schema can tie a header's
    value or a `binary_data_size` to the body's bytes (`Inference-Header-Content-Length` is
    the length of the JSON request at the body's start, and the bytes after it are the
    `binary_data_size` tensors', in order), nor make the header required for one content
    type only. So: 400 malformed-body for sizes that do not add up, or `binary_data_size`
    in a body without the header (a header that is not a count stays a failure: the
    document says it is one); 400 malformed-json where the header, or an octet-stream body,
    puts the JSON request's end elsewhere than the body's (a JSON body framed exactly by
    its header must parse); 415 for octet-stream without the header; 422 for an
    octet-stream body whose JSON request, as its header frames it, the models refuse (the
    bytes that a header of any count frames are JSON by chance: the document describes the
    request inside a binary body in words, and no schema reaches into one; a request the
    models take is judged as any other). What a schema can say of the sizes, the document
    says, and a refusal for it stays a failure: the header is at least 1 (the JSON request
    is never empty) and, as `binary_data_size` is, at most the body limit (no body is
    longer)."""
    sent = exchange.headers.get(BINARY_HEADER.lower())
    octets = exchange.headers.get("content-type", "").startswith("application/octet-stream")
    if exchange.status == 415:
        return octets and sent is None
    if exchange.status not in (400, 422) or not (sent is None or _is_count(sent)):
        return False
    if (sent is not None and not 1 <= int(sent) <= BODY_LIMIT) or any(
        size > BODY_LIMIT for size in _binary_sizes(exchange)
    ):
        return False
    if exchange.status == 422:
        return octets and sent is not None and not _models_accept(exchange, _request(exchange))
    problem = _problem_type(exchange)
    return problem == TYPE_PREFIX + "malformed-body" or (
        problem == TYPE_PREFIX + "malformed-json"
        and (octets or (sent is not None and int(sent) != len(exchange.body)))
    )


def _is_count(value: str) -> bool:
    """ASCII digits, as the server reads the header (str.isdigit() alone takes "²")."""
    count = value.strip()
    return count.isascii() and count.isdigit()


def _binary_sizes(exchange: Exchange) -> Iterator[int]:
    """The `binary_data_size` counts of the JSON request."""
    request = _request(exchange)
    for section in ("inputs", "grad_outputs"):
        tensors = request.get(section) if isinstance(request, dict) else None
        for tensor in tensors.values() if isinstance(tensors, dict) else ():
            size = tensor.get("binary_data_size") if isinstance(tensor, dict) else None
            if isinstance(size, int):
                yield size


def refused_for_its_meaning(exchange: Exchange) -> bool:
    """Excluded: a body that the wire models accept, refused with 422. The document is
    generated from those models; beyond them the server checks what only the op catalog,
    the host and the graph's own hash can say, which no JSON Schema can: names that resolve,
    ops that exist and their arity and attributes, expr syntax, shapes and dtypes that
    agree, tensor data that fills its shape, a device this host has, the budgets, and a
    `graph_id` that is the sent graph's. A body the models refuse but the document allows
    is the looseness this run looks for, and stays a failure; and so does one that breaks a
    bound the document states beyond the models (`_beyond_the_models`)."""
    if exchange.status != 422:
        return False
    request = _request(exchange)
    return _models_accept(exchange, request) and not _beyond_the_models(request)


def integer_spelled_as_float(exchange: Exchange) -> bool:
    """Excluded: a body refused with 422 only because an integer is written as a whole float
    (`"shape": [2.0]`). JSON Schema's `integer` is any number without a fractional part, so
    `2.0` is one, and schemathesis sends such spellings on purpose; the server reads
    integers strictly, as written (as it refuses `"2"`), and a document cannot tell the two
    spellings of one number apart."""
    if exchange.status != 422:
        return False
    request = _request(exchange)
    return not _models_accept(exchange, request) and _models_accept(
        exchange, _whole_floats_as_ints(request)
    )


KINDS: tuple[Callable[[Exchange], bool], ...] = (
    binary_framing,
    refused_for_its_meaning,
    integer_spelled_as_float,
)


def _request(exchange: Exchange) -> Any:
    """The JSON request, as the server parses it (integers past 64 bits stay integers): the
    body, or its start as the binary header frames it (`_NOT_JSON` when that is not JSON)."""
    sent = exchange.headers.get(BINARY_HEADER.lower())
    framed = sent is not None and _is_count(sent)
    try:
        return codec.loads(exchange.body[: int(sent)] if framed else exchange.body)
    except codec.JSONError:
        return _NOT_JSON


_NOT_JSON = object()


def _models_accept(exchange: Exchange, body: Any) -> bool:
    model = request_model(exchange.operation)
    if model is None or body is _NOT_JSON:
        return False
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


def request_model(operation: Mapping[str, Any]) -> type[BaseModel] | None:
    """The wire model an operation's JSON body is documented by (`#/components/schemas/X`),
    if it has one."""
    content = operation.get("requestBody", {}).get("content", {})
    ref = content.get("application/json", {}).get("schema", {}).get("$ref")
    model = None if ref is None else getattr(schemas, ref.rpartition("/")[2], None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _beyond_the_models(request: Any) -> bool:
    """Whether the request breaks a bound the document states beyond the wire models
    (service/schemas.py), which the server checks after them: a blank `expr`; an empty
    `body.carry` or `body.xs` name, `body.next` key or `results` value (the compiler's
    refusals); a `b64` that is not strict base64, a shape of more than 64 dims or with a
    dim of 2**63 or more (the codec's)."""
    if not isinstance(request, dict):
        return False
    for section in ("inputs", "grad_outputs"):
        tensors = request.get(section)
        for tensor in tensors.values() if isinstance(tensors, dict) else ():
            if not isinstance(tensor, dict):
                continue
            b64, shape = tensor.get("b64"), _items(tensor.get("shape"))
            if isinstance(b64, str) and not _base64(b64):
                return True
            if len(shape) > 64 or any(isinstance(n, int) and n >= 2**63 for n in shape):
                return True
    graph = request.get("graph")
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    stack = list(nodes) if isinstance(nodes, list) else []
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        expr, body, results = node.get("expr"), node.get("body"), node.get("results")
        if isinstance(expr, str) and not expr.strip():
            return True
        if isinstance(results, dict) and "" in results.values():
            return True
        if isinstance(body, dict):
            names = [
                *_items(body.get("carry")),
                *_items(body.get("xs")),
                *(body.get("next") if isinstance(body.get("next"), dict) else ()),
            ]
            if "" in names:
                return True
            stack.extend(_items(body.get("nodes")))
    return False


def _base64(text: str) -> bool:
    try:
        pybase64.b64decode(text, validate=True)
    except ValueError:  # (binascii.Error is one)
        return False
    return True


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _whole_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _problem_type(exchange: Exchange) -> str | None:
    try:
        problem = orjson.loads(exchange.content)
    except orjson.JSONDecodeError:
        return None
    return problem.get("type") if isinstance(problem, dict) else None
