"""Service settings, read from `GRADSERVE_*` environment variables (the names are part of
the contract: docs/contract.md)."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

GiB = 1024**3
MiB = 1024**2


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRADSERVE_", extra="ignore", frozen=True)

    host: str = Field(
        "127.0.0.1",
        description="bind address (the Docker image sets `0.0.0.0`)",
    )
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="port",
    )
    workers: int = Field(
        1,
        ge=1,
        description=(
            "uvicorn worker processes, each a front process with its own compute workers and "
            "limits; `/metrics` sums them all"
        ),
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info",
        description="`critical`, `error`, `warning`, `info`, `debug`, `trace`",
    )

    max_body_bytes: int = Field(
        64 * MiB,
        ge=1,
        description="larger bodies get 413, refused while they stream in",
    )
    max_nodes: int = Field(
        100_000,
        ge=1,
        description=(
            "nodes per graph, counted before the body becomes objects and again after `expr` "
            "expansion"
        ),
    )
    expr_max_chars: int = Field(
        10_000,
        ge=1,
        description="length of one `expr` string",
    )
    expr_max_depth: int = Field(
        100,
        ge=1,
        description="nesting depth of one `expr` (brackets, and operators within operators)",
    )
    memory_budget_bytes: int = Field(
        4 * GiB,
        ge=1,
        description="planned peak of one grad request (`/backward`, `/forward` with grad)",
    )
    no_grad_memory_budget_bytes: int = Field(
        1 * GiB,
        ge=1,
        description="planned peak of one `no_grad` request",
    )
    inflight_memory_bytes: int = Field(
        8 * GiB,
        ge=1,
        description=(
            "bytes held by all requests together: bodies from their first byte, what parsing "
            "them takes, then their planned peaks; at least the larger budget"
        ),
    )
    max_concurrency: int = Field(
        8,
        ge=1,
        description=(
            "requests admitted to compute at once (per front process); past it, they queue"
        ),
    )
    # Worker processes computing (None: one per CPU, at least 2, at most max_concurrency):
    # more processes than cores only add memory; admitted requests beyond them wait their
    # turn inside their deadline.
    compute_workers: int | None = Field(
        None,
        ge=1,
        description=(
            "worker processes at most: more than the cores only add memory (each holds NumPy "
            "and the engine, ~45 MB RSS warm, most of it shared with the forkserver); "
            "admitted requests beyond them wait their turn within their deadline (unset: one "
            "per CPU, at least 2, at most `GRADSERVE_MAX_CONCURRENCY`)"
        ),
    )
    # Workers always alive, started and warm before /readyz says ready (at most
    # compute_workers): the first request, and the first after any idle time, finds one.
    min_compute_workers: int = Field(
        1,
        ge=1,
        description=(
            "worker processes always alive (at most `GRADSERVE_COMPUTE_WORKERS`), started and"
            " warm before `/readyz` says ready: the first request, and the first after any "
            "idle time, never waits for a process to start. One is enough for that; more only"
            " hold memory while idle"
        ),
    )
    # A worker whose RSS has grown by more than this since it was warm is replaced (its
    # replacement first). Its caches may add at most program_cache_bytes +
    # graph_cache_bytes (320 MiB by default): past that, it holds freed memory the allocator
    # cannot give back, or a leak. (Growth, not RSS: a warm worker holds ~45 MiB on a CPU,
    # and far more once CUDA is loaded.)
    compute_worker_max_rss_growth_bytes: int = Field(
        512 * MiB,
        ge=0,
        description=(
            "a worker whose RSS (measured after each task) has grown by more than this since "
            "it was warm is recycled, its replacement first. Its caches may add at most "
            "`GRADSERVE_PROGRAM_CACHE_BYTES` + `GRADSERVE_GRAPH_CACHE_BYTES` (320 MiB): a "
            "worker is never recycled for what its caches are allowed to hold, only for what "
            "the allocator cannot give back, or a leak. Growth rather than RSS, because what "
            "a warm worker holds depends on the device: ~45 MiB on a CPU (measured: 43 MiB, "
            "and 47 MiB after 300 different graphs), far more with CUDA loaded"
        ),
    )
    # Workers above the minimum exit after this long idle: their memory goes back within
    # seconds of a burst's end, and one starts again in ~20 ms, off the request path.
    compute_worker_idle_s: float = Field(
        5.0,
        gt=0,
        description=(
            "workers above the minimum exit after this long idle. Five seconds without work "
            "ends a burst; their memory then goes back within seconds of the load's end, and "
            "a worker starts again in ~20 ms, off the request path"
        ),
    )
    # Admission queue (as Triton's queue policy): requests that find every compute slot
    # busy wait for one, first come first served, at most this many; past it, 503.
    max_queue_size: int = Field(
        16,
        ge=0,
        description=(
            "requests that may wait for a compute slot (per front process); past it, 503 at "
            "once. Twice the default slots: the soak's 16 clients on 8 slots all wait rather "
            "than bounce, and a burst of 24 is absorbed; a waiting request holds its body's "
            "memory (counted in the in-flight memory) and a connection, nothing more. `0`: "
            "refused at once when no slot is free"
        ),
    )
    # How long a request may wait for a slot (never past its own deadline: 504 then);
    # past it, 503 with Retry-After, for the client to go elsewhere.
    queue_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "how long a request may wait for a slot before 503 with `Retry-After` (and never "
            "past its own deadline: 504 then). HAProxy's `timeout queue` in docker/haproxy is"
            " 10 s too: a request waits in one queue or the other that long at most, then "
            "goes elsewhere"
        ),
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "time limit of one request; its worker is stopped at it, even inside a kernel (504)"
        ),
    )
    # NoDecode: a comma-separated list, not the JSON pydantic-settings expects for a list.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = Field(
        (),
        description=(
            "comma-separated keys, sent as `Authorization: Bearer KEY` or `X-API-Key: KEY`; "
            "`/healthz` and `/readyz` need none, nor GET of the explorer's page and files "
            "(which then asks for the key) (empty: API keys off)"
        ),
    )
    default_device: str = Field(
        "cpu",
        description="device of requests that name none: `cpu`, `cuda`, `cuda:N`, `auto`",
    )

    # Compute: the static cost of a request's program (forward and backward), in cost units
    # (flop-equivalents: floating-point operations plus 8 per byte read or written), is
    # checked against this before anything runs. 5e12 is about 50 s of this 2-core
    # machine's BLAS: what the default time limit could let run.
    compute_budget: float = Field(
        5e12,
        gt=0,
        description=(
            "static cost of one request, forward and backward, in flop-equivalents "
            "(floating-point operations plus 8 per byte moved); over it, 422 before anything "
            "runs, naming the most expensive node. 5e12 is about 50 s of this 2-core "
            "machine's BLAS, what the default time limit could let run; a GPU host may raise "
            "it"
        ),
    )
    # Compiled programs kept for repeated graphs, bounded by their estimated bytes.
    program_cache_bytes: int = Field(
        256 * MiB,
        ge=0,
        description=(
            "compiled programs kept in each process's memory, by their estimated bytes (~400 "
            "a step), least recently used out: about 600k steps, a few hundred large unrolled"
            " graphs"
        ),
    )
    # Graphs held by id (`meta.graph_id`), per process, bounded by their estimated bytes.
    graph_cache_bytes: int = Field(
        64 * MiB,
        ge=0,
        description=(
            "graphs kept in each process's memory for requests that send `graph_id` (~600 "
            "bytes a node), least recently used out: about 100k nodes; the store keeps them "
            "for every process"
        ),
    )
    # The program store (service/store.py): compiled programs and graphs for every process
    # of the host. None: a directory of this server's own, in shared memory, removed when
    # it stops; a directory named here (a volume) outlives it, and a restarted server or a
    # replica that mounts it starts warm. 0 bytes: no store.
    program_store_dir: str | None = Field(
        None,
        description=(
            "the program store (compiled programs, graphs and ids, for every process of the "
            "host): name a directory (a volume) to keep it across restarts and share it "
            "between replicas (unset: a directory of the server's own in `/dev/shm`, removed "
            "at exit)"
        ),
    )
    program_store_bytes: int = Field(
        256 * MiB,
        ge=0,
        description=(
            "the store's bound, least recently used out (a 30,000-node graph's program is ~3 "
            "MB); in `/dev/shm` it is RAM, counted in a container's memory; `0`: no store"
        ),
    )
    # Tensors held by id (service/tensors.py): None: a directory of this server's own in
    # shared memory, removed when it stops (nothing survives a restart); a directory named
    # here (a volume, beside the program store's) keeps them across restarts.
    tensor_store_dir: str | None = Field(
        None,
        description=(
            "where tensors held by id live (`POST /tensors`, `keep`), for every process of "
            "the host: unset, a directory of the server's own in `/dev/shm`, removed at exit, "
            "so no tensor survives a restart; name a directory (e.g. on the program store's "
            "volume) to keep them across restarts"
        ),
    )
    tensor_quota_bytes: int = Field(
        256 * MiB,
        ge=0,
        description=(
            "tensor data held per API key (one quota with keys off), least recently used "
            "out; a tensor or a `keep` larger than this is refused (422 `tensor-quota`); "
            "in `/dev/shm` it is RAM, counted in a container's memory and its `shm_size` "
            "(a full store answers 507); `0`: no tensors held"
        ),
    )
    # The native tier (service/tier.py): a program is lowered to XLA through JAX, by the
    # host's lowering process, when its predicted saving pays for the compile, and runs there
    # from then on. "auto": where jax is importable; "off": never.
    xla: Literal["auto", "off"] = Field(
        "auto",
        description=(
            'the native tier (see "The native tier"): `auto` lowers programs to XLA where jax'
            " is installed (the `xla` extra) and a program store is kept, when their "
            "predicted saving pays for the compile; `off`: never, every program interpreted"
        ),
    )
    # The lowering process is stopped (and another started) past this RSS: XLA's compile of
    # a large program can take gigabytes; the program then stays interpreted, and says why.
    xla_lowering_memory_bytes: int = Field(
        4 * GiB,
        ge=64 * MiB,
        description=(
            "the lowering process is stopped past this RSS (XLA's compile of a large program "
            "can take gigabytes) and another started; the program it was lowering stays "
            "interpreted, and says why"
        ),
    )
    # Request shape limits (checked before compiling).
    max_inputs: int = Field(
        10_000,
        ge=1,
        description=(
            "inputs (and `grad_outputs`) per request, counted before they become objects: a "
            "body of a million tiny inputs is refused in milliseconds, not after a gigabyte "
            "of models. Ten thousand named tensors is far past any real graph"
        ),
    )
    max_id_chars: int = Field(
        256,
        ge=1,
        description=(
            "length of a node id or an input name: ids appear in errors and logs, and no one "
            "names a value in a kilobyte"
        ),
    )

    # Connections (enforced by the HTTP protocol, before the app sees a request).
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "a request head must be complete this long after the connection opened or the "
            "previous response finished, else 408 and close (checked once a second)"
        ),
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "a body must be complete this long after its head, plus 1 s per "
            "`GRADSERVE_BODY_MIN_RATE_BYTES_S` bytes received (Apache mod_reqtimeout's rule),"
            " else 408"
        ),
    )
    body_min_rate_bytes_s: int = Field(
        65536,
        ge=0,
        description=(
            "the rate a body must keep up after the first `GRADSERVE_BODY_TIMEOUT_S` (a 64 "
            "MiB body may take 17 minutes, a 1-byte-a-second sender is cut at 10 s); `0`: the"
            " whole body within `GRADSERVE_BODY_TIMEOUT_S`"
        ),
    )
    max_connections: int = Field(
        512,
        ge=1,
        description=(
            "open connections per front process. At the cap a connection idle for 1 s makes "
            "room (as nginx drains idle ones); then 8 more may each serve one `/healthz` or "
            "`/readyz`, so a liveness probe gets through a flood; then 503 at once. The soft "
            "open-file limit is raised to fit it, or the cap lowered with a warning"
        ),
    )
    # On SIGTERM: how long requests in flight may finish before they are cut off (503).
    # Under `docker stop`'s 10 s, so they are cut off with an answer rather than killed.
    graceful_shutdown_s: int = Field(
        8,
        ge=1,
        description=(
            "after SIGTERM, how long requests in flight may finish before they get 503 "
            "`cancelled`; keep it under the orchestrator's kill delay (`docker stop`: 10 s)"
        ),
    )

    @field_validator("log_level", "xla", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(SecretStr(k.strip()) for k in value.split(",") if k.strip())
        return value

    @property
    def workers_for_compute(self) -> int:
        if self.compute_workers is not None:
            return min(self.compute_workers, self.max_concurrency)
        return min(self.max_concurrency, max(2, os.cpu_count() or 2))

    @model_validator(mode="after")
    def _budgets_fit(self) -> Settings:
        # A request within its own budget must be able to run once the server is idle;
        # otherwise it would get 503 forever instead of a clear 422.
        largest = max(self.memory_budget_bytes, self.no_grad_memory_budget_bytes)
        if self.inflight_memory_bytes < largest:
            raise ValueError(
                f"GRADSERVE_INFLIGHT_MEMORY_BYTES ({self.inflight_memory_bytes}) must be at least "
                f"the largest per-request budget ({largest})"
            )
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
