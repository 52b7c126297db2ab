"""Arrangement and value transforms of one stored tensor: ``Transform``, applied per box.

A stored tensor and the tree piece it becomes differ by an arrangement of its axes and
by values:

1. arrangement: ``np.transpose(stored, perm)``, then a reshape in ``groups`` that
   only ever splits one axis into adjacent ones or merges adjacent ones (a
   PyTorch ``(heads * head_dim, hidden)`` weight → a Flax ``(hidden, heads,
   head_dim)`` kernel), so each group's box math is independent of the others;
2. values: ``permutes`` reorder single axes (RoPE halves ↔ interleaved,
   ``PERMUTATIONS``), ``scale`` multiplies and then ``offset`` adds (both in
   float32, float64 for float64: Gemma's norms are stored as ``w`` and used
   as ``1 + w``), ``dtype`` is the dtype saved;
3. ``takes`` keep one index of an axis and drop it (then ``tree_perm`` orders the axes
   left, where the transpose before the reshape cannot: DeepSeek-V4's ``wo_a``
   ``[G * r, X]`` is MaxText's ``[G, X, r]``, its split axis's parts apart): gpt-oss stores gate and
   up interleaved in one ``gate_up_proj`` (``[..., 2 * F]``, gate at even
   columns), MaxText holds them as two leaves; split into ``(F, 2)``, ``wi_0``
   takes index 0 of the new axis and ``wi_1`` index 1. A save writes such a
   stored tensor from all the pieces that take a part of it: each piece's
   values go back to its index of the taken axis (``to_stored`` writes those
   stored boxes alone, ``tree_box`` says what of the piece a stored box needs).

Everything applies to a box, never to a whole tensor, so a sharded load still
reads only the bytes each device holds: ``stored_box`` turns the box a device
wants into the stored box holding it (a transpose permutes the box; a split
axis becomes the enclosing range of the merged stored axis, exact when the
inner axes are whole; a permuted axis the range its indices span, exact when
the axis is whole; a taken axis its one index, so a box of ``wi_0``'s columns
``[a, b)`` reads the interleaved columns ``[2a, 2b)``, gate and up together as
they are stored), ``to_tree`` the bytes read into the box's values. On save
``to_stored`` turns a shard into stored boxes and their bytes, cutting it
where it is not one stored box (the C-order box helpers are in
``planning.boxes``). A save applies the inverse value transforms, ``(x -
offset) * (1 / scale)`` in the same precision. What comes back bit for bit:

* a scale by a power of two is exact; by another factor it can move a float32
  value by one unit in the last place, while a bfloat16 or float16 checkpoint
  still round-trips bit for bit (the float32 error is far below their ulp);
* an offset gives back a stored ``w`` whenever ``w + offset`` is exact in the
  tree's precision (``(w + offset) - offset`` then is ``w``), and where
  ``offset`` is below half a unit of ``w``'s last place (both roundings land on
  ``w``): for ``offset=1`` in float32, every bfloat16 ``w`` with ``|w| >=
  2**-16``, every float16 one with ``|w| >= 2**-13``, a float32 one only where
  ``w + 1`` is exact (a bfloat16 value of at least ``2**-16``, for one). A
  smaller nonzero ``w`` loses its bits below ``2**-24`` (``2**-23`` when
  positive), ``-0.0`` comes back as ``+0.0``, a NaN as a NaN.

The arrangement is a view of the bytes read; ``copy_into`` is the one copy a load
pays, done in cache-sized tiles where it transposes. Which transform a tensor
gets is the rules' business (``planning.rules``).

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning.boxes import (
    Box,
    box_shape,
    box_size,
    contiguous_cover,
    contiguous_parts,
    flat_range,
    range_boxes,
    range_cover,
    relative_slices,
)

Permutation = str | Callable[[int], Sequence[int]]


def halves_to_interleaved(n: int) -> tuple[int, ...]:
    """RoPE's two orders of a head's features: ``[x0..x_{n/2-1}, y0..y_{n/2-1}]`` (Hugging Face) →
    ``[x0, y0, x1, y1, ...]`` (MaxText): tree index ``2m`` holds ``m``, ``2m+1`` holds ``n/2+m``."""
    if n % 2:
        raise MappingError(f"halves_to_interleaved: an axis of odd size {n}")
    return tuple(int(k) for k in np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], -1).reshape(-1))


def interleaved_to_halves(n: int) -> tuple[int, ...]:
    return tuple(int(k) for k in np.argsort(halves_to_interleaved(n)))


PERMUTATIONS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "halves_to_interleaved": halves_to_interleaved, "interleaved_to_halves": interleaved_to_halves}


def transposed_axes(axes: tuple, perm: Sequence[int]) -> tuple:
    """Per-axis items (sizes, bounds) of an array in the order ``np.transpose(a, perm)`` gives
    its axes (empty ``perm``: as they are)."""
    return tuple(axes[p] for p in perm) if perm else tuple(axes)


def untransposed_axes(axes: tuple, perm: Sequence[int]) -> tuple:
    """The inverse of ``transposed_axes``: per-axis items of ``np.transpose(a, perm)`` in ``a``'s order."""
    if not perm:
        return tuple(axes)
    out: list = [None] * len(axes)
    for item, p in zip(axes, perm):
        out[p] = item
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Transform:
    """Stored tensor → tree piece: its arrangement (``np.transpose(stored, perm)``, a grouped
    reshape), then the value transforms (``permutes`` of single axes, ``scale``, then
    ``offset``); ``dtype``: saved as; ``takes``: ``(axis, index)`` pairs, ascending, of the
    reshaped piece's axes that the tree piece holds one index of, and lacks (the other
    indices are other pieces'); ``tree_perm``: then ``np.transpose(piece, tree_perm)`` (empty:
    as they are). Every method takes and gives boxes of the tree piece: ``tree_perm`` is
    undone on the way in and applied on the way out, the rest works on the piece before it.

    ``groups`` cover the transposed axes and the tree axes in order: each is
    ``(transposed sizes, tree sizes)`` with equal products, so the reshape only
    ever splits or merges adjacent axes and each group's box math is
    independent of the others.
    """

    perm: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    permutes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    scale: float | None = None
    offset: float | None = None
    dtype: np.dtype | None = None
    takes: tuple[tuple[int, int], ...] = ()
    tree_perm: tuple[int, ...] = ()

    @property
    def tree_shape(self) -> tuple[int, ...]:
        taken = dict(self.takes)
        return transposed_axes(tuple(s for axis, s in enumerate(self._reshaped_shape) if axis not in taken), self.tree_perm)


    @property
    def _reshaped_shape(self) -> tuple[int, ...]:
        """The piece after the reshape, before ``takes`` drop their axes."""
        return tuple(s for _, tree in self.groups for s in tree)

    @property
    def transposed_shape(self) -> tuple[int, ...]:
        return tuple(s for src, _ in self.groups for s in src)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = [0] * len(self.perm)
        for axis, size in zip(self.perm, self.transposed_shape):
            shape[axis] = size
        return tuple(shape)

    @property
    def _same_arrangement(self) -> bool:
        """Whether the arrangement is the stored one (no transpose, no split or merge)."""
        return not self.takes and not self.tree_perm and self.perm == tuple(range(len(self.perm))) and all(
            len(src) == len(tree) == 1 for src, tree in self.groups)

    @property
    def is_identity(self) -> bool:
        """Whether the tree piece is the stored tensor, bytes and all (``dtype`` aside)."""
        return self._same_arrangement and not self.permutes and not self.changes_values

    @property
    def changes_values(self) -> bool:
        """Whether values are scaled or offset: computed in their own precision, so a
        producer must hand them over unrounded (a dequantized box in float32)."""
        return self.scale is not None or self.offset is not None

    def tree_dtype(self, stored: np.dtype) -> np.dtype:
        """The dtype of the tree values of a ``stored`` tensor: widened to float32 (float64
        for float64) where scaled or offset, so they are computed in that precision."""
        if not self.changes_values:
            return np.dtype(stored)
        return np.dtype(np.float64 if stored == np.float64 else np.float32)

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """The whole tree value of a whole stored value."""
        x = np.transpose(stored, self.perm).reshape(self._reshaped_shape)
        for axis, order in self.permutes:
            x = np.take(x, order, axis=axis)
        taken = dict(self.takes)
        x = self._scaled(x[tuple(taken.get(axis, slice(None)) for axis in range(x.ndim))])
        return np.transpose(x, self.tree_perm) if self.tree_perm else x

    def _scaled(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        """``x * scale + offset`` in the tree's precision (``inverse``: ``(x - offset) / scale``,
        as a product with ``1 / scale``)."""
        if not self.changes_values:
            return x
        wide = self.tree_dtype(x.dtype).type
        x = x.astype(wide)
        if inverse and self.offset is not None:
            x = x - wide(self.offset)
        if self.scale is not None:
            x = x * wide(1.0 / self.scale if inverse else self.scale)
        if not inverse and self.offset is not None:
            x = x + wide(self.offset)
        return x

    def _unpermuted(self, tree_box: Box) -> Box:
        """The box before the permutations: each permuted axis the range its indices span."""
        box = list(tree_box)
        for axis, order in self.permutes:
            a, b = box[axis]
            picked = order[a:b]
            box[axis] = (min(picked), max(picked) + 1)
        return tuple(box)

    def _spans(self) -> list[tuple[int, int, int, int]]:
        """Per group: (first transposed axis, count, first tree axis, count)."""
        spans, i, j = [], 0, 0
        for src, tree in self.groups:
            spans.append((i, len(src), j, len(tree)))
            i, j = i + len(src), j + len(tree)
        return spans

    def _unpermute(self, transposed_box: Box) -> Box:
        box: list[tuple[int, int]] = [(0, 0)] * len(self.perm)
        for axis, bounds in zip(self.perm, transposed_box):
            box[axis] = bounds
        return tuple(box)

    def stored_box(self, tree_box: Box) -> Box:
        """The smallest stored box whose values give ``tree_box`` (exact where possible)."""
        if box_size(tree_box) == 0:
            return tuple((0, 0) for _ in self.perm)
        return self._unpermute(tuple(self._regrouped(self._unpermuted(self._with_taken(tree_box)), to_tree=False)))

    def _with_taken(self, tree_box: Box) -> Box:
        """A tree box as a box of the reshaped piece: in its order before ``tree_perm``, each
        taken axis back, at its one index."""
        box = list(untransposed_axes(tuple(tree_box), self.tree_perm))
        for axis, index in self.takes:
            box.insert(axis, (index, index + 1))
        return tuple(box)

    def _regrouped(self, box: Box, *, to_tree: bool) -> list[tuple[int, int]]:
        """``box`` of the transposed axes as the smallest box of the tree axes holding it
        (``to_tree``), or the other way: per group, the enclosing range of a split or merged
        axis."""
        out: list[tuple[int, int]] = []
        for (src, tree), (i, m, j, k) in zip(self.groups, self._spans()):
            have, want, part = (src, tree, box[i:i + m]) if to_tree else (tree, src, box[j:j + k])
            if len(src) == len(tree) == 1:
                out.extend(part)
                continue
            f0, f1 = flat_range(contiguous_cover(part, have), have)
            out.extend(range_cover(f0, f1, want))
        return out

    def tree_box(self, stored_box: Box) -> Box | None:
        """The smallest tree box whose stored values (``to_stored``) cover this piece's part of
        ``stored_box``: what of the piece a streamed save must hold to write that box of the
        stored tensor (a split axis cut inside its inner sizes takes their enclosing range, a
        permuted axis the range of tree indices its stored indices go to). ``None``: the box
        holds none of a piece that takes (only other pieces' indices of the taken axis)."""
        if box_size(stored_box) == 0:
            return tuple((0, 0) for _ in self.tree_shape)
        tree = self._regrouped(tuple(stored_box[p] for p in self.perm), to_tree=True)
        for axis, order in self.permutes:
            a, b = tree[axis]
            held = [j for j, k in enumerate(order) if a <= k < b]
            tree[axis] = (min(held), max(held) + 1)
        taken = dict(self.takes)
        if any(not tree[axis][0] <= index < tree[axis][1] for axis, index in taken.items()):
            return None
        return transposed_axes(tuple(bounds for axis, bounds in enumerate(tree) if axis not in taken), self.tree_perm)

    def to_tree(self, data: np.ndarray, stored_box: Box, tree_box: Box,
                out: np.ndarray | None = None) -> np.ndarray:
        """The values of ``tree_box`` from ``data`` holding ``stored_box = self.stored_box(tree_box)``,
        written into ``out`` (cast to its dtype) when given: the arrangement is a view of ``data``
        and this is the one copy it costs."""
        if box_size(tree_box) == 0:
            x = self._scaled(np.zeros(box_shape(tree_box), data.dtype))
        else:
            box = self._with_taken(tree_box)
            reshaped = self._unpermuted(box)
            x = self._arrange_to_tree(data, stored_box, reshaped)
            for axis, order in self.permutes:
                a, b = box[axis]
                x = np.take(x, np.asarray(order[a:b]) - reshaped[axis][0], axis=axis)
            x = self._scaled(np.squeeze(x, tuple(axis for axis, _ in self.takes)) if self.takes else x)
            x = np.transpose(x, self.tree_perm) if self.tree_perm else x
        if out is None:
            return x
        copy_into(out, x)
        return out

    def _arrange_to_tree(self, data: np.ndarray, stored_box: Box, tree_box: Box) -> np.ndarray:
        x = np.transpose(data.reshape(box_shape(stored_box)), self.perm)
        transposed = tuple(stored_box[p] for p in self.perm)
        axis = 0
        for (src, tree), (i, m, j, k) in zip(self.groups, self._spans()):
            if len(src) == len(tree) == 1:
                axis += 1
                continue
            part = tree_box[j:j + k]
            cover = contiguous_cover(part, tree)
            f0, f1 = flat_range(cover, tree)
            g0, _ = flat_range(transposed[i:i + m], src)
            lead = (slice(None),) * axis
            x = x.reshape(x.shape[:axis] + (math.prod(x.shape[axis:axis + m]),) + x.shape[axis + m:])
            x = x[lead + (slice(f0 - g0, f1 - g0),)]
            x = x.reshape(x.shape[:axis] + box_shape(cover) + x.shape[axis + 1:])
            x = x[lead + relative_slices(part, cover)]
            axis += k
        return x

    def to_stored(self, tree_box: Box, data: np.ndarray) -> list[tuple[Box, np.ndarray]]:
        """A tree shard as stored boxes and their C-contiguous values (of ``dtype``, if set).

        One box where the shard is one stored box (always, unless a split axis
        is sharded inside its inner sizes, a merged axis across its rows, or a
        permuted axis into parts whose indices are not one range); otherwise
        the shard is cut into the fewest stored boxes it spans. A piece that takes writes its
        index of each taken axis alone (the other pieces of the stored tensor write theirs):
        the interleaved columns of gpt-oss's ``gate_up_proj`` one column box each.
        """
        data = np.asarray(data)
        if self.tree_perm:
            data = np.transpose(data.reshape(box_shape(tree_box)), np.argsort(self.tree_perm))
        tree_box = self._with_taken(tree_box)
        data = data.reshape(box_shape(tree_box))
        dtype = data.dtype if self.dtype is None else self.dtype
        stored = [item for box, values in self._unpermuted_parts(tree_box, self._scaled(data, inverse=True))
                  for item in self._arrange_to_stored(box, values)]
        return [(box, values if values.dtype == dtype else values.astype(dtype)) for box, values in stored]

    def _unpermuted_parts(self, tree_box: Box, data: np.ndarray) -> list[tuple[Box, np.ndarray]]:
        """The shard before the permutations, as boxes: each permuted axis cut into the
        runs of consecutive indices its tree indices hold."""
        parts = [(tree_box, data)]
        for axis, order in self.permutes:
            a, b = tree_box[axis]
            held = np.asarray(order[a:b])
            positions = np.argsort(held)
            values = held[positions]
            cuts = np.flatnonzero(np.diff(values) != 1) + 1
            runs = [(p, int(v[0]), int(v[-1]) + 1) for p, v in zip(np.split(positions, cuts),
                                                               np.split(values, cuts))]
            parts = [(box[:axis] + ((lo, hi),) + box[axis + 1:], np.take(x, p, axis=axis))
                     for box, x in parts for p, lo, hi in runs]
        return parts

    def _arrange_to_stored(self, tree_box: Box, data: np.ndarray) -> list[tuple[Box, np.ndarray]]:
        if self._same_arrangement:
            return [(tree_box, np.ascontiguousarray(data))]
        # Per group: the tree box cut into parts contiguous in the group's flat order.
        parts_per_group = [
            [tree_box[j:j + k]] if len(src) == len(tree) == 1
            else contiguous_parts(tree_box[j:j + k], tree)
            for (src, tree), (_, _, j, k) in zip(self.groups, self._spans())]
        stored = []
        for parts in itertools.product(*parts_per_group):
            sub_box = tuple(b for part in parts for b in part)
            sub = data[relative_slices(sub_box, tree_box)]
            for chosen in itertools.product(*self._covers(parts)):
                stored.append(self._stored_part(sub, chosen))
        return stored

    def _covers(self, parts: Sequence[Box]) -> list[list[tuple[Box, int | None]]]:
        """Per group, the transposed boxes a contiguous tree part spans, each with its offset in
        the part's flat range (``None``: a group the reshape leaves alone)."""
        covers: list[list[tuple[Box, int | None]]] = []
        for (src, tree), part in zip(self.groups, parts):
            if len(src) == len(tree) == 1:
                covers.append([(part, None)])
                continue
            f0, f1 = flat_range(part, tree)
            covers.append([(b, flat_range(b, src)[0] - f0) for b in range_boxes(f0, f1, src)])
        return covers

    def _stored_part(self, sub: np.ndarray, chosen: Sequence[tuple[Box, int | None]]
                     ) -> tuple[Box, np.ndarray]:
        """The stored box of one cover per group, and its values cut from the tree part ``sub``."""
        x, axis = sub, 0
        for (_, _, _, k), (b, offset) in zip(self._spans(), chosen):
            if offset is None:
                axis += 1
                continue
            n = box_size(b)
            x = x.reshape(x.shape[:axis] + (math.prod(x.shape[axis:axis + k]),) + x.shape[axis + k:])
            x = x[(slice(None),) * axis + (slice(offset, offset + n),)]
            x = x.reshape(x.shape[:axis] + box_shape(b) + x.shape[axis + 1:])
            axis += len(b)
        transposed = tuple(bounds for b, _ in chosen for bounds in b)
        inverse = tuple(np.argsort(self.perm))
        return self._unpermute(transposed), np.ascontiguousarray(np.transpose(x, inverse))

_TILE = 256  # elements per side of a copied tile: both tiles' cache lines stay in L1/L2


def copy_into(out: np.ndarray, x: np.ndarray) -> None:
    """``out[...] = x`` (cast to ``out``'s dtype), tile by tile when ``x`` is a transposed view.

    A transpose copied element by element in C order reads ``x`` a cache line per element;
    copied in square tiles each line is used for a whole tile. Twice as fast for a bf16
    matrix here (1.2 vs 0.6 GB/s), which is most of a transposing load's time on the host.
    """
    if x.ndim >= 2 and not x.flags.c_contiguous and x.size >= _TILE * _TILE:
        flat_out, flat_x = _rows(out), _rows(x)  # as 2-D views, axis 0 and the rest, where they are
        if flat_out is None or flat_x is None:
            if x.ndim > 2 and x[0].size >= _TILE * _TILE:  # one slab of axis 0 at a time (experts)
                for part_out, part in zip(out, x):
                    copy_into(part_out, part)
                return
            flat_out, flat_x = out, x
        rows, cols = flat_x.shape[0], flat_x.shape[-1]
        # A cast reads its source element by element where it is strided (8 ns each for
        # ml_dtypes' bfloat16): each tile is gathered first (in cache), then cast, 3x faster.
        gather = np.ascontiguousarray if out.dtype != x.dtype and flat_x.ndim == 2 else (lambda tile: tile)
        for i in range(0, rows, _TILE):
            for j in range(0, cols, _TILE):
                flat_out[i:i + _TILE, ..., j:j + _TILE] = gather(flat_x[i:i + _TILE, ..., j:j + _TILE])
        return
    out[...] = x


def _rows(a: np.ndarray) -> np.ndarray | None:
    """``a`` as ``(a.shape[0], -1)`` where that is a view of it, else ``None``. Asked of the
    strides first: a refused ``reshape(copy=False)`` costs what its exception costs, and the
    shape setter that refused the same way copied the whole array first (73 ms for 66 MB)."""
    inner = [(n, stride) for n, stride in zip(a.shape[1:], a.strides[1:]) if n != 1]
    if any(outer != n * stride for (_, outer), (n, stride) in zip(inner, inner[1:])):
        return None
    return a.reshape((a.shape[0], -1), copy=False)
