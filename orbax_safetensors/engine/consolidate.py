"""``consolidate``: a distributed checkpoint (ours or torch DCP's) → the HF layout.

The output is planned like any HF save (``max_shard_size`` packing, headers,
offsets). Each output file is written front to back, tensor by tensor, and
each tensor in row blocks of at most ``block_bytes`` assembled from the
slices they intersect, so memory stays at a few blocks whatever the model
size. Under ``jax.distributed`` the output files are shared out round-robin
and written by all processes in parallel; process 0 commits the index last.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine.checkpoint_reader import TensorSource, open_checkpoint
from orbax_safetensors.engine.coordination import next_operation_key
from orbax_safetensors.engine.progress import Progress
from orbax_safetensors.engine.save import SaveJob, SaveStats, take_location
from orbax_safetensors.engine.shard_reader import execute_read, piece_runs
from orbax_safetensors.format import TensorInfo
from orbax_safetensors.index import parse_size
from orbax_safetensors.planning import (
    Box,
    FilePlan,
    TensorSpec,
    box_shape,
    box_size,
    coalesce,
    full_box,
    intersect,
    plan_hf_checkpoint,
    relative_slices,
    row_blocks,
)
from orbax_safetensors.storage import Storage, storage_for

_PREFETCH = 4  # blocks read ahead of the writer


def consolidate(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    block_bytes: int | str = "64MB",
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> SaveStats:
    """Rewrites the checkpoint at ``src`` (any layout we read) as an HF checkpoint at ``dst``.

    Args:
      src: a distributed checkpoint (ours, or torch DCP ``save_sharded``
        output), or any other checkpoint ``ost.load`` reads.
      dst: the HF checkpoint directory to write.
      max_shard_size: bytes per output file.
      metadata: extra str→str for every output file's ``__metadata__`` (the
        source's own metadata is kept, minus torch DCP's sharding info).
      overwrite: replace a checkpoint already at ``dst``.
      block_bytes: the most bytes of one tensor held at once (times a few
        blocks read ahead); memory stays bounded by it, not by tensor size.
      progress: a progress line on stderr; ``None`` shows it on a terminal.
      storage_options / filesystem: for both ``src`` and ``dst``, as in ``ost.load``.
    """
    started = time.perf_counter()
    with open_checkpoint(src, storage_options, filesystem) as checkpoint:
        names = sorted(checkpoint.tensors)
        specs = [TensorSpec(n, checkpoint.tensors[n].dtype, checkpoint.tensors[n].shape) for n in names]
        return write_hf_streaming(
        dst, specs,
            lambda info, block: read_tensor_block(checkpoint.storage, checkpoint.tensors[info.name], info, block),
            label=f"consolidate {os.fspath(src)} -> {os.fspath(dst)}", started=started,
            max_shard_size=max_shard_size, metadata={**checkpoint.metadata, **(metadata or {})},
            overwrite=overwrite, block_bytes=block_bytes, progress=progress,
            storage_options=storage_options, filesystem=filesystem)


def write_hf_streaming(
    dst: str | os.PathLike,
    specs: Sequence[TensorSpec],
    read_block: Callable[[TensorInfo, Box | None], memoryview],
    *,
    label: str,
    started: float | None = None,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    block_bytes: int | str = "64MB",
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
) -> SaveStats:
    """Writes an HF checkpoint at ``dst`` whose tensor bytes come from ``read_block``.

    The writing half of ``consolidate``, shared with the other converters
    (``ost.convert`` reads Orbax checkpoints through it): any source that can
    hand over one row block of a tensor at a time (``read_block(info, box)``
    returns its raw little-endian bytes; ``box`` is ``None`` for a packed
    tensor, wanted whole) gets the same planning, bounded memory, progress
    line and commit.
    """
    started = time.perf_counter() if started is None else started
    plan = plan_hf_checkpoint(list(specs), max_shard_size=max_shard_size, metadata=dict(metadata or {}))
    storage, directory = storage_for(dst, storage_options, filesystem)
    key = next_operation_key("consolidate")
    commit = take_location(storage, directory, key, single_file=None, overwrite=overwrite,
                           url=os.fspath(dst))
    stats = SaveStats()
    job = SaveJob(commit, plan, [], key, stats, started)
    mine = [f for i, f in enumerate(plan.files) if i % jax.process_count() == jax.process_index()]
    report = Progress(label, sum(t.nbytes for f in mine for t in f.tensors),
                      enabled=progress).start()
    blocks = parse_size(block_bytes)
    try:
        with concurrent.futures.ThreadPoolExecutor(_PREFETCH) as pool:
            job.stream_files(mine, lambda file: _file_chunks(read_block, file, blocks, pool, report))
    finally:
        commit.release()
    report.close()
    stats.bytes_written, stats.files = report.done, len(mine)
    stats.seconds = time.perf_counter() - started
    return stats


def _file_chunks(
    read_block: Callable[[TensorInfo, Box | None], memoryview], file: FilePlan, block_bytes: int,
    pool: concurrent.futures.Executor, report: Progress,
) -> Iterator[memoryview | bytes]:
    """The output file's bytes in order, blocks read a few ahead of the writer."""
    yield file.header
    pending: list[concurrent.futures.Future] = []
    for info in file.tensors:
        for block in _tensor_blocks(info, block_bytes):
            pending.append(pool.submit(read_block, info, block))
            if len(pending) > _PREFETCH:
                yield _reported(pending.pop(0).result(), report)
    for future in pending:
        yield _reported(future.result(), report)


def _reported(chunk: memoryview, report: Progress) -> memoryview:
    report.advance(len(chunk))
    return chunk


def _tensor_blocks(info: TensorInfo, block_bytes: int) -> list:
    if info.dtype.is_packed:
        return [None]  # packed values are not cut: the tensor is one block
    return row_blocks(full_box(info.shape), info.dtype.bits // 8, block_bytes)


def read_tensor_block(storage: Storage, source: TensorSource, info: TensorInfo, block) -> memoryview:
    """One row block of the tensor, assembled from every slice it intersects."""
    if block is None:
        piece = source.whole
        if piece is None:
            raise ValueError(f"tensor {info.name!r}: {info.dtype.code} slices cannot be joined")
        out = np.empty(piece.info.nbytes, np.uint8)
        storage.read_scatter(piece.file, piece.offset, [memoryview(out)])
        return memoryview(out)
    itemsize = info.dtype.bits // 8
    out = np.empty(box_shape(block) + (itemsize,), np.uint8)
    for piece in source.pieces:
        part = intersect(block, piece.box)
        if part is None:
            continue
        temp = np.empty(box_size(part) * itemsize, np.uint8)
        for op in coalesce(piece_runs(piece, part, itemsize, 0), max_gap=0, max_overread=1.0,
                           chunk_bytes=1 << 62):
            execute_read(storage, piece.file, op, [temp])
        out[relative_slices(part, block)] = temp.reshape(box_shape(part) + (itemsize,))
    return memoryview(out.reshape(-1))
