"""The program store's directory (service/store.py): entries written whole or not at all,
damage of every kind refused and deleted, one entry from concurrent writers, the byte
bound with least-recently-used eviction, and a store that cannot be written (read-only,
full, missing) costing nothing but a warning."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from gradserve.service import store as store_module
from gradserve.service.store import MAGIC, STALE_TEMP_S, Store, entry_name

VERSION = "v1"


def make(tmp_path: Path, max_bytes: int = 1 << 20, version: str = VERSION) -> Store:
    return Store(tmp_path / "store", max_bytes, version)


def test_an_entry_round_trips_with_its_metadata(tmp_path: Path) -> None:
    s = make(tmp_path)
    name = entry_name("p", "ns", "graph", "specs")
    assert s.get(name) is None
    assert s.put(name, [b"hello ", memoryview(b"world")], {"cost": 12, "peak": 34})
    payload, meta = s.get(name)  # type: ignore[misc]
    assert bytes(payload) == b"hello world"
    assert meta == {"cost": 12, "peak": 34}
    assert s.meta(name) == {"cost": 12, "peak": 34}
    assert s.put(name, b"again")  # (a rewrite replaces it whole)
    assert bytes(s.get(name)[0]) == b"again"  # type: ignore[index]


def test_names_are_hashes_of_their_parts_under_their_kind() -> None:
    a = entry_name("p", "ns", "x")
    assert a.startswith("p-") and len(a) == 2 + 32
    assert a == entry_name("p", "ns", "x")
    assert a != entry_name("p", "ns2", "x") != entry_name("g", "ns", "x")
    assert entry_name("a", "ns", b"xy") != entry_name("a", "nsx", b"y")  # (parts delimited)


def _damaged(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "truncated":
        path.write_bytes(data[:-3])
    elif how == "header":
        path.write_bytes(data[: len(MAGIC)] + b"\xff\xff\xff\x7f" + data[len(MAGIC) + 4 :])
    elif how == "payload":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["garbage", "truncated", "header", "payload", "empty"])
def test_a_damaged_entry_is_a_miss_and_is_deleted(tmp_path: Path, how: str) -> None:
    s = make(tmp_path)
    name = entry_name("p", "k")
    s.put(name, b"x" * 1000)
    _damaged(s.directory / name, how)
    assert s.get(name) is None
    assert not (s.directory / name).exists()
    assert s.damaged == 1
    assert s.put(name, b"y") and bytes(s.get(name)[0]) == b"y"  # type: ignore[index]


def test_another_version_or_a_renamed_file_is_refused(tmp_path: Path) -> None:
    old = make(tmp_path, version="v0")
    name = entry_name("p", "k")
    old.put(name, b"from another version")
    assert make(tmp_path).get(name) is None  # (the names differ too, in practice)
    old.put(name, b"payload")
    other = entry_name("p", "other")
    os.rename(old.directory / name, old.directory / other)
    assert old.get(other) is None


def test_a_half_written_entry_is_never_seen_and_is_swept(tmp_path: Path) -> None:
    s = make(tmp_path, max_bytes=10_000)
    # A writer that died between its write and its rename leaves only a temporary file.
    dead = s.directory / ".tmp-99999-0"
    dead.write_bytes(MAGIC + b"\x00" * 50)
    assert s.get(entry_name("p", "k")) is None
    old = time.time() - STALE_TEMP_S - 1
    os.utime(dead, (old, old))
    fresh = s.directory / ".tmp-99999-1"  # (a writer at work now: left alone)
    fresh.write_bytes(b"...")
    for i in range(20):  # enough writes to scan
        s.put(entry_name("p", str(i)), b"x" * 900)
    assert not dead.exists() and fresh.exists()


def _write_many(directory: str, name: str, tag: int, n: int) -> None:
    s = Store(directory, 1 << 30, VERSION)
    for _ in range(n):
        s.put(name, bytes([tag]) * 200_000)


def test_concurrent_writers_of_one_key_leave_one_whole_entry(tmp_path: Path) -> None:
    s = make(tmp_path, max_bytes=1 << 30)
    name = entry_name("p", "contended")
    ctx = multiprocessing.get_context("spawn")
    writers = [
        ctx.Process(target=_write_many, args=(str(s.directory), name, tag, 40)) for tag in (1, 2, 3)
    ]
    for w in writers:
        w.start()
    seen = 0
    deadline = time.monotonic() + 60
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        found = s.get(name)
        if found is not None:  # never torn: one writer's bytes, whole
            data = bytes(found[0])
            assert len(data) == 200_000 and data == data[:1] * 200_000
            seen += 1
    for w in writers:
        w.join(30)
        assert w.exitcode == 0
    assert s.damaged == 0 and seen > 0
    data = bytes(s.get(name)[0])  # type: ignore[index]
    assert len(data) == 200_000 and data[0] in (1, 2, 3)
    assert [p.name for p in s.directory.iterdir()] == [name]


def test_the_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    s = make(tmp_path, max_bytes=10_000)
    names = [entry_name("p", str(i)) for i in range(8)]
    for i, name in enumerate(names):
        s.put(name, b"x" * 1000)
        t = time.time() - 100 + i
        os.utime(s.directory / name, (t, t))
    # names[0] is used now: it is the most recent, and names[1] the oldest.
    store_module.TOUCH_EVERY_S = 0.0
    try:
        assert s.get(names[0]) is not None
    finally:
        store_module.TOUCH_EVERY_S = 10.0
    for i in range(8, 12):
        s.put(entry_name("p", str(i)), b"x" * 1000)
    assert s.total_bytes() <= 10_000
    assert s.evictions >= 3
    assert s.get(names[0]) is not None
    assert s.get(names[1]) is None and s.get(names[2]) is None
    assert not s.put(entry_name("p", "huge"), b"x" * 20_000)  # (alone over the bound)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_a_store_that_cannot_be_written_warns_once_and_keeps_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    s = make(tmp_path)
    kept = entry_name("p", "kept")
    s.put(kept, b"written before")

    def refuse(*_: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_module.os, "replace", refuse)
    with caplog.at_level(logging.WARNING, "gradserve.store"):
        for i in range(5):
            assert not s.put(entry_name("p", str(i)), b"x")
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1, caplog.records
    assert bytes(s.get(kept)[0]) == b"written before"  # type: ignore[index]
    assert not [p for p in s.directory.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.undo()
    monkeypatch.setattr(store_module, "RETRY_WRITES_AFTER_S", 0.0)
    s._writable_after = 0.0  # (the pause is over)
    assert s.put(entry_name("p", "later"), b"y")


def test_a_store_whose_directory_cannot_be_made_is_no_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, "gradserve.store"):
        s = Store(blocker / "store", 1 << 20, VERSION)
        assert s.get(entry_name("p", "x")) is None
        assert not s.put(entry_name("p", "x"), b"x")
    assert any("cannot create" in r.getMessage() for r in caplog.records)


def test_a_real_full_file_system(tmp_path: Path) -> None:
    """On a 64 KiB tmpfs (where this machine lets a test mount one): writes past it fail
    with ENOSPC, and the store carries on without them."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip(
            "cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN); the "
            "monkeypatched ENOSPC test covers the same path"
        )
    try:
        s = Store(mount / "store", 1 << 30, VERSION)  # (a bound far above the room)
        results = [s.put(entry_name("p", str(i)), b"x" * 20_000) for i in range(6)]
        assert results[0] and not all(results)
        assert s.get(entry_name("p", "0")) is not None
        assert not [p for p in (mount / "store").iterdir() if p.name.startswith(".tmp-")]
    finally:
        os.system(f"umount {mount}")
