"""Array backends, keyed by canonical device strings ("cpu", "cuda:0").

Ops receive a backend's array namespace `xp` and never import numpy or cupy
themselves. CuPy is imported on the first CUDA request only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar, Token
from functools import cache
from types import TracebackType

from gradserve.engine.backends.base import Backend
from gradserve.engine.errors import DeviceUnavailableError

__all__ = [
    "Backend",
    "available_devices",
    "default_backend",
    "get_backend",
    "parse_device",
    "set_cpu_namespace",
    "use_device",
]

_DEVICE_RE = re.compile(r"^(cpu|cuda|auto)(?::(\d+))?$")

# The CPU backend's namespace can be swapped for array-api-strict in tests: that is how the
# op suite proves it uses only portable calls, without a GPU.
_cpu_factory: list[Callable[[], Backend]] = []


def set_cpu_namespace(factory: Callable[[], Backend] | None) -> None:
    """Replace the CPU backend (tests only); None restores NumPy."""
    _cpu_factory.clear()
    if factory is not None:
        _cpu_factory.append(factory)
    _cpu_backend.cache_clear()


@cache
def _cpu_backend() -> Backend:
    if _cpu_factory:
        return _cpu_factory[0]()
    from gradserve.engine.backends.numpy_backend import make_numpy_backend

    return make_numpy_backend()


@cache
def _cuda_count() -> int:
    try:
        from gradserve.engine.backends.cupy_backend import device_count
    except ImportError:
        return 0
    return device_count()


@cache
def _cuda_backend(index: int) -> Backend:
    from gradserve.engine.backends.cupy_backend import make_cupy_backend

    return make_cupy_backend(index)


def available_devices() -> list[str]:
    return ["cpu"] + [f"cuda:{i}" for i in range(_cuda_count())]


def parse_device(spec: str | None, default: str = "cpu") -> str:
    """Canonical device name for `cpu`, `cuda`, `cuda:N` or `auto`; raises if unusable here."""
    spec = default if spec is None else spec
    match = _DEVICE_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
    if match is None:
        raise DeviceUnavailableError(
            f"unknown device {spec!r}; expected 'cpu', 'cuda', 'cuda:N' or 'auto'",
            loc=("device",),
        )
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise DeviceUnavailableError(f"unknown device {spec!r}", loc=("device",))
        return "cpu"
    if kind == "auto":
        return "cuda:0" if _cuda_count() > 0 else "cpu"
    name = f"cuda:{index or 0}"
    if int(index or 0) >= _cuda_count():
        raise DeviceUnavailableError(
            f"device {name!r} is not available on this host; available: "
            + ", ".join(available_devices()),
            loc=("device",),
        )
    return name


def get_backend(device: str = "cpu") -> Backend:
    name = "cpu" if device == "cpu" else parse_device(device)
    if name == "cpu":
        return _cpu_backend()
    return _cuda_backend(int(name.split(":")[1]))


# Where tensors are made when an op has no tensor argument (constants, literal-only
# expressions): a graph run sets it to the request's device.
_default_device: ContextVar[str] = ContextVar("gradserve_default_device", default="cpu")


def default_backend() -> Backend:
    return get_backend(_default_device.get())


class use_device:
    """Run a block on `device`: constants are made there, and it is the current device."""

    def __init__(self, device: str) -> None:
        self.name = "cpu" if device == "cpu" else parse_device(device)
        self._active = get_backend(self.name).activate()
        self._token: Token[str] | None = None

    def __enter__(self) -> None:
        self._token = _default_device.set(self.name)
        self._active.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active.__exit__(exc_type, exc, tb)
        assert self._token is not None
        _default_device.reset(self._token)
