"""bench/workloads.py's workloads are right: gradserve, the hand-written NumPy and the
PyTorch eager versions agree on the value and every gradient (small sizes; no timing)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
import pytest

pytest.importorskip("torch")

from bench import harness, workloads
from gradserve.engine.graph import xla
from tests.support.server import free_port

WORKLOADS = workloads.small_workloads()


@pytest.fixture(scope="module")
def gs() -> harness.Gradserve:
    return harness.Gradserve()


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_implementations_agree(workload: workloads.Workload, gs: harness.Gradserve) -> None:
    baselines = [impl for impl in (workload.numpy, workload.torch) if impl is not None]
    assert baselines, "nothing to compare gradserve with"
    harness.check(workload, gs)  # raises AssertionError on any disagreement


def test_check_catches_a_wrong_gradient(gs: harness.Gradserve) -> None:
    w = workloads.gmm(2, 3, 10)
    numpy_gmm = w.numpy
    assert numpy_gmm is not None

    def wrong(inputs: workloads.Arrays) -> tuple[np.ndarray, workloads.Arrays]:
        value, grads = numpy_gmm(inputs)
        return value, {**grads, "means": grads["means"] * 1.001}

    w.numpy = wrong
    with pytest.raises(AssertionError, match="means"):
        harness.check(w, gs)


def test_objectives_are_the_tests_objectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies in the bench still say what the tests' objectives say."""
    tests = pytest.importorskip("tests.support.objectives")
    assert set(workloads.OBJECTIVES) == set(tests.OBJECTIVES)
    monkeypatch.setattr(tests, "RNG", np.random.default_rng(42))  # its first draws
    data = workloads.objectives_data()
    for k, v in tests.objective_data().items():
        np.testing.assert_array_equal(data[k], v, err_msg=k)
    for name, (nodes, output, wrt) in workloads.OBJECTIVES.items():
        theirs, their_output, their_wrt, _ = tests.OBJECTIVES[name]
        assert (output, wrt) == (their_output, their_wrt), name
        ours = [
            (n["id"], n.get("op"), list(n.get("args", ())), n.get("attrs", {}), n.get("expr"))
            for n in nodes
        ]
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


def test_raw_client_reads_an_answer_sent_before_the_body() -> None:
    """A server that answers 413 on the head and closes while the client is still sending
    a large body: the client returns that answer rather than a broken pipe."""
    import socket
    import threading

    answer = b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 7\r\n\r\ntoo big"
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def refuse() -> None:
            conn, _ = listener.accept()
            with conn:
                while b"\r\n\r\n" not in conn.recv(65536):
                    pass
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)

        server = threading.Thread(target=refuse)
        server.start()
        with harness.RawClient(listener.getsockname()[1], timeout=30) as client:
            status, fields, body = client.post("/forward", [bytes(64 << 20)])
        server.join(timeout=30)
    assert (status, fields["content-length"], bytes(body)) == (413, "7", b"too big")


def test_raw_client_reconnects_where_the_server_closed_an_idle_connection() -> None:
    """A server that answers one request and closes the connection (as uvicorn closes an
    idle keep-alive one after 5 s): the client's next request goes on a new connection."""
    import socket
    import threading

    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def one_answer_each() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\nbody" not in data:
                        data += conn.recv(65536)
                    conn.sendall(answer)

        server = threading.Thread(target=one_answer_each)
        server.start()
        with harness.RawClient(listener.getsockname()[1], timeout=30) as client:
            first = client.post("/echo", [b"body"])
            server_side_closed = time.monotonic() + 10
            while not client._closed_by_server() and time.monotonic() < server_side_closed:
                time.sleep(0.01)
            second = client.post("/echo", [b"body"])
        server.join(timeout=30)
    assert [(r[0], bytes(r[2])) for r in (first, second)] == [(200, b"ok")] * 2


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
    from bench import bench_capacity

    port = free_port()
    with bench_capacity.replica(port, 1) as proc:
        m = bench_capacity.load(port, workloads.SEED, 2, 0.5, 200, [proc.pid])
    assert m.requests > 0 and m.statuses == {}, m
    assert m.peak_rss > 0 and m.server_cpu_ms > 0, m


def test_the_gradbench_ode_graph_is_gradbenchs_ode() -> None:
    """bench.workloads' ode (GradBench's, an RK4 scan) against its PyTorch reference,
    with the server's budget and with one that checkpoints its loop: the same gradient."""
    import json
    import time

    from gradserve.engine.errors import MemoryBudgetError
    from gradserve.service.compute import Compute, Stats
    from gradserve.service.settings import Settings

    n, s = 40, 40
    x = np.random.default_rng(5).random(n)
    m = np.zeros(n)
    m[0] = 1.0
    want, grad = workloads.ode_torch(x, s)
    compute = Compute(Settings(program_store_bytes=0))

    def run(budget: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "graph": workloads.ode_graph(n, s),
            "inputs": {
                "x": {"data": x.tolist(), "dtype": "float64", "requires_grad": True},
                "m": {"data": m.tolist(), "dtype": "float64"},
            },
        }
        if budget:
            body["memory_budget_bytes"] = budget
        reply = compute.serve(
            "backward",
            json.dumps(body).encode(),
            None,
            None,
            time.monotonic() + 60,
            lambda _: None,
            Stats(),
        )
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

    gs = harness.Gradserve()
    for case in (
        bx.rnn_scan(20),
        bx.lse(100),
        bx.llsq(16, 4),
        bx.kmeans(20, 3, 2),
        bx.gmm(3, 4, 20),
        bx.ode(10, 4),
    ):
        row = bx.bench_case(case, gs, rounds=1, budget_s=0.0)
        assert {"interp", "xla", "jax"} <= set(row.ms), (case.name, row.note)
        assert row.served_jax is not None or not row.gradbench, case.name


@pytest.mark.skipif(not xla.available(), reason="jax is not importable (the run without it)")
def test_the_cell_as_a_scan_agrees_with_jax_and_numpy() -> None:
    """bench_xla's cell written as a scan, with and without the inputs' projection hoisted
    out of the loop: the interpreter, the tier, JAX and the hand-written NumPy agree
    (bench_case checks it, to 1e-5 in float32), and both fit their plans (lowered)."""
    from bench import bench_xla as bx

    gs = harness.Gradserve()
    for hoisted in (False, True):
        row = bx.bench_case(bx.cell_scan(hoisted), gs, rounds=1, budget_s=0.0)
        assert {"interp", "xla", "jax", "numpy"} <= set(row.ms), row.note


def _particle_reference(w: float) -> float:
    """Particle's objective in plain floats, the force by hand (-∇ₓp = Σ (x - c) / |x - c|³),
    the loop GradBench's `while`: what the bench's masked loop and its `grad` must give."""
    x1, x2, v1, v2 = 0.0, 8.0, 0.75, 0.0
    while True:
        a1 = a2 = 0.0
        for c1, c2 in ((10.0, 10.0 - w), (10.0, 0.0)):
            r3 = ((x1 - c1) ** 2 + (x2 - c2) ** 2) ** 1.5
            a1, a2 = a1 + (x1 - c1) / r3, a2 + (x2 - c2) / r3
        if x2 + 0.1 * v2 < 0:
            break
        x1, x2, v1, v2 = x1 + 0.1 * v1, x2 + 0.1 * v2, v1 + 0.1 * a1, v2 + 0.1 * a2
    x_final = x1 - x2 / v2 * v1
    return x_final * x_final


def _saddle_reference(x: np.ndarray) -> float:
    """Saddle's objective: gd.hpp's argmax of f(x, .) from (1, 1), its gradient by hand."""
    from bench import bench_xla as bx

    fx = float(np.sum(x * x))
    y = bx.multivariate_argmin(
        lambda y: -(fx - float(np.sum(y * y))), lambda y: 2.0 * y, np.ones(2)
    )
    return fx - float(np.sum(y * y))


def test_gradbench_particle_and_saddle_programs() -> None:
    """bench/bench_xla.py's particle and saddle programs, interpreted, from a loop bound
    too short: the bound doubles until the loop finishes, the objective is the plain-float
    one, and the gradient (gradserve's backward through the loop and the `grad` in it) is
    the objective's central difference in float64."""
    from bench import bench_xla as bx

    gs = harness.Gradserve()
    for ev, reference in (
        (bx.particle(16), lambda p: _particle_reference(float(p[0]))),
        (bx.saddle(16), _saddle_reference),
    ):
        server = bx.Server(ev, bx.interpreted(gs))
        value = server.objective(ev.start)
        assert server.bound > 16 and server.runs > 1, ev.name
        np.testing.assert_allclose(value, reference(ev.start), rtol=1e-10, err_msg=ev.name)
        h = 1e-6
        central = [
            (server.objective(ev.start + h * e) - server.objective(ev.start - h * e)) / (2 * h)
            for e in np.eye(ev.start.size)
        ]
        np.testing.assert_allclose(server.gradient(ev.start), central, rtol=1e-6, err_msg=ev.name)


@pytest.mark.skipif(not xla.available(), reason="jax is not importable (the run without it)")
def test_gradbench_particle_and_saddle_evaluations() -> None:
    """Whole evaluations through the native tier and JAX end at GradBench's answers (to
    1e-9), with the same program runs; the interpreter's runs agree with the native tier's
    at the start and at the answer (where the objective is near 0: to 1e-12 absolute)."""
    from bench import bench_xla as bx

    gs = harness.Gradserve()
    for ev in (bx.particle(), bx.saddle()):
        runs = set()
        for build in (bx.lowered, bx.jax_built):
            server = bx.Server(ev, build)
            result, seconds, n = server.evaluate()
            np.testing.assert_allclose(result, ev.expected, rtol=1e-9, atol=0, err_msg=ev.name)
            assert seconds > 0
            runs.add(n)
        assert len(runs) == 1, (ev.name, runs)
        interp, native = bx.Server(ev, bx.interpreted(gs)), bx.Server(ev, bx.lowered)
        for at in (ev.start, result[: ev.start.size]):
            for k, v in native.outputs(at).items():
                np.testing.assert_allclose(
                    interp.outputs(at)[k],
                    v,
                    rtol=1e-9,
                    atol=1e-12,
                    err_msg=f"{ev.name}: {k} at {at}",
                )
            np.testing.assert_allclose(
                interp.gradient(at),
                native.gradient(at),
                rtol=1e-9,
                atol=1e-12,
                err_msg=f"{ev.name}: gradient at {at}",
            )


def test_the_gradbench_kmeans_dir_is_its_closed_form() -> None:
    """bench_xla's kmeans dir (a forward program with `grad` and `jvp` inside): J / H
    with J = 2 sum(c - p) over each centroid's points and H = 2 * their count, from
    gradserve's interpreter, and from the native tier and GradBench's JAX `dir` where jax
    is importable (bench_case checks those against the interpreter)."""
    from bench import bench_xla as bx

    case = bx.kmeans(30, 4, 3)
    P, C = case.inputs["P"], case.inputs["C"]
    nearest = np.argmin(((P[:, None, :] - C[None, :, :]) ** 2).sum(2), axis=1)
    want = np.stack([(C[j] - P[nearest == j]).sum(0) / (nearest == j).sum() for j in range(len(C))])
    program = bx.compile_program(case)
    assert not program.backward
    gs = harness.Gradserve()
    outputs, _, _ = gs.run(program, case.inputs)
    np.testing.assert_allclose(outputs["out"], want, rtol=1e-12, atol=1e-14)
    assert case.numpy is not None
    np.testing.assert_allclose(case.numpy(case.inputs)[0], want, rtol=1e-12, atol=1e-14)
    if xla.available():
        row = bx.bench_case(case, gs, rounds=1, budget_s=0.0)
        assert {"interp", "xla", "jax", "numpy"} <= set(row.ms), row.note


def test_the_gradbench_gmm_is_gradbenchs_definition() -> None:
    """bench.workloads' gmm is GradBench's log posterior: on a 1-d, 1-component model it
    is the Gaussian log likelihood of the points plus the log Wishart (here gamma-
    distribution) density of the precision exp(2 q), at gamma = 1, m = 0."""
    from math import lgamma, log, pi

    n = 5
    w = workloads.gmm(1, 1, n)
    x, mu, q = w.inputs["x"][:, 0], w.inputs["means"][0, 0], w.inputs["icf"][0, 0]
    tau = np.exp(2 * q)  # the precision, Q^T Q
    likelihood = np.sum(0.5 * np.log(tau / (2 * pi)) - 0.5 * tau * (x - mu) ** 2)
    # Wishart_1(V = 1/gamma^2 = 1, dof 2): a gamma density of shape 1, scale 2.
    prior = -tau / 2 - log(2) - lgamma(1)
    outputs, _, _ = harness.Gradserve().run_graph(w.graph, w.inputs, w.wrt)
    np.testing.assert_allclose(outputs["loss"], likelihood + prior, rtol=1e-12)


@pytest.mark.skipif(not xla.available(), reason="jax is not importable (the run without it)")
def test_the_device_rows_run_on_the_cpu() -> None:
    """bench_xla --device (the issue's GPU row, prepared for a GPU), run on the CPU: the
    cell at 64x256 as the service runs it (the unrolled one refused by its memory plan,
    interpreted; the scans lowered) agrees with PyTorch eager (device_rows checks it)."""
    from bench import bench_xla as bx

    rows = bx.device_rows("cpu", rounds=1, budget_s=0.0)
    assert [tier.split(" ")[0] for _, tier, _, _ in rows] == ["interpreter", "xla", "xla"]
    assert all(gs_ms > 0 and torch_ms > 0 for _, _, gs_ms, torch_ms in rows)


def test_the_tier_benchmark_runs_small() -> None:
    """bench/bench_tier.py's one-off row at a small size: both servers answer both
    requests, and the server with the tier off says so."""
    from bench import bench_tier as bt

    rows = bt.one_off(2_000)
    assert [len(rows[name]) for name in ("tier on", "tier off")] == [2, 2]
    assert {meta["tier_reason"] for _, meta in rows["tier off"]} == {"off"}
    assert all(ms > 0 for ms, _ in rows["tier on"] + rows["tier off"])


def test_the_large_tensor_benchmark_agrees_with_torch() -> None:
    """bench_large's graphs are the script's math: gradserve's answer to each body it
    sends (JSON and binary) holds the script's value and gradient."""
    from bench import bench_large
    from gradserve.service.compute import Compute, Stats
    from gradserve.service.settings import Settings
    from gradserve.wire.binary import split

    compute = Compute(Settings(xla="off", program_store_dir=None))
    for case in bench_large.cases(n=50, rows=8, cols=3):
        for binary in (False, True):
            body, headers = bench_large.gradserve_body(case, binary)
            length = dict(headers).get("Inference-Header-Content-Length")
            reply = compute.serve(
                "backward",
                body,
                None if length is None else int(length),
                None,
                1e18,
                lambda _: None,
                Stats(),
            )
            content = b"".join(bytes(p) for p in reply.parts)
            if binary:
                head, tail = split(content, reply.header_length or 0)
                assert orjson.loads(bytes(head))["outputs"]["loss"]["binary_data_size"] == 8
                value, grad = bench_large.torch_gradient(case)
                got = np.frombuffer(bytes(tail), np.float64)  # the loss, then the gradient
                np.testing.assert_allclose(got[0], value, rtol=1e-12)
                np.testing.assert_allclose(got[1:], grad, rtol=1e-10, atol=1e-12)
            else:
                bench_large.check(memoryview(content), case)
