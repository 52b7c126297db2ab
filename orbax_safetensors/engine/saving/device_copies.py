"""A blocking save's shards on accelerators: copied to the host a window ahead of the writes.

A save writes host bytes. Shards on CPU devices already are host memory
(written from their own buffers), and ``async_save`` copies every shard before
it returns (its caller may change the arrays). A blocking save of arrays in
accelerator memory used to copy every shard to the host first, then write: the
whole model in host memory at once, and no write before the last copy. Here each
such shard stays on its device as an ``OnDevice`` until the writers get near it:
``HostCopies`` lets the writes in range by range, starting the copies of the
shards each range needs as it is queued (overlapping the writes queued before)
while their bytes fit the save's ``memory_budget``, and lets a shard's copy go
once its last range is written, which makes room for the next.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors.errors import ProtocolError
from orbax_safetensors.format import to_bytes


class OnDevice:
    """One shard left on its accelerator until written: ``host()`` copies it (once),
    ``prefetch()`` starts that copy, ``release()`` lets both the copy and the device
    reference go. Reads as an array (``shape``, ``dtype``, ``nbytes``, ``np.asarray``)."""

    def __init__(self, array: jax.Array):
        self.shape, self.dtype, self.nbytes = array.shape, np.dtype(array.dtype), array.nbytes
        self._array: jax.Array | None = array
        self._host: np.ndarray | None = None
        self._lock = threading.Lock()

    def prefetch(self) -> None:
        array = self._array
        if array is not None:
            array.copy_to_host_async()

    def host(self) -> np.ndarray:
        with self._lock:
            if self._host is None:
                if self._array is None:
                    raise ProtocolError("a shard's host copy was wanted after its last write let it go")
                self._host = np.asarray(self._array)
            return self._host

    def release(self) -> None:
        with self._lock:
            self._array = self._host = None

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.array(self.host(), dtype=dtype, copy=copy)


def on_accelerator(data: Any) -> bool:
    """Whether ``data`` is an array in accelerator memory (a device the host cannot read)."""
    return isinstance(data, jax.Array) and any(d.platform != "cpu" for d in data.devices())


def prefetch_all(datas: Iterable[Any]) -> None:
    """Starts every ``OnDevice`` copy among ``datas``: for writers that take the bytes in no
    set order, or may need them again (an upload retried replays its stream)."""
    for data in datas:
        if isinstance(data, OnDevice):
            data.prefetch()


class HostCopies(Sequence[memoryview]):
    """The bytes of a save's shards (``Payloads``), by index: ``datas[k]`` as written, an
    ``OnDevice`` brought to the host when first wanted.

    Writers that take each shard's bytes once, in order (``strategies.InPlace``), are let in
    range by range: ``admit`` (the submitting thread) waits until the accelerator shards a
    range starts fit ``budget`` bytes beside those started and not yet written, then starts
    their copies, so they overlap the writes of the ranges before; ``done`` lets a shard go
    after its last use; ``finished`` ends a range. A range that finds no other in flight is
    let in whatever its size: nothing would make room. Writers that take bytes in no set
    order, or again (a retried upload replays its stream), ``prefetch_all`` instead."""

    def __init__(self, datas: Sequence[Any], budget: int):
        self._datas = list(datas)
        self._budget = budget
        # Host arrays only (CPU devices, numpy leaves): their bytes are views, taken all at once
        # at first use; no window, no lock per access (100 000 tiny tensors take 200 000).
        self._host_only = not any(isinstance(d, OnDevice) for d in self._datas)
        self._all: list[memoryview] | None = None
        self._bytes: dict[int, memoryview] = {}
        self._uses: collections.Counter[int] = collections.Counter()
        self._started: set[int] = set()  # accelerator shards started, not let go
        self._inflight = 0  # their bytes
        self._ranges = 0  # admitted, not finished
        self._cond = threading.Condition()
        self.nbytes = 0  # the bytes handed out, each shard counted once
        self.peak = 0  # the most bytes of ``_inflight``

    def uses(self, targets: Iterable[int]) -> HostCopies:
        """Each shard is let go after as many ``done`` as it appears in ``targets``."""
        if not self._host_only:
            self._uses.update(targets)
        return self

    def prefetch_all(self) -> HostCopies:
        prefetch_all(self._datas)
        return self

    def __len__(self) -> int:
        return len(self._datas)

    def __getitem__(self, k: int) -> memoryview:  # type: ignore[override]
        if self._host_only:
            if self._all is None:
                with self._cond:
                    if self._all is None:
                        self._all = [to_bytes(data) for data in self._datas]
                        self.nbytes = sum(map(len, self._all))
            return self._all[k]
        with self._cond:
            held = self._bytes.get(k)
            if held is not None:
                return held
            self._start([k])
        data = self._datas[k]
        view = to_bytes(data.host() if isinstance(data, OnDevice) else data)
        with self._cond:
            if k not in self._bytes:
                self._bytes[k] = view
                self.nbytes += len(view)
            return self._bytes[k]

    def admit(self, targets: Iterable[int]) -> None:
        """Waits for room for the shards among ``targets`` not yet started, and starts them."""
        if self._host_only:
            return
        new = {k for k in targets if isinstance(self._datas[k], OnDevice) and k not in self._started}
        size = sum(self._datas[k].nbytes for k in new)
        with self._cond:
            self._cond.wait_for(lambda: self._inflight + size <= self._budget or self._ranges == 0)
            self._ranges += 1
            self._start(new)

    def finished(self) -> None:
        """A range ``admit`` let in is written (or failed)."""
        if self._host_only:
            return
        with self._cond:
            self._ranges -= 1
            self._cond.notify_all()

    def done(self, targets: Iterable[int]) -> None:
        """One use of each of ``targets`` is written; a shard with none left is let go."""
        if self._host_only:
            return
        with self._cond:
            for k in targets:
                self._uses[k] -= 1
                if self._uses[k] == 0:
                    self._bytes.pop(k, None)
                    if k in self._started:
                        self._started.discard(k)
                        self._inflight -= self._datas[k].nbytes
                        self._datas[k].release()
                    self._datas[k] = None
            self._cond.notify_all()

    def _start(self, shards: Iterable[int]) -> None:
        """Starts the copies of ``shards`` (under the lock)."""
        for k in shards:
            data = self._datas[k]
            if isinstance(data, OnDevice) and k not in self._started:
                self._started.add(k)
                self._inflight += data.nbytes
                data.prefetch()
        self.peak = max(self.peak, self._inflight)
