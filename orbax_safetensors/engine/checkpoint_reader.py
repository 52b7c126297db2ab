"""Finding a checkpoint's tensors: which files, which headers, which byte ranges.

A path ending in ``.safetensors`` is one file. Anything else is a directory,
recognised by its commit marker: ``orbax_safetensors.distributed.json`` (our
distributed layout: slices, opened only where needed), else
``model.safetensors.index.json`` (HF shards; only the files the index names
are opened), else ``model.safetensors``. A directory of torch DCP
``save_distributed`` files (``shard-*-model-*``) has no marker; their headers
say where each slice sits. A directory holding HF shard files but no index is
an interrupted save, since the index is written last, and is reported as such
rather than half-loaded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import fsspec

from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import PREFIX_SIZE, DType, Header, TensorInfo, header_size, parse_header
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    DistributedTensor,
    SliceEntry,
    check_slices,
    dcp_offsets,
    is_distributed_file_name,
    is_shard_file_name,
    parse_distributed_index,
    parse_index,
)
from orbax_safetensors.index.distributed_index import DCP_SHARDING_INFO, DCP_VERSION
from orbax_safetensors.storage import Storage, storage_for
from orbax_safetensors.storage.commit import DirectoryView, is_interrupted_direct_save, read_view

_FIRST_READ = 1 << 16  # one request usually covers the whole header
MAX_INDEX_SIZE = 1 << 30  # an index lists names and slices: megabytes even for huge models
_HEADER_THREADS = 16
_OPEN_ATTEMPTS = 50  # an overwrite commits in milliseconds; fifty looks span seconds


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One stored piece of a tensor: the whole of it (hf) or one slice (distributed).

    ``offset`` is the absolute byte offset of the piece in ``file``; ``origin``
    is where the piece starts in the global tensor.
    """

    info: TensorInfo
    file: str
    offset: int
    origin: tuple[int, ...]

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        return tuple((o, o + n) for o, n in zip(self.origin, self.info.shape))


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """A tensor of the checkpoint and the pieces it is stored in."""

    dtype: DType
    shape: tuple[int, ...]
    pieces: tuple[StoredTensor, ...]

    @property
    def whole(self) -> StoredTensor | None:
        """The single piece holding the entire tensor, if it is stored that way."""
        if len(self.pieces) == 1 and self.pieces[0].info.shape == self.shape:
            return self.pieces[0]
        return None

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint's tensors and headers; ``storage`` reads its files as one snapshot."""

    storage: Storage
    tensors: dict[str, TensorSource]
    headers: dict[str, Header]  # file path → header, in file order
    index_metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    directory: tuple[Storage, str] | None = None  # (the storage, the path) of a directory

    def unchanged(self) -> bool:
        """Whether every file read so far is still part of the committed checkpoint there."""
        if self.directory is None:
            return self.storage.unchanged()
        storage, path = self.directory
        view = _view_or_none(storage, path)
        return view is not None and self.storage.unchanged(lambda p: view.relocate(storage, p))

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of all files merged (they agree in what we write)."""
        merged: dict[str, str] = dict(self.index_metadata)
        for header in self.headers.values():
            for key, value in (header.metadata or {}).items():
                if key not in (DCP_SHARDING_INFO, DCP_VERSION):
                    merged.setdefault(key, value)
        return merged

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def is_single_file(url: str | os.PathLike) -> bool:
    return os.fspath(url).endswith(".safetensors")


def read_index(storage: Storage, path: str) -> bytes:
    """An index file's bytes, refused past ``MAX_INDEX_SIZE`` before any is read."""
    size = storage.size(path)
    if size > MAX_INDEX_SIZE:
        raise SafetensorsError(
            f"index is {size} bytes, over the {MAX_INDEX_SIZE}-byte limit", file=path)
    return storage.read(path, 0, size)


def distributed_slice_problem(name: str, entry: DistributedTensor, piece: SliceEntry,
                              header: Header, *, file: str) -> str | None:
    """What is wrong with the file holding one slice the distributed index lists, if anything.

    The file's own ``DCP_SHARDING_INFO`` must agree with the index on where the slice
    sits: two equal-shaped slices with swapped offsets would otherwise load swapped.
    """
    info = header.tensors.get(name)
    if info is None or info.shape != piece.shape or info.dtype != entry.dtype:
        held = "no such tensor" if info is None else f"{info.dtype.code} {list(info.shape)}"
        return (f"the distributed index places a {entry.dtype.code} slice of shape "
                f"{list(piece.shape)} here, but the file holds {held}")
    declared = dcp_offsets(header.metadata, file=file).get(name)
    if declared is not None and declared != piece.offsets:
        return (f"DCP_SHARDING_INFO puts this slice at {list(declared)}, the distributed index "
                f"at {list(piece.offsets)}")
    return None


def read_header(storage: Storage, path: str) -> Header:
    """Reads and validates one file's header, in one request when it is small."""
    try:
        size = storage.size(path)
        first = storage.read(path, 0, min(size, _FIRST_READ))
    except FileNotFoundError:
        raise SafetensorsError("file does not exist", file=path) from None
    except IsADirectoryError:
        raise SafetensorsError("is a directory, not a safetensors file", file=path) from None
    n = header_size(first, size, file=path)
    raw = first[PREFIX_SIZE:PREFIX_SIZE + n]
    if len(raw) < n:
        raw += storage.read(path, len(first), PREFIX_SIZE + n - len(first))
    return parse_header(raw, size, file=path)


def _read_headers(storage: Storage, files: list[str]) -> dict[str, Header]:
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_HEADER_THREADS, len(files)))) as pool:
        return dict(zip(files, pool.map(lambda f: read_header(storage, f), files)))


def open_checkpoint(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                    filesystem: fsspec.AbstractFileSystem | None = None) -> Checkpoint:
    """The committed checkpoint at ``url``, every file it needs opened as one snapshot.

    A directory is resolved through ``read_view`` (a commit in progress leaves
    the old checkpoint visible), each file is pinned on its first read, and the
    result is kept only if the view and every pinned name are unchanged after
    all headers are read: otherwise an overwrite committed meanwhile, and the
    checkpoint is opened again. Close the result (it is a context manager).
    """
    storage, path = storage_for(url, storage_options, filesystem)
    if is_single_file(url):  # one file pinned by one descriptor is its own snapshot
        snapshot = storage.snapshot()
        return _closing_on_error(snapshot, lambda: _whole_tensors(snapshot, [path], None))
    for attempt in range(_OPEN_ATTEMPTS):
        view = _view(storage, path, os.fspath(url))
        snapshot = storage.snapshot()
        try:
            checkpoint = dataclasses.replace(_open_directory(snapshot, path, view, os.fspath(url)),
                                             directory=(storage, path))
        except Exception:
            snapshot.close()
            if _view_or_none(storage, path) != view:
                continue  # an overwrite moved files under us: look again
            raise
        if checkpoint.unchanged():
            return checkpoint
        snapshot.close()
        time.sleep(min(0.001 * 2 ** attempt, 0.05))
    raise SafetensorsError(
        f"the checkpoint kept changing while it was being opened ({_OPEN_ATTEMPTS} attempts)",
        file=os.fspath(url))


def _closing_on_error(snapshot: Storage, build: Callable[[], Checkpoint]) -> Checkpoint:
    try:
        return build()
    except BaseException:
        snapshot.close()
        raise


def _view(storage: Storage, path: str, url: str) -> DirectoryView:
    try:
        return read_view(storage, path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no safetensors checkpoint at {url!r}: it does not exist") from None
    except NotADirectoryError:
        raise SafetensorsError("is a file, not a checkpoint directory (a single-file checkpoint "
                               "is named *.safetensors)", file=url) from None


def _view_or_none(storage: Storage, path: str) -> DirectoryView | None:
    try:
        return read_view(storage, path)
    except OSError:
        return None


def existing_checkpoint(storage: Storage, directory: str) -> tuple[set[str], set[str]]:
    """``(committed, present)`` names in ``directory``: the files of the checkpoint there, if
    one is committed, and every checkpoint file there (committed or left by a crash).

    What a save replaces and, with ``committed``, whether it may without
    ``overwrite``. An index that does not parse still counts as a committed
    checkpoint (so ``overwrite=True`` replaces it), whose files are then every
    file named like a shard.
    """
    try:
        view = read_view(storage, directory)
    except (FileNotFoundError, NotADirectoryError):
        return set(), set()
    names = view.names
    shards = {n for n in names if is_shard_file_name(n) or is_distributed_file_name(n)}
    committed: set[str] = set()
    for index_name in (INDEX_NAME, DISTRIBUTED_INDEX_NAME):
        if index_name not in names:
            continue
        committed.add(index_name)
        index_path = view.path(storage, directory, index_name)
        try:
            raw = read_index(storage, index_path)
            if index_name == INDEX_NAME:
                committed |= set(parse_index(raw, file=index_path).files)
            else:
                tensors, _ = parse_distributed_index(raw, file=index_path)
                committed |= {s.file for t in tensors.values() for s in t.slices}
        except (SafetensorsError, OSError):
            committed |= shards
    if SINGLE_FILE_NAME in names:
        committed.add(SINGLE_FILE_NAME)
    if not committed and not any(is_shard_file_name(n) for n in names) \
            and not is_interrupted_direct_save(view.listing, DISTRIBUTED_INDEX_NAME):
        # torch DCP output, which ``load`` reads, unless a save of ours was interrupted
        committed = {n for n in names if is_distributed_file_name(n)}
    return committed, committed | shards


def _open_directory(storage: Storage, path: str, view: DirectoryView, url: str) -> Checkpoint:
    def located(name: str) -> str:
        return view.path(storage, path, name)
    names = view.names
    if DISTRIBUTED_INDEX_NAME in names:
        return _distributed_checkpoint(storage, located)
    if INDEX_NAME in names:
        index_path = located(INDEX_NAME)
        index = parse_index(read_index(storage, index_path), file=index_path)
        files = {name: located(name) for name in index.files}
        return _whole_tensors(storage, list(files.values()),
                              {t: files[f] for t, f in index.weight_map.items()})
    if SINGLE_FILE_NAME in names:
        return _whole_tensors(storage, [located(SINGLE_FILE_NAME)], None)
    if any(is_shard_file_name(n) for n in names):
        raise SafetensorsError(
            f"holds shard files but no {INDEX_NAME}: an interrupted save? "
            "(the index is written last, so this checkpoint was never committed)",
            file=url)
    if any(is_distributed_file_name(n) for n in names):
        if is_interrupted_direct_save(view.listing, DISTRIBUTED_INDEX_NAME):
            raise SafetensorsError(
                f"holds shard files and a temporary {DISTRIBUTED_INDEX_NAME} but not the index: "
                "an interrupted save (the index is put in place last, so this checkpoint was "
                "never committed)", file=url)
        return _dcp_checkpoint(storage, [located(n) for n in sorted(names)
                                         if is_distributed_file_name(n)], url)
    raise SafetensorsError(
        f"no {INDEX_NAME}, {DISTRIBUTED_INDEX_NAME} or {SINGLE_FILE_NAME} in this directory",
        file=url)


def _whole_tensors(storage: Storage, files: list[str], weight_map: dict[str, str] | None) -> Checkpoint:
    headers = _read_headers(storage, files)
    tensors: dict[str, TensorSource] = {}
    for file, header in headers.items():
        for name, info in header.tensors.items():
            if weight_map is not None and weight_map.get(name) != file:
                continue  # the index decides which file's copy is the tensor
            piece = StoredTensor(info, file, header.data_start + info.begin, (0,) * len(info.shape))
            tensors[name] = TensorSource(info.dtype, info.shape, (piece,))
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise SafetensorsError(
                    f"the index says this tensor is in {file!r}, which does not hold it",
                    file=file, tensor=name)
    return Checkpoint(storage, tensors, headers)


def _distributed_checkpoint(storage: Storage, located: Callable[[str], str]) -> Checkpoint:
    """Our distributed layout: the index says where every slice is."""
    index_path = located(DISTRIBUTED_INDEX_NAME)
    entries, metadata = parse_distributed_index(read_index(storage, index_path), file=index_path)
    files = sorted({located(s.file) for t in entries.values() for s in t.slices})
    headers = _read_headers(storage, files)
    tensors = {}
    for name, entry in entries.items():
        pieces = []
        for s in entry.slices:
            file = located(s.file)
            problem = distributed_slice_problem(name, entry, s, headers[file], file=file)
            if problem is not None:
                raise SafetensorsError(problem, file=file, tensor=name)
            info = headers[file].tensors[name]
            pieces.append(StoredTensor(info, file, headers[file].data_start + info.begin, s.offsets))
        tensors[name] = TensorSource(entry.dtype, entry.shape, tuple(pieces))
    return Checkpoint(storage, tensors, headers, metadata)


def _dcp_checkpoint(storage: Storage, files: list[str], url: str) -> Checkpoint:
    """torch DCP ``save_sharded`` output: slices and offsets from every file's header."""
    headers = _read_headers(storage, files)
    found: dict[str, list[StoredTensor]] = collections.defaultdict(list)
    for file, header in headers.items():
        offsets = dcp_offsets(header.metadata, file=file)
        for name, info in header.tensors.items():
            origin = offsets.get(name, (0,) * len(info.shape))
            if len(origin) != len(info.shape):
                raise SafetensorsError(
                    f"saved_offsets {list(origin)} do not match the slice's rank", file=file, tensor=name)
            found[name].append(StoredTensor(info, file, header.data_start + info.begin, origin))
    tensors = {}
    for name, pieces in found.items():
        shape = tuple(max(p.origin[d] + p.info.shape[d] for p in pieces)
                      for d in range(len(pieces[0].info.shape)))
        dtypes = {p.info.dtype for p in pieces}
        if len(dtypes) > 1:
            raise SafetensorsError(f"slices disagree on the dtype: {sorted(d.code for d in dtypes)}",
                                   file=url, tensor=name)
        check_slices(name, shape, [SliceEntry(p.file, p.origin, p.info.shape) for p in pieces], file=url)
        tensors[name] = TensorSource(pieces[0].info.dtype, shape, tuple(pieces))
    return Checkpoint(storage, tensors, headers)
