"""The cyclic garbage collector paused around work that makes many objects that live.

Compiling a graph makes about ten objects a node that all live to its end (steps, slots,
their facts); parsing a request body makes a list or dict for every JSON array and object.
While they are made, the collector runs again and again over young objects that all
survive, and on a large heap its full passes cost more than the work itself (a 30,000-node
chain: compile 26 -> 12 us a node; its 1.4 MB body parsed in 15 ms instead of 40). What the
work leaves is collected afterwards, once. Pauses in several threads share one: the
collector runs again when the last ends (if it ran before the first began).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
_resume = False


@contextmanager
def paused() -> Iterator[None]:
    global _pauses, _resume
    with _lock:
        if not _pauses:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if not _pauses and _resume:
                gc.enable()
