"""An independent numpy dequantizer: the ground truth the quantized-checkpoint tests hold
ours and the peers (transformers, MaxText) to.

Written from the formats' definitions, sharing nothing with
``orbax_safetensors.planning.quantization``:

* FP8 (DeepSeek-V3, Qwen3-FP8): ``value = float32(fp8) * float32(weight_scale_inv)``, one
  scale per block of ``block`` over the trailing axes; the last block of an axis may be partial
  (the scale grid is ``ceil(size / block)``). ``block=None``: per-tensor or per-channel scales
  that broadcast against the weight.
* MXFP4 (gpt-oss, OCP microscaling): each byte holds two e2m1 values (sign, 2 exponent bits,
  1 mantissa bit; the even element in the low nibble), each group of ``group`` values shares an
  E8M0 exponent byte: ``value = e2m1 * 2 ** (byte - 127)``. gpt-oss's tensors ``[..., rows,
  groups, 16]`` stand for ``[..., groups * 32, rows]`` (the last two axes swapped).

The products are computed in float64 (exact for these operands) and rounded once to float32,
then, for a bfloat16 result, once more: what a float32 product rounded to the target does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def fp8_reference(weight: np.ndarray, scales: np.ndarray, block: tuple[int, ...] | None) -> np.ndarray:
    """The float32 values of an FP8 ``weight`` with ``scales`` per ``block`` (``None``: broadcast)."""
    x = weight.astype(np.float64)
    s = np.asarray(scales, np.float64)
    if block is None:
        s = s.reshape(s.shape + (1,) * (x.ndim - s.ndim)) if s.size > 1 else s.reshape(())
        return (x * s).astype(np.float32)
    lead = x.ndim - len(block)
    for axis, b in enumerate(block, start=lead):
        s = np.repeat(s, b, axis=axis).take(np.arange(x.shape[axis]), axis=axis)
    return (x * s).astype(np.float32)


def e2m1(nibbles: np.ndarray) -> np.ndarray:
    """e2m1 codes (0..15) as float64, from their bits: subnormal when the exponent bits are 0."""
    nibbles = nibbles.astype(np.int64)
    sign = np.where(nibbles & 0b1000, -1.0, 1.0)
    exponent, mantissa = (nibbles >> 1) & 0b11, nibbles & 0b1
    magnitude = np.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * 2.0 ** (exponent - 1))
    return sign * magnitude


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray, *, swap_last: bool = True) -> np.ndarray:
    """The float32 values of MXFP4 ``blocks`` ``[..., G, group // 2]`` with ``scales`` ``[..., G]``."""
    pairs = np.stack([e2m1(blocks & 0x0F), e2m1(blocks >> 4)], axis=-1)  # even element: low nibble
    values = pairs.reshape(blocks.shape[:-1] + (-1,)) * np.exp2(scales.astype(np.float64) - 127)[..., None]
    with np.errstate(over="ignore"):  # 6 * 2 ** 127 is inf in float32
        flat = values.reshape(values.shape[:-2] + (-1,)).astype(np.float32)
    return np.swapaxes(flat, -1, -2) if swap_last else flat


def random_fp8(rng: np.random.Generator, shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Random FP8 values (every finite code, NaN excluded) and float32 scales on ``grid``,
    scales that are not bfloat16 numbers (so rounding them first would show)."""
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
    scales = (rng.uniform(0.5, 2.0, grid) * 2.0 ** rng.integers(-12, -4, grid)).astype(np.float32)
    return codes.view(ml_dtypes.float8_e4m3fn), scales


def random_mxfp4(rng: np.random.Generator, lead: tuple[int, ...], groups: int, group: int = 32,
                 exponents: tuple[int, int] = (118, 134)) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 ``[*lead, groups, group // 2]`` bytes (every nibble) and exponent bytes."""
    blocks = rng.integers(0, 256, (*lead, groups, group // 2), dtype=np.uint8)
    scales = rng.integers(*exponents, (*lead, groups), dtype=np.uint8)
    return blocks, scales


def bits(x: np.ndarray) -> np.ndarray:
    """``x``'s bit patterns (an unsigned view), to compare arrays bit for bit (-0.0 ≠ 0.0)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def pack_int(codes: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
    """Signed ``bits``-bit ``codes`` packed into int32 words along ``axis``, as compressed-tensors'
    ``pack-quantized`` defines them: code ``i`` of a run at bits ``i * bits`` of the run's bit
    stream (``32 // bits`` a word), each stored as ``code + 2 ** (bits - 1)``; a short last word
    is padded with zero bits."""
    moved = np.moveaxis(np.asarray(codes, np.int64) + (1 << (bits - 1)), axis, -1)
    per = 32 // bits
    pad = -moved.shape[-1] % per
    moved = np.concatenate([moved, np.zeros(moved.shape[:-1] + (pad,), np.int64)], -1)
    runs = moved.reshape(moved.shape[:-1] + (-1, per))
    words = (runs << (bits * np.arange(per))).sum(-1)
    # Contiguous: safetensors' numpy save_file writes a strided array's memory, not its values.
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis))


def int_reference(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                  blocks: tuple[int, ...]) -> np.ndarray:
    """The float32 values ``(code - zero) * scale`` of integer ``codes`` with ``scales`` (and
    ``zeros``) per block of ``blocks`` values on each axis."""
    def spread(p: np.ndarray) -> np.ndarray:
        p = np.asarray(p, np.float64).reshape(p.shape + (1,) * (codes.ndim - p.ndim))
        for axis, b in enumerate(blocks):
            p = np.repeat(p, b, axis=axis)[tuple(slice(0, n) for n in codes.shape[:axis + 1])]
        return p
    x = codes.astype(np.float64) - (0 if zeros is None else spread(zeros))
    return (x * spread(scales)).astype(np.float32)


def nvfp4_reference(nibbles: np.ndarray, scales: np.ndarray, second: float, layout: str) -> np.ndarray:
    """The float32 values of NVFP4 codes ``nibbles`` ``[..., n]`` (0..15) with FP8 ``scales``
    ``[..., n // 16]`` and the second-level scale: compressed-tensors computes the group scale
    ``float32(scale / global_scale)`` then ``code * that``, ModelOpt
    ``float32(scale * scale_2)`` then ``code * that``, each rounded to float32 (float64
    products and quotients of these operands round once to the same bits), and ModelOpt's
    code 0b1000 is +0.0."""
    s = scales.astype(np.float64)
    group = (s / np.float64(np.float32(second)) if layout == "compressed-tensors"
             else s * np.float64(np.float32(second))).astype(np.float32)
    values = e2m1(nibbles)
    if layout == "modelopt":
        values = np.where(values == 0, 0.0, values)
    return (values * np.repeat(group.astype(np.float64), 16, axis=-1)).astype(np.float32)


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """Codes 0..15 two a byte along the last axis, the even one in the low nibble."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
