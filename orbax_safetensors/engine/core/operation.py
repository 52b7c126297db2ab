"""One write operation across processes: its steps agree, it can be cancelled, it commits once.

A save (and a consolidation) is a sequence of steps that each process runs
with its own part of the data. Every step that can fail ends in an
agreement (``agree``): all processes learn whether any failed, all clean up
and stop together, and each raises its own original error -- the exception
itself where one process failed alone, else a ``DistributedError`` keeping
every process's failure (type, errno, file) with its own as ``__cause__``.
Agreement goes through the ``jax.distributed`` key-value store, which is
safe from the background thread an ``async_save`` runs on.

Cancelling (Ctrl-C during a blocking save) and committing exclude each
other: ``cancel`` succeeds only before ``at_commit_point`` has been passed,
so a caller that sees ``KeyboardInterrupt`` knows nothing new was committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NoReturn, TypeVar

import jax

from orbax_safetensors.engine.core.coordination import Peers
from orbax_safetensors.storage.executor import Executor
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.errors import DistributedError, PeerFailedError, ProcessFailure

T = TypeVar("T")


class Operation:
    """The steps of one write among ``peers`` (``peers.where`` names it in messages)."""

    def __init__(self, peers: Peers, progress: Progress | None = None):
        self.peers = peers
        self.where = peers.where
        self.progress = progress
        self.cancelled = threading.Event()
        self.committing = False
        self._guard = threading.Lock()

    @property
    def is_primary(self) -> bool:
        return self.peers.is_primary

    def executor(self, threads: int, name: str) -> Executor:
        """A pool whose waits end in ``KeyboardInterrupt`` once this operation is cancelled."""
        return Executor(threads, name=name, cancelled=self.cancelled)

    def cancel(self) -> bool:
        """Stops the writes and the commit where they are; False if it is too late (the
        commit point has been passed)."""
        with self._guard:
            if not self.committing:
                self.cancelled.set()
            return not self.committing

    def at_commit_point(self) -> None:
        """Called right before the step that commits: from here on ``cancel`` fails."""
        with self._guard:
            if self.cancelled.is_set():
                raise KeyboardInterrupt("save cancelled")
            self.committing = True

    def wrote(self, nbytes: int) -> None:
        """This process wrote ``nbytes`` more of the checkpoint (for the progress line)."""
        if self.progress is not None:
            self.progress.advance(nbytes)

    def check_going(self) -> None:
        """Called per unit of work: ``KeyboardInterrupt`` once this operation is cancelled,
        ``PeerFailedError`` once another process failed (``Peers.check``), so no process
        writes the rest of its share for a checkpoint that will not be committed."""
        if self.cancelled.is_set():
            raise KeyboardInterrupt("save cancelled")
        self.peers.check()

    def agree(self, step: str, error: BaseException | None,
              clean_up: Callable[[], None] = lambda: None) -> None:
        """Every process learns whether any failed at ``step``; then, if one did, all clean up
        and raise: the original exception where there is one (alone in one process), else a
        ``DistributedError`` keeping every process's failure.

        A process that failed does not wait for the others: it leaves its failure where
        their waits look (``Peers.fail``), cleans up and raises at once. A ``PeerFailedError``
        as ``error`` is another process's failure, heard while this one waited.
        """
        if isinstance(error, PeerFailedError):
            self._stop(dict(error.failures), None, clean_up)
        if error is not None:
            self.peers.fail(error)
            me = jax.process_index()
            self._stop({**self.peers.failures(), me: ProcessFailure.of(me, error)}, error, clean_up)
        self.exchange(step, "", clean_up)

    def exchange(self, step: str, value: str, clean_up: Callable[[], None] = lambda: None) -> list[str]:
        """Every process's ``value`` for ``step``; if another process failed meanwhile, clean
        up and raise as ``agree`` does."""
        try:
            return self.peers.gather(step, value)
        except PeerFailedError as e:
            self._stop(dict(e.failures), None, clean_up)

    def _stop(self, failures: dict[int, ProcessFailure], error: BaseException | None,
              clean_up: Callable[[], None]) -> NoReturn:
        clean_up()
        if error is None:
            raise PeerFailedError(f"{self.where}: save failed, nothing was committed", failures)
        if len(failures) == 1 or isinstance(error, KeyboardInterrupt):
            raise error
        raise DistributedError(f"{self.where}: save failed, nothing was committed",
                               failures) from error

    def run(self, step: str, action: Callable[[], T],
            clean_up: Callable[[], None] = lambda: None) -> T:
        """``action`` on every process, then ``agree`` on the outcome; its result."""
        error, result = None, None
        try:
            result = action()
        except BaseException as e:
            error = e
        self.agree(step, error, clean_up)
        return result

    def on_primary(self, step: str, action: Callable[[], None],
                   clean_up: Callable[[], None] = lambda: None) -> None:
        """``action`` on process 0, then ``agree`` on its outcome."""
        self.run(step, action if self.is_primary else lambda: None, clean_up)
