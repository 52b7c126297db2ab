"""Host staging a load recycles: buffers only copied out of, page-locked where the platform allows.

Where a load's results live on an accelerator, the host buffers it reads into
are staging: each is copied to device memory and dropped. Fresh pages for every
batch cost a first touch each time (``host_buffers``: 0.3-1.9 GB/s on a VM that
hands freed memory back), and a copy out of pageable memory goes through the
driver's own bounce buffer. Measured on one H200 (jax 0.11.2, 64 MB / 1 GB
buffers): ``device_put`` of pageable numpy 5.3 / 8.8 GB/s; of the same buffer
once registered with the device's client (``client.dma_map``) 36.5 / 53.1 GB/s.
So a ``StagingPool`` keeps a load's staging, at most its memory budget, in a few
page-aligned arenas, registers each with the accelerators' clients once, hands
them out batch by batch, and unregisters them when the load ends.

A transfer reads its host buffer after ``device_put`` returns (measured: a
value overwritten right after the call arrived overwritten), so a buffer comes
back only once the arrays made from it are ready (``execution``).

The CPU backend adopts an aligned host buffer as the array instead of copying it:
a recycled buffer would change under a loaded array, so a pooled load onto CPU
devices copies each shard out of the pool (``device_assembly.off_staging``), which
the fresh-pages path never pays. ``LoadOptions.staging="auto"`` pools for
accelerators only; the CPU path pools just the staging of jobs that copy on the
host anyway (mapped tensors).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from orbax_safetensors.engine.loading.host_buffers import PAGE, carve, footprint, host_buffers

_LOG = logging.getLogger(__name__)

def arena_size(nbytes: int) -> int:
    """The arena that holds ``nbytes``: whole pages (what ``dma_map`` registers; a smaller
    allocation costs a page of alignment anyway). Sizes are not rounded further: a model's
    shards come in a few exact sizes, which recur layer after layer."""
    return max(-(-nbytes // PAGE) * PAGE, PAGE)


class StagingPool:
    """Arenas of host memory lent out batch by batch and given back once copied from, at most
    ``capacity`` bytes of them kept (one batch bigger than that gets an arena of its own, freed
    when given back). ``clients``: the PjRt clients each arena is registered with for DMA
    (``dma_map``); a client that refuses (the CPU backend: UNIMPLEMENTED; a host out of
    lockable memory) leaves this and later arenas pageable, which costs speed, not correctness."""

    def __init__(self, capacity: int, clients: Iterable[Any] = ()):
        self.capacity = capacity
        self.peak = 0  # the most bytes of arenas held at once
        self.pinned = 0  # bytes of arenas registered for DMA, all told
        self._clients = list(clients)
        self._registering = bool(self._clients)  # off once a client refuses
        self._free: dict[int, list[np.ndarray]] = {}  # by size: a load's shards come in a few sizes
        self._lent: dict[int, np.ndarray] = {}  # id of the views handed out → their arena
        self._registered: set[int] = set()  # addresses of registered arenas
        self._held = 0
        self._lock = threading.Lock()

    def take(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """Buffers of ``sizes`` bytes, 64-byte aligned, from one arena: a free one of exactly
        its size, else a new one (free arenas of other sizes are let go first, the largest
        first, while the pool would otherwise hold more than ``capacity``).

        Never a bigger free arena: the caller's budget counts the bytes asked for, so a
        small job lent a big arena would leave the next job none, and the pool would grow
        past ``capacity`` by the difference."""
        total = arena_size(footprint(sizes))
        with self._lock:
            arena = self._pop(total) if total in self._free else None
            dropped = []
            while arena is None and self._free and self._held + total > self.capacity:
                dropped.append(self._pop(max(self._free)))  # the largest
                self._held -= dropped[-1].size
            if arena is None:
                self._held += total
                self.peak = max(self.peak, self._held)
        self._let_go(dropped)
        if arena is None:
            arena = self._new(total)
        views = carve(arena, sizes)
        with self._lock:
            self._lent[id(views)] = arena
        return views

    def give(self, views: list[np.ndarray]) -> None:
        """``views`` (from ``take``) are copied from: their arena is free again, or let go if
        the pool holds more than ``capacity``."""
        with self._lock:
            arena = self._lent.pop(id(views))
            keep = self._held <= self.capacity
            if keep:
                self._free.setdefault(arena.size, []).append(arena)
            else:
                self._held -= arena.size
        if not keep:
            self._let_go([arena])

    def close(self, *, lent_done: bool) -> None:
        """Unregisters every arena and lets the pool go. ``lent_done``: no transfer reads an
        arena still lent (after a failure that waited for the transfer in flight); an arena
        an unfinished transfer may still read stays registered rather than be unmapped under it."""
        with self._lock:
            arenas = [a for free in self._free.values() for a in free] + (
                list(self._lent.values()) if lent_done else [])
            self._free, self._held = {}, 0
        self._let_go(arenas)

    def _pop(self, size: int) -> np.ndarray:
        """A free arena of ``size`` bytes (one there is), under the lock."""
        free = self._free[size]
        arena = free.pop()
        if not free:
            del self._free[size]
        return arena

    def _new(self, nbytes: int) -> np.ndarray:
        arena = host_buffers([nbytes])[0]
        if not self._registering:
            return arena
        for k, client in enumerate(self._clients):
            try:
                client.dma_map(arena.ctypes.data, arena.nbytes)
            except Exception as e:  # noqa: BLE001 - any refusal: stay pageable
                _LOG.debug("host staging stays pageable: %s refused dma_map: %s", client.platform, e)
                self._unregister(arena, self._clients[:k])
                self._registering = False
                return arena
        with self._lock:
            self._registered.add(arena.ctypes.data)
            self.pinned += arena.nbytes
        return arena

    def _let_go(self, arenas: Sequence[np.ndarray]) -> None:
        for arena in arenas:
            with self._lock:
                registered = arena.ctypes.data in self._registered
                self._registered.discard(arena.ctypes.data)
            if registered:
                self._unregister(arena, self._clients)

    @staticmethod
    def _unregister(arena: np.ndarray, clients: Sequence[Any]) -> None:
        for client in clients:
            try:
                client.dma_unmap(arena.ctypes.data)
            except Exception as e:  # noqa: BLE001 - nothing left to do but say so
                _LOG.warning("could not unregister %d bytes of host staging from %s: %s",
                             arena.nbytes, client.platform, e)


def accelerator_clients(devices: Iterable[Any]) -> list[Any]:
    """The distinct clients of the non-CPU ``devices``: where staging is registered for DMA."""
    return list({id(d.client): d.client for d in devices if d.platform != "cpu"}.values())
