"""The HTTP API in process: httpx on the ASGI app, a fresh app per test."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openapi_spec_validator
import pytest

import gradserve.engine as engine
from gradserve.engine.rules import TRANSFORMS
from gradserve.service.app import create_app
from gradserve.service.metrics import Metrics
from gradserve.service.middleware import TENANT, Gateway, tenant_id
from gradserve.service.settings import Settings
from tests.support.in_process import serving
from tests.support.problems import assert_problem, strict_json
from tests.support.seeds import SEED_EXPR, SEED_NO_GRAD, SEED_OP

pytestmark = pytest.mark.anyio


def graph(expr: str, *outputs: str) -> dict[str, Any]:
    return {"nodes": [{"id": "z", "expr": expr}], "outputs": list(outputs or ["z"])}


# ----------------------------------------------------------------------- seed examples
@pytest.mark.parametrize("body", [SEED_OP, SEED_EXPR], ids=["op", "expr"])
async def test_seed_backward(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    r = await client.post("/backward", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    out = strict_json(r)
    assert out["outputs"]["z"] == {
        "dtype": "float32",
        "shape": [],
        "data": -5.0,
        "requires_grad": True,
        "grad_fn": "MulBackward",
    }
    assert out["gradients"] == {
        "x": {"dtype": "float32", "shape": [], "data": 4.0},
        "y": {"dtype": "float32", "shape": [], "data": -6.0},
    }
    meta = out["meta"]
    assert meta["device"] == "cpu" and meta["no_grad"] is False and meta["nodes"] == 3
    assert meta["peak_bytes"] > 0 and {"forward", "backward"} <= set(meta["timings_ms"])


async def test_seed_no_grad(client: httpx.AsyncClient) -> None:
    r = await client.post("/forward", json=SEED_NO_GRAD)
    assert r.status_code == 200, r.text
    out = strict_json(r)
    assert out["outputs"]["B"] == {
        "dtype": "float32",
        "shape": [1],
        "data": [41.0],
        "requires_grad": False,
        "grad_fn": None,
    }
    # A still requires grad (an input), was never the result of an op, and gets no gradient.
    assert out["outputs"]["A"]["requires_grad"] is True
    assert out["outputs"]["A"]["grad_fn"] is None
    assert "gradients" not in out
    assert out["meta"]["no_grad"] is True and out["meta"]["nodes"] == 2


async def test_forward_with_grad_records_grad_fn(client: httpx.AsyncClient) -> None:
    body = {**SEED_NO_GRAD, "no_grad": False}
    out = strict_json(await client.post("/forward", json=body))
    assert out["outputs"]["B"]["requires_grad"] is True
    assert out["outputs"]["B"]["grad_fn"] == "AddBackward"
    assert "gradients" not in out


async def test_no_grad_plans_less_than_grad(client: httpx.AsyncClient) -> None:
    body = {
        "graph": graph("sum(exp(tanh(sin(x) * 2) + 1))"),
        "inputs": {"x": {"data": [0.5] * 1000, "requires_grad": True}},
    }
    grad = strict_json(await client.post("/forward", json=body))["meta"]
    lean = strict_json(await client.post("/forward", json={**body, "no_grad": True}))["meta"]
    assert lean["planned_peak_bytes"] < grad["planned_peak_bytes"]
    assert lean["peak_bytes"] < grad["peak_bytes"]


async def test_backward_grad_outputs_and_unused_input(client: httpx.AsyncClient) -> None:
    body = {
        "graph": graph("x * 3"),
        "inputs": {
            "x": {"data": [1.0, 2.0], "requires_grad": True},
            "u": {"data": [[1.0, 2.0]], "dtype": "float64", "requires_grad": True},
        },
        "grad_outputs": {"z": [1.0, 10.0]},
    }
    out = strict_json(await client.post("/backward", json=body))
    assert out["gradients"]["x"]["data"] == [3.0, 30.0]
    # An input the outputs do not depend on gets zeros of its own shape and dtype.
    assert out["gradients"]["u"] == {"dtype": "float64", "shape": [1, 2], "data": [[0.0, 0.0]]}


async def test_grad_mode_never_leaks_between_concurrent_requests() -> None:
    async def one(client: httpx.AsyncClient, i: int) -> None:
        no_grad = i % 2 == 0
        r = await client.post("/forward", json={**SEED_NO_GRAD, "no_grad": no_grad})
        b = strict_json(r)["outputs"]["B"]
        assert b["data"] == [41.0]
        assert b["requires_grad"] is (not no_grad)
        assert b["grad_fn"] == (None if no_grad else "AddBackward")

    async with serving(max_concurrency=16) as (client, _):
        await asyncio.gather(*(one(client, i) for i in range(16)))


# ----------------------------------------------------------------------- tensor codec
async def test_tensor_forms(client: httpx.AsyncClient) -> None:
    raw = np.arange(6, dtype="<f8").reshape(2, 3)
    body = {
        "graph": {"nodes": [], "outputs": ["bare", "nested", "flat", "b64", "i", "flag"]},
        "inputs": {
            "bare": 2.5,
            "nested": [[1, 2], [3, 4]],
            "flat": {"data": [1, 2, 3, 4, 5, 6], "shape": [2, 3], "dtype": "float16"},
            "b64": {
                "b64": base64.b64encode(raw.tobytes()).decode(),
                "dtype": "float64",
                "shape": [2, 3],
            },
            "i": {"data": [1.0, 2.0], "dtype": "int32"},
            "flag": [True, False],
        },
    }
    out = strict_json(await client.post("/forward", json=body))["outputs"]
    assert out["bare"] | {} == {
        "dtype": "float32",
        "shape": [],
        "data": 2.5,
        "requires_grad": False,
        "grad_fn": None,
    }
    assert (out["nested"]["dtype"], out["nested"]["data"]) == ("int64", [[1, 2], [3, 4]])
    assert out["flat"]["dtype"] == "float16" and out["flat"]["shape"] == [2, 3]
    assert out["flat"]["data"] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert out["b64"]["data"] == raw.tolist()
    assert (out["i"]["dtype"], out["i"]["data"]) == ("int32", [1, 2])
    assert (out["flag"]["dtype"], out["flag"]["data"]) == ("bool", [True, False])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "bool"])
async def test_base64_round_trip(client: httpx.AsyncClient, dtype: str) -> None:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    le = array.astype(np.dtype(dtype).newbyteorder("<"))
    body = {
        "graph": {"nodes": [], "outputs": ["x"]},
        "inputs": {
            "x": {"b64": base64.b64encode(le.tobytes()).decode(), "dtype": dtype, "shape": [3, 4]}
        },
        "encoding": "base64",
    }
    out = strict_json(await client.post("/forward", json=body))["outputs"]["x"]
    assert "data" not in out
    back = np.frombuffer(base64.b64decode(out["b64"]), dtype=le.dtype).reshape(out["shape"])
    np.testing.assert_array_equal(back, array)


async def test_base64_applies_to_gradients(client: httpx.AsyncClient) -> None:
    out = strict_json(await client.post("/backward", json={**SEED_EXPR, "encoding": "base64"}))
    grad = out["gradients"]["y"]
    assert np.frombuffer(base64.b64decode(grad["b64"]), "<f4").item() == -6.0


async def test_float32_json_uses_shortest_digits(client: httpx.AsyncClient) -> None:
    body = {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": [0.1, 1 / 3]}}
    r = await client.post("/forward", json=body)
    assert b"[0.1,0.33333334]" in r.content


async def test_non_finite_values_are_strict_json(client: httpx.AsyncClient) -> None:
    # Non-finite values travel as strings, in lists and alone, both ways.
    content = (
        b'{"graph": {"nodes": [{"id": "z", "expr": "x * 1"}, {"id": "w", "expr": "s + 0"}],'
        b' "outputs": ["z", "w"]},'
        b' "inputs": {"x": [1.5, "NaN", "Infinity", "-Infinity"], "s": "Infinity"}}'
    )
    r = await client.post("/forward", content=content)
    out = strict_json(r)["outputs"]
    assert out["z"]["data"] == [1.5, "NaN", "Infinity", "-Infinity"]
    assert out["w"]["data"] == "Infinity"


@pytest.mark.parametrize(
    ("token", "column"),
    [
        (b"NaN", 75),
        (b"Infinity", 75),
        (b"-Infinity", 76),  # where the parser stopped
    ],
)
async def test_bare_non_finite_tokens_are_malformed_json(
    client: httpx.AsyncClient, token: bytes, column: int
) -> None:
    # Requests are strict JSON (RFC 8259) too: the bare tokens Python's json writes are
    # refused with where they are, and the strings to use instead.
    content = (
        b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": {"data": [1.5, '
        + token
        + b"]}}}"
    )
    r = await client.post("/forward", content=content)
    p = assert_problem(r, 400, "malformed-json", "NaN, Infinity and -Infinity are not JSON")
    assert f"line 1 column {column}" in p["detail"]
    assert '"NaN", "Infinity" and "-Infinity"' in p["detail"]
    assert p["errors"] == [
        {"loc": [], "msg": p["detail"].removeprefix("the body is not valid JSON: ")}
    ]


@pytest.mark.parametrize(
    "content",
    [
        b'{"graph": {"nodes": [{"id": "z", "op": "add", "args": ["x", NaN]}], "outputs": ["z"]},'
        b' "inputs": {"x": 1.0}}',  # a number literal argument
        b'{"graph": {"nodes": [{"id": "z", "op": "clamp", "args": ["x"],'
        b' "attrs": {"min": -Infinity}}], "outputs": ["z"]}, "inputs": {"x": 1.0}}',  # an attribute
        b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": Infinity}}',  # a bare scalar
        b'{"graph": {"nodes": [], "outputs": ["x"]},'
        b' "inputs": {"x": {"data": [1], "shape": [NaN]}}}',
        b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": 1.0}, "nope": NaN}',
    ],
)
async def test_bare_tokens_are_refused_wherever_they_are(
    client: httpx.AsyncClient, content: bytes
) -> None:
    # Before any schema check: a field that is no number, or no field at all, still says 400.
    assert_problem(
        await client.post("/backward", content=content), 400, "malformed-json", "not JSON numbers"
    )


async def test_non_finite_words_inside_strings_are_fine(client: httpx.AsyncClient) -> None:
    # Ids that contain the words, and a literal past the float range (valid JSON: it reads
    # as infinity, as in Python's json and torch.tensor), are not bare tokens.
    content = (
        b'{"graph": {"nodes": [{"id": "NaN", "expr": "Infinity_x * 1e400"}],'
        b' "outputs": ["NaN"]}, "inputs": {"Infinity_x": [1.0, "-Infinity"]}}'
    )
    r = await client.post("/forward", content=content)
    assert r.status_code == 200, r.text
    assert strict_json(r)["outputs"]["NaN"]["data"] == ["Infinity", "-Infinity"]


async def test_other_malformed_json_is_not_blamed_on_tokens(client: httpx.AsyncClient) -> None:
    p = assert_problem(
        await client.post("/forward", content=b'{"graph": [1, 2,]}'),
        400,
        "malformed-json",
        "trailing comma at line 1 column 17",
    )
    assert "NaN" not in p["detail"]


async def test_non_finite_gradient_is_a_string(client: httpx.AsyncClient) -> None:
    body = {"graph": graph("sqrt(x)"), "inputs": {"x": {"data": 0.0, "requires_grad": True}}}
    out = strict_json(await client.post("/backward", json=body))
    assert out["gradients"]["x"]["data"] == "Infinity"


# ----------------------------------------------------------------------- discovery
async def test_ops_catalog(client: httpx.AsyncClient) -> None:
    r = await client.get("/ops")
    assert r.status_code == 200
    ops = {op["name"]: op for op in strict_json(r)["ops"]}
    assert ops == {name: op.describe() for name, op in [*engine.OPS.items(), *TRANSFORMS.items()]}
    for name in ["add", "matmul", "einsum", "log_softmax", "scatter_add", "arange", "detach"]:
        assert name in ops
    assert set(ops["sum"]) == {
        "name",
        "group",
        "args",
        "variadic",
        "attrs",
        "differentiable",
        "doc",
    }
    assert ops["sum"]["attrs"]["keepdim"] == {"type": "bool", "default": False, "required": False}


async def test_devices(client: httpx.AsyncClient) -> None:
    body = strict_json(await client.get("/devices"))
    assert body["default"] == "cpu"
    assert body["devices"][0] == {"name": "cpu", "kind": "cpu"}
    assert [d["name"] for d in body["devices"]] == engine.available_devices()


async def test_health_and_readiness() -> None:
    app = create_app(Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        assert_problem(await c.get("/readyz"), 503, "not-ready")  # lifespan has not run
    async with serving() as (c, _):
        assert (await c.get("/readyz")).json() == {"status": "ready"}


async def test_metrics(client: httpx.AsyncClient) -> None:
    await client.post("/backward", json=SEED_OP)
    await client.post("/forward", json=SEED_NO_GRAD)
    await client.post("/forward", content=b"{")
    text = (await client.get("/metrics")).text
    for line in [
        'gradserve_requests_total{method="POST",route="/backward",status="200"} 1.0',
        'gradserve_requests_total{method="POST",route="/forward",status="400"} 1.0',
        'gradserve_request_duration_seconds_count{method="POST",route="/forward"} 2.0',
        'gradserve_planned_peak_bytes_count{path="no_grad"} 1.0',
        'gradserve_peak_bytes_count{path="grad"} 1.0',
        'gradserve_rejections_total{reason="queue_full"} 0.0',
        'gradserve_rejections_total{reason="queue_timeout"} 0.0',
        "gradserve_requests_in_flight 1.0",  # this scrape
        "gradserve_computations_in_flight 0.0",
        "gradserve_queue_length 0.0",
        "gradserve_queue_wait_seconds_count 0.0",
        "gradserve_compute_workers 1.0",  # the minimum, warm from the start
        'gradserve_compute_worker_exits_total{reason="died"} 0.0',
    ]:
        assert line in text, line
    assert 'gradserve_request_bytes_total{route="/backward"}' in text
    assert 'gradserve_response_bytes_total{route="/backward"}' in text


async def test_docs_are_served_without_a_cdn(client: httpx.AsyncClient) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    for asset in [
        "/static-offline-docs/swagger-ui-bundle.js",
        "/static-offline-docs/swagger-ui.css",
    ]:
        assert asset in page.text
        r = await client.get(asset)
        assert r.status_code == 200 and len(r.content) > 10_000
    spec = strict_json(await client.get("/openapi.json"))
    body = spec["paths"]["/forward"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ForwardRequest"}
    assert "ForwardRequest" in spec["components"]["schemas"]


async def test_openapi_document_is_valid(client: httpx.AsyncClient) -> None:
    openapi_spec_validator.validate(strict_json(await client.get("/openapi.json")))


# ----------------------------------------------------------------------- request ids and logs
async def test_request_id_echoed_or_generated(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gradserve.access"):
        r = await client.get("/healthz", headers={"X-Request-ID": "req-42"})
        assert r.headers["x-request-id"] == "req-42"
        generated = (await client.get("/healthz")).headers["x-request-id"]
        assert len(generated) == 32
        # An id unfit for a log line is replaced, not echoed.
        bad = await client.get("/healthz", headers={"X-Request-ID": "a b\tc"})
        assert bad.headers["x-request-id"] != "a b\tc"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gradserve.access"]
    assert any(
        line.startswith("req-42 ") and '"GET /healthz HTTP/1.1" 200' in line for line in lines
    )
    assert any(line.startswith(generated) for line in lines)


# ----------------------------------------------------------------------- the error table
HUGE = "q" * 5_000_000


@pytest.mark.parametrize(
    "body",
    [
        {
            "graph": {"nodes": [{"id": HUGE, "op": "nope", "args": ["x"]}], "outputs": [HUGE]},
            "inputs": {"x": 1.0},
        },
        {
            "graph": {"nodes": [{"id": HUGE, "expr": "x +"}], "outputs": [HUGE]},
            "inputs": {"x": 1.0},
        },
        {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": 1.0, HUGE: [1, "oops"]}},
        {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": {"data": HUGE}}},
        {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": 1.0}, HUGE: 1},
        {
            "graph": {
                "nodes": [{"id": f"n{i}", "op": "nope"} for i in range(100)],
                "outputs": ["x"],
            },
            "inputs": {"x": 1.0},
            **{f"{HUGE[:100_000]}{i}": 1 for i in range(50)},
        },
    ],
    ids=["node-id", "expr-node-id", "input-name", "string-data", "unknown-field", "many-errors"],
)
async def test_errors_do_not_echo_huge_strings(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    # A 5 MB id once made a 15 MB problem: every string echoed is capped, with its length.
    r = await client.post("/forward", json=body)
    assert 400 <= r.status_code < 500
    p = assert_problem(r, r.status_code, strict_json(r)["type"].rpartition(":")[2])
    assert len(r.content) < 10_000, r.content[:300]
    assert "characters)" in r.text
    assert len(p.get("errors", [])) <= 20


async def test_400_malformed_json(client: httpx.AsyncClient) -> None:
    p = assert_problem(
        await client.post("/forward", content=b'{"graph": '),
        400,
        "malformed-json",
        "not valid JSON",
    )
    assert p["errors"][0]["loc"] == []


async def test_400_empty_body(client: httpx.AsyncClient) -> None:
    assert_problem(await client.post("/forward"), 400, "malformed-json", "empty")


async def test_400_too_deep(client: httpx.AsyncClient) -> None:
    deep = b'{"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": ' + b"[" * 5000
    deep += b"1" + b"]" * 5000 + b"}}"
    assert_problem(
        await client.post("/forward", content=deep), 400, "malformed-json", "recursion limit"
    )


async def test_400_bad_content_length(client: httpx.AsyncClient) -> None:
    r = await client.post("/forward", content=b"{}", headers={"Content-Length": "x2"})
    assert_problem(r, 400, "bad-request", "Content-Length")


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer no"}, {"Authorization": "Basic k1"}],
)
async def test_401_without_a_valid_key(headers: dict[str, str]) -> None:
    async with serving(api_keys="k1,k2") as (c, _):
        r = await c.post("/backward", json=SEED_OP, headers=headers)
        assert_problem(r, 401, "unauthorized", "API key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_problem(await c.get("/metrics", headers=headers), 401, "unauthorized")
        assert_problem(await c.get("/nope", headers=headers), 401, "unauthorized")
        metrics = await c.get("/metrics", headers={"X-API-Key": "k1"})
        assert 'gradserve_rejections_total{reason="unauthorized"} 3.0' in metrics.text


async def test_api_keys_accepted_and_probes_exempt() -> None:
    async with serving(api_keys="k1, k2") as (c, _):
        for headers in [{"X-API-Key": "k2"}, {"Authorization": "Bearer k1"}]:
            r = await c.post("/backward", json=SEED_OP, headers=headers)
            assert r.status_code == 200, r.text
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).status_code == 200


async def _tenants_seen(
    api_keys: list[str], requests: list[tuple[str, dict[str, str]]]
) -> list[tuple[int, Any]]:
    """(status, the scope's tenant as the app behind the Gateway saw it, or "-" when the
    app was not reached) for each (path, headers), through a Gateway with these keys and
    /open as an open path."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["state"][TENANT])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gateway = Gateway(
        app, metrics=Metrics(), max_body_bytes=1000, api_keys=api_keys, open_paths={"/open"}
    )
    out = []
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway), base_url="http://test"
    ) as c:
        for path, headers in requests:
            seen.clear()
            r = await c.get(path, headers=headers)
            out.append((r.status_code, seen[0] if seen else "-"))
    return out


async def test_the_tenant_is_the_keys_hash_never_the_key() -> None:
    """With keys on, the scope's state carries the BLAKE2b-128 of the key that was used
    (whichever header carried it), None on the paths open to all; with keys off, None."""
    k1, k2 = "key-one", "key-two"
    t1, t2 = (hashlib.blake2b(k.encode(), digest_size=16).hexdigest() for k in (k1, k2))
    assert tenant_id(k1) == t1
    seen = await _tenants_seen(
        [k1, k2],
        [
            ("/x", {"X-API-Key": k1}),
            ("/x", {"Authorization": f"Bearer {k2}"}),
            ("/x", {"X-API-Key": k2}),
            ("/x", {"X-API-Key": "key-three"}),
            ("/x", {}),
            ("/open", {}),
            ("/open", {"X-API-Key": k1}),
            ("/healthz", {"X-API-Key": k1}),
        ],
    )
    assert seen == [
        (204, t1),
        (204, t2),
        (204, t2),
        (401, "-"),
        (401, "-"),
        (204, None),
        (204, None),
        (204, None),
    ]
    assert await _tenants_seen([], [("/x", {}), ("/x", {"X-API-Key": k1})]) == [
        (204, None),
        (204, None),
    ]


async def test_404_and_405(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/nope"), 404, "not-found", "/nope")
    r = await client.get("/forward")
    assert_problem(r, 405, "method-not-allowed", "GET")
    assert r.headers["allow"] == "POST"


async def test_413_declared_length() -> None:
    async with serving(max_body_bytes=1000) as (c, _):
        r = await c.post("/forward", content=b" " * 1001)
        assert_problem(r, 413, "body-too-large", "1000 bytes")
        ok = await c.post("/forward", json=SEED_NO_GRAD)  # within the limit
        assert ok.status_code == 200


async def test_413_streamed_body_is_cut_off() -> None:
    """A chunked 1 GiB body is refused once it crosses the limit, without being read."""
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        block = b" " * (1 << 20)
        for _ in range(1024):
            sent += len(block)
            yield block

    async with serving(max_body_bytes=4 << 20) as (c, _):
        r = await c.post("/forward", content=chunks())
        assert_problem(r, 413, "body-too-large")
        assert sent <= 6 << 20
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_rejections_total{reason="body_size"} 1.0' in metrics


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
async def test_415_non_json(client: httpx.AsyncClient, content_type: str) -> None:
    r = await client.post(
        "/forward", content=json.dumps(SEED_NO_GRAD), headers={"Content-Type": content_type}
    )
    assert_problem(r, 415, "unsupported-media-type", content_type.split(";")[0])


@pytest.mark.parametrize(
    "content_type", [None, "application/json; charset=utf-8", "application/vnd.gradserve+json"]
)
async def test_json_content_types(client: httpx.AsyncClient, content_type: str | None) -> None:
    request = client.build_request("POST", "/forward", content=json.dumps(SEED_NO_GRAD))
    if content_type is not None:
        request.headers["Content-Type"] = content_type
    assert ("content-type" in request.headers) is (content_type is not None)
    assert (await client.send(request)).status_code == 200


SCHEMA_CASES = {
    "unknown field": ("/backward", {**SEED_OP, "colour": 1}, ["colour"]),
    "no_grad on backward": ("/backward", {**SEED_OP, "no_grad": True}, ["no_grad"]),
    "grad_outputs on forward": ("/forward", {**SEED_OP, "grad_outputs": {}}, ["grad_outputs"]),
    "misspelt tensor field": (
        "/backward",
        {**SEED_OP, "inputs": {"x": {"data": 1.0, "requires_grd": True}}},
        ["inputs", "x", "requires_grd"],
    ),
    "string bool": ("/forward", {**SEED_NO_GRAD, "no_grad": "true"}, ["no_grad"]),
    "op and expr": (
        "/forward",
        {"graph": {"nodes": [{"id": "z", "op": "neg", "expr": "-x"}], "outputs": ["z"]}},
        ["graph", "nodes", 0],
    ),
    "no outputs": ("/forward", {"graph": {"nodes": [], "outputs": []}}, ["graph", "outputs"]),
    "bad dtype": (
        "/forward",
        {**SEED_OP, "inputs": {"x": {"data": 1, "dtype": "int8"}}},
        ["inputs", "x", "dtype"],
    ),
    "bad encoding": ("/forward", {**SEED_OP, "encoding": "hex"}, ["encoding"]),
    "not an object": ("/forward", [1, 2], []),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
async def test_422_schema(client: httpx.AsyncClient, case: str) -> None:
    path, body, loc = SCHEMA_CASES[case]
    p = assert_problem(await client.post(path, json=body), 422, "invalid-request")
    assert p["errors"][0]["loc"] == loc, p["errors"]


async def test_422_schema_speaks_of_json_types(client: httpx.AsyncClient) -> None:
    body = {"graph": {"nodes": "a", "outputs": ["x"]}, "inputs": [], "device": 3}
    p = assert_problem(await client.post("/forward", json=body), 422, "invalid-request")
    assert [e["msg"] for e in p["errors"]] == [
        "Input should be a valid array",
        "Input should be an object",
        "Input should be a valid string",
    ]
    assert_problem(
        await client.post("/forward", json=[1]),
        422,
        "invalid-request",
        "body: Input should be an object",
    )


ENGINE_CASES = {
    "unknown op": (
        {"nodes": [{"id": "z", "op": "frobnicate", "args": ["x"]}]},
        {"x": 1.0},
        "unknown-op",
        "z",
    ),
    "unknown reference": (
        {"nodes": [{"id": "z", "op": "add", "args": ["x", "nope"]}]},
        {"x": 1.0},
        "graph",
        "z",
    ),
    "cycle": (
        {
            "nodes": [
                {"id": "a", "op": "neg", "args": ["z"]},
                {"id": "z", "op": "neg", "args": ["a"]},
            ]
        },
        {},
        "graph",
        None,
    ),
    "arity": ({"nodes": [{"id": "z", "op": "neg", "args": ["x", "x"]}]}, {"x": 1.0}, "arity", "z"),
    "attribute": (
        {"nodes": [{"id": "z", "op": "sum", "args": ["x"], "attrs": {"dims": 1}}]},
        {"x": [1.0]},
        "attribute",
        "z",
    ),
    "shape": (
        {"nodes": [{"id": "z", "op": "matmul", "args": ["a", "b"]}]},
        {"a": [[1.0] * 4] * 3, "b": [[1.0] * 2] * 5},
        "shape-mismatch",
        "z",
    ),
    "expr": ({"nodes": [{"id": "z", "expr": "__import__('os').system('id')"}]}, {}, "expr", "z"),
    "id equals input": (
        {"nodes": [{"id": "x", "op": "neg", "args": ["x"]}]},
        {"x": 1.0},
        "graph",
        "x",
    ),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
async def test_422_graph_errors(client: httpx.AsyncClient, case: str) -> None:
    nodes, inputs, slug, node = ENGINE_CASES[case]
    body = {"graph": {**nodes, "outputs": ["z"]}, "inputs": inputs}
    p = assert_problem(await client.post("/forward", json=body), 422, slug)
    if node is not None:
        assert p["node"] == node
    assert p["errors"] and all({"loc", "msg"} == set(e) for e in p["errors"])


async def test_422_detail_names_node_and_shapes(client: httpx.AsyncClient) -> None:
    nodes, inputs, _, _ = ENGINE_CASES["shape"]
    body = {"graph": {**nodes, "outputs": ["z"]}, "inputs": inputs}
    p = strict_json(await client.post("/forward", json=body))
    assert p["detail"] == "node 'z' (matmul): shapes (3, 4) and (5, 2) do not match"


async def test_422_cycle_lists_the_cycle(client: httpx.AsyncClient) -> None:
    nodes, inputs, _, _ = ENGINE_CASES["cycle"]
    body = {"graph": {**nodes, "outputs": ["z"]}, "inputs": inputs}
    p = strict_json(await client.post("/forward", json=body))
    assert "->" in p["detail"] and "a" in p["detail"] and "z" in p["detail"]


TENSOR_CASES = {
    "data vs shape": ({"data": [1.0, 2.0, 3.0], "shape": [2, 2]}, "shape"),
    "scalar with shape": ({"data": 1.0, "shape": [1]}, "shape"),
    "non-integral int": ({"data": [1.5], "dtype": "int64"}, "data"),
    "boolean under float": ({"data": [True, 1.0]}, "data"),
    "ragged": ({"data": [[1.0, 2.0], [3.0]]}, "data"),
    "string": ({"data": ["one"]}, "data"),
    "bad base64": ({"b64": "AAAA*AAA", "dtype": "float32", "shape": [2]}, "b64"),
    "base64 length": ({"b64": "AAAA", "dtype": "float32", "shape": [2]}, "b64"),
    "bool byte": (
        {"b64": base64.b64encode(b"\x00\x02").decode(), "dtype": "bool", "shape": [2]},
        "b64",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
async def test_422_tensor_data(client: httpx.AsyncClient, case: str) -> None:
    tensor, field = TENSOR_CASES[case]
    body = {"graph": {"nodes": [], "outputs": ["x"]}, "inputs": {"x": tensor}}
    p = assert_problem(await client.post("/forward", json=body), 422, "tensor-data", "input 'x'")
    assert p["errors"][0]["loc"] == ["inputs", "x", field]


async def test_422_every_bad_input_reported(client: httpx.AsyncClient) -> None:
    body = {
        "graph": {"nodes": [], "outputs": ["x"]},
        "inputs": {"x": {"data": [1.5], "dtype": "int32"}, "y": ["NaNa"]},
    }
    p = assert_problem(await client.post("/forward", json=body), 422, "tensor-data")
    assert [e["loc"] for e in p["errors"]] == [["inputs", "x", "data"], ["inputs", "y", "data"]]


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
async def test_422_requires_grad_on_an_integer_or_bool_dtype(
    client: httpx.AsyncClient, dtype: str
) -> None:
    data = [True, False] if dtype == "bool" else [1, 2]
    body = {
        "graph": graph("x * 2"),
        "inputs": {"x": {"data": data, "dtype": dtype, "requires_grad": True}},
    }
    p = assert_problem(
        await client.post("/backward", json=body),
        422,
        "invalid-request",
        f"has dtype {dtype}: only floating point tensors can require "
        "gradients; give it a floating dtype",
    )
    assert p["errors"][0]["loc"] == ["inputs", "x", "requires_grad"]


async def test_json_integers_that_require_grad_take_the_default_float(
    client: httpx.AsyncClient,
) -> None:
    """The seed as JavaScript writes it (JSON.stringify(2.0) is "2"): float32, as if the
    numbers had a decimal point; on /plan too. Booleans stay bool, and are refused."""
    seed = {
        "graph": graph("(x + y) * (x - y)"),
        "inputs": {
            "x": {"data": 2, "requires_grad": True},
            "y": {"data": 3, "requires_grad": True},
        },
    }
    r = (await client.post("/backward", json=seed)).json()
    assert r["outputs"]["z"] == {
        "dtype": "float32",
        "shape": [],
        "data": -5.0,
        "requires_grad": True,
        "grad_fn": "MulBackward",
    }
    assert r["gradients"] == {
        "x": {"dtype": "float32", "shape": [], "data": 4.0},
        "y": {"dtype": "float32", "shape": [], "data": -6.0},
    }
    nested = {
        "graph": graph("sum(x * x)"),
        "inputs": {"x": {"data": [[1, 2], [3, 4]], "requires_grad": True}},
    }
    r = (await client.post("/backward", json=nested)).json()
    assert r["gradients"]["x"] == {
        "dtype": "float32",
        "shape": [2, 2],
        "data": [[2.0, 4.0], [6.0, 8.0]],
    }
    plan = (await client.post("/plan", json=seed)).json()
    assert {step["dtype"] for step in plan["nodes"]} == {"float32"}
    unmarked = {"graph": graph("x * 2"), "inputs": {"x": {"data": [1, 2]}}}
    r = (await client.post("/forward", json=unmarked)).json()
    assert r["outputs"]["z"]["dtype"] == "int64"  # (no grad asked: int64, as torch.tensor)
    bools = {"graph": graph("x * 2"), "inputs": {"x": {"data": [True], "requires_grad": True}}}
    assert_problem(
        await client.post("/backward", json=bools), 422, "invalid-request", "has dtype bool"
    )


async def test_422_node_limit() -> None:
    async with serving(max_nodes=2) as (c, _):
        p = assert_problem(await c.post("/backward", json=SEED_OP), 422, "graph", "limit is 2")
        assert p["errors"][0]["loc"] == ["graph", "nodes"]


async def test_422_expr_limits_are_settings() -> None:
    async with serving(expr_max_chars=20, expr_max_depth=3) as (c, _):
        long = {**SEED_EXPR, "graph": graph("x + y + x + y + x + y + x")}
        p = assert_problem(await c.post("/backward", json=long), 422, "expr", "limit is 20")
        assert p["node"] == "z" and p["errors"][0]["loc"] == ["graph", "nodes", 0, "expr"]
        deep = {**SEED_EXPR, "graph": graph("((((x))))")}
        assert_problem(await c.post("/backward", json=deep), 422, "expr", "more than 3 levels")
        assert (await c.post("/backward", json=SEED_EXPR)).status_code == 200


@pytest.mark.parametrize(
    ("expr", "detail"),
    [
        ("sum(x, dim=0, keepdim=true)", "'true'; did you mean True?"),
        ("x + " + "9" * 9000, "is too long for int64"),
    ],
)
async def test_422_expr_mistakes_say_what_to_write(
    client: httpx.AsyncClient, expr: str, detail: str
) -> None:
    r = await client.post("/forward", json={"graph": graph(expr), "inputs": {"x": [1.0]}})
    p = assert_problem(r, 422, "expr", detail)
    assert p["node"] == "z" and p["errors"][0]["loc"] == ["graph", "nodes", 0, "expr"]
    assert "set_int_max_str_digits" not in r.text and len(r.content) < 1000


async def test_422_memory_budget_lower_for_no_grad() -> None:
    body = {
        "graph": graph("sum(exp(x) * 2)"),
        "inputs": {"x": {"data": [1.0] * 1000, "requires_grad": True}},
    }
    async with serving(
        memory_budget_bytes=1 << 20, no_grad_memory_budget_bytes=4000, inflight_memory_bytes=1 << 20
    ) as (c, _):
        assert (await c.post("/forward", json=body)).status_code == 200
        p = assert_problem(
            await c.post("/forward", json={**body, "no_grad": True}),
            422,
            "memory-budget",
            "no_grad budget is 4000 bytes",
        )
        assert p["budget_bytes"] == 4000 and p["planned_bytes"] > 4000
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_rejections_total{reason="memory_budget"} 1.0' in metrics


@pytest.mark.parametrize("device", ["cuda:7", "tpu"])
async def test_422_unavailable_device(client: httpx.AsyncClient, device: str) -> None:
    if device == "cuda:7" and len(engine.available_devices()) > 7:
        pytest.skip("this host has a cuda:7")
    p = assert_problem(
        await client.post("/forward", json={**SEED_NO_GRAD, "device": device}),
        422,
        "device-unavailable",
        device,
    )
    assert p["errors"][0]["loc"] == ["device"]


async def test_422_backward_nothing_requires_grad(client: httpx.AsyncClient) -> None:
    body = {"graph": graph("x * 2"), "inputs": {"x": 1.0}}
    assert_problem(await client.post("/backward", json=body), 422, "backward")


async def test_422_non_scalar_without_grad_outputs(client: httpx.AsyncClient) -> None:
    body = {"graph": graph("x * 2"), "inputs": {"x": {"data": [1.0, 2.0], "requires_grad": True}}}
    p = assert_problem(await client.post("/backward", json=body), 422, "backward")
    assert "grad_outputs" in p["detail"]


async def test_422_grad_outputs_errors_name_the_output(client: httpx.AsyncClient) -> None:
    body = {
        "graph": graph("x * 2"),
        "inputs": {"x": {"data": [1.0, 2.0], "requires_grad": True}},
        "grad_outputs": {"z": [1.0, 2.0, 3.0]},
    }
    r = await client.post("/backward", json=body)
    assert r.status_code == 422
    assert "'z'" in strict_json(r)["detail"]
    bad = {**body, "grad_outputs": {"z": ["x"]}}
    p = assert_problem(await client.post("/backward", json=bad), 422, "tensor-data")
    assert p["errors"][0]["loc"] == ["grad_outputs", "z", "data"]


async def test_503_when_all_slots_are_busy_and_nothing_may_queue() -> None:
    async with serving(max_concurrency=1, max_queue_size=0) as (c, app):
        # A computation holds the only slot.
        slot = await app.state.front.admission.enter(time.monotonic() + 60)
        # A body over 16 KiB: a small one computes in the front process, with no slot.
        body = {
            "graph": {"nodes": [{"id": "s", "expr": "sum(x)"}], "outputs": ["s"]},
            "inputs": {"x": [1.0] * 5000},
            "no_grad": True,
        }
        r = await c.post("/forward", json=body)
        assert_problem(r, 503, "overloaded", "compute slots")
        assert r.headers["retry-after"] == "1"
        app.state.front.admission.leave(slot)
        assert (await c.post("/forward", json=body)).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_rejections_total{reason="queue_full"} 1.0' in metrics


async def test_503_when_in_flight_memory_is_full() -> None:
    async with serving(
        memory_budget_bytes=10_000,
        no_grad_memory_budget_bytes=10_000,
        inflight_memory_bytes=100_000,
    ) as (c, app):
        runner = app.state.front
        slot = await runner.admission.enter(time.monotonic() + 60)
        runner.ledger.reserve(slot, 99_990)  # another request holds most of it
        r = await c.post("/backward", json=SEED_OP)
        p = assert_problem(r, 503, "overloaded", "in-flight")
        assert r.headers["retry-after"] == "1" and p["planned_bytes"] > 10
        runner.ledger.release(slot)
        runner.admission.leave(slot)
        assert (await c.post("/backward", json=SEED_OP)).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_rejections_total{reason="inflight_memory"} 1.0' in metrics
        assert "gradserve_inflight_planned_bytes 0.0" in metrics


async def test_504_past_the_time_limit() -> None:
    async with serving(request_timeout_s=1e-9) as (c, _):
        assert_problem(await c.post("/backward", json=SEED_OP), 504, "timeout", "time limit")
        metrics = (await c.get("/metrics")).text
        assert 'gradserve_rejections_total{reason="timeout"} 1.0' in metrics


async def test_500_hides_the_traceback(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr("gradserve.service.compute.execute", boom)
    with caplog.at_level(logging.ERROR, logger="gradserve.errors"):
        r = await client.post("/backward", json=SEED_OP, headers={"X-Request-ID": "r-500"})
    p = assert_problem(r, 500, "internal", "r-500")
    assert "secret" not in r.text
    assert any("r-500" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert p["request_id"] == "r-500"
    monkeypatch.undo()
    assert (await client.post("/backward", json=SEED_OP)).status_code == 200


# ----------------------------------------------------------------------- program cache, client
async def test_program_cache_reuses_plans_per_graph_and_specs() -> None:
    async with serving() as (c, app):
        cache = app.state.front.compute.programs.memory
        before = len(cache._items)
        for x in (1.0, 2.0, 3.0):
            r = await c.post(
                "/backward",
                json={
                    **SEED_EXPR,
                    "inputs": {
                        "x": {"data": x, "requires_grad": True},
                        "y": {"data": 1.0, "requires_grad": True},
                    },
                },
            )
            assert strict_json(r)["gradients"]["x"]["data"] == 2 * x
        assert len(cache._items) == before + 1
        # Another shape is another plan; bad data for a cached graph is still refused.
        vec = {"x": {"data": [1.0, 2.0], "requires_grad": True}, "y": [1.0, 1.0]}
        r = await c.post("/forward", json={**SEED_EXPR, "inputs": vec})
        assert strict_json(r)["outputs"]["z"]["data"] == [0.0, 3.0]
        assert len(cache._items) == before + 2
        bad = {"x": {"data": [1.0, True], "requires_grad": True}, "y": [1.0, 1.0]}
        assert_problem(
            await c.post("/forward", json={**SEED_EXPR, "inputs": bad}), 422, "tensor-data"
        )


async def test_async_client() -> None:
    from gradserve.client.http import AsyncClient, GradserveHTTPError

    async with serving() as (_, app):
        transport = httpx.ASGITransport(app)
        graph_ = {"nodes": [{"id": "z", "expr": "sum(x * w)"}], "outputs": ["z"]}
        w = np.arange(2000, dtype=np.float64)
        async with AsyncClient("http://test", transport=transport, base64_threshold=1000) as gs:
            r = await gs.backward(
                graph_, {"x": np.ones(2000, np.float64), "w": w}, requires_grad=["x"]
            )
            np.testing.assert_array_equal(r.gradients["x"], w)
            assert r.gradients["x"].dtype == np.float64 and r.outputs["z"] == w.sum()
            nan = await gs.forward(
                {"nodes": [], "outputs": ["v"]}, {"v": np.array([np.nan, -np.inf], np.float32)}
            )
            assert np.isnan(nan.outputs["v"][0]) and nan.outputs["v"][1] == -np.inf
            assert [op["name"] for op in await gs.ops()][:1]
            assert (await gs.devices())["default"] == "cpu"
            with pytest.raises(GradserveHTTPError) as info:
                await gs.backward(graph_, {"x": [1, 2], "w": [1, 2]}, requires_grad=["x"])
            assert info.value.status == 422 and info.value.errors
        async with AsyncClient("http://test", transport=transport, encoding="json") as gs:
            r = await gs.forward(
                {"nodes": [], "outputs": ["v"]}, {"v": np.array([np.inf, 1.5], np.float32)}
            )
            np.testing.assert_array_equal(r.outputs["v"], [np.inf, 1.5])
