"""Index domains ("boxes") of C-order tensors and the bytes they occupy.

A box is a tuple of half-open ``(start, stop)`` bounds, one per dimension: the
slice of a tensor one device holds. In a row-major file a box is contiguous
only along its trailing full dimensions, so it occupies equally long, equally
spaced runs: one run when it splits only the leading dimension (FSDP), one per
row when it splits the last one (tensor parallel). Offsets are computed with
numpy so a box of a million runs costs one vectorised expression, not a
Python loop.

A mapped tensor (``planning.transforms``) is reshaped as well as sliced: its
box in one shape is a box in the other only where it is contiguous in C order,
so the last helpers here cover or cut a box into contiguous ones and turn a
flat index range back into boxes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from orbax_safetensors.errors import ArgumentError

Box = tuple[tuple[int, int], ...]


def normalize_index(index: Sequence[slice | int], shape: Sequence[int]) -> Box:
    """A ``devices_indices_map`` index (slices) as explicit bounds."""
    bounds = []
    for item, size in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step != 1:
                raise ArgumentError(f"strided shard index {item} is not a box")
        else:
            start, stop = int(item), int(item) + 1
        bounds.append((start, max(start, stop)))
    return tuple(bounds)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple([stop - start for start, stop in box])


def box_size(box: Box) -> int:
    return math.prod([stop - start for start, stop in box])


def full_box(shape: Sequence[int]) -> Box:
    return _full_box(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _full_box(shape: tuple[int, ...]) -> Box:
    """One box per shape, made once: a checkpoint of 100 000 tensors has a few shapes, and
    boxes compared with the box of their own shape then compare by identity."""
    return tuple((0, int(size)) for size in shape)


def bounding_box(boxes: Sequence[Box]) -> Box:
    return tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that cut ``inner`` out of an array holding ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def row_runs(boxes: Sequence[Box], itemsize: int, least: int, align: int) -> dict[Box, tuple[Box, ...]]:
    """``boxes`` (distinct) merged into *runs*: boxes that follow each other along the first
    axis, with the same bounds on every other, joined in order until a run holds ``least``
    bytes. A run is one C-order array whose boxes are consecutive row slices of it, so a
    caller fills a run's boxes in one pass rather than one per box (a load of small shards
    spent more on the calls per box than on their values). A box joins a run only where it
    starts ``align`` bytes apart from the run's start (a multiple of it), so each is as
    aligned as the run is. Each run (its bounding box) → its boxes; a box alone is its own."""
    runs: dict[Box, tuple[Box, ...]] = {}
    members: list[Box] = []

    def close() -> None:
        if members:
            runs[bounding_box(members) if len(members) > 1 else members[0]] = tuple(members)
            members.clear()

    for box in sorted(boxes):
        if members:
            last, first = members[-1], members[0]
            offset = (box[0][0] - first[0][0]) * math.prod(box_shape(box[1:])) * itemsize
            if (box[1:] != last[1:] or box[0][0] != last[0][1] or offset % align
                    or sum(map(box_size, members)) * itemsize >= least):
                close()
        members.append(box)
    close()
    return runs


def row_slabs(box: Box, itemsize: int, least: int, most: int) -> list[Box]:
    """``box`` cut along its first axis into at most ``most`` slabs of at least ``least``
    bytes each (itself where it has no axis or is too small for two): the pieces one box's
    work is shared out in."""
    if not box:
        return [box]
    start, rows = box[0][0], box[0][1] - box[0][0]
    count = min(most, rows, box_size(box) * itemsize // max(least, 1))
    if count < 2:
        return [box]
    bounds = [start + rows * k // count for k in range(count + 1)]
    return [((a, b),) + box[1:] for a, b in zip(bounds, bounds[1:])]


def intersect(a: Box, b: Box) -> Box | None:
    bounds = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return bounds if all(start < stop for start, stop in bounds) else None


def is_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` occupies at most one run of a C-order tensor of ``shape``: every
    dimension after its innermost partial one is whole, every one before it a single index
    (``byte_runs`` without building the offsets)."""
    if box_size(box) == 0:
        return True
    split = len(shape) - 1
    while split >= 0 and box[split] == (0, shape[split]):
        split -= 1
    return all(stop - start == 1 for start, stop in box[:max(split, 0)])


def tiles(boxes: Sequence[Box], outer: Box) -> bool:
    """Whether the distinct ``boxes`` cover ``outer`` exactly once.

    The bounds of all boxes cut ``outer`` into a grid of cells; boxes whose sizes
    add up to ``outer``'s tile it when every cell is covered exactly once. The
    boxes of a sharding are cells of that grid themselves, so thousands of them
    cost a few vectorised passes, not a comparison of every pair. A grid too fine
    to count (boxes staggered arbitrarily) counts as not tiling: the caller then
    reads box by box, which is always correct.
    """
    if sum(box_size(b) for b in boxes) != box_size(outer):
        return False
    if not outer:  # a scalar: one box is all of it
        return len(boxes) == 1
    bounds = np.array(boxes, np.int64).reshape(len(boxes), len(outer), 2)
    cuts = [np.unique(bounds[:, d]) for d in range(len(outer))]
    first = np.stack([np.searchsorted(c, bounds[:, d, 0]) for d, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, bounds[:, d, 1]) for d, c in enumerate(cuts)], axis=1)
    grid = tuple(len(c) - 1 for c in cuts)
    cells = np.prod(last - first, axis=1)
    if int(cells.sum()) != math.prod(grid) or math.prod(grid) > _MAX_GRID_CELLS:
        return False
    covered = np.zeros(grid, np.int64)
    single = cells == 1
    np.add.at(covered.reshape(-1), np.ravel_multi_index(tuple(first[single].T), grid), 1)
    for lo, hi in zip(first[~single & (cells > 0)].tolist(), last[~single & (cells > 0)].tolist()):
        covered[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
    return bool((covered == 1).all())


_MAX_GRID_CELLS = 1 << 22  # beyond this, ``tiles`` does not look


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


def flat_range(box: Box, shape: Sequence[int]) -> tuple[int, int]:
    """``[first, last + 1)`` flat C-order indices of a box's corners in ``shape``."""
    first = int(np.ravel_multi_index([a for a, _ in box], shape)) if shape else 0
    last = int(np.ravel_multi_index([b - 1 for _, b in box], shape)) if shape else 0
    return first, last + 1


def contiguous_cover(box: Box, shape: Sequence[int]) -> Box:
    """The smallest box containing ``box`` that is contiguous in C order: after the first
    axis taken by more than one index, every axis whole."""
    lead = next((d for d, (a, b) in enumerate(box) if b - a > 1), len(box) - 1)
    return tuple(box[:lead + 1]) + tuple((0, s) for s in shape[lead + 1:])


def contiguous_parts(box: Box, shape: Sequence[int]) -> list[Box]:
    """``box`` cut into boxes contiguous in C order: the axes before its last partial
    axis are taken one index at a time; one box when it is contiguous already."""
    partial = [d for d, ((a, b), s) in enumerate(zip(box, shape)) if (a, b) != (0, s)]
    if not partial:
        return [box]
    last = partial[-1]
    if all(b - a == 1 for a, b in box[:last]):
        return [box]
    heads = itertools.product(*(range(a, b) for a, b in box[:last]))
    return [tuple((i, i + 1) for i in head) + tuple(box[last:]) for head in heads]


def range_cover(f0: int, f1: int, shape: Sequence[int]) -> Box:
    """The smallest contiguous box of ``shape`` holding flat indices ``[f0, f1)``."""
    first = np.unravel_index(f0, shape) if shape else ()
    last = np.unravel_index(f1 - 1, shape) if shape else ()
    box = []
    for d, (a, b) in enumerate(zip(first, last)):
        if a == b:
            box.append((int(a), int(a) + 1))
            continue
        return tuple(box) + ((int(a), int(b) + 1),) + tuple((0, s) for s in shape[d + 1:])
    return tuple(box)


def range_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[Box]:
    """Flat indices ``[lo, hi)`` of ``shape`` as the fewest boxes contiguous in C order, in order."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = math.prod(shape[1:])
    a, ra = divmod(lo, inner)
    b, rb = divmod(hi, inner)
    if a == b:
        return [((a, a + 1),) + box for box in range_boxes(ra, rb, shape[1:])]
    boxes = []
    if ra:
        boxes += [((a, a + 1),) + box for box in range_boxes(ra, inner, shape[1:])]
        a += 1
    if b > a:
        boxes.append(((a, b),) + tuple((0, s) for s in shape[1:]))
    if rb:
        boxes += [((b, b + 1),) + box for box in range_boxes(0, rb, shape[1:])]
    return boxes
