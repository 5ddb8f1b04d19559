"""Where a request computes (service/placement.py): the fast lane for the cheapest, the idle
lane when no compute slot is busy (a known program of some milliseconds runs in the front
process: a hop to a worker would only add its ~1 ms), and a worker otherwise, or when the
native tier may yet lower the program (its runs count in the workers). A new graph whose
text lifted (a graph seen before but for its float literals) is placed by that program."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from gradserve.service.compute import Stats
from gradserve.service.placement import (
    FAST_LANE,
    IDLE_LANE,
    IDLE_MAX_BODY_BYTES,
    KNOWN_MAX_DOCUMENT_BYTES,
    LIFTED_LANE,
    NEW_MAX_NODES,
    WORKER,
    Facts,
    Placement,
)
from tests.support.in_process import serving
from tests.support.problems import strict_json

pytestmark = pytest.mark.anyio

GRAPH = "g" * 32


def _known(cost: int, steps: int, peak: int = 1 << 20, lowered: bool = False) -> Placement:
    placement = Placement()
    stats = Stats(graph_id=GRAPH, program_key="k", compute_cost=cost, steps=steps)
    stats.planned_peak_bytes, stats.lowered = peak, lowered
    placement.learn(stats)
    return placement


def _facts(document: int, idle: bool, body: int | None = None) -> Facts:
    return Facts(body or document, document, GRAPH, None, idle)


def test_a_cheap_known_program_takes_the_fast_lane_busy_or_not() -> None:
    placement = _known(FAST_LANE.cost, FAST_LANE.steps)
    for idle in (False, True):
        lane = placement.place(_facts(KNOWN_MAX_DOCUMENT_BYTES, idle))
        assert lane.fast and lane.bounds is FAST_LANE and lane.affinity == "k"


@pytest.mark.parametrize(
    ("cost", "steps", "peak", "document", "fast"),
    [
        (IDLE_LANE.cost, IDLE_LANE.steps, IDLE_LANE.peak_bytes, 200_000, True),
        (IDLE_LANE.cost + 1, 10, 1 << 20, 200_000, False),  # too costly
        (10, IDLE_LANE.steps + 1, 1 << 20, 200_000, False),  # too many steps
        (10, 10, (IDLE_LANE.peak_bytes or 0) + 1, 200_000, False),  # too much memory
        (10, 10, 1 << 20, IDLE_MAX_BODY_BYTES, False),  # a body for shared memory
    ],
)
def test_an_idle_server_runs_a_known_program_of_milliseconds_in_the_front(
    cost: int, steps: int, peak: int, document: int, fast: bool
) -> None:
    placement = _known(cost, steps, peak)
    lane = placement.place(_facts(document, idle=True))
    assert lane.fast is fast and lane.affinity == "k"
    if fast:
        assert lane.bounds is IDLE_LANE
    assert not placement.place(_facts(document, idle=False)).fast  # a busy server: a worker


def test_a_program_lowered_to_xla_runs_in_a_worker() -> None:
    assert not _known(FAST_LANE.cost + 1, 10, lowered=True).place(_facts(200_000, True)).fast


TEXT = "t" * 32


def _lifted_text(cost: int, steps: int, lowered: bool = False) -> Placement:
    """A placement told that a graph of TEXT was lifted (by a worker, say)."""
    placement = Placement()
    stats = Stats(graph_id=GRAPH, program_key="k", compute_cost=cost, steps=steps)
    stats.planned_peak_bytes, stats.lowered, stats.text_key = 1 << 20, lowered, TEXT
    placement.learn(stats)
    return placement


def _new_of_text(idle: bool, here: bool, document: int = 20_000) -> Facts:
    return Facts(document, document, None, NEW_MAX_NODES + 200, idle, TEXT, here)


def test_a_new_graph_of_a_lifted_text_is_placed_by_that_program() -> None:
    cheap = _lifted_text(FAST_LANE.cost, FAST_LANE.steps)
    assert cheap.lifted_texts() and not Placement().lifted_texts()
    # The front found where that text's literals are: lifted in the fast lane, busy or not.
    for idle in (False, True):
        lane = cheap.place(_new_of_text(idle, here=True))
        assert lane.fast and lane.bounds is FAST_LANE
    # Not yet: compiled in the front only when the server is idle (once or twice a text).
    lane = cheap.place(_new_of_text(idle=True, here=False))
    assert lane.fast and lane.bounds is LIFTED_LANE and LIFTED_LANE.nodes > NEW_MAX_NODES
    assert cheap.place(_new_of_text(idle=False, here=False)) is WORKER
    # Too large a document for the fast lane, too costly, lowered: a worker.
    assert cheap.place(_new_of_text(False, True, KNOWN_MAX_DOCUMENT_BYTES + 1)) is WORKER
    costly = _lifted_text(IDLE_LANE.cost + 1, 10)
    assert costly.place(_new_of_text(idle=True, here=True)) is WORKER
    lowered = _lifted_text(10, 10, lowered=True)
    assert lowered.place(_new_of_text(idle=True, here=False)) is WORKER
    # Another text: by its nodes, as any new graph.
    other = Facts(20_000, 20_000, None, NEW_MAX_NODES + 200, True, "u" * 32, False)
    assert cheap.place(other) is WORKER
    small = dataclasses.replace(other, nodes=NEW_MAX_NODES, body_bytes=9_000, document_bytes=9_000)
    assert cheap.place(small).fast


# ---------------------------------------------------------------- over HTTP, in process
def _body(n: int, salt: float) -> dict[str, Any]:
    """A JSON body past the 64 KiB the fast lane takes: a worker's, the idle lane's once
    its program is known."""
    x = np.linspace(-1.0, 1.0, n).tolist()
    graph = {
        "nodes": [{"id": "loss", "expr": f"sum(tanh(x * {salt}) * exp(x) @ W)"}],
        "outputs": ["loss"],
    }
    W = np.ones((n, 8)).tolist()
    return {
        "graph": graph,
        "inputs": {
            "x": {"data": x, "dtype": "float64", "requires_grad": True},
            "W": {"data": W, "dtype": "float64"},
        },
    }


async def _front_runs(c: Any) -> float:
    """The programs the front process has found for the requests it ran (its lookups)."""
    text = (await c.get("/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('gradserve_program_lookups_total{role="front"')
    )


async def test_over_http_an_idle_server_answers_a_known_program_in_its_front_process() -> None:
    body = _body(4000, 0.5)
    # (the native tier off: a loaded machine's timings could have it lower the program,
    # whose runs then belong in a worker, as test_a_program_lowered_to_xla_runs_in_a_worker has)
    async with serving(compute_workers=1, xla="off") as (c, _):
        first = strict_json(await c.post("/backward", json=body))
        assert await _front_runs(c) == 0  # (new: a worker compiles it and reports)
        again = strict_json(await c.post("/backward", json=body))
        assert await _front_runs(c) == 1
    assert again["gradients"] == first["gradients"] and again["outputs"] == first["outputs"]


async def test_over_http_a_busy_server_sends_it_to_a_worker() -> None:
    body = _body(4000, 0.25)
    # ~2 s in a worker: 30 matmuls of 600 x 600, chained
    n = 600
    heavy_nodes = [{"id": "m0", "expr": "A @ A"}]
    heavy_nodes += [{"id": f"m{k}", "expr": f"m{k - 1} @ A * 0.001"} for k in range(1, 30)]
    heavy_nodes += [{"id": "s", "expr": "sum(m29)"}]
    heavy = {
        "graph": {"nodes": heavy_nodes, "outputs": ["s"]},
        "inputs": {"A": {"data": (np.eye(n) * 0.5).tolist(), "dtype": "float64"}},
        "no_grad": True,
    }
    async with serving(compute_workers=2, min_compute_workers=2, xla="off") as (c, app):
        strict_json(await c.post("/backward", json=body))  # (known now)
        slow = asyncio.ensure_future(c.post("/forward", json=heavy))
        while app.state.front.admission.active == 0:  # (until it holds its slot)
            await asyncio.sleep(0.01)
            assert not slow.done()
        busy = strict_json(await c.post("/backward", json=body))
        assert not slow.done()  # (the slot was still taken)
        assert await _front_runs(c) == 0
        strict_json(await slow)
        idle = strict_json(await c.post("/backward", json=body))
        assert await _front_runs(c) == 1
    assert busy["gradients"] == idle["gradients"]
