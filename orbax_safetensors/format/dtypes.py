"""The dtype table of the safetensors spec, mapped onto numpy via ``ml_dtypes``.

Every dtype the current spec defines is here, including the sub-byte ones.
In memory, ``ml_dtypes`` keeps one F4/F6 value per byte; on disk the spec packs
them densely. We pack them as a little-endian bit stream (value ``k`` occupies
bits ``[k*b, (k+1)*b)`` counting from the least significant bit of byte 0), which
for F4 is the "low nibble first" order torch's ``float4_e2m1fn_x2`` uses. A
tensor of a sub-byte dtype must hold a whole number of bytes, exactly as the
Rust crate demands; anything else is a misaligned slice.

It also says which casts to a target's dtype keep values (``cast_kind``), the
rule a load follows under ``LoadOptions(casting="same_kind")``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from orbax_safetensors.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class DType:
    """One safetensors dtype: its header code, its width and its numpy type."""

    code: str
    bits: int
    numpy: np.dtype

    @functools.cached_property
    def little(self) -> np.dtype:
        """The numpy type of the values as a file holds them: little-endian."""
        return self.numpy.newbyteorder("<")

    @property
    def is_packed(self) -> bool:
        """Whether several values share a byte on disk (F4, F6_*)."""
        return self.bits < 8

    @property
    def is_float(self) -> bool:
        """A floating-point type (``ml_dtypes``' bfloat16 and float8s too, whose numpy kind is "V")."""
        return _kind(self.numpy) == "f"

    def nbytes(self, shape: Sequence[int]) -> int:
        """On-disk size of a tensor of ``shape``; ValueError if not whole bytes."""
        if self.bits >= 8:
            return math.prod(shape) * (self.bits // 8)
        nbits = math.prod(shape) * self.bits
        if nbits % 8:
            raise ArgumentError(
                f"{math.prod(shape)} values of {self.code} ({self.bits} bits each) "
                "do not fill a whole number of bytes"
            )
        return nbits // 8


_TABLE = (
    DType("BOOL", 8, np.dtype(np.bool_)),
    DType("U8", 8, np.dtype(np.uint8)),
    DType("I8", 8, np.dtype(np.int8)),
    DType("I16", 16, np.dtype(np.int16)),
    DType("U16", 16, np.dtype(np.uint16)),
    DType("I32", 32, np.dtype(np.int32)),
    DType("U32", 32, np.dtype(np.uint32)),
    DType("I64", 64, np.dtype(np.int64)),
    DType("U64", 64, np.dtype(np.uint64)),
    DType("F16", 16, np.dtype(np.float16)),
    DType("BF16", 16, np.dtype(ml_dtypes.bfloat16)),
    DType("F32", 32, np.dtype(np.float32)),
    DType("F64", 64, np.dtype(np.float64)),
    DType("C64", 64, np.dtype(np.complex64)),
    DType("F8_E4M3", 8, np.dtype(ml_dtypes.float8_e4m3fn)),
    DType("F8_E5M2", 8, np.dtype(ml_dtypes.float8_e5m2)),
    DType("F8_E4M3FNUZ", 8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    DType("F8_E5M2FNUZ", 8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    DType("F8_E8M0", 8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    DType("F4", 4, np.dtype(ml_dtypes.float4_e2m1fn)),
    DType("F6_E2M3", 6, np.dtype(ml_dtypes.float6_e2m3fn)),
    DType("F6_E3M2", 6, np.dtype(ml_dtypes.float6_e3m2fn)),
)

DTYPES: dict[str, DType] = {d.code: d for d in _TABLE}
# The order the Rust crate writes a file's tensors in: its ``Dtype`` enum, highest first (which
# is widest first, so every tensor starts aligned to its own width), then by name (safetensors
# 0.8, observed; F6, which its TensorSpec cannot name, among the sub-byte ones).
_WRITE_ORDER = {code: rank for rank, code in enumerate((
    "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ", "F8_E4M3FNUZ",
    "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F6_E3M2", "F6_E2M3", "F4", "BOOL"))}


def write_order(dtype: DType) -> int:
    """Where tensors of ``dtype`` go in a file the Rust crate writes (lower first)."""
    return _WRITE_ORDER[dtype.code]
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _TABLE}


def dtype_for_numpy(dtype: np.dtype | type) -> DType:
    """The safetensors dtype that stores ``dtype``; ValueError if none does."""
    if isinstance(dtype, np.dtype) and dtype in _BY_NUMPY:  # an array's, as a rule: no conversion
        return _BY_NUMPY[dtype]
    np_dtype = np.dtype(dtype)
    found = _BY_NUMPY.get(np_dtype.newbyteorder("=")) or _BY_NUMPY.get(np_dtype)
    if found is None:
        raise ArgumentError(
            f"dtype {np_dtype} has no safetensors equivalent; supported: "
            + ", ".join(str(d.numpy) for d in _TABLE)
        )
    return found


def to_bytes(array: np.ndarray) -> memoryview:
    """The on-disk bytes of ``array``: little-endian, C order, packed if sub-byte.

    Byte-aligned arrays that are already little-endian and contiguous are
    returned as a view, without a copy.
    """
    if _exports_bytes(array.dtype) and array.flags.c_contiguous and array.size:
        return memoryview(array).cast("B")  # a sixth of the cost of the general path (100 000 tensors)
    dtype = dtype_for_numpy(array.dtype)
    array = np.ascontiguousarray(array, dtype=dtype.little)
    if dtype.is_packed:
        return memoryview(_pack(array, dtype))
    return memoryview(array.reshape(-1).view(np.uint8))


@functools.lru_cache(maxsize=None)
def _exports_bytes(dtype: np.dtype) -> bool:
    """Whether an array of ``dtype`` is stored as its own buffer's bytes, which Python's buffer
    protocol exports (numpy's builtin numbers in little-endian order; not ml_dtypes' types,
    which it cannot export, nor packed ones)."""
    try:
        stored = dtype_for_numpy(dtype)
    except (TypeError, ValueError):
        return False
    return dtype.isbuiltin == 1 and dtype == stored.little and not stored.is_packed


_BYTE = np.dtype(np.uint8)


def from_bytes(buffer, dtype: DType, shape: Sequence[int]) -> np.ndarray:
    """An array of ``shape`` viewing (or, if packed, unpacking) ``buffer``."""
    raw = (buffer if type(buffer) is np.ndarray and buffer.dtype is _BYTE and buffer.ndim == 1
           else np.frombuffer(buffer, dtype=np.uint8))  # a byte array already: no second view
    if raw.size != dtype.nbytes(shape):
        raise ArgumentError(
            f"{raw.size} bytes cannot hold {dtype.code} of shape {tuple(shape)}"
        )
    if dtype.is_packed:
        return _unpack(raw, dtype, math.prod(shape)).reshape(shape)
    values = raw.view(dtype.little)
    if values.dtype != dtype.numpy:  # a big-endian machine
        values = values.astype(dtype.numpy)
    return values.reshape(shape)


def _pack(array: np.ndarray, dtype: DType) -> np.ndarray:
    dtype.nbytes(array.shape)  # rejects a partial byte before any work
    codes = array.reshape(-1).view(np.uint8)
    bits = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, : dtype.bits]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _unpack(raw: np.ndarray, dtype: DType, count: int) -> np.ndarray:
    bits = np.unpackbits(raw, bitorder="little").reshape(count, dtype.bits)
    codes = np.packbits(bits, axis=1, bitorder="little").reshape(count)
    return codes.view(dtype.numpy)


# Casting on load -----------------------------------------------------------------------------
#
# A load converts each tensor to its target's dtype. ``numpy.astype`` does any conversion
# without a word: -300.0 into int8 is -44, NaN into int32 is INT_MIN, 200 into int8 is -56.
# Loading weights that silently became other numbers is worse than failing, so a load casts
# only where every value keeps its meaning unless asked (``LoadOptions.casting="unsafe"``).

def cast_kind(stored: np.dtype | type, target: np.dtype | type) -> str:
    """How a cast of ``stored`` values to ``target`` can change them, numpy's ``same_kind``
    rule extended to the ``ml_dtypes`` types (whose numpy kind is ``"V"``):

    * ``"same"``: no cast.
    * ``"safe"``: every value keeps its meaning: float ↔ float (bfloat16, float16, fp8 ...:
      precision may be lost, as ``same_kind`` allows), bool → anything, int → float,
      int → an int type holding every stored value (int8 → int32, uint8 → int16), real →
      complex.
    * ``"check_range"``: int → an int type (or bool) holding only some of the stored values
      (int32 → int8, int8 → uint8, uint64 → int64, int → bool), and float or int → a float type
      whose finite range (or infinities, NaN, sign) does not cover the stored type's
      (float32 → float16 or bfloat16 or fp8, float64 → float32, int32 → float16): safe exactly
      when the values fit, which only the values can tell (``first_out_of_range``). A float
      that does not fit would become inf, NaN or the largest value, silently.
    * ``"unsafe"``: float → int or bool (truncated; NaN and inf become arbitrary integers),
      complex → real (the imaginary part dropped), and anything this does not know.
    """
    stored, target = np.dtype(stored), np.dtype(target)
    if stored == target:
        return "same"
    have, want = _kind(stored), _kind(target)
    if have == "b" or (have in "iuf" and want == "c") or (have == want == "c"):
        return "safe"
    if have in "iuf" and want == "f":
        return "safe" if _float_covers(target, stored) else "check_range"
    if have in "iu" and want in "iub":
        lo, hi = int_range(stored)
        tlo, thi = int_range(target)
        return "safe" if tlo <= lo and hi <= thi else "check_range"
    return "unsafe"


@dataclasses.dataclass(frozen=True)
class FloatRange:
    """What a float type can hold: its largest finite value, whether it has infinities and
    NaN, and its smallest value above zero when it holds no others (``float8_e8m0fnu``, a
    scale type: powers of two only, no sign, no zero)."""

    max: float
    has_inf: bool
    has_nan: bool
    positive_from: float | None

    def holds(self, values: np.ndarray) -> np.ndarray:
        """Which of ``values`` (float64) a cast to this type keeps the meaning of."""
        finite = np.isfinite(values)
        ok = np.where(np.isnan(values), self.has_nan, np.where(finite, np.abs(values) <= self.max, self.has_inf))
        if self.positive_from is not None:
            ok &= np.isnan(values) | (values >= self.positive_from)
        return ok


@functools.lru_cache(maxsize=None)
def float_range(dtype: np.dtype) -> FloatRange:
    dtype = np.dtype(dtype)
    info = ml_dtypes.finfo(dtype)
    special = np.array([np.inf, np.nan, -1.0], np.float64).astype(dtype).astype(np.float64)
    positive = None if special[2] == -1.0 else float(info.tiny)
    return FloatRange(float(info.max), bool(np.isposinf(special[0])), bool(np.isnan(special[1])), positive)


def _float_covers(target: np.dtype, stored: np.dtype) -> bool:
    """Whether every value of ``stored`` (an int or float type) keeps its meaning in the float
    type ``target`` (rounded, as ``same_kind`` allows, but never to inf, NaN or another sign)."""
    want = float_range(target)
    if _kind(stored) in "iu":
        lo, hi = int_range(stored)
        return want.positive_from is None and max(-lo, hi) <= want.max
    have = float_range(stored)
    return (have.max <= want.max and (want.has_inf or not have.has_inf)
            and (want.has_nan or not have.has_nan)
            and (want.positive_from is None or have.positive_from is not None))


def int_range(dtype: np.dtype | type) -> tuple[int, int]:
    """The smallest and largest value of an integer (or bool: 0, 1) dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 0, 1
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def first_out_of_range(values: np.ndarray, target: np.dtype | type):
    """The first of the int or float ``values`` (C order) that ``target`` cannot hold (that a
    cast would change beyond rounding: overflow to inf, NaN, or the largest value), or ``None``
    when all fit; a min and a max unless one does not."""
    if values.size == 0:
        return None
    target = np.dtype(target)
    flat = values.reshape(-1)
    if _kind(target) == "f":
        limits = float_range(target)
        lo, hi = float(values.min()), float(values.max())
        if (np.isfinite(lo) and np.isfinite(hi) and -limits.max <= lo and hi <= limits.max
                and (limits.positive_from is None or lo >= limits.positive_from)):
            return None
        bad = np.flatnonzero(~limits.holds(flat.astype(np.float64)))
        return flat[bad[0]].item() if bad.size else None
    lo, hi = int_range(target)
    if lo <= int(values.min()) and int(values.max()) <= hi:
        return None
    return flat[np.flatnonzero((flat < lo) | (flat > hi))[0]].item()


def _kind(dtype: np.dtype) -> str:
    """numpy's kind letter ("b", "i", "u", "f", "c"), also for ``ml_dtypes`` types; "?" else."""
    if dtype.kind in "biufc":
        return dtype.kind
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except ValueError:
        pass
    try:
        return "i" if ml_dtypes.iinfo(dtype).min < 0 else "u"
    except ValueError:
        return "?"
