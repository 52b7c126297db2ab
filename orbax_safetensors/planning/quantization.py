"""Quantized stored tensors read as the values they stand for: ``FP8``, ``MXFP4``, ``Quantized``.

What people download is often quantized. DeepSeek-V3 and the Qwen3 "-FP8"
releases store a ``Linear`` weight as ``F8_E4M3`` values with a float32
``weight_scale_inv`` per block of ``weight_block_size`` (128 × 128): the value
is ``fp8 * scale`` (it multiplies, despite the name). gpt-oss stores its
experts as MXFP4: ``*_blocks`` (U8, two e2m1 values a byte, the even element
in the low nibble) and ``*_scales`` (U8 exponents, ``2 ** (byte - 127)``, one
per 32 values of the last axis).

A quantized tensor stands for its *dequantized twin*: the tensor a bfloat16
release of the same model stores, same name (``X.weight``; ``X`` for
``X_blocks`` + ``X_scales``) and shape (gpt-oss's twin has its last two axes
swapped, as transformers' dequantization returns it). Mapping rules are
written for the twin, so one mapping reads both releases. Reading a box of
the twin is pure box math, as the rest of a mapped read:

1. ``Quantized.boxes``: the twin box → the box of the quantized values and the
   box of the scales that cover it (a box that cuts a scale block reads the
   whole scale of that block, never more than the blocks it touches);
2. ``Quantized.dequantize``: those values → the twin box, in float32 (the
   product rounded once; a bfloat16 target rounds it again, as MaxText's and
   transformers' dequantizers do).

``FP8(block=None)`` takes per-tensor or per-channel scales (each scale axis
1 or the weight's own size); with a block, the scale grid must be
``ceil(weight / block)`` on each axis, a partial last block included: the
block is never inferred from the shapes (``[576, 7168]`` with scales
``[5, 56]`` is block 128 with a partial last row block, not block 115).

Pure: no devices, no files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Mapping as MappingABC

import ml_dtypes
import numpy as np

from orbax_safetensors.errors import MappingError, SafetensorsError
from orbax_safetensors.format import DTYPES, DType
from orbax_safetensors.planning.boxes import Box, box_shape, box_size
from orbax_safetensors.planning.transforms import copy_into

# e2m1: sign, 2 exponent bits, 1 mantissa bit; nibble → value.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 np.float32)
# byte → its two values (low nibble first) as one 8-byte item: one gather decodes a byte.
E2M1_PAIRS = np.stack([E2M1[np.arange(256) & 0x0F], E2M1[np.arange(256) >> 4]], -1).view(np.uint64)[:, 0]


@dataclasses.dataclass(frozen=True)
class FP8:
    """FP8 weights (``F8_E4M3``) with float32 scales, stored as ``<weight><scale_suffix>``:
    one per block of ``block`` (a config's ``weight_block_size``, e.g. ``(128, 128)``;
    the last axes of the weight, a partial last block included), or with ``None`` one per
    tensor or per channel (each scale axis 1 or the weight's own size). compressed-tensors'
    ``float-quantized`` and ModelOpt's FP8 name the scales ``weight_scale``
    (``scale_suffix="_scale"``); a suffix that starts with a dot names them beside the module,
    not the weight: DeepSeek-V4's ``X.scale`` for ``X.weight`` (``scale_suffix=".scale"``),
    E8M0 powers of two. ``only``: a regular expression the module name (``X`` of
    ``X.weight``) must match, for a release whose modules are quantized differently.
    ``activations``: the activation parameters each module stores (``"input_scale"`` for
    static FP8), which a load of the values leaves out and a kept release keeps.

    ``ost.Mapping(rules, quantization=ost.FP8((128, 128)))`` reads each such weight as
    ``float32(fp8) * scale``, rounded once more into the target's dtype: what MaxText's
    ``dequantize_fp8`` computes. The block is never inferred from the shapes: transformers
    infers it from ``weight.shape / scale.shape``, which fails on DeepSeek-V3's own
    ``kv_a_proj_with_mqa`` ([576, 7168], scales [5, 56]) and is silently wrong where the
    division works with another block. ``ost.mappings.for_config`` builds it from the config.
    """

    block: tuple[int, ...] | None = None
    scale_suffix: str = "_scale_inv"
    only: str | None = None
    activations: tuple[str, ...] = ()
    # Scales as releases store them (float32; bfloat16 and float16 too; E8M0 powers of two, as
    # their own dtype or as bytes): an integer scale is no FP8 scale (an I32 one loaded values
    # up to 4e11).
    scale_dtypes = ("F32", "BF16", "F16", "F8_E8M0", "U8")
    value_dtypes = None  # the values are cast to float32 whatever they are

    def __post_init__(self):
        if self.block is not None:
            block = tuple(self.block)
            if not block or any(not isinstance(b, int) or b < 1 for b in block):
                raise MappingError(f"FP8 block {self.block!r}: one positive int per axis")
            object.__setattr__(self, "block", block)
        if not self.scale_suffix:
            raise MappingError("FP8: an empty scale suffix")
        check_pattern(self)

    def find(self, name: str, shapes: MappingABC[str, Sequence[int]]) -> Quantized | None:
        """The quantized tensor behind twin ``name`` in a checkpoint of ``shapes``, if any."""
        scales = self.scales_name(name)
        if scales is None or name not in shapes or scales not in shapes or not reads_module(self, name):
            return None
        return Quantized(self, name, scales, tuple(shapes[name]), tuple(shapes[scales]),
                         activation_parameters(name, shapes))

    def twin(self, name: str) -> str | None:
        """The twin a stored ``name`` would be the values of (if its scales are there)."""
        return None if name.endswith(self.scale_suffix) else name

    def kept_tensors(self, weight: str) -> tuple[tuple[str, str, bool], ...]:
        """What a kept weight ``weight`` is stored as: ``(stored name, suffix of its tree
        leaf, transposed as the kernel)`` each; block scales are transposed with it, per-channel
        and per-tensor ones stay as stored."""
        return ((weight, "", True), (self.scales_name(weight), "_scale", self.block is not None),
                *kept_activations(weight, self.activations))

    def scales_name(self, name: str) -> str | None:
        """The name of weight ``name``'s scales (``None``: a name whose module has none)."""
        if not self.scale_suffix.startswith("."):
            return name + self.scale_suffix
        return name[:-len(".weight")] + self.scale_suffix if name.endswith(".weight") else None


@dataclasses.dataclass(frozen=True)
class MXFP4:
    """MXFP4 (OCP microscaling), as gpt-oss stores its experts: ``<name>_blocks`` (U8,
    ``[..., groups, group // 2]``, two e2m1 values a byte, the even one in the low nibble)
    and ``<name>_scales`` (U8 exponents, ``[..., groups]``: ``2 ** (byte - 127)``), read as
    ``<name>``. Exact in float32 (an e2m1 value times a power of two). ``swap_last``: the
    tensor read has its last two axes swapped, as transformers' dequantization returns
    gpt-oss's ``gate_up_proj`` (``[experts, hidden, 2 * intermediate]``) and ``down_proj``."""

    group: int = 32
    swap_last: bool = True
    # E8M0 exponents (U8, or the spec's own dtype) and e2m1 pairs a byte: a BF16 scale would
    # be decoded as bytes of another meaning.
    scale_dtypes = ("U8", "F8_E8M0")
    value_dtypes = ("U8",)

    def __post_init__(self):
        if not isinstance(self.group, int) or self.group < 2 or self.group % 2:
            raise MappingError(f"MXFP4 group {self.group!r}: a positive even int")

    def find(self, name: str, shapes: MappingABC[str, Sequence[int]]) -> Quantized | None:
        blocks, scales = name + "_blocks", name + "_scales"
        if blocks not in shapes or scales not in shapes:
            return None
        return Quantized(self, blocks, scales, tuple(shapes[blocks]), tuple(shapes[scales]))

    def twin(self, name: str) -> str | None:
        return name[:-len("_blocks")] if name.endswith("_blocks") else None

    def kept_tensors(self, twin: str) -> tuple[tuple[str, str, bool], ...]:
        """What a kept twin ``twin`` is stored as: its blocks and exponents, as stored."""
        return (twin + "_blocks", "_blocks", False), (twin + "_scales", "_scales", False)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """One quantized tensor: ``weight`` (its stored values) and ``scales``, both stored
    names, with their stored shapes; ``shape`` is the twin's. ``dropped``: stored tensors
    of the module that are no part of its values (activation scales), left out of a load.

    The protocol every quantized tensor keeps (``group_quantization.GroupQuantized`` too):
    ``stored`` (the values first, then the parameters read before them), ``boxes``,
    ``problem``, ``check_dtypes`` and ``dequantize``."""

    scheme: FP8 | MXFP4
    weight: str
    scales: str
    weight_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    dropped: tuple[str, ...] = ()

    def __post_init__(self):
        self._check()

    @property
    def stored(self) -> tuple[str, str]:
        return self.weight, self.scales

    @property
    def dtype(self) -> DType:
        """The twin's dtype: what ``dequantize`` computes in (the target's rounds once more)."""
        return DTYPES["F32"]

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self.scheme, FP8):
            return self.weight_shape
        shape = self.weight_shape[:-2] + (self.weight_shape[-2] * self.weight_shape[-1] * 2,)
        return _swapped(shape) if self.scheme.swap_last else shape

    @property
    def _blocks(self) -> tuple[int, ...]:
        """The scale block of each axis of the weight (FP8) or of the values (MXFP4, unswapped)."""
        if isinstance(self.scheme, MXFP4):
            return (1,) * (len(self.scale_shape) - 1) + (self.scheme.group,)
        if self.scheme.block is None:
            return tuple(w if s == 1 else 1 for w, s in zip(self.weight_shape, self._scale_axes))
        lead = len(self.weight_shape) - len(self.scheme.block)
        return (1,) * lead + self.scheme.block

    @property
    def _scale_axes(self) -> tuple[int, ...]:
        """The scale shape with one axis per weight axis (a per-tensor scale ``()`` or ``(1,)``
        becomes all ones; a per-channel ``(rows,)`` becomes ``(rows, 1)``)."""
        scale, ndim = self.scale_shape, len(self.weight_shape)
        if math.prod(scale) == 1:
            return (1,) * ndim
        if len(scale) < ndim:
            return tuple(scale) + (1,) * (ndim - len(scale))
        return tuple(scale)

    def check_dtypes(self, codes: MappingABC[str, str]) -> None:
        """Refuses stored dtypes (``codes``: name → dtype code) the scheme does not read as it
        says, before any read: the values would come out as another number, or numpy's
        broadcast error."""
        scheme = type(self.scheme).__name__
        for name, accepted in ((self.weight, self.scheme.value_dtypes), (self.scales, self.scheme.scale_dtypes)):
            code = codes.get(name)
            if accepted is not None and code is not None and code not in accepted:
                raise MappingError(f"quantized tensor {self.weight!r}: {name!r} is stored as {code}; "
                                   f"{scheme} reads {' or '.join(accepted)} there")

    def problem(self, index: int, scales: np.ndarray) -> str | None:
        """What is wrong with the scales read (``index`` 0, the one parameter; ``None``:
        nothing). An MXFP4 exponent byte 0xFF is NaN in the OCP MX spec."""
        if not isinstance(self.scheme, MXFP4):
            return nonfinite_problem(self.scales, self.weight, scales)
        bad = np.flatnonzero(np.asarray(scales).view(np.uint8).reshape(-1) == 0xFF)
        return None if not bad.size else _bad_scales(self.scales, self.weight, bad,
                                                     "exponent 0xFF (NaN in the MX spec)")

    def _check(self) -> None:
        where = f"quantized tensor {self.weight!r} {self.weight_shape} with scales {self.scales!r} {self.scale_shape}"
        if isinstance(self.scheme, MXFP4):
            if (len(self.weight_shape) < 2 or self.weight_shape[-1] * 2 != self.scheme.group
                    or self.weight_shape[:-1] != self.scale_shape
                    or (self.scheme.swap_last and len(self.weight_shape) < 3)):
                raise MappingError(f"{where}: MXFP4 needs blocks [..., groups, {self.scheme.group // 2}] and "
                                   "scales [..., groups]" + (" (at least 2 axes before the groups to swap)"
                                                             if self.scheme.swap_last else ""))
            return
        scale = self._scale_axes
        if len(scale) != len(self.weight_shape):
            raise MappingError(f"{where}: the scales have more axes than the weight")
        if self.scheme.block is None:
            if any(s not in (1, w) for s, w in zip(scale, self.weight_shape)):
                raise MappingError(f"{where}: without a block size each scale axis is 1 or the weight's "
                                   "(give FP8(block=...) as the config's weight_block_size says)")
            return
        if len(self.scheme.block) > len(self.weight_shape):
            raise MappingError(f"{where}: block {self.scheme.block} has more axes than the weight")
        expected = tuple(-(-w // b) for w, b in zip(self.weight_shape, self._blocks))
        if scale != expected:
            raise MappingError(f"{where}: block {self.scheme.block} needs scales {expected}")

    def boxes(self, box: Box) -> tuple[Box, Box]:
        """The stored boxes of the values and of the scales that give twin box ``box``."""
        values = self._unswapped(box)
        grid = self._grid(values)
        if isinstance(self.scheme, MXFP4):
            return grid + ((0, self.weight_shape[-1]),), grid
        if math.prod(self.scale_shape) == 1:  # one scale: every box needs it
            return values, tuple((0, 1) for _ in self.scale_shape)
        return values, grid[:len(self.scale_shape)]

    def _unswapped(self, box: Box) -> Box:
        """A twin box in the order the values are stored."""
        return _swapped(box) if isinstance(self.scheme, MXFP4) and self.scheme.swap_last else tuple(box)

    def _grid(self, values: Box) -> Box:
        """The scale blocks (one range per value axis) a box of the values touches."""
        return tuple((a // b, -(-c // b)) if c > a else (0, 0) for (a, c), b in zip(values, self._blocks))

    def dequantize(self, weight: np.ndarray, parameters: Sequence[np.ndarray], box: Box,
                   out: np.ndarray | None = None,
                   check: Callable[[np.ndarray], None] | None = None, file: str | None = None) -> np.ndarray:
        """Twin box ``box`` from the values and scales (``parameters``: one) ``boxes(box)``
        names: each value the float32 product, written into ``out`` (rounded once more to its dtype) when given,
        else a new float32 array. ``check`` sees the float32 products before they are rounded
        into ``out`` (the load's cast policy: a product past a float16 target's range is
        refused, as a stored float32 value would be, not made inf). A product past float32
        itself is refused whatever the target (``in_float32``; ``file``: the values' file,
        for its message). FP8 goes a cache-sized chunk at a time, so a load writes a
        bfloat16 leaf's buffer directly: the bits of casting the float32 box, without that box
        (a device's share of a DeepSeek-V3 expert stack is gigabytes of it)."""
        if box_size(box) == 0:
            return np.zeros(box_shape(box), np.float32) if out is None else out
        (scales,) = parameters
        weight_box, scale_box = self.boxes(box)
        values = self._unswapped(box)
        if isinstance(self.scheme, MXFP4):
            decoded = self._mxfp4(weight.reshape(box_shape(weight_box)), scales.reshape(box_shape(scale_box)), values,
                                  file)
            decoded = np.swapaxes(decoded, -1, -2) if self.scheme.swap_last else decoded
            if out is None:
                return decoded
            if check is not None:
                check(decoded)
            copy_into(out, decoded)  # a swapped view: cast in cache-sized tiles
            return out
        out = np.empty(box_shape(box), np.float32) if out is None else out
        grid = self._grid(values)
        s = scale_values(scales).reshape(
            box_shape(grid) if math.prod(self.scale_shape) != 1 else (1,) * len(values))
        # Every axis but the last: each index's scale row (a few rows per block; cheap).
        for axis in range(len(values) - 1):
            if s.shape[axis] > 1 and self._blocks[axis] > 1:
                (a, c), b, (g, _) = values[axis], self._blocks[axis], grid[axis]
                s = np.take(s, np.arange(a, c) // b - g, axis=axis)
        last = box_shape(values)[-1]
        rows = box_size(values) // last
        codes = weight.reshape(rows, last)
        s = s.reshape(1, -1) if math.prod(s.shape[:-1]) == 1 else np.broadcast_to(
            s, box_shape(values)[:-1] + s.shape[-1:]).reshape(rows, -1)
        target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        flat = target.reshape(rows, last)
        step = max(1, _CHUNK // last)
        for i in range(0, rows, step):  # in cache-sized chunks: a box's float32 is never whole
            x = _as_float32(codes[i:i + step])
            with in_float32(self.scales, self.weight, file):
                self._scale_last_axis(x, s[i:i + step] if s.shape[0] > 1 else s, values[-1], grid[-1][0])
            if check is not None:
                check(x)
            flat[i:i + step] = x
        if target is not out:
            out[...] = target
        return out

    def _scale_last_axis(self, x: np.ndarray, s: np.ndarray, columns: tuple[int, int], first_block: int) -> None:
        """``x *= s`` in place, ``s`` holding a scale per block of the last axis: its whole
        blocks as one broadcast product, a cut block at either end apart."""
        b = self._blocks[-1]
        if s.shape[-1] == 1 or b == 1:
            x *= s
            return
        a, c = columns
        head, tail = min(-(-a // b) * b, c) - a, max(c // b * b, a) - a
        if head:
            x[..., :head] *= s[..., :1]
        if tail > head:
            whole = x[..., head:tail]
            whole = whole.reshape(whole.shape[:-1] + ((tail - head) // b, b), copy=False)
            first = (a + head) // b - first_block
            whole *= s[..., first:first + whole.shape[-2], None]
        if c - a > tail >= head:
            x[..., tail:] *= s[..., -1:]

    def _mxfp4(self, raw: np.ndarray, exponents: np.ndarray, values: Box, file: str | None) -> np.ndarray:
        """The e2m1 pairs of ``raw`` times ``2 ** (exponent - 127)``, cut to ``values``'s last axis."""
        pairs = E2M1_PAIRS[raw.view(np.uint8)]
        decoded = pairs.view(np.float32)  # [..., group // 2 * 2]: low nibble, high nibble, ...
        with np.errstate(over="ignore"):  # 0xFF (NaN in the spec; a load refuses it first) is inf, as the reference's
            powers = np.ldexp(np.float32(1), exponents.view(np.uint8).astype(np.int32) - 127)
        with in_float32(self.scales, self.weight, file):
            decoded *= powers[..., None]
        flat = decoded.reshape(decoded.shape[:-2] + (-1,))
        (a, c), first = values[-1], (values[-1][0] // self.scheme.group) * self.scheme.group
        return flat[..., a - first:c - first]


@contextlib.contextmanager
def in_float32(scales: str, weight: str, file: str | None) -> Iterator[None]:
    """Products computed inside past float32's range refused: as inf they would pass any
    target's range check (float16 holds inf too) and load a damaged scale as infinities."""
    try:
        with np.errstate(over="raise"):
            yield
    except FloatingPointError:
        raise SafetensorsError(
            f"a value times its scale in {scales!r} is past float32's largest "
            f"({float(np.finfo(np.float32).max):.4g}), the dtype dequantized values are computed in: "
            "refusing to read it as inf (a scale that large is damaged, or not this scheme's)",
            file=file, tensor=weight) from None


def scale_values(scales: np.ndarray) -> np.ndarray:
    """Scales as read, in float32: E8M0 exponents stored as bytes (U8) are ``2 ** (byte - 127)``
    and their byte 0xFF NaN, as E8M0's own dtype reads them."""
    scales = np.asarray(scales)
    if scales.dtype == np.uint8:
        with np.errstate(over="ignore"):
            powers = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)
        return np.where(scales == 0xFF, np.float32(np.nan), powers).astype(np.float32)
    table = _BYTE_SCALES.get(scales.dtype)
    if table is not None:  # a byte's float32, looked up: a fifth of the cost of the cast
        return table[scales.view(np.uint8)]
    if scales.dtype == ml_dtypes.bfloat16:  # bfloat16 is float32's upper half: a shift, not a cast
        return (scales.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return scales.astype(np.float32, copy=False)


def nonfinite_problem(scales: str, weight: str, values: np.ndarray) -> str | None:
    """What is wrong with scales read (``None``: nothing): a NaN or infinite scale makes
    every value of its block NaN or inf, which is damage to say, not a result to load. One
    pass over the stored bytes where a byte pattern says it (E8M0 0xFF, E4M3 ±0x7F: the only
    NaNs of those types, which have no inf): a load checks every box's scales."""
    values = np.asarray(values)
    if values.dtype in _NAN_BYTES:
        mask, nan = _NAN_BYTES[values.dtype]
        codes = values.view(np.uint8).reshape(-1)
        bad = np.flatnonzero(codes & mask == nan)
    elif np.isfinite(values).all():
        return None
    else:
        bad = np.flatnonzero(~np.isfinite(values.reshape(-1)))
    return None if not bad.size else _bad_scales(scales, weight, bad, "NaN or infinite scales")


# The one-byte scale types whose NaNs are byte patterns (they have no inf): (mask, NaN bits).
_BYTE_SCALES = {np.dtype(t): np.arange(256, dtype=np.uint8).view(t).astype(np.float32)
                for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu)}
_NAN_BYTES = {np.dtype(np.uint8): (0xFF, 0xFF), np.dtype(ml_dtypes.float8_e8m0fnu): (0xFF, 0xFF),
              np.dtype(ml_dtypes.float8_e4m3fn): (0x7F, 0x7F)}


def _bad_scales(scales: str, weight: str, bad: np.ndarray, what: str) -> str:
    return (f"{scales!r} holds {bad.size} {what}, the first at flat index {int(bad[0])} "
            f"of the scales read; every value of {weight!r} it scales would be NaN or inf")


def check_pattern(scheme: object) -> None:
    """Refuses a scheme whose ``only`` is no regular expression, when it is made."""
    if scheme.only is not None:
        try:
            re.compile(scheme.only)
        except re.error as e:
            raise MappingError(f"{type(scheme).__name__} only={scheme.only!r}: not a regular expression ({e})")


def reads_module(scheme: object, twin: str) -> bool:
    """Whether ``scheme`` (its ``only``) reads weight ``twin`` (``X.weight``): ``only``
    matches the module name ``X``."""
    if scheme.only is None:
        return True
    return twin.endswith(".weight") and re.fullmatch(scheme.only, twin[:-len(".weight")]) is not None


# A quantized module's activation parameters (static FP8 and compressed-tensors' W8A8, NVFP4):
# written beside its weight, no part of its values.
ACTIVATION_PARAMETERS = ("input_scale", "input_global_scale", "input_zero_point", "output_scale",
                         "output_zero_point", "output_global_scale")


def kept_activations(weight: str, activations: Sequence[str]) -> tuple[tuple[str, str, bool], ...]:
    """A kept weight's activation parameters: ``X.input_scale`` → leaf suffix ``_input_scale``."""
    module = weight[:-len(".weight")]
    return tuple((f"{module}.{name}", f"_{name}", False) for name in activations)


def activation_parameters(twin: str, shapes: MappingABC[str, Sequence[int]], also: Sequence[str] = ()) -> tuple[str, ...]:
    """The activation parameters (and ``also``) stored beside weight ``twin`` (``X.weight``)."""
    module = twin[:-len(".weight")] if twin.endswith(".weight") else None
    names = [] if module is None else [f"{module}.{p}" for p in ACTIVATION_PARAMETERS]
    return tuple(n for n in names + list(also) if n in shapes)


_FP8_VALUES = {np.dtype(t): np.arange(256, dtype=np.uint8).view(t).astype(np.float32)
               for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)}
_CHUNK = 1 << 16  # values dequantized at once: their float32 (256 KiB) stays in cache


@functools.cache
def _fp8_pairs(dtype: np.dtype) -> np.ndarray:
    """Two FP8 codes (one uint16) → their two float32 values (one uint64): 512 KB, built once."""
    codes = np.arange(1 << 16)
    values = _FP8_VALUES[dtype]
    return np.stack([values[codes & 0xFF], values[codes >> 8]], -1).view(np.uint64)[:, 0]


def _as_float32(values: np.ndarray) -> np.ndarray:
    """``values`` as a new float32 array: FP8 through a table of its values, two codes a
    lookup where the bytes allow (exact; 10x faster than ml_dtypes' cast)."""
    table = _FP8_VALUES.get(values.dtype)
    if table is None:
        return values.astype(np.float32)
    codes = values.view(np.uint8)
    if (codes.ndim and codes.shape[-1] % 2 == 0 and codes.strides[-1] == 1 and codes.ctypes.data % 2 == 0
            and all(stride % 2 == 0 for stride in codes.strides[:-1])):
        return _fp8_pairs(values.dtype)[codes.view(np.uint16)].view(np.float32)
    return table[codes]


def _swapped(seq: Sequence) -> tuple:
    """``seq`` with its last two entries swapped (a shape or a box)."""
    seq = tuple(seq)
    return seq[:-2] + (seq[-1], seq[-2])


