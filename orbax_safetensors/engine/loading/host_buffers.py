"""Host buffers a load reads into: aligned for XLA, and cheap to touch the first time.

On the CPU backend these buffers *become* the loaded arrays (XLA adopts an
aligned host buffer instead of copying it), so every load needs fresh memory
for all of its bytes, and what that memory costs to touch for the first time
is most of a load's cost in a fresh process. Measured on a 2-CPU VM whose
freed memory goes back to its host (1 GiB, fresh process):

    transparent huge pages (NumPy madvises them for large arrays), faulted   0.3-0.75 GB/s
    4 KiB pages, faulted one by one by the reads                            0.9-1.3 GB/s
    4 KiB pages, populated by one madvise(MADV_POPULATE_WRITE) first        1.7-1.9 GB/s

Huge pages are slow to fault here because the kernel compacts memory to find
each one (``defrag=madvise``), so buffers opt out of them. A read (``preadv``)
faults its destination's pages inside the kernel, about as fast as populating
them; a copy loop in user space takes a trap per page, so a buffer about to be
filled by copies (strided shards cut from a bounce buffer) is populated first,
in one call, by the thread about to copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
from collections.abc import Sequence

import numpy as np

# XLA's CPU client adopts a 64-byte aligned, contiguous host buffer as the device
# buffer instead of copying it (and copies rather than writes it when donated), so
# on CPU a shard read into an aligned buffer costs no second copy and no memory.
XLA_ALIGNMENT = 64
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, and arm64 with 4 KiB pages)
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL and pages fault as usual


def _madvise():
    if not os.uname().sysname == "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_advise = _madvise()
try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds  # NumPy >= 2
except ImportError:  # NumPy 1.x
    _byte_bounds = np.byte_bounds


def _aligned(n: int) -> int:
    return -(-n // XLA_ALIGNMENT) * XLA_ALIGNMENT


def _starts(sizes: Sequence[int]) -> list[int]:
    """Offsets of ``sizes`` bytes laid out 64-byte aligned, and (last) the bytes they span."""
    return list(itertools.accumulate(map(_aligned, sizes), initial=0))


def footprint(sizes: Sequence[int]) -> int:
    """The bytes ``carve`` needs for buffers of ``sizes``."""
    return sum(map(_aligned, sizes))


def carve(arena: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Buffers of ``sizes`` bytes, each 64-byte aligned, from a 64-byte aligned ``arena``
    of at least ``footprint(sizes)`` bytes."""
    return [arena[start:start + n] for start, n in zip(_starts(sizes), sizes)]


def host_buffers(sizes: Sequence[int], populated: bool = False) -> list[np.ndarray]:
    """Uninitialised byte buffers, each 64-byte aligned, carved from one allocation of small
    pages (one allocation per tensor rather than per shard: an allocation per shard, and the
    kernel's work on each, cost a load of 16 000 small shards more than its reads).
    ``populated``: their pages faulted in, in one call (see ``populate``)."""
    total = footprint(sizes)
    raw = np.empty(total + PAGE, np.uint8)
    address = raw.__array_interface__["data"][0]  # a tenth of the cost of ``raw.ctypes.data``
    base = -address % PAGE  # page-aligned, hence 64-byte aligned
    if _advise is not None and total >= HUGE_PAGE:  # a smaller one holds none
        _advise(address + base, total - total % PAGE, _MADV_NOHUGEPAGE)
    arena = raw[base:base + total]
    if populated:
        populate(arena)
    return carve(arena, sizes)


# A tensor whose buffers take less than this shares an allocation with its neighbours: alone,
# 64 bytes cost a page and a page of alignment (100 000 tiny tensors: 800 MB for 6.4 MB),
# and an allocation each. An arena lives as long as any array carved from it, so arenas stay
# small: one kept tiny tensor holds at most ``SHARED_ARENA`` bytes.
SHARED_BELOW = 64 << 10
SHARED_ARENA = 1 << 20


def tensor_buffers(sizes: Sequence[Sequence[int]]) -> list[list[np.ndarray]]:
    """``host_buffers`` for each of several tensors (``sizes[k]``: the bytes of tensor ``k``'s
    shards): one allocation per tensor, except that small tensors (under ``SHARED_BELOW``)
    share allocations of up to ``SHARED_ARENA`` bytes, in order."""
    result: list[list[np.ndarray]] = [[] for _ in sizes]
    shared: list[int] = []  # small tensors waiting for their arena
    shared_bytes = 0

    def allocate_shared() -> None:
        buffers = iter(host_buffers([n for k in shared for n in sizes[k]]))
        for k in shared:
            result[k] = [next(buffers) for _ in sizes[k]]
        shared.clear()

    for k, tensor in enumerate(sizes):
        total = footprint(tensor)
        if total >= SHARED_BELOW:
            result[k] = host_buffers(tensor)
            continue
        if shared_bytes + total > SHARED_ARENA:
            allocate_shared()
            shared_bytes = 0
        shared.append(k)
        shared_bytes += total
    if shared:
        allocate_shared()
    return result


def populate(view: np.ndarray) -> None:
    """Faults in the pages ``view`` spans, in one system call, before something is written
    there (a no-op for pages already there, and where the kernel cannot)."""
    if _advise is None or view.nbytes < PAGE:
        return
    low, high = _byte_bounds(view)
    start = low - low % PAGE
    _advise(start, high - start, _MADV_POPULATE_WRITE)
