"""What a save writes where, decided before the first byte moves: the write plan.

Which tensor goes to which file at which offset (the hf layout, or one
process's files of the distributed layout), and which byte ranges of those
files this process owns. Every process of a multi-process save must reach the
same file plan without talking to the others, so it depends only on names,
dtypes and shapes (in the caller's order) and the options, never on devices
or timing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring

import numpy as np

from orbax_safetensors.errors import ProtocolError
from orbax_safetensors.format import DType, TensorInfo, serialize_header, write_order
from orbax_safetensors.format.checksums import BLOCK_BYTES, BLOCKS_KEY, BlockGrid, FileChecksums
from orbax_safetensors.index import (
    dcp_metadata,
    distributed_file_name,
    natural_key,
    pack_shards,
    serialize_index,
    shard_file_name,
)
from orbax_safetensors.index.hf_index import INDEX_NAME, SINGLE_FILE_NAME
from orbax_safetensors.planning.boxes import Box, byte_runs, full_box
from orbax_safetensors.planning.transfers import Runs, Transfers, WholeRuns, coalesce

HF_METADATA = {"format": "pt"}  # transformers refuses files without it


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclasses.dataclass(frozen=True)
class FilePlan:
    """One output file: the bytes before its data and where each tensor goes.

    A ``checksummed`` file's header holds zeros where its block checksums go
    (``format.checksums``): they are known only once the data is written, and
    ``header_with`` then gives the same-length header that replaces it.
    """

    name: str
    header: bytes
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    checksummed: bool = False

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def grid(self) -> BlockGrid:
        """Where the checksum blocks of this file lie."""
        return BlockGrid.of(self.tensors, self.data_start)

    def header_with(self, crcs: np.ndarray) -> bytes:
        """The header that stores ``crcs`` (one per block), as long as the planned one: the
        planned header with the checksums' text in place of the zeros' (the one thing that
        differs; serialising 100 000 entries again took longer than writing them).

        The zeros' text appears once: as the value of a key no tensor (whose values are
        objects) and no caller's metadata (reserved) can have, and JSON escapes the quotes
        of any string that holds it."""
        planned = _json_item(BLOCKS_KEY, FileChecksums.zeros(self.grid).metadata()[BLOCKS_KEY])
        final = _json_item(BLOCKS_KEY, FileChecksums(self.grid, crcs).metadata()[BLOCKS_KEY])
        at = self.header.find(planned)
        if len(final) != len(planned) or at < 0 or self.header.find(planned, at + 1) >= 0:
            raise ProtocolError(f"{self.name}: the planned header does not hold its checksums once")
        return self.header[:at] + final + self.header[at + len(planned):]


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """The files of a save and what its index lists (``index_name`` is ``None`` when one
    file holds everything); the index is made last, once the files' checksums are known."""

    files: tuple[FilePlan, ...]
    index_name: str | None = None
    weight_map: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def index(self, file_crcs: Mapping[str, int] | None = None) -> tuple[str, bytes] | None:
        """``(name, bytes)`` of the index, put in place last by the commit; with each
        file's whole-object crc32c (``file_crcs``) in its metadata."""
        if self.index_name is None:
            return None
        total = sum(t.nbytes for f in self.files for t in f.tensors)
        return self.index_name, serialize_index(self.weight_map, total, file_crcs)


def plan_file(name: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str],
              *, checksums: bool = False) -> FilePlan:
    """One file with ``specs`` ordered as the Rust crate orders them.

    By the crate's dtype order (``format.write_order``: widest first), then by
    name: every tensor starts at an offset aligned to its own width, which lets
    readers view the data without copying, and a file of ours is byte for byte
    the crate's (F32 before I32, F8_E4M3 scales before U8 codes).
    """
    ordered = sorted(specs, key=lambda s: (write_order(s.dtype), s.name))
    entries = [(s.name, s.dtype, s.shape) for s in ordered]
    planned = dict(metadata)
    if checksums:  # zeros where the block checksums go: as many as the tensors have blocks
        try:
            planned |= FileChecksums.placeholder(sum(-(-s.nbytes // BLOCK_BYTES) for s in ordered))
        except ValueError:  # a tensor of no whole number of bytes: serialize_header names it
            pass
    header, infos = serialize_header(entries, planned)
    return FilePlan(name, header, tuple(infos.values()), dict(metadata), checksums)


def _json_item(key: str, value: str) -> bytes:
    """``"key":"value"`` as ``serialize_header`` writes it."""
    return json.dumps({key: value}, separators=(",", ":"), ensure_ascii=False)[1:-1].encode("utf-8")


# What a tensor's header entry holds besides its name, dtype code, shape and offsets:
# "NAME":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]} and the comma after it.
_ENTRY_SYNTAX = len(':{"dtype":"","shape":[],"data_offsets":[,]},')
_HEADER_SLACK = 7 + 4  # the header's padding to 8 bytes; base64's rounding of the checksums


def _stored_sizes(specs: Sequence[TensorSpec], max_shard_size: int, checksums: bool,
                  extra: Sequence[int] | None = None) -> list[tuple[str, int]]:
    """Each tensor's bytes plus at least what it adds to its file's header, to pack by: its
    entry (offsets as long as any inside the limit) and, with ``checksums``, its blocks'
    share of the base64 checksum text (4 bytes a block: 16/3 characters); ``extra``: more
    header bytes per tensor (the distributed layout's slice offsets)."""
    offsets = 2 * len(str(max_shard_size))
    kinds: dict[tuple[str, tuple[int, ...]], int] = {}  # the bytes besides the name's, by code and shape
    sizes = []
    for i, spec in enumerate(specs):
        key = (spec.dtype.code, spec.shape)
        rest = kinds.get(key)
        if rest is None:
            nbytes = spec.nbytes
            rest = nbytes + _ENTRY_SYNTAX + len(spec.dtype.code) + len(",".join(map(str, spec.shape))) + offsets
            if checksums:
                rest += -(-16 * -(-nbytes // BLOCK_BYTES) // 3)
            kinds[key] = rest
        sizes.append((spec.name, len(encode_basestring(spec.name).encode()) + rest + (extra[i] if extra else 0)))
    return sizes


def _file_overhead(metadata: Mapping[str, str], checksums: bool) -> int:
    """The header bytes of a file of ``metadata`` without tensors, at most."""
    return len(plan_file("", [], metadata, checksums=checksums).header) + _HEADER_SLACK


def plan_hf_checkpoint(
    specs: Sequence[TensorSpec],
    *,
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
    checksums: bool = False,
) -> WritePlan:
    """Shards ``specs`` like transformers: one ``model.safetensors`` or indexed shards, filled
    in the names' natural order (``layers.2`` before ``layers.10``). ``max_shard_size`` in
    bytes: the options a call is given parse sizes, once, where it is made."""
    header_metadata = {**HF_METADATA, **(metadata or {})}
    by_name = {s.name: s for s in specs}
    overhead = _file_overhead(header_metadata, checksums)
    sizes = dict(_stored_sizes(specs, max_shard_size, checksums))
    if sum(sizes.values()) <= max_shard_size - overhead:
        groups = [list(sizes)]  # all in one file, in any order: no natural sort (100 000 names: 1 s)
    else:
        ordered = sorted(specs, key=lambda s: natural_key(s.name))
        groups = pack_shards([(s.name, sizes[s.name]) for s in ordered], max_shard_size,
                             file_overhead=overhead)
    if len(groups) == 1:
        return WritePlan((plan_file(SINGLE_FILE_NAME, specs, header_metadata, checksums=checksums),))
    files = tuple(
        plan_file(shard_file_name(i, len(groups)), [by_name[n] for n in group], header_metadata,
                  checksums=checksums)
        for i, group in enumerate(groups)
    )
    return WritePlan(files, INDEX_NAME, {t.name: f.name for f in files for t in f.tensors})


def plan_single_file(
    name: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None,
    *, checksums: bool = False,
) -> WritePlan:
    """Everything in one named file, whatever its size (the caller asked for it)."""
    return WritePlan((plan_file(name, specs, {**HF_METADATA, **(metadata or {})}, checksums=checksums),))


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """A slice one process saves in the distributed layout: a box of a tensor."""

    name: str
    dtype: DType
    box: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


def plan_distributed_files(
    process: int,
    slices: Sequence[SliceSpec],
    *,
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
    checksums: bool = False,
) -> tuple[tuple[FilePlan, tuple[SliceSpec, ...]], ...]:
    """One process's files of the distributed layout, named and annotated like torch DCP.

    Returns each file's plan with the slices it holds.

    A file cannot hold a name twice, so the k-th slice a process has of each
    tensor goes into its k-th group of files; within a group, slices are
    packed under ``max_shard_size`` like the hf layout.
    """
    slots: list[list[SliceSpec]] = []
    seen: dict[str, int] = collections.Counter()
    for spec in slices:
        slot = seen[spec.name]
        seen[spec.name] += 1
        while len(slots) <= slot:
            slots.append([])
        slots[slot].append(spec)
    # A slice's offsets are repeated in its file's DCP_SHARDING_INFO: JSON inside a string.
    overhead = _file_overhead({**HF_METADATA, **(metadata or {}), **dcp_metadata({})}, checksums)
    groups = [
        [by_name[n] for n in group]
        for slot in slots
        for by_name in [{s.name: s for s in slot}]
        for group in pack_shards(_stored_sizes(
            [TensorSpec(s.name, s.dtype, s.shape) for s in slot], max_shard_size, checksums,
            [len(encode_basestring(json.dumps({s.name: {"saved_offsets": [a for a, _ in s.box]}})))
             for s in slot]), max_shard_size, file_overhead=overhead)
        if group
    ]
    files = []
    for i, group in enumerate(groups):
        header_metadata = {
            **HF_METADATA, **(metadata or {}),
            **dcp_metadata({s.name: [a for a, _ in s.box] for s in group})}
        specs = [TensorSpec(s.name, s.dtype, s.shape) for s in group]
        files.append((plan_file(distributed_file_name(process, i, len(groups)), specs, header_metadata,
                                checksums=checksums), tuple(group)))
    return tuple(files)


def owned_ranges(files: Sequence[FilePlan], boxes: Sequence[tuple[str, Box]],
                 chunk_bytes: int) -> list[tuple[str, Transfers]]:
    """Where the shards a process writes land: contiguous byte ranges of each file, cut at
    ``chunk_bytes``, each with the segments that fill it in order (``targets`` index
    ``boxes``, ``target_offsets`` are byte offsets within that shard's row-major bytes).

    ``boxes`` are ``(tensor name, box)`` of the shards, in the tensor's global coordinates;
    a packed dtype (sub-byte values) can only be written whole. The ranges of a file are
    one ``Transfers`` (arrays): a strided shard owns a range per row, millions of them
    for a process holding a column block of every layer.
    """
    location = {t.name: (f.name, f.data_start, t) for f in files for t in f.tensors}
    by_file: dict[str, tuple[list[Runs], WholeRuns]] = {}  # in the order files first appear
    for index, (name, box) in enumerate(boxes):
        file, data_start, info = location[name]
        if file not in by_file:
            by_file[file] = ([], WholeRuns())
        runs, whole = by_file[file]
        start = data_start + info.begin
        if info.dtype.is_packed or box == full_box(info.shape):  # the whole tensor: one run
            whole.add(start, info.end - info.begin, index)
            continue
        offsets, length = byte_runs(box, info.shape, info.dtype.bits // 8)
        runs.append(Runs.of(offsets + start, length, index))
    return [(file_name, coalesce(Runs.concatenate([*runs, whole.runs()]), max_gap=0, max_overread=1.0,
                                 chunk_bytes=chunk_bytes))
            for file_name, (runs, whole) in by_file.items()]


HEADER = -2  # Segment.target of a file's header bytes, which process 0 writes


@dataclasses.dataclass(frozen=True)
class Upload:
    """One object a process uploads before the merge: ranges of one file, back to back.

    ``ranges`` are requests (``offset`` in the file, segments); the object holds
    their bytes in order, so range k sits at the sum of the earlier lengths.
    ``key`` (the first range's file offset) names the object.
    """

    file: str
    key: int
    ranges: Transfers

    @property
    def length(self) -> int:
        return self.ranges.nbytes


def plan_uploads(ranges: Sequence[tuple[str, Transfers]], headers: Sequence[FilePlan] = (), *,
                 max_objects_per_file: int, small_object: int) -> list[Upload]:
    """Objects that carry a process's ranges (and, given ``headers``, those files' headers)
    to an object store, where a server-side merge assembles each file from them.

    A small range is joined to the range right after it (a header and the first
    tensor bytes): one object fewer, and none too small to merge. A process
    owning many small ranges of a file (strided shards) packs them all into one
    object instead, read back in order at the merge.
    """
    by_file: dict[str, list[Transfers]] = collections.defaultdict(list)
    for name, transfers in ranges:
        by_file[name].append(transfers)
    for file in headers:
        by_file[file.name].append(Transfers.single(0, HEADER, len(file.header)))
    uploads = []
    for name, parts in by_file.items():
        transfers = Transfers.concatenate(parts)
        spans = _join_small_neighbours(
            transfers.take(np.argsort(transfers.offsets, kind="stable")), small_object)
        if len(spans) <= max_objects_per_file or spans.nbytes >= len(spans) * small_object:
            uploads += [Upload(name, int(spans.offsets[k]), spans.take(np.array([k])))
                        for k in range(len(spans))]
        elif len(spans):
            uploads.append(Upload(name, int(spans.offsets[0]), spans))
    return uploads


def _join_small_neighbours(transfers: Transfers, small: int) -> Transfers:
    """Each range shorter than ``small`` joined with the range right after it (repeatedly).

    Only ranges that continue each other can join: chunks of one contiguous range and a
    header with the bytes after it, a few per file, so the loop runs over those alone.
    """
    if len(transfers) == 0:
        return transfers
    length = transfers.lengths.copy()  # of the span each range ends so far
    starts = np.ones(len(transfers), bool)
    continued = transfers.offsets[:-1] + transfers.lengths[:-1] == transfers.offsets[1:]
    for i in np.flatnonzero(continued).tolist():
        if length[i] < small:
            starts[i + 1] = False
            length[i + 1] += length[i]
    return transfers.merged(np.flatnonzero(starts))
