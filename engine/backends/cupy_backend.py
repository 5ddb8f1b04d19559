"""The CUDA backend: CuPy behind array-api-compat (the `gpu` extra). Imported lazily."""

from __future__ import annotations

import cupy
import numpy as np
from array_api_compat import cupy as xp_cupy

from gradserve.engine.backends.base import Array, Backend, namespace_with


def device_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def device_info(index: int) -> dict[str, object]:
    props = cupy.cuda.runtime.getDeviceProperties(index)
    uuid = props.get("uuid", b"")
    uuid_text = bytes(uuid).hex() if uuid else ""
    if len(uuid_text) == 32:
        uuid_text = "GPU-" + "-".join(
            (uuid_text[:8], uuid_text[8:12], uuid_text[12:16], uuid_text[16:20], uuid_text[20:])
        )
    return {
        "model": props["name"].decode(),
        "memory_bytes": int(props["totalGlobalMem"]),
        "uuid": uuid_text,
    }


def make_cupy_backend(index: int) -> Backend:
    device = cupy.cuda.Device(index)

    def scatter_add(x: Array, dim: int, index_: Array, src: Array) -> Array:
        with device:
            out = x.copy()
            # NumPy's indices(sparse=True), which CuPy lacks: one arange per dim, shaped to
            # broadcast against the others.
            ndim = len(index_.shape)
            grid = [
                cupy.arange(n).reshape([n if k == d else 1 for k in range(ndim)])
                for d, n in enumerate(index_.shape)
            ]
            grid[dim] = index_
            cupy.add.at(out, tuple(grid), src[tuple(slice(0, n) for n in index_.shape)])
            return out

    def from_host(a: np.ndarray) -> Array:
        with device:
            return cupy.asarray(a)

    return Backend(
        device=f"cuda:{index}",
        xp=namespace_with(xp_cupy, einsum=cupy.einsum, scatter_add=scatter_add),
        to_host=cupy.asnumpy,
        from_host=from_host,
        synchronize=lambda: device.synchronize(),
        activate=lambda: device,
        ufuncs=cupy,
    )
