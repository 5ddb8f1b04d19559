"""A compute request from its bytes: the envelope, then the request itself.

- `Envelope`: the body split into its JSON document's members, each left as raw bytes (a
  scan that validates JSON and builds nothing: msgspec), its binary tail, and the key of
  its graph's bytes as sent. That is all the front process reads of a request it places
  in a worker (service/placement.py): the raw key finds a graph seen before, and the
  members say whether it was sent by id.
- `Request`: the document parsed (strict JSON: pydantic-core), validated by the wire models
  (service/schemas.py, the one validator), its graph named by id, its tensors decoded, its
  budget and program key worked out. A graph whose bytes were seen before is neither
  parsed nor validated again: its id is found by the raw key, and only the other members
  are parsed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
from pydantic import ValidationError

from gradserve.engine import collector
from gradserve.engine.dtypes import DEFAULT_FLOAT
from gradserve.engine.errors import (
    GradserveError,
    GraphError,
    TensorDataError,
    ValidationErrors,
    quoted,
)
from gradserve.engine.graph import GraphLike, TensorSpec
from gradserve.service import codec
from gradserve.service.errors import ProblemError, pydantic_errors, schema_problem
from gradserve.service.literals import Split, TextSites, split_numbers
from gradserve.service.programs import Programs, spec_json
from gradserve.service.schemas import (
    BackwardRequest,
    ForwardRequest,
    Graph,
    KeepOutputs,
    PlanRequest,
    TensorIn,
    TensorRefIn,
    TensorSpecIn,
    Wire,
)
from gradserve.service.settings import Settings
from gradserve.service.tensors import Pins, TensorStore, tensor_unknown
from gradserve.wire.binary import REQUEST_SECTIONS, FramingError, split, tensor_bytes
from gradserve.wire.graph_id import canonical_graph, id_of_canonical

Decoded = dict[str, tuple[np.ndarray, bool]]  # name -> (host array, requires_grad)
W = TypeVar("W", bound=Wire)
Body = ForwardRequest | BackwardRequest | PlanRequest
MODELS: dict[str, type[Body]] = {
    "forward": ForwardRequest,
    "backward": BackwardRequest,
    "plan": PlanRequest,
}

# Splits a JSON object into its members, each left as raw bytes (validated as JSON, not
# parsed into objects): what finds a graph by its bytes without parsing it.
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
# A large document is split in one pass down to its tensors' fields (a second scan of its
# tensors' megabytes would cost as much as the first): the requests' members, the tensors'
# split (codec.TensorFields). A member of another name, or a tensor that is not an object
# (bare data), fails it: the document is then split as any other.
TENSOR_MEMBERS = frozenset({"inputs", "grad_outputs"})
SPLIT_DEEP_BYTES = 256 << 10
_DEEP = msgspec.json.Decoder(
    msgspec.defstruct(
        "Document",
        [
            (name, codec.TensorFields if name in TENSOR_MEMBERS else msgspec.Raw, msgspec.UNSET)
            for name in sorted({n for model in MODELS.values() for n in model.model_fields})
        ],
        forbid_unknown_fields=True,
    )
)


@dataclass(frozen=True)
class Envelope:
    """A body, split: its JSON document, the document's members as raw bytes (None: not a
    JSON object, which the parse then says), a binary body's tail, and the raw key of the
    graph's bytes as sent (None: no graph in the body)."""

    document: bytes | memoryview  # (a view where the body lies in shared memory)
    members: Mapping[str, memoryview] | None  # (tensors members: in `tensors`, if split)
    tail: memoryview | None
    raw_key: str | None
    tensors: Mapping[str, codec.TensorFields] | None = None  # a large document's, split
    split: Split | None = None  # the graph's bytes split into text and numbers, if read

    @property
    def graph_bytes(self) -> memoryview | None:
        graph = None if self.members is None else self.members.get("graph")
        return None if graph is None or graph == b"null" else graph

    @property
    def graph_id(self) -> str | None:
        """The `graph_id` member, when it is a JSON string (else validation says why)."""
        raw = None if self.members is None else self.members.get("graph_id")
        if raw is None:
            return None
        try:
            value = codec.loads(bytes(raw))
        except codec.JSONError:
            return None
        return value if isinstance(value, str) else None


def open_envelope(
    body: bytes | memoryview,
    header_length: int | None,
    programs: Programs,
    raw_key: str | None = None,
) -> Envelope:
    """Split a body (a binary one at its JSON header's end), and key its graph's bytes
    (`raw_key`: already keyed by the process that placed it)."""
    if header_length is None:
        document, tail = body, None
    else:
        try:
            head, tail = split(body, header_length)
        except FramingError as err:
            raise framing_problem(err) from None
        document = bytes(head)
    members, tensors = _split(document)
    graph = None if members is None else members.get("graph")
    if graph is None or graph == b"null":
        raw_key = None
    elif raw_key is None:
        raw_key = programs.raw_key(graph)
    return Envelope(document, members, tail, raw_key, tensors)


def _split(
    document: bytes | memoryview,
) -> tuple[dict[str, memoryview] | None, dict[str, codec.TensorFields] | None]:
    """A document's members, and (a large one's) its tensors members split (None, None:
    not a JSON object, which the parse then says)."""
    try:
        if len(document) >= SPLIT_DEEP_BYTES:
            try:
                deep = _DEEP.decode(document)
            except msgspec.ValidationError:
                pass
            else:
                members, tensors = {}, {}
                for name in deep.__struct_fields__:
                    value = getattr(deep, name)
                    if value is msgspec.UNSET:
                        continue
                    if name in TENSOR_MEMBERS:
                        tensors[name] = value
                    else:
                        members[name] = memoryview(value)
                return members, tensors
        return {k: memoryview(v) for k, v in _MEMBERS.decode(document).items()}, None
    except (msgspec.DecodeError, ValueError, RecursionError):  # (RecursionError: too deep)
        return None, None


@dataclass(frozen=True)
class GraphText:
    """A graph sent in the body: its bytes, split into text and numbers, and the key its
    literals' places go by (its text's, with the input specs and flags the program key
    holds)."""

    graph: bytes
    found: Split
    sites_key: str


@dataclass(frozen=True)
class Request:
    """A parsed, validated request: its graph (by id; the validated model when this
    process parsed it), how to run and answer it, its decoded tensors, its memory budget,
    and its program's key."""

    kind: str  # "forward", "backward" or "plan"
    graph_id: str
    graph: Graph | None
    device: str
    encoding: str
    inputs: Decoded
    grad_outputs: Decoded | None
    no_grad: bool
    backward: bool
    budget: int  # the server's for its path, or less if it asks less
    recompute: bool  # a backward over its budget may recompute forward values to fit
    program_key: str
    started: float  # perf_counter() when parsing began
    graphs_evicted: int = 0  # by this process's graph cache, to hold this one
    # /plan: the tensors as specs (shape, dtype, requires_grad), without data
    input_specs: Mapping[str, TensorSpec] | None = None
    grad_output_specs: Mapping[str, TensorSpec] | None = None
    path: str = ""  # /plan's `path`
    detect_anomaly: bool = False  # the first step to make NaN or inf from finite inputs: 422
    tenant: str | None = None  # the API key's id (None with keys off): whose tensors
    keep: KeepOutputs | None = None  # the values to keep on the server (a Keep: gradients too)
    # The held tensors it reads, locked against eviction until it ends (`release`).
    pins: Pins = field(default_factory=Pins)
    # Its graph's bytes as sent, split (None: sent by id, or seen before by its bytes)...
    text: GraphText | None = None
    # ... and where their numbers gave its lifted literals: its lifting shape and literals'
    # values (service/literals.py; its graph then was not validated: its text was).
    lifted: tuple[Hashable, list[float]] | None = None

    @property
    def budget_shapes_program(self) -> bool:
        """Whether its program depends on its budget: a backward that may recompute (every
        other program is the same under any budget, checked against it on use)."""
        return self.backward and self.recompute

    def specs(self) -> tuple[Mapping[str, TensorSpec], Mapping[str, TensorSpec] | None]:
        """Its inputs' and upstream gradients' specs, as the compiler takes them."""
        if self.input_specs is not None:
            return self.input_specs, self.grad_output_specs
        return _specs(self.inputs), None if self.grad_outputs is None else _specs(self.grad_outputs)


class Parser:
    """Envelopes into Requests, for one process (its settings, and its programs' keys,
    aliases, graphs and grants)."""

    def __init__(
        self, settings: Settings, programs: Programs, tensors: TensorStore | None = None
    ) -> None:
        self.settings = settings
        self.programs = programs
        self.tensors = tensors  # (None: this process holds no tensors: every id is unknown)
        self.sites = TextSites()  # where the literals of graphs' texts are written
        self._devices: dict[str | None, str] = {}  # request's device -> canonical name

    def device(self, spec: str | None) -> str:
        """`parse_device`, remembered: the devices of a process do not change while it
        runs. Only names that parsed are kept, and only a few (clients choose them)."""
        from gradserve.engine.backends import parse_device

        name = self._devices.get(spec)
        if name is None:
            name = parse_device(spec, self.settings.default_device)
            if len(self._devices) < 16:
                self._devices[spec] = name
        return name

    def parse(self, envelope: Envelope, kind: str, tenant: str | None) -> Request:
        """The request an envelope holds (see the module's docstring). The held tensors it
        names are pinned until the caller releases `request.pins` (here, if it fails)."""
        pins = Pins()
        try:
            return self._parse(envelope, kind, tenant, pins)
        except BaseException:
            pins.release()
            raise

    def _parse(self, envelope: Envelope, kind: str, tenant: str | None, pins: Pins) -> Request:
        started = time.perf_counter()
        model = MODELS[kind]
        with collector.paused():  # (the parse makes acyclic objects by the 100,000)
            v = self._validated(envelope, model, tenant)
            data, req, graph_id, graph, evicted = v.data, v.req, v.graph_id, v.graph, v.evicted
            errors: list[GradserveError] = []
            specs: dict[str, TensorSpec] | None = None
            grad_specs: dict[str, TensorSpec] | None = None
            inputs: Decoded = {}
            grad_outputs: Decoded | None = None
            try:
                binary = tensor_bytes(data, envelope.tail, REQUEST_SECTIONS)
            except FramingError as err:
                raise framing_problem(err) from None
            held = _Held(self.tensors, tenant, pins, isinstance(req, PlanRequest))
            if isinstance(req, PlanRequest):
                specs = _specs_of("inputs", req.inputs, errors, binary, held)
                grad_specs = (
                    None
                    if req.grad_outputs is None
                    else _specs_of("grad_outputs", req.grad_outputs, errors, binary, held)
                )
            else:
                inputs = _decode_all("inputs", req.inputs, errors, binary, held)
                if isinstance(req, BackwardRequest) and req.grad_outputs is not None:
                    grad_outputs = _decode_all(
                        "grad_outputs", req.grad_outputs, errors, binary, held
                    )
        if errors:
            if v.unchecked is not None:  # (the graph's errors come first, as they would)
                _validate(v.unchecked, model)
            raise ValidationErrors(errors)
        try:
            held.resolve()  # (409 listing every id unknown here, once the data is valid)
        except ProblemError:
            if v.unchecked is not None:  # (likewise)
                _validate(v.unchecked, model)
            raise
        path: str = ""
        if isinstance(req, PlanRequest):
            no_grad, backward, path = req.path == "no_grad", req.path == "backward", req.path
        else:
            no_grad = isinstance(req, ForwardRequest) and req.no_grad
            backward = isinstance(req, BackwardRequest)
        device = self.device(req.device)
        budget = self._budget(req.memory_budget_bytes, no_grad)
        recompute = req.recompute == "auto"
        spec_keys = (
            spec_json(
                _spec_key(inputs) if specs is None else _spec_tuple(specs),
                _spec_key(grad_outputs) if specs is None else _spec_tuple(grad_specs),
            ),
            no_grad,
            backward,
            device,
        )
        shaping = budget if backward and recompute else None
        key = self.programs.program_key(graph_id, *spec_keys, budget=shaping)
        text = lifted = None
        if v.found is not None:
            assert v.graph_bytes is not None
            sites_key = self.programs.program_key(v.found.text_key, *spec_keys, budget=shaping)
            text = GraphText(v.graph_bytes, v.found, sites_key)
            if v.unchecked is not None and specs is None:
                lifted = self.sites.literals(sites_key, v.found.numbers)
        if v.unchecked is not None:
            if lifted is None:  # (its literals are not where they were: validated now)
                graph, evicted = self._remember(v, model, tenant)
            else:
                assert v.canonical is not None
                evicted = self.programs.remember_graph(graph_id, None, v.canonical, v.raw_key)
                self.programs.grant(tenant, graph_id)
        return Request(
            kind=kind,
            graph_id=graph_id,
            graph=graph,
            device=device,
            encoding=getattr(req, "encoding", "json"),
            inputs=inputs,
            grad_outputs=grad_outputs,
            no_grad=no_grad,
            backward=backward,
            budget=budget,
            recompute=recompute,
            program_key=key,
            started=started,
            graphs_evicted=evicted,
            input_specs=specs,
            grad_output_specs=grad_specs,
            detect_anomaly=getattr(req, "detect_anomaly", False),
            path=path,
            tenant=tenant,
            keep=getattr(req, "keep", None),
            pins=pins,
            text=text,
            lifted=lifted,
        )

    def _validated(self, envelope: Envelope, model: type[Body], tenant: str | None) -> _Validated:
        """The document's data, validated as `model`, its graph's id, the graph (when
        parsed here), and how many graphs this process's cache evicted to hold it. A graph
        whose text (all but its numbers) was seen with its literals' places found is left
        `unchecked`: only its other members are validated, and the graph is, by `_remember`,
        unless its numbers turn out to be a lifted program's literals."""
        graph_bytes, raw_key = envelope.graph_bytes, envelope.raw_key
        if graph_bytes is not None and raw_key is not None:
            graph_id = self.programs.alias(raw_key)
            rest = None if graph_id is None else _parse_members(envelope, skip="graph")
            if rest is not None and graph_id is not None:  # a graph seen before, by its bytes
                self._check_sizes(rest)
                req = _validate(_with_id(rest, graph_id), model)
                _check_id(req, graph_id)
                self.programs.grant(tenant, graph_id)
                return _Validated(rest, req, graph_id)
        data = _parse_members(envelope)
        if data is None:  # (not a JSON object, or a member that is not JSON: it says how)
            data = parse_json(envelope.document)
        self._check_sizes(data)
        graph_data = data.get("graph") if isinstance(data, dict) else None
        found = text = None
        if graph_bytes is not None and isinstance(graph_data, dict):
            text = bytes(graph_bytes)
            found = split_numbers(text) if envelope.split is None else envelope.split
            if self.sites.seen(found.text_key):
                canonical = canonical_graph(graph_data)
                graph_id = id_of_canonical(canonical)
                rest = {k: v for k, v in data.items() if k != "graph"}
                try:
                    req = _validate(_with_id(rest, graph_id), model)
                    _check_id(req, graph_id)
                except ProblemError:
                    _validate(data, model)  # (what is wrong, the graph's errors with the rest)
                    raise
                return _Validated(
                    rest,
                    req,
                    graph_id,
                    found=found,
                    graph_bytes=text,
                    unchecked=data,
                    canonical=canonical,
                    raw_key=raw_key,
                )
        req = _validate(data, model)
        graph = req.graph
        if graph is None:  # sent by id
            graph_id = req.graph_id
            assert graph_id is not None  # (the models' rule: a graph or its id)
            if not self.programs.granted(tenant, graph_id):
                raise graph_unknown(graph_id)
            return _Validated(data, req, graph_id)
        canonical = canonical_graph(data["graph"])
        graph_id = id_of_canonical(canonical)
        _check_id(req, graph_id)
        evicted = self.programs.remember_graph(graph_id, graph, canonical, raw_key)
        self.programs.grant(tenant, graph_id)
        return _Validated(data, req, graph_id, graph, evicted, found=found, graph_bytes=text)

    def _remember(self, v: _Validated, model: type[Body], tenant: str | None) -> tuple[Graph, int]:
        """An unchecked graph validated (as the whole document would have been), and held."""
        assert v.unchecked is not None and v.canonical is not None
        graph = _validate(v.unchecked, model).graph
        assert graph is not None
        evicted = self.programs.remember_graph(v.graph_id, graph, v.canonical, v.raw_key)
        self.programs.grant(tenant, v.graph_id)
        return graph, evicted

    def _check_sizes(self, data: Any) -> None:
        """The request's counts, before its models are built: a body of a million tiny
        inputs is refused before it becomes a million models."""
        if not isinstance(data, dict):
            return  # validation says what is wrong
        limits = self.settings
        for where in ("inputs", "grad_outputs"):
            tensors = data.get(where)
            if isinstance(tensors, dict) and len(tensors) > limits.max_inputs:
                raise GraphError(
                    f"the request has {len(tensors)} {where.replace('_', ' ')}; "
                    f"the limit is {limits.max_inputs}",
                    loc=(where,),
                )
        graph = data.get("graph")
        nodes = graph.get("nodes") if isinstance(graph, dict) else None
        if isinstance(nodes, list) and len(nodes) > limits.max_nodes:
            raise GraphError(
                f"the graph has {len(nodes)} nodes; the limit is {limits.max_nodes}",
                loc=("graph", "nodes"),
            )

    def _budget(self, asked: int | None, no_grad: bool) -> int:
        """A request's memory budget: the server's for its path, or less if it asks; more
        is refused (a budget protects the server, not the request)."""
        s = self.settings
        server = s.no_grad_memory_budget_bytes if no_grad else s.memory_budget_bytes
        if asked is None:
            return server
        if asked > server:
            path = "no_grad" if no_grad else "grad"
            raise ProblemError(
                "invalid-request",
                f"memory_budget_bytes is {asked}, over this server's {path} "
                f"budget of {server} bytes: a request may ask for less, never more",
                errors=[{"loc": ["memory_budget_bytes"], "msg": f"at most {server}"}],
            )
        return asked

    def graph_of(self, request: Request) -> GraphLike:
        """The request's graph, to compile: parsed with it, or held by id (by this process,
        or in the store); 409 when nobody holds it."""
        if request.graph is not None:
            return request.graph
        graph = self.programs.graph(request.graph_id, parse_graph)
        if graph is None:
            raise graph_unknown(request.graph_id)
        return graph


@dataclass(frozen=True)
class _Validated:
    """What `Parser._validated` found (see there)."""

    data: Any
    req: Body
    graph_id: str
    graph: Graph | None = None
    evicted: int = 0
    found: Split | None = None  # its graph's bytes, split (a graph sent in the body)
    graph_bytes: bytes | None = None
    unchecked: Any = None  # the whole document, where its graph was not validated
    canonical: bytes | None = None
    raw_key: str | None = None


def parse_json(document: bytes | memoryview) -> Any:
    """Strict JSON (RFC 8259: no bare NaN or Infinity), parsed once by pydantic-core:
    malformed JSON is 400."""
    document = bytes(document)  # (a no-op on bytes)
    if not document or document.isspace():  # (not `strip()`: a copy of up to 64 MiB)
        raise ProblemError("malformed-json", "the request body is empty; send a JSON object")
    try:
        return codec.loads(document)
    except codec.JSONError as exc:
        raise ProblemError(
            "malformed-json",
            f"the body is not valid JSON: {exc}",
            errors=[{"loc": [], "msg": str(exc)}],
        ) from None


def _validate(data: Any, model: type[W]) -> W:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise schema_problem(pydantic_errors(exc)) from None


def parse_graph(canonical: bytes) -> Graph:
    """A graph from its JSON alone (held by id: its canonical JSON), validated."""
    return _validate(codec.loads(canonical), Graph)


def _parse_members(envelope: Envelope, skip: str | None = None) -> dict[str, Any] | None:
    """Every member but `skip` parsed as the full parse would (the tensors' members by
    `codec.loads_tensors`), or None where that parse would refuse one (it then runs, and
    says what is wrong)."""
    if envelope.members is None:
        return None
    try:
        parsed = {
            k: codec.loads_tensors(v) if k in TENSOR_MEMBERS else codec.loads(bytes(v))
            for k, v in envelope.members.items()
            if k != skip
        }
        for k, fields in (envelope.tensors or {}).items():
            parsed[k] = codec.tensors_of_fields(fields)
        return parsed
    except codec.JSONError:
        return None


def _with_id(rest: dict[str, Any], graph_id: str) -> dict[str, Any]:
    """A request's members without its graph, validated in its stead by the graph's id (a
    `graph_id` the body gives stays, to be checked against it)."""
    return rest if rest.get("graph_id") is not None else {**rest, "graph_id": graph_id}


def _check_id(req: Body, graph_id: str) -> None:
    given = req.graph_id
    if given is not None and given != graph_id:
        raise ProblemError(
            "invalid-request",
            f"graph_id {quoted(given)} is not the id of the graph "
            f"sent with it ({graph_id}); send one or the other, or both matching",
            errors=[{"loc": ["graph_id"], "msg": "does not match the graph"}],
        )


def graph_unknown(graph_id: str) -> ProblemError:
    return ProblemError(
        "graph-unknown",
        f"this server does not hold graph {quoted(graph_id)} (a server "
        "holds the graphs it was sent recently, in its program store, and with API keys only "
        "for the key that sent them): send the graph itself, which it then holds under that "
        "id",
        errors=[{"loc": ["graph_id"], "msg": "unknown here"}],
    )


def framing_problem(err: FramingError) -> ProblemError:
    return ProblemError(
        "malformed-body", str(err), errors=[{"loc": list(err.loc), "msg": err.short}]
    )


class _Held:
    """A request's tensors named by id: each noted where the request names it, then
    resolved at once (`resolve`), from this host's tensor store, for the request's API
    key. A /plan reads their headers alone (`specs_only`); the others map their data,
    pinned for the request."""

    def __init__(
        self, store: TensorStore | None, tenant: str | None, pins: Pins, specs_only: bool
    ) -> None:
        self.store, self.tenant, self.pins, self.specs_only = store, tenant, pins, specs_only
        # Each use: (where, name) and the id, and what to fill in once it is resolved.
        self.wanted: list[
            tuple[tuple[str, str], str, Callable[[np.ndarray | TensorSpec], None]]
        ] = []

    def want(self, loc: tuple[str, str], tensor: str, fill: Callable[[Any], None]) -> None:
        self.wanted.append((loc, tensor, fill))

    def resolve(self) -> None:
        if not self.wanted:
            return
        if self.specs_only:
            found: dict[str, Any] = {}
            for _, tensor, _ in self.wanted:
                described = None if self.store is None else self.store.describe(self.tenant, tensor)
                if described is not None:
                    found[tensor] = described
        else:
            found = (
                {}
                if self.store is None
                else self.store.open(
                    self.tenant,
                    [((*loc, "tensor_id"), t) for loc, t, _ in self.wanted],
                    self.pins,
                )
            )
        missing = [((*loc, "tensor_id"), t) for loc, t, _ in self.wanted if t not in found]
        if missing:
            raise tensor_unknown(missing)
        for _, tensor, fill in self.wanted:
            fill(found[tensor])


def _decode_all(
    where: str,
    tensors: Mapping[str, Any],
    errors: list[GradserveError],
    binary: Mapping[tuple[str, str], memoryview],
    held: _Held,
) -> Decoded:
    out: Decoded = {}
    for name, value in tensors.items():
        if isinstance(value, TensorRefIn):
            out[name] = (_PENDING, value.requires_grad)  # (its place kept: order is the key's)

            def fill(array: np.ndarray, name: str = name, rg: bool = value.requires_grad) -> None:
                out[name] = (array, rg)

            held.want((where, name), value.tensor_id, fill)
            continue
        try:
            if isinstance(value, TensorIn):
                array = codec.decode_tensor(
                    (where, name),
                    data=value.data,
                    b64=value.b64,
                    binary=binary.get((where, name)),
                    dtype=value.dtype,
                    shape=value.shape,
                )
                requires_grad = value.requires_grad
                if requires_grad and value.dtype is None and array.dtype.kind == "i":
                    # JSON numbers that require grad take the default floating dtype, even
                    # written without a decimal point (as JavaScript and Go write 2.0).
                    array = codec.decode_tensor(
                        (where, name), data=value.data, dtype=DEFAULT_FLOAT, shape=value.shape
                    )
            else:
                array = codec.decode_tensor((where, name), data=value)
                requires_grad = False
        except TensorDataError as err:
            errors.append(err)
            continue
        out[name] = (array, requires_grad)  # requires_grad on an int: the compiler refuses
    return out


def _specs_of(
    where: str,
    tensors: Mapping[str, Any],
    errors: list[GradserveError],
    binary: Mapping[tuple[str, str], memoryview],
    held: _Held,
) -> dict[str, TensorSpec]:
    """A /plan request's tensors as specs: given as specs, or decoded from their data (in
    the JSON, or a binary body's tail), or read from a held tensor's header."""
    specs: dict[str, TensorSpec] = {}
    for name, value in tensors.items():
        if isinstance(value, TensorRefIn):
            specs[name] = _PENDING_SPEC

            def fill(h: Any, name: str = name, rg: bool = value.requires_grad) -> None:
                specs[name] = TensorSpec(h.shape, h.dtype, rg)

            held.want((where, name), value.tensor_id, fill)
        elif isinstance(value, TensorSpecIn):
            try:
                codec.check_shape((where, name), value.shape, np.dtype(value.dtype).itemsize)
            except TensorDataError as err:
                errors.append(err)
                continue
            specs[name] = TensorSpec(tuple(value.shape), value.dtype, value.requires_grad)
        else:
            specs.update(_specs(_decode_all(where, {name: value}, errors, binary, held)))
    return specs


# What a held tensor's place holds until it is resolved (a request that fails first never
# reads it).
_PENDING = np.empty(0)
_PENDING_SPEC = TensorSpec((0,), "float32", False)


def _specs(decoded: Decoded) -> dict[str, TensorSpec]:
    return {
        name: TensorSpec(shape=a.shape, dtype=codec.dtype_name(a), requires_grad=rg)
        for name, (a, rg) in decoded.items()
    }


def _spec_key(decoded: Decoded | None) -> Hashable:
    """What `_specs` would say, as a cache key, without making the specs."""
    if decoded is None:
        return None
    return tuple([(name, a.shape, a.dtype, rg) for name, (a, rg) in decoded.items()])


def _spec_tuple(specs: Mapping[str, TensorSpec] | None) -> Hashable:
    """Specs keyed as `_spec_key` keys decoded arrays (so that /plan finds their programs)."""
    if specs is None:
        return None
    return tuple([(name, t.shape, np.dtype(t.dtype), t.requires_grad) for name, t in specs.items()])
