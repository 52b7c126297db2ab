"""A checkpoint's tensors as one or more quantization schemes read them: each quantized
tensor as its dequantized twin, what it is read from gone.

A release may quantize modules differently (compressed-tensors' config groups:
INT4 experts beside FP8 attention), so a mapping takes several schemes; each
finds its own tensors, and a tensor two of them would read is refused rather
than read by the first.

Pure: no devices, no files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning.group_quantization import NVFP4, GroupQuantized, IntQuantized, MXFP4Packed
from orbax_safetensors.planning.quantization import FP8, MXFP4, Quantized

Quantization = FP8 | MXFP4 | IntQuantized | NVFP4 | MXFP4Packed
QuantizedTensor = Quantized | GroupQuantized
_SCHEMES = (FP8, MXFP4, IntQuantized, NVFP4, MXFP4Packed)


def schemes(quantization: Quantization | Sequence[Quantization] | None) -> tuple[Quantization, ...]:
    """``Mapping(quantization=...)`` as a tuple of schemes (none, one, or several)."""
    if quantization is None:
        return ()
    found = (quantization,) if isinstance(quantization, _SCHEMES) else tuple(quantization)
    wrong = [s for s in found if not isinstance(s, _SCHEMES)]
    if wrong:
        raise MappingError(f"quantization {wrong[0]!r}: one of {', '.join(t.__name__ for t in _SCHEMES)}, "
                           "or a sequence of them")
    return found


class Dequantized(dict):
    """A checkpoint's tensor shapes as its schemes read them (name → shape): each
    quantized tensor as its dequantized twin, what it is read from gone; ``quantized``
    says what each twin is read from."""

    quantized: dict[str, QuantizedTensor]


def dequantized(found_by: Sequence[Quantization], shapes: Mapping[str, Sequence[int]]) -> Dequantized:
    """``shapes`` (a checkpoint's) as the schemes ``found_by`` read them; a quantized tensor
    whose parameters do not fit its scheme, or that two schemes would read, is an error
    naming them, before anything is read."""
    found: dict[str, QuantizedTensor] = {}
    for scheme in found_by:
        for name in shapes:
            twin = scheme.twin(name)
            q = None if twin is None else scheme.find(twin, shapes)
            if q is None:
                continue
            if twin in found and found[twin] != q:
                raise MappingError(f"{twin!r} is read by two quantization schemes, {found[twin].scheme} "
                                   f"and {scheme}: give them targets that part them (only=...)")
            found[twin] = q
    read = {stored for q in found.values() for stored in q.stored + q.dropped}
    view = Dequantized((name, shape) for name, shape in shapes.items() if name not in read)
    view.update((twin, q.shape) for twin, q in found.items())
    view.quantized = found
    return view
