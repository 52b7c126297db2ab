"""``verify``: the catalog in collect-every-problem mode.

Loading stops at the first problem, which is right for a load and wrong for a
repair: someone holding a damaged checkpoint wants the whole list (three
truncated shards, a tensor the index forgot, a file left over from an older
save) before deciding what to re-upload. So ``verify`` asks the catalog the
same questions a load does (``catalog.survey`` and ``catalog.read``), with
findings collected instead of raised. Every structural fault (offsets, file
sizes, truncation) is visible from the headers, the indexes and the files'
sizes, so that is all it reads by default. With ``data=True`` it also reads
every byte of every file that stores block checksums (``format.checksums``)
and reports each tensor whose bytes do not match them: a bit flipped on disk
or in transit leaves the structure intact and only a checksum sees it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

from orbax_safetensors.engine.core import catalog
from orbax_safetensors.storage.executor import Executor
from orbax_safetensors.engine.core.integrity import Damage, Verifier, damage_message
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.errors import located
from orbax_safetensors.index import encode_crc
from orbax_safetensors.storage import Location

_DATA_CHUNK = 16 << 20  # bytes of one read of ``data=True``; memory is a few of them
_DATA_THREADS = 4


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong, and where: ``file`` and ``tensor`` are ``None`` where they do not apply."""

    message: str
    file: str | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        return located(self.message, self.file, self.tensor)


@dataclasses.dataclass
class VerifyReport:
    """What ``verify`` checked and everything it found wrong (``ok`` when nothing)."""

    path: str
    kind: str
    """What kind of checkpoint the catalog found there (``"hf sharded"``, ``"distributed"``,
    ``"torch dcp"``, ...): which index, if any, decides what its files hold."""
    files: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)
    leftovers: list[str] = dataclasses.field(default_factory=list)
    """Files no reader of the checkpoint looks at: shards no index names and our temporaries.
    They are not problems, but usually what a crash or an interrupted save left behind."""
    bytes_checked: int = 0
    """Tensor bytes read and checked against their files' checksums (``data=True``)."""
    unchecked: list[str] = dataclasses.field(default_factory=list)
    """Files whose data ``data=True`` could not check: they store no checksums of ours (written
    by another library, whose metadata may use a key named ``crc32c`` for its own ends, or
    saved with ``checksums=False``). Not a problem."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "kind": str(self.kind), "files": self.files,
                "tensors": self.tensors, "bytes": self.bytes,
                "problems": [dataclasses.asdict(p) for p in self.problems],
                "leftovers": self.leftovers, "bytes_checked": self.bytes_checked,
                "unchecked": self.unchecked}


def verify(
    path: str | os.PathLike,
    *,
    data: bool = False,
    progress: bool | None = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> VerifyReport:
    """Checks every file of the checkpoint at ``path`` and reports all problems at once.

    Each file's header is validated as the Rust ``safetensors`` crate does
    (offsets, dtypes, shapes, the file's size, the block checksums it stores
    being well formed); an HF index against the files it names (every listed
    tensor where it says, no tensor unlisted or stored twice, ``total_size``);
    our distributed index against the slices' files (dtype, shape, DCP offsets,
    exact coverage of every tensor); a torch DCP directory's slices against each
    other. Files no reader looks at (shards no index names, temporaries of an
    interrupted save) are listed as ``leftovers``.

    Args:
      path: a ``.safetensors`` file or a checkpoint directory (any fsspec URL).
      data: also read every byte of every file and check it against the crc32c
        checksums the file stores (as every load does for the bytes it reads),
        reporting each damaged tensor with the bytes that do not match. Reads
        the whole checkpoint, a few 16 MB chunks at a time. Files that store no
        checksums are listed as ``unchecked`` (not a problem).
      progress: a progress line on stderr while ``data`` is read; ``None``
        shows it on a terminal.
      storage_options / filesystem: as in ``ost.load``.

    Raises ``FileNotFoundError`` if nothing exists at ``path``; every other
    finding is a ``Problem`` in the returned report.
    """
    location = Location.resolve(path, storage_options, filesystem)
    findings = catalog.Findings(collect=True)
    found = catalog.survey(location, findings, leftovers=True)
    if found.kind == catalog.CheckpointKind.NOTHING:
        catalog.raise_missing(location)
    checkpoint = catalog.read(found, location.storage, findings)
    report = VerifyReport(
        location.url, found.kind,
        files=sorted(checkpoint.files),
        tensors=len(checkpoint.tensors),
        bytes=sum(t.nbytes for t in checkpoint.tensors.values()),
        problems=[Problem(*p) for p in findings.problems],
        leftovers=found.leftovers)
    report.problems += _check_objects(checkpoint)
    if data:
        report.unchecked = sorted(set(checkpoint.headers) - set(checkpoint.checksums))
        report.bytes_checked, damage = _check_data(checkpoint, f"verify {location.url}", progress)
        report.problems += _damaged_tensors(damage)
    return report


def _check_objects(checkpoint: catalog.Checkpoint) -> list[Problem]:
    """Each checksummed file's whole crc32c (its header's, combined with its blocks': no data
    read) against the one the store keeps (GCS, S3): an object the store holds damaged shows
    without reading the tensors. (The catalog compares it with the index's, for loads too.)"""
    storage = checkpoint.storage

    def check(file: str) -> list[Problem]:
        ours = checkpoint.checksums[file].file_crc(checkpoint.header_bytes[file])
        try:
            stored = storage.stored_crc32c(file)
        except OSError as e:
            return [Problem(f"its crc32c could not be asked of the store: {e}", file)]
        problems = []
        if stored is not None and stored != ours:
            problems.append(Problem(f"the store's crc32c of the object is {encode_crc(stored)!r}, but "
                                    f"its header and block checksums give {encode_crc(ours)!r}: the "
                                    "object is damaged", file))
        return problems

    with Executor(_DATA_THREADS, name="orbax_safetensors-verify") as pool:
        return [p for found_problems in pool.map(check, sorted(checkpoint.checksums)) for p in found_problems]


def _check_data(checkpoint: catalog.Checkpoint, label: str,
                progress: bool | None) -> tuple[int, list[Damage]]:
    """Reads the data of every file that stores checksums, in chunks on a few threads, and
    checks it: the bytes checked, and every damaged block."""
    chunks = [(file, offset, min(_DATA_CHUNK, header.file_size - offset))
              for file in checkpoint.checksums for header in [checkpoint.headers[file]]
              for offset in range(header.data_start, header.file_size, _DATA_CHUNK)]
    report = Progress(label, sum(length for _, _, length in chunks), enabled=progress).start()
    verifier = Verifier(checkpoint.checksums)

    def check(chunk: tuple[str, int, int]) -> list[Damage]:
        file, offset, length = chunk
        data = np.empty(length, np.uint8)
        checkpoint.storage.read_scatter(file, offset, [memoryview(data)])
        damage = verifier.check(file, offset, [data])
        report.advance(length)
        return damage

    with Executor(_DATA_THREADS, name="orbax_safetensors-verify") as pool:
        damage = [d for found in pool.map(check, chunks) for d in found]
    report.close()
    verifier.finish()
    return verifier.bytes_verified, damage


def _damaged_tensors(damage: list[Damage]) -> list[Problem]:
    """One problem per damaged tensor, naming every damaged range of it."""
    by_tensor: dict[tuple[str, str], list[Damage]] = collections.defaultdict(list)
    for d in damage:
        by_tensor[d.file, d.tensor].append(d)
    return [Problem(damage_message(blocks), file, tensor)
            for (file, tensor), blocks in sorted(by_tensor.items())]
