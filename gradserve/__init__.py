"""gradserve: gradients as a service, PyTorch-style.

    >>> from gradserve import Client, AsyncClient, trace, F   # talk to a gradserve
    >>> import gradserve.engine as ge                         # the autodiff engine in Python

`gradserve.service` is the HTTP service (`gradserve serve`; its dependencies come with the
`server` extra) and `gradserve.engine` the engine behind it. The names here are loaded when
first used: `import gradserve.engine` does not load the client, and the client loads neither
the service nor the eager engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradserve.service.client import AsyncClient, Client, GradserveHTTPError, Result, Retry
    from gradserve.service.trace import F, TracedTensor, TraceError, grad, jvp, scan, trace

# name -> the module that defines it
_EXPORTS = {
    "Client": "gradserve.service.client",
    "AsyncClient": "gradserve.service.client",
    "GradserveHTTPError": "gradserve.service.client",
    "Result": "gradserve.service.client",
    "Retry": "gradserve.service.client",
    "trace": "gradserve.service.trace",
    "F": "gradserve.service.trace",
    "TracedTensor": "gradserve.service.trace",
    "TraceError": "gradserve.service.trace",
    "grad": "gradserve.service.trace",
    "jvp": "gradserve.service.trace",
    "scan": "gradserve.service.trace",
}

__all__ = ["AsyncClient", "Client", "F", "GradserveHTTPError", "Result", "Retry", "TraceError",
           "TracedTensor", "grad", "jvp", "scan", "trace"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gradserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
