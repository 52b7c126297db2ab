"""Writing a block source as an Orbax PyTree checkpoint, chunk by chunk, from every process.

Orbax's save takes a tree of in-memory arrays, so the tree handed to it holds
placeholders (``_StreamedTensor``: a tensor of the source, not yet read) and a
``TypeHandler`` for them that writes each array with the TensorStore spec
Orbax's ``NumpyHandler`` would use, one chunk at a time (``planning.chunking``).
It reports the type ``np.ndarray``, so the result is an ordinary Orbax
checkpoint (tree metadata, OCDBT, zarr) that any Orbax restore reads with no
knowledge of this module. ``OrbaxForm`` says where the tree sits in the
directory (MaxText's train state: ``0/items``, under ``params.params``).

Under ``jax.distributed`` the chunks are shared out: process 0 runs Orbax's
handler (alone: its barriers do not involve the others) and writes its share;
the others write theirs straight into their own OCDBT files of the item, which
Orbax merges when process 0 finalizes, once every process has said it wrote
its share. The directory is staged beside the destination and swapped in
(``DirectorySwap``), so a failure anywhere, or a Ctrl-C, leaves no checkpoint
and no junk, and an old checkpoint whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import type_handlers

from orbax_safetensors.engine import BlockSource, Operation, Peers, Progress, TreeBlocks
from orbax_safetensors.engine import nest as nest_names
from orbax_safetensors.errors import ArgumentError, StorageError
from orbax_safetensors.format import TensorInfo, from_bytes
from orbax_safetensors.planning import (
    Box,
    TensorSpec,
    box_shape,
    chunk_boxes,
    chunk_shape,
)
from orbax_safetensors.storage import Location
from orbax_safetensors.storage.commit import DirectorySwap


@dataclasses.dataclass(frozen=True)
class OrbaxForm:
    """Where a converted tree sits in an Orbax checkpoint directory.

    ``item``: the PyTree item's directory under it; ``root``: the keys above
    the tree inside the item; ``beside``: other roots a read takes tree leaves from
    too (MaxText's variable collections beside ``params``, where its converter keeps
    DeepSeek's router bias, ``MoEBiasVar``, and V4's token table, ``Tid2EidVar``; a
    write puts them under ``root``, where MaxText's restore looks them up as well:
    ``checkpointing._alias_legacy_collections``); ``extra``: the item's other leaves;
    ``handler``: the item's handler, as the checkpoint's metadata names it;
    ``zarr3``: its arrays' format.
    """

    item: tuple[str, ...] = ()
    root: tuple[str, ...] = ()
    beside: tuple[tuple[str, ...], ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()
    handler: str = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    zarr3: bool = False

    @property
    def prefixes(self) -> tuple[str, ...]:
        """What the tree's names inside the item start with: its root's, then those beside it."""
        return tuple("".join(f"{key}." for key in root) for root in (self.root, *self.beside))

    def tree(self, leaves: dict[str, Any], *, nest: bool) -> dict[str, Any]:
        tree: dict[str, Any] = nest_names(leaves) if nest else dict(leaves)
        for key in reversed(self.root):
            tree = {key: tree}
        return {**dict(self.extra), **tree}

    def write_step_files(self, item: epath.Path) -> None:
        """The checkpoint's files around the item, as Orbax's ``Checkpointer`` leaves them: its
        ``_CHECKPOINT_METADATA`` (which Orbax v1's loaders read) naming the item's handler,
        and commit markers. A lone item is the checkpoint itself."""
        step, handlers = (item.parent, {item.name: self.handler}) if self.item else (item, self.handler)
        now = time.time_ns()
        (step / "_CHECKPOINT_METADATA").write_text(json.dumps({
            "item_handlers": handlers, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}))
        for directory in {item, step}:
            (directory / "commit_success.txt").write_text(
                f"Checkpoint commit was successful to {directory}")


# What MaxText 0.2.5's to_maxtext.py writes (a TrainState of step 0 through Orbax v1's
# training Checkpointer), and what its load_parameters_path (load_params_from_path) reads.
FORMS = {
    None: OrbaxForm(),
    "maxtext": OrbaxForm(item=("0", "items"), root=("params", "params"),
                         beside=(("params", "MoEBiasVar"), ("params", "Tid2EidVar")),
                         extra=(("step", 0), ("opt_state", {})),
                         handler="orbax.checkpoint.experimental.v1._src.handlers."
                                 "pytree_handler.PyTreeHandler", zarr3=True),
}


_IN_FLIGHT = 3  # chunks read, transformed or written at once (each about 3 chunks of memory)


async def _all(coroutines: Iterator[Any]) -> None:
    """Awaits all; every one has finished before a failure is raised (the caller then removes
    the staged directory, which TensorStore must no longer be writing into)."""
    outcomes = await asyncio.gather(*coroutines, return_exceptions=True)
    failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failure is not None:
        raise failure


class _Cancelled(Exception):
    """The conversion was interrupted; a chunk not written yet is not written."""


def _context(cache_bytes: int) -> ts.Context:
    """The TensorStore context every array of a conversion is written with, on a process.

    Orbax's own gives OCDBT a 100 MB node cache, which a long write fills
    with every B-tree version it commits: native memory outside any budget,
    growing with the model. Ours holds ``cache_bytes`` (a share of
    ``memory_budget``). One context per process, shared by every array
    (scalars too): one OCDBT writer per database.
    """
    return ts.Context({"file_io_concurrency": {"limit": 128},
                       "cache_pool#ocdbt": {"total_bytes_limit": cache_bytes}})


@dataclasses.dataclass(frozen=True, eq=False)
class _OrbaxWrite:
    """One conversion's Orbax output: where each leaf's bytes come from, its chunks, which
    of them this process writes, the context it writes them with, and the operation the
    processes share."""

    source: BlockSource
    specs: dict[str, TensorSpec]  # by tree name (the form's root left out)
    chunks: dict[str, tuple[int, ...]]
    mine: dict[str, list[Box]]
    op: Operation
    zarr3: bool
    context: ts.Context

    @classmethod
    def plan(cls, source: BlockSource, op: Operation, chunk_bytes: int, zarr3: bool,
             cache_bytes: int) -> _OrbaxWrite:
        """Every leaf's chunks, shared out round-robin in a fixed order, so each process knows
        its own without asking. A mapped tree's are tiles, one layer / expert each where the
        mapping stacks them (restored sharded: MaxText); a copied checkpoint's are rows (read
        back as row blocks, ``planning.chunking``)."""
        mapped = isinstance(source, TreeBlocks)
        specs = {spec.name: spec for spec in source.specs}
        chunks = {name: chunk_shape(spec.shape, spec.dtype.bits // 8, chunk_bytes,
                                    source.stacked(name) if mapped else (), tiles=mapped)
                  for name, spec in specs.items()}
        every = [(name, box) for name, spec in specs.items() for box in chunk_boxes(spec.shape, chunks[name])]
        mine: dict[str, list[Box]] = {name: [] for name in specs}
        for name, box in every[jax.process_index()::jax.process_count()]:
            mine[name].append(box)
        return cls(source, specs, chunks, mine, op, zarr3, _context(cache_bytes))

    @property
    def nbytes(self) -> int:
        """The bytes this process writes."""
        return sum(self.specs[name].dtype.nbytes(box_shape(box)) for name, boxes in self.mine.items()
                   for box in boxes)

    async def write_leaves(self, infos: MappingABC[str, Any], *, create: bool) -> None:
        """This process's chunks of every leaf, Orbax's ``infos`` giving their specs.

        ``_IN_FLIGHT`` workers take the chunks in turn (each read and transformed on a
        thread while TensorStore compresses and writes the others'): a task per chunk, all
        created up front, cost memory in proportion to the model. The first failure stops
        the others at their next chunk; so does another process's (``Peers.check``).
        """
        for name in infos:
            if self.specs[name].dtype.is_packed:
                raise ArgumentError(f"tensor {name!r}: Orbax cannot store "
                                    f"{self.specs[name].dtype.code} (sub-byte) arrays")
        # Every leaf opened at once (created, on process 0), those this process writes no
        # chunk of too: Orbax's merge wants every array's metadata.
        stores = {name: asyncio.ensure_future(self._open(name, info, create=create))
                  for name, info in infos.items()}
        chunks = ((name, box) for name in infos for box in self.mine[name])
        stopped = False

        async def worker() -> None:
            nonlocal stopped
            try:
                for name, box in chunks:
                    if stopped:
                        return
                    if self.op.cancelled.is_set():  # a Ctrl-C: the rest is not written
                        raise _Cancelled(name)
                    await self._write_chunk(name, await stores[name], box)
            except BaseException:
                stopped = True
                raise

        await _all(worker() for _ in range(_IN_FLIGHT))
        await _all(iter(stores.values()))  # opened, also where no worker waited for it

    async def _open(self, name: str, info: Any, *, create: bool) -> Any:
        spec = self.specs[name]
        tspec = type_handlers.get_json_tspec_write(
            info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=spec.shape, local_shape=spec.shape,
            dtype=spec.dtype.numpy,
            process_index=jax.process_index() if info.is_ocdbt_checkpoint else None)
        _set_chunk_shape(tspec, self.chunks[name])
        return await ts.open(ts.Spec(tspec), create=create, open=True, assume_metadata=not create,
                             context=self.context)

    async def _write_chunk(self, name: str, store: Any, box: Box) -> None:
        spec = self.specs[name]
        tensor = TensorInfo(name, spec.dtype, spec.shape, 0, spec.dtype.nbytes(spec.shape))
        raw = await asyncio.to_thread(self._read, tensor, box)
        await store[tuple(slice(a, b) for a, b in box)].write(from_bytes(raw, spec.dtype, box_shape(box)))
        self.op.wrote(len(raw))

    def _read(self, tensor: TensorInfo, box: Box) -> memoryview:
        self.op.peers.check()  # another process failed: the rest of this share is for nothing
        return self.source.read_block(tensor, box)


@dataclasses.dataclass(frozen=True, eq=False)
class _StreamedTensor:
    """A leaf of the tree handed to Orbax: a tensor of a block source, not yet read.

    Orbax asks a leaf for little more than its shape and dtype before handing
    it to its ``TypeHandler``; ``_StreamedTensorHandler`` then writes it.
    """

    name: str
    write: _OrbaxWrite

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.write.specs[self.name].shape)

    @property
    def dtype(self) -> np.dtype:
        return self.write.specs[self.name].dtype.numpy

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.write.specs[self.name].dtype.nbytes(self.shape)


class _StreamedTensorHandler(type_handlers.NumpyHandler):
    """Writes ``_StreamedTensor``s as Orbax writes numpy arrays, one chunk at a time.

    The type string stays ``np.ndarray``, so the checkpoint's metadata is that
    of a plain numpy save and any Orbax restore reads it with its own handler.
    Chunks are ``planning.chunking``'s (Orbax would make each array one
    chunk), and each is written whole: nothing is read back and merged, and
    readers can stream them too. This is process 0's half of the write: it
    creates the arrays and writes its share of the chunks, and returns (so
    Orbax merges the processes' OCDBT files and commits) only once every
    process has written its share.
    """

    async def serialize(self, values: Sequence[_StreamedTensor], infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> list[Any]:
        return [ocp_future.CommitFutureAwaitingContractedSignals(
            self._write_all(values, infos), name="orbax_safetensors_convert")]

    async def _write_all(self, values: Sequence[_StreamedTensor], infos: Sequence[Any]) -> None:
        for info in infos:
            await info.await_path_creation()
        if values:
            await values[0].write.write_leaves({v.name: i for v, i in zip(values, infos)}, create=True)
        if values:
            await asyncio.to_thread(values[0].write.op.exchange, "written", "")


class _ScalarHandler(type_handlers.ScalarHandler):
    """Orbax's, writing through the conversion's context (``_context``): with Orbax's own, a
    form's scalars (MaxText's ``step``) would be a second OCDBT writer of the process's
    database beside the arrays'."""

    def __init__(self, context: ts.Context):
        super().__init__()
        self._context = context

    async def serialize(self, values: Sequence[Any], infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> list[Any]:
        ours = [copy.copy(info) for info in infos]
        for info in ours:
            info.ts_context = self._context
        return await super().serialize(values, ours, args)


def _set_chunk_shape(spec: dict, chunk: tuple[int, ...]) -> None:
    """Our chunks in Orbax's zarr metadata (zarr v2, or v3's sharding codec)."""
    while "metadata" not in spec and "base" in spec:  # through a ``cast`` driver
        spec = spec["base"]
    metadata = spec["metadata"]
    if "chunks" in metadata:  # zarr v2
        metadata["chunks"] = list(chunk)
    else:  # zarr v3: the storage chunk is the shard; its inner chunks follow
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = list(chunk)
        for codec in metadata.get("codecs", []):
            if codec.get("name") == "sharding_indexed":
                codec["configuration"]["chunk_shape"] = list(chunk)


def write_orbax(source: BlockSource, dst: Location, form: OrbaxForm, *, chunk_bytes: int, cache_bytes: int,
                nest: bool, metadata: MappingABC[str, str] | None, progress: bool | None,
                label: str) -> tuple[int, int]:
    """Writes ``source`` as an Orbax checkpoint of ``form`` at ``dst`` (see the module
    docstring); every process calls it alike. ``cache_bytes``: TensorStore's OCDBT node cache
    on each process (``_context``). Returns (arrays, bytes this process wrote)."""
    for spec in source.specs:
        if 0 in spec.shape:
            raise ArgumentError(f"tensor {spec.name!r} has zero size, which Orbax cannot save")
    peers = Peers.collective("convert", dst.url)
    op = Operation(peers)
    write = _OrbaxWrite.plan(source, op, chunk_bytes, form.zarr3, cache_bytes)
    op.progress = report = Progress(label, write.nbytes, enabled=progress).start()
    # Written beside the target and swapped in: a failure leaves an old checkpoint whole.
    swap = DirectorySwap(dst, peers.share("token", uuid.uuid4().hex[:12]))
    op.on_primary("lock", swap.acquire)
    try:
        if op.is_primary:
            error = None
            try:
                swap.replace(functools.partial(_save_item, write, form, nest,
                                               {**source.metadata, **(metadata or {})}, dst.url))
            except BaseException as e:
                error = e
            op.agree("committed", error)
        else:
            item = os.path.join(swap.storage.url(swap.staged), *form.item)
            op.run("written", functools.partial(_write_share, write, item, form, dst.url))
            op.agree("committed", None)
    finally:
        if op.is_primary:
            swap.release()
    report.close()
    return len(write.specs), report.done


def _save_item(write: _OrbaxWrite, form: OrbaxForm, nest: bool, custom: MappingABC[str, str],
               destination: str, url: str) -> None:
    """Process 0: the Orbax checkpoint at ``url`` (the tree through Orbax's own handler, then
    the step's files of ``form``), staged there for ``destination`` (which errors name)."""
    leaves = {name: _StreamedTensor(name, write) for name in write.specs}
    registry = type_handlers.create_type_handler_registry(  # jax.Array's: Orbax warns without one
        (_StreamedTensor, _StreamedTensorHandler()), (int, _ScalarHandler(write.context)),
        (jax.Array, type_handlers.ArrayHandler()))
    item = epath.Path(url).joinpath(*form.item)
    item.mkdir(parents=True, exist_ok=True)
    handler = ocp.PyTreeCheckpointHandler(
        use_zarr3=form.zarr3, type_handler_registry=registry,
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}))
    args = ocp.args.PyTreeSave(form.tree(leaves, nest=nest), custom_metadata=dict(custom) or None)
    with _orbax_failures(destination):
        before = set(threading.enumerate())
        try:
            handler.save(item, args=args)
            handler.finalize(item)
        except BaseException:
            # Orbax's threads may still be writing (a Ctrl-C reaches only this one): ours stop
            # at their next chunk, which fails Orbax's metadata write after them, and all of
            # the save's threads are waited for before the staged directory goes.
            write.op.cancel()
            for thread in set(threading.enumerate()) - before:
                if type(thread).__name__ == "_SignalingThread":  # Orbax's commit threads
                    with contextlib.suppress(Exception):  # its join re-raises what it raised
                        thread.join()
            with contextlib.suppress(Exception):
                handler.close()
            raise
        handler.close()
    form.write_step_files(item)


def _write_share(write: _OrbaxWrite, item: str, form: OrbaxForm, destination: str) -> None:
    """Processes other than 0: their chunks, into their own OCDBT files of the item that process
    0 is writing (it merges them before committing)."""
    root = tuple(form.root)

    async def run() -> None:
        await write.write_leaves({name: type_handlers.ParamInfo(
            name=".".join(root + (name,)), parent_dir=epath.Path(item), is_ocdbt_checkpoint=True,
            use_zarr3=write.zarr3, ts_context=write.context) for name in write.specs}, create=False)

    with _orbax_failures(destination):
        asyncio.run(run())


# TensorStore's words for a full disk, which it reports as a ValueError.
_DISK_FULL = re.compile(r"RESOURCE_EXHAUSTED.*(No space left on device|os_error_code='%d')"
                        % errno.ENOSPC, re.DOTALL)


@contextlib.contextmanager
def _orbax_failures(destination: str) -> Iterator[None]:
    """Orbax's failures, as the caller should see them: once, and of the type they are.

    A full disk reaches us as TensorStore reports it, ``ValueError:
    RESOURCE_EXHAUSTED ... No space left on device [os_error_code='28']``: it
    is raised as an ``OSError`` (ENOSPC) naming the destination, as a full disk
    is everywhere else, with TensorStore's error as its cause. Orbax's threads
    also log each error they pass on (absl ``ERROR``, with its traceback):
    while the save runs, such records wait, and those of the error we raise
    are dropped, not printed (all of them after a Ctrl-C: writes still in
    flight fail on the staged directory being removed); any other is logged
    once the save ends.
    """
    absl_logger = logging.getLogger("absl")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or (record.exc_info and record.exc_info[1] is not None):
            held.append(record)
            return False
        return True

    absl_logger.addFilter(hold)
    raised: set[int] = set()
    try:
        yield
    except ValueError as e:
        raised = _chain(e)
        if _DISK_FULL.search(str(e)):
            raise StorageError("no space left on device writing the Orbax checkpoint",
                               url=destination, code=errno.ENOSPC) from e
        raise
    except BaseException as e:
        raised = _chain(e)
        if isinstance(e, KeyboardInterrupt):  # what the writes in flight then hit is ours, not news
            held.clear()
        raise
    finally:
        absl_logger.removeFilter(hold)
        for record in held:
            if not record.exc_info or id(record.exc_info[1]) not in raised:
                absl_logger.handle(record)


def _chain(error: BaseException) -> set[int]:
    """The ids of ``error`` and the exceptions it was raised from or during."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return seen
