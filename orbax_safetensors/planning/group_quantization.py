"""Group-scaled codes read as the values they stand for: ``IntQuantized`` and ``NVFP4``.

Most quantized releases on the Hub are not FP8 blocks: they are written by
compressed-tensors (``quant_method: "compressed-tensors"``: Kimi-K2's INT4
experts, the "-W4A16", "-W8A8", "-FP8-dynamic" and "-NVFP4" releases) or by
NVIDIA ModelOpt (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``). Each
stores a ``Linear`` weight as small codes along its input axis with a scale
per group of them (and, for asymmetric integers, a zero point per group):

* ``IntQuantized(bits, group, symmetric, packed=True)``: compressed-tensors'
  ``pack-quantized``. ``X.weight_packed`` (I32) holds ``32 // bits`` codes a
  word, element ``i`` at bits ``i * bits`` (so a little-endian word's bytes
  hold consecutive codes, low nibble first), each ``code + 2 ** (bits - 1)``.
  ``X.weight_scale`` is per group of ``group`` codes, per channel or per
  tensor; an asymmetric ``X.weight_zero_point`` is packed the same way along
  the *output* axis (one word holds eight rows' zero points of a group).
  ``packed=False``: ``int-quantized``, ``X.weight`` stored as I8.
* ``NVFP4(layout)``: two E2M1 codes a byte (low nibble first), an FP8 E4M3
  scale per 16 codes and an F32 second-level scale. The two layouts apply it
  in opposite directions: compressed-tensors (``X.weight_packed``,
  ``X.weight_global_scale``) divides the group scale by it, ModelOpt
  (``X.weight``, ``X.weight_scale_2``) multiplies.

A value is ``(code - zero) * scale`` computed in float32 in the reference
libraries' own order (NVFP4: the group scale is divided or multiplied first,
then the code times it), so a float32 load equals them bit for bit and a
bfloat16 one is that product rounded once, as transformers' bfloat16 load of
the same release computes it. The tensor read (the *twin*) is ``X.weight`` in
the release's ``[out, in]``; the module's activation parameters
(``input_scale``, ``input_global_scale``...) are not values of the twin and
are left out of what a load reads.

Boxes are pure math, as for ``FP8``: a box of the twin reads the words that
hold its codes and only the scale and zero-point groups it touches; a group
cut by a box (between devices or processes) is read by each side.

Pure: no devices, no files.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from orbax_safetensors.errors import MappingError
from orbax_safetensors.format import DTYPES, DType
from orbax_safetensors.format.dtypes import float_range
from orbax_safetensors.planning.boxes import Box, box_shape, box_size
from orbax_safetensors.planning.quantization import (
    E2M1,
    E2M1_PAIRS,
    activation_parameters,
    check_pattern,
    kept_activations,
    in_float32,
    nonfinite_problem,
    reads_module,
    scale_values,
)
from orbax_safetensors.planning.transforms import copy_into

_CHUNK = 1 << 16  # values decoded at once: their float32 (256 KiB) stays in cache


class _GroupScheme:
    """What the group schemes share: the layouts they read, their tensors' names, and
    finding a module's codes and scales."""

    layouts: tuple[str, ...] = ()
    scales_suffix = ".weight_scale"

    def __post_init__(self):
        layout = getattr(self, "layout", None)
        if layout not in (self.layouts or (None,)):
            raise MappingError(f"{type(self).__name__} layout {layout!r}: " + " or ".join(map(repr, self.layouts)))
        _check_group(self, self.group)

    def twin(self, name: str) -> str | None:
        """The twin a stored ``name`` would be the codes of."""
        if not name.endswith(self.codes_suffix):
            return None
        module = name[:-len(self.codes_suffix)]
        return module + ".weight" if _module(self, module + ".weight") is not None else None

    def kept_tensors(self, weight: str) -> tuple[tuple[str, str, bool], ...]:
        """What a kept weight ``weight`` (``X.weight``) is stored as: ``(stored name, suffix of
        its tree leaf, transposed as the kernel)`` each. The codes are transposed with the
        kernel (their packing runs along the input axis, inside each stored element); the
        scales, zero points and second-level scales stay as stored."""
        module = weight[:-len(".weight")]
        codes = self.codes_suffix
        kept = [(module + codes, codes[len(".weight"):], True), (module + self.scales_suffix, "_scale", False)]
        kept += [(module + suffix, "_" + suffix.split(".", 1)[1].removeprefix("weight_"), False)
                 for suffix in self._kept_parameters]
        return (*kept, *kept_activations(weight, self.activations))

    _kept_parameters: tuple[str, ...] = ()

    def _stored_pair(self, name: str, shapes: Mapping[str, Sequence[int]]
                     ) -> tuple[str, StoredTensor, StoredTensor] | None:
        """The module of twin ``name``, its codes and its scales, where ``shapes`` has both."""
        module = _module(self, name)
        if module is None or module + self.codes_suffix not in shapes or module + self.scales_suffix not in shapes:
            return None
        return module, _stored(module + self.codes_suffix, shapes), _stored(module + self.scales_suffix, shapes)


@dataclasses.dataclass(frozen=True)
class IntQuantized(_GroupScheme):
    """Integer codes with a scale (and an optional zero point) per group, as
    compressed-tensors writes them: ``packed=True`` is its ``pack-quantized``
    format (``X.weight_packed``, I32), ``packed=False`` its ``int-quantized``
    (``X.weight``, I8); both read as ``X.weight``.

    ``group``: codes per scale along the input axis (the config's
    ``group_size``); ``None``: a scale per output channel or one per tensor, as
    the scale's shape says. A grouped width is the scales' (``groups * group``),
    never inferred from the words; an ungrouped packed one is checked against the
    ``X.weight_shape`` tensor compressed-tensors writes, as the words only bound
    it. ``symmetric=False`` reads ``X.weight_zero_point``. ``only``: a regular
    expression the module name (``X``) must match, for a config whose groups
    quantize different modules differently (its ``re:`` targets); ``None``: any.
    ``activations``: as ``FP8``'s (a static W8A8 release's ``input_scale``).
    """

    bits: int = 4
    group: int | None = None
    symmetric: bool = True
    packed: bool = True
    only: str | None = None
    activations: tuple[str, ...] = ()
    scale_dtypes = ("F32", "BF16", "F16")

    @property
    def _kept_parameters(self) -> tuple[str, ...]:
        return ((() if self.symmetric else (".weight_zero_point",))
                + ((".weight_shape",) if self.packed else ()))

    def __post_init__(self):
        if self.bits not in ((1, 2, 4, 8) if self.packed else (8,)):
            raise MappingError(f"IntQuantized bits {self.bits!r}: read are 1, 2, 4 or 8 packed, 8 unpacked "
                               "(codes that straddle a word's bytes are not)")
        super().__post_init__()

    @property
    def codes_suffix(self) -> str:
        return ".weight_packed" if self.packed else ".weight"

    @property
    def value_dtypes(self) -> tuple[str, ...]:
        return ("I32",) if self.packed else ("I8",)

    @property
    def per_code(self) -> int:
        """Codes per stored element."""
        return 32 // self.bits if self.packed else 1

    def find(self, name: str, shapes: Mapping[str, Sequence[int]]) -> GroupQuantized | None:
        pair = self._stored_pair(name, shapes)
        if pair is None:
            return None
        module, codes, scales = pair
        zero = None if self.symmetric else _required(module + ".weight_zero_point", shapes, self)
        recorded = module + ".weight_shape"
        return GroupQuantized(
            self, name, codes, scales, zero=zero,
            recorded_shape=(_stored(recorded, shapes)
                            if self.packed and self.group is None and recorded in shapes else None),
            dropped=activation_parameters(name, shapes, (recorded,) if self.packed and self.group is not None else ()))


@dataclasses.dataclass(frozen=True)
class NVFP4(_GroupScheme):
    """NVFP4: E2M1 codes two a byte (the even one in the low nibble), an FP8 E4M3 scale
    per 16 of them and an F32 second-level scale, read as ``X.weight``.

    ``layout="compressed-tensors"`` (``nvfp4-pack-quantized``): ``X.weight_packed``,
    ``X.weight_scale``, ``X.weight_global_scale``; a value is
    ``code * (scale / global_scale)``. ``layout="modelopt"`` (ModelOpt's HF export):
    ``X.weight``, ``X.weight_scale``, ``X.weight_scale_2``; a value is
    ``code * (scale * scale_2)``, and its code 0b1000 reads as +0.0 where
    compressed-tensors reads -0.0 (each library's own table). ``only``: as
    ``IntQuantized``'s. ``activations``: as ``FP8``'s (compressed-tensors' NVFP4 stores
    ``input_global_scale``, ModelOpt's ``input_scale``).
    """

    layout: str = "compressed-tensors"
    group: int = 16
    only: str | None = None
    activations: tuple[str, ...] = ()
    scale_dtypes = ("F8_E4M3",)
    value_dtypes = ("U8",)
    per_code = 2
    layouts = ("compressed-tensors", "modelopt")

    @property
    def codes_suffix(self) -> str:
        return ".weight_packed" if self.layout == "compressed-tensors" else ".weight"

    @property
    def second_suffix(self) -> str:
        return ".weight_global_scale" if self.layout == "compressed-tensors" else ".weight_scale_2"

    @property
    def _kept_parameters(self) -> tuple[str, ...]:
        return (self.second_suffix,)

    def find(self, name: str, shapes: Mapping[str, Sequence[int]]) -> GroupQuantized | None:
        pair = self._stored_pair(name, shapes)
        if pair is None:
            return None
        module, codes, scales = pair
        return GroupQuantized(self, name, codes, scales, second=_required(module + self.second_suffix, shapes, self),
                              dropped=activation_parameters(name, shapes))


@dataclasses.dataclass(frozen=True)
class MXFP4Packed(_GroupScheme):
    """MXFP4 codes packed along a ``Linear`` weight's input axis: E2M1 two a byte (the even
    one in the low nibble) and an E8M0 exponent per 32 (``2 ** (byte - 127)``), read as
    ``X.weight`` ``[out, in]``: DeepSeek-V4's experts (``layout="deepseek-v4"``:
    ``X.weight`` stored I8, ``X.scale``) and compressed-tensors' ``mxfp4-pack-quantized``
    (``layout="compressed-tensors"``: ``X.weight_packed`` U8, ``X.weight_scale``). Exact in
    float32 (a code times a power of two). gpt-oss's own layout (``*_blocks``,
    ``*_scales``) is ``MXFP4``. ``only``, ``activations``: as ``NVFP4``'s.
    """

    layout: str = "deepseek-v4"
    group: int = 32
    only: str | None = None
    activations: tuple[str, ...] = ()
    scale_dtypes = ("F8_E8M0", "U8")
    value_dtypes = ("I8", "U8")
    per_code = 2
    layouts = ("deepseek-v4", "compressed-tensors")

    @property
    def codes_suffix(self) -> str:
        """What the module's name takes to name its codes."""
        return ".weight" if self.layout == "deepseek-v4" else ".weight_packed"

    @property
    def scales_suffix(self) -> str:
        """What the module's name takes to name its scales (V4's beside the weight)."""
        return ".scale" if self.layout == "deepseek-v4" else ".weight_scale"

    def find(self, name: str, shapes: Mapping[str, Sequence[int]]) -> GroupQuantized | None:
        pair = self._stored_pair(name, shapes)
        if pair is None:
            return None
        _, codes, scales = pair
        return GroupQuantized(self, name, codes, scales, dropped=activation_parameters(name, shapes))


GroupScheme = IntQuantized | NVFP4 | MXFP4Packed


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A stored tensor's name and shape."""

    name: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GroupQuantized:
    """One group-quantized tensor: its codes, scales and (where the scheme has them) zero
    points, second-level scale and recorded shape, all stored; ``twin`` is the name read.
    ``dropped``: the module's activation parameters (and an unread recorded shape), stored
    but no part of a load."""

    scheme: GroupScheme
    twin: str
    codes: StoredTensor
    scales: StoredTensor
    zero: StoredTensor | None = None
    second: StoredTensor | None = None
    recorded_shape: StoredTensor | None = None
    dropped: tuple[str, ...] = ()

    def __post_init__(self):
        self._check()

    @property
    def weight(self) -> str:
        """The stored codes (the tensor whose file a message names)."""
        return self.codes.name

    @property
    def parameters(self) -> tuple[StoredTensor, ...]:
        return tuple(p for p in (self.scales, self.zero, self.second, self.recorded_shape) if p is not None)

    @property
    def stored(self) -> tuple[str, ...]:
        """The tensors read: the codes first, then each parameter (``boxes``' order)."""
        return (self.codes.name,) + tuple(p.name for p in self.parameters)

    @property
    def dtype(self) -> DType:
        return DTYPES["F32"]

    @property
    def shape(self) -> tuple[int, ...]:
        codes = self.codes.shape
        group = self.scheme.group
        width = self._scale_axes[-1] * group if group is not None else codes[-1] * self.scheme.per_code
        return codes[:-1] + (width,)

    @functools.cached_property
    def _scale_axes(self) -> tuple[int, ...]:
        """The scale shape with one axis per value axis (per tensor: all ones; per channel
        ``(rows,)``: ``(rows, 1)``)."""
        scale, ndim = self.scales.shape, len(self.codes.shape)
        if math.prod(scale) == 1:
            return (1,) * ndim
        return tuple(scale) + (1,) * (ndim - len(scale))

    @functools.cached_property
    def _blocks(self) -> tuple[int, ...]:
        """Values per scale element on each axis: 1, the whole axis, or the group (last axis)."""
        group = self.scheme.group
        return tuple((group if group is not None and axis == len(self.codes.shape) - 1 else
                      1 if s != 1 else size)
                     for axis, (s, size) in enumerate(zip(self._scale_axes, self.shape)))

    def _check(self) -> None:
        name = type(self.scheme).__name__
        where = f"quantized tensor {self.twin!r} ({name}): {self.codes.name!r} {self.codes.shape} " \
                f"with scales {self.scales.name!r} {self.scales.shape}"
        codes = self.codes.shape
        if len(codes) < 1 or len(self.scales.shape) > len(codes):
            raise MappingError(f"{where}: the scales have more axes than the codes")
        scale = self._scale_axes
        group = self.scheme.group
        if group is not None:
            if len(self.scales.shape) != len(codes):
                raise MappingError(f"{where}: {name} group {group} needs scales [..., groups], one axis per "
                                   "axis of the codes")
            if -(-self.shape[-1] // self.scheme.per_code) != codes[-1]:
                raise MappingError(f"{where}: {scale[-1]} groups of {group} are {self.shape[-1]} values, "
                                   f"which {codes[-1]} stored elements of {self.scheme.per_code} codes do not hold")
        extent = self.shape
        lead = zip(scale[:-1], extent[:-1]) if group is not None else zip(scale, extent)
        if any(s not in (1, w) for s, w in lead):
            raise MappingError(f"{where}: each scale axis must be 1 or the weight's "
                               + (f"and the last {extent[-1]} // {group}" if group is not None else
                                  "(per channel or per tensor; a grouped scheme needs its group size)"))
        if self.zero is not None and self.zero.shape != self._zero_shape():
            raise MappingError(f"quantized tensor {self.twin!r}: zero points {self.zero.name!r} are "
                               f"{self.zero.shape}; {name} needs {self._zero_shape()}")
        if self.second is not None and math.prod(self.second.shape) != 1:
            raise MappingError(f"quantized tensor {self.twin!r}: {self.second.name!r} is {self.second.shape}; "
                               "one second-level scale per tensor is read")
        if self.recorded_shape is not None and self.recorded_shape.shape != (len(codes),):
            raise MappingError(f"quantized tensor {self.twin!r}: {self.recorded_shape.name!r} is "
                               f"{self.recorded_shape.shape}, not one size per axis ({len(codes)},)")

    def _zero_shape(self) -> tuple[int, ...]:
        """Zero points as stored: the scales' shape, packed along the rows where
        compressed-tensors packs them (grouped or per channel, not per tensor)."""
        scale = self.scales.shape
        if not self._packs_zero:
            return tuple(scale)
        return scale[:-2] + (-(-scale[-2] // self.scheme.per_code), scale[-1])

    @property
    def _packs_zero(self) -> bool:
        return (isinstance(self.scheme, IntQuantized) and self.scheme.packed and len(self.scales.shape) >= 2
                and math.prod(self.scales.shape) != 1)

    def check_dtypes(self, codes: Mapping[str, str]) -> None:
        """Refuses stored dtypes the scheme does not read as it says, before any read."""
        scheme = type(self.scheme).__name__
        accepted = {self.codes.name: self.scheme.value_dtypes, self.scales.name: self.scheme.scale_dtypes}
        if self.zero is not None:
            accepted[self.zero.name] = ("I32",) if self._packs_zero else ("I8", "I32")
        if self.second is not None:
            accepted[self.second.name] = ("F32",)
        if self.recorded_shape is not None:
            accepted[self.recorded_shape.name] = ("I64", "I32")
        for name, dtypes in accepted.items():
            if name in codes and codes[name] not in dtypes:
                raise MappingError(f"quantized tensor {self.twin!r}: {name!r} is stored as {codes[name]}; "
                                   f"{scheme} reads {' or '.join(dtypes)} there")

    def boxes(self, box: Box) -> tuple[Box, ...]:
        """The stored boxes of the codes and of each parameter (``stored``'s order) that
        give twin box ``box``: the words holding its codes, the groups it touches."""
        per = self.scheme.per_code
        grid = self._grid(box)
        (a, c) = box[-1]
        codes = tuple(box[:-1]) + (((a // per, -(-c // per)) if c > a else (0, 0)),)
        scales = tuple((0, 1) for _ in self.scales.shape) if math.prod(self.scales.shape) == 1 \
            else grid[:len(self.scales.shape)]
        out = [codes, scales]
        if self.zero is not None:
            if self._packs_zero:
                (r0, r1) = scales[-2]
                out.append(scales[:-2] + (((r0 // per, -(-r1 // per)) if r1 > r0 else (0, 0)),) + scales[-1:])
            else:
                out.append(scales)
        out += [tuple((0, s) for s in p.shape) for p in (self.second, self.recorded_shape) if p is not None]
        return tuple(out)

    def _grid(self, box: Box) -> Box:
        return tuple((a // b, -(-c // b)) if c > a else (0, 0) for (a, c), b in zip(box, self._blocks))

    def problem(self, index: int, values: np.ndarray) -> str | None:
        """What is wrong with parameter ``index`` (``parameters``' order) as read."""
        parameter = self.parameters[index]
        if parameter is self.recorded_shape:
            recorded = tuple(int(v) for v in np.asarray(values).reshape(-1))
            if recorded != self.shape:
                return (f"{parameter.name!r} records the weight as {list(recorded)}; its codes "
                        f"{self.codes.name!r} {self.codes.shape} read as {list(self.shape)}: a width that is "
                        f"not a multiple of {self.scheme.per_code} codes is not read")
            return None
        if parameter is self.zero:
            return None
        problem = nonfinite_problem(parameter.name, self.codes.name, values)
        if problem is None and parameter is self.second and isinstance(self.scheme, NVFP4) \
                and self.scheme.layout == "compressed-tensors" and not np.all(np.asarray(values, np.float32)):
            problem = (f"{parameter.name!r} is 0: compressed-tensors divides the scales of {self.codes.name!r} "
                       "by it, which makes every value infinite")
        return problem

    def dequantize(self, codes: np.ndarray, parameters: Sequence[np.ndarray], box: Box,
                   out: np.ndarray | None = None, check: Callable[[np.ndarray], None] | None = None,
                   file: str | None = None) -> np.ndarray:
        """Twin box ``box`` from the stored boxes ``boxes(box)`` names: the float32 values,
        a cache-sized run of rows at a time (a box's float32 is never whole), written into
        ``out`` (rounded once more to its dtype) when given, else a new float32 array.
        ``check`` sees the float32 values before they are rounded into ``out``, unless the
        box's largest scale times its largest code fits ``out``'s dtype (then no value can
        fail it: a bfloat16 load of finite scales is never checked chunk by chunk)."""
        out = np.empty(box_shape(box), np.float32) if out is None else out
        if box_size(box) == 0:
            return out
        boxes = self.boxes(box)
        params = dict(zip((p.name for p in self.parameters), parameters))
        grid = self._grid(box)
        scales = self._group_scales(params, boxes[1], grid)  # float32, grid-shaped
        zeros = None
        if self.zero is not None:
            zeros = self._zero_points(params[self.zero.name], boxes[2], grid)
        # Leading axes as rows: each row's scales (and zero points) once per row.
        rows_shape = box_shape(box)[:-1]
        rows = math.prod(rows_shape)
        last = box[-1][1] - box[-1][0]
        scales = self._per_row(scales, box, grid, rows)
        zeros = None if zeros is None else self._per_row(zeros, box, grid, rows)
        codes = np.asarray(codes).reshape(rows, -1)
        if check is not None and _fits(out.dtype, float(np.abs(scales).max()) * self._largest_code):
            check = None
        target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        flat = target.reshape(rows, last)
        skip = box[-1][0] - (box[-1][0] // self.scheme.per_code) * self.scheme.per_code
        step = max(1, _CHUNK // max(last, 1))
        columns = self._column_groups(box[-1], grid[-1][0])
        for i in range(0, rows, step):
            x = self._decode(codes[i:i + step])[:, skip:skip + last]
            with in_float32(self.scales.name, self.codes.name, file):
                if zeros is not None:
                    _apply(np.subtract, x, zeros[i:i + step] if zeros.shape[0] > 1 else zeros, columns)
                _apply(np.multiply, x, scales[i:i + step] if scales.shape[0] > 1 else scales, columns)
            if check is not None:
                check(x)
            flat[i:i + step] = x
        if target is not out:
            copy_into(out, target)
        return out

    @property
    def _largest_code(self) -> float:
        """The largest ``|code - zero|`` the scheme stores."""
        if not isinstance(self.scheme, IntQuantized):
            return 6.0  # E2M1's largest
        bits = self.scheme.bits
        return float((1 << bits) - 1 if self.zero is not None else 1 << (bits - 1))

    def _group_scales(self, params: dict[str, np.ndarray], box: Box, grid: Box) -> np.ndarray:
        """The scales of the groups ``grid`` names, in float32, with the second-level scale
        applied as the layout's reference does (one rounding, before the codes)."""
        scales = scale_values(params[self.scales.name])
        scales = scales.reshape(box_shape(grid) if math.prod(self.scales.shape) != 1 else (1,) * len(grid))
        if self.second is not None:
            second = np.float32(np.asarray(params[self.second.name]).reshape(-1)[0])
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # refused by ``problem``
                scales = scales / second if self.scheme.layout == "compressed-tensors" else scales * second
        return scales

    def _zero_points(self, stored: np.ndarray, box: Box, grid: Box) -> np.ndarray:
        """The zero points of the groups ``grid`` names, in float32 (unpacked along the rows
        where they are packed)."""
        zeros = np.asarray(stored)
        if not self._packs_zero:
            return zeros.astype(np.float32).reshape(box_shape(grid) if math.prod(self.scales.shape) != 1
                                                    else (1,) * len(grid))
        rows = np.swapaxes(zeros, -1, -2)  # [..., groups, words]: the packed axis last
        unpacked = np.swapaxes(_int_codes(np.ascontiguousarray(rows), self.scheme.bits), -1, -2)
        first = box[-2][0] * self.scheme.per_code
        (r0, r1) = grid[-2]
        return unpacked[..., r0 - first:r1 - first, :]

    def _per_row(self, values: np.ndarray, box: Box, grid: Box, rows: int) -> np.ndarray:
        """Grid-shaped ``values`` as one row per row of the box (``[rows, groups]``), or one
        row for all where no leading axis has its own."""
        for axis in range(len(box) - 1):
            if values.shape[axis] > 1 and self._blocks[axis] > 1:
                (a, c), b, (g, _) = box[axis], self._blocks[axis], grid[axis]
                values = np.take(values, np.arange(a, c) // b - g, axis=axis)
        if math.prod(values.shape[:-1]) == 1:
            return values.reshape(1, -1)
        return np.broadcast_to(values, box_shape(box)[:-1] + values.shape[-1:]).reshape(rows, -1)

    def _column_groups(self, columns: tuple[int, int], first_group: int) -> np.ndarray | int:
        """Each column's group among the scales read (an int: the groups are whole and
        aligned, so a reshape spreads them)."""
        a, c = columns
        b = self._blocks[-1]
        if b == 1:
            return np.arange(c - a)
        if a % b == 0 and (c - a) % b == 0 and b > 1:
            return b
        return np.arange(a, c) // b - first_group

    def _decode(self, codes: np.ndarray) -> np.ndarray:
        """Stored elements (rows of them) → their codes' values, float32, ``per_code`` each."""
        if isinstance(self.scheme, (NVFP4, MXFP4Packed)):
            table = _E2M1_PAIRS_PLUS_ZERO if self.scheme.layout == "modelopt" else E2M1_PAIRS
            return table[np.ascontiguousarray(codes).view(np.uint8)].view(np.float32).reshape(len(codes), -1)
        if not self.scheme.packed:
            return codes.astype(np.float32)
        return _int_codes(np.ascontiguousarray(codes), self.scheme.bits)


def _fits(dtype: np.dtype, bound: float) -> bool:
    """Whether every float32 value of magnitude up to ``bound`` keeps its meaning in ``dtype``
    (a float type holding everything from 0 to past ``bound``)."""
    try:
        limits = float_range(dtype)
    except ValueError:  # not a float type
        return False
    return np.isfinite(bound) and bound < limits.max and limits.positive_from is None


def _apply(op: np.ufunc, x: np.ndarray, values: np.ndarray, columns: np.ndarray | int) -> None:
    """``x = op(x, values)`` in place, ``values`` ``[rows, groups]`` spread over their groups'
    columns: broadcast over a reshape where the groups are whole (``columns`` the group size),
    gathered per column where a box cuts one."""
    if isinstance(columns, int):
        grouped = x.reshape(x.shape[0], -1, columns)
        op(grouped, values[:, :, None], out=grouped)
    else:
        op(x, values[:, columns], out=x)


def _int_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """Packed I32 words → their signed codes as float32, along the last axis: one gather of a
    byte's codes (8 bytes of float32 for two INT4 codes) per byte."""
    flat = words.astype("<i4", copy=False).view(np.uint8)
    if bits == 4:
        return _INT4_PAIRS[flat].view(np.float32)
    return _INT_TABLES[bits][flat].reshape(flat.shape[:-1] + (-1,))


def _int_table(bits: int) -> np.ndarray:
    """Byte → its ``8 // bits`` codes (lowest bits first), each minus the offset."""
    per, byte = 8 // bits, np.arange(256)
    codes = np.stack([(byte >> (bits * k)) & ((1 << bits) - 1) for k in range(per)], -1)
    return (codes - (1 << (bits - 1))).astype(np.float32)


_INT_TABLES = {bits: _int_table(bits) for bits in (1, 2, 4, 8)}
_INT4_PAIRS = np.ascontiguousarray(_INT_TABLES[4]).view(np.uint64)[:, 0]
_PLUS_ZERO = np.where(E2M1 == 0, np.float32(0), E2M1).astype(np.float32)
_E2M1_PAIRS_PLUS_ZERO = np.stack([_PLUS_ZERO[np.arange(256) & 0x0F], _PLUS_ZERO[np.arange(256) >> 4]],
                                 -1).view(np.uint64)[:, 0]


def _check_group(scheme: GroupScheme, group: int | None) -> None:
    if group is not None and (not isinstance(group, int) or group < 1):
        raise MappingError(f"{type(scheme).__name__} group {group!r}: a positive int")
    check_pattern(scheme)


def _module(scheme: GroupScheme, twin: str) -> str | None:
    """The module a twin ``X.weight`` is the weight of, if ``scheme`` reads it."""
    if not twin.endswith(".weight") or not reads_module(scheme, twin):
        return None
    return twin[:-len(".weight")]


def _stored(name: str, shapes: Mapping[str, Sequence[int]]) -> StoredTensor:
    return StoredTensor(name, tuple(shapes[name]))


def _required(name: str, shapes: Mapping[str, Sequence[int]], scheme: GroupScheme) -> StoredTensor:
    if name not in shapes:
        raise MappingError(f"quantized tensor {name.rsplit('.', 1)[0] + '.weight'!r}: {name!r} is missing "
                           f"({scheme} reads it)")
    return _stored(name, shapes)
