"""Tensors that stay on the server (benchmark, not a test): training loops as a user writes
them with `gradserve.Client` against `gradserve serve` with its defaults, side by side
with the same loop in local PyTorch and with gradserve sending its parameters every step.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 -m bench.bench_tensors [--smoke]

Every loop is SGD on the mean squared error of a tanh MLP against fixed random targets,
float32, lr 0.05, the same initial parameters and batches everywhere:

- **local**: PyTorch eager: the loss, `torch.autograd.grad`, the update under no_grad.
- **sending**: `Client.backward(loss_fn, params + batch)` (traced once, sent by
  `graph_id`, binary bodies), the update in NumPy: every parameter up and every gradient
  down, each step.
- **held**: the parameters are `Parameter`s on the server; one `Client.forward(step, ...)`
  a step, `step` a traced function returning the loss and `w - lr * grad(loss, w)` for
  each parameter: the new parameters are kept there, and only the batch is sent.

1. The issue's loop: batch 256x32 -> 64 -> 10, 200 steps. Target: held <= 1.0 ms a step,
   its losses as the local loop's.
2. A model whose local step takes tens of milliseconds: batch 256, 784 -> 1024 -> 1024 ->
   10. Targets: held <= 1.25x local, <= 0.3x sending.
3. A 10M-parameter MLP (784 -> 3072 -> 2432 -> 10): the bytes a held step sends (request
   bodies, as the client wrote them) against the batch's own. Target: <= batch + 2 KiB.
4. 8 clients training at once (threads), each with its own API key and parameters, the
   quota set to hold 4 versions of a model: no id crosses keys (each key's GET /tensors
   lists its own; another key's id is 409 to it), the quota holds (used <= quota at every
   look), nothing a running request uses is evicted (no 409 in any step).

Per-step times are medians after two warm-up steps; a step is timed end to end in the
client. PyTorch runs with its default threads. Loopback only; bounded in steps and time.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from bench.harness import Report, command_line
from gradserve import Client, F, GradserveHTTPError, Parameter, grad
from tests.support.server import serving

LR = 0.05
Arrays = dict[str, np.ndarray]
MAX_SECONDS = 900.0  # the whole run's bound


@dataclass(frozen=True)
class Model:
    name: str
    widths: tuple[int, ...]  # input, hidden..., output
    batch: int

    @property
    def params(self) -> int:
        w = self.widths
        return sum(a * b + b for a, b in itertools.pairwise(w))


def init(model: Model, seed: int = 0) -> Arrays:
    rng = np.random.default_rng(seed)
    out = {}
    w = model.widths
    for i, (a, b) in enumerate(itertools.pairwise(w)):
        out[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    return out


def batches(model: Model, steps: int, seed: int = 1) -> list[Arrays]:
    """A few distinct batches, cycled."""
    rng = np.random.default_rng(seed)
    distinct = [
        {
            "x": rng.standard_normal((model.batch, model.widths[0])).astype(np.float32),
            "y": rng.standard_normal((model.batch, model.widths[-1])).astype(np.float32),
        }
        for _ in range(min(steps, 4))
    ]
    return [distinct[i % len(distinct)] for i in range(steps)]


def loss_of(x: Any, y: Any, params: dict[str, Any], tanh: Callable[[Any], Any]) -> Any:
    h = x
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = tanh(h)
    return ((h - y) ** 2).mean()


def sgd_step(names: list[str]) -> Callable[..., dict[str, Any]]:
    """The traced step of a held loop: the loss, and each parameter's next value under its
    own name (which the client keeps on the server, and moves the Parameter to)."""

    def step(x: Any, y: Any, **p: Any) -> dict[str, Any]:
        loss = loss_of(x, y, p, F.tanh)
        grads = grad(loss, [p[k] for k in names])
        return {"loss": loss, **{k: p[k] - LR * g for k, g in zip(names, grads, strict=True)}}

    return step


# ------------------------------------------------------------------ the three loops
def local_loop(model: Model, data: list[Arrays]) -> tuple[list[float], list[float]]:
    """PyTorch eager: (per-step ms, losses)."""
    params = {k: torch.tensor(v, requires_grad=True) for k, v in init(model).items()}
    times, losses = [], []
    for b in data:
        t0 = time.perf_counter()
        x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
        loss = loss_of(x, y, params, torch.tanh)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads, strict=True):
                p -= LR * g
        losses.append(float(loss.detach()))
        times.append((time.perf_counter() - t0) * 1000)
    return times, losses


def sending_loop(
    client: Client, model: Model, data: list[Arrays]
) -> tuple[list[float], list[float]]:
    """Every parameter sent and every gradient received each step; the update here."""
    params = init(model)
    names = list(params)

    def loss_fn(x: Any, y: Any, **p: Any) -> Any:
        return {"loss": loss_of(x, y, p, F.tanh)}

    times, losses = [], []
    for b in data:
        t0 = time.perf_counter()
        r = client.backward(loss_fn, {**b, **params}, requires_grad=names)
        params = {k: params[k] - LR * r.gradients[k] for k in names}
        losses.append(float(r.outputs["loss"]))
        times.append((time.perf_counter() - t0) * 1000)
    return times, losses


def held_loop(
    client: Client, model: Model, data: list[Arrays]
) -> tuple[list[float], list[float], dict[str, Parameter]]:
    """The parameters held on the server; one request a step, sending the batch alone."""
    params = {k: client.parameter(v) for k, v in init(model).items()}
    step = sgd_step(list(params))
    times, losses = [], []
    for b in data:
        t0 = time.perf_counter()
        r = client.forward(step, {**b, **params})
        losses.append(float(r.outputs["loss"]))
        times.append((time.perf_counter() - t0) * 1000)
    return times, losses, params


def per_step(times: list[float]) -> float:
    return statistics.median(times[2:] if len(times) > 4 else times)


def max_diff(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.array(a) - np.array(b))))


# ------------------------------------------------------------------ parts
def bench_loops(
    report: Report, base: str, model: Model, steps: int, targets: tuple[float | None, ...]
) -> None:
    """The three loops side by side; `targets`: the held step's most ms, most times
    local, most times sent (None: none)."""
    data = batches(model, steps)
    local_t, local_l = local_loop(model, data)
    with Client(base) as client:
        send_t, send_l = sending_loop(client, model, data)
        held_t, held_l, _ = held_loop(client, model, data)
    local, send, held = per_step(local_t), per_step(send_t), per_step(held_t)
    part = f"{model.name} ({'x'.join(map(str, (model.batch, *model.widths)))}, {steps} steps)"
    report.add(part, "local PyTorch, ms a step", f"{local:.3f}")
    report.add(
        part,
        "parameters sent, ms a step",
        f"{send:.3f} ({send / local:.2f}x local; losses within {max_diff(send_l, local_l):.1e})",
    )
    most_ms, most_local, most_sent = targets
    wanted = [
        f"<= {limit}{unit}"
        for limit, unit in ((most_ms, " ms"), (most_local, "x local"), (most_sent, "x sent"))
        if limit is not None
    ]
    report.add(
        part,
        "parameters held, ms a step",
        f"{held:.3f} ({held / local:.2f}x local, {held / send:.2f}x sent; losses within "
        f"{max_diff(held_l, local_l):.1e})",
        ", ".join(wanted),
        (most_ms is None or held <= most_ms)
        and (most_local is None or held <= most_local * local)
        and (most_sent is None or held <= most_sent * send),
    )


class Counting(httpx.HTTPTransport):
    """The bytes of every request body the client writes, and of every response body."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []
        self.received: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.sent.append(int(request.headers.get("content-length", 0)))
        response.read()
        self.received.append(len(response.content))
        return response


def bench_bytes(report: Report, base: str, model: Model, steps: int) -> None:
    counting = Counting()
    data = batches(model, steps + 1)
    with Client(base, transport=counting) as client:
        _, _, params = held_loop(client, model, data[:1])  # the uploads, and the trace
        counting.sent.clear()
        counting.received.clear()
        held_loop_steps(client, params, data[1:])
    batch = data[0]["x"].nbytes + data[0]["y"].nbytes
    sent, received = max(counting.sent), max(counting.received)
    over = sent - batch
    report.add(
        f"{model.name} ({model.params / 1e6:.1f}M parameters, {steps} steps)",
        "bytes a held step sends",
        f"{sent:,} (the batch's {batch:,} + {over:,}; receives {received:,})",
        "<= batch + 2 KiB",
        over <= 2048,
    )


def held_loop_steps(client: Client, params: dict[str, Parameter], data: list[Arrays]) -> None:
    step = sgd_step(list(params))
    for b in data:
        client.forward(step, {**b, **params})


def bench_clients(report: Report, model: Model, clients: int, steps: int) -> None:
    """`clients` threads, each its own key and parameters, on one server whose quota holds
    4 versions of the model."""
    keys = [f"bench-key-{i}" for i in range(clients)]
    quota = 4 * model.params * 4
    env = {"GRADSERVE_API_KEYS": ",".join(keys), "GRADSERVE_TENSOR_QUOTA_BYTES": str(quota)}
    conflicts: list[str] = []
    used_max = 0
    unknown = 0
    finals: dict[int, dict[str, Parameter]] = {}
    lock = threading.Lock()

    def train(i: int, base: str) -> None:
        nonlocal used_max, unknown
        data = batches(model, steps, seed=10 + i)
        with Client(base, api_key=keys[i]) as client:
            try:
                _, _, params = held_loop(client, model, data)
            except GradserveHTTPError as exc:
                with lock:
                    unknown += exc.status == 409
                    conflicts.append(f"client {i}: {exc}")
                return
            used = client.tensors()["used_bytes"]
            with lock:
                used_max = max(used_max, used)
                finals[i] = params

    started = time.perf_counter()
    with serving(env=env) as server:
        threads = [threading.Thread(target=train, args=(i, server.base)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=MAX_SECONDS)
        seconds = time.perf_counter() - started
        crossed = 0
        for i, params in finals.items():
            with Client(server.base, api_key=keys[(i + 1) % clients]) as other:
                theirs = {t["tensor_id"] for t in other.tensors()["tensors"]}
                for p in params.values():
                    crossed += p.ref.tensor_id in theirs
                    try:
                        other.get(p)
                        crossed += 1
                    except GradserveHTTPError as exc:
                        crossed += exc.status != 409
    report.add(
        f"{clients} clients x {steps} steps, own keys",
        "isolation, quota, evictions",
        f"{clients * steps / seconds:.0f} steps/s; {crossed} ids crossed keys; max used "
        f"{used_max:,} of {quota:,} B; {unknown} 409s"
        + (f" ({conflicts[0]})" if conflicts else ""),
        "no id crosses keys, the quota holds, no 409",
        not conflicts and crossed == 0 and used_max <= quota and len(finals) == clients,
    )


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__)
    args = parser.parse_args(argv)
    smoke = args.smoke
    started = time.perf_counter()
    small = Model("2-layer tanh MLP", (32, 64, 10), 256)
    large = Model("MLP", (784, 1024, 1024, 10), 256) if not smoke else Model("MLP", (16, 32, 10), 8)
    huge = Model("MLP", (784, 3072, 2432, 10), 256) if not smoke else Model("MLP", (16, 64, 10), 8)
    report = Report()
    with serving() as server:
        bench_loops(report, server.base, small, 5 if smoke else 200, (1.0, None, None))
        bench_loops(report, server.base, large, 4 if smoke else 20, (None, 1.25, 0.3))
        bench_bytes(report, server.base, huge, 2 if smoke else 3)
    bench_clients(report, small, 2 if smoke else 8, 3 if smoke else 50)
    report.print(f"held tensors ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
