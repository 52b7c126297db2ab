"""Checking the bytes reads deliver against the block checksums their files store.

``format.checksums`` says where a file's blocks lie and how CRCs combine; here
reads meet it. Reads arrive from several threads, in any order, cut anywhere
(a chunk boundary may split a block, two reads may cover one block): each read
hashes its own bytes, cut at block boundaries, in the thread that read them
(so hashing overlaps the other threads' I/O), and a per-file ``Tally``, under a
lock, recombines the pieces; a block is checked once pieces tile it. A load
raises the first damaged block (``ChecksumError``); ``verify`` collects them
all and reports each damaged tensor once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from orbax_safetensors.errors import ChecksumError
from orbax_safetensors.format.checksums import FileChecksums, Tally

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


class Verifier:
    """The checksums of some files, checked as reads deliver their bytes (``check``, from any
    thread). Files it holds no checksums of are not checked."""

    def __init__(self, checksums: Mapping[str, FileChecksums]):
        self._checksums = dict(checksums)
        self._tallies = {file: Tally(c.layout) for file, c in self._checksums.items()}
        self._lock = threading.Lock()
        self.bytes_verified = 0

    def checks(self, file: str) -> bool:
        return file in self._checksums

    def check(self, file: str, offset: int, views: Sequence[memoryview | np.ndarray]) -> list[Damage]:
        """The damaged blocks among those completed by the bytes ``views`` hold back to back
        from ``offset`` of ``file`` (their pieces are hashed by the calling thread)."""
        checksums = self._checksums.get(file)
        if checksums is None:
            return []
        pieces = checksums.layout.pieces(offset, views)
        with self._lock:
            done = self._tallies[file].add(pieces)
            self.bytes_verified += int(pieces.lengths.sum())
        blocks, crcs = done.T
        bad = np.flatnonzero(checksums.crcs[blocks] != crcs)
        return [self._damage(file, int(blocks[k]), int(crcs[k])) for k in bad.tolist()]

    def _damage(self, file: str, block: int, crc: int) -> Damage:
        checksums = self._checksums[file]
        tensor, start, stop = checksums.layout.block(block)
        begin = checksums.layout.begins[checksums.layout.names.index(tensor)]
        return Damage(file, tensor, start, stop, begin, int(checksums.crcs[block]), crc)

    def finish(self) -> None:
        """Raises if some block was read only in part. Every read plan reads each block it
        touches whole, so this is a bug, never damage."""
        for file, tally in self._tallies.items():
            if tally.incomplete:
                tensor, start, stop = tally.layout.block(tally.incomplete[0])
                raise AssertionError(
                    f"{file}: {len(tally.incomplete)} checksum block(s) read only in part, e.g. "
                    f"[{start}, {stop}) of tensor {tensor!r}")
