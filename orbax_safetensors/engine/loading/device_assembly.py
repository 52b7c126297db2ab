"""Device assembly: host shards (or raw bytes) into global ``jax.Array``s.

Two ways in. ``device_array`` puts each of this process's host shards on the
devices holding it and forms the global array
(``jax.make_array_from_single_device_arrays``). ``bytes_to_array`` turns
bytes spread over the devices (a tensor read 1/N per process, read once per
cluster) into the typed, reshaped array of the target sharding: the
all-gather happens on device, compiled once per (shape, dtype, sharding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from orbax_safetensors.engine.loading.casting import Cast, apply_cast
from orbax_safetensors.engine.loading.host_work import host_map
from orbax_safetensors.planning import Box


def device_array(shape: tuple[int, ...], sharding: jax.sharding.Sharding, cast: Cast,
                 local: dict[Box, list[jax.Device]], host_shard: Callable[[Box], np.ndarray],
                 *, staged: bool = False) -> jax.Array:
    """The global array of ``sharding`` whose local shards ``host_shard(box)`` gives (a
    lookup or a view: work to make a shard belongs to the caller, on ``host_map``), each cast
    to ``cast.to`` (on every core where one needs it), put on its devices by one batched
    ``device_put`` (a third of the dispatch cost of one call per shard). Shards already of
    the dtype go straight there: handing them to the host threads cost more than a load of
    small tensors spent on anything else (0.2 ms a tensor).

    ``staged``: the shards are views of recycled staging (``staging``). Each goes to the
    first device holding it and is copied from there to the others (over the devices' own
    links, not again from the host), and XLA never adopts one as the array
    (``off_staging``)."""
    held = [host_shard(box) for box in local]
    if cast.to is not None and any(shard.dtype != cast.to for shard in held):
        held = host_map(lambda shard: apply_cast(shard, cast), held)
        staged = False  # fresh arrays now
    if not staged:
        shards, targets = [], []
        for shard, devices in zip(held, local.values()):
            shards.extend([shard] * len(devices))
            targets.extend(devices)
        arrays = jax.device_put(shards, targets)
    else:
        firsts = jax.device_put([off_staging(shard, devices) for shard, devices in zip(held, local.values())],
                                [devices[0] for devices in local.values()])
        copies = [(first, device) for first, devices in zip(firsts, local.values()) for device in devices[1:]]
        copied = iter(jax.device_put([a for a, _ in copies], [d for _, d in copies]) if copies else [])
        arrays = [array for first, devices in zip(firsts, local.values())
                  for array in [first, *(next(copied) for _ in devices[1:])]]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=cast.to)


def off_staging(host: np.ndarray, devices: Iterable[jax.Device]) -> np.ndarray:
    """``host`` (a view of recycled staging), safe to ``device_put`` onto ``devices``: a copy
    where one is a CPU, whose client adopts an aligned host buffer as the array (even with
    ``may_alias=False`` in a batched ``device_put``: jax 0.10) and would keep the buffer the
    next batch reads into; as it is elsewhere (an accelerator copies it to its memory)."""
    return np.array(host) if any(d.platform == "cpu" for d in devices) else host


def bitcastable(dtype: np.dtype) -> bool:
    """Dtypes XLA can rebuild from raw bytes on device (not complex, not sub-byte)."""
    return dtype.kind != "c" and dtype.itemsize >= 1 and dtype.name not in (
        "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")


@functools.lru_cache(maxsize=256)
def bytes_to_array(nbytes, shape, stored: np.dtype, target: np.dtype, sharding,
                   bounds: bool = False) -> Callable:
    """A compiled bytes → typed, reshaped, resharded array (the all-gather happens here);
    with ``bounds``, also what a range check needs, replicated: the smallest and largest
    stored value (infinities included, NaN not), whether any is NaN, and whether all are."""

    def convert(flat: jax.Array) -> jax.Array:
        raw = flat[:nbytes]
        if stored == np.bool_:
            typed = raw != 0
        elif stored.itemsize == 1:
            typed = jax.lax.bitcast_convert_type(raw, stored)
        else:
            typed = jax.lax.bitcast_convert_type(raw.reshape(-1, stored.itemsize), stored)
        result = typed.reshape(shape).astype(target)
        if not bounds:
            return result
        if not jnp.issubdtype(stored, jnp.inexact):
            return result, typed.min(), typed.max(), jnp.bool_(False), jnp.bool_(False)
        wide = typed.astype(jnp.float32)  # every stored float type's values, and ±inf to fill NaN
        nan = jnp.isnan(wide)
        return (result, jnp.where(nan, jnp.inf, wide).min(), jnp.where(nan, -jnp.inf, wide).max(),
                nan.any(), nan.all())

    if not bounds:
        return jax.jit(convert, out_shardings=sharding)
    devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("all",)),
                                            jax.sharding.PartitionSpec())
    return jax.jit(convert, out_shardings=(sharding, replicated, replicated, replicated, replicated))
