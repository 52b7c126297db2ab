"""``save``: a PyTree of arrays → an HF-compatible safetensors checkpoint.

Commit protocol, the same on every backend: each data file is written under a
temporary name and renamed into place, and the index (for sharded
checkpoints) is written last. A reader therefore sees either the previous
committed checkpoint or the new one, never a half-written file under a final
name. The one exception is a crash in the short window of an *overwrite*
after the old index is removed: then no checkpoint is visible, which the
reader reports as an interrupted save rather than mixing old and new shards.
The distributed layout's files would read as torch DCP output without their
index, so its index is written under its temporary name *before* they are
renamed in, and renamed last: the reader takes shard files next to that
temporary for an interrupted save.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import (
    is_interrupted_distributed_save,
    is_single_file,
    read_index,
)
from orbax_safetensors.engine.coordination import (
    barrier,
    gather_to_all,
    next_operation_key,
    share_from_primary,
)
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.format import dtype_for_numpy, to_bytes
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    DistributedTensor,
    SliceEntry,
    is_distributed_file_name,
    is_shard_file_name,
    parse_distributed_index,
    parse_index,
    serialize_distributed_index,
)
from orbax_safetensors.planning import (
    Box,
    FilePlan,
    ReadOp,
    Runs,
    SavePlan,
    SliceSpec,
    TensorSpec,
    box_shape,
    byte_runs,
    coalesce,
    full_box,
    normalize_index,
    plan_distributed_files,
    plan_hf_checkpoint,
    plan_regions,
    plan_single_file,
    relative_slices,
)
from orbax_safetensors.planning import mapping as mapping_rules
from orbax_safetensors.planning.mapping import Transform
from orbax_safetensors.storage import Storage, storage_for

LAYOUTS = ("hf", "distributed")
_WRITE_CHUNK_BYTES = 64 << 20
_WRITE_THREADS = 8
_MAX_PARTS_PER_FILE = 64  # beyond this a process packs its small ranges of a file into one object
_SMALL_PART = 4 << 20  # a part smaller than this costs more in requests than it moves
_VIEWS_PER_WRITE = 1024  # buffers per pwritev (Linux's IOV_MAX)
_TEMPORARY = re.compile(r"^\.(.+\.safetensors|.+\.json)\.(tmp-[0-9a-f]{12}|part-[0-9a-f]{12}-\d{20})$")


@dataclasses.dataclass
class SaveStats:
    """What one process's save cost; the result of ``save`` and of ``async_save(...).result()``.

    ``bytes_written`` counts tensor bytes this process wrote: the shards it
    holds with ``replica_id == 0``, so across processes every byte is written
    exactly once. ``blocking_seconds`` is how long ``async_save`` held the
    caller (the device→host copies); ``seconds`` runs until the commit.
    """

    bytes_written: int = 0
    requests: int = 0
    files: int = 0
    blocking_seconds: float = 0.0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A shard this process writes: its box in the tensor and a host copy of its values."""

    name: str
    box: Box
    data: np.ndarray | tuple[np.ndarray, ...]  # a tuple: row blocks of the box, in order


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    layout: str = "hf",
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
) -> SaveStats:
    """Saves the arrays of ``tree`` as safetensors, named by their key paths; blocks until committed.

    Every process calls it with its part of the same global arrays. All
    processes derive the same plan (files, headers, offsets) on their own;
    each writes the bytes of the shards it holds with ``replica_id == 0``
    straight into the shared files, so nothing is gathered onto one process
    and no byte is written twice.

    Args:
      path: ``.../name.safetensors`` writes exactly that one file; any other
        path is a checkpoint directory (``model.safetensors``, or
        ``model-0000i-of-0000N.safetensors`` plus the index when the tensors
        exceed ``max_shard_size``). Any fsspec URL; several processes need a
        filesystem they share (local/NFS/GCSFuse paths).
      tree: a PyTree of ``jax.Array`` (any sharding, across processes) or numpy
        arrays (written by process 0).
      layout: ``"hf"``, whole tensors in the Hugging Face layout.
      max_shard_size: bytes per file, as an int or a string like ``"5GB"``.
      metadata: str→str stored in every file's ``__metadata__`` (next to
        ``"format": "pt"``, which transformers requires).
      overwrite: replace a checkpoint already at ``path`` instead of refusing.
      storage_options: constructor arguments of the fsspec filesystem (credentials,
        ``endpoint_url``, ...), e.g. ``{"anon": True}``; or
      filesystem: an fsspec filesystem you already configured (``s3fs.S3FileSystem(...)``).
      mapping: an ``ost.Mapping`` from checkpoint names and layouts to the tree's;
        each leaf is stored under its mapped name, each shard transposed or
        reshaped on the host into the stored box(es) it covers.
    """
    return prepare_save(path, tree, layout=layout, max_shard_size=max_shard_size,
                        metadata=metadata, overwrite=overwrite, copy=False,
                        storage_options=storage_options, filesystem=filesystem,
                        mapping=mapping).start().result()


def async_save(
    path: str | os.PathLike,
    tree: Any,
    *,
    layout: str = "hf",
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
) -> concurrent.futures.Future[SaveStats]:
    """Like ``save``, but returns once this process's shards are copied to host memory.

    The caller may then mutate or donate its arrays: the files are written by
    a background thread from the host copies. The returned future resolves
    to ``SaveStats`` once the checkpoint is committed on every process, or
    raises what went wrong (on every process). The interpreter waits for a
    pending save at exit, so nothing is lost by returning early.
    """
    return prepare_save(path, tree, layout=layout, max_shard_size=max_shard_size,
                        metadata=metadata, overwrite=overwrite, copy=True,
                        storage_options=storage_options, filesystem=filesystem,
                        mapping=mapping).start()


def prepare_save(
    path: str | os.PathLike,
    tree: Any,
    *,
    layout: str,
    max_shard_size: int | str,
    metadata: Mapping[str, str] | None,
    overwrite: bool,
    copy: bool,
    new_directory: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
) -> SaveJob:
    """Plans and takes this process's shards to the host; ``start()`` on the result writes.

    The split lets a caller hold the writes back until the directory may be
    touched (Orbax creates a step's directories in the background, after the
    handler returns) while the caller's arrays are already free again.
    ``copy=False`` (the blocking ``save``) views the shards where the platform
    allows (on CPU, the device buffers themselves): the caller waits for the
    writer, so its arrays cannot change underneath it, and a gigabyte memcpy
    is saved. ``new_directory``: the caller creates ``path`` for this save
    (Orbax's step temporary, which Orbax may still be clearing out of a crashed
    attempt), so nothing already there is looked at.
    """
    started = time.perf_counter()
    arrays, specs = check_tree(tree, layout)
    tree_specs, transforms = specs, None
    if mapping is not None:  # plan in stored names and shapes; pieces are mapped below
        specs, transforms = mapping.map_specs(specs)
    storage, target = storage_for(path, storage_options, filesystem)
    if is_single_file(path):
        if layout == "distributed":
            raise ValueError(f"{os.fspath(path)!r}: the distributed layout is a directory of files")
        directory, file_name = storage.split(target)
        plan = plan_single_file(file_name, specs, metadata)
        committed = previous = {target} if storage.exists(target) else set()
    else:
        directory = target
        plan = plan_hf_checkpoint(specs, max_shard_size=max_shard_size, metadata=metadata)
        committed, previous = (set(), set()) if new_directory else directory_files(storage, directory)
    if committed and not overwrite:
        raise FileExistsError(
            f"{os.fspath(path)!r} already holds a checkpoint; pass overwrite=True to replace it")
    pieces = _host_pieces(arrays, {s.name: s for s in tree_specs}, copy=copy, transforms=transforms)
    key = next_operation_key("save")
    token = share_from_primary(f"{key}/token", uuid.uuid4().hex[:12])
    stats = SaveStats(blocking_seconds=time.perf_counter() - started)
    if layout == "distributed":
        pieces = _merge_pieces(pieces, {s.name: s for s in specs})
        job: SaveJob = DistributedSaveJob(
            storage, directory, plan, previous, pieces, key, token, stats, started,
            specs={s.name: s for s in specs}, max_shard_size=max_shard_size,
            metadata=dict(metadata or {}))
    else:
        job = SaveJob(storage, directory, plan, previous, pieces, key, token, stats, started,
                      single_file=is_single_file(path))
    return job


def check_tree(tree: Any, layout: str = "hf") -> tuple[dict[str, Any], list[TensorSpec]]:
    """Names each leaf and checks it can be stored, from shapes and dtypes alone (no data moves).

    Run where the mistake is made: Orbax's save arguments call it on
    construction, before Orbax starts a step it would then have to abandon.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    names, leaves, _ = flatten_with_names(tree)
    arrays = dict(zip(names, (_checked_array(n, leaf) for n, leaf in zip(names, leaves))))
    return arrays, [_spec(name, array) for name, array in arrays.items()]


def _checked_array(name: str, leaf: Any) -> jax.Array | np.ndarray:
    if isinstance(leaf, jax.Array):
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    raise TypeError(
        f"leaf {name!r} is a {type(leaf).__name__}, not an array; safetensors stores "
        "arrays only (convert scalars with np.asarray, or drop the leaf)")


def _spec(name: str, array: jax.Array | np.ndarray) -> TensorSpec:
    try:
        dtype = dtype_for_numpy(array.dtype)
    except ValueError as e:
        raise ValueError(f"leaf {name!r}: {e}") from None
    spec = TensorSpec(name, dtype, tuple(array.shape))
    try:
        spec.nbytes
    except ValueError as e:
        raise ValueError(f"leaf {name!r}: {e}") from None
    return spec


def _host_pieces(
    arrays: Mapping[str, Any], specs: Mapping[str, TensorSpec], *, copy: bool,
    transforms: Mapping[str, tuple[str, Transform]] | None = None,
) -> list[_Piece]:
    """Host values of the shards this process writes (``replica_id == 0``).

    All device→host transfers are started before the first is awaited. With
    ``copy`` (``async_save``) the caller may donate or overwrite its arrays as
    soon as we return, so accelerator shards are copied to host memory and
    numpy leaves are copied. CPU shards are not: their immutable buffers
    already are host memory, and the view we keep is a reference XLA honours
    (a donation of a still-referenced buffer is skipped, not performed), so a
    gigabyte memcpy on the caller's critical path buys nothing there.
    """
    owned = []
    for name, array in arrays.items():
        shape = specs[name].shape
        if isinstance(array, jax.Array):
            for shard in array.addressable_shards:
                if shard.replica_id == 0:
                    shard.data.copy_to_host_async()
                    owned.append((name, normalize_index(shard.index, shape), shard.data))
        elif jax.process_index() == 0:
            owned.append((name, full_box(shape), array))
    pieces = [_Piece(name, box, np.array(data, copy=True if copy and _copied(data) else None))
              for name, box, data in owned]
    for piece in pieces:
        if specs[piece.name].dtype.is_packed and piece.box != full_box(specs[piece.name].shape):
            raise ValueError(
                f"leaf {piece.name!r}: {specs[piece.name].dtype.code} packs values below a byte, "
                "so it can only be saved from an unsharded (replicated) array")
    return pieces if transforms is None else _map_pieces(pieces, transforms, copy=copy)


def _map_pieces(pieces: list[_Piece], transforms: Mapping[str, tuple[str, Transform]],
                *, copy: bool) -> list[_Piece]:
    """Tree shards → stored names, boxes and bytes, one shard at a time (see ``Mapping``).

    A transposed shard is a fresh array; a merely reshaped one may still view
    the caller's, so ``async_save`` copies it like any other shard.
    """
    mapped = []
    for piece in pieces:
        stored, transform = transforms[piece.name]
        for box, data in transform.to_stored(piece.box, piece.data):
            if copy and np.may_share_memory(data, piece.data):
                data = data.copy()
            mapped.append(_Piece(stored, box, data))
    return mapped


def _copied(data: Any) -> bool:
    """Whether ``async_save`` must copy this value (see ``_host_pieces``)."""
    return not isinstance(data, jax.Array) or any(d.platform != "cpu" for d in data.devices())


@dataclasses.dataclass
class SaveJob:
    """Writes planned files and commits them, agreeing with the other processes.

    The half of a save that runs after the host copies (on a background thread
    for ``async_save``); ``consolidate`` uses its streaming writer and commit.
    """

    storage: Storage
    directory: str
    plan: SavePlan
    previous: set[str]
    pieces: list[_Piece]
    key: str
    token: str
    stats: SaveStats
    started: float
    single_file: bool = False
    """A ``.safetensors`` path: the directory is shared with other files (and other saves)."""

    def start(self) -> concurrent.futures.Future[SaveStats]:
        """Writes and commits on a background thread; the future gives the stats or the error."""
        future: concurrent.futures.Future[SaveStats] = concurrent.futures.Future()
        threading.Thread(target=self.run, args=(future,), name="orbax_safetensors-save").start()
        return future

    def run(self, future: concurrent.futures.Future) -> None:
        try:
            if self.storage.supports_offset_writes:
                self._write_in_place()
            elif jax.process_count() > 1 or not self.storage.cheap_rename:
                self._write_in_parts()
            else:
                self._write_streaming()
            self.stats.seconds = time.perf_counter() - self.started
            future.set_result(self.stats)
        except BaseException as e:  # the caller sees it through the future
            future.set_exception(e)

    def _temporary(self, name: str) -> str:
        """Where a file is written before the commit.

        A temporary name where renaming is cheap. On object stores a rename is
        a full copy, so files go straight to their final names: the old
        checkpoint is uncommitted first (``_begin_direct_writes``) and the
        index, written last, is still the commit marker (a single-file
        checkpoint appears atomically when its one object is complete).
        """
        if not self.storage.cheap_rename:
            return self.storage.join(self.directory, name)
        return self._staged(name)

    def _staged(self, name: str) -> str:
        """This save's temporary name for ``name`` (removed by the next successful save)."""
        return self.storage.join(self.directory, f".{name}.tmp-{self.token}")

    def _begin_direct_writes(self) -> None:
        """Process 0 uncommits the old checkpoint before final names are overwritten."""
        if not self.storage.cheap_rename and jax.process_index() == 0:
            self._uncommit()

    def _write_in_place(self) -> None:
        """Process 0 creates every file at its final size; each process fills its runs."""
        primary = jax.process_index() == 0
        created = ""
        if primary:
            try:
                self.storage.makedirs(self.directory)
                for file in self.plan.files:
                    self.storage.create_sized(self._temporary(file.name), file.size, file.header)
            except Exception as e:
                created = f"process 0 could not create the files: {type(e).__name__}: {e}"
        created = share_from_primary(f"{self.key}/created", created)
        if created:
            raise OSError(created)
        problem = ""
        try:
            self._write_pieces()
        except Exception as e:
            problem = f"process {jax.process_index()}: {type(e).__name__}: {e}"
        problems = [p for p in gather_to_all(f"{self.key}/written", problem) if p]
        if problems:
            if primary:
                self.storage.discard(self._temporary(file.name) for file in self.plan.files)
            raise OSError("save failed, nothing was committed: " + "; ".join(problems))
        if primary:
            self._commit()
        barrier(f"{self.key}/committed")

    def _owned_ranges(self, chunk_bytes: int) -> tuple[list[memoryview], list[tuple[str, ReadOp]]]:
        """This process's bytes per file as contiguous ranges (split at ``chunk_bytes``).

        Returns the payload of each piece and, per range, the file and the
        pieces (by payload index) that fill it in order.
        """
        location = {t.name: (f, t) for f in self.plan.files for t in f.tensors}
        runs_by_file: dict[str, list[Runs]] = collections.defaultdict(list)
        payloads = [to_bytes(piece.data) for piece in self.pieces]
        for index, piece in enumerate(self.pieces):
            file, info = location[piece.name]
            start = file.data_start + info.begin
            if info.dtype.is_packed:  # whole tensor, checked in _host_pieces
                offsets, length = np.zeros(1, np.int64), info.nbytes
            else:
                offsets, length = byte_runs(piece.box, info.shape, info.dtype.bits // 8)
            runs_by_file[file.name].append(Runs(
                offsets + start, np.full(len(offsets), length, np.int64),
                np.full(len(offsets), index, np.int64), np.arange(len(offsets)) * length))
        ranges = [
            (file_name, op)
            for file_name, runs in runs_by_file.items()
            for op in coalesce(Runs.concatenate(runs), max_gap=0, max_overread=1.0,
                               chunk_bytes=chunk_bytes)
        ]
        return payloads, ranges

    def _write_pieces(self) -> None:
        payloads, writes = self._owned_ranges(_WRITE_CHUNK_BYTES)

        def write(file_name: str, op: ReadOp) -> None:
            # Views a batch at a time: a range of strided shards holds a run per row of each,
            # and a memoryview per run for a whole 64 MB range costs more than its bytes.
            offset = op.offset
            for start in range(0, len(op.pieces), _VIEWS_PER_WRITE):
                batch = op.pieces[start:start + _VIEWS_PER_WRITE]
                self.storage.write_at(self._temporary(file_name), offset, [
                    payloads[p.target][p.offset:p.offset + p.length] for p in batch])
                offset += sum(p.length for p in batch)

        files = sorted({name for name, _ in writes})
        with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
            for done in [pool.submit(write, name, op) for name, op in writes]:
                done.result()
            list(pool.map(lambda name: self.storage.sync(self._temporary(name)), files))
        self.stats.bytes_written = sum(len(p) for p in payloads)
        self.stats.requests = len(writes)
        self.stats.files = len(files)

    def _write_in_parts(self) -> None:
        """Object stores: parts uploaded in parallel by their owners, merged by process 0.

        Each process uploads the contiguous ranges of a file it owns, cut at
        ``_WRITE_CHUNK_BYTES``, as part objects (in parallel, and each one
        retried on its own); process 0 adds the headers, then assembles each
        file from its parts with the store's server-side concatenation (GCS
        compose, S3 multipart copy), so tensor bytes never pass through
        another process unless the store's part rules force it.
        """
        payloads, ranges = self._owned_ranges(_WRITE_CHUNK_BYTES)
        by_file: dict[str, list[tuple[int, int, list[memoryview]]]] = collections.defaultdict(list)
        for name, op in ranges:
            by_file[name].append((op.offset, op.length, [
                payloads[p.target][p.offset:p.offset + p.length] for p in op.pieces]))
        if jax.process_index() == 0:
            for f in self.plan.files:
                by_file[f.name].append((0, len(f.header), [f.header]))
        # parts: (file, offset, length, object, offset in object). A process uploads one
        # object per range; one owning many small ranges of a file (strided shards) packs
        # them into one object instead, read back sequentially.
        parts = []
        for name, spans in by_file.items():
            spans = _join_small_neighbours(sorted(spans, key=lambda span: span[0]))
            if len(spans) <= _MAX_PARTS_PER_FILE or sum(n for _, n, _ in spans) >= len(spans) * _SMALL_PART:
                parts += [(name, o, n, self._part(name, o), 0, views) for o, n, views in spans]
            else:
                packed, position = self._part(name, spans[0][0]), 0
                for o, n, views in spans:
                    parts.append((name, o, n, packed, position, views))
                    position += n
        uploads: dict[str, list[memoryview]] = collections.defaultdict(list)
        for part in parts:
            uploads[part[3]].extend(part[5])
        problem = ""
        try:
            self.storage.makedirs(self.directory)
            self._begin_direct_writes()
            with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
                list(pool.map(lambda item: self.storage.write(*item), uploads.items()))
        except Exception as e:
            problem = f"process {jax.process_index()}: {type(e).__name__}: {e}"
        report = json.dumps({"problem": problem, "parts": [p[:5] for p in parts]})
        reports = [json.loads(r) for r in gather_to_all(f"{self.key}/parts", report)]
        problems = [r["problem"] for r in reports if r["problem"]]
        if jax.process_index() == 0:
            every = [p for r in reports for p in r["parts"]]
            try:
                if not problems:
                    self._assemble_parts(every)
            except Exception as e:
                problems.append(f"process 0 could not assemble the files: {type(e).__name__}: {e}")
            part_objects = {p[3] for p in every}
            if problems:
                self.storage.discard(part_objects)
            else:
                with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
                    list(pool.map(self.storage.remove, part_objects))
        problems = [p for p in gather_to_all(f"{self.key}/merged", "; ".join(problems)) if p]
        if problems:
            if jax.process_index() == 0:
                self.storage.discard(self._temporary(file.name) for file in self.plan.files)
            raise OSError("save failed, nothing was committed: " + problems[0])
        if jax.process_index() == 0:
            self._commit()
        barrier(f"{self.key}/committed")
        self.stats.bytes_written = sum(len(p) for p in payloads)
        self.stats.requests = len(uploads)
        self.stats.files = len(by_file)

    def _assemble_parts(self, parts: list[list]) -> None:
        """Process 0: each file from its parts, server-side where each part is one object."""
        by_file = collections.defaultdict(list)
        for name, offset, length, path, position in parts:
            by_file[name].append((offset, length, path, position))
        for file in self.plan.files:
            spans = sorted(by_file[file.name])
            covered = sum(n for _, n, _, _ in spans)
            if covered != file.size or any(a[0] + a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise OSError(f"{file.name}: the processes' parts do not tile the file")
            if len({path for _, _, path, _ in spans}) == len(spans):
                self.storage.merge(self._temporary(file.name), [p for _, _, p, _ in spans],
                                   [n for _, n, _, _ in spans])
            else:  # packed parts: read each object front to back, in file order
                self.storage.write(self._temporary(file.name), _read_spans(self.storage, spans))

    def _part(self, name: str, offset: int) -> str:
        return self.storage.join(self.directory, f".{name}.part-{self.token}-{offset:020d}")

    def _write_streaming(self) -> None:
        """One process, no offset writes nor server-side concatenation (memory://): each file
        front to back."""
        by_name = collections.defaultdict(list)
        for piece in self.pieces:
            by_name[piece.name].append(piece)

        def chunks(file: FilePlan) -> Iterator[memoryview | bytes]:
            yield file.header
            for info in file.tensors:
                yield to_bytes(_assemble(info, by_name[info.name]))

        self.stream_files(self.plan.files, chunks)
        self.stats.bytes_written = sum(p.data.nbytes for p in self.pieces)
        self.stats.requests = self.stats.files = len(self.plan.files)

    def stream_files(self, mine: Sequence[FilePlan],
                     chunks: Callable[[FilePlan], Iterable[memoryview | bytes]]) -> None:
        """Writes this process's files front to back; then all agree and process 0 commits."""
        problem = ""
        try:
            self.storage.makedirs(self.directory)
            self._begin_direct_writes()
        except Exception as e:
            problem = f"process {jax.process_index()}: {type(e).__name__}: {e}"
        barrier(f"{self.key}/uncommitted")  # nobody overwrites a file the old index names
        if not problem:
            try:
                for file in mine:
                    self.storage.write(self._temporary(file.name), chunks(file))
            except Exception as e:
                problem = f"process {jax.process_index()}: {type(e).__name__}: {e}"
        problems = [p for p in gather_to_all(f"{self.key}/written", problem) if p]
        if problems:
            self.storage.discard(self._temporary(file.name) for file in mine)
            raise OSError("nothing was committed: " + "; ".join(problems))
        if jax.process_index() == 0:
            self._commit()
        barrier(f"{self.key}/committed")

    def _uncommit(self) -> None:
        """Removes the old checkpoint's commit markers before any of its files change."""
        for name in (INDEX_NAME, DISTRIBUTED_INDEX_NAME):
            index_path = self.storage.join(self.directory, name)
            if index_path in self.previous:
                self.storage.remove(index_path)

    def _remove_stale(self, kept: set[str]) -> None:
        """Deletes the replaced checkpoint's files and temporaries of crashed saves.

        A checkpoint directory is the checkpoint's own; next to a single file, only that
        file's temporaries are ours (another save may be writing its neighbour right now).
        """
        storage, directory = self.storage, self.directory
        ours = {f.name for f in self.plan.files}
        leftovers = {
            storage.join(directory, name) for name in storage.listdir(directory)
            if (match := _TEMPORARY.match(name)) and (not self.single_file or match[1] in ours)}
        for stale in (self.previous - kept) | leftovers:
            storage.remove(stale)

    def _commit(self) -> None:
        """Renames the files into place and writes the index last, replacing ``previous``."""
        storage, directory = self.storage, self.directory
        final = {f.name: storage.join(directory, f.name) for f in self.plan.files}
        index_path = storage.join(directory, INDEX_NAME)
        self._uncommit()
        for name, path in final.items():
            if self._temporary(name) != path:
                storage.rename(self._temporary(name), path)
        if self.plan.index is not None:
            index_temporary = self._temporary(INDEX_NAME)
            storage.write(index_temporary, [self.plan.index])
            if index_temporary != index_path:
                storage.rename(index_temporary, index_path)
        self._remove_stale(
            set(final.values()) | ({index_path} if self.plan.index is not None else set()))


def _read_spans(storage: Storage, spans: list[tuple[int, int, str, int]]) -> Iterator[bytes]:
    """The bytes of ``spans`` in order, each object read sequentially through one reader."""
    readers: dict[str, Any] = {}
    try:
        for _, length, path, position in spans:
            reader = readers.get(path) or readers.setdefault(path, storage.open_read(path))
            reader.seek(position)
            yield reader.read(length)
    finally:
        for reader in readers.values():
            reader.close()


def _join_small_neighbours(
    spans: list[tuple[int, int, list[memoryview]]]
) -> list[tuple[int, int, list[memoryview]]]:
    """Sorted ``(offset, length, views)`` spans, a small span joined to the span right after it
    (a header and the first tensor bytes): one part fewer, and no part too small to merge."""
    joined: list[tuple[int, int, list[memoryview]]] = []
    for offset, length, views in spans:
        if joined and joined[-1][1] < _SMALL_PART and sum(joined[-1][:2]) == offset:
            start, size, before = joined.pop()
            joined.append((start, size + length, before + views))
        else:
            joined.append((offset, length, views))
    return joined


def _merge_pieces(pieces: list[_Piece], specs: Mapping[str, TensorSpec]) -> list[_Piece]:
    """One slice per tensor where this process's shards of it form a box.

    The distributed layout stores at most one slice of a tensor per file, so
    fewer, larger slices mean fewer files; shards that do not form a box stay
    separate slices (and spread over several files). Shards that are row
    blocks of the slice are written one after the other, not copied together.
    """
    by_name: dict[str, list[_Piece]] = collections.defaultdict(list)
    for piece in pieces:
        by_name[piece.name].append(piece)
    merged = []
    for name, group in by_name.items():
        regions = plan_regions(specs[name].shape, [p.box for p in group])
        if len(group) == 1 or len(regions) != 1:
            merged.extend(group)
            continue
        box = regions[0].box
        rows = sorted(group, key=lambda p: p.box)
        if all(p.box[1:] == box[1:] for p in rows):  # row blocks: concatenation in order
            merged.append(_Piece(name, box, tuple(p.data for p in rows)))
            continue
        merged.append(_Piece(name, box, _Gathered(box, tuple(group))))
    return merged


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """Shards that together form one slice, copied into it only when the slice is written:
    a file's tensors are gathered one at a time as the file streams out, not the whole
    tree up front (column shards of a tensor on one process, say)."""

    box: Box
    shards: tuple[_Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.shards)

    def array(self) -> np.ndarray:
        data = np.empty(box_shape(self.box), self.shards[0].data.dtype)
        for piece in self.shards:
            data[relative_slices(piece.box, self.box)] = piece.data
        return data


def _payload(data: np.ndarray | tuple[np.ndarray, ...] | _Gathered) -> list[memoryview]:
    """The on-disk bytes of a piece: one array, row blocks back to back, or gathered shards."""
    if isinstance(data, _Gathered):
        return [to_bytes(data.array())]
    return [to_bytes(a) for a in (data if isinstance(data, tuple) else (data,))]


def _payload_nbytes(data: np.ndarray | tuple[np.ndarray, ...] | _Gathered) -> int:
    return data.nbytes if isinstance(data, _Gathered) else sum(len(b) for b in _payload(data))


@dataclasses.dataclass
class DistributedSaveJob(SaveJob):
    """Each process writes whole files of its own slices; process 0 writes the index last."""

    specs: Mapping[str, TensorSpec] = dataclasses.field(default_factory=dict)
    max_shard_size: int | str = "5GB"
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    def run(self, future: concurrent.futures.Future) -> None:
        try:
            self._write_distributed()
            self.stats.seconds = time.perf_counter() - self.started
            future.set_result(self.stats)
        except BaseException as e:
            future.set_exception(e)

    def _begin_direct_writes(self) -> None:
        """Files go straight to their final names here, where without their index they would
        read as torch DCP output (some tensors, or old and new files mixed). So before any is
        written, process 0 leaves the temporary index name that marks them an interrupted save
        (``is_interrupted_distributed_save``) until the index is in place and it is removed."""
        if jax.process_index() == 0:
            self.storage.makedirs(self.directory)
            self.storage.write(self._staged(DISTRIBUTED_INDEX_NAME), [b"{}"])
        super()._begin_direct_writes()

    def _write_distributed(self) -> None:
        me = jax.process_index()
        data = {(p.name, p.box): p.data for p in self.pieces}
        files = plan_distributed_files(
            me, [SliceSpec(p.name, self.specs[p.name].dtype, p.box) for p in self.pieces],
            max_shard_size=self.max_shard_size, metadata=self.metadata)
        problem = ""
        if not self.storage.cheap_rename:  # files go to final names: uncommit the old first
            try:
                self._begin_direct_writes()
            except Exception as e:
                problem = f"process {me}: {type(e).__name__}: {e}"
            barrier(f"{self.key}/direct")
        try:
            if problem:
                raise OSError(problem)
            self.storage.makedirs(self.directory)
            for file, slices in files:
                order = {s.name: data[(s.name, s.box)] for s in slices}
                self.storage.write(self._temporary(file.name), itertools.chain(
                    [file.header],
                    itertools.chain.from_iterable(_payload(order[t.name]) for t in file.tensors)))
        except Exception as e:
            problem = f"process {me}: {type(e).__name__}: {e}"
        report = json.dumps({"problem": problem, "slices": [
            [s.name, file.name, [a for a, _ in s.box], list(s.shape)]
            for file, slices in files for s in slices]})
        reports = [json.loads(r) for r in gather_to_all(f"{self.key}/written", report)]
        problems = [r["problem"] for r in reports if r["problem"]]
        if problems:
            self.storage.discard(self._temporary(file.name) for file, _ in files)
            raise OSError("save failed, nothing was committed: " + "; ".join(problems))
        entries = [entry for r in reports for entry in r["slices"]]
        if me == 0:
            # The index first, under its temporary name: while it is there, the shard files being
            # renamed in are an uncommitted save, which a reader must not take for torch DCP
            # output (some of the tensors, or old and new files mixed).
            self._write_index(entries, commit=False)
            self._uncommit()
        barrier(f"{self.key}/uncommitted")
        for file, _ in files:
            final = self.storage.join(self.directory, file.name)
            if self._temporary(file.name) != final:
                self.storage.rename(self._temporary(file.name), final)
        barrier(f"{self.key}/renamed")
        if me == 0:
            self._write_index(entries, commit=True)
        barrier(f"{self.key}/committed")
        self.stats.bytes_written = sum(_payload_nbytes(p.data) for p in self.pieces)
        self.stats.requests = self.stats.files = len(files)

    def _write_index(self, entries: list[list], *, commit: bool) -> None:
        """``commit=False``: the index under its temporary name (where renames are cheap);
        ``commit=True``: the index in place, then the replaced files removed."""
        slices: dict[str, list[SliceEntry]] = collections.defaultdict(list)
        for name, file, offsets, shape in entries:
            slices[name].append(SliceEntry(file, tuple(offsets), tuple(shape)))
        tensors = {
            name: DistributedTensor(spec.dtype, spec.shape, tuple(slices[name]))
            for name, spec in self.specs.items()}
        index_path = self.storage.join(self.directory, DISTRIBUTED_INDEX_NAME)
        index_temporary = self._temporary(DISTRIBUTED_INDEX_NAME)
        staged = index_temporary != index_path  # object stores write the final name directly
        if not commit:
            if staged:
                self.storage.write(index_temporary, [serialize_distributed_index(tensors, self.metadata)])
            return
        if staged:
            self.storage.rename(index_temporary, index_path)
        else:
            self.storage.write(index_path, [serialize_distributed_index(tensors, self.metadata)])
        self._remove_stale({index_path} | {
            self.storage.join(self.directory, s.file) for t in tensors.values() for s in t.slices})


def _assemble(info, pieces: list[_Piece]) -> np.ndarray:
    """A whole tensor from the pieces one process holds of it (all of them, here)."""
    if len(pieces) == 1 and pieces[0].box == full_box(info.shape):
        return pieces[0].data
    whole = np.empty(info.shape, pieces[0].data.dtype)
    for piece in pieces:
        whole[tuple(slice(a, b) for a, b in piece.box)] = piece.data
    return whole


def directory_files(storage: Storage, directory: str) -> tuple[set[str], set[str]]:
    """``(committed, present)``: the files of the checkpoint in ``directory``, if one is
    committed, and every checkpoint file there (committed or left by a crash)."""
    if not storage.isdir(directory):
        return set(), set()
    names = set(storage.listdir(directory))
    committed: set[str] = set()
    for index_name, parse in ((INDEX_NAME, parse_index), (DISTRIBUTED_INDEX_NAME, None)):
        if index_name in names:
            committed.add(index_name)
            index_path = storage.join(directory, index_name)
            raw = read_index(storage, index_path)
            if parse is not None:
                committed |= set(parse(raw, file=index_path).files)
            else:
                tensors, _ = parse_distributed_index(raw, file=index_path)
                committed |= {s.file for t in tensors.values() for s in t.slices}
    if SINGLE_FILE_NAME in names:
        committed.add(SINGLE_FILE_NAME)
    if not committed and not any(is_shard_file_name(n) for n in names) \
            and not is_interrupted_distributed_save(names):
        # torch DCP output, which ``load`` reads, unless a save of ours was interrupted
        committed = {n for n in names if is_distributed_file_name(n)}
    present = committed | {
        n for n in names if is_shard_file_name(n) or is_distributed_file_name(n)}
    return ({storage.join(directory, n) for n in committed},
            {storage.join(directory, n) for n in present})
