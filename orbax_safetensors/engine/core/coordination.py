"""Agreement between processes without device collectives.

A save may run on a background thread while the training loop issues its own
collectives; two threads issuing device collectives in different orders
deadlock. The ``jax.distributed`` coordination service (the key-value store
Orbax uses too) is safe from any thread, so every cross-process step of a
load or save goes through it. With one process everything here is free.

Two rules keep processes from waiting on each other in vain:

* **Keys cannot drift.** An operation's keys are named by its kind, its
  location and how many operations of that kind on that location this
  process has run *together with the others*. What a process does alone (a
  load into host arrays, ``metadata``, a save of host data only) is
  ``Peers.local`` and takes no number, so it cannot shift the next collective
  operation's keys on one process only.
* **A failure is heard at once.** A process that fails anywhere in a collective
  operation (``Peers.fail``) leaves its failure under the operation's key; every
  wait of the others looks there while it waits, and raises a
  ``PeerFailedError`` naming the process and its error within ``POLL_MS``, instead
  of waiting for a key the failed process will never set. Work is no wait:
  every long loop (a save's writes, a load's reads, a conversion's chunks)
  asks ``Peers.check`` per unit of work, so a survivor stops within about
  ``POLL_MS`` however much of its share is left, rather than finishing hours
  of work to learn at the next meeting that it was for nothing. A peer that is
  merely slow is waited for (up to ``TIMEOUT_S``), with a log line once the
  wait is long, naming who is awaited and where.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Collection, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import jax

from orbax_safetensors.errors import (
    ArgumentError,
    DistributedSetupError,
    PeerFailedError,
    PeerTimeoutError,
    ProcessFailure,
)

_LOG = logging.getLogger("orbax_safetensors")
TIMEOUT_S = 30 * 60
POLL_MS = 250  # how often a wait looks for a peer's failure
_WARN_S = 60  # a wait this long is logged: a peer is slow, or never called the operation
_sequence: collections.Counter[tuple[str, str]] = collections.Counter()
_sequence_lock = threading.Lock()


def _client():
    from jax._src import distributed  # the coordination client has no public accessor

    client = distributed.global_state.client
    if client is None:
        raise DistributedSetupError(
            "several JAX processes but no jax.distributed client: call "
            "jax.distributed.initialize() first")
    return client


class Peers:
    """The processes taking part in one load or save, and where they meet.

    ``collective`` operations involve every process (each must call them, in
    the same order as its other collective operations); local ones only this
    one, and every meeting is then immediate.
    """

    def __init__(self, key: str | None, where: str):
        self.key, self.where = key, where
        self._failed = False
        self._next_look = 0.0  # when ``check`` next asks the coordination service
        self._look_lock = threading.Lock()

    @classmethod
    def local(cls, where: str) -> Peers:
        return cls(None, where)

    @classmethod
    def collective(cls, kind: str, where: str) -> Peers:
        """The next collective operation of ``kind`` at ``where`` (a URL): the same key on every
        process, whatever each did alone before. One process alone is local."""
        if jax.process_count() == 1:
            return cls.local(where)
        with _sequence_lock:
            n = _sequence[kind, where]
            _sequence[kind, where] += 1
        return cls(f"orbax_safetensors/{kind}/{where}/{n}", where)

    @property
    def is_collective(self) -> bool:
        return self.key is not None

    @property
    def is_primary(self) -> bool:
        return not self.is_collective or jax.process_index() == 0

    def gather(self, step: str, value: str) -> list[str]:
        """Every process's ``value`` for ``step``, in process order, on every process."""
        if not self.is_collective:
            return [value]
        client = _client()
        client.key_value_set(f"{self.key}/{step}/{jax.process_index()}", value)
        return [self._wait(f"{self.key}/{step}/{p}", step, p) for p in range(jax.process_count())]

    def gather_to_primary(self, step: str, value: str) -> list[str] | None:
        """Every process's ``value``, in process order, on process 0 (``None`` elsewhere): what
        only process 0 needs is not sent to everyone."""
        if not self.is_collective:
            return [value]
        _client().key_value_set(f"{self.key}/{step}/{jax.process_index()}", value)
        if jax.process_index() != 0:
            return None
        return [self._wait(f"{self.key}/{step}/{p}", step, p) for p in range(jax.process_count())]

    def share(self, step: str, value: str) -> str:
        """Process 0's ``value`` for ``step``, on every process."""
        if not self.is_collective:
            return value
        if jax.process_index() == 0:
            _client().key_value_set(f"{self.key}/{step}", value)
            return value
        return self._wait(f"{self.key}/{step}", step, 0)

    def meet(self, step: str) -> None:
        """Returns once every process has reached ``step``; raises if one failed instead."""
        self.gather(step, "")

    def check_same(self, step: str, description: Sequence[str], what: str) -> None:
        """Raises on every process unless every process gave the same ``description`` (of
        the target, the tree, the options): only a digest travels, and the full lines only
        when they differ, to name the first that does."""
        if not self.is_collective:
            return
        digest = hashlib.sha256("\n".join(description).encode("utf-8", "surrogatepass")).hexdigest()
        if len(set(self.gather(step, digest))) == 1:
            return
        every = [json.loads(raw) for raw in self.gather(f"{step}/lines", json.dumps(list(description)))]
        for i in range(max(map(len, every))):
            seen = collections.defaultdict(list)
            for process, lines in enumerate(every):
                seen[lines[i] if i < len(lines) else "(nothing)"].append(process)
            if len(seen) > 1:
                break
        detail = "; ".join(f"process{'es' if len(p) > 1 else ''} {', '.join(map(str, p))}: {line}"
                           for line, p in seen.items())
        raise ArgumentError(f"{self.where}: the processes passed different {what} "
                         f"(every process must pass the same): {detail}")

    def fail(self, error: BaseException) -> None:
        """Tells the others this process failed (once; best effort: a dead coordination
        service must not hide the error being raised)."""
        if not self.is_collective or self._failed or isinstance(error, PeerFailedError):
            return  # another's failure is theirs to tell
        self._failed = True
        me = jax.process_index()
        try:
            _client().key_value_set(f"{self.key}/failed/{me}", ProcessFailure.of(me, error).to_json(),
                                    allow_overwrite=True)
        except Exception as e:  # the original error matters more
            _LOG.warning("%s: could not tell the other processes of this failure: %s", self.where, e)

    def check(self) -> None:
        """Raises ``PeerFailedError`` once another process has reported a failure. Called per
        unit of work from any thread; it asks the coordination service at most once every
        ``POLL_MS``, so calling it per chunk costs nothing measurable."""
        if not self.is_collective:
            return
        now = time.monotonic()
        with self._look_lock:
            if now < self._next_look:
                return
            self._next_look = now + POLL_MS / 1000
        failures = self.failures()
        if failures:
            raise PeerFailedError(f"{self.where}: another process failed", failures)

    def failures(self) -> dict[int, ProcessFailure]:
        """The failures other processes reported so far."""
        if not self.is_collective:
            return {}
        found = (ProcessFailure.from_json(raw) for _, raw in _client().key_value_dir_get(f"{self.key}/failed/"))
        return {f.process: f for f in found if f.process != jax.process_index()}

    def _wait(self, key: str, step: str, process: int) -> str:
        client, started = _client(), time.monotonic()
        warned = False
        while True:
            try:
                return client.blocking_key_value_get(key, POLL_MS)
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
            failures = self.failures()
            if failures:
                raise PeerFailedError(f"{self.where}: another process failed", failures)
            waited = time.monotonic() - started
            if waited > TIMEOUT_S:
                raise PeerTimeoutError(f"{self.where}: process {process} did not reach {step!r} "
                                       f"in {TIMEOUT_S} s (did every process call this operation?)")
            if waited > _WARN_S and not warned:
                warned = True
                _LOG.warning("%s: waiting %.0f s for process %d at %r (every process must call "
                             "this operation, in the same order)", self.where, waited, process, step)


def describe_arguments(options: Any, *, leave_out: Collection[str] = ("progress",)) -> list[str]:
    """A dataclass of options as processes compare them (``Peers.check_same``): a line per
    field, ``name=value``, so the error names the first argument that differs. ``leave_out``:
    what shapes nothing the processes write together (a progress line, a memory budget that
    bounds only this process's buffers)."""
    def plain(value: Any) -> str:  # a mapping's order is the caller's accident, not a difference
        return repr(dict(sorted(value.items()))) if isinstance(value, MappingABC) else repr(value)

    return [f"{field.name}={plain(getattr(options, field.name))}"
            for field in dataclasses.fields(options) if field.name not in leave_out]


def describe_spec(spec: Any) -> str:
    """A tensor (a ``TensorSpec``) as processes compare it: name, dtype and shape."""
    return f"{spec.name}: {spec.dtype.code}{list(spec.shape)}"


def describe_sharding(sharding: jax.sharding.Sharding | None) -> str:
    """A sharding as processes compare it: its kind, spec and devices in order (two processes
    that lay a tensor out differently would read or write each other's bytes)."""
    if sharding is None:
        return "host"
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return (f"{type(sharding).__name__}({dict(mesh.shape)}, {getattr(sharding, 'spec', None)}, "
                f"devices {_devices_digest(tuple(d.id for d in mesh.devices.flat))})")
    try:
        devices = _devices_digest(tuple(sorted(d.id for d in sharding.device_set)))
    except Exception:  # over an abstract mesh: no devices yet
        devices = "(abstract)"
    return f"{sharding!r} on devices {devices}"


@functools.lru_cache(maxsize=64)
def _devices_digest(ids: tuple[int, ...]) -> str:
    """Device ids in order, short: a mesh of thousands of devices is one line per leaf."""
    shown = ",".join(map(str, ids[:4])) + (",..." if len(ids) > 4 else "")
    return f"[{shown}]#{hashlib.sha256(repr(ids).encode()).hexdigest()[:12]}"
