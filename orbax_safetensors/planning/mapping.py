"""Mapping checkpoint names and layouts to a params tree: rules, names, boxes.

A Hugging Face checkpoint is a PyTorch ``state_dict``: ``q_proj.weight`` is a
``Linear`` weight of shape ``(heads * head_dim, hidden)`` per layer, while a
Flax model wants a ``DenseGeneral`` kernel ``(hidden, heads, head_dim)`` under
another name, and a scanned model (MaxText, ``nn.scan``) one kernel holding
every layer. A ``Rule`` says how one family of tensors differs, declaratively:

* names: a pattern on each side; a placeholder only the stored side has is
  *stacked* into a tree axis (``model.layers.{i}`` → axis 1 of
  ``decoder.layers...``; MoE experts ``{e}``), several stored patterns are
  *concatenated* along a tree axis (fused QKV, gate+up);
* layout: a transpose of the stored axes, then a reshape that splits one axis
  into adjacent ones (or merges adjacent ones);
* values: a permutation within an axis (RoPE halves ↔ interleaved), an
  elementwise scale (computed in float32), the stored dtype.

A ``Mapping`` is a list of rules; it translates names both ways and resolves
each leaf's ``Assembly``: the stored tensors it is made of (``Piece``), where
each sits in the leaf, and each one's ``Transform``.

Everything applies per shard, never to a whole tensor, so a sharded load
still reads only the bytes each device holds: a device's box of the leaf
meets some pieces (a layer-sharded device only its layers'), and a
``Transform`` turns the part of the box in a piece into the stored box
holding it (a transpose permutes the box; a split axis becomes the enclosing
range of the merged stored axis, exact when the inner axes are whole; a
permuted axis the range its indices span, exact when the axis is whole), and
the bytes read into the box's values. On save it turns a shard into stored
boxes and their bytes, cutting it where it is not one stored box. Value
transforms are exact on save (the inverse), except that a scale by a factor
that is not a power of two can move a float32 value by one unit in the last
place; a bfloat16 or float16 checkpoint still round-trips bit for bit.

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Mapping as MappingABC

import ml_dtypes  # noqa: F401  (numpy learns "bfloat16" and friends: Rule(dtype=...))
import numpy as np

from orbax_safetensors.errors import MappingError
from orbax_safetensors.format.dtypes import dtype_for_numpy
from orbax_safetensors.planning.boxes import (
    Box, bounding_box, box_shape, box_size, full_box, intersect, relative_slices)
from orbax_safetensors.planning.write_plan import TensorSpec

Size = int | str  # a size in a split/merge: an int (-1: infer it) or a dimension name
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _pattern(text: str, side: str) -> tuple[re.Pattern, tuple[str, ...]]:
    """``"model.layers.{i}.mlp"`` → a regex where each placeholder is one dotted segment."""
    names = tuple(_PLACEHOLDER.findall(text))
    if len(set(names)) != len(names):
        raise MappingError(f"{side} pattern {text!r} repeats a placeholder")
    parts, last = [], 0
    for match in _PLACEHOLDER.finditer(text):
        parts.append(re.escape(text[last:match.start()]))
        parts.append(f"(?P<{match.group(1)}>[^.]+)")
        last = match.end()
    parts.append(re.escape(text[last:]))
    return re.compile("".join(parts)), names


Permutation = str | Callable[[int], Sequence[int]]


def halves_to_interleaved(n: int) -> tuple[int, ...]:
    """RoPE's two layouts of a head: ``[x0..x_{n/2-1}, y0..y_{n/2-1}]`` (Hugging Face) →
    ``[x0, y0, x1, y1, ...]`` (MaxText): tree index ``2m`` holds ``m``, ``2m+1`` holds ``n/2+m``."""
    if n % 2:
        raise MappingError(f"halves_to_interleaved: an axis of odd size {n}")
    return tuple(int(k) for k in np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], -1).reshape(-1))


def interleaved_to_halves(n: int) -> tuple[int, ...]:
    return tuple(int(k) for k in np.argsort(halves_to_interleaved(n)))


PERMUTATIONS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "halves_to_interleaved": halves_to_interleaved, "interleaved_to_halves": interleaved_to_halves}


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one family of stored tensors appears in the tree.

    ``stored`` and ``tree`` are names with ``{placeholders}``, each matching one
    dot-separated segment and carried to the other side, e.g.
    ``Rule("model.layers.{i}.mlp.up_proj.weight", "model.layers_{i}.mlp.up_proj.kernel",
    transpose=(1, 0))``. Each stored tensor becomes a *piece* of the tree leaf:
    transposed (``np.transpose(stored, transpose)``), then reshaped:

    * ``split={axis: sizes}``: axis ``axis`` of the transposed tensor becomes
      ``len(sizes)`` adjacent axes, e.g. ``{1: ("heads", "head_dim")}``;
    * ``merge={axis: sizes}``: the ``len(sizes)`` adjacent transposed axes from
      ``axis`` on become one axis;

    then its values: ``permute={axis: p}`` reorders one axis of the piece (index
    ``j`` holds index ``p(n)[j]`` of the reshaped piece; ``p`` a name in
    ``PERMUTATIONS`` or a function of the axis size ``n``), ``scale`` multiplies
    (in float32, float64 for float64 tensors; divided out again on save), and
    ``dtype`` is the dtype saved (a float32 tree saved as ``"bfloat16"``).

    Pieces form the leaf: ``stack={placeholder: axis}`` names placeholders of
    the stored side only, each a leaf axis whose index is the placeholder's
    value (``stack={"i": 1}``: layer ``i`` at index ``i`` of axis 1); several
    ``stored`` patterns are concatenated along one leaf axis,
    ``concat={axis: sizes}`` with one size per pattern. ``split``/``merge``/
    ``permute`` axes count a piece's axes; ``stack``/``concat`` axes the leaf's.

    A size is an int, ``-1`` (inferred), or a dimension name looked up in the
    ``Mapping``'s ``dims`` (inferred when absent). Sizes are only needed where
    the shapes at hand do not fix them; where they do they are checked.
    """

    stored: str | tuple[str, ...]
    tree: str
    transpose: tuple[int, ...] | None = None
    split: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)
    merge: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)
    permute: MappingABC[int, Permutation] = dataclasses.field(default_factory=dict)
    scale: float | None = None
    dtype: Any = None
    stack: MappingABC[str, int] = dataclasses.field(default_factory=dict)
    concat: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)

    @property
    def stored_patterns(self) -> tuple[str, ...]:
        return (self.stored,) if isinstance(self.stored, str) else tuple(self.stored)

    def __post_init__(self):
        patterns = self.stored_patterns
        where = f"rule {patterns[0]!r}"
        _, tree_names = _pattern(self.tree, "tree")
        for pattern in patterns:
            _, stored_names = _pattern(pattern, "stored")
            if set(stored_names) != set(tree_names) | set(self.stack) or set(self.stack) & set(tree_names):
                raise MappingError(
                    f"rule {pattern!r} ↔ {self.tree!r}: both sides need the same placeholders, "
                    "except the stacked ones, which only the stored side has")
        if len(set(self.stack.values())) != len(self.stack) or any(
                not isinstance(a, int) or a < 0 for a in self.stack.values()):
            raise MappingError(f"{where}: stack axes {dict(self.stack)} must be distinct and >= 0")
        if len(patterns) > 1 or self.concat:
            if len(self.concat) != 1 or len(next(iter(self.concat.values()))) != len(patterns):
                raise MappingError(f"{where}: {len(patterns)} stored patterns need concat={{axis: "
                                   f"one size per pattern}}")
            if next(iter(self.concat)) in self.stack.values():
                raise MappingError(f"{where}: the concat axis is a stack axis")
        if self.transpose is not None and sorted(self.transpose) != list(range(len(self.transpose))):
            raise MappingError(f"{where}: transpose {self.transpose} is not a permutation")
        for kind, entries in (("split", self.split), ("merge", self.merge)):
            for axis, sizes in entries.items():
                if not isinstance(axis, int) or axis < 0:
                    raise MappingError(f"{where}: {kind} axis {axis!r}: use axes >= 0")
                if len(sizes) < 1 or (kind == "merge" and len(sizes) < 2):
                    raise MappingError(f"{where}: {kind} {axis}: {tuple(sizes)} is too short")
        merged = {a + k for a, sizes in self.merge.items() for k in range(len(sizes))}
        if merged & set(self.split) or len(merged) != sum(len(s) for s in self.merge.values()):
            raise MappingError(f"{where}: split and merge axes overlap")
        for permutation in self.permute.values():
            if isinstance(permutation, str) and permutation not in PERMUTATIONS:
                raise MappingError(f"{where}: unknown permutation {permutation!r}; "
                                   f"known: {', '.join(PERMUTATIONS)}")
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale != 0):
            raise MappingError(f"{where}: scale {self.scale} has no inverse")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", np.dtype(self.dtype))
            except TypeError as e:
                raise MappingError(f"{where}: dtype {self.dtype!r}: {e}") from None

    def resolve(
        self,
        *,
        stored_shape: Sequence[int] | None = None,
        tree_shape: Sequence[int] | None = None,
        dims: MappingABC[str, int] | None = None,
    ) -> Transform:
        """The transform of one piece between concrete shapes (the piece's, not the
        leaf's: without the stacked axes, its own part of a concatenated axis);
        either shape may be unknown, not both."""
        dims = dims or {}
        where = f"rule {self.stored_patterns[0]!r} ↔ {self.tree!r}"
        if stored_shape is None and tree_shape is None:
            raise MappingError(f"{where}: needs the stored or the tree shape")
        stored = None if stored_shape is None else tuple(int(s) for s in stored_shape)
        tree = None if tree_shape is None else tuple(int(s) for s in tree_shape)
        ndim = len(self.transpose) if self.transpose is not None else (
            len(stored) if stored is not None else None)
        if stored is not None and ndim != len(stored):
            raise MappingError(f"{where}: transpose {self.transpose} does not fit stored shape {stored}")
        perm = self.transpose
        transposed = None if stored is None else tuple(stored[p] for p in (perm or range(len(stored))))
        groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        i = j = 0  # next transposed axis, next tree axis
        while (i < ndim) if ndim is not None else (j < len(tree)):
            if i in self.split:
                count = len(self.split[i])
                total = None if transposed is None else transposed[i]
                actual = None if tree is None else tree[j:j + count]
                sizes = _sizes(self.split[i], actual, total, dims, f"{where}: split {i}")
                groups.append(((math.prod(sizes),), sizes))
                i, j = i + 1, j + count
            elif i in self.merge:
                count = len(self.merge[i])
                actual = None if transposed is None else transposed[i:i + count]
                total = None if tree is None or j >= len(tree) else tree[j]
                sizes = _sizes(self.merge[i], actual, total, dims, f"{where}: merge {i}")
                groups.append((sizes, (math.prod(sizes),)))
                i, j = i + count, j + 1
            else:
                if transposed is not None:
                    size = transposed[i]
                elif j < len(tree):
                    size = tree[j]
                else:
                    raise MappingError(f"{where}: tree shape {tree} has too few axes")
                groups.append(((size,), (size,)))
                i, j = i + 1, j + 1
        if any(a >= i for a in itertools.chain(self.split, self.merge)):
            raise MappingError(f"{where}: split/merge axes beyond the tensor's {i} axes")
        perm = tuple(perm) if perm is not None else tuple(range(i))
        layout = Transform(perm, tuple(groups))
        if tree is not None and layout.tree_shape != tree:
            raise MappingError(
                f"{where}: stored shape {stored} maps to {layout.tree_shape}, not the tree's {tree}")
        permutes = []
        for axis, permutation in sorted(self.permute.items()):
            shape = layout.tree_shape
            if not -len(shape) <= axis < len(shape):
                raise MappingError(f"{where}: permute axis {axis} of a {len(shape)}-axis tensor")
            axis %= len(shape)
            n = shape[axis]
            order = tuple(int(k) for k in (PERMUTATIONS[permutation] if isinstance(permutation, str)
                                           else permutation)(n))
            if sorted(order) != list(range(n)):
                raise MappingError(f"{where}: permute {axis}: not a permutation of {n} indices")
            permutes.append((axis, order))
        return dataclasses.replace(layout, permutes=tuple(permutes), scale=self.scale, dtype=self.dtype)


def _dims_size(item: Size, dims: MappingABC[str, int]) -> int | None:
    """A declared size: an int, a name in ``dims``, or ``None`` (-1, or a name not given)."""
    if isinstance(item, str):
        return dims.get(item)
    return None if int(item) == -1 else int(item)


def _sizes(spec: Sequence[Size], actual: Sequence[int] | None, total: int | None,
           dims: MappingABC[str, int], where: str) -> tuple[int, ...]:
    """Concrete sizes of a split/merge: ``actual`` when known (checked against ``spec``),
    else from ``spec``, with one unknown inferred from ``total``."""
    declared = [_dims_size(item, dims) for item in spec]
    if actual is not None:
        actual = tuple(actual)
        if len(actual) != len(spec) or any(d is not None and d != a for d, a in zip(declared, actual)):
            raise MappingError(f"{where}: declared sizes {tuple(spec)} = {tuple(declared)} "
                               f"do not match the shape's {actual}")
        if total is not None and math.prod(actual) != total:
            raise MappingError(f"{where}: sizes {actual} do not multiply to {total}")
        return actual
    unknown = [k for k, d in enumerate(declared) if d is None]
    if len(unknown) > 1 or (unknown and total is None):
        raise MappingError(f"{where}: cannot infer sizes {tuple(spec)} (give them in dims=)")
    if unknown:
        known = math.prod(d for d in declared if d is not None)
        if known == 0 or total % known:
            raise MappingError(f"{where}: {total} is not divisible by {known}")
        declared[unknown[0]] = total // known
    sizes = tuple(int(d) for d in declared)
    if total is not None and math.prod(sizes) != total:
        raise MappingError(f"{where}: sizes {sizes} do not multiply to {total}")
    return sizes


@dataclasses.dataclass(frozen=True)
class Transform:
    """Stored tensor → tree piece: ``np.transpose(stored, perm)``, a grouped reshape, then
    the value transforms (``permutes`` of single axes, ``scale``); ``dtype``: saved as.

    ``groups`` cover the transposed axes and the tree axes in order: each is
    ``(transposed sizes, tree sizes)`` with equal products, so the reshape only
    ever splits or merges adjacent axes and each group's box math is
    independent of the others.
    """

    perm: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    permutes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    scale: float | None = None
    dtype: np.dtype | None = None

    @property
    def tree_shape(self) -> tuple[int, ...]:
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
    def _same_layout(self) -> bool:
        """Whether the layout is the stored one (no transpose, no split or merge)."""
        return self.perm == tuple(range(len(self.perm))) and all(
            len(src) == len(tree) == 1 for src, tree in self.groups)

    @property
    def is_identity(self) -> bool:
        """Whether the tree piece is the stored tensor, bytes and all (``dtype`` aside)."""
        return self._same_layout and not self.permutes and self.scale is None

    def tree_dtype(self, stored: np.dtype) -> np.dtype:
        """The dtype of the tree values of a ``stored`` tensor: widened to float32 (float64
        for float64) where scaled, so the scale is computed in that precision."""
        if self.scale is None:
            return np.dtype(stored)
        return np.dtype(np.float64 if stored == np.float64 else np.float32)

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """The whole tree value of a whole stored value."""
        x = np.transpose(stored, self.perm).reshape(self.tree_shape)
        for axis, order in self.permutes:
            x = np.take(x, order, axis=axis)
        return self._scaled(x)

    def _scaled(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        if self.scale is None:
            return x
        wide = self.tree_dtype(x.dtype).type
        factor = wide(1.0 / self.scale if inverse else self.scale)
        return x.astype(wide) * factor

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
        tree_box = self._unpermuted(tree_box)
        transposed: list[tuple[int, int]] = []
        for (src, tree), (_, _, j, k) in zip(self.groups, self._spans()):
            part = tree_box[j:j + k]
            if len(src) == len(tree) == 1:
                transposed.extend(part)
                continue
            f0, f1 = _flat_range(_contiguous_cover(part, tree), tree)
            transposed.extend(_range_cover(f0, f1, src))
        return self._unpermute(tuple(transposed))

    def to_tree(self, data: np.ndarray, stored_box: Box, tree_box: Box,
                out: np.ndarray | None = None) -> np.ndarray:
        """The values of ``tree_box`` from ``data`` holding ``stored_box = self.stored_box(tree_box)``,
        written into ``out`` (cast to its dtype) when given: the layout is a view of ``data``
        and this is the one copy it costs."""
        if box_size(tree_box) == 0:
            x = self._scaled(np.zeros(box_shape(tree_box), data.dtype))
        else:
            reshaped = self._unpermuted(tree_box)
            x = self._layout_to_tree(data, stored_box, reshaped)
            for axis, order in self.permutes:
                a, b = tree_box[axis]
                x = np.take(x, np.asarray(order[a:b]) - reshaped[axis][0], axis=axis)
            x = self._scaled(x)
        if out is None:
            return x
        copy_into(out, x)
        return out

    def _layout_to_tree(self, data: np.ndarray, stored_box: Box, tree_box: Box) -> np.ndarray:
        x = np.transpose(data.reshape(box_shape(stored_box)), self.perm)
        transposed = tuple(stored_box[p] for p in self.perm)
        axis = 0
        for (src, tree), (i, m, j, k) in zip(self.groups, self._spans()):
            if len(src) == len(tree) == 1:
                axis += 1
                continue
            part = tree_box[j:j + k]
            cover = _contiguous_cover(part, tree)
            f0, f1 = _flat_range(cover, tree)
            g0, _ = _flat_range(transposed[i:i + m], src)
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
        the shard is cut into the fewest stored boxes it spans.
        """
        data = np.asarray(data).reshape(box_shape(tree_box))
        dtype = data.dtype if self.dtype is None else self.dtype
        stored = [item for box, values in self._unpermuted_parts(tree_box, self._scaled(data, inverse=True))
                  for item in self._layout_to_stored(box, values)]
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

    def _layout_to_stored(self, tree_box: Box, data: np.ndarray) -> list[tuple[Box, np.ndarray]]:
        if self._same_layout:
            return [(tree_box, np.ascontiguousarray(data))]
        spans = self._spans()
        # Per group: the tree box cut into parts contiguous in the group's flat order.
        parts_per_group = [
            [tree_box[j:j + k]] if len(src) == len(tree) == 1
            else _contiguous_parts(tree_box[j:j + k], tree)
            for (src, tree), (_, _, j, k) in zip(self.groups, spans)]
        stored = []
        for parts in itertools.product(*parts_per_group):
            sub_box = tuple(b for part in parts for b in part)
            sub = data[relative_slices(sub_box, tree_box)]
            covers = []  # per group: [(transposed box part, offset in the part's flat range)]
            for (src, tree), part in zip(self.groups, parts):
                if len(src) == len(tree) == 1:
                    covers.append([(part, None)])
                    continue
                f0, f1 = _flat_range(part, tree)
                covers.append([(b, _flat_range(b, src)[0] - f0) for b in _range_boxes(f0, f1, src)])
            for chosen in itertools.product(*covers):
                x, axis = sub, 0
                for (src, tree), (_, _, _, k), (b, offset) in zip(self.groups, spans, chosen):
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
                stored.append((self._unpermute(transposed), np.ascontiguousarray(np.transpose(x, inverse))))
        return stored


_TILE = 256  # elements per side of a copied tile: both tiles' cache lines stay in L1/L2


def copy_into(out: np.ndarray, x: np.ndarray) -> None:
    """``out[...] = x`` (cast to ``out``'s dtype), tile by tile when ``x`` is a transposed view.

    A transpose copied element by element in C order reads ``x`` a cache line per element;
    copied in square tiles each line is used for a whole tile. Twice as fast for a bf16
    matrix here (1.2 vs 0.6 GB/s), which is most of a transposing load's time on the host.
    """
    if x.ndim >= 2 and not x.flags.c_contiguous and x.size >= _TILE * _TILE:
        flat_out, flat_x = out.view(), x.view()
        try:  # as 2-D views, axis 0 and the rest (a reshape that would copy raises here)
            flat_out.shape = flat_x.shape = (x.shape[0], -1)
        except AttributeError:
            flat_out, flat_x = out, x
        rows, cols = flat_x.shape[0], flat_x.shape[-1]
        for i in range(0, rows, _TILE):
            for j in range(0, cols, _TILE):
                flat_out[i:i + _TILE, ..., j:j + _TILE] = flat_x[i:i + _TILE, ..., j:j + _TILE]
        return
    out[...] = x


def _flat_range(box: Box, shape: Sequence[int]) -> tuple[int, int]:
    """``[first, last + 1)`` flat C-order indices of a box's corners in ``shape``."""
    first = int(np.ravel_multi_index([a for a, _ in box], shape)) if shape else 0
    last = int(np.ravel_multi_index([b - 1 for _, b in box], shape)) if shape else 0
    return first, last + 1


def _contiguous_cover(box: Box, shape: Sequence[int]) -> Box:
    """The smallest box containing ``box`` that is contiguous in C order: after the first
    axis taken by more than one index, every axis whole."""
    lead = next((d for d, (a, b) in enumerate(box) if b - a > 1), len(box) - 1)
    return tuple(box[:lead + 1]) + tuple((0, s) for s in shape[lead + 1:])


def _contiguous_parts(box: Box, shape: Sequence[int]) -> list[Box]:
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


def _range_cover(f0: int, f1: int, shape: Sequence[int]) -> Box:
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


def _range_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[Box]:
    """Flat indices ``[lo, hi)`` of ``shape`` as the fewest boxes contiguous in C order, in order."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = math.prod(shape[1:])
    a, ra = divmod(lo, inner)
    b, rb = divmod(hi, inner)
    if a == b:
        return [((a, a + 1),) + box for box in _range_boxes(ra, rb, shape[1:])]
    boxes = []
    if ra:
        boxes += [((a, a + 1),) + box for box in _range_boxes(ra, inner, shape[1:])]
        a += 1
    if b > a:
        boxes.append(((a, b),) + tuple((0, s) for s in shape[1:]))
    if rb:
        boxes += [((b, b + 1),) + box for box in _range_boxes(0, rb, shape[1:])]
    return boxes


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stored tensor's place in a tree leaf: the block ``region`` of the leaf, whose
    ``stacked`` axes (one index each) the piece itself does not have."""

    stored: str
    transform: Transform
    region: Box
    stacked: tuple[int, ...] = ()

    def part(self, box: Box) -> tuple[Box, Box] | None:
        """The part of the leaf box ``box`` this piece holds, in the leaf and in the
        piece's own coordinates; ``None`` when it holds none of it."""
        inside = intersect(box, self.region)
        if inside is None:
            return None
        own = tuple((a - r, b - r) for axis, ((a, b), (r, _)) in enumerate(zip(inside, self.region))
                    if axis not in self.stacked)
        return inside, own


@dataclasses.dataclass(frozen=True)
class Assembly:
    """A tree leaf of ``shape`` made of the stored tensors ``pieces``, which tile it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def transform(self) -> Transform | None:
        """The transform when one stored tensor is the whole leaf, else ``None``."""
        if len(self.pieces) == 1 and not self.pieces[0].stacked:
            return self.pieces[0].transform
        return None


class Mapping:
    """Rules that translate stored tensor names and layouts to a params tree, both ways.

    ``dims`` names sizes the rules' ``split``/``merge``/``concat`` refer to (e.g.
    ``{"heads": 32, "head_dim": 128}``); they are needed only where no shape
    fixes them (loading without a target) and are checked everywhere else.
    Every name must be matched by exactly one rule, on either side: a name no
    rule maps or several rules map is an error, never a silent guess.
    """

    def __init__(self, rules: Iterable[Rule], *, dims: MappingABC[str, int] | None = None):
        self.rules = tuple(rules)
        self.dims = dict(dims or {})
        self._stored = [(rule, _pattern(p, "stored")[0]) for rule in self.rules for p in rule.stored_patterns]
        self._tree = [(rule, _pattern(rule.tree, "tree")[0]) for rule in self.rules]

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules, dims={self.dims})"

    def _find(self, name: str, patterns: list[tuple[Rule, re.Pattern]], side: str
              ) -> tuple[Rule, dict[str, str]]:
        hits = [(rule, m.groupdict()) for rule, p in patterns for m in [p.fullmatch(name)] if m]
        if not hits:
            raise MappingError(f"no rule maps the {side} name {name!r}")
        if len(hits) > 1:
            raise MappingError(f"the {side} name {name!r} is mapped by several rules: " + ", ".join(
                f"{r.stored_patterns[0]!r} ↔ {r.tree!r}" for r, _ in hits))
        return hits[0]

    def stored_rule(self, tree_name: str) -> tuple[str, Rule]:
        """``(stored name, rule)`` of a tree leaf that is one stored tensor."""
        rule, values = self._find(tree_name, self._tree, "tree")
        if rule.stack or len(rule.stored_patterns) > 1:
            raise MappingError(f"the tree leaf {tree_name!r} is made of several stored tensors "
                               "(use Mapping.assembly)")
        return _fill(rule.stored_patterns[0], values), rule

    def stored_name(self, tree_name: str) -> str:
        return self.stored_rule(tree_name)[0]

    def tree_name(self, stored_name: str) -> str:
        """The tree leaf a stored tensor is (part of)."""
        rule, values = self._find(stored_name, self._stored, "stored")
        return _fill(rule.tree, values)

    def transform(self, tree_name: str, *, stored_shape: Sequence[int] | None = None,
                  tree_shape: Sequence[int] | None = None) -> Transform:
        """The transform of a tree leaf that is one stored tensor, between the shapes given."""
        _, rule = self.stored_rule(tree_name)
        return rule.resolve(stored_shape=stored_shape, tree_shape=tree_shape, dims=self.dims)

    def unmapped(self, names: Iterable[str], side: str = "tree") -> list[str]:
        """The names no rule or several rules map (to report them all at once)."""
        patterns = self._tree if side == "tree" else self._stored
        return [n for n in names if sum(bool(p.fullmatch(n)) for _, p in patterns) != 1]

    def assembly(self, tree_name: str, *, tree_shape: Sequence[int] | None = None,
                 stored_shapes: MappingABC[str, Sequence[int]] | None = None) -> Assembly:
        """The stored tensors a tree leaf is made of, and how.

        ``tree_shape`` (a target's, or a leaf being saved) fixes how many
        layers / experts are stacked and every piece's shape; without it they
        come from ``stored_shapes`` (the checkpoint's tensors: the stacked
        indices present must run from 0). Where both are known every piece is
        checked against its stored shape; a stored tensor missing from
        ``stored_shapes`` is an error only when its shape is needed.
        """
        rule, values = self._find(tree_name, self._tree, "tree")
        where = f"{tree_name!r}"
        tree = None if tree_shape is None else tuple(int(s) for s in tree_shape)
        stack = sorted(rule.stack.items(), key=lambda item: item[1])
        stacked = tuple(axis for _, axis in stack)
        if tree is not None and any(axis >= len(tree) for axis in stacked + tuple(rule.concat)):
            raise MappingError(f"{where}: shape {tree} has no axis {max(stacked + tuple(rule.concat))}")
        counts = ([tree[axis] for axis in stacked] if tree is not None
                  else self._stack_counts(rule, values, stored_shapes or {}, where))

        def named(pattern: str, index: tuple[int, ...]) -> str:
            return _fill(pattern, {**values, **{p: str(i) for (p, _), i in zip(stack, index)}})

        def piece_shape(shape: tuple[int, ...], size: int | None) -> tuple[int, ...]:
            """The leaf's shape without the stacked axes, ``size`` on the concat axis."""
            own = [s for axis, s in enumerate(shape) if axis not in stacked]
            if rule.concat:
                own[concat_axis] = size
            return tuple(own)

        concat_axis = None
        if rule.concat:
            leaf_axis = next(iter(rule.concat))
            concat_axis = leaf_axis - sum(a < leaf_axis for a in stacked)
        first = (0,) * len(stack)
        sizes = self._concat_sizes(rule, tree, stored_shapes, [named(p, first) for p in rule.stored_patterns],
                                   where)
        pieces = []
        for index in itertools.product(*(range(c) for c in counts)):
            offset = 0
            for k, pattern in enumerate(rule.stored_patterns):
                name = named(pattern, index)
                stored_shape = None if stored_shapes is None else stored_shapes.get(name)
                if tree is None and stored_shape is None:
                    raise MappingError(f"{where}: the stored tensor {name!r} is missing")
                own = None if tree is None else piece_shape(tree, None if sizes is None else sizes[k])
                try:
                    transform = rule.resolve(stored_shape=stored_shape, tree_shape=own, dims=self.dims)
                except MappingError as e:
                    raise MappingError(f"{where} ({name!r}): {e}") from None
                region = list((0, s) for s in transform.tree_shape)
                if concat_axis is not None:
                    size = transform.tree_shape[concat_axis]
                    region[concat_axis] = (offset, offset + size)
                    offset += size
                for axis, i in zip(stacked, index):
                    region.insert(axis, (i, i + 1))
                pieces.append(Piece(name, transform, tuple(region), stacked))
        shape = tree if tree is not None else tuple(b for _, b in _bounding(pieces))
        if tree is not None and pieces and _bounding(pieces) != full_box(tree):
            raise MappingError(f"{where}: its pieces span {_bounding(pieces)}, not the shape {tree}")
        return Assembly(shape, tuple(pieces))

    def _stack_counts(self, rule: Rule, values: MappingABC[str, str],
                      stored_shapes: MappingABC[str, Sequence[int]], where: str) -> list[int]:
        """How many indices each stacked placeholder takes, from the stored names present."""
        pattern = _pattern(_fill(rule.stored_patterns[0], values, keep=True), "stored")[0]
        seen: dict[str, set[str]] = {p: set() for p in rule.stack}
        for name in stored_shapes:
            match = pattern.fullmatch(name)
            if match:
                for placeholder in rule.stack:
                    seen[placeholder].add(match.group(placeholder))
        counts = []
        for placeholder, found in seen.items():
            expected = {str(i) for i in range(len(found))}
            if found != expected:
                raise MappingError(f"{where}: stacked {{{placeholder}}} takes the values "
                                   f"{sorted(found, key=lambda v: (len(v), v))}, not 0..n-1")
            counts.append(len(found))
        return counts

    def _concat_sizes(self, rule: Rule, tree: tuple[int, ...] | None,
                      stored_shapes: MappingABC[str, Sequence[int]] | None, first: list[str],
                      where: str) -> tuple[int, ...] | None:
        """The concatenated pieces' sizes along the concat axis (``None``: no concat), from
        the first stored pieces (``first``) where present, else the declared sizes."""
        if not rule.concat:
            return None
        axis, spec = next(iter(rule.concat.items()))
        total = None if tree is None else tree[axis]
        declared = [_dims_size(item, self.dims) for item in spec]
        if stored_shapes is not None and all(name in stored_shapes for name in first):
            piece_axis = axis - sum(a < axis for a in rule.stack.values())
            actual = [rule.resolve(stored_shape=stored_shapes[name], dims=self.dims).tree_shape[piece_axis]
                      for name in first]
            if any(d is not None and d != a for d, a in zip(declared, actual)):
                raise MappingError(f"{where}: concat sizes {tuple(spec)} do not match the stored {actual}")
            declared = actual
        unknown = [k for k, d in enumerate(declared) if d is None]
        if len(unknown) > 1 or (unknown and total is None):
            raise MappingError(f"{where}: cannot infer the concat sizes {tuple(spec)} (give them in dims=)")
        if unknown:
            declared[unknown[0]] = total - sum(d for d in declared if d is not None)
        if total is not None and sum(declared) != total:
            raise MappingError(f"{where}: concat sizes {tuple(declared)} do not add up to {total}")
        return tuple(declared)

    def tree_shapes(self, stored_shapes: MappingABC[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """The tree leaves a checkpoint's tensors make and their shapes (from headers alone,
        e.g. ``ost.metadata(path).tensors``): the skeleton of a target, before shardings."""
        bad = self.unmapped(stored_shapes, "stored")
        if bad:
            raise MappingError(f"no single rule maps the stored names: {', '.join(sorted(bad))}")
        leaves = dict.fromkeys(self.tree_name(name) for name in stored_shapes)
        return {leaf: self.assembly(leaf, stored_shapes=stored_shapes).shape for leaf in leaves}

    def map_specs(self, specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], dict[str, Assembly]]:
        """Tree-named specs → stored specs, and each tree leaf's ``Assembly``."""
        bad = self.unmapped(s.name for s in specs)
        if bad:
            # One error listing every offender; _find explains the first one.
            try:
                self._find(bad[0], self._tree, "tree")
            except MappingError as e:
                raise MappingError(f"{e} (unmapped or ambiguous: {', '.join(bad)})") from None
        stored_specs, assemblies, owner = [], {}, {}
        for spec in specs:
            assembly = self.assembly(spec.name, tree_shape=spec.shape)
            assemblies[spec.name] = assembly
            for piece in assembly.pieces:
                if piece.stored in owner:
                    raise MappingError(
                        f"tree leaves {owner[piece.stored]!r} and {spec.name!r} both map to {piece.stored!r}")
                owner[piece.stored] = spec.name
                dtype = spec.dtype if piece.transform.dtype is None else dtype_for_numpy(piece.transform.dtype)
                stored_specs.append(TensorSpec(piece.stored, dtype, piece.transform.stored_shape))
        return stored_specs, assemblies


def _bounding(pieces: Sequence[Piece]) -> Box:
    return bounding_box([p.region for p in pieces])


def _fill(template: str, values: MappingABC[str, str], keep: bool = False) -> str:
    """The template with its placeholders' values (``keep``: placeholders without one stay)."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values or not keep
                            else m.group(0), template)
