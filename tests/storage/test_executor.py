"""The engine's pool: its threads outlive it, can be started ahead of need, and are never
needed.

A background save at the end of a script runs while the interpreter exits, when Python 3.12.0
and 3.12.1 start no thread: ``reserve`` starts them before, and a pool that gets none runs its
work in the thread that submits it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from orbax_safetensors.storage import executor
from orbax_safetensors.storage.executor import Executor


def _refuse_new_threads(monkeypatch) -> None:
    """From here on, starting a worker fails as it does while Python 3.12.0 exits."""
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    monkeypatch.setattr(executor._Worker, "start", refuse)


def test_reserved_workers_serve_a_later_pool_at_once_when_no_thread_can_be_started(monkeypatch):
    executor._crew.forget()  # only what reserve starts below
    executor.reserve(4)
    _refuse_new_threads(monkeypatch)
    together = threading.Barrier(4, timeout=10)  # passes only if 4 tasks run at once
    with Executor(4, name="test") as pool:
        names = pool.map(lambda _: (together.wait(), threading.current_thread().name)[1], range(4))
    assert sorted(names) == [f"test_{i}" for i in range(4)]


def test_a_pool_that_gets_no_thread_runs_its_work_in_the_caller(monkeypatch):
    executor._crew.forget()
    _refuse_new_threads(monkeypatch)
    caller = threading.current_thread()
    with Executor(8, name="test") as pool:
        ran_in = pool.map(lambda x: (threading.current_thread(), x * 2), range(5))
    assert ran_in == [(caller, x * 2) for x in range(5)]
    with Executor(2, name="test") as pool:
        future = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):  # the first failure, as it was
            pool.wait([future])


def test_a_closed_pools_workers_serve_the_next_pool():
    for _ in range(3):
        with Executor(4, name="test") as pool:
            pool.map(lambda _: None, range(16))
    before = threading.active_count()
    for _ in range(20):
        with Executor(4, name="test") as pool:
            pool.map(lambda _: threading.current_thread().name, range(16))
    assert threading.active_count() <= before


def test_a_forked_child_starts_its_own_workers():
    script = textwrap.dedent("""
        import os, sys
        from orbax_safetensors.storage.executor import Executor, reserve
        reserve(4)  # the parent's idle workers do not exist in the child
        pid = os.fork()
        with Executor(4, name="t") as pool:
            assert pool.map(lambda x: x + 1, range(8)) == list(range(1, 9))
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
