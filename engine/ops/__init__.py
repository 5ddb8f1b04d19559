"""The op catalog. Importing this package registers every op.

It is part of the engine's rules (which everything else reads through engine.rules):
nothing here imports the eager engine (Tensor, autograd), so the client's tracer reads the
same shape rules, promotion and attribute binding the engine runs.
"""

from gradserve.engine.ops import (  # noqa: F401  (importing a group registers its ops)
    arithmetic,
    comparison,
    constants,
    elementwise,
    indexing,
    linalg,
    reduction,
    shape,
)
from gradserve.engine.ops.registry import OPS, Attr, Meta, OpDef

# One module per group of the catalog (the op tests keep their samples in modules of the
# same names).
GROUP_MODULES = (
    "arithmetic",
    "comparison",
    "constants",
    "elementwise",
    "indexing",
    "linalg",
    "reduction",
    "shape",
)

__all__ = ["GROUP_MODULES", "OPS", "Attr", "Meta", "OpDef"]
