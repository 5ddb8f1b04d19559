"""The compute path: wire request -> engine graph -> wire response.

The route hands over the raw body; everything else runs in one worker-thread job so the
event loop stays free (health checks, small requests) however large the body or graph:
parse (pydantic-core, once), decode tensors, `compile_graph` (validation and memory
plan), admission of the planned bytes, `execute`, and encoding with orjson.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio
import numpy as np
from pydantic import ValidationError

import engine
from engine.backends import parse_device
from engine.errors import (
    DeadlineExceeded,
    GradserveError,
    MemoryBudgetError,
    TensorDataError,
    ValidationErrors,
)
from engine.graph import GraphSpec, Limits, NodeSpec, RunResult, TensorSpec, compile_graph, execute
from service import codec
from service.admission import Admission
from service.errors import ProblemError, pydantic_errors, schema_problem
from service.metrics import Metrics
from service.schemas import BackwardRequest, ForwardRequest, Graph, TensorIn
from service.settings import Settings

Decoded = dict[str, tuple[np.ndarray, bool]]  # name -> (host array, requires_grad)


class Runner:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(
            settings.max_concurrency, settings.inflight_memory_bytes, metrics
        )
        # Our own thread budget: sized to the slots, shared with nothing else.
        self.limiter = anyio.CapacityLimiter(settings.max_concurrency)

    async def run(self, body: bytes, model: type[ForwardRequest | BackwardRequest]) -> bytes:
        deadline = time.monotonic() + self.settings.request_timeout_s
        self.admission.enter()
        try:
            return await anyio.to_thread.run_sync(
                self._job, body, model, deadline, limiter=self.limiter
            )
        finally:
            self.admission.leave()

    def warm_up(self, body: bytes) -> None:
        """Run one small request end to end, off the books: a throwaway Metrics, and
        limits that a tiny configured one (in a test) cannot trip."""
        roomy = self.settings.model_copy(update={
            "max_nodes": 100_000, "memory_budget_bytes": 1 << 20,
            "no_grad_memory_budget_bytes": 1 << 20, "inflight_memory_bytes": 1 << 20,
        })
        Runner(roomy, Metrics())._job(body, BackwardRequest, time.monotonic() + 60)

    # ------------------------------------------------------------------ in the worker
    def _job(
        self, body: bytes, model: type[ForwardRequest | BackwardRequest], deadline: float
    ) -> bytes:
        req = parse_body(body, model)
        backward = isinstance(req, BackwardRequest)
        no_grad = isinstance(req, ForwardRequest) and req.no_grad
        device = parse_device(req.device, self.settings.default_device)

        errors: list[GradserveError] = []
        inputs = _decode_all("inputs", req.inputs, errors)
        grad_outputs = (
            _decode_all("grad_outputs", req.grad_outputs, errors)
            if isinstance(req, BackwardRequest) and req.grad_outputs is not None
            else None
        )
        if errors:
            raise ValidationErrors(errors)

        s = self.settings
        budget = s.no_grad_memory_budget_bytes if no_grad else s.memory_budget_bytes
        path = "no_grad" if no_grad else "grad"
        try:
            program = compile_graph(
                graph_spec(req.graph),
                _specs(inputs),
                limits=Limits(max_nodes=s.max_nodes, memory_budget_bytes=budget),
                no_grad=no_grad,
                backward=backward,
                grad_outputs=None if grad_outputs is None else _specs(grad_outputs),
            )
        except MemoryBudgetError:
            self.metrics.rejections.labels("memory_budget").inc()
            raise
        with self.admission.reserve(program.planned_peak_bytes):
            self.metrics.planned_peak.labels(path).observe(program.planned_peak_bytes)
            try:
                result = execute(
                    program,
                    _tensors(inputs, device),
                    grad_outputs=None if grad_outputs is None else _tensors(grad_outputs, device),
                    deadline=deadline,
                    device=device,
                )
            except DeadlineExceeded:
                self.metrics.rejections.labels("timeout").inc()
                raise
            self.metrics.measured_peak.labels(path).observe(result.peak_bytes)
            return encode_result(result, device=device, no_grad=no_grad, encoding=req.encoding)


def parse_body(body: bytes, model: type[ForwardRequest | BackwardRequest]) -> Any:
    """One pass of pydantic-core over the raw bytes: malformed JSON is 400, schema 422."""
    if not body.strip():
        raise ProblemError("malformed-json", "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        for e in exc.errors():
            if e["type"] == "json_invalid":
                raise ProblemError("malformed-json", f"the body is not valid JSON: {e['msg']}",
                                   errors=[{"loc": [], "msg": e["msg"]}]) from None
        raise schema_problem(pydantic_errors(exc)) from None


def graph_spec(graph: Graph) -> GraphSpec:
    return GraphSpec(
        nodes=[
            NodeSpec(id=n.id, op=n.op, args=n.args or (), attrs=n.attrs or {}, expr=n.expr)
            for n in graph.nodes
        ],
        outputs=graph.outputs,
    )


def _decode_all(where: str, tensors: Mapping[str, Any], errors: list[GradserveError]) -> Decoded:
    out: Decoded = {}
    for name, value in tensors.items():
        try:
            if isinstance(value, TensorIn):
                array = codec.decode_tensor(
                    (where, name), data=value.data, b64=value.b64,
                    dtype=value.dtype, shape=value.shape,
                )
                requires_grad = value.requires_grad
            else:
                array = codec.decode_tensor((where, name), data=value)
                requires_grad = False
        except TensorDataError as err:
            errors.append(err)
            continue
        out[name] = (array, requires_grad)  # requires_grad on an int: compile_graph refuses
    return out


def _specs(decoded: Decoded) -> dict[str, TensorSpec]:
    return {
        name: TensorSpec(shape=a.shape, dtype=a.dtype.name, requires_grad=rg)
        for name, (a, rg) in decoded.items()
    }


def _tensors(decoded: Decoded, device: str) -> dict[str, engine.Tensor]:
    return {
        name: engine.tensor(a, requires_grad=rg, device=device)
        for name, (a, rg) in decoded.items()
    }


def encode_result(result: RunResult, *, device: str, no_grad: bool, encoding: str) -> bytes:
    outputs = {}
    for name, t in result.outputs.items():
        entry = codec.encode_tensor(t.numpy(), encoding)
        entry["requires_grad"] = t.requires_grad
        entry["grad_fn"] = t.grad_fn.name() if t.grad_fn is not None else None
        outputs[name] = entry
    content: dict[str, Any] = {"outputs": outputs}
    if result.gradients is not None:
        content["gradients"] = {
            name: codec.encode_tensor(g.numpy(), encoding) for name, g in result.gradients.items()
        }
    content["meta"] = {
        "device": device,
        "no_grad": no_grad,
        "nodes": result.nodes,
        "peak_bytes": result.peak_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "timings_ms": result.timings_ms,
    }
    return codec.dumps(content)
