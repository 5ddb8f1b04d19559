"""Memory between a server's processes, and memory given back.

- Bodies and responses of a MiB or more cross between the front process and its workers
  in POSIX shared memory segments (files in /dev/shm on Linux), not through a worker's
  pipe. The front process names every segment (`gs<its pid>-<n>`) and removes it in the
  end, so that none is left behind when a worker is killed.
- A server's own directories (its ledger's, its program store when it has none named) are
  made in shared memory too (`state_dir`), named with the front process's pid, and held:
  the front process keeps a shared lock on an `owner` file in each, which the kernel
  releases when it dies. A server killed before it could clean up leaves its segments and
  directories behind; the next server to start sweeps them (`sweep_orphans`).
- `keep_freed_memory` makes the allocator keep what a computation frees for the next one,
  and `trim_memory` gives it back to the system (when a process idles, or after a
  computation that took more than the allocator keeps).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import itertools
import logging
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable

import numpy as np

log = logging.getLogger("gradserve")

SHM_MIN_BYTES = 1 << 20  # smaller payloads go through the worker's pipe
SHM_DIR = "/dev/shm"  # where POSIX shared memory segments are files (Linux)
OWNER = "owner"  # the file of a server's directory whose lock says the server is alive
_SEGMENT = re.compile(r"^gs(\d+)-\d+[os]?$")  # a segment's name: the front process's pid
# Body segments the front process keeps for the next bodies (`Spares`): at most this many,
# and this share of /dev/shm (Docker's is 64 MiB by default), up to SPARE_MAX_BYTES.
SPARES = 4
SPARE_SHARE = 8
SPARE_MAX_BYTES = 64 << 20
_DIRECTORY = re.compile(r"^gradserve-(?:[a-z]+-)?(\d+)-")  # a server's own directory


Payload = bytes | tuple[str, int]  # the bytes, or a shared memory segment's name and size


class Segment:
    """A shared memory segment: a file in /dev/shm, mapped into this process. (Not
    multiprocessing's SharedMemory, whose every open and close on Python < 3.13 is a
    message to a resource-tracker process, and which would unlink segments still in use
    when a process exits: here the front process owns every segment's end.)"""

    def __init__(self, name: str, size: int | None = None) -> None:
        """Segment `name`: a new one of `size` bytes (created sparse), or the one that
        exists (size None)."""
        create = size is not None
        fd = os.open(
            os.path.join(SHM_DIR, name),
            os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0),
            0o600,
        )
        try:
            if size is None:
                size = os.fstat(fd).st_size
            else:
                os.ftruncate(fd, max(size, 1))
            self._map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.buf = memoryview(self._map)

    def close(self) -> None:
        """Unmap it (BufferError while a view of it lives: it goes with the last one)."""
        self.buf.release()
        self._map.close()


def pack(data: bytes | list[bytes | memoryview], name: str, into: Segment | None = None) -> Payload:
    """`data` (bytes, or parts written one after another) for another process: in a
    shared memory segment `name` when it is large (whoever made `name` is not who unlinks
    it: see `unlink`), or in segment `into` if it fits there and no part lies in it."""
    parts: list[bytes | memoryview] = [data] if isinstance(data, bytes) else data
    size = sum(len(memoryview(p).cast("B")) for p in parts)
    segment: Segment | None = None
    if into is not None and size >= SHM_MIN_BYTES and _fits(parts, size, into):
        segment, name = into, into.name
    elif size >= SHM_MIN_BYTES:
        segment = create_segment(name, size)
    if segment is None:  # the pipe still works
        return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
    try:
        buf = segment.buf
        at = 0
        for part in parts:  # each straight into the segment: no joined copy
            raw = memoryview(part).cast("B")
            buf[at : at + len(raw)] = raw
            at += len(raw)
        del buf, raw
    finally:
        if segment is not into:
            segment.close()
    return (name, size)


def _fits(parts: list[bytes | memoryview], size: int, segment: Segment) -> bool:
    """Whether `size` bytes fit in `segment` and no part views it (an output that is an
    input would be overwritten as it is copied)."""
    if size > segment.size:
        return False
    base = np.frombuffer(segment.buf, dtype=np.uint8)
    try:
        start = base.ctypes.data
        end = start + base.nbytes
        for part in parts:
            at = np.frombuffer(part, dtype=np.uint8)
            if start < at.ctypes.data + at.nbytes and at.ctypes.data < end:
                return False
        return True
    finally:
        del base


def create_segment(name: str, size: int) -> Segment | None:
    """A new shared memory segment of `size` bytes, or None if /dev/shm has no room for it
    (the caller then passes bytes through the pool's pipe)."""
    if not _shm_has_room(size):
        return None
    try:
        return Segment(name, size)
    except OSError:
        return None


class Spares:
    """Body segments the front process is done with, kept (renamed `gs<pid>-<k>s`) for the
    next bodies. A new segment's pages are allocated and zeroed as they are first written:
    ~1 ms a MB on a 2-core VM, most of what a 1 MB binary body costs the front process; a
    kept one's are there already (~0.2 ms a MB). One is kept only once its worker has
    answered elsewhere (not into it: an answer sent from its segment may be held by the
    server's write buffer after the reply), and taken for a body it fits within twice.
    Used on the front process's event loop only."""

    def __init__(self) -> None:
        self._kept: list[tuple[int, str]] = []  # (size, name)
        self._names = itertools.count()
        try:
            stat = os.statvfs(SHM_DIR)
            room = stat.f_blocks * stat.f_frsize // SPARE_SHARE
        except OSError:
            room = 0
        self.max_bytes = min(SPARE_MAX_BYTES, room)

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self._kept)

    def take(self, name: str, size: int) -> Segment | None:
        """A kept segment renamed `name`, of `size` bytes, or None (none fits)."""
        fitting = [k for k in self._kept if size <= k[0] <= 2 * size]
        if not fitting:
            return None
        kept = min(fitting)
        self._kept.remove(kept)
        path = os.path.join(SHM_DIR, name)
        try:
            os.rename(os.path.join(SHM_DIR, kept[1]), path)
            if kept[0] != size:
                os.truncate(path, size)
            return Segment(name)
        except OSError:
            unlink(name)
            return None

    def give(self, name: str) -> None:
        """Segment `name`, done with: kept where there is room, else removed."""
        path = os.path.join(SHM_DIR, name)
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        if size < SHM_MIN_BYTES or len(self._kept) >= SPARES or self.bytes + size > self.max_bytes:
            unlink(name)
            return
        spare = f"gs{os.getpid()}-{next(self._names)}s"
        try:
            os.rename(path, os.path.join(SHM_DIR, spare))
        except OSError:
            unlink(name)
            return
        self._kept.append((size, spare))

    def clear(self) -> None:
        for _, name in self._kept:
            unlink(name)
        self._kept.clear()


def _shm_has_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` (twice over, for another segment at the same
    time): a segment is created sparse, and writing past the room there kills the
    process with SIGBUS (Docker gives 64 MiB by default: see --shm-size)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


def unpack(payload: Payload, consume: bool = False) -> bytes:
    """The bytes of a payload; `consume`: remove its segment once read (its memory goes
    back at once; the front process's own `unlink` then finds nothing)."""
    if isinstance(payload, bytes):
        return payload
    name, size = payload
    segment = Segment(name)
    try:
        return bytes(segment.buf[:size])
    finally:
        segment.close()
        if consume:
            unlink(name)


def open_payload(payload: Payload) -> tuple[bytes | memoryview, Callable[[], None]]:
    """The bytes of a payload without copying them out of their segment: a read-only view
    on it (the segment is unlinked at once; its memory goes back when the last view does,
    which may be a server's write buffer), and a function that drops this process's own
    hold on it."""
    if isinstance(payload, bytes):
        return payload, lambda: None
    name, size = payload
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        unlink(name)
    view = memoryview(mapping)

    def release() -> None:
        with contextlib.suppress(BufferError):  # (a slice still being sent holds it)
            view.release()

    return view, release


def unlink(name: str) -> None:
    """Remove segment `name` if it exists (the front process owns every segment's end, so
    that none is left behind when a worker is killed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def state_dir() -> str | None:
    """Where a server keeps its own state (the ledger's file, its program store): shared
    memory when the host has it (it is RAM, and writable in containers whose root is
    read-only); else the temporary directory."""
    return SHM_DIR if os.access(SHM_DIR, os.W_OK) else None


def own_directory(kind: str) -> tuple[str, int]:
    """A new directory of this server's own (`gradserve-<kind>-<pid>-...`, or
    `gradserve-<pid>-...` for kind ""), and the descriptor that holds it: a shared lock
    on its owner file, released by the kernel when this process dies. Keep the
    descriptor open for the directory's life; close it, then remove the directory."""
    prefix = "-".join(filter(None, ("gradserve", kind, str(os.getpid())))) + "-"
    path = tempfile.mkdtemp(prefix=prefix, dir=state_dir())
    fd = os.open(os.path.join(path, OWNER), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return path, fd


def sweep_orphans() -> int:
    """Remove what servers that died left in shared memory (and in the temporary
    directory, where shared memory is not writable): their own directories, whose owner
    file no process holds any more, and the segments named with a pid that no live
    server's directory has. How many were removed. A directory without an owner file (of
    another program, or of an older gradserve) is left alone, and a segment of a pid
    that a live directory has too."""
    removed = 0
    live: set[str] = set()
    for base in dict.fromkeys(filter(None, (state_dir(), tempfile.gettempdir()))):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            found = _DIRECTORY.match(name)
            if found is None:
                continue
            owned = _owner_alive(os.path.join(base, name, OWNER))
            if owned is None:
                continue  # not ours to judge
            if owned:
                live.add(found[1])
            else:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
                removed += 1
    try:
        segments = os.listdir(SHM_DIR)
    except OSError:
        segments = []
    for name in segments:
        found = _SEGMENT.match(name)
        if found is not None and found[1] not in live and found[1] != str(os.getpid()):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
    if removed:
        log.info("removed %d directories and shared memory segments of servers that died", removed)
    return removed


def _owner_alive(path: str) -> bool | None:
    """Whether some process holds the owner file at `path` (None: there is none)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # (which also lets go of the lock, when it was had)
    return False


# What a process's allocator keeps of the memory it frees (see keep_freed_memory).
KEPT_FREE_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt(3) parameters


def keep_freed_memory() -> None:
    """Make the allocator keep up to KEPT_FREE_BYTES of freed memory for the next
    allocations. By default glibc gives a large array's pages back to the system when it
    is freed (each array above its mmap threshold is a mapping of its own, and the heap's
    top is trimmed past its trim threshold), so that every request faults every page of
    its arrays in again, at ~4 µs a page on a virtual machine: k-means of 10,000 points
    took 20.8 ms a run, 12.0 ms without the faults (3,180 a run). Arrays up to 32 MiB come
    from the heap, which keeps up to KEPT_FREE_BYTES at its top; `trim_memory` gives it all
    back (a process calls it when it idles)."""
    if _mallopt is not None:
        _mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        _mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)


def trim_memory() -> None:
    """Give the allocator's free memory back to the system (glibc keeps freed arenas)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


_libc_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_libc_name) if _libc_name else None
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallopt = getattr(_libc, "mallopt", None)
