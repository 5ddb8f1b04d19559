"""A Python client for gradserve, on httpx: NumPy arrays in, NumPy arrays out. Plain
`http://` goes through the client's own HTTP/1.1 transports (client/transport.py: a request
in one write; with requests built here, some 0.7 ms a request less than httpx's client on
loopback, sync or async), `https://` and proxied URLs through httpx's; `transport=` takes
any other.

    >>> from gradserve.client.http import Client
    >>> graph = {"nodes": [{"id": "z", "expr": "(x + y) * (x - y)"}], "outputs": ["z"]}
    >>> with Client("http://127.0.0.1:8000") as gs:
    ...     r = gs.backward(graph, {"x": 2.0, "y": 3.0})
    >>> r.outputs["z"], r.gradients["x"], r.gradients["y"]
    (array(-5.), array(4.), array(-6.))

Requests. A tensor of `binary_threshold` elements or more (default 64) travels as its raw
little-endian bytes in a binary body (the Open Inference Protocol's binary tensor
extension: the JSON request as a header of `Inference-Header-Content-Length` bytes, then
the bytes of each tensor that gives `binary_data_size`, in the order the header lists
them). They are read from the array's own buffer: a C-contiguous little-endian array is
copied once, as it is sent (joined into a body under 64 KiB, else by the socket write);
any other is first made so (one more copy). Smaller tensors go in the same header, as
base64 from `base64_threshold` elements, else as JSON `data`; a request with no binary
tensor is plain JSON. `binary_threshold=None` turns binary bodies off, and so
does giving `base64_threshold` without `binary_threshold`: code written for the earlier
client sends what it sent (base64 from that threshold, JSON below it).

Graphs. The first request with a graph sends it in full and remembers the response's
`meta.graph_id` (an opaque id; per client, for the 256 graphs used last, keyed by the
graph's canonical JSON); later requests send `graph_id` instead. A 409 graph-unknown (a
restarted server, or another process of it) resends the request once with the graph; a
graph whose id misses three times in a row is sent in full from then on.
`reuse_graphs=False` always sends the graph. Either way every request also carries the
graph's id as computed here, the server's way (wire/graph_id.py), in the header
`X-Gradserve-Graph`: a balancer sends a graph's repeats to one replica by it (the HAProxy
profile does), and the service ignores it.

Responses, by `encoding`:
- "binary" (default): every output and gradient is a read-only view (`np.frombuffer`) on
  the response body, no copy: `arr.flags.writeable` is False, `arr.base` holds the whole
  body alive while any of its arrays lives. The server pads the JSON header to 8 bytes,
  so a tensor is aligned when the ones before it are a multiple of 8 bytes long (else
  `arr.flags.aligned` is False; NumPy computes on such arrays as on any other).
  `arr.copy()` gives a writable, aligned one. On a big-endian host each array is instead
  a byte-swapped, writable copy.
- "base64": each array is writable, a view on its own decoded buffer (one copy: the
  base64 decode).
- "json": each array is a new, writable one.
Errors raise `GradserveHTTPError` with the problem+json fields.

Retries (`retries`, a `Retry`; on by default: 3 attempts within the client's timeout).
Every request is a pure function of its body (the graph, the inputs, the options; the
server keeps no state between requests but caches), so sending it again is always safe:
at worst the work is done twice. A request is sent again, with the same body, after a
refused connection or one that failed to open (`httpx.ConnectError`, `ConnectTimeout`), a
connection dropped before the whole response came (`RemoteProtocolError`, `ReadError`,
`WriteError`: a replica killed, or a kept-alive connection closed under it), a 502 (a
balancer's word for the same), or a 503 (after its `Retry-After` at least). Nothing else
is: not a 4xx (a 409 graph-unknown is answered by the one resend with the graph, above),
not a 500 (a bug, or a worker that died computing this very request: the same body would
do it again), not a 504 nor a read timeout (the work ran past a time limit: it would
again). Between attempts the client waits a random time up to `backoff` * 2**n seconds
(at most `max_backoff`; "full jitter", so that clients that failed together do not come
back together), added to a 503's `Retry-After`. It gives up, raising the last error, after
`attempts` attempts, or when the next would start past `deadline` seconds from the call
(default: the client's timeout); an attempt in flight is given only the time left.
`retries=0` turns retries off; `retries=n` allows n retries.

Tracing (client/trace.py). `forward` and `backward` also take a Python function instead of
a graph: it is traced on the inputs' shapes and dtypes with the server's op catalog (`GET
/ops`, fetched once), once per function and input specs (the 256 used last; what the
function reads of Python values is frozen into that graph, as with jax.jit), and the graph
is sent as any other. `trace(fn, **specs)` gives the graph itself; `F` is the functional
namespace of the server's catalog.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import functools
import math
import random
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import httpx
import numpy as np
import orjson
import pybase64
import pydantic_core

from gradserve.client.catalog import Catalog
from gradserve.client.tensors import Held, Parameter, TensorRef, affinity_of, ref_of
from gradserve.client.trace import Functional, TraceError, spec_of
from gradserve.client.trace import trace as trace_graph
from gradserve.client.transport import AsyncHttp11Transport, Http11Transport
from gradserve.wire.binary import (
    BINARY_HEADER,
    RESPONSE_SECTIONS,
    FramingError,
    array_of,
    byte_size,
    raw_bytes,
    split,
    tensor_bytes,
)
from gradserve.wire.dtypes import DTYPES, LITTLE_ENDIAN, wire_dtype
from gradserve.wire.graph_id import GRAPH_HEADER, canonical_graph, id_of_canonical
from gradserve.wire.numbers import json_data
from gradserve.wire.tensor_id import TENSOR_HEADER

ArrayLike = Any  # a NumPy array, a Python number, or nested lists of numbers

_ENCODINGS = ("json", "base64", "binary")
GRAPH_UNKNOWN = "urn:gradserve:problem:graph-unknown"
TENSOR_UNKNOWN = "urn:gradserve:problem:tensor-unknown"

# Tensors of 64 elements or more go as raw bytes: the server decodes those in ~1.6 us
# at any size, while JSON costs it ~85 ns an element (10 us at 64 float32, 90 us at
# 1,024, measured with service.codec), and ~11 bytes an element on the wire. Below 64,
# JSON costs a few microseconds, and keeps small requests (the seed examples) plain JSON.
BINARY_THRESHOLD = 64
# Base64 (4/3 bytes a byte, exact) where binary bodies are off: from the size where JSON
# text starts to cost more than the encoding, as before binary bodies.
BASE64_THRESHOLD = 1024
JOIN_BELOW = 64 * 1024  # binary bodies smaller than this are sent as one bytes
GRAPH_IDS = 256  # graphs whose server id a client remembers
GRAPH_ID_MISSES = 3  # consecutive 409s after which a graph is always sent in full
KNOWN_URLS = 64  # request paths whose URLs a client keeps built (tensor paths come and go)
_UNSET: Any = object()

# What is sent again (see the module's docstring): transport errors that say the request
# did not complete on a replica that is gone, or was never sent to it. Not the timeouts of
# a read or a write (the server was there and slow: the same work would be slow again; and
# they are how an attempt is cut at the deadline), nor a full pool (this client's own
# connections, not a replica), nor protocol errors of our own making or decoding errors
# (they would repeat).
RETRY_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,  # refused (nothing listens: a replica down or restarting), unreachable
    httpx.ConnectTimeout,  # the connect unanswered (a host gone): nothing was sent
    httpx.RemoteProtocolError,  # closed without a (whole) response: killed mid-request
    httpx.ReadError,  # reset while the response was awaited or read
    httpx.WriteError,  # reset, or a broken pipe, while the body was sent
)
# 503: the server is busy or shutting down, and says so. 502: a balancer found its
# replica gone (the same as a dropped connection, one hop further).
RETRY_STATUSES = frozenset({502, 503})


class Clock:
    """The time a client's retries run on: the deadline, the backoff's waits, the time an
    attempt is given. This one is the system's monotonic clock; a test passes its own
    (`Retry(clock=...)`), whose waits advance it at once, to check a schedule of retries
    without waiting it out."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = Clock()


@dataclass(frozen=True)
class Retry:
    """When to send a request again (see the module's docstring): up to `attempts`
    attempts in all, the first included, none starting past `deadline` seconds from the
    call (None: the client's timeout). Before retry n (from 0) the client waits
    `rand()` * min(`max_backoff`, `backoff` * 2**n) seconds (full jitter), after a 503's
    `Retry-After` if it has one. Retrying is safe: every request is a pure function of
    its body.

    The defaults: 3 attempts ride out a replica killed or restarted behind a balancer (the
    next attempt goes elsewhere) or a busy moment, while a server that is down stays an
    error within a fraction of a second; within the client's timeout, a call with
    retries takes no longer than one without could. The backoff starts small (0.1 s) as
    another replica is usually ready at once; past that, more attempts and a longer
    `deadline` wait out a restart. `rand` (uniform in [0, 1)) and `clock` can be fixed for
    tests."""

    attempts: int = 3
    deadline: float | None = None
    backoff: float = 0.1
    max_backoff: float = 2.0
    rand: Callable[[], float] = field(default=random.random, repr=False, compare=False)
    clock: Clock = field(default=SYSTEM_CLOCK, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"deadline must be positive, not {self.deadline}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("backoff and max_backoff must not be negative")

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry `retry` (0 for the first): a 503's Retry-After,
        if any, plus the jittered backoff."""
        jitter = self.rand() * min(self.max_backoff, self.backoff * 2.0**retry)
        return jitter if retry_after is None else retry_after + jitter


DEFAULT_RETRY = Retry()


class _Attempts:
    """One call's retries: its deadline (the 409 resend included), and what to wait
    before the next attempt of one request, or None: give up."""

    def __init__(self, policy: Retry, timeout: httpx.Timeout) -> None:
        self.policy = policy
        self.timeout = timeout
        self.clock = policy.clock
        self.start = self.clock.now()
        limit = policy.deadline if policy.deadline is not None else _longest(timeout)
        self.deadline = None if limit is None else self.start + limit
        self.made = 0  # attempts of the current request

    def begin(self) -> None:
        self.made = 0

    def attempt_timeout(self) -> httpx.Timeout:
        """The client's timeouts, none past the time left."""
        self.made += 1
        if self.deadline is None:
            return self.timeout
        left = max(self.deadline - self.clock.now(), 0.001)
        t = self.timeout
        return httpx.Timeout(
            connect=_at_most(t.connect, left),
            read=_at_most(t.read, left),
            write=_at_most(t.write, left),
            pool=_at_most(t.pool, left),
        )

    def after_response(self, response: httpx.Response) -> float | None:
        if response.status_code not in RETRY_STATUSES:
            return None
        retry_after = _retry_after(response) if response.status_code == 503 else None
        return self._next(retry_after)

    def after_error(self, exc: Exception) -> float | None:
        if not isinstance(exc, RETRY_ERRORS):
            return None
        delay = self._next(None)
        if delay is None:
            elapsed = self.clock.now() - self.start
            exc.add_note(
                f"gradserve client: gave up after {self.made} attempt(s) in {elapsed:.2f} s"
            )
        return delay

    def _next(self, retry_after: float | None) -> float | None:
        if self.made >= self.policy.attempts:
            return None
        delay = self.policy.delay(self.made - 1, retry_after)
        if self.deadline is not None and self.clock.now() + delay >= self.deadline:
            return None  # no time for another attempt: the last error now, not later
        return delay


def _at_most(value: float | None, limit: float) -> float:
    return limit if value is None else min(value, limit)


def _longest(timeout: httpx.Timeout) -> float | None:
    values = [
        v for v in (timeout.connect, timeout.read, timeout.write, timeout.pool) if v is not None
    ]
    return max(values) if values else None


def _retry_after(response: httpx.Response) -> float | None:
    """A Retry-After in seconds (delta-seconds, or an HTTP date), or None."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # ("-0000": UTC, of unknown origin)
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


class GradserveHTTPError(Exception):
    """An error response; the fields are those of its problem+json body."""

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        self.status = status
        self.problem = dict(problem)
        self.type: str = problem.get("type", "about:blank")
        self.title: str = problem.get("title", "")
        self.detail: str = problem.get("detail", "")
        self.node: str | None = problem.get("node")
        self.errors: list[dict[str, Any]] = problem.get("errors") or []
        self.request_id: str | None = problem.get("request_id")
        super().__init__(f"{status} {self.title}: {self.detail}")


@dataclass
class Result:
    """A response (of /forward: `gradients` is None). With encoding "binary" the arrays of
    `outputs` and `gradients` are read-only views on the response body (`arr.copy()` for a
    writable one; on a big-endian host, writable copies); with "base64" and "json" they are
    writable arrays of their own."""

    outputs: dict[str, np.ndarray]
    gradients: dict[str, np.ndarray] | None
    meta: dict[str, Any]
    requires_grad: dict[str, bool] = field(default_factory=dict)
    grad_fn: dict[str, str | None] = field(default_factory=dict)
    # The outputs and gradients the request kept on the server (`keep=`, or a Parameter's
    # new value), by name: their ids, without data (they are not in `outputs`/`gradients`).
    kept: dict[str, TensorRef] = field(default_factory=dict)
    kept_gradients: dict[str, TensorRef] = field(default_factory=dict)


@dataclass
class BackwardResult(Result):
    """A /backward response: it always has gradients (as the server's BackwardResponse),
    so that `r.gradients["x"]` type-checks."""

    gradients: dict[str, np.ndarray]


_R = TypeVar("_R", bound=Result)


@dataclass(eq=False)
class _Call:
    """One request, encoded but for its graph: sent by id, or in full."""

    path: str
    key: bytes  # the graph's canonical JSON (sorted keys): the graph-id cache's key
    route: str  # the graph's id as this client computes it: sent as GRAPH_HEADER
    fields: dict[str, Any]  # the rest of the JSON header
    binary: bool  # some tensor is given by binary_data_size: the body is binary
    tail: list[memoryview]  # those tensors' bytes, in the order `fields` lists them
    tail_bytes: int
    refs: dict[str, TensorRef] = field(default_factory=dict)  # the held tensors it names, by id
    params: dict[str, Parameter] = field(default_factory=dict)  # its Parameters, by input name
    keeps: bool = False  # it keeps values on the server


@dataclass(eq=False)
class _Entry:
    graph_id: str
    route: str  # (the id computed here, kept: hashing a large graph takes milliseconds)
    misses: int = 0  # 409s in a row to requests that sent this id


class _GraphIds:
    """The server's ids of the graphs this client sent, by canonical JSON; the least
    recently used forgotten past `size`. Thread-safe (a `Client` may be shared)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def route(self, key: bytes) -> str:
        """The graph's id computed here (GRAPH_HEADER): remembered with the server's."""
        with self._lock:
            item = self._items.get(key)
        return item.route if item is not None else id_of_canonical(key)

    def get(self, key: bytes) -> str | None:
        """The id to send for the graph, or None: send the graph itself."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return None if item.misses >= GRAPH_ID_MISSES else item.graph_id

    def put(self, key: bytes, graph_id: str, route: str, sent_by_id: bool) -> None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._items[key] = _Entry(graph_id, route)
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
                return
            item.graph_id = graph_id
            if sent_by_id:
                item.misses = 0
            self._items.move_to_end(key)

    def missed(self, key: bytes) -> None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                item.misses += 1

    def __len__(self) -> int:
        return len(self._items)


class _Base:
    def __init__(
        self,
        api_key: str | None,
        base64_threshold: int | None,
        encoding: str,
        retries: int | Retry,
        binary_threshold: int | None,
        reuse_graphs: bool,
        tensor_affinity: str | None = None,
    ) -> None:
        if encoding not in _ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(_ENCODINGS)}, not {encoding!r}")
        if binary_threshold is _UNSET:  # base64_threshold alone: the requests as before
            binary_threshold = BINARY_THRESHOLD if base64_threshold is _UNSET else None
        if base64_threshold is _UNSET:
            base64_threshold = BASE64_THRESHOLD
        self.headers = {"X-API-Key": api_key} if api_key else {}
        self.binary_threshold: int | None = binary_threshold
        self.base64_threshold: int | None = base64_threshold
        self.encoding = encoding
        if isinstance(retries, bool) or not isinstance(retries, (int, Retry)):
            raise TypeError(f"retries must be an int or a Retry, not {retries!r}")
        self.retry = retries if isinstance(retries, Retry) else Retry(attempts=retries + 1)
        self.reuse_graphs = reuse_graphs
        self.graph_ids = _GraphIds(GRAPH_IDS)
        # The routing header of every request that names or keeps held tensors.
        self.tensor_headers = {TENSOR_HEADER: affinity_of(api_key, tensor_affinity)}
        self.catalog: Catalog | None = None  # GET /ops, once fetched: what tracing reads
        self._traces: OrderedDict[Any, dict[str, Any]] = OrderedDict()
        self._traces_lock = threading.Lock()

    def _go_direct(self, http: httpx.Client | httpx.AsyncClient) -> None:
        """Requests to be built here from now on, as `http` would build them (its base URL,
        headers and timeouts), for its transport straight (client/transport.py)."""
        self._base_url = http.base_url  # (ends with "/", as httpx makes it)
        self._default_headers = {k.lower(): v for k, v in http.headers.items()}
        self._urls: dict[str, httpx.URL] = {}

    def _direct_request(
        self,
        method: str,
        path: str,
        content: Any,
        headers: dict[str, str],
        timeout: httpx.Timeout,
    ) -> httpx.Request:
        """The request httpx's client would send (its URL merging, cookies and hooks cost
        some 0.25 ms a request, as much as the transport itself)."""
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) >= KNOWN_URLS:
                self._urls.clear()
            base = self._base_url
            url = self._urls[path] = base.copy_with(
                raw_path=base.raw_path + path.lstrip("/").encode()
            )
        return httpx.Request(
            method,
            url,
            content=content,
            headers={**self._default_headers, **{k.lower(): v for k, v in headers.items()}},
            extensions={"timeout": timeout.as_dict()},
        )

    def _traced(
        self, fn: Callable[..., Any], inputs: Mapping[str, ArrayLike | Held], catalog: Catalog
    ) -> dict[str, Any]:
        """`fn`'s graph for the specs of `inputs`, traced once per (fn, specs). An output
        it returns under a Parameter's name is that Parameter's next value (`next_name`)."""
        specs = {name: spec_of(value) for name, value in inputs.items()}
        key = (fn, tuple(specs.items()))
        params = [n for n, v in inputs.items() if isinstance(v, Parameter)]
        traced = _renaming(fn, params) if params else fn
        try:
            with self._traces_lock:
                graph = self._traces.get(key)
                if graph is not None:
                    self._traces.move_to_end(key)
                    return graph
        except TypeError:  # an unhashable callable: traced each time
            return trace_graph(traced, catalog, **specs)
        graph = trace_graph(traced, catalog, **specs)
        with self._traces_lock:
            self._traces[key] = graph
            while len(self._traces) > GRAPH_IDS:
                self._traces.popitem(last=False)
        return graph

    def _call(
        self,
        path: str,
        graph: Mapping[str, Any],
        inputs: Mapping[str, ArrayLike | Held],
        *,
        requires_grad: Collection[str] | None,
        device: str | None,
        no_grad: bool = False,
        grad_outputs: Mapping[str, ArrayLike | Held] | None = None,
        memory_budget_bytes: int | None = None,
        recompute: str = "auto",
        detect_anomaly: bool = False,
        keep: Keep | None = None,
    ) -> _Call:
        values = {n: _held_or_array(v) for n, v in inputs.items()}
        if requires_grad is None:  # backward: every floating input; forward: none
            requires_grad = [
                n for n, v in values.items() if path == "/backward" and _is_floating(v)
            ]
        refs: dict[str, TensorRef] = {}
        tail: list[memoryview] = []
        fields: dict[str, Any] = {
            "inputs": {
                n: self._value(v, n in requires_grad, tail, refs) for n, v in values.items()
            },
            "encoding": self.encoding,
        }
        # A Parameter whose next value is an output of the graph takes it, kept.
        params = {n: v for n, v in inputs.items() if isinstance(v, Parameter)}
        outputs = set(graph.get("outputs", ()))
        kept = _keep_fields(keep, [next_name(n) for n in params if next_name(n) in outputs])
        if kept:
            fields["keep"] = kept
        if device is not None:
            fields["device"] = device
        if no_grad:
            fields["no_grad"] = True
        if memory_budget_bytes is not None:
            fields["memory_budget_bytes"] = memory_budget_bytes
        if recompute != "auto":
            fields["recompute"] = recompute
        if detect_anomaly:
            fields["detect_anomaly"] = True
        if grad_outputs is not None:  # after the inputs: their bytes follow the inputs'
            fields["grad_outputs"] = {
                n: self._value(_held_or_array(v), False, tail, refs)
                for n, v in grad_outputs.items()
            }
        key = canonical_graph(graph)
        binary = any("binary_data_size" in t for t in _tensors(fields))
        return _Call(
            path,
            key,
            self.graph_ids.route(key),
            fields,
            binary,
            tail,
            sum(v.nbytes for v in tail),
            refs,
            params,
            bool(kept),
        )

    def _value(
        self,
        value: np.ndarray | TensorRef,
        requires_grad: bool,
        tail: list[memoryview],
        refs: dict[str, TensorRef],
    ) -> dict[str, Any]:
        """A request's tensor: a held one by id (noted in `refs`), else its data."""
        if isinstance(value, TensorRef):
            refs[value.tensor_id] = value
            return value.wire(requires_grad)
        return self._tensor(value, requires_grad, tail)

    def _tensor(
        self, array: np.ndarray, requires_grad: bool, tail: list[memoryview]
    ) -> dict[str, Any]:
        if array.dtype.name not in DTYPES:
            array = array.astype(wire_dtype(array.dtype))
        out: dict[str, Any] = {"dtype": array.dtype.name, "shape": list(array.shape)}
        if self.binary_threshold is not None and array.size >= self.binary_threshold:
            raw = raw_bytes(array)
            if raw.nbytes:
                tail.append(raw)
            out["binary_data_size"] = raw.nbytes
        elif self.base64_threshold is not None and array.size >= self.base64_threshold:
            # From the array's buffer into the body, as the server writes its responses:
            # no bytes copy of the array, no str of the base64.
            out["b64"] = orjson.Fragment(b'"%s"' % pybase64.b64encode(raw_bytes(array)))
        else:
            out["data"] = json_data(array)
        if requires_grad:
            out["requires_grad"] = True
        return out

    def _graph_id(self, call: _Call) -> str | None:
        return self.graph_ids.get(call.key) if self.reuse_graphs else None

    @staticmethod
    def _encode(
        call: _Call, graph_id: str | None
    ) -> tuple[bytes | list[bytes | memoryview], dict[str, str]]:
        """The body (bytes, or a binary body's parts) and its headers."""
        ref = (
            {"graph_id": graph_id} if graph_id is not None else {"graph": orjson.Fragment(call.key)}
        )
        header = orjson.dumps({**ref, **call.fields}, option=orjson.OPT_SERIALIZE_NUMPY)
        return _framed(header, call.binary, call.tail, call.tail_bytes, {GRAPH_HEADER: call.route})

    def _accept(self) -> dict[str, str]:
        """GET /tensors/{id}'s headers: the tensor as a binary body."""
        return {"Accept": "application/octet-stream", **self.tensor_headers}

    def _headers(self, call: _Call, headers: dict[str, str]) -> dict[str, str]:
        """A compute request's headers, with the tensors' routing header if it names or
        keeps held tensors."""
        return {**headers, **self.tensor_headers} if call.refs or call.keeps else headers

    def _upload(self, array: np.ndarray) -> tuple[bytes | list[bytes | memoryview], dict[str, str]]:
        """POST /tensors' body for `array`: as a request's tensor would travel."""
        tail: list[memoryview] = []
        entry = self._tensor(array, False, tail)
        header = orjson.dumps(entry, option=orjson.OPT_SERIALIZE_NUMPY)
        binary = "binary_data_size" in entry
        return _framed(header, binary, tail, sum(v.nbytes for v in tail), self.tensor_headers)

    @staticmethod
    def _missing(call: _Call, response: httpx.Response) -> list[TensorRef] | None:
        """For a 409 tensor-unknown, the refs to upload again before the one retry (None:
        not that, or an id the client has no data for: the error stands)."""
        problem = _problem_of(response, TENSOR_UNKNOWN) if call.refs else None
        if problem is None:
            return None
        missing = [call.refs.get(t) for t in problem.get("tensor_ids", [])]
        if not missing or any(ref is None or ref.value is None for ref in missing):
            return None
        return [ref for ref in missing if ref is not None]

    def _retry_by_graph(self, call: _Call, graph_id: str | None, response: httpx.Response) -> bool:
        """Whether `response` is a 409 graph-unknown to a request sent by id (noted): the
        request is to be sent again with the graph."""
        if graph_id is None or _problem_of(response, GRAPH_UNKNOWN) is None:
            return False
        self.graph_ids.missed(call.key)
        return True

    def _finish(
        self, call: _Call, graph_id: str | None, response: httpx.Response, kind: type[_R]
    ) -> _R:
        result = self._result(response, kind)
        served = result.meta.get("graph_id")
        if self.reuse_graphs and isinstance(served, str):
            self.graph_ids.put(call.key, served, call.route, sent_by_id=graph_id is not None)
        for name, param in call.params.items():
            new = result.kept.pop(next_name(name), None)
            if new is not None:
                param.ref = result.kept[name] = new
        return result

    @staticmethod
    def _result(response: httpx.Response, kind: type[_R]) -> _R:
        _raise_for_problem(response)
        length = response.headers.get(BINARY_HEADER)
        content = response.content
        if length is None:
            header = _loads(content)
            outputs = {n: decode(t) for n, t in header["outputs"].items() if _has_data(t)}
            gradients = header.get("gradients")
            if gradients is not None:
                gradients = {n: decode(t) for n, t in gradients.items() if _has_data(t)}
        else:
            header, arrays = decode_binary(content, int(length))
            outputs, gradients = arrays.get("outputs", {}), arrays.get("gradients")
        if kind is BackwardResult and gradients is None:
            gradients = {}  # (a 200 of /backward always has them)
        return kind(
            outputs=outputs,
            gradients=gradients,
            meta=header["meta"],
            requires_grad={n: t["requires_grad"] for n, t in header["outputs"].items()},
            grad_fn={n: t["grad_fn"] for n, t in header["outputs"].items()},
            kept=_kept(header.get("outputs")),
            kept_gradients=_kept(header.get("gradients")),
        )

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        _raise_for_problem(response)
        return orjson.loads(response.content)


class Client(_Base):
    """Synchronous client. Use as a context manager, or call `close()`.

    `encoding`: of the responses, "binary" (default: outputs and gradients are read-only
    views on the response body), "base64" or "json" (writable arrays of their own).
    `binary_threshold` (default 64; None: never) and `base64_threshold` (default 1024;
    None: never): from how many elements a request's tensor travels as raw bytes in a
    binary body, or else as base64; smaller ones as JSON. Passing `base64_threshold`
    without `binary_threshold` turns binary bodies off. `reuse_graphs`: send a graph's
    `graph_id` once the server has given one (see the module's docstring). `timeout`:
    httpx's, for each connect, read and write. `retries`: a `Retry` (default `Retry()`: 3
    attempts within `timeout`), or how many retries with the defaults otherwise (0: none).
    Every request is a pure function of its body, so a retry is always safe.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        base64_threshold: int | None = _UNSET,
        encoding: str = "binary",
        retries: int | Retry = DEFAULT_RETRY,
        transport: httpx.BaseTransport | None = None,
        binary_threshold: int | None = _UNSET,
        reuse_graphs: bool = True,
        tensor_affinity: str | None = None,
    ) -> None:
        super().__init__(
            api_key,
            base64_threshold,
            encoding,
            retries,
            binary_threshold,
            reuse_graphs,
            tensor_affinity,
        )
        # Plain http that no proxy of the environment takes goes through the client's own
        # transport, and straight to it (`_direct_request`); https, or a proxy: httpx's
        # transport, which reads the environment's proxies.
        if transport is None and _plain(base_url):
            transport = Http11Transport()
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, headers=self.headers, transport=transport
        )
        self._direct = transport if isinstance(transport, Http11Transport) else None
        if self._direct is not None:
            self._go_direct(self._http)

    def forward(
        self,
        graph: Mapping[str, Any] | Callable[..., Any],
        inputs: Mapping[str, ArrayLike | Held],
        *,
        no_grad: bool = False,
        requires_grad: Collection[str] | None = None,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        detect_anomaly: bool = False,
        keep: Keep | None = None,
    ) -> Result:
        if not isinstance(graph, Mapping):
            graph = self._traced(graph, inputs, self._catalog())
        return self._send(
            self._call(
                "/forward",
                graph,
                inputs,
                requires_grad=requires_grad,
                device=device,
                no_grad=no_grad,
                memory_budget_bytes=memory_budget_bytes,
                detect_anomaly=detect_anomaly,
                keep=keep,
            ),
            Result,
        )

    def backward(
        self,
        graph: Mapping[str, Any] | Callable[..., Any],
        inputs: Mapping[str, ArrayLike | Held],
        *,
        grad_outputs: Mapping[str, ArrayLike | Held] | None = None,
        requires_grad: Collection[str] | None = None,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        recompute: str = "auto",
        detect_anomaly: bool = False,
        keep: Keep | None = None,
    ) -> BackwardResult:
        """`memory_budget_bytes`: a budget below the server's for this request; `recompute`:
        "never" refuses a request over its budget (422) rather than recompute to fit it;
        `detect_anomaly`: the first step to make NaN or inf from finite inputs is a 422
        `non-finite` naming its node, phase and op; `keep`: output names (or `{"outputs":
        [...], "gradients": [...]}`) whose values stay on the server, in `result.kept`
        and `result.kept_gradients` as `TensorRef`s instead of arrays."""
        if not isinstance(graph, Mapping):
            graph = self._traced(graph, inputs, self._catalog())
        return self._send(
            self._call(
                "/backward",
                graph,
                inputs,
                requires_grad=requires_grad,
                device=device,
                grad_outputs=grad_outputs,
                memory_budget_bytes=memory_budget_bytes,
                recompute=recompute,
                detect_anomaly=detect_anomaly,
                keep=keep,
            ),
            BackwardResult,
        )

    def ops(self) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = self._json(self._get("/ops"))["ops"]
        self.catalog = Catalog(ops)
        return ops

    def _catalog(self) -> Catalog:
        if self.catalog is None:
            self.ops()
        assert self.catalog is not None
        return self.catalog

    def trace(self, fn: Callable[..., Any], /, **specs: Any) -> dict[str, Any]:
        """The graph of `fn` on inputs of these specs (service.trace.trace with this server's
        catalog)."""
        return trace_graph(fn, self._catalog(), **specs)

    @property
    def F(self) -> Functional:
        """The functional namespace of this server's op catalog."""
        return Functional(self._catalog())

    def devices(self) -> dict[str, Any]:
        return self._json(self._get("/devices"))  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ held tensors
    def put(self, array: ArrayLike) -> TensorRef:
        """Hold `array` on the server (`POST /tensors`): its ref, to pass as an input by id.
        The same content gives the same id, and uploading it again changes nothing."""
        value = _wire_array(array)
        response = self._request("POST", "/tensors", *self._upload(value), self._attempts())
        return TensorRef.of(self._json(response), value)

    def parameter(self, array: ArrayLike) -> Parameter:
        """A `Parameter` held on the server, starting at `array`."""
        return Parameter(self.put(array))

    def get(self, ref: Held) -> np.ndarray:
        """A held tensor's value (a read-only view on the response)."""
        path = f"/tensors/{ref_of(ref).tensor_id}"
        return _held_value(self._request("GET", path, None, self._accept(), self._attempts()))

    def delete(self, ref: Held) -> bool:
        """Drop a held tensor: False if the server held none under its id."""
        path = f"/tensors/{ref_of(ref).tensor_id}"
        response = self._request("DELETE", path, None, self.tensor_headers, self._attempts())
        return _deleted(response)

    def tensors(self) -> dict[str, Any]:
        """`GET /tensors`: the tensors held for this client's API key, and its quota."""
        return self._json(  # type: ignore[no-any-return]
            self._request("GET", "/tensors", None, self.tensor_headers, self._attempts())
        )

    # ------------------------------------------------------------------ inside
    def _attempts(self) -> _Attempts:
        return _Attempts(self.retry, self._http.timeout)

    def _send(self, call: _Call, kind: type[_R]) -> _R:
        attempts = self._attempts()
        graph_id = self._graph_id(call)
        response = self._compute(call, graph_id, attempts)
        if self._retry_by_graph(call, graph_id, response):
            graph_id = None
            response = self._compute(call, graph_id, attempts)
        missing = self._missing(call, response)
        if missing is not None:  # evicted, or a restart: upload them again, and retry once
            for ref in missing:
                assert ref.value is not None
                self.put(ref.value)
            response = self._compute(call, graph_id, attempts)
        return self._finish(call, graph_id, response, kind)

    def _compute(self, call: _Call, graph_id: str | None, attempts: _Attempts) -> httpx.Response:
        body, headers = self._encode(call, graph_id)
        return self._request("POST", call.path, body, self._headers(call, headers), attempts)

    def _get(self, path: str) -> httpx.Response:
        return self._request("GET", path, None, {}, self._attempts())

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | list[bytes | memoryview] | None,
        headers: dict[str, str],
        attempts: _Attempts,
    ) -> httpx.Response:
        """The request's response, with its retries."""
        attempts.begin()
        while True:
            try:
                response = self._exchange(method, path, body, headers, attempts.attempt_timeout())
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
                if delay is None:
                    raise
            else:
                delay = attempts.after_response(response)
                if delay is None:
                    return response
            attempts.clock.sleep(delay)

    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | list[bytes | memoryview] | None,
        headers: dict[str, str],
        timeout: httpx.Timeout,
    ) -> httpx.Response:
        """One attempt's response."""
        # (a list: each part is written as it lies, by one sendmsg: client/transport.py)
        content = None if body is None else cast(Iterable[bytes], body)
        if self._direct is None:
            return self._http.request(
                method, path, content=content, headers=headers, timeout=timeout
            )
        request = self._direct_request(method, path, content, headers, timeout)
        response = self._direct.handle_request(request)
        response.request = request
        response.read()
        return response

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """Asynchronous client: the same methods and options as `Client`, awaited."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        base64_threshold: int | None = _UNSET,
        encoding: str = "binary",
        retries: int | Retry = DEFAULT_RETRY,
        transport: httpx.AsyncBaseTransport | None = None,
        binary_threshold: int | None = _UNSET,
        reuse_graphs: bool = True,
        tensor_affinity: str | None = None,
    ) -> None:
        super().__init__(
            api_key,
            base64_threshold,
            encoding,
            retries,
            binary_threshold,
            reuse_graphs,
            tensor_affinity,
        )
        if transport is None and _plain(base_url):  # (as Client's)
            transport = AsyncHttp11Transport()
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers=self.headers, transport=transport
        )
        self._direct = transport if isinstance(transport, AsyncHttp11Transport) else None
        if self._direct is not None:
            self._go_direct(self._http)

    async def forward(
        self,
        graph: Mapping[str, Any] | Callable[..., Any],
        inputs: Mapping[str, ArrayLike | Held],
        *,
        no_grad: bool = False,
        requires_grad: Collection[str] | None = None,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        detect_anomaly: bool = False,
        keep: Keep | None = None,
    ) -> Result:
        if not isinstance(graph, Mapping):
            graph = self._traced(graph, inputs, await self._catalog())
        return await self._send(
            self._call(
                "/forward",
                graph,
                inputs,
                requires_grad=requires_grad,
                device=device,
                no_grad=no_grad,
                memory_budget_bytes=memory_budget_bytes,
                detect_anomaly=detect_anomaly,
                keep=keep,
            ),
            Result,
        )

    async def backward(
        self,
        graph: Mapping[str, Any] | Callable[..., Any],
        inputs: Mapping[str, ArrayLike | Held],
        *,
        grad_outputs: Mapping[str, ArrayLike | Held] | None = None,
        requires_grad: Collection[str] | None = None,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        recompute: str = "auto",
        detect_anomaly: bool = False,
        keep: Keep | None = None,
    ) -> BackwardResult:
        """As Client.backward."""
        if not isinstance(graph, Mapping):
            graph = self._traced(graph, inputs, await self._catalog())
        return await self._send(
            self._call(
                "/backward",
                graph,
                inputs,
                requires_grad=requires_grad,
                device=device,
                grad_outputs=grad_outputs,
                memory_budget_bytes=memory_budget_bytes,
                recompute=recompute,
                detect_anomaly=detect_anomaly,
                keep=keep,
            ),
            BackwardResult,
        )

    async def ops(self) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = self._json(await self._get("/ops"))["ops"]
        self.catalog = Catalog(ops)
        return ops

    async def _catalog(self) -> Catalog:
        if self.catalog is None:
            await self.ops()
        assert self.catalog is not None
        return self.catalog

    async def trace(self, fn: Callable[..., Any], /, **specs: Any) -> dict[str, Any]:
        """The graph of `fn` on inputs of these specs (service.trace.trace with this server's
        catalog)."""
        return trace_graph(fn, await self._catalog(), **specs)

    @property
    def F(self) -> Functional:
        """The functional namespace of this server's op catalog (once fetched: by `await
        ops()`, `trace`, or a traced `forward` or `backward`)."""

        def catalog() -> Catalog:
            if self.catalog is None:
                raise TraceError(
                    "AsyncClient.F needs the server's catalog: await "
                    "client.ops() (or trace, forward, backward) first"
                )
            return self.catalog

        return Functional(catalog)

    async def devices(self) -> dict[str, Any]:
        return self._json(await self._get("/devices"))  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ held tensors
    async def put(self, array: ArrayLike) -> TensorRef:
        """As Client.put."""
        value = _wire_array(array)
        response = await self._request("POST", "/tensors", *self._upload(value), self._attempts())
        return TensorRef.of(self._json(response), value)

    async def parameter(self, array: ArrayLike) -> Parameter:
        """As Client.parameter."""
        return Parameter(await self.put(array))

    async def get(self, ref: Held) -> np.ndarray:
        """As Client.get."""
        path = f"/tensors/{ref_of(ref).tensor_id}"
        return _held_value(await self._request("GET", path, None, self._accept(), self._attempts()))

    async def delete(self, ref: Held) -> bool:
        """As Client.delete."""
        path = f"/tensors/{ref_of(ref).tensor_id}"
        return _deleted(
            await self._request("DELETE", path, None, self.tensor_headers, self._attempts())
        )

    async def tensors(self) -> dict[str, Any]:
        """As Client.tensors."""
        return self._json(  # type: ignore[no-any-return]
            await self._request("GET", "/tensors", None, self.tensor_headers, self._attempts())
        )

    # ------------------------------------------------------------------ inside
    def _attempts(self) -> _Attempts:
        return _Attempts(self.retry, self._http.timeout)

    async def _send(self, call: _Call, kind: type[_R]) -> _R:
        attempts = self._attempts()
        graph_id = self._graph_id(call)
        response = await self._compute(call, graph_id, attempts)
        if self._retry_by_graph(call, graph_id, response):
            graph_id = None
            response = await self._compute(call, graph_id, attempts)
        missing = self._missing(call, response)
        if missing is not None:  # evicted, or a restart: upload them again, and retry once
            for ref in missing:
                assert ref.value is not None
                await self.put(ref.value)
            response = await self._compute(call, graph_id, attempts)
        return self._finish(call, graph_id, response, kind)

    async def _compute(
        self, call: _Call, graph_id: str | None, attempts: _Attempts
    ) -> httpx.Response:
        body, headers = self._encode(call, graph_id)
        return await self._request("POST", call.path, body, self._headers(call, headers), attempts)

    async def _get(self, path: str) -> httpx.Response:
        return await self._request("GET", path, None, {}, self._attempts())

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | list[bytes | memoryview] | None,
        headers: dict[str, str],
        attempts: _Attempts,
    ) -> httpx.Response:
        """The request's response, with its retries."""
        attempts.begin()
        while True:
            try:
                response = await self._exchange(
                    method, path, body, headers, attempts.attempt_timeout()
                )
            except httpx.TransportError as exc:
                delay = attempts.after_error(exc)
                if delay is None:
                    raise
            else:
                delay = attempts.after_response(response)
                if delay is None:
                    return response
            await attempts.clock.asleep(delay)

    async def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | list[bytes | memoryview] | None,
        headers: dict[str, str],
        timeout: httpx.Timeout,
    ) -> httpx.Response:
        """One attempt's response."""
        if self._direct is None:
            # (the parts anew each attempt: an async iterator is used up)
            content = None if body is None else body if isinstance(body, bytes) else _parts(body)
            return await self._http.request(
                method, path, content=content, headers=headers, timeout=timeout
            )
        request = self._direct_request(method, path, body, headers, timeout)
        response = await self._direct.handle_async_request(request)
        response.request = request
        await response.aread()
        return response

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _parts(parts: list[bytes | memoryview]) -> AsyncIterator[bytes]:
    """A binary body's parts for httpx's async transports (which take only an async
    iterable of chunks); each is written as it lies."""
    for part in parts:
        yield cast(bytes, part)


def _tensors(fields: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for where in ("inputs", "grad_outputs"):
        yield from fields.get(where, {}).values()


# Past this size a response is mostly base64 text, which pydantic-core's parser reads
# about 1.5x as fast as orjson's (13 against 20 ms for 21 MB here); for numbers and small
# documents orjson is as fast or faster.
_LARGE_RESPONSE = 1 << 20


def _loads(content: bytes) -> Any:
    if len(content) >= _LARGE_RESPONSE:
        return pydantic_core.from_json(content)
    return orjson.loads(content)


def decode(tensor: Mapping[str, Any]) -> np.ndarray:
    """A response tensor (`data` or `b64`) as a writable NumPy array of its dtype and
    shape (base64: a view on its own decoded buffer; JSON: a new array)."""
    dtype, shape = np.dtype(tensor["dtype"]), tuple(tensor["shape"])
    if "b64" in tensor:
        raw = pybase64.b64decode_as_bytearray(tensor["b64"], validate=True)
        array = np.frombuffer(raw, dtype=LITTLE_ENDIAN[tensor["dtype"]])
        return array.astype(dtype, copy=False).reshape(shape)  # (a copy on big-endian)
    data = np.array(tensor["data"])
    if data.dtype.kind == "U":  # "NaN"/"Infinity" strings: NumPy reads them as floats
        data = data.astype(np.float64)
    return data.astype(dtype).reshape(shape)


def decode_binary(
    content: bytes, header_length: int
) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """A binary response: its JSON header, and its tensors by where ("outputs",
    "gradients") and name. Each array is a read-only view on `content` (on a big-endian
    host, a byte-swapped, writable copy): gradserve.wire.binary says how they lie.
    ValueError when the sizes do not add up."""
    head, tail = split(content, header_length)
    header = orjson.loads(head)
    found = tensor_bytes(header, tail, RESPONSE_SECTIONS)
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for where in RESPONSE_SECTIONS:
        tensors = header.get(where)
        if not isinstance(tensors, dict):
            continue
        arrays[where] = {}
        for name, tensor in tensors.items():
            if not _has_data(tensor):
                continue  # (kept on the server)
            raw = found.get((where, name))
            arrays[where][name] = (
                decode(tensor) if raw is None else _view(raw, tensor, f"{where}[{name!r}]")
            )
    return header, arrays


def next_name(parameter: str) -> str:
    """The output that is a Parameter's next value: `W'` for `W` (an output cannot take an
    input's name; a traced function returns it under the Parameter's own)."""
    return parameter + "'"


def _renaming(fn: Callable[..., Any], params: list[str]) -> Callable[..., Any]:
    """`fn`, with the outputs it returns under a Parameter's name renamed to `next_name`."""

    @functools.wraps(fn)  # (its signature: the tracer passes inputs by name)
    def renamed(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, Mapping):
            return {next_name(k) if k in params else k: v for k, v in out.items()}
        return out

    return renamed


def _wire_array(array: ArrayLike) -> np.ndarray:
    """An array as it travels: a dtype of the wire's (float32 for other floats, as
    requests send them)."""
    value = np.asarray(array)
    return value if value.dtype.name in DTYPES else value.astype(wire_dtype(value.dtype))


def _held_value(response: httpx.Response) -> np.ndarray:
    """GET /tensors/{id}'s answer: a binary body's tensor (a view on it), or JSON's."""
    _raise_for_problem(response)
    length = response.headers.get(BINARY_HEADER)
    if length is None:
        return decode(_loads(response.content))
    head, tail = split(response.content, int(length))
    entry = orjson.loads(head)
    return _view(tail, entry, f"tensor {entry.get('tensor_id')}")


def _deleted(response: httpx.Response) -> bool:
    if _problem_of(response, TENSOR_UNKNOWN) is not None:
        return False
    _raise_for_problem(response)
    return True


def _problem_of(response: httpx.Response, kind: str) -> dict[str, Any] | None:
    """A 409's problem when it is of type `kind` (graph-unknown, tensor-unknown), else
    None."""
    if response.status_code != 409:
        return None
    try:
        problem = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    return problem if isinstance(problem, dict) and problem.get("type") == kind else None


def _has_data(tensor: Mapping[str, Any]) -> bool:
    """Whether a response's tensor has its value (else it was kept: only its id)."""
    return "tensor_id" not in tensor


def _kept(tensors: Mapping[str, Any] | None) -> dict[str, TensorRef]:
    return {n: TensorRef.of(t) for n, t in (tensors or {}).items() if not _has_data(t)}


# What `keep=` takes: output names, or {"outputs": [...], "gradients": [...]}.
Keep = Collection[str] | Mapping[str, Collection[str]]


def _keep_fields(keep: Keep | None, params: list[str]) -> dict[str, list[str]]:
    """The request's `keep`: what the caller asked, and the outputs that are its
    Parameters' new values."""
    if isinstance(keep, str):
        raise TypeError("keep takes a list of output names (or {'outputs', 'gradients'})")
    if isinstance(keep, Mapping):
        unknown = set(keep) - {"outputs", "gradients"}
        if unknown:
            raise TypeError(f"keep takes 'outputs' and 'gradients', not {sorted(unknown)}")
        outputs, gradients = list(keep.get("outputs", ())), list(keep.get("gradients", ()))
    else:
        outputs, gradients = list(keep or ()), []
    outputs += [n for n in params if n not in outputs]
    fields = {}
    if outputs:
        fields["outputs"] = outputs
    if gradients:
        fields["gradients"] = gradients
    return fields


def _held_or_array(value: Any) -> np.ndarray | TensorRef:
    return ref_of(value) if isinstance(value, TensorRef | Parameter) else np.asarray(value)


def _is_floating(value: np.ndarray | TensorRef) -> bool:
    if isinstance(value, TensorRef):
        return value.dtype.startswith("float")
    return value.dtype.kind == "f"


def _plain(base_url: str) -> bool:
    """Whether `base_url` is plain http that the environment's proxy settings
    (HTTP_PROXY, ALL_PROXY, NO_PROXY, as httpx reads them) send through no proxy."""
    url = httpx.URL(base_url)
    if url.scheme != "http":
        return False
    proxies = urllib.request.getproxies()
    return not ({"http", "all"} & proxies.keys()) or bool(urllib.request.proxy_bypass(url.host))


def _framed(
    header: bytes,
    binary: bool,
    tail: list[memoryview],
    tail_bytes: int,
    headers: Mapping[str, str],
) -> tuple[bytes | list[bytes | memoryview], dict[str, str]]:
    """A body (bytes, or a binary body's parts) and its headers: JSON, or a binary body
    (the JSON header, then the tensors' bytes)."""
    if not binary:
        return header, {"Content-Type": "application/json", **headers}
    size = len(header) + tail_bytes
    # A small body is joined (its one copy: one buffer, whichever transport writes it). A
    # larger one goes as its parts, each copied as it is written.
    parts: list[bytes | memoryview] = [header, *tail]
    return (b"".join(parts) if size < JOIN_BELOW else parts), {
        "Content-Type": "application/octet-stream",
        BINARY_HEADER: str(len(header)),
        "Content-Length": str(size),
        **headers,
    }


def _view(raw: memoryview, tensor: Mapping[str, Any], what: str) -> np.ndarray:
    dtype, shape = tensor["dtype"], tuple(tensor["shape"])
    if dtype not in LITTLE_ENDIAN:
        raise FramingError(f"{what}: unknown dtype {dtype!r}", (what,), "unknown dtype")
    if len(raw) != byte_size(dtype, shape):
        raise FramingError(
            f"{what}: binary_data_size {len(raw)} does not hold shape {list(shape)} of {dtype}",
            (what,),
            "wrong size",
        )
    return array_of(raw, dtype, shape)


def _raise_for_problem(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        problem = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    problem.setdefault("title", response.reason_phrase)
    problem.setdefault("detail", response.text[:500])
    raise GradserveHTTPError(response.status_code, problem)
