"""``save``: a PyTree of arrays → a safetensors checkpoint, every process writing its own bytes.

A save runs in four steps, each in its own room. The caller's thread checks
the tree, takes the location (``take_location``: the lock, the overwrite
check through the catalog, one ``Commit`` strategy for every process) and
copies this process's shards to the host. Then, on a background thread for
``async_save``, the plan is made (files, headers, offsets, this process's
byte ranges: ``planning``), a write strategy chosen from the backend's
capabilities executes it (``write``), and process 0 commits
(``storage/commit``). Every step that can fail ends in an agreement between
the processes (``Operation``), so they stop together and each raises its
own original error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine import catalog, write
from orbax_safetensors.engine.coordination import Peers, describe_sharding
from orbax_safetensors.engine.gc_pause import gc_paused
from orbax_safetensors.engine.operation import Operation
from orbax_safetensors.engine.pending import SaveFuture
from orbax_safetensors.engine.progress import Progress
from orbax_safetensors.engine.resharding import resharding, row_sharding
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.errors import DistributedError, ProcessFailure
from orbax_safetensors.format import check_name, dtype_for_numpy, to_bytes
from orbax_safetensors.format import check_metadata as format_check_metadata
from orbax_safetensors.format.checksums import RESERVED_KEYS
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    parse_size,
    DistributedTensor,
    SliceEntry,
    serialize_distributed_index,
)
from orbax_safetensors.planning import (
    Box,
    FilePlan,
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
from orbax_safetensors.planning import rules as mapping_rules
from orbax_safetensors.planning.assembly import Assembly
from orbax_safetensors.storage import Location
from orbax_safetensors.storage.commit import Commit

_LOG = logging.getLogger("orbax_safetensors")
_CANCEL_WAIT = 2.0  # seconds a cancelled save's clean-up may hold the caller
LAYOUTS = ("hf", "distributed")


@dataclasses.dataclass
class SaveStats:
    """What one process's save cost; the result of ``save`` and of ``async_save(...).result()``.

    ``bytes_written`` counts tensor bytes this process wrote: the shards it
    holds with ``replica_id == 0``, so across processes every byte is written
    exactly once. ``tensors_resharded`` counts tensors whose shards were thin
    strips across processes, moved to row blocks on device before the copy
    (``planning.reshard_parts``), so each process writes contiguous rows.
    ``blocking_seconds`` is how long ``async_save`` held the caller (the
    device→host copies); ``seconds`` runs until the commit.
    """

    bytes_written: int = 0
    requests: int = 0
    files: int = 0
    tensors_resharded: int = 0
    blocking_seconds: float = 0.0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """What to write, besides the tree (``save``'s keyword arguments, as one value)."""

    layout: str = "hf"
    max_shard_size: int | str | None = None  # None: DEFAULT_MAX_SHARD_SIZE (set by prepare_save)
    metadata: Mapping[str, str] | None = None
    overwrite: bool = False
    mapping: mapping_rules.Mapping | None = None
    checksums: bool = True
    progress: bool = False


DEFAULT_MAX_SHARD_SIZE = "5GB"


def check_max_shard_size(location: Location, max_shard_size: int | str | None) -> None:
    """A bad size, or one that cannot apply (a single ``.safetensors`` file), is the caller's
    error, raised before anything starts."""
    if max_shard_size is None:
        return
    parse_size(max_shard_size)
    if location.is_single_file:
        raise ValueError(f"{location.url!r} is one .safetensors file, which max_shard_size cannot "
                         "split: save to a directory (no .safetensors suffix) to get "
                         "model-0000i-of-0000N.safetensors files and an index, or drop max_shard_size")


def check_metadata(metadata: Mapping[str, str] | None, *, checksums: bool) -> None:
    """The caller's ``__metadata__`` must be what every reader reads (string keys and values,
    a header under 100 MB) and, with checksums, leave our checksum entries to us."""
    format_check_metadata(metadata or {})
    taken = sorted(set(metadata or ()) & set(RESERVED_KEYS)) if checksums else []
    if taken:
        raise ValueError(f"metadata keys {taken} are reserved for the checksums a save writes "
                         "(pass checksums=False to write none)")


@dataclasses.dataclass(frozen=True)
class HostShard:
    """A shard this process writes: its box in the tensor and a host copy of its values."""

    name: str
    box: Box
    data: np.ndarray | tuple[np.ndarray, ...] | _Gathered  # a tuple: row blocks of the box


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    layout: str = "hf",
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
    checksums: bool = True,
    progress: bool = False,
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
        arrays. When an array spans several processes' devices, every process
        calls ``save`` with the same tree (same names, shapes, dtypes, shardings:
        checked first) and host data in it is written by process 0. A tree of
        this process's data alone (numpy, arrays on its own devices) is this
        process's own save, which needs no other process to call it (as in
        ``if jax.process_index() == 0: ost.save(...)``).
      layout: ``"hf"``, whole tensors in the Hugging Face layout.
      max_shard_size: bytes per file of a checkpoint directory, as an int or a
        string like ``"2GB"`` (default ``"5GB"``, as transformers), headers
        included: only a tensor too big for it alone makes a bigger file. A
        ``.safetensors`` path is one file: passing it there is an error.
      metadata: str→str stored in every file's ``__metadata__`` (next to
        ``"format": "pt"``, which transformers requires).
      overwrite: replace a checkpoint already at ``path`` instead of refusing.
      storage_options: constructor arguments of the fsspec filesystem (credentials,
        ``endpoint_url``, ...), e.g. ``{"anon": True}``; or
      filesystem: an fsspec filesystem you already configured (``s3fs.S3FileSystem(...)``).
      mapping: an ``ost.Mapping`` from checkpoint names and layouts to the tree's;
        each leaf is stored under its mapped name, each shard transposed or
        reshaped on the host into the stored box(es) it covers.
      checksums: store the crc32c of every 256 KiB block of every tensor (in
        each file's ``__metadata__``, and each file's whole crc32c in the
        index), computed by each process over the bytes it writes; every load
        then checks the blocks it reads. Other readers ignore them. ``False``
        writes exactly what transformers' ``save_pretrained`` writes.
      progress: report progress on stderr (this process's bytes written, rate,
        time left; process 0 only): one updating line on a terminal, as the CLI
        draws it, else a plain line every 10 s and one at the end.
    """
    with gc_paused():
        job = prepare_save(Location.resolve(path, storage_options, filesystem), tree,
                           SaveOptions(layout, max_shard_size, metadata, overwrite, mapping, checksums,
                                       progress), copy=False)
        return wait_interruptibly(job, job.start())


def wait_interruptibly(job: SaveJob, future: SaveFuture) -> SaveStats:
    """The job's result; Ctrl-C cancels it and raises ``KeyboardInterrupt`` promptly.

    A caller that sees ``KeyboardInterrupt`` knows nothing new was committed:
    cancelling and committing exclude each other (``Operation.cancel``). The
    writers stop at their next chunk and roll back; the caller waits for that
    up to ``_CANCEL_WAIT`` seconds (a disk may hold an uninterruptible ``fsync``
    longer), after which the clean-up finishes in the background, still
    holding the location's lock. An interrupt that comes after the commit point
    is too late to undo the save: it returns normally, with a warning.
    """
    try:
        return future.result()
    except KeyboardInterrupt:
        if not job.operation.cancel():
            _LOG.warning("interrupted after %s was committed: the save is complete",
                         job.operation.where)
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
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
    checksums: bool = True,
    progress: bool = False,
) -> SaveFuture:
    """Like ``save``, but returns once this process's shards are copied to host memory.

    The caller may then mutate or donate its arrays: the files are written by
    a background thread from the host copies. The returned future resolves
    to ``SaveStats`` once the checkpoint is committed on every process, or
    raises what went wrong (on every process). The interpreter waits for a
    pending save at exit, so a final ``async_save`` of a script commits; one
    that fails with nothing waiting for it is printed on stderr at exit, and
    the exit status is 1. ``future.cancel()`` stops a save still writing and
    returns once it has rolled back (``engine.pending.SaveFuture``).
    """
    with gc_paused():  # not while the background writes run: the caller trains meanwhile
        job = prepare_save(Location.resolve(path, storage_options, filesystem), tree,
                           SaveOptions(layout, max_shard_size, metadata, overwrite, mapping, checksums,
                                       progress), copy=True)
    return job.start()


def prepare_save(location: Location, tree: Any, options: SaveOptions, *, copy: bool,
                 new_directory: bool = False) -> SaveJob:
    """Takes the location and copies this process's shards to the host; ``start()`` on the
    result plans, writes and commits.

    The split lets a caller hold the writes back until the directory may be
    touched (Orbax creates a step's directories in the background, after the
    handler returns) while the caller's arrays are already free again.
    ``copy=False`` (the blocking ``save``) views the shards where the platform
    allows (on CPU, the device buffers themselves): the caller waits for the
    writer, so its arrays cannot change underneath it, and a gigabyte memcpy
    is saved. ``new_directory``: the caller creates the location for this save
    and owns it (Orbax's step temporary, which Orbax may still be clearing out
    of a crashed attempt), so nothing already there is looked at, locked or
    removed.
    """
    started = time.perf_counter()
    peers = _peers(tree, location)
    try:
        arrays, tree_specs = check_tree(tree, options.layout)
        specs, assemblies = tree_specs, None
        if options.mapping is not None:  # plan in stored names and shapes; shards are mapped below
            specs, assemblies = options.mapping.map_specs(tree_specs)
        if location.is_single_file and options.layout == "distributed":
            raise ValueError(f"{location.url!r}: the distributed layout is a directory of files")
        check_max_shard_size(location, options.max_shard_size)
        options = dataclasses.replace(options, max_shard_size=options.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        check_metadata(options.metadata, checksums=options.checksums)
    except BaseException as e:
        peers.fail(e)
        raise
    # Every process saves the same tree the same way, or none starts: plans made from
    # different trees or options would write different files over each other.
    if peers.is_collective:  # a line per leaf: described only where there are others to compare
        peers.check_same("tree", [_describe(spec, arrays[spec.name]) for spec in tree_specs]
                         + [f"options {dataclasses.replace(options, progress=False)!r}"], "the tree or options")
    commit = take_location(location, peers, overwrite=options.overwrite, fresh=new_directory)
    # Several processes writing one hf file: thin strips are written as row blocks instead.
    several_writers = peers.is_collective and options.layout == "hf" and assemblies is None
    reshard_below = location.storage.capabilities.max_gap if several_writers else 0
    try:
        shards, resharded = _host_shards(arrays, {s.name: s for s in tree_specs}, copy=copy,
                                         assemblies=assemblies, reshard_below=reshard_below, peers=peers)
    except BaseException as e:
        peers.fail(e)
        commit.release()
        raise
    stats = SaveStats(tensors_resharded=resharded, blocking_seconds=time.perf_counter() - started)
    report = None
    if options.progress and jax.process_index() == 0:
        sizes = {s.name: s for s in specs}
        report = Progress(f"save {location.url}", sum(
            sizes[s.name].dtype.nbytes(box_shape(s.box)) for s in shards), enabled=True).start()
    if options.layout == "distributed":
        strategy = lambda: _distributed(shards, {s.name: s for s in specs}, options)  # noqa: E731
    else:
        strategy = lambda: _hf(location, shards, specs, options)  # noqa: E731
    return SaveJob(Operation(peers, report), commit, strategy, stats, started)


def _peers(tree: Any, location: Location) -> Peers:
    """Who takes part in saving ``tree``: every process when any of its arrays spans devices
    of another process (each process writes its own shards); otherwise this process alone
    (host data, arrays on its own devices), which then needs nobody else to call ``save``."""
    spans = any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
                for leaf in jax.tree_util.tree_leaves(tree))
    return Peers.collective("save", location.url) if spans else Peers.local(location.url)


def _describe(spec: TensorSpec, array: Any) -> str:
    """A leaf as the processes compare it before a save: name, dtype, shape, and the sharding
    of a global array (data of one process alone is process 0's to write, whatever others hold)."""
    sharding = None if not isinstance(array, jax.Array) or array.is_fully_addressable else array.sharding
    return f"{spec.name}: {spec.dtype.code}{list(spec.shape)} {describe_sharding(sharding)}"


def take_location(location: Location, peers: Peers, *, overwrite: bool, fresh: bool = False) -> Commit:
    """Process 0 locks the location and asks the catalog what is there; every process gets
    the same ``Commit`` (token, the files it replaces), or every process raises.

    Refuses to replace a committed checkpoint unless ``overwrite``; debris of a
    save of ours that never committed (its temporaries, the files its marker
    lists) is no reason to refuse, and is removed. Without ``overwrite``, no
    other file is removed: checkpoint-named files that are neither committed
    nor ours (shards without an index, of the user's or of another tool) make
    the save refuse, naming them. ``overwrite`` replaces every checkpoint-named
    file there (a reader that globs shard files must not find old ones beside
    the new), never other files (config.json, a tokenizer, a README).
    """
    token = uuid.uuid4().hex[:12]
    commit = Commit.for_location(location, token, ())
    error, old, markers = None, frozenset(), frozenset()
    if peers.is_primary and not fresh:
        try:
            commit.acquire()
            found = catalog.survey(location, catalog.Findings(collect=True))
            catalog.refuse_non_files(found)
            if found.committed and not overwrite:
                raise FileExistsError(errno.EEXIST, "already holds a checkpoint; pass "
                                      "overwrite=True to replace it", location.url)
            foreign = sorted(found.present - found.committed - found.ours)
            if foreign and not overwrite:
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                raise FileExistsError(errno.EEXIST, f"holds safetensors files that no save of ours "
                                      f"wrote and no index names ({shown}); pass overwrite=True to "
                                      "replace them, or remove them", location.url)
            old = (found.present if overwrite else frozenset()) | found.ours
            markers = found.markers
            commit.clear_leftovers()
        except BaseException as e:
            commit.release()
            error = e
    shared = json.loads(peers.share("location", json.dumps({
        "token": token, "old": sorted(old), "markers": sorted(markers),
        "error": "" if error is None else ProcessFailure.of(0, error).to_json()})))
    if error is not None:
        raise error
    if shared["error"]:
        failure = ProcessFailure.from_json(shared["error"])
        if failure.type == FileExistsError.__name__:  # the refusal, the same on every process
            raise FileExistsError(failure.errno, failure.message, failure.filename)
        raise DistributedError(f"{location.url}: process 0 could not begin the save", {0: failure})
    if peers.is_primary:
        commit.old, commit.markers = old, markers
        return commit
    return Commit.for_location(location, shared["token"], shared["old"], shared["markers"])


def check_tree(tree: Any, layout: str = "hf") -> tuple[dict[str, Any], list[TensorSpec]]:
    """Names each leaf and checks it can be stored, from shapes and dtypes alone (no data moves).

    Run where the mistake is made: Orbax's save arguments call it on
    construction, before Orbax starts a step it would then have to abandon.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    names, leaves, _ = flatten_with_names(tree)
    for name in names:
        check_name(name)
    arrays = dict(zip(names, (_checked_array(n, leaf) for n, leaf in zip(names, leaves))))
    return arrays, [_spec(name, array) for name, array in arrays.items()]


def _checked_array(name: str, leaf: Any) -> jax.Array | np.ndarray:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"leaf {name!r} is a typed PRNG key ({leaf.dtype}), which has no safetensors dtype: "
            "save jax.random.key_data(key) (uint32) and rebuild it with jax.random.wrap_key_data")
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


def _host_shards(
    arrays: Mapping[str, Any], specs: Mapping[str, TensorSpec], *, copy: bool,
    assemblies: Mapping[str, Assembly] | None = None, reshard_below: int = 0, peers: Peers,
) -> tuple[list[HostShard], int]:
    """Host values of the shards this process writes (``replica_id == 0``), and how many
    arrays were resharded into row blocks first (runs under ``reshard_below`` bytes).

    All device→host transfers are started before the first is awaited. With
    ``copy`` (``async_save``) the caller may donate or overwrite its arrays as
    soon as we return, so accelerator shards are copied to host memory and
    numpy leaves are copied. CPU shards are not: their immutable buffers
    already are host memory, and the view we keep is a reference XLA honours
    (a donation of a still-referenced buffer is skipped, not performed), so a
    gigabyte memcpy on the caller's critical path buys nothing there. A
    resharded array is ours, never the caller's: its shards are brought to the
    host at once (copied off an accelerator, viewed on CPU), so at most one
    such extra array is alive on device at a time. The resharding is a device
    collective: the processes meet first, so none enters it after another failed.
    In a collective save, data of this process alone (numpy leaves, arrays on its
    own devices) is written by process 0, as one value for all.
    """
    owned, resharded = [], 0
    for name, array in arrays.items():
        spec = specs[name]
        if isinstance(array, jax.Array) and not (peers.is_collective and array.is_fully_addressable):
            rows = (row_sharding(array.sharding, spec.shape, spec.dtype.bits // 8, reshard_below)
                    if reshard_below and not spec.dtype.is_packed else None)
            if rows is not None:
                peers.meet(f"reshard/{name}")
                array, resharded = resharding(array.sharding, rows)(array), resharded + 1
            mine = [shard for shard in array.addressable_shards if shard.replica_id == 0]
            for shard in mine:
                shard.data.copy_to_host_async()
            for shard in mine:  # a resharded array's shards come to the host now, not later
                data = shard.data if rows is None else np.asarray(shard.data)
                owned.append((name, normalize_index(shard.index, spec.shape), data, rows is not None))
        elif peers.is_primary:
            owned.append((name, full_box(spec.shape), array, False))
    shards = [HostShard(name, box, np.array(
        data, copy=True if copy and not ours and _copied(data) else None))
              for name, box, data, ours in owned]
    for shard in shards:
        if specs[shard.name].dtype.is_packed and shard.box != full_box(specs[shard.name].shape):
            raise ValueError(
                f"leaf {shard.name!r}: {specs[shard.name].dtype.code} packs values below a byte, "
                "so it can only be saved from an unsharded (replicated) array")
    return (shards if assemblies is None else _map_shards(shards, assemblies, copy=copy)), resharded


def _map_shards(shards: list[HostShard], assemblies: Mapping[str, Assembly],
                *, copy: bool) -> list[HostShard]:
    """Tree shards → stored names, boxes and bytes, one shard at a time (see ``Mapping``):
    each piece of the leaf the shard meets (a layer of a stacked leaf, a projection of a
    fused one) gets the shard's part of it, so every process writes its own rows of
    every per-layer tensor and nothing is gathered.

    A transposed shard is a fresh array; a merely reshaped one may still view
    the caller's, so ``async_save`` copies it like any other shard.
    """
    mapped = []
    for shard in shards:
        for piece in assemblies[shard.name].pieces:
            part = piece.part(shard.box)
            if part is None:
                continue
            inside, own = part
            values = np.asarray(shard.data)[relative_slices(inside, shard.box)].reshape(box_shape(own))
            for box, data in piece.transform.to_stored(own, values):
                if copy and np.may_share_memory(data, shard.data):
                    data = data.copy()
                mapped.append(HostShard(piece.stored, box, data))
    return mapped


def _copied(data: Any) -> bool:
    """Whether ``async_save`` must copy this value (see ``_host_shards``)."""
    return not isinstance(data, jax.Array) or any(d.platform != "cpu" for d in data.devices())


@dataclasses.dataclass
class SaveJob:
    """The half of a save that runs after the host copies (on a background thread for
    ``async_save``): plan, write with the chosen strategy, commit."""

    operation: Operation
    commit: Commit
    strategy: Callable[[], write.Strategy]
    stats: SaveStats
    started: float

    def start(self) -> SaveFuture:
        """Writes and commits on a background thread (not a daemon: the interpreter waits for
        it at exit); the future gives the stats or the error (``engine.pending``)."""
        future = SaveFuture(self.operation.where, self.operation.cancel)
        future.run_in(threading.Thread(target=self.run, args=(future,), name="orbax_safetensors-save"))
        return future

    def abandon(self) -> None:
        """A prepared save that will never start (its caller gave up on it): the location is
        let go (lock, a directory it made), and processes waiting on this one fail at once."""
        self.operation.peers.fail(concurrent.futures.CancelledError(
            f"the save to {self.operation.where} was given up before it started"))
        self.commit.release()

    def run(self, future: SaveFuture) -> None:
        try:
            try:
                planned: list[write.Strategy] = []
                self.operation.run("planned", lambda: planned.append(self.strategy()))
                written = planned[0].write(self.operation, self.commit)
                write.commit_written(self.operation, self.commit, written)
            except BaseException as e:
                self.operation.peers.fail(e)
                if self.operation.is_primary and not self.operation.committing:
                    self.commit.abandon()
                raise
            finally:
                self.commit.release()
                if self.operation.progress is not None:
                    self.operation.progress.close()
            self.stats.bytes_written = written.bytes_written
            self.stats.requests = written.requests
            self.stats.files = written.files_written
            self.stats.seconds = time.perf_counter() - self.started
            future.finish(self.stats)
        except BaseException as e:  # the caller sees it through the future
            future.finish(error=e)


def _hf(location: Location, shards: list[HostShard], specs: list[TensorSpec],
        options: SaveOptions) -> write.Strategy:
    """The hf layout's plan, and the strategy the backend calls for."""
    if location.is_single_file:
        plan = plan_single_file(location.file_name, specs, options.metadata, checksums=options.checksums)
    else:
        plan = plan_hf_checkpoint(specs, max_shard_size=options.max_shard_size,
                                  metadata=options.metadata, checksums=options.checksums)
    by_name = collections.defaultdict(list)
    for shard in shards:
        by_name[shard.name].append(shard)

    def streamed(file: FilePlan) -> Iterator[memoryview | bytes]:
        for info in file.tensors:
            yield to_bytes(_whole_tensor(info.shape, by_name[info.name]))

    return write.for_storage(
        location.storage, plan,
        lambda: owned_ranges(plan.files, [(s.name, s.box) for s in shards], write.WRITE_CHUNK_BYTES),
        lambda: [to_bytes(s.data) for s in shards], streamed)


def _distributed(shards: list[HostShard], specs: Mapping[str, TensorSpec],
                 options: SaveOptions) -> write.Strategy:
    """Each process writes whole files of its own slices; process 0 commits them with the index
    of every process's slices."""
    merged = _merge_shards(shards, specs)
    data = {(s.name, s.box): s.data for s in merged}
    metadata = dict(options.metadata or {})
    files = plan_distributed_files(
        jax.process_index(), [SliceSpec(s.name, specs[s.name].dtype, s.box) for s in merged],
        max_shard_size=options.max_shard_size, metadata=metadata, checksums=options.checksums)
    slices_in = {file.name: slices for file, slices in files}

    def chunks(file: FilePlan) -> Iterator[memoryview | bytes]:
        order = {s.name: data[(s.name, s.box)] for s in slices_in[file.name]}
        for info in file.tensors:
            yield from _payload(order[info.name])

    def to_commit(op: Operation, file_crcs: dict[str, int]) -> tuple[list[str], tuple[str, bytes]]:
        mine = {"slices": [[s.name, file.name, [a for a, _ in s.box], list(s.shape)]
                           for file, slices in files for s in slices], "crc32c": file_crcs}
        every = [json.loads(raw) for raw in op.exchange("slices", json.dumps(mine))]
        entries = [e for document in every for e in document["slices"]]
        slices: dict[str, list[SliceEntry]] = collections.defaultdict(list)
        for name, file, offsets, shape in entries:
            slices[name].append(SliceEntry(file, tuple(offsets), tuple(shape)))
        tensors = {name: DistributedTensor(spec.dtype, spec.shape, tuple(slices[name]))
                   for name, spec in specs.items()}
        crcs = {file: crc for document in every for file, crc in document["crc32c"].items()}
        return (sorted({file for _, file, _, _ in entries}),
                (DISTRIBUTED_INDEX_NAME, serialize_distributed_index(tensors, metadata, crcs)))

    return write.Streamed([f for f, _ in files], chunks, to_commit)


def _merge_shards(shards: list[HostShard], specs: Mapping[str, TensorSpec]) -> list[HostShard]:
    """One slice per tensor where this process's shards of it form a box.

    The distributed layout stores at most one slice of a tensor per file, so
    fewer, larger slices mean fewer files; shards that do not form a box stay
    separate slices (and spread over several files). Shards that are row
    blocks of the slice are written one after the other, not copied together.
    """
    by_name: dict[str, list[HostShard]] = collections.defaultdict(list)
    for shard in shards:
        by_name[shard.name].append(shard)
    merged = []
    for name, group in by_name.items():
        regions = plan_regions(specs[name].shape, [p.box for p in group])
        if len(group) == 1 or len(regions) != 1:
            merged.extend(group)
            continue
        box = regions[0].box
        rows = sorted(group, key=lambda p: p.box)
        if all(p.box[1:] == box[1:] for p in rows):  # row blocks: concatenation in order
            merged.append(HostShard(name, box, tuple(p.data for p in rows)))
            continue
        merged.append(HostShard(name, box, _Gathered(box, tuple(group))))
    return merged


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """Shards that together form one slice, copied into it only when the slice is written:
    a file's tensors are gathered one at a time as the file streams out, not the whole
    tree up front (column shards of a tensor on one process, say)."""

    box: Box
    shards: tuple[HostShard, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.shards)

    def array(self) -> np.ndarray:
        data = np.empty(box_shape(self.box), self.shards[0].data.dtype)
        for shard in self.shards:
            data[relative_slices(shard.box, self.box)] = shard.data
        return data


def _payload(data: np.ndarray | tuple[np.ndarray, ...] | _Gathered) -> list[memoryview]:
    """The on-disk bytes of a slice: one array, row blocks back to back, or gathered shards."""
    if isinstance(data, _Gathered):
        return [to_bytes(data.array())]
    return [to_bytes(a) for a in (data if isinstance(data, tuple) else (data,))]


def _whole_tensor(shape: tuple[int, ...], shards: list[HostShard]) -> np.ndarray:
    """A whole tensor from the shards one process holds of it (all of them, here)."""
    if len(shards) == 1 and shards[0].box == full_box(shape):
        return shards[0].data
    whole = np.empty(shape, shards[0].data.dtype)
    for shard in shards:
        whole[tuple(slice(a, b) for a, b in shard.box)] = shard.data
    return whole
