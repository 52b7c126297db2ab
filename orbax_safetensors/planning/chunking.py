"""The storage chunks of an array a streamed conversion writes: ``chunk_shape``, ``chunk_boxes``.

A chunk is what a reader of the output decodes at once (TensorStore decodes
whole chunks) and what a conversion reads, transforms and writes at once, so
its size bounds the conversion's memory and its shape decides who reads what:

1. a stacked axis (a scanned model's layers, an MoE block's experts) takes one
   index per chunk: the chunk then comes from one stored tensor (one layer's,
   one expert's), and a conversion back to per-layer tensors decodes each
   chunk for one layer only;
2. the other axes are halved (rounding up) until the chunk holds at most
   ``chunk_bytes``. Halving keeps chunk edges on the edges of power-of-two
   shards, so a restore sharded over a mesh reads whole chunks of its own and
   nothing of its neighbours'. As *tiles* (the longest axis halved first)
   every axis is cut so: MaxText shards the embedding axis (``fsdp``) of
   some kernels at axis 0 and of others at the last axis, heads, MLP and
   vocabulary on ``tensor``, and reads its shards of a converted checkpoint
   without decoding its neighbours'. As *rows* (the first axis halved first)
   a chunk spans whole rows, which is what a reader of row blocks wants
   (``convert``'s way back to safetensors, without a mapping: a band of rows
   is one chunk, not a row of tiles as wide as the array).

Pure: no devices, no files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from orbax_safetensors.planning.boxes import Box


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int,
                stacked: Sequence[int] = (), *, tiles: bool = True) -> tuple[int, ...]:
    """The chunk of an array of ``shape``: one index of each ``stacked`` axis, the other axes
    halved (rounding up) until it holds at most ``chunk_bytes`` (a single element always
    fits): the longest first (``tiles``), or the first first (rows)."""
    chunk = [1 if axis in stacked else max(size, 1) for axis, size in enumerate(shape)]
    while math.prod(chunk) * itemsize > chunk_bytes:
        cut = (max(range(len(chunk)), key=lambda axis: chunk[axis]) if tiles
               else next((axis for axis, size in enumerate(chunk) if size > 1), 0))
        if chunk[cut] == 1:
            break
        chunk[cut] = -(-chunk[cut] // 2)
    return tuple(chunk)


def chunk_boxes(shape: Sequence[int], chunk: Sequence[int]) -> list[Box]:
    """The chunks of ``shape`` in C order (the last ones cut at the array's edge)."""
    starts = [range(0, size, step) for size, step in zip(shape, chunk)]
    return [tuple((a, min(a + step, size)) for a, step, size in zip(corner, chunk, shape))
            for corner in itertools.product(*starts)]
