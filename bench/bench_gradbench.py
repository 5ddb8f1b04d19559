"""GradBench's own harness driving gradserve (benchmark, not a test): GradBench's evals
(their inputs, their repetitions, their validation against GradBench's C++ golden
implementations) answered by bench.gradbench_tool, which sends each run of an evaluation
to `gradserve serve` with its defaults as one HTTP request, beside GradBench's own JAX
tool (made to block on its result: its timings otherwise stop before XLA has run), in one
run. Per evaluation: the median of its runs' timings (each tool's own: the function alone,
its input's conversion and its output's outside), and the first run's (a compile, for
both); the geometric mean of gradserve / JAX per eval and over lse, llsq, kmeans, gmm and
ode (target: <= 1.5).

It needs a checkout of GradBench (`--gradbench PATH`: `git clone
https://github.com/gradbench/gradbench`) with its C++ golden implementations built (`make
-C tools/manual bin/lse ...`, which needs nlohmann's json.hpp as `cpp/json.hpp`: Debian's
nlohmann-json3-dev has it), and jax. GradBench's intermediary (`gradbench run`, in Rust)
needs crates that these machines cannot download: the messages go through
`relay` below instead, which passes each line of the eval to the tool and its answer back,
as the intermediary does. With the intermediary, the tool runs as it is: `gradbench run
--eval "..." --tool "python3 -m bench.gradbench_tool --url http://127.0.0.1:8000"`.

`--smoke` needs no checkout: a stand-in eval (GradBench's protocol, lse's messages, its
answers checked against NumPy) through the relay and the tool, against a live server.

    python3 -m bench.bench_gradbench --gradbench PATH [--min-seconds 1] [--evals lse,gmm]
"""

from __future__ import annotations

import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness import command_line
from tests.support.server import ROOT, serving

MAX_SECONDS = 1800.0  # the whole run's bound
ANSWER_S = 600.0  # one message's bound (a tool's evaluation repeats for min_seconds)
# Each eval's sizes (its own arguments): bounded, and the sizes the issue names among them.
EVALS = {
    "lse": ["-n", "10000", "100000"],
    "llsq": ["-n", "1024", "4096", "-m", "128"],
    "kmeans": ["-k", "10", "100", "-n", "1000", "10000", "-d", "8"],
    "gmm": ["-d", "2", "10", "-k", "5", "25", "-n", "1000"],
    "ode": ["-n", "1000", "10000", "-s", "10", "100"],
    "det": ["-l", "5", "8", "11"],
}
TARGET_EVALS = ("lse", "llsq", "kmeans", "gmm", "ode")

# GradBench's JAX tool, each run blocking on its result inside the timed call (run from
# the checkout, whose tools/jax modules it imports by the evals' names, as its image does).
JAX_TOOL = """
import sys

sys.path.insert(0, "python/gradbench/gradbench/tools/jax")
import jax
from gradbench import wrap

plain = wrap.multiple_runs


def blocking(**options):
    def decorate(function):
        return plain(**options)(lambda input: jax.block_until_ready(function(input)))

    return decorate


wrap.multiple_runs = blocking
from gradbench.tools.jax.run import main

main()
"""

# --smoke's stand-in for an eval: GradBench's protocol and lse's messages (start, define,
# an evaluation of each function, an analysis of each), its own check of the answers.
SMOKE_EVAL = """
import json, sys
import numpy as np

def send(message):
    print(json.dumps(message), flush=True)
    return json.loads(sys.stdin.readline())

x = np.random.default_rng(0).standard_normal(64)
send({"id": 0, "kind": "start", "eval": "lse"})
assert send({"id": 1, "kind": "define", "module": "lse"})["success"]
expected = {"primal": float(np.log(np.exp(x).sum())),
            "gradient": (np.exp(x) / np.exp(x).sum()).tolist()}
for k, function in enumerate(("primal", "gradient")):
    answer = send({"id": 2 + 2 * k, "kind": "evaluate", "module": "lse", "function": function,
                   "input": {"x": x.tolist(), "min_runs": 2, "min_seconds": 0}})
    valid = bool(np.allclose(answer["output"], expected[function], rtol=1e-9))
    send({"id": 3 + 2 * k, "kind": "analysis", "of": 2 + 2 * k, "valid": valid})
"""


class _Lines:
    """A process's stdout, a line at a time, with a bound on each wait."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, out: Any) -> None:
        for line in out:
            self.lines.put(line)
        self.lines.put(None)  # (its end)

    def next(self, timeout: float) -> bytes | None:
        """The next line; None when the process closed its stdout or went quiet."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None


def relay(eval_argv: list[str], tool_argv: list[str], cwd: Path, env: dict[str, str]) -> list[dict]:
    """Run an eval against a tool as GradBench's intermediary does: each line the eval
    writes goes to the tool, and the tool's answer back to the eval, until the eval ends.
    Every exchange: the message, the answer, and its round trip in ms."""
    popen: dict[str, Any] = {"cwd": cwd, "env": env, "stdin": subprocess.PIPE}
    exchanges: list[dict] = []
    with (
        subprocess.Popen(eval_argv, stdout=subprocess.PIPE, **popen) as ev,
        subprocess.Popen(tool_argv, stdout=subprocess.PIPE, **popen) as tool,
    ):
        assert ev.stdin is not None and tool.stdin is not None
        from_eval, from_tool = _Lines(ev), _Lines(tool)
        try:
            deadline = time.monotonic() + MAX_SECONDS
            while time.monotonic() < deadline:
                line = from_eval.next(ANSWER_S)
                if line is None:
                    break  # (the eval is done)
                message = json.loads(line)
                t0 = time.perf_counter()
                tool.stdin.write(line)
                tool.stdin.flush()
                answer = from_tool.next(ANSWER_S)
                if answer is None:
                    raise RuntimeError(f"the tool gave no answer to {message['kind']}")
                ms = (time.perf_counter() - t0) * 1000
                exchanges.append({"message": message, "answer": json.loads(answer), "ms": ms})
                ev.stdin.write(answer)
                ev.stdin.flush()
        finally:
            for proc in (ev, tool):
                proc.kill()
    return exchanges


def evaluations(exchanges: list[dict]) -> Iterator[dict[str, Any]]:
    """Each evaluation of an exchange log: its function, description, runs' timings (ms)
    and whether the eval found it valid."""
    valid = {
        e["message"]["of"]: e["message"]["valid"]
        for e in exchanges
        if e["message"]["kind"] == "analysis"
    }
    for e in exchanges:
        m, a = e["message"], e["answer"]
        if m["kind"] != "evaluate":
            continue
        if not a.get("success"):
            raise RuntimeError(f"{m['module']} {m['function']}: {str(a.get('error'))[:600]}")
        yield {
            "key": (m["module"], m["function"], m.get("description", "")),
            **{
                name: [t["nanoseconds"] / 1e6 for t in a["timings"] if t["name"] == timing]
                for name, timing in (("runs", "evaluate"), ("prepare", "prepare"), ("http", "http"))
            },
            "valid": valid.get(m["id"]),
        }


def run_eval(
    name: str, gradbench: Path, server_url: str, min_seconds: float, env: dict[str, str]
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """One eval through both tools: per evaluation, each tool's runs and validity."""
    eval_argv = [
        sys.executable,
        "-m",
        f"gradbench.evals.{name}.run",
        *EVALS[name],
        "--min-runs",
        "1",
        "--min-seconds",
        str(min_seconds),
    ]
    tools = {
        "gradserve": [sys.executable, "-m", "bench.gradbench_tool", "--url", server_url],
        "jax": [sys.executable, "-c", JAX_TOOL],
    }
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for tool, argv in tools.items():
        for ev in evaluations(relay(eval_argv, argv, gradbench, env)):
            out.setdefault(ev["key"], {})[tool] = ev
    return out


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def report(results: dict[str, dict[tuple[str, str, str], dict[str, Any]]]) -> None:
    print(
        "| eval | function | size | gradserve run ms | jax ms | gradserve / jax | gradserve "
        "server ms | first ms (gradserve server / jax) | gradserve over HTTP ms | valid |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    per_eval: dict[str, list[float]] = {}
    for name, rows in results.items():
        for (_, function, size), row in rows.items():
            ours, theirs = row["gradserve"], row.get("jax")
            a = statistics.median(ours["runs"])
            server = [r + p for r, p in zip(ours["runs"], ours["prepare"], strict=True)]
            if theirs is None:  # (GradBench's JAX tool has no such module)
                b, ratio, first, valid = "-", "-", "-", f"{ours['valid']} / -"
            else:
                b = f"{statistics.median(theirs['runs']):.3g}"
                per_eval.setdefault(name, []).append(a / statistics.median(theirs["runs"]))
                ratio = f"{per_eval[name][-1]:.2f}"
                first = f"{theirs['runs'][0]:.3g}"
                valid = f"{ours['valid']} / {theirs['valid']}"
            print(
                f"| {name} | {function} | {size} | {a:.3g} | {b} | {ratio} | "
                f"{statistics.median(server):.3g} | {server[0]:.3g} / {first} | "
                f"{statistics.median(ours['http']):.3g} | {valid} |"
            )
    print("\nwarm (each evaluation's median run):")
    for name, ratios in per_eval.items():
        print(f"- {name}: gradserve / jax, geometric mean {geomean(ratios):.2f}")
    target = [r for name in TARGET_EVALS for r in per_eval.get(name, [])]
    if target:
        overall = geomean(target)
        verdict = "met" if overall <= 1.5 else "MISS"
        print(
            f"- lse, llsq, kmeans, gmm, ode: gradserve / jax, geometric mean {overall:.2f} "
            f"(target <= 1.5: {verdict})"
        )
    # GradBench's own score of a tool on an eval (its scorer for these evals): each
    # evaluation's runs averaged (the first, with its compile, among them), summed.
    print("\nGradBench's score (each evaluation's mean run, summed), ms:")
    scores = {}
    for name, rows in results.items():
        if not all("jax" in row for row in rows.values()):
            continue
        ours, theirs = (
            sum(statistics.fmean(r[t]["runs"]) for r in rows.values())
            for t in (
                "gradserve",
                "jax",
            )
        )
        scores[name] = ours / theirs
        print(f"- {name}: gradserve {ours:.4g}, jax {theirs:.4g}: {ours / theirs:.2f}")
    if all(name in scores for name in TARGET_EVALS):
        overall = geomean([scores[name] for name in TARGET_EVALS])
        verdict = "met" if overall <= 1.5 else "MISS"
        print(
            f"- lse, llsq, kmeans, gmm, ode: geometric mean of the scores' ratios "
            f"{overall:.2f} (target <= 1.5: {verdict})"
        )


def smoke() -> int:
    """The relay and the tool against a live server, with the stand-in eval."""
    with serving() as server:
        exchanges = relay(
            [sys.executable, "-c", SMOKE_EVAL],
            [sys.executable, "-m", "bench.gradbench_tool", "--url", server.base],
            ROOT,
            dict(os.environ),
        )
    evals = list(evaluations(exchanges))
    assert [e["valid"] for e in evals] == [True, True], exchanges
    assert all(len(e["runs"]) == 2 for e in evals)
    for e in evals:
        print(f"{' '.join(e['key'])}: runs {[f'{ms:.2f}' for ms in e['runs']]} ms, valid")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--gradbench", type=Path, help="a checkout of GradBench")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="each evaluation's")
    parser.add_argument("--evals", default=",".join(EVALS), help="comma-separated")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.gradbench is None:
        parser.error("--gradbench PATH is needed (a checkout of GradBench)")
    gradbench = args.gradbench.resolve()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(gradbench / "python" / "gradbench"), str(ROOT)]),
    }
    names = args.evals.split(",")
    missing = [n for n in names if not (gradbench / "tools" / "manual" / "bin" / n).exists()]
    if missing:
        parser.error(
            f"GradBench's golden implementations are not built for {missing}: "
            f"make -C {gradbench}/tools/manual " + " ".join(f"bin/{n}" for n in missing)
        )
    t0 = time.monotonic()
    results = {}
    with serving() as server:
        for name in names:
            results[name] = run_eval(name, gradbench, server.base, args.min_seconds, env)
    print(
        f"\nGradBench's evals through its protocol, each run of an evaluation one request to "
        f"gradserve serve (defaults) against GradBench's JAX tool (one CPU, as GradBench runs "
        f"it; blocking on its result); min_seconds {args.min_seconds}; "
        f"{time.monotonic() - t0:.0f} s"
    )
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
