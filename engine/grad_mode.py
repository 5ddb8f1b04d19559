"""Grad mode, per thread *and* per asyncio task.

It lives in a ContextVar, not a threading.local: the server's thread pool
reuses threads, and a thread-local flag set by one request leaks into the
next request that lands on that thread. anyio runs each job in a copy of the
caller's context, so a ContextVar set inside a job does not leak.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, TypeVar

_grad_enabled: ContextVar[bool] = ContextVar("gradserve_grad_enabled", default=True)

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    return _grad_enabled.get()


class _GradMode:
    """Context manager and decorator that sets grad mode for a block, then restores it."""

    def __init__(self, mode: bool) -> None:
        self.mode = bool(mode)
        self._tokens: list[Token[bool]] = []

    def __enter__(self) -> None:
        self._tokens.append(_grad_enabled.set(self.mode))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _grad_enabled.reset(self._tokens.pop())

    def __call__(self, fn: F) -> F:
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _GradMode(mode):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class no_grad(_GradMode):
    """Nothing computed inside records a graph: results have no grad_fn."""

    def __init__(self) -> None:
        super().__init__(False)


class enable_grad(_GradMode):
    """Re-enable recording inside a no_grad block."""

    def __init__(self) -> None:
        super().__init__(True)


class set_grad_enabled(_GradMode):
    """As in PyTorch, the mode is set on construction, so a bare call switches it for the
    current context; used with `with`, the previous mode comes back on exit."""

    def __init__(self, mode: bool) -> None:
        super().__init__(mode)
        self._tokens.append(_grad_enabled.set(self.mode))

    def __enter__(self) -> None:
        pass
