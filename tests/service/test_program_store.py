"""Programs that stay compiled: a graph found by its bytes as sent (no parse, no
validation), programs and graphs shared by every process through the store, ids scoped
to the API key that sent the graph, and a damaged or unusable store that costs a compile,
never a wrong answer or a 5xx."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradserve.service import request as request_module
from gradserve.service.compute import Compute, Stats
from gradserve.service.errors import ProblemError
from gradserve.service.placement import IDLE_MAX_BODY_BYTES
from gradserve.service.settings import Settings
from tests.support.in_process import serving
from tests.support.problems import strict_json

pytestmark = pytest.mark.anyio

CHAIN = {
    "nodes": [
        {"id": f"n{i}", "expr": f"sin(n{i - 1}) * 0.5" if i else "sin(x) * 0.5"} for i in range(40)
    ],
    "outputs": ["n39"],
}


def chain_body(x: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "graph": CHAIN,
        "inputs": {"x": {"data": x, "requires_grad": True}},
        "grad_outputs": {"n39": {"data": [1.0] * len(x)}},
        **extra,
    }


def chain_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h, g = x.astype(np.float32), np.ones_like(x, np.float32)
    for _ in range(40):
        g = g * np.cos(h) * np.float32(0.5)
        h = np.sin(h) * np.float32(0.5)
    return h, g


def run(
    compute: Compute,
    body: dict[str, Any] | bytes,
    kind: str = "backward",
    tenant: str | None = None,
) -> tuple[dict[str, Any], Stats]:
    stats = Stats()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = compute.serve(kind, raw, None, tenant, 1e12, lambda _: None, stats)
    return json.loads(b"".join(bytes(p) for p in reply.parts)), stats


@pytest.fixture
def store_dir(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "store")


def test_a_cheap_program_is_stored_at_its_second_use_a_costly_one_at_once(
    store_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program that compiles in under STORE_AT_ONCE_MS is not worth its dump and write
    for a graph used once (define-by-run: a new graph every request); one used again is."""
    compute = Compute(Settings(program_store_dir=store_dir))
    store = compute.programs.store
    assert store is not None

    def programs() -> int:
        return len(store.recent("p", 100))

    # Every compile cheap, whatever this machine's speed (a first compile warms memos).
    monkeypatch.setattr("gradserve.service.programs.STORE_AT_ONCE_MS", math.inf)
    for k in range(3):  # three one-off graphs: none stored
        run(
            compute,
            {
                "graph": {**CHAIN, "outputs": [f"n{30 + k}"]},
                "inputs": {"x": [0.5]},
                "no_grad": True,
            },
            "forward",
        )
        compute.programs.flush()
    assert programs() == 0
    run(compute, chain_body([0.5]))
    compute.programs.flush()
    assert programs() == 0
    run(compute, chain_body([0.5]))  # its second use
    compute.programs.flush()
    assert programs() == 1
    monkeypatch.setattr("gradserve.service.programs.STORE_AT_ONCE_MS", 0.0)  # (as if costly)
    run(compute, chain_body([0.5, 1.0]))
    compute.programs.flush()
    assert programs() == 2


def test_a_graph_with_a_null_graph_id_is_served(store_dir: str) -> None:
    compute = Compute(Settings(program_store_dir=store_dir))
    for _ in range(2):  # (parsed, then found by its bytes)
        answer, _ = run(compute, chain_body([0.5, 1.0], graph_id=None))
        assert answer["meta"]["graph_id"]


def test_a_repeat_is_found_by_its_bytes_without_a_parse(
    store_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compute = Compute(Settings(program_store_dir=store_dir))
    first, stats = run(compute, chain_body([0.5, 1.0]))
    assert stats.program == "compiled" and first["meta"]["program"] == "compiled"
    parsed: list[Any] = []
    original, validate = request_module.parse_json, request_module._validate

    def counting(body: bytes) -> Any:
        parsed.append(body)
        return original(body)

    def no_graph(data: Any, model: Any) -> Any:
        assert "graph" not in data, "the graph was validated again"
        return validate(data, model)

    monkeypatch.setattr(request_module, "parse_json", counting)
    monkeypatch.setattr(request_module, "_validate", no_graph)
    again, stats = run(compute, chain_body([0.25, 2.0]))
    assert parsed == [] and stats.program == "process"
    assert again["meta"]["graph_id"] == first["meta"]["graph_id"]
    want, grad = chain_numpy(np.array([0.25, 2.0]))
    np.testing.assert_allclose(again["outputs"]["n39"]["data"], want, rtol=1e-6)
    np.testing.assert_allclose(again["gradients"]["x"]["data"], grad, rtol=1e-5)


@pytest.mark.parametrize(
    "bad",
    [
        {"inputs": {"x": {"data": [1.0, True], "requires_grad": True}}},  # tensor data
        {"inputs": {"x": {"dat": [1.0]}}},  # a misspelt field (schema)
        {"encoding": "yaml"},
        {"unknown": 1},
        {"graph_id": "0" * 32},  # not the graph's id
        {"graph_id": 12},
        {"graph_id": None, "inputs": {"x": {"data": "one", "requires_grad": True}}},
        {"grad_outputs": {"nope": [1.0, 2.0]}},
    ],
)
def test_a_hit_refuses_what_a_miss_refuses_with_the_same_problem(
    store_dir: str, bad: dict[str, Any]
) -> None:
    """Bad members beside a known graph: the same problem as beside a new one."""
    body = {**chain_body([0.5, 1.0]), **bad}

    def problem(compute: Compute) -> dict[str, Any]:
        with pytest.raises(Exception) as info:
            run(compute, body)
        err = info.value
        if isinstance(err, ProblemError):
            return {"slug": err.slug, "detail": err.detail, "errors": err.errors}
        return {"type": type(err).__name__, "message": str(err), "loc": getattr(err, "loc", None)}

    fresh = problem(Compute(Settings(program_store_dir=store_dir + "-fresh")))
    known = Compute(Settings(program_store_dir=store_dir))
    run(known, chain_body([0.5, 1.0]))  # (its graph is known by its bytes from now on)
    assert problem(known) == fresh


def test_graphs_and_programs_are_shared_through_the_store(store_dir: str) -> None:
    """Two processes of one host (two Computes on one store): what one compiled, the other
    loads; what one was sent, the other knows by its bytes and by its id."""
    a, b = (Compute(Settings(program_store_dir=store_dir)) for _ in range(2))
    first, stats = run(a, chain_body([0.5, 1.0]))
    assert stats.program == "compiled"
    run(a, chain_body([0.5, 1.0]))  # (a cheap program is stored at its second use)
    a.programs.flush()  # (after the answer, as the runner does)
    again, stats = run(b, chain_body([0.5, 1.0]))
    assert stats.program == "store" and stats.compile_ms is None and stats.load_ms is not None
    assert again["outputs"] == first["outputs"] and again["gradients"] == first["gradients"]
    by_id = {
        "graph_id": first["meta"]["graph_id"],
        "inputs": {"x": {"data": [0.5, 1.0, 2.0], "requires_grad": True}},
        "grad_outputs": {"n39": [1.0, 1.0, 1.0]},
    }
    c = Compute(Settings(program_store_dir=store_dir))
    third, stats = run(c, by_id)  # (a new signature: compiled from the store's graph)
    assert stats.program == "compiled"
    _, grad = chain_numpy(np.array([0.5, 1.0, 2.0]))
    np.testing.assert_allclose(third["gradients"]["x"]["data"], grad, rtol=1e-5)


@pytest.mark.parametrize("graph_id", ["a\x00b", "../" + "0" * 32, "0" * 31, "A" * 32])
def test_an_id_no_graph_can_have_is_unknown_not_a_file_name(store_dir: str, graph_id: str) -> None:
    # Found by schemathesis: a NUL in graph_id reached open() in the store (a 500).
    with pytest.raises(ProblemError) as info:
        run(Compute(Settings(program_store_dir=store_dir)), {"graph_id": graph_id}, "plan")
    assert info.value.slug == "graph-unknown"


def test_ids_are_scoped_to_the_key_that_sent_the_graph(store_dir: str) -> None:
    a, b = (Compute(Settings(program_store_dir=store_dir)) for _ in range(2))
    first, _ = run(a, chain_body([0.5, 1.0]), tenant="tenant-a")
    by_id = {
        "graph_id": first["meta"]["graph_id"],
        "inputs": {"x": {"data": [0.5, 1.0], "requires_grad": True}},
        "grad_outputs": {"n39": [1.0, 1.0]},
    }
    for compute in (a, b):  # (the same process, and another: the grant is in the store)
        with pytest.raises(ProblemError) as info:
            run(compute, by_id, tenant="tenant-b")
        assert info.value.slug == "graph-unknown"
        with pytest.raises(ProblemError) as info:
            run(compute, {**by_id, "path": "backward"}, "plan", tenant="tenant-b")
        assert info.value.slug == "graph-unknown"
        answer, _ = run(compute, by_id, tenant="tenant-a")
        assert answer["gradients"] == first["gradients"]
    # Once B sends the graph itself, the id is B's too; the program below is shared.
    _, stats = run(b, chain_body([0.5, 1.0]), tenant="tenant-b")
    assert stats.program in ("process", "store")
    assert run(b, by_id, tenant="tenant-b")[0]["gradients"] == first["gradients"]
    with pytest.raises(ProblemError):
        run(a, by_id, tenant="tenant-c")


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :])


@pytest.mark.parametrize("how", ["garbage", "truncated", "flipped", "version", "half"])
async def test_a_damaged_store_gives_a_correct_answer_and_no_5xx(tmp_path: Path, how: str) -> None:
    store = tmp_path / "store"
    body = chain_body([0.5, 1.0])
    async with serving(program_store_dir=str(store)) as (c, app):
        first = strict_json(await c.post("/backward", json=body))
        await c.post("/backward", json=body)  # (its second use: stored)
        app.state.front.compute.programs.flush()
    entries = sorted(p for p in store.iterdir() if p.is_file())  # (not lowering/)
    assert {p.name[0] for p in entries} >= {"p", "g", "a"}, entries
    for path in entries:
        if how == "version":  # another gradserve's entries: never read, never served
            path.rename(path.with_name(path.name[:2] + "f" * 32))
        elif how == "half":  # a writer that died before its rename
            path.rename(path.with_name(".tmp-4242-" + path.name))
        else:
            _damage(path, how)
    async with serving(program_store_dir=str(store)) as (c, _):
        again = strict_json(await c.post("/backward", json=body))
        by_id = await c.post(
            "/backward",
            json={
                "graph_id": first["meta"]["graph_id"],
                **{k: body[k] for k in ("inputs", "grad_outputs")},
            },
        )
    assert again["meta"]["program"] == "compiled"
    assert again["outputs"] == first["outputs"] and again["gradients"] == first["gradients"]
    assert strict_json(by_id)["gradients"] == first["gradients"]


async def test_an_unusable_store_directory_is_no_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    async with serving(program_store_dir=str(blocker / "store")) as (c, app):
        for x in ([0.5, 1.0], [0.25, 2.0]):
            r = await c.post("/backward", json=chain_body(x))
            _, grad = chain_numpy(np.array(x))
            np.testing.assert_allclose(strict_json(r)["gradients"]["x"]["data"], grad, rtol=1e-5)
        app.state.front.compute.programs.flush()
    assert sum("cannot create" in r.getMessage() for r in caplog.records) == 1


async def test_the_metrics_count_where_programs_come_from(store_dir: str) -> None:
    async with serving(program_store_dir=store_dir) as (c, _):
        for x in ([0.5, 1.0], [0.25, 2.0], [1.0, 1.0]):
            assert (await c.post("/backward", json=chain_body(x))).status_code == 200
        text = (await c.get("/metrics")).text
    # (a graph of 40 nodes and a small body: the front process's fast lane runs it)
    assert 'gradserve_program_lookups_total{role="front",source="compiled"} 1.0' in text
    assert 'gradserve_program_lookups_total{role="front",source="process"} 2.0' in text
    assert 'gradserve_compiles_total{role="front"} 1.0' in text
    assert 'gradserve_compiles_total{role="worker"} 0.0' in text
    assert "gradserve_program_compile_seconds_count 1.0" in text
    assert "gradserve_program_store_bytes" in text


async def test_the_default_store_is_the_servers_own_and_goes_with_it() -> None:
    async with serving() as (c, app):
        directory = app.state.front.settings.program_store_dir
        assert directory and Path(directory).is_dir()
        r = await c.post("/backward", json=chain_body([0.5]))
        assert r.status_code == 200
    assert not Path(directory).exists()


async def test_without_a_store_every_process_compiles_its_own(store_dir: str) -> None:
    async with serving(program_store_bytes=0) as (c, app):
        assert app.state.front.compute.programs.store is None
        r = await c.post("/backward", json=chain_body([0.5]))
        assert strict_json(r)["meta"]["program"] == "compiled"


def test_client_errors_on_by_id_bodies_are_unchanged(store_dir: str) -> None:
    compute = Compute(Settings(program_store_dir=store_dir))
    with pytest.raises(ProblemError) as info:
        run(compute, {"graph_id": "f" * 32, "inputs": {}})
    assert info.value.slug == "graph-unknown"


async def test_an_http_repeat_reports_where_its_program_came_from(store_dir: str) -> None:
    async with serving(program_store_dir=store_dir) as (c, _):
        sources = [
            strict_json(await c.post("/backward", json=chain_body([0.5, 1.0])))["meta"]["program"]
            for _ in range(2)
        ]
    assert sources == ["compiled", "process"]


async def test_over_http_an_id_resolves_only_for_the_key_that_sent_the_graph(
    store_dir: str,
) -> None:
    async with serving(program_store_dir=store_dir, api_keys="key-a,key-b") as (c, _):
        a, b = {"X-API-Key": "key-a"}, {"Authorization": "Bearer key-b"}
        first = strict_json(await c.post("/backward", json=chain_body([0.5, 1.0]), headers=a))
        by_id = {
            "graph_id": first["meta"]["graph_id"],
            **{k: chain_body([0.5, 1.0])[k] for k in ("inputs", "grad_outputs")},
        }
        unknown = {
            "graph_id": "0" * 32,
            "inputs": by_id["inputs"],
            "grad_outputs": by_id["grad_outputs"],
        }
        refused = await c.post("/backward", json=by_id, headers=b)
        never = await c.post("/backward", json=unknown, headers=b)
        assert refused.status_code == never.status_code == 409
        # B learns nothing: the same problem as for an id that does not exist.
        assert (
            refused.json()["detail"].replace(by_id["graph_id"], "0" * 32) == never.json()["detail"]
        )
        plan = await c.post(
            "/plan",
            json={
                "graph_id": by_id["graph_id"],
                "inputs": {"x": {"shape": [2], "dtype": "float32", "requires_grad": True}},
            },
            headers=b,
        )
        assert plan.status_code == 409 and "nodes" not in plan.text
        ok = strict_json(await c.post("/backward", json=by_id, headers=a))
        assert ok["gradients"] == first["gradients"]
        # B sends the graph itself: from then on the id is B's too.
        assert (
            await c.post("/backward", json=chain_body([0.5, 1.0]), headers=b)
        ).status_code == 200
        assert (
            strict_json(await c.post("/backward", json=by_id, headers=b))["gradients"]
            == first["gradients"]
        )


# ---------------------------------------------------------------- across worker processes

# Inputs of this many values: a body past what the front process's lanes take even for a
# graph known to be cheap on an idle server (service/placement.py): a worker computes it.
BIG = 60_000


async def _worker_request(c: Any, x: list[float]) -> dict[str, Any]:
    body = chain_body(x)
    assert len(json.dumps(body)) >= IDLE_MAX_BODY_BYTES
    r = await c.post("/backward", json=body)
    doc = strict_json(r)
    _, grad = chain_numpy(np.array(x))
    np.testing.assert_allclose(doc["gradients"]["x"]["data"], grad, rtol=1e-5)
    return doc


def _holders(app: Any, graph_id: str) -> list[int]:
    """The workers that hold the graph's program (as the front process knows them)."""
    known = app.state.front.placement.known(graph_id)
    return [
        w.pid
        for w in app.state.front.pool._workers
        if known is not None and known.program_key in w.programs
    ]


def _lookups(text: str, role: str = "worker") -> dict[str, float]:
    return {
        source: float(
            text.split(f'gradserve_program_lookups_total{{role="{role}",source="{source}"}} ')[
                1
            ].split()[0]
        )
        for source in ("process", "store", "compiled")
    }


async def test_a_program_compiled_by_one_worker_is_loaded_by_another(store_dir: str) -> None:
    """Worker A compiles; while A is busy the same graph goes to worker B, which loads A's
    program from the store (no compile, as the metrics count); afterwards each holds it."""
    x = list(np.linspace(-1, 1, BIG))
    async with serving(program_store_dir=store_dir, compute_workers=2, min_compute_workers=2) as (
        c,
        app,
    ):
        first = await _worker_request(c, x)
        assert first["meta"]["program"] == "compiled"
        await _worker_request(c, x)  # (A again: its second use, and A stores it)
        await asyncio.sleep(0.5)  # (A writes the program to the store after its answer)
        big = 'full(shape=[1500, 1500], value=1.0, dtype="float64")'
        slow = {
            "graph": {"nodes": [{"id": "m", "expr": f"sum({big} @ {big})"}], "outputs": ["m"]},
            "inputs": {},
            "no_grad": True,
        }
        holder = _holders(app, first["meta"]["graph_id"])
        assert len(holder) == 1
        # Keep A busy (affinity would send the graph to it when idle).
        busy = asyncio.create_task(c.post("/forward", json=slow))
        workers = app.state.front.pool._workers
        for _ in range(200):  # until A has the slow task (the worker freed last gets it)
            if any(w.pid in holder and w.task is not None for w in workers):
                break
            await asyncio.sleep(0.01)
        docs = [await _worker_request(c, x) for _ in range(3)]
        await asyncio.wait([busy])
        text = (await c.get("/metrics")).text
    sources = [d["meta"]["program"] for d in docs]
    assert sources[0] == "store" and "compiled" not in sources, sources
    assert (await busy).status_code == 200
    # The chain and the slow graph, in workers; and the slow graph once in the front
    # process, whose fast lane took it for its small body, found its program past the
    # lane's bounds, dropped it and sent the request on.
    assert 'gradserve_compiles_total{role="worker"} 2.0' in text
    assert 'gradserve_compiles_total{role="front"} 1.0' in text
    assert _lookups(text)["store"] >= 1


async def test_after_a_worker_is_killed_the_next_request_loads_from_the_store(
    store_dir: str,
) -> None:
    x = list(np.linspace(-1, 1, BIG))
    async with serving(program_store_dir=store_dir, compute_workers=1, min_compute_workers=1) as (
        c,
        app,
    ):
        first = await _worker_request(c, x)
        await _worker_request(c, x)  # (its second use: stored)
        await asyncio.sleep(0.5)
        (pid,) = _holders(app, first["meta"]["graph_id"])
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        again = await _worker_request(c, x)
        assert again["meta"]["program"] == "store"
        assert again["gradients"] == first["gradients"]
        assert _holders(app, first["meta"]["graph_id"]) != [pid]


async def test_a_recycled_workers_successor_takes_over_its_programs(store_dir: str) -> None:
    """The successor loads its predecessor's programs before it says it is ready: the first
    request it serves finds the program in its memory, not in the store."""
    x = list(np.linspace(-1, 1, BIG))
    async with serving(
        program_store_dir=store_dir,
        compute_workers=1,
        min_compute_workers=1,
        compute_worker_max_rss_growth_bytes=1 << 40,
    ) as (c, app):
        first = await _worker_request(c, x)
        await asyncio.sleep(0.5)  # (the program is written to the store after the answer)
        pool = app.state.front.pool
        (old,) = pool._workers
        pool.settings = pool.settings.model_copy(
            update={"compute_worker_max_rss_growth_bytes": 0}
        )  # (recycle after the next)
        await _worker_request(c, x)
        for _ in range(100):
            await asyncio.sleep(0.1)
            if old not in pool._workers:
                break
        (new,) = pool._workers
        assert new.pid != old.pid and _holders(app, first["meta"]["graph_id"]) == [new.pid]
        pool.settings = pool.settings.model_copy(
            update={"compute_worker_max_rss_growth_bytes": 1 << 40}
        )
        again = await _worker_request(c, x)
    assert again["meta"]["program"] == "process"


async def test_a_server_on_a_persistent_store_starts_with_its_recent_programs(
    store_dir: str,
) -> None:
    x = list(np.linspace(-1, 1, BIG))
    async with serving(program_store_dir=store_dir, compute_workers=1) as (c, _):
        first = await _worker_request(c, x)
        await _worker_request(c, x)  # (its second use: stored)
        await asyncio.sleep(0.5)
    async with serving(program_store_dir=store_dir, compute_workers=1) as (c, _):
        again = await _worker_request(c, x)  # (a restart: the worker preloaded it)
    assert again["meta"]["program"] == "process"
    assert again["gradients"] == first["gradients"]


def _count(text: str, metric: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(metric) and not line.startswith("#")
    )


async def test_a_program_is_compiled_once_on_the_host_across_recycles_and_a_restart(
    store_dir: str,
) -> None:
    """Two workers, each replaced after every task (an RSS limit of 0): the first compiles
    the program; each replacement is told to store what it holds first, and its successor
    loads it once before it is ready. A server restarted on the same store compiles it
    nowhere. The front process compiles and looks up nothing: these are workers' requests
    (the role label says who)."""
    x = list(np.linspace(-1, 1, BIG))
    async with serving(
        program_store_dir=store_dir,
        compute_workers=2,
        min_compute_workers=2,
        compute_worker_max_rss_growth_bytes=0,
    ) as (c, app):
        docs = [await _worker_request(c, x) for _ in range(6)]
        pool = app.state.front.pool
        for _ in range(100):  # (the last replacement, warm)
            if pool.warm == 2 and all(w.successor is None for w in pool._workers):
                break
            await asyncio.sleep(0.05)
        text = (await c.get("/metrics")).text
        starts = pool.starts
    assert docs[0]["meta"]["program"] == "compiled"
    assert "compiled" not in [d["meta"]["program"] for d in docs[1:]]
    assert _count(text, 'gradserve_compiles_total{role="worker"}') == 1
    assert _count(text, 'gradserve_compiles_total{role="front"}') == 0
    assert _count(text, 'gradserve_program_lookups_total{role="front"') == 0
    assert starts >= 3  # (2 at start, and replacements)
    # Loaded at most once per worker: by preload, or at a first request.
    assert 1 <= _count(text, "gradserve_program_load_seconds_count") <= starts
    async with serving(program_store_dir=store_dir, compute_workers=1) as (c, _):
        again = await _worker_request(c, x)
        text = (await c.get("/metrics")).text
    assert again["meta"]["program"] in ("process", "store")  # (preloaded, or loaded)
    assert again["gradients"] == docs[0]["gradients"]
    assert _count(text, "gradserve_compiles_total") == 0
