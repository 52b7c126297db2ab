"""The one way the engine runs I/O concurrently: a bounded pool with failure semantics.

Every operation (a load's reads, a save's writes and uploads, header reads,
a conversion's read-ahead) runs its requests on an ``Executor`` of a fixed
number of threads, and waits for them the same way: the first failure is
raised as it was (its type, errno and file intact, never wrapped), and a
cancelled operation stops waiting within ``POLL`` seconds. On the way out
after a failure, queued work is dropped and requests already in flight are
left to finish on their own: a request cannot be interrupted, and its
outcome no longer matters.

Its threads are its own, not ``concurrent.futures``' pools: those refuse new
work once the interpreter starts to exit ("cannot schedule new futures after
interpreter shutdown"), which is exactly when an ``async_save`` at the end of
a training script must still write and commit. The workers are daemon
threads; whoever waits on them (a save's thread, which is not a daemon) is
what keeps the interpreter alive until the work is done.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL = 0.05  # seconds between looks at the cancel flag while requests are in flight
_STOP = None  # what a worker takes from the queue to end


class Executor:
    """At most ``threads`` tasks at once; ``cancelled`` (when set) stops ``wait`` with
    ``KeyboardInterrupt``."""

    def __init__(self, threads: int, *, name: str = "orbax_safetensors",
                 cancelled: threading.Event | None = None):
        self._limit, self._name, self._cancelled = max(1, threads), name, cancelled
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close")
            self._queue.put((future, fn, args))
            if self._idle > 0:
                self._idle -= 1  # a waiting worker takes it
            elif len(self._workers) < self._limit:
                worker = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}_{len(self._workers)}")
                self._workers.append(worker)
                worker.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as e:  # the waiter raises it as it was
                    future.set_exception(e)
                else:
                    future.set_result(result)
                del future, fn, args, item  # no reference outlives the task
            with self._lock:
                self._idle += 1

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``fn`` of every item, in order; the first failure raised as it was."""
        futures = [self.submit(fn, item) for item in items]
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
        """Stops the workers once the queue is done; ``wait=False`` drops what is queued
        (its futures are cancelled) and returns without waiting for tasks in flight."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        if not wait:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in workers:
            self._queue.put(_STOP)
        if wait:
            for worker in workers:
                if worker is not threading.current_thread():
                    worker.join()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        self.close(wait=exc_type is None)
