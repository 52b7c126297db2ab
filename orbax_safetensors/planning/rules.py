"""Mapping checkpoint names and arrangements to a params tree: ``Rule`` and ``Mapping``.

A Hugging Face checkpoint is a PyTorch ``state_dict``: ``q_proj.weight`` is a
``Linear`` weight of shape ``(heads * head_dim, hidden)`` per layer, while a
Flax model wants a ``DenseGeneral`` kernel ``(hidden, heads, head_dim)`` under
another name, and a scanned model (MaxText, ``nn.scan``) one kernel holding
every layer. A ``Rule`` says how one family of tensors differs, declaratively,
and a ``Mapping`` (a list of rules) answers for every name:

1. names: a pattern on each side whose ``{placeholders}`` each match one
   dotted segment and carry over to the other side; ``Mapping`` finds the one
   rule whose pattern matches a name, on either side. No rule, or several, is
   an error naming the offenders, never a silent guess: a name mapped wrongly
   would load the wrong bytes without a sound. A ``Strided`` placeholder's
   value is computed from the other side's (layer ``6 * n + k``), and a rule
   matches only the values it can compute.
2. sizes: a split, merge or concat declares its sizes as ints, ``-1`` or
   dimension names (``Mapping``'s ``dims``); the shapes at hand fix them where
   they can and are checked against them, and ``_sizes`` infers the one
   unknown size, for all three.
3. ``Rule.resolve``: a rule between two concrete shapes (one may be unknown)
   is a ``Transform`` (``planning.transforms``): the arrangement and the values.
4. ``Mapping.assembly``: the stored tensors a leaf is made of (a placeholder
   only the stored side has is *stacked* into a leaf axis; several stored
   patterns are *concatenated*), each a ``Piece`` placed by the rule's
   ``Tiling`` (``planning.assembly``).

Rules are checked when they are made, so a mapping that cannot work fails at
its definition, not halfway through a load; everything else is resolved per
leaf from the shapes in hand (a target, a checkpoint's headers), before any
byte is read.

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import ml_dtypes  # noqa: F401  (numpy learns "bfloat16" and friends: Rule(dtype=...))
import numpy as np

from orbax_safetensors.errors import MappingError
from orbax_safetensors.format.dtypes import dtype_for_numpy
from orbax_safetensors.planning.assembly import Assembly, Constant, Tiling, assemble
from orbax_safetensors.planning.dequantized import Quantization, dequantized, schemes
from orbax_safetensors.planning.quantization import FP8
from orbax_safetensors.planning.transforms import PERMUTATIONS, Permutation, Transform, untransposed_axes
from orbax_safetensors.planning.write_plan import TensorSpec

Size = int | str  # a size in a split/merge/concat: an int (-1: infer it) or a dimension name
Group = tuple[tuple[int, ...], tuple[int, ...]]  # a reshape group: (transposed sizes, tree sizes)
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


def _fill(template: str, values: MappingABC[str, str], keep: bool = False) -> str:
    """The template with its placeholders' values (``keep``: placeholders without one stay)."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values or not keep
                            else m.group(0), template)


@dataclasses.dataclass(frozen=True)
class Strided:
    """A stored placeholder whose value is ``start + step * n + k``: ``n`` its index along
    its ``stack`` axis (``0`` where it is not stacked), ``k`` the value of the tree
    placeholder ``within`` (``0 <= k < step``); it takes the values in ``[start, stop)``
    (``stop=None``: no end), and a rule matches no other.

    MaxText's Gemma 3 scans its layers in a 6-layer attention pattern: layer ``6 * n + k``
    is index ``n`` of ``decoder.layers.layers_{k}``, and the ``N % 6`` layers left over,
    ``6 * (N // 6) + k``, are ``decoder.layers_remainder.layers_{k}``::

        R = 6 * (N // 6)
        Rule("model.layers.{i}.mlp.up_proj.weight", "decoder.layers.layers_{k}.mlp.wi_1.kernel",
             stack={"i": 1}, strided={"i": Strided("k", 6, stop=R)})
        Rule("model.layers.{i}.mlp.up_proj.weight", "decoder.layers_remainder.layers_{k}.mlp.wi_1.kernel",
             strided={"i": Strided("k", 6, start=R)})

    ``within=None``: ``k`` is 0 and the tree side has no placeholder for it, so a
    stack can start or stop at any layer: DeepSeek-V3's first ``K`` layers are dense
    and the rest MoE, stacked apart (``decoder.dense_layers`` holds layers ``[0, K)``,
    ``decoder.moe_layers`` the rest)::

        Rule("model.layers.{i}.self_attn.kv_a_layernorm.weight",
             "decoder.moe_layers.self_attention.kv_norm.scale", stack={"i": 1},
             strided={"i": Strided(None, 1, start=K)})

    ``within`` may instead be a placeholder of the rule's ``stack`` (on neither side's
    names): ``k`` is then the index along that leaf axis too, so one stored placeholder
    fills two stacked axes. ``width`` (default ``step``) bounds ``k`` (``0 <= k < width``).
    MaxText's Qwen3-Next scans blocks of 4 layers (3 linear-attention layers, then a
    full-attention one) and, inside each block, scans the 3 again: layer ``4 * n + k``
    (``k < 3``) is index ``(n, k)`` of axes 1 and 2 of ``decoder.layers.local_layers``::

        Rule("model.layers.{i}.input_layernorm.weight",
             "decoder.layers.local_layers.input_layernorm.scale", stack={"i": 1, "k": 2},
             strided={"i": Strided("k", 4, width=3)})
    """

    within: str | None
    step: int
    start: int = 0
    stop: int | None = None
    width: int | None = None

    def __post_init__(self):
        if not (isinstance(self.step, int) and self.step >= 1 and isinstance(self.start, int) and self.start >= 0
                and (self.stop is None or isinstance(self.stop, int))):
            raise MappingError(f"{self}: step >= 1, start >= 0 and stop must be ints")
        if self.width is not None and not (isinstance(self.width, int) and 1 <= self.width <= self.step):
            raise MappingError(f"{self}: width must be an int in [1, step]")

    @property
    def span(self) -> int:
        """How many values ``k`` takes."""
        return self.step if self.width is None else self.width

    def value(self, n: int, k: int) -> int:
        """The stored placeholder's value at stack index ``n`` of the leaf ``within=k``."""
        return self.start + self.step * n + k

    def split(self, value: str) -> tuple[int, int] | None:
        """``(n, k)`` of a stored placeholder's value; ``None`` outside ``[start, stop)``."""
        number = _number(value)
        if number is None or number < self.start or (self.stop is not None and number >= self.stop):
            return None
        return divmod(number - self.start, self.step)

    def k(self, tree: MappingABC[str, str]) -> int:
        """``k`` of the leaf whose tree placeholders are ``tree`` (0 without ``within``)."""
        return 0 if self.within is None else int(tree[self.within])

    def count(self, k: int) -> int | None:
        """How many stored values the leaf ``within=k`` stacks (``None``: no ``stop``, so the
        names present tell)."""
        return None if self.stop is None else len(range(self.value(0, k), self.stop, self.step))

    def holds(self, k: str) -> bool:
        """Whether the tree placeholder's value ``k`` names a leaf of stored values in range."""
        number = _number(k)
        return number is not None and number < self.span and (self.stop is None or self.value(0, number) < self.stop)


def _number(text: str) -> int | None:
    """A placeholder's value as a non-negative int, written the one way ``str`` writes it."""
    return int(text) if text.isdigit() and str(int(text)) == text else None


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one family of stored tensors appears in the tree.

    ``stored`` and ``tree`` are names with ``{placeholders}``, each matching one
    dot-separated segment and carried to the other side, e.g.
    ``Rule("model.layers.{i}.mlp.up_proj.weight", "model.layers_{i}.mlp.up_proj.kernel",
    transpose=(1, 0))``. Each stored tensor becomes a *piece* of the tree leaf, first its
    arrangement: transposed (``np.transpose(stored, transpose)``), then reshaped:

    * ``split={axis: sizes}``: axis ``axis`` of the transposed tensor becomes
      ``len(sizes)`` adjacent axes, e.g. ``{1: ("heads", "head_dim")}``;
    * ``merge={axis: sizes}``: the ``len(sizes)`` adjacent transposed axes from
      ``axis`` on become one axis;

    then its values: ``permute={axis: p}`` reorders one axis of the piece (index
    ``j`` holds index ``p(n)[j]`` of the reshaped piece; ``p`` a name in
    ``PERMUTATIONS`` or a function of the axis size ``n``), ``scale`` multiplies
    and then ``offset`` adds (in float32, float64 for float64 tensors; undone
    on save, exactly where ``planning.transforms`` says), and ``dtype`` is the
    dtype saved (a float32 tree saved as ``"bfloat16"``). ``take={axis: k}``
    keeps index ``k`` of an axis of the reshaped piece and drops the axis:
    one stored tensor read as several leaves, e.g. gpt-oss's interleaved
    ``gate_up_proj`` ``[E, D, 2F]`` as MaxText's ``wi_0`` (``split={2: ("mlp",
    2)}, take={3: 0}``) and ``wi_1`` (``take={3: 1}``). A save writes the
    stored tensor from all the leaves that take a part of it, each its own
    indices (a save given only some of them is refused while it is planned);
    the taken axis's size must then be declared (an int, or a name in
    ``dims``), as the tree's shape lacks it. Last, ``transpose_after`` orders the
    piece's axes as ``np.transpose`` does, where a transpose before the split
    cannot: DeepSeek-V4's ``wo_a`` ``[G * r, X]`` is MaxText's ``[G, X, r]``
    (``split={0: (G, r)}, transpose_after=(0, 2, 1)``).

    ``only={placeholder: values}`` limits a placeholder both sides have to some values: the
    rule maps no other name. DeepSeek-V4's layers differ by their attention, not by where they
    are: ``only={"i": (2, 4, 6)}`` gives the compressed-sparse-attention layers their indexer.

    Pieces form the leaf: ``stack={placeholder: axis}`` names placeholders of
    the stored side only, each a leaf axis whose index is the placeholder's
    value (``stack={"i": 1}``: layer ``i`` at index ``i`` of axis 1), or, for a
    placeholder in ``strided={placeholder: Strided(...)}``, the value that
    ``Strided`` computes (every 6th layer in one leaf: ``Strided``); several
    ``stored`` patterns are concatenated along one leaf axis,
    ``concat={axis: sizes}`` with one size per pattern. ``split``/``merge``/
    ``permute`` axes count a piece's axes; ``stack``/``concat`` axes the leaf's.

    ``order`` interleaves the concatenated patterns: along the concat axis, in
    ``chunk``-wide slices, the leaf holds slice ``j`` of pattern ``p`` for each
    ``(p, j)`` of ``order`` in turn (a rule without ``split`` or ``merge``). A
    ``chunk`` that is a shape (``(1, k)``) makes each slice that many axes, the
    first along the concat axis: the slices of a vector as the rows of a matrix.
    MaxText's Qwen3.5 ``in_proj_qkvz`` kernel holds, key head by key head, that
    head's query, key and value columns of ``in_proj_qkv`` and its ``in_proj_z``
    columns. Each slice is its own piece (``take``), so a save writes the stored
    tensors from the leaf (and the other leaves with slices of them) slice by slice.
    ``concat``'s sizes are then the stored patterns' whole sizes along the axis, and the
    order may leave slices to other leaves: DeepSeek-V4's ``hc_attn_fn`` holds MaxText's
    ``pre_alpha``, ``post_alpha`` and ``res_alpha``, its first, second and last ``k`` slices.

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
    offset: float | None = None
    dtype: Any = None
    stack: MappingABC[str, int] = dataclasses.field(default_factory=dict)
    concat: MappingABC[int, Sequence[Size]] = dataclasses.field(default_factory=dict)
    strided: MappingABC[str, Strided] = dataclasses.field(default_factory=dict)
    only: MappingABC[str, Iterable[int]] = dataclasses.field(default_factory=dict)
    take: MappingABC[int, int] = dataclasses.field(default_factory=dict)
    transpose_after: tuple[int, ...] | None = None
    order: Sequence[tuple[int, int]] = ()
    chunk: int | tuple[int, ...] | None = None

    @property
    def stored_patterns(self) -> tuple[str, ...]:
        return (self.stored,) if isinstance(self.stored, str) else tuple(self.stored)

    def maps_stored(self, name: str) -> bool:
        """Whether the stored name ``name`` is one this rule maps (a pattern of it matches)."""
        return any(_pattern(p, "stored")[0].fullmatch(name) for p in self.stored_patterns)

    @property
    def _stacked_placeholders(self) -> tuple[str, ...]:
        """The ``stack`` placeholders in the order of their leaf axes."""
        return tuple(sorted(self.stack, key=self.stack.__getitem__))

    def _slice(self, pattern: int, j: int) -> Rule:
        """The rule of slice ``j`` of stored pattern ``pattern`` of an ``order``ed rule: the concat
        axis split into ``chunk``-wide slices, slice ``j`` taken. A save, planned from the tree's
        shape, needs their count: the pattern's declared size over ``chunk``, or, undeclared, the
        order's slices of it where they run from 0 without a gap."""
        axis = self._tiling.concat_piece_axis
        size, chunk = next(iter(self.concat.values()))[pattern], self._chunk_shape
        slices = sorted(k for p, k in self.order if p == pattern)
        if isinstance(size, int) and size > 0:
            if size % math.prod(chunk):
                raise MappingError(f"{self._where}: concat size {size} is not a multiple of the chunk {self.chunk}")
            count = size // math.prod(chunk)
        else:
            count = len(slices) if slices == list(range(len(slices))) else -1
        return dataclasses.replace(self, stored=self.stored_patterns[pattern], concat={}, order=(), chunk=None,
                                   split={axis: (count, *chunk)}, take={axis: j})

    @property
    def _chunk_shape(self) -> tuple[int, ...]:
        """An ordered rule's slice as the piece has it: ``chunk`` wide, or of ``chunk``'s shape."""
        return (self.chunk,) if isinstance(self.chunk, int) else tuple(self.chunk)

    @property
    def _inner(self) -> dict[str, str]:
        """The stacked ``within`` placeholders, each with the stored placeholder it is within."""
        return {s.within: p for p, s in self.strided.items() if s.within is not None and s.within in self.stack}

    @property
    def _tiling(self) -> Tiling:
        """Where the pieces of a leaf this rule makes sit in it."""
        return Tiling(tuple(sorted(self.stack.values())), next(iter(self.concat), None))

    def __post_init__(self):
        where = f"rule {self.stored_patterns[0]!r}"
        object.__setattr__(self, "only", {p: frozenset(int(v) for v in values) for p, values in self.only.items()})
        self._check_names()
        self._check_tiling(where)
        self._check_arrangement(where)
        self._check_values(where)

    def _check_names(self) -> None:
        """Both sides have the same placeholders, but the stacked and strided ones (the stored
        side's only) and the strided ones' ``within`` (the tree side's only); ``only``'s are
        on both."""
        _, tree_names = _pattern(self.tree, "tree")
        if not set(self.only) <= set(tree_names) - set(self.stack) - set(self.strided):
            raise MappingError(f"rule {self.stored_patterns[0]!r} ↔ {self.tree!r}: only {sorted(self.only)} must "
                               "name placeholders both sides have")
        inner = set(self._inner)  # stacked withins: on neither side
        stored_only = (set(self.stack) | set(self.strided)) - inner
        tree_only = {s.within for s in self.strided.values() if s.within is not None} - inner
        for pattern in self.stored_patterns:
            _, stored_names = _pattern(pattern, "stored")
            if (set(stored_names) - stored_only != set(tree_names) - tree_only or not stored_only <= set(stored_names)
                    or not tree_only <= set(tree_names) - set(stored_names)
                    or len(tree_only) != sum(s.within is not None for s in self.strided.values()) - len(inner)):
                raise MappingError(
                    f"rule {pattern!r} ↔ {self.tree!r}: both sides need the same placeholders, "
                    "except the stacked and strided ones, which only the stored side has, and each "
                    "strided one's own `within`, which only the tree side has")

    def _check_tiling(self, where: str) -> None:
        if len(set(self.stack.values())) != len(self.stack) or any(
                not isinstance(a, int) or a < 0 for a in self.stack.values()):
            raise MappingError(f"{where}: stack axes {dict(self.stack)} must be distinct and >= 0")
        patterns = self.stored_patterns
        if len(patterns) > 1 or self.concat:
            if len(self.concat) != 1 or len(next(iter(self.concat.values()))) != len(patterns):
                raise MappingError(f"{where}: {len(patterns)} stored patterns need concat={{axis: "
                                   f"one size per pattern}}")
            if next(iter(self.concat)) in self.stack.values():
                raise MappingError(f"{where}: the concat axis is a stack axis")

    def _check_arrangement(self, where: str) -> None:
        for name in ("transpose", "transpose_after"):
            perm = getattr(self, name)
            if perm is not None and sorted(perm) != list(range(len(perm))):
                raise MappingError(f"{where}: {name} {perm} is not a permutation")
        for kind, entries in (("split", self.split), ("merge", self.merge)):
            for axis, sizes in entries.items():
                if not isinstance(axis, int) or axis < 0:
                    raise MappingError(f"{where}: {kind} axis {axis!r}: use axes >= 0")
                if len(sizes) < 1 or (kind == "merge" and len(sizes) < 2):
                    raise MappingError(f"{where}: {kind} {axis}: {tuple(sizes)} is too short")
        merged = {a + k for a, sizes in self.merge.items() for k in range(len(sizes))}
        if merged & set(self.split) or len(merged) != sum(len(s) for s in self.merge.values()):
            raise MappingError(f"{where}: split and merge axes overlap")
        if any(not isinstance(v, int) or v < 0 for item in self.take.items() for v in item):
            raise MappingError(f"{where}: take {dict(self.take)}: axes and indices must be ints >= 0")

    def _check_values(self, where: str) -> None:
        if self.order and (not self.concat or self.split or self.merge or self.take or self.chunk is None
                           or any(not isinstance(c, int) or c < 1 for c in self._chunk_shape)
                           or any(not 0 <= p < len(self.stored_patterns) or j < 0
                                                    for p, j in self.order)):
            raise MappingError(f"{where}: order needs concat, a chunk >= 1, no split, merge or take, and "
                               "(pattern, slice) pairs of its stored patterns")
        for permutation in self.permute.values():
            if isinstance(permutation, str) and permutation not in PERMUTATIONS:
                raise MappingError(f"{where}: unknown permutation {permutation!r}; "
                                   f"known: {', '.join(PERMUTATIONS)}")
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale != 0):
            raise MappingError(f"{where}: scale {self.scale} has no inverse")
        if self.offset is not None and not math.isfinite(self.offset):
            raise MappingError(f"{where}: offset {self.offset} has no inverse")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", np.dtype(self.dtype))
            except TypeError:
                raise MappingError(f"{where}: dtype {self.dtype!r} is not a dtype: pass a NumPy dtype "
                                   "or its name, e.g. 'float32' or 'bfloat16'") from None

    def resolve(
        self,
        *,
        stored_shape: Sequence[int] | None = None,
        tree_shape: Sequence[int] | None = None,
        dims: MappingABC[str, int] | None = None,
        undeclared: str | None = None,
    ) -> Transform:
        """The transform of one piece between concrete shapes (the piece's, not the
        leaf's: without the stacked axes, its own part of a concatenated axis);
        either shape may be unknown, not both. ``undeclared``: the whole message where a
        size is neither in ``dims`` nor inferred (what gives it, e.g. a family's config)."""
        where = self._where
        if stored_shape is None and tree_shape is None:
            raise MappingError(f"{where}: needs the stored or the tree shape")
        stored, tree = _shape(stored_shape), _shape(tree_shape)
        after = tuple(self.transpose_after or ())
        if tree is not None and after:
            if len(after) != len(tree):
                raise MappingError(f"{where}: transpose_after {after} does not fit the tree shape {tree}")
            tree = untransposed_axes(tree, after)
        reshaped = tree if not self.take or stored is not None else self._with_taken_axes(tree, dims or {})
        arranged = self._arrangement(self._transposed(stored), None if self.take and stored is not None
                                     else reshaped, dims or {}, undeclared)
        takes = self._takes(arranged.tree_shape)
        shape = dataclasses.replace(arranged, takes=takes).tree_shape
        if tree is not None and shape != tree:
            raise MappingError(f"{where}: stored shape {stored} maps to {shape}, not the tree's "
                               f"{_shape(tree_shape)}" + (f" before transpose_after {after}" if after else ""))
        if after and len(after) != len(shape):
            raise MappingError(f"{where}: transpose_after {after} does not fit the piece's shape {shape}")
        return dataclasses.replace(arranged, permutes=self._permutes(arranged.tree_shape), takes=takes,
                                   scale=self.scale, offset=self.offset, dtype=self.dtype, tree_perm=after)

    def _with_taken_axes(self, tree: tuple[int, ...], dims: MappingABC[str, int]) -> tuple[int, ...]:
        """The tree shape of a piece that takes, with its taken axes back: the reshaped piece a
        save plans from (the taken axes' sizes as the split declares them)."""
        declared: dict[int, Size] = {}
        offset = 0  # reshaped axis - transposed axis, from the splits and merges before
        for axis in sorted({*self.split, *self.merge}):
            if axis in self.split:
                declared.update({axis + offset + k: size for k, size in enumerate(self.split[axis])})
                offset += len(self.split[axis]) - 1
            else:
                offset -= len(self.merge[axis]) - 1
        shape = list(tree)
        for axis in sorted(self.take):
            size = _declared(declared.get(axis, -1), dims)
            if size is None:
                raise MappingError(f"{self._where}: take {axis}: the taken axis's size is not declared "
                                   "(an int or a name in dims), so a save cannot plan the stored tensor "
                                   "from the tree's shape, which lacks that axis")
            shape.insert(axis, size)
        return tuple(shape)

    def _takes(self, reshaped: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``take`` as the transform's ``(axis, index)`` pairs of the ``reshaped`` piece (from the
        stored shape, or from the tree's with the taken axes' declared sizes put back)."""
        for axis, index in self.take.items():
            if axis >= len(reshaped) or index >= reshaped[axis]:
                raise MappingError(f"{self._where}: take {axis}: index {index} of a piece of shape {reshaped}")
        return tuple(sorted(self.take.items()))

    def _accepts(self, values: MappingABC[str, str], side: str) -> bool:
        """Whether a name whose pattern gave placeholder ``values`` on ``side`` is this
        rule's: every value a ``Strided`` placeholder computes is in its range, every ``only``
        placeholder's among its values."""
        if any(_number(values[p]) not in allowed for p, allowed in self.only.items()):
            return False
        if side == "tree":
            return all(s.within is None or s.within in self._inner or s.holds(values[s.within])
                       for s in self.strided.values())
        for placeholder, strided in self.strided.items():
            split = strided.split(values[placeholder])
            if split is None or (placeholder not in self.stack and split[0] != 0) or (
                    strided.within is None and split[1] != 0) or split[1] >= strided.span:
                return False
        return True

    def _tree_values(self, stored: MappingABC[str, str]) -> dict[str, str]:
        """The tree's placeholder values of a stored name's (that ``_accepts``)."""
        values = {p: v for p, v in stored.items() if p not in self.stack and p not in self.strided}
        values.update({s.within: str(s.split(stored[p])[1]) for p, s in self.strided.items()
                       if s.within is not None and s.within not in self._inner})
        return values

    def _stored_values(self, tree: MappingABC[str, str], index: Sequence[int]) -> dict[str, str]:
        """The stored placeholder values of the piece at stack ``index`` (in the order of the
        stack axes) of the leaf whose tree placeholders are ``tree``."""
        stacked = dict(zip(self._stacked_placeholders, index))
        values = {**tree, **{p: str(i) for p, i in stacked.items()}}
        values.update({p: str(s.value(stacked.get(p, 0), stacked[s.within] if s.within in self._inner else s.k(tree)))
                       for p, s in self.strided.items()})
        return values

    def _stack_index(self, stored: MappingABC[str, str], tree: MappingABC[str, str]) -> tuple[str, ...] | None:
        """The stack index (per stacked placeholder, as text) of the stored name with values
        ``stored`` in the leaf with tree values ``tree``; ``None``: another leaf's."""
        index = []
        for placeholder in self._stacked_placeholders:
            if placeholder in self._inner:  # k of the stored placeholder it is within
                outer = self._inner[placeholder]
                split = self.strided[outer].split(stored[outer])
                if split is None or split[1] >= self.strided[outer].span:
                    return None
                index.append(str(split[1]))
                continue
            strided = self.strided.get(placeholder)
            if strided is None:
                index.append(stored[placeholder])
                continue
            split = strided.split(stored[placeholder])
            if split is None or (placeholder not in self._inner.values() and split[1] != strided.k(tree)):
                return None
            index.append(str(split[0]))
        return tuple(index)

    def _transposed(self, stored: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The stored shape transposed (``None`` when it is unknown)."""
        if stored is None:
            return None
        if self.transpose is None:
            return stored
        if len(self.transpose) != len(stored):
            raise MappingError(
                f"{self._where}: transpose {self.transpose} does not fit stored shape {stored}")
        return tuple(stored[p] for p in self.transpose)

    def _arrangement(self, transposed: tuple[int, ...] | None, tree: tuple[int, ...] | None,
                     dims: MappingABC[str, int], undeclared: str | None) -> Transform:
        """The piece's arrangement alone (the transpose and the reshape groups, walking the
        transposed and the tree axes), a ``Transform`` whose value transforms come after."""
        ndim = len(self.transpose) if self.transpose is not None else (
            None if transposed is None else len(transposed))
        groups: list[Group] = []
        i = j = 0  # next transposed axis, next tree axis
        while (i < ndim) if ndim is not None else (j < len(tree)):
            src, out = self._group(i, j, transposed, tree, dims, undeclared)
            groups.append((src, out))
            i, j = i + len(src), j + len(out)
        if any(a >= i for a in itertools.chain(self.split, self.merge)):
            raise MappingError(f"{self._where}: split/merge axes beyond the tensor's {i} axes")
        perm = tuple(self.transpose) if self.transpose is not None else tuple(range(i))
        return Transform(perm, tuple(groups))

    def _group(self, i: int, j: int, transposed: tuple[int, ...] | None, tree: tuple[int, ...] | None,
               dims: MappingABC[str, int], undeclared: str | None) -> Group:
        """The reshape group at transposed axis ``i`` and tree axis ``j``: a split, a merge,
        or one axis kept as it is."""
        if i in self.split:
            count = len(self.split[i])
            sizes = _sizes(self.split[i], None if tree is None else tree[j:j + count],
                           None if transposed is None else transposed[i], dims, f"{self._where}: split {i}",
                           undeclared=undeclared)
            return (math.prod(sizes),), sizes
        if i in self.merge:
            count = len(self.merge[i])
            total = None if tree is None or j >= len(tree) else tree[j]
            sizes = _sizes(self.merge[i], None if transposed is None else transposed[i:i + count],
                           total, dims, f"{self._where}: merge {i}", undeclared=undeclared)
            return sizes, (math.prod(sizes),)
        if transposed is not None:
            return (transposed[i],), (transposed[i],)
        if j < len(tree):
            return (tree[j],), (tree[j],)
        raise MappingError(f"{self._where}: tree shape {tree} has too few axes")

    def _permutes(self, shape: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``permute`` as concrete index orders of the axes of a piece of ``shape``."""
        permutes = []
        for axis, permutation in sorted(self.permute.items()):
            if not -len(shape) <= axis < len(shape):
                raise MappingError(f"{self._where}: permute axis {axis} of a {len(shape)}-axis tensor")
            axis %= len(shape)
            n = shape[axis]
            order = tuple(int(k) for k in (PERMUTATIONS[permutation] if isinstance(permutation, str)
                                           else permutation)(n))
            if sorted(order) != list(range(n)):
                raise MappingError(f"{self._where}: permute {axis}: not a permutation of {n} indices")
            permutes.append((axis, order))
        return tuple(permutes)

    @property
    def _where(self) -> str:
        """How an error about resolving this rule names it."""
        return f"rule {self.stored_patterns[0]!r} ↔ {self.tree!r}"


def _shape(shape: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(s) for s in shape)


def _sizes(spec: Sequence[Size], actual: Sequence[int] | None, total: int | None,
           dims: MappingABC[str, int], where: str, *, add: bool = False,
           undeclared: str | None = None) -> tuple[int, ...]:
    """Concrete sizes of a split or merge (they multiply to ``total``) or a concat
    (``add``: they add up to it): ``actual`` when known, checked against ``spec``; else
    from ``spec``, its one unknown size inferred from ``total``. Either total may be unknown.
    ``undeclared``: the message where sizes are unknown and cannot be inferred."""
    declared = [_declared(item, dims) for item in spec]
    if actual is not None:
        if len(actual) != len(spec) or any(d is not None and d != a for d, a in zip(declared, actual)):
            raise MappingError(f"{where}: declared sizes {tuple(spec)} = {tuple(declared)} "
                               f"do not match the shape's {tuple(actual)}")
        declared = list(actual)
    unknown = [k for k, d in enumerate(declared) if d is None]
    if len(unknown) > 1 or (unknown and total is None):
        raise MappingError(undeclared or f"{where}: cannot infer sizes {tuple(spec)}: give them in "
                           f"Mapping(dims=...), e.g. dims={{{', '.join(f'{s!r}: ...' for s in spec)}}}")
    combine = sum if add else math.prod
    if unknown:
        known = combine(d for d in declared if d is not None)
        if not add and (known == 0 or total % known):
            raise MappingError(f"{where}: {total} is not divisible by {known}")
        declared[unknown[0]] = total - known if add else total // known
    sizes = tuple(int(d) for d in declared)
    if total is not None and combine(sizes) != total:
        raise MappingError(f"{where}: sizes {sizes} do not {'add up' if add else 'multiply'} to {total}")
    return sizes


def _declared(item: Size, dims: MappingABC[str, int]) -> int | None:
    """A declared size: an int, a name in ``dims``, or ``None`` (-1, or a name not given)."""
    if isinstance(item, str):
        return dims.get(item)
    return None if int(item) == -1 else int(item)



@dataclasses.dataclass(frozen=True)
class ConfigSize:
    """A size a model's config states, which the checkpoint must show: rules match names and
    split heads whatever the number of layers or experts, so a config of another model would
    convert (3 layers on a 2-layer checkpoint made a 2-layer stack) and fail only where the
    result is restored, far from the cause.

    With ``axis``, every stored tensor ``stored`` names (placeholders match one dotted
    segment: ``"model.layers.{i}.mlp.gate_proj.weight"``) is ``value`` long along ``axis``;
    without, the stored names beginning with ``stored`` give its one placeholder ``value``
    values (``"model.layers.{i}."``: the layers). Where the checkpoint has no such name there
    is nothing to check (another family's tensor).
    """

    field: str  # the config's name for the size, which a refusal names
    value: int
    stored: str
    axis: int | None = None

    def __post_init__(self):
        if self.axis is None and len(_pattern(self.stored, "stored")[1]) != 1:
            raise MappingError(f"{self}: counting needs a stored pattern with one placeholder")

    def misfit(self, stored_shapes: MappingABC[str, Sequence[int]]) -> str | None:
        """How the checkpoint differs from the config (``None``: it does not)."""
        pattern = _pattern(self.stored, "stored")[0]
        said = f"the config's {self.field} is {self.value}, but"
        if self.axis is None:
            found = {m.group(1) for name in stored_shapes for m in [pattern.match(name)] if m}
            if not found or len(found) == self.value:
                return None
            shown = sorted(found, key=lambda v: (len(v), v))
            return f"{said} the checkpoint holds {len(found)} ({self.stored}…: {', '.join(shown[:8])}" + (
                ", …)" if len(shown) > 8 else ")")
        wrong = [(name, tuple(shape)) for name, shape in stored_shapes.items() if pattern.fullmatch(name)
                 and len(shape) > self.axis and shape[self.axis] != self.value]
        if not wrong:
            return None
        (name, shape), more = wrong[0], len(wrong) - 1
        return (f"{said} the checkpoint's {name} is {shape}: {shape[self.axis]} along axis {self.axis}"
                + (f" (and {more} more tensors like it)" if more else ""))


class Mapping:
    """Rules that translate stored tensor names and arrangements to a params tree, both ways.

    ``dims`` names sizes the rules' ``split``/``merge``/``concat`` refer to (e.g.
    ``{"heads": 32, "head_dim": 128}``); they are needed only where no shape
    fixes them (loading without a target) and are checked everywhere else.
    Every name must be matched by exactly one rule, on either side: a name no
    rule maps or several rules map is an error, never a silent guess.
    ``checkpoint_form`` names how a checkpoint of the tree (not of the stored
    tensors) holds it, for ``ost.convert``: ``None``, the tree is the
    checkpoint; ``"maxtext"``, MaxText's train state (``0/items``, the tree
    under ``params.params``).
    ``quantization`` (``FP8``, ``MXFP4``, ``IntQuantized``, ``NVFP4``, ``MXFP4Packed``, or a
    sequence of them): the checkpoint may store tensors quantized so; each is read as its
    dequantized twin, the tensor the rules name (``planning.quantization``,
    ``planning.group_quantization``), dequantized box by box as it is read.
    ``ignore``: prefixes of stored names the tree does not hold (DeepSeek-V3's
    multi-token-prediction layer, which transformers skips too): left out of
    a load or a conversion, and never reported as unmapped or unexpected.
    ``sizes``: what the config says the checkpoint holds (``ConfigSize``: layers,
    experts, hidden size...); a checkpoint that differs is refused (``check_sizes``),
    naming the config field, before anything is read or written.
    ``undeclared``: what a load says where a size is neither in ``dims`` nor inferred from
    the shapes (a family's mapping made without its config: pass the config), the whole
    message for every leaf it stops, so that they are reported as one.
    ``constants``: tree leaves (whole names) no stored tensor holds (``Constant``).
    """

    def __init__(self, rules: Iterable[Rule], *, dims: MappingABC[str, int] | None = None,
                 checkpoint_form: str | None = None,
                 quantization: Quantization | Sequence[Quantization] | None = None,
                 ignore: Iterable[str] = (), sizes: Iterable[ConfigSize] = (),
                 undeclared: str | None = None, constants: MappingABC[str, Constant] | None = None):
        self.rules = tuple(rules)
        self.constants = dict(constants or {})
        self.dims = dict(dims or {})
        self.undeclared = undeclared
        self.sizes = tuple(sizes)
        self.checkpoint_form = checkpoint_form
        self.quantization = quantization
        self._schemes = schemes(quantization)
        self.ignore = tuple(ignore)
        self._stored = [(rule, _pattern(p, "stored")[0]) for rule in self.rules for p in rule.stored_patterns]
        self._tree = [(rule, _pattern(rule.tree, "tree")[0]) for rule in self.rules]

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules, dims={self.dims})"

    def stored_view(self, stored_shapes: MappingABC[str, Sequence[int]],
                    dtypes: MappingABC[str, str] | None = None) -> MappingABC[str, Sequence[int]]:
        """A checkpoint's tensors (name → shape) as the rules see them: with a
        ``quantization``, each quantized tensor as its dequantized twin (pass this to
        ``assembly``, which then reads the twins' pieces from the quantized tensors).
        ``dtypes`` (name → dtype code), when known, check that no FP8 tensor lacks its
        scales (read without them its values would be off by the scale, silently) and that
        values and scales are of dtypes the scheme reads. Names
        the mapping ``ignore``s are left out; the rest must fit ``sizes``."""
        if hasattr(stored_shapes, "quantized"):
            return stored_shapes
        if self.ignore:
            stored_shapes = {n: shape for n, shape in stored_shapes.items() if not self.ignores(n)}
        if not self._schemes:
            self.check_sizes(stored_shapes)
            return stored_shapes
        view = dequantized(self._schemes, stored_shapes)
        fp8 = [s for s in self._schemes if isinstance(s, FP8)]
        unscaled = [name for name, code in (dtypes or {}).items() if fp8 and code.startswith("F8_")
                    and name in view and name not in view.quantized]
        if unscaled:
            raise MappingError(f"{len(unscaled)} FP8 tensors have no scales ({fp8[0]}): "
                               + ", ".join(sorted(unscaled)[:5]) + (" ..." if len(unscaled) > 5 else ""))
        if dtypes is not None:
            for quantized in view.quantized.values():
                quantized.check_dtypes(dtypes)
        self.check_sizes(view)
        return view

    def check_sizes(self, stored_shapes: MappingABC[str, Sequence[int]]) -> None:
        """Refuses a checkpoint (stored name → shape, as the rules see them) that differs from
        what ``sizes`` says, naming every field that does not fit."""
        misfits = [m for m in (size.misfit(stored_shapes) for size in self.sizes) if m is not None]
        if misfits:
            raise MappingError("the checkpoint does not fit the mapping's config: " + "; ".join(misfits))

    def _hits(self, name: str, side: str) -> list[tuple[Rule, dict[str, str]]]:
        """The rules that map ``name`` on ``side``, each with its placeholder values."""
        patterns = self._tree if side == "tree" else self._stored
        return [(rule, m.groupdict()) for rule, p in patterns for m in [p.fullmatch(name)]
                if m and rule._accepts(m.groupdict(), side)]

    def _find(self, name: str, side: str) -> tuple[Rule, dict[str, str]]:
        hits = self._hits(name, side)
        if not hits:
            raise MappingError(f"no rule maps the {side} name {name!r}")
        if len(hits) > 1:
            raise MappingError(f"the {side} name {name!r} is mapped by several rules: " + ", ".join(
                f"{r.stored_patterns[0]!r} ↔ {r.tree!r}" for r, _ in hits))
        return hits[0]

    def stored_rule(self, tree_name: str) -> tuple[str, Rule]:
        """``(stored name, rule)`` of a tree leaf that is one stored tensor."""
        rule, values = self._find(tree_name, "tree")
        if rule.stack or len(rule.stored_patterns) > 1:
            raise MappingError(f"the tree leaf {tree_name!r} is made of several stored tensors "
                               "(use Mapping.assembly)")
        return _piece_names(rule, values, ())[0], rule

    def stored_name(self, tree_name: str) -> str:
        return self.stored_rule(tree_name)[0]

    def tree_name(self, stored_name: str) -> str:
        """The tree leaf a stored tensor is (part of)."""
        rule, values = self._find(stored_name, "stored")
        return _fill(rule.tree, rule._tree_values(values))

    def tree_names(self, stored_name: str) -> list[str]:
        """The tree leaves a stored tensor is (part of): one, or each that ``take``s a part of
        it (gpt-oss's ``gate_up_proj``: MaxText's ``wi_0`` and ``wi_1``)."""
        hits = self._hits(stored_name, "stored")
        if not _one_tensor_per_leaf(hits):
            self._find(stored_name, "stored")  # raises, naming the rules
        return [_fill(rule.tree, rule._tree_values(values)) for rule, values in hits]

    def transform(self, tree_name: str, *, stored_shape: Sequence[int] | None = None,
                  tree_shape: Sequence[int] | None = None) -> Transform:
        """The transform of a tree leaf that is one stored tensor, between the shapes given."""
        _, rule = self.stored_rule(tree_name)
        return rule.resolve(stored_shape=stored_shape, tree_shape=tree_shape, dims=self.dims,
                            undeclared=self.undeclared)

    def ignores(self, stored_name: str) -> bool:
        """Whether the tree leaves a stored tensor out (``ignore``)."""
        return bool(self.ignore) and stored_name.startswith(self.ignore)

    def unmapped(self, names: Iterable[str], side: str = "tree") -> list[str]:
        """The names no rule or several rules map (to report them all at once); a stored name
        several rules each ``take`` a part of is mapped."""
        if side == "tree":
            return [n for n in names if n not in self.constants and len(self._hits(n, side)) != 1]
        return [n for n in names if not _one_tensor_per_leaf(self._hits(n, side))]

    def idle_rules(self, stored_names: Iterable[str]) -> list[Rule]:
        """The rules no stored name matches: a checkpoint of another family, or one missing
        tensors the tree needs (a conversion would write a tree without those leaves)."""
        names = list(stored_names)
        return [rule for rule in self.rules if not any(rule.maps_stored(n) for n in names)]

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
        constant = self.constants.get(tree_name)
        if constant is not None:
            if tree_shape is not None and tuple(tree_shape) != constant.shape:
                raise MappingError(f"{tree_name!r}: a constant of shape {constant.shape}, not {tuple(tree_shape)}")
            return Assembly(constant.shape, (), constant)
        rule, values = self._find(tree_name, "tree")
        where, tree, tiling = repr(tree_name), _shape(tree_shape), rule._tiling
        if tree is not None:
            tiling.check(tree, where)
        counts = ([tree[axis] for axis in tiling.stacked] if tree is not None
                  else self._stack_counts(rule, values, stored_shapes or {}, where))
        first = _piece_names(rule, values, (0,) * len(counts))
        # An ordered rule's pieces are its slices, each of the chunk's shape: no pattern is one piece.
        sizes = (None if rule.order else self._concat_sizes(rule, tree, stored_shapes, first, where)
                 ) or (None,) * len(first)
        own = [None if tree is None else tiling.piece_shape(tree, size) for size in sizes]
        slices = {(p, j): rule._slice(p, j) for p, j in rule.order}
        pieces = []
        for index in itertools.product(*(range(c) for c in counts)):
            names = _piece_names(rule, values, index)
            if rule.order:  # each slice a piece of its own, in the order's turn
                shape = None if tree is None else tiling.piece_shape(tree, rule._chunk_shape[0])
                stored = [(names[p], self._piece_transform(slices[p, j], names[p], shape, stored_shapes, where))
                          for p, j in rule.order]
            else:
                stored = [(name, self._piece_transform(rule, name, shape, stored_shapes, where))
                          for name, shape in zip(names, own)]
            pieces += tiling.place(index, stored)
        quantized = getattr(stored_shapes, "quantized", {})
        if quantized:
            pieces = [dataclasses.replace(p, quantized=quantized.get(p.stored)) for p in pieces]
        return assemble(tree, pieces, where)

    def _piece_transform(self, rule: Rule, name: str, tree_shape: tuple[int, ...] | None,
                         stored_shapes: MappingABC[str, Sequence[int]] | None, where: str) -> Transform:
        """The transform of the stored tensor ``name``, a piece of ``tree_shape`` when known."""
        stored_shape = None if stored_shapes is None else stored_shapes.get(name)
        if tree_shape is None and stored_shape is None:
            raise MappingError(f"{where}: the stored tensor {name!r} is missing")
        try:
            return rule.resolve(stored_shape=stored_shape, tree_shape=tree_shape, dims=self.dims,
                                undeclared=self.undeclared)
        except MappingError as e:
            if self.undeclared is not None and str(e) == self.undeclared:
                raise  # the same for every leaf it stops: not located, so they are said once
            raise MappingError(f"{where} ({name!r}): {e}") from None

    def _stack_counts(self, rule: Rule, values: MappingABC[str, str],
                      stored_shapes: MappingABC[str, Sequence[int]], where: str) -> list[int]:
        """How many indices each stacked placeholder takes (in the order of their axes), from
        the stored names present."""
        pattern = _pattern(_fill(rule.stored_patterns[0], values, keep=True), "stored")[0]
        seen: dict[str, set[str]] = {p: set() for p in rule._stacked_placeholders}
        for name in stored_shapes:
            match = pattern.fullmatch(name)
            index = None if match is None else rule._stack_index(match.groupdict(), values)
            for found, i in zip(seen.values(), index or ()):
                found.add(i)
        counts = []
        for placeholder, found in seen.items():
            strided = rule.strided.get(placeholder)
            known = None if strided is None else strided.count(0 if placeholder in rule._inner.values()
                                                                else strided.k(values))
            expected = {str(i) for i in range(len(found) if known is None else known)}
            if found != expected:
                raise MappingError(f"{where}: stacked {{{placeholder}}} takes the values "
                                   f"{sorted(found, key=lambda v: (len(v), v))}, not 0..n-1"
                                   + ("" if known is None else f" (n = {known})"))
            counts.append(len(expected))
        return counts

    def _concat_sizes(self, rule: Rule, tree: tuple[int, ...] | None,
                      stored_shapes: MappingABC[str, Sequence[int]] | None, first: list[str],
                      where: str) -> tuple[int, ...] | None:
        """The concatenated pieces' sizes along the concat axis (``None``: no concat), from
        the first stored pieces (``first``) where present, else the declared sizes."""
        if not rule.concat:
            return None
        axis, spec = next(iter(rule.concat.items()))
        actual = None
        if stored_shapes is not None and all(name in stored_shapes for name in first):
            piece_axis = rule._tiling.concat_piece_axis
            actual = [rule.resolve(stored_shape=stored_shapes[name], dims=self.dims,
                                   undeclared=self.undeclared).tree_shape[piece_axis] for name in first]
        return _sizes(spec, actual, None if tree is None else tree[axis], self.dims,
                      f"{where}: concat {axis}", add=True, undeclared=self.undeclared)

    def tree_shapes(self, stored_shapes: MappingABC[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """The tree leaves a checkpoint's tensors make and their shapes (from headers alone,
        e.g. ``ost.metadata(path).tensors``): the skeleton of a target, before shardings."""
        stored_shapes = self.stored_view(stored_shapes)
        bad = self.unmapped(stored_shapes, "stored")
        if bad:
            raise MappingError(f"no single rule maps the stored names: {', '.join(sorted(bad))}")
        leaves = dict.fromkeys(leaf for name in stored_shapes for leaf in self.tree_names(name))
        return {**{leaf: self.assembly(leaf, stored_shapes=stored_shapes).shape for leaf in leaves},
                **{leaf: constant.shape for leaf, constant in self.constants.items()}}

    def map_specs(self, specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], dict[str, Assembly]]:
        """Tree-named specs → stored specs, and each tree leaf's ``Assembly``."""
        bad = self.unmapped(s.name for s in specs)
        if bad:
            # One error listing every offender; _find explains the first one.
            try:
                self._find(bad[0], "tree")
            except MappingError as e:
                raise MappingError(f"{e} (unmapped or ambiguous: {', '.join(bad)})") from None
        stored_specs, assemblies, owner, taken = {}, {}, {}, {}
        for spec in specs:
            assembly = self.assembly(spec.name, tree_shape=spec.shape)
            assemblies[spec.name] = assembly
            for piece in assembly.pieces:
                takes = piece.transform.takes
                dtype = spec.dtype if piece.transform.dtype is None else dtype_for_numpy(piece.transform.dtype)
                stored = TensorSpec(piece.stored, dtype, piece.transform.stored_shape)
                if piece.stored in owner and not (takes and piece.stored in taken and takes not in taken[piece.stored]
                                                  and stored_specs[piece.stored] == stored):
                    raise MappingError(
                        f"tree leaves {owner[piece.stored]!r} and {spec.name!r} both map to {piece.stored!r}"
                        + (" (the same part of it, or as tensors of different shapes or dtypes)" if takes else ""))
                owner[piece.stored] = spec.name
                stored_specs[piece.stored] = stored
                if takes:
                    last = max(axis for axis, _ in takes)  # the axes after it may be split otherwise
                    taken.setdefault(piece.stored, {})[takes] = (piece.transform.perm,
                                                                 piece.transform._reshaped_shape[:last + 1])
        for name, parts in taken.items():
            _check_parts(name, parts)
        return list(stored_specs.values()), assemblies


def _check_parts(name: str, parts: MappingABC[tuple[tuple[int, int], ...],
                                               tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Refuses a save that has leaves for some parts of the stored tensor ``name`` only (each
    part: the ``(axis, index)`` pairs a piece takes of the reshaped piece's shape, given with
    the transpose and the reshaped shape through the last taken axis, which fix what the
    indices are): the stored tensor would hold garbage where the missing parts go."""
    axes = {tuple(axis for axis, _ in takes) for takes in parts}
    shapes = set(parts.values())
    if len(axes) != 1 or len(shapes) != 1:
        raise MappingError(f"the stored tensor {name!r} is taken apart along different axes "
                           f"{sorted(axes)} or of different shapes {sorted(s for _, s in shapes)}")
    (taken,), ((_, shape),) = axes, shapes
    missing = [tuple(zip(taken, index)) for index in itertools.product(*(range(shape[a]) for a in taken))
               if tuple(zip(taken, index)) not in parts]
    if missing:
        raise MappingError(f"the stored tensor {name!r} cannot be written: no tree leaf holds its part(s) "
                           + ", ".join(" ".join(f"index {i} of axis {a}" for a, i in m) for m in missing[:8])
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                           + " (the saved tree must hold every leaf that takes a part of it)")


def _one_tensor_per_leaf(hits: Sequence[tuple[Rule, Any]]) -> bool:
    """Whether the rules that map a stored name agree: one rule, or several that each take a
    part of it (or ordered slices of it) into a leaf of its own."""
    return len(hits) == 1 or (len(hits) > 1 and all(rule.take or rule.order for rule, _ in hits))


def _piece_names(rule: Rule, values: MappingABC[str, str], index: Sequence[int]) -> list[str]:
    """The stored names of the pieces at stack ``index`` of the leaf with placeholder ``values``."""
    filled = rule._stored_values(values, index)
    return [_fill(pattern, filled) for pattern in rule.stored_patterns]
