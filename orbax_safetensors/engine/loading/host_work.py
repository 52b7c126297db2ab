"""Host work of a load: read bytes viewed as arrays, host buffers for results, and the copies
between them run on every core.

Turning read buffers into shards (transposing copies, first touches of the
result's pages) releases the GIL; on one thread it is what a mapped load
waits for. ``host_map`` shares it out over one pool of the engine's
``Executor``, made on first use and closed when the interpreter exits.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orbax_safetensors.engine.loading.host_buffers import host_buffers
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import from_bytes
from orbax_safetensors.planning import StoredSlice
from orbax_safetensors.storage.executor import Executor

HOST_THREADS = os.cpu_count() or 1
_pool: Executor | None = None
_pool_lock = threading.Lock()


def host_map(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on every core, in order; the first error is raised."""
    global _pool
    if len(items) < 2 or HOST_THREADS < 2:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None:
            _pool = Executor(HOST_THREADS, name="orbax_safetensors-host")
        pool = _pool
    return pool.map(fn, items)


def _close_pool() -> None:
    """At exit (after the loads still running were stopped: ``load``'s hook runs first)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


atexit.register(_close_pool)


def host_arrays(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """Arrays about to be filled by copies (a tensor's shards), in host buffers XLA's CPU
    client adopts without a copy, carved from one allocation; their pages faulted in at once
    (by copies, page by page, costs twice)."""
    itemsize = np.dtype(dtype).itemsize
    buffers = host_buffers([math.prod(shape) * itemsize for shape in shapes], populated=True)
    return [buffer.view(dtype).reshape(shape) for buffer, shape in zip(buffers, shapes)]


def view(buffer: np.ndarray, stored: StoredSlice, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes read of tensor ``name`` (stored as ``stored``) as an array of ``shape``."""
    try:
        return from_bytes(buffer, stored.info.dtype, shape)
    except ValueError as e:
        raise SafetensorsError(
            f"cannot hold shape {shape} in an array: {e}", file=stored.file, tensor=name) from None
