"""One write session: every write of a checkpoint takes its location, plans, writes, commits and
reports here, once.

``save``, ``async_save``, ``consolidate`` and ``convert`` (to safetensors) differ
only in where their bytes come from: a tree's host shards, or a block source.
What they share is the order of a write, and it is written down only here:

1. ``take_location``: process 0 locks the location and asks the catalog what is
   there (``Commit.take``); every process gets the same ``Commit``, or every
   process raises. The caller then builds the ``WriteSession`` whole: the
   ``Operation`` its processes agree through (with its progress line), the
   commit, and a ``Planner``, the named value that will plan the write.
2. ``run`` (``start``: the same on a background thread) asks the planner for its
   plan and the ``strategies.Strategy`` that moves its bytes, and the processes
   agree that each could plan;
3. writes with that strategy (``write``);
4. commits on process 0 (``strategies.commit_written``); a failure before the commit
   point removes what the save wrote, on every process;
5. releases the location and closes the progress line whatever happened, and
   reports what was written as ``SaveStats``.

Every step that can fail ends in an agreement between the processes
(``Operation``), so they stop together and each raises its own original error.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Collection
from typing import Protocol

import jax

from orbax_safetensors.engine.core import catalog
from orbax_safetensors.engine.saving import strategies
from orbax_safetensors.engine.core.coordination import Peers
from orbax_safetensors.engine.core.operation import Operation
from orbax_safetensors.engine.core.pending import SaveFuture
from orbax_safetensors.errors import DistributedError, LocationTakenError, ProcessFailure
from orbax_safetensors.storage import Location
from orbax_safetensors.storage import executor
from orbax_safetensors.storage.commit import Commit

_LOG = logging.getLogger("orbax_safetensors")
_CANCEL_WAIT = 2.0  # seconds a cancelled save's clean-up may hold the caller


@dataclasses.dataclass
class SaveStats:
    """What one process's save cost; the result of ``save`` and of ``async_save(...).result()``.

    ``bytes_written`` counts tensor bytes this process wrote: the shards it
    holds with ``replica_id == 0``, so across processes every byte is written
    exactly once. ``tensors_resharded`` counts tensors whose shards were thin
    strips across processes, moved to row blocks on device before the copy
    (``planning.reshard_parts``), so each process writes contiguous rows.
    ``blocking_seconds`` is how long ``async_save`` held the caller (the
    device→host copies); ``seconds`` runs until the commit. ``copied_peak``: the
    most bytes of a blocking save's accelerator shards copied to the host ahead
    of their writes at once, or of ``async_save``'s in transfer at once before it
    returned (``SaveOptions.memory_budget``; 0 where none was).
    """

    bytes_written: int = 0
    requests: int = 0
    files: int = 0
    tensors_resharded: int = 0
    blocking_seconds: float = 0.0
    seconds: float = 0.0
    copied_peak: int = 0


class Planner(Protocol):
    """What a session writes, as a value: a save's tree in the layout it names (``HfPlanner``,
    ``DistributedPlanner``), or a block source's files (``consolidate``)."""

    def strategy(self) -> strategies.Strategy:
        """Plans the write (files, headers, this process's bytes) and picks how they move."""


def take_location(location: Location, peers: Peers, *, overwrite: bool, fresh: bool = False,
                  beside: Collection[str] = ()) -> Commit:
    """Process 0 takes the location; every process gets the same ``Commit`` (token, the files
    it replaces), or every process raises. ``beside``: the names of the small files the write
    commits with its tensors (``WriteSession.beside``), which must be files where they exist.

    ``fresh``: the caller made the location for this save and owns it (Orbax's
    step temporary), so nothing there is looked at, locked or removed.
    """
    token = uuid.uuid4().hex[:12]
    commit, error = None, None
    if peers.is_primary and not fresh:
        try:
            commit = Commit.take(location, token,
                                 lambda: _replaced(location, overwrite=overwrite, beside=beside))
        except BaseException as e:
            error = e
    shared = json.loads(peers.share("location", json.dumps({
        "token": token, "old": sorted(commit.old if commit is not None else ()),
        "markers": sorted(commit.markers if commit is not None else ()),
        "error": "" if error is None else ProcessFailure.of(0, error).to_json()})))
    if error is not None:
        raise error
    if shared["error"]:
        failure = ProcessFailure.from_json(shared["error"])
        if failure.type == LocationTakenError.__name__:  # the refusal, the same on every process
            raise LocationTakenError(failure.message, failure.filename)
        raise DistributedError(f"{location.url}: process 0 could not begin the save", {0: failure})
    return commit or Commit.for_location(location, shared["token"], shared["old"], shared["markers"])


def _replaced(location: Location, *, overwrite: bool,
              beside: Collection[str] = ()) -> tuple[frozenset[str], frozenset[str]]:
    """What a save to ``location`` replaces, and which of those files mark the checkpoint
    committed (its index), as the catalog finds them (under the lock).

    Refuses to replace a committed checkpoint unless ``overwrite``; debris of a
    save of ours that never committed (its temporaries, the files its marker
    lists) is no reason to refuse, and is removed. Without ``overwrite``, no
    other file is removed: checkpoint-named files that are neither committed
    nor ours (shards without an index, of the user's or of another tool) make
    the save refuse, naming them. ``overwrite`` replaces every checkpoint-named
    file there (a reader that globs shard files must not find old ones beside
    the new), never other files (config.json, a tokenizer, a README).
    """
    found = catalog.survey(location, catalog.Findings(collect=True))
    catalog.refuse_non_files(found, beside)
    if found.committed and not overwrite:
        raise LocationTakenError("already holds a checkpoint; pass overwrite=True to replace it",
                                 location.url)
    foreign = sorted(found.present - found.committed - found.ours)
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise LocationTakenError(f"holds safetensors files that no save of ours wrote and no "
                                 f"index names ({shown}); pass overwrite=True to replace them, "
                                 "or remove them", location.url)
    return (found.present if overwrite else frozenset()) | found.ours, found.markers


@dataclasses.dataclass(frozen=True)
class WriteSession:
    """A write whose location is taken: plans, writes and commits once ``run`` or ``start``.

    ``stats`` holds what the caller measured before (its host copies); the
    session adds what it writes. ``started`` is when the caller began. ``beside``: small
    files committed with the tensors (name, bytes), a model's ``config.json``.
    """

    operation: Operation
    commit: Commit
    planner: Planner
    stats: SaveStats
    started: float
    beside: tuple[tuple[str, bytes], ...] = ()

    def run(self) -> SaveStats:
        """Plans, writes and commits in this thread (steps 2-5 of the module docstring)."""
        op, commit = self.operation, self.commit
        try:
            try:
                strategy = op.run("planned", self.planner.strategy)
                written = strategy.write(op, commit)
                strategies.commit_written(op, commit, written, self.beside)
            except BaseException as e:
                op.peers.fail(e)
                if op.is_primary and not op.committing:
                    commit.abandon()
                raise
        finally:
            commit.release()
            if op.progress is not None:
                op.progress.close()
        return dataclasses.replace(
            self.stats, bytes_written=written.bytes_written, requests=written.requests,
            files=written.files_written, seconds=time.perf_counter() - self.started,
            copied_peak=max(self.stats.copied_peak, written.copied_peak))

    def start(self) -> SaveFuture:
        """``run`` on a background thread (not a daemon: the interpreter waits for it at
        exit); the future gives the stats or the error (``engine.pending``).

        The last ``async_save`` of a script runs while the interpreter exits, when Python
        3.12.0 and 3.12.1 start no thread. So what the session would start a thread for is
        started here, in the caller's thread: the JAX backend (whose start starts one) and
        idle workers for its writes (``executor.reserve``).
        """
        jax.process_index()
        executor.reserve(strategies.WRITE_THREADS)
        future = SaveFuture(self.operation.where, self.operation.cancel)
        future.run_in(threading.Thread(target=self._run_into, args=(future,),
                                       name="orbax_safetensors-save"))
        return future

    def _run_into(self, future: SaveFuture) -> None:
        try:
            future.finish(self.run())
        except BaseException as e:  # the caller sees it through the future
            future.finish(error=e)

    def wait(self, future: SaveFuture) -> SaveStats:
        """The started session's result; Ctrl-C cancels it and raises ``KeyboardInterrupt``
        promptly.

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
            if not self.operation.cancel():
                _LOG.warning("interrupted after %s was committed: the save is complete",
                             self.operation.where)
                return future.result()
            try:
                future.exception(timeout=_CANCEL_WAIT)
            except (concurrent.futures.TimeoutError, KeyboardInterrupt):
                pass
            raise

    def abandon(self) -> None:
        """A session that will never start (its caller gave up on it): the location is let go
        (lock, a directory it made), and processes waiting on this one fail at once."""
        self.operation.peers.fail(concurrent.futures.CancelledError(
            f"the save to {self.operation.where} was given up before it started"))
        self.commit.release()

