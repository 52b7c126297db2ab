"""What checkpoint is at a location: the one place that answers it.

``load``, ``metadata``, ``verify``, ``save``'s overwrite check (and its commit,
which takes the old index away first: ``Survey.markers``), ``consolidate`` and
``convert`` (``detect_kind``) all ask here, so they never disagree about what
a directory holds. A path ending in ``.safetensors`` is one file. A directory is
recognised by its commit marker: ``orbax_safetensors.distributed.json`` (our
distributed layout), else ``model.safetensors.index.json`` (HF shards; only
the files the index names count), else ``model.safetensors``. Without any of
them, the marker of a save of ours writing files under their final names
makes it an interrupted save (never half-loaded); else its ``*.safetensors``
files are the checkpoint, every one of them (``CheckpointKind.UNINDEXED``, what Orbax's
``SafetensorsLayout`` and ``safetensors`` users read): ``model-0000i-of-0000N``
shards only as a whole set 1..N (the rest of an interrupted copy is no
model), and no tensor in two files. A directory of torch DCP
``save_distributed`` files (``shard-*-model-*``) has no marker; their headers
say where each slice sits. While a commit is in progress the old checkpoint
is the one there (``naming.read_view``).

Two questions at two costs. ``survey`` answers from the listing and the
index alone: the kind of checkpoint, which files the committed checkpoint consists of,
what else lies there (an older save's shards, our temporaries). ``read``
adds every needed file's header: each tensor's dtype, shape and the slices it
is stored in, and the block checksums each file stores. Every check reports to
``Findings``: a load raises the first problem, ``verify`` collects them all,
and only ``verify`` hears of what a reader tolerates (a tensor the index does
not list, a stale ``total_size``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from orbax_safetensors.storage.executor import Executor
from orbax_safetensors.engine.core.integrity import StoredChecksums
from orbax_safetensors.errors import (CheckpointChangedError, LocationTakenError, MissingFileError,
                                      SafetensorsError)
from orbax_safetensors.format import PREFIX_SIZE, Header, checksums, header_size, parse_header
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    DistributedTensor,
    HFIndex,
    SliceEntry,
    check_slices,
    dcp_offsets,
    incomplete_shard_sets,
    is_distributed_file_name,
    is_shard_file_name,
    listed_crcs,
    natural_key,
    parse_distributed_index,
    parse_index,
)
from orbax_safetensors.index.distributed_index import DCP_SHARDING_INFO, DCP_VERSION
from orbax_safetensors.planning import StoredSlice, TensorSource
from orbax_safetensors.storage import Location, Storage
from orbax_safetensors.storage.location import SINGLE_FILE_SUFFIX
from orbax_safetensors.storage.naming import (
    DirectoryView,
    files_of_marker,
    is_transient,
    read_view,
    writing_markers,
)
from orbax_safetensors.storage.retry import SNAPSHOT_REREADS


class CheckpointKind(str, enum.Enum):
    """What kind of checkpoint the catalog found at a location. A ``str`` whose value is what
    ``VerifyReport.kind`` (and ``orbax-safetensors verify``) says."""

    SINGLE_FILE = "single file"  # a location named *.safetensors
    HF_SINGLE = "hf single file"
    HF_SHARDED = "hf sharded"
    UNINDEXED = "safetensors files (no index)"  # a directory of *.safetensors: all of them
    DISTRIBUTED = "distributed"
    TORCH_DCP = "torch dcp"
    UNKNOWN = "unknown"
    NOTHING = "nothing"  # no such file or directory

    def __str__(self) -> str:
        return self.value


_FIRST_READ = 1 << 16  # one request usually covers the whole header
MAX_INDEX_SIZE = 1 << 30  # an index lists names and slices: megabytes even for huge models
_HEADER_THREADS = 16
_INDEXES = frozenset({INDEX_NAME, DISTRIBUTED_INDEX_NAME})  # what marks a directory committed
_MISSING_ATTEMPTS = 3  # looks again at a named file that is missing under an unchanged view


class Findings:
    """Where checks report: ``raise`` the first problem (a load) or collect all (``verify``)."""

    def __init__(self, *, collect: bool):
        self.collect = collect
        self.problems: list[tuple[str, str | None, str | None]] = []  # (message, file, tensor)

    def problem(self, message: str, file: str | None = None, tensor: str | None = None) -> None:
        """Something no reader can get past."""
        if not self.collect:
            raise SafetensorsError(message, file=file, tensor=tensor)
        self.problems.append((message, file, tensor))

    def tolerated(self, message: str, file: str | None = None, tensor: str | None = None) -> None:
        """Something a reader gets past (the index decides), but a repair wants to hear of."""
        if self.collect:
            self.problems.append((message, file, tensor))

    def attempt(self, check: Callable[[], Any]) -> Any:
        """``check()``; when collecting, ``None`` with its ``SafetensorsError`` recorded."""
        try:
            return check()
        except SafetensorsError as e:
            if not self.collect:
                raise
            self.problems.append((e.reason, e.file, e.tensor))
            return None


@dataclasses.dataclass(frozen=True)
class Survey:
    """What is at a location, from its listing and its index (no headers read).

    ``committed`` are the names of the committed checkpoint's files (its index
    included); ``present`` every checkpoint-named file, committed or left over;
    ``ours`` the files a save that has not committed listed as its own (a
    ``DirectCommit`` marker: the next save may remove them, and no other file it
    did not write); ``transient`` our temporaries, backups and journals (not the
    lock of a live writer). ``index`` is the parsed index of a
    ``CheckpointKind.HF_SHARDED`` (an ``HFIndex``) or ``CheckpointKind.DISTRIBUTED``
    (tensors, metadata) checkpoint, ``None`` if it has none or it did not parse.
    """

    location: Location
    kind: CheckpointKind
    view: DirectoryView
    committed: frozenset[str] = frozenset()
    present: frozenset[str] = frozenset()
    transient: tuple[str, ...] = ()
    index: Any = None
    ours: frozenset[str] = frozenset()

    def path(self, name: str) -> str:
        """Where the checkpoint's file ``name`` is read from (a backup while a commit is open)."""
        return self.view.path(self.location.storage, self.location.directory, name)

    @property
    def markers(self) -> frozenset[str]:
        """The committed checkpoint's commit markers (its indexes): what a save replacing it
        takes away before any other file changes (``Commit.markers``)."""
        return self.committed & _INDEXES

    @property
    def leftovers(self) -> list[str]:
        """Paths of files no reader of the committed checkpoint looks at."""
        stray = sorted(self.present - self.committed) if self.committed else []
        return [self.location.join(n) for n in stray + list(self.transient)]


def survey(location: Location, findings: Findings, storage: Storage | None = None, *,
           leftovers: bool = False, view: DirectoryView | None = None) -> Survey:
    """The kind of checkpoint and the files at ``location``; the index is read through
    ``storage`` (a snapshot, for a load: the listing and a commit's journal are not pinned,
    the index is) and problems go to ``findings``. A single file's temporaries are looked for only with
    ``leftovers`` (its directory may be a whole bucket). ``view``: the directory's, already
    read."""
    storage = storage or location.storage
    if location.is_single_file:
        return _survey_file(location, leftovers)
    try:
        view = view or read_view(location.storage, location.path)
    except FileNotFoundError:
        return Survey(location, CheckpointKind.NOTHING, DirectoryView(frozenset()))
    except NotADirectoryError:
        findings.problem(_not_a_directory(location), location.url)
        return Survey(location, CheckpointKind.UNKNOWN, DirectoryView(frozenset()))
    names = view.names
    dcp = {n for n in names if is_distributed_file_name(n)}
    whole = {n for n in names if n.endswith(SINGLE_FILE_SUFFIX)} - dcp  # files of whole tensors
    shards = {n for n in whole if is_shard_file_name(n)} | dcp
    transient = tuple(sorted(n for n in view.entries if is_transient(n)))
    markers = writing_markers(view.entries)
    ours = frozenset().union(*(files_of_marker(location.storage, location.join(m)) for m in markers))
    found = Survey(location, CheckpointKind.UNKNOWN, view, present=frozenset(shards),
                   transient=transient, ours=ours)
    committed: set[str] = set()
    index: Any = None
    if DISTRIBUTED_INDEX_NAME in names:
        kind = CheckpointKind.DISTRIBUTED
        index = _parse(found, storage, findings, DISTRIBUTED_INDEX_NAME, parse_distributed_index)
        committed = {DISTRIBUTED_INDEX_NAME} | (
            shards if index is None else {s.file for t in index[0].values() for s in t.slices})
        if INDEX_NAME in names:  # an hf index beside it is replaced too, but never read
            committed |= {INDEX_NAME} | shards
    elif INDEX_NAME in names:
        kind = CheckpointKind.HF_SHARDED
        index = _parse(found, storage, findings, INDEX_NAME, parse_index)
        committed = {INDEX_NAME} | (shards if index is None else set(index.files))
    elif SINGLE_FILE_NAME in names:
        kind = CheckpointKind.HF_SINGLE
    elif (whole or dcp) and markers:
        # Before anything else without an index: a save writing files under their final names
        # (object stores) has removed the old index first, and its marker is what tells a
        # reader that the files there now are half old, half new.
        kind = CheckpointKind.DISTRIBUTED if dcp else CheckpointKind.HF_SHARDED
        findings.problem(f"holds *{SINGLE_FILE_SUFFIX} files and the marker of a save in progress "
                         f"({markers[0]}) "
                         "but no index: an interrupted save, or one still writing (the index is "
                         "put in place last, so this checkpoint was never committed)", location.url)
    elif whole:
        kind = CheckpointKind.UNINDEXED
        if _check_unindexed(location, whole, dcp, findings):
            committed = set(whole)
        else:  # no checkpoint, but files a save without overwrite must not remove
            shards |= whole
    elif dcp:
        kind, committed = CheckpointKind.TORCH_DCP, set(dcp)
    else:
        kind = CheckpointKind.UNKNOWN
        findings.problem(_orbax_message(location) if _is_orbax(location.storage, location.path, view.entries)
                         else f"no {INDEX_NAME}, {DISTRIBUTED_INDEX_NAME} or *{SINGLE_FILE_SUFFIX} "
                         "file in this directory: pass the directory that holds the checkpoint", location.url)
    if SINGLE_FILE_NAME in names:  # beside an index too: an overwrite replaces it
        committed.add(SINGLE_FILE_NAME)
    return dataclasses.replace(found, kind=kind, committed=frozenset(committed),
                               present=frozenset(shards | committed), index=index)


def refuse_non_files(found: Survey, beside: Iterable[str] = ()) -> None:
    """Raises ``FileExistsError`` naming the first entry where a save would put a file that is
    no regular file: a directory, FIFO, device, socket or dangling link named like a checkpoint
    file (``model.safetensors``, a shard, an index) or like a file written ``beside`` the
    tensors (``config.json``). A save replaces files by renaming over
    their names, which would fail halfway on a directory and silently replace a FIFO; neither
    is ours to replace, with or without ``overwrite``, so the save stops before writing."""
    location = found.location
    if location.is_single_file:
        paths = [location.path]
    else:
        paths = [location.join(n) for n in sorted(found.present) + sorted(beside)]
    storage = location.storage
    for path in paths:
        kind = storage.special_kind(path) or ("a directory" if storage.isdir(path) else None)
        if kind is not None:
            raise LocationTakenError(f"is {kind}, not a file, where the save would write one; "
                                     "move it away or save elsewhere", path)
def _check_unindexed(location: Location, whole: set[str], dcp: set[str], findings: Findings) -> bool:
    """Whether the safetensors files of a directory without index are a checkpoint: every one
    of them, but only whole (``model-0000i-of-0000N`` shards without all of 1..N are a copy or
    a download cut short, and loading the rest would be half a model) and not mixed with
    torch DCP slice files."""
    incomplete = incomplete_shard_sets(whole)
    for count, (missing, first) in incomplete.items():
        more = f" and {missing - len(first)} more" if missing > len(first) else ""
        findings.problem(f"holds shards of {count} (model-*-of-{count:05d}{SINGLE_FILE_SUFFIX}) "
                         f"but not {', '.join(first)}{more}, and no {INDEX_NAME}: an interrupted save, "
                         "copy or download? fetch the missing shards (without an index every one must be there)",
                         location.url)
    if dcp:
        findings.problem(f"holds torch DCP slice files ({sorted(dcp)[0]}, ...) beside other "
                         f"*{SINGLE_FILE_SUFFIX} files ({sorted(whole)[0]}, ...) and no index: "
                         "which of them is the checkpoint?", location.url)
    return not incomplete and not dcp


# What Orbax writes in a PyTree item directory (``_METADATA``, the OCDBT manifest and each
# process's OCDBT data) and in a step directory (``_CHECKPOINT_METADATA``): by their names
# alone, the engine knows no Orbax.
_ORBAX_MARKERS = frozenset({"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt"})
_ORBAX_DATA_PREFIX = "ocdbt.process_"
_ORBAX_DEPTH = 2  # a CheckpointManager's root: <step>/<item>/_METADATA
_ORBAX_LOOKS = 8  # subdirectories looked into per level, at most


def _is_orbax(storage: Storage, path: str, names: frozenset[str] | None = None,
              depth: int = _ORBAX_DEPTH) -> bool:
    """Whether directory ``path`` (whose entries are ``names``, when known) is an Orbax
    checkpoint: a PyTree item, a step holding items, or a root holding steps. Looks into
    the latest step and a few other entries of each level, no deeper than ``depth``."""
    if names is None:
        try:
            names = frozenset(storage.listdir(path))
        except OSError:
            return False
    if names & _ORBAX_MARKERS or any(n.startswith(_ORBAX_DATA_PREFIX) for n in names):
        return True
    if depth == 0:
        return False
    steps = sorted((n for n in names if n.isdigit()), key=int)
    others = sorted(n for n in names if not n.isdigit() and "." not in n)
    return any(_is_orbax(storage, storage.join(path, n), None, depth - 1)
               for n in (steps[-1:] + others)[:_ORBAX_LOOKS])


def _orbax_message(location: Location) -> str:
    return (f"is an Orbax checkpoint, not safetensors: convert it with `orbax-safetensors convert "
            f"{location.url} <dst>` (ost.convert)")


def _not_a_directory(location: Location) -> str:
    """What a checkpoint directory's path holds instead: a file, or a device, FIFO or socket,
    which is neither file nor directory."""
    kind = location.storage.special_kind(location.path)
    if kind is not None:
        return f"is {kind}, not a regular file or directory, so not a checkpoint"
    return ("is a file, not a checkpoint directory: pass a directory, or name a single-file "
            "checkpoint *.safetensors")


def _survey_file(location: Location, leftovers: bool) -> Survey:
    """One ``*.safetensors`` file in a directory that may hold other files of the user's: only
    that file and its own temporaries are the checkpoint's."""
    storage, name = location.storage, location.file_name
    if not storage.exists(location.path):
        return Survey(location, CheckpointKind.NOTHING, DirectoryView(frozenset()))
    transient = tuple(sorted(n for n in storage.listdir(location.directory)
                             if is_transient(n, name))) if leftovers else ()
    return Survey(location, CheckpointKind.SINGLE_FILE, DirectoryView(frozenset({name})),
                  frozenset({name}), frozenset({name}), transient)


def _parse(found: Survey, storage: Storage, findings: Findings, name: str, parse) -> Any:
    path = found.path(name)
    return findings.attempt(lambda: parse(read_index(storage, path), file=path))


def read_index(storage: Storage, path: str) -> bytes:
    """An index file's bytes, refused past ``MAX_INDEX_SIZE`` before any is read."""
    try:
        size = storage.size(path)
        if size > MAX_INDEX_SIZE:
            raise SafetensorsError(
                f"index is {size} bytes, over the {MAX_INDEX_SIZE}-byte limit", file=path)
        return storage.read(path, 0, size)
    except FileNotFoundError:
        raise MissingFileError("does not exist", file=path) from None


def read_header(storage: Storage, path: str) -> tuple[Header, bytes]:
    """Reads and validates one file's header, in one request when it is small; also its
    bytes from the file's first (what its whole crc32c starts with)."""
    try:
        size = storage.size(path)
        first = storage.read(path, 0, min(size, _FIRST_READ))
    except FileNotFoundError:
        raise MissingFileError("does not exist", file=path) from None
    except IsADirectoryError:
        raise SafetensorsError("is a directory, not a safetensors file", file=path) from None
    n = header_size(first, size, file=path)
    raw = first[:PREFIX_SIZE + n]
    if len(raw) < PREFIX_SIZE + n:
        raw += storage.read(path, len(first), PREFIX_SIZE + n - len(first))
    return parse_header(raw[PREFIX_SIZE:], size, file=path), raw


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's tensors and headers; ``storage`` reads its files (as one snapshot, when
    opened by ``open_checkpoint``)."""

    storage: Storage
    survey: Survey
    tensors: dict[str, TensorSource]
    headers: dict[str, Header]  # file path → header, in file order (the valid ones)
    index_metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    files: tuple[str, ...] = ()  # every file the checkpoint consists of, valid or not
    # file path → the block checksums its header stores (files that store none are absent)
    checksums: Mapping[str, checksums.FileChecksums] = dataclasses.field(default_factory=dict)
    # file path → its header's bytes as read, from the file's first (what its crc32c starts with)
    header_bytes: Mapping[str, bytes] = dataclasses.field(default_factory=dict)

    def unchanged(self) -> bool:
        """Whether every file read so far is still part of the committed checkpoint there."""
        location = self.survey.location
        if location.is_single_file:
            return self.storage.unchanged()
        try:
            view = read_view(location.storage, location.path)
        except OSError:
            return False
        return self.storage.unchanged(lambda p: view.relocate(location.storage, p))

    def modified_ns(self) -> int | None:
        """When the checkpoint was last written: the latest modification time of its files
        (the index is put in place last, so for our saves the commit), in nanoseconds since
        the epoch; ``None`` where the store keeps no times. One metadata request per file,
        so asked for only by who reports it (Orbax's ``commit_timestamp_nsecs``)."""
        indexes = [self.survey.path(n) for n in sorted(self.survey.markers)]
        times = [self.storage.modified(file) for file in (*self.files, *indexes)]
        return None if not times or None in times else max(times)

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of all files merged (they agree in what we write), without what
        differs per file: torch DCP's slice offsets and our checksums."""
        merged: dict[str, str] = dict(self.index_metadata)
        for header in self.headers.values():
            for key, value in (header.metadata or {}).items():
                if key not in (DCP_SHARDING_INFO, DCP_VERSION, *checksums.RESERVED_KEYS):
                    merged.setdefault(key, value)
        return merged

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read(found: Survey, storage: Storage, findings: Findings) -> Checkpoint:
    """Every header the checkpoint ``found`` needs, checked, and its tensors' slices."""
    reader = _Reader(found, storage, findings)
    if found.kind == CheckpointKind.SINGLE_FILE:
        return reader.whole_tensors([found.location.path], None)
    if found.kind == CheckpointKind.HF_SINGLE:
        return reader.whole_tensors([found.path(SINGLE_FILE_NAME)], None)
    if found.kind == CheckpointKind.HF_SHARDED and found.index is not None:
        return reader.hf_sharded(found.index)
    if found.kind == CheckpointKind.UNINDEXED:
        return reader.whole_tensors(sorted((found.path(n) for n in found.committed), key=natural_key),
                                    None)
    if found.kind == CheckpointKind.DISTRIBUTED and found.index is not None:
        return reader.distributed(*found.index)
    if found.kind == CheckpointKind.TORCH_DCP:
        return reader.torch_dcp()
    return Checkpoint(storage, found, {}, {})  # what is wrong is already reported


class _Reader:
    """The header-level checks of one surveyed checkpoint."""

    def __init__(self, found: Survey, storage: Storage, findings: Findings):
        self.found, self.storage, self.findings = found, storage, findings
        self.files: list[str] = []
        self.raw: dict[str, bytes] = {}  # file → its header's bytes, from its first
        self.listed: dict[str, object] = {}  # file → the whole crc32c its index lists (as written)

    def headers(self, files: list[str]) -> dict[str, Header]:
        """The valid headers among ``files``, in order; each invalid or missing file is a problem."""
        self.files = files
        def attempt(file: str) -> tuple[Header, bytes] | SafetensorsError:
            try:
                return read_header(self.storage, file)
            except SafetensorsError as e:
                return e
        with Executor(min(_HEADER_THREADS, len(files)), name="orbax_safetensors-headers") as pool:
            results = dict(zip(files, pool.map(attempt, files)))
        valid = {}
        for file, result in results.items():
            if isinstance(result, SafetensorsError):
                if not self.findings.collect:
                    raise result
                self.findings.problem(result.reason, result.file, result.tensor)
            else:
                valid[file], self.raw[file] = result
        return valid

    def checkpoint(self, tensors: dict[str, TensorSource], headers: dict[str, Header],
                   metadata: dict[str, str] | None = None) -> Checkpoint:
        return Checkpoint(self.storage, self.found, tensors, headers, metadata or {},
                          tuple(self.files), self.block_checksums(headers), self.raw)

    def block_checksums(self, headers: dict[str, Header]) -> StoredChecksums:
        """The block checksums each file stores, parsed when a check first needs them (a load
        that does not verify never does); ``verify`` parses them now, each malformed entry a
        problem of its file (never a silently unchecked load)."""
        stored = StoredChecksums(headers, self.findings.attempt, self.raw, self.listed)
        if self.findings.collect:
            stored.parse()
        return stored

    def whole_tensors(self, files: list[str], weight_map: dict[str, str] | None) -> Checkpoint:
        """Files of whole tensors: each tensor from the file ``weight_map`` places it in, or
        (no index) from the one file holding it; a name stored in two files is a problem of
        both (``hf_sharded`` reports those the index resolves)."""
        headers = self.headers(files)
        tensors: dict[str, TensorSource] = {}
        for file, header in headers.items():
            start = header.data_start
            for name, info in header.tensors.items():
                if weight_map is not None and weight_map.get(name) != file:
                    continue  # the index decides which file's copy is the tensor
                if name in tensors:
                    first = self.storage.split(tensors[name].slices[0].file)[1]
                    self.findings.problem(f"stored twice: in {first!r} and in this file (which "
                                          "copy is the tensor?)", file, name)
                    continue
                stored = StoredSlice(info, file, start + info.begin, (0,) * len(info.shape))
                tensors[name] = TensorSource(info.dtype, info.shape, (stored,))
        return self.checkpoint(tensors, headers)

    def hf_sharded(self, index: HFIndex) -> Checkpoint:
        files = {name: self.found.path(name) for name in index.files}
        listed = {tensor: files[name] for tensor, name in index.weight_map.items()}
        self.listed = {files[name]: crc for name, crc in listed_crcs(index.metadata).items()
                       if name in files}
        checkpoint = self.whole_tensors(list(files.values()), listed)
        headers = checkpoint.headers
        for tensor, file in listed.items():
            if file in headers and tensor not in headers[file].tensors:
                self.findings.problem(
                    "the index places this tensor here, but the file does not hold it", file, tensor)
        for file, header in headers.items():
            for tensor in header.tensors:
                if tensor not in listed:
                    self.findings.tolerated("holds a tensor the index does not list", file, tensor)
                elif listed[tensor] != file:
                    # transformers reads every tensor of every file the index names (the last
                    # copy wins), we the one the index places: two readers, two models.
                    self.findings.problem(
                        "stored twice: the index places this tensor in "
                        f"{self.storage.split(listed[tensor])[1]!r}, and this file holds "
                        "another copy (which copy is the tensor?)", file, tensor)
        total = index.metadata.get("total_size")
        stored = sum(t.nbytes for t in checkpoint.tensors.values())
        if total is not None and len(checkpoint.tensors) == len(listed) \
                and not (isinstance(total, int) and total == stored):
            self.findings.tolerated(f"metadata.total_size is {total!r}, but the tensors hold "
                                    f"{stored} bytes", self.found.path(INDEX_NAME))
        return checkpoint

    def distributed(self, entries: dict[str, DistributedTensor], metadata: dict[str, str],
                    crcs: dict[str, str]) -> Checkpoint:
        """Our distributed layout: the index says where every slice is; each file's own
        ``DCP_SHARDING_INFO`` must agree (equal-shaped slices with swapped offsets would
        otherwise load swapped)."""
        files = sorted({self.found.path(s.file) for t in entries.values() for s in t.slices})
        self.listed = {self.found.path(name): crc for name, crc in crcs.items()}
        headers = self.headers(files)
        tensors, placed = {}, collections.defaultdict(set)
        declared: dict[str, dict[str, tuple[int, ...]] | SafetensorsError] = {}

        def declared_in(file: str) -> dict[str, tuple[int, ...]]:
            """A file's DCP_SHARDING_INFO, parsed once (per slice, 2000 slices took 19 s)."""
            if file not in declared:
                try:
                    declared[file] = dcp_offsets(headers[file].metadata, file=file)
                except SafetensorsError as e:
                    declared[file] = e
            if isinstance(declared[file], SafetensorsError):
                raise declared[file]
            return declared[file]

        for name, entry in entries.items():
            slices = []
            for s in entry.slices:
                file = self.found.path(s.file)
                placed[file].add(name)
                if file not in headers:
                    continue  # already reported
                problem = self.findings.attempt(
                    lambda: _slice_problem(name, entry, s, headers[file], declared_in, file=file))
                if problem is not None:
                    self.findings.problem(problem, file, name)
                    continue
                info = headers[file].tensors[name]
                slices.append(StoredSlice(info, file, headers[file].data_start + info.begin, s.offsets))
            if len(slices) == len(entry.slices):
                tensors[name] = TensorSource(entry.dtype, entry.shape, tuple(slices))
        for file, header in headers.items():
            for name in sorted(set(header.tensors) - placed[file]):
                self.findings.tolerated("holds a tensor the distributed index does not place here",
                                        file, name)
        return self.checkpoint(tensors, headers, metadata)

    def torch_dcp(self) -> Checkpoint:
        """torch DCP ``save_sharded`` output: slices and offsets from every file's header."""
        url = self.found.location.url
        files = sorted(self.found.path(n) for n in self.found.committed)
        headers = self.headers(files)
        found: dict[str, list[StoredSlice]] = collections.defaultdict(list)
        for file, header in headers.items():
            offsets = self.findings.attempt(lambda: dcp_offsets(header.metadata, file=file)) or {}
            for name, info in header.tensors.items():
                origin = offsets.get(name, (0,) * len(info.shape))
                if len(origin) != len(info.shape):
                    self.findings.problem(f"saved_offsets {list(origin)} do not match the "
                                          "slice's rank", file, name)
                    continue
                found[name].append(StoredSlice(info, file, header.data_start + info.begin, origin))
        tensors = {}
        for name, slices in sorted(found.items()):
            dtypes = {s.info.dtype for s in slices}
            if len(dtypes) > 1:
                self.findings.problem(
                    f"slices disagree on the dtype: {sorted(d.code for d in dtypes)}", url, name)
                continue
            shape = tuple(max(s.origin[d] + s.info.shape[d] for s in slices)
                          for d in range(len(slices[0].info.shape)))
            entries = [SliceEntry(s.file, s.origin, s.info.shape) for s in slices]
            if self.findings.attempt(lambda: check_slices(name, shape, entries, file=url) or True):
                tensors[name] = TensorSource(slices[0].info.dtype, shape, tuple(slices))
        return self.checkpoint(tensors, headers)


def _slice_problem(name: str, entry: DistributedTensor, stored: SliceEntry, header: Header,
                   declared_in: Callable[[str], dict[str, tuple[int, ...]]], *, file: str) -> str | None:
    """What is wrong with the file holding one slice the distributed index lists, if anything
    (``declared_in``: the slice offsets a file's header declares, ``dcp_offsets``)."""
    info = header.tensors.get(name)
    if info is None or info.shape != stored.shape or info.dtype != entry.dtype:
        held = "no such tensor" if info is None else f"{info.dtype.code} {list(info.shape)}"
        return (f"the distributed index places a {entry.dtype.code} slice of shape "
                f"{list(stored.shape)} here, but the file holds {held}")
    declared = declared_in(file).get(name)
    if declared is not None and declared != stored.offsets:
        return (f"DCP_SHARDING_INFO puts this slice at {list(declared)}, the distributed index "
                f"at {list(stored.offsets)}")
    return None


def open_checkpoint(location: Location) -> Checkpoint:
    """The committed checkpoint at ``location``, every file it needs opened as one snapshot.

    Each file is pinned on its first read, and the result is kept only if
    every pinned name still points at what was read once all headers are in:
    otherwise an overwrite committed meanwhile, and the checkpoint is opened
    again. A file that is missing, or a problem found while the directory
    changed, is looked at again too: a commit may have run to completion
    between the listing and the read. Close the result (a context manager).
    """
    storage = location.storage
    for attempt in SNAPSHOT_REREADS.tries():
        view = _view_or_none(location)
        snapshot = storage.snapshot()
        found = None
        try:
            found = survey(location, Findings(collect=False), snapshot, view=view)
            if found.kind == CheckpointKind.NOTHING:
                raise_missing(location)
            checkpoint = read(found, snapshot, Findings(collect=False))
        except Exception as e:
            snapshot.close()
            # What the listing shows (no index: an interrupted save; an index that does not
            # parse) is the state of the location, not a race; what reading the files finds
            # may be (a file replaced or gone since the listing) if the directory changed. A
            # missing file may also be a commit that ran to completion between the two.
            raced = isinstance(e, MissingFileError) and attempt + 1 < _MISSING_ATTEMPTS or (
                found is not None and _view_or_none(location) != view)
            if raced and attempt + 1 < SNAPSHOT_REREADS.attempts:
                continue
            raise
        if checkpoint.unchanged():
            return checkpoint
        snapshot.close()
    raise CheckpointChangedError(
        f"the checkpoint kept changing while it was being opened ({attempt + 1} attempts)",
        file=location.url)


def detect_kind(location: Location) -> CheckpointKind:
    """What kind of checkpoint is at ``location``, from its listing and index alone (no header
    is read), for a caller that chooses what to do by it (``convert``). Raises as a load would
    where there is none: ``FileNotFoundError`` where nothing is, ``SafetensorsError`` naming
    what is there instead (an interrupted save, a directory of other files)."""
    found = survey(location, Findings(collect=False))
    if found.kind == CheckpointKind.NOTHING:
        raise_missing(location)
    return found.kind


def _view_or_none(location: Location) -> DirectoryView | None:
    """The directory's view; ``None`` for a single file or where there is none to read."""
    if location.is_single_file:
        return None
    try:
        return read_view(location.storage, location.path)
    except OSError:
        return None


def raise_missing(location: Location) -> None:
    """Raises ``MissingFileError``: nothing is at ``location``, and why (``missing_reason``)."""
    what = "file" if location.is_single_file else "checkpoint"
    raise MissingFileError(f"no safetensors {what} here: it {missing_reason(location).removeprefix('file ')}; "
                           "check the path", file=location.url)


def missing_reason(location: Location) -> str:
    """Why nothing is at ``location``: it does not exist, or is a link to something missing
    (which ``ls`` shows, so "does not exist" alone would puzzle)."""
    kind = location.storage.special_kind(location.path)
    return "file does not exist" if kind is None else f"file is {kind}"

