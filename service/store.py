"""The program store: compiled programs, and what finds them, shared by every process of a
host (and, in a persistent directory, by restarts and by replicas that mount it).

One file per entry in one directory, named by its kind and a content hash:

- `p-<program key>`: a compiled program (engine.graph.serial's format: data only);
- `g-<graph id>`: a graph's canonical JSON, so that any process can compile a graph sent
  by id to another one;
- `a-<raw key>`: the graph id of a graph's bytes as sent, so that a repeat is found by
  hashing those bytes, with no parse;
- `t-<grant key>`: that an API key has sent a graph (ids resolve only for their sender);
- `x-<program key>`: a program's XLA executable (service/lowering.py), `r-<program key>`:
  why it could not be lowered.

Every key is hashed under the version key (`version_key`): gradserve's version, the engine's
source, the op catalog and the array library. Another version never looks at this one's
files, and the header repeats the version and the name, so that a file copied or renamed
is refused too.

An entry is written to a temporary file and renamed into place (`os.replace` is atomic):
concurrent writers of one key leave one whole entry, and a reader sees a whole entry or
none. A file is checked before it is used: magic, header, the name and version, the
payload's length and CRC-32. A damaged entry (garbage, truncated, another version,
half-written by a process that died) is deleted and treated as a miss, never served.

The directory is bounded in bytes, least recently used out: a hit touches the file's mtime
(at most every few seconds per entry), and a process that is about to pass the bound
scans the directory and deletes the oldest entries. Each process knows the total only from
its own last scan plus what it wrote since, so several writers can pass the bound by what
they wrote between scans.

A store that cannot be written (a read-only or full file system, a missing directory) is
not an error: the service runs without it, with one warning, and tries again later.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.metadata
import itertools
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("gradserve.store")

MAGIC = b"GSENTRY1"
_HEADER_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _HEADER_LENGTH.size
KINDS = frozenset("pgatxr")  # program, graph, alias, grant, executable, refusal
TOUCH_EVERY_S = 10.0  # a hit refreshes its entry's mtime at most this often, per process
RETRY_WRITES_AFTER_S = 60.0  # after a failed write, the store is read-only for this long
STALE_TEMP_S = 600.0  # a temporary file this old belonged to a writer that died
EVICT_TO = 0.9  # an eviction frees room down to this fraction of the bound
_TEMP = ".tmp-"


class Store:
    """The entries of one directory (see the module's docstring). Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, version: str) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.version = version
        self.evictions = 0  # entries this process deleted to stay within the bound
        self.damaged = 0  # entries this process found damaged, and deleted
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes at the last scan, plus those written since
        self._touched: OrderedDict[str, float] = OrderedDict()
        self._writable_after = 0.0  # time.monotonic() before which no write is tried
        self._warned: set[str] = set()
        self._names = itertools.count()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._failed("create", exc)

    # ------------------------------------------------------------------ reading
    def get(self, name: str) -> tuple[memoryview, dict[str, Any]] | None:
        """The payload of entry `name` and its metadata, or None (absent or damaged)."""
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None
        entry = self._check(name, data)
        if entry is None:
            self._discard(path)
            return None
        self._touch(name, path)
        return entry

    def meta(self, name: str) -> dict[str, Any] | None:
        """Entry `name`'s metadata from its header alone (its payload is not read, so not
        checked: a damaged one shows up when it is got)."""
        try:
            with open(self.directory / name, "rb") as f:
                prefix = f.read(_PREFIX)
                if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
                    return None
                (length,) = _HEADER_LENGTH.unpack_from(prefix, len(MAGIC))
                header = orjson.loads(f.read(length))
        except (OSError, orjson.JSONDecodeError):
            return None
        if (
            not isinstance(header, dict)
            or header.get("name") != name
            or header.get("version") != self.version
        ):
            return None
        meta = header.get("meta")
        return meta if isinstance(meta, dict) else {}

    def _check(self, name: str, data: bytes) -> tuple[memoryview, dict[str, Any]] | None:
        if len(data) < _PREFIX or data[: len(MAGIC)] != MAGIC:
            return None
        (length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
        start = _PREFIX + length
        try:
            header = orjson.loads(data[_PREFIX:start])
        except orjson.JSONDecodeError:
            return None
        if (
            not isinstance(header, dict)
            or header.get("name") != name
            or header.get("version") != self.version
            or header.get("length") != len(data) - start
        ):
            return None
        payload = memoryview(data)[start:]
        if header.get("crc") != zlib.crc32(payload):
            return None
        meta = header.get("meta")
        return payload, meta if isinstance(meta, dict) else {}

    def _touch(self, name: str, path: Path) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._touched.get(name)
            if last is not None and now - last < TOUCH_EVERY_S:
                return
            self._touched[name] = now
            self._touched.move_to_end(name)
            if len(self._touched) > 4096:
                self._touched.popitem(last=False)
        with contextlib.suppress(OSError):
            os.utime(path)

    # ------------------------------------------------------------------ writing
    def put(
        self,
        name: str,
        payload: bytes | memoryview | Sequence[bytes | memoryview],
        meta: dict[str, Any] | None = None,
    ) -> bool:
        """Write entry `name` (replacing any), unless the store cannot be written now;
        whether it was written. Never raises for a store that fails."""
        if time.monotonic() < self._writable_after:
            return False
        parts = [payload] if isinstance(payload, bytes | memoryview) else list(payload)
        length = sum(memoryview(p).nbytes for p in parts)
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        header = orjson.dumps(
            {
                "name": name,
                "version": self.version,
                "length": length,
                "crc": crc,
                "meta": meta or {},
            }
        )
        size = _PREFIX + len(header) + length
        if size > self.max_bytes:
            return False  # it alone would take the whole store
        self._make_room(size)
        temp = self.directory / f"{_TEMP}{os.getpid()}-{next(self._names)}"
        try:
            with open(temp, "wb") as f:
                f.write(MAGIC + _HEADER_LENGTH.pack(len(header)) + header)
                for p in parts:
                    f.write(p)
            os.replace(temp, self.directory / name)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            if exc.errno == errno.ENOSPC and self._total is not None:
                self._total = None  # the file system is fuller than the bound says: rescan
            self._failed("write", exc)
            return False
        with self._lock:
            if self._total is not None:
                self._total += size
        return True

    def _make_room(self, size: int) -> None:
        with self._lock:
            if self._total is not None and self._total + size <= self.max_bytes:
                return
            entries, stale = self._scan()
            total = sum(s for _, s, _ in entries)
            evicted = 0
            if total + size > self.max_bytes:
                target = EVICT_TO * self.max_bytes - size
                entries.sort(key=lambda e: e[2])  # oldest first
                for path, nbytes, _ in entries:
                    if total <= target:
                        break
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                        total -= nbytes
                        evicted += 1
            for path in stale:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._total = total
            self.evictions += evicted

    def _scan(self) -> tuple[list[tuple[str, int, float]], list[str]]:
        """The entries (path, bytes, mtime) and the temporary files left by dead writers."""
        entries: list[tuple[str, int, float]] = []
        stale: list[str] = []
        now = time.time()
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    try:
                        st = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if item.name.startswith(_TEMP):
                        if now - st.st_mtime > STALE_TEMP_S:
                            stale.append(item.path)
                    elif _is_entry(item.name) and item.is_file(follow_symlinks=False):
                        entries.append((item.path, st.st_size, st.st_mtime))
        except OSError as exc:
            self._failed("scan", exc)
        return entries, stale

    def recent(self, kind: str, limit: int) -> list[str]:
        """The names of the `limit` entries of `kind` written or used last, newest first."""
        entries, _ = self._scan()
        named = [
            (mtime, os.path.basename(path))
            for path, _, mtime in entries
            if os.path.basename(path).startswith(f"{kind}-")
        ]
        named.sort(reverse=True)
        return [name for _, name in named[:limit]]

    def total_bytes(self) -> int:
        """The bytes of the entries (a scan: for metrics and tests, not per request)."""
        with self._lock:
            entries, _ = self._scan()
            self._total = sum(s for _, s, _ in entries)
            return self._total

    def discard(self, name: str) -> None:
        """Delete entry `name`, found damaged by its reader."""
        self._discard(self.directory / name)

    def _discard(self, path: Path) -> None:
        with self._lock:
            self.damaged += 1
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _failed(self, what: str, exc: OSError) -> None:
        """A store that fails is not an error: no write for a while, one warning."""
        self._writable_after = time.monotonic() + RETRY_WRITES_AFTER_S
        kind = f"{what}:{exc.errno}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(
                "program store %s: cannot %s (%s); the service runs without storing "
                "programs there for now (compiled programs stay in each process)",
                self.directory,
                what,
                exc.strerror or exc,
            )


def _is_entry(name: str) -> bool:
    return len(name) > 2 and name[0] in KINDS and name[1] == "-"


def entry_name(kind: str, *parts: bytes | memoryview | str) -> str:
    """An entry's file name: its kind and the BLAKE2b-128 of its parts (under the version
    key, which the caller puts first)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\x00")
    return f"{kind}-{h.hexdigest()}"


@functools.cache
def version_key(array_library: str) -> str:
    """What a stored entry depends on: gradserve's version, its source (the engine's every
    module, the wire format's, and the service's, which parse and validate graphs), the op
    catalog, and the
    array library that runs the programs (with its version)."""
    import gradserve.engine as engine
    import gradserve.wire as wire
    from gradserve.engine.ops import OPS

    h = hashlib.blake2b(digest_size=16)
    h.update(_gradserve_version().encode())
    for package in (
        Path(engine.__file__).parent,
        Path(wire.__file__).parent,
        Path(__file__).parent,
    ):
        for path in sorted(package.rglob("*.py")):
            h.update(path.relative_to(package.parent).as_posix().encode())
            h.update(path.read_bytes())
    h.update(orjson.dumps([op.describe() for op in OPS.values()]))
    h.update(array_library.encode())
    return h.hexdigest()


def _gradserve_version() -> str:
    try:
        return importlib.metadata.version("gradserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
