"""A tree leaf made of several stored tensors (``planning.assembly.Assembly``: layers stacked,
projections concatenated), read as one job per stored tensor and put on its devices once whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors.engine.loading.casting import Cast, cast_rule, device_dtype
from orbax_safetensors.engine.loading.host_buffers import XLA_ALIGNMENT
from orbax_safetensors.engine.loading.device_assembly import device_array
from orbax_safetensors.engine.loading.host_work import HOST_THREADS, host_arrays, host_map
from orbax_safetensors.engine.loading.jobs import Job, Staging, local_boxes, planned_reads
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.planning import (
    Box,
    TensorSource,
    box_shape,
    box_size,
    full_box,
    relative_slices,
    row_runs,
    row_slabs,
    tiles,
)
from orbax_safetensors.planning.boxes import is_contiguous
from orbax_safetensors.planning.assembly import Assembly, Piece
from orbax_safetensors.planning.transforms import Transform, copy_into

RUN_BYTES = 4 << 20  # device boxes joined into one buffer up to this
SLAB_BYTES = 512 << 10  # a run's work is shared among the host threads in slabs of at least this


class AssembledLeaf:
    """A leaf assembled from its pieces' stored tensors; ``value`` once its last job finished.

    Each job reads only the stored boxes behind the parts of this process's
    device boxes its tensor holds (a device holding layers 0-7 never reads
    layer 8), transforms them and copies them into the leaf's host buffers,
    one per *run* of device boxes (``row_runs``: boxes that follow each other
    along the first axis, joined up to ``RUN_BYTES``, each box a slice of its
    run's buffer), filled in row slabs shared among the host threads. A leaf
    of small shards so costs a call per slab, not per shard (a load of 2 016
    INT4 experts of 8 shards each spent most of its time on the calls:
    docs/benchmarks.md). Where this process
    holds all of a leaf in shards contiguous in it, the buffers are one
    array of the leaf's shape, put on the devices by one ``device_put`` that
    cuts it (a third of the cost of a shard each). The job that completes
    the leaf puts it on the devices, so a leaf's host buffers live from its
    first piece to its last (on CPU they become the array itself: 64-byte
    aligned, adopted by XLA).

    A quantized piece (``Piece.quantized``) is a job per parameter (scales,
    zero points...), each read ``first`` (every such job finishes before any
    other: ``plan_reads``) and kept, and one of its values, dequantized box by
    box with them as they are finished. Each reads only the groups its boxes
    touch.
    """

    def __init__(self, name: str, tensors: Mapping[str, TensorSource], assembly: Assembly,
                 dtype: np.dtype, sharding: jax.sharding.Sharding | None, policy: ReadPolicy):
        self.name, self.assembly, self.sharding = name, assembly, sharding
        self.dtype = np.dtype(dtype) if sharding is None else device_dtype(dtype)
        sources = [_read_as(piece, tensors) for piece in assembly.pieces]
        casts = [cast_rule(piece.stored, source, piece.transform, self.dtype, policy.casting, leaf=name)
                 for piece, source in zip(assembly.pieces, sources)]
        # Every piece's refused cast (``refuse_casts``), whether or not this process reads it.
        self.refused = tuple(cast.refused for cast in casts if cast.refused is not None)
        shape = assembly.shape
        self.local = {full_box(shape): []} if sharding is None else local_boxes(name, shape, sharding)
        self.runs = row_runs(list(self.local), self.dtype.itemsize, RUN_BYTES, XLA_ALIGNMENT)
        self.slabs = {slab: run for run in self.runs
                      for slab in row_slabs(run, self.dtype.itemsize, SLAB_BYTES, HOST_THREADS)}
        self.buffers: dict[Box, np.ndarray] = {}  # by run, all made by the first job's ``prepare``
        self.whole: np.ndarray | None = None  # the leaf, where the runs are views of it
        self.value: Any = None
        self.jobs: list[Job] = []
        covered: set[Box] = set()
        for piece, source, cast in zip(assembly.pieces, sources, casts):
            parts = {slab: part for slab in self.slabs for part in [piece.part(slab)] if part is not None}
            covered.update(self.slabs[slab] for slab in parts)
            if parts and piece.quantized is not None:
                self.jobs += self._quantized_jobs(piece, parts, tensors, policy, cast)
            elif parts:
                self.jobs.append(self._job(piece, parts, source, policy, cast))
        self._uncovered = [run for run in self.runs if run not in covered]  # a constant's, or a gap's
        self._remaining = sum(not job.reads.first for job in self.jobs)
        if not self.jobs:  # this process holds none of it (or it is empty)
            self.value = self._result()

    def _job(self, piece: Piece, parts: dict[Box, tuple[Box, Box]], source: TensorSource, policy: ReadPolicy,
             cast: Cast) -> Job:
        """The job of one piece: the stored boxes behind its ``parts`` of this process's boxes;
        ``cast.check``: of the stored values read, before the transform casts them into the
        leaf's buffers."""
        if source.dtype.is_packed:
            raise SafetensorsError(f"a {source.dtype.code} tensor cannot be part of a stacked or "
                                   f"concatenated leaf ({self.name!r})", tensor=piece.stored)
        transform = piece.transform
        staged = Staging(source, piece.stored, [transform.stored_box(own) for _, own in parts.values()])
        needed = sum(box_size(inside) for inside, _ in parts.values()) * source.dtype.bits // 8

        def values(buffers: list[np.ndarray]) -> Callable[[Box, Box, np.ndarray], Any]:
            views = staged.views(buffers, cast.check)
            return lambda stored, own, into: transform.to_tree(views(stored), stored, own, out=into)

        return Job(planned_reads(source, staged.boxes, needed, policy), self._fill(transform, parts, values),
                   scratch=True, prepare=self._prepare)

    def _quantized_jobs(self, piece: Piece, parts: dict[Box, tuple[Box, Box]], tensors: Mapping[str, TensorSource],
                        policy: ReadPolicy, cast: Cast) -> list[Job]:
        """A quantized piece's jobs: one per parameter (scales, zero points...: ``first``,
        kept; a damaged one refused) and its values', dequantized under ``cast``'s check of
        the products."""
        quantized, transform = piece.quantized, piece.transform
        boxes = {twin: quantized.boxes(twin) for twin in dict.fromkeys(
            transform.stored_box(own) for _, own in parts.values())}
        sources = [tensors[name] for name in quantized.stored]
        staged = [Staging(source, name, [b[k] for b in boxes.values()])
                  for k, (source, name) in enumerate(zip(sources, quantized.stored))]
        file = sources[0].slices[0].file if sources[0].slices else None
        held: dict[Box, list[Any]] = {twin: [None] * (len(sources) - 1) for twin in boxes}

        def keep(k: int) -> Callable[[list[np.ndarray]], None]:
            def finish(buffers: list[np.ndarray]) -> None:
                views = staged[k].views(buffers)
                for twin, stored in boxes.items():
                    kept = np.array(views(stored[k]))
                    problem = quantized.problem(k - 1, kept)
                    if problem is not None:
                        raise SafetensorsError(problem, file=sources[k].slices[0].file if sources[k].slices else None,
                                               tensor=quantized.stored[k])
                    held[twin][k - 1] = kept
            return finish

        def values(buffers: list[np.ndarray]) -> Callable[[Box, Box, np.ndarray], Any]:
            views = staged[0].views(buffers)

            def write(twin: Box, own: Box, into: np.ndarray) -> None:
                """Dequantized straight into the leaf's buffer where the arrangement is the stored
                one, else rounded to its dtype first unless the transform computes with them
                (then its results are what the cast checks)."""
                if not transform.changes_values:
                    staged_box = into if transform.is_identity else np.empty(box_shape(twin), into.dtype)
                    quantized.dequantize(views(boxes[twin][0]), held[twin], twin, out=staged_box, check=cast.check,
                                         file=file)
                    if staged_box is not into:
                        transform.to_tree(staged_box, twin, own, out=into)
                    return
                products = quantized.dequantize(views(boxes[twin][0]), held[twin], twin,
                                                out=np.empty(box_shape(twin), np.float32), file=file)
                if cast.check is None:
                    transform.to_tree(products, twin, own, out=into)
                    return
                result = np.empty(into.shape, np.float32)
                transform.to_tree(products, twin, own, out=result)
                cast.check(result)
                copy_into(into, result)

            return write

        def reads(k: int) -> Any:
            needed = sum(box_size(b[k]) for b in boxes.values()) * sources[k].dtype.bits // 8
            return planned_reads(sources[k], staged[k].boxes, needed, policy)

        return [*(Job(dataclasses.replace(reads(k), first=True), keep(k), scratch=True)
                  for k in range(1, len(sources))),
                Job(reads(0), self._fill(transform, parts, values), scratch=True, prepare=self._prepare)]

    def _fill(self, transform: Transform, parts: dict[Box, tuple[Box, Box]],
              values: Callable[[list[np.ndarray]], Callable[[Box, Box, np.ndarray], Any]],
              ) -> Callable[[list[np.ndarray]], Any]:
        """A finish that fills the piece's ``parts`` of the leaf's buffers: ``values`` of the
        read buffers writes the part of each stored box (``transform.stored_box`` of its tree
        box) into the view of the leaf's buffer it gets."""

        def finish(buffers: list[np.ndarray]) -> Any:
            write = values(buffers)

            def fill(part: tuple[Box, tuple[Box, Box]]) -> None:
                slab, (inside, own) = part
                run = self.slabs[slab]
                into = self.buffers[run][relative_slices(inside, run)].reshape(
                    box_shape(own), copy=False)  # drops the stacked axes; never a copy (raises instead)
                write(transform.stored_box(own), own, into)

            host_map(fill, list(parts.items()))
            self._remaining -= 1  # finishes run on the one transfer thread, in turn
            if self._remaining == 0:
                self.value = self._result()
                return self.value
            return None

        return finish

    def _prepare(self) -> None:
        """A job's ``prepare``: the leaf's buffers, made by the first (one allocation, faulted
        in before its reads are done, by the one thread that starts batches while the
        previous batch finishes on another); runs no piece fills hold the fill value."""
        if self.buffers:
            return
        shape = self.assembly.shape
        whole = full_box(shape)
        if (self.sharding is not None and self.sharding.is_fully_addressable
                and all(is_contiguous(run, shape) for run in self.runs) and tiles(list(self.runs), whole)):
            self.whole = host_arrays([shape], self.dtype)[0]
            self.buffers = {run: self.whole[relative_slices(run, whole)] for run in self.runs}
        else:
            self.buffers = dict(zip(self.runs, host_arrays([box_shape(run) for run in self.runs], self.dtype)))
        for run in self._uncovered:
            self.buffers[run][...] = self._fill_value

    def _result(self) -> Any:
        buffers, self.buffers = self.buffers, {}
        whole, self.whole = self.whole, None
        shape = self.assembly.shape
        if self.sharding is None:
            return buffers[full_box(shape)] if buffers else np.full(shape, self._fill_value, self.dtype)
        if whole is not None:
            return jax.device_put(whole, self.sharding)
        run_of = {box: run for run, boxes in self.runs.items() for box in boxes}

        def shard(box: Box) -> np.ndarray:
            if not buffers:  # no job: this process holds none of it
                return np.full(box_shape(box), self._fill_value, self.dtype)
            run = run_of[box]
            return buffers[run][relative_slices(box, run)]

        return device_array(shape, self.sharding, Cast(self.dtype), self.local, shard)

    @property
    def _fill_value(self) -> Any:
        """What no piece fills holds: a constant's value, else 0 (an empty leaf's)."""
        constant = self.assembly.constant
        return 0 if constant is None else constant.value


def _read_as(piece: Piece, tensors: Mapping[str, TensorSource]) -> TensorSource:
    """The tensor a piece's values are read as: its stored tensor, or a quantized one's
    float32 twin (in the values' file, for messages)."""
    if piece.quantized is None:
        return tensors[piece.stored]
    return TensorSource(piece.quantized.dtype, piece.quantized.shape, tensors[piece.quantized.weight].slices)


def leaf_dtype(assembly: Assembly, tensors: Mapping[str, TensorSource]) -> np.dtype:
    """The dtype of an assembled leaf no target names one for: its first piece's values (a
    constant's own)."""
    if assembly.constant is not None:
        return np.dtype(assembly.constant.dtype)
    piece = assembly.pieces[0]
    return piece.transform.tree_dtype(_read_as(piece, tensors).dtype.numpy)
