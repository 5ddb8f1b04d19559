"""The op catalog. Importing this package registers every op and builds its functions."""

import importlib

from engine.ops.functional import FUNCTIONS, install
from engine.ops.registry import OPS, Attr, Meta, OpDef

# One module per group of the catalog; importing one registers its ops (the op tests keep
# their samples in modules of the same names).
GROUP_MODULES = ("arithmetic", "comparison", "constants", "elementwise", "indexing", "linalg",
                 "reduction", "shape")
for _group in GROUP_MODULES:
    importlib.import_module(f"engine.ops.{_group}")

install()

__all__ = ["FUNCTIONS", "GROUP_MODULES", "OPS", "Attr", "Meta", "OpDef"]
