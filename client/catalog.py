"""The op catalog a client traces with: a server's (`GET /ops`), or the standard one of this
version's engine (engine.rules), with PyTorch's other spellings of its ops."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from typing import Any

from gradserve.engine.rules import catalog_ops
from gradserve.wire.catalog import AttrInfo, OpInfo

__all__ = ["ALIASES", "TRANSFORMS", "AttrInfo", "Catalog", "OpInfo", "standard_catalog"]

# PyTorch's other spellings of catalog ops (used only where the catalog has the target and
# not the alias itself).
ALIASES = {
    "inverse": "inv",
    "clip": "clamp",
    "concat": "cat",
    "concatenate": "cat",
    "amax": "max",
    "amin": "min",
    "absolute": "abs",
    "negative": "neg",
    "multiply": "mul",
    "divide": "div",
    "true_divide": "div",
    "subtract": "sub",
    "greater": "gt",
    "less": "lt",
    "greater_equal": "ge",
    "less_equal": "le",
    "not_equal": "ne",
    "swapaxes": "transpose",
    "swapdims": "transpose",
}
TRANSFORMS = ("grad", "jvp", "scan", "vmap", "jacobian", "hessian")


class Catalog:
    """The op catalog: from `GET /ops`'s JSON, its list of ops, a mapping of name to op,
    or another Catalog."""

    def __init__(self, source: Any) -> None:
        if isinstance(source, Catalog):
            self.ops: dict[str, OpInfo] = dict(source.ops)
            self.transforms: set[str] = set(source.transforms)
            return
        if (
            isinstance(source, Mapping)
            and "ops" in source
            and not isinstance(source["ops"], Mapping)
        ):
            source = source["ops"]
        items = list(source.values()) if isinstance(source, Mapping) else list(source)
        self.ops = {}
        self.transforms = set()
        for item in items:
            name = item["name"]
            if item.get("group") == "transforms" or (name in TRANSFORMS and "min_args" in item):
                self.transforms.add(name)
                continue
            self.ops[name] = OpInfo.from_json(item)

    def resolve(self, name: str) -> OpInfo | None:
        op = self.ops.get(name)
        if op is None and ALIASES.get(name):
            op = self.ops.get(ALIASES[name])
        return op

    def names(self) -> list[str]:
        aliases = [a for a, t in ALIASES.items() if t and t in self.ops and a not in self.ops]
        return sorted([*self.ops, *self.transforms, *aliases])

    def missing(self, name: str, owner: str) -> AttributeError:
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return AttributeError(
            f"{owner} has no attribute {name!r}: op {name!r} is not in "
            f"this server's op catalog (GET /ops){hint}",
            name=name,
        )


def as_catalog(source: Any) -> Catalog:
    return source if isinstance(source, Catalog) else Catalog(source)


@functools.cache  # the registry is fixed once imported
def standard_catalog() -> Catalog:
    """The catalog of this version's engine (engine.rules), for tracing without a server."""
    return Catalog(catalog_ops())
