"""Run a function in several real JAX processes joined by ``jax.distributed``.

Multi-host behaviour (``jax.process_count() > 1``, arrays that are not fully
addressable, cross-process collectives) cannot be faked inside one Python
process, so tests that need it launch N genuine Python interpreters on the CPU
backend, each pretending to be a host with ``devices_per_process`` devices
(``--xla_force_host_platform_device_count``), wired together through a
coordinator on ``127.0.0.1``.

Usage::

    results = run_multiprocess("tests.test_foo:child_fn", num_processes=2,
                               args={"n": 3})
    assert [r.value for r in results] == [...]

The target is called as ``fn(args)`` in every child, after
``jax.distributed.initialize``; whatever it returns must be JSON-serialisable
and comes back as ``ProcessResult.value``. See ``tests/support/_multiprocess_child.py``.

This module deliberately has no pytest dependency; ``tests/conftest.py``
exposes it as the ``multiprocess`` fixture.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from tests.support import REPO

__all__ = [
    "MultiProcessError",
    "ProcessResult",
    "free_port",
    "run_multiprocess",
]

# Repository root: the directory that contains the ``tests`` package. Children
# run from here (and get it on PYTHONPATH) so that ``-m tests.support._multiprocess_child``
# and ``tests.<module>:<fn>`` targets import regardless of the caller's cwd.
REPO_ROOT = REPO

CHILD_MODULE = "tests.support._multiprocess_child"

# After the first child fails, how long the survivors get to finish on their
# own before being killed. A process whose peer has died usually blocks in a
# collective or in the shutdown barrier (or aborts after a heartbeat timeout of
# ~100 s), so waiting for it would turn every failure into a full timeout.
FAILURE_GRACE_SECONDS = 3.0

# On timeout, children get SIGUSR1 first (the child registers faulthandler on
# it, so every thread's Python stack lands in its stderr -> in the error
# message), then this long before the SIGKILL.
TRACEBACK_DUMP_SECONDS = 1.0

TAIL_LINES = 200

_POLL_SECONDS = 0.05

# Failures that mean "the coordinator could not bind its port" -- the only
# failure that is retried (the port from free_port() is released before the
# child binds it, so another process can grab it in between).
_PORT_CLASH_MARKERS = (
    "address already in use",
    "failed to add port",  # grpc: "Failed to add port to server: ..."
    "eaddrinuse",
    "failed to bind",
    "could not bind",
    "couldn't bind",
)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago.

    The OS picks it (bind to port 0); the socket is closed again so the
    coordinator can bind it, which leaves a small race window -- hence the
    single retry in ``run_multiprocess``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ProcessResult:
    """Outcome of one child process."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    # JSON-decoded return value of the target function, or None if the child
    # did not get as far as writing it.
    value: Any


class MultiProcessError(AssertionError):
    """One or more children failed or the group timed out.

    An AssertionError so pytest reports it as a test failure, not an error in
    the test machinery. The message contains, for every child, its status and
    the tail of its stdout/stderr: the children's output is otherwise lost.
    ``results`` holds the full ``ProcessResult`` of each child.
    """

    def __init__(self, message: str, results: list[ProcessResult]):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class _Child:
    process_id: int
    proc: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    result_path: Path
    # Why we killed it ("timed out", "killed after peer failure"), if we did.
    killed_reason: str | None = None
    # When we noticed it exit non-zero on its own; the earliest one is
    # normally the root cause, the others are collateral damage.
    failed_at: float | None = None


def _tail(text: str, n: int = TAIL_LINES) -> str:
    lines = text.splitlines()
    if len(lines) <= n:
        return text
    return f"[... {len(lines) - n} earlier lines omitted ...]\n" + "\n".join(
        lines[-n:]
    )


def _describe_returncode(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _child_env(
    base: dict[str, str],
    devices_per_process: int,
) -> dict[str, str]:
    env = dict(base)
    # Keep other XLA flags the caller set, but the device count must be ours.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith(_DEVICE_COUNT_FLAG)
    ]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    # Unbuffered so that output printed just before a hang/kill is not lost.
    env["PYTHONUNBUFFERED"] = "1"
    pythonpath = env.get("PYTHONPATH")
    env["PYTHONPATH"] = (
        str(REPO_ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    )
    return env


def _kill_group(child: _Child, sig: int = signal.SIGKILL) -> None:
    """Signals the child's whole process group.

    Each child is started with ``start_new_session=True`` so it leads its own
    group: anything it spawned dies with it, and we never signal the test
    runner's own group.
    """
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # Already gone.


def _launch(
    target: str,
    *,
    num_processes: int,
    port: int,
    timeout: float,
    args: Any,
    env: dict[str, str],
    cwd: str,
    workdir: Path,
) -> list[_Child]:
    children: list[_Child] = []
    try:
        for pid in range(num_processes):
            stdout_path = workdir / f"process_{pid}.stdout"
            stderr_path = workdir / f"process_{pid}.stderr"
            result_path = workdir / f"process_{pid}.result.json"
            config = {
                "target": target,
                "coordinator_address": f"127.0.0.1:{port}",
                "num_processes": num_processes,
                "process_id": pid,
                "args": args,
                "result_path": str(result_path),
                # The children must not wait for a coordinator longer than the
                # group may run at all.
                "initialization_timeout": max(10, int(timeout) + 1),
            }
            # Output goes to files, not pipes: with pipes we would have to
            # drain N stdout+stderr streams concurrently, and a child that
            # fills a 64 KiB pipe buffer (e.g. XLA logging) blocks forever,
            # which looks exactly like the collective hangs we want to detect.
            with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", CHILD_MODULE, json.dumps(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            children.append(
                _Child(pid, proc, stdout_path, stderr_path, result_path)
            )
    except BaseException:
        for child in children:
            _kill_group(child)
            child.proc.wait()
        raise
    return children


def _wait(children: list[_Child], timeout: float) -> bool:
    """Waits for all children; returns True iff the group timed out.

    Fail-fast: once any child exits non-zero, the others get
    FAILURE_GRACE_SECONDS and are then killed. On return every child has
    exited and been reaped.
    """
    deadline = time.monotonic() + timeout
    kill_at: float | None = None
    timed_out = False
    while True:
        running = [c for c in children if c.proc.poll() is None]
        now = time.monotonic()
        for c in children:
            if c.failed_at is None and c.proc.returncode not in (None, 0):
                c.failed_at = now
                if kill_at is None:
                    kill_at = now + FAILURE_GRACE_SECONDS
        if not running:
            break
        if kill_at is not None and now >= kill_at:
            for c in running:
                c.killed_reason = "killed after a peer failed"
                _kill_group(c)
            break
        if now >= deadline:
            timed_out = True
            for c in running:
                c.killed_reason = f"timed out after {timeout:g}s"
                _kill_group(c, signal.SIGUSR1)  # Dump Python stacks.
            time.sleep(TRACEBACK_DUMP_SECONDS)
            for c in running:
                _kill_group(c)
            break
        time.sleep(_POLL_SECONDS)
    for c in children:
        c.proc.wait()
    return timed_out


def _collect(children: list[_Child]) -> list[ProcessResult]:
    results = []
    for c in children:
        value = None
        if c.result_path.exists():
            value = json.loads(c.result_path.read_text())
        results.append(
            ProcessResult(
                process_id=c.process_id,
                returncode=c.proc.returncode,
                stdout=c.stdout_path.read_text(errors="replace"),
                stderr=c.stderr_path.read_text(errors="replace"),
                value=value,
            )
        )
    return results


def _failed(children: list[_Child]) -> bool:
    return any(c.proc.returncode != 0 or c.killed_reason for c in children)


def _looks_like_port_clash(results: list[ProcessResult]) -> bool:
    # Only the coordinator (process 0) binds the port.
    stderr = results[0].stderr.lower() if results else ""
    return any(marker in stderr for marker in _PORT_CLASH_MARKERS)


def _error_message(
    target: str, children: list[_Child], results: list[ProcessResult]
) -> str:
    n_bad = sum(1 for c in children if c.proc.returncode != 0 or c.killed_reason)
    parts = [
        f"{n_bad} of {len(children)} processes running {target!r} failed:"
    ]
    failed = [c for c in children if c.failed_at is not None]
    first = min(failed, key=lambda c: c.failed_at) if failed else None
    for c in children:
        status = _describe_returncode(c.proc.returncode)
        if c.killed_reason:
            status = f"{c.killed_reason} ({status})"
        if c is first:
            status += "  <-- first to fail"
        parts.append(f"  process {c.process_id}: {status}")
    for c, r in zip(children, results):
        parts.append(
            f"\n===== process {r.process_id} stdout (tail) =====\n"
            f"{_tail(r.stdout)}"
        )
        parts.append(
            f"===== process {r.process_id} stderr (tail) =====\n"
            f"{_tail(r.stderr)}"
        )
    return "\n".join(parts)


def run_multiprocess(
    target: str,
    *,
    num_processes: int,
    devices_per_process: int = 4,
    timeout: float = 120,
    args: Any = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> list[ProcessResult]:
    """Runs ``target`` in ``num_processes`` JAX processes and returns results.

    Args:
      target: ``"package.module:function"``, importable in the child (the repo
        root is put on PYTHONPATH). Called as ``fn(args)`` after
        ``jax.distributed.initialize``; must return something JSON-encodable.
      num_processes: number of processes (= simulated hosts).
      devices_per_process: CPU devices per process, via
        ``--xla_force_host_platform_device_count``.
      timeout: seconds for the whole group. On expiry all children are killed
        (after a stack dump) and MultiProcessError is raised. Applies per
        attempt; only a coordinator port clash causes a second attempt.
      args: JSON-encodable argument passed to ``fn``.
      env: extra environment variables for the children (on top of
        ``os.environ``). XLA_FLAGS given here are kept, except the device
        count flag, which is replaced.
      cwd: children's working directory (default: repo root).

    Returns:
      One ProcessResult per child, ordered by process id.

    Raises:
      MultiProcessError: a child exited non-zero, was killed, or the group
        timed out.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    child_env = _child_env({**os.environ, **(env or {})}, devices_per_process)
    cwd = str(cwd) if cwd is not None else str(REPO_ROOT)

    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="multiprocess_") as tmp:
            children = _launch(
                target,
                num_processes=num_processes,
                port=free_port(),
                timeout=timeout,
                args=args,
                env=child_env,
                cwd=cwd,
                workdir=Path(tmp),
            )
            try:
                _wait(children, timeout)
            finally:
                # Also on KeyboardInterrupt / any error in the wait loop: never
                # leave orphaned JAX processes holding ports and CPU.
                for c in children:
                    if c.proc.poll() is None:
                        _kill_group(c)
                        c.proc.wait()
            results = _collect(children)
        if not _failed(children):
            return results
        if attempt == 0 and _looks_like_port_clash(results):
            continue
        raise MultiProcessError(
            _error_message(target, children, results), results
        )
    raise AssertionError("unreachable")
