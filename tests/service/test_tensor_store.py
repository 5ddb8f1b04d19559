"""The tensors held by id (service/tensors.py), on a directory of the test's own: every
dtype bit-exact through a file and back, content-addressed ids, the per-key quota with
least-recently-used eviction, tensors a request reads pinned against any process's
eviction, a writer killed before its rename leaving nothing under an id, damaged files
never served (and repaired by an upload of the same tensor), and a store that cannot be
written refused as 507."""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gradserve.service.errors import ProblemError
from gradserve.service.tensors import (
    ALIGN,
    ANONYMOUS,
    MAGIC,
    READ_BELOW,
    Held,
    Pins,
    TensorStore,
)
from gradserve.wire.tensor_id import id_of_array, tensor_id

REPO = Path(__file__).resolve().parents[2]
F64 = 8


def arrays_of_every_kind() -> Iterator[tuple[str, np.ndarray]]:
    """(case, array) for every wire dtype: a 2-d array with its edge values, a 0-d one and
    an empty one."""
    for name in ("float16", "float32", "float64"):
        info = np.finfo(name)
        edges = [0.0, -0.0, 1.0, -2.5, np.nan, np.inf, -np.inf, info.max, info.tiny, info.eps]
        yield f"{name}-edges", np.array(edges * 3, dtype=name).reshape(3, 10)
        yield f"{name}-0d", np.array(-0.0, dtype=name)
        yield f"{name}-empty", np.zeros((0, 3), dtype=name)
    for name in ("int32", "int64"):
        ints = np.iinfo(name)
        yield f"{name}-edges", np.array([[ints.min, -1, 0], [1, 7, ints.max]], dtype=name)
        yield f"{name}-0d", np.array(ints.min, dtype=name)
        yield f"{name}-empty", np.zeros((2, 0), dtype=name)
    yield "bool-edges", np.array([[True, False, True], [False, False, True]])
    yield "bool-0d", np.array(True)
    yield "bool-empty", np.zeros((0,), dtype=bool)
    # NaNs that are not NumPy's: another payload, and the sign bit set (bits, not values).
    yield "float32-nan-payloads", np.array([0x7FC00001, 0xFFC00000], np.uint32).view(np.float32)
    yield "float64-nan-payload", np.array([0x7FF0000000000001], np.uint64).view(np.float64)


EVERY_KIND = dict(arrays_of_every_kind())


def store_at(tmp_path: Path, quota: int = 1 << 20) -> TensorStore:
    return TensorStore(tmp_path / "tensors", quota)


def floats(n: int, seed: int) -> np.ndarray:
    """n distinct float64s (n * 8 bytes), different for each seed."""
    return np.arange(n, dtype=np.float64) + seed * 1000.5


def path_of(store: TensorStore, tensor: str, tenant: str | None = None) -> Path:
    return store.root / (tenant or ANONYMOUS) / tensor


def set_mtime(store: TensorStore, tensor: str, when: float) -> None:
    os.utime(path_of(store, tensor), (when, when))


def read(store: TensorStore, tensor: str, tenant: str | None = None) -> np.ndarray:
    """A held tensor's value, copied (its pin released at once)."""
    pins = Pins()
    try:
        return store.open(tenant, [(("inputs", "x"), tensor)], pins)[tensor].copy()
    finally:
        pins.release()


def assert_unknown(store: TensorStore, tensor: str, tenant: str | None = None) -> None:
    pins = Pins()
    with pytest.raises(ProblemError) as caught:
        store.open(tenant, [(("inputs", "x"), tensor)], pins)
    assert caught.value.slug == "tensor-unknown" and caught.value.status == 409
    assert caught.value.extra["tensor_ids"] == [tensor]
    assert caught.value.errors == [{"loc": ["inputs", "x"], "msg": f"unknown here: {tensor}"}]
    assert pins.descriptors == [] and pins.ids == set()  # (nothing left pinned)


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def python_child(script: str, *args: str) -> subprocess.Popen[str]:
    """Another process of the host, with this repository importable."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


# ---------------------------------------------------------------- round trips and ids
@pytest.mark.parametrize("case", EVERY_KIND)
def test_every_dtype_round_trips_bit_exact_under_its_content_id(tmp_path: Path, case: str) -> None:
    array = EVERY_KIND[case]
    store = store_at(tmp_path)
    name = array.dtype.name
    held, created = store.put(None, array)
    assert created
    assert held == Held(id_of_array(array, name), array.shape, name, array.nbytes)
    assert held.tensor_id == tensor_id(name, array.shape, array.tobytes())
    assert len(held.tensor_id) == 32 and set(held.tensor_id) <= set("0123456789abcdef")
    pins = Pins()
    got = store.open(None, [(("inputs", "x"), held.tensor_id)], pins)[held.tensor_id]
    same_bits(got, array)
    assert not got.flags.writeable  # (a view on the file's bytes, read or mapped read-only)
    assert pins.ids == {held.tensor_id} and len(pins.descriptors) == 1
    pins.release()
    same_bits(got, array)  # (the mapping outlives the pin)
    assert store.describe(None, held.tensor_id) == held
    assert held.ref() == {"tensor_id": held.tensor_id, "shape": list(array.shape), "dtype": name}
    assert held.listed() == {**held.ref(), "bytes": array.nbytes}
    # The file: the magic, a header padded to 64 bytes, then the raw bytes.
    data = path_of(store, held.tensor_id).read_bytes()
    assert data.startswith(MAGIC) and len(data) % ALIGN == array.nbytes % ALIGN
    assert data[len(data) - array.nbytes :] == array.tobytes()


@pytest.mark.parametrize("elements", [1, READ_BELOW // F64 - 16, READ_BELOW // F64, 1 << 16])
def test_small_files_are_read_and_large_ones_mapped_alike(tmp_path: Path, elements: int) -> None:
    """Either side of READ_BELOW (a file of its header and data): the same bits, read-only,
    pinned the same way; a file cut short is never served, read or mapped."""
    array = floats(elements, 3)
    store = store_at(tmp_path, quota=1 << 24)
    held = store.put(None, array)[0]
    pins = Pins()
    got = store.open(None, [((), held.tensor_id)], pins)[held.tensor_id]
    same_bits(got, array)
    assert not got.flags.writeable and len(pins.descriptors) == 1
    pins.release()
    path = store.root / ANONYMOUS / held.tensor_id
    os.truncate(path, path.stat().st_size - 1)
    assert_unknown(store, held.tensor_id)


def test_the_same_content_is_one_tensor_and_a_put_again_only_touches_it(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    a = floats(6, 1).reshape(2, 3)
    held, created = store.put(None, a)
    set_mtime(store, held.tensor_id, 1000.0)
    again, created_again = store.put(None, a.copy())
    assert created and not created_again and again == held
    assert os.stat(path_of(store, held.tensor_id)).st_mtime > 1000.0  # (used: touched)
    # Fortran order, or a strided view, of the same values: the same tensor.
    assert store.put(None, np.asfortranarray(a))[0] == held
    wide = np.zeros((2, 6))
    wide[:, ::2] = a
    assert store.put(None, wide[:, ::2]) == (held, False)
    assert [h.tensor_id for h in store.held(None)] == [held.tensor_id]
    # The same bytes as another shape, or as another dtype: other tensors.
    flat = store.put(None, a.reshape(6))[0]
    as_ints = store.put(None, a.view(np.int64))[0]
    assert len({held.tensor_id, flat.tensor_id, as_ints.tensor_id}) == 3
    assert flat.tensor_id == id_of_array(a.reshape(6), "float64")
    assert store.used_bytes(None) == 3 * a.nbytes


# ---------------------------------------------------------------- quota and eviction
def test_a_tensor_over_the_quota_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=10 * F64)
    store.put(None, floats(10, 0))  # (exactly the quota: held)
    with pytest.raises(ProblemError) as caught:
        store.put(None, floats(11, 1))
    problem = caught.value
    assert problem.slug == "tensor-quota" and problem.status == 422
    assert problem.extra == {"quota_bytes": 80, "needed_bytes": 88}
    assert "88 bytes" in problem.detail and "80 bytes" in problem.detail
    assert [h.nbytes for h in store.held(None)] == [80]  # (nothing evicted for it either)
    assert store.evictions == 0


def test_eviction_takes_the_least_recently_used_and_an_open_is_a_use(tmp_path: Path) -> None:
    """Room for a tensor, and a tenth of the quota more (the directory is listed only when
    room must be made: once per tenth of the quota written), least recently used first."""
    store = store_at(tmp_path, quota=10 * 10 * F64)  # ten tensors; a tenth: one
    t = [store.put(None, floats(10, seed))[0].tensor_id for seed in range(10)]
    for k, tensor in enumerate(t):
        set_mtime(store, tensor, 1000.0 + k)
    assert [h.tensor_id for h in store.held(None)] == t[::-1]
    read(store, t[0])  # the oldest, used now
    assert [h.tensor_id for h in store.held(None)] == [t[0], *t[:0:-1]]
    n1 = store.put(None, floats(10, 10))[0].tensor_id  # t1 and t2 go, not t0
    assert store.evictions == 2
    for gone in t[1:3]:
        assert_unknown(store, gone)
    held = [h.tensor_id for h in store.held(None)]  # (n1 and t0: used in one clock tick)
    assert set(held[:2]) == {n1, t[0]} and held[2:] == t[:2:-1]
    n2 = store.put(None, floats(10, 11))[0].tensor_id  # (the tenth freed: no eviction)
    assert store.evictions == 2 and store.used_bytes(None) == store.quota_bytes
    set_mtime(store, n1, 2000.0)
    set_mtime(store, n2, 2001.0)
    set_mtime(store, t[0], 1500.0)
    n3 = store.put(None, floats(10, 12))[0].tensor_id  # t3 and t4 now
    assert store.evictions == 4
    assert [h.tensor_id for h in store.held(None)] == [n3, n2, n1, t[0], *t[:4:-1]]
    # Room for a tensor of three (and a tenth): the three least recently used go.
    store.put(None, floats(30, 13))
    assert store.evictions == 7
    assert {h.tensor_id for h in store.held(None)} == {n3, n2, n1, t[0], t[8], t[9]} | {
        id_of_array(floats(30, 13), "float64")
    }
    assert store.usage() == {ANONYMOUS: (7, 90 * F64)}  # (its books, kept exact)
    same_bits(read(store, t[9]), floats(10, 9))


def test_a_pinned_tensor_is_never_evicted_by_this_or_another_store(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=2 * 10 * F64)
    other = store_at(tmp_path, quota=2 * 10 * F64)  # (as another process opens it)
    a, b = (store.put(None, floats(10, seed))[0].tensor_id for seed in range(2))
    pins = Pins()
    value = store.open(None, [(("inputs", "a"), a)], pins)[a]
    set_mtime(store, a, 1000.0)  # the least recently used, but in use
    set_mtime(store, b, 2000.0)
    c = other.put(None, floats(10, 2))[0].tensor_id  # b goes instead
    assert other.evictions == 1
    assert_unknown(store, b)
    set_mtime(store, c, 3000.0)
    d = other.put(None, floats(10, 3))[0].tensor_id  # c goes: a still is in use
    assert_unknown(store, c)
    # Room that only a could make: refused, by either store, a kept; and nothing evicted
    # for a refusal (d could go, but going would not make room).
    for s in (store, other):
        with pytest.raises(ProblemError) as caught:
            s.put(None, floats(20, 4))
        assert caught.value.slug == "tensor-quota"
        assert "80 of them are held by tensors that requests in flight use" in (caught.value.detail)
    same_bits(value, floats(10, 0))
    same_bits(read(store, a), floats(10, 0))
    assert {h.tensor_id for h in store.held(None)} == {a, d}
    assert other.evictions == 2
    pins.release()
    other.put(None, floats(20, 4))  # released: a goes now (and d)
    assert_unknown(store, a)
    assert_unknown(store, d)


def test_a_tensor_pinned_by_another_process_is_not_evicted_until_it_lets_go(
    tmp_path: Path,
) -> None:
    store = store_at(tmp_path, quota=10 * F64)
    a = store.put(None, floats(10, 0))[0].tensor_id
    child = python_child(
        "import sys\n"
        "from gradserve.service.tensors import Pins, TensorStore\n"
        "pins = Pins()\n"
        "TensorStore(sys.argv[1], 1 << 20).open(None, [((), sys.argv[2])], pins)\n"
        "print('pinned', flush=True)\n"
        "sys.stdin.readline()\n"
        "pins.release()\n"
        "print('released', flush=True)\n"
        "sys.stdin.readline()\n",
        str(store.root),
        a,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "pinned\n"
        with pytest.raises(ProblemError) as caught:
            store.put(None, floats(10, 1))
        assert caught.value.slug == "tensor-quota"
        same_bits(read(store, a), floats(10, 0))
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "released\n"
        b, created = store.put(None, floats(10, 1))
        assert created and store.evictions == 1
        assert_unknown(store, a)
        assert [h.tensor_id for h in store.held(None)] == [b.tensor_id]
    finally:
        child.kill()
        child.wait()


def test_a_puts_own_pins_are_passed_over(tmp_path: Path) -> None:
    """A request's keep passes its pins: its own inputs are not evicted for its outputs."""
    store = store_at(tmp_path, quota=2 * 10 * F64)
    a, b = (store.put(None, floats(10, seed))[0].tensor_id for seed in range(2))
    pins = Pins()
    store.open(None, [(("inputs", "a"), a)], pins)
    set_mtime(store, a, 1000.0)
    set_mtime(store, b, 2000.0)
    store.put(None, floats(10, 2), pins)
    assert_unknown(store, b)
    pins.release()
    # Pins that name an id (as a keep's do) protect it in the same process, lock or not.
    pins = Pins(ids={a})
    with pytest.raises(ProblemError) as caught:
        store.put(None, floats(20, 3), pins)
    assert caught.value.slug == "tensor-quota"
    same_bits(read(store, a), floats(10, 0))


def test_reserve_makes_room_before_a_run(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=3 * 10 * F64)
    a, b = (store.put(None, floats(10, seed))[0].tensor_id for seed in range(2))
    set_mtime(store, a, 1000.0)
    set_mtime(store, b, 2000.0)
    store.reserve(None, 10 * F64, Pins())  # fits already: nothing goes
    assert store.evictions == 0 and store.used_bytes(None) == 20 * F64
    store.reserve(None, 0, Pins(ids={a, b}))
    store.reserve(None, 20 * F64, Pins(ids={b}))  # a goes (b, the request's own, stays)
    assert store.evictions == 1
    assert [h.tensor_id for h in store.held(None)] == [b]
    with pytest.raises(ProblemError) as caught:
        store.reserve(None, 30 * F64, Pins(ids={b}))  # only b could make room: in use
    assert caught.value.slug == "tensor-quota"
    assert caught.value.extra == {"quota_bytes": 240, "needed_bytes": 240}
    assert "80 of them are held by tensors that requests in flight use" in caught.value.detail
    with pytest.raises(ProblemError) as caught:
        store.reserve(None, 30 * F64 + 1, Pins())  # over the quota itself: nothing looked at
    assert caught.value.extra == {"quota_bytes": 240, "needed_bytes": 241}
    assert "keep needs 241 bytes" in caught.value.detail
    assert store.evictions == 1 and store.held(None)[0].tensor_id == b
    store.reserve(None, 30 * F64, Pins())  # b too, when nothing holds it
    assert store.evictions == 2 and store.held(None) == []


def test_threads_putting_at_once_stay_within_the_quota(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=10 * 4 * F64)
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for k in range(20):
                store.put(None, floats(4, 100 * thread + k))
        except BaseException as exc:  # (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # Serialised by the key's lock: room for one and a tenth each time it is full, so that
    # it ends full, having evicted all but ten.
    held = store.held(None)
    assert len(held) == 10 and store.used_bytes(None) == 10 * 4 * F64
    assert store.evictions == 6 * 20 - 10
    assert store.usage() == {ANONYMOUS: (10, 10 * 4 * F64)}
    for h in held:  # each intact, its id its content's
        value = read(store, h.tensor_id)
        assert id_of_array(value, "float64") == h.tensor_id
    assert not [p for p in path_of(store, "x").parent.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------- delete, describe, list
def test_delete_describe_held_and_usage(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    a = store.put(None, floats(3, 0))[0]
    b = store.put(None, np.zeros((2, 2), np.int32))[0]
    c = store.put("0f" * 16, np.array([True, False]))[0]
    set_mtime(store, a.tensor_id, 2000.0)
    set_mtime(store, b.tensor_id, 1000.0)
    assert store.held(None) == [a, b]
    assert store.held("0f" * 16) == [c]
    assert store.held("1f" * 16) == []
    assert store.used_bytes(None) == 24 + 16 and store.used_bytes("0f" * 16) == 2
    assert store.usage() == {ANONYMOUS: (2, 40), "0f" * 16: (1, 2)}
    assert store.describe(None, b.tensor_id) == Held(b.tensor_id, (2, 2), "int32", 16)
    assert store.describe("0f" * 16, a.tensor_id) is None  # (another key's)
    assert store.describe(None, "../" + a.tensor_id[3:]) is None  # (not an id: no path)
    assert store.describe(None, a.tensor_id.upper()) is None
    # Delete: a request that holds it keeps its value.
    pins = Pins()
    value = store.open(None, [(("inputs", "a"), a.tensor_id)], pins)[a.tensor_id]
    assert store.delete(None, a.tensor_id)
    assert not store.delete(None, a.tensor_id)
    assert not store.delete("0f" * 16, b.tensor_id)
    assert not store.delete(None, "not an id")
    same_bits(value, floats(3, 0))
    pins.release()
    assert_unknown(store, a.tensor_id)
    assert store.describe(None, a.tensor_id) is None
    assert store.usage() == {ANONYMOUS: (1, 16), "0f" * 16: (1, 2)}
    # Upload again: held again, as new.
    assert store.put(None, floats(3, 0)) == (a, True)


def test_each_key_sees_only_its_own_tensors(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=10 * F64)
    ka, kb = "aa" * 16, "bb" * 16
    a = store.put(ka, floats(10, 0))[0].tensor_id
    assert_unknown(store, a, kb)
    assert_unknown(store, a)  # (no key)
    # Each key has its quota: b's tensor evicts nothing of a's.
    b, created = store.put(kb, floats(10, 0))
    assert created and b.tensor_id == a and store.evictions == 0
    store.put(kb, floats(10, 1))  # evicts b's copy only
    assert_unknown(store, a, kb)
    same_bits(read(store, a, ka), floats(10, 0))
    pins = Pins()
    with pytest.raises(ProblemError) as caught:
        store.open(kb, [(("inputs", "x"), a), (("inputs", "y"), "f" * 32)], pins)
    assert caught.value.extra["tensor_ids"] == [a, "f" * 32]  # every id it cannot read


def test_an_id_named_twice_is_opened_once_and_unknown_ids_are_all_listed(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    a = store.put(None, floats(2, 0))[0].tensor_id
    pins = Pins()
    found = store.open(None, [(("inputs", "x"), a), (("inputs", "y"), a)], pins)
    assert list(found) == [a] and len(pins.descriptors) == 1
    pins.release()
    missing = ["1" * 32, "2" * 32]
    with pytest.raises(ProblemError) as caught:
        store.open(
            None,
            [(("inputs", "x"), missing[0]), (("inputs", "y"), a), (("g", "z"), missing[1])],
            pins,
        )
    assert caught.value.extra["tensor_ids"] == missing
    assert [e["loc"] for e in caught.value.errors or []] == [["inputs", "x"], ["g", "z"]]
    assert "tensors 1111" in caught.value.detail
    # What the failed open had pinned is still the caller's to release.
    assert pins.ids == {a}
    pins.release()
    assert pins.descriptors == []


# ---------------------------------------------------------------- killed writers, damage
WRITER_KILLED_BEFORE_ITS_RENAME = """
import os, sys, time
import numpy as np
from gradserve.service.tensors import TensorStore

def stalled(src, dst):  # its bytes written, the rename not yet made: killed here
    print(os.path.basename(src), flush=True)
    time.sleep(60)

os.replace = stalled
TensorStore(sys.argv[1], 1 << 30).put(None, np.arange(1 << 20, dtype=np.float64))
"""


def test_a_writer_killed_mid_write_leaves_nothing_under_the_id(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=1 << 24)
    big = np.arange(1 << 20, dtype=np.float64)
    tensor = id_of_array(big, "float64")
    child = python_child(WRITER_KILLED_BEFORE_ITS_RENAME, str(store.root))
    assert child.stdout is not None
    temp_name = child.stdout.readline().strip()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    scope = store.root / ANONYMOUS
    assert temp_name == f".tmp-{child.pid}-0"
    assert (scope / temp_name).stat().st_size == ALIGN + big.nbytes  # (all but the rename)
    # A temp file cut short (killed in its write), one of a live writer, and another's.
    (scope / f".tmp-{child.pid}-1").write_bytes(MAGIC + b"\x10\x00")
    live = scope / f".tmp-{os.getpid()}-99"
    live.write_bytes(b"being written")
    nobody = scope / ".tmp-junk"
    nobody.write_bytes(b"")
    assert not (scope / tensor).exists()
    assert_unknown(store, tensor)
    assert store.describe(None, tensor) is None
    assert store.held(None) == [] and store.used_bytes(None) == 0
    assert store.usage() == {ANONYMOUS: (0, 0)}
    store.sweep()
    assert sorted(p.name for p in scope.iterdir()) == [".lock", live.name]
    # The key's lock died with the writer: the tensor can be held now.
    held, created = store.put(None, big)
    assert created and held.tensor_id == tensor
    same_bits(read(store, tensor), big)


WRITER_KILLED_BEFORE_ITS_BOOKS = """
import os, sys, time
import numpy as np
from gradserve.service.tensors import TensorStore

def stalled(fd, data, offset):  # renamed into place, its books not yet written: killed here
    print("renamed", flush=True)
    time.sleep(60)

os.pwrite = stalled
TensorStore(sys.argv[1], int(sys.argv[2])).put(None, np.arange(10.0) + 0.5)
"""


def test_a_writer_killed_after_its_rename_leaves_a_whole_tensor_and_books_made_exact(
    tmp_path: Path,
) -> None:
    store = store_at(tmp_path, quota=4 * 10 * F64)
    a = store.put(None, floats(10, 0))[0].tensor_id
    child = python_child(WRITER_KILLED_BEFORE_ITS_BOOKS, str(store.root), str(store.quota_bytes))
    assert child.stdout is not None
    assert child.stdout.readline() == "renamed\n"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    b = id_of_array(np.arange(10.0) + 0.5, "float64")
    same_bits(read(store, b), np.arange(10.0) + 0.5)  # whole, under its id
    assert {h.tensor_id for h in store.held(None)} == {a, b}
    # Its key's lock went with it; the next time room is made, the books are counted.
    for seed in range(1, 5):
        store.put(None, floats(10, seed))
    store.put(None, floats(20, 9))
    assert store.used_bytes(None) <= store.quota_bytes
    listed = store.held(None)
    assert store.usage() == {ANONYMOUS: (len(listed), sum(h.nbytes for h in listed))}


def test_put_many_holds_each_under_one_lock_or_none_over_the_quota(tmp_path: Path) -> None:
    store = store_at(tmp_path, quota=10 * F64)
    a, b = floats(3, 0), np.arange(4, dtype=np.int32)
    out = store.put_many(None, [a, b, a])
    assert [created for _, created in out] == [True, True, False]
    assert [h.tensor_id for h, _ in out] == [
        id_of_array(a, "float64"),
        id_of_array(b, "int32"),
        id_of_array(a, "float64"),
    ]
    with pytest.raises(ProblemError) as caught:
        store.put_many(None, [floats(2, 5), floats(11, 6)])  # one over: none held
    assert caught.value.slug == "tensor-quota"
    assert store.usage() == {ANONYMOUS: (2, 24 + 16)}
    assert store.used_bytes(None) == 24 + 16


@pytest.mark.parametrize("held_before", [4, 6])
def test_books_stay_exact_when_a_keep_fails_half_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_before: int
) -> None:
    """A keep of two values whose second write fails (the store full): the first is held,
    and the key's books count it (and what was evicted for it), so that the quota holds."""
    quota = 6 * 10 * F64
    store = store_at(tmp_path, quota=quota)
    for seed in range(held_before):
        set_mtime(store, store.put(None, floats(10, seed))[0].tensor_id, 1000.0 + seed)
    replace = os.replace
    calls = []

    def full_on_the_second(src: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", full_on_the_second)
    with pytest.raises(ProblemError) as caught:
        store.put_many(None, [floats(10, 10), floats(10, 11)])
    assert caught.value.slug == "tensor-store-unavailable"
    monkeypatch.setattr(os, "replace", replace)
    listed = store.held(None)
    assert id_of_array(floats(10, 10), "float64") in {h.tensor_id for h in listed}
    fresh = store_at(tmp_path, quota=quota)  # (its books, as another process reads them)
    assert fresh.usage() == {ANONYMOUS: (len(listed), sum(h.nbytes for h in listed))}
    for seed in range(20, 24):  # (no write passes the quota on books that undercount)
        fresh.put(None, floats(10, seed))
        assert fresh.used_bytes(None) <= quota


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    dims = len(MAGIC) + 8  # (the header: the magic, the dtype and rank, then each dim)
    if how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "truncated":
        path.write_bytes(data[:-8])
    elif how == "header-only":
        path.write_bytes(data[:ALIGN])
    elif how == "magic-only":
        path.write_bytes(data[: len(MAGIC)])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bad-magic":
        path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    elif how == "negative-dim":  # (4, 4) read as (-1, 4): a shape no tensor has
        path.write_bytes(data[:dims] + struct.pack("<q", -1) + data[dims + 8 :])
    elif how == "huge-dim":  # (2**40, 4): past the file's bytes
        path.write_bytes(data[:dims] + struct.pack("<q", 1 << 40) + data[dims + 8 :])


DAMAGE = [
    "garbage",
    "truncated",
    "header-only",
    "magic-only",
    "empty",
    "bad-magic",
    "negative-dim",
    "huge-dim",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_file_is_unknown_and_an_upload_of_its_tensor_repairs_it(
    tmp_path: Path, how: str
) -> None:
    store = store_at(tmp_path)
    value = floats(16, 7).reshape(4, 4)
    held = store.put(None, value)[0]
    _damage(path_of(store, held.tensor_id), how)
    store = store_at(tmp_path)  # (a process that never saw it whole)
    assert_unknown(store, held.tensor_id)
    assert store.describe(None, held.tensor_id) is None  # (nor planned with, nor listed)
    assert store.held(None) == [] and store.used_bytes(None) == 0
    # The client's answer to a 409: upload it again. That must hold it again.
    assert store.put(None, value) == (held, True)
    same_bits(read(store, held.tensor_id), value)
    assert store.describe(None, held.tensor_id) == held
    assert store.held(None) == [held] and store.usage() == {ANONYMOUS: (1, 128)}


# ---------------------------------------------------------------- a store not writable
def test_a_store_under_a_regular_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    store = TensorStore(tmp_path / "a-file" / "tensors", 1 << 20)
    for call in (
        lambda: store.put(None, floats(3, 0)),
        lambda: store.reserve(None, 8, Pins()),
    ):
        with pytest.raises(ProblemError) as caught:
            call()
        assert caught.value.slug == "tensor-store-unavailable" and caught.value.status == 507
        assert "cannot be written (Not a directory)" in caught.value.detail
    # Reading and listing it: nothing held.
    assert_unknown(store, id_of_array(floats(3, 0), "float64"))
    assert store.held(None) == [] and store.usage() == {}
    store.sweep()  # (nothing to sweep, and no error)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_store_refuses_puts_and_serves_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    store = store_at(tmp_path)
    a = store.put(None, floats(3, 0))[0].tensor_id

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", refuse)
    if code == errno.EROFS:  # a read-only mount refuses even the touch of a use
        monkeypatch.setattr(os, "utime", refuse)
    with pytest.raises(ProblemError) as caught:
        store.put(None, floats(3, 1))
    assert caught.value.slug == "tensor-store-unavailable" and caught.value.status == 507
    assert os.strerror(code) in caught.value.detail
    scope = store.root / ANONYMOUS
    assert sorted(p.name for p in scope.iterdir()) == [".lock", a]  # (no temp file left)
    same_bits(read(store, a), floats(3, 0))  # what it holds is still served
