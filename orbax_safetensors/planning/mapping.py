"""Mapping checkpoint names and layouts to a params tree: rules, names, boxes.

A Hugging Face checkpoint is a PyTorch ``state_dict``: ``q_proj.weight`` is a
``Linear`` weight of shape ``(heads * head_dim, hidden)``, while a Flax model
wants a ``DenseGeneral`` kernel ``(hidden, heads, head_dim)`` under another
name. A ``Rule`` says how one family of tensors differs, declaratively: a name
pattern on each side, a transpose of the stored axes, then a reshape that
splits one axis into several adjacent ones (or merges adjacent ones). A
``Mapping`` is a list of rules; it translates names both ways and resolves
each tensor's ``Transform`` from the shapes at hand.

The transform is applied per shard, never to a whole tensor, so a sharded
load still reads only the bytes each device holds: a ``Transform`` turns the
box a device holds in the tree into the stored box holding it (a transpose
permutes the box; a split axis becomes the enclosing range of the merged
stored axis, exact when the inner axes are whole), and the bytes read into
the box's values. On save it turns a shard into stored boxes and their bytes,
cutting a shard into several stored boxes where it is not one (a split axis
sharded inside its inner sizes).

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as MappingABC

import numpy as np

from orbax_safetensors.planning.boxes import Box, box_shape, box_size, relative_slices
from orbax_safetensors.planning.write_plan import TensorSpec

Size = int | str  # a size in a split/merge: an int (-1: infer it) or a dimension name
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class MappingError(ValueError):
    """A name no rule maps, one several rules map, or shapes a rule cannot map."""


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


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one family of stored tensors appears in the tree.

    ``stored`` and ``tree`` are names with ``{placeholders}``, each matching one
    dot-separated segment and carried to the other side, e.g.
    ``Rule("model.layers.{i}.mlp.up_proj.weight", "model.layers_{i}.mlp.up_proj.kernel",
    transpose=(1, 0))``. The tree value is the stored one transposed
    (``np.transpose(stored, transpose)``), then reshaped:

    * ``split={axis: sizes}``: axis ``axis`` of the transposed tensor becomes
      ``len(sizes)`` adjacent tree axes, e.g. ``{1: ("heads", "head_dim")}``;
    * ``merge={axis: sizes}``: the ``len(sizes)`` adjacent transposed axes from
      ``axis`` on become one tree axis.

    A size is an int, ``-1`` (inferred), or a dimension name looked up in the
    ``Mapping``'s ``dims`` (inferred when absent). Sizes are only needed where
    the shapes at hand do not fix them; where they do they are checked.
    """

    stored: str
    tree: str
    transpose: tuple[int, ...] | None = None
    split: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)
    merge: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _, stored_names = _pattern(self.stored, "stored")
        _, tree_names = _pattern(self.tree, "tree")
        if set(stored_names) != set(tree_names):
            raise MappingError(
                f"rule {self.stored!r} ↔ {self.tree!r}: both sides need the same placeholders")
        if self.transpose is not None and sorted(self.transpose) != list(range(len(self.transpose))):
            raise MappingError(f"rule {self.stored!r}: transpose {self.transpose} is not a permutation")
        for kind, entries in (("split", self.split), ("merge", self.merge)):
            for axis, sizes in entries.items():
                if not isinstance(axis, int) or axis < 0:
                    raise MappingError(f"rule {self.stored!r}: {kind} axis {axis!r}: use axes >= 0")
                if len(sizes) < 1 or (kind == "merge" and len(sizes) < 2):
                    raise MappingError(f"rule {self.stored!r}: {kind} {axis}: {tuple(sizes)} is too short")
        merged = {a + k for a, sizes in self.merge.items() for k in range(len(sizes))}
        if merged & set(self.split) or len(merged) != sum(len(s) for s in self.merge.values()):
            raise MappingError(f"rule {self.stored!r}: split and merge axes overlap")

    def resolve(
        self,
        *,
        stored_shape: Sequence[int] | None = None,
        tree_shape: Sequence[int] | None = None,
        dims: MappingABC[str, int] | None = None,
    ) -> Transform:
        """The transform between concrete shapes; either shape may be unknown, not both."""
        dims = dims or {}
        where = f"rule {self.stored!r} ↔ {self.tree!r}"
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
        transform = Transform(perm, tuple(groups))
        if tree is not None and transform.tree_shape != tree:
            raise MappingError(
                f"{where}: stored shape {stored} maps to {transform.tree_shape}, not the tree's {tree}")
        return transform


def _sizes(spec: Sequence[Size], actual: Sequence[int] | None, total: int | None,
           dims: MappingABC[str, int], where: str) -> tuple[int, ...]:
    """Concrete sizes of a split/merge: ``actual`` when known (checked against ``spec``),
    else from ``spec``, with one unknown inferred from ``total``."""
    declared: list[int | None] = []
    for item in spec:
        if isinstance(item, str):
            declared.append(dims.get(item))
        elif int(item) == -1:
            declared.append(None)
        else:
            declared.append(int(item))
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
    """Stored tensor → tree tensor: ``np.transpose(stored, perm)``, then a grouped reshape.

    ``groups`` cover the transposed axes and the tree axes in order: each is
    ``(transposed sizes, tree sizes)`` with equal products, so the reshape only
    ever splits or merges adjacent axes and each group's box math is
    independent of the others.
    """

    perm: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

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
    def is_identity(self) -> bool:
        return self.perm == tuple(range(len(self.perm))) and all(
            len(src) == len(tree) == 1 for src, tree in self.groups)

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """The whole tree value of a whole stored value."""
        return np.transpose(stored, self.perm).reshape(self.tree_shape)

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
        transposed: list[tuple[int, int]] = []
        for (src, tree), (_, _, j, k) in zip(self.groups, self._spans()):
            part = tree_box[j:j + k]
            if len(src) == len(tree) == 1:
                transposed.extend(part)
                continue
            f0, f1 = _flat_range(_contiguous_cover(part, tree), tree)
            transposed.extend(_range_cover(f0, f1, src))
        return self._unpermute(tuple(transposed))

    def to_tree(self, data: np.ndarray, stored_box: Box, tree_box: Box) -> np.ndarray:
        """The values of ``tree_box`` from ``data`` holding ``stored_box = self.stored_box(tree_box)``."""
        if box_size(tree_box) == 0:
            return np.zeros(box_shape(tree_box), data.dtype)
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
        """A tree shard as stored boxes and their C-contiguous values.

        One box where the shard is one stored box (always, unless a split axis
        is sharded inside its inner sizes or a merged axis across its rows);
        otherwise the shard is cut into the fewest stored boxes it spans.
        """
        data = np.asarray(data).reshape(box_shape(tree_box))
        if self.is_identity:
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


class Mapping:
    """Rules that translate stored tensor names and layouts to a params tree, both ways.

    ``dims`` names sizes the rules' ``split``/``merge`` refer to (e.g.
    ``{"heads": 32, "head_dim": 128}``); they are needed only where no shape
    fixes them (loading without a target) and are checked everywhere else.
    Every name must be matched by exactly one rule, on either side: a name no
    rule maps or several rules map is an error, never a silent guess.
    """

    def __init__(self, rules: Iterable[Rule], *, dims: MappingABC[str, int] | None = None):
        self.rules = tuple(rules)
        self.dims = dict(dims or {})
        self._stored = [_pattern(r.stored, "stored")[0] for r in self.rules]
        self._tree = [_pattern(r.tree, "tree")[0] for r in self.rules]

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules, dims={self.dims})"

    def _find(self, name: str, patterns: list[re.Pattern], side: str) -> tuple[Rule, dict[str, str]]:
        hits = [(rule, m.groupdict()) for rule, p in zip(self.rules, patterns)
                for m in [p.fullmatch(name)] if m]
        if not hits:
            raise MappingError(f"no rule maps the {side} name {name!r}")
        if len(hits) > 1:
            raise MappingError(f"the {side} name {name!r} is mapped by several rules: " + ", ".join(
                f"{r.stored!r} ↔ {r.tree!r}" for r, _ in hits))
        return hits[0]

    def stored_rule(self, tree_name: str) -> tuple[str, Rule]:
        """``(stored name, rule)`` of a tree leaf."""
        rule, values = self._find(tree_name, self._tree, "tree")
        return _fill(rule.stored, values), rule

    def tree_rule(self, stored_name: str) -> tuple[str, Rule]:
        """``(tree name, rule)`` of a stored tensor."""
        rule, values = self._find(stored_name, self._stored, "stored")
        return _fill(rule.tree, values), rule

    def stored_name(self, tree_name: str) -> str:
        return self.stored_rule(tree_name)[0]

    def tree_name(self, stored_name: str) -> str:
        return self.tree_rule(stored_name)[0]

    def transform(self, tree_name: str, *, stored_shape: Sequence[int] | None = None,
                  tree_shape: Sequence[int] | None = None) -> Transform:
        """The transform of a tree leaf between the shapes given (at least one)."""
        _, rule = self.stored_rule(tree_name)
        return rule.resolve(stored_shape=stored_shape, tree_shape=tree_shape, dims=self.dims)

    def unmapped(self, names: Iterable[str], side: str = "tree") -> list[str]:
        """The names no rule or several rules map (to report them all at once)."""
        patterns = self._tree if side == "tree" else self._stored
        return [n for n in names if sum(bool(p.fullmatch(n)) for p in patterns) != 1]

    def map_specs(self, specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], dict[str, tuple[str, Transform]]]:
        """Tree-named specs → stored specs, and each tree name's ``(stored name, transform)``."""
        bad = self.unmapped(s.name for s in specs)
        if bad:
            # One error listing every offender; _find explains the first one.
            try:
                self.stored_rule(bad[0])
            except MappingError as e:
                raise MappingError(f"{e} (unmapped or ambiguous: {', '.join(bad)})") from None
        stored_specs, transforms, owner = [], {}, {}
        for spec in specs:
            stored, rule = self.stored_rule(spec.name)
            if stored in owner:
                raise MappingError(f"tree leaves {owner[stored]!r} and {spec.name!r} both map to {stored!r}")
            owner[stored] = spec.name
            transform = rule.resolve(tree_shape=spec.shape, dims=self.dims)
            transforms[spec.name] = (stored, transform)
            stored_specs.append(dataclasses.replace(spec, name=stored, shape=transform.stored_shape))
        return stored_specs, transforms


def _fill(template: str, values: MappingABC[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
