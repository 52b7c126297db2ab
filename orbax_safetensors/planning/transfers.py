"""Byte runs and the ranged requests that move them, for reads and writes alike.

A *run* is a contiguous stretch of a file and where it lands in (or comes
from) a caller's buffer. Runs of one file become *transfers*: one ranged
request each, made of *segments* that scatter its bytes into buffers (a
``preadv``/``pwritev`` of views, or one ranged GET sliced up). ``coalesce``
decides which runs share a request: adjacent runs always do; a gap is read
through (and discarded) only when it is at most ``max_gap`` bytes and at most
``max_overread - 1`` times the run after it, so no request reads more than
``max_overread`` times the bytes it delivers. Requests are then cut at
``chunk_bytes`` so one big tensor is moved by parallel requests and no single
buffer outgrows the in-flight budget. A write plan coalesces with no gaps and
no over-read: its transfers are exactly the bytes a process owns.

A read whose file stores block checksums (``format.checksums``) must see every
block it touches whole to check it: requests reach down and up to block
boundaries, and two runs touching one block share a request (the bytes between
them are read), whatever the gap rules say. Blocks are cut per tensor, so this
never reads into another tensor, and adds less than two blocks per run.

A strided shard has a run per row, millions for a large tensor, so runs and
transfers are kept as parallel integer arrays (``Runs``, ``Transfers``) and
computed with vectorised numpy, never one Python object per run: a plan's
memory and time grow with its arrays, not with its interpreter objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.format.checksums import BlockGrid

GAP = -1  # Segment.target of bytes read only because they lie between two needed runs


class Segment(NamedTuple):
    """Part of a transfer: ``length`` bytes of buffer ``target`` from its byte ``offset``."""

    target: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One ranged request of ``length`` bytes at file ``offset``: its segments, in order, as
    parallel arrays (``targets``, ``offsets`` into each target, ``lengths``)."""

    offset: int
    length: int
    targets: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @property
    def segments(self) -> Iterator[Segment]:
        return map(Segment._make, zip(self.targets.tolist(), self.offsets.tolist(),
                                      self.lengths.tolist()))

    @property
    def needed(self) -> int:
        return int(self.lengths[self.targets != GAP].sum())


@dataclasses.dataclass(frozen=True)
class Transfers:
    """Ranged requests on one file as parallel arrays: request ``i`` moves ``lengths[i]``
    bytes at ``offsets[i]``, made of segments ``bounds[i]:bounds[i + 1]`` of ``segments``
    (a ``Runs`` whose ``offsets`` are unused: a segment's place in the file follows from
    the request's offset and the lengths before it).

    ``padding`` counts the bytes the requests read only to complete checksum blocks
    (``coalesce`` with ``blocks``), beyond what they would read without; a write plan's
    requests (which ``take`` and ``merged`` regroup) have none."""

    offsets: np.ndarray
    lengths: np.ndarray
    bounds: np.ndarray
    targets: np.ndarray
    target_offsets: np.ndarray
    segment_lengths: np.ndarray
    padding: int = 0

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Transfer:
        a, b = self.bounds[i], self.bounds[i + 1]
        return Transfer(int(self.offsets[i]), int(self.lengths[i]), self.targets[a:b],
                        self.target_offsets[a:b], self.segment_lengths[a:b])

    def __iter__(self) -> Iterator[Transfer]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        """Bytes the requests move (gaps included)."""
        return int(self.lengths.sum())

    @staticmethod
    def single(offset: int, target: int, length: int) -> Transfers:
        """One request of ``length`` bytes at ``offset``, all of buffer ``target`` from its start."""
        one = np.array([length], np.int64)
        return Transfers(np.array([offset], np.int64), one, np.array([0, 1], np.int64),
                         np.array([target], np.int64), np.zeros(1, np.int64), one)

    @staticmethod
    def concatenate(parts: Sequence[Transfers]) -> Transfers:
        """The requests of ``parts`` one after the other."""
        counts = np.cumsum([0] + [len(p.targets) for p in parts])
        bounds = np.concatenate([p.bounds[:-1] + shift for p, shift in zip(parts, counts)]
                                + [counts[-1:]])
        return Transfers(*(np.concatenate([p.offsets for p in parts]),
                           np.concatenate([p.lengths for p in parts]), bounds),
                         *(np.concatenate([getattr(p, name) for p in parts])
                           for name in ("targets", "target_offsets", "segment_lengths")))

    def take(self, requests: np.ndarray) -> Transfers:
        """Requests ``requests`` (indices), in that order, with their segments."""
        counts = np.diff(self.bounds)[requests]
        starts = self.bounds[:-1][requests]
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        segments = np.repeat(starts, counts) + within
        return Transfers(self.offsets[requests], self.lengths[requests],
                         np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                         self.targets[segments], self.target_offsets[segments],
                         self.segment_lengths[segments])

    def merged(self, starts: np.ndarray) -> Transfers:
        """Requests ``starts[k]`` up to ``starts[k + 1]`` each made one request (they must
        continue each other in the file): the same segments, fewer requests."""
        return Transfers(self.offsets[starts], np.add.reduceat(self.lengths, starts),
                         np.concatenate([self.bounds[starts], self.bounds[-1:]]),
                         self.targets, self.target_offsets, self.segment_lengths)


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

    @staticmethod
    def of(offsets: np.ndarray, length: int, target: int) -> Runs:
        """Runs of ``length`` bytes at ``offsets``, landing back to back in buffer ``target``."""
        count = len(offsets)
        return Runs(np.asarray(offsets, np.int64), np.full(count, length, np.int64),
                    np.full(count, target, np.int64), np.arange(count, dtype=np.int64) * length)


class WholeRuns:
    """Runs that are each all of a buffer (a whole small tensor, a byte range), gathered one
    by one as ints and made one ``Runs`` at the end: a planner adds one per tensor, and four
    arrays per tensor (``Runs.of``) cost more than a tiny tensor's read or write."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.targets: list[int] = []

    def add(self, offset: int, length: int, target: int) -> None:
        """``length`` bytes at file ``offset``, all of buffer ``target`` from its start."""
        self.offsets.append(offset)
        self.lengths.append(length)
        self.targets.append(target)

    def runs(self) -> Runs:
        return Runs(np.array(self.offsets, np.int64), np.array(self.lengths, np.int64),
                    np.array(self.targets, np.int64), np.zeros(len(self.offsets), np.int64))


def coalesce(runs: Runs, *, max_gap: int, max_overread: float, chunk_bytes: int,
             blocks: BlockGrid | None = None) -> Transfers:
    """Ranged requests that deliver every run, under the over-read and chunk bounds; with
    ``blocks`` (the file's checksum blocks), reading every block a run touches whole."""
    if max_overread < 1.0:
        raise ArgumentError(f"max_overread must be >= 1.0, got {max_overread}")
    if chunk_bytes <= 0:
        raise ArgumentError(f"chunk_bytes must be positive, got {chunk_bytes}")
    order = np.argsort(runs.offsets, kind="stable")
    keep = order[runs.lengths[order] > 0]
    offsets, lengths = runs.offsets[keep], runs.lengths[keep]
    targets, target_offsets = runs.targets[keep], runs.target_offsets[keep]
    if len(offsets) == 0:
        empty = np.zeros(0, np.int64)
        return Transfers(empty, empty, np.zeros(1, np.int64), empty, empty, empty)
    # Runs that continue each other in the file *and* in their buffer become one segment
    # (a shard's rows, when it holds full rows).
    continues = np.zeros(len(offsets), bool)
    continues[1:] = (
        (offsets[1:] == offsets[:-1] + lengths[:-1])
        & (targets[1:] == targets[:-1])
        & (target_offsets[1:] == target_offsets[:-1] + lengths[:-1]))
    starts = np.flatnonzero(~continues)
    seg_offsets, seg_lengths = offsets[starts], np.add.reduceat(lengths, starts)
    seg_targets, seg_target_offsets = targets[starts], target_offsets[starts]
    seg_ends = seg_offsets + seg_lengths

    # A segment joins the request of the one before it across a gap it pays for itself.
    gaps = seg_offsets[1:] - seg_ends[:-1]
    joins = (gaps == 0) | ((gaps > 0) & (gaps <= max_gap)
                           & (gaps <= (max_overread - 1.0) * seg_lengths[1:]))
    # Each segment's reach: itself, or the whole blocks it touches.
    low, high, padding = seg_offsets, seg_ends, 0
    if blocks is not None:
        low, high = blocks.cover(seg_offsets, seg_lengths)
        plain = _spanned(seg_offsets, seg_ends, joins)
        joins = joins | ((gaps >= 0) & (low[1:] <= high[:-1]))  # a shared block, or no gap
        padding = _spanned(low, high, joins) - plain
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    last = np.concatenate([first[1:] - 1, [len(seg_offsets) - 1]])
    # Every segment with the GAP segment before it (the gap after the segment before, or the
    # padding down to its first block), and the last of a request with the padding after it.
    before = np.zeros(len(seg_offsets), np.int64)
    before[1:] = np.where(joins, gaps, 0)
    before[first] = seg_offsets[first] - low[first]
    after = np.zeros(len(seg_offsets), np.int64)
    after[last] = high[last] - seg_ends[last]
    position = np.cumsum(1 + (before > 0) + (after > 0)) - 1 - (after > 0)
    count = int(position[-1] + (after[-1] > 0)) + 1
    out_targets = np.full(count, GAP, np.int64)
    out_offsets = np.zeros(count, np.int64)
    out_lengths = np.zeros(count, np.int64)
    out_targets[position] = seg_targets
    out_offsets[position] = seg_target_offsets
    out_lengths[position] = seg_lengths
    out_lengths[position[before > 0] - 1] = before[before > 0]
    out_lengths[position[after > 0] + 1] = after[after > 0]
    request_offsets = low[first]
    request_lengths = high[last] - request_offsets
    bounds = np.concatenate([position[first] - (before[first] > 0), [count]])
    if int(request_lengths.max()) <= chunk_bytes:
        return Transfers(request_offsets, request_lengths, bounds, out_targets, out_offsets,
                         out_lengths, padding)
    return dataclasses.replace(
        _chunked(request_offsets, request_lengths, bounds, out_targets, out_offsets, out_lengths,
                 chunk_bytes), padding=padding)


def _spanned(low: np.ndarray, high: np.ndarray, joins: np.ndarray) -> int:
    """Bytes read by requests from ``low`` of their first segment to ``high`` of their last,
    a segment joining the one before it where ``joins``."""
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    last = np.concatenate([first[1:] - 1, [len(low) - 1]])
    return int((high[last] - low[first]).sum())


def _chunked(request_offsets: np.ndarray, request_lengths: np.ndarray, bounds: np.ndarray,
             targets: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
             chunk_bytes: int) -> Transfers:
    """Requests cut into chunks of at most ``chunk_bytes``, segments split where they cross."""
    request_of = np.repeat(np.arange(len(request_offsets)), np.diff(bounds))
    # Each segment's place in its request, and the chunks it touches.
    within = np.cumsum(lengths) - lengths
    within -= within[bounds[:-1]][request_of]
    first_chunk = within // chunk_bytes
    last_chunk = (within + lengths - 1) // chunk_bytes
    pieces = last_chunk - first_chunk + 1
    segment = np.repeat(np.arange(len(lengths)), pieces)
    chunk = first_chunk[segment] + (np.arange(len(segment)) - np.repeat(np.cumsum(pieces) - pieces, pieces))
    start = np.maximum(within[segment], chunk * chunk_bytes)
    stop = np.minimum(within[segment] + lengths[segment], (chunk + 1) * chunk_bytes)
    new_targets = targets[segment]
    new_offsets = np.where(new_targets == GAP, 0, offsets[segment] + start - within[segment])
    request = request_of[segment]
    starts = np.flatnonzero(np.concatenate(
        [[True], (request[1:] != request[:-1]) | (chunk[1:] != chunk[:-1])]))
    chunk_offsets = request_offsets[request[starts]] + chunk[starts] * chunk_bytes
    chunk_lengths = np.minimum(chunk_bytes, request_lengths[request[starts]] - chunk[starts] * chunk_bytes)
    return Transfers(chunk_offsets, chunk_lengths, np.concatenate([starts, [len(segment)]]),
                     new_targets, new_offsets, stop - start)
