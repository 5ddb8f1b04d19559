"""`"detect_anomaly": true` over HTTP: a 422 `non-finite` problem naming the node, phase
and primitive, from the front process's fast lane and from a compute worker alike (the
problem crosses the process boundary whole); a clean run answers what a plain one does,
and says why it was interpreted; without the flag, NaN and inf flow as in PyTorch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.server import Server, start_server, stop_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NON_FINITE = "urn:gradserve:problem:non-finite"
BIG = 20_000  # values: a body the front process sends to a worker


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("anomaly"))
    yield s
    stop_server(s)


def post(server: Server, path: str, body: dict[str, Any], flag: bool) -> httpx.Response:
    return httpx.post(server.base + path, json={**body, "detect_anomaly": flag}, timeout=60)


def log_of(values: list[float]) -> dict[str, Any]:
    return {
        "graph": {
            "nodes": [{"id": "l", "expr": "log(x)"}, {"id": "y", "expr": "sum(l)"}],
            "outputs": ["y"],
        },
        "inputs": {"x": {"data": values, "dtype": "float64", "requires_grad": True}},
    }


@pytest.mark.parametrize("size", [3, BIG], ids=["fast lane", "worker"])
def test_a_forward_nan_is_a_422_naming_node_phase_and_op(server: Server, size: int) -> None:
    values = [1.0] * size
    values[1] = values[2] = -1.0
    plain = post(server, "/backward", log_of(values), False)
    assert plain.status_code == 200 and plain.json()["outputs"]["y"]["data"] == "NaN"
    r = post(server, "/backward", log_of(values), True)
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert (problem["type"], problem["node"], problem["phase"], problem["op"]) == (
        NON_FINITE,
        "l",
        "forward",
        "log",
    ), problem
    assert f"2 of {size} values of 'log' are NaN or infinite" in problem["detail"]


def test_a_backward_nan_names_the_forward_primitive(server: Server) -> None:
    body = {
        "graph": {"nodes": [{"id": "z", "expr": "sqrt(x) * 0"}], "outputs": ["z"]},
        "inputs": {"x": {"data": 0.0, "requires_grad": True}},
    }
    plain = post(server, "/backward", body, False).json()
    assert plain["gradients"]["x"]["data"] == "NaN"  # as PyTorch: 0 * inf
    problem = post(server, "/backward", body, True).json()
    assert (problem["status"], problem["node"], problem["phase"], problem["op"]) == (
        422,
        "z",
        "backward",
        "sqrt",
    ), problem


def test_a_clean_run_answers_as_a_plain_one(server: Server) -> None:
    x = np.random.default_rng(3).standard_normal(BIG).tolist()
    body = {
        "graph": {"nodes": [{"id": "y", "expr": "sum(tanh(x) * x)"}], "outputs": ["y"]},
        "inputs": {"x": {"data": x, "dtype": "float64", "requires_grad": True}},
    }
    plain, watched = (post(server, "/backward", body, flag).json() for flag in (False, True))
    assert watched["outputs"] == plain["outputs"] and watched["gradients"] == plain["gradients"]
    assert watched["meta"]["tier_reason"] == "detect_anomaly: interpreted, every step looked at"


def test_the_flag_is_a_json_boolean(server: Server) -> None:
    body = {**log_of([1.0]), "detect_anomaly": "true"}
    r = httpx.post(server.base + "/forward", json=body, timeout=60)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["detect_anomaly"], r.text
