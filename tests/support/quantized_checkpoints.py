"""Quantized checkpoints for the tests and ``bench/quantized.py``, and their numpy reference.

Four releases as people download them, scaled down, written once from random weights:

* ``write_deepseek``: FP8 block-scaled, DeepSeek-V3-shaped. Every ``Linear`` weight of the
  MLA attention (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
  ``o_proj``), of the dense MLP, of each routed expert and of the shared experts is stored
  ``F8_E4M3`` with a float32 ``weight_scale_inv`` per 128 × 128 block (``amax / 448``),
  partial last blocks included (``kv_a_proj_with_mqa`` has ``kv_lora_rank + rope = 576``
  rows); embeddings, norms and the router stay bf16 and ``e_score_correction_bias`` float32,
  as DeepSeek keeps them. ``config.json`` carries DeepSeek's ``quantization_config``.
* ``write_gpt_oss``: MXFP4, gpt-oss-shaped. The experts' ``gate_up_proj`` and
  ``down_proj`` are stored as ``*_blocks`` (U8 ``[experts, rows, groups, 16]``, two e2m1
  values a byte, the even element in the low nibble) and ``*_scales`` (U8 exponents
  ``[experts, rows, groups]``, one per 32 values); their biases, the attention (with its
  biases and sinks), the router, norms and embeddings are bf16.
* ``write_kimi_int4``: compressed-tensors ``pack-quantized`` INT4, DeepSeek-V3-shaped as
  Kimi-K2-Thinking ships it: the routed experts only (symmetric, a BF16 scale per 32 values
  along the input axis) as ``X.weight_packed`` (I32 ``[out, in / 8]``, code ``i`` of a word at
  bits ``4 i``, stored as ``q + 8``), ``X.weight_scale`` (BF16 ``[out, in / 32]``) and
  ``X.weight_shape`` (I64 ``[2]``); attention, shared experts, the dense MLP, the router,
  norms, embeddings and ``lm_head`` bf16 (its config's ``ignore``, ``KIMI_K2_IGNORE``).
* ``write_deepseek_nvfp4``: compressed-tensors ``nvfp4-pack-quantized``, DeepSeek-V3-shaped
  with *every* ``Linear`` weight (attention, routed and shared experts, dense MLP) NVFP4, as
  the all-Linear NVFP4 releases of DeepSeek-R1/V3 quantize them: ``X.weight_packed`` (U8
  ``[out, in / 2]``, the even element in the low nibble), ``X.weight_scale`` (F8_E4M3
  ``[out, in / 16]``), ``X.weight_global_scale`` and ``X.input_global_scale`` (F32 ``[1]``);
  the router, norms, embeddings and ``lm_head`` bf16.

  Both write random codes and scales (every code, no float weights behind them: what is
  measured is reading and decoding, not the quantizer) packed by the format's rule
  (``quantized_reference.pack_int`` / ``pack_nibbles``), fast enough for a 1 GB checkpoint;
  ``tests/support/compressed_checkpoints.py`` writes the same formats with compressed-tensors'
  own code, tiny.

``reference_twins`` reads a checkpoint's tensors as their twins, dequantized by
``tests/support/quantized_reference.py`` (the ground truth, independent of
``orbax_safetensors.planning.quantization``) or, for the bench's load-then-dequantize peer, by
``dequantize_fp8`` / ``dequantize_mxfp4``: whole tensors in float32, as a user (and MaxText's
scripts) write it: an FP8 value is ``float32(fp8) * float32(scale)``; an MXFP4 value is
``e2m1(nibble) * 2 ** (scale - 127)``. The compressed-tensors checkpoints' peer instead reads
torch tensors and hands each module to compressed-tensors 0.20.1's own decompression
(``compressors/base.py`` ``BaseCompressor.get_value_from_registry(format).decompress(state_dict,
scheme)``, the scale in its stored dtype, as transformers 5.24's ``CompressedTensorsDequantize``
calls it), bf16 out. Each quantized tensor reads as its *dequantized twin*: ``X.weight`` for
FP8, INT4 and NVFP4; ``X`` for ``X_blocks`` + ``X_scales``, with its last two axes swapped
(``[experts, in, out]``, as transformers' dequantization returns gpt-oss's experts).

Specs are plain dicts (``bench/quantized.py`` caches them as JSON).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from tests.support import quantized_reference

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
GROUP = 32  # MXFP4 values per scale
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
MXFP4_CONFIG = {"quant_method": "mxfp4"}
INT4_GROUP = 32  # Kimi-K2-Thinking's group_size
NVFP4_GROUP = 16  # NVFP4's values per FP8 scale
# Kimi-K2-Thinking's config.json: only the routed experts are int4 (the dense MLP is ``mlp.*_proj``).
KIMI_K2_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": KIMI_K2_IGNORE, "kv_cache_scheme": None}
# compressed-tensors 0.20.1's NVFP4 preset (quantization/quant_scheme.py ``NVFP4``) on every Linear.
_NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": NVFP4_GROUP}
NVFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {**_NVFP4_ARGS, "dynamic": False, "observer": "minmax"},
        "input_activations": {**_NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}
MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}

# DeepSeek-V3 (hidden 7168, 256 experts, 61 layers) and gpt-oss-20b (hidden 2880, 32 experts,
# 24 layers), scaled down; "1" stores about 1 GB, "tiny" a few MB. The tiny DeepSeek's hidden
# 320 and moe_intermediate 192 also cut column blocks.
DEEPSEEK = {
    "tiny": dict(hidden=320, heads=2, q_lora_rank=384, intermediate=640, moe_intermediate=192,
                 experts=8, layers=2, dense_layers=1, vocab=1024, max_shard_size="2MB"),
    "1": dict(hidden=1024, heads=8, q_lora_rank=384, intermediate=2816, moe_intermediate=512,
              experts=16, layers=29, dense_layers=1, vocab=32000, max_shard_size="200MB"),
}
# DeepSeek-V3's shape (as DEEPSEEK) with more routed experts, so that 4-bit experts store ~1 GB at "1".
KIMI_INT4 = {
    "tiny": DEEPSEEK["tiny"],
    "1": dict(DEEPSEEK["1"], experts=24),
}
DEEPSEEK_NVFP4 = {
    "tiny": DEEPSEEK["tiny"],
    "1": dict(DEEPSEEK["1"], experts=32),
}
GPT_OSS = {
    "tiny": dict(hidden=320, heads=4, kv_heads=2, head_dim=64, intermediate=192, experts=8,
                 layers=2, vocab=1024, max_shard_size="2MB"),
    "1": dict(hidden=2880, heads=16, kv_heads=4, head_dim=64, intermediate=2880, experts=8,
              layers=8, vocab=8192, max_shard_size="200MB"),
}


# ---------------------------------------------------------------------------
# Shapes: the twins (what a bf16 release stores) and how each is stored.


def deepseek_twins(s: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Twin name → (shape, how it is stored: ``fp8``, ``bf16`` or ``f32``)."""
    h, n = s["hidden"], s["heads"]
    rope, nope, v, kv_lora = (MLA[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                 "kv_lora_rank"))
    twins = {"model.embed_tokens.weight": ((s["vocab"], h), "bf16")}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        twins |= {p + "input_layernorm.weight": ((h,), "bf16"),
                  p + "post_attention_layernorm.weight": ((h,), "bf16"),
                  p + "self_attn.q_a_proj.weight": ((s["q_lora_rank"], h), "fp8"),
                  p + "self_attn.q_a_layernorm.weight": ((s["q_lora_rank"],), "bf16"),
                  p + "self_attn.q_b_proj.weight": ((n * (nope + rope), s["q_lora_rank"]), "fp8"),
                  p + "self_attn.kv_a_proj_with_mqa.weight": ((kv_lora + rope, h), "fp8"),
                  p + "self_attn.kv_a_layernorm.weight": ((kv_lora,), "bf16"),
                  p + "self_attn.kv_b_proj.weight": ((n * (nope + v), kv_lora), "fp8"),
                  p + "self_attn.o_proj.weight": ((h, n * v), "fp8")}
        if i < s["dense_layers"]:
            twins |= _mlp(p + "mlp.", h, s["intermediate"])
            continue
        twins |= {p + "mlp.gate.weight": ((s["experts"], h), "bf16"),
                  p + "mlp.gate.e_score_correction_bias": ((s["experts"],), "f32")}
        for e in range(s["experts"]):
            twins |= _mlp(p + f"mlp.experts.{e}.", h, s["moe_intermediate"])
        twins |= _mlp(p + "mlp.shared_experts.", h, s["moe_intermediate"])
    return twins | {"model.norm.weight": ((h,), "bf16"), "lm_head.weight": ((s["vocab"], h), "bf16")}


def kimi_int4_twins(s: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """``deepseek_twins`` as Kimi-K2-Thinking stores them: routed experts ``int4``, the other
    ``Linear`` weights ``bf16``."""
    return {name: (shape, "int4" if ROUTED.search(name) else "bf16" if how == "fp8" else how)
            for name, (shape, how) in deepseek_twins(s).items()}


def deepseek_nvfp4_twins(s: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """``deepseek_twins`` with every ``Linear`` weight ``nvfp4``."""
    return {name: (shape, "nvfp4" if how == "fp8" else how) for name, (shape, how) in deepseek_twins(s).items()}


ROUTED = re.compile(r"\.mlp\.experts\.\d+\.")


def _mlp(prefix: str, hidden: int, inner: int) -> dict:
    return {prefix + "gate_proj.weight": ((inner, hidden), "fp8"), prefix + "up_proj.weight": ((inner, hidden), "fp8"),
            prefix + "down_proj.weight": ((hidden, inner), "fp8")}


def gpt_oss_twins(s: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Twin name → (shape, ``mxfp4`` or ``bf16``); an MXFP4 twin is ``[experts, in, out]``."""
    h, e, inner = s["hidden"], s["experts"], s["intermediate"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    twins = {"model.embed_tokens.weight": ((s["vocab"], h), "bf16")}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        twins |= {p + "input_layernorm.weight": ((h,), "bf16"), p + "post_attention_layernorm.weight": ((h,), "bf16"),
                  p + "self_attn.sinks": ((s["heads"],), "bf16")}
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            twins |= {p + f"self_attn.{name}.weight": ((rows, cols), "bf16"), p + f"self_attn.{name}.bias": ((rows,), "bf16")}
        twins |= {p + "mlp.router.weight": ((e, h), "bf16"), p + "mlp.router.bias": ((e,), "bf16"),
                  p + "mlp.experts.gate_up_proj": ((e, h, 2 * inner), "mxfp4"),
                  p + "mlp.experts.gate_up_proj_bias": ((e, 2 * inner), "bf16"),
                  p + "mlp.experts.down_proj": ((e, inner, h), "mxfp4"),
                  p + "mlp.experts.down_proj_bias": ((e, h), "bf16")}
    return twins | {"model.norm.weight": ((h,), "bf16"), "lm_head.weight": ((s["vocab"], h), "bf16")}


def stored_bytes(twins: dict) -> int:
    """The bytes a checkpoint of ``twins`` stores (values and scales)."""
    total = 0
    for shape, how in twins.values():
        n = int(np.prod(shape))
        if how == "fp8":
            total += n + 4 * int(np.prod([-(-d // b) for d, b in zip(shape, BLOCK)]))
        else:
            total += {"bf16": 2 * n, "f32": 4 * n, "mxfp4": n // 2 + n // GROUP,
                      "int4": n // 2 + 2 * n // INT4_GROUP + 16, "nvfp4": n // 2 + n // NVFP4_GROUP + 8}[how]
    return total


def twin_dtype(how: str) -> np.dtype:
    """The dtype a twin loads as: bf16 for quantized and bf16 tensors, float32 for float32 ones."""
    return np.dtype(np.float32 if how == "f32" else ml_dtypes.bfloat16)


def identity_patterns(names) -> list[str]:
    """The names with their layer and expert numbers as ``{i}`` / ``{e}`` placeholders, once each:
    the patterns of identity mapping rules."""
    patterns = (re.sub(r"\.experts\.\d+\.", ".experts.{e}.", re.sub(r"\.layers\.\d+\.", ".layers.{i}.", n))
                for n in names)
    return sorted(set(patterns))


# ---------------------------------------------------------------------------
# Quantizers.


def quantize_fp8(x: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (2-D float32) as float8_e4m3fn values and float32 ``weight_scale_inv`` per block
    (``amax / 448``; partial last blocks are blocks of their own)."""
    padded, grid = _padded(x, block)
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = np.abs(blocks).max(axis=(1, 3)) / np.float32(FP8_MAX)
    scale[scale == 0] = 1.0
    blocks /= scale[:, None, :, None]
    values = padded[:x.shape[0], :x.shape[1]].astype(ml_dtypes.float8_e4m3fn)
    return values, scale.astype(np.float32)


def _padded(x: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int]]:
    """A float32 copy of ``x`` padded with zeros to whole blocks, and the block grid."""
    grid = (-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
    padded[:x.shape[0], :x.shape[1]] = x
    return padded, grid


def quantize_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32 ``[..., cols]``, cols a multiple of 32) as MXFP4 ``blocks`` (U8
    ``[..., cols / 32, 16]``) and ``scales`` (U8 ``[..., cols / 32]``): each group's exponent
    the smallest that fits its amax under 6, each value rounded to the nearest e2m1."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(amax, np.float32(2.0 ** -100)) / np.float32(6.0)))
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    midpoints = (E2M1[:7] + E2M1[1:8]) / 2  # between neighbouring magnitudes
    nearest = np.searchsorted(midpoints, np.abs(scaled)).astype(np.uint8)
    nibbles = nearest | ((scaled < 0).astype(np.uint8) << 3)
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)


E2M1 = quantized_reference.e2m1(np.arange(16)).astype(np.float32)  # by nibble


# ---------------------------------------------------------------------------
# Dequantizing: the load-then-dequantize peer's float32 numpy, and the reference.


def dequantize_fp8(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """float32 ``values * scale_inv`` of each value's block (the product in float32)."""
    padded, grid = _padded(values.astype(np.float32), block)
    padded.reshape(grid[0], block[0], grid[1], block[1])[...] *= scale_inv.astype(np.float32)[:, None, :, None]
    return padded[:values.shape[0], :values.shape[1]]


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., groups * 32]``: ``e2m1(nibble) * 2 ** (scale - 127)``, the low nibble first."""
    pairs = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1)  # [..., groups, 16, 2]
    values = pairs.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    values *= np.exp2(scales.astype(np.float32) - np.float32(127))[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def unpack_int4(words: np.ndarray) -> np.ndarray:
    """``pack-quantized`` I32 words ``[..., n / 8]`` as their signed codes ``[..., n]``, by the
    format's rule (``quantized_reference.pack_int``'s inverse): code ``i`` at bits ``4 i``,
    stored as ``code + 8``."""
    shifted = words.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))
    return ((shifted & 0xF).astype(np.int8) - 8).reshape(*words.shape[:-1], -1)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """U8 ``[..., n / 2]`` as its codes 0..15 ``[..., n]``, the even one from the low nibble."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def stored_names(twin: str, how: str) -> tuple[str, ...]:
    """The stored tensors a twin is read from: values first, then scales (and what
    compressed-tensors' decompression takes besides: ``weight_shape``, ``weight_global_scale``)."""
    if how == "fp8":
        return twin, twin + "_scale_inv"
    if how == "mxfp4":
        return twin + "_blocks", twin + "_scales"
    module = twin.removesuffix(".weight")
    if how == "int4":
        return module + ".weight_packed", module + ".weight_scale", module + ".weight_shape"
    if how == "nvfp4":
        return module + ".weight_packed", module + ".weight_scale", module + ".weight_global_scale"
    return (twin,)


def twin_from_stored(how: str, stored: list, block: tuple[int, int] = BLOCK,
                     reference: bool = True, config: dict | None = None) -> np.ndarray:
    """The twin (in its load dtype) of the stored tensors ``stored_names`` names, dequantized by
    ``tests/support/quantized_reference.py`` or (``reference=False``) by this module's float32
    numpy (FP8, MXFP4) or compressed-tensors' own decompression of torch tensors (INT4, NVFP4;
    ``config`` the checkpoint's ``quantization_config``)."""
    if how in ("int4", "nvfp4") and not reference:
        return decompress_compressed_tensors(how, stored, config)
    if how == "int4":
        words, scales, shape = stored
        codes = unpack_int4(words)
        if list(codes.shape) != [int(d) for d in shape]:
            raise ValueError(f"weight_shape {list(shape)} is not the {list(codes.shape)} its words hold")
        return quantized_reference.int_reference(codes, scales, None, (1, INT4_GROUP)).astype(ml_dtypes.bfloat16)
    if how == "nvfp4":
        packed, scales, global_scale = stored
        values = quantized_reference.nvfp4_reference(unpack_nibbles(packed), scales, float(global_scale.reshape(-1)[0]),
                                                      "compressed-tensors")
        return values.astype(ml_dtypes.bfloat16)
    if how == "fp8":
        values = quantized_reference.fp8_reference(*stored, block) if reference else dequantize_fp8(*stored, block)
        return values.astype(ml_dtypes.bfloat16)
    if how == "mxfp4":
        values = (quantized_reference.mxfp4_reference(*stored) if reference
                  else np.swapaxes(dequantize_mxfp4(*stored), -1, -2))
        return values.astype(ml_dtypes.bfloat16, order="C")
    return stored[0] if isinstance(stored[0], np.ndarray) else torch_to_numpy(stored[0])


def torch_to_numpy(t) -> np.ndarray:
    """A torch tensor as numpy, its memory shared (bfloat16 and float8 through a same-size view)."""
    import torch

    views = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
             torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}
    if t.dtype in views:
        raw, dtype = views[t.dtype]
        return t.contiguous().view(raw).numpy().view(dtype)
    return t.numpy()


def decompress_compressed_tensors(how: str, stored: list, config: dict) -> np.ndarray:
    """compressed-tensors 0.20.1's own decompression of one module's whole torch tensors
    (``compressors/base.py`` ``BaseCompressor.get_value_from_registry(format).decompress(state_dict,
    scheme)``, the scale handed over in its stored dtype, as transformers 5.24's
    ``integrations/compressed_tensors.py`` ``CompressedTensorsDequantize`` hands it), as bf16
    numpy (a view of the tensor's memory)."""
    import torch

    compressor, scheme = _compressor(json.dumps(config, sort_keys=True))
    keys = ("weight_packed", "weight_scale", "weight_shape" if how == "int4" else "weight_global_scale")
    return torch_to_numpy(compressor.decompress(dict(zip(keys, stored)), scheme)["weight"].to(torch.bfloat16))


@functools.cache
def _compressor(config: str):
    """The format's compressor and the config's one scheme (``group_0``), from its JSON."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(json.loads(config))
    return BaseCompressor.get_value_from_registry(parsed.format), parsed.config_groups["group_0"]


def reference_twins(checkpoint: Path, twins: dict, names=None, open_file=None,
                    reference: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """``(twin name, twin)`` for ``names`` (default: all of ``twins``), each stored tensor read
    whole (``open_file(path).get_tensor(name)``; default ``RawFile``), file by file, and
    dequantized by ``twin_from_stored(..., reference=reference)``."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())["quantization_config"]
    block = tuple(config.get("weight_block_size", BLOCK))
    where = weight_map(Path(checkpoint))
    by_file: dict[str, list[str]] = {}
    for name in list(twins) if names is None else names:
        by_file.setdefault(where[stored_names(name, twins[name][1])[0]], []).append(name)
    handles: dict[str, object] = {}
    for file in sorted(by_file):
        for name in by_file[file]:
            stored = []
            for stored_name in stored_names(name, twins[name][1]):
                source = where[stored_name]
                if source not in handles:
                    handles[source] = (open_file or RawFile)(str(Path(checkpoint) / source))
                stored.append(handles[source].get_tensor(stored_name))
            yield name, twin_from_stored(twins[name][1], stored, block, reference, config)


STORED_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "U8": np.uint8,
                 "I32": np.int32, "I64": np.int64}


class RawFile:
    """A safetensors file read by its format alone (8-byte header size, JSON header, data):
    the reference's reader, independent of ``safetensors`` and of ours (whose numpy backend
    has no float8 in safetensors 0.8)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(size))
        self.data = np.memmap(path, np.uint8, mode="r", offset=8 + size)

    def get_tensor(self, name: str) -> np.ndarray:
        entry = self.header[name]
        start, end = entry["data_offsets"]
        return np.array(self.data[start:end]).view(STORED_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def weight_map(checkpoint: Path) -> dict[str, str]:
    """Stored tensor name → file name (the index, or the single file's header)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    header = RawFile(str(checkpoint / "model.safetensors")).header
    return {name: "model.safetensors" for name in header if name != "__metadata__"}


# ---------------------------------------------------------------------------
# Writers.


def stored_tensors(twins: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights (normal, std 0.02; norms near 1), quantized as ``twins`` says, by stored name."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, how) in twins.items():
        if how in ("int4", "nvfp4"):
            out |= dict(zip(stored_names(name, how), random_codes(rng, shape, how)))
            if how == "nvfp4":
                out[name.removesuffix(".weight") + ".input_global_scale"] = _global_scale(rng)
            continue
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if "norm" in name:
            x += np.float32(1.0)
        if how == "fp8":
            out[name], out[name + "_scale_inv"] = quantize_fp8(x)
        elif how == "mxfp4":
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(np.swapaxes(x, -1, -2))
        else:
            out[name] = x.astype(twin_dtype(how))
    return out


def random_codes(rng: np.random.Generator, shape: tuple[int, int], how: str) -> tuple[np.ndarray, ...]:
    """Random stored tensors of a ``[out, in]`` weight, every code equally likely: INT4's words,
    BF16 scales (about 0.02 / 8, a std-0.02 weight's) and ``weight_shape``; NVFP4's bytes,
    positive finite F8_E4M3 scales and the F32 ``weight_global_scale`` (``448 * 6 / amax``,
    llm-compressor's ``generate_gparam``, for an amax near 0.1)."""
    rows, cols = shape
    if how == "int4":
        codes = rng.integers(-8, 8, shape, dtype=np.int8)
        scales = rng.uniform(0.5, 2.0, (rows, cols // INT4_GROUP)).astype(np.float32) * np.float32(0.0025)
        return (quantized_reference.pack_int(codes, 4), scales.astype(ml_dtypes.bfloat16),
                np.array(shape, np.int64))
    nibbles = rng.integers(0, 16, shape, dtype=np.uint8)
    scales = rng.uniform(1.0, 448.0, (rows, cols // NVFP4_GROUP)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return quantized_reference.pack_nibbles(nibbles), scales, _global_scale(rng)


def _global_scale(rng: np.random.Generator) -> np.ndarray:
    return np.array([448.0 * 6.0 / rng.uniform(0.05, 0.2)], np.float32)


def _write(directory: Path, twins: dict, config: dict, seed: int, max_shard_size: str) -> Path:
    import orbax_safetensors as ost

    directory = Path(directory)
    ost.save(directory, stored_tensors(twins, seed), max_shard_size=max_shard_size)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def write_deepseek(directory: Path, s: dict, seed: int = 0) -> Path:
    """A DeepSeek-V3-shaped FP8 checkpoint of spec ``s`` (``DEEPSEEK``) in ``directory``."""
    return _write(directory, deepseek_twins(s), _deepseek_config(s, FP8_CONFIG), seed, s["max_shard_size"])


def _deepseek_config(s: dict, quantization: dict) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": s["hidden"], "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"],
            "q_lora_rank": s["q_lora_rank"], **MLA, "intermediate_size": s["intermediate"],
            "moe_intermediate_size": s["moe_intermediate"], "n_routed_experts": s["experts"],
            "n_shared_experts": 1, "num_experts_per_tok": min(8, s["experts"]),
            "first_k_dense_replace": s["dense_layers"], "num_hidden_layers": s["layers"],
            "vocab_size": s["vocab"], "torch_dtype": "bfloat16", "quantization_config": quantization}


def write_kimi_int4(directory: Path, s: dict, seed: int = 0) -> Path:
    """A Kimi-K2-Thinking-shaped checkpoint (DeepSeek-V3's architecture, routed experts
    compressed-tensors INT4) of spec ``s`` (``KIMI_INT4``) in ``directory``."""
    return _write(directory, kimi_int4_twins(s), _deepseek_config(s, INT4_CONFIG), seed, s["max_shard_size"])


def write_deepseek_nvfp4(directory: Path, s: dict, seed: int = 0) -> Path:
    """A DeepSeek-V3-shaped checkpoint, every Linear weight compressed-tensors NVFP4, of spec
    ``s`` (``DEEPSEEK_NVFP4``) in ``directory``."""
    return _write(directory, deepseek_nvfp4_twins(s), _deepseek_config(s, NVFP4_CONFIG), seed, s["max_shard_size"])


def write_gpt_oss(directory: Path, s: dict, seed: int = 0) -> Path:
    """A gpt-oss-shaped MXFP4 checkpoint of spec ``s`` (``GPT_OSS``) in ``directory``."""
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": s["hidden"],
              "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
              "intermediate_size": s["intermediate"], "num_local_experts": s["experts"],
              "num_experts_per_tok": min(4, s["experts"]), "num_hidden_layers": s["layers"],
              "vocab_size": s["vocab"], "torch_dtype": "bfloat16", "quantization_config": MXFP4_CONFIG}
    return _write(directory, gpt_oss_twins(s), config, seed, s["max_shard_size"])
