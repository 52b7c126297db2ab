"""Executing a read plan: bytes into host buffers, buffers into arrays.

Each wanted tensor becomes a *job*: its ``TensorReads`` (pure: the boxes to
fill and the reads that fill them) and a ``finish`` that turns the filled
buffers into the result -- a numpy array, or a global ``jax.Array``
assembled from this process's shards with
``jax.make_array_from_single_device_arrays``. ``planning.plan_reads`` cuts
the jobs into batches under the memory budget, with every request already
decided; here a batch is read by the executor's threads while the previous
one is converted and transferred to devices by a single transfer thread, and
its host buffers are released as soon as its arrays exist. The single
transfer thread also keeps every process issuing cross-process collectives
(replicated read-once, thin strips resharded) in the same order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_safetensors.storage.executor import Executor
from orbax_safetensors.engine.host_memory import carve, footprint, host_buffers, populate, tensor_buffers
from orbax_safetensors.engine.integrity import Verifier
from orbax_safetensors.engine.progress import Progress
from orbax_safetensors.engine.resharding import (
    device_boxes,
    resharding,
    row_sharding,
    shared_across_processes,
)
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import from_bytes
from orbax_safetensors.format.checksums import FileChecksums
from orbax_safetensors.format.dtypes import cast_kind, first_out_of_range
from orbax_safetensors.planning import (
    GAP,
    Batch,
    BounceRead,
    Box,
    ReadPlan,
    StoredSlice,
    TensorReads,
    TensorSource,
    Transfer,
    box_shape,
    box_size,
    full_box,
    plan_byte_reads,
    plan_tensor_reads,
    plan_whole_reads,
    bounding_box,
    intersect,
    read_once_boxes,
    relative_slices,
)
from orbax_safetensors.planning.assembly import Assembly, Piece
from orbax_safetensors.planning.transforms import Transform
from orbax_safetensors.storage import Storage


@dataclasses.dataclass
class LoadStats:
    """What one process's load cost. Pass one to ``ost.load(..., stats=...)``.

    ``bytes_needed`` counts the bytes of the shards this process's devices
    hold (a replicated tensor counts in full); ``bytes_read`` the bytes it
    fetched from storage, which exceeds it by coalesced gaps and falls below
    it for tensors read once per cluster and all-gathered. ``tensors_resharded``
    counts tensors read in row blocks and moved to the target sharding on
    device (``ReadOptions.reshard_thin_shards``). ``bytes_verified`` counts the
    bytes read that were checked against their files' block checksums
    (``ReadOptions.verify_checksums``), ``checksum_overread`` the bytes among
    ``bytes_read`` read only to complete blocks needed in part (less than two
    blocks per contiguous run: 512 KiB at the default block size).
    ``skipped`` names the target leaves a ``strict=False`` load left out
    (absent from the checkpoint, or of another shape).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    files: int = 0
    tensors: int = 0
    tensors_read_once: int = 0
    tensors_resharded: int = 0
    bytes_verified: int = 0
    checksum_overread: int = 0
    seconds: float = 0.0
    skipped: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Job:
    """One tensor: what to read (planned) and how its filled buffers become the result.

    ``scratch``: the result is a copy (transformed by a mapping), so the buffers
    are only staging and come from memory recycled between batches rather than
    fresh pages (which cost most of a load here; see ``host_memory``).
    ``refused``: the cast to the result's dtype ``ReadOptions.casting`` refuses (float →
    int), described; ``refuse_casts`` raises them all before anything is read.
    ``collective``: ``finish`` runs a device collective (an all-gather of a tensor read
    once, an all-to-all of row blocks) that every process must enter.
    ``tensors``: how many tensors it reads (a ``group_job``'s members, else one).
    """

    reads: TensorReads
    finish: Callable[[list[np.ndarray]], Any]
    scratch: bool = False
    refused: str | None = None
    collective: bool = False
    tensors: int = 1


_UNSAFE_HINT = ('pass options=ost.ReadOptions(casting="unsafe") to cast as numpy astype does '
                "(truncating, wrapping around)")


def _casting(name: str, source: TensorSource, transform: Transform | None, target: np.dtype | None,
             casting: str, leaf: str | None = None) -> tuple[str | None, Callable | None]:
    """What ``casting`` (``ReadOptions.casting``) makes of casting a tensor to ``target``: the
    refusal to report before any read (float → int: ``format.dtypes.cast_kind``), or the
    check of the values read (int → an int type holding only some ints), or neither. The cast
    is from the values the ``transform`` leaves (float32 once scaled), the final one."""
    if target is None or casting == "unsafe":
        return None, None
    stored = source.dtype.numpy
    values = stored if transform is None else transform.tree_dtype(stored)
    kind = cast_kind(values, target)
    file = source.slices[0].file if source.slices else None
    if kind == "unsafe":
        where = f" in {file.rsplit('/', 1)[-1]}" if file else ""
        scaled = "" if values == stored else f" ({values} once scaled)"
        part = "" if leaf is None else f" (part of {leaf!r})"
        return f"{name!r}{part}{where}: stored {stored}{scaled}, target {np.dtype(target)}", None
    if kind == "check_range":
        return None, functools.partial(_check_range, name, file, np.dtype(target))
    return None, None


def _check_range(name: str, file: str | None, target: np.dtype, values: np.ndarray) -> None:
    """Raises unless every one of the integer ``values`` read fits ``target``. Where the target
    is the 32-bit type JAX makes of a 64-bit one (without ``jax_enable_x64``), an unsafe cast
    would wrap the value around: the hint is 64-bit JAX or a host array instead."""
    bad = first_out_of_range(values, target)
    if bad is not None:
        hint = _UNSAFE_HINT
        if values.dtype.itemsize == 8 and target == _device_dtype(values.dtype) != values.dtype:
            hint = ('JAX holds 64-bit integers as 32-bit unless jax_enable_x64 is on: call '
                    'jax.config.update("jax_enable_x64", True) before building the target, or '
                    'load the tensor as a host numpy array (a target leaf without a sharding); '
                    'casting="unsafe" would wrap the value around')
        raise SafetensorsError(
            f"value {bad} (stored {values.dtype}) does not fit the target dtype {target}: "
            f"refusing a cast that changes it; {hint}", file=file, tensor=name)


def refuse_casts(jobs: Sequence[Job], outputs: Sequence[Any] = ()) -> None:
    """Raises ``SafetensorsError`` listing every refused cast of ``jobs`` and of the
    ``AssembledLeaf``s among ``outputs`` (other items are ignored), if any."""
    refused = [job.refused for job in jobs if job.refused is not None]
    refused += [r for leaf in outputs if isinstance(leaf, AssembledLeaf) for r in leaf.refused]
    refused = list(dict.fromkeys(refused))
    if refused:
        raise SafetensorsError(
            f"refusing to cast {len(refused)} tensor(s) to a target dtype that changes their "
            "values (float → int truncates; NaN and inf become arbitrary integers): "
            + "; ".join(refused) + f". Give the target the stored dtype, or {_UNSAFE_HINT}")


def _whole_slice(name: str, source: TensorSource, why: str) -> StoredSlice:
    if source.whole is None:
        raise SafetensorsError(
            f"{why} needs the tensor stored whole, not in {len(source.slices)} slices", tensor=name)
    return source.whole


def host_job(name: str, source: TensorSource, dtype: np.dtype | None, *, bounce_bytes: int,
             transform: Transform | None = None, slices_by_region: bool = False,
             casting: str = "same_kind") -> Job:
    """The whole tensor as a numpy array (of ``dtype``, if given; mapped by ``transform``).
    ``slices_by_region``: as ``plan_tensor_reads`` (where checksum blocks are checked);
    ``casting``: as ``ReadOptions.casting``."""
    refused, check = _casting(name, source, transform, dtype, casting)

    def convert(host: np.ndarray) -> np.ndarray:
        if transform is not None:
            host = np.ascontiguousarray(transform.apply(host))
        if dtype is None or dtype == host.dtype:
            return host
        if check is not None:
            check(host)
        return host.astype(dtype)

    if source.dtype.is_packed:
        stored = _whole_slice(name, source, f"a {source.dtype.code} tensor")
        return Job(plan_byte_reads(stored, [((0, stored.info.nbytes),)], stored.info.nbytes),
                   lambda buffers: convert(_view(buffers[0], stored, name, source.shape)),
                   refused=refused)
    return Job(plan_tensor_reads(source, [full_box(source.shape)], source.nbytes, bounce_bytes,
                                 slices_by_region=slices_by_region),
               lambda buffers: convert(_view(buffers[0], source.slices[0], name, source.shape)),
               scratch=transform is not None, refused=refused)


# Whole tensors under this size, loaded as stored, are read in groups of up to ``GROUP_BYTES``
# of one file (``group_job``); a group's host arrays share one allocation.
GROUPED_BELOW = 64 << 10
GROUP_BYTES = 1 << 20


def groupable(source: TensorSource, dtype: np.dtype | None,
              sharding: jax.sharding.Sharding | None = None) -> bool:
    """Whether this tensor (without a transform) can be one of a ``group_job``'s: small,
    stored whole and loaded as stored (no cast), into a host array or onto devices of this
    process that each hold all of it (replicated: ``device_put`` of the host array does it)."""
    if source.whole is None or source.dtype.is_packed or source.nbytes >= GROUPED_BELOW:
        return False
    if sharding is None:
        return dtype is None or dtype == source.dtype.numpy
    if _device_dtype(dtype) != source.dtype.numpy or not sharding.is_fully_addressable:
        return False
    try:
        local, _ = device_boxes(sharding, source.shape)
    except Exception:  # a sharding that does not fit: sharded_job says so
        return False
    return list(local) == [full_box(source.shape)]


def group_job(members: Sequence[tuple[str, TensorSource, jax.sharding.Sharding | None]]) -> Job:
    """Several ``groupable`` tensors of one file as one job: their reads planned as one
    (``plan_whole_reads``), their arrays made by one ``finish``, which returns them in order
    (host arrays, or, with shardings, ``jax.Array``s put on their devices by one
    ``device_put``). A job of its own per tensor costs more than its read: 100 000 tiny
    tensors spent most of a load planning and finishing jobs, and a ``device_put`` per
    tensor costs more than one for many."""
    slices = [source.whole for _, source, _ in members]
    shardings = [sharding for _, _, sharding in members]

    def finish(buffers: list[np.ndarray]) -> list[Any]:
        arrays = [_view(buffer, stored, name, source.shape)
                  for buffer, stored, (name, source, _) in zip(buffers, slices, members)]
        if shardings[0] is None:
            return arrays
        return jax.block_until_ready(jax.device_put(arrays, shardings))  # host buffers go once copied

    return Job(plan_whole_reads(slices), finish, tensors=len(members))


def group_jobs(members: Sequence[tuple[str, TensorSource, jax.sharding.Sharding | None]]
               ) -> list[tuple[Job, list[int]]]:
    """``groupable`` tensors, as few ``group_job``s as they make (per file, host arrays and
    device arrays apart, in file order, up to ``GROUP_BYTES`` each), each with the indices
    into ``members`` of its members."""
    where = [(source.slices[0].file, sharding is None, source.slices[0].offset)
             for _, source, sharding in members]
    order = sorted(range(len(members)), key=where.__getitem__)
    groups: list[list[int]] = []
    size = 0
    for k in order:
        nbytes = members[k][1].nbytes
        if not groups or size + nbytes > GROUP_BYTES or where[k][:2] != where[groups[-1][0]][:2]:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return [(group_job([members[k] for k in group]), group) for group in groups]


def sharded_job(
    name: str, source: TensorSource, dtype: np.dtype, sharding: jax.sharding.Sharding,
    *, read_once: bool, bounce_bytes: int, reshard_below: int = 0, transform: Transform | None = None,
    slices_by_region: bool = False, casting: str = "same_kind",
) -> Job:
    """This process's shards of a tensor, assembled into a global ``jax.Array``.

    The boxes come from the target sharding (``devices_indices_map``, kept to
    the devices of this process); the reads from the planner. With a
    ``transform`` (a mapping rule) the array has the tree's shape: each device
    box is read as the stored box holding it and transformed on the host, so
    a transposed or head-split shard still costs only its own bytes. A tensor
    whose shards across processes have runs under ``reshard_below`` bytes is
    read in row blocks and resharded on device (``planning.reshard_parts``).
    ``slices_by_region``: as ``plan_tensor_reads`` (where checksum blocks are checked);
    ``casting``: as ``ReadOptions.casting`` (a narrowing int cast checks each shard read),
    of a cast to the dtype JAX gives the array (int32 for int64 unless ``jax_enable_x64``).
    """
    dtype = _device_dtype(dtype)
    refused, check = _casting(name, source, transform, dtype, casting)
    job = _sharded_job(name, source, dtype, sharding, read_once=read_once, bounce_bytes=bounce_bytes,
                       reshard_below=reshard_below, transform=transform,
                       slices_by_region=slices_by_region, check=check)
    return job if refused is None else dataclasses.replace(job, refused=refused)


def _device_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a ``jax.Array`` of ``dtype`` has: without ``jax_enable_x64``, JAX makes
    64-bit types 32-bit, wrapping values around; cast on the host instead, under the policy."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _sharded_job(
    name: str, source: TensorSource, dtype: np.dtype, sharding: jax.sharding.Sharding,
    *, read_once: bool, bounce_bytes: int, reshard_below: int, transform: Transform | None,
    slices_by_region: bool, check: Callable[[np.ndarray], None] | None,
) -> Job:
    shape = source.shape if transform is None else transform.tree_shape
    try:
        local, _ = device_boxes(sharding, shape)
    except Exception as e:  # jax raises several types for shardings that do not fit
        raise ValueError(f"tensor {name!r} of shape {shape}: target sharding does not fit: {e}") from None
    needed = sum(box_size(b) for b in local) * source.dtype.bits // 8
    if (read_once and transform is None and source.whole is not None and source.nbytes > 0
            and _bitcastable(source.dtype.numpy) and shared_across_processes(sharding, shape)):
        return _read_once_job(source.whole, dtype, sharding, needed, check)
    if reshard_below and transform is None and source.whole is not None and not source.dtype.is_packed:
        rows = row_sharding(sharding, shape, source.dtype.bits // 8, reshard_below)
        if rows is not None:
            inner = _sharded_job(name, source, dtype, rows, read_once=False, bounce_bytes=bounce_bytes,
                                 reshard_below=0, transform=None, slices_by_region=slices_by_region,
                                 check=check)
            move = resharding(rows, sharding)
            return Job(dataclasses.replace(inner.reads, needed=needed, resharded=True),
                       lambda buffers: move(inner.finish(buffers)), collective=True)

    if source.dtype.is_packed:  # read the bytes, unpack, then cut the shards in memory
        stored = _whole_slice(name, source, f"a {source.dtype.code} tensor")

        def finish_packed(buffers: list[np.ndarray]) -> jax.Array:
            host = _view(buffers[0], stored, name, source.shape)
            host = host if transform is None else transform.apply(host)
            return _device_array(shape, sharding, dtype, local, lambda box: host[
                tuple(slice(a, b) for a, b in box)], check)

        return Job(plan_byte_reads(stored, [((0, stored.info.nbytes),)], needed), finish_packed)

    if transform is None:
        shards = tuple(local)

        def finish(buffers: list[np.ndarray]) -> jax.Array:
            views = {box: _view(buf, source.slices[0], name, box_shape(box)) for box, buf in zip(shards, buffers)}
            return _device_array(shape, sharding, dtype, local, views.__getitem__, check)

        return Job(plan_tensor_reads(source, shards, needed, bounce_bytes,
                                     slices_by_region=slices_by_region), finish)

    staged = _Staging(source, name, [transform.stored_box(box) for box in local])

    def finish_mapped(buffers: list[np.ndarray]) -> jax.Array:
        views = staged.views(buffers, check)
        return _device_array(shape, sharding, dtype, local, lambda box: transform.to_tree(
            views(transform.stored_box(box)), transform.stored_box(box), box,
            out=_host_array(box_shape(box), dtype)))

    return Job(plan_tensor_reads(source, staged.boxes, needed, bounce_bytes,
                                 slices_by_region=slices_by_region), finish_mapped, scratch=True)


class _Staging:
    """Where the stored boxes a mapped tensor's shards need are staged: one buffer for
    the box they tile together, when they do (read as one run instead of strips cut apart
    through a bounce buffer; the transform takes views), else one buffer each."""

    def __init__(self, source: TensorSource, name: str, wanted: Sequence[Box]):
        self.source, self.name = source, name
        wanted = tuple(dict.fromkeys(wanted))
        region = bounding_box(wanted) if wanted else ()
        tiles = (1 < len(wanted) <= 64 and sum(box_size(b) for b in wanted) == box_size(region)
                 and all(intersect(a, b) is None for k, a in enumerate(wanted) for b in wanted[k + 1:]))
        self.boxes = (region,) if tiles else wanted

    def views(self, buffers: list[np.ndarray],
              check: Callable[[np.ndarray], None] | None = None) -> Callable[[Box], np.ndarray]:
        """The staged values of each wanted box, all passed to ``check`` first (if given)."""
        held = {box: _view(buf, self.source.slices[0], self.name, box_shape(box))
                for box, buf in zip(self.boxes, buffers)}
        if check is not None:
            host_map(check, list(held.values()))
        if len(self.boxes) != 1 or len(held) == 0:
            return held.__getitem__
        (region, values), = held.items()
        return lambda box: values[relative_slices(box, region)]


class AssembledLeaf:
    """A tree leaf made of several stored tensors (``planning.mapping.Assembly``: layers
    stacked, projections concatenated), read as one job per stored tensor.

    Each job reads only the stored boxes behind the parts of this process's
    device boxes its tensor holds (a device holding layers 0-7 never reads
    layer 8), transforms them and copies them into the leaf's host buffers,
    one per device box. The job that completes the leaf puts it on the
    devices, so a leaf's host buffers live from its first piece to its last
    (on CPU they become the array itself: 64-byte aligned, adopted by XLA).
    """

    def __init__(self, name: str, sources: Sequence[TensorSource], assembly: Assembly,
                 dtype: np.dtype, sharding: jax.sharding.Sharding | None, *, bounce_bytes: int,
                 slices_by_region: bool = False, casting: str = "same_kind"):
        self.name, self.assembly, self.sharding = name, assembly, sharding
        self.dtype = np.dtype(dtype) if sharding is None else _device_dtype(dtype)
        casts = [_casting(piece.stored, source, piece.transform, self.dtype, casting, leaf=name)
                 for piece, source in zip(assembly.pieces, sources)]
        # Every piece's refused cast (``refuse_casts``), whether or not this process reads it.
        self.refused = tuple(refused for refused, _ in casts if refused is not None)
        shape = assembly.shape
        if sharding is None:
            self.local = {full_box(shape): []}
        else:
            try:
                self.local, _ = device_boxes(sharding, shape)
            except Exception as e:  # jax raises several types for shardings that do not fit
                raise ValueError(f"tensor {name!r} of shape {shape}: target sharding does not fit: {e}") from None
        self.buffers: dict[Box, np.ndarray] = {}
        self.value: Any = None
        self.jobs = [job for piece, source, (_, check) in zip(assembly.pieces, sources, casts)
                     for job in [self._job(piece, source, bounce_bytes, slices_by_region, check)]
                     if job is not None]
        self._remaining = len(self.jobs)
        if not self.jobs:  # this process holds none of it (or it is empty)
            self.value = self._result()

    def _job(self, piece: Piece, source: TensorSource, bounce_bytes: int, slices_by_region: bool,
             check: Callable[[np.ndarray], None] | None) -> Job | None:
        """``check``: of the stored values read, before their cast (``_casting``)."""
        if source.dtype.is_packed:
            raise SafetensorsError(f"a {source.dtype.code} tensor cannot be part of a stacked or "
                                   f"concatenated leaf ({self.name!r})", tensor=piece.stored)
        parts = {box: part for box in self.local for part in [piece.part(box)] if part is not None}
        if not parts:
            return None
        transform = piece.transform
        staged = _Staging(source, piece.stored, [transform.stored_box(own) for _, own in parts.values()])
        needed = sum(box_size(inside) for inside, _ in parts.values()) * source.dtype.bits // 8

        def finish(buffers: list[np.ndarray]) -> Any:
            views = staged.views(buffers, check)
            for box in parts:  # allocated here, in turn; filled below, in parallel
                self._buffer(box)

            def fill(part: tuple[Box, tuple[Box, Box]]) -> None:
                box, (inside, own) = part
                stored = transform.stored_box(own)
                into = self.buffers[box][relative_slices(inside, box)].view()
                into.shape = box_shape(own)  # drops the stacked axes; never a copy (raises instead)
                transform.to_tree(views(stored), stored, own, out=into)

            host_map(fill, list(parts.items()))
            self._remaining -= 1  # finishes run on the one transfer thread, in turn
            if self._remaining == 0:
                self.value = self._result()
                return self.value
            return None

        return Job(plan_tensor_reads(source, staged.boxes, needed, bounce_bytes,
                                     slices_by_region=slices_by_region), finish, scratch=True)

    def _buffer(self, box: Box) -> np.ndarray:
        if box not in self.buffers:
            self.buffers[box] = _host_array(box_shape(box), self.dtype)
        return self.buffers[box]

    def _result(self) -> Any:
        buffers, self.buffers = self.buffers, {}
        if self.sharding is None:
            box = full_box(self.assembly.shape)
            return buffers[box] if box in buffers else np.zeros(self.assembly.shape, self.dtype)
        return _device_array(self.assembly.shape, self.sharding, self.dtype, self.local,
                             lambda box: buffers[box] if box in buffers else np.zeros(box_shape(box), self.dtype))


_HOST_THREADS = os.cpu_count() or 1
_host_pool: concurrent.futures.ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()


def host_map(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on every core: the host work of turning read buffers into
    shards (transposing copies, first touches of the result's pages) releases the GIL, and on
    one thread it is what a mapped load waits for. In order; the first error is raised."""
    global _host_pool
    if len(items) < 2 or _HOST_THREADS < 2:
        return [fn(x) for x in items]
    with _host_pool_lock:
        if _host_pool is None:
            _host_pool = concurrent.futures.ThreadPoolExecutor(_HOST_THREADS, "orbax_safetensors-host")
    return list(_host_pool.map(fn, items))


def _host_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array about to be filled by copies, in a host buffer XLA's CPU client adopts
    without a copy; its pages faulted in at once (by copies, page by page, costs twice)."""
    array = host_buffers([math.prod(shape) * np.dtype(dtype).itemsize])[0].view(dtype).reshape(shape)
    populate(array)
    return array


def _device_array(shape, sharding, dtype, local: dict[Box, list[jax.Device]], host_shard,
                  check: Callable[[np.ndarray], None] | None = None) -> jax.Array:
    """Puts each local shard on its devices (one batched ``device_put``, a third of the
    dispatch cost of one call per shard) and forms the global array. ``check``: of each
    shard's values, before they are cast to ``dtype``."""
    def host(box: Box) -> np.ndarray:
        shard = host_shard(box)
        if shard.dtype == dtype:
            return shard
        if check is not None:
            check(shard)
        return shard.astype(dtype)

    shards, targets = [], []
    for shard, devices in zip(host_map(host, list(local)), local.values()):
        shards.extend([shard] * len(devices))
        targets.extend(devices)
    arrays = jax.device_put(shards, targets)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def _read_once_job(
    stored: StoredSlice, dtype: np.dtype, sharding: jax.sharding.Sharding, needed: int,
    check: Callable[[np.ndarray], None] | None = None,
) -> Job:
    """Each process reads 1/N of the bytes; XLA all-gathers them into ``sharding``.
    ``check``: of the tensor's smallest and largest value (found on device)."""
    info = stored.info
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    chunk = math.ceil(info.nbytes / len(devices))
    byte_boxes = read_once_boxes(info.nbytes, len(devices))
    mine = [k for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    byte_mesh = jax.sharding.Mesh(np.array(devices), ("bytes",))
    byte_sharding = jax.sharding.NamedSharding(byte_mesh, jax.sharding.PartitionSpec("bytes"))

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        parts = []
        for k, buffer in zip(mine, buffers):
            padded = np.zeros(chunk, np.uint8)
            padded[:len(buffer)] = buffer
            parts.append(jax.device_put(padded, devices[k]))
        flat = jax.make_array_from_single_device_arrays(
            (chunk * len(devices),), byte_sharding, parts)
        convert = _bytes_to_array(info.nbytes, info.shape, info.dtype.numpy, np.dtype(dtype), sharding,
                                  bounds=check is not None)
        if check is None:
            return convert(flat)
        result, *bounds = convert(flat)  # every process sees the same bounds, and fails alike
        lo, hi, nan, only_nan = (np.asarray(b.addressable_data(0)) for b in bounds)
        check(np.array(([] if only_nan else [lo, hi]) + ([np.nan] if nan else []), info.dtype.numpy))
        return result

    return Job(plan_byte_reads(stored, [byte_boxes[k] for k in mine], needed, read_once=True),
               finish, collective=True)


def _bitcastable(dtype: np.dtype) -> bool:
    """Dtypes XLA can rebuild from raw bytes on device (not complex, not sub-byte)."""
    return dtype.kind != "c" and dtype.itemsize >= 1 and dtype.name not in (
        "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")


@functools.lru_cache(maxsize=256)
def _bytes_to_array(nbytes, shape, stored: np.dtype, target: np.dtype, sharding,
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


def _view(buffer: np.ndarray, stored: StoredSlice, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return from_bytes(buffer, stored.info.dtype, shape)
    except ValueError as e:
        raise SafetensorsError(
            f"cannot hold shape {shape} in an array: {e}", file=stored.file, tensor=name) from None


class _Budget:
    """Bytes of host buffers alive at once; a request above the total waits for all."""

    def __init__(self, total: int):
        self.total, self.free = total, total
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.total)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.free += n
            self._cond.notify_all()


class _Scratch:
    """Staging buffers of ``Job.scratch`` jobs, recycled: a batch takes memory a finished
    batch gave back (its pages already faulted in) before it allocates fresh pages."""

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}  # id of the list handed out → its arena
        self._lock = threading.Lock()

    def take(self, sizes: Sequence[int]) -> list[np.ndarray]:
        total = footprint(sizes)
        with self._lock:
            fits = [arena for arena in self._free if arena.size >= total]
            if fits:
                arena = min(fits, key=lambda a: a.size)
                self._free = [a for a in self._free if a is not arena]
            else:
                arena = None
        if arena is None:
            arena = host_buffers([total])[0]
        views = carve(arena, sizes)
        with self._lock:
            self._lent[id(views)] = arena
        return views

    def give(self, views: list[np.ndarray]) -> None:
        with self._lock:
            self._free.append(self._lent.pop(id(views)))


def _batch_buffers(jobs: Sequence[Job], scratch: _Scratch) -> list[list[np.ndarray]]:
    """Each job's shard buffers: recycled staging for ``scratch`` jobs, fresh pages for the
    others (small tensors sharing allocations: ``host_memory.tensor_buffers``)."""
    fresh = iter(tensor_buffers([job.reads.shard_nbytes for job in jobs if not job.scratch]))
    return [scratch.take(job.reads.shard_nbytes) if job.scratch else next(fresh) for job in jobs]


def transfer(storage: Storage, file: str, request: Transfer, buffers: Sequence[np.ndarray],
             verifier: Verifier | None = None) -> None:
    """One ranged read, scattered into ``buffers``, its bytes checked by ``verifier`` when it
    holds the file's checksums (raising ``ChecksumError`` for a damaged block).

    Gap bytes land in scratch memory: all gaps in one buffer, overwriting each other,
    unless they are checked (then each keeps its own bytes until hashed).
    """
    checked = verifier is not None and verifier.checks(file)
    gaps = request.lengths[request.targets == GAP]
    scratch = memoryview(np.empty(int(gaps.sum() if checked else gaps.max()) if len(gaps) else 0, np.uint8))
    views: list[memoryview | np.ndarray] = []
    used = 0
    for target, offset, length in zip(request.targets.tolist(), request.offsets.tolist(),
                                      request.lengths.tolist()):  # no Segment per tiny tensor
        if target == GAP:
            views.append(scratch[used:used + length])
            used += length if checked else 0
        elif offset == 0 and length == buffers[target].nbytes:  # all of it (a small tensor, say)
            views.append(buffers[target])
        else:
            views.append(memoryview(buffers[target])[offset:offset + length])
    storage.read_scatter(file, request.offset, views)
    if checked:
        damage = verifier.check(file, request.offset, views)
        if damage:
            raise damage[0].error()


def execute(storage: Storage, plan: ReadPlan, jobs: Sequence[Job], *, memory_budget: int,
            threads: int, stats: LoadStats, cancelled: threading.Event | None = None,
            checksums: Mapping[str, FileChecksums] | None = None,
            progress: Progress | None = None,
            meet: Callable[[str], None] = lambda step: None) -> list[Any]:
    """Runs ``plan`` (of ``jobs``' reads): every job's result, in job order; stops with
    ``KeyboardInterrupt`` once ``cancelled`` is set. Reads of the files ``checksums`` holds
    are checked against them (``plan`` must read their blocks whole: ``plan_reads`` with
    their layouts). Before a ``collective`` job's device collective the processes ``meet``:
    one whose reads failed never leaves the others inside a collective it will not enter."""
    budget = _Budget(memory_budget)
    scratch = _Scratch()
    verifier = Verifier(checksums or {})
    lock = threading.Lock()
    results: list[Any] = [None] * len(jobs)
    stats.tensors += sum(job.tensors for job in jobs)
    stats.tensors_read_once += sum(j.reads.read_once for j in jobs)
    stats.tensors_resharded += sum(j.reads.resharded for j in jobs)
    stats.bytes_needed += sum(j.reads.needed for j in jobs)
    stats.files += len(plan.files)
    stats.checksum_overread += plan.padding

    def read(file: str, request: Transfer, buffers: Sequence[np.ndarray]) -> None:
        pool.check_cancelled()  # queued reads of a cancelled load end here, unread
        transfer(storage, file, request, buffers, verifier)
        with lock:
            stats.bytes_read += request.length
            stats.requests += 1
        if progress is not None:
            progress.advance(request.length)

    bounce_buffers = threading.local()

    def bounce(bounced: BounceRead, buffers: list[np.ndarray]) -> None:
        """Reads ``bounced.box`` into a temporary and copies each shard's part out."""
        tensor = jobs[bounced.tensor].reads
        if getattr(bounce_buffers, "buffer", np.zeros(0, np.uint8)).size < bounced.nbytes:
            bounce_buffers.buffer = np.empty(bounced.nbytes, np.uint8)  # reused: faulted in once per thread
        temp = bounce_buffers.buffer[:bounced.nbytes]
        for request in bounced.transfers:
            read(bounced.file, request, [temp])
        source = temp.reshape(box_shape(bounced.box) + (tensor.itemsize,))
        for shard, into, out_of in bounced.copies:
            target = buffers[shard].reshape(box_shape(tensor.shards[shard]) + (tensor.itemsize,))
            populate(target[into])  # faulting page by page from a copy loop costs twice as much
            target[into] = source[out_of]

    def finish(batch: Batch, buffers: list[list[np.ndarray]], reads, reserved: int) -> None:
        try:
            for future in reads:
                future.result()
            for i, job_buffers in zip(batch.tensors, buffers):
                if jobs[i].collective:
                    meet(f"job/{i}")
                results[i] = jobs[i].finish(job_buffers)
                if isinstance(results[i], jax.Array):
                    results[i].block_until_ready()  # host buffers may go only once copied
                if jobs[i].scratch:
                    scratch.give(job_buffers)
            buffers.clear()
        finally:
            budget.release(reserved)

    with Executor(threads, name="orbax_safetensors-read", cancelled=cancelled) as pool, \
            Executor(1, name="orbax_safetensors-transfer", cancelled=cancelled) as transferring:
        finishing = []
        for batch in plan.batches:
            if any(f.done() and f.exception() for f in finishing):
                break
            pool.check_cancelled()
            reserved = budget.acquire(batch.nbytes)
            buffers = _batch_buffers([jobs[i] for i in batch.tensors], scratch)
            flat = [b for job_buffers in buffers for b in job_buffers]
            by_tensor = dict(zip(batch.tensors, buffers))
            reads = [pool.submit(bounce, b, by_tensor[b.tensor]) for b in batch.bounced]
            reads += [pool.submit(read, file, request, flat)
                      for file, transfers in batch.transfers for request in transfers]
            finishing.append(transferring.submit(finish, batch, buffers, reads, reserved))
        transferring.wait(finishing)
    verifier.finish()
    stats.bytes_verified += verifier.bytes_verified
    return results
