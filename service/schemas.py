"""Wire models (the JSON shapes of docs/contract.md). Unknown fields are refused at every level, and
booleans are strict (`"true"` or `1` is not `true`): typos must not pass silently."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, WithJsonSchema
from pydantic_core import core_schema

from gradserve.service.errors import PROBLEM_TYPES
from gradserve.wire.catalog import OpInfo

DType = Literal["float16", "float32", "float64", "int32", "int64", "bool"]
Encoding = Literal["json", "base64", "binary"]

# One element of tensor data, a component of the document (service/app.py adds it).
TENSOR_SCALAR_SCHEMA = {
    "anyOf": [
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["NaN", "Infinity", "-Infinity"]},
    ],
    "description": 'a number, a boolean, or "NaN"/"Infinity"/"-Infinity" (strings: bare '
    "NaN and Infinity are not JSON)",
}
_SCALAR = {"$ref": "#/components/schemas/TensorScalar"}
# Tensor data: a number, a non-finite string, or (nested) lists of them. Kept as plain
# JSON values here: the codec turns them into an array in one pass. In the document,
# lists of lists to `TYPED_DIMS` deep, of scalars: a client's type is nested numbers. Not
# one recursive schema: TypeScript refuses a type that holds itself by name in a list (as
# openapi-typescript writes one). Deeper data (the codec takes 64 dims) goes as b64 or
# binary.
TYPED_DIMS = 8


def _nested(dims: int) -> dict[str, Any]:
    items = _nested(dims - 1) if dims > 1 else _SCALAR
    return {"anyOf": [_SCALAR, {"type": "array", "items": items}]}


TENSOR_DATA_SCHEMA = {
    **_nested(TYPED_DIMS),
    "description": f"a scalar (`TensorScalar`), or lists of them nested up to {TYPED_DIMS} "
    "deep (deeper: send the tensor as `b64` or binary)",
}
TensorData = Annotated[Any, WithJsonSchema(TENSOR_DATA_SCHEMA)]


class WireJsonSchema(GenerateJsonSchema):
    """The models' JSON Schema as the OpenAPI document gives it, written for the client
    generators users point at it (openapi-typescript, openapi-python-client):

    - no `default`: openapi-typescript types a field that has one as always present, so a
      request could not leave out what the server defaults (docs/contract.md gives each
      default, and each field's description);
    - a response field that the server leaves out when it has no value (a default of
      None) is its value's schema: optional, and never null."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        inner = schema["schema"]
        if (
            self.mode == "serialization"
            and "default" in schema
            and schema["default"] is None
            and inner["type"] == "nullable"
        ):
            return self.generate_inner(inner["schema"])
        return self.generate_inner(inner)


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# Bounds the server checks after the models (in the compiler and the codec), which the
# models leave to it: the contract's shape takes any string there (tests/service/test_validator.py),
# and each refusal keeps its own problem type. The document states them, so that it is no
# looser than the server; validation stays where it is.
#
# Names the compiler refuses empty: a scan body's carry and xs names, its next's keys
# (carries) and the scan's results' values (carries or body node ids). Output ids, input
# names, args, next's values and results' keys may be empty: an input may be named "",
# and they may name it (a result id is a new name).
_NonEmpty = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
# An expr the compiler refuses blank. Not blank: a character that `str.strip()` keeps,
# Python's whitespace spelt out (`\s` means other sets in other regex flavours).
_NOT_BLANK = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
_NotBlank = Annotated[str, WithJsonSchema({"type": "string", "pattern": _NOT_BLANK})]
# Base64 as the codec decodes it: strict (the standard alphabet, padded, nothing else).
_BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_Base64 = Annotated[str, WithJsonSchema({"type": "string", "pattern": _BASE64})]
# A declared shape as the codec takes it (`codec.check_shape`): NumPy's 64 dims at most,
# and no dim of 2**63 or more, which no array's bytes can span.
_Shape = Annotated[
    list[Annotated[int, Field(ge=0)]],
    WithJsonSchema(
        {
            "type": "array",
            "maxItems": 64,
            "items": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        }
    ),
]

# A count of a body's bytes: at most the server's body limit, a setting, so not the
# models' own: `with_body_limit` puts it in the document (the framing refuses more).
_BODY_LIMIT = "x-gradserve-body-limit"
_BodyBytes = Annotated[
    int, Field(ge=0), WithJsonSchema({"type": "integer", "minimum": 0, _BODY_LIMIT: True})
]


def with_body_limit(schema: Any, max_body_bytes: int) -> Any:
    """`schema` (generated from these models) with each count of a body's bytes bounded by
    the body limit, `max_body_bytes`."""
    if isinstance(schema, dict):
        bounded = {
            k: with_body_limit(v, max_body_bytes) for k, v in schema.items() if k != _BODY_LIMIT
        }
        if schema.get(_BODY_LIMIT):
            bounded["maximum"] = max_body_bytes
        return bounded
    if isinstance(schema, list):
        return [with_body_limit(v, max_body_bytes) for v in schema]
    return schema


def _rules(*rules: dict[str, Any]) -> ConfigDict:
    """A model's cross-field rules (what its validator, or the codec, checks) in the
    document, so that the document is no looser than the server. Inside an allOf:
    openapi-python-client reads an object's own anyOf or oneOf as a union of models, and
    would build the model from the branches alone, losing its fields."""
    return ConfigDict(json_schema_extra={"allOf": list(rules)})


def _given(**fields: dict[str, Any]) -> dict[str, Any]:
    """Each field is present and not null (its schema says what it is then)."""
    return {"required": list(fields), "properties": fields}


def _not_given(*names: str) -> dict[str, Any]:
    """None of the fields is given: each is absent, or null (the same to the models). Said
    with `not`, which the client generators leave out of a type: a property whose only
    type is null comes out of openapi-fetch as `never`, and no value fits it."""
    return {
        "not": {
            "anyOf": [
                {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                for name in names
            ]
        }
    }


def schema_ref(model: str) -> dict[str, str]:
    """A reference to `model`'s schema among the document's components."""
    return {"$ref": f"#/components/schemas/{model}"}


_STRING = {"type": "string"}
_ARRAY = {"type": "array"}
_DATA = _given(data={"type": ["number", "boolean", "string", "array"]})  # any but null


class TensorUpload(Wire):
    """A tensor as an object: `data` (JSON), `b64` (raw little-endian bytes), or
    `binary_data_size` (that many raw bytes of a binary body's tail). As `POST /tensors`
    takes it."""

    model_config = _rules(
        {"oneOf": [_DATA, _given(b64=_STRING), _given(binary_data_size={"type": "integer"})]},
        # raw bytes say nothing of their type and shape (the codec's "needs a dtype")
        {"anyOf": [_DATA, _given(dtype=_STRING, shape=_ARRAY)]},
    )

    data: TensorData | None = None
    b64: _Base64 | None = None
    binary_data_size: _BodyBytes | None = Field(
        None,
        description="in a binary body (Inference-Header-Content-Length): the tensor "
        "is the next this many bytes of the tail",
    )
    dtype: DType | None = None
    shape: _Shape | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TensorUpload:
        if sum(v is not None for v in (self.data, self.b64, self.binary_data_size)) != 1:
            raise ValueError("a tensor needs exactly one of 'data', 'b64' and 'binary_data_size'")
        return self


class TensorIn(TensorUpload):
    """A request's tensor as an object: its data, as an upload gives it, and whether it
    requires grad."""

    requires_grad: bool = False


TensorId = Annotated[
    str,
    Field(
        pattern=r"^[0-9a-f]{32}$",
        description="a held tensor's id (32 hex digits): the answer to POST /tensors, or a "
        "value a request kept",
    ),
]


class TensorRefIn(Wire):
    """A tensor this server holds, by its id, instead of its data (409 tensor-unknown if
    it holds none under that id for the caller's API key)."""

    tensor_id: TensorId
    requires_grad: bool = False


def _tensor_form(value: Any) -> str:
    if isinstance(value, TensorRefIn) or (isinstance(value, dict) and "tensor_id" in value):
        return "tensor-ref"
    return "tensor" if isinstance(value, dict | TensorIn) else "value"


# A tensor is an object (its data, or a held tensor's id), or bare data (a number or a
# nested list). The tag is picked by the JSON type (and an object's `tensor_id`), so a
# misspelt field of an object is reported as such, not as bad data.
Tensor = Annotated[
    Annotated[TensorIn, Tag("tensor")]
    | Annotated[TensorRefIn, Tag("tensor-ref")]
    | Annotated[TensorData, Tag("value")],
    Discriminator(_tensor_form),
]


class KeepOutputs(Wire):
    """Outputs to keep on the server (/forward): each is answered as its id, shape and
    dtype, no data, and later requests name it by that id."""

    outputs: list[str] = Field([], description="output ids whose values to keep")


class Keep(KeepOutputs):
    """Outputs and gradients to keep on the server (/backward), answered as /forward's."""

    gradients: list[str] = Field([], description="input names whose gradients to keep")


Arg = Annotated[
    str | bool | int | float,
    Field(description="a node id, an input name, or a number literal"),
]


class Reduction(Wire):
    """A vmap result that reduces a body value over the mapped dim, never holding the
    stacked values."""

    model_config = _rules(
        {
            "oneOf": [
                _given(reduce={"const": "clip_sum"}, max_norm={"type": "number"}),
                {
                    **_given(reduce={"enum": ["sum", "mean"]}),
                    **_not_given("max_norm", "norm_of"),
                },
            ]
        }
    )

    of: _NonEmpty = Field(description="the body node (or body input) reduced")
    reduce: Literal["sum", "mean", "clip_sum"]
    max_norm: float | None = Field(
        None,
        gt=0,
        description="clip_sum only: each index's values scaled by "
        "min(1, max_norm / (norm + 1e-6)) before they are added",
    )
    norm_of: list[_NonEmpty] | None = Field(
        None,
        description="clip_sum only: the body ids whose values, all together, make an "
        "index's norm (default: `of` alone)",
    )

    @model_validator(mode="after")
    def _clip_fields(self) -> Reduction:
        if (self.reduce == "clip_sum") != (self.max_norm is not None):
            raise ValueError("'max_norm' belongs to, and is required by, reduce 'clip_sum'")
        if self.norm_of is not None and self.reduce != "clip_sum":
            raise ValueError("'norm_of' belongs to reduce 'clip_sum'")
        return self


def _body_form(value: Any) -> str:
    """A vmap's body names its slices in `in`; a scan's has carries."""
    if isinstance(value, dict):
        return "vmap-body" if "in" in value else "scan-body"
    return "vmap-body" if isinstance(value, VmapBody) else "scan-body"


class Node(Wire):
    """One graph node: `op` with `args` and `attrs`, or an infix `expr`; a `scan` or
    `vmap` node also has `body` and `results`."""

    model_config = _rules(
        {
            "oneOf": [
                # an infix expression: no op, args, attrs, body or results
                {
                    **_given(expr=_STRING),
                    **_not_given("op", "args", "attrs", "body", "results"),
                },
                # an op other than scan and vmap: no expr, body or results
                {
                    **_given(op={"type": "string", "not": {"enum": ["scan", "vmap"]}}),
                    **_not_given("expr", "body", "results"),
                },
                # a scan, with its body and (at least one of) its results
                {
                    **_given(
                        op={"const": "scan"},
                        body=schema_ref("Body"),
                        results={
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": _STRING,
                        },
                    ),
                    **_not_given("expr"),
                },
                # a vmap, with its body and (at least one of) its results
                {
                    **_given(
                        op={"const": "vmap"},
                        body=schema_ref("VmapBody"),
                        results={
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"anyOf": [_STRING, schema_ref("Reduction")]},
                        },
                    ),
                    **_not_given("expr"),
                },
            ]
        }
    )

    id: str = Field(min_length=1)
    op: str | None = None
    args: list[Arg] | None = None
    attrs: dict[str, Any] | None = None
    expr: _NotBlank | None = None
    body: (
        Annotated[
            Annotated[Body, Tag("scan-body")] | Annotated[VmapBody, Tag("vmap-body")],
            Discriminator(_body_form),
        ]
        | None
    ) = Field(None, description="scan and vmap only: the body")
    results: dict[str, _NonEmpty | Reduction] | None = Field(
        None,
        description="scan and vmap only: new id -> a carry name (its final value) or a body "
        "node id (its value at every step or index, stacked on a new dim 0); for a vmap, "
        "also a reduction over the mapped dim",
    )

    @model_validator(mode="after")
    def _op_or_expr(self) -> Node:
        if (self.op is None) == (self.expr is None):
            raise ValueError("a node needs exactly one of 'op' and 'expr'")
        if self.expr is not None and (self.args is not None or self.attrs is not None):
            raise ValueError("an 'expr' node takes no 'args' or 'attrs'")
        bodied = self.op in ("scan", "vmap")
        if bodied != (self.body is not None):
            raise ValueError("'body' belongs to, and is required by, ops 'scan' and 'vmap'")
        if bodied != (self.results is not None):
            raise ValueError("'results' belongs to, and is required by, ops 'scan' and 'vmap'")
        if self.op == "scan":
            if isinstance(self.body, VmapBody):
                raise ValueError("a scan's body has 'carry' and 'next' ('in' is a vmap's)")
            if not all(isinstance(v, str) for v in self.results.values()):  # type: ignore[union-attr]
                raise ValueError("a scan's results are carry names or body node ids")
        if self.op == "vmap" and isinstance(self.body, Body):
            raise ValueError("a vmap's body names its slices in 'in' (carry and next are a scan's)")
        return self


class Body(Wire):
    """A scan's body: carries and per-step slices by name, nodes in their own scope, and
    each carry's next value."""

    carry: list[_NonEmpty]
    xs: list[_NonEmpty] = []
    nodes: list[Node] = []
    next: dict[_NonEmpty, str]


class VmapBody(Wire):
    """A vmap's body: the names of its slices, one per argument, and its nodes."""

    model_config = ConfigDict(populate_by_name=True)

    in_: list[_NonEmpty] = Field(alias="in", description="the slices' names, in `args` order")
    nodes: list[Node] = []


Node.model_rebuild()


class Graph(Wire):
    nodes: list[Node] = []
    outputs: list[str] = Field(min_length=1)


Recompute = Annotated[
    Literal["auto", "never"],
    Field(
        description="auto: a /backward whose planned peak is over its memory budget recomputes "
        "forward values in the backward (chosen by the planner) so that it fits; "
        "never: it is refused with 422 memory-budget instead"
    ),
]
MemoryBudget = Annotated[
    int | None,
    Field(
        None,
        ge=1,
        description="a memory budget for this request's planned peak, at most the "
        "server's for its path (more is a 422)",
    ),
]


# "a request needs 'graph' or 'graph_id'"
_GRAPH_OR_ID = {"anyOf": [_given(graph=schema_ref("Graph")), _given(graph_id=_STRING)]}


class _ComputeRequest(Wire):
    model_config = _rules(_GRAPH_OR_ID)

    graph: Graph | None = None
    graph_id: str | None = Field(
        None,
        description="instead of `graph`: the `meta.graph_id` of an earlier response "
        "(409 graph-unknown if this server does not hold it); with "
        "`graph`, it must be that graph's id",
    )
    inputs: dict[str, Tensor] = {}
    device: str | None = Field(None, description="cpu, cuda, cuda:N or auto")
    encoding: Encoding = "json"
    recompute: Recompute = "auto"
    memory_budget_bytes: MemoryBudget = None
    detect_anomaly: bool = Field(
        False,
        description="the first step (forward or backward) that makes NaN or infinite values "
        "from finite inputs fails the request: 422 non-finite, naming its node, phase and op "
        "(the run is interpreted, and costs a little more)",
    )

    @model_validator(mode="after")
    def _a_graph(self) -> _ComputeRequest:
        if self.graph is None and self.graph_id is None:
            raise ValueError("a request needs 'graph' or 'graph_id'")
        return self


class ForwardRequest(_ComputeRequest):
    """One of `graph` or `graph_id` (both: the id must be the graph's), the inputs, and how
    to run and answer."""

    no_grad: bool = False
    keep: KeepOutputs | None = Field(  # (no gradients to keep: keep.gradients is refused)
        None,
        description="outputs to keep on the server, answered as {tensor_id, shape, dtype}; "
        "their bytes count against the API key's tensor quota before the request runs "
        "(422 tensor-quota)",
    )


class BackwardRequest(_ComputeRequest):
    """What /forward takes (but `no_grad`), and the upstream gradients."""

    grad_outputs: dict[str, Tensor] | None = None
    keep: Keep | None = Field(
        None,
        description="outputs and gradients to keep on the server, answered "
        "as {tensor_id, shape, dtype}; their bytes count against the API key's tensor quota "
        "before the request runs (422 tensor-quota)",
    )


PlanPath = Literal["no_grad", "forward", "backward"]


class TensorSpecIn(Wire):
    """A tensor described without its data (POST /plan)."""

    shape: _Shape
    dtype: DType
    requires_grad: bool = False


_SOURCES = frozenset({"data", "b64", "binary_data_size"})


def _plan_tensor_form(value: Any) -> str:
    if isinstance(value, TensorSpecIn) or (
        isinstance(value, dict) and not (_SOURCES | {"tensor_id"}) & value.keys()
    ):
        return "tensor-spec"
    return _tensor_form(value)


# A tensor for /plan: a spec (shape and dtype, no data), or any tensor /forward takes.
PlanTensor = Annotated[
    Annotated[TensorSpecIn, Tag("tensor-spec")]
    | Annotated[TensorIn, Tag("tensor")]
    | Annotated[TensorRefIn, Tag("tensor-ref")]
    | Annotated[TensorData, Tag("value")],
    Discriminator(_plan_tensor_form),
]


class PlanRequest(Wire):
    """What /forward or /backward would take, with tensors as specs or data, and the path
    to plan."""

    model_config = _rules(
        _GRAPH_OR_ID,
        {
            "anyOf": [  # "grad_outputs belongs to path 'backward'"
                _not_given("grad_outputs"),
                {"properties": {"path": {"const": "backward"}}},
            ]
        },
    )

    graph: Graph | None = None
    graph_id: str | None = None
    inputs: dict[str, PlanTensor] = {}
    grad_outputs: dict[str, PlanTensor] | None = Field(
        None, description="path backward: the upstream gradients, as specs or data"
    )
    device: str | None = Field(None, description="cpu, cuda, cuda:N or auto")
    path: PlanPath = Field(
        "backward",
        description="no_grad: /forward with no_grad; forward: /forward with "
        "grad recording; backward: /backward",
    )
    recompute: Recompute = "auto"
    memory_budget_bytes: MemoryBudget = None

    @model_validator(mode="after")
    def _a_graph(self) -> PlanRequest:
        if self.graph is None and self.graph_id is None:
            raise ValueError("a request needs 'graph' or 'graph_id'")
        if self.grad_outputs is not None and self.path != "backward":
            raise ValueError("grad_outputs belongs to path 'backward'")
        return self


# ------------------------------------------------------------------ responses (OpenAPI)
class TensorOut(BaseModel):
    dtype: DType
    shape: list[int]
    data: TensorData | None = Field(None, description="with encoding json")
    b64: str | None = Field(None, description="with encoding base64")
    binary_data_size: int | None = Field(
        None, description="with encoding binary: the tensor's bytes in the body's tail, in order"
    )
    tensor_id: str | None = Field(
        None,
        description="a value the request kept (`keep`): its id on the server, in place of its "
        'data; name it as an input: {"tensor_id": ...}',
    )


class OutputTensor(TensorOut):
    requires_grad: bool
    grad_fn: str | None


class HeldTensor(BaseModel):
    """A tensor the server holds for the caller's API key."""

    tensor_id: str
    shape: list[int]
    dtype: DType
    bytes: int = Field(description="its data's bytes (what counts against the quota)")


class HeldTensors(BaseModel):
    """The tensors held for the caller's API key, most recently used first, and its quota."""

    tensors: list[HeldTensor]
    quota_bytes: int = Field(description="the tensor data a key may hold (tensor_quota_bytes)")
    used_bytes: int = Field(description="the tensor data it holds now")


class HeldTensorData(TensorOut):
    """A held tensor's value (GET /tensors/{tensor_id})."""

    tensor_id: str


class Recomputation(BaseModel):
    """What recomputing forward values in the backward bought, and cost."""

    peak_bytes_without: int = Field(description="the planned peak without recomputation")
    added_cost: int = Field(description="cost units the recomputation adds (in compute_cost)")
    steps: int = Field(description="recomputation steps in the program")


class Timings(BaseModel):
    """Where the request's time went, in milliseconds."""

    plan: float = Field(
        description="parsing, decoding, and compiling or looking up the compiled graph"
    )
    forward: float = Field(description="the forward pass (with tier xla: the whole call)")
    backward: float | None = Field(
        None, description="the backward pass, when one ran in the interpreter"
    )


_VMAP_CHUNKS = (
    "per vmap, jacobian or hessian node, the indices (rows or columns) it computed at once: "
    "its chunk_size, or (null there) the whole batch, or the largest chunks that fit the "
    "memory budget (absent: no such node)"
)


class Meta(BaseModel):
    device: str = Field(pattern=r"^(cpu|cuda:[0-9]+)$", description="the device that ran it")
    graph_id: str = Field(description="send it as `graph_id` instead of the graph")
    no_grad: bool
    nodes: int
    peak_bytes: int
    planned_peak_bytes: int
    compute_cost: int = Field(description="the program's static cost, in cost units")
    program: Literal["process", "store", "lifted", "compiled"] = Field(
        description="where the program came from: this process's memory, the host's program "
        "store, the program of a graph that differs from this one only in float "
        "literals (with this graph's put in), or compiled for this request"
    )
    recompute: Recomputation | None = Field(
        description="null: nothing is recomputed; the peak figures above are with it"
    )
    tier: Literal["interpreter", "xla"] = Field(
        description="what ran the program: gradserve's interpreter, or its native tier "
        "(the program lowered to XLA once hot)"
    )
    tier_reason: str | None = Field(
        description="null with the native tier; else why the interpreter ran it: a word, "
        "or a word, a colon and the figures that decided: `off`, "
        "`unavailable`, `fast lane: ...`, `cold: ...`, `compiling: ...`, "
        "`small: ...`, `slower in XLA: ...`, or why the tier refused the "
        "program (e.g. an op without a lowering)"
    )
    timings_ms: Timings
    vmap_chunks: dict[str, int] | None = Field(None, description=_VMAP_CHUNKS)


class ForwardResponse(BaseModel):
    outputs: dict[str, OutputTensor]
    meta: Meta


class BackwardResponse(ForwardResponse):
    gradients: dict[str, TensorOut]


class PlannedStep(BaseModel):
    step: int = Field(description="its place in the run, forward then backward")
    id: str | None = Field(
        description="the client's node it serves (a derived step's, the node it differentiates)"
    )
    op: str
    kind: Literal["node", "cast", "constant", "derived", "backward", "recompute"] = Field(
        description="node, cast, constant, derived (grad/jvp), backward, or "
        "recompute (a forward value computed again in the backward)"
    )
    shape: list[int]
    dtype: DType
    bytes: int
    cost: int = Field(description="cost units: flops plus 8 per byte moved")
    freed_after: int | None = Field(
        description="the step after which its value is freed; null: held to the end"
    )


class PlanRecomputation(Recomputation):
    nodes_without: list[PlannedStep] = Field(description="the program without recomputation")


class PlanResponse(BaseModel):
    planned_peak_bytes: int
    memory_budget_bytes: int = Field(
        description="the request's: the server's for the path, or less if the request asks for less"
    )
    compute_cost: int
    compute_budget: float
    admitted: bool = Field(
        description="within both budgets: /forward or /backward would "
        "run it (the in-flight memory allowing)"
    )
    path: PlanPath
    graph_id: str
    nodes: list[PlannedStep]
    recompute: PlanRecomputation | None = Field(
        description="how the planner fitted the budget by recomputation (null: it did not)"
    )
    minimum_peak_bytes: int | None = Field(
        description="over budget even with the most recomputation: the smallest planned "
        "peak it reached (null otherwise)"
    )
    vmap_chunks: dict[str, int] | None = Field(None, description=_VMAP_CHUNKS)


# Every problem type the server answers (service/errors.py), as the document lists them.
ProblemType = Annotated[str, WithJsonSchema({"type": "string", "enum": list(PROBLEM_TYPES)})]


class ProblemItem(BaseModel):
    loc: list[str | int] = Field(
        description="where, as a path into the request: `graph.nodes.<id>` names a node"
    )
    msg: str


class Problem(BaseModel):
    """RFC 9457 problem details: every error, of every route. The fields after `detail`
    are there when they apply."""

    type: ProblemType
    title: str
    status: int
    detail: str
    node: str | None = Field(
        None,
        description="the graph node at fault (for a backward step, the forward node it "
        "differentiates)",
    )
    errors: list[ProblemItem] | None = Field(
        None, description="each fault found, where it is (one validation pass finds several)"
    )
    planned_bytes: int | None = Field(None, description="memory-budget: the planned peak")
    budget_bytes: int | None = Field(None, description="memory-budget: the budget it is over")
    compute_cost: int | None = Field(None, description="compute-budget: the program's cost")
    compute_budget: float | None = Field(None, description="compute-budget: the budget it is over")
    phase: Literal["forward", "backward"] | None = Field(
        None, description="non-finite: where the step ran"
    )
    op: str | None = Field(
        None,
        description="non-finite: the primitive (a backward step's: the forward primitive "
        "whose derivative made the values)",
    )
    request_id: str | None = Field(None, description="quote it when reporting a problem")


class OpsResponse(BaseModel):
    ops: list[OpInfo]


class DeviceInfo(BaseModel):
    name: str
    kind: Literal["cpu", "cuda"]
    model: str | None = None
    memory_bytes: int | None = None
    uuid: str | None = None


class DevicesResponse(BaseModel):
    default: str
    devices: list[DeviceInfo]


class Health(BaseModel):
    status: str
