"""Orbax v1: a checkpointable handler and a ``CheckpointLayout`` for safetensors.

``SafetensorsHandler`` is the v1 counterpart of the v0 handler: a step's
checkpointable saved through it is the same HF directory the v0 handler
writes, and the shim (``orbax_shim``) makes each generation read the other's
steps. It claims only what asks for it (a ``SafetensorsSave``, or any PyTree
under a name it is registered for), never plain PyTrees, so registering it
does not take over Orbax's own PyTree saves.

``SafetensorsLayout`` treats a whole path as one safetensors checkpoint (a
file, or a directory: an HF one written by us, ``transformers`` or anyone
else, or any ``*.safetensors`` files without index), the way Orbax's own
``SafetensorsLayout`` does, and adds saving. It is a drop-in for Orbax's:
``ost.install_orbax_layout()`` makes Orbax's own entry points use it
(``ocp.v1.load_pytree``, ``load_async``, ``pytree_metadata``, any
``Context(checkpoint_layout=SAFETENSORS)``), and it can be used directly:

    layout = ost.SafetensorsLayout()
    loading = await layout.load(path, abstract_state=abstract_params)  # opened and planned
    params = await loading                                              # once the reads are done
    await (await layout.save_checkpointables(path, checkpointables={"params": params}))

What it keeps of Orbax's contract: ``abstract_state`` may name a subset of the
checkpoint's tensors (the others are not read; ``{}`` loads nothing), each with
its shape, a missing one raising a ``KeyError`` (``ost.MissingTensorError``);
no ``abstract_state`` loads every tensor as a host array; the context's
``MemoryOptions.read_concurrent_bytes`` and ``SafetensorsOptions``
(``read_chunk_bytes``, ``max_over_read_ratio``) bound the reads;
``metadata`` fills ``commit_timestamp_nsecs`` from the files. Where it differs, on
purpose: the checkpoint is the one the catalog finds there (an index decides
which files count; without one, every ``*.safetensors`` file, and HF-named
shards only as a whole set); everything that can fail before a byte is read
(a missing tensor, a shape mismatch) raises from ``load`` itself rather than from
its awaitable; ``abstract_state`` may be nested (names are key paths joined with
``.``); a leaf without a sharding is a host numpy array rather than a replicated
``jax.Array``; the files are checked against the crc32c they store; and the
checkpointable methods and saving work.

The trade-off, measured in ``bench/maxtext_dynamic.py``: Orbax's layout reads the
target sharding's byte ranges with asyncio and coalesces strided runs under an
over-read ratio; ours plans the same per-process ranges, serves strided
(column-sharded) tensors through coalesced reads into bounce buffers, can read a
tensor replicated across processes once and share it over the devices
(``LoadOptions.replicated_read_once``), and moves thin strips across processes as
row blocks resharded on device (``reshard_thin_shards``). It opens the checkpoint
through the catalog, which reads every header once more per call than Orbax's
name-only ``validate_checkpointables``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1._src.context import context as orbax_context

from orbax_safetensors.engine import LoadOptions, WriteSession, metadata_of, open_checkpoint
from orbax_safetensors.errors import ArgumentError, SafetensorsError
from orbax_safetensors.storage import Location
from orbax_safetensors.integrations.orbax_items import (
    SafetensorsRestore,
    SafetensorsSave,
    item_tensors,
    prepare_item_save,
    start_restore_item,
)

STATE = "state"  # the name a flat checkpoint's one checkpointable goes by (Orbax's "state")
_ARRAY_LEAVES = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)


def _save_args(checkpointable: Any) -> SafetensorsSave:
    return checkpointable if isinstance(checkpointable, SafetensorsSave) else SafetensorsSave(checkpointable)


def _restore_args(abstract: Any) -> SafetensorsRestore:
    return abstract if isinstance(abstract, SafetensorsRestore) else SafetensorsRestore(abstract)


async def _save(directory: Any, checkpointable: Any) -> Awaitable[None]:
    """Host copies now; the writes once ``directory`` exists (Orbax creates it in the
    background), and only if the returned awaitable is awaited: a caller that gave up on the
    save (a sibling checkpointable failed) never starts them. A plain path is the caller's own
    and is taken as ``ost.save`` takes it (refused if it holds a checkpoint, unless
    ``SafetensorsSave(overwrite=True)``)."""
    orbax_temporary = hasattr(directory, "await_creation")
    job = prepare_item_save(directory.path if orbax_temporary else directory,
                            _save_args(checkpointable), fresh=orbax_temporary)
    return _Writes(job, directory if orbax_temporary else None)


class _Writes:
    """The writes of a prepared save, run when awaited. Dropped without being awaited, the
    save is let go (``WriteSession.abandon``): no lock left on the caller's path."""

    def __init__(self, job: WriteSession, creation: Any):
        self._job, self._creation, self._awaited = job, creation, False

    def __await__(self):
        self._awaited = True
        return self._write().__await__()

    async def _write(self) -> None:
        if self._creation is not None:
            await self._creation.await_creation()
        await asyncio.wrap_future(self._job.start())

    def __del__(self) -> None:
        if not self._awaited:
            try:
                self._job.abandon()
            except Exception:  # noqa: BLE001 -- at collection, with nobody to tell
                pass


class SafetensorsHandler:
    """``ocp.v1.handlers.CheckpointableHandler`` writing a checkpointable as an HF safetensors directory.

    Registered globally once Orbax and orbax_safetensors are both imported
    (``orbax_registration``, through ``orbax_shim``). Saving picks it for a
    ``SafetensorsSave`` checkpointable; to send a plain PyTree through it,
    scope it to a name in a local registry:
    ``ocp.v1.handlers.local_registry().add(ost.SafetensorsHandler, checkpointable_name="params")``.
    Loading finds it through the typestr recorded at save time, v0 or v1.
    """

    async def save(self, directory: Any, checkpointable: Any) -> Awaitable[None]:
        return await _save(directory, checkpointable)

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        """Opens and plans now (what can fail before a read raises here); the returned
        awaitable gives the item once the background reads finish (``ost.async_load``)."""
        loading = await asyncio.to_thread(
            start_restore_item, directory, _restore_args(abstract_checkpointable))

        async def loaded() -> Any:
            return await asyncio.wrap_future(loading)

        return loaded()

    async def metadata(self, directory: Any) -> dict[str, jax.ShapeDtypeStruct]:
        return item_tensors(directory)

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, SafetensorsSave)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
        """Any PyTree of array-likes: reached only once the saved typestr picked this handler
        (or nothing else can load the item), so it need not tell our items from others."""
        if isinstance(abstract_checkpointable, SafetensorsRestore):
            return True
        leaves = jax.tree_util.tree_leaves(abstract_checkpointable)
        return all(isinstance(leaf, _ARRAY_LEAVES) for leaf in leaves)


class SafetensorsLayout:
    """An Orbax v1 ``CheckpointLayout``: one safetensors checkpoint at ``path``, loaded and saved.

    A safetensors checkpoint is flat: one PyTree, no named checkpointables.
    ``load_checkpointables`` and ``save_checkpointables`` therefore take or
    give exactly one, keyed ``"state"`` unless the caller names it (Orbax's
    layout raises ``NotImplementedError`` for both).
    """

    async def get_checkpointable_names(self, path: Any) -> list[str | None]:
        del path
        return []

    async def checkpointables_metadata(self, path: Any) -> ocp_v1.CheckpointMetadata:
        inner = await self.metadata(path, None)
        return ocp_v1.CheckpointMetadata(
            path, metadata={STATE: inner.metadata}, custom_metadata=inner.custom_metadata,
            commit_timestamp_nsecs=inner.commit_timestamp_nsecs)

    async def metadata(self, path: Any, checkpointable_name: str | None) -> ocp_v1.CheckpointMetadata:
        """Tensors (``ShapeDtypeStruct``), merged ``__metadata__``, and as
        ``commit_timestamp_nsecs`` the latest modification time of the checkpoint's
        files in nanoseconds (Orbax's layout gives whole seconds under that name)."""
        del checkpointable_name

        def read() -> tuple[Any, int | None]:
            with open_checkpoint(Location.resolve(str(path))) as checkpoint:
                return metadata_of(checkpoint), checkpoint.modified_ns()

        info, modified = await asyncio.to_thread(read)
        return ocp_v1.CheckpointMetadata(path, metadata=info.tensors, custom_metadata=info.metadata,
                                         commit_timestamp_nsecs=modified)

    async def validate_checkpointables(self, path: Any) -> None:
        """Raises ``InvalidLayoutError`` unless ``path`` opens as a committed safetensors checkpoint."""
        try:
            await asyncio.to_thread(lambda: open_checkpoint(Location.resolve(str(path))).close())
        except (SafetensorsError, OSError) as e:
            raise ocp_v1.errors.InvalidLayoutError(
                f"{path} is not a safetensors checkpoint: {e}") from e

    async def validate(self, path: Any, checkpointable_name: str | None) -> None:
        """Nothing beyond ``validate_checkpointables``: a flat checkpoint has no named parts."""
        del path, checkpointable_name

    async def load(self, path: Any, checkpointable_name: str | None = None,
                   abstract_state: Any = None) -> Awaitable[Any]:
        """The tensors ``abstract_state`` names (a subset is fine: others are not read),
        shaped and sharded like it; every tensor as a flat ``{name: array}`` if None.
        Opens and plans now, so a missing tensor (``KeyError``) or a shape mismatch raises
        here; the awaitable gives the arrays once read."""
        del checkpointable_name
        restore = SafetensorsRestore(abstract_state, strict="target", options=_load_options())
        return await SafetensorsHandler().load(path, restore)

    async def load_checkpointables(self, path: Any, abstract_checkpointables:
                                   dict[str, Any] | None = None) -> Awaitable[dict[str, Any]]:
        requested = abstract_checkpointables or {STATE: None}
        if len(requested) != 1:
            raise ArgumentError(
                f"{path} is a safetensors checkpoint: one PyTree, not checkpointables {sorted(requested)}")
        ((name, abstract),) = requested.items()
        loading = await self.load(path, name, abstract)

        async def named() -> dict[str, Any]:
            return {name: await loading}

        return named()

    async def save_checkpointables(self, path: Any, *, checkpointables: dict[str, Any]) -> Awaitable[None]:
        """Writes the one checkpointable as an HF directory at ``path`` (or one file if it ends
        in ``.safetensors``); ``path`` may be a ``PathAwaitingCreation`` (Orbax's temporary) or
        a plain path/URL, where a checkpoint already there is refused unless the checkpointable
        is a ``SafetensorsSave(..., overwrite=True)``, which replaces it whole (never two
        checkpoints in one directory)."""
        if len(checkpointables) != 1:
            raise ArgumentError(
                "a safetensors checkpoint holds one PyTree; got checkpointables "
                f"{sorted(checkpointables)} (save the others with Orbax's own layout)")
        (checkpointable,) = checkpointables.values()
        return await _save(path, checkpointable)


def _load_options() -> LoadOptions:
    """The active Orbax context's knobs of a safetensors load, as ours: its in-flight budget
    (``MemoryOptions.read_concurrent_bytes``), read size and over-read ratio
    (``SafetensorsOptions``, where the installed Orbax has them); refused as Orbax refuses them.
    A read size under ``LoadOptions.MIN_CHUNK_BYTES`` is raised to it (Orbax takes any: each
    chunk is a request, and smaller ones only add requests)."""
    context = orbax_context.get_context()
    budget = getattr(context.memory_options, "read_concurrent_bytes", None)
    chunk = getattr(context.safetensors_options, "read_chunk_bytes", None)
    ratio = getattr(context.safetensors_options, "max_over_read_ratio", None)
    if chunk is not None and chunk <= 0:
        raise ArgumentError(f"SafetensorsOptions.read_chunk_bytes must be positive, got {chunk}")
    if ratio is not None and ratio < 1.0:
        raise ArgumentError(f"SafetensorsOptions.max_over_read_ratio must be >= 1.0, got {ratio}")
    if chunk is not None:
        chunk = max(chunk, LoadOptions.MIN_CHUNK_BYTES)
    chosen = dict(memory_budget=budget, chunk_bytes=chunk, max_overread=ratio)
    return LoadOptions(**{k: v for k, v in chosen.items() if v is not None})
