"""Reading exactly the bytes this process's devices need, and building arrays.

Each wanted tensor becomes a *job*: the boxes to read (planning), one host
buffer per box, and a ``finish`` that turns the filled buffers into the
result. Jobs run in file order, in batches admitted under a byte budget:
while one batch is being read by the thread pool, the previous one is being
converted and transferred to devices by a single transfer thread, and its
host buffers are released as soon as its arrays exist. The single transfer
thread also keeps every process issuing cross-process collectives (the
replicated read-once path) in the same order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import Checkpoint, StoredTensor, TensorSource
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import from_bytes
from orbax_safetensors.planning.mapping import Transform
from orbax_safetensors.planning import (
    GAP,
    Box,
    ReadOp,
    Region,
    Runs,
    box_shape,
    box_size,
    coalesce,
    full_box,
    intersect,
    normalize_index,
    plan_region_reads,
    plan_regions,
    read_once_boxes,
    relative_slices,
    replication_factor,
    row_blocks,
    tensor_runs,
)


@dataclasses.dataclass
class LoadStats:
    """What one process's load cost. Pass one to ``ost.load(..., stats=...)``.

    ``bytes_needed`` counts the bytes of the shards this process's devices
    hold (a replicated tensor counts in full); ``bytes_read`` the bytes it
    fetched from storage, which exceeds it by coalesced gaps and falls below
    it for tensors read once per cluster and all-gathered.
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    files: int = 0
    tensors: int = 0
    tensors_read_once: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class PieceRead:
    """Read ``box`` (global coordinates) from stored piece ``piece``.

    ``direct`` names the shard whose buffer the bytes land in, in order (the
    box is that shard); without it the box goes through a bounce buffer and
    every shard it intersects copies its part out.
    """

    piece: int
    box: Box
    direct: Box | None


@dataclasses.dataclass(frozen=True)
class Job:
    """One tensor: the shard buffers to fill, the reads that fill them, and ``finish``.

    ``shards`` are boxes over ``layout`` (the tensor's shape and itemsize, or
    its bytes for packed dtypes and read-once pieces); each gets one aligned
    host buffer, which ``finish`` turns into the result.
    """

    pieces: tuple[StoredTensor, ...]
    layout: tuple[tuple[int, ...], int]  # (shape, itemsize) the boxes index into
    shards: tuple[Box, ...]
    reads: tuple[PieceRead, ...]
    needed: int  # bytes of the shards this process's devices hold
    finish: Callable[[list[np.ndarray]], Any]
    read_once: bool = False
    byte_space: bool = False  # boxes index the bytes of the (single, whole) piece

    @property
    def nbytes(self) -> int:
        return sum(box_size(b) for b in self.shards) * self.layout[1]

    def runs(self, read: PieceRead, target: int) -> Runs:
        """The byte runs of ``read`` in its piece's file, landing in buffer ``target``."""
        piece = self.pieces[read.piece]
        if self.byte_space:
            return tensor_runs(Region(read.box, ()), *self.layout, piece.offset, target)
        return piece_runs(piece, read.box, self.layout[1], target)


def _byte_job(piece: StoredTensor, boxes: Sequence[Box], needed: int, finish, read_once=False) -> Job:
    """A job over one whole piece's raw bytes, each box read straight into its buffer."""
    boxes = tuple(boxes)
    return Job((piece,), ((piece.info.nbytes,), 1), boxes,
               tuple(PieceRead(0, b, b) for b in boxes), needed, finish, read_once, byte_space=True)


def _whole_piece(name: str, source: TensorSource, why: str) -> StoredTensor:
    if source.whole is None:
        raise SafetensorsError(
            f"{why} needs the tensor stored whole, not in {len(source.pieces)} slices", tensor=name)
    return source.whole


def _plan_reads(source: TensorSource, shards: Sequence[Box], bounce_bytes: int) -> tuple[PieceRead, ...]:
    """Reads that fill ``shards`` from the source's pieces.

    A whole stored tensor goes through region planning (shards that together
    form a box are read once, contiguously). For slices, each shard is read
    directly from the slice holding all of it, or assembled through bounce
    blocks from every slice it intersects.
    """
    itemsize = source.dtype.bits // 8
    if source.whole is not None:
        return tuple(
            PieceRead(0, read.box, read.direct)
            for region in plan_regions(source.shape, shards)
            for read in plan_region_reads(region, source.shape, itemsize, bounce_bytes))
    reads = []
    for shard in shards:
        for k, piece in enumerate(source.pieces):
            part = intersect(shard, piece.box)
            if part is None:
                continue
            if part == shard:
                reads.append(PieceRead(k, shard, shard))
                continue
            relative = tuple((a - o, b - o) for (a, b), o in zip(part, piece.origin))
            for block in row_blocks(relative, itemsize, bounce_bytes):
                box = tuple((a + o, b + o) for (a, b), o in zip(block, piece.origin))
                reads.append(PieceRead(k, box, None))
    return tuple(reads)


def host_job(name: str, source: TensorSource, dtype: np.dtype | None, *, bounce_bytes: int,
             transform: Transform | None = None) -> Job:
    """The whole tensor as a numpy array (of ``dtype``, if given; mapped by ``transform``)."""

    def convert(host: np.ndarray) -> np.ndarray:
        if transform is not None:
            host = np.ascontiguousarray(transform.apply(host))
        return host if dtype is None or dtype == host.dtype else host.astype(dtype)

    if source.dtype.is_packed:
        piece = _whole_piece(name, source, f"a {source.dtype.code} tensor")
        return _byte_job(piece, [((0, piece.info.nbytes),)], piece.info.nbytes,
                         lambda buffers: convert(_view(buffers[0], piece, name, source.shape)))
    whole = full_box(source.shape)
    return Job(source.pieces, (source.shape, source.dtype.bits // 8), (whole,),
               _plan_reads(source, [whole], bounce_bytes), source.nbytes,
               lambda buffers: convert(_view(buffers[0], source.pieces[0], name, source.shape)))


def sharded_job(
    name: str, source: TensorSource, dtype: np.dtype, sharding: jax.sharding.Sharding,
    *, read_once: bool, bounce_bytes: int, transform: Transform | None = None,
) -> Job:
    """This process's shards of a tensor, assembled into a global ``jax.Array``.

    With a ``transform`` (a mapping rule) the array has the tree's shape: each
    device box is read as the stored box holding it and transformed on the
    host, so a transposed or head-split shard still costs only its own bytes.
    """
    shape = source.shape if transform is None else transform.tree_shape
    try:
        index_map = sharding.devices_indices_map(shape)
    except Exception as e:  # jax raises several types for shardings that do not fit
        raise ValueError(f"tensor {name!r} of shape {shape}: target sharding does not fit: {e}") from None
    boxes = {device: normalize_index(index, shape) for device, index in index_map.items()}
    me = jax.process_index()
    local: dict[Box, list[jax.Device]] = collections.defaultdict(list)
    for device, box in boxes.items():
        if device.process_index == me:
            local[box].append(device)
    needed = sum(box_size(b) for b in local) * source.dtype.bits // 8
    by_process: dict[int, list[Box]] = collections.defaultdict(list)
    for device, box in boxes.items():
        by_process[device.process_index].append(box)
    if (read_once and transform is None and source.whole is not None and source.nbytes > 0
            and _bitcastable(source.dtype.numpy) and replication_factor(shape, by_process) > 1.0):
        return _read_once_job(source.whole, dtype, sharding, needed)

    if source.dtype.is_packed:  # read the bytes, unpack, then cut the shards in memory
        piece = _whole_piece(name, source, f"a {source.dtype.code} tensor")

        def finish_packed(buffers: list[np.ndarray]) -> jax.Array:
            host = _view(buffers[0], piece, name, source.shape)
            host = host if transform is None else transform.apply(host)
            return _assemble(shape, sharding, dtype, local, lambda box: host[
                tuple(slice(a, b) for a, b in box)])

        return _byte_job(piece, [((0, piece.info.nbytes),)], needed, finish_packed)

    stored_box = (lambda box: box) if transform is None else transform.stored_box
    shards = tuple(dict.fromkeys(stored_box(box) for box in local))

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        views = {box: _view(buf, source.pieces[0], name, box_shape(box))
                 for box, buf in zip(shards, buffers)}
        if transform is None:
            return _assemble(shape, sharding, dtype, local, views.__getitem__)
        return _assemble(shape, sharding, dtype, local, lambda box: transform.to_tree(
            views[stored_box(box)], stored_box(box), box))

    return Job(source.pieces, (source.shape, source.dtype.bits // 8), shards,
               _plan_reads(source, shards, bounce_bytes), needed, finish)


def _assemble(shape, sharding, dtype, local: dict[Box, list[jax.Device]], host_shard) -> jax.Array:
    """Puts each local shard on its devices and forms the global array."""
    arrays = []
    for box, devices in local.items():
        shard = host_shard(box)
        if shard.dtype != dtype:
            shard = shard.astype(dtype)
        arrays.extend(jax.device_put(shard, device) for device in devices)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def _read_once_job(
    stored: StoredTensor, dtype: np.dtype, sharding: jax.sharding.Sharding, needed: int
) -> Job:
    """Each process reads 1/N of the bytes; XLA all-gathers them into ``sharding``."""
    info = stored.info
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    chunk = math.ceil(info.nbytes / len(devices))
    byte_boxes = read_once_boxes(info.nbytes, len(devices))
    mine = [k for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    byte_mesh = jax.sharding.Mesh(np.array(devices), ("bytes",))
    byte_sharding = jax.sharding.NamedSharding(byte_mesh, jax.sharding.PartitionSpec("bytes"))

    def finish(buffers: list[np.ndarray]) -> jax.Array:
        pieces = []
        for k, buffer in zip(mine, buffers):
            padded = np.zeros(chunk, np.uint8)
            padded[:len(buffer)] = buffer
            pieces.append(jax.device_put(padded, devices[k]))
        flat = jax.make_array_from_single_device_arrays(
            (chunk * len(devices),), byte_sharding, pieces)
        convert = _bytes_to_array(info.nbytes, info.shape, info.dtype.numpy, np.dtype(dtype), sharding)
        return convert(flat)

    return _byte_job(stored, [byte_boxes[k] for k in mine], needed, finish, read_once=True)


def _bitcastable(dtype: np.dtype) -> bool:
    """Dtypes XLA can rebuild from raw bytes on device (not complex, not sub-byte)."""
    return dtype.kind != "c" and dtype.itemsize >= 1 and dtype.name not in (
        "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")


@functools.lru_cache(maxsize=256)
def _bytes_to_array(nbytes, shape, stored: np.dtype, target: np.dtype, sharding) -> Callable:
    """A compiled bytes → typed, reshaped, resharded array (the all-gather happens here)."""

    def convert(flat: jax.Array) -> jax.Array:
        raw = flat[:nbytes]
        if stored == np.bool_:
            typed = raw != 0
        elif stored.itemsize == 1:
            typed = jax.lax.bitcast_convert_type(raw, stored)
        else:
            typed = jax.lax.bitcast_convert_type(raw.reshape(-1, stored.itemsize), stored)
        return typed.reshape(shape).astype(target)

    return jax.jit(convert, out_shardings=sharding)


def _view(buffer: np.ndarray, stored: StoredTensor, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return from_bytes(buffer, stored.info.dtype, shape)
    except ValueError as e:
        raise SafetensorsError(
            f"cannot hold shape {shape} in an array: {e}", file=stored.file, tensor=name) from None


# XLA's CPU client adopts a 64-byte aligned, contiguous host buffer as the device
# buffer instead of copying it (and copies rather than writes it when donated), so
# on CPU a shard read into an aligned buffer costs no second copy and no memory.
_ALIGNMENT = 64


def aligned_buffers(sizes: Sequence[int]) -> list[np.ndarray]:
    """Uninitialised byte buffers, each 64-byte aligned, carved from one allocation.

    One allocation per tensor rather than per shard: large allocations get
    transparent huge pages, and faulting in 4 KiB pages one by one costs more
    than the copy that fills them.
    """
    starts = np.cumsum([0] + [-(-n // _ALIGNMENT) * _ALIGNMENT for n in sizes])
    raw = np.empty(int(starts[-1]) + _ALIGNMENT, np.uint8)
    base = -raw.ctypes.data % _ALIGNMENT
    return [raw[base + int(start):base + int(start) + n] for start, n in zip(starts, sizes)]


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


def execute_read(storage, file: str, op: ReadOp, buffers: Sequence[np.ndarray]) -> None:
    """One ranged read, scattered into ``buffers`` (gaps into a scratch buffer)."""
    scratch = np.empty(max((p.length for p in op.pieces if p.target == GAP), default=0), np.uint8)
    views = [memoryview(scratch)[:p.length] if p.target == GAP
             else memoryview(buffers[p.target])[p.offset:p.offset + p.length] for p in op.pieces]
    storage.read_scatter(file, op.offset, views)


def piece_runs(piece: StoredTensor, box: Box, itemsize: int, target: int) -> Runs:
    """The byte runs of ``box`` (global coordinates, inside ``piece``) in the piece's file."""
    relative = tuple((a - o, b - o) for (a, b), o in zip(box, piece.origin))
    return tensor_runs(Region(relative, ()), piece.info.shape, itemsize, piece.offset, target)


def _batches(jobs: Sequence[Job], limit: int) -> list[list[int]]:
    batches: list[list[int]] = []
    size = 0
    for i, job in enumerate(jobs):
        if not batches or size + job.nbytes > limit:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += job.nbytes
    return batches


def run_jobs(
    checkpoint: Checkpoint,
    jobs: Sequence[Job],
    *,
    memory_budget: int,
    chunk_bytes: int,
    max_gap: int,
    max_overread: float,
    threads: int,
    stats: LoadStats,
) -> list[Any]:
    """Reads and finishes every job; results in job order."""
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].pieces[0].file, jobs[i].pieces[0].offset))
    budget = _Budget(memory_budget)
    lock = threading.Lock()
    results: list[Any] = [None] * len(jobs)
    stats.tensors += len(jobs)
    stats.tensors_read_once += sum(j.read_once for j in jobs)
    stats.bytes_needed += sum(j.needed for j in jobs)
    stats.files += len({p.file for j in jobs for r in j.reads for p in [j.pieces[r.piece]]})

    def read_op(file: str, op: ReadOp, buffers: Sequence[np.ndarray]) -> None:
        execute_read(checkpoint.storage, file, op, buffers)
        with lock:
            stats.bytes_read += op.length
            stats.requests += 1

    bounce_buffers = threading.local()

    def bounce(job: Job, read: PieceRead, buffers: list[np.ndarray]) -> None:
        """Reads ``read.box`` into a temporary and copies each shard's part out."""
        shape, itemsize = job.layout
        nbytes = box_size(read.box) * itemsize
        if getattr(bounce_buffers, "buffer", np.zeros(0, np.uint8)).size < nbytes:
            bounce_buffers.buffer = np.empty(nbytes, np.uint8)  # reused: faulted in once per thread
        temp = bounce_buffers.buffer[:nbytes]
        for op in coalesce(job.runs(read, 0), max_gap=max_gap, max_overread=max_overread,
                           chunk_bytes=chunk_bytes):
            read_op(job.pieces[read.piece].file, op, [temp])
        source = temp.reshape(box_shape(read.box) + (itemsize,))
        for shard, buffer in zip(job.shards, buffers):
            part = intersect(read.box, shard)
            if part is not None:
                buffer.reshape(box_shape(shard) + (itemsize,))[relative_slices(part, shard)] = \
                    source[relative_slices(part, read.box)]

    def finish(batch: list[int], buffers: list[list[np.ndarray]], reads, reserved: int) -> None:
        try:
            for future in reads:
                future.result()
            for i, job_buffers in zip(batch, buffers):
                results[i] = jobs[i].finish(job_buffers)
                if isinstance(results[i], jax.Array):
                    results[i].block_until_ready()  # host buffers may go only once copied
            buffers.clear()
        finally:
            budget.release(reserved)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
            concurrent.futures.ThreadPoolExecutor(1) as transfer:
        finishing = []
        for batch in _batches([jobs[i] for i in order], max(memory_budget // 2, 1)):
            batch = [order[i] for i in batch]
            if any(f.done() and f.exception() for f in finishing):
                break
            reserved = budget.acquire(sum(jobs[i].nbytes for i in batch))
            buffers = [aligned_buffers([box_size(b) * jobs[i].layout[1] for b in jobs[i].shards])
                       for i in batch]
            runs_by_file: dict[str, list[Runs]] = collections.defaultdict(list)
            direct_buffers: list[np.ndarray] = []
            reads = []
            for i, job_buffers in zip(batch, buffers):
                job = jobs[i]
                buffer_of = dict(zip(job.shards, job_buffers))
                for read in job.reads:
                    if read.direct is None:
                        reads.append(pool.submit(bounce, job, read, job_buffers))
                        continue
                    runs_by_file[job.pieces[read.piece].file].append(
                        job.runs(read, len(direct_buffers)))
                    direct_buffers.append(buffer_of[read.direct])
            reads += [
                pool.submit(read_op, file, op, direct_buffers)
                for file, runs in runs_by_file.items()
                for op in coalesce(Runs.concatenate(runs), max_gap=max_gap,
                                   max_overread=max_overread, chunk_bytes=chunk_bytes)
            ]
            finishing.append(transfer.submit(finish, batch, buffers, reads, reserved))
        for future in finishing:
            future.result()
    return results
