"""``save``: a PyTree of arrays → an HF-compatible safetensors checkpoint.

Every process computes the same plan and writes the bytes it owns; process 0
then commits through the location's ``Commit`` strategy (``storage/commit.py``
knows the temporary names, the journal, the lock and the cleanup). Every step
that can fail ends in an agreement between the processes, so they stop
together and each raises its own original error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import existing_checkpoint, is_single_file
from orbax_safetensors.engine.coordination import (
    gather_to_all,
    next_operation_key,
    share_from_primary,
)
from orbax_safetensors.errors import DistributedError, ProcessFailure
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.format import dtype_for_numpy, to_bytes
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    DistributedTensor,
    SliceEntry,
    serialize_distributed_index,
)
from orbax_safetensors.planning import (
    Box,
    FilePlan,
    ReadOp,
    SavePlan,
    SliceSpec,
    TensorSpec,
    box_shape,
    full_box,
    normalize_index,
    owned_ranges,
    plan_distributed_files,
    plan_hf_checkpoint,
    plan_regions,
    plan_single_file,
    relative_slices,
)
from orbax_safetensors.planning import mapping as mapping_rules
from orbax_safetensors.planning.mapping import Transform
from orbax_safetensors.storage import Storage, storage_for
from orbax_safetensors.storage.commit import Commit

_LOG = logging.getLogger("orbax_safetensors")
_CANCEL_WAIT = 2.0  # seconds a cancelled save's clean-up may hold the caller
_POLL = 0.05  # seconds between looks at the cancel flag while writes are in flight
LAYOUTS = ("hf", "distributed")
_WRITE_CHUNK_BYTES = 64 << 20
_WRITE_THREADS = 8
_MAX_PARTS_PER_FILE = 64  # beyond this a process packs its small ranges of a file into one object
_SMALL_PART = 4 << 20  # a part smaller than this costs more in requests than it moves
_VIEWS_PER_WRITE = 1024  # buffers per pwritev (Linux's IOV_MAX)


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
    job = prepare_save(path, tree, layout=layout, max_shard_size=max_shard_size,
                       metadata=metadata, overwrite=overwrite, copy=False,
                       storage_options=storage_options, filesystem=filesystem, mapping=mapping)
    return wait_interruptibly(job, job.start())


def wait_interruptibly(job: SaveJob, future: concurrent.futures.Future[SaveStats]) -> SaveStats:
    """The job's result; Ctrl-C cancels it and raises ``KeyboardInterrupt`` promptly.

    A caller that sees ``KeyboardInterrupt`` knows nothing new was committed:
    cancelling and committing exclude each other (``SaveJob.cancel``). The
    writers stop at their next chunk and roll back; the caller waits for that
    up to ``_CANCEL_WAIT`` seconds (a disk may hold an uninterruptible ``fsync``
    longer), after which the clean-up finishes in the background, still
    holding the location's lock. An interrupt that comes after the commit point
    is too late to undo the save: it returns normally, with a warning.
    """
    try:
        return future.result()
    except KeyboardInterrupt:
        if not job.cancel():
            _LOG.warning("interrupted after %s was committed: the save is complete", job.directory)
            return future.result()
        try:
            future.exception(timeout=_CANCEL_WAIT)
        except (concurrent.futures.TimeoutError, KeyboardInterrupt):
            pass
        raise


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
    """Plans, takes the location, and copies this process's shards to the host; ``start()`` on
    the result writes.

    The split lets a caller hold the writes back until the directory may be
    touched (Orbax creates a step's directories in the background, after the
    handler returns) while the caller's arrays are already free again.
    ``copy=False`` (the blocking ``save``) views the shards where the platform
    allows (on CPU, the device buffers themselves): the caller waits for the
    writer, so its arrays cannot change underneath it, and a gigabyte memcpy
    is saved. ``new_directory``: the caller creates ``path`` for this save and
    owns it (Orbax's step temporary, which Orbax may still be clearing out of a
    crashed attempt), so nothing already there is looked at, locked or removed.
    """
    started = time.perf_counter()
    arrays, specs = check_tree(tree, layout)
    tree_specs, transforms = specs, None
    if mapping is not None:  # plan in stored names and shapes; pieces are mapped below
        specs, transforms = mapping.map_specs(specs)
    storage, target = storage_for(path, storage_options, filesystem)
    plan: SavePlan | None = None
    if is_single_file(path):
        if layout == "distributed":
            raise ValueError(f"{os.fspath(path)!r}: the distributed layout is a directory of files")
        directory, file_name = storage.split(target)
        plan = plan_single_file(file_name, specs, metadata)
    else:
        directory, file_name = target, None
        if layout == "hf":
            plan = plan_hf_checkpoint(specs, max_shard_size=max_shard_size, metadata=metadata)
    key = next_operation_key("save")
    commit = take_location(storage, directory, key, single_file=file_name, overwrite=overwrite,
                           url=os.fspath(path), fresh=new_directory)
    try:
        pieces = _host_pieces(arrays, {s.name: s for s in tree_specs}, copy=copy, transforms=transforms)
    except BaseException:
        commit.release()
        raise
    stats = SaveStats(blocking_seconds=time.perf_counter() - started)
    if layout == "distributed":
        return DistributedSaveJob(
            commit, plan, _merge_pieces(pieces, {s.name: s for s in specs}), key, stats, started,
            specs={s.name: s for s in specs}, max_shard_size=max_shard_size,
            metadata=dict(metadata or {}))
    return SaveJob(commit, plan, pieces, key, stats, started)


def take_location(storage: Storage, directory: str, key: str, *, single_file: str | None,
                  overwrite: bool, url: str, fresh: bool = False) -> Commit:
    """Process 0 locks the location and looks at what is there; every process gets the same
    ``Commit`` (token, the files it replaces), or every process raises.

    Refuses to replace a committed checkpoint unless ``overwrite``; debris of a
    save that never committed is no reason to refuse.
    """
    token = uuid.uuid4().hex[:12]
    commit = Commit.for_storage(storage, directory, token, (), single_file)
    error, old = None, set()
    if jax.process_index() == 0 and not fresh:
        try:
            commit.acquire()
            if single_file is not None:
                old = committed = {single_file} if storage.exists(commit.path(single_file)) else set()
            else:
                committed, old = existing_checkpoint(storage, directory)
            if committed and not overwrite:
                raise FileExistsError(errno.EEXIST, "already holds a checkpoint; pass "
                                      "overwrite=True to replace it", url)
            commit.clear_leftovers()
        except BaseException as e:
            commit.release()
            error = e
    shared = json.loads(share_from_primary(f"{key}/location", json.dumps({
        "token": token, "old": sorted(old),
        "error": "" if error is None else ProcessFailure.of(0, error).to_json()})))
    if error is not None:
        raise error
    if shared["error"]:
        failure = ProcessFailure.from_json(shared["error"])
        if failure.type == FileExistsError.__name__:  # the refusal, the same on every process
            raise FileExistsError(failure.errno, failure.message, failure.filename)
        raise DistributedError(f"{url}: process 0 could not begin the save", {0: failure})
    if jax.process_index() == 0:
        commit.old = frozenset(old)
        return commit
    return Commit.for_storage(storage, directory, shared["token"], shared["old"], single_file)


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
    Every step that can fail ends in an agreement (``_agree``): all processes
    learn of any failure and stop together, each raising its own original
    error where it had one.
    """

    commit: Commit
    plan: SavePlan
    pieces: list[_Piece]
    key: str
    stats: SaveStats
    started: float
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set by ``cancel``: the writers stop at their next chunk and nothing is committed."""
    committing: bool = False
    _guard: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def storage(self) -> Storage:
        return self.commit.storage

    @property
    def directory(self) -> str:
        return self.commit.directory

    def start(self) -> concurrent.futures.Future[SaveStats]:
        """Writes and commits on a background thread; the future gives the stats or the error."""
        future: concurrent.futures.Future[SaveStats] = concurrent.futures.Future()
        threading.Thread(target=self.run, args=(future,), name="orbax_safetensors-save").start()
        return future

    def cancel(self) -> bool:
        """Stops the writes and the commit where they are; False if it is too late (the
        commit point has been passed)."""
        with self._guard:
            if not self.committing:
                self.cancelled.set()
            return not self.committing

    def _at_commit_point(self) -> None:
        with self._guard:
            self._check_cancelled()
            self.committing = True

    def run(self, future: concurrent.futures.Future) -> None:
        try:
            try:
                self._write()
            finally:
                self.commit.release()
            self.stats.seconds = time.perf_counter() - self.started
            future.set_result(self.stats)
        except BaseException as e:  # the caller sees it through the future
            future.set_exception(e)

    def _write(self) -> None:
        if self.storage.supports_offset_writes:
            self._write_in_place()
        elif jax.process_count() > 1 or not self.storage.cheap_rename:
            self._write_in_parts()
        else:
            self._write_streaming()

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise KeyboardInterrupt("save cancelled")

    def _cancellable(self, chunks: Iterable[memoryview | bytes]) -> Iterator[memoryview | bytes]:
        for chunk in chunks:
            self._check_cancelled()
            yield chunk

    def _wait_all(self, futures: list[concurrent.futures.Future]) -> None:
        """Waits for ``futures``, raising the first error as it was, or ``KeyboardInterrupt``
        as soon as the save is cancelled (a write in flight cannot be interrupted; its
        outcome no longer matters)."""
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=_POLL, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    raise future.exception()
            self._check_cancelled()

    def _agree(self, step: str, error: BaseException | None,
               clean_up: Callable[[], None] = lambda: None) -> None:
        """Every process learns whether any failed at ``step``; then, if one did, all clean up
        and raise: the original exception where there is one (alone in one process), else a
        ``DistributedError`` keeping every process's failure."""
        me = jax.process_index()
        raw = gather_to_all(f"{self.key}/{step}",
                            "" if error is None else ProcessFailure.of(me, error).to_json())
        failures = {f.process: f for f in map(ProcessFailure.from_json, filter(None, raw))}
        if not failures:
            return
        clean_up()
        if error is not None and (len(failures) == 1 or isinstance(error, KeyboardInterrupt)):
            raise error
        raise DistributedError(f"{self.directory}: save failed, nothing was committed",
                               failures) from error

    def _primary(self, step: str, action: Callable[[], None],
                 clean_up: Callable[[], None] = lambda: None) -> None:
        """``action`` on process 0, then ``_agree`` on its outcome."""
        error = None
        if jax.process_index() == 0:
            try:
                action()
            except BaseException as e:
                error = e
        self._agree(step, error, clean_up)

    def _begin(self, **kwargs: Any) -> None:
        def begin() -> None:
            self.storage.makedirs(self.directory)
            self.commit.begin(**kwargs)
        self._primary("begun", begin)

    def _commit_files(self, names: Sequence[str], index: tuple[str, bytes] | None) -> None:
        """Process 0 commits; on a failure it has rolled back, and the files are discarded."""
        def commit() -> None:
            try:
                self.commit.commit(names, index, self._at_commit_point)
            except BaseException:
                self.commit.discard(list(names) + ([index[0]] if index else []))
                raise
        self._primary("committed", commit)

    def _commit_plan(self) -> None:
        index = (INDEX_NAME, self.plan.index) if self.plan.index is not None else None
        self._commit_files([f.name for f in self.plan.files], index)

    def _write_in_place(self) -> None:
        """Process 0 creates every file at its final size; each process fills its runs."""
        def create() -> None:
            self.storage.makedirs(self.directory)
            self.commit.begin()
            for file in self.plan.files:
                self._check_cancelled()
                self.storage.create_sized(self.commit.temporary(file.name), file.size, file.header)
        discard_all = lambda: self.commit.discard(f.name for f in self.plan.files)  # noqa: E731
        self._primary("created", create, discard_all)
        error = None
        try:
            self._write_pieces()
        except BaseException as e:
            error = e
        self._agree("written", error, discard_all if jax.process_index() == 0 else lambda: None)
        self._commit_plan()

    def _owned_ranges(self, chunk_bytes: int) -> tuple[list[memoryview], list[tuple[str, ReadOp]]]:
        """The payload of each piece, and this process's ranges of each file (``owned_ranges``)."""
        ranges = owned_ranges(self.plan.files, [(p.name, p.box) for p in self.pieces], chunk_bytes)
        return [to_bytes(piece.data) for piece in self.pieces], ranges

    def _write_pieces(self) -> None:
        payloads, writes = self._owned_ranges(_WRITE_CHUNK_BYTES)

        def write(file_name: str, op: ReadOp) -> None:
            # Views a batch at a time: a range of strided shards holds a run per row of each,
            # and a memoryview per run for a whole 64 MB range costs more than its bytes.
            offset = op.offset
            for start in range(0, len(op.pieces), _VIEWS_PER_WRITE):
                self._check_cancelled()
                batch = op.pieces[start:start + _VIEWS_PER_WRITE]
                self.storage.write_at(self.commit.temporary(file_name), offset, [
                    payloads[p.target][p.offset:p.offset + p.length] for p in batch])
                offset += sum(p.length for p in batch)

        files = sorted({name for name, _ in writes})
        pool = concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS)
        try:
            self._wait_all([pool.submit(write, name, op) for name, op in writes])
            self._wait_all([pool.submit(self.storage.sync, self.commit.temporary(name))
                            for name in files])
        finally:  # after a failure or a cancel, writes in flight finish on their own
            pool.shutdown(wait=False, cancel_futures=True)
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
                parts += [(name, o, n, self.commit.part(name, o), 0, views) for o, n, views in spans]
            else:
                packed, position = self.commit.part(name, spans[0][0]), 0
                for o, n, views in spans:
                    parts.append((name, o, n, packed, position, views))
                    position += n
        uploads: dict[str, list[memoryview]] = collections.defaultdict(list)
        for part in parts:
            uploads[part[3]].extend(part[5])
        self._begin()
        error = None
        try:
            with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
                def upload(item: tuple[str, list[memoryview]]) -> None:
                    self._check_cancelled()
                    self.storage.write(*item)
                self._wait_all([pool.submit(upload, item) for item in uploads.items()])
        except BaseException as e:
            error = e
        every = [p for r in gather_to_all(f"{self.key}/parts", json.dumps([p[:5] for p in parts]))
                 for p in json.loads(r)]
        part_objects = {p[3] for p in every}
        self._agree("uploaded", error, lambda: self.storage.discard(part_objects)
                    if jax.process_index() == 0 else None)

        def assemble() -> None:
            try:
                self._assemble_parts(every)
            except BaseException:
                self.storage.discard(part_objects)
                self.commit.discard(f.name for f in self.plan.files)
                raise
            with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
                list(pool.map(self.storage.remove, part_objects))
        self._primary("merged", assemble)
        self._commit_plan()
        self.stats.bytes_written = sum(len(p) for p in payloads)
        self.stats.requests = len(uploads)
        self.stats.files = len(by_file)

    def _assemble_parts(self, parts: list[list]) -> None:
        """Process 0: each file from its parts, server-side where each part is one object."""
        by_file = collections.defaultdict(list)
        for name, offset, length, path, position in parts:
            by_file[name].append((offset, length, path, position))
        for file in self.plan.files:
            self._check_cancelled()
            spans = sorted(by_file[file.name])
            covered = sum(n for _, n, _, _ in spans)
            if covered != file.size or any(a[0] + a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise OSError(f"{file.name}: the processes' parts do not tile the file")
            if len({path for _, _, path, _ in spans}) == len(spans):
                self.storage.merge(self.commit.temporary(file.name), [p for _, _, p, _ in spans],
                                   [n for _, n, _, _ in spans])
            else:  # packed parts: read each object front to back, in file order
                self.storage.write(self.commit.temporary(file.name), _read_spans(self.storage, spans))

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
        self._begin()
        error = None
        try:
            for file in mine:
                self.storage.write(self.commit.temporary(file.name), self._cancellable(chunks(file)))
        except BaseException as e:
            error = e
        self._agree("written", error, lambda: self.commit.discard(f.name for f in mine))
        self._commit_plan()


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
    """Each process writes whole files of its own slices; process 0 commits them with the index."""

    specs: Mapping[str, TensorSpec] = dataclasses.field(default_factory=dict)
    max_shard_size: int | str = "5GB"
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    def _write(self) -> None:
        me = jax.process_index()
        data = {(p.name, p.box): p.data for p in self.pieces}
        files = plan_distributed_files(
            me, [SliceSpec(p.name, self.specs[p.name].dtype, p.box) for p in self.pieces],
            max_shard_size=self.max_shard_size, metadata=self.metadata)
        # Without their index these files read as torch DCP output: where they go straight
        # to their final names, a marker says they are a save in progress until it commits.
        self._begin(marks_files=DISTRIBUTED_INDEX_NAME)
        error = None
        try:
            for file, slices in files:
                order = {s.name: data[(s.name, s.box)] for s in slices}
                self.storage.write(self.commit.temporary(file.name), self._cancellable(itertools.chain(
                    [file.header],
                    itertools.chain.from_iterable(_payload(order[t.name]) for t in file.tensors))))
        except BaseException as e:
            error = e
        self._agree("written", error, lambda: self.commit.discard(f.name for f, _ in files))
        mine = [[s.name, file.name, [a for a, _ in s.box], list(s.shape)]
                for file, slices in files for s in slices]
        entries = [e for r in gather_to_all(f"{self.key}/slices", json.dumps(mine)) for e in json.loads(r)]
        self._commit_files(sorted({file for _, file, _, _ in entries}),
                           (DISTRIBUTED_INDEX_NAME, self._index(entries)))
        self.stats.bytes_written = sum(_payload_nbytes(p.data) for p in self.pieces)
        self.stats.requests = self.stats.files = len(files)

    def _index(self, entries: list[list]) -> bytes:
        slices: dict[str, list[SliceEntry]] = collections.defaultdict(list)
        for name, file, offsets, shape in entries:
            slices[name].append(SliceEntry(file, tuple(offsets), tuple(shape)))
        tensors = {
            name: DistributedTensor(spec.dtype, spec.shape, tuple(slices[name]))
            for name, spec in self.specs.items()}
        return serialize_distributed_index(tensors, self.metadata)


def _assemble(info, pieces: list[_Piece]) -> np.ndarray:
    """A whole tensor from the pieces one process holds of it (all of them, here)."""
    if len(pieces) == 1 and pieces[0].box == full_box(info.shape):
        return pieces[0].data
    whole = np.empty(info.shape, pieces[0].data.dtype)
    for piece in pieces:
        whole[tuple(slice(a, b) for a, b in piece.box)] = piece.data
    return whole
