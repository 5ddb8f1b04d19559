"""The in-flight memory, one budget for every process of a server: a `Ledger` of the bytes
each compute slot holds (and the bodies still arriving), in a small shared file, changed
under an `flock` (the kernel releases it should a worker die holding it)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator

from gradserve.service.admission import RETRY_AFTER_S
from gradserve.service.errors import ProblemError


class Ledger:
    """The bytes held in flight, shared by the front process and its workers: one int64
    per compute slot, and one (`BODIES`, after them) for the bodies still arriving, in a
    file mapped by all, read and changed under an exclusive `flock` of that file. Each
    process opens the file itself: flock excludes across open files, and is released by
    the kernel when its holder dies."""

    def __init__(self, path: str, slots: int, limit: int) -> None:
        self.path, self.slots, self.limit = path, slots, limit
        self.bodies = slots  # the line of the bodies being received
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 8 * (slots + 1))
        self._values = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, directory: str, slots: int, limit: int) -> Ledger:
        path = os.path.join(directory, "ledger")
        with open(path, "wb") as f:
            f.write(bytes(8 * (slots + 1)))
        return cls(path, slots, limit)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reserve(self, slot: int, nbytes: int) -> bool:
        """Set `slot`'s bytes to `nbytes` if all slots together stay within the limit."""
        with self._locked():
            values = self._values
            if sum(values) - values[slot] + nbytes > self.limit:
                return False
            values[slot] = nbytes
            return True

    def grow(self, line: int, nbytes: int) -> bool:
        """Add `nbytes` to `line` if all lines together stay within the limit."""
        with self._locked():
            values = self._values
            if sum(values) + nbytes > self.limit:
                return False
            values[line] += nbytes
            return True

    def shrink(self, line: int, nbytes: int) -> None:
        with self._locked():
            self._values[line] -= nbytes

    def held(self, slot: int) -> int:
        return self._values[slot]

    def release(self, slot: int) -> None:
        with self._locked():
            self._values[slot] = 0

    def total(self) -> int:
        return sum(self._values)

    def busy(self, compute_slots: int) -> list[int]:
        """The compute slots (the first `compute_slots` lines) that hold bytes now."""
        return [i for i, held in enumerate(self._values[:compute_slots]) if held]

    def close(self) -> None:
        if self._fd < 0:
            return
        self._values.release()
        self._map.close()
        os.close(self._fd)
        self._fd = -1


def overloaded(nbytes: int, ledger: Ledger) -> ProblemError:
    """503: the in-flight memory has no room for `nbytes` more now."""
    return ProblemError(
        "overloaded",
        f"the server's in-flight memory is full: this request needs {nbytes} bytes and "
        f"{ledger.total()} of {ledger.limit} are taken; retry shortly",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        planned_bytes=nbytes,
    )
