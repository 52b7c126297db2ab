"""``save``: a PyTree of arrays → a safetensors checkpoint, every process writing its own bytes.

The caller's thread checks the tree and the options (``SaveOptions``, resolved
once for the location), takes the location (``session.take_location``) and
copies this process's shards to the host (``host_shards``). What is left is
a ``WriteSession``: on a background thread for ``async_save`` (and, so that
Ctrl-C can cancel it, for ``save``), it plans with the planner of the layout the
options name (``HfPlanner``, ``DistributedPlanner``: values, planned only when the
session runs), writes with the strategy the plan picks (``strategies``) and commits
(``storage/commit``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Unpack

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine.saving import strategies
from orbax_safetensors.engine.saving import host_shards
from orbax_safetensors.engine.core.coordination import (
    Peers,
    describe_arguments,
    describe_sharding,
    describe_spec,
)
from orbax_safetensors.engine.saving.device_copies import HostCopies, prefetch_all
from orbax_safetensors.engine.core.gc_pause import gc_paused
from orbax_safetensors.engine.saving.host_shards import HostShard, merge_shards, payload, whole_tensor
from orbax_safetensors.engine.core.operation import Operation
from orbax_safetensors.engine.core.pending import SaveFuture
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.engine.saving.session import SaveStats, WriteSession, take_location
from orbax_safetensors.engine.core.tree_names import flatten_with_names
from orbax_safetensors.engine.core.options import with_shorthand
from orbax_safetensors.engine.saving.options import SaveKeywords, SaveOptions, files_beside
from orbax_safetensors.errors import ArgumentError, ArgumentTypeError
from orbax_safetensors.format import DType, check_names, dtype_for_numpy, to_bytes
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    DistributedTensor,
    SliceEntry,
    serialize_distributed_index,
)
from orbax_safetensors.planning import (
    FilePlan,
    SliceSpec,
    TensorSpec,
    box_shape,
    owned_ranges,
    plan_distributed_files,
    plan_hf_checkpoint,
    plan_single_file,
)
from orbax_safetensors.storage import Location


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    options: SaveOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[SaveKeywords],
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
      options: an ``ost.SaveOptions``: the layout and file size, metadata, checksums,
        a mapping, a config.json, the memory the copies off accelerators may take.
      storage_options: constructor arguments of the fsspec filesystem (credentials,
        ``endpoint_url``, ...), e.g. ``{"anon": True}``; or
      filesystem: an fsspec filesystem you already configured (``s3fs.S3FileSystem(...)``).
      **shorthand: any field of ``SaveOptions`` as a keyword (``max_shard_size="2GB"``),
        replacing that field of ``options``.
    """
    options = with_shorthand(SaveOptions, options, shorthand)
    with gc_paused():
        session = prepare_save(Location.resolve(path, storage_options, filesystem), tree, options,
                               copy=False)
        return session.wait(session.start())


def async_save(
    path: str | os.PathLike,
    tree: Any,
    *,
    options: SaveOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[SaveKeywords],
) -> SaveFuture:
    """Like ``save``, but returns once this process's shards are copied to host memory.

    The caller may then mutate or donate its arrays: the files are written by
    a background thread from the host copies. The returned future resolves
    to ``SaveStats`` once the checkpoint is committed on every process, or
    raises what went wrong (on every process). The interpreter waits for a
    pending save at exit, so a final ``async_save`` of a script commits; one
    that fails with nothing waiting for it is printed on stderr at exit, and
    the exit status is 1. ``future.cancel()`` stops a save still writing and
    returns once it has rolled back (``engine.pending.SaveFuture``). Arguments as for
    ``save``; ``memory_budget`` bounds the copies under way while it blocks.
    """
    options = with_shorthand(SaveOptions, options, shorthand)
    with gc_paused():  # not while the background writes run: the caller trains meanwhile
        session = prepare_save(Location.resolve(path, storage_options, filesystem), tree, options,
                               copy=True)
    return session.start()


def prepare_save(location: Location, tree: Any, options: SaveOptions, *, copy: bool,
                 new_directory: bool = False) -> WriteSession:
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
        specs, assemblies = (tree_specs, None) if options.mapping is None else \
            options.mapping.map_specs(tree_specs)  # planned in stored names; shards mapped on copy
        options = options.resolve(location)
    except BaseException as e:
        peers.fail(e)
        raise
    # Every process saves the same tree the same way, or none starts: plans made from
    # different trees or options would write different files over each other.
    if peers.is_collective:  # a line per leaf: described only where there are others to compare
        peers.check_same("tree", [_describe(spec, arrays[spec.name]) for spec in tree_specs]
                         + describe_arguments(options, leave_out=("progress", "memory_budget", "config")),
                         "the tree or options")
    beside = files_beside(options.config_json)
    commit = take_location(location, peers, overwrite=options.overwrite, fresh=new_directory,
                           beside=[name for name, _ in beside])
    try:
        shards, resharded, in_transfer = host_shards.copy_to_host(
            arrays, {s.name: s for s in tree_specs}, copy=copy, budget=options.memory_budget,
            assemblies=assemblies,
            reshard_below=_reshard_below(location, peers, options, mapped=assemblies is not None),
            peers=peers)
    except BaseException as e:
        peers.fail(e)
        commit.release()
        raise
    stats = SaveStats(tensors_resharded=resharded, blocking_seconds=time.perf_counter() - started,
                      copied_peak=in_transfer)
    planner = _PLANNERS[options.layout](location, shards, specs, options)
    return WriteSession(Operation(peers, planner.progress()), commit, planner, stats, started, beside)


def _reshard_below(location: Location, peers: Peers, options: SaveOptions, *, mapped: bool) -> int:
    """Runs under this many bytes are thin strips, resharded into row blocks before the copy:
    where several processes write one hf file (unmapped), the backend's gap; else none."""
    several_writers = peers.is_collective and options.layout == "hf" and not mapped
    return location.storage.capabilities.max_gap if several_writers else 0


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
    return f"{describe_spec(spec)} {describe_sharding(sharding)}"


def check_tree(tree: Any, layout: str = "hf") -> tuple[dict[str, Any], list[TensorSpec]]:
    """Names each leaf and checks it can be stored, from shapes and dtypes alone (no data moves).

    Run where the mistake is made: Orbax's save arguments call it on
    construction, before Orbax starts a step it would then have to abandon.
    """
    if layout not in LAYOUTS:
        raise ArgumentError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    names, leaves, _ = flatten_with_names(tree)
    check_names(names)
    arrays = dict(zip(names, (_checked_array(n, leaf) for n, leaf in zip(names, leaves))))
    kinds: dict[tuple[np.dtype, tuple[int, ...]], tuple[DType, tuple[int, ...]]] = {}  # checked once each
    specs = []
    for name, array in arrays.items():
        key = (array.dtype, array.shape)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = _kind(name, array)
        specs.append(TensorSpec(name, *kind))
    return arrays, specs


def _checked_array(name: str, leaf: Any) -> jax.Array | np.ndarray:
    if type(leaf) is np.ndarray:  # as it is, and the commonest leaf of a host tree
        return leaf
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise ArgumentTypeError(
            f"leaf {name!r} is a typed PRNG key ({leaf.dtype}), which has no safetensors dtype: "
            + ("save the params alone, nnx.state(model, nnx.Param), or " if ".rngs." in f".{name}." else "")
            + "save jax.random.key_data(key) (uint32) and rebuild it with jax.random.wrap_key_data")
    if isinstance(leaf, jax.Array):
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    raise ArgumentTypeError(
        f"leaf {name!r} is a {type(leaf).__name__}, not an array; safetensors stores "
        "arrays only (convert scalars with np.asarray, or drop the leaf)")


def _kind(name: str, array: jax.Array | np.ndarray) -> tuple[DType, tuple[int, ...]]:
    """The stored dtype and shape of ``array`` (leaf ``name``), or why it cannot be stored."""
    try:
        dtype = dtype_for_numpy(array.dtype)
    except ValueError as e:
        raise ArgumentError(f"leaf {name!r}: {e}") from None
    shape = tuple(array.shape)
    try:
        dtype.nbytes(shape)
    except ValueError as e:
        raise ArgumentError(f"leaf {name!r}: {e}") from None
    return dtype, shape


@dataclasses.dataclass(frozen=True)
class _SavePlanner:
    """A save's host shards, to be planned and written in one layout (a session's ``Planner``)."""

    location: Location
    shards: list[HostShard]
    specs: list[TensorSpec]  # stored names and shapes
    options: SaveOptions

    def progress(self) -> Progress | None:
        """Process 0's progress line, if asked for: the bytes this process writes."""
        if not self.options.progress or jax.process_index() != 0:
            return None
        sizes = {s.name: s for s in self.specs}
        return Progress(f"save {self.location.url}", sum(
            sizes[s.name].dtype.nbytes(box_shape(s.box)) for s in self.shards), enabled=True).start()


class HfPlanner(_SavePlanner):
    """Plans the hf layout: whole tensors, in one file or in files of ``max_shard_size`` under an
    index, written the way the backend's capabilities call for (``strategies.for_storage``)."""

    def strategy(self) -> strategies.Strategy:
        location, shards, options = self.location, self.shards, self.options
        if location.is_single_file:
            plan = plan_single_file(location.file_name, self.specs, options.metadata,
                                    checksums=options.checksums)
        else:
            plan = plan_hf_checkpoint(self.specs, max_shard_size=options.max_shard_size,
                                      metadata=options.metadata, checksums=options.checksums)
        by_name = collections.defaultdict(list)
        for shard in shards:
            by_name[shard.name].append(shard)

        def streamed(file: FilePlan) -> Iterator[memoryview | bytes]:
            for info in file.tensors:
                yield to_bytes(whole_tensor(info.shape, by_name[info.name]))

        return strategies.for_storage(
            location.storage, plan,
            lambda: owned_ranges(plan.files, [(s.name, s.box) for s in shards], strategies.WRITE_CHUNK_BYTES),
            HostCopies([s.data for s in shards], options.memory_budget), streamed)


class DistributedPlanner(_SavePlanner):
    """Plans our distributed layout: each process writes whole files of its own slices; process 0
    commits them with the index of every process's slices."""

    def strategy(self) -> strategies.Strategy:
        specs = {s.name: s for s in self.specs}
        prefetch_all(s.data for s in self.shards)  # files in turn, each streamed (and replayed if retried)
        merged = merge_shards(self.shards, specs)
        data = {(s.name, s.box): s.data for s in merged}
        files = plan_distributed_files(
            jax.process_index(), [SliceSpec(s.name, specs[s.name].dtype, s.box) for s in merged],
            max_shard_size=self.options.max_shard_size, metadata=dict(self.options.metadata or {}),
            checksums=self.options.checksums)
        slices_in = {file.name: slices for file, slices in files}

        def chunks(file: FilePlan) -> Iterator[memoryview | bytes]:
            order = {s.name: data[(s.name, s.box)] for s in slices_in[file.name]}
            for info in file.tensors:
                yield from payload(order[info.name])

        return strategies.Streamed([f for f, _ in files], chunks, functools.partial(self._index, files))

    def _index(self, files: list[tuple[FilePlan, list[SliceSpec]]], op: Operation,
               file_crcs: dict[str, int]) -> tuple[list[str], tuple[str, bytes]]:
        """Every process's files, and the index of every process's slices and file checksums."""
        mine = {"slices": [[s.name, file.name, [a for a, _ in s.box], list(s.shape)]
                           for file, slices in files for s in slices], "crc32c": file_crcs}
        every = [json.loads(raw) for raw in op.exchange("slices", json.dumps(mine))]
        entries = [e for document in every for e in document["slices"]]
        slices: dict[str, list[SliceEntry]] = collections.defaultdict(list)
        for name, file, offsets, shape in entries:
            slices[name].append(SliceEntry(file, tuple(offsets), tuple(shape)))
        tensors = {spec.name: DistributedTensor(spec.dtype, spec.shape, tuple(slices[spec.name]))
                   for spec in self.specs}
        crcs = {file: crc for document in every for file, crc in document["crc32c"].items()}
        index = serialize_distributed_index(tensors, dict(self.options.metadata or {}), crcs)
        return sorted({file for _, file, _, _ in entries}), (DISTRIBUTED_INDEX_NAME, index)


_PLANNERS: dict[str, type[_SavePlanner]] = {"hf": HfPlanner, "distributed": DistributedPlanner}
LAYOUTS = tuple(_PLANNERS)  # the values of ``layout=``
