"""How a tree leaf is assembled from stored tensors: ``Assembly``, ``Piece``, ``Tiling``.

A leaf of a mapped tree need not be one stored tensor. A scanned model
(MaxText, ``nn.scan``) keeps every layer in one kernel that a Hugging Face
checkpoint stores as one tensor per layer; a fused QKV kernel is three stored
projections side by side. The leaf is then an ``Assembly`` of *pieces*: each
``Piece`` is one stored tensor with the block of the leaf it fills and the
``Transform`` between the two. A ``Tiling`` says where the pieces of a rule go:

1. stacked axes: a piece holds one index of each (layer ``i`` at index ``i``),
   so the piece itself lacks those axes;
2. a concat axis: the pieces of one stack index follow each other along it,
   each as long as its own tree shape says.

``assemble`` checks that the pieces tile the leaf. The leaf is kept as its
pieces, never as one array: a device's box of the leaf meets only some pieces
(a layer-sharded device only its own layers'), and ``Piece.part`` tells which
part of that box each one holds, in its own coordinates, so a sharded load
still reads only the bytes each device holds. Which stored names make a leaf,
and each piece's transform, are the rules' business (``planning.rules``).

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning.boxes import Box, bounding_box, full_box, intersect
from orbax_safetensors.planning.dequantized import QuantizedTensor
from orbax_safetensors.planning.transforms import Transform


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stored tensor's place in a tree leaf: the block ``region`` of the leaf, whose
    ``stacked`` axes (one index each) the piece itself does not have. ``quantized``: the
    stored tensor is the dequantized twin of these quantized values and their parameters."""

    stored: str
    transform: Transform
    region: Box
    stacked: tuple[int, ...] = ()
    quantized: QuantizedTensor | None = None

    @property
    def stored_tensors(self) -> tuple[str, ...]:
        """The checkpoint's tensors the piece is read from."""
        return (self.stored,) if self.quantized is None else self.quantized.stored

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
class Constant:
    """A tree leaf no stored tensor holds, ``value`` throughout: a parameter one side keeps
    and the other does not. MaxText's DeepSeek-V4 has an ``mhc_norm`` scale its release lacks
    (the release normalises there without a weight), ones. A load fills it; a save writes
    nothing for it and refuses a leaf that holds anything else, which the checkpoint could
    not keep."""

    shape: tuple[int, ...]
    value: float
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Assembly:
    """A tree leaf of ``shape`` made of the stored tensors ``pieces``, which tile it, or of
    none: a ``constant``."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    constant: Constant | None = None

    @property
    def transform(self) -> Transform | None:
        """The transform when one stored tensor, as stored, is the whole leaf, else ``None``."""
        if len(self.pieces) == 1 and not self.pieces[0].stacked and self.pieces[0].quantized is None:
            return self.pieces[0].transform
        return None


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Where the pieces of a leaf sit: ``stacked`` leaf axes (ascending), of which a piece
    holds one index each, and at most one ``concat`` leaf axis along which the pieces of
    one stack index follow each other."""

    stacked: tuple[int, ...] = ()
    concat: int | None = None

    @property
    def concat_piece_axis(self) -> int | None:
        """The concat axis among a piece's own axes (the stacked ones left out)."""
        if self.concat is None:
            return None
        return self.concat - sum(axis < self.concat for axis in self.stacked)

    def check(self, shape: tuple[int, ...], where: str) -> None:
        """That a leaf of ``shape`` has the stacked and concat axes."""
        axes = self.stacked + (() if self.concat is None else (self.concat,))
        if any(axis >= len(shape) for axis in axes):
            raise MappingError(f"{where}: shape {shape} has no axis {max(axes)}")

    def piece_shape(self, shape: tuple[int, ...], size: int | None) -> tuple[int, ...]:
        """A piece's shape in a leaf of ``shape``: without the stacked axes, ``size`` on
        the concat axis (``None``: no concat)."""
        own = [s for axis, s in enumerate(shape) if axis not in self.stacked]
        axis = self.concat_piece_axis
        if axis is not None and size is not None:
            own[axis] = size
        return tuple(own)

    def place(self, index: Sequence[int], stored: Iterable[tuple[str, Transform]]) -> list[Piece]:
        """The pieces at stack ``index`` (one index per stacked axis), ``stored`` (name,
        transform) in concat order."""
        pieces, offset, axis = [], 0, self.concat_piece_axis
        for name, transform in stored:
            region = list(full_box(transform.tree_shape))
            if axis is not None:
                size = transform.tree_shape[axis]
                region[axis] = (offset, offset + size)
                offset += size
            for stacked, i in zip(self.stacked, index):
                region.insert(stacked, (i, i + 1))
            pieces.append(Piece(name, transform, tuple(region), self.stacked))
        return pieces


def assemble(shape: tuple[int, ...] | None, pieces: Sequence[Piece], where: str) -> Assembly:
    """The leaf ``pieces`` tile: of ``shape`` when it is known (checked: the pieces span all
    of it), else as large as the pieces span."""
    if shape is None:
        return Assembly(tuple(b for _, b in _bounds(pieces)), tuple(pieces))
    if pieces and _bounds(pieces) != full_box(shape):
        raise MappingError(f"{where}: its pieces span {_bounds(pieces)}, not the shape {shape}")
    return Assembly(shape, tuple(pieces))


def _bounds(pieces: Sequence[Piece]) -> Box:
    return bounding_box([p.region for p in pieces])
