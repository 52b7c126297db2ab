"""The one way the engine runs I/O concurrently: a bounded pool with failure semantics.

Every operation (a load's reads, a save's writes and uploads, header reads,
a conversion's read-ahead) runs its requests on an ``Executor`` of a fixed
number of threads, and waits for them the same way: the first failure is
raised as it was (its type, errno and file intact, never wrapped), and a
cancelled operation stops waiting within ``POLL`` seconds. On the way out
after a failure, queued work is dropped and requests already in flight are
left to finish on their own: a request cannot be interrupted, and its
outcome no longer matters.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL = 0.05  # seconds between looks at the cancel flag while requests are in flight


class Executor:
    """At most ``threads`` tasks at once; ``cancelled`` (when set) stops ``wait`` with
    ``KeyboardInterrupt``."""

    def __init__(self, threads: int, *, name: str = "orbax_safetensors",
                 cancelled: threading.Event | None = None):
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)
        self._cancelled = cancelled

    def submit(self, fn: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
        return self._pool.submit(fn, *args)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``fn`` of every item, in order; the first failure raised as it was."""
        futures = [self._pool.submit(fn, item) for item in items]
        self.wait(futures)
        return [f.result() for f in futures]

    def wait(self, futures: Iterable[concurrent.futures.Future]) -> None:
        """Returns once all are done; raises the first failure as soon as it happens, or
        ``KeyboardInterrupt`` as soon as the operation is cancelled."""
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=POLL if self._cancelled is not None else None,
                return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    raise future.exception()
            self.check_cancelled()

    def check_cancelled(self) -> None:
        if self._cancelled is not None and self._cancelled.is_set():
            raise KeyboardInterrupt("cancelled")

    def close(self, *, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        self.close(wait=exc_type is None)
