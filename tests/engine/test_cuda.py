"""The CUDA path, where a GPU and CuPy are present (marker `cuda`): every op sample and its
gradients through compiled programs on the GPU against the same programs on the CPU, and
the service's `/devices` and seed example on `cuda`. On a host without a GPU these skip,
saying so: the CPU suite guards the CUDA path by running on array-api-strict."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradserve.engine.backends import available_devices, get_backend
from gradserve.engine.graph.autodiff import vjp
from gradserve.engine.graph.builder import Builder
from gradserve.engine.graph.compiler import assemble
from gradserve.engine.graph.executor import execute
from gradserve.engine.ops import OPS
from gradserve.engine.ops.registry import Meta
from tests.support.op_samples import Sample
from tests.support.ops import is_float_array, op_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("cuda:0" not in available_devices(), reason="no CUDA device here"),
]

TOLERANCE = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-9}


def _program(
    name: str, sample: Sample, dtype: str, device: str, grads: bool
) -> tuple[Any, dict[str, np.ndarray]]:
    """The op (and, with `grads`, its VJP with an upstream gradient) as a program."""
    op = OPS[name]
    b = Builder()
    args: list[Any] = []
    inputs: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for i, a in enumerate(sample.args):
        if isinstance(a, np.ndarray):
            array = a.astype(dtype) if is_float_array(a) else a
            sym = b.value(Meta(array.shape, str(array.dtype)))
            inputs[f"a{i}"], arrays[f"a{i}"] = sym, array
            args.append(sym)
        else:
            args.append(a)
    out = b.emit(op, args, op.bind_attrs(sample.attrs))
    outputs = {"out": out}
    if grads:
        wrt = [
            k
            for k, s in inputs.items()
            if s.dtype.startswith("float") and op.arg_differentiable(int(k[1:]))
        ]
        v = b.value(out.meta)
        inputs["v"] = v
        arrays["v"] = np.random.default_rng(5).standard_normal(out.shape).astype(out.dtype)
        found = vjp(b, list(b.steps), [(out.slot, v)], [inputs[k].slot for k in wrt])
        outputs.update({f"d{k}": g for k, g in zip(wrt, found, strict=True) if g is not None})
    return assemble(b, inputs, outputs, device=device), arrays


def _run(name: str, sample: Sample, dtype: str, grads: bool) -> None:
    results = []
    for device in ("cpu", "cuda:0"):
        program, arrays = _program(name, sample, dtype, device, grads)
        backend = get_backend(device)
        r = execute(program, {k: backend.from_host(a) for k, a in arrays.items()}, verify=True)
        assert r.peak_bytes == r.planned_peak_bytes
        results.append({k: np.asarray(backend.to_host(v)) for k, v in r.outputs.items()})
    cpu, gpu = results
    for key in cpu:
        assert gpu[key].shape == cpu[key].shape and gpu[key].dtype == cpu[key].dtype, key
        tol = TOLERANCE.get(str(cpu[key].dtype), 0)  # integers and bools: exact
        np.testing.assert_allclose(
            gpu[key], cpu[key], rtol=tol, atol=tol, equal_nan=True, err_msg=key
        )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_forward_on_the_gpu_is_the_cpu_forward(name: str, sample: Sample, dtype: str) -> None:
    _run(name, sample, dtype, grads=False)


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_gradients_on_the_gpu_are_the_cpu_gradients(name: str, sample: Sample) -> None:
    _run(name, sample, "float64", grads=True)


def test_the_service_lists_the_gpu_and_computes_on_it() -> None:
    import anyio
    import httpx
    from asgi_lifespan import LifespanManager

    from gradserve.service.app import create_app
    from gradserve.service.settings import Settings
    from tests.support.seeds import SEED_OP

    async def check() -> None:
        app = create_app(Settings())
        async with (
            LifespanManager(app) as manager,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(manager.app), base_url="http://test"
            ) as c,
        ):
            devices = (await c.get("/devices")).json()["devices"]
            gpu = next(d for d in devices if d["name"] == "cuda:0")
            assert gpu["kind"] == "cuda" and gpu["memory_bytes"] > 0
            assert gpu["uuid"].startswith("GPU-") and gpu["model"]
            for device in ("cuda", "cuda:0", "auto"):
                r = (await c.post("/backward", json={**SEED_OP, "device": device})).json()
                assert r["meta"]["device"] == "cuda:0"
                assert r["outputs"]["z"]["data"] == -5.0
                assert r["gradients"]["x"]["data"] == 4.0
                assert r["gradients"]["y"]["data"] == -6.0
            # A large body computes in a worker process, on the GPU too.
            x = np.linspace(-1, 1, 5000)
            body = {
                "graph": {"nodes": [{"id": "z", "expr": "sum(sin(x) * x)"}], "outputs": ["z"]},
                "device": "cuda",
                "inputs": {"x": {"data": x.tolist(), "dtype": "float64", "requires_grad": True}},
            }
            r = (await c.post("/backward", json=body)).json()
            assert r["meta"]["device"] == "cuda:0"
            np.testing.assert_allclose(r["outputs"]["z"]["data"], np.sum(np.sin(x) * x))
            np.testing.assert_allclose(r["gradients"]["x"]["data"], np.sin(x) + x * np.cos(x))

    anyio.run(check)


def test_scan_and_derivative_nodes_on_the_gpu_are_the_cpu_ones() -> None:
    """A differentiated scan (an RNN, with a grad node in a second loop's body) and an
    in-graph HVP, compiled for each device: the loop's stacking and slicing run on CuPy."""
    from gradserve.engine.graph import BodySpec, GraphSpec, NodeSpec, TensorSpec, compile_graph

    rng = np.random.default_rng(3)
    arrays = {
        "xs": rng.standard_normal((50, 4, 8)),
        "w": rng.standard_normal((8, 8)) * 0.3,
        "u": rng.standard_normal((8, 8)) * 0.3,
        "b": rng.standard_normal(8),
        "h0": rng.standard_normal((4, 8)),
        "v": rng.standard_normal((8, 8)),
    }
    rnn = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[NodeSpec("h2", expr="tanh(x @ w + h @ u + b)")],
        next={"h": "h2"},
    )
    descent = BodySpec(
        carry=["p"],
        xs=[],
        nodes=[
            NodeSpec("f", expr="sum((p - h_last) ** 2) + sum(p ** 4) / 4"),
            NodeSpec("p2", expr="p - 0.1 * grad(f, p)"),
        ],
        next={"p": "p2"},
    )
    nodes = [
        NodeSpec(
            "rnn", op="scan", args=["h0", "xs"], body=rnn, results={"h_last": "h", "hs": "h2"}
        ),
        NodeSpec(
            "gd", op="scan", args=["h0"], body=descent, results={"p_end": "p"}, attrs={"length": 5}
        ),
        NodeSpec("loss", expr="sum(hs * hs) + sum(p_end * p_end)"),
        NodeSpec("g", expr="grad(loss, w)"),
        NodeSpec("hv", expr="grad(sum(g * v), w)"),
    ]
    specs = {k: TensorSpec(a.shape, str(a.dtype), k in ("w", "u", "h0")) for k, a in arrays.items()}
    results = []
    for device in ("cpu", "cuda:0"):
        program = compile_graph(
            GraphSpec(nodes, ["loss", "hv"]),
            specs,
            backward=True,
            grad_outputs={"hv": TensorSpec((8, 8), "float64")},
            device=device,
        )
        backend = get_backend(device)
        r = execute(
            program,
            {k: backend.from_host(a) for k, a in arrays.items()},
            grad_outputs={"hv": backend.from_host(np.ones((8, 8)))},
            verify=True,
        )
        assert r.peak_bytes == r.planned_peak_bytes
        results.append(
            {
                **{k: np.asarray(backend.to_host(v)) for k, v in r.outputs.items()},
                **{f"d{k}": np.asarray(backend.to_host(v)) for k, v in (r.gradients or {}).items()},
            }
        )
    cpu, gpu = results
    assert set(cpu) == {"loss", "hv", "dw", "du", "dh0"}
    for key in cpu:
        np.testing.assert_allclose(gpu[key], cpu[key], rtol=1e-9, atol=1e-9, err_msg=key)
