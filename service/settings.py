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

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"

    max_body_bytes: int = Field(64 * MiB, ge=1)
    max_nodes: int = Field(100_000, ge=1)
    expr_max_chars: int = Field(10_000, ge=1)
    expr_max_depth: int = Field(100, ge=1)
    memory_budget_bytes: int = Field(4 * GiB, ge=1)
    no_grad_memory_budget_bytes: int = Field(1 * GiB, ge=1)
    inflight_memory_bytes: int = Field(8 * GiB, ge=1)
    max_concurrency: int = Field(8, ge=1)
    # Worker processes computing (None: one per CPU, at least 2, at most max_concurrency):
    # more processes than cores only add memory; admitted requests beyond them wait their
    # turn inside their deadline.
    compute_workers: int | None = Field(None, ge=1)
    # Workers always alive, started and warm before /readyz says ready (at most
    # compute_workers): the first request, and the first after any idle time, finds one.
    min_compute_workers: int = Field(1, ge=1)
    # A worker whose RSS has grown by more than this since it was warm is replaced (its
    # replacement first). Its caches may add at most program_cache_bytes +
    # graph_cache_bytes (320 MiB by default): past that, it holds freed memory the allocator
    # cannot give back, or a leak. (Growth, not RSS: a warm worker holds ~45 MiB on a CPU,
    # and far more once CUDA is loaded.)
    compute_worker_max_rss_growth_bytes: int = Field(512 * MiB, ge=0)
    # Workers above the minimum exit after this long idle: their memory goes back within
    # seconds of a burst's end, and one starts again in ~20 ms, off the request path.
    compute_worker_idle_s: float = Field(5.0, gt=0)
    # Admission queue (as Triton's queue policy): requests that find every compute slot
    # busy wait for one, first come first served, at most this many; past it, 503.
    max_queue_size: int = Field(16, ge=0)
    # How long a request may wait for a slot (never past its own deadline: 504 then);
    # past it, 503 with Retry-After, for the client to go elsewhere.
    queue_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    # NoDecode: a comma-separated list, not the JSON pydantic-settings expects for a list.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    default_device: str = "cpu"

    # Compute: the static cost of a request's program (forward and backward), in cost units
    # (flop-equivalents: floating-point operations plus 8 per byte read or written), is
    # checked against this before anything runs. 5e12 is about 50 s of this 2-core
    # machine's BLAS: what the default time limit could let run.
    compute_budget: float = Field(5e12, gt=0)
    # Compiled programs kept for repeated graphs, bounded by their estimated bytes.
    program_cache_bytes: int = Field(256 * MiB, ge=0)
    # Graphs held by id (`meta.graph_id`), per process, bounded by their estimated bytes.
    graph_cache_bytes: int = Field(64 * MiB, ge=0)
    # The program store (service/store.py): compiled programs and graphs for every process
    # of the host. None: a directory of this server's own, in shared memory, removed when
    # it stops; a directory named here (a volume) outlives it, and a restarted server or a
    # replica that mounts it starts warm. 0 bytes: no store.
    program_store_dir: str | None = None
    program_store_bytes: int = Field(256 * MiB, ge=0)
    # The native tier (service/tier.py): a program is lowered to XLA through JAX, by the
    # host's lowering process, when its predicted saving pays for the compile, and runs there
    # from then on. "auto": where jax is importable; "off": never.
    xla: Literal["auto", "off"] = "auto"
    # The lowering process is stopped (and another started) past this RSS: XLA's compile of
    # a large program can take gigabytes; the program then stays interpreted, and says why.
    xla_lowering_memory_bytes: int = Field(4 * GiB, ge=64 * MiB)
    # Request shape limits (checked before compiling).
    max_inputs: int = Field(10_000, ge=1)
    max_id_chars: int = Field(256, ge=1)

    # Connections (enforced by the HTTP protocol, before the app sees a request).
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(10.0, gt=0)
    body_min_rate_bytes_s: int = Field(65536, ge=0)
    max_connections: int = Field(512, ge=1)
    # On SIGTERM: how long requests in flight may finish before they are cut off (503).
    # Under `docker stop`'s 10 s, so they are cut off with an answer rather than killed.
    graceful_shutdown_s: int = Field(8, ge=1)

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

