"""Accounting of the tensor memory a run holds: live bytes and their peak.

A tracker is switched on for a block (`with MemoryTracker() as mem:`). While it
is on, every array the engine holds (a tensor's value, a value saved for
backward, a gradient in flight) is counted once per array object, from the
first holder to the last.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

_current: ContextVar[MemoryTracker | None] = ContextVar("gradserve_memory", default=None)


def current_tracker() -> MemoryTracker | None:
    return _current.get()


class MemoryTracker:
    __slots__ = ("_holders", "_token", "live", "peak")

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._holders: dict[int, list[int]] = {}  # id(array) -> [holders, nbytes]
        self._token: Token[MemoryTracker | None] | None = None

    def retain(self, array: Any) -> None:
        key = id(array)
        entry = self._holders.get(key)
        if entry is not None:
            entry[0] += 1
            return
        size = array.nbytes
        self._holders[key] = [1, size]
        self.live += size
        if self.live > self.peak:
            self.peak = self.live

    def release(self, array: Any) -> None:
        key = id(array)
        entry = self._holders.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._holders[key]
            self.live -= entry[1]

    def __enter__(self) -> MemoryTracker:
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._token = None
