"""Child entry point for ``tests.support.multiprocess.run_multiprocess``.

Invoked as ``python -m tests.support._multiprocess_child '<json config>'`` with
XLA_FLAGS / JAX_PLATFORMS already in the environment (they must be set before
jax is imported, which is why they are environment variables and not config
keys). Joins the ``jax.distributed`` group, calls ``fn(args)`` and writes its
JSON-encoded return value to ``result_path`` -- a file rather than stdout so
that anything the function or JAX prints cannot corrupt the result.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback
import warnings


def _load_target(target: str):
    module_name, _, fn_name = target.partition(":")
    module = importlib.import_module(module_name)
    fn = module
    for part in fn_name.split("."):
        fn = getattr(fn, part)
    return fn


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    # pyproject.toml's filterwarnings, which pytest applies to its own process only: what a newer
    # JAX, NumPy or Orbax deprecates in our code fails here too.
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("error", category=category, module="orbax_safetensors")
    # The parent sends SIGUSR1 before killing a timed-out group, so the stack
    # of every thread (i.e. where it hung) ends up in stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import jax

    # Gloo is already the default CPU collectives implementation in recent
    # jax; set it explicitly because without a cross-process implementation
    # collectives between CPU "hosts" fail.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    jax.distributed.initialize(
        coordinator_address=config["coordinator_address"],
        # By default the coordinator listens on all interfaces ([::]:port);
        # bind exactly the loopback address whose port the parent checked.
        coordinator_bind_address=config["coordinator_address"],
        num_processes=config["num_processes"],
        process_id=config["process_id"],
        local_device_ids=None,
        initialization_timeout=config["initialization_timeout"],
    )
    try:
        # Imported only after initialize: a target module that touches devices
        # at import time would otherwise start a single-process backend.
        fn = _load_target(config["target"])
        value = fn(config["args"])
        result_path = config["result_path"]
        tmp_path = result_path + ".tmp"
        with open(tmp_path, "w") as f:
            json.dump(value, f)
        os.replace(tmp_path, result_path)  # Never leave a half-written result.
    except BaseException:  # pylint: disable=broad-except
        # Exit at once WITHOUT jax.distributed.shutdown(): shutdown is a
        # barrier over all processes, and the peers are typically blocked in a
        # collective waiting for this process, so a failed process that tries
        # to shut down cleanly deadlocks with them until a gloo/coordination
        # timeout (30 s to minutes). Exiting makes the failure visible to the
        # parent, which then kills the peers after a short grace period.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # pylint: disable=protected-access
    try:
        jax.distributed.shutdown()
    except Exception:  # pylint: disable=broad-except
        pass  # The result is already written; a peer may be gone by now.
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
