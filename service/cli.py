"""`gradserve serve` and `gradserve openapi`.

Every `serve` flag also reads its GRADSERVE_* variable; a flag given on the command line
wins. Flags are handed to the workers through the environment, so one worker or many
build the same `Settings`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradserve.service.settings import Settings

OPENAPI_PATH = Path("openapi") / "openapi.json"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# What the `server` extra brings (pyproject.toml), by import name: the base install is the
# client and the engine, and this command says so rather than fail on an import.
SERVER_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "msgspec", "prometheus_client")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="bind address (GRADSERVE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (GRADSERVE_PORT, default 8000)")
    serve.add_argument(
        "--workers", type=int, help="worker processes (GRADSERVE_WORKERS, default 1)"
    )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level (GRADSERVE_LOG_LEVEL, default info)",
    )

    spec = commands.add_parser("openapi", help="write the OpenAPI document")
    spec.add_argument("--output", type=Path, default=OPENAPI_PATH, help=f"default {OPENAPI_PATH}")

    args = parser.parse_args(argv)
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        parser.exit(
            2,
            f"gradserve {args.command}: the service's dependencies are not "
            f"installed ({', '.join(missing)}): pip install 'gradserve[server]'\n",
        )
    if args.command == "openapi":
        return write_openapi(args.output)
    flags = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    return serve_forever(flags)


def serve_forever(flags: dict[str, Any]) -> int:
    import uvicorn
    from pydantic import ValidationError

    from gradserve.service.protocol import GradserveProtocol
    from gradserve.service.settings import Settings

    for name, value in flags.items():
        os.environ[f"GRADSERVE_{name.upper()}"] = str(value)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"gradserve: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    # Several front processes sum their figures through files there (service/metrics.py),
    # and share one program store (service/store.py).
    with metrics_directory(settings.workers), store_directory(settings), tensor_directory(settings):
        uvicorn.run(
            "gradserve.service.app:app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level=settings.log_level,
            log_config=log_config(settings.log_level),
            access_log=False,  # gradserve.access writes the line, with the request id
            # uvicorn's own protocol, plus head and body deadlines and a connection cap.
            http=GradserveProtocol,
            timeout_graceful_shutdown=settings.graceful_shutdown_s,
        )
    return 0


@contextlib.contextmanager
def metrics_directory(workers: int) -> Iterator[str | None]:
    """PROMETHEUS_MULTIPROC_DIR for the front processes, set before uvicorn starts them
    (they are spawned: each imports prometheus-client with it set, and writes its values
    there; a scrape of any one sums them all: service/metrics.py).

    One set by the user is used as it is, and kept (empty it between runs: counters there
    carry on from the last run). Otherwise, with more than one worker, a fresh directory
    under /dev/shm (RAM) where it is writable, else the temporary directory, removed when
    the server exits. One worker keeps its figures in its own registry: nothing to sum,
    and no file written on each increment."""
    own = os.environ.get(METRICS_ENV) or os.environ.get(METRICS_ENV.lower())
    if own:
        os.makedirs(own, exist_ok=True)
        os.environ[METRICS_ENV] = own
        yield own
        return
    if workers <= 1:
        yield None
        return
    with _server_directory("metrics", METRICS_ENV) as path:
        yield path


@contextlib.contextmanager
def store_directory(settings: Settings) -> Iterator[str | None]:
    """GRADSERVE_PROGRAM_STORE_DIR for the front processes, when there are several and
    none is named: one directory of this server's own for all of them (each would make
    its own otherwise: service/front.py), under /dev/shm where it is writable, removed
    when the server exits."""
    if (
        settings.workers <= 1
        or settings.program_store_dir is not None
        or not settings.program_store_bytes
    ):
        yield settings.program_store_dir
        return
    with _server_directory("programs", "GRADSERVE_PROGRAM_STORE_DIR") as path:
        yield path


@contextlib.contextmanager
def tensor_directory(settings: Settings) -> Iterator[str | None]:
    """GRADSERVE_TENSOR_STORE_DIR for several front processes, as `store_directory` does
    for the program store: one directory of this server's own, so that a tensor uploaded
    through one front process is found through any."""
    if settings.workers <= 1 or settings.tensor_store_dir is not None:
        yield settings.tensor_store_dir
        return
    with _server_directory("tensors", "GRADSERVE_TENSOR_STORE_DIR") as path:
        yield path


@contextlib.contextmanager
def _server_directory(kind: str, variable: str) -> Iterator[str]:
    """A new directory for the server's processes, named in `variable` for them: under
    /dev/shm (RAM) where it is writable, else the temporary directory; held while the
    server runs, and removed when it exits (or by the next server to start, should this
    one be killed: service/shm.py)."""
    from gradserve.service.shm import own_directory

    path, held = own_directory(kind)
    os.environ[variable] = path
    try:
        yield path
    finally:
        os.environ.pop(variable, None)
        os.close(held)
        shutil.rmtree(path, ignore_errors=True)


def log_config(level: str) -> dict[str, Any]:
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    python_level = "DEBUG" if level == "trace" else level.upper()
    config["loggers"]["gradserve"] = {
        "handlers": ["default"],
        "level": python_level,
        "propagate": False,
    }
    return config


def write_openapi(path: Path) -> int:
    from gradserve.service.app import create_app
    from gradserve.service.settings import Settings

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(openapi_text(create_app(Settings())))
    print(f"wrote {path}")
    return 0


def openapi_text(app: Any) -> str:
    return json.dumps(app.openapi(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.exit(main())
