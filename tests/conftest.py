"""Shared pytest fixtures.

The test process gets 8 CPU devices (set here, before anything imports jax),
so single-process tests exercise real multi-device shardings. ``OST_TEST_DEVICE_COUNT``
picks another count, to move XLA's reduction orders the way another CPU does when checking
that a computed value's tolerance holds (``tests/support/tolerances.py``); tests that build an
8-device mesh need the default.

A suite started in the background (``cmd &`` in a script, as CI may) inherits SIGINT ignored,
and so would every child it starts: a child that ignores Ctrl-C makes the tests of what Ctrl-C
does fail (the demo ran to its end) or pass without looking (a load finished before its
interrupt). Python's own handler is put back here, so children start with a terminal user's
SIGINT.
"""

import functools
import os
import re
import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ["XLA_FLAGS"] = " ".join(
    [re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")),
     f"--xla_force_host_platform_device_count={os.environ.get('OST_TEST_DEVICE_COUNT', '8')}"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from tests.support.multiprocess import run_multiprocess


@pytest.fixture
def multiprocess():
    """Runs a function in several real JAX processes; see tests/support/multiprocess.py.

    Usage: ``multiprocess("tests.test_foo:child_fn", num_processes=2, args=...)``
    returns a list of ``ProcessResult`` ordered by process id and raises
    ``MultiProcessError`` if any process fails or the group times out.
    """
    return functools.partial(run_multiprocess)


@pytest.fixture
def slow_writes(monkeypatch):
    """Local writes wait for ``gate``; ``started`` is set by the first: ``(gate, started)``.
    A save held mid-write, for tests of what stopping one does."""
    import threading

    from orbax_safetensors.storage.local import LocalStorage

    gate, started = threading.Event(), threading.Event()
    real = LocalStorage.write_at

    def write_at(self, *args):
        started.set()
        gate.wait(30)
        return real(self, *args)

    monkeypatch.setattr(LocalStorage, "write_at", write_at)
    yield gate, started
    gate.set()


# Tests that start several JAX processes are slow whichever file they are in.
_SLOW_FIXTURES = {"multiprocess", "distributed_checkpoint"}


def pytest_collection_modifyitems(items):
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
