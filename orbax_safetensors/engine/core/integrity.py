"""Checking the bytes reads deliver against the block checksums their files store.

``format.checksums`` says where a file's blocks lie and how CRCs combine; here
reads meet it. Reads arrive from several threads, in any order, cut anywhere
(a chunk boundary may split a block, two reads may cover one block): each read
hashes its own bytes, cut at block boundaries, in the thread that read them
(so hashing overlaps the other threads' I/O), and a per-file ``Tally``, under a
lock, recombines the pieces; a block is checked once pieces tile it. A load
raises the first damaged block (``ChecksumError``); ``verify`` collects them
all and reports each damaged tensor once.

What the files store is parsed from their headers only when a check first
needs it (``StoredChecksums``): a load with ``verify_checksums=False`` reads
none of it, so no metadata, ours malformed or another tool's, keeps a file
from loading.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors.errors import ChecksumError, ProtocolError, SafetensorsError
from orbax_safetensors.format import Header
from orbax_safetensors.format.checksums import BlockGrid, FileChecksums, Tally
from orbax_safetensors.index import decode_crc, encode_crc

_LISTED = 4  # damaged byte ranges a message spells out; the rest are counted


@dataclasses.dataclass(frozen=True)
class Damage:
    """A block whose bytes do not match their stored crc32c: ``[start, stop)`` of ``file``,
    in tensor ``tensor``, whose first byte is at ``begin`` (file offsets)."""

    file: str
    tensor: str
    start: int
    stop: int
    begin: int
    stored: int
    read: int

    def error(self) -> ChecksumError:
        return ChecksumError(damage_message([self]), file=self.file, tensor=self.tensor)


def damage_message(damage: Sequence[Damage]) -> str:
    """What is wrong with damaged blocks of one tensor, in one sentence: their bytes within the
    tensor and the file (adjacent blocks merged), and for a single block both CRCs."""
    ordered = sorted(damage, key=lambda d: d.start)
    ranges: list[list[int]] = []
    for d in ordered:
        if ranges and ranges[-1][1] == d.start:
            ranges[-1][1] = d.stop
        else:
            ranges.append([d.start, d.stop])
    begin = ordered[0].begin
    within = ", ".join(f"[{a - begin}, {b - begin})" for a, b in ranges[:_LISTED])
    offsets = ", ".join(f"[{a}, {b})" for a, b in ranges[:_LISTED])
    more = f", and {len(ranges) - _LISTED} more ranges," if len(ranges) > _LISTED else ""
    crcs = (f" (stored {ordered[0].stored:#010x}, read {ordered[0].read:#010x})"
            if len(ordered) == 1 else "")
    return (f"bytes {within} of the tensor (file offsets {offsets}){more} do not match their "
            f"crc32c{crcs}: the file is damaged or was changed")


class StoredChecksums(Mapping[str, FileChecksums]):
    """The block checksums a checkpoint's files store (a file that stores none is absent),
    parsed from their headers' metadata on first use, and each file's whole crc32c compared
    then with the one its index lists (``listed``): a file copied in from another save of the
    same shapes would otherwise load, mixing two checkpoints. A header's own bytes (``raw``)
    and block checksums give that crc32c without reading any data.

    ``attempt`` runs each file's parse and comparison: a load's raises, ``verify``'s records
    a problem of the file (a file whose checksums do not parse is left out).
    """

    def __init__(self, headers: Mapping[str, Header],
                 attempt: Callable[[Callable[[], Any]], Any],
                 raw: Mapping[str, bytes], listed: Mapping[str, object]):
        self._headers, self._attempt, self._raw, self._listed = headers, attempt, raw, listed
        self._parsed: dict[str, FileChecksums] | None = None

    def parse(self) -> dict[str, FileChecksums]:
        if self._parsed is None:
            parsed = {}
            for file, header in self._headers.items():
                stored = self._attempt(functools.partial(
                    FileChecksums.of_metadata, header.metadata, header.tensors.values(),
                    header.data_start, file=file))
                if stored is not None:
                    parsed[file] = stored
                    if file in self._listed and file in self._raw:
                        self._attempt(functools.partial(
                            _compare_listed, stored, self._raw[file], self._listed[file], file))
            self._parsed = parsed
        return self._parsed

    def __getitem__(self, file: str) -> FileChecksums:
        return self.parse()[file]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parse())

    def __len__(self) -> int:
        return len(self.parse())


def _compare_listed(stored: FileChecksums, raw: bytes, listed: object, file: str) -> None:
    ours = stored.file_crc(raw)
    if decode_crc(listed) != ours:
        raise SafetensorsError(
            f"the index lists crc32c {listed!r} for this file, but its header and block checksums "
            f"give {encode_crc(ours)!r}: it is not the file the index was committed with (copied "
            "in from another save?)", file=file)


class Verifier:
    """The checksums of some files, checked as reads deliver their bytes (``check``, from any
    thread). Files it holds no checksums of are not checked."""

    def __init__(self, checksums: Mapping[str, FileChecksums]):
        self._checksums = dict(checksums)
        self._tallies = {file: Tally(c.grid) for file, c in self._checksums.items()}
        self._lock = threading.Lock()
        self.bytes_verified = 0

    @property
    def grids(self) -> dict[str, BlockGrid]:
        """Each checked file's checksum blocks (reads that cover them whole check fastest)."""
        return {file: c.grid for file, c in self._checksums.items()}

    def checks(self, file: str) -> bool:
        return file in self._checksums

    def check(self, file: str, offset: int, views: Sequence[memoryview | np.ndarray]) -> list[Damage]:
        """The damaged blocks among those completed by the bytes ``views`` hold back to back
        from ``offset`` of ``file`` (their pieces are hashed by the calling thread)."""
        checksums = self._checksums.get(file)
        if checksums is None:
            return []
        pieces = checksums.grid.pieces(offset, views)
        with self._lock:
            done = self._tallies[file].add(pieces)
            self.bytes_verified += int(pieces.lengths.sum())
        blocks, crcs = done.T
        bad = np.flatnonzero(checksums.crcs[blocks] != crcs)
        return [self._damage(file, int(blocks[k]), int(crcs[k])) for k in bad.tolist()]

    def _damage(self, file: str, block: int, crc: int) -> Damage:
        checksums = self._checksums[file]
        tensor, start, stop = checksums.grid.block(block)
        begin = checksums.grid.begins[checksums.grid.names.index(tensor)]
        return Damage(file, tensor, start, stop, begin, int(checksums.crcs[block]), crc)

    def finish(self) -> None:
        """Raises if some block was read only in part. Every read plan reads each block it
        touches whole, so this is a bug, never damage."""
        for file, tally in self._tallies.items():
            if tally.incomplete:
                tensor, start, stop = tally.grid.block(tally.incomplete[0])
                raise ProtocolError(
                    f"{file}: {len(tally.incomplete)} checksum block(s) read only in part, e.g. "
                    f"[{start}, {stop}) of tensor {tensor!r}")
