"""``consolidate``: any checkpoint we read (a distributed one, ours or torch DCP's) → the HF layout.

The writer here reads from a *block source*: anything that hands over one
row block of one tensor at a time (``BlockSource``). A safetensors checkpoint
is one (``CheckpointBlocks``); an Orbax checkpoint read through TensorStore is
another (``ost.convert``). The output is planned like any HF save
(``max_shard_size`` packing, headers, offsets). Each output file is written
front to back, tensor by tensor, each tensor in row blocks of at most
``block_bytes`` read a few ahead of the writer, so memory stays at a few
blocks whatever the model size. Under ``jax.distributed`` the output files
are shared out round-robin and written by all processes in parallel; process
0 commits the index last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, Unpack

import fsspec
import jax
import numpy as np

from orbax_safetensors.engine.core import catalog
from orbax_safetensors.engine.saving import strategies
from orbax_safetensors.engine.core.coordination import Peers, describe_arguments, describe_spec
from orbax_safetensors.engine.core.integrity import Verifier
from orbax_safetensors.engine.core.operation import Operation
from orbax_safetensors.engine.core.progress import Progress
from orbax_safetensors.engine.loading.execution import transfer
from orbax_safetensors.engine.saving.session import SaveStats, WriteSession, take_location
from orbax_safetensors.engine.core.options import with_shorthand
from orbax_safetensors.engine.saving.options import ConsolidateKeywords, ConsolidateOptions, check_metadata
from orbax_safetensors.errors import SafetensorsError
from orbax_safetensors.format import TensorInfo
from orbax_safetensors.planning import (
    Box,
    FilePlan,
    TensorSpec,
    Transfers,
    WritePlan,
    box_shape,
    full_box,
    plan_block,
    plan_hf_checkpoint,
    row_blocks,
)
from orbax_safetensors.storage import Location
from orbax_safetensors.storage.executor import Executor

_PREFETCH = 4  # blocks read ahead of the writer


class BlockSource(Protocol):
    """Tensors handed over one row block at a time.

    ``specs`` name the tensors (dtype, shape); ``metadata`` is carried into the
    output's ``__metadata__``; ``read_block(info, box)`` returns the raw
    little-endian bytes of ``box`` of tensor ``info.name`` (``box`` is
    ``None`` for a packed, sub-byte tensor, wanted whole). It is called from a
    few threads at once.
    """

    specs: list[TensorSpec]
    metadata: dict[str, str]

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview: ...


class CheckpointBlocks:
    """A safetensors checkpoint (any kind we read) as a block source.

    The source's block checksums are checked as its bytes are read (a damaged
    tensor raises ``ChecksumError`` rather than being copied into the output).
    A row block's edges cut checksum blocks, which the next row blocks complete:
    every byte of every tensor is read once, so each block is checked once.
    """

    def __init__(self, checkpoint: catalog.Checkpoint):
        self.checkpoint = checkpoint
        self.specs = [TensorSpec(n, t.dtype, t.shape) for n, t in sorted(checkpoint.tensors.items())]
        self.metadata = checkpoint.metadata
        self.verifier = Verifier(checkpoint.checksums)

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview:
        """One row block of the tensor, assembled from every slice it intersects."""
        source = self.checkpoint.tensors[info.name]
        storage = self.checkpoint.storage
        if block is None:
            stored = source.whole
            if stored is None:
                raise SafetensorsError(f"{info.dtype.code} slices cannot be joined", tensor=info.name)
            out = np.empty(stored.info.nbytes, np.uint8)
            for request in Transfers.single(stored.offset, 0, stored.info.nbytes):
                transfer(storage, stored.file, request, [out], self.verifier)
            return memoryview(out)
        itemsize = info.dtype.bits // 8
        out = np.empty(box_shape(block) + (itemsize,), np.uint8)
        for part in plan_block(source, block, self.verifier.grids):
            temp = np.empty(part.shape + (itemsize,), np.uint8)
            for request in part.transfers:
                transfer(storage, part.file, request, [temp.reshape(-1)], self.verifier)
            out[part.into] = temp
        return memoryview(out.reshape(-1))


def consolidate(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    options: ConsolidateOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: fsspec.AbstractFileSystem | None = None,
    **shorthand: Unpack[ConsolidateKeywords],
) -> SaveStats:
    """Rewrites the checkpoint at ``src`` (any kind we read) as an HF checkpoint at ``dst``.

    Args:
      src: a distributed checkpoint (ours, or torch DCP ``save_sharded``
        output), or any other checkpoint ``ost.load`` reads.
      dst: the HF checkpoint directory to write.
      options: an ``ost.ConsolidateOptions``: file size, metadata, overwrite, the
        block size that bounds memory, checksums, a progress line.
      storage_options / filesystem: for both ``src`` and ``dst``, as in ``ost.load``.
      **shorthand: any field of ``ConsolidateOptions`` as a keyword
        (``max_shard_size="2GB"``), replacing that field of ``options``.
    """
    started = time.perf_counter()
    options = with_shorthand(ConsolidateOptions, options, shorthand)
    with catalog.open_checkpoint(Location.resolve(src, storage_options, filesystem)) as checkpoint:
        return write_blocks(
            Location.resolve(dst, storage_options, filesystem), CheckpointBlocks(checkpoint), options,
            label=f"consolidate {os.fspath(src)} -> {os.fspath(dst)}", started=started)


def write_blocks(location: Location, source: BlockSource, options: ConsolidateOptions, *,
                 label: str, started: float | None = None,
                 beside: Sequence[tuple[str, bytes]] = ()) -> SaveStats:
    """Writes an HF checkpoint at ``location`` whose tensor bytes come from ``source``.

    The same planning, bounded memory, progress line, lock and commit as any
    save (a ``WriteSession``); metadata is the source's, overridden by
    ``options.metadata``. Every process writes its share of the files.
    ``beside``: small files committed with the tensors (``convert``'s config.json).
    """
    started = time.perf_counter() if started is None else started
    metadata = {**source.metadata, **(options.metadata or {})}
    check_metadata(metadata, checksums=options.checksums)
    plan = plan_hf_checkpoint(source.specs, max_shard_size=options.max_shard_size,
                              metadata=metadata, checksums=options.checksums)
    peers = Peers.collective("consolidate", location.url)
    # Processes that planned from different arguments or sources would write each other's
    # files with different contents: none starts. (``block_bytes`` only sizes each one's reads.)
    peers.check_same("plan", describe_arguments(options, leave_out=("progress", "block_bytes"))
                     + [f"tensor {describe_spec(spec)}" for spec in source.specs]
                     + [f"metadata of the source={dict(sorted(source.metadata.items()))!r}"]
                     + [f"{name}={content!r}" for name, content in beside],
                     "arguments or sources")
    commit = take_location(location, peers, overwrite=options.overwrite, beside=[n for n, _ in beside])
    mine = plan.files[jax.process_index()::jax.process_count()]  # shared out round-robin
    report = Progress(label, sum(t.nbytes for f in mine for t in f.tensors),
                      enabled=options.progress).start()
    with Executor(_PREFETCH, name="orbax_safetensors-prefetch") as pool:
        blocks = _Blocks(source, plan, mine, options.block_bytes, pool)
        return WriteSession(Operation(peers, report), commit, blocks, SaveStats(), started,
                            tuple(beside)).run()


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """A block source's write (a session's planner): this process's ``files`` of ``plan``
    streamed front to back, read ``block_bytes`` at a time a few blocks ahead on ``pool``;
    process 0 commits every process's files with the index."""

    source: BlockSource
    plan: WritePlan
    files: list[FilePlan]
    block_bytes: int
    pool: Executor

    def strategy(self) -> strategies.Strategy:
        return strategies.Streamed(self.files, self._chunks, self._index)

    def _chunks(self, file: FilePlan) -> Iterator[memoryview | bytes]:
        """The output file's data in order, blocks read a few ahead of the writer."""
        pending = []
        for info in file.tensors:
            blocks = [None] if info.dtype.is_packed else row_blocks(  # packed values are not cut
                full_box(info.shape), info.dtype.bits // 8, self.block_bytes)
            for block in blocks:
                pending.append(self.pool.submit(self.source.read_block, info, block))
                if len(pending) > _PREFETCH:
                    yield pending.pop(0).result()
        for future in pending:
            yield future.result()

    def _index(self, op: Operation, file_crcs: dict[str, int]) -> tuple[list[str], tuple[str, bytes]]:
        """Every file, and the index with every process's files' whole crc32c."""
        every = {name: crc for raw in op.exchange("crc32c", json.dumps(file_crcs))
                 for name, crc in json.loads(raw).items()}
        return [f.name for f in self.plan.files], self.plan.index(every)
