"""bench/bench_compiled.py's workloads are right: gradserve, the hand-written NumPy and the
PyTorch eager versions agree on the value and every gradient (small sizes; no timing)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from bench import bench_compiled as bc
from gradserve.engine.graph import xla

WORKLOADS = bc.small_workloads()


@pytest.fixture(scope="module")
def gs() -> bc.Gradserve:
    return bc.Gradserve()


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_implementations_agree(workload: bc.Workload, gs: bc.Gradserve) -> None:
    baselines = [impl for impl in (workload.numpy, workload.torch) if impl is not None]
    assert baselines, "nothing to compare gradserve with"
    bc.check(workload, gs)  # raises AssertionError on any disagreement


def test_check_catches_a_wrong_gradient(gs: bc.Gradserve) -> None:
    w = bc.gmm(2, 3, 10)
    numpy_gmm = w.numpy
    assert numpy_gmm is not None

    def wrong(inputs: bc.Arrays) -> tuple[np.ndarray, bc.Arrays]:
        value, grads = numpy_gmm(inputs)
        return value, {**grads, "means": grads["means"] * 1.001}

    w.numpy = wrong
    with pytest.raises(AssertionError, match="means"):
        bc.check(w, gs)


def test_objectives_are_the_tests_objectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies in the bench still say what tests/test_objectives.py says."""
    tests = pytest.importorskip("tests.test_objectives")
    assert set(bc.OBJECTIVES) == set(tests.OBJECTIVES)
    monkeypatch.setattr(tests, "RNG", np.random.default_rng(42))  # its first draws
    data = bc.objectives_data()
    for k, v in tests._data().items():
        np.testing.assert_array_equal(data[k], v, err_msg=k)
    for name, (nodes, output, wrt) in bc.OBJECTIVES.items():
        theirs, their_output, their_wrt, _ = tests.OBJECTIVES[name]
        assert (output, wrt) == (their_output, their_wrt), name
        ours = [(n["id"], n.get("op"), list(n.get("args", ())), n.get("attrs", {}),
                 n.get("expr")) for n in nodes]
        assert ours == [(n.id, n.op, list(n.args), dict(n.attrs), n.expr) for n in theirs], name


def test_transform_benchmarks_agree_with_torch() -> None:
    """bench/bench_transforms.py: the scan, the unrolled loop and PyTorch agree on the RNN's
    gradients, and every objective's in-graph HVP and JVP on PyTorch's double backward and
    torch.func.jvp."""
    from bench import bench_transforms as bt

    bt.check_rnn(steps=20)
    for name in bt.OBJECTIVES:
        bt.check_hvp(name)
        bt.check_jvp(name)


@pytest.mark.parametrize("encoding", ["binary", "base64", "json"])
def test_wire_client_encodes_and_decodes(encoding: str) -> None:
    """bench/bench_service.py's wire client: a request it encodes, echoed back as the
    floor echoes it, decodes to the tensor it sent."""
    from bench import bench_service as bs

    x = np.random.default_rng(3).standard_normal((3, 5), dtype=np.float32)
    parts, headers = bs.encode_tensor_request(x, encoding)
    body = np.frombuffer(b"".join(bytes(memoryview(p)) for p in parts), np.uint8)
    fields = {k.lower(): v for k, v in headers}
    got = bs.decode_tensor_response((200, fields, body), "inputs", "x")
    np.testing.assert_array_equal(got, x)
    assert got.dtype == np.float32 and got.shape == (3, 5)


@pytest.mark.integration
def test_wire_part_runs_small() -> None:
    """The wire part end to end at small sizes (no timing): its three servers start, every
    encoding and the echo decode to what they should (the part checks), a graph sent by id
    answers as the full graph does, and the RSS sampler sees the server's process tree."""
    from bench import bench_service as bs

    w = bs.wire(rounds=1, shape=(64, 64), steps=30, width=512, rss_elements=1 << 18)
    assert set(w["tensor"]["ms"]) == {"floor", "binary", "base64", "json"}
    assert w["graph"]["sent"]["id"] < w["graph"]["sent"]["full"]
    assert w["graph"]["sent"]["id"] > bs.INLINE_MAX_BODY  # (see the graph_id probe)
    assert w["rss"]["before"] > 0 and w["rss"]["peak"] >= w["rss"]["before_front"]
    bs.print_wire(w, 1)


@pytest.mark.integration
def test_capacity_load_runs_small() -> None:
    """bench/bench_capacity.py's load generator and its accounting against one replica
    (no timing): every answer a 200, the tree's RSS and CPU seen."""
    from bench import bench_capacity as bc

    port = bc.free_port()
    with bc.replica(port, 1) as proc:
        m = bc.load(port, bc.SEED, 2, 0.5, 200, [proc.pid])
    assert m.requests > 0 and m.statuses == {}, m
    assert m.peak_rss > 0 and m.server_cpu_ms > 0, m


def test_the_gradbench_ode_graph_is_gradbenchs_ode() -> None:
    """bench/bench_remat.py's ode (GradBench's, an RK4 scan) against its PyTorch reference,
    with the server's budget and with one that checkpoints its loop: the same gradient."""
    import json
    import time

    from bench import bench_remat as br
    from gradserve.engine.errors import MemoryBudgetError
    from gradserve.service.compute import MODELS, Compute
    from gradserve.service.settings import Settings

    n, s = 40, 40
    x = np.random.default_rng(5).random(n)
    m = np.zeros(n)
    m[0] = 1.0
    want, grad = br.ode_torch(x, s)
    compute = Compute(Settings(program_store_bytes=0))

    def run(budget: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"graph": br.ode_graph(n, s), "inputs": {
            "x": {"data": x.tolist(), "dtype": "float64", "requires_grad": True},
            "m": {"data": m.tolist(), "dtype": "float64"}}}
        if budget:
            body["memory_budget_bytes"] = budget
        reply = compute.run(json.dumps(body).encode(), MODELS["backward"],
                            time.monotonic() + 60, lambda _: None)
        return json.loads(b"".join(bytes(p) for p in reply.parts))  # type: ignore[no-any-return]

    plain = run(None)
    with pytest.raises(MemoryBudgetError) as info:  # (the least peak it can reach)
        run(1)
    least = info.value.planned_bytes
    assert least < plain["meta"]["planned_peak_bytes"]
    fitted = run(least)
    assert fitted["meta"]["recompute"] is not None and fitted["meta"]["peak_bytes"] <= least
    assert fitted["gradients"] == plain["gradients"]
    np.testing.assert_allclose(plain["outputs"]["out"]["data"], want, rtol=1e-12)
    np.testing.assert_allclose(plain["gradients"]["x"]["data"], grad, rtol=1e-10, atol=1e-15)


@pytest.mark.skipif(not xla.available(), reason="jax is not importable (the run without it)")
def test_the_native_tier_benchmark_agrees_with_jax() -> None:
    """bench/bench_xla.py's workloads, small: the interpreter, the native tier and JAX's
    own derivative of the same function agree (bench_case checks it, to 1e-9)."""
    from bench import bench_xla as bx

    gs = bc.Gradserve()
    for case in (bx.rnn_scan(20), bx.lse(100), bx.llsq(16, 4), bx.kmeans(20, 3, 2),
                 bx.gmm(3, 4, 20), bx.ode(10, 4), bx.saddle(3)):
        row = bx.bench_case(case, gs, rounds=1, budget_s=0.0)
        assert {"interp", "xla", "jax"} <= set(row.ms), (case.name, row.note)
        assert row.served_jax is not None or not row.gradbench, case.name


def test_the_gradbench_kmeans_dir_is_its_closed_form() -> None:
    """bench_xla's kmeans dir (a forward program with `grad` and `jvp` inside): J / H
    with J = 2 sum(c - p) over each centroid's points and H = 2 * their count, from
    gradserve's interpreter, and from the native tier and GradBench's JAX `dir` where jax
    is importable (bench_case checks those against the interpreter)."""
    from bench import bench_xla as bx

    case = bx.kmeans(30, 4, 3)
    P, C = case.inputs["P"], case.inputs["C"]
    nearest = np.argmin(((P[:, None, :] - C[None, :, :]) ** 2).sum(2), axis=1)
    want = np.stack([(C[j] - P[nearest == j]).sum(0) / (nearest == j).sum()
                     for j in range(len(C))])
    program = bx.compile_program(case)
    assert not program.backward
    gs = bc.Gradserve()
    outputs, _, _ = gs.run(program, case.inputs)
    np.testing.assert_allclose(outputs["out"], want, rtol=1e-12, atol=1e-14)
    assert case.numpy is not None
    np.testing.assert_allclose(case.numpy(case.inputs)[0], want, rtol=1e-12, atol=1e-14)
    if xla.available():
        row = bx.bench_case(case, gs, rounds=1, budget_s=0.0)
        assert {"interp", "xla", "jax", "numpy"} <= set(row.ms), row.note


def test_the_gradbench_gmm_is_gradbenchs_definition() -> None:
    """bench_compiled's gmm is GradBench's log posterior: on a 1-d, 1-component model it
    is the Gaussian log likelihood of the points plus the log Wishart (here gamma-
    distribution) density of the precision exp(2 q), at gamma = 1, m = 0."""
    from math import lgamma, log, pi

    n = 5
    w = bc.gmm(1, 1, n)
    x, mu, q = w.inputs["x"][:, 0], w.inputs["means"][0, 0], w.inputs["icf"][0, 0]
    tau = np.exp(2 * q)  # the precision, Q^T Q
    likelihood = np.sum(0.5 * np.log(tau / (2 * pi)) - 0.5 * tau * (x - mu) ** 2)
    # Wishart_1(V = 1/gamma^2 = 1, dof 2): a gamma density of shape 1, scale 2.
    prior = -tau / 2 - log(2) - lgamma(1)
    outputs, _, _ = bc.Gradserve().run_graph(w.graph, w.inputs, w.wrt)
    np.testing.assert_allclose(outputs["loss"], likelihood + prior, rtol=1e-12)
