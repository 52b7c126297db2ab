"""Orbax v0: ``SafetensorsCheckpointHandler`` for ``ocp.CheckpointManager`` and friends.

    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=ocp.args.Composite(
        params=ost.SafetensorsSave(params, max_shard_size="2GB"),
        opt_state=ocp.args.StandardSave(opt_state)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ost.SafetensorsRestore(abstract_params)))

The handler is asynchronous the way Orbax's own are: ``async_save`` returns
once this process's shards are on the host, and the writes run in a commit
future. That future starts writing only when Orbax asks for its result, which
Orbax does once every item of the step has started: a step Orbax gives up on
(another item failed in its ``async_save``) is never written into, and its
retry finds the temporary directory as Orbax left it. The writes first wait
for Orbax's directory-creation signals (the contract of the save's operation,
read in ``async_save``): the item directory is created in the background by
the primary process and must not be touched before. Every
process writes the shards it holds (replica 0) and process 0 writes the
index, so nothing is gathered. Orbax then finalizes the step (rename or
commit marker), which is what makes the step visible to ``all_steps()``; a
save killed midway leaves only a temporary step directory behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import threading
from collections.abc import Callable
from typing import Any

import jax
from etils import epath
from orbax.checkpoint import args as ocp_args
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import handlers as ocp_handlers
from orbax.checkpoint._src.futures import future as orbax_futures
from orbax.checkpoint._src.futures import synchronization

from orbax_safetensors.engine import CheckpointMetadata, WriteSession, metadata, unwatch, watch_at_exit
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
# The suffix of Orbax's temporary step and item directories (renamed away at the commit).
_TEMPORARY = re.compile(r"\.orbax-checkpoint-tmp(-[0-9]+)?(?=/|$)")


class _WritesOnceAwaited(ocp_future.Future):
    """A prepared item save whose writes start on the first ``result()``: Orbax asks for it
    only once every item of the step has started, so a step that failed before never gets
    our writes. The signals to wait for (Orbax's directory creation) are those of the
    operation that was current in ``async_save``; they are read there, while it is."""

    def __init__(self, job: WriteSession, directory: Any):
        self._job, self._directory = job, directory
        self._operation_id = synchronization.OperationIdGenerator.get_current_operation_id()
        self._signals = orbax_futures.AwaitableSignalsContract.get_awaitable_signals_from_contract(
            operation_id=self._operation_id)
        self._lock = threading.Lock()
        self._commit: orbax_futures.CommitFuture | None = None
        self._writing: concurrent.futures.Future | None = None  # the SaveFuture, once started
        self._cancelled = False

    def result(self, timeout: float | None = None) -> Any:
        with self._lock:
            if self._cancelled:
                raise concurrent.futures.CancelledError()
            if self._commit is None:
                self._commit = orbax_futures.CommitFuture(
                    self._write(), name="orbax_safetensors_save", receive_signals=self._signals,
                    operation_id=self._operation_id)
        try:
            result = self._commit.result(timeout=timeout)
        except TimeoutError:
            raise
        except BaseException:
            unwatch(_watch_key(self._directory))  # Orbax raises it on wait/close, or logs it
            raise
        if jax.process_index() != 0:  # Orbax's primary process commits the step and says it
            unwatch(_watch_key(self._directory))
        return result

    async def _write(self) -> None:
        with self._lock:
            if self._cancelled:
                raise concurrent.futures.CancelledError()
            self._writing = self._job.start()
        await asyncio.wrap_future(self._writing)

    def cancel(self) -> None:
        """Stops the writes and waits until they are rolled back (temporaries removed);
        never started, they never will be. Whoever cancels knows the item is not saved: the
        exit does not say it again."""
        unwatch(_watch_key(self._directory))
        with self._lock:
            self._cancelled = True
            writing, commit = self._writing, self._commit
        if writing is not None:
            writing.cancel()
        if commit is not None:
            commit.cancel()


class SafetensorsCheckpointHandler(ocp_handlers.AsyncCheckpointHandler):
    """Saves and restores one PyTree of arrays as an HF safetensors directory."""

    def __init__(self) -> None:
        # The saves of this item (Orbax makes a handler per item of a checkpointer) the exit
        # watches, until the next save or ``close``: Orbax begins either only once its wait
        # for the saves before has returned, and that wait raises a failed step to the caller
        # (from ``save``, ``wait_until_finished`` or ``close``). Each then either committed
        # (``finalize`` unwatched it) or failed and was said: the exit must not say it again,
        # nor end a recovered script with status 1.
        self._watched: list[tuple[tuple[str, str], Callable[[], str | None]]] = []

    async def async_save(self, directory: Any, args: SafetensorsSave) -> list[ocp_future.Future]:
        self._settle()
        lost = functools.partial(_not_committed, directory)
        future = _WritesOnceAwaited(prepare_item_save(directory, args, fresh=True), directory)
        # Orbax commits the step after us, in a thread the end of a script cuts short (its
        # own items are lost the same way, status 0): until it finalizes ours, an exit says so
        # (on the primary process; the others once their writes are done). A write of ours
        # that fails goes to Orbax, which raises it on wait or close: not said again.
        watch_at_exit(_watch_key(directory), lost)
        self._watched.append((_watch_key(directory), lost))
        return [future]

    def close(self) -> None:
        """The checkpointer is closing, its wait for this item's saves returned: see ``__init__``."""
        self._settle()

    def _settle(self) -> None:
        for key, lost in self._watched:
            unwatch(key, lost)
        self._watched.clear()

    def save(self, directory: Any, args: SafetensorsSave) -> None:
        """Blocking save (``ocp.Checkpointer``): the directory already exists here."""
        prepare_item_save(directory, args, fresh=True).start().result()

    def restore(self, directory: Any, args: SafetensorsRestore | None = None) -> Any:
        return restore_item(directory, args)

    def metadata(self, directory: Any) -> CheckpointMetadata:
        """Tensor names, shapes, dtypes, ``__metadata__`` and files, from the headers."""
        return metadata(str(directory))

    def finalize(self, directory: Any) -> None:
        """The item is complete (its index, written last by the save itself, commits it) and
        Orbax is committing the step: an exit from here on loses nothing of ours."""
        unwatch(_watch_key(directory))

    @classmethod
    def typestr(cls) -> str:
        return TYPESTR


def _watch_key(directory: Any) -> tuple[str, str]:
    return ("orbax step item", str(directory))


def _not_committed(directory: Any) -> str | None:
    """What an exit before ``finalize`` says; nothing where the item is in place under its
    final name already (a primary process other than 0 committed it)."""
    final = _TEMPORARY.sub("", str(directory))
    if final != str(directory) and epath.Path(final).exists():
        return None
    return (f"the Orbax save of {directory} was not committed: the script ended before the "
            "CheckpointManager finished it (call mngr.wait_until_finished() or mngr.close() "
            "before the end, or use `with ocp.CheckpointManager(...) as mngr:`), or the step "
            "failed in another item (Orbax's log says why)")


ocp_args.register_with_handler(SafetensorsCheckpointHandler, for_save=True)(SafetensorsSave)
ocp_args.register_with_handler(SafetensorsCheckpointHandler, for_restore=True)(SafetensorsRestore)
