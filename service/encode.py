"""A computation's answer: its outputs, gradients and `meta`, as the response body."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradserve.engine.backends import get_backend
from gradserve.engine.graph import Program, RunResult
from gradserve.engine.graph.ir import RECOMPUTE
from gradserve.service import codec
from gradserve.service.tensors import Held
from gradserve.service.tier import INTERPRETER, XLA
from gradserve.wire.binary import padded
from gradserve.wire.numbers import dumps


@dataclass(frozen=True, eq=False)
class Reply:
    """A response body: its parts in order (a binary body's JSON header, then each
    tensor's bytes, viewed where they lie), and that header's length (None: a JSON body)."""

    parts: list[bytes | memoryview]
    header_length: int | None = None
    media_type: str = "application/json"  # of a body that is not binary
    release: Callable[[], None] | None = None  # lets the parts' memory go, once sent

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in self.parts)


# A JSON text of tensor data takes up to ~20 characters a number; base64 4/3 a byte; the
# binary encoding views the arrays (a copy only of one that is not contiguous).
_TEXT_PER_BYTE = {"json": 5, "base64": 2, "binary": 1}


def output_bytes(program: Program, encoding: str) -> int:
    """What encoding the outputs and gradients may take, on top of the program's plan."""
    metas = program.metas
    raw = sum(value_bytes(metas[s]) for _, s in [*program.outputs, *program.gradients])
    return raw * _TEXT_PER_BYTE.get(encoding, 2)


def value_bytes(meta: Any) -> int:
    n = 1
    for d in meta.shape:
        n *= d
    return n * np.dtype(meta.dtype).itemsize


def recomputation(program: Program) -> dict[str, Any] | None:
    """What recomputing forward values in the backward bought and cost (None: nothing is
    recomputed)."""
    if not program.recompute_cost:  # (every step computed again costs something)
        return None
    steps = sum(step.kind == RECOMPUTE for step in program.steps)
    return {
        "peak_bytes_without": program.peak_without_recompute,
        "added_cost": program.recompute_cost,
        "steps": steps,
    }


def encode_result(
    program: Program,
    result: RunResult,
    *,
    device: str,
    no_grad: bool,
    encoding: str,
    graph_id: str,
    source: str,
    tier: str,
    kept: Mapping[tuple[str, str], Held] | None = None,
) -> Reply:
    """The response: JSON, or with the binary encoding a JSON header whose tensors say
    `binary_data_size`, followed by their bytes in the order they appear in it. `tier`:
    "xla", or why the interpreter ran it (service/tier.py); `kept`: the values held on the
    server instead, by ("outputs" or "gradients", name): their `tensor_id` in place of
    their data (an output keeps its `requires_grad` and `grad_fn`)."""
    to_host = get_backend(device).to_host
    tail: list[memoryview] = []
    slots = dict(program.outputs)
    kept = kept or {}
    outputs = {}
    for name, value in result.outputs.items():
        held = kept.get(("outputs", name))
        entry = (
            held.ref()
            if held is not None
            else codec.encode_tensor(np.asarray(to_host(value)), encoding, tail)
        )
        entry["requires_grad"] = program.requires_grad[slots[name]]
        entry["grad_fn"] = program.grad_fn[slots[name]]
        outputs[name] = entry
    content: dict[str, Any] = {"outputs": outputs}
    if result.gradients is not None:
        content["gradients"] = {
            name: kept[("gradients", name)].ref()
            if ("gradients", name) in kept
            else codec.encode_tensor(np.asarray(to_host(g)), encoding, tail)
            for name, g in result.gradients.items()
        }
    content["meta"] = {
        "device": device,
        "graph_id": graph_id,
        "no_grad": no_grad,
        "nodes": result.nodes,
        "peak_bytes": result.peak_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "compute_cost": program.compute_cost,
        "program": source,
        "recompute": recomputation(program),
        "tier": XLA if tier == XLA else INTERPRETER,
        "tier_reason": None if tier == XLA else tier,
        "timings_ms": result.timings_ms,
    }
    if program.vmap_chunks:
        content["meta"]["vmap_chunks"] = program.vmap_chunks
    header = dumps(content)
    if encoding != "binary":
        return Reply([header])
    header = padded(header)
    return Reply([header, *tail], header_length=len(header))
