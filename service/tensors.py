"""Tensors held by id: uploaded (`POST /tensors`) or kept from a result (`keep`), named by
later requests, and shared by every process of the host.

One directory per API key (its tenant id; `anonymous` with keys off) under the store's
root, one immutable file per tensor, named by its content-addressed id
(wire/tensor_id.py): a header (magic, dtype, dims; binary, read with two `struct`
unpacks) padded to 64 bytes, then the raw little-endian bytes. A process reads a tensor
by mapping its file (no copy: the array is a read-only view on the page cache, or on RAM
in /dev/shm), or, for a file of at most 64 KiB, by reading it (a copy of a few KiB costs
less than a mapping and its unmapping: 4 small parameters in 83 us rather than 210). A
file is written under a temporary name and renamed into place, so a
process killed while writing leaves nothing visible under an id (its temporary file is
swept later).

Bounded per key: at most `quota_bytes` of tensor data, least recently used out (a use
touches the file's mtime). A key's books (its bytes and tensors) are kept in its lock
file, read and written under its `flock`, so that two processes making room at once
cannot both pass the quota, and a write costs no listing of the directory: that happens
only when room must be made (the books are then made exact, and a tenth of the quota more
is freed, so that a training loop keeping new parameters every step lists it once per
tenth of the quota it writes).

A request holds a shared `flock` on each tensor it reads from the moment it resolves it
to its end; eviction takes only files it can lock exclusively at once, so a
tensor a running request uses is never evicted (and a reader that finds its file unlinked
between opening and locking it treats it as gone).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradserve.service.errors import ProblemError
from gradserve.wire.binary import array_of, raw_bytes
from gradserve.wire.dtypes import DTYPES, dtype_name
from gradserve.wire.tensor_id import is_tensor_id, tensor_id

log = logging.getLogger("gradserve.tensors")

MAGIC = b"GSTENSR2"
# After the magic: the dtype (its index in DTYPES) and the number of dims, then each dim.
_KIND = struct.Struct("<BB6x")
_DIM = struct.Struct("<q")
_DTYPES = tuple(DTYPES)
# A tensor is read whole: its pages mapped at once (one call) rather than fault by fault.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_BOOKS = struct.Struct("<QQ")  # a key's lock file: its data bytes and tensors held
ALIGN = 64  # a tensor's bytes start at a multiple of this in its file
JOIN_BELOW = 64 << 10  # a smaller tensor is written with its header in one write
READ_BELOW = 64 << 10  # a file this small is read (copied) rather than mapped
PARALLEL_BYTES = 1 << 20  # a request's keeps of this many bytes or more are written at once
SIZES_KNOWN = 1 << 16  # ids whose sizes a process remembers (a listing reads the others')
ANONYMOUS = "anonymous"  # the directory of requests without an API key (keys off)
_LOCK = ".lock"
_TEMP = ".tmp-"
_temp_names = itertools.count()


_Write = tuple[str, "Held", memoryview, bool]  # a file to write: path, entry, data, new


@dataclass
class _Books:
    """A key's totals, kept in its lock file: every writer adds what it wrote, and an
    eviction or a delete takes it off."""

    used: int  # data bytes held
    count: int  # tensors held

    def add(self, nbytes: int, count: int) -> None:
        self.used, self.count = max(self.used + nbytes, 0), max(self.count + count, 0)


@dataclass(frozen=True)
class Held:
    """A tensor the store holds: its id, shape, dtype and data bytes."""

    tensor_id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def ref(self) -> dict[str, Any]:
        """What a response says of a kept value: its id, shape and dtype, no data."""
        return {"tensor_id": self.tensor_id, "shape": list(self.shape), "dtype": self.dtype}

    def listed(self) -> dict[str, Any]:
        """What an upload answers, and `GET /tensors` lists: the ref and its bytes."""
        return {**self.ref(), "bytes": self.nbytes}


@dataclass
class Pins:
    """The tensors one request reads: each file held open under a shared lock until the
    request ends (`release`), so that no eviction takes it meanwhile. The arrays are views
    on their files' mappings (or, for a small file, on a copy of its bytes), which outlive
    the locks (and an unlinked file)."""

    descriptors: list[int] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)

    def release(self) -> None:
        for fd in self.descriptors:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)  # (the mapping's duplicate shares the lock)
            with contextlib.suppress(OSError):
                os.close(fd)
        self.descriptors.clear()


def tensor_unknown(missing: Sequence[tuple[tuple[str | int, ...], str]]) -> ProblemError:
    """409 naming every id this server does not hold for the caller: `missing` is each
    id with where the request names it."""
    ids = list(dict.fromkeys(tensor for _, tensor in missing))
    return ProblemError(
        "tensor-unknown",
        f"this server does not hold tensor{'s' if len(ids) > 1 else ''} "
        f"{', '.join(ids)} (a server holds the tensors uploaded to it or kept by a request, "
        "for the API key that did so, until its quota evicts them, least recently used "
        "first, or it restarts without a persistent tensor store): upload them again "
        "(POST /tensors) and retry",
        errors=[{"loc": list(loc), "msg": f"unknown here: {tensor}"} for loc, tensor in missing],
        tensor_ids=ids,
    )


def quota_problem(need: int, quota: int, what: str, used: int | None = None) -> ProblemError:
    """422: `what` needs `need` bytes, past the key's quota (or past what eviction could
    free, `used` being what stays held by requests in flight)."""
    if used is None:
        why = f"{what} needs {need} bytes, over this server's tensor quota of {quota} bytes"
    else:
        why = (
            f"{what} needs {need} bytes; the tensor quota is {quota} bytes and {used} of "
            "them are held by tensors that requests in flight use"
        )
    return ProblemError(
        "tensor-quota",
        f"{why} per API key (the tensor_quota_bytes setting): keep fewer or smaller values, "
        "or delete tensors you no longer need (DELETE /tensors/{id})",
        quota_bytes=quota,
        needed_bytes=need,
    )


def store_unavailable(exc: OSError) -> ProblemError:
    return ProblemError(
        "tensor-store-unavailable",
        f"the tensor store cannot be written ({os.strerror(exc.errno or 0) or exc}): "
        "requests that send their data still run",
    )


class TensorStore:
    """The tensors of one root directory (see the module's docstring). Safe to use from
    several threads and processes at once."""

    def __init__(self, root: str | os.PathLike[str], quota_bytes: int) -> None:
        self.root = Path(root)
        self._root = os.fspath(root)
        self._made: set[str] = set()  # key directories this process has seen exist
        self.quota_bytes = quota_bytes
        self.evictions = 0  # tensors this process evicted to stay within a quota
        # id -> data bytes, as listing learnt them (ids are content: never stale); bounded,
        # since a training loop writes new ids for as long as it runs
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()  # (flock is per open file: threads need their own)
        self._writers: ThreadPoolExecutor | None = None  # (large keeps, written at once)

    # ------------------------------------------------------------------ reading
    def open(
        self,
        tenant: str | None,
        wanted: Iterable[tuple[tuple[str | int, ...], str]],
        pins: Pins,
    ) -> dict[str, np.ndarray]:
        """The arrays of the ids `wanted` names (each with where the request names it),
        pinned in `pins` until the request ends; 409 tensor-unknown listing every id
        this key cannot read."""
        scope = self._scope(tenant)
        found: dict[str, np.ndarray] = {}
        missing = []
        for loc, tensor in wanted:
            if tensor in found:
                continue
            array = (
                self._open(os.path.join(scope, tensor), tensor, pins)
                if is_tensor_id(tensor)
                else None
            )
            if array is None:
                missing.append((loc, tensor))
            else:
                found[tensor] = array
                pins.ids.add(tensor)
        if missing:
            raise tensor_unknown(missing)
        return found

    def _open(self, path: str, tensor: str, pins: Pins) -> np.ndarray | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            status = os.fstat(fd)
            if status.st_nlink == 0:  # evicted between the open and the lock
                raise FileNotFoundError(path)
            with contextlib.suppress(OSError):
                _touch(fd)  # (most recently used; a read-only store keeps its order)
            mapped: bytes | mmap.mmap
            if status.st_size <= READ_BELOW:  # (a copy costs less than a mapping)
                mapped = os.pread(fd, status.st_size, 0)
            else:
                # The mapping holds a duplicate of `fd`, of the same open file: the lock,
                # which belongs to that, would last as long as the mapping. It ends with the
                # request instead: `release` unlocks before it closes.
                mapped = mmap.mmap(fd, 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
            held, offset = _header(mapped, tensor)
            if len(mapped) < offset + held.nbytes:
                raise ValueError("a truncated tensor file")
        except (OSError, ValueError):
            os.close(fd)
            return None
        pins.descriptors.append(fd)
        return array_of(memoryview(mapped)[offset : offset + held.nbytes], held.dtype, held.shape)

    def describe(self, tenant: str | None, tensor: str) -> Held | None:
        """What the store holds under `tensor` for `tenant` (None: nothing), read from its
        header alone."""
        if not is_tensor_id(tensor):
            return None
        return _described(os.path.join(self._scope(tenant), tensor))

    def held(self, tenant: str | None) -> list[Held]:
        """Every tensor held for `tenant`, most recently used first."""
        entries = sorted(self._entries(self._scope(tenant)), key=lambda e: -e[1])
        out = []
        for tensor, _, _ in entries:
            described = self.describe(tenant, tensor)
            if described is not None:
                out.append(described)
        return out

    def used_bytes(self, tenant: str | None) -> int:
        """The tensor data held for `tenant`."""
        return sum(size for _, _, size in self._entries(self._scope(tenant)))

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per key directory: (tensors, data bytes) held, as its books say (the metrics'
        gauges: no tensor is listed)."""
        out = {}
        with contextlib.suppress(OSError):
            for scope in os.scandir(self.root):
                if scope.is_dir():
                    with contextlib.suppress(OSError):
                        books = self._read_books(scope.path)
                        out[scope.name] = (books.count, books.used)
        return out

    # ------------------------------------------------------------------ writing
    def put(
        self, tenant: str | None, array: np.ndarray, pins: Pins | None = None
    ) -> tuple[Held, bool]:
        """Hold `array` for `tenant`: its entry and whether it is new (the same content
        held already is only touched). Room is made by evicting the key's least recently
        used tensors that no request holds; 422 when it cannot be, and 507 when the store
        cannot be written."""
        return self.put_many(tenant, [array], pins)[0]

    def put_many(
        self, tenant: str | None, arrays: Sequence[np.ndarray], pins: Pins | None = None
    ) -> list[tuple[Held, bool]]:
        """`put` for several arrays, under one lock of the key's books (what a request
        keeps)."""
        prepared = []
        for array in arrays:
            dtype = dtype_name(array)
            data = raw_bytes(array, dtype)
            held = Held(tensor_id(dtype, array.shape, data), tuple(array.shape), dtype, data.nbytes)
            if held.nbytes > self.quota_bytes or not self.quota_bytes:
                raise quota_problem(held.nbytes, self.quota_bytes, "the tensor")
            prepared.append((held, data))
        scope = self._scope(tenant)
        out = []
        # Each value it holds is safe from the room its next ones make (and the request's).
        kept = Pins(ids=set() if pins is None else set(pins.ids))
        done: set[str] = set()  # (the same value twice in one keep is held once)
        try:
            with self._books(scope) as books:
                writes = []
                for held, data in prepared:
                    if held.tensor_id in done:
                        out.append((held, False))
                        continue
                    done.add(held.tensor_id)
                    path = os.path.join(scope, held.tensor_id)
                    new = _needs_writing(path, held)
                    if new is not None:
                        if new:
                            self._make_room(scope, books, held.nbytes, "the tensor", kept)
                        writes.append((path, held, data, new))
                    out.append((held, new is not None))
                    kept.ids.add(held.tensor_id)
                written, failure = self._write_many(writes)
                for _, held, _, new in written:
                    self._learn_size(held.tensor_id, held.nbytes)
                    if new:
                        books.add(held.nbytes, 1)
                if failure is not None:
                    raise failure
        except OSError as exc:
            raise store_unavailable(exc) from None
        return out

    def _write_many(self, writes: list[_Write]) -> tuple[list[_Write], OSError | None]:
        """Write each file: those written, and the first failure. Large ones at once, in
        threads: a write to tmpfs is a copy at memory speed, one core each, the GIL
        released."""
        if len(writes) > 1 and sum(w[2].nbytes for w in writes) >= PARALLEL_BYTES:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(
                    min(4, os.cpu_count() or 1), thread_name_prefix="gradserve-tensors"
                )
            futures = [self._writers.submit(self._write, p, h, d) for p, h, d, _ in writes]
            failed = [f.exception() for f in futures]
        else:
            failed = []
            for path, held, data, _ in writes:
                try:
                    self._write(path, held, data)
                    failed.append(None)
                except OSError as exc:
                    failed.append(exc)
        written = [w for w, exc in zip(writes, failed, strict=True) if exc is None]
        errors: list[OSError] = []
        for error in failed:
            if error is not None and not isinstance(error, OSError):
                raise error  # (a bug, not the store: as it is)
            if error is not None:
                errors.append(error)
        return written, errors[0] if errors else None

    def reserve(self, tenant: str | None, nbytes: int, pins: Pins) -> None:
        """Room for `nbytes` of values a request will keep, made before it runs (422 past
        the quota; a store that cannot be listed is left to the writes to report)."""
        if nbytes > self.quota_bytes:
            raise quota_problem(nbytes, self.quota_bytes, "keep")
        if not nbytes:
            return
        scope = self._scope(tenant)
        try:
            with self._books(scope) as books:
                self._make_room(scope, books, nbytes, "keep", pins)
        except OSError as exc:
            raise store_unavailable(exc) from None

    def delete(self, tenant: str | None, tensor: str) -> bool:
        """Drop `tensor` for `tenant` (a request using it keeps its mapping); False if
        it holds none."""
        if not is_tensor_id(tensor):
            return False
        scope = self._scope(tenant)
        path = os.path.join(scope, tensor)
        held = _described(path)  # (None: damaged, never counted nor served: removed)
        try:
            with self._books(scope) as books:
                os.unlink(path)
                if held is not None:
                    books.add(-held.nbytes, -1)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise store_unavailable(exc) from None
        return True

    def sweep(self) -> None:
        """Temporary files of writers that died (a live writer's name carries its pid)."""
        with contextlib.suppress(OSError):
            for scope in os.scandir(self.root):
                if not scope.is_dir():
                    continue
                for entry in os.scandir(scope.path):
                    if entry.name.startswith(_TEMP) and not _alive(entry.name):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)

    # ------------------------------------------------------------------ inside
    def _scope(self, tenant: str | None) -> str:
        return os.path.join(self._root, tenant or ANONYMOUS)  # (tenant ids are hex: safe as a name)

    @contextlib.contextmanager
    def _books(self, scope: str) -> Iterator[_Books]:
        """A key's books (its data bytes and tensors), under its lock: read from the lock
        file, or counted from its directory where that holds none (a new key), and written
        back, also when the work failed half way. The file is emptied while they are out:
        a writer that dies between its rename and its books leaves none, and the next
        reader counts the directory again."""
        with self._lock:
            lock = os.path.join(scope, _LOCK)
            try:
                if scope not in self._made:
                    raise FileNotFoundError(scope)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # (a new key, or its directory removed meanwhile)
                os.makedirs(scope, exist_ok=True)
                self._made.add(scope)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, _BOOKS.size, 0)
                books = (
                    _Books(*_BOOKS.unpack(raw)) if len(raw) == _BOOKS.size else self._count(scope)
                )
                os.ftruncate(fd, 0)
                try:
                    yield books
                finally:
                    os.pwrite(fd, _BOOKS.pack(books.used, books.count), 0)
            finally:
                os.close(fd)

    def _read_books(self, scope: str) -> _Books:
        """A key's books as they stand, for a reader (the metrics): under a shared lock,
        so never mid-write, and nothing written back (counted, where the file holds
        none)."""
        fd = os.open(os.path.join(scope, _LOCK), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            raw = os.pread(fd, _BOOKS.size, 0)
        finally:
            os.close(fd)
        return _Books(*_BOOKS.unpack(raw)) if len(raw) == _BOOKS.size else self._count(scope)

    def _count(self, scope: str) -> _Books:
        entries = self._entries(scope)
        return _Books(sum(size for _, _, size in entries), len(entries))

    def _entries(self, scope: str) -> list[tuple[str, float, int]]:
        """(id, mtime, data bytes) of each tensor in a key's directory."""
        out: list[tuple[str, float, int]] = []
        try:
            listing = list(os.scandir(scope))
        except OSError:
            return out
        for entry in listing:
            if not is_tensor_id(entry.name):
                continue
            try:
                mtime = entry.stat().st_mtime
            except OSError:
                continue
            size = self._sizes.get(entry.name)
            if size is None:
                described = _described(entry.path)
                if described is None:
                    continue
                size = described.nbytes
                self._learn_size(entry.name, size)
            out.append((entry.name, mtime, size))
        return out

    def _learn_size(self, tensor: str, nbytes: int) -> None:
        if len(self._sizes) >= SIZES_KNOWN:
            self._sizes.clear()  # (relearnt from headers at the next listing)
        self._sizes[tensor] = nbytes

    def _make_room(
        self, scope: str, books: _Books, nbytes: int, what: str, pins: Pins | None
    ) -> None:
        """Evict the key's least recently used tensors until `nbytes` more fit its quota
        (and a tenth of it more, where that many can go: the directory is listed once per
        tenth of the quota written, not on every write), passing over those a request
        holds (its own included). Under the key's lock."""
        if books.used + nbytes <= self.quota_bytes:
            return
        entries = self._entries(scope)  # (the books made exact: a list is needed anyway)
        books.used, books.count = sum(size for _, _, size in entries), len(entries)
        target = self.quota_bytes - nbytes
        own = set() if pins is None else pins.ids
        victims: list[tuple[int, str, int]] = []  # (its descriptor, locked; path; bytes)
        freed = 0
        try:
            for tensor, _, size in sorted(entries, key=lambda e: e[1]):
                if books.used - freed <= target - self.quota_bytes // 10:
                    break
                path = os.path.join(scope, tensor)
                fd = None if tensor in own else _lock_unused(path)
                if fd is not None:
                    victims.append((fd, path, size))
                    freed += size
            if books.used - freed > target:  # (nothing evicted for a refusal)
                raise quota_problem(nbytes, self.quota_bytes, what, books.used - freed)
            for _, path, size in victims:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    self.evictions += 1
                    books.add(-size, -1)
        finally:
            for fd, _, _ in victims:
                os.close(fd)

    def _write(self, path: str, held: Held, data: memoryview) -> None:
        prefix = b"".join(
            [
                MAGIC,
                _KIND.pack(_DTYPES.index(held.dtype), len(held.shape)),
                *(_DIM.pack(n) for n in held.shape),
            ]
        )
        prefix += b"\0" * (-len(prefix) % ALIGN)
        if data.nbytes < JOIN_BELOW:  # (one write)
            prefix, data = prefix + data, memoryview(b"")
        temp = os.path.join(os.path.dirname(path), f"{_TEMP}{os.getpid()}-{next(_temp_names)}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, prefix)
                _write_all(fd, data)
            finally:
                os.close(fd)
            _touch(temp)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise


def _touch(file: str | int) -> None:
    """Its mtime to now, to the nanosecond: the kernel's own "now" moves in ticks of a few
    milliseconds, and uses within one tick would leave least recently used undecided."""
    now = time.time_ns()
    os.utime(file, ns=(now, now))


def _needs_writing(path: str, held: Held) -> bool | None:
    """None: held already, whole (a use: touched); else whether the file is new (False: a
    damaged one under its id, never served, to be written again)."""
    try:
        _touch(path)
    except FileNotFoundError:
        return True
    return None if _described(path) == held else False


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _header(view: bytes | mmap.mmap, tensor: str) -> tuple[Held, int]:
    """A file's entry and where its data starts; ValueError for a file that is not one."""
    start = len(MAGIC) + _KIND.size
    if len(view) < start or view[: len(MAGIC)] != MAGIC:
        raise ValueError("not a tensor file")
    kind, ndim = _KIND.unpack_from(view, len(MAGIC))
    end = start + ndim * _DIM.size
    if kind >= len(_DTYPES) or len(view) < end:
        raise ValueError("not a tensor file")
    shape = struct.unpack_from(f"<{ndim}q", view, start)
    if any(n < 0 for n in shape):  # (a damaged header: no tensor has that shape)
        raise ValueError("not a tensor file")
    dtype = _DTYPES[kind]
    return Held(tensor, shape, dtype, math.prod(shape) * _ITEMSIZE[dtype]), end + (-end % ALIGN)


_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}


def _described(path: str) -> Held | None:
    """A file's entry, from its header, if the file holds all of its bytes (else None:
    a damaged file is never described, as it is never opened)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)  # (a header of 64 dims of 19 digits is ~1.3 KB)
            size = os.fstat(f.fileno()).st_size
        held, offset = _header(head, os.path.basename(path))
    except (OSError, ValueError):
        return None
    return held if size >= offset + held.nbytes else None


def _lock_unused(path: str) -> int | None:
    """A descriptor of a tensor's file holding its exclusive lock, if no request holds it
    (a shared lock), else None: while held, no request can start to use it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning("could not evict tensor %s: %s", os.path.basename(path), exc)
        return None
    return fd


def _alive(temp_name: str) -> bool:
    """Whether the writer a temporary file names (`.tmp-<pid>-<n>`) still runs."""
    try:
        pid = int(temp_name[len(_TEMP) :].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
