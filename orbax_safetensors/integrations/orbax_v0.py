"""Orbax v0: ``SafetensorsCheckpointHandler`` for ``ocp.CheckpointManager`` and friends.

    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=ocp.args.Composite(
        params=ost.SafetensorsSave(params, max_shard_size="2GB"),
        opt_state=ocp.args.StandardSave(opt_state)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ost.SafetensorsRestore(abstract_params)))

The handler is asynchronous the way Orbax's own are: ``async_save`` returns
once this process's shards are on the host, and the writes run in a commit
future. That future first waits for Orbax's directory-creation signals
(``CommitFutureAwaitingContractedSignals``): the item directory is created in
the background by the primary process and must not be touched before. Every
process writes the shards it holds (replica 0) and process 0 writes the
index, so nothing is gathered. Orbax then finalizes the step (rename or
commit marker), which is what makes the step visible to ``all_steps()``; a
save killed midway leaves only a temporary step directory behind.
"""

from __future__ import annotations

from typing import Any

from orbax.checkpoint import args as ocp_args
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import handlers as ocp_handlers

from orbax_safetensors.engine import CheckpointMetadata, metadata
from orbax_safetensors.integrations.orbax_items import (
    SafetensorsRestore,
    SafetensorsSave,
    prepare_item_save,
    restore_item,
)

# Recorded in every step's _CHECKPOINT_METADATA (item_handlers): a fresh
# CheckpointManager resolves a no-argument restore through it, so it must
# never change, whatever module the class lives in.
TYPESTR = "orbax_safetensors.SafetensorsCheckpointHandler"


class SafetensorsCheckpointHandler(ocp_handlers.AsyncCheckpointHandler):
    """Saves and restores one PyTree of arrays as an HF safetensors directory."""

    async def async_save(self, directory: Any, args: SafetensorsSave) -> list[ocp_future.Future]:
        job = prepare_item_save(directory, args)

        async def write() -> None:
            job.start().result()

        return [ocp_future.CommitFutureAwaitingContractedSignals(
            write(), name="orbax_safetensors_save")]

    def save(self, directory: Any, args: SafetensorsSave) -> None:
        """Blocking save (``ocp.Checkpointer``): the directory already exists here."""
        prepare_item_save(directory, args).start().result()

    def restore(self, directory: Any, args: SafetensorsRestore | None = None) -> Any:
        return restore_item(directory, args)

    def metadata(self, directory: Any) -> CheckpointMetadata:
        """Tensor names, shapes, dtypes, ``__metadata__`` and files, from the headers."""
        return metadata(str(directory))

    def finalize(self, directory: Any) -> None:
        """Nothing to do: the index, written last by the save itself, commits the item."""

    @classmethod
    def typestr(cls) -> str:
        return TYPESTR


ocp_args.register_with_handler(SafetensorsCheckpointHandler, for_save=True)(SafetensorsSave)
ocp_args.register_with_handler(SafetensorsCheckpointHandler, for_restore=True)(SafetensorsRestore)
