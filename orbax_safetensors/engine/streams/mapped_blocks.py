"""A block source seen through an ``ost.Mapping``, one box at a time, either way.

``convert`` moves a model between a Hugging Face checkpoint and a tree
checkpoint (MaxText's params, a Flax tree) without holding a whole tensor:
the output is written in boxes (storage chunks, row blocks), and each box is
assembled from exactly the boxes of the inputs it needs.

* ``TreeBlocks``: a source of stored tensors (a safetensors checkpoint) as
  the mapped tree's leaves. A box of a leaf meets some pieces (one layer's,
  one expert's stored tensor: ``Piece.part``); of each, the stored box that
  holds its part (``Transform.stored_box``) is read and transformed into the
  box (``Transform.to_tree``).
* ``StoredBlocks``: a source of tree leaves (an Orbax checkpoint) as the
  stored tensors the mapping makes of them. A box of a stored tensor comes
  from the smallest box of its leaf that gives it (``Transform.tree_box``),
  transformed back (``Transform.to_stored``), as a save through the mapping
  would write it; a stored tensor several leaves take parts of (``Rule.take``)
  from each of them, its part.

Both are block sources themselves (``BlockSource``: specs, metadata,
``read_block``), so the writers never know a mapping was there. Memory is
the box asked for, the boxes read for it and one transformed copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from orbax_safetensors.engine.streams.consolidate import BlockSource
from orbax_safetensors.errors import ArgumentError, MappingError, SafetensorsError
from orbax_safetensors.format import DType, TensorInfo, dtype_for_numpy, from_bytes, to_bytes
from orbax_safetensors.index import natural_key
from orbax_safetensors.planning import Assembly, Box, Mapping, Piece, TensorSpec, box_shape, intersect, relative_slices


def _info(spec: TensorSpec) -> TensorInfo:
    return TensorInfo(spec.name, spec.dtype, tuple(spec.shape), 0, spec.dtype.nbytes(spec.shape))


def _output_dtype(dtype: DType, wanted: np.dtype | None) -> DType:
    """``wanted`` for a floating-point tensor, else the tensor's own (ids stay integers)."""
    if wanted is None or not dtype.is_float:
        return dtype
    return dtype_for_numpy(wanted)


def _read(source: BlockSource, spec: TensorSpec, box: Box) -> np.ndarray:
    if spec.dtype.is_packed:
        raise ArgumentError(f"tensor {spec.name!r}: {spec.dtype.code} (sub-byte) tensors cannot be mapped "
                            "box by box")
    return from_bytes(source.read_block(_info(spec), box), spec.dtype, box_shape(box))


class TreeBlocks:
    """The stored tensors of ``source`` as the leaves ``mapping`` makes of them.

    ``dtype`` is the leaves' floating-point dtype (``None``: the stored one,
    float32 where the mapping scales). Leaves come in natural name order.
    """

    def __init__(self, source: BlockSource, mapping: Mapping, dtype: np.dtype | None = None):
        self._source = source
        self._stored = {spec.name: spec for spec in source.specs}
        shapes = mapping.stored_view({name: spec.shape for name, spec in self._stored.items()},
                                     {name: spec.dtype.code for name, spec in self._stored.items()})
        idle = mapping.idle_rules(shapes)
        if idle:
            raise MappingError("the checkpoint has no tensor for " + ", ".join(
                f"{rule.stored_patterns[0]!r} (→ {rule.tree!r})" for rule in idle[:5])
                + (f" and {len(idle) - 5} more rules" if len(idle) > 5 else "")
                + ": is the mapping for this model's family and config?")
        tree_shapes = mapping.tree_shapes(shapes)
        self.assemblies: dict[str, Assembly] = {
            leaf: mapping.assembly(leaf, tree_shape=shape, stored_shapes=shapes)
            for leaf, shape in tree_shapes.items()}
        self.specs = [TensorSpec(leaf, self._leaf_dtype(self.assemblies[leaf], dtype), tree_shapes[leaf])
                      for leaf in sorted(tree_shapes, key=natural_key)]
        self.metadata = source.metadata

    def _leaf_dtype(self, assembly: Assembly, wanted: np.dtype | None) -> DType:
        if assembly.constant is not None:
            return _output_dtype(dtype_for_numpy(np.dtype(assembly.constant.dtype)), wanted)
        first = assembly.pieces[0]
        stored = first.quantized.dtype if first.quantized is not None else self._stored[first.stored].dtype
        return _output_dtype(dtype_for_numpy(first.transform.tree_dtype(stored.numpy)), wanted)

    def stacked(self, leaf: str) -> tuple[int, ...]:
        """The leaf's axes along which its pieces are stacked (layers, experts)."""
        pieces = self.assemblies[leaf].pieces
        return pieces[0].stacked if pieces else ()

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview:
        """``block`` of leaf ``info.name`` (``None``: all of it), from the stored boxes it meets."""
        assembly = self.assemblies[info.name]
        block = tuple((0, s) for s in assembly.shape) if block is None else block
        if assembly.constant is not None:
            return to_bytes(np.full(box_shape(block), assembly.constant.value, info.dtype.numpy))
        out = np.empty(box_shape(block), info.dtype.numpy)
        for piece in assembly.pieces:
            part = piece.part(block)
            if part is not None:
                self._fill(out, block, piece, *part)
        return to_bytes(out)

    def _fill(self, out: np.ndarray, block: Box, piece: Piece, inside: Box, own: Box) -> None:
        stored_box = piece.transform.stored_box(own)
        quantized = piece.quantized
        if quantized is None:
            data = _read(self._source, self._stored[piece.stored], stored_box)
        else:  # the values and the parameters of the groups the box touches, dequantized
            weight, *parameters = (_read(self._source, self._stored[name], box)
                                   for name, box in zip(quantized.stored, quantized.boxes(stored_box)))
            for k, (name, values) in enumerate(zip(quantized.stored[1:], parameters)):
                problem = quantized.problem(k, values)
                if problem is not None:
                    raise SafetensorsError(problem, tensor=name)
            data = quantized.dequantize(weight, parameters, stored_box)
        # The piece's place in the block; its stacked axes (one index each) indexed away.
        into = tuple(a - b0 if axis in piece.stacked else slice(a - b0, b - b0)
                     for axis, ((a, b), (b0, _)) in enumerate(zip(inside, block)))
        piece.transform.to_tree(data, stored_box, own, out=out[into])


def _leaves_under(specs: Sequence[TensorSpec], prefixes: tuple[str, ...]) -> dict[str, TensorSpec]:
    """The arrays named one of ``prefixes`` + a leaf name, by leaf name (the first prefix's
    where two hold one: refused, as the one to write back cannot be chosen)."""
    leaves: dict[str, TensorSpec] = {}
    for spec in specs:
        prefix = next((p for p in prefixes if spec.name.startswith(p)), None)
        if prefix is None:
            continue
        leaf = spec.name[len(prefix):]
        if leaf in leaves:
            raise ArgumentError(f"the source holds {leaf!r} twice: as {leaves[leaf].name!r} and {spec.name!r}")
        leaves[leaf] = spec
    if not leaves:
        raise ArgumentError(f"the source holds no arrays under {' or '.join(map(repr, prefixes))}"
                            if any(prefixes) else "the source holds no arrays")
    return leaves


class StoredBlocks:
    """The leaves of ``source`` named ``prefix`` (or one of several) + a tree name of ``mapping``,
    as the stored tensors the mapping makes of them (other leaves are left out).

    ``dtype`` is the stored tensors' floating-point dtype (``None``: the
    mapping's, else the leaf's).

    A stored tensor of a stacked leaf (one layer of a scanned kernel) is read
    from a *band* of its leaf: a few consecutive layers (the first stacked
    axis), every other axis whole, kept until a tensor outside it is asked
    for. A source that decodes whole storage chunks, a chunk holding every
    layer (what MaxText's ``to_maxtext.py`` writes: its arrays sharded 16 ways
    on axis 0), then decodes each chunk once per band rather than once per
    layer and block. The bands of all stacked leaves together hold at most
    ``band_bytes``; the layers per band follow. No band where a source says
    (``chunks(name)``) its chunks hold one layer each (``convert``'s own
    output), nor where one layer of every leaf would not fit.
    """

    def __init__(self, source: BlockSource, mapping: Mapping, *, prefix: str | tuple[str, ...] = "",
                 dtype: np.dtype | None = None, band_bytes: int = 0):
        self._source = source
        self._leaves = _leaves_under(source.specs, (prefix,) if isinstance(prefix, str) else tuple(prefix))
        tree = [TensorSpec(name, spec.dtype, spec.shape) for name, spec in self._leaves.items()]
        stored, assemblies = mapping.map_specs(sorted(tree, key=lambda s: natural_key(s.name)))
        mapping.check_sizes({spec.name: spec.shape for spec in stored})  # written with the config beside them
        self._pieces: dict[str, list[tuple[str, Piece]]] = {}  # several where leaves take parts of one
        for leaf, assembly in assemblies.items():
            for piece in assembly.pieces:
                self._pieces.setdefault(piece.stored, []).append((leaf, piece))
        self.specs = [TensorSpec(s.name, _output_dtype(s.dtype, dtype), s.shape) for s in stored]
        self.metadata = source.metadata
        chunks = getattr(source, "chunks", None)
        stacked = {}
        for leaf, assembly in assemblies.items():
            axis = assembly.pieces[0].stacked[0] if assembly.pieces and assembly.pieces[0].stacked else None
            if axis is not None and (chunks is None or chunks(self._leaves[leaf].name)[axis] > 1):
                stacked[leaf] = axis  # a chunk per layer needs no band
        per_index = sum(self._leaves[leaf].dtype.nbytes(self._leaves[leaf].shape) // self._leaves[leaf].shape[axis]
                        for leaf, axis in stacked.items())
        self._band_size = band_bytes // max(per_index, 1)
        self._band_axis = stacked if self._band_size else {}  # not even one layer fits: no bands
        self._bands: dict[str, tuple[Box, np.ndarray]] = {}
        self._lock = threading.Lock()

    def read_block(self, info: TensorInfo, block: Box | None) -> memoryview:
        """``block`` of stored tensor ``info.name`` (``None``: all of it), from the smallest
        box of its leaf that gives it (of each leaf that takes a part of it, its part)."""
        block = tuple((0, s) for s in info.shape) if block is None else block
        out = np.empty(box_shape(block), info.dtype.numpy)
        for leaf, piece in self._pieces[info.name]:
            own = piece.transform.tree_box(block)
            if own is None:
                continue
            data = self._leaf_box(leaf, _in_leaf(piece, own)).reshape(box_shape(own))
            for stored_box, values in piece.transform.to_stored(own, data):
                part = intersect(stored_box, block)
                if part is not None:
                    out[relative_slices(part, block)] = values[relative_slices(part, stored_box)]
        return to_bytes(out)

    def _leaf_box(self, leaf: str, box: Box) -> np.ndarray:
        """``box`` of ``leaf``: from its band where it is stacked, else read as it is."""
        spec = self._leaves[leaf]
        axis = self._band_axis.get(leaf)
        if axis is None:
            return _read(self._source, spec, box)
        with self._lock:
            band = self._bands.get(leaf)
            if band is None or intersect(band[0], box) != box:
                self._bands.pop(leaf, None)  # freed before the next one is read
                start = box[axis][0] // self._band_size * self._band_size
                band_box = tuple((start, min(start + self._band_size, size)) if a == axis else (0, size)
                                 for a, size in enumerate(spec.shape))
                band = (band_box, _read(self._source, spec, band_box))
                self._bands[leaf] = band
        band_box, values = band
        return values[relative_slices(box, band_box)]


def _in_leaf(piece: Piece, own: Sequence[tuple[int, int]]) -> Box:
    """A box in the piece's own coordinates as a box of its leaf."""
    own_axes = iter(own)
    box = []
    for axis, (start, stop) in enumerate(piece.region):
        if axis in piece.stacked:
            box.append((start, stop))
        else:
            a, b = next(own_axes)
            box.append((start + a, start + b))
    return tuple(box)
