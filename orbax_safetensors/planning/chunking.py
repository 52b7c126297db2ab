"""The storage chunks of an array a streamed conversion writes: ``chunk_shape``, ``chunk_boxes``.

A chunk is what a reader of the output decodes at once (TensorStore decodes
whole chunks) and what a conversion reads, transforms and writes at once, so
its size bounds the conversion's memory and its shape decides who reads what:

1. a stacked axis (a scanned model's layers, an MoE block's experts) takes one
   index per chunk: the chunk then comes from one stored tensor (one layer's,
   one expert's), and a conversion back to per-layer tensors decodes each
   chunk for one layer only;
2. the other axes are halved, first axis first, until the chunk holds at most
   ``chunk_bytes``. Halving keeps chunk edges on the edges of power-of-two
   shards of that axis, so a restore sharded over a mesh (MaxText's ``fsdp`` on
   the embedding axis, ``tensor`` on heads or the MLP) reads whole chunks of
   its own and nothing of its neighbours'.

Pure: no devices, no files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from orbax_safetensors.planning.boxes import Box


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int,
                stacked: Sequence[int] = ()) -> tuple[int, ...]:
    """The chunk of an array of ``shape``: one index of each ``stacked`` axis, the other axes
    halved in order (rounding up) until it holds at most ``chunk_bytes`` (a single element
    always fits)."""
    chunk = [1 if axis in stacked else max(size, 1) for axis, size in enumerate(shape)]
    for axis in range(len(chunk)):
        while chunk[axis] > 1 and math.prod(chunk) * itemsize > chunk_bytes:
            chunk[axis] = -(-chunk[axis] // 2)
    return tuple(chunk)


def chunk_boxes(shape: Sequence[int], chunk: Sequence[int]) -> list[Box]:
    """The chunks of ``shape`` in C order (the last ones cut at the array's edge)."""
    starts = [range(0, size, step) for size, step in zip(shape, chunk)]
    return [tuple((a, min(a + step, size)) for a, step, size in zip(corner, chunk, shape))
            for corner in itertools.product(*starts)]
