"""Shardings as storage sees them: which boxes each process holds, whether processes share
bytes, and row blocks instead of thin strips.

A target sharding decides which bytes each process's devices hold. When
those are strided strips too thin to transfer well (``planning.reshard_parts``),
loads read and saves write the tensor in contiguous row blocks, one set per
process, and XLA moves the data between the row-block sharding and the real
one on device. Everything here is JAX-side and cached: a model repeats a few
(shape, sharding) pairs, and every answer walks every device of the mesh.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
import numpy as np

from orbax_safetensors.planning import Box, normalize_index, replication_factor, reshard_parts


@functools.lru_cache(maxsize=256)
def device_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
               ) -> tuple[dict[Box, list[jax.Device]], dict[int, list[Box]]]:
    """This process's boxes (with the devices holding each) and every process's boxes
    (a 405B model's 1100 tensors come in 9 distinct (shape, sharding) pairs)."""
    me = jax.process_index()
    local: dict[Box, list[jax.Device]] = collections.defaultdict(list)
    by_process: dict[int, list[Box]] = collections.defaultdict(list)
    for device, index in sharding.devices_indices_map(shape).items():
        box = normalize_index(index, shape)
        by_process[device.process_index].append(box)
        if device.process_index == me:
            local[box].append(device)
    return dict(local), dict(by_process)


@functools.lru_cache(maxsize=256)
def shared_across_processes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether processes hold some bytes of the tensor in common (replicated across hosts):
    the case for reading it once per cluster."""
    return replication_factor(shape, device_boxes(sharding, shape)[1]) > 1.0


@functools.lru_cache(maxsize=256)
def row_sharding(sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int,
                 thin: int) -> jax.sharding.Sharding | None:
    """The row-block sharding to move a tensor through on its way to or from storage
    (``None``: its shards transfer well as they are). Blocks are ordered by process, so
    each process's devices hold consecutive rows: one contiguous range per process."""
    _, by_process = device_boxes(sharding, shape)
    devices = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    per_process = collections.Counter(d.process_index for d in devices)
    parts = reshard_parts(shape, itemsize, by_process, [per_process[p] for p in sorted(per_process)],
                          thin)
    if parts is None:
        return None
    mesh = jax.sharding.Mesh(np.array(devices).reshape(parts, -1), ("rows", "copies"))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))


@functools.lru_cache(maxsize=64)
def resharding(source: jax.sharding.Sharding, target: jax.sharding.Sharding) -> Callable:
    """A compiled move from ``source`` to ``target`` sharding (XLA's all-to-all)."""
    return jax.jit(lambda x: x, in_shardings=source, out_shardings=target)
