"""Large tensors (benchmark, not a test): GradBench's lse (n = 10^5) and least squares
(1024 x 128) as a user sends them to `gradserve serve` with its defaults, JSON and binary
bodies, against the FastAPI + PyTorch script a competent engineer would write (orjson both
ways, torch on the CPU), side by side in one run; then where the time goes in one
process (gradserve's parse, decode, run and encode against the script's).

Each row: its body sent once to warm up, then `--requests` times, rounds alternating
between the servers; the median of the rounds' p50s, and of their ratios. Loopback only;
bounded in count and time.

    python3 -m bench.bench_large [--rounds 5] [--requests 5]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

from bench.harness import RawClient, command_line
from tests.support.server import free_port, serving

# The script: JSON lists in, JSON lists out, a graph per endpoint; binary bodies as raw
# float64 bytes (what `np.frombuffer` reads), as such a script would take them.
TORCH_APP = """
import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request, Response

app = FastAPI()


def lse(x):
    return torch.logsumexp(x, 0)


def llsq(x, y):
    def loss(t):
        return 0.5 * torch.sum((y - x @ t) ** 2)
    return loss


async def answer(request, binary, fn):
    body = await request.body()
    if binary:
        head = int(request.headers["x-head"])
        meta = orjson.loads(body[:head])
        arrays, at = [], head
        for shape in meta["shapes"]:
            n = int(np.prod(shape)) * 8
            arrays.append(torch.from_numpy(
                np.frombuffer(body, np.float64, n // 8, at).reshape(shape).copy()))
            at += n
    else:
        arrays = [torch.tensor(a, dtype=torch.float64) for a in orjson.loads(body)]
    arrays[0].requires_grad_(True)
    value = fn(*arrays)
    value.backward()
    grad = arrays[0].grad
    if binary:
        return Response(orjson.dumps({"value": value.item()}) + grad.numpy().tobytes(),
                        media_type="application/octet-stream")
    return Response(orjson.dumps({"value": value.item(), "gradient": grad.numpy()},
                                 option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json")


@app.post("/lse")
async def lse_json(request: Request):
    return await answer(request, False, lse)


@app.post("/lse-binary")
async def lse_binary(request: Request):
    return await answer(request, True, lse)


@app.post("/llsq")
async def llsq_json(request: Request):
    return await answer(request, False, lambda t, x, y: llsq(x, y)(t))


@app.post("/llsq-binary")
async def llsq_binary(request: Request):
    return await answer(request, True, lambda t, x, y: llsq(x, y)(t))
"""

# name, inputs (the first one differentiated), the loss's expr, the differentiated input
Case = tuple[str, dict[str, np.ndarray], str, str]


def cases(n: int = 100_000, rows: int = 1024, cols: int = 128) -> list[Case]:
    rng = np.random.default_rng(0)
    return [
        (f"lse, n = {n:,}", {"x": rng.standard_normal(n)}, "logsumexp(x, dim=0)", "x"),
        (
            f"least squares, {rows} x {cols}",
            {
                "t": rng.standard_normal(cols) * 0.1,
                "X": rng.standard_normal((rows, cols)),
                "Y": rng.standard_normal(rows),
            },
            "0.5 * sum((Y - X @ t) ** 2)",
            "t",
        ),
    ]


def torch_gradient(case: Case) -> tuple[float, np.ndarray]:
    """The script's value and gradient (its math, in process)."""
    import torch

    arrays = [torch.tensor(a, dtype=torch.float64) for a in case[1].values()]
    arrays[0].requires_grad_(True)
    value = (
        torch.logsumexp(arrays[0], 0)
        if case[3] == "x"
        else 0.5 * torch.sum((arrays[2] - arrays[1] @ arrays[0]) ** 2)
    )
    value.backward()
    return value.item(), arrays[0].grad.numpy()  # type: ignore[union-attr]


def gradserve_body(case: Case, binary: bool) -> tuple[bytes, list[tuple[str, str]]]:
    _, arrays, expr, wrt = case
    graph = {"nodes": [{"id": "loss", "expr": expr}], "outputs": ["loss"]}
    if not binary:
        inputs = {
            k: {"data": v.tolist(), "dtype": "float64", "requires_grad": k == wrt}
            for k, v in arrays.items()
        }
        return orjson.dumps({"graph": graph, "inputs": inputs}), [
            ("Content-Type", "application/json")
        ]
    inputs = {
        k: {
            "dtype": "float64",
            "shape": list(v.shape),
            "binary_data_size": v.nbytes,
            "requires_grad": k == wrt,
        }
        for k, v in arrays.items()
    }
    head = orjson.dumps({"graph": graph, "inputs": inputs, "encoding": "binary"})
    return head + b"".join(v.tobytes() for v in arrays.values()), [
        ("Content-Type", "application/octet-stream"),
        ("Inference-Header-Content-Length", str(len(head))),
    ]


def script_body(case: Case, binary: bool) -> tuple[bytes, list[tuple[str, str]]]:
    arrays = list(case[1].values())
    if not binary:
        return orjson.dumps([a.tolist() for a in arrays]), [("Content-Type", "application/json")]
    head = orjson.dumps({"shapes": [list(a.shape) for a in arrays]})
    return head + b"".join(a.tobytes() for a in arrays), [
        ("Content-Type", "application/octet-stream"),
        ("x-head", str(len(head))),
    ]


def check(content: memoryview, case: Case) -> None:
    """A gradserve answer holds the script's value and gradient, or raise."""
    doc = orjson.loads(content)
    value, grad = torch_gradient(case)
    np.testing.assert_allclose(doc["outputs"]["loss"]["data"], value, rtol=1e-12)
    np.testing.assert_allclose(doc["gradients"][case[3]]["data"], grad, rtol=1e-10, atol=1e-12)


def p50(client: RawClient, path: str, body: bytes, headers: list[tuple[str, str]], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        status, _, content = client.post(path, [body], headers)
        times.append((time.perf_counter() - t0) * 1000)
        if status != 200:
            raise RuntimeError(f"{path}: status {status}: {bytes(content[:300])!r}")
    return statistics.median(times)


def over_http(
    rounds: int, requests: int, workloads: list[Case]
) -> list[tuple[str, str, float, float, float]]:
    """(case, body kind, gradserve p50, script p50, median ratio) per row."""
    apps = Path(tempfile.mkdtemp(prefix="bench-large-torch-"))
    (apps / "torch_app.py").write_text(TORCH_APP)
    torch_port = free_port()
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "torch_app:app",
        "--port",
        str(torch_port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--app-dir",
        str(apps),
    ]
    rows = []
    try:
        with (
            serving() as server,
            serving(argv, port=torch_port, ready="/"),
            RawClient(server.port) as gs,
            RawClient(torch_port) as pt,
        ):
            for case in workloads:
                slug = "lse" if case[0].startswith("lse") else "llsq"
                for binary in (False, True):
                    body, headers = gradserve_body(case, binary)
                    sbody, sheaders = script_body(case, binary)
                    spath = f"/{slug}-binary" if binary else f"/{slug}"
                    if not binary:  # (warm-up: its first compile; and both are right)
                        check(memoryview(gs.post("/backward", [body], headers)[2]), case)
                    p50(gs, "/backward", body, headers, 1)
                    p50(pt, spath, sbody, sheaders, 1)
                    ours, theirs = [], []
                    for _ in range(rounds):
                        ours.append(p50(gs, "/backward", body, headers, requests))
                        theirs.append(p50(pt, spath, sbody, sheaders, requests))
                    rows.append(
                        (
                            case[0],
                            "binary" if binary else "JSON",
                            statistics.median(ours),
                            statistics.median(theirs),
                            statistics.median(o / t for o, t in zip(ours, theirs, strict=True)),
                        )
                    )
    finally:
        shutil.rmtree(apps, ignore_errors=True)
    return rows


def in_process(case: Case, rounds: int) -> dict[str, float]:
    """Where a JSON request's time goes in the process that computes it, in ms: the
    gradserve stages (the envelope's scan, the document's parse, the tensors' decode,
    compile-or-find, the run, the answer's encode) against the script's (parse, tensors,
    autograd, encode)."""
    import torch

    from gradserve.service.codec import decode_tensor, loads
    from gradserve.service.compute import Compute, Stats
    from gradserve.service.request import _MEMBERS
    from gradserve.service.settings import Settings

    body, _ = gradserve_body(case, binary=False)
    compute = Compute(Settings(xla="off", program_store_dir=None))

    def serve() -> None:
        compute.serve("backward", body, None, None, time.monotonic() + 60, lambda _: None, Stats())

    doc = loads(body)

    def decode() -> None:
        for k, t in doc["inputs"].items():
            decode_tensor(("inputs", k), data=t["data"], dtype=t["dtype"])

    sbody, _ = script_body(case, binary=False)
    fn = (
        (lambda x: torch.logsumexp(x, 0))
        if case[3] == "x"
        else (lambda t, x, y: 0.5 * torch.sum((y - x @ t) ** 2))
    )

    def script() -> None:
        arrays = [torch.tensor(a, dtype=torch.float64) for a in orjson.loads(sbody)]
        arrays[0].requires_grad_(True)
        value = fn(*arrays)
        value.backward()
        orjson.dumps(
            {"value": value.item(), "gradient": arrays[0].grad.numpy()},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )

    stages: dict[str, Callable[[], object]] = {
        "gradserve: whole request": serve,
        "  envelope scan (msgspec)": lambda: _MEMBERS.decode(body),
        "  document parse (jiter)": lambda: loads(body),
        "  tensors decode": decode,
        "script: whole request": script,
        "  parse (orjson)": lambda: orjson.loads(sbody),
    }
    serve()
    out = {}
    for name, stage in stages.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            stage()
            times.append((time.perf_counter() - t0) * 1000)
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.requests = 1, 1
    sizes = {"n": 100, "rows": 16, "cols": 4} if args.smoke else {}
    rows = over_http(args.rounds, args.requests, cases(**sizes))
    print(f"\nover HTTP, p50 of {args.requests} requests, median of {args.rounds} rounds")
    print("| workload | body | gradserve ms | script ms | gradserve / script |")
    print("|---|---|---|---|---|")
    for name, kind, ours, theirs, ratio in rows:
        print(f"| {name} | {kind} | {ours:.2f} | {theirs:.2f} | {ratio:.2f}x |")
    for case in cases(**sizes):
        print(f"\nin one process, JSON, {case[0]}: median of {args.rounds * 3}")
        for stage, ms in in_process(case, args.rounds * 3).items():
            print(f"  {stage:<28} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
