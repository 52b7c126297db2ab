"""``load``, ``async_load`` and ``metadata``: from storage to host arrays or sharded ``jax.Array``s.

The target tree decides everything about the result: its structure, each
leaf's dtype (conversion happens on the host, after the read) and each leaf's
sharding. Without a target the result is a flat ``{name: numpy array}``.

A load resolves the call once (a ``Location``, a ``LoadTarget``, the
``LoadOptions``), then per opened version of the checkpoint a ``ReadPolicy``
and a ``LoadPlan`` (``plan``), and executes the plan; an overwrite that
changed the files meanwhile means planning and reading again (``_Loading``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Unpack

import fsspec
import jax

from orbax_safetensors.engine.core.catalog import Checkpoint, open_checkpoint
from orbax_safetensors.engine.core.coordination import Peers, describe_arguments, describe_sharding
from orbax_safetensors.engine.core.gc_pause import gc_paused
from orbax_safetensors.engine.loading.plan import LoadPlan, execute_load, plan_load
from orbax_safetensors.engine.loading.execution import LoadStats
from orbax_safetensors.engine.core.options import with_shorthand
from orbax_safetensors.engine.loading.options import LoadKeywords, LoadOptions, ReadPolicy, resolve_policy
from orbax_safetensors.engine.loading.target_match import LoadTarget, concrete_sharding
from orbax_safetensors.engine.core.tree_names import flatten_with_names
from orbax_safetensors.errors import CheckpointChangedError, SkippedLeavesWarning
from orbax_safetensors.storage import Location
from orbax_safetensors.storage.retry import SNAPSHOT_REREADS

_LOG = logging.getLogger("orbax_safetensors")


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from headers only (no tensor bytes)."""

    tensors: dict[str, jax.ShapeDtypeStruct]
    metadata: dict[str, str]
    files: dict[str, tuple[str, ...]]  # tensor name → the file(s) holding it


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
    building 100 000 took most of the call), and tensors stored in the same files one tuple
    of their names (a file's name split off its path once).
    """
    structs: dict[tuple[tuple[int, ...], str], jax.ShapeDtypeStruct] = {}
    file_names: dict[tuple[str, ...], tuple[str, ...]] = {}
    tensors: dict[str, jax.ShapeDtypeStruct] = {}
    files: dict[str, tuple[str, ...]] = {}
    split = checkpoint.storage.split
    for name, t in sorted(checkpoint.tensors.items()):  # one loop, no call per tensor: 100 000 of them
        key = (t.shape, t.dtype.code)
        struct = structs.get(key)
        if struct is None:
            struct = structs[key] = jax.ShapeDtypeStruct(t.shape, t.dtype.numpy)
        tensors[name] = struct
        paths = tuple([s.file for s in t.slices])
        names = file_names.get(paths)
        if names is None:
            names = file_names[paths] = tuple(split(path)[1] for path in paths)
        files[name] = names
    return CheckpointMetadata(tensors=tensors, metadata=checkpoint.metadata, files=files)


def load(
    path: str | os.PathLike,
    target: Any = None,
    *,
    options: LoadOptions | None = None,
    stats: LoadStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[LoadKeywords],
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
      options: an ``ost.LoadOptions``: how to match the target (``strict``, ``mapping``,
        ``nest``), how much to stage and how to read (``memory_budget``, read sizes,
        checksums, casts), a ``progress`` line.
      stats: a ``LoadStats`` to fill with this process's bytes and requests.
      storage_options: constructor arguments of the fsspec filesystem (credentials,
        ``endpoint_url``, ...), e.g. ``{"anon": True}``; for ``hf://`` paths also
        ``token``, ``revision``, ``local_files_only`` and ``cache_dir``; or
      filesystem: an fsspec filesystem you already configured (``s3fs.S3FileSystem(...)``).
      **shorthand: any field of ``LoadOptions`` as a keyword (``strict=False``,
        ``memory_budget="2GB"``), replacing that field of ``options``.
    """
    options = with_shorthand(LoadOptions, options, shorthand)
    loading = _Loading(Location.resolve(path, storage_options, filesystem),
                       LoadTarget(target, options.strict, options.mapping, options.nest), options,
                       LoadStats() if stats is None else stats)
    with gc_paused():
        return loading.run(loading.plan())


def async_load(
    path: str | os.PathLike,
    target: Any = None,
    *,
    options: LoadOptions | None = None,
    stats: LoadStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[LoadKeywords],
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
    ``reshard_thin_shards`` are off unless the options turn them on, because
    they end in device collectives (an all-gather, an all-to-all), and one
    issued from a background thread can deadlock against collectives the
    caller issues meanwhile on the other processes.
    """
    options = with_shorthand(LoadOptions, options, shorthand)
    loading = _Loading(Location.resolve(path, storage_options, filesystem),
                       LoadTarget(target, options.strict, options.mapping, options.nest), options,
                       LoadStats() if stats is None else stats, background=True)
    with gc_paused():  # not while the reads run: the caller compiles meanwhile
        planned = loading.plan()
    return _in_background(loading, planned)


@dataclasses.dataclass(frozen=True)
class _Planned:
    """One attempt's plan (its opened version of the checkpoint inside)."""

    plan: LoadPlan
    attempt: int


@dataclasses.dataclass
class _Loading:
    """A load: open and plan, then read; again if an overwrite changed what it read.

    Where the backend pins what it opened (local files) one attempt always
    suffices; on object stores a commit landing mid-load means reading again.
    ``background``: an ``async_load``, whose reads stop once the caller is gone
    (``abandoned``) and whose policy issues no collective unasked (``_policy``).
    """

    location: Location
    target: LoadTarget
    options: LoadOptions
    stats: LoadStats
    background: bool = False
    started: float = dataclasses.field(default_factory=time.perf_counter)
    peers: Peers = dataclasses.field(init=False)
    accelerated: bool = dataclasses.field(init=False)  # a target leaf on a device not a CPU
    abandoned: threading.Event | None = dataclasses.field(init=False)  # set: the reads stop

    def __post_init__(self) -> None:
        devices = _target_devices(self.target.tree)
        self.peers = _peers(devices, self.location)
        self.accelerated = any(d.platform != "cpu" for held in devices for d in held or ())
        self.abandoned = _Abandoned() if self.background else None

    def plan(self) -> _Planned:
        """Opens the checkpoint (the version every process opened) and plans its reads; a
        failure here is told to the other processes (``Peers.fail``), who raise too."""
        try:
            return self._plan(0)
        except BaseException as e:
            self.peers.fail(e)
            raise

    def _policy(self, checkpoint: Checkpoint) -> ReadPolicy:
        """The options resolved for ``checkpoint``. In the background, the knobs left to the
        process count (read once, reshard thin shards) stay off: they end in device
        collectives, and one issued from a background thread can deadlock against
        collectives the caller issues meanwhile on the other processes."""
        return resolve_policy(self.options, checkpoint,
                              collectives=self.peers.is_collective and not self.background,
                              accelerated=self.accelerated)

    def _plan(self, first: int) -> _Planned:
        """Plans on one version of the checkpoint, opened from attempt ``first`` on. Where a
        backend cannot pin what a load reads (object stores), a load that read a file changed
        meanwhile plans and reads again: a commit takes milliseconds to seconds, a retry as
        long as a load, under the one policy for snapshot re-reads."""
        for attempt in SNAPSHOT_REREADS.tries(first=first):
            checkpoint, planned = open_checkpoint(self.location), None
            try:
                if attempt == 0 and self.peers.is_collective:  # after what may fail alone: the lookup
                    self.peers.check_same("target", _describe_target(self), "targets or load options")
                if self._same_everywhere(attempt, checkpoint):
                    planned = _Planned(plan_load(checkpoint, self.target, self._policy(checkpoint)), attempt)
            except Exception:
                if not self._changed(checkpoint):
                    raise
            finally:
                if planned is None:  # also on Ctrl-C: nothing keeps this version open
                    checkpoint.close()
            if planned is not None:
                self._report_skipped(planned.plan)
                return planned
        raise CheckpointChangedError(f"the checkpoint kept changing while it was read "
                                     f"({SNAPSHOT_REREADS.attempts} attempts)", file=self.location.url)

    def _report_skipped(self, plan: LoadPlan) -> None:
        """A ``strict=False`` load says which leaves it left out: a warning (pointing at the
        caller's ``load``) and ``stats.skipped``."""
        if plan.skeleton is None:
            return
        skipped = self.stats.skipped
        skipped[:] = plan.skipped
        if skipped:
            shown = ", ".join(skipped[:20]) + (", ..." if len(skipped) > 20 else "")
            warnings.warn(f"strict=False: {len(skipped)} target leaves not loaded (absent from "
                          f"the checkpoint or of another shape; abstract ones are returned as None, "
                          f"arrays unchanged; the list is in LoadStats.skipped): {shown}",
                          SkippedLeavesWarning, stacklevel=5)

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
            with planned.plan.checkpoint as checkpoint:
                try:
                    result = self._read(planned)
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

    def _read(self, planned: _Planned) -> Any:
        """Executes one attempt's plan; the processes meet under the attempt's name."""
        result = execute_load(planned.plan, self.stats, progress=self.options.progress, cancelled=self.abandoned,
                              meet=lambda step: self.peers.meet(f"{planned.attempt}/{step}"),
                              check_peers=self.peers.check)
        self.stats.seconds += time.perf_counter() - self.started
        _LOG.debug("loaded %s: %s", self.location.url, self.stats)
        return result

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


def _peers(shardings: list[frozenset | None], location: Location) -> Peers:
    """Who takes part in a load: every process when a target leaf is sharded over devices of
    another process (they read their own shards of one global array, and must agree on the
    version they read); otherwise this process alone (no target, host arrays, arrays on its
    own devices), which then needs nobody else to call ``load``. ``shardings``: the devices of
    each (``_target_devices``)."""
    me = jax.process_index()
    spans = any(jax.process_count() > 1 if devices is None else any(d.process_index != me for d in devices)
                for devices in shardings)
    return Peers.collective("load", location.url) if spans else Peers.local(location.url)


def _target_devices(target: Any) -> list[frozenset | None]:
    """The devices of each distinct sharding of the target's array leaves (100 000 leaves hold
    a few); ``None`` for an abstract mesh with none set (reported when planned, everywhere)."""
    distinct: dict[Any, Any] = {}
    for leaf in jax.tree_util.tree_leaves(target) if target is not None else []:
        if getattr(leaf, "sharding", None) is None or not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            continue
        try:
            distinct.setdefault(leaf.sharding, leaf.sharding)
        except TypeError:  # a sharding that cannot be hashed
            distinct[object()] = leaf.sharding

    def devices(sharding: Any) -> frozenset | None:
        try:
            return frozenset(concrete_sharding("", sharding).device_set)
        except Exception:  # an abstract mesh with none set: reported when planned, everywhere
            return None

    return [devices(sharding) for sharding in distinct.values()]


def _describe_target(loading: _Loading) -> list[str]:
    """What the processes of a collective load must agree on: the target leaf by leaf
    (name, dtype, shape, sharding), the mapping and the options that decide the reads."""
    target = loading.target
    names, leaves, _ = flatten_with_names(target.tree)
    lines = [f"{name}: {getattr(leaf, 'dtype', None)}{list(getattr(leaf, 'shape', ()))} "
             f"{describe_sharding(getattr(leaf, 'sharding', None))}" for name, leaf in zip(names, leaves)]
    return lines + describe_arguments(loading.options) + [f"background {loading.background}"]


class _Abandoned(threading.Event):
    """Set, or the interpreter is exiting: a Ctrl-C or the end of the script left nobody to
    take a background load's result, so its reads stop instead of holding the exit."""

    def is_set(self) -> bool:
        return super().is_set() or _EXITING.is_set()


_EXITING = threading.Event()
_background: set[threading.Thread] = set()  # the background loads still running
_background_lock = threading.Lock()


def _in_background(loading: _Loading, planned: _Planned) -> concurrent.futures.Future[Any]:
    """Runs ``planned`` on a thread of its own; the future resolves to what ``load`` returns.
    The thread is a daemon: at exit ``_stop_background_loads`` stops and joins it."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(loading.run(planned))
        except BaseException as e:  # the caller gets it from the future
            future.set_exception(e)
        finally:
            with _background_lock:
                _background.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="orbax_safetensors-load", daemon=True)
    with _background_lock:
        _background.add(thread)
    thread.start()
    return future


def _stop_background_loads() -> None:
    """At exit nobody is left to take a background load's result: its reads stop (within the
    executor's ``POLL``) and its thread is joined, before the interpreter (and, registered
    after jax's hooks, before JAX's backends) goes away."""
    _EXITING.set()
    with _background_lock:
        running = list(_background)
    for thread in running:
        thread.join()


atexit.register(_stop_background_loads)
