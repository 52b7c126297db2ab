"""``async_save`` when nobody waits: at the end of a script, after an error, on ``cancel()``.

Before, a save still writing when the script ended was never committed
(``concurrent.futures`` refuses new work once the interpreter exits: the
writer's pool raised into a future nobody read), with exit status 0 and a
full-size temporary left; ``cancel()`` on a running save returned True while
the save went on to commit, and printed an ``InvalidStateError`` traceback.

The scripts start no thread once their exit begins (``tests/support/exit_without_threads.py``), as
Python 3.12.0 and 3.12.1 do: what a save needs a thread for is started before ``async_save``
returns, or the save runs without it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.object_stores import object_store_server, storage_options

REPO = str(REPO)

# Writes slowed down so that the save is certainly still writing when the script ends.
_SCRIPT = textwrap.dedent("""
    import tests.support.exit_without_threads
    import sys, time
    import numpy as np
    import orbax_safetensors as ost
    from orbax_safetensors.storage.local import LocalStorage

    path, ending, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
    real = LocalStorage.write_at
    def slow(self, *args):
        time.sleep(2.0 if ending == "interrupted" else 0.3)
        return real(self, *args)
    LocalStorage.write_at = slow
    if ending == "fails":
        def broken(self, *args):
            raise OSError(5, "Input/output error", args[0])
        LocalStorage.write_at = broken
    ost.async_save(path, {f"w{i}": np.full(4096, value + i, np.float32) for i in range(4)},
                   overwrite=True, max_shard_size=20_000)
    print("returned", flush=True)
    if ending == "raise":
        raise RuntimeError("the training loop crashed")
    if ending == "exit":
        sys.exit(3)
""")


_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(path, ending: str, value: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(path), ending, str(value)],
                          capture_output=True, text=True, timeout=120, env=_ENV)


def _expected(value: float) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full(4096, value + i, np.float32) for i in range(4)}


@pytest.mark.parametrize("ending,status", [("end", 0), ("raise", 1), ("exit", 3)])
def test_a_save_pending_when_the_script_ends_is_committed(tmp_path, ending, status):
    path = tmp_path / "ckpt"
    ost.save(path, _expected(1.0))
    finished = _run(path, ending, 2.0)  # overwrites: the old one must not be what is left
    assert finished.returncode == status, finished.stderr
    assert finished.stdout.startswith("returned")
    loaded = ost.load(path)
    for name, value in _expected(2.0).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert not [n for n in os.listdir(path) if n.startswith(".")]  # no temporary, no lock left
    assert "orbax_safetensors" not in finished.stderr


# Connections are looked up each time (no cache) and closed once idle (a millisecond): a save
# that goes on after the script's end opens new ones, each with a lookup.
_S3_SCRIPT = textwrap.dedent("""
    import tests.support.exit_without_threads
    import sys
    import numpy as np
    import orbax_safetensors as ost

    url, endpoint = sys.argv[1], sys.argv[2]
    options = {"endpoint_url": endpoint, "key": "test", "secret": "test",
               "config_kwargs": {"connector_args": {"use_dns_cache": False, "keepalive_timeout": 0.001}}}
    ost.async_save(url, {f"w{i}": np.full(4096, 2.0 + i, np.float32) for i in range(4)},
                   storage_options=options, max_shard_size=20_000)
    print("returned", flush=True)
""")


@pytest.mark.slow  # an S3 server (moto)
def test_a_save_to_s3_pending_when_the_script_ends_still_looks_hosts_up(tmp_path):
    """aiohttp looks host names up on its event loop's default executor; asyncio's refuses work
    once the interpreter exits. Before, such a save failed at its first new connection after the
    script's end ("cannot schedule new futures after shutdown", said at exit, status 1) and its
    checkpoint was lost: with aiohttp's cache of lookups (10 s), any upload longer than that."""
    with object_store_server("s3") as (bucket, env):
        options = storage_options(env, "s3")
        endpoint = options["endpoint_url"].replace("127.0.0.1", "localhost")
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        finished = subprocess.run([sys.executable, "-c", _S3_SCRIPT, f"{bucket}/ck", endpoint],
                                  capture_output=True, text=True, timeout=120, env=env)
        assert finished.returncode == 0, finished.stderr[-3000:]
        loaded = ost.load(f"{bucket}/ck", storage_options=options)
    for name, value in _expected(2.0).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_ctrl_c_while_the_script_exits_rolls_the_save_back_and_says_so(tmp_path):
    """The interrupt ends the interpreter's wait for the writer. Before, the writer was cut off
    when the process ended: exit status 0, nothing said, temporaries and the lock left beside
    the old checkpoint."""
    path = tmp_path / "ckpt"
    ost.save(path, _expected(1.0))
    child = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path), "interrupted", "2.0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)
    assert child.stdout.readline() == "returned\n"
    time.sleep(0.5)  # the script has ended: the interpreter waits for the writes (2 s each)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert f"async_save to {path} was interrupted while the script exited; nothing was committed" in stderr
    loaded = ost.load(path)  # the old checkpoint, whole
    for name, value in _expected(1.0).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert os.listdir(path) == ["model.safetensors"]  # no temporary, no lock left


def test_a_save_that_fails_with_nobody_waiting_is_said_at_exit_with_status_1(tmp_path):
    path = tmp_path / "ckpt"
    ost.save(path, _expected(1.0))
    finished = _run(path, "fails", 2.0)
    assert finished.returncode == 1
    assert f"async_save to {path} failed" in finished.stderr, finished.stderr
    assert "OSError: [Errno 5] Input/output error" in finished.stderr
    assert "nothing was committed" in finished.stderr
    loaded = ost.load(path)  # the old checkpoint, whole
    for name, value in _expected(1.0).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_cancel_stops_a_save_that_is_writing_and_leaves_the_old_checkpoint(tmp_path, slow_writes, capfd):
    gate, started = slow_writes
    path = tmp_path / "ckpt"
    gate.set()
    ost.save(path, _expected(1.0))
    gate.clear()
    future = ost.async_save(path, _expected(2.0), overwrite=True)
    assert started.wait(30)
    threading.Timer(0.2, gate.set).start()  # the write in flight completes; the save stops after it
    assert future.cancel() is True
    assert future.cancelled() and future.done()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    loaded = ost.load(path)
    for name, value in _expected(1.0).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert not [n for n in os.listdir(path) if n.startswith(".")]  # rolled back before cancel returned
    assert "Traceback" not in capfd.readouterr().err


def test_cancel_after_the_commit_is_too_late_and_says_so(tmp_path):
    future = ost.async_save(tmp_path / "ckpt", _expected(1.0))
    stats = future.result()
    assert future.cancel() is False and not future.cancelled()
    assert future.result() is stats
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not future.done():
        time.sleep(0.01)
    loaded = ost.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(loaded["w0"], _expected(1.0)["w0"])
