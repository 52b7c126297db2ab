"""Background saves: what their futures promise when nobody waits, is cancelled, or exits.

``async_save`` returns a ``SaveFuture`` while a thread writes and commits.
Four promises hold however the caller treats it:

* **The end of a script does not lose it.** The writer is not a daemon, so the
  interpreter waits for it at exit, and the engine's pools keep their own
  threads, started before ``async_save`` returns (``concurrent.futures``'
  pools refuse work once exit begins; Python 3.12.0 and 3.12.1 start no thread
  then: ``storage.executor``). A final ``async_save`` of a training script
  commits.
* **A failure nobody read is said.** If the save failed and nothing asked its
  future for the outcome, the interpreter's exit prints the error on stderr and
  ends with status 1 instead of 0: a lost checkpoint is never silent. Saves
  that others commit (Orbax's steps) use the same report (``watch_at_exit``).
* **Ctrl-C while the script exits stops the save cleanly.** The interrupt ends
  the interpreter's wait for the writer, not the writer: left alone, it would
  be cut off mid-write when the process ends, its temporaries and lock left
  behind and nothing said. The exit stops it as ``cancel()`` does (rolled back,
  the old checkpoint untouched), says so, and ends with status 130, as an
  interrupted program does; one past its commit point is let finish.
* **``cancel()`` means it.** On a save still writing, ``cancel`` stops the
  writers, waits for them to roll back (temporaries removed, the old
  checkpoint untouched) and returns True; once the commit point is passed it
  returns False and the save completes.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

# What the exit reports as not committed: key → a function giving the line to print, or None
# when, by the time the interpreter exits, nothing was lost after all.
_watched: dict[Any, Callable[[], str | None]] = {}
_watched_lock = threading.Lock()
_writing: set[SaveFuture] = set()  # saves whose writer has not finished


def watch_at_exit(key: Any, lost: Callable[[], str | None]) -> None:
    """At exit (after the non-daemon threads are done), ``lost()``'s line, if any, goes to
    stderr and the exit status becomes 1; ``unwatch(key)`` once the save is safe."""
    with _watched_lock:
        _watched[key] = lost


def unwatch(key: Any, lost: Callable[[], str | None] | None = None) -> None:
    """Stops watching ``key``; with ``lost``, only while that is what it watches (a later
    save to the same place may watch it by then)."""
    with _watched_lock:
        if lost is None or _watched.get(key) is lost:
            _watched.pop(key, None)


class SaveFuture(concurrent.futures.Future):
    """The outcome of one background save at ``where``; ``stop`` asks it to stop before its
    commit point (False once past it)."""

    def __init__(self, where: str, stop: Callable[[], bool]):
        super().__init__()
        self.where, self._stop = where, stop
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._was_read = False

    def run_in(self, thread: threading.Thread) -> None:
        """The save runs on ``thread``; where no thread can be started (the interpreter is
        exiting), it runs here and is done when this returns."""
        self._thread = thread
        with _watched_lock:
            _writing.add(self)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            self._thread = None
            thread.run()

    def result(self, timeout: float | None = None) -> Any:
        self._read()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._read()
        return super().exception(timeout)

    def cancel(self) -> bool:
        """Stops a save still writing and waits until it has rolled back (True); False once it
        has committed, failed, or passed its commit point."""
        if self.done() or self._stopping:
            return self.cancelled()
        if not self._stop():
            return False
        self._stopping = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._read()
        return super().cancel()

    @property
    def stopping(self) -> bool:
        """``cancel`` has stopped the save: its writer leaves the outcome to ``cancel``."""
        return self._stopping

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """The writer's outcome (not set when the save was cancelled: the future is)."""
        with _watched_lock:
            _writing.discard(self)
        if self._stopping:
            return
        if error is None:
            self.set_result(result)
            return
        with _watched_lock:
            if not self._was_read:
                _watched[id(self)] = lambda: (
                    f"async_save to {self.where} failed and nothing waited for its result; nothing "
                    f"was committed there: {type(error).__name__}: {error}")
        self.set_exception(error)

    def _read(self) -> None:
        with _watched_lock:
            self._was_read = True
            _watched.pop(id(self), None)


def _stop_interrupted() -> list[str]:
    """At exit, the saves still writing: the interpreter's wait for them was interrupted (it
    waits for every writer otherwise). Each is stopped and rolled back, or, past its commit
    point, let finish; what to say of those that committed nothing."""
    with _watched_lock:
        writing = list(_writing)
    said = []
    for future in writing:
        if future.cancel():
            said.append(f"async_save to {future.where} was interrupted while the script exited; "
                        "nothing was committed there")
        else:
            concurrent.futures.wait([future])
    return said


def _report_at_exit() -> None:
    """At exit, after the interpreter waited for the writers: saves lost with nobody told, said,
    and exit status 1; 130 where a save was interrupted (``_stop_interrupted``)."""
    interrupted = _stop_interrupted()
    with _watched_lock:
        watched = list(_watched.values())
    lost = [line for line in (describe() for describe in watched) if line is not None]
    if not lost and not interrupted:
        return
    for line in interrupted + lost:
        print(f"orbax_safetensors: {line}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130 if interrupted else 1)


atexit.register(_report_at_exit)
