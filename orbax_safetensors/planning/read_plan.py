"""What one process reads, decided before the first byte moves: the read plan.

Input: for every wanted tensor, the slices it is stored in (``TensorSource``:
files, offsets, origins) and the boxes this process's devices hold; and a
``ReadProfile`` (what a request costs on the storage, and the memory budget).
Output: a ``ReadPlan`` -- batches of tensors that fit the budget, each with its
ranged requests already coalesced and chunked. The engine executes it and
never re-plans. Four steps, all pure:

1. ``plan_regions``: a tensor's local device boxes (deduplicated: devices
   holding the same shard share one read) are merged into as few *regions* as
   possible. When the union of the boxes is itself a box, that box is read
   once into one buffer and every device's shard is sliced from it in memory:
   a process whose four devices hold the four column blocks of a tensor reads
   whole rows (one contiguous run) instead of four strided sets.
2. ``plan_tensor_reads``: each shard is read straight into its own buffer
   when its bytes are contiguous in the file (or it lies within one stored
   slice), or through a bounce buffer in bounded row blocks when it is strided
   (a column block) or spans several stored slices.
3. ``box_runs``: boxes → byte runs (file offset, length) with the place each
   run lands in its buffer.
4. ``plan_reads``: tensors in file order, cut into batches under the memory
   budget; each batch's direct runs coalesced per file across its tensors
   (``transfers.coalesce``), each bounce read's runs on their own; in a file
   whose checksums are checked, every checksum block a run touches read whole.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from orbax_safetensors.format import DTYPES, DType, TensorInfo
from orbax_safetensors.format.checksums import BlockGrid
from orbax_safetensors.planning.boxes import (
    Box,
    box_shape,
    box_size,
    bounding_box,
    byte_runs,
    full_box,
    intersect,
    is_contiguous,
    relative_slices,
    tiles,
)
from orbax_safetensors.planning.transfers import Runs, Transfers, WholeRuns, coalesce

_BYTES = DTYPES["U8"]


class StoredSlice(NamedTuple):
    """One stored part of a tensor: the whole of it (hf) or one slice (distributed, DCP).

    ``offset`` is the absolute byte offset of its data in ``file``; ``origin``
    is where it starts in the global tensor. A named tuple, as ``TensorSource``: a
    checkpoint opened has one per tensor, and can hold 100 000 tensors.
    """

    info: TensorInfo
    file: str
    offset: int
    origin: tuple[int, ...]

    @property
    def box(self) -> Box:
        if not any(self.origin):  # a whole tensor: the (shared) box of its shape
            return full_box(self.info.shape)
        return tuple((o, o + n) for o, n in zip(self.origin, self.info.shape))

    def runs(self, box: Box, itemsize: int, target: int) -> Runs:
        """The byte runs of ``box`` (global coordinates, inside this slice) in its file."""
        relative = tuple((a - o, b - o) for (a, b), o in zip(box, self.origin))
        return box_runs(relative, self.info.shape, itemsize, self.offset, target)


class TensorSource(NamedTuple):
    """A tensor of a checkpoint and the slices it is stored in."""

    dtype: DType
    shape: tuple[int, ...]
    slices: tuple[StoredSlice, ...]

    @property
    def whole(self) -> StoredSlice | None:
        """The single slice holding the entire tensor, if it is stored that way."""
        if len(self.slices) == 1 and self.slices[0].info.shape == self.shape:
            return self.slices[0]
        return None

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclasses.dataclass(frozen=True)
class Region:
    """A box read into one buffer, and the (distinct) device boxes cut from it."""

    box: Box
    members: tuple[Box, ...]


def plan_regions(shape: Sequence[int], boxes: Sequence[Box]) -> list[Region]:
    """Regions covering ``boxes``: one, when their union is a box they tile; else one each."""
    distinct = list(dict.fromkeys(boxes))
    if not distinct:
        return []
    outer = bounding_box(distinct)
    if len(distinct) == 1 or tiles(distinct, outer):
        return [Region(outer, tuple(distinct))]
    return [Region(b, (b,)) for b in distinct]


@dataclasses.dataclass(frozen=True)
class RegionRead:
    """One read of a region: straight into a shard's buffer, or through a bounce buffer.

    ``direct`` names the shard (a member box) whose buffer the bytes land in,
    in order. Without it, ``box`` is read into a temporary buffer and every
    shard it intersects copies its part out: the way to serve strided shards
    (column blocks) from contiguous reads without staging a whole region.
    """

    box: Box
    direct: Box | None


def plan_region_reads(
    region: Region, shape: Sequence[int], itemsize: int, block_bytes: int
) -> list[RegionRead]:
    """Direct reads when each shard is contiguous in the file, else bounced row blocks.

    A bounced region is cut along its first dimension into blocks of at most
    ``block_bytes`` (at least one index of that dimension), so the bounce
    memory per read stays bounded whatever the tensor's size.
    """
    if region.members == (region.box,) or all(is_contiguous(m, shape) for m in region.members):
        return [RegionRead(m, m) for m in region.members]
    return [RegionRead(block, None) for block in row_blocks(region.box, itemsize, block_bytes)]


def row_blocks(box: Box, itemsize: int, block_bytes: int) -> list[Box]:
    """``box`` cut along its first dimension into blocks of at most ``block_bytes``.

    A block keeps at least one index of the first dimension, so a single
    "row" larger than ``block_bytes`` stays whole.
    """
    if not box:
        return [box]
    (start, stop), rest = box[0], box[1:]
    row_bytes = box_size(((0, 1),) + rest) * itemsize
    step = max(1, block_bytes // max(row_bytes, 1))
    return [((r, min(r + step, stop)),) + rest for r in range(start, stop, step)]


def replication_factor(shape: Sequence[int], boxes_by_process: Mapping[int, Sequence[Box]]) -> float:
    """How many times over the processes together hold a tensor (1.0: each byte once).

    Above 1, every process reading its own shards would fetch some bytes
    several times across the cluster; the read-once path avoids that.
    """
    total = box_size(full_box(shape))
    if total == 0:
        return 1.0
    # Each distinct box sized once (with numpy): a sharding over thousands of devices hands
    # in thousands of boxes per tensor, a replicated tensor the same box thousands of times.
    held = collections.Counter(b for boxes in boxes_by_process.values() for b in set(boxes))
    if not held:
        return 0.0
    bounds = np.array(list(held), np.int64).reshape(len(held), len(shape), 2)
    sizes = np.prod(bounds[:, :, 1] - bounds[:, :, 0], axis=1)
    return int(sizes @ np.fromiter(held.values(), np.int64, len(held))) / total


@functools.lru_cache(maxsize=64)
def read_once_boxes(nbytes: int, parts: int) -> tuple[Box, ...]:
    """``parts`` consecutive byte ranges of equal size (the last ones may be short or empty).

    Cached: every process asks it for each replicated tensor, with one ``parts`` (the
    devices) and a few sizes (a model's norms are all alike).
    """
    chunk = -(-nbytes // parts)
    return tuple(((min(k * chunk, nbytes), min((k + 1) * chunk, nbytes)),) for k in range(parts))


def reshard_parts(shape: Sequence[int], itemsize: int, boxes_by_process: Mapping[int, Sequence[Box]],
                  devices_per_process: Sequence[int], thin: int) -> int | None:
    """How many row blocks to read a tensor in and reshard on device, instead of reading
    its shards (``None``: read the shards).

    A target sharding can give each process a strided strip of a tensor: under
    ``P("tp", "fsdp")`` with 64 fsdp columns, each process of a 512-device
    cluster holds 512-byte pieces of every row of a projection, and reading
    them is a ranged request per row, millions per checkpoint (a bounce read
    cannot help: the rows in between belong to other processes). The same
    number of bytes read as whole rows, one contiguous block per process, and
    moved to the target sharding by XLA (an all-to-all over the interconnect,
    faster than any storage) costs a few requests. Chosen when several
    processes hold the tensor and what some process reads (its boxes, or the
    box they tile) is strided in runs shorter than ``thin`` bytes (the gap a
    backend would rather read through than request apart). A contiguous part
    is one request, however short; a process holding whole rows cut into
    column blocks among its devices (``P("fsdp", "tp")``) reads them as one.

    XLA shards evenly, so the tensor is cut into ``gcd(rows, devices)`` blocks,
    each on ``devices / blocks`` consecutive devices (ordered by process);
    when a block would straddle two processes -- both would read it -- the
    shards are read instead.
    """
    if len(shape) < 2 or len(boxes_by_process) < 2:
        return None
    regions = _process_regions(boxes_by_process, len(shape))
    extents = regions[:, :, 1] - regions[:, :, 0]
    partial = extents != np.asarray(shape, np.int64)
    # A run spans the innermost partial dimension and every dimension after it; the
    # dimensions before it count the runs. One run is one request, however short.
    split = np.where(partial.any(axis=1), len(shape) - 1 - np.argmax(partial[:, ::-1], axis=1), 0)
    every = np.arange(len(split))
    runs = np.cumprod(np.c_[np.ones(len(split), np.int64), extents], axis=1)[every, split]
    run_bytes = np.cumprod(extents[:, ::-1], axis=1)[:, ::-1][every, split] * itemsize
    if not ((runs > 1) & (run_bytes < thin)).any():
        return None
    parts = math.gcd(shape[0], sum(devices_per_process))
    per_part = sum(devices_per_process) // parts
    if any(n % per_part for n in devices_per_process):
        return None
    return parts


def _process_regions(boxes_by_process: Mapping[int, Sequence[Box]], ndim: int) -> np.ndarray:
    """``(regions, ndim, 2)`` bounds of what each process reads: its bounding box where its
    distinct non-empty boxes tile it (as ``plan_regions`` reads them), else each box."""
    counts = [len(boxes) for boxes in boxes_by_process.values()]
    bounds = np.array([b for boxes in boxes_by_process.values() for b in boxes],
                      np.int64).reshape(sum(counts), ndim, 2)
    table = np.c_[np.repeat(np.fromiter(boxes_by_process, np.int64), counts),
                  bounds.reshape(len(bounds), 2 * ndim)]
    table = np.unique(table[np.all(bounds[:, :, 1] > bounds[:, :, 0], axis=1)], axis=0)
    if not len(table):
        return np.zeros((0, ndim, 2), np.int64)
    process, bounds = table[:, 0], table[:, 1:].reshape(len(table), ndim, 2)
    first = np.r_[True, process[1:] != process[:-1]]
    starts, group = np.flatnonzero(first), np.cumsum(first) - 1
    low = np.minimum.reduceat(bounds[:, :, 0], starts)
    high = np.maximum.reduceat(bounds[:, :, 1], starts)
    held = np.add.reduceat(np.prod(bounds[:, :, 1] - bounds[:, :, 0], axis=1), starts)
    tiled = held == np.prod(high - low, axis=1)  # distinct device boxes never half-overlap
    return np.concatenate([np.stack([low, high], axis=2)[tiled], bounds[~tiled[group]]])


def box_runs(box: Box, shape: Sequence[int], itemsize: int, base: int, target: int) -> Runs:
    """The runs of ``box`` in a C-order tensor of ``shape`` whose data starts at file offset
    ``base``, landing back to back in buffer ``target``."""
    offsets, run_length = byte_runs(box, shape, itemsize)
    return Runs.of(offsets + base, run_length, target)


class SliceRead(NamedTuple):
    """Read ``box`` (global coordinates) from stored slice ``slice``.

    ``direct`` names the shard whose buffer the bytes land in, in order (the
    box is that shard); without it the box goes through a bounce buffer and
    every shard it intersects copies its part out. A named tuple, as ``Segment``:
    a tensor read as many byte ranges has one per range.
    """

    slice: int
    box: Box
    direct: Box | None


@dataclasses.dataclass(frozen=True)
class TensorReads:
    """What one tensor needs read: a host buffer per shard box, and the reads that fill them.

    ``shards`` are boxes over ``shape`` with ``itemsize``-byte elements (the
    tensor's own, or for packed dtypes and read-once parts its raw bytes, with
    ``byte_space``: then boxes index the bytes of the single whole slice).
    ``needed`` counts the bytes of the shards this process's devices hold.
    ``first``: read and finished before every tensor without it (the scales
    another tensor's values are dequantized with, in its finish).
    """

    slices: tuple[StoredSlice, ...]
    shape: tuple[int, ...]
    itemsize: int
    shards: tuple[Box, ...]
    reads: tuple[SliceRead, ...]
    needed: int
    read_once: bool = False
    byte_space: bool = False
    resharded: bool = False
    first: bool = False

    shard_nbytes: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    nbytes: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Host buffer bytes of each shard, and of all (asked for several times per tensor
        while planning and reading: computed once)."""
        sizes = (tuple([stop - start for ((start, stop),) in self.shards]) if self.byte_space
                 else tuple([box_size(b) * self.itemsize for b in self.shards]))
        object.__setattr__(self, "shard_nbytes", sizes)
        object.__setattr__(self, "nbytes", sum(sizes))

    def single_run(self, read: SliceRead) -> tuple[int, int] | None:
        """``(file offset, length)`` of ``read`` when its bytes are one run of the file known
        without computing it (a byte range, or a whole stored slice), else ``None``."""
        stored = self.slices[read.slice]
        if self.byte_space:
            (start, stop), = read.box
            return stored.offset + start, stop - start
        if read.box == stored.box:
            return stored.offset, stored.info.nbytes
        return None

    def runs(self, read: SliceRead, target: int) -> Runs:
        """The byte runs of ``read`` in its slice's file, landing in buffer ``target``."""
        stored = self.slices[read.slice]
        if self.byte_space:
            return box_runs(read.box, self.shape, self.itemsize, stored.offset, target)
        return stored.runs(read.box, self.itemsize, target)


def plan_tensor_reads(source: TensorSource, shards: Sequence[Box], needed: int,
                      bounce_bytes: int, *, slices_by_region: bool = False) -> TensorReads:
    """Reads that fill ``shards`` (boxes of the tensor) from the source's slices.

    A whole stored tensor goes through region planning (shards that together
    form a box are read once, contiguously). For slices, each shard is read
    directly from the slice holding all of it, or assembled through bounce
    blocks from every slice it intersects. With ``slices_by_region`` slices are
    read by region too: the part of a region each slice holds is read once and
    cut into every shard it feeds. A file with checksum blocks wants that: a
    strided part of one shard reads every block it touches whole, so shard by
    shard each block would be read once per shard.
    """
    itemsize = source.dtype.bits // 8
    shards = tuple(shards)
    if source.whole is not None:
        if shards and shards.count(shards[0]) == len(shards):
            # One box (a host array, a replicated tensor): a region of its own, read
            # straight into its buffer, as ``plan_regions`` and ``plan_region_reads`` have it.
            return TensorReads(source.slices, source.shape, itemsize, shards,
                               (SliceRead(0, shards[0], shards[0]),), needed)
        reads = tuple(
            SliceRead(0, read.box, read.direct)
            for region in plan_regions(source.shape, shards)
            for read in plan_region_reads(region, source.shape, itemsize, bounce_bytes))
        return TensorReads(source.slices, source.shape, itemsize, shards, reads, needed)
    regions = (plan_regions(source.shape, shards) if slices_by_region
               else [Region(shard, (shard,)) for shard in shards])
    reads = tuple(read for region in regions for k, stored in enumerate(source.slices)
                  for read in _slice_reads(region, k, stored, itemsize, bounce_bytes))
    return TensorReads(source.slices, source.shape, itemsize, shards, reads, needed)


def _slice_reads(region: Region, k: int, stored: StoredSlice, itemsize: int,
                 bounce_bytes: int) -> list[SliceRead]:
    """The reads of the part of ``region`` that slice ``k`` holds: as ``plan_region_reads``
    reads a whole tensor's region when every shard touching the part lies in it, else
    through bounce blocks (a shard split between slices is assembled from each)."""
    part = intersect(region.box, stored.box)
    if part is None:
        return []

    def relative(box: Box) -> Box:
        return tuple((a - o, b - o) for (a, b), o in zip(box, stored.origin))

    def absolute(box: Box) -> Box:
        return tuple((a + o, b + o) for (a, b), o in zip(box, stored.origin))

    touching = [m for m in region.members if intersect(m, stored.box) is not None]
    if all(intersect(m, stored.box) == m for m in touching):
        reads = plan_region_reads(Region(relative(part), tuple(map(relative, touching))),
                                  stored.info.shape, itemsize, bounce_bytes)
    else:
        reads = [RegionRead(block, None) for block in row_blocks(relative(part), itemsize, bounce_bytes)]
    return [SliceRead(k, absolute(r.box), None if r.direct is None else absolute(r.direct))
            for r in reads]


def plan_byte_reads(stored: StoredSlice, boxes: Sequence[Box], needed: int, *,
                    read_once: bool = False) -> TensorReads:
    """Reads of byte ranges ``boxes`` of one whole slice, each straight into its own buffer
    (packed dtypes, read whole; read-once parts of a replicated tensor)."""
    boxes = tuple(boxes)
    return TensorReads((stored,), (stored.info.nbytes,), 1, boxes,
                       tuple([SliceRead(0, b, b) for b in boxes]), needed, read_once, byte_space=True)


class WholeReads(NamedTuple):
    """``plan_whole_reads``'s plan: the reads, and where each slice's bytes land (buffer
    ``buffers[k]``, from byte ``starts[k]`` of it)."""

    reads: TensorReads
    buffers: list[int]
    starts: list[int]


def plan_whole_reads(slices: Sequence[StoredSlice]) -> WholeReads:
    """Reads of several whole stored slices of one file, planned as one: a ``TensorReads`` in
    the bytes of the stretch of the file that holds them (its one slice), where slices that
    follow one another without a gap are one byte range read into one buffer. Many small
    tensors are then one tensor to plan, batch and finish, and a few reads into a few buffers,
    not one each: the Python spent per buffer and per read is what a load of 100 000 tiny
    tensors costs. A slice inside another (two leaves of one stored tensor) lands in its
    buffer too."""
    count = len(slices)
    offsets = np.fromiter([s.offset for s in slices], np.int64, count)
    stops = offsets + np.fromiter([s.info.nbytes for s in slices], np.int64, count)
    order = np.argsort(offsets, kind="stable")
    starts, ends = offsets[order], stops[order]
    reach = np.maximum.accumulate(ends)
    opens = np.ones(count, bool)  # a slice starting past every byte before it opens a buffer
    opens[1:] = starts[1:] > reach[:-1]
    buffer = np.cumsum(opens) - 1
    first_of = np.flatnonzero(opens)
    begin, end = starts[first_of], np.maximum.reduceat(ends, first_of)
    buffers, within = np.empty(count, np.int64), np.empty(count, np.int64)
    buffers[order], within[order] = buffer, starts - begin[buffer]
    first = int(begin[0])
    stretch = StoredSlice(TensorInfo(f"{count} tensors", _BYTES, (int(end[-1]) - first,), 0, int(end[-1]) - first),
                          slices[0].file, first, (0,))
    boxes = [((a, b),) for a, b in zip((begin - first).tolist(), (end - first).tolist())]
    return WholeReads(plan_byte_reads(stretch, boxes, int((end - begin).sum())), buffers.tolist(), within.tolist())


@dataclasses.dataclass(frozen=True)
class ReadProfile:
    """How a plan cuts its requests and batches (see ``ost.LoadOptions``)."""

    chunk_bytes: int
    max_gap: int
    max_overread: float
    memory_budget: int


@dataclasses.dataclass(frozen=True)
class BounceRead:
    """``box`` of tensor ``tensor`` read into a bounce buffer of ``nbytes`` (``transfers``
    target buffer 0), then cut into the tensor's shards, whose bounds ``shards`` holds as
    an array ``(shard, dimension, start/stop)`` shared by all the tensor's bounce reads."""

    tensor: int
    box: Box
    nbytes: int
    file: str
    transfers: Transfers
    shards: np.ndarray

    @property
    def copies(self) -> tuple[tuple[int, tuple[slice, ...], tuple[slice, ...]], ...]:
        """``(shard, slices into the shard, slices of the bounce buffer)`` for every shard the
        box intersects, over arrays of the boxes' shapes.

        Derived when asked, not stored: a block of a wide region feeds hundreds of
        shards (a process holding every column block of a tensor), and listing every
        (block, shard) pair up front would cost more than the reads themselves.
        """
        box = np.array(self.box, np.int64).reshape(-1, 2)
        start = np.maximum(self.shards[:, :, 0], box[:, 0])
        stop = np.minimum(self.shards[:, :, 1], box[:, 1])
        return tuple(
            (k, _slices(start[k] - self.shards[k, :, 0], stop[k] - self.shards[k, :, 0]),
             _slices(start[k] - box[:, 0], stop[k] - box[:, 0]))
            for k in np.flatnonzero((start < stop).all(axis=1)).tolist())


def _slices(starts: np.ndarray, stops: np.ndarray) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(starts.tolist(), stops.tolist()))


@dataclasses.dataclass(frozen=True)
class Batch:
    """Tensors whose host buffers are alive together, under the memory budget.

    ``transfers`` are the direct reads of all of them, per file; a segment's
    target numbers the batch's buffers in order (each tensor's shards in turn).
    """

    tensors: tuple[int, ...]
    nbytes: int
    transfers: tuple[tuple[str, Transfers], ...]
    bounced: tuple[BounceRead, ...]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Everything one process reads, batch by batch, in file order."""

    tensors: tuple[TensorReads, ...]
    batches: tuple[Batch, ...]

    @property
    def files(self) -> set[str]:
        """The files the plan reads (every read's, from the batches: one entry per file each)."""
        return {file for batch in self.batches for file, _ in batch.transfers} | {
            r.file for batch in self.batches for r in batch.bounced}

    @property
    def nbytes(self) -> int:
        """Bytes the plan reads from storage."""
        return sum(transfers.nbytes for batch in self.batches
                   for transfers in [t for _, t in batch.transfers] + [r.transfers for r in batch.bounced])

    @property
    def padding(self) -> int:
        """Bytes read only to complete checksum blocks (``Transfers.padding``)."""
        return sum(transfers.padding for batch in self.batches
                   for transfers in [t for _, t in batch.transfers] + [r.transfers for r in batch.bounced])


def plan_reads(tensors: Sequence[TensorReads], profile: ReadProfile,
               blocks: Mapping[str, BlockGrid] | None = None) -> ReadPlan:
    """Batches of ``tensors`` in file order (those ``first`` before the rest), each at most
    half the budget (so the next batch is read while the last one is finished), with every
    request coalesced and chunked. Batches finish in order, so a ``first`` tensor's finish
    has run before any other's.

    ``blocks``: the checksum blocks of the files whose checksums the reads check; each
    block a run touches is read whole (``coalesce``), so it can be checked.
    """
    tensors = tuple(tensors)
    order = sorted(range(len(tensors)),
                   key=lambda i: (not tensors[i].first, tensors[i].slices[0].file, tensors[i].slices[0].offset))
    limit = max(profile.memory_budget // 2, 1)
    groups: list[list[int]] = []
    size = 0
    for i in order:
        if not groups or size + tensors[i].nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += tensors[i].nbytes
    blocks = blocks or {}
    return ReadPlan(tensors, tuple(_batch(tensors, group, profile, blocks) for group in groups))


def _batch(tensors: Sequence[TensorReads], group: list[int], profile: ReadProfile,
           blocks: Mapping[str, BlockGrid]) -> Batch:
    def cut(runs: Runs, file: str) -> Transfers:
        return coalesce(runs, max_gap=profile.max_gap, max_overread=profile.max_overread,
                        chunk_bytes=profile.chunk_bytes, blocks=blocks.get(file))

    # Per file, in the order files first appear: runs, and reads that are one run each (whole
    # slices, byte ranges).
    by_file: dict[str, tuple[list[Runs], WholeRuns]] = {}
    bounced = []
    first_buffer = 0
    for i in group:
        tensor = tensors[i]
        shards = tensor.shards
        shard_index = {box: k for k, box in enumerate(shards)}
        shard_bounds = None
        for read in tensor.reads:
            file = tensor.slices[read.slice].file
            if read.direct is not None:
                target = first_buffer + shard_index[read.direct]
                if file not in by_file:
                    by_file[file] = ([], WholeRuns())
                runs, whole = by_file[file]
                run = tensor.single_run(read)
                if run is None:
                    runs.append(tensor.runs(read, target))
                else:
                    whole.add(*run, target)
                continue
            if shard_bounds is None:
                shard_bounds = np.array(tensor.shards, np.int64).reshape(
                    len(tensor.shards), len(tensor.shape), 2)
            bounced.append(BounceRead(i, read.box, box_size(read.box) * tensor.itemsize, file,
                                      cut(tensor.runs(read, 0), file), shard_bounds))
        first_buffer += len(shards)
    transfers = tuple((file, cut(Runs.concatenate([*runs, whole.runs()]), file))
                      for file, (runs, whole) in by_file.items())
    return Batch(tuple(group), sum(tensors[i].nbytes for i in group), transfers, tuple(bounced))


BLOCK_REQUEST_BYTES = 16 << 20  # the most one request of a box read in whole checksum blocks holds


@dataclasses.dataclass(frozen=True)
class BlockPart:
    """The part of a row block one stored slice holds: ``transfers`` read it (into buffer 0,
    of ``shape``), and it lands at ``into`` of the block."""

    file: str
    shape: tuple[int, ...]
    transfers: Transfers
    into: tuple[slice, ...]


def plan_block(source: TensorSource, block: Box,
               blocks: Mapping[str, BlockGrid] | None = None) -> list[BlockPart]:
    """Reads of one box of a tensor, from every stored slice it intersects.

    A row block is read exactly (no gaps, no chunking: it is bounded already).
    A box that is not one range of the file (a mapped read of a transposed
    tensor: a few hundred bytes of every row) is read in whole checksum
    blocks of its file where ``blocks`` has them, in requests of at most
    ``BLOCK_REQUEST_BYTES``: checking a block costs one crc32c when its bytes
    arrive whole, and a crc combination per piece when they arrive cut into
    thousands.
    """
    itemsize = source.dtype.bits // 8
    parts = []
    for stored in source.slices:
        part = intersect(block, stored.box)
        if part is None:
            continue
        grid = None if blocks is None else blocks.get(stored.file)
        transfers = coalesce(stored.runs(part, itemsize, 0), max_gap=0, max_overread=1.0,
                             chunk_bytes=BLOCK_REQUEST_BYTES if grid else 1 << 62, blocks=grid)
        parts.append(BlockPart(stored.file, box_shape(part), transfers,
                               relative_slices(part, block)))
    return parts
