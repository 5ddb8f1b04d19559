"""Run a benchmark script and keep what it printed, with the date and the machine, for the
benchmarks page (docs/hooks/bench_results.py renders bench/results/<script>.md there).

    python3 -m bench.record [--results DIR] <script> [its arguments...]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 -m bench.record bench_compiled

The script runs as `python3 -m bench.<script>` would run it. Its standard output is saved
as it was printed, under a header: when, on what (CPU, cores, memory, the load average at
the start), with what (Python, NumPy, PyTorch, JAX, the revision) and how (the command
line, the BLAS environment, the time it took). A run that fails saves nothing: the record
it would have replaced stays. `--smoke` runs are refused (their figures mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import revision

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
HEADER = "<!-- written by `python3 -m bench.record`; run it again rather than edit this -->"
PACKAGES = ("numpy", "torch", "jax")
# The environment that changes what a benchmark measures, saved with its figures.
ENVIRONMENT = re.compile(r"^(OPENBLAS_|OMP_|MKL_|XLA_|GRADSERVE_)")


@dataclass(frozen=True)
class Run:
    """One run of a script: what it printed and everything needed to read the figures."""

    script: str
    args: tuple[str, ...]
    stdout: str
    returncode: int
    seconds: float
    started: datetime.datetime
    machine: str
    software: str
    environment: tuple[str, ...]


def scripts() -> list[str]:
    """The benchmark scripts, by module name."""
    return sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))


def machine() -> str:
    """The CPU, its cores, the memory and the load at the start, from /proc where it is."""
    cpu = platform.processor() or platform.machine()
    memory = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(
            line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line
        )
        total_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
        memory = f", {total_kib / (1 << 20):.1f} GiB"
    except (OSError, StopIteration):
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average {:.2f} {:.2f} {:.2f} at the start".format(*os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores{memory}, {platform.system()}{load}"


def software() -> str:
    versions = [f"Python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"no {name}")
    return ", ".join(versions) + f"; gradserve {revision()}"


def run(script: str, args: list[str]) -> Run:
    """Runs `python3 -m bench.<script> args` from the repository's root, its standard output
    captured (and echoed, so that a long run shows its progress), its errors passed through."""
    started = datetime.datetime.now(datetime.UTC)
    where = machine()
    begun = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", f"bench.{script}", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    returncode = process.wait()
    return Run(
        script=script,
        args=tuple(args),
        stdout="".join(lines),
        returncode=returncode,
        seconds=time.perf_counter() - begun,
        started=started,
        machine=where,
        software=software(),
        environment=tuple(
            sorted(f"{k}={v}" for k, v in os.environ.items() if ENVIRONMENT.match(k))
        ),
    )


def render(record: Run) -> str:
    """A record as Markdown: the facts, then the output verbatim in a fence longer than any
    run of backticks it holds."""
    command = " ".join(["python3", "-m", f"bench.{record.script}", *record.args])
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", record.stdout)), default=0))
    environment = ", ".join(f"`{e}`" for e in record.environment) or "none set"
    return "\n".join(
        [
            HEADER,
            "",
            f"- **run** {record.started:%Y-%m-%d %H:%M} UTC: `{command}`, {record.seconds:.0f} s",
            f"- **machine** {record.machine}",
            f"- **software** {record.software}",
            f"- **environment** {environment}",
            "",
            f"{fence}text",
            record.stdout.rstrip("\n"),
            fence,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.record",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", choices=scripts(), metavar="script", help="e.g. bench_tier")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where records go (default bench/results)"
    )
    options = parser.parse_args(argv)
    if "--smoke" in options.args:
        parser.error("a --smoke run's figures mean nothing: record a real run")
    record = run(options.script, options.args)
    if record.returncode != 0:
        print(
            f"record: bench.{options.script} exited {record.returncode}; nothing saved",
            file=sys.stderr,
        )
        return record.returncode or 1
    options.results.mkdir(parents=True, exist_ok=True)
    path = options.results / f"{options.script}.md"
    path.write_text(render(record))
    print(f"record: saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
