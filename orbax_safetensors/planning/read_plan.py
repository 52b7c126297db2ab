"""What one process reads: regions per tensor, byte runs, coalesced ranged reads.

Three steps, all pure:

1. ``plan_regions``: a tensor's local device boxes (deduplicated: devices
   holding the same shard share one read) are merged into as few *regions* as
   possible. When the union of the boxes is itself a box, that box is read
   once into one buffer and every device's shard is sliced from it in memory:
   a process whose four devices hold the four column blocks of a tensor reads
   whole rows (one contiguous run) instead of four strided sets.
2. ``tensor_runs``: regions → byte runs (file offset, length) with the place
   each run lands in its region's buffer.
3. ``coalesce``: runs of one file → ranged reads. Adjacent runs always merge;
   a gap is read through (and discarded) only when it is at most ``max_gap``
   bytes and the read stays within ``max_overread`` × the bytes it delivers.
   Reads are then cut into chunks of at most ``chunk_bytes`` so one big tensor
   is fetched by parallel requests and no single buffer outgrows the
   in-flight budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from orbax_safetensors.planning.boxes import (
    Box,
    bounding_box,
    box_size,
    byte_runs,
    full_box,
    intersect,
)

GAP = -1  # Piece.target of bytes read only because they lie between two needed runs


@dataclasses.dataclass(frozen=True)
class Region:
    """A box read into one buffer, and the (distinct) device boxes cut from it."""

    box: Box
    members: tuple[Box, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of a ranged read: ``length`` bytes for ``target`` at ``offset``."""

    target: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class ReadOp:
    """One ranged read of ``length`` bytes at file ``offset``, scattered into pieces."""

    offset: int
    length: int
    pieces: tuple[Piece, ...]

    @property
    def needed(self) -> int:
        return sum(p.length for p in self.pieces if p.target != GAP)


@dataclasses.dataclass(frozen=True)
class Runs:
    """Byte runs as parallel arrays (a strided shard can have millions)."""

    offsets: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    target_offsets: np.ndarray

    @staticmethod
    def concatenate(parts: Sequence[Runs]) -> Runs:
        if not parts:
            empty = np.zeros(0, np.int64)
            return Runs(empty, empty, empty, empty)
        return Runs(*(np.concatenate([getattr(p, f.name) for p in parts])
                      for f in dataclasses.fields(Runs)))


def plan_regions(shape: Sequence[int], boxes: Sequence[Box], *, whole_tensor: bool = False) -> list[Region]:
    """Regions covering ``boxes``; ``whole_tensor`` for dtypes packed below a byte."""
    distinct = list(dict.fromkeys(boxes))
    if not distinct:
        return []
    if whole_tensor:
        return [Region(full_box(shape), tuple(distinct))]
    disjoint = all(
        intersect(a, b) is None for i, a in enumerate(distinct) for b in distinct[i + 1:])
    outer = bounding_box(distinct)
    if disjoint and sum(box_size(b) for b in distinct) == box_size(outer):
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
    if region.members == (region.box,) or all(
            len(byte_runs(m, shape, itemsize)[0]) <= 1 for m in region.members):
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
    held = sum(
        sum(box_size(b) for b in dict.fromkeys(boxes)) for boxes in boxes_by_process.values())
    return held / total


def read_once_boxes(nbytes: int, parts: int) -> list[Box]:
    """``parts`` consecutive byte ranges of equal size (the last ones may be short or empty)."""
    chunk = -(-nbytes // parts)
    return [((min(k * chunk, nbytes), min((k + 1) * chunk, nbytes)),) for k in range(parts)]


def tensor_runs(
    region: Region, shape: Sequence[int], itemsize: int, tensor_offset: int, target: int
) -> Runs:
    """The runs of one region, landing back to back in buffer ``target``."""
    offsets, run_length = byte_runs(region.box, shape, itemsize)
    count = len(offsets)
    return Runs(
        offsets + tensor_offset,
        np.full(count, run_length, np.int64),
        np.full(count, target, np.int64),
        np.arange(count, dtype=np.int64) * run_length,
    )


def coalesce(
    runs: Runs, *, max_gap: int, max_overread: float, chunk_bytes: int
) -> list[ReadOp]:
    """Ranged reads that deliver every run, under the over-read and chunk bounds."""
    if max_overread < 1.0:
        raise ValueError(f"max_overread must be >= 1.0, got {max_overread}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    order = np.argsort(runs.offsets, kind="stable")
    offsets, lengths = runs.offsets[order], runs.lengths[order]
    targets, target_offsets = runs.targets[order], runs.target_offsets[order]
    nonempty = lengths > 0
    offsets, lengths = offsets[nonempty], lengths[nonempty]
    targets, target_offsets = targets[nonempty], target_offsets[nonempty]
    if len(offsets) == 0:
        return []
    # Vectorised first pass: runs that continue each other in the file *and*
    # in their buffer become one piece (a shard's rows, when it holds full rows).
    continues = np.zeros(len(offsets), bool)
    continues[1:] = (
        (offsets[1:] == offsets[:-1] + lengths[:-1])
        & (targets[1:] == targets[:-1])
        & (target_offsets[1:] == target_offsets[:-1] + lengths[:-1]))
    starts = np.flatnonzero(~continues)
    piece_offsets = offsets[starts]
    piece_lengths = np.add.reduceat(lengths, starts)
    piece_targets, piece_target_offsets = targets[starts], target_offsets[starts]

    ops: list[ReadOp] = []
    pieces: list[Piece] = []
    op_start = op_end = needed = 0
    for i in range(len(starts)):
        offset, length = int(piece_offsets[i]), int(piece_lengths[i])
        piece = Piece(int(piece_targets[i]), int(piece_target_offsets[i]), length)
        if pieces:
            gap = offset - op_end
            if 0 <= gap <= max_gap and (offset + length - op_start) <= max_overread * (needed + length):
                if gap:
                    pieces.append(Piece(GAP, 0, gap))
                pieces.append(piece)
                op_end, needed = offset + length, needed + length
                continue
            ops.extend(_split(ReadOp(op_start, op_end - op_start, tuple(pieces)), chunk_bytes))
        pieces, op_start, op_end, needed = [piece], offset, offset + length, length
    ops.extend(_split(ReadOp(op_start, op_end - op_start, tuple(pieces)), chunk_bytes))
    return ops


def _split(op: ReadOp, chunk_bytes: int) -> list[ReadOp]:
    """Cuts a read into chunks of at most ``chunk_bytes``, splitting pieces as needed."""
    if op.length <= chunk_bytes:
        return [op]
    chunks: list[ReadOp] = []
    current: list[Piece] = []
    chunk_start = position = op.offset
    for piece in op.pieces:
        done = 0
        while done < piece.length:
            room = chunk_bytes - (position - chunk_start)
            take = min(room, piece.length - done)
            current.append(Piece(piece.target, piece.offset + done if piece.target != GAP else 0, take))
            done += take
            position += take
            if position - chunk_start == chunk_bytes:
                chunks.append(ReadOp(chunk_start, chunk_bytes, tuple(current)))
                current, chunk_start = [], position
    if current:
        chunks.append(ReadOp(chunk_start, position - chunk_start, tuple(current)))
    return chunks
