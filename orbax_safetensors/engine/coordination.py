"""Agreement between processes without device collectives.

A save may run on a background thread while the training loop issues its own
collectives; two threads issuing device collectives in different orders
deadlock. The ``jax.distributed`` coordination service (the key-value store
and barriers Orbax uses too) is safe from any thread, so every cross-process
step of a save goes through it. With one process everything here is free.
"""

from __future__ import annotations

import itertools
import threading

import jax

_TIMEOUT_MS = 30 * 60 * 1000
_sequence = itertools.count()
_sequence_lock = threading.Lock()


def _client():
    from jax._src import distributed  # the coordination client has no public accessor

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "several JAX processes but no jax.distributed client: call "
            "jax.distributed.initialize() first")
    return client


def next_operation_key(kind: str) -> str:
    """A key that every process derives identically for its n-th operation.

    Processes must start their saves in the same order (as they must start any
    collective), so a per-process counter names each one the same everywhere.
    """
    with _sequence_lock:
        return f"orbax_safetensors/{kind}/{next(_sequence)}"


def barrier(key: str) -> None:
    """Returns once every process has reached ``key``."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(key, _TIMEOUT_MS)


def share_from_primary(key: str, value: str) -> str:
    """Process 0's ``value`` for ``key``, on every process."""
    if jax.process_count() == 1:
        return value
    client = _client()
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, _TIMEOUT_MS)


def gather_to_all(key: str, value: str) -> list[str]:
    """Every process's ``value``, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    return [client.blocking_key_value_get(f"{key}/{p}", _TIMEOUT_MS)
            for p in range(jax.process_count())]


def gather_to_primary(key: str, value: str) -> list[str] | None:
    """Every process's ``value``, in process order, on process 0 (``None`` elsewhere): what
    only process 0 needs is not sent to everyone."""
    if jax.process_count() == 1:
        return [value]
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    if jax.process_index() != 0:
        return None
    return [client.blocking_key_value_get(f"{key}/{p}", _TIMEOUT_MS)
            for p in range(jax.process_count())]
