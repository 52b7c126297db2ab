"""crc32c checksums of a file's tensors in fixed-size blocks: compute, combine, store, check.

Safetensors has no checksums, so ours live where every other reader ignores
them: two string entries of the file's ``__metadata__``, under keys named for
this package so that no other tool's metadata is taken for them::

    "orbax_safetensors.crc32c_block_bytes": "262144"
    "orbax_safetensors.crc32c": base64 of one big-endian uint32 per block

Blocks are cut per tensor: each tensor's bytes are split into blocks of
``crc32c_block_bytes`` from its own first byte (the last block of a tensor is
shorter), and the blocks of all tensors follow each other in data-offset
order. Per tensor, not per file, so a damaged byte fails exactly the loads
that read its tensor, and a reader of a few rows of one tensor reads (and
checks) at most one block beyond each end of what it needs.

Earlier versions wrote the same two entries under the bare keys ``crc32c`` and
``crc32c_block_bytes``, which other tools use too (a single hex CRC of the
file, say). Files that store no namespaced entries are read by the old keys
only if both are there and parse as ours; otherwise the metadata is someone
else's and the file loads unchecked. The namespaced entries are ours alone:
malformed, they are an error naming the file and the key.

The block size is a trade between three costs, measured on this project's
2-core VM (SSE4.2): hashing speed (64 KiB blocks 10.0 GB/s, 256 KiB 11.3,
1 MiB 12.3, with ``google-crc32c``), the checksum text every header carries
(per GB of tensors: 87, 22, 5.5 KB) and the over-read of a partial read
(< 2 blocks per contiguous run: a process of a 64-way FSDP load reads
512 KiB of each 32 MiB projection, which is whole 256 KiB blocks but half of
a 1 MiB one). 256 KiB is where none of the three dominates.

CRCs of adjacent byte ranges combine without the bytes (``combine``, zlib's
``crc32_combine`` for the Castagnoli polynomial): a block written by two
processes, or read by two requests, is checked from the pieces' CRCs.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format.header import TensorInfo

BLOCK_BYTES = 256 << 10
BLOCKS_KEY = "orbax_safetensors.crc32c"
BLOCK_SIZE_KEY = "orbax_safetensors.crc32c_block_bytes"
LEGACY_BLOCKS_KEY = "crc32c"  # what versions before the namespace wrote, still read
LEGACY_BLOCK_SIZE_KEY = "crc32c_block_bytes"
# A save's own metadata may not use these. The legacy keys stay reserved: earlier versions of
# this package, still reading checkpoints, take them for their checksums and refuse a file
# whose values are anything else.
RESERVED_KEYS = (BLOCKS_KEY, BLOCK_SIZE_KEY, LEGACY_BLOCKS_KEY, LEGACY_BLOCK_SIZE_KEY)
_MAX_BLOCK_BYTES = 1 << 40
_BLOCK_SIZE = re.compile(r"[1-9][0-9]{0,12}")  # ASCII only: str.isdigit() also takes "²", "٣"

_POLY = 0x82F63B78  # Castagnoli, reflected


def _hasher() -> tuple[str, Callable[..., int]]:
    """The crc32c function this install hashes with, and its package's name.

    ``google-crc32c`` (Apache-2.0, a dependency) holds the GIL while it hashes
    anything shorter than 1 MiB, so threads hashing 256 KiB blocks take turns.
    The ``crc32c`` package (LGPL, the ``crc32c`` extra) releases it, so the
    read and write threads hash in parallel and alongside their I/O: it is
    used where installed. Both hash with the CPU's crc32c instructions.
    """
    try:
        import crc32c as package
    except ImportError:
        import google_crc32c

        def extend(data: memoryview | bytes | np.ndarray, crc: int = 0) -> int:
            # It takes bytes and numpy arrays as they are, other buffers (memoryviews)
            # through a numpy view of the same memory: no copy.
            return google_crc32c.extend(crc, data if isinstance(data, (bytes, np.ndarray))
                                        else np.frombuffer(data, np.uint8))
        return "google-crc32c", extend
    return "crc32c", package.crc32c


HASHER, _extend = _hasher()


def crc32c(data: memoryview | bytes | np.ndarray, crc: int = 0) -> int:
    """``crc`` extended by ``data`` (a contiguous buffer), by ``HASHER``'s package."""
    return _extend(data, crc)


def _multiply(a: int, b: int) -> int:
    """a × b modulo the polynomial, both reflected (zlib's ``multmodp``)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multiply(p, p)
    return table


_X2N = _powers()


def combine(crc1: int, crc2: int, length2: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    return _multiply(_shift(length2), crc1) ^ crc2


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> int:
    """x^(8 × length) modulo the polynomial: what appending ``length`` bytes multiplies a CRC
    by. Cached: a file's blocks have a few lengths, mostly one."""
    p, k, n = 1 << 31, 3, length  # x^0; a byte is x^8 = x^(2^3)
    while n:
        if n & 1:
            p = _multiply(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


_TABLE_FROM = 64  # pieces of one length that pay for a table (its 32 multiplications and 1024 XORs)


@functools.lru_cache(maxsize=64)
def _shift_table(length: int) -> tuple[tuple[int, ...], ...]:
    """Multiplication by ``_shift(length)`` as four tables, one per byte of the other factor:
    the product is linear in it, so it is the XOR of the products of its bytes."""
    shift = _shift(length)
    images = [_multiply(shift, 1 << bit) for bit in range(32)]
    tables = []
    for byte in range(4):
        table = [0] * 256
        for j in range(1, 256):
            table[j] = table[j & (j - 1)] ^ images[8 * byte + (j & -j).bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def combine_all(crcs: np.ndarray, lengths: np.ndarray, crc: int = 0) -> int:
    """``crc`` extended by consecutive pieces, from each one's crc32c and length (``combine``
    in turn). A length that recurs (a file's blocks are mostly full, a model's tensors come in a
    few shapes) multiplies by table lookups instead of bit by bit: 100 000 blocks in a
    tenth of a second rather than in seconds."""
    values, counts = np.unique(lengths, return_counts=True)
    tables = {n: _shift_table(n) for n in values[counts >= _TABLE_FROM].tolist()}
    for value, length in zip(np.asarray(crcs).tolist(), np.asarray(lengths).tolist()):
        table = tables.get(length)
        if table is None:
            crc = _multiply(_shift(length), crc) ^ value
        else:
            low, second, third, high = table
            crc = low[crc & 255] ^ second[(crc >> 8) & 255] ^ third[(crc >> 16) & 255] ^ high[crc >> 24] ^ value
    return crc


@dataclasses.dataclass(frozen=True)
class Piece:
    """The crc32c of bytes ``[start, start + length)`` (file offsets) inside block ``block``."""

    block: int
    start: int
    length: int
    crc: int


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Pieces as parallel int64 arrays (piece ``k``: ``blocks[k]``, ``starts[k]``,
    ``lengths[k]``, ``crcs[k]``); iterating gives ``Piece``s. Arrays rather than objects: a
    read of 100 000 tiny tensors delivers a piece per tensor."""

    blocks: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    crcs: np.ndarray

    @staticmethod
    def of(pieces: Iterable[Piece]) -> Pieces:
        rows = [(p.block, p.start, p.length, p.crc) for p in pieces]
        return Pieces(*np.array(rows, np.int64).reshape(len(rows), 4).T)

    @staticmethod
    def concatenate(parts: Sequence[Pieces]) -> Pieces:
        if not parts:
            return Pieces.of(())
        return Pieces(*(np.concatenate([getattr(p, f.name) for p in parts])
                        for f in dataclasses.fields(Pieces)))

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Piece]:
        return map(Piece, self.blocks.tolist(), self.starts.tolist(), self.lengths.tolist(),
                   self.crcs.tolist())


def _data_order(tensor: TensorInfo) -> tuple[int, int]:
    return tensor.begin, tensor.end


def _bytes_of(view: memoryview | np.ndarray) -> memoryview:
    """A flat byte view of ``view``'s data."""
    if isinstance(view, np.ndarray):
        return memoryview(view.reshape(-1).view(np.uint8))
    return view if view.format == "B" and view.ndim == 1 else memoryview(view).cast("B")


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """Where a file's checksum blocks lie: per tensor, from its first data byte.

    ``begins``/``ends`` are the tensors' absolute file offsets in data order,
    ``firsts`` the index of each tensor's first block in the file's list.
    """

    block_bytes: int
    names: tuple[str, ...]
    begins: tuple[int, ...]
    ends: tuple[int, ...]
    firsts: tuple[int, ...]
    count: int

    @staticmethod
    def of(tensors: Iterable[TensorInfo], data_start: int, block_bytes: int = BLOCK_BYTES) -> BlockGrid:
        ordered = sorted(tensors, key=_data_order)
        begins = np.fromiter((t.begin for t in ordered), np.int64, len(ordered)) + data_start
        ends = np.fromiter((t.end for t in ordered), np.int64, len(ordered)) + data_start
        counts = -(-(ends - begins) // block_bytes)
        firsts = np.cumsum(counts) - counts
        return BlockGrid(block_bytes, tuple(t.name for t in ordered), tuple(begins.tolist()),
                           tuple(ends.tolist()), tuple(firsts.tolist()), int(counts.sum()))

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``begins``, ``ends`` and ``firsts`` as arrays, for the vectorised questions."""
        return (np.asarray(self.begins, np.int64).reshape(-1), np.asarray(self.ends, np.int64).reshape(-1),
                np.asarray(self.firsts, np.int64).reshape(-1))

    @property
    def nbytes(self) -> int:
        """The bytes the blocks cover: every tensor's."""
        begins, ends, _ = self._arrays
        return int((ends - begins).sum())

    def block(self, index: int) -> tuple[str, int, int]:
        """``(tensor, start, stop)`` of block ``index`` (file offsets)."""
        t = bisect.bisect_right(self.firsts, index) - 1
        while self.begins[t] == self.ends[t]:  # empty tensors own no block
            t += 1
        start = self.begins[t] + (index - self.firsts[t]) * self.block_bytes
        return self.names[t], start, min(start + self.block_bytes, self.ends[t])

    def block_bounds(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` of each of ``blocks`` (file offsets), as ``block`` gives them (the
        last tensor whose first block is at most the index is never an empty one)."""
        begins, ends, firsts = self._arrays
        t = np.searchsorted(firsts, blocks, side="right") - 1
        starts = begins[t] + (blocks - firsts[t]) * self.block_bytes
        return starts, np.minimum(starts + self.block_bytes, ends[t])

    def pieces(self, offset: int, views: Sequence[memoryview | np.ndarray]) -> Pieces:
        """The CRCs of the bytes ``views`` hold back to back from file ``offset``, one piece per
        block they touch (bytes outside every tensor, a header, are skipped).

        Where views and blocks cut each other is found with numpy; Python only hashes each
        part, extending the crc of a block a view boundary cut: a read of many tiny
        tensors costs a crc32c call per tensor, not a walk through the grid.
        """
        # Hashed as they are: a byte view of each costs more than hashing a small tensor.
        data = [view if type(view) is memoryview or type(view) is np.ndarray and view.flags.c_contiguous
                else _bytes_of(view) for view in views]
        lengths = np.fromiter((view.nbytes for view in data), np.int64, len(data))
        view_starts = offset + np.cumsum(lengths) - lengths
        end = offset + int(lengths.sum())
        blocks, low, high = self._spans(offset, end)
        if not len(blocks):
            return Pieces.of(())
        # The elementary parts between consecutive cuts each lie in one view and one block
        # (or outside every block).
        cuts = np.sort(np.concatenate([view_starts, [end], low, high]))
        cuts = cuts[np.append(True, cuts[1:] != cuts[:-1])]
        starts, stops = cuts[:-1], cuts[1:]
        span = np.searchsorted(low, starts, side="right") - 1
        inside = (span >= 0) & (stops <= high[np.maximum(span, 0)])
        starts, stops, span = starts[inside], stops[inside], span[inside]
        view = np.searchsorted(view_starts, starts, side="right") - 1
        within = starts - view_starts[view]
        # Only parts that are not a whole view are sliced (a slice costs more than 64 bytes' hash),
        # out of one byte view of each view cut (a read of many tensors into one buffer: one
        # view, a part per block).
        cut = (within > 0) | (stops - starts < lengths[view])
        crcs = [0] * len(blocks)
        flat: dict[int, memoryview] = {}
        for k, v, part, a, b in zip(span.tolist(), view.tolist(), cut.tolist(), within.tolist(),
                                    (stops - starts + within).tolist()):
            if part:
                whole = flat.get(v)
                if whole is None:
                    whole = flat[v] = _bytes_of(data[v])
                crcs[k] = crc32c(whole[a:b], crcs[k])
            else:
                crcs[k] = crc32c(data[v], crcs[k])
        return Pieces(blocks, low, high - low, np.array(crcs, np.int64))

    def _spans(self, offset: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The blocks that bytes ``[offset, end)`` touch, with the part of each inside them."""
        begins, ends, firsts = self._arrays
        first_tensor = np.searchsorted(ends, offset, side="right")
        last_tensor = np.searchsorted(begins, end, side="left")
        begins, ends, firsts = (a[first_tensor:last_tensor] for a in (begins, ends, firsts))
        low, high = np.maximum(begins, offset), np.minimum(ends, end)
        first = (low - begins) // self.block_bytes
        count = np.where(low < high, (high - 1 - begins) // self.block_bytes - first + 1, 0)
        tensor = np.repeat(np.arange(len(begins)), count)
        within = first[tensor] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        block_start = begins[tensor] + within * self.block_bytes
        return (firsts[tensor] + within, np.maximum(low[tensor], block_start),
                np.minimum(high[tensor], block_start + self.block_bytes))

    def cover(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[low, high)`` of the whole blocks holding each run ``[offset, offset + length)``
        (a run may span tensors; an end outside every tensor, or an empty run, stays put)."""
        stops = offsets + lengths
        if not self.begins:
            return offsets, stops
        begins, ends, _ = self._arrays
        block = self.block_bytes
        first = np.maximum(np.searchsorted(begins, offsets, side="right") - 1, 0)
        last = np.maximum(np.searchsorted(begins, stops - 1, side="right") - 1, 0)
        low_inside = (lengths > 0) & (begins[first] <= offsets) & (offsets < ends[first])
        high_inside = (lengths > 0) & (begins[last] < stops) & (stops <= ends[last])
        low = np.where(low_inside, begins[first] + (offsets - begins[first]) // block * block, offsets)
        high = np.where(high_inside, np.minimum(begins[last] + -(-(stops - begins[last]) // block) * block,
                                                ends[last]), stops)
        return low, high


@dataclasses.dataclass(frozen=True)
class FileChecksums:
    """A file's block grid and the crc32c of every block."""

    grid: BlockGrid
    crcs: np.ndarray  # uint32, one per block

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries that store these checksums (fixed length: a plan's
        header holds zeros there until the data is written, then the same bytes change)."""
        return _entries(self.grid.block_bytes, self.crcs)

    @staticmethod
    def zeros(grid: BlockGrid) -> FileChecksums:
        return FileChecksums(grid, np.zeros(grid.count, np.uint32))

    @staticmethod
    def placeholder(count: int, block_bytes: int = BLOCK_BYTES) -> dict[str, str]:
        """``metadata()`` of ``count`` zero checksums, known before the grid: what a planned
        header holds until its data is written."""
        return _entries(block_bytes, np.zeros(count, np.uint32))

    @staticmethod
    def of_metadata(metadata: Mapping[str, str] | None, tensors: Iterable[TensorInfo], data_start: int,
                    *, file: str) -> FileChecksums | None:
        """The checksums a file's ``__metadata__`` stores, ``None`` if it stores none of ours.

        Malformed namespaced entries are an error naming the file and the key (never a
        silently unchecked load); malformed legacy ones are another tool's metadata."""
        metadata = metadata or {}
        if BLOCKS_KEY in metadata or BLOCK_SIZE_KEY in metadata:
            stored = _stored(metadata, BLOCK_SIZE_KEY, BLOCKS_KEY, tensors, data_start)
            if isinstance(stored, str):
                raise SafetensorsError(f"{stored}; ost.LoadOptions(verify_checksums=False) loads "
                                       "the file unchecked", file=file)
            return stored
        if LEGACY_BLOCKS_KEY in metadata and LEGACY_BLOCK_SIZE_KEY in metadata:
            stored = _stored(metadata, LEGACY_BLOCK_SIZE_KEY, LEGACY_BLOCKS_KEY, tensors, data_start)
            return None if isinstance(stored, str) else stored
        return None

    def data_crc(self) -> int:
        """The crc32c of the whole data buffer, from the blocks'."""
        starts, stops = self.grid.block_bounds(np.arange(self.grid.count))
        return combine_all(self.crcs, stops - starts)

    def file_crc(self, header: bytes) -> int:
        """The crc32c of the whole file (what GCS reports for the object), from its header
        bytes (length prefix included) and the blocks'."""
        return combine(crc32c(header), self.data_crc(), self.grid.nbytes)


def _entries(block_bytes: int, crcs: np.ndarray) -> dict[str, str]:
    return {BLOCK_SIZE_KEY: str(block_bytes),
            BLOCKS_KEY: base64.b64encode(crcs.astype(">u4").tobytes()).decode("ascii")}


def _stored(metadata: Mapping[str, str], size_key: str, blocks_key: str, tensors: Iterable[TensorInfo],
            data_start: int) -> FileChecksums | str:
    """The checksums under ``size_key`` and ``blocks_key``, or what is wrong with them."""
    size, blocks = metadata.get(size_key), metadata.get(blocks_key)
    if size is None or blocks is None:
        has, lacks = (size_key, blocks_key) if blocks is None else (blocks_key, size_key)
        return f"__metadata__ has {has!r} but no {lacks!r}"
    if _BLOCK_SIZE.fullmatch(size) is None or int(size) > _MAX_BLOCK_BYTES:
        return (f"__metadata__[{size_key!r}] = {size[:40]!r} is not a block size (a number of "
                f"bytes from 1 to 2**40 in ASCII digits)")
    grid = BlockGrid.of(tensors, data_start, int(size))
    try:
        raw = base64.b64decode(blocks.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return f"__metadata__[{blocks_key!r}] is not base64"
    if len(raw) != 4 * grid.count:
        return (f"__metadata__[{blocks_key!r}] holds {len(raw)} bytes, not the 4 of each of the "
                f"{grid.count} block checksums of this file's tensors")
    return FileChecksums(grid, np.frombuffer(raw, ">u4").astype(np.uint32))


class Tally:
    """Pieces of blocks as they arrive, in any order, from any thread: a block is complete
    once pieces tile it, and its crc is then combined from theirs.

    Two reads may cover a block twice (overlapping pieces): any chain of pieces from the
    block's start to its end will do, and completes the block once; pieces it did not use
    stay for another chain (a second read's, cut elsewhere, may have started arriving).
    """

    def __init__(self, grid: BlockGrid):
        self.grid = grid
        self._open: dict[int, dict[int, list[Piece]]] = {}

    def add(self, pieces: Pieces | Iterable[Piece]) -> np.ndarray:
        """``(block, crc)`` rows (int64) of every block these pieces complete; a piece that is
        a whole block completes it at once (found for all of them with numpy)."""
        if not isinstance(pieces, Pieces):
            pieces = Pieces.of(pieces)
        starts, stops = self.grid.block_bounds(pieces.blocks)
        whole = (pieces.starts == starts) & (pieces.lengths == stops - starts)
        done = [(pieces.blocks[whole], pieces.crcs[whole])]
        for k in np.flatnonzero(~whole).tolist():
            piece = Piece(int(pieces.blocks[k]), int(pieces.starts[k]), int(pieces.lengths[k]),
                          int(pieces.crcs[k]))
            held = self._open.setdefault(piece.block, {})
            held.setdefault(piece.start, []).append(piece)
            chain = _chain(held, int(starts[k]), int(stops[k]))
            if chain is not None:
                crc, used = chain
                done.append((np.array([piece.block]), np.array([crc])))
                for p in used:
                    held[p.start].remove(p)
                    if not held[p.start]:
                        del held[p.start]
                if not held:
                    del self._open[piece.block]
        return np.stack([np.concatenate([b for b, _ in done]).astype(np.int64),
                         np.concatenate([c for _, c in done]).astype(np.int64)], axis=1)

    @property
    def incomplete(self) -> list[int]:
        return sorted(self._open)

    def partial(self) -> list[Piece]:
        """The pieces of the blocks not complete yet (to hand to whoever holds the rest)."""
        return [p for held in self._open.values() for pieces in held.values() for p in pieces]


def _chain(held: Mapping[int, list[Piece]], start: int, stop: int) -> tuple[int, list[Piece]] | None:
    """The crc of ``[start, stop)`` and the pieces that tile it, if some chain of them does."""
    stack: list[tuple[int, int, list[Piece]]] = [(start, 0, [])]
    seen = set()
    while stack:
        position, crc, used = stack.pop()
        if position == stop:
            return crc, used
        for piece in held.get(position, ()):
            end = piece.start + piece.length
            if end <= stop and (end, piece) not in seen:
                seen.add((end, piece))
                stack.append((end, combine(crc, piece.crc, piece.length), used + [piece]))
    return None
