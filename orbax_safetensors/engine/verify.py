"""``verify``: the catalog in collect-every-problem mode.

Loading stops at the first problem, which is right for a load and wrong for a
repair: someone holding a damaged checkpoint wants the whole list (three
truncated shards, a tensor the index forgot, a file left over from an older
save) before deciding what to re-upload. So ``verify`` asks the catalog the
same questions a load does (``catalog.survey`` and ``catalog.read``), with
findings collected instead of raised. It reads headers and indexes only,
never tensor data: the format carries no checksums, and every structural
fault (offsets, file sizes, truncation) is visible from the header and the
file's size alone.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import fsspec

from orbax_safetensors.engine import catalog
from orbax_safetensors.errors import located
from orbax_safetensors.storage import Location


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
    layout: str
    files: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)
    leftovers: list[str] = dataclasses.field(default_factory=list)
    """Files no reader of the checkpoint looks at: shards no index names and our temporaries.
    They are not problems, but usually what a crash or an interrupted save left behind."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "layout": self.layout, "files": self.files,
                "tensors": self.tensors, "bytes": self.bytes,
                "problems": [dataclasses.asdict(p) for p in self.problems],
                "leftovers": self.leftovers}


def verify(
    path: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> VerifyReport:
    """Checks every file of the checkpoint at ``path`` and reports all problems at once.

    Each file's header is validated as the Rust ``safetensors`` crate does
    (offsets, dtypes, shapes, the file's size); an HF index against the files
    it names (every listed tensor where it says, no tensor unlisted or stored
    twice, ``total_size``); our distributed index against the slices' files
    (dtype, shape, DCP offsets, exact coverage of every tensor); a torch DCP
    directory's slices against each other. Files no reader looks at (shards no
    index names, temporaries of an interrupted save) are listed as
    ``leftovers``.

    Raises ``FileNotFoundError`` if nothing exists at ``path``; every other
    finding is a ``Problem`` in the returned report.
    """
    location = Location.resolve(path, storage_options, filesystem)
    findings = catalog.Findings(collect=True)
    found = catalog.survey(location, findings, leftovers=True)
    if found.layout == catalog.NOTHING:
        what = "safetensors file" if location.is_single_file else "safetensors checkpoint"
        raise FileNotFoundError(f"no {what} at {location.url!r}")
    checkpoint = catalog.read(found, location.storage, findings)
    return VerifyReport(
        location.url, found.layout,
        files=sorted(checkpoint.files),
        tensors=len(checkpoint.tensors),
        bytes=sum(t.nbytes for t in checkpoint.tensors.values()),
        problems=[Problem(*p) for p in findings.problems],
        leftovers=found.leftovers)
