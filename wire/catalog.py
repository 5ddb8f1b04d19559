"""An op of the catalog as `GET /ops` lists it: what a client traces with, and what the
service's document describes (one definition for both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttrInfo:
    """An attribute: its type (as "int", "int|null", "list[int]"), its default (null when
    it is required), and whether it must be given."""

    type: str
    default: Any
    required: bool


@dataclass(frozen=True)
class OpInfo:
    """One op: its tensor arguments (`variadic`: any number of them, as a list), its
    attributes in their positional order, whether it is differentiable, and a line of doc.
    Node kinds (`grad`, `jvp`, `scan`, group "transforms") also give `min_args`, the
    arguments that must be given (the rest are optional), and `fields`, the node's keys
    beyond id, op, args and attrs."""

    name: str
    group: str
    args: tuple[str, ...]
    variadic: bool
    attrs: dict[str, AttrInfo]
    differentiable: bool
    doc: str
    min_args: int | None = None
    fields: dict[str, str] | None = None

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> OpInfo:
        """An op as `GET /ops` writes it (what a newer server adds is ignored)."""
        attrs = {
            k: AttrInfo(str(a.get("type", "")), a.get("default"), bool(a.get("required", False)))
            for k, a in (item.get("attrs") or {}).items()
        }
        return cls(
            str(item["name"]),
            str(item.get("group", "")),
            tuple(item.get("args", ())),
            bool(item.get("variadic", False)),
            attrs,
            bool(item.get("differentiable", True)),
            str(item.get("doc", "")),
            item.get("min_args"),
            item.get("fields"),
        )

    # How PyTorch calls it (the tracer's calling convention, read from the catalog):
    @property
    def lead_attr(self) -> str | None:
        """A variadic op's required string attribute, written first (einsum's equation)."""
        if not self.variadic:
            return None
        return next(
            (k for k, a in self.attrs.items() if a.required and a.type.split("|")[0] == "str"), None
        )

    @property
    def order(self) -> tuple[str, ...]:
        """The positional order of a non-variadic op: its tensors, then its attributes in
        the catalog's order; a required `dim` of an op of several tensors goes second, as
        PyTorch writes `gather(input, dim, index)`."""
        attrs = tuple(self.attrs)
        dim = self.attrs.get("dim")
        if len(self.args) > 1 and dim is not None and dim.required:
            rest = tuple(a for a in attrs if a != "dim")
            return (self.args[0], "dim", *self.args[1:], *rest)
        return (*self.args, *attrs)

    @property
    def self_arg(self) -> str:
        """The argument a method's `self` is: `input` where there is one (`x.where(c, y)` is
        where(c, x, y)), else the first."""
        return "input" if "input" in self.args else self.args[0]
