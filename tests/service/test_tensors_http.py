"""Tensors held by id, over HTTP (service/routes/tensors.py, and ids and `keep` in the
compute requests): every dtype bit-exact through each upload form and each answer, ids the
client computes, kept outputs and gradients named by the next request, a training loop of
50 steps that sends only its batches, /plan by id, eviction under a small quota and the
409 that lists every missing id, the quota refusing a keep before anything runs, tenants,
a store that cannot be written, bad input naming its field, the metrics, and a worker
process resolving ids and keeping values in the same store."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gradserve.service.middleware import tenant_id
from gradserve.wire.tensor_id import id_of_array
from tests.support.in_process import serving
from tests.support.problems import assert_problem, strict_json

pytestmark = pytest.mark.anyio

BINARY = "Inference-Header-Content-Length"
OCTETS = {"Accept": "application/octet-stream"}
RNG = np.random.default_rng(61)


# ---------------------------------------------------------------- the wire, by hand
def json_data(a: np.ndarray) -> Any:
    """An array's JSON data: nested numbers, non-finite values as their strings."""

    def leaf(v: Any) -> Any:
        if isinstance(v, list):
            return [leaf(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"
        return v

    return leaf(a.tolist())


def le_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


def as_json(a: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"data": json_data(a), "dtype": a.dtype.name, "shape": list(a.shape), **extra}


def as_b64(a: np.ndarray, **extra: Any) -> dict[str, Any]:
    b64 = base64.b64encode(le_bytes(a)).decode()
    return {"b64": b64, "dtype": a.dtype.name, "shape": list(a.shape), **extra}


def binary_body(a: np.ndarray) -> tuple[bytes, dict[str, str]]:
    raw = le_bytes(a)
    header = json.dumps(
        {"dtype": a.dtype.name, "shape": list(a.shape), "binary_data_size": len(raw)}
    ).encode()
    headers = {BINARY: str(len(header)), "Content-Type": "application/octet-stream"}
    return header + raw, headers


def from_json(entry: dict[str, Any]) -> np.ndarray:
    def leaf(v: Any) -> Any:
        if isinstance(v, list):
            return [leaf(x) for x in v]
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v)

    return np.array(leaf(entry["data"]), dtype=entry["dtype"]).reshape(entry["shape"])


def from_binary(r: httpx.Response) -> tuple[dict[str, Any], np.ndarray]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers[BINARY])
    header = json.loads(r.content[:n])
    raw = r.content[n:]
    assert n % 8 == 0 and len(raw) == header["binary_data_size"]
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    return header, np.frombuffer(raw, dtype=dtype).reshape(header["shape"])


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert le_bytes(got) == le_bytes(want), (got, want)


async def upload(c: httpx.AsyncClient, a: np.ndarray, status: int = 201, **kw: Any) -> str:
    r = await c.post("/tensors", json=as_json(a), **kw)
    body = strict_json(r)
    assert r.status_code == status, r.text
    tensor = id_of_array(a, a.dtype.name)
    assert body == {
        "tensor_id": tensor,
        "shape": list(a.shape),
        "dtype": a.dtype.name,
        "bytes": a.nbytes,
    }
    return tensor


async def value_of(c: httpx.AsyncClient, tensor: str, **kw: Any) -> np.ndarray:
    """A held tensor's value, by both GET forms (which must agree bit for bit)."""
    r = await c.get(f"/tensors/{tensor}", **kw)
    as_json_value = from_json(strict_json(r))
    assert r.status_code == 200 and strict_json(r)["tensor_id"] == tensor
    header, as_binary = from_binary(
        await c.get(f"/tensors/{tensor}", headers={**kw.pop("headers", {}), **OCTETS}, **kw)
    )
    assert header["tensor_id"] == tensor
    same_bits(as_json_value, as_binary)  # (the NaNs here are NumPy's: "NaN" is their bits)
    return as_binary


def age(app: Any, tensor: str, when: float, key: str = "anonymous") -> None:
    """Set when a held tensor was last used (its file's mtime), as the server's LRU sees it."""
    path = app.state.front.compute.tensors.root / key / tensor
    os.utime(path, (when, when))


def ref(tensor: str, requires_grad: bool = False) -> dict[str, Any]:
    return {"tensor_id": tensor, "requires_grad": requires_grad}


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value in a Prometheus text exposition (`labels` as written: `{k="v"}`)."""
    prefix = f"{name}{labels} "
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    assert len(values) == 1, (prefix, values)
    return values[0]


def assert_unknown(r: httpx.Response, where: list[tuple[list[Any], str]]) -> None:
    """409 tensor-unknown naming each (loc, id) of `where`, and listing every id."""
    body = assert_problem(r, 409, "tensor-unknown")
    assert body["tensor_ids"] == list(dict.fromkeys(t for _, t in where))
    assert body["errors"] == [{"loc": loc, "msg": f"unknown here: {t}"} for loc, t in where]
    for _, t in where:
        assert t in body["detail"]


# ---------------------------------------------------------------- round trips
def every_kind() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in ("float16", "float32", "float64"):
        info = np.finfo(name)
        edges = [0.0, -0.0, 1.0, -2.5, np.nan, np.inf, -np.inf, info.max, info.tiny, -info.eps]
        out[f"{name}-edges"] = np.array(edges * 2, dtype=name).reshape(2, 10)
        out[f"{name}-random"] = RNG.standard_normal((3, 4)).astype(name)
        out[f"{name}-0d"] = np.array(-0.0, dtype=name)
        out[f"{name}-empty"] = np.zeros((0, 3), dtype=name)
    for name in ("int32", "int64"):
        ints = np.iinfo(name)
        out[f"{name}-edges"] = np.array([[ints.min, -1, 0], [1, 7, ints.max]], dtype=name)
        out[f"{name}-0d"] = np.array(ints.min, dtype=name)
        out[f"{name}-empty"] = np.zeros((2, 0), dtype=name)
    out["bool-edges"] = np.array([[True, False, True], [False, False, True]])
    out["bool-0d"] = np.array(False)
    out["bool-empty"] = np.zeros((0,), dtype=bool)
    return out


async def test_every_dtype_round_trips_bit_exact_through_every_upload_and_answer() -> None:
    async with serving() as (c, _):
        kinds = every_kind()
        for case, a in kinds.items():
            tensor = await upload(c, a)  # JSON data: new
            listed = {
                "tensor_id": tensor,
                "shape": list(a.shape),
                "dtype": a.dtype.name,
                "bytes": a.nbytes,
            }
            r = await c.post("/tensors", json=as_b64(a))  # the same, as base64
            assert r.status_code == 200 and strict_json(r) == listed, case
            content, headers = binary_body(a)
            r = await c.post("/tensors", content=content, headers=headers)  # and binary
            assert r.status_code == 200 and strict_json(r) == listed, case
            same_bits(await value_of(c, tensor), a)
            r = await c.get(f"/tensors/{tensor}")
            assert set(strict_json(r)) == {"tensor_id", "dtype", "shape", "data"}
        held = strict_json(await c.get("/tensors"))
        assert {t["tensor_id"] for t in held["tensors"]} == {
            id_of_array(a, a.dtype.name) for a in kinds.values()
        }
        assert held["used_bytes"] == sum(a.nbytes for a in kinds.values())
        assert held["quota_bytes"] == 256 << 20
        # NaNs that are not NumPy's travel as bits through b64 and binary bodies.
        payloads = np.array([0x7FC00001, 0xFFC00000, 0x7F800001], np.uint32).view(np.float32)
        r = await c.post("/tensors", json=as_b64(payloads))
        assert r.status_code == 201
        tensor = strict_json(r)["tensor_id"]
        assert tensor == id_of_array(payloads, "float32")
        same_bits(from_binary(await c.get(f"/tensors/{tensor}", headers=OCTETS))[1], payloads)
        content, headers = binary_body(payloads[::-1].copy())
        r = await c.post("/tensors", content=content, headers=headers)
        assert r.status_code == 201
        got = from_binary(await c.get(f"/tensors/{strict_json(r)['tensor_id']}", headers=OCTETS))
        same_bits(got[1], payloads[::-1].copy())
        assert strict_json(await c.get(f"/tensors/{tensor}"))["data"] == ["NaN"] * 3
        # Dropped: then unknown, by every route.
        r = await c.delete(f"/tensors/{tensor}")
        assert r.status_code == 204 and r.content == b""
        for r in (
            await c.get(f"/tensors/{tensor}"),
            await c.get(f"/tensors/{tensor}", headers=OCTETS),
            await c.delete(f"/tensors/{tensor}"),
        ):
            assert_unknown(r, [(["path", "tensor_id"], tensor)])


# ---------------------------------------------------------------- keep, and ids as inputs
MLP = {
    "nodes": [
        {"id": "h", "expr": "tanh(X @ W + b)"},
        {"id": "loss", "expr": "sum((h @ V - Y) ** 2)"},
    ],
    "outputs": ["h", "loss"],
}


async def test_kept_outputs_and_gradients_are_what_inline_data_computes() -> None:
    w, b, v = RNG.standard_normal((4, 5)), RNG.standard_normal(5), RNG.standard_normal((5, 2))
    x, y = RNG.standard_normal((6, 4)), RNG.standard_normal((6, 2))
    g_h = RNG.standard_normal((6, 5))  # (h's upstream gradient; the loss's is 1)
    async with serving() as (c, _):
        ids = {k: await upload(c, a) for k, a in (("W", w), ("b", b), ("V", v))}
        inline = {
            "graph": MLP,
            "grad_outputs": {"h": as_json(g_h)},
            "inputs": {
                "X": as_json(x),
                "Y": as_json(y),
                "W": as_json(w, requires_grad=True),
                "b": as_json(b, requires_grad=True),
                "V": as_json(v),
            },
            "encoding": "base64",  # (bits: compared as bytes)
        }
        want = strict_json(await c.post("/backward", json=inline))
        by_id = {
            **inline,
            "inputs": {
                "X": as_json(x),
                "Y": as_json(y),
                "W": ref(ids["W"], True),
                "b": ref(ids["b"], True),
                "V": ref(ids["V"]),
            },
            "keep": {"outputs": ["h"], "gradients": ["W", "b"]},
        }
        r = await c.post("/backward", json=by_id)
        got = strict_json(r)
        assert r.status_code == 200, r.text

        def b64_value(entry: dict[str, Any]) -> np.ndarray:
            raw = base64.b64decode(entry["b64"])
            return np.frombuffer(raw, dtype=entry["dtype"]).reshape(entry["shape"])

        kept = {
            ("outputs", "h"): b64_value(want["outputs"]["h"]),
            ("gradients", "W"): b64_value(want["gradients"]["W"]),
            ("gradients", "b"): b64_value(want["gradients"]["b"]),
        }
        for (section, name), value in kept.items():
            entry = got[section][name]
            # Answered by id, shape and dtype, no data (an output with its requires_grad and
            # grad_fn, as any output): its id is its content's.
            autograd = (
                {k: want[section][name][k] for k in ("requires_grad", "grad_fn")}
                if section == "outputs"
                else {}
            )
            assert entry == {
                "tensor_id": id_of_array(value, "float64"),
                "shape": list(value.shape),
                "dtype": "float64",
                **autograd,
            }
            same_bits(await value_of(c, entry["tensor_id"]), value)
        assert got["outputs"]["loss"] == want["outputs"]["loss"]  # (not kept: its data)
        # The next request names them: the kept h and dW as inputs, bit-exact as inline.
        follow = {
            "graph": {
                "nodes": [{"id": "s", "expr": "sum(h * 3.0) + sum(gW * gW)"}],
                "outputs": ["s"],
            },
            "encoding": "base64",
        }
        named = {
            "h": ref(got["outputs"]["h"]["tensor_id"]),
            "gW": ref(got["gradients"]["W"]["tensor_id"]),
        }
        sent = {"h": as_b64(kept[("outputs", "h")]), "gW": as_b64(kept[("gradients", "W")])}
        r1 = strict_json(await c.post("/forward", json={**follow, "inputs": named}))
        r2 = strict_json(await c.post("/forward", json={**follow, "inputs": sent}))
        assert r1["outputs"]["s"]["b64"] == r2["outputs"]["s"]["b64"]
        # /forward keeps outputs too; the listing has every tensor held.
        r = await c.post("/forward", json={**follow, "inputs": named, "keep": {"outputs": ["s"]}})
        s_entry = strict_json(r)["outputs"]["s"]
        assert s_entry["shape"] == [] and s_entry["dtype"] == "float64"
        same_bits(await value_of(c, s_entry["tensor_id"]), b64_value(r2["outputs"]["s"]))
        listing = strict_json(await c.get("/tensors"))
        assert {t["tensor_id"] for t in listing["tensors"]} == {
            *ids.values(),
            *(id_of_array(v, "float64") for v in kept.values()),
            s_entry["tensor_id"],
        }
        assert listing["used_bytes"] == (20 + 5 + 10) * 8 + (30 + 20 + 5) * 8 + 8


# ---------------------------------------------------------------- a training loop by id
SGD = {
    "nodes": [
        {"id": "h", "expr": "tanh(X @ W1 + b1)"},
        {"id": "loss", "expr": "mean((h @ W2 + b2 - Y) ** 2)"},
        {"id": "W1n", "expr": "W1 - 0.1 * grad(loss, W1)"},
        {"id": "b1n", "expr": "b1 - 0.1 * grad(loss, b1)"},
        {"id": "W2n", "expr": "W2 - 0.1 * grad(loss, W2)"},
        {"id": "b2n", "expr": "b2 - 0.1 * grad(loss, b2)"},
    ],
    "outputs": ["loss", "W1n", "b1n", "W2n", "b2n"],
}
PARAMS = ("W1", "b1", "W2", "b2")


def numpy_sgd_step(
    p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float = 0.1
) -> tuple[float, dict[str, np.ndarray]]:
    h = np.tanh(x @ p["W1"] + p["b1"])
    r = h @ p["W2"] + p["b2"] - y
    loss = float(np.mean(r**2))
    dp = 2.0 * r / r.size
    dz = (dp @ p["W2"].T) * (1.0 - h**2)
    grads = {"W1": x.T @ dz, "b1": dz.sum(0), "W2": h.T @ dp, "b2": dp.sum(0)}
    return loss, {k: p[k] - lr * grads[k] for k in PARAMS}


async def test_fifty_sgd_steps_by_id_match_numpy_under_a_tight_quota() -> None:
    """Each step names the parameters the last one kept and sends only its batch. The
    quota holds two sets of parameters: each step's keep evicts the set before last,
    never the one the step reads."""
    params = {
        "W1": RNG.standard_normal((4, 6)) * 0.5,
        "b1": RNG.standard_normal(6) * 0.1,
        "W2": RNG.standard_normal((6, 1)) * 0.5,
        "b2": np.zeros(1),
    }
    one_set = sum(a.nbytes for a in params.values())
    batches = [(RNG.standard_normal((8, 4)), RNG.standard_normal((8, 1))) for _ in range(50)]
    async with serving(tensor_quota_bytes=2 * one_set) as (c, _):
        ids = {k: await upload(c, a) for k, a in params.items()}
        first = last = dict(ids)
        losses = []
        for x, y in batches:
            body = {
                "graph": SGD,
                "inputs": {"X": as_json(x), "Y": as_json(y)}
                | {k: ref(ids[k], True) for k in PARAMS},
                "keep": {"outputs": [f"{k}n" for k in PARAMS]},
            }
            assert len(json.dumps(body)) < 3000  # (the batch, the graph and four ids)
            r = await c.post("/forward", json=body)
            out = strict_json(r)
            assert r.status_code == 200, r.text
            losses.append(out["outputs"]["loss"]["data"])
            last, ids = ids, {k: out["outputs"][f"{k}n"]["tensor_id"] for k in PARAMS}
        want = []
        for x, y in batches:
            loss, params = numpy_sgd_step(params, x, y)
            want.append(loss)
        np.testing.assert_allclose(losses, want, rtol=1e-12, atol=0)
        assert np.mean(losses[-10:]) < 0.9 * np.mean(losses[:10])  # (it learns)
        for k in PARAMS:
            np.testing.assert_allclose(await value_of(c, ids[k]), params[k], rtol=1e-12, atol=0)
        # Two sets held: the last step's inputs and its outputs; the rest evicted.
        listing = strict_json(await c.get("/tensors"))
        assert listing["used_bytes"] == 2 * one_set and len(listing["tensors"]) == 8
        held = {t["tensor_id"] for t in listing["tensors"]}
        assert held == {*ids.values(), *last.values()}
        r = await c.get(f"/tensors/{first['W1']}")
        assert_unknown(r, [(["path", "tensor_id"], first["W1"])])
        text = (await c.get("/metrics")).text
        assert metric(text, "gradserve_tensor_evictions_total") == 4 * 49
        assert metric(text, "gradserve_tensors_held", '{key="anonymous"}') == 8


# ---------------------------------------------------------------- /plan by id
async def test_plan_with_ids_is_plan_with_their_specs() -> None:
    w = RNG.standard_normal((4, 5)).astype(np.float32)
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    graph = {"nodes": [{"id": "y", "expr": "sum(tanh(X @ W))"}], "outputs": ["y"]}
    async with serving() as (c, _):
        wid, xid = await upload(c, w), await upload(c, x)
        for path in ("no_grad", "forward", "backward"):
            specs = {
                "W": {"shape": [4, 5], "dtype": "float32", "requires_grad": True},
                "X": {"shape": [3, 4], "dtype": "float32"},
            }
            by_spec = strict_json(
                await c.post("/plan", json={"graph": graph, "inputs": specs, "path": path})
            )
            r = await c.post(
                "/plan",
                json={
                    "graph": graph,
                    "inputs": {"W": ref(wid, True), "X": ref(xid)},
                    "path": path,
                },
            )
            assert r.status_code == 200, r.text
            assert strict_json(r) == by_spec
            assert by_spec["path"] == path and by_spec["admitted"]
        r = await c.post(
            "/plan",
            json={"graph": graph, "inputs": {"W": ref("a" * 32), "X": ref("b" * 32)}},
        )
        assert_unknown(
            r, [(["inputs", "W", "tensor_id"], "a" * 32), (["inputs", "X", "tensor_id"], "b" * 32)]
        )


# ---------------------------------------------------------------- eviction and the 409
async def test_evicted_ids_are_all_listed_then_uploaded_again_and_the_retry_runs() -> None:
    a, b = RNG.standard_normal(100), RNG.standard_normal(100)  # 800 bytes each
    fillers = [RNG.standard_normal(100) for _ in range(3)]
    graph = {"nodes": [{"id": "d", "expr": "sum(A * B)"}], "outputs": ["d"]}
    async with serving(tensor_quota_bytes=4 * 800) as (c, app):
        aid, bid = await upload(c, a), await upload(c, b)
        body = {"graph": graph, "inputs": {"A": ref(aid), "B": ref(bid)}}
        first = strict_json(await c.post("/forward", json=body))["outputs"]["d"]["data"]
        assert first == pytest.approx(float(a @ b), rel=1e-12)
        # Full; a third upload makes room for itself and a tenth more: A and B go.
        fids = [await upload(c, f) for f in fillers[:2]]
        # (uses within one tick of the file clock are one time: their order set here)
        for k, tensor in enumerate((aid, bid, *fids)):
            age(app, tensor, 1000.0 + k)
        listing = strict_json(await c.get("/tensors"))  # most recently used first
        assert [t["tensor_id"] for t in listing["tensors"]] == [*fids[::-1], bid, aid]
        assert listing["used_bytes"] == listing["quota_bytes"] == 4 * 800
        await upload(c, fillers[2])
        listing = strict_json(await c.get("/tensors"))
        f2 = id_of_array(fillers[2], "float64")
        assert [t["tensor_id"] for t in listing["tensors"]] == [f2, *fids[::-1]]
        assert listing["used_bytes"] == 3 * 800
        r = await c.post("/forward", json=body)
        assert_unknown(
            r, [(["inputs", "A", "tensor_id"], aid), (["inputs", "B", "tensor_id"], bid)]
        )
        r = await c.post("/backward", json={**body, "inputs": {"A": ref(aid, True), "B": [1.0]}})
        assert_unknown(r, [(["inputs", "A", "tensor_id"], aid)])
        text = (await c.get("/metrics")).text
        assert metric(text, "gradserve_tensor_evictions_total") == 2
        assert metric(text, "gradserve_tensor_unknown_total") == 2
        assert metric(text, "gradserve_tensors_held", '{key="anonymous"}') == 3
        assert metric(text, "gradserve_tensor_bytes", '{key="anonymous"}') == 3 * 800
        # What the client does: upload them again (201: new again), and retry.
        assert await upload(c, a) == aid and await upload(c, b) == bid
        again = strict_json(await c.post("/forward", json=body))["outputs"]["d"]["data"]
        assert again == first
        text = (await c.get("/metrics")).text
        assert metric(text, "gradserve_tensor_evictions_total") == 4  # (the fillers' first two)
        assert metric(text, "gradserve_tensors_held", '{key="anonymous"}') == 3
        assert metric(text, "gradserve_tensor_unknown_total") == 2


async def test_keep_over_the_quota_is_refused_before_anything_runs() -> None:
    # A run that would fail (a NaN from finite inputs, looked for): the quota is first.
    graph = {"nodes": [{"id": "r", "expr": "log(x - 1.0) * 0.0"}], "outputs": ["r"]}
    x = np.zeros(200)  # its output: 1600 bytes
    async with serving(tensor_quota_bytes=1000) as (c, _):
        body = {"graph": graph, "inputs": {"x": as_json(x)}, "detect_anomaly": True}
        r = await c.post("/forward", json={**body, "keep": {"outputs": ["r"]}})
        problem = assert_problem(r, 422, "tensor-quota", "keep needs 1600 bytes")
        assert problem["quota_bytes"] == 1000 and problem["needed_bytes"] == 1600
        assert_problem(await c.post("/forward", json=body), 422, "non-finite")  # (it would)
        listing = strict_json(await c.get("/tensors"))
        assert listing == {"tensors": [], "quota_bytes": 1000, "used_bytes": 0}
        # A single upload over the quota: refused, nothing held.
        r = await c.post("/tensors", json=as_json(np.zeros(126)))
        problem = assert_problem(r, 422, "tensor-quota", "needs 1008 bytes")
        assert problem["quota_bytes"] == 1000 and problem["needed_bytes"] == 1008
        # Names that are not outputs, or gradients in /forward: 422 naming them.
        r = await c.post("/forward", json={**body, "keep": {"outputs": ["r", "nope"]}})
        problem = assert_problem(r, 422, "invalid-request", "keep.outputs names 'nope'")
        assert problem["errors"] == [
            {"loc": ["keep", "outputs", 1], "msg": "not an output of the graph"}
        ]
        r = await c.post("/forward", json={**body, "keep": {"gradients": ["x"]}})
        problem = assert_problem(r, 422, "invalid-request", "keep.gradients")
        assert [e["loc"] for e in problem["errors"]] == [["keep", "gradients"]]
        dot = {"nodes": [{"id": "s", "expr": "sum(x * y)"}], "outputs": ["s"]}
        both = {"x": as_json(x), "y": as_json(x, requires_grad=True)}
        r = await c.post(
            "/backward", json={"graph": dot, "inputs": both, "keep": {"gradients": ["y", "x"]}}
        )
        problem = assert_problem(r, 422, "invalid-request", "keep.gradients names 'x'")
        assert problem["errors"][0]["loc"] == ["keep", "gradients", 1]
        assert strict_json(await c.get("/tensors"))["tensors"] == []


async def test_a_requests_own_inputs_are_never_evicted_for_its_keep() -> None:
    w, other = RNG.standard_normal(100), RNG.standard_normal(100)  # 800 bytes each
    graph = {  # y: 1600 bytes
        "nodes": [
            {"id": "w2", "expr": "W * 2.0"},
            {"id": "y", "op": "cat", "args": ["W", "w2"], "attrs": {"dim": 0}},
        ],
        "outputs": ["y"],
    }
    async with serving(tensor_quota_bytes=3 * 800) as (c, app):
        wid = await upload(c, w)
        oid = await upload(c, other)
        body = {"graph": graph, "inputs": {"W": ref(wid)}, "keep": {"outputs": ["y"]}}
        # Room for 1600 (and a tenth): W is in use, so only the other goes, and it fits.
        r = await c.post("/forward", json=body)
        kept = strict_json(r)["outputs"]["y"]
        assert r.status_code == 200 and kept["shape"] == [200]
        same_bits(await value_of(c, kept["tensor_id"]), np.concatenate([w, w * 2.0]))
        same_bits(await value_of(c, wid), w)
        assert_unknown(await c.get(f"/tensors/{oid}"), [(["path", "tensor_id"], oid)])
        # Now W alone: room for 2400 would take W, which the request reads: refused.
        assert (await c.delete(f"/tensors/{kept['tensor_id']}")).status_code == 204
        big = {
            "nodes": [{"id": "y", "op": "cat", "args": ["W", "W", "W"], "attrs": {"dim": 0}}],
            "outputs": ["y"],
        }
        r = await c.post("/forward", json={**body, "graph": big})
        problem = assert_problem(r, 422, "tensor-quota", "800 of them are held by tensors")
        assert problem["needed_bytes"] == 2400
        same_bits(await value_of(c, wid), w)
        # Readers while uploads evict around them: each answer whole, or a 409.
        fillers = [RNG.standard_normal(100) for _ in range(12)]
        reads = [c.get(f"/tensors/{wid}", headers=OCTETS) for _ in range(12)]
        writes = [c.post("/tensors", json=as_json(f)) for f in fillers]
        answers = await asyncio.gather(*reads, *writes)
        for r in answers[:12]:
            if r.status_code == 200:
                same_bits(from_binary(r)[1], w)
            else:
                assert_unknown(r, [(["path", "tensor_id"], wid)])
        assert [r.status_code for r in answers[12:]] == [201] * 12
        listing = strict_json(await c.get("/tensors"))
        assert listing["used_bytes"] <= 3 * 800
        assert app.state.front.compute.tensors.used_bytes(None) == listing["used_bytes"]


# ---------------------------------------------------------------- tenants
async def test_a_key_cannot_see_or_use_or_drop_another_keys_tensors() -> None:
    a = RNG.standard_normal((3, 3))
    ka, kb = {"Authorization": "Bearer ka"}, {"X-API-Key": "kb"}
    graph = {"nodes": [{"id": "s", "expr": "sum(M)"}], "outputs": ["s"]}
    async with serving(api_keys=("ka", "kb")) as (c, _):
        assert (await c.post("/tensors", json=as_json(a))).status_code == 401
        tensor = await upload(c, a, headers=ka)
        where = [(["path", "tensor_id"], tensor)]
        assert_unknown(await c.get(f"/tensors/{tensor}", headers=kb), where)
        assert_unknown(await c.get(f"/tensors/{tensor}", headers={**kb, **OCTETS}), where)
        assert_unknown(await c.delete(f"/tensors/{tensor}", headers=kb), where)
        body = {"graph": graph, "inputs": {"M": ref(tensor)}}
        assert_unknown(
            await c.post("/forward", json=body, headers=kb),
            [(["inputs", "M", "tensor_id"], tensor)],
        )
        assert_unknown(
            await c.post("/plan", json=body, headers=kb), [(["inputs", "M", "tensor_id"], tensor)]
        )
        assert strict_json(await c.get("/tensors", headers=kb))["tensors"] == []
        # A still can, all of it.
        same_bits(await value_of(c, tensor, headers=ka), a)
        r = await c.post("/forward", json=body, headers=ka)
        assert strict_json(r)["outputs"]["s"]["data"] == pytest.approx(a.sum(), rel=1e-12)
        assert [
            t["tensor_id"] for t in strict_json(await c.get("/tensors", headers=ka))["tensors"]
        ] == [tensor]
        # B's upload of the same content is B's own (new to B), and B's delete only B's.
        assert await upload(c, a, headers=kb) == tensor
        assert (await c.delete(f"/tensors/{tensor}", headers=kb)).status_code == 204
        same_bits(await value_of(c, tensor, headers=ka), a)
        text = (await c.get("/metrics", headers=ka)).text
        label_a, label_b = tenant_id("ka")[:12], tenant_id("kb")[:12]
        assert metric(text, "gradserve_tensors_held", f'{{key="{label_a}"}}') == 1
        assert metric(text, "gradserve_tensor_bytes", f'{{key="{label_a}"}}') == a.nbytes
        assert metric(text, "gradserve_tensors_held", f'{{key="{label_b}"}}') == 0
        assert metric(text, "gradserve_tensor_unknown_total") == 5
        assert (await c.delete(f"/tensors/{tensor}", headers=ka)).status_code == 204


# ---------------------------------------------------------------- a store not writable
async def test_a_store_that_cannot_be_written_is_507_and_inline_requests_still_run(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    graph = {"nodes": [{"id": "y", "expr": "x * 2.0"}], "outputs": ["y"]}
    body = {"graph": graph, "inputs": {"x": as_json(np.arange(3.0))}}
    async with serving(tensor_store_dir=str(tmp_path / "a-file" / "tensors")) as (c, _):
        r = await c.post("/tensors", json=as_json(np.arange(3.0)))
        assert_problem(r, 507, "tensor-store-unavailable", "cannot be written")
        content, headers = binary_body(np.arange(3.0))
        r = await c.post("/tensors", content=content, headers=headers)
        assert_problem(r, 507, "tensor-store-unavailable")
        r = await c.post("/forward", json=body)
        assert r.status_code == 200 and strict_json(r)["outputs"]["y"]["data"] == [0.0, 2.0, 4.0]
        r = await c.post("/forward", json={**body, "keep": {"outputs": ["y"]}})
        assert_problem(r, 507, "tensor-store-unavailable")
        tensor = id_of_array(np.arange(3.0), "float64")
        assert_unknown(await c.get(f"/tensors/{tensor}"), [(["path", "tensor_id"], tensor)])
        assert strict_json(await c.get("/tensors"))["tensors"] == []
        assert (await c.get("/metrics")).status_code == 200


# ---------------------------------------------------------------- bad input
async def test_bad_uploads_and_ids_name_their_field() -> None:
    async with serving() as (c, _):

        async def refused(status: int, slug: str, loc: list[Any], **kw: Any) -> dict[str, Any]:
            problem = assert_problem(await c.post("/tensors", **kw), status, slug)
            assert [e["loc"] for e in problem["errors"]] == [loc], problem
            return problem

        await refused(
            422, "invalid-request", ["dtype"], json={**as_json(np.zeros(2)), "dtype": "float8"}
        )
        p = await refused(
            422, "tensor-data", ["shape"], json={**as_json(np.zeros(2)), "shape": [3]}
        )
        assert p["detail"].startswith("the tensor: data has shape [2]"), p["detail"]
        p = await refused(422, "tensor-data", ["b64"], json={**as_b64(np.zeros(2)), "shape": [3]})
        assert "16 bytes do not hold shape [3] of float64 (24 bytes expected)" in p["detail"]
        content, headers = binary_body(np.zeros(2))
        header_length = int(headers[BINARY])
        wrong_shape = content[:header_length].replace(b"[2]", b"[3]") + content[header_length:]
        await refused(
            422, "tensor-data", ["binary_data_size"], content=wrong_shape, headers=headers
        )
        await refused(  # (cut short: the header says more bytes than come)
            400, "malformed-body", ["binary_data_size"], content=content[:-1], headers=headers
        )
        await refused(
            400,
            "malformed-body",
            ["headers", BINARY.lower()],
            content=content[: header_length - 1],
            headers=headers,
        )
        await refused(
            400,
            "malformed-body",
            ["binary_data_size"],
            json={"binary_data_size": 16, "dtype": "float64", "shape": [2]},
        )
        await refused(
            422,
            "invalid-request",
            [],
            json={**as_json(np.zeros(2)), "b64": as_b64(np.zeros(2))["b64"]},
        )
        r = await c.post("/tensors", content=b"{", headers={"Content-Type": "application/json"})
        assert_problem(r, 400, "malformed-json")
        assert strict_json(await c.get("/tensors"))["tensors"] == []
        # Ids of the wrong form: in the path, and as an input or upstream gradient.
        for bad in ("a" * 31, "a" * 33, "A" * 32, "g" * 32):
            for r in (await c.get(f"/tensors/{bad}"), await c.delete(f"/tensors/{bad}")):
                problem = assert_problem(r, 422, "invalid-request")
                assert [e["loc"] for e in problem["errors"]] == [["path", "tensor_id"]]
        graph = {"nodes": [{"id": "y", "expr": "x * 2.0"}], "outputs": ["y"]}
        r = await c.post("/forward", json={"graph": graph, "inputs": {"x": ref("ab" * 15)}})
        problem = assert_problem(r, 422, "invalid-request")
        assert [e["loc"] for e in problem["errors"]] == [["inputs", "x", "tensor_id"]]
        r = await c.post(
            "/backward",
            json={
                "graph": graph,
                "inputs": {"x": as_json(np.ones(2), requires_grad=True)},
                "grad_outputs": {"y": ref("c" * 31)},
            },
        )
        problem = assert_problem(r, 422, "invalid-request")
        assert [e["loc"] for e in problem["errors"]] == [["grad_outputs", "y", "tensor_id"]]
        # A well-formed id nobody holds, as an upstream gradient: 409 naming where.
        r = await c.post(
            "/backward",
            json={
                "graph": graph,
                "inputs": {"x": as_json(np.ones(2), requires_grad=True)},
                "grad_outputs": {"y": ref("c" * 32)},
            },
        )
        assert_unknown(r, [(["grad_outputs", "y", "tensor_id"], "c" * 32)])


# ---------------------------------------------------------------- in a worker process
async def _lookups(c: httpx.AsyncClient, role: str) -> float:
    text = (await c.get("/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f'gradserve_program_lookups_total{{role="{role}"')
    )


async def test_a_worker_resolves_ids_and_keeps_values_in_the_same_store() -> None:
    """A new graph of more nodes than the fast lane compiles runs in a worker process: it
    reads the tensors the front process wrote, and its kept values are the front's to
    serve (and its evictions count in the metrics)."""
    w, x = RNG.standard_normal((4, 3)), RNG.standard_normal((2, 4))
    nodes = [{"id": "a0", "expr": "tanh(X @ W)"}]
    nodes += [{"id": f"a{k}", "expr": f"a{k - 1} * 0.5 + 0.25"} for k in range(1, 70)]
    nodes += [{"id": "loss", "expr": "sum(a69 * a69)"}]
    graph = {"nodes": nodes, "outputs": ["loss", "a69"]}
    # W 96 bytes, X 64 and the zeros 96 held; the keep (48 + 96) needs the zeros' room.
    async with serving(compute_workers=1, tensor_quota_bytes=320) as (c, _):
        wid = await upload(c, w)
        xid = await upload(c, x)
        await upload(c, np.zeros(12))  # (96 bytes, the least recently used: evicted)
        body = {
            "graph": graph,
            "inputs": {"X": ref(xid), "W": ref(wid, True)},
            "grad_outputs": {"a69": as_json(np.ones((2, 3)))},
            "keep": {"outputs": ["a69"], "gradients": ["W"]},
        }
        r = await c.post("/backward", json=body)
        got = strict_json(r)
        assert r.status_code == 200, r.text
        assert await _lookups(c, "worker") == 1 and await _lookups(c, "front") == 0
        assert not got["meta"]["tier_reason"].startswith("fast lane")
        inline = {
            **body,
            "inputs": {"X": as_json(x), "W": as_json(w, requires_grad=True)},
            "keep": None,
            "encoding": "base64",
        }
        want = strict_json(await c.post("/backward", json=inline))
        for section, name in (("outputs", "a69"), ("gradients", "W")):
            entry = want[section][name]
            value = np.frombuffer(base64.b64decode(entry["b64"]), "<f8").reshape(entry["shape"])
            assert got[section][name]["tensor_id"] == id_of_array(value, "float64")
            same_bits(await value_of(c, got[section][name]["tensor_id"]), value)
        assert got["outputs"]["loss"]["data"] == pytest.approx(
            float(np.sum((np.tanh(x @ w) * 0.5**69 + 0.25 * (2 - 0.5**68)) ** 2)), rel=1e-9
        )
        # The worker's eviction (the zeros) is counted; its 409 lists every id.
        text = (await c.get("/metrics")).text
        assert metric(text, "gradserve_tensor_evictions_total") == 1
        held = {t["tensor_id"] for t in strict_json(await c.get("/tensors"))["tensors"]}
        kept = {got["outputs"]["a69"]["tensor_id"], got["gradients"]["W"]["tensor_id"]}
        assert held == {wid, xid, *kept}  # (the zeros gone)
        r = await c.post(
            "/backward",
            json={**body, "inputs": {"X": ref("1" * 32), "W": ref("2" * 32, True)}},
        )
        assert_unknown(
            r,
            [(["inputs", "X", "tensor_id"], "1" * 32), (["inputs", "W", "tensor_id"], "2" * 32)],
        )
