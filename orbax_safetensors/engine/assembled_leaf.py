"""A tree leaf made of several stored tensors (``planning.assembly.Assembly``: layers stacked,
projections concatenated), read as one job per stored tensor and put on its devices once whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.casting import Cast, cast_rule, device_dtype
from orbax_safetensors.engine.device_assembly import device_array
from orbax_safetensors.engine.host_work import host_array, host_map
from orbax_safetensors.engine.read_jobs import Job, Staging, local_boxes, planned_reads
from orbax_safetensors.engine.read_policy import ReadPolicy
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.planning import Box, TensorSource, box_shape, box_size, full_box, relative_slices
from orbax_safetensors.planning.assembly import Assembly, Piece


class AssembledLeaf:
    """A leaf assembled from its pieces' stored tensors; ``value`` once its last job finished.

    Each job reads only the stored boxes behind the parts of this process's
    device boxes its tensor holds (a device holding layers 0-7 never reads
    layer 8), transforms them and copies them into the leaf's host buffers,
    one per device box. The job that completes the leaf puts it on the
    devices, so a leaf's host buffers live from its first piece to its last
    (on CPU they become the array itself: 64-byte aligned, adopted by XLA).
    """

    def __init__(self, name: str, sources: Sequence[TensorSource], assembly: Assembly,
                 dtype: np.dtype, sharding: jax.sharding.Sharding | None, policy: ReadPolicy):
        self.name, self.assembly, self.sharding = name, assembly, sharding
        self.dtype = np.dtype(dtype) if sharding is None else device_dtype(dtype)
        casts = [cast_rule(piece.stored, source, piece.transform, self.dtype, policy.casting, leaf=name)
                 for piece, source in zip(assembly.pieces, sources)]
        # Every piece's refused cast (``refuse_casts``), whether or not this process reads it.
        self.refused = tuple(cast.refused for cast in casts if cast.refused is not None)
        shape = assembly.shape
        self.local = {full_box(shape): []} if sharding is None else local_boxes(name, shape, sharding)
        self.buffers: dict[Box, np.ndarray] = {}
        self.value: Any = None
        self.jobs = [job for piece, source, cast in zip(assembly.pieces, sources, casts)
                     for job in [self._job(piece, source, policy, cast)] if job is not None]
        self._remaining = len(self.jobs)
        if not self.jobs:  # this process holds none of it (or it is empty)
            self.value = self._result()

    def _job(self, piece: Piece, source: TensorSource, policy: ReadPolicy, cast: Cast) -> Job | None:
        """The job of one piece, if this process holds any of it; ``cast.check``: of the stored
        values read, before the transform casts them into the leaf's buffers."""
        if source.dtype.is_packed:
            raise SafetensorsError(f"a {source.dtype.code} tensor cannot be part of a stacked or "
                                   f"concatenated leaf ({self.name!r})", tensor=piece.stored)
        parts = {box: part for box in self.local for part in [piece.part(box)] if part is not None}
        if not parts:
            return None
        transform = piece.transform
        staged = Staging(source, piece.stored, [transform.stored_box(own) for _, own in parts.values()])
        needed = sum(box_size(inside) for inside, _ in parts.values()) * source.dtype.bits // 8

        def finish(buffers: list[np.ndarray]) -> Any:
            views = staged.views(buffers, cast.check)
            for box in parts:  # allocated here, in turn; filled below, in parallel
                self._buffer(box)

            def fill(part: tuple[Box, tuple[Box, Box]]) -> None:
                box, (inside, own) = part
                stored = transform.stored_box(own)
                into = self.buffers[box][relative_slices(inside, box)].view()
                into.shape = box_shape(own)  # drops the stacked axes; never a copy (raises instead)
                transform.to_tree(views(stored), stored, own, out=into)

            host_map(fill, list(parts.items()))
            self._remaining -= 1  # finishes run on the one transfer thread, in turn
            if self._remaining == 0:
                self.value = self._result()
                return self.value
            return None

        return Job(planned_reads(source, staged.boxes, needed, policy), finish, scratch=True)

    def _buffer(self, box: Box) -> np.ndarray:
        if box not in self.buffers:
            self.buffers[box] = host_array(box_shape(box), self.dtype)
        return self.buffers[box]

    def _result(self) -> Any:
        buffers, self.buffers = self.buffers, {}
        if self.sharding is None:
            box = full_box(self.assembly.shape)
            return buffers[box] if box in buffers else np.zeros(self.assembly.shape, self.dtype)
        return device_array(self.assembly.shape, self.sharding, Cast(self.dtype), self.local,
                            lambda box: buffers[box] if box in buffers else np.zeros(box_shape(box), self.dtype))
