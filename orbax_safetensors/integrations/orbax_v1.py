"""Orbax v1: a checkpointable handler and a ``CheckpointLayout`` for safetensors.

``SafetensorsHandler`` is the v1 counterpart of the v0 handler: a step's
checkpointable saved through it is the same HF directory the v0 handler
writes, and the shim (``orbax_shim``) makes each generation read the other's
steps. It claims only what asks for it (a ``SafetensorsSave``, or any PyTree
under a name it is registered for), never plain PyTrees, so registering it
does not take over Orbax's own PyTree saves.

``SafetensorsLayout`` treats a whole path as one safetensors checkpoint (a
file, or an HF directory written by us, ``transformers`` or anyone else),
the way Orbax's own ``SafetensorsLayout`` does, and adds saving. Orbax
0.12.x resolves layouts from a fixed enum with no registry, so ours cannot be
selected with ``ocp.v1.Context(checkpoint_layout=...)``; use it directly:

    layout = ost.SafetensorsLayout()
    loading = await layout.load(path, abstract_state=abstract_params)  # opened and planned
    params = await loading                                              # once the reads are done
    await (await layout.save_checkpointables(path, checkpointables={"params": params}))

Compared with Orbax's layout, a load is planned per process from the target
sharding the same way, but strided (column-sharded) tensors are served by
coalesced reads into bounce buffers instead of many small requests, and a
tensor replicated across processes can be read once and shared over the
devices (``ReadOptions.replicated_read_once``); thin strips across processes
are read as row blocks and resharded on device (``reshard_thin_shards``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint.experimental import v1 as ocp_v1

from orbax_safetensors.engine import metadata, open_checkpoint
from orbax_safetensors.errors import SafetensorsError
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
    """Host copies now; the writes once ``directory`` exists (Orbax creates it in the background)."""
    target = directory.path if hasattr(directory, "await_creation") else directory
    job = prepare_item_save(target, _save_args(checkpointable))

    async def write() -> None:
        if hasattr(directory, "await_creation"):
            await directory.await_creation()
        await asyncio.wrap_future(job.start())

    return write()


class SafetensorsHandler:
    """``ocp.v1.handlers.CheckpointableHandler`` writing a checkpointable as an HF safetensors directory.

    Registered globally on import (``orbax_shim``). Saving picks it for a
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
    give exactly one, keyed ``"state"`` unless the caller names it.
    """

    async def get_checkpointable_names(self, path: Any) -> list[str | None]:
        del path
        return []

    async def checkpointables_metadata(self, path: Any) -> ocp_v1.CheckpointMetadata:
        inner = await self.metadata(path, None)
        return ocp_v1.CheckpointMetadata(
            path, metadata={STATE: inner.metadata}, custom_metadata=inner.custom_metadata)

    async def metadata(self, path: Any, checkpointable_name: str | None) -> ocp_v1.CheckpointMetadata:
        del checkpointable_name
        info = metadata(str(path))
        return ocp_v1.CheckpointMetadata(path, metadata=info.tensors, custom_metadata=info.metadata)

    async def validate_checkpointables(self, path: Any) -> None:
        """Raises ``InvalidLayoutError`` unless ``path`` opens as a committed safetensors checkpoint."""
        try:
            await asyncio.to_thread(lambda: open_checkpoint(Location.resolve(str(path))).close())
        except (SafetensorsError, OSError) as e:
            raise ocp_v1.errors.InvalidLayoutError(
                f"{path} is not a safetensors checkpoint: {e}") from e

    async def validate(self, path: Any, checkpointable_name: str | None) -> None:
        await self.validate_checkpointables(path)

    async def load(self, path: Any, checkpointable_name: str | None = None,
                   abstract_state: Any = None) -> Awaitable[Any]:
        """The checkpoint shaped and sharded like ``abstract_state`` (flat ``{name: array}`` if None)."""
        del checkpointable_name
        return await SafetensorsHandler().load(path, abstract_state)

    async def load_checkpointables(self, path: Any, abstract_checkpointables:
                                   dict[str, Any] | None = None) -> Awaitable[dict[str, Any]]:
        requested = abstract_checkpointables or {STATE: None}
        if len(requested) != 1:
            raise ValueError(
                f"{path} is a safetensors checkpoint: one PyTree, not checkpointables {sorted(requested)}")
        ((name, abstract),) = requested.items()
        loading = await self.load(path, name, abstract)

        async def named() -> dict[str, Any]:
            return {name: await loading}

        return named()

    async def save_checkpointables(self, path: Any, *, checkpointables: dict[str, Any]) -> Awaitable[None]:
        """Writes the one checkpointable as an HF directory at ``path`` (or one file if it ends
        in ``.safetensors``); ``path`` may be a ``PathAwaitingCreation`` or a plain path/URL."""
        if len(checkpointables) != 1:
            raise ValueError(
                "a safetensors checkpoint holds one PyTree; got checkpointables "
                f"{sorted(checkpointables)} (save the others with Orbax's own layout)")
        (checkpointable,) = checkpointables.values()
        return await _save(path, checkpointable)
