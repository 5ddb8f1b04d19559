"""The op catalog. Importing this package registers every op and builds its functions."""

from engine.ops import (  # noqa: F401 - each module registers its ops
    arithmetic,
    comparison,
    constants,
    elementwise,
    indexing,
    linalg,
    reduction,
    shape,
)
from engine.ops.functional import FUNCTIONS, install
from engine.ops.registry import OPS, Attr, Meta, OpDef

install()

__all__ = ["FUNCTIONS", "OPS", "Attr", "Meta", "OpDef"]
