"""gradserve's autodiff engine: PyTorch-style tensors and reverse mode on array backends.

    >>> import gradserve.engine as ge
    >>> x = ge.tensor(2.0, requires_grad=True)
    >>> y = ge.tensor(3.0, requires_grad=True)
    >>> z = (x + y) * (x - y)
    >>> z.backward()
    >>> x.grad.item(), y.grad.item()
    (4.0, -6.0)

Every op of the catalog is a function here (`ge.sum(x, dim=1)`), with PyTorch's
argument names. No web framework is imported.

Importing the package runs nothing: the eager API (Tensor, its ops, autograd) is loaded on
the first use of one of its names (PEP 562), so that the engine's rules (engine.rules and
the modules it gathers) import without it, as the client's tracer needs. Type checkers
read the same names from the imports under TYPE_CHECKING.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if __name__ != "gradserve.engine":  # the folder imported by its own name, from a checkout
    raise ImportError(
        f"this is gradserve.engine: import it by that name, not {__name__!r} "
        "(two names would load every module twice)"
    )

if TYPE_CHECKING:
    from gradserve.engine._tensor import Tensor, backward, from_numpy, grad, tensor
    from gradserve.engine.backends import available_devices, parse_device
    from gradserve.engine.dtypes import bool_, float16, float32, float64, int32, int64
    from gradserve.engine.errors import GradserveError
    from gradserve.engine.functions import *  # noqa: F403
    from gradserve.engine.grad_mode import (
        enable_grad,
        is_grad_enabled,
        no_grad,
        set_grad_enabled,
    )
    from gradserve.engine.gradcheck import gradcheck
    from gradserve.engine.ops import OPS

__all__ = [  # and every op's function: engine.functions.__all__
    "OPS",
    "GradserveError",
    "Tensor",
    "available_devices",
    "backward",
    "bool_",
    "enable_grad",
    "float16",
    "float32",
    "float64",
    "from_numpy",
    "grad",
    "gradcheck",
    "int32",
    "int64",
    "is_grad_enabled",
    "no_grad",
    "parse_device",
    "set_grad_enabled",
    "tensor",
]
# Where the names of __all__ live (the imports above, for type checkers).
_HOMES = tuple(
    f"{__name__}.{m}"
    for m in ("_tensor", "backends", "dtypes", "errors", "grad_mode", "gradcheck", "ops")
)

if not TYPE_CHECKING:  # hidden from type checkers, for which `engine.summ` stays an error

    def __getattr__(name: str) -> Any:
        functions = importlib.import_module(f"{__name__}.functions")
        if name in functions.__all__:
            value = getattr(functions, name)
        elif name in __all__:
            homes = map(importlib.import_module, _HOMES)
            value = next(getattr(m, name) for m in homes if hasattr(m, name))
        else:
            raise AttributeError(
                f"module {__name__!r} has no attribute {name!r} (and no op of that name)"
            )
        globals()[name] = value  # found once; the next lookup is a plain attribute
        return value

    def __dir__() -> list[str]:
        functions = importlib.import_module(f"{__name__}.functions")
        return sorted({*globals(), *__all__, *functions.__all__})
