"""Index domains ("boxes") of C-order tensors and the bytes they occupy.

A box is a tuple of half-open ``(start, stop)`` bounds, one per dimension: the
slice of a tensor one device holds. In a row-major file a box is contiguous
only along its trailing full dimensions, so it occupies equally long, equally
spaced runs: one run when it splits only the leading dimension (FSDP), one per
row when it splits the last one (tensor parallel). Offsets are computed with
numpy so a box of a million runs costs one vectorised expression, not a
Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]


def normalize_index(index: Sequence[slice | int], shape: Sequence[int]) -> Box:
    """A ``devices_indices_map`` index (slices) as explicit bounds."""
    bounds = []
    for item, size in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step != 1:
                raise ValueError(f"strided shard index {item} is not a box")
        else:
            start, stop = int(item), int(item) + 1
        bounds.append((start, max(start, stop)))
    return tuple(bounds)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(size)) for size in shape)


def bounding_box(boxes: Sequence[Box]) -> Box:
    return tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that cut ``inner`` out of an array holding ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def intersect(a: Box, b: Box) -> Box | None:
    bounds = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return bounds if all(start < stop for start, stop in bounds) else None


def byte_runs(box: Box, shape: Sequence[int], itemsize: int) -> tuple[np.ndarray, int]:
    """Where ``box`` lives in a C-order tensor of ``shape``: ``(offsets, run_length)``.

    Offsets are relative to the tensor's first byte, ascending; every run is
    ``run_length`` bytes, and consecutive runs fill consecutive parts of a
    C-order buffer of the box's shape. An empty box has no runs.
    """
    if box_size(box) == 0:
        return np.zeros(0, np.int64), 0
    ndim = len(shape)
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(ndim)]
    # The innermost dimension that is not taken whole ends the contiguous part.
    split = ndim - 1
    while split >= 0 and box[split] == (0, shape[split]):
        split -= 1
    if split < 0:
        return np.zeros(1, np.int64), itemsize * math.prod(shape)
    run_length = (box[split][1] - box[split][0]) * strides[split]
    offsets = np.array([box[split][0] * strides[split]], np.int64)
    for d in range(split - 1, -1, -1):
        outer = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
        offsets = (outer[:, None] + offsets[None, :]).reshape(-1)
    return offsets, run_length
