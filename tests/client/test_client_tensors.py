"""The client's held tensors against a live server: `put`, `get`, `delete`, `tensors`,
`TensorRef` inputs, `keep=`, the one re-upload and retry after 409 tensor-unknown, the
routing header, and `Parameter`s that a traced optimiser step moves along, with the
losses of the same loop run locally (NumPy, float64)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gradserve import AsyncClient, Client, F, GradserveHTTPError, Parameter, TensorRef, grad
from gradserve.client.http import next_name
from gradserve.client.tensors import affinity_of
from gradserve.wire.tensor_id import TENSOR_HEADER, id_of_array
from tests.support.server import Server, start_server, stop_server

RNG = np.random.default_rng(29)
QUOTA = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("tensors-client"), GRADSERVE_TENSOR_QUOTA_BYTES=str(QUOTA)
    )
    yield s
    stop_server(s)


class Recording(httpx.HTTPTransport):
    """Every request's method, path and headers, as sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str, httpx.Headers]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.method, request.url.path, request.headers))
        return super().handle_request(request)


def client(server: Server, **options: Any) -> Client:
    return Client(server.base, **options)


# ------------------------------------------------------------------ put, get, delete
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (70,)])
def test_put_then_get_is_bit_exact_and_content_addressed(
    server: Server, dtype: str, shape: tuple[int, ...]
) -> None:
    array = (RNG.standard_normal(shape) * 100).astype(dtype)
    with client(server) as gs:
        ref = gs.put(array)
        assert ref == TensorRef(id_of_array(array, dtype), shape, dtype)
        assert gs.put(array.copy()).tensor_id == ref.tensor_id  # the same content, one id
        back = gs.get(ref)
        assert back.dtype == np.dtype(dtype) and back.shape == shape
        assert back.tobytes() == array.tobytes()


def test_put_takes_what_a_request_takes(server: Server) -> None:
    """Lists and Python numbers, and dtypes the wire does not have (as float32 or int64)."""
    with client(server) as gs:
        assert gs.get(gs.put([[1.5, 2.5]])).tolist() == [[1.5, 2.5]]
        ref = gs.put(np.arange(3, dtype=np.int16))
        assert (ref.dtype, gs.get(ref).tolist()) == ("int64", [0, 1, 2])


def test_delete_and_the_listing(server: Server) -> None:
    with client(server, api_key=None) as gs:
        ref = gs.put(RNG.standard_normal(5))
        listed = {t["tensor_id"]: t for t in gs.tensors()["tensors"]}
        assert listed[ref.tensor_id] == {
            "tensor_id": ref.tensor_id,
            "shape": [5],
            "dtype": "float64",
            "bytes": 40,
        }
        assert gs.tensors()["quota_bytes"] == QUOTA
        assert gs.delete(ref) is True
        assert gs.delete(ref) is False  # held no more
        assert ref.tensor_id not in {t["tensor_id"] for t in gs.tensors()["tensors"]}
        with pytest.raises(GradserveHTTPError) as err:
            gs.get(ref)
        assert err.value.status == 409
        assert err.value.problem["tensor_ids"] == [ref.tensor_id]


# ------------------------------------------------------------------ refs as inputs, keep
GRAPH = {
    "nodes": [
        {"id": "loss", "expr": "sum((x @ w - y) ** 2)"},
        {"id": "w_next", "expr": "w - 0.01 * grad(loss, w)"},
    ],
    "outputs": ["loss", "w_next"],
}


def local_step(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    r = x @ w - y
    return float((r**2).sum()), w - 0.01 * (2 * x.T @ r)


def test_refs_go_wherever_arrays_do_and_keep_answers_by_id(server: Server) -> None:
    x, y, w = RNG.standard_normal((8, 3)), RNG.standard_normal((8, 2)), RNG.standard_normal((3, 2))
    with client(server) as gs:
        by_data = gs.forward(GRAPH, {"x": x, "y": y, "w": w})
        held = gs.forward(GRAPH, {"x": x, "y": y, "w": gs.put(w)}, keep=["w_next"])
        assert held.outputs["loss"] == by_data.outputs["loss"]
        assert list(held.outputs) == ["loss"] and list(held.kept) == ["w_next"]
        kept = held.kept["w_next"]
        assert (kept.shape, kept.dtype, kept.value) == ((3, 2), "float64", None)
        assert gs.get(kept).tobytes() == by_data.outputs["w_next"].tobytes()
        # a /backward keeping a gradient, the upstream gradient held too
        r = gs.backward(
            {"nodes": [{"id": "z", "expr": "x * w"}], "outputs": ["z"]},
            {"x": gs.put(x[:, :2]), "w": w[:2, 0]},
            grad_outputs={"z": gs.put(np.ones((8, 2)))},
            requires_grad=["w"],
            keep={"gradients": ["w"]},
        )
        assert list(r.gradients) == [] and list(r.kept_gradients) == ["w"]
        np.testing.assert_array_equal(gs.get(r.kept_gradients["w"]), x[:, :2].sum(0))


def test_a_chain_of_kept_steps_matches_the_local_loop(server: Server) -> None:
    x, y, w = RNG.standard_normal((8, 3)), RNG.standard_normal((8, 2)), RNG.standard_normal((3, 2))
    with client(server) as gs:
        ref = gs.put(w)
        for _ in range(10):
            r = gs.forward(GRAPH, {"x": x, "y": y, "w": ref}, keep=["w_next"])
            loss, w = local_step(x, y, w)
            assert float(r.outputs["loss"]) == pytest.approx(loss, rel=1e-12)
            ref = r.kept["w_next"]
        np.testing.assert_allclose(gs.get(ref), w, rtol=1e-12)


def test_a_409_uploads_what_the_client_put_and_retries_once(server: Server) -> None:
    x, y, w = RNG.standard_normal((8, 3)), RNG.standard_normal((8, 2)), RNG.standard_normal((3, 2))
    recording = Recording()
    with client(server, transport=recording) as gs:
        wref, xref = gs.put(w), gs.put(x)
        gs.delete(wref), gs.delete(xref)  # as an eviction would
        recording.sent.clear()
        r = gs.forward(GRAPH, {"x": xref, "y": y, "w": wref})
        assert float(r.outputs["loss"]) == pytest.approx(local_step(x, y, w)[0], rel=1e-12)
        assert [(m, p) for m, p, _ in recording.sent] == [
            ("POST", "/forward"),  # 409 tensor-unknown, both ids
            ("POST", "/tensors"),
            ("POST", "/tensors"),
            ("POST", "/forward"),
        ]
        # A kept result has no local value: its 409 is raised.
        kept = gs.forward(GRAPH, {"x": x, "y": y, "w": w}, keep=["w_next"]).kept["w_next"]
        gs.delete(kept)
        with pytest.raises(GradserveHTTPError) as err:
            gs.forward(GRAPH, {"x": x, "y": y, "w": kept})
        assert err.value.status == 409 and err.value.problem["tensor_ids"] == [kept.tensor_id]


def test_eviction_under_the_quota_then_the_retry(server: Server) -> None:
    """The quota (64 KiB) holds two of these 24 KiB tensors: a third evicts the least
    recently used, and a request naming it is answered after the client uploads it again."""
    arrays = [RNG.standard_normal(3072) for _ in range(3)]
    with client(server) as gs:
        for held in gs.tensors()["tensors"]:  # (the other tests' tensors, of the same key)
            assert gs.delete(TensorRef.of(held))
        refs = [gs.put(a) for a in arrays]
        held = {t["tensor_id"] for t in gs.tensors()["tensors"]}
        assert refs[0].tensor_id not in held and {refs[1].tensor_id, refs[2].tensor_id} <= held
        assert gs.tensors()["used_bytes"] <= QUOTA
        r = gs.forward({"nodes": [{"id": "s", "expr": "sum(a)"}], "outputs": ["s"]}, {"a": refs[0]})
        assert float(r.outputs["s"]) == pytest.approx(arrays[0].sum(), rel=1e-12)


def test_the_routing_header_goes_with_held_tensors_only(server: Server) -> None:
    recording = Recording()
    with client(server, transport=recording, tensor_affinity="job-7") as gs:
        gs.forward(GRAPH, {"x": np.ones((2, 3)), "y": np.ones((2, 2)), "w": np.ones((3, 2))})
        ref = gs.put(np.ones((3, 2)))
        gs.forward(GRAPH, {"x": np.ones((2, 3)), "y": np.ones((2, 2)), "w": ref})
        gs.forward(
            GRAPH, {"x": np.ones((2, 3)), "y": np.ones((2, 2)), "w": ref.value}, keep=["loss"]
        )
        gs.get(ref), gs.tensors(), gs.delete(ref)
    routed = [TENSOR_HEADER in headers for _, _, headers in recording.sent]
    assert routed == [False, True, True, True, True, True, True]
    values = {h[TENSOR_HEADER] for _, _, h in recording.sent if TENSOR_HEADER in h}
    assert values == {affinity_of(None, "job-7")} and len(values.pop()) == 32
    # By default: the API key's (one replica for a key's tensors), else the client's own.
    assert affinity_of("key", None) == affinity_of("key", None) != affinity_of("other", None)
    assert affinity_of(None, None) != affinity_of(None, None)


# ------------------------------------------------------------------ Parameters
def step(x: Any, y: Any, w1: Any, w2: Any) -> dict[str, Any]:
    loss = ((F.tanh(x @ w1) @ w2 - y) ** 2).mean()
    g1, g2 = grad(loss, [w1, w2])
    return {"loss": loss, "w1": w1 - 0.1 * g1, "w2": w2 - 0.1 * g2}


def local_mlp(x: np.ndarray, y: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> tuple[float, ...]:
    h = np.tanh(x @ w1)
    r = h @ w2 - y
    d = 2 * r / r.size
    g2 = h.T @ d
    g1 = x.T @ ((d @ w2.T) * (1 - h**2))
    return float((r**2).mean()), w1 - 0.1 * g1, w2 - 0.1 * g2  # type: ignore[return-value]


def test_parameters_move_to_the_values_a_traced_step_keeps(server: Server) -> None:
    x, y = RNG.standard_normal((16, 4)), RNG.standard_normal((16, 2))
    w1, w2 = RNG.standard_normal((4, 8)) / 2, RNG.standard_normal((8, 2)) / 3
    recording = Recording()
    with client(server, transport=recording) as gs:
        params = {"w1": gs.parameter(w1), "w2": gs.parameter(w2)}
        for _ in range(8):
            before = params["w1"].ref
            r = gs.forward(step, {"x": x, "y": y, **params})
            loss, w1, w2 = local_mlp(x, y, w1, w2)
            assert float(r.outputs["loss"]) == pytest.approx(loss, rel=1e-12)
            assert list(r.outputs) == ["loss"] and sorted(r.kept) == ["w1", "w2"]
            assert params["w1"].ref == r.kept["w1"] != before
        np.testing.assert_allclose(gs.get(params["w1"]), w1, rtol=1e-12)
        np.testing.assert_allclose(gs.get(params["w2"]), w2, rtol=1e-12)
    # The graph names the next values w1' and w2', and keeps them; a step sends only x, y.
    header = recording.sent[-3]  # (the last forward; then the two gets)
    assert header[:2] == ("POST", "/forward")
    assert next_name("w1") == "w1'"


def test_a_parameter_in_a_graph_by_hand(server: Server) -> None:
    graph = {"nodes": [{"id": "w'", "expr": "w * 2"}], "outputs": ["w'"]}
    with client(server) as gs:
        w = gs.parameter(np.ones(3))
        gs.forward(graph, {"w": w})
        gs.forward(graph, {"w": w})
        assert gs.get(w).tolist() == [4.0, 4.0, 4.0]
        assert isinstance(w, Parameter) and w.shape == (3,) and w.dtype == "float64"


def test_the_async_client_does_the_same(server: Server) -> None:
    x, y, w = RNG.standard_normal((8, 3)), RNG.standard_normal((8, 2)), RNG.standard_normal((3, 2))

    async def run() -> None:
        async with AsyncClient(server.base) as gs:
            ref = await gs.put(w)
            assert (await gs.get(ref)).tobytes() == w.tobytes()
            r = await gs.forward(GRAPH, {"x": x, "y": y, "w": ref}, keep=["w_next"])
            loss, w_next = local_step(x, y, w)
            assert float(r.outputs["loss"]) == pytest.approx(loss, rel=1e-12)
            np.testing.assert_allclose(await gs.get(r.kept["w_next"]), w_next, rtol=1e-12)
            assert await gs.delete(ref) is True
            r = await gs.forward(GRAPH, {"x": x, "y": y, "w": ref})  # re-uploaded, retried
            assert float(r.outputs["loss"]) == pytest.approx(loss, rel=1e-12)
            p = await gs.parameter(w)
            await gs.forward(step_linear, {"x": x, "y": y, "w": p})
            np.testing.assert_allclose(await gs.get(p), w_next, rtol=1e-12)
            listed = await gs.tensors()
            assert p.ref.tensor_id in {t["tensor_id"] for t in listed["tensors"]}

    asyncio.run(run())


def step_linear(x: Any, y: Any, w: Any) -> dict[str, Any]:
    loss = ((x @ w - y) ** 2).sum()
    return {"loss": loss, "w": w - 0.01 * grad(loss, w)}


def test_keep_is_checked_before_sending(tmp_path: Path) -> None:
    with Client("http://127.0.0.1:9") as gs, pytest.raises(TypeError, match="list of output"):
        gs.forward(GRAPH, {"x": 1.0}, keep="w_next")  # type: ignore[arg-type]
    with Client("http://127.0.0.1:9") as gs, pytest.raises(TypeError, match="not \\['output'\\]"):
        gs.forward(GRAPH, {"x": 1.0}, keep={"output": ["w_next"]})
