"""The engine's rules, in one module: the dtype table and type promotion, every op's
declaration (its shape-and-dtype rule `infer`, its attributes and their binding), and the
declarations of the graph transforms (`grad`, `jvp`, `scan`, `vmap`, `jacobian`,
`hessian`), which with the ops make the
standard catalog (`GET /ops`).

The eager engine, the compiler, the client's tracer and the codec all read the rules from
here, so that a rule changed once changes for each of them. Hence this module imports
nothing heavy (NumPy at most) and never the eager engine (Tensor, autograd, backends) nor
the compiler: the light client imports it. Each rule is written beside what it rules (an
op's `infer` in its group's module of engine/ops, promotion in engine/dtypes.py); what
lives here is only what has no such home: the transforms' declarations and the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from gradserve.engine.dtypes import DTYPES, FLOATS, INTS, check_dtype, scalar_dtype
from gradserve.engine.errors import ArityError
from gradserve.engine.ops import OPS
from gradserve.engine.ops.common import elementwise_infer, is_number
from gradserve.engine.ops.registry import (
    INT64_MAX,
    INT64_MIN,
    Attr,
    Meta,
    OpDef,
    bind_attributes,
    literal_meta,
    promoted_dtype,
)
from gradserve.engine.shapes import Shape, fmt, numel

__all__ = [
    "DTYPES",
    "FLOATS",
    "GRAD",
    "HESSIAN",
    "INT64_MAX",
    "INT64_MIN",
    "INTS",
    "JACOBIAN",
    "JVP",
    "OPS",
    "SCAN_NODE",
    "TRANSFORMS",
    "VMAP_NODE",
    "Attr",
    "Meta",
    "OpDef",
    "Shape",
    "Transform",
    "bind_attributes",
    "catalog_ops",
    "check_dtype",
    "elementwise_infer",
    "fmt",
    "is_number",
    "literal_meta",
    "numel",
    "promoted_dtype",
    "scalar_dtype",
]


@dataclass(frozen=True, eq=False)
class Transform:
    """A graph-level node kind: its name, arguments and attributes, as `GET /ops` lists
    them (`args` beyond `min_args` are optional; `fields` are the node's other keys)."""

    name: str
    args: tuple[str, ...]
    min_args: int
    doc: str
    attrs: dict[str, Attr] = field(default_factory=dict)
    variadic: bool = False
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def defaults(self) -> dict[str, Any]:
        return {k: a.default for k, a in self.attrs.items() if not a.required}

    def check_arity(self, n: int) -> None:
        if self.variadic:
            return
        if not self.min_args <= n <= len(self.args):
            want = (
                str(len(self.args))
                if self.min_args == len(self.args)
                else f"{self.min_args} or {len(self.args)}"
            )
            raise ArityError(
                f"takes {want} arguments ({', '.join(self.args)}), got {n}", op=self.name
            )

    def bind_attrs(self, given: dict[str, Any]) -> dict[str, Any]:
        return bind_attributes(self.name, self.attrs, self.defaults, given)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "group": "transforms",
            "args": list(self.args),
            "variadic": self.variadic,
            "attrs": {k: a.describe() for k, a in self.attrs.items()},
            "differentiable": True,
            "doc": self.doc,
            "min_args": self.min_args,
        }
        if self.fields:
            out["fields"] = dict(self.fields)
        return out


GRAD = Transform(
    "grad",
    ("target", "wrt", "grad_output"),
    2,
    "The gradient of `target` with respect to `wrt` (an input or any node), as "
    "torch.autograd.grad(target, wrt, grad_output, create_graph=True): `wrt`'s shape and "
    "dtype; zeros where the target does not depend on it; differentiable again. Without "
    "`grad_output` the target must have one element.",
)
JVP = Transform(
    "jvp",
    ("output", "input", "tangent"),
    3,
    "Forward mode: ∂output/∂input · tangent, with `tangent` of `input`'s shape and dtype "
    "and the result of `output`'s; differentiable again.",
)

SCAN_NODE = Transform(
    "scan",
    ("carries...", "xs..."),
    0,
    "A loop over the leading axis of the sequences (as jax.lax.scan): `args` are the "
    "initial carries, then the sequences, in the order of body.carry then body.xs. Each step "
    "runs body.nodes (which may read the carries, the current slices and any outer value), "
    "and body.next gives each carry's next value. `results` declares new ids: a carry name "
    "gives its final value, a body node id its value at every step stacked on a new dim 0. "
    "Differentiable; the loop is compiled once, not unrolled.",
    attrs={
        "length": Attr(
            "int",
            None,
            doc="the number of steps: required without "
            "sequences; with them, optional and must match",
            nullable=True,
        )
    },
    variadic=True,
    fields={
        "body": "{carry: [name], xs: [name], nodes: [node], next: {carry: id}}",
        "results": "{new id: carry name or body node id}",
    },
)

VMAP_NODE = Transform(
    "vmap",
    ("mapped...",),
    1,
    "The body run once per index of the mapped dim of its arguments, as torch.func.vmap, "
    "computed for the whole batch at once: `args` are mapped over attrs.in_axes (one int per "
    "argument, default 0) in body.in order, and every mapped size must agree. The body sees "
    "one slice of each (the mapped dim removed) and may read any outer value, unmapped. "
    "`results` declares new ids: a body node id gives its values for every index stacked on a "
    "new dim 0; {of, reduce} gives a reduction over the mapped dim that never holds the "
    'stacked values: "sum", "mean", or "clip_sum" (Σᵢ vᵢ · min(1, max_norm / (‖wᵢ‖₂ + 1e-6)), '
    "‖wᵢ‖₂ the norm of index i's values of every id in norm_of together, default of alone, as "
    "Opacus clips). Reductions add in index order, so the chunking never changes a result. "
    "Differentiable; vmaps nest and may hold grad, jvp and scan.",
    attrs={
        "in_axes": Attr(
            "int|ints",
            None,
            doc="per argument, the dim it is mapped over (one int: for every argument; default 0)",
            nullable=True,
        ),
        "chunk_size": Attr(
            "int",
            None,
            doc="indices computed at once; null: the whole batch when it fits the memory "
            "budget, else the largest chunks that fit",
            nullable=True,
        ),
    },
    variadic=True,
    fields={
        "body": "{in: [name], nodes: [node]}",
        "results": "{new id: body node id, or {of: body node id, reduce: sum|mean|clip_sum, "
        "max_norm: number (clip_sum), norm_of: [body node id] (clip_sum)}}",
    },
)
JACOBIAN = Transform(
    "jacobian",
    ("output", "input"),
    2,
    "The Jacobian of `output` with respect to `input`: shape output.shape + input.shape, "
    "as torch.func.jacrev/jacfwd; attrs.mode picks reverse or forward mode (auto: forward "
    "when input has fewer elements than output). Differentiable.",
    attrs={"mode": Attr("str", "auto", doc="rev, fwd or auto", choices=("rev", "fwd", "auto"))},
)
HESSIAN = Transform(
    "hessian",
    ("output", "input"),
    2,
    "The Hessian of a one-element `output` with respect to `input`: shape input.shape + "
    "input.shape, forward over reverse as torch.func.hessian. Differentiable.",
)
TRANSFORMS: dict[str, Transform] = {
    t.name: t for t in (GRAD, JVP, SCAN_NODE, VMAP_NODE, JACOBIAN, HESSIAN)
}


@cache  # the registry is fixed once its modules are imported
def catalog_ops() -> list[dict[str, Any]]:
    """The standard op catalog, as `GET /ops` lists it: every op, then the transforms."""
    return [*(op.describe() for op in OPS.values()), *(t.describe() for t in TRANSFORMS.values())]
