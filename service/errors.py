"""Every error as `application/problem+json` (RFC 9457), from one table.

Engine errors map by class (the most specific entry in `ENGINE_PROBLEMS` wins); the
service's own refusals (bad JSON, size, auth, admission) are `ProblemError`s; the
framework's 404/405/422 go through the same `problem_response`. Anything else is a 500
with no traceback, logged with the request id.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gradserve.engine.errors import (
    ArityError,
    AttributeError_,
    BackwardError,
    Cancelled,
    ComputeBudgetError,
    DeadlineExceeded,
    DeviceUnavailableError,
    DTypeError,
    ExprError,
    GradserveError,
    GraphError,
    MemoryBudgetError,
    NonFiniteError,
    ShapeError,
    TensorDataError,
    UnknownOpError,
    ValidationErrors,
)
from gradserve.engine.graph.spec import Limits

if TYPE_CHECKING:  # the web framework is not imported by the worker processes (memory)
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

PROBLEM_JSON = "application/problem+json"
TYPE_PREFIX = "urn:gradserve:problem:"

# A problem echoes the request (ids, names, messages that quote them), and a request may
# hold a megabyte-long id: what is echoed is capped, with the original length noted.
MAX_TEXT_CHARS = 1000  # `detail`, each `errors[].msg`
MAX_NAME_CHARS = 256  # `node`, each string in an `errors[].loc`
MAX_ERRORS = Limits.max_errors  # as many as the engine reports from one validation pass

# engine error class -> (status, problem type slug, title). Looked up along the MRO.
ENGINE_PROBLEMS: dict[type[GradserveError], tuple[int, str, str]] = {
    UnknownOpError: (422, "unknown-op", "Unknown op"),
    ArityError: (422, "arity", "Wrong number of arguments"),
    AttributeError_: (422, "attribute", "Invalid attribute"),
    ExprError: (422, "expr", "Invalid expression"),
    GraphError: (422, "graph", "Invalid graph"),
    ShapeError: (422, "shape-mismatch", "Shape mismatch"),
    DTypeError: (422, "dtype-mismatch", "Dtype mismatch"),
    TensorDataError: (422, "tensor-data", "Invalid tensor data"),
    DeviceUnavailableError: (422, "device-unavailable", "Device unavailable"),
    BackwardError: (422, "backward", "Invalid backward request"),
    MemoryBudgetError: (422, "memory-budget", "Planned memory over budget"),
    ComputeBudgetError: (422, "compute-budget", "Planned compute over budget"),
    NonFiniteError: (422, "non-finite", "Non-finite values"),
    DeadlineExceeded: (504, "timeout", "Request timed out"),
    Cancelled: (503, "cancelled", "Request cancelled"),
    GradserveError: (422, "invalid-request", "Invalid request"),
}

# The service's own problem types: slug -> (status, title).
SERVICE_PROBLEMS: dict[str, tuple[int, str]] = {
    "malformed-json": (400, "Malformed JSON"),
    "malformed-body": (400, "Malformed binary body"),
    "bad-request": (400, "Bad request"),
    "unauthorized": (401, "Unauthorized"),
    "not-found": (404, "Not found"),
    "method-not-allowed": (405, "Method not allowed"),
    "body-too-large": (413, "Request body too large"),
    "unsupported-media-type": (415, "Unsupported media type"),
    "graph-unknown": (409, "Graph unknown"),
    "tensor-unknown": (409, "Tensor unknown"),
    "tensor-quota": (422, "Tensor quota exceeded"),
    "tensor-store-unavailable": (507, "Tensor store unavailable"),
    "invalid-request": (422, "Invalid request"),
    "overloaded": (503, "Server busy"),
    "not-ready": (503, "Not ready"),
    "internal": (500, "Internal server error"),
    "request-timeout": (408, "Request timeout"),  # (written by the protocol: service/protocol.py)
}

# Framework HTTPExceptions (404, 405, ...) reuse the service slugs by status; any other
# status they raise is "http".
_OTHER_HTTP = "http"

# Every problem type there is (the OpenAPI document lists them).
PROBLEM_TYPES: tuple[str, ...] = tuple(
    sorted(
        TYPE_PREFIX + slug
        for slug in {
            *SERVICE_PROBLEMS,
            *(slug for _, slug, _ in ENGINE_PROBLEMS.values()),
            _OTHER_HTTP,
        }
    )
)

# Framework HTTPExceptions (404, 405, ...) reuse the service slugs by status.
_STATUS_SLUGS = {
    status: slug
    for slug, (status, _) in SERVICE_PROBLEMS.items()
    if slug
    not in (
        "malformed-json",
        "malformed-body",
        "invalid-request",
        "not-ready",
        "graph-unknown",
        "tensor-unknown",
        "tensor-quota",
    )
}


class ProblemError(Exception):
    """A refusal by the service itself; rendered by `problem_response`. `status` and
    `title` come from SERVICE_PROBLEMS by slug unless given (an engine error carried
    across from a worker process)."""

    def __init__(
        self,
        slug: str,
        detail: str,
        *,
        errors: Sequence[Mapping[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
        title: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.slug = slug
        self.status, self.title = (
            SERVICE_PROBLEMS[slug]
            if status is None
            else (status, title or HTTPStatus(status).phrase)
        )
        self.detail = detail
        self.errors = errors
        self.headers = dict(headers or {})
        self.extra = extra

    def __reduce__(self) -> tuple[Any, ...]:
        # It crosses from a worker to the front process pickled; an exception pickles as
        # its class and args, and these arguments are keywords.
        return (
            _problem,
            (
                self.slug,
                self.detail,
                self.errors,
                self.headers,
                self.status,
                self.title,
                self.extra,
            ),
        )


def _problem(
    slug: str,
    detail: str,
    errors: Any,
    headers: Any,
    status: int,
    title: str,
    extra: dict[str, Any],
) -> ProblemError:
    return ProblemError(
        slug, detail, errors=errors, headers=headers, status=status, title=title, **extra
    )


def as_problem(err: GradserveError) -> ProblemError:
    """An engine error as the problem it is rendered as."""
    status, slug, title, fields = engine_problem(err)
    errors = fields.pop("errors", None)
    return ProblemError(slug, str(err), errors=errors, status=status, title=title, **fields)


def problem_body(
    status: int,
    slug: str,
    title: str,
    detail: str,
    *,
    request_id: str | None = None,
    node: str | None = None,
    errors: Iterable[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> bytes:
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + slug,
        "title": title,
        "status": status,
        "detail": capped(detail, MAX_TEXT_CHARS),
    }
    if node is not None:
        body["node"] = capped(node, MAX_NAME_CHARS)
    if errors is not None:
        body["errors"] = [_capped_error(e) for e in itertools.islice(errors, MAX_ERRORS)]
    body.update(extra)
    if request_id is not None:
        body["request_id"] = request_id
    try:
        return orjson.dumps(body)
    except TypeError:
        # orjson refuses integers past 64 bits: the planned bytes of a request that asks
        # for shape [2**31, 2**31] of float32 is 2**64. The standard library writes any int.
        return json.dumps(body, default=str, allow_nan=False).encode()


def capped(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} characters)"


def _capped_error(error: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(error)
    if isinstance(out.get("msg"), str):
        out["msg"] = capped(out["msg"], MAX_TEXT_CHARS)
    if isinstance(out.get("loc"), list | tuple):
        out["loc"] = [capped(p, MAX_NAME_CHARS) if isinstance(p, str) else p for p in out["loc"]]
    return out


def problem_response(
    status: int,
    slug: str,
    title: str,
    detail: str,
    *,
    request_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    **fields: Any,
) -> Response:
    return Response(
        problem_body(status, slug, title, detail, request_id=request_id, **fields),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=dict(headers or {}),
    )


def internal_error_body(request_id: str | None) -> bytes:
    detail = f"an internal error occurred; quote request id {request_id} when reporting it"
    return problem_body(500, "internal", "Internal server error", detail, request_id=request_id)


def request_id_of(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def _error_loc(err: GradserveError) -> list[str | int]:
    if err.loc:
        return list(err.loc)
    if err.node is not None:
        return ["graph", "nodes", err.node]
    return []


def engine_problem(err: GradserveError) -> tuple[int, str, str, dict[str, Any]]:
    """(status, slug, title, fields) for an engine error: the one mapping table."""
    first = err.errors[0] if isinstance(err, ValidationErrors) and err.errors else err
    status, slug, title = next(
        ENGINE_PROBLEMS[cls] for cls in type(first).__mro__ if cls in ENGINE_PROBLEMS
    )
    fields: dict[str, Any] = {"node": first.node}
    members = err.errors if isinstance(err, ValidationErrors) else [err]
    if any(e.loc or e.node for e in members) or len(members) > 1:
        fields["errors"] = [{"loc": _error_loc(e), "msg": str(e)} for e in members]
    if isinstance(first, MemoryBudgetError):
        fields["planned_bytes"] = first.planned_bytes
        fields["budget_bytes"] = first.budget_bytes
    if isinstance(first, ComputeBudgetError):
        fields["compute_cost"] = first.cost
        fields["compute_budget"] = first.budget
    if isinstance(first, NonFiniteError):
        fields["phase"] = first.phase
        fields["op"] = first.op
    return status, slug, title, fields


def engine_error_response(err: GradserveError, request_id: str | None) -> Response:
    status, slug, title, fields = engine_problem(err)
    return problem_response(status, slug, title, str(err), request_id=request_id, **fields)


def pydantic_errors(exc: ValidationError | RequestValidationError) -> list[dict[str, Any]]:
    """`{loc, msg}` pairs, without the union tags our schemas use to tell tensor forms apart,
    and in JSON's words for its containers."""
    out = []
    for e in exc.errors():
        loc = [part for part in e["loc"] if part not in _UNION_TAGS]
        out.append({"loc": loc, "msg": _JSON_WORDS.get(e["type"], e["msg"])})
    return out


# Bodies are validated as the Python data their strict parse gave, where pydantic speaks
# of dictionaries, model instances and lists; the client sent JSON objects and arrays.
_JSON_WORDS = {
    "model_type": "Input should be an object",
    "dict_type": "Input should be an object",
    "list_type": "Input should be a valid array",
}


# Tags of the tagged unions in schemas.py; they are not part of the user's document.
_UNION_TAGS = frozenset({"tensor", "tensor-ref", "tensor-spec", "value", "scan-body", "vmap-body"})


def schema_problem(errors: list[dict[str, Any]]) -> ProblemError:
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ProblemError("invalid-request", f"{where}: {first['msg']}{more}", errors=errors)


def error_response(exc: ProblemError | GradserveError, request_id: str | None) -> Response:
    """The problem+json answer to a service or an engine error."""
    if isinstance(exc, ProblemError):
        return _service_problem_response(exc, request_id)
    return engine_error_response(exc, request_id)


def _service_problem_response(exc: ProblemError, request_id: str | None) -> Response:
    fields: dict[str, Any] = dict(exc.extra)
    if exc.errors is not None:
        fields["errors"] = exc.errors
    return problem_response(
        exc.status,
        exc.slug,
        exc.title,
        exc.detail,
        request_id=request_id,
        headers=exc.headers,
        **fields,
    )


def _allowed_methods(request: Request) -> str:
    """Every method some route takes on the request's path (Starlette's 405 names only
    the first route that matched the path: `/tensors` is two, GET and POST)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        for method in getattr(route, "methods", None) or ():
            if route.matches({**request.scope, "method": method})[0] == Match.FULL:
                methods.add(method)
    return ", ".join(sorted(methods))


def install_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProblemError | GradserveError)
        return error_response(exc, request_id_of(request))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        slug = _STATUS_SLUGS.get(exc.status_code)
        title = SERVICE_PROBLEMS[slug][1] if slug else HTTPStatus(exc.status_code).phrase
        slug = slug or _OTHER_HTTP
        detail = exc.detail if isinstance(exc.detail, str) else title
        if exc.status_code == 404:
            detail = f"no route for {request.method} {request.url.path}"
        headers = exc.headers
        if exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return problem_response(
            exc.status_code,
            slug,
            title,
            detail,
            request_id=request_id_of(request),
            headers=headers,
        )

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _service_problem_response(
            schema_problem(pydantic_errors(exc)), request_id_of(request)
        )

    app.add_exception_handler(ProblemError, on_error)
    app.add_exception_handler(GradserveError, on_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
