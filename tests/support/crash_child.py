"""Fork server for ``tests/faults/test_crash_safety.py``: saves that get SIGKILLed at chosen points.

Started once per test module as ``python -m tests.support.crash_child`` (with
``JAX_PLATFORMS=cpu``). It imports numpy, jax and orbax_safetensors once and
then reads one JSON command per line on stdin. For each command it forks a
worker that runs one ``ost.save`` or ``ost.consolidate`` and dies by SIGKILL:

* ``kill_at: k`` -- the worker counts the storage operations that change
  files (``LocalStorage`` methods below, and every chunk a streaming
  ``write`` hands to the OS) and SIGKILLs itself right before the k-th one;
* ``kill_after: seconds`` -- this server SIGKILLs the worker that long after
  the worker announced it is about to start the operation (a wall-clock kill
  from outside, at whatever instruction the worker is executing);
* neither -- the operation runs to the end, and the worker reports how many
  counted operations it made and how long it took (the range the test draws
  kill points from).

Forking saves an interpreter start and the jax import per kill. The server
itself never initialises a jax backend (no threads to be lost in the fork);
each worker does so on its own.

Messages on stdout, one JSON object per line: ``{"event": "forked", "pid"}``
from the server, ``{"event": "done"|"error", "ops", "seconds", ...}`` from
the worker, then ``{"event": "exit", "signal", "code"}`` from the server once
the worker is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

# Methods of LocalStorage that create, change or delete files.
MUTATIONS = ("makedirs", "create_sized", "write_at", "sync", "write", "rename", "remove",
             "sync_directory", "lock")


def tree(version: int) -> dict[str, np.ndarray]:
    """The values saved as ``version``: every version has the same names, shapes and dtypes,
    so a checkpoint mixing files of two versions would load without complaint (and be wrong)."""
    rng = np.random.default_rng(7919 * version + 1)
    return {
        "embed": rng.standard_normal((48, 32)).astype(np.float32),
        "layers.0.w": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.0.b": rng.standard_normal(32).astype(np.float32),
        "layers.1.w": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.1.b": rng.standard_normal(32).astype(np.float32),
        "head": rng.standard_normal((32, 40)).astype(np.float16),
        "count": rng.integers(0, 1 << 30, size=(24,), dtype=np.int64),
        "step": np.asarray(version, np.int32),
    }


def run(command: dict) -> None:
    """What a worker does: the operation of ``command`` (a fresh jax backend in this process)."""
    import orbax_safetensors as ost

    if command["op"] == "save":
        ost.save(command["path"], tree(command["version"]), layout=command["layout"],
                 max_shard_size=command["max_shard_size"], overwrite=command["overwrite"])
    elif command["op"] == "consolidate":
        ost.consolidate(command["src"], command["dst"], max_shard_size=command["max_shard_size"],
                        overwrite=command["overwrite"], block_bytes=command.get("block_bytes", "64MB"))
    else:
        raise ValueError(f"unknown op {command['op']!r}")


def multiprocess_save(args: dict) -> dict:
    """A save of ``tree(version)`` sharded over the devices of every process (a target of
    ``tests.support.multiprocess``); process ``victim`` SIGKILLs itself before its ``kill_at``-th counted
    operation. Returns how many operations this process counted."""
    import jax

    import orbax_safetensors as ost

    jax.config.update("jax_enable_x64", True)  # keeps the int64 leaf int64
    kill_at = args.get("kill_at") if jax.process_index() == args.get("victim") else None
    count = install_counter(kill_at)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def global_array(value: np.ndarray) -> jax.Array:
        split = value.ndim and value.shape[0] % mesh.size == 0
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x" if split else None))
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    ost.save(args["path"], {k: global_array(v) for k, v in tree(args["version"]).items()},
             layout=args["layout"], max_shard_size=args["max_shard_size"], overwrite=True)
    return {"ops": count[0]}


def install_counter(kill_at: int | None) -> list[int]:
    """Counts file-changing storage operations; SIGKILLs this process before the ``kill_at``-th."""
    from orbax_safetensors.storage.local import LocalStorage

    count = [0]
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            count[0] += 1
            hit = count[0] == kill_at
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached: SIGKILL is not deferred

    def counted(original):
        def method(self, *args, **kwargs):
            tick()
            return original(self, *args, **kwargs)
        return method

    def chunks_counted(chunks):
        for chunk in chunks:
            tick()  # the file is open (truncated); the chunks before this one are written
            yield chunk

    for name in MUTATIONS:
        original = getattr(LocalStorage, name)
        if name == "write":
            def write(self, path, chunks, _original=original):
                tick()
                return _original(self, path, chunks_counted(chunks))
            setattr(LocalStorage, name, write)
        else:
            setattr(LocalStorage, name, counted(original))
    return count


def _emit(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _worker(command: dict, ready_fd: int) -> None:
    count = install_counter(command.get("kill_at"))
    import jax

    jax.devices()  # start the backend before the clock of a wall-clock kill starts
    started = time.perf_counter()
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    try:
        run(command)
    except BaseException as e:
        _emit({"event": "error", "ops": count[0], "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()})
    else:
        _emit({"event": "done", "ops": count[0], "seconds": time.perf_counter() - started})


def serve() -> None:
    assert threading.active_count() == 1, "the fork server must have no threads to lose"
    for line in sys.stdin:
        command = json.loads(line)
        ready_read, ready_write = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(ready_read)
                _worker(command, ready_write)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(ready_write)
        _emit({"event": "forked", "pid": pid})
        ready = os.read(ready_read, 1)
        os.close(ready_read)
        if ready and command.get("kill_after") is not None:
            time.sleep(command["kill_after"])
            os.kill(pid, signal.SIGKILL)  # still our child (unreaped), so the pid is its
        _, status = os.waitpid(pid, 0)
        _emit({"event": "exit", "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
               "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None})


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: F401  (imported once here, inherited by every worker)

    import orbax_safetensors  # noqa: F401

    serve()
