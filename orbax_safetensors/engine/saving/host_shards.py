"""A save's host shards: this process's part of the tree, copied off the devices, mapped to
stored names, and merged into the slices the distributed layout writes.

A ``HostShard`` is one box of one stored tensor and its values on the host.
``copy_to_host`` makes them (device→host transfers started ahead of the first
awaited, as many as the save's budget holds; thin strips resharded into row
blocks first), through a
``Mapping`` where the tree's names and arrangements are not the stored ones
(``_map_shards``). The planners (``HfPlanner``, ``DistributedPlanner``) then read
them as they are written: the hf layout's streamed files a ``whole_tensor`` at a
time, the distributed layout's slices as ``merge_shards`` forms them, each
written as its ``payload``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.core.coordination import Peers
from orbax_safetensors.engine.saving.device_copies import OnDevice, on_accelerator
from orbax_safetensors.engine.core.resharding import resharding, row_sharding
from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.format import to_bytes
from orbax_safetensors.planning import (
    Box,
    TensorSpec,
    box_shape,
    full_box,
    normalize_index,
    plan_regions,
    relative_slices,
)
from orbax_safetensors.planning.assembly import Assembly


@dataclasses.dataclass(frozen=True)
class HostShard:
    """A shard this process writes: its box in the tensor and a host copy of its values."""

    name: str
    box: Box
    data: np.ndarray | OnDevice | tuple[np.ndarray | OnDevice, ...] | _Gathered  # a tuple: row blocks


def copy_to_host(
    arrays: Mapping[str, Any], specs: Mapping[str, TensorSpec], *, copy: bool, budget: int,
    assemblies: Mapping[str, Assembly] | None = None, reshard_below: int = 0, peers: Peers,
) -> tuple[list[HostShard], int, int]:
    """Host values of the shards this process writes (``replica_id == 0``), how many
    arrays were resharded into row blocks first (runs under ``reshard_below`` bytes), and the
    most bytes of accelerator shards in transfer at once (``_landed``).

    With ``copy`` (``async_save``) the caller may donate or overwrite its arrays
    as soon as we return, so accelerator shards are copied to host memory (the
    transfers under way at once within ``budget``: ``_landed``) and numpy leaves are copied.
    Without (a blocking ``save``), an accelerator shard stays there as an
    ``OnDevice``, copied a window ahead of the writes (``device_copies``). CPU
    shards are not copied either way: their immutable buffers
    already are host memory, and the view we keep is a reference XLA honours
    (a donation of a still-referenced buffer is skipped, not performed), so a
    gigabyte memcpy on the caller's critical path buys nothing there. A
    resharded array is ours, never the caller's: its shards are brought to the
    host at once (copied off an accelerator, viewed on CPU), so at most one
    such extra array is alive on device at a time. The resharding is a device
    collective: the processes meet first, so none enters it after another failed.
    In a collective save, data of this process alone (numpy leaves, arrays on its
    own devices) is written by process 0, as one value for all.
    """
    owned, resharded = [], 0
    for name, array in arrays.items():
        spec = specs[name]
        if isinstance(array, jax.Array) and not (peers.is_collective and array.is_fully_addressable):
            rows = (row_sharding(array.sharding, spec.shape, spec.dtype.bits // 8, reshard_below)
                    if reshard_below and not spec.dtype.is_packed else None)
            if rows is not None:
                peers.meet(f"reshard/{name}")
                array, resharded = resharding(array.sharding, rows)(array), resharded + 1
            mine = [shard for shard in array.addressable_shards if shard.replica_id == 0]
            if spec.dtype.is_packed and any(normalize_index(shard.index, spec.shape) != full_box(spec.shape)
                                            for shard in mine):
                raise ArgumentError(
                    f"leaf {name!r}: {spec.dtype.code} packs values below a byte, "
                    "so it can only be saved from an unsharded (replicated) array")
            left = rows is None and on_accelerator(array)  # copied as the writes near, or in a window
            for shard in () if left else mine:
                shard.data.copy_to_host_async()
            for shard in mine:  # a resharded array's shards come to the host now, not later
                data = (OnDevice(shard.data) if left and not copy else shard.data if rows is None
                        else np.asarray(shard.data))
                owned.append((name, normalize_index(shard.index, spec.shape), data, rows is not None))
        elif peers.is_primary:
            owned.append((name, full_box(spec.shape), array, False))
    windowed = [i for i, (_, _, data, ours) in enumerate(owned)
                if copy and not ours and on_accelerator(data)]
    landed, peak = _landed([owned[i][2] for i in windowed], budget)
    host = dict(zip(windowed, landed))
    shards = [HostShard(name, box, host[i] if i in host else data if type(data) is np.ndarray and not copy
                        else data if isinstance(data, OnDevice)
                        else np.array(data, copy=True if copy and not ours and _copied(data) else None))
              for i, (name, box, data, ours) in enumerate(owned)]
    return (shards if assemblies is None else _map_shards(shards, assemblies, copy=copy)), resharded, peak


def _landed(arrays: list[jax.Array], budget: int) -> tuple[list[np.ndarray], int]:
    """Host copies of ``arrays``, in order, and the most bytes in transfer at once: a transfer
    starts once its bytes fit ``budget`` beside those started and not yet landed (copied into
    an array of ours), or when none is under way, so that what ``async_save`` has queued off
    the devices stays within its budget as a blocking save's copies ahead of the writes do."""
    copies: list[np.ndarray] = []
    started = inflight = peak = 0
    for array in arrays:
        while started < len(arrays) and (
                started == len(copies) or inflight + arrays[started].nbytes <= budget):
            arrays[started].copy_to_host_async()
            inflight += arrays[started].nbytes
            started += 1
        peak = max(peak, inflight)
        copies.append(np.array(array, copy=True))
        inflight -= array.nbytes
    return copies, peak


def _map_shards(shards: list[HostShard], assemblies: Mapping[str, Assembly],
                *, copy: bool) -> list[HostShard]:
    """Tree shards → stored names, boxes and bytes, one shard at a time (see ``Mapping``):
    each piece of the leaf the shard meets (a layer of a stacked leaf, a projection of a
    fused one) gets the shard's part of it, so every process writes its own rows of
    every per-layer tensor and nothing is gathered.

    A transposed shard is a fresh array; a merely reshaped one may still view
    the caller's, so ``async_save`` copies it like any other shard.
    """
    mapped = []
    for shard in shards:
        constant = assemblies[shard.name].constant
        if constant is not None and not np.all(np.asarray(shard.data) == constant.value):
            raise ArgumentError(f"tree leaf {shard.name!r} is a constant of the mapping ({constant.value} "
                                "throughout, which the checkpoint holds no tensor for), but holds other values")
        for piece in assemblies[shard.name].pieces:
            part = piece.part(shard.box)
            if part is None:
                continue
            inside, own = part
            values = np.asarray(shard.data)[relative_slices(inside, shard.box)].reshape(box_shape(own))
            for box, data in piece.transform.to_stored(own, values):
                if copy and np.may_share_memory(data, shard.data):
                    data = data.copy()
                mapped.append(HostShard(piece.stored, box, data))
    return mapped


def _copied(data: Any) -> bool:
    """Whether ``async_save`` must copy this value (see ``copy_to_host``)."""
    return not isinstance(data, jax.Array) or on_accelerator(data)


def merge_shards(shards: list[HostShard], specs: Mapping[str, TensorSpec]) -> list[HostShard]:
    """One slice per tensor where this process's shards of it form a box.

    The distributed layout stores at most one slice of a tensor per file, so
    fewer, larger slices mean fewer files; shards that do not form a box stay
    separate slices (and spread over several files). Shards that are row
    blocks of the slice are written one after the other, not copied together.
    """
    by_name: dict[str, list[HostShard]] = collections.defaultdict(list)
    for shard in shards:
        by_name[shard.name].append(shard)
    merged = []
    for name, group in by_name.items():
        regions = plan_regions(specs[name].shape, [p.box for p in group])
        if len(group) == 1 or len(regions) != 1:
            merged.extend(group)
            continue
        box = regions[0].box
        rows = sorted(group, key=lambda p: p.box)
        if all(p.box[1:] == box[1:] for p in rows):  # row blocks: concatenation in order
            merged.append(HostShard(name, box, tuple(p.data for p in rows)))
            continue
        merged.append(HostShard(name, box, _Gathered(box, tuple(group))))
    return merged


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """Shards that together form one slice, copied into it only when the slice is written:
    a file's tensors are gathered one at a time as the file streams out, not the whole
    tree up front (column shards of a tensor on one process, say)."""

    box: Box
    shards: tuple[HostShard, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.shards)

    def array(self) -> np.ndarray:
        data = np.empty(box_shape(self.box), self.shards[0].data.dtype)
        for shard in self.shards:
            data[relative_slices(shard.box, self.box)] = shard.data
        return data


def payload(data: np.ndarray | OnDevice | tuple[np.ndarray | OnDevice, ...] | _Gathered) -> list[memoryview]:
    """The on-disk bytes of a slice: one array, row blocks back to back, or gathered shards."""
    if isinstance(data, _Gathered):
        return [to_bytes(data.array())]
    return [to_bytes(np.asarray(a)) for a in (data if isinstance(data, tuple) else (data,))]


def whole_tensor(shape: tuple[int, ...], shards: list[HostShard]) -> np.ndarray:
    """A whole tensor from the shards one process holds of it (all of them, here)."""
    if len(shards) == 1 and shards[0].box == full_box(shape):
        return np.asarray(shards[0].data)
    whole = np.empty(shape, shards[0].data.dtype)
    for shard in shards:
        whole[tuple(slice(a, b) for a, b in shard.box)] = shard.data
    return whole
