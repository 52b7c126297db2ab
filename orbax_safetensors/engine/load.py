"""``load`` and ``metadata``: from storage to host arrays or sharded ``jax.Array``s.

The target tree decides everything about the result: its structure, each
leaf's dtype (conversion happens on the host, after the read) and each leaf's
sharding. Without a target the result is a flat ``{name: numpy array}``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine import option_checks
from orbax_safetensors.engine.catalog import Checkpoint, open_checkpoint
from orbax_safetensors.engine.coordination import Peers, describe_sharding
from orbax_safetensors.engine.gc_pause import gc_paused
from orbax_safetensors.engine.progress import Progress
from orbax_safetensors.engine.read import (
    AssembledLeaf, Job, LoadStats, execute, group_jobs, groupable, host_job, refuse_casts, sharded_job)
from orbax_safetensors.engine.tree_names import flatten_with_names
from orbax_safetensors.engine.tree_names import nest as nest_names
from orbax_safetensors.errors import (CheckpointChangedError, MappingError, MissingTensorError,
                                      SafetensorsError, SkippedLeavesWarning)
from orbax_safetensors.index import parse_size
from orbax_safetensors.planning import ReadProfile, TensorSource, plan_reads
from orbax_safetensors.planning import rules as mapping_rules
from orbax_safetensors.planning.assembly import Assembly
from orbax_safetensors.planning.transforms import Transform
from orbax_safetensors.storage import Location

_LOG = logging.getLogger("orbax_safetensors")
# Strided shards are served through bounce buffers of this size, one per read thread:
# small enough that they add little to the result, big enough to amortise a request.
_BOUNCE_BYTES = 4 << 20
# Where a backend cannot pin what a load reads (object stores), a load that read a file changed
# meanwhile is read again; a commit takes milliseconds to seconds, a retry as long as a load.
_READ_ATTEMPTS = 20
_SCRATCH_BUDGET = 128 << 20


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from headers only (no tensor bytes)."""

    tensors: dict[str, jax.ShapeDtypeStruct]
    metadata: dict[str, str]
    files: dict[str, tuple[str, ...]]  # tensor name → the file(s) holding it


@dataclasses.dataclass(frozen=True)
class _Request:
    """What the caller wants for one leaf: dtype, shape, and where to put it."""

    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    sharding: jax.sharding.Sharding | None


def metadata(
    path: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> CheckpointMetadata:
    """Names → ``jax.ShapeDtypeStruct``, plus ``__metadata__`` and file of each tensor.

    ``storage_options``/``filesystem`` as in ``load``.
    """
    with gc_paused(), open_checkpoint(Location.resolve(path, storage_options, filesystem)) as checkpoint:
        return metadata_of(checkpoint)


def metadata_of(checkpoint: Checkpoint) -> CheckpointMetadata:
    """What ``metadata`` returns, of a checkpoint already open.

    Tensors of one shape and dtype share one ``ShapeDtypeStruct`` (it is immutable, and
    building 100 000 took most of the call), and a file's name is split off its path once.
    """
    structs: dict[tuple[tuple[int, ...], str], jax.ShapeDtypeStruct] = {}
    file_names: dict[str, str] = {}

    def struct(t: TensorSource) -> jax.ShapeDtypeStruct:
        key = (t.shape, t.dtype.code)
        if key not in structs:
            structs[key] = jax.ShapeDtypeStruct(t.shape, t.dtype.numpy)
        return structs[key]

    def file_name(path: str) -> str:
        if path not in file_names:
            file_names[path] = checkpoint.storage.split(path)[1]
        return file_names[path]

    ordered = sorted(checkpoint.tensors.items())
    return CheckpointMetadata(
        tensors={name: struct(t) for name, t in ordered},
        metadata=checkpoint.metadata,
        files={name: tuple(file_name(s.file) for s in t.slices) for name, t in ordered},
    )


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """Knobs of a load; the defaults suit local disks and buckets alike. Every field is
    checked when the options are built (a ``ValueError`` or ``TypeError`` naming it), and
    sizes are stored as ints (``"1GB"`` → ``10**9``).

    Attributes:
      memory_budget: host bytes staged at once (read but not yet on device).
        One tensor's local shard is staged whole, so a shard bigger than the
        budget is the budget. At most 128 MB when a mapping transforms
        tensors: their staging is only copied from, and recycled.
      chunk_bytes: the largest single read; bigger runs become parallel reads.
        ``None`` lets the storage backend choose (32 MB locally, 8 MiB on object
        stores, whose connections are slow alone and fast together). At least
        4 KiB (``MIN_CHUNK_BYTES``): every chunk is one request.
      max_overread: a coalesced read may fetch at most this many times the
        bytes it delivers (1.0: never read a byte that is not needed).
      max_gap: the largest unneeded gap read through; ``None`` lets the
        storage backend choose (16 KiB locally, 1 MiB on object stores).
      threads: concurrent reads (at least 1).
      replicated_read_once: with several processes, read each tensor that
        several processes need (replicated across hosts) once per cluster,
        1/N per process, and all-gather it on device. ``None``: on whenever
        ``jax.process_count() > 1``.
      reshard_thin_shards: with several processes, read a tensor whose shards
        are strided strips too thin to read well (runs shorter than
        ``max_gap``, or than a checksum block while checking them: under
        ``P("tp", "fsdp")`` on hundreds of devices, a ranged request per
        512-byte row piece) in contiguous row blocks, one set per
        process, and move it to the target sharding on device (an all-to-all).
        ``None``: on whenever ``jax.process_count() > 1``.
      verify_checksums: check every byte read against the crc32c its file
        stores (``ost.save`` stores one per 256 KiB block of each tensor), and
        raise ``ost.ChecksumError`` naming the file, tensor and bytes that do not
        match: damage on disk or in transit, or a file changed since it was
        written, fails the load instead of loading wrong weights. It costs
        hashing (about 11 GB/s, overlapped with the reads) and, for a
        partial read (a shard of a tensor), reading the blocks it touches whole:
        less than two blocks per contiguous run (``LoadStats.checksum_overread``).
        Files without checksums load unchecked; ``False`` reads exactly what is
        needed and checks nothing.
      casting: which conversions to the target's dtypes a load makes, because
        numpy's ``astype`` changes values without a word (-300.0 into int8 is
        -44, NaN into int32 is INT_MIN) and a model would train or serve on them.
        ``"same_kind"`` converts where every value keeps its meaning: float ↔
        float (bfloat16, float16, fp8: rounded), bool → anything, int → float,
        int → an int type holding all of the stored type's values. It refuses
        float → int or bool (and complex → real) before reading a byte, with an
        ``ost.SafetensorsError`` listing every such tensor; and it checks, on the
        values read, per shard (a min and a max), every cast that only some values
        survive: a narrowing or sign-changing int cast (int32 → int8, int8 → uint8,
        uint64 → int64, int → bool), and a cast to a float type of smaller range
        (float32 → float16 or fp8, float64 → float32, int32 → float16), where a value
        beyond the target's largest would become inf, NaN or that largest value, and
        inf or NaN where the target has none; raising an ``ost.SafetensorsError``
        naming the tensor and the first value that does not fit. With a mapping that scales, the rule applies to
        the final cast (float32 once scaled). ``"unsafe"`` casts as ``astype``
        does, whatever the values.
    """

    memory_budget: int | str = "1GB"
    chunk_bytes: int | str | None = None
    max_overread: float = 2.0
    max_gap: int | None = None
    threads: int = 16
    replicated_read_once: bool | None = None
    reshard_thin_shards: bool | None = None
    verify_checksums: bool = True
    casting: str = "same_kind"

    # Every chunk is one read request (a syscall, or an HTTP request), about 10 us of overhead
    # locally: a 1-byte chunk made a 6 MB load take 60 s. Below a page, a request reads less
    # than the kernel reads anyway; at 4 KiB the overhead stays under ~3 ms per MB.
    MIN_CHUNK_BYTES = 4096

    def __post_init__(self):
        """Checks every field, naming it, and stores sizes as ints (``"1GB"`` → 10**9)."""
        def resolve(field: str, check: Callable[..., Any], *, optional: bool = False,
                    **limits: Any) -> None:
            value = getattr(self, field)
            if not (optional and value is None):  # None: the backend's, or by process count
                object.__setattr__(self, field, check(f"ReadOptions.{field}", value, **limits))
        resolve("memory_budget", option_checks.size)
        resolve("chunk_bytes", option_checks.size, optional=True, minimum=self.MIN_CHUNK_BYTES,
                why=" (each chunk is one read request: smaller ones only add requests)")
        resolve("max_overread", option_checks.ratio, minimum=1.0)
        resolve("max_gap", option_checks.count, optional=True, minimum=0)
        resolve("threads", option_checks.count, minimum=1)
        resolve("replicated_read_once", option_checks.flag, optional=True)
        resolve("reshard_thin_shards", option_checks.flag, optional=True)
        resolve("verify_checksums", option_checks.flag)
        if self.casting not in ("same_kind", "unsafe"):
            raise ValueError(f'ReadOptions.casting must be "same_kind" (refuse casts that change '
                             f'values) or "unsafe" (numpy astype), not {self.casting!r}')


def load(
    path: str | os.PathLike,
    target: Any = None,
    *,
    strict: bool | str = True,
    options: ReadOptions | None = None,
    stats: LoadStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
    progress: bool = False,
    nest: bool = False,
) -> Any:
    """Loads a checkpoint into the structure, dtypes and shardings of ``target``.

    Loading is driven by the target sharding: every process reads only the
    bytes its own devices hold, from every file, and no process ever holds a
    tensor it only has a slice of.

    Args:
      path: a ``.safetensors`` file or a checkpoint directory (any fsspec URL).
      target: a PyTree whose leaves are ``jax.Array``s or ``jax.ShapeDtypeStruct``s
        (with ``.sharding`` for device arrays; without, numpy arrays) or numpy
        arrays, e.g. ``jax.eval_shape(init)``. ``None`` in the tree is an empty
        subtree, as in JAX (optax states hold some): it is returned as ``None``.
        No target loads every tensor into a flat ``{name: numpy array}``. When a
        leaf is sharded over several processes' devices, every process calls
        ``load`` with the same target (checked first); a target of host arrays
        or this process's devices only (or none) is this process's own load.
      strict: ``True``: raise if the target and the checkpoint differ in names
        or shapes (the error lists every offending tensor; an
        ``ost.MissingTensorError``, also a ``KeyError``, when the target names
        tensors the checkpoint lacks). ``"target"``: every target leaf must be
        in the checkpoint with its shape, as with ``True``, but checkpoint
        tensors the target does not name are fine and left unread (a subset
        load: some layers, the weights without the optimizer state; what
        Orbax's ``SafetensorsLayout`` does). ``False``: only tensors present
        in both with equal shapes are loaded; of the other target leaves,
        arrays are returned unchanged and abstract ones (``ShapeDtypeStruct``)
        as ``None``, with a ``SkippedLeavesWarning`` naming them and their
        names in ``stats.skipped``.
      options: memory budget, read sizes, replicated read-once; see ``ReadOptions``.
      stats: a ``LoadStats`` to fill with this process's bytes and requests.
      storage_options: constructor arguments of the fsspec filesystem (credentials,
        ``endpoint_url``, ...), e.g. ``{"anon": True}``; for ``hf://`` paths also
        ``token``, ``revision``, ``local_files_only`` and ``cache_dir``; or
      filesystem: an fsspec filesystem you already configured (``s3fs.S3FileSystem(...)``).
      mapping: an ``ost.Mapping`` from checkpoint names and layouts to the target's
        (e.g. ``ost.mappings.llama()`` for a Hugging Face Llama into a Flax model).
        Each leaf is read as the stored box holding its shards and transposed or
        reshaped on the host, shard by shard. Without a target the result is
        keyed by tree names.
      progress: report progress on stderr (this process's bytes read, rate,
        time left; process 0 only): one updating line on a terminal, as the CLI
        draws it, else a plain line every 10 s and one at the end.
      nest: without a target, return the tensors nested by the dots of their
        names (``{"model": {"layers": {"0": {...}}}}``) instead of flat.
    """
    loading = _Loading(Location.resolve(path, storage_options, filesystem), target, strict,
                       options or ReadOptions(), stats if stats is not None else LoadStats(), mapping,
                       progress=progress, nest=nest)
    with gc_paused():
        return loading.run(loading.plan())


def async_load(
    path: str | os.PathLike,
    target: Any = None,
    *,
    strict: bool | str = True,
    options: ReadOptions | None = None,
    stats: LoadStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    mapping: mapping_rules.Mapping | None = None,
    progress: bool = False,
    nest: bool = False,
) -> concurrent.futures.Future[Any]:
    """Like ``load``, but returns once the load is planned; the reads run in the background.

    What can fail before a byte is read fails here, raised to the caller:
    the checkpoint is opened (one version, pinned where the backend allows),
    checked against the target, and every read is planned. The future then
    resolves to what ``load`` returns, or raises what it would. Meanwhile the
    caller can do what does not need the weights, typically compiling the
    train or serve step (``jax.jit(step).lower(...).compile()``), whose time
    the load then hides, as Orbax's ``load_pytree_async`` allows.

    Arguments as for ``load``. One difference: ``replicated_read_once`` and
    ``reshard_thin_shards`` are off unless ``options`` turns them on, because
    they end in device collectives (an all-gather, an all-to-all), and one
    issued from a background thread can deadlock against collectives the
    caller issues meanwhile on the other processes.
    """
    options = options or ReadOptions()
    options = dataclasses.replace(
        options,
        replicated_read_once=bool(options.replicated_read_once),
        reshard_thin_shards=bool(options.reshard_thin_shards))
    loading = _Loading(Location.resolve(path, storage_options, filesystem), target, strict,
                       options, stats if stats is not None else LoadStats(), mapping,
                       abandoned=_Abandoned(), progress=progress, nest=nest)
    with gc_paused():  # not while the reads run: the caller compiles meanwhile
        planned = loading.plan()
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(loading.run(planned))
        except BaseException as e:  # the caller gets it from the future
            future.set_exception(e)

    threading.Thread(target=run, name="orbax_safetensors-load").start()
    return future


@dataclasses.dataclass(frozen=True)
class _Planned:
    """One opened version of the checkpoint and the plan to read it; ``read()`` runs the plan."""

    checkpoint: Checkpoint
    attempt: int
    read: Callable[[], Any]


@dataclasses.dataclass
class _Loading:
    """A load: open and plan, then read; again if an overwrite changed what it read.

    Where the backend pins what it opened (local files) one attempt always
    suffices; on object stores a commit landing mid-load means reading again.
    """

    location: Location
    target: Any
    strict: bool | str
    options: ReadOptions
    stats: LoadStats
    mapping: mapping_rules.Mapping | None
    abandoned: threading.Event | None = None  # stops the reads (KeyboardInterrupt) once set
    progress: bool = False
    nest: bool = False
    started: float = dataclasses.field(default_factory=time.perf_counter)
    peers: Peers = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.peers = _peers(self.target, self.location)

    def plan(self) -> _Planned:
        """Opens the checkpoint (the version every process opened) and plans its reads; a
        failure here is told to the other processes (``Peers.fail``), who raise too."""
        try:
            return self._plan(0)
        except BaseException as e:
            self.peers.fail(e)
            raise

    def _plan(self, first: int) -> _Planned:
        for attempt in range(first, _READ_ATTEMPTS):
            if attempt > first:
                time.sleep(min(0.01 * 2 ** attempt, 0.2))
            checkpoint, planned = open_checkpoint(self.location), None
            try:
                if attempt == 0 and self.peers.is_collective:  # after what may fail alone: the lookup
                    self.peers.check_same("target", _describe_target(self), "targets or load options")
                if self._same_everywhere(attempt, checkpoint):
                    planned = _Planned(checkpoint, attempt, _plan(checkpoint, self, attempt))
            except Exception:
                if not self._changed(checkpoint):
                    raise
            finally:
                if planned is None:  # also on Ctrl-C: nothing keeps this version open
                    checkpoint.close()
            if planned is not None:
                return planned
        raise CheckpointChangedError(f"the checkpoint kept changing while it was read ({_READ_ATTEMPTS} "
                               "attempts)", file=self.location.url)

    def run(self, planned: _Planned) -> Any:
        """Reads what ``planned`` planned; reads again if it changed meanwhile. A failure on
        any process (a damaged block, a read error) fails every process at once."""
        try:
            return self._run(planned)
        except BaseException as e:
            self.peers.fail(e)
            raise

    def _run(self, planned: _Planned) -> Any:
        while True:
            with planned.checkpoint as checkpoint:
                try:
                    result = planned.read()
                    whole = (checkpoint.storage.capabilities.pins_versions
                             or checkpoint.unchanged())
                except Exception:
                    if not self._changed(checkpoint):
                        raise
                    whole = False
                if all(v == "1" for v in self.peers.gather(f"{planned.attempt}/read", "1" if whole else "0")):
                    return result
            _LOG.info("%s changed while it was read (an overwrite committed); reading it again",
                      self.location.url)
            planned = self._plan(planned.attempt + 1)

    def _same_everywhere(self, attempt: int, checkpoint: Checkpoint) -> bool:
        """Whether every process opened the same version of the checkpoint.

        Each process opens its files on its own; an overwrite committing in
        between would give processes different checkpoints, and the global arrays
        would mix them. Every process learns every other's version and all open
        again together unless they agree.
        """
        return len(set(self.peers.gather(f"{attempt}/version", checkpoint.storage.version()))) == 1

    @staticmethod
    def _changed(checkpoint: Checkpoint) -> bool:
        """Whether a failure may be a file that vanished or changed under a backend that
        cannot pin it (then reading again is the answer, not the error)."""
        return not (jax.process_count() > 1 or checkpoint.storage.capabilities.pins_versions
                    or checkpoint.unchanged())


def _peers(target: Any, location: Location) -> Peers:
    """Who takes part in a load: every process when a target leaf is sharded over devices of
    another process (they read their own shards of one global array, and must agree on the
    version they read); otherwise this process alone (no target, host arrays, arrays on its
    own devices), which then needs nobody else to call ``load``."""
    me = jax.process_index()

    def spans(leaf: Any) -> bool:
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            return False
        try:
            devices = _concrete("", sharding).device_set
        except Exception:  # an abstract mesh with none set: reported when planned, everywhere
            return jax.process_count() > 1
        return any(d.process_index != me for d in devices)

    leaves = jax.tree_util.tree_leaves(target) if target is not None else []
    distinct: dict[Any, Any] = {}  # one check per distinct sharding (100 000 leaves hold a few)
    for leaf in leaves:
        try:
            distinct.setdefault(getattr(leaf, "sharding", None), leaf)
        except TypeError:  # a sharding that cannot be hashed
            distinct[object()] = leaf
    return Peers.collective("load", location.url) if any(map(spans, distinct.values())) else Peers.local(location.url)


def _describe_target(loading: _Loading) -> list[str]:
    """What the processes of a collective load must agree on: the target leaf by leaf
    (name, dtype, shape, sharding), the mapping and the options that decide the reads."""
    names, leaves, _ = flatten_with_names(loading.target)
    lines = [f"{name}: {getattr(leaf, 'dtype', None)}{list(getattr(leaf, 'shape', ()))} "
             f"{describe_sharding(getattr(leaf, 'sharding', None))}" for name, leaf in zip(names, leaves)]
    return lines + [f"strict {loading.strict!r}, mapping {loading.mapping!r}",
                    f"options {loading.options!r}"]


_EXITING = threading.Event()
# Set when the interpreter starts to exit, before it joins threads: the hook concurrent.futures
# uses to stop its pools (atexit would run only after the joins). Absent: loads run to the end.
getattr(threading, "_register_atexit", lambda hook: None)(_EXITING.set)


class _Abandoned(threading.Event):
    """Set, or the interpreter is exiting: a Ctrl-C or the end of the script left nobody to
    take a background load's result, so its reads stop instead of holding the exit."""

    def is_set(self) -> bool:
        return super().is_set() or _EXITING.is_set()


def _plan(checkpoint: Checkpoint, loading: _Loading, attempt: int) -> Callable[[], Any]:
    """Checks the target against the checkpoint and plans every read; the result reads them."""
    target, strict, options, mapping = loading.target, loading.strict, loading.options, loading.mapping
    if loading.nest and target is not None:
        raise ValueError("nest=True shapes a load without a target; a target gives its own structure")
    stats = loading.stats
    if target is None:
        names = sorted(checkpoint.tensors)
        requests = [_Request(None, None, None)] * len(names)
        leaves, treedef = [], None
    else:
        names, leaves, treedef = flatten_with_names(target)
        seen: dict[tuple[Any, ...], _Request] = {}  # leaves alike share one (100 000 tiny ones)
        requests = [_request_for(name, leaf, seen) for name, leaf in zip(names, leaves)]
    assemblies = None
    if mapping is not None:
        names, requests, assemblies = _map(checkpoint, mapping, names, requests, target is None, strict)
        wanted = [i for i, assembly in enumerate(assemblies) if assembly is not None]
    else:
        wanted = _match(checkpoint, names, requests, strict)
    if target is not None:
        _report_skipped(names, wanted, stats)
    elif loading.nest:
        nest_names(dict.fromkeys(names[i] for i in wanted))  # names that cannot nest fail here, unread
    several = loading.peers.is_collective
    read_once = options.replicated_read_once if options.replicated_read_once is not None else several
    reshard = options.reshard_thin_shards if options.reshard_thin_shards is not None else several
    capabilities = checkpoint.storage.capabilities
    profile = ReadProfile(
        chunk_bytes=(capabilities.chunk_bytes if options.chunk_bytes is None
                     else parse_size(options.chunk_bytes)),
        max_gap=capabilities.max_gap if options.max_gap is None else options.max_gap,
        max_overread=options.max_overread,
        memory_budget=parse_size(options.memory_budget))
    bounce_bytes = min(profile.chunk_bytes, _BOUNCE_BYTES)
    checksums = checkpoint.checksums if options.verify_checksums else {}
    # A checked read reads every block it touches whole: a strip whose runs are thinner than a
    # block would read the other processes' bytes between them too, so it is read in row
    # blocks and resharded instead; slices are read by region, each block once.
    thin = max([profile.max_gap, *(c.layout.block_bytes for c in checksums.values())])
    reshard_below = thin if reshard else 0
    by_region = bool(checksums)
    jobs: list[Job] = []
    # Per wanted leaf: its job, its group's job and its place there, or the leaf its jobs build.
    outputs: list[int | tuple[int, int] | AssembledLeaf] = []
    grouped: list[tuple[int, str, Any]] = []  # small tensors read in groups: (output, stored, sharding)
    for i in wanted:
        request = requests[i]
        assembly = None if assemblies is None else assemblies[i]
        if assembly is None or assembly.transform is not None:
            stored = names[i] if assembly is None else assembly.pieces[0].stored
            transform = None if assembly is None else assembly.transform
            if ((transform is None or transform.is_identity)
                    and groupable(checkpoint.tensors[stored], request.dtype, request.sharding)):
                grouped.append((len(outputs), stored, request.sharding))
                outputs.append(-1)  # its group's job, once the groups are made
                continue
            outputs.append(len(jobs))
            jobs.append(_job(stored, checkpoint.tensors[stored], request, read_once, reshard_below,
                             bounce_bytes, transform, slices_by_region=by_region, casting=options.casting))
            continue
        sources = [checkpoint.tensors[piece.stored] for piece in assembly.pieces]
        dtype = request.dtype or assembly.pieces[0].transform.tree_dtype(sources[0].dtype.numpy)
        leaf = AssembledLeaf(names[i], sources, assembly, dtype, request.sharding, bounce_bytes=bounce_bytes,
                             slices_by_region=by_region, casting=options.casting)
        outputs.append(leaf)
        jobs.extend(leaf.jobs)
    for job, members in group_jobs([(stored, checkpoint.tensors[stored], sharding)
                                    for _, stored, sharding in grouped]):
        for k, member in enumerate(members):
            outputs[grouped[member][0]] = (len(jobs), k)
        jobs.append(job)
    refuse_casts(jobs, outputs)  # float → int and the like, all at once, before any read
    if any(job.scratch for job in jobs):
        # Staging of transformed tensors is recycled between batches (Job.scratch); a small
        # budget keeps it, and the fresh pages it costs, small.
        profile = dataclasses.replace(profile, memory_budget=min(profile.memory_budget, _SCRATCH_BUDGET))
    plan = plan_reads([job.reads for job in jobs], profile,
                      {file: c.layout for file, c in checksums.items()})

    def read() -> Any:
        report = None
        if loading.progress and jax.process_index() == 0:
            report = Progress(f"load {checkpoint.survey.location.url}", plan.nbytes, enabled=True).start()
        values = execute(checkpoint.storage, plan, jobs, memory_budget=profile.memory_budget,
                         threads=options.threads, stats=stats, cancelled=loading.abandoned,
                         checksums=checksums, progress=report,
                         meet=lambda step: loading.peers.meet(f"{attempt}/{step}"))
        if report is not None:
            report.close()
        stats.seconds += time.perf_counter() - loading.started
        _LOG.debug("loaded %s: %s", checkpoint.survey.location.url, stats)
        loaded = [_output(out, values) for out in outputs]
        if treedef is None:
            flat = dict(zip([names[i] for i in wanted], loaded))
            return nest_names(flat) if loading.nest else flat
        # A skipped leaf the caller gave as a value stays; one given as a shape only (nothing
        # to return) becomes None, an empty subtree, so no abstract leaf passes for an array.
        result = [None if isinstance(leaf, jax.ShapeDtypeStruct) else leaf for leaf in leaves]
        for i, value in zip(wanted, loaded):
            result[i] = value
        return jax.tree_util.tree_unflatten(treedef, result)

    return read


def _output(out: int | tuple[int, int] | AssembledLeaf, values: list[Any]) -> Any:
    """A wanted leaf's value: its job's, its group's member's, or its assembled leaf's."""
    if isinstance(out, int):
        return values[out]
    if isinstance(out, tuple):
        return values[out[0]][out[1]]
    return out.value


def _job(name: str, source: TensorSource, request: _Request, read_once: bool, reshard_below: int,
         bounce_bytes: int, transform: Transform | None = None, *, slices_by_region: bool,
         casting: str) -> Job:
    if transform is not None and transform.is_identity:
        transform = None
    if request.sharding is None:
        return host_job(name, source, request.dtype, bounce_bytes=bounce_bytes, transform=transform,
                        slices_by_region=slices_by_region, casting=casting)
    return sharded_job(name, source, request.dtype, request.sharding,
                       read_once=read_once, bounce_bytes=bounce_bytes, reshard_below=reshard_below,
                       transform=transform, slices_by_region=slices_by_region, casting=casting)


def _map(
    checkpoint: Checkpoint, mapping: mapping_rules.Mapping, names: list[str], requests: list[_Request],
    from_checkpoint: bool, strict: bool | str,
) -> tuple[list[str], list[_Request], list[Assembly | None]]:
    """Tree names, their requests, and how each leaf is made of stored tensors.

    ``names`` are tree names, or (``from_checkpoint``, no target) stored ones,
    which become the tree leaves they map to (a stacked leaf gathers many).
    A leaf no rule maps, or whose stored tensors are missing or of shapes the
    rule cannot map, gets ``None`` (not loaded) unless ``strict``, which
    reports every such leaf at once (``MissingTensorError`` when stored tensors
    are missing), and with ``strict=True`` every stored tensor no leaf uses.
    """
    _check_strict(strict)
    shapes = {name: tensor.shape for name, tensor in checkpoint.tensors.items()}
    side = "stored" if from_checkpoint else "tree"
    unmapped = set(mapping.unmapped(names, side))
    problems = [f"no single rule maps the {side} names: {', '.join(sorted(unmapped))}"] if unmapped else []
    if from_checkpoint:
        names = list(dict.fromkeys(mapping.tree_name(n) for n in names if n not in unmapped))
        requests = [_Request(None, None, None)] * len(names)
        unmapped = set()
    assemblies: list[Assembly | None] = []
    used: set[str] = set()
    any_missing = False
    for name, request in zip(names, requests):
        assembly = None
        if name not in unmapped:
            try:
                assembly = mapping.assembly(name, tree_shape=request.shape, stored_shapes=shapes)
                missing = [p.stored for p in assembly.pieces if p.stored not in shapes]
                any_missing |= bool(missing)
                if missing:
                    raise MappingError(f"missing from the checkpoint: {', '.join(missing)}")
                wrong = [f"{p.stored} {shapes[p.stored]} (needs {p.transform.stored_shape})"
                         for p in assembly.pieces if tuple(shapes[p.stored]) != p.transform.stored_shape]
                if wrong:
                    raise MappingError(f"shape mismatch: {'; '.join(wrong)}")
                used.update(p.stored for p in assembly.pieces)
            except MappingError as e:
                problems.append(f"{name}: {e}")
                assembly = None
        assemblies.append(assembly)
    unexpected = sorted(set(shapes) - used)
    if strict is True and unexpected and not from_checkpoint:
        problems.append(f"in the checkpoint but not the target: {', '.join(unexpected)}")
    if strict and problems:
        error = MissingTensorError if any_missing else SafetensorsError
        raise error(f"target does not map to the checkpoint ({_LOOSER[strict]}): " + " | ".join(problems))
    return names, requests, assemblies


def _report_skipped(names: list[str], wanted: list[int], stats: LoadStats) -> None:
    """A ``strict=False`` load says which leaves it left out: a warning and ``stats.skipped``."""
    chosen = set(wanted)
    stats.skipped[:] = [name for i, name in enumerate(names) if i not in chosen]
    if stats.skipped:
        shown = ", ".join(stats.skipped[:20]) + (", ..." if len(stats.skipped) > 20 else "")
        warnings.warn(f"strict=False: {len(stats.skipped)} target leaves not loaded (absent from "
                      f"the checkpoint or of another shape; abstract ones are returned as None, "
                      f"arrays unchanged; the list is in LoadStats.skipped): {shown}",
                      SkippedLeavesWarning, stacklevel=5)


def _request_for(name: str, leaf: Any, seen: dict[tuple[Any, ...], _Request]) -> _Request:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(leaf, "sharding", None)
        key = (leaf.dtype, leaf.shape, sharding)
        try:
            return seen[key]
        except KeyError:
            request = seen[key] = _Request(np.dtype(leaf.dtype), tuple(leaf.shape), _concrete(name, sharding))
            return request
        except TypeError:  # a sharding that cannot be hashed
            return _Request(np.dtype(leaf.dtype), tuple(leaf.shape), _concrete(name, sharding))
    if isinstance(leaf, (np.ndarray, np.generic)):
        return _Request(leaf.dtype, tuple(leaf.shape), None)
    raise TypeError(
        f"target leaf {name!r} is a {type(leaf).__name__}; use a jax.Array, a "
        "jax.ShapeDtypeStruct (without a sharding: a numpy array) or a numpy array")


def _concrete(name: str, sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """A sharding over devices: ``jax.eval_shape`` of sharded arrays names only an abstract
    mesh (axis names and sizes), which the mesh set with ``jax.sharding.set_mesh`` makes
    concrete."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    current = jax.sharding.get_mesh()
    if isinstance(current, jax.sharding.Mesh) and current.devices.size and current.abstract_mesh == mesh:
        return jax.sharding.NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)
    raise ValueError(
        f"target leaf {name!r} is sharded over an abstract mesh ({mesh}), as jax.eval_shape "
        "returns: load inside `with jax.sharding.set_mesh(mesh):` with the mesh it stands for, "
        "or give shardings on a concrete mesh (ost.target builds them from the checkpoint)")


def _match(checkpoint: Checkpoint, names: list[str], requests: list[_Request],
           strict: bool | str) -> list[int]:
    """Indices of the target leaves to load; unless ``strict`` is False, every mismatch at once
    (``MissingTensorError`` when tensors are missing)."""
    _check_strict(strict)
    missing = [n for n in names if n not in checkpoint.tensors]
    unexpected = sorted(set(checkpoint.tensors) - set(names)) if strict is True else []
    mismatched = [
        f"{n}: checkpoint {checkpoint.tensors[n].shape}, target {r.shape}"
        for n, r in zip(names, requests)
        if n in checkpoint.tensors and r.shape is not None
        and r.shape != checkpoint.tensors[n].shape
    ]
    if strict and (missing or unexpected or mismatched):
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"in the checkpoint but not the target: {', '.join(unexpected)}")
        if mismatched:
            problems.append("shape mismatch: " + "; ".join(mismatched))
        error = MissingTensorError if missing else SafetensorsError
        raise error(f"target does not match the checkpoint ({_LOOSER[strict]}): " + " | ".join(problems))
    return [
        i for i, (n, r) in enumerate(zip(names, requests))
        if n in checkpoint.tensors
        and (r.shape is None or r.shape == checkpoint.tensors[n].shape)
    ]


# What a caller who hit a mismatch may pass instead, per strictness.
_LOOSER = {True: 'pass strict="target" to leave other checkpoint tensors unread, strict=False '
                 "to load the intersection",
           "target": "pass strict=False to load the intersection"}


def _check_strict(strict: bool | str) -> None:
    if strict not in (True, False, "target"):
        raise ValueError(f'strict must be True, False or "target", not {strict!r}')
