"""Binary bodies (the Open Inference Protocol's binary tensor extension) and graphs sent
once (`graph_id`), over HTTP in process: round trips of every dtype through every
encoding, each framing error's problem (and a healthy server after it), the body limit on
the framed body, and the graph-id cache's hit, miss, eviction and stability."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.in_process import serving
from tests.support.problems import assert_problem, strict_json

pytestmark = pytest.mark.anyio

HEADER = "Inference-Header-Content-Length"
IDENTITY = {"nodes": [], "outputs": ["x"]}
DOUBLE = {"nodes": [{"id": "y", "expr": "x * 2 + 1"}], "outputs": ["y"]}
RNG = np.random.default_rng(11)


def framed(header: dict[str, Any], *tail: bytes) -> tuple[bytes, dict[str, str]]:
    """A binary body and its headers."""
    head = json.dumps(header).encode()
    return head + b"".join(tail), {
        HEADER: str(len(head)),
        "Content-Type": "application/octet-stream",
    }


def binary(array: np.ndarray, **extra: Any) -> tuple[dict[str, Any], bytes]:
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "binary_data_size": len(raw),
        **extra,
    }, raw


def unframe(response: httpx.Response) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A binary response's header and its tensors (outputs, then gradients, by name)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    n = int(response.headers[HEADER])
    header = json.loads(response.content[:n])
    arrays: dict[str, np.ndarray] = {}
    at = n
    for where in ("outputs", "gradients"):
        for name, t in header.get(where, {}).items():
            size = t["binary_data_size"]
            arrays[f"{where}.{name}"] = np.frombuffer(
                response.content,
                dtype=np.dtype(t["dtype"]).newbyteorder("<"),
                count=size // np.dtype(t["dtype"]).itemsize,
                offset=at,
            ).reshape(t["shape"])
            at += size
    assert at == len(response.content)
    return header, arrays


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return RNG.standard_normal(shape) > 0
    if dtype.startswith("int"):
        return RNG.integers(-1000, 1000, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def decoded(t: dict[str, Any]) -> np.ndarray:
    """A JSON or base64 response tensor."""
    import base64

    if "b64" in t:
        return np.frombuffer(
            base64.b64decode(t["b64"]), dtype=np.dtype(t["dtype"]).newbyteorder("<")
        ).reshape(t["shape"])
    return np.array(t["data"], dtype=t["dtype"]).reshape(t["shape"])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3)])
async def test_every_dtype_round_trips_through_every_encoding(
    client: httpx.AsyncClient, dtype: str, shape: tuple[int, ...]
) -> None:
    x = sample(dtype, shape)
    spec, raw = binary(x)
    for encoding in ("binary", "json", "base64"):
        body, headers = framed(
            {"graph": IDENTITY, "inputs": {"x": spec}, "encoding": encoding}, raw
        )
        r = await client.post("/forward", content=body, headers=headers)
        if encoding == "binary":
            header, arrays = unframe(r)
            got = arrays["outputs.x"]
            assert header["outputs"]["x"]["binary_data_size"] == x.nbytes
        else:
            assert r.status_code == 200, r.text
            got = decoded(strict_json(r)["outputs"]["x"])
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got, x)


async def test_mixed_inputs_and_binary_gradients(client: httpx.AsyncClient) -> None:
    """Some inputs binary, some JSON; grad_outputs binary too, listed before the inputs
    (the tail follows the header's order); gradients come back binary."""
    w, x = RNG.standard_normal((3, 4)), RNG.standard_normal(4)
    g = RNG.standard_normal(3)
    w_spec, w_raw = binary(w, requires_grad=True)
    g_spec, g_raw = binary(g)
    header = {
        "grad_outputs": {"y": g_spec},
        "graph": {"nodes": [{"id": "y", "expr": "tanh(w @ x)"}], "outputs": ["y"]},
        "inputs": {"b": {"data": 1.0}, "w": w_spec, "x": {"data": x.tolist(), "dtype": "float64"}},
        "encoding": "binary",
    }
    body, headers = framed(header, g_raw, w_raw)
    _, arrays = unframe(await client.post("/backward", content=body, headers=headers))
    y = np.tanh(w @ x)
    np.testing.assert_allclose(arrays["outputs.y"], y, rtol=1e-15)
    np.testing.assert_allclose(arrays["gradients.w"], np.outer(g * (1 - y * y), x), rtol=1e-14)
    # The same body with JSON content types is read the same way.
    r = await client.post(
        "/backward", content=body, headers={**headers, "Content-Type": "application/json"}
    )
    assert r.status_code == 200


def _frames(x: np.ndarray) -> dict[str, tuple[bytes, dict[str, str], int, str, str]]:
    """Malformed binary bodies: (body, headers, status, problem type, text in detail)."""
    spec, raw = binary(x)
    ok_header = {"graph": DOUBLE, "inputs": {"x": spec}}
    ok, headers = framed(ok_header, raw)
    head = len(ok) - len(raw)
    return {
        "short tail": (
            ok[:-4],
            headers,
            400,
            "malformed-body",
            "inputs['x'] has binary_data_size 32, but the binary tail has 28 bytes",
        ),
        "long tail": (ok + b"\0" * 5, headers, 400, "malformed-body", "5 bytes after the last"),
        "header past the body": (
            ok,
            {**headers, HEADER: str(len(ok) + 1)},
            400,
            "malformed-body",
            "past the body",
        ),
        "header not a count": (ok, {**headers, HEADER: "12x"}, 400, "malformed-body", "byte count"),
        "header not JSON": (
            b"{nope" + raw,
            {**headers, HEADER: "5"},
            400,
            "malformed-json",
            "not valid JSON",
        ),
        "header cut short": (
            ok,
            {**headers, HEADER: str(head - 1)},
            400,
            "malformed-json",
            "not valid JSON",
        ),
        "size not dtype x shape": (
            framed({"graph": DOUBLE, "inputs": {"x": {**spec, "shape": [3]}}}, raw)[0],
            headers,
            422,
            "tensor-data",
            "32 bytes do not hold shape [3] of float64",
        ),
        "binary tensor in a JSON body": (
            json.dumps(ok_header).encode(),
            {"Content-Type": "application/json"},
            400,
            "malformed-body",
            "the body is not binary",
        ),
        "octet-stream without the header": (
            ok,
            {"Content-Type": "application/octet-stream"},
            415,
            "unsupported-media-type",
            "octet-stream",
        ),
    }


@pytest.mark.parametrize("case", list(_frames(np.zeros(4))))
async def test_malformed_framing_gets_its_problem_and_the_server_stays_up(
    client: httpx.AsyncClient, case: str
) -> None:
    x = np.arange(4.0)
    body, headers, status, slug, text = _frames(x)[case]
    r = await client.post("/forward", content=body, headers=headers)
    problem = assert_problem(r, status, slug, text)
    if slug == "malformed-body" and case.endswith("tail"):
        assert problem["errors"][0]["loc"][0] in ("inputs", "body")
    good, good_headers = framed(
        {"graph": DOUBLE, "inputs": {"x": binary(x)[0]}, "encoding": "binary"}, binary(x)[1]
    )
    _, arrays = unframe(await client.post("/forward", content=good, headers=good_headers))
    np.testing.assert_array_equal(arrays["outputs.y"], x * 2 + 1)


async def test_a_header_of_other_digits_is_not_a_count(client: httpx.AsyncClient) -> None:
    """ "²" (a latin-1 header byte) is a digit to str.isdigit(), but not to int(): it is
    refused as any other value that is not a count, not with a 500."""
    body, headers = framed({"graph": IDENTITY, "inputs": {"x": 1.0}})
    r = await client.post(
        "/forward",
        content=body,
        headers={**headers, HEADER: "\N{SUPERSCRIPT TWO}".encode("latin-1")},
    )
    assert_problem(r, 400, "malformed-body", "byte count")


async def test_the_body_limit_applies_to_the_whole_framed_body() -> None:
    x = np.zeros(1000)
    spec, raw = binary(x)
    body, headers = framed({"graph": DOUBLE, "inputs": {"x": spec}}, raw)
    async with serving(max_body_bytes=len(body) - 1) as (c, _):
        assert_problem(
            await c.post("/forward", content=body, headers=headers), 413, "body-too-large"
        )
    async with serving(max_body_bytes=len(body)) as (c, _):
        assert (await c.post("/forward", content=body, headers=headers)).status_code == 200


# ------------------------------------------------------------------ graph_id
async def _forward(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/forward", json={"inputs": {"x": [1.0, 2.0]}, **body})


async def test_graph_id_hit_miss_and_the_graph_with_its_id(client: httpx.AsyncClient) -> None:
    first = strict_json(await _forward(client, graph=DOUBLE))
    graph_id = first["meta"]["graph_id"]
    again = strict_json(await _forward(client, graph_id=graph_id))
    assert again["outputs"] == first["outputs"] and again["meta"]["graph_id"] == graph_id
    # Another signature of the same graph compiles from the held graph.
    other = strict_json(
        await client.post("/forward", json={"graph_id": graph_id, "inputs": {"x": [[3.0]]}})
    )
    assert other["outputs"]["y"]["data"] == [[7.0]]
    assert_problem(
        await _forward(client, graph_id="0" * 32), 409, "graph-unknown", "send the graph itself"
    )
    # Both: the id must be the graph's.
    assert (await _forward(client, graph=DOUBLE, graph_id=graph_id)).status_code == 200
    problem = assert_problem(
        await _forward(client, graph=DOUBLE, graph_id="0" * 32),
        422,
        "invalid-request",
        "is not the id of the graph sent with it",
    )
    assert problem["errors"][0]["loc"] == ["graph_id"]
    assert_problem(
        await client.post("/forward", json={"inputs": {}}),
        422,
        "invalid-request",
        "'graph' or 'graph_id'",
    )


async def test_graph_ids_ignore_key_order_and_spacing_and_not_the_data(
    client: httpx.AsyncClient,
) -> None:
    a = strict_json(await _forward(client, graph=DOUBLE))["meta"]["graph_id"]
    reordered = {"outputs": ["y"], "nodes": [{"expr": "x * 2 + 1", "id": "y"}]}
    body = json.dumps({"inputs": {"x": [5.0]}, "graph": reordered}, indent=3).encode()
    b = strict_json(await client.post("/forward", content=body))["meta"]["graph_id"]
    assert a == b
    changed = {"nodes": [{"id": "y", "expr": "x * 2 + 2"}], "outputs": ["y"]}
    assert strict_json(await _forward(client, graph=changed))["meta"]["graph_id"] != a


def test_graph_ids_are_stable_across_processes() -> None:
    """The id is a function of the graph alone: another interpreter (another hash seed)
    computes the same one."""
    script = (
        "import json, sys; from gradserve.wire.graph_id import graph_key; "
        "print(graph_key(json.loads(sys.argv[1])))"
    )
    ids = {
        subprocess.run(
            [sys.executable, "-c", script, json.dumps(DOUBLE)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=".",
        ).stdout.strip()
        for seed in ("1", "2")
    }
    from gradserve.wire.graph_id import graph_key

    assert ids == {graph_key(DOUBLE)}


async def test_graph_cache_evicts_by_bytes_and_counts_it() -> None:
    """Without a program store, a graph evicted from the process's cache is unknown."""
    graphs = [{"nodes": [{"id": "y", "expr": f"x * {k}"}], "outputs": ["y"]} for k in (2, 3)]
    async with serving(graph_cache_bytes=1500, program_store_bytes=0) as (c, _):
        # (room for one 1-node graph: 1.2 KB)
        ids = [strict_json(await _forward(c, graph=g))["meta"]["graph_id"] for g in graphs]
        # (The compiled program of a signature already run still serves the id: a new
        # signature needs the graph itself.)
        assert (await _forward(c, graph_id=ids[0])).status_code == 200
        other = {"x": [[1.0, 2.0]]}
        assert_problem(
            await c.post("/forward", json={"graph_id": ids[0], "inputs": other}),
            409,
            "graph-unknown",
        )
        assert (
            await c.post("/forward", json={"graph_id": ids[1], "inputs": other})
        ).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert "gradserve_graph_cache_evictions_total 1.0" in metrics


async def test_a_graph_evicted_from_the_process_is_found_in_the_store() -> None:
    graphs = [{"nodes": [{"id": "y", "expr": f"x * {k}"}], "outputs": ["y"]} for k in (2, 3)]
    async with serving(graph_cache_bytes=1500) as (c, app):
        ids = [strict_json(await _forward(c, graph=g))["meta"]["graph_id"] for g in graphs]
        assert len(app.state.front.compute.programs.graphs) == 1
        r = await c.post("/forward", json={"graph_id": ids[0], "inputs": {"x": [[1.0, 2.0]]}})
        assert strict_json(r)["outputs"]["y"]["data"] == [[2.0, 4.0]]


async def test_a_large_binary_body_through_a_worker_process(client: httpx.AsyncClient) -> None:
    """Past the inline size, the body and its framing go to a worker, and the binary
    answer comes back through shared memory."""
    x = RNG.standard_normal(300_000)
    spec, raw = binary(x)
    body, headers = framed({"graph": DOUBLE, "inputs": {"x": spec}, "encoding": "binary"}, raw)
    _, arrays = unframe(await client.post("/forward", content=body, headers=headers))
    np.testing.assert_array_equal(arrays["outputs.y"], x * 2 + 1)
    assert_problem(
        await client.post("/forward", content=body[:-8], headers=headers),
        400,
        "malformed-body",
        "bytes left",
    )


async def test_a_small_request_by_id_finds_a_graph_that_a_worker_holds() -> None:
    """A large first request registers its graph in a worker; a small request by id (which
    would compute in the front process) goes to the worker rather than answering 409."""
    x = RNG.standard_normal(300_000)
    spec, raw = binary(x)
    graph = {"nodes": [{"id": "y", "expr": "x * 3 - 1"}], "outputs": ["y"]}
    body, headers = framed({"graph": graph, "inputs": {"x": spec}, "encoding": "binary"}, raw)
    async with serving(compute_workers=1) as (client, _):  # (one worker: the one that holds it)
        header, _ = unframe(await client.post("/forward", content=body, headers=headers))
        r = await client.post(
            "/forward", json={"graph_id": header["meta"]["graph_id"], "inputs": {"x": [1.0, 2.0]}}
        )
    assert r.status_code == 200 and strict_json(r)["outputs"]["y"]["data"] == [2.0, 5.0]


async def test_empty_json_data_takes_its_dtype_and_binary_answers_are_aligned(
    client: httpx.AsyncClient,
) -> None:
    for dtype in ("bool", "int32", "int64", "float16", "float64"):
        r = await client.post(
            "/forward",
            json={
                "graph": IDENTITY,
                "inputs": {"x": {"data": [], "dtype": dtype}},
                "encoding": "binary",
            },
        )
        _, arrays = unframe(r)
        assert arrays["outputs.x"].dtype == np.dtype(dtype) and arrays["outputs.x"].size == 0
        assert int(r.headers[HEADER]) % 8 == 0  # the tensors start 8-byte aligned
