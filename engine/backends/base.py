"""What the engine needs from an array library, beyond its array-API namespace."""

from __future__ import annotations

import operator
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from gradserve.engine.dtypes import DTYPES

Array = Any  # an array of the backend's namespace


def namespace_with(xp: Any, **extras: Any) -> SimpleNamespace:
    """The array namespace plus the calls the array API standard lacks (einsum,
    scatter_add), so ops see one `xp` whatever the backend."""
    names = {k: v for k, v in vars(xp).items() if not k.startswith("__")}
    # The standard's extensions may be served by a module __getattr__ (array-api-strict).
    names.update({ext: getattr(xp, ext) for ext in ("linalg",) if hasattr(xp, ext)})
    return SimpleNamespace(**{**names, **extras})


@dataclass(eq=False)
class Backend:
    """One device: its namespace `xp` and the transfers to and from the host."""

    device: str
    xp: Any
    to_host: Callable[[Array], np.ndarray]
    from_host: Callable[[np.ndarray], Array]
    synchronize: Callable[[], None] = lambda: None
    # Makes this device current for a block (CuPy launches kernels on the current device).
    activate: Callable[[], AbstractContextManager[Any]] = nullcontext
    # The module whose ufuncs (add, exp, ...) take `out=`, for compiled programs to call
    # directly and to write into dead buffers (NumPy, CuPy); None where there is none.
    ufuncs: Any = None
    # An array's bytes (the array API standard has no `nbytes`; NumPy's and CuPy's arrays do).
    nbytes: Callable[[Array], int] = operator.attrgetter("nbytes")
    _dtypes: dict[str, Any] = field(init=False, repr=False)
    _names: dict[Any, str] = field(init=False, repr=False)
    float_dtypes: frozenset[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # array-api-strict has no float16: a backend offers the dtypes its namespace has.
        self._dtypes = {name: getattr(self.xp, name) for name in DTYPES if hasattr(self.xp, name)}
        # Keyed by what `array.dtype` gives (NumPy's dtype objects, not its scalar types).
        self._names = {self.xp.empty((0,), dtype=v).dtype: k for k, v in self._dtypes.items()}
        self._dtypes = {k: self.xp.empty((0,), dtype=v).dtype for k, v in self._dtypes.items()}
        self.float_dtypes = frozenset(
            self._dtypes[k] for k in ("float16", "float32", "float64") if k in self._dtypes
        )

    def dtype(self, name: str) -> Any:
        return self._dtypes[name]

    def dtype_name(self, array: Array) -> str:
        return self._names[array.dtype]

    def name_of(self, dtype: Any) -> str:
        """The dtype name of one of this backend's dtype objects."""
        return self._names[dtype]
