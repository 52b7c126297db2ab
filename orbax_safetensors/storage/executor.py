"""The one way the engine runs I/O concurrently: a bounded pool with failure semantics.

Every operation (a load's reads, a save's writes and uploads, header reads,
a conversion's read-ahead) runs its requests on an ``Executor`` of a fixed
number of threads, and waits for them the same way: the first failure is
raised as it was (its type, errno and file intact, never wrapped), and a
cancelled operation stops waiting within ``POLL`` seconds. On the way out
after a failure, queued work is dropped and requests already in flight are
left to finish on their own: a request cannot be interrupted, and its
outcome no longer matters.

An ``async_save`` at the end of a training script must still write and commit
while the interpreter exits, and exiting is when threads are hardest to get:
``concurrent.futures``' pools refuse new work once exit begins ("cannot
schedule new futures after interpreter shutdown"), and Python 3.12.0 and
3.12.1 refuse to start any thread then ("can't create new thread at
interpreter shutdown"). So the pools' threads are the engine's own and
outlive the pool that started them: a closed pool's workers wait, idle, for
the next pool (``_Crew``), a background save makes sure before it returns
that its writers will find idle ones (``reserve``), and a pool that can get
no thread at all runs its work in the thread that submits it, never fails
for the want of one. The workers are daemon threads; whoever waits on them
(a save's thread, which is not a daemon) is what keeps the interpreter alive
until the work is done.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL = 0.05  # seconds between looks at the cancel flag while requests are in flight
_STOP = None  # what a worker takes from a pool's queue to leave it


class _Worker(threading.Thread):
    """A daemon thread that serves one pool at a time, then waits for the next."""

    def __init__(self, crew: _Crew):
        super().__init__(daemon=True, name="orbax_safetensors-idle")
        self._crew = crew
        self._next: queue.SimpleQueue[tuple[Executor, str]] = queue.SimpleQueue()

    def serve(self, pool: Executor, name: str) -> None:
        self._next.put((pool, name))

    def run(self) -> None:
        while True:
            pool, self.name = self._next.get()
            pool.work()
            del pool  # an idle worker keeps no pool alive
            self.name = "orbax_safetensors-idle"
            self._crew.rest(self)


class _Crew:
    """The idle workers of every pool of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []

    def hire(self) -> _Worker | None:
        """An idle worker, else a new one; None when no thread can be started (the
        interpreter is exiting)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        worker = _Worker(self)
        try:
            worker.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            return None
        return worker

    def rest(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def reserve(self, count: int) -> None:
        """Up to ``count`` idle workers exist when this returns (started here, in the
        caller's thread), so work submitted later finds them even while the interpreter
        exits; fewer where no more can be started."""
        with self._lock:
            missing = count - len(self._idle)
        for _ in range(missing):
            worker = _Worker(self)
            try:
                worker.start()
            except RuntimeError:  # the pools will run their work in their callers
                return
            self.rest(worker)

    def forget(self) -> None:
        """In a forked child: the parent's workers do not exist here."""
        self._idle = []
        self._lock = threading.Lock()


_crew = _Crew()
os.register_at_fork(after_in_child=_crew.forget)


def reserve(count: int) -> None:
    """Makes sure ``count`` threads wait idle for the engine's next pools; see the module
    docstring."""
    _crew.reserve(count)


class Executor:
    """At most ``threads`` tasks at once; ``cancelled`` (when set) stops ``wait`` with
    ``KeyboardInterrupt``."""

    def __init__(self, threads: int, *, name: str = "orbax_safetensors",
                 cancelled: threading.Event | None = None):
        self._limit, self._name, self._cancelled = max(1, threads), name, cancelled
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._left = threading.Semaphore(0)  # released by each worker as it leaves the pool
        self._idle = 0
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        inline = False
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close")
            if self._idle > 0:
                self._idle -= 1  # a waiting worker takes it
            elif len(self._workers) < self._limit and (worker := _crew.hire()) is not None:
                worker.serve(self, f"{self._name}_{len(self._workers)}")
                self._workers.append(worker)
            elif not self._workers:  # no thread to be had: the caller runs it (below)
                inline = True
            if not inline:
                self._queue.put((future, fn, args))
        if inline:
            future.set_running_or_notify_cancel()
            _run(future, fn, args)
        return future

    def work(self) -> None:
        """A worker's share of this pool: tasks until it takes a ``_STOP``."""
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._left.release()
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                _run(future, fn, args)
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
        """Lets the workers go once the queue is done; ``wait=False`` drops what is queued
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
            for _ in range(len(workers) - (threading.current_thread() in workers)):
                self._left.acquire()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        self.close(wait=exc_type is None)


def _run(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    try:
        result = fn(*args)
    except BaseException as e:  # the waiter raises it as it was
        future.set_exception(e)
    else:
        future.set_result(result)
