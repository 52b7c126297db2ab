"""``verify``: every file of a checkpoint against the format and against its index.

Loading stops at the first problem, which is right for a load and wrong for a
repair: someone holding a damaged checkpoint wants the whole list (three
truncated shards, a tensor the index forgot, a file left over from an older
save) before deciding what to re-upload. So this walks everything, turns each
``SafetensorsError`` into a ``Problem`` and goes on. It reads headers and
indexes only, never tensor data: the format carries no checksums, and every
structural fault (offsets, file sizes, truncation) is visible from the header
and the file's size alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec

from orbax_safetensors.engine.checkpoint_reader import (
    distributed_slice_problem,
    is_single_file,
    read_header,
    read_index,
)
from orbax_safetensors.errors import SafetensorsError, located
from orbax_safetensors.format import DType, Header
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    SliceEntry,
    check_slices,
    dcp_offsets,
    is_distributed_file_name,
    is_shard_file_name,
    parse_distributed_index,
    parse_index,
)
from orbax_safetensors.storage import Storage, storage_for
from orbax_safetensors.storage.commit import (
    LOCK_NAME,
    DirectoryView,
    is_interrupted_direct_save,
    is_transient,
    read_view,
)

_HEADER_THREADS = 16


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
    """Checkpoint-named files no index names: readers ignore them, so they are not problems,
    but they are usually what a crash between commit and cleanup left of an older save."""

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
    directory's slices against each other. Shard files in the directory that
    no index names are listed as ``leftovers``: a reader ignores them, but they
    are usually the remains of an older save.

    Raises ``FileNotFoundError`` if nothing exists at ``path``; every other
    finding is a ``Problem`` in the returned report.
    """
    storage, root = storage_for(path, storage_options, filesystem)
    url = os.fspath(path)
    if is_single_file(url):
        report = VerifyReport(url, "single file")
        if not storage.exists(root):
            raise FileNotFoundError(f"no safetensors file at {url!r}")
        _Verifier(storage, report).single_file(root)
        return report
    try:
        view = read_view(storage, root)
    except FileNotFoundError:
        raise FileNotFoundError(f"no safetensors checkpoint at {url!r}: it does not exist") from None
    names = set(view.names)
    verifier = _Verifier(storage, VerifyReport(url, "unknown"), root, names, view)
    verifier.report.leftovers += [storage.join(root, n) for n in sorted(view.listing)
                                  if is_transient(n) and n != LOCK_NAME]
    if DISTRIBUTED_INDEX_NAME in names:
        verifier.distributed()
    elif INDEX_NAME in names:
        verifier.hf_index()
    elif SINGLE_FILE_NAME in names:
        verifier.report.layout = "hf single file"
        verifier.single_file(verifier.located(SINGLE_FILE_NAME))
        verifier.strays(set(), is_shard_file_name)
    elif any(is_shard_file_name(n) for n in names):
        verifier.report.layout = "hf sharded"
        verifier.problem(f"holds shard files but no {INDEX_NAME}: an interrupted save? (the "
                         "index is written last, so this checkpoint was never committed)", url)
    elif any(is_distributed_file_name(n) for n in names) \
            and is_interrupted_direct_save(view.listing, DISTRIBUTED_INDEX_NAME):
        verifier.report.layout = "distributed"
        verifier.problem(f"holds shard files and a temporary {DISTRIBUTED_INDEX_NAME} but not the "
                         "index: an interrupted save (never committed)", url)
    elif any(is_distributed_file_name(n) for n in names):
        verifier.dcp()
    else:
        verifier.problem(f"no {INDEX_NAME}, {DISTRIBUTED_INDEX_NAME} or {SINGLE_FILE_NAME} "
                         "in this directory", url)
    return verifier.report


class _Verifier:
    """The checks of one checkpoint, filling one report."""

    def __init__(self, storage: Storage, report: VerifyReport, root: str = "",
                 names: set[str] | None = None, view: DirectoryView | None = None):
        self.storage = storage
        self.report = report
        self.root = root
        self.names = names or set()
        self.view = view or DirectoryView(frozenset(self.names))

    def located(self, name: str) -> str:
        """Where the checkpoint's file ``name`` is read from (a backup while a commit is open)."""
        return self.view.path(self.storage, self.root, name)

    def problem(self, message: str, file: str | None = None, tensor: str | None = None) -> None:
        self.report.problems.append(Problem(message, file, tensor))

    def attempt(self, check: Callable[[], Any]) -> Any:
        """``check()``, or ``None`` with its ``SafetensorsError`` recorded as a problem."""
        try:
            return check()
        except SafetensorsError as e:
            self.problem(e.reason, e.file, e.tensor)
            return None

    def headers(self, files: list[str]) -> dict[str, Header]:
        """The valid headers among ``files``; each invalid or missing file is a problem."""
        def read(file: str) -> Header | SafetensorsError:
            try:
                return read_header(self.storage, file)
            except SafetensorsError as e:
                return e
        with concurrent.futures.ThreadPoolExecutor(max(1, min(_HEADER_THREADS, len(files)))) as pool:
            results = dict(zip(files, pool.map(read, files)))
        self.report.files = sorted(files)
        valid = {}
        for file, result in results.items():
            if isinstance(result, SafetensorsError):
                self.problem(result.reason, result.file, result.tensor)
            else:
                valid[file] = result
        return valid

    def single_file(self, file: str) -> None:
        for header in self.headers([file]).values():
            self._count(t.nbytes for t in header.tensors.values())

    def _count(self, sizes: Iterable[int]) -> None:
        sizes = list(sizes)
        self.report.tensors += len(sizes)
        self.report.bytes += sum(sizes)

    def strays(self, named: set[str], pattern: Callable[[str], bool]) -> None:
        self.report.leftovers += [self.storage.join(self.root, n) for n in sorted(self.names - named)
                                  if pattern(n)]

    def parsed_index(self, name: str, parse: Callable[..., Any]) -> tuple[str, Any]:
        """The index file's path, and ``parse`` of its bytes (``None``, a problem, if it fails)."""
        path = self.located(name)
        return path, self.attempt(lambda: parse(read_index(self.storage, path), file=path))

    def hf_index(self) -> None:
        self.report.layout = "hf sharded"
        index_path, index = self.parsed_index(INDEX_NAME, parse_index)
        if index is None:
            return
        headers = self.headers([self.located(f) for f in index.files])
        listed = {name: self.located(f) for name, f in index.weight_map.items()}
        sizes = {}
        for name, file in listed.items():
            if file not in headers:
                continue  # its file is already reported
            info = headers[file].tensors.get(name)
            if info is None:
                self.problem("the index places this tensor here, but the file does not hold it",
                             file, name)
            else:
                sizes[name] = info.nbytes
        for file, header in headers.items():
            for name in header.tensors:
                if name not in listed:
                    self.problem("holds a tensor the index does not list", file, name)
                elif listed[name] != file:
                    self.problem(f"holds a second copy of a tensor the index places in "
                                 f"{self.storage.split(listed[name])[1]!r}", file, name)
        self._count(sizes.values())
        total = index.metadata.get("total_size")
        if (total is not None and len(sizes) == len(listed)
                and not (isinstance(total, int) and total == self.report.bytes)):
            self.problem(f"metadata.total_size is {total!r}, but the tensors hold "
                         f"{self.report.bytes} bytes", index_path)
        self.strays(set(index.files), is_shard_file_name)

    def distributed(self) -> None:
        self.report.layout = "distributed"
        _, parsed = self.parsed_index(DISTRIBUTED_INDEX_NAME, parse_distributed_index)
        if parsed is None:
            return
        entries, _ = parsed
        named = sorted({s.file for t in entries.values() for s in t.slices})
        headers = self.headers([self.located(f) for f in named])
        placed = collections.defaultdict(set)
        for name, entry in entries.items():
            for s in entry.slices:
                file = self.located(s.file)
                placed[file].add(name)
                if file in headers:  # else its file is already reported
                    problem = self.attempt(lambda: distributed_slice_problem(
                        name, entry, s, headers[file], file=file))
                    if problem is not None:
                        self.problem(problem, file, name)
            self._count([entry.dtype.nbytes(entry.shape)])
        for file, header in headers.items():
            for name in sorted(set(header.tensors) - placed[file]):
                self.problem("holds a tensor the distributed index does not place here", file, name)
        self.strays(set(named), is_distributed_file_name)

    def dcp(self) -> None:
        """torch DCP ``save_sharded`` output: no index, the headers say where slices go."""
        self.report.layout = "torch dcp"
        files = sorted(self.located(n) for n in self.names if is_distributed_file_name(n))
        pieces: dict[str, list[tuple[SliceEntry, DType]]] = collections.defaultdict(list)
        for file, header in self.headers(files).items():
            offsets = self.attempt(lambda: dcp_offsets(header.metadata, file=file)) or {}
            for name, info in header.tensors.items():
                origin = offsets.get(name, (0,) * len(info.shape))
                if len(origin) != len(info.shape):
                    self.problem(f"saved_offsets {list(origin)} do not match the slice's rank",
                                 file, name)
                else:
                    pieces[name].append((SliceEntry(file, origin, info.shape), info.dtype))
        for name, found in sorted(pieces.items()):
            dtypes = {dtype for _, dtype in found}
            if len(dtypes) > 1:
                self.problem(f"slices disagree on the dtype: {sorted(d.code for d in dtypes)}",
                             self.report.path, name)
                continue
            slices = [s for s, _ in found]
            shape = tuple(max(s.offsets[d] + s.shape[d] for s in slices)
                          for d in range(len(slices[0].shape)))
            self.attempt(lambda: check_slices(name, shape, slices, file=self.report.path))
            self._count([found[0][1].nbytes(shape)])
