"""gradserve: gradients as a service, PyTorch-style.

    >>> from gradserve import Client, AsyncClient, trace, F   # talk to a gradserve
    >>> import gradserve.engine as ge                         # the autodiff engine in Python

Three parts and what they share: `gradserve.client` (the HTTP client, the tracer and its op
catalog), `gradserve.service` (the HTTP service, `gradserve serve`; its dependencies come
with the `server` extra), `gradserve.engine` (the autodiff engine behind it), and
`gradserve.wire` (the wire format the client and the service both speak). The names here
are loaded when first used: `import gradserve.engine` does not load the client, and the
client loads neither the service nor the eager engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradserve.client.http import AsyncClient, Client, GradserveHTTPError, Result, Retry
    from gradserve.client.tensors import Parameter, TensorRef
    from gradserve.client.trace import (
        F,
        TracedTensor,
        TraceError,
        grad,
        hessian,
        jacfwd,
        jacobian,
        jacrev,
        jvp,
        scan,
        trace,
        vmap,
    )

# name -> the module that defines it
_EXPORTS = {
    "Client": "gradserve.client.http",
    "AsyncClient": "gradserve.client.http",
    "GradserveHTTPError": "gradserve.client.http",
    "Result": "gradserve.client.http",
    "Retry": "gradserve.client.http",
    "TensorRef": "gradserve.client.tensors",
    "Parameter": "gradserve.client.tensors",
    "trace": "gradserve.client.trace",
    "F": "gradserve.client.trace",
    "TracedTensor": "gradserve.client.trace",
    "TraceError": "gradserve.client.trace",
    "grad": "gradserve.client.trace",
    "jvp": "gradserve.client.trace",
    "scan": "gradserve.client.trace",
    "vmap": "gradserve.client.trace",
    "jacobian": "gradserve.client.trace",
    "jacrev": "gradserve.client.trace",
    "jacfwd": "gradserve.client.trace",
    "hessian": "gradserve.client.trace",
}

__all__ = [
    "AsyncClient",
    "Client",
    "F",
    "GradserveHTTPError",
    "Parameter",
    "Result",
    "Retry",
    "TensorRef",
    "TraceError",
    "TracedTensor",
    "grad",
    "hessian",
    "jacfwd",
    "jacobian",
    "jacrev",
    "jvp",
    "scan",
    "trace",
    "vmap",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gradserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
