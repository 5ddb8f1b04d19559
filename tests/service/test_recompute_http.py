"""Gradients that fit the memory budget, over HTTP: `recompute` and `memory_budget_bytes` on
/forward, /backward and /plan; what `meta` and /plan report; the 422s."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.workloads import chain_numpy
from tests.support.chains import STEPS, N, chain
from tests.support.in_process import serving
from tests.support.problems import assert_problem, strict_json

pytestmark = pytest.mark.anyio


async def _plain_peak(c: Any) -> int:
    r = await c.post("/plan", json={**chain(), "recompute": "never"})
    return int(strict_json(r)["planned_peak_bytes"])


async def test_a_backward_over_its_budget_recomputes_and_fits_bit_for_bit() -> None:
    async with serving() as (c, _):
        plain = strict_json(await c.post("/backward", json=chain()))
        assert plain["meta"]["recompute"] is None
        budget = plain["meta"]["planned_peak_bytes"] // 3
        r = strict_json(await c.post("/backward", json=chain(memory_budget_bytes=budget)))
    meta = r["meta"]
    assert meta["planned_peak_bytes"] <= budget
    assert meta["peak_bytes"] == meta["planned_peak_bytes"]
    rec = meta["recompute"]
    assert rec["peak_bytes_without"] == plain["meta"]["planned_peak_bytes"]
    assert rec["added_cost"] > 0 and rec["steps"] > 0
    assert meta["compute_cost"] == plain["meta"]["compute_cost"] + rec["added_cost"]
    assert r["outputs"] == plain["outputs"] and r["gradients"] == plain["gradients"]
    loss, grad = chain_numpy(np.linspace(-1.0, 1.0, N), STEPS)
    np.testing.assert_allclose(r["outputs"]["loss"]["data"], loss, rtol=1e-12)
    np.testing.assert_allclose(r["gradients"]["h0"]["data"], grad, rtol=1e-12)


async def test_never_refuses_as_before() -> None:
    async with serving() as (c, _):
        budget = await _plain_peak(c) // 3
        r = await c.post("/backward", json=chain(memory_budget_bytes=budget, recompute="never"))
    p = assert_problem(r, 422, "memory-budget")
    assert p["budget_bytes"] == budget and p["planned_bytes"] > budget


async def test_a_budget_that_not_even_recomputation_fits_names_what_it_needs() -> None:
    async with serving() as (c, _):
        r = await c.post("/backward", json=chain(memory_budget_bytes=4096))
        p = assert_problem(r, 422, "memory-budget", "at least")
        assert p["budget_bytes"] == 4096 and p["planned_bytes"] > 4096
        plan = strict_json(await c.post("/plan", json=chain(memory_budget_bytes=4096)))
    assert plan["admitted"] is False and plan["recompute"] is None
    assert plan["minimum_peak_bytes"] == p["planned_bytes"]


async def test_a_request_may_ask_for_less_memory_never_more() -> None:
    async with serving(
        memory_budget_bytes=10 << 20,
        no_grad_memory_budget_bytes=1 << 20,
        inflight_memory_bytes=64 << 20,
    ) as (c, _):
        for path, body, server in (
            ("/backward", chain(), 10 << 20),
            ("/forward", {**chain(), "no_grad": True}, 1 << 20),
            ("/plan", chain(), 10 << 20),
        ):
            r = await c.post(path, json={**body, "memory_budget_bytes": server + 1})
            p = assert_problem(r, 422, "invalid-request", "may ask for less")
            assert p["errors"][0]["loc"] == ["memory_budget_bytes"]
        r = await c.post("/forward", json={**chain(), "no_grad": True, "memory_budget_bytes": 1000})
        assert_problem(r, 422, "memory-budget")
        for bad in (0, -1, "1000", 1.5):
            r = await c.post("/backward", json={**chain(), "memory_budget_bytes": bad})
            assert_problem(r, 422, "invalid-request")
        r = await c.post("/backward", json={**chain(), "recompute": "sometimes"})
        assert_problem(r, 422, "invalid-request")


async def test_the_plan_shows_both_programs_and_its_figures_are_the_runs() -> None:
    async with serving() as (c, _):
        budget = await _plain_peak(c) // 3
        plan = strict_json(await c.post("/plan", json=chain(memory_budget_bytes=budget)))
        run = strict_json(await c.post("/backward", json=chain(memory_budget_bytes=budget)))
    assert plan["admitted"] is True and plan["memory_budget_bytes"] == budget
    assert plan["planned_peak_bytes"] == run["meta"]["planned_peak_bytes"] <= budget
    assert plan["compute_cost"] == run["meta"]["compute_cost"]
    rec = plan["recompute"]
    assert {k: rec[k] for k in ("peak_bytes_without", "added_cost", "steps")} == run["meta"][
        "recompute"
    ]
    kinds = [n["kind"] for n in plan["nodes"]]
    assert kinds.count("recompute") == rec["steps"] > 0
    without = rec["nodes_without"]
    assert "recompute" not in {n["kind"] for n in without}
    assert len(without) == len(plan["nodes"]) - rec["steps"]


async def test_programs_for_two_budgets_are_two_programs() -> None:
    async with serving() as (c, _):
        plain_peak = await _plain_peak(c)
        answers = [
            strict_json(await c.post("/backward", json=chain(memory_budget_bytes=b)))
            for b in (plain_peak // 2, plain_peak // 4, plain_peak // 2)
        ]
    peaks = [a["meta"]["planned_peak_bytes"] for a in answers]
    assert peaks[0] <= plain_peak // 2 and peaks[1] <= plain_peak // 4 and peaks[2] == peaks[0]
    assert [a["meta"]["program"] for a in answers] == ["compiled", "compiled", "process"]
    assert answers[0]["gradients"] == answers[1]["gradients"]
