"""gradserve's autodiff engine: PyTorch-style tensors and reverse mode on array backends.

    >>> import engine
    >>> x = engine.tensor(2.0, requires_grad=True)
    >>> y = engine.tensor(3.0, requires_grad=True)
    >>> z = (x + y) * (x - y)
    >>> z.backward()
    >>> x.grad.item(), y.grad.item()
    (4.0, -6.0)

Every op of the catalog is a function here (`engine.sum(x, dim=1)`), with PyTorch's
argument names. No web framework is imported.
"""

from typing import Any

from engine.autograd import backward, grad
from engine.backends import available_devices, parse_device
from engine.dtypes import bool_, float16, float32, float64, int32, int64
from engine.errors import GradserveError
from engine.grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from engine.gradcheck import gradcheck
from engine.ops import FUNCTIONS, OPS
from engine.tensor import Tensor, from_numpy, tensor

globals().update(FUNCTIONS)


def __getattr__(name: str) -> Any:  # for type checkers and a clear error on a typo
    raise AttributeError(f"module 'engine' has no attribute {name!r} (and no op of that name)")


__all__ = [
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
    *FUNCTIONS,
]
