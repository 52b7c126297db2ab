"""Tiny compressed-tensors and ModelOpt NVFP4 checkpoints, written by the quantizers' own code, and
the formats' own dequantization as the reference.

Two tiny random transformers models (bf16, as the Hub releases store them): ``LlamaForCausalLM``
(hidden 64, 2 layers, intermediate 128, vocab 256, 4 heads, 2 kv heads) and a
``DeepseekV3ForCausalLM`` MoE (Kimi-K2's architecture: MLA with q_lora_rank 32, kv_lora_rank 32,
rope 16, nope 16, v_head 16; layer 0 dense, layer 1 with 4 routed experts of 32 and one shared
expert). Every Linear weight gets a random offset per (row, 32 columns) on top of N(0, 0.02), so
asymmetric zero points differ from group to group.

compressed-tensors (``write_compressed``; compressed-tensors 0.20.1):

* The scheme is one of ``quantization/quant_scheme.py``'s presets (``W4A16``, ``W4A16_ASYM``,
  ``W8A8``, ``FP8_DYNAMIC``, ``FP8``, ``NVFP4``), group size 32 instead of 128 for the int4 ones
  and ``strategy="channel"`` for ``int4-channel``; ``quantization/lifecycle/apply.py``
  ``apply_quantization_config`` registers the qparams; they are filled the way llm-compressor's
  min-max observers fill them, with the library's ``quantization/utils/helpers.py``
  ``calculate_qparams`` (weights: min/max of the bf16 weight per tensor, row or group) and
  ``generate_gparam`` (NVFP4's ``weight_global_scale``, shared by q/k/v, by gate/up and by MLA's
  q_a/kv_a as llm-compressor's ``update_fused_layer_weight_global_scales`` does; static
  activation scales from the float model's inputs on random tokens). ``compressors/
  model_compressors/model_compressor.py`` ``ModelCompressor.from_pretrained_model`` /
  ``compress_model`` / ``update_config`` then compress and write ``quantization_config``;
  ``save_pretrained`` writes the safetensors.
* The DeepSeek experts are transformers 5's fused ``[experts, ...]`` parameters; they are split
  into one ``DeepseekV3MLP`` per expert first (what llm-compressor's MoE calibration modules do,
  all experts seeing every calibration token), so the checkpoint names them
  ``mlp.experts.{e}.{gate,up,down}_proj`` as DeepSeek and Kimi-K2 do. The router
  (``DeepseekV3TopkRouter``, not a Linear) is never quantized and nothing but its bf16 ``weight``
  and float32 ``e_score_correction_bias`` is stored for it; ``ModelCompressor`` itself lists it by
  name in ``ignore`` (``["model.layers.1.mlp.gate", "lm_head"]``) and ``re:.*mlp.gate$`` is
  appended as Kimi-K2 writes it. Kimi-K2-Thinking quantizes the routed experts only: pass
  ``ignore=KIMI_K2_IGNORE`` for that.

What each format stores for a Linear ``X`` (``[out, in]``; ``weight_shape`` is an I64 ``[2]``
tensor holding ``[out, in]``):

* ``pack-quantized`` (int4): ``X.weight_packed`` I32 ``[out, in / 8]`` (eight values per word,
  element ``i`` at bits ``4 i``, stored as ``q + 8``), ``X.weight_scale`` BF16 ``[out, in / 32]``
  (``[out, 1]`` per channel), ``X.weight_shape``; asymmetric adds ``X.weight_zero_point`` I32
  ``[out / 8, in / 32]``: the int8 zero points ``+ 8`` packed the same way but along the *output*
  axis (``pack_to_int32(..., packed_dim=0)``). Symmetric zero points are dropped.
* ``int-quantized`` (W8A8): ``X.weight`` I8, ``X.weight_scale`` BF16 ``[out, 1]``; activations
  dynamic per token, nothing stored for them.
* ``float-quantized``: ``X.weight`` F8_E4M3, ``X.weight_scale`` BF16 ``[out, 1]`` (FP8_DYNAMIC)
  or ``[1]`` (FP8); FP8 also stores the static ``X.input_scale`` BF16 ``[1]``.
* ``nvfp4-pack-quantized``: ``X.weight_packed`` U8 ``[out, in / 2]`` (even element in the low
  nibble), ``X.weight_scale`` F8_E4M3 ``[out, in / 16]``, ``X.weight_global_scale`` F32 ``[1]``
  (``448 * 6 / amax``: the reciprocal of ModelOpt's ``weight_scale_2``), and
  ``X.input_global_scale`` F32 ``[1]``.

``reference`` reads a checkpoint back as its dequantized twins (``X.weight``), through the format's
compressor (``compressors/base.py`` ``BaseCompressor.get_value_from_registry(format)
.decompress(state_dict, scheme)``, as ``entrypoints/convert/converters/ct_dequantizer.py`` and
transformers' ``CompressedTensorsDequantize`` call it); activation qparams (``input_scale``,
``input_global_scale``) are left out; every other tensor is returned as stored.

* ``dtype="bfloat16"``: what transformers 5.24 loads with ``CompressedTensorsConfig(
  dequantize=True)`` (``integrations/compressed_tensors.py`` ``CompressedTensorsDequantize``):
  the compressor's ``decompress`` on the stored tensors, which computes in the scale's dtype
  (``quantization/lifecycle/forward_helpers.py`` ``_dequantize``: ``x_q.to(scale.dtype)``, minus
  the zero point, times the scale), then ``.to(bfloat16)``. NVFP4 is the exception: its
  ``decompress`` unpacks to bf16 and always returns bf16 (``compressors/nvfp4/base.py``).
* ``dtype="float32"``: the same library functions handed float32 operands: the stored scale cast
  to float32 (exact) before ``decompress`` (``dequantize``'s output dtype is the scale's), and for
  NVFP4 ``unpack_fp4_from_uint8(..., dtype=float32)`` and ``dequantize(..., dtype=float32)``
  called directly. In float32 the library computes:

  - int4 / int8: ``(float32(q) - float32(z)) * scale``: exact difference, one rounding.
  - FP8: ``float32(fp8) * scale``: one rounding (exact for a bf16 scale).
  - NVFP4: ``s = float32(fp8 scale) / weight_global_scale`` (rounded), then ``e2m1 * s``
    (rounded): the division comes first, so the value is not ``e2m1 * fp8 * (1 / global)``.
    ``unpack_fp4_from_uint8`` gives nibble 8 the value ``-0.0``.

  Since each bf16 operand is exact in float32, the bf16 reference equals the float32 one rounded
  to bf16, bit for bit; transformers 5.24's dequantized load (bf16 by default, the config's dtype;
  the router's ``gate.weight`` float32, transformers keeps it so) equals the bf16 reference bit
  for bit for every scheme on Llama and for int4-group, int4-channel, fp8-channel and fp8-tensor
  on DeepSeek. Its fused-experts path (``CompressedTensorsDequantize`` for
  ``mlp.experts.gate_up_proj`` / ``down_proj``) fails on the others: asymmetric int4 (no zero
  point is handed to ``decompress``), int8 (it looks for ``weight_packed``), and NVFP4, which
  loads but never divides the experts by ``weight_global_scale`` (values about 25000 times too
  large), so ``transformers_logits`` is wrong for a DeepSeek NVFP4 checkpoint.

ModelOpt NVFP4 (``write_modelopt_nvfp4``; nvidia-modelopt 0.47.0): ``mtq.quantize(model,
NVFP4_DEFAULT_CFG)`` then ``export_hf_checkpoint`` (``torch/export/unified_export_hf.py``) write,
per Linear, ``X.weight`` U8 ``[out, in / 2]`` (low nibble first), ``X.weight_scale`` F8_E4M3
``[out, in / 16]``, ``X.weight_scale_2`` F32 ``[]`` and ``X.input_scale`` F32 ``[]``;
``hf_quant_config.json`` (``{"producer": {"name": "modelopt", "version": "0.47.0"},
"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
"exclude_modules": [...]}}``) and, in ``config.json``, ``convert_hf_config.py``
``convert_hf_quant_config_format``'s ``quantization_config`` (``quant_method: "modelopt"``).
``exclude_modules`` lists ``lm_head``, ``model.embed_tokens`` and the MoE routers by name
(``model.layers.1.mlp.gate``). The writer here transcribes ``torch/quantization/qtensor/
nvfp4_tensor.py`` ``NVFP4QTensor.quantize`` (``weight_scale_2 = amax / (6 * 448)``, per-block
``fp8(clamp(amax_block / (6 * weight_scale_2), 2 ** -9, 448))``, ``x / (float32(fp8) *
weight_scale_2)`` rounded to e2m1 with ties at 0.75, 1.75 and 3.5 rounding up, and ties at 0.25,
1.25, 2.5 and 5 rounding down), with modelopt's fusion (q/k/v, gate/up and MLA's q_a/kv_a share
``weight_scale_2`` and ``input_scale``, the largest of each) and ``input_scale = amax / (6 *
448)`` of the float model's inputs (calibration does not quantize). ModelOpt quantizes
transformers' fused experts with one input quantizer per projection for all experts of a layer,
each expert seeing only its routed tokens, and exports them per expert
(``mlp.experts.{e}.gate_proj.weight``, ...): every expert of a layer gets the same
``input_scale``, the largest over the experts, while ``weight_scale_2`` stays per expert (shared
by its gate and up). ``modelopt_reference`` transcribes ``NVFP4QTensor.dequantize``:
``per_block = float32(fp8 scale) * weight_scale_2`` (rounded), then ``e2m1 * per_block``
(rounded), in float32, then ``.to(dtype)``; its e2m1 table maps nibble 8 to ``+0.0``, not
``-0.0``. Both quantizers write nibble 8 for small negative values (about 2% of the values here),
so the two formats' references differ in the sign of those zeros, and the two multiply in a
different order (``fp8 / global`` against ``fp8 * weight_scale_2``).

The ModelOpt writer and reference need no modelopt: ``nvidia_modelopt-0.47.0`` imports on CPU
torch (``NVFP4QTensor`` included) once ``omegaconf`` (with ``antlr4-python3-runtime``), ``pulp``
and ``nvidia-ml-py`` are installed next to its torch, numpy, pydantic, regex, rich, safetensors,
scipy, tqdm and PyYAML dependencies, and for these two models ``write_modelopt_nvfp4`` writes
what ``mtq.quantize`` + ``export_hf_checkpoint`` write from the same weights and calibration
tokens, bit for bit (every tensor, ``config.json``, ``hf_quant_config.json``), and
``modelopt_reference`` returns what ``NVFP4QTensor.dequantize`` returns, bit for bit, in float32
and bfloat16. transformers 5.24 cannot load a ModelOpt checkpoint (its ``nvfp4`` quantizer
refuses pre-quantized ones).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np

HIDDEN = 64
VOCAB = 256
GROUP_OFFSET = 32  # columns sharing a random offset
SCHEMES = ("int4-group", "int4-group-asym", "int4-channel", "int8-channel", "fp8-channel", "fp8-tensor",
           "nvfp4", "mxfp4")
ROUTER_IGNORE = "re:.*mlp.gate$"
# Kimi-K2-Thinking's ignore list: only the routed experts are int4.
KIMI_K2_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
ACTIVATION_QPARAMS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale",
                      "output_zero_point", "output_global_scale", "k_scale", "v_scale")
CALIBRATION_TOKENS = (4, 32)  # batch, length of the random calibration prompt
# vLLM's fused groups, which llm-compressor (NVFP4 global scales) and ModelOpt (weight_scale_2 and
# input_scale) give one scale each.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


# ---------------------------------------------------------------------------
# The tiny models.


def model_config(model: str):
    """The transformers config of the tiny ``model`` (``llama`` or ``deepseek_v3``)."""
    import torch
    from transformers import DeepseekV3Config, LlamaConfig

    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=VOCAB, num_attention_heads=4,
                  tie_word_embeddings=False, dtype=torch.bfloat16)
    if model == "llama":
        return LlamaConfig(intermediate_size=128, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
                           **common)
    if model == "deepseek_v3":
        return DeepseekV3Config(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
                                first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
                                num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32,
                                kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                architectures=["DeepseekV3ForCausalLM"], **common)
    raise ValueError(f"unknown model {model!r}")


def tiny_model(model: str = "llama", seed: int = 0, split_experts: bool = True):
    """The tiny bf16 model with seeded random weights; DeepSeek's experts split into Linears
    unless ``split_experts`` is false (transformers' fused experts, as ModelOpt quantizes them)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(model)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(net.named_parameters()):
            param.copy_(torch.from_numpy(_random(rng, name, tuple(param.shape))))
        if model == "deepseek_v3":
            for layer in net.model.layers:
                if hasattr(layer.mlp, "gate"):
                    bias = rng.standard_normal(layer.mlp.gate.e_score_correction_bias.shape).astype(np.float32)
                    layer.mlp.gate.e_score_correction_bias = torch.from_numpy(bias * np.float32(0.01))
                    if split_experts:
                        layer.mlp.experts = _linear_experts_class()(config, layer.mlp.experts)
    return net


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, 0.02); norms near 1; 2-D and 3-D weights offset per (row, 32 columns), so that a
    group's values are not centred on zero."""
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if "norm" in name:
        return x + np.float32(1.0)
    if len(shape) >= 2 and "embed" not in name and "lm_head" not in name and "gate.weight" not in name:
        groups = -(-shape[-1] // GROUP_OFFSET)
        offset = rng.uniform(-0.04, 0.04, size=shape[:-1] + (groups,)).astype(np.float32)
        x += np.repeat(offset, GROUP_OFFSET, axis=-1)[..., :shape[-1]]
    return x


def _linear_experts_class():
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    class LinearExperts(torch.nn.ModuleList):
        """transformers' fused experts as one ``DeepseekV3MLP`` each, every expert computing every
        token (llm-compressor's ``calibrate_all_experts``) and the routed ones summed."""

        def __init__(self, config, fused):
            inner = config.moe_intermediate_size
            experts = []
            for e in range(config.n_routed_experts):
                mlp = DeepseekV3MLP(config, intermediate_size=inner).to(fused.gate_up_proj.dtype)
                mlp.gate_proj.weight.data.copy_(fused.gate_up_proj.data[e, :inner])
                mlp.up_proj.weight.data.copy_(fused.gate_up_proj.data[e, inner:])
                mlp.down_proj.weight.data.copy_(fused.down_proj.data[e])
                experts.append(mlp)
            super().__init__(experts)

        routed_only = False  # True: each expert sees only its tokens (ModelOpt's calibration)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e, expert in enumerate(self):
                weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
                if self.routed_only:
                    rows = (top_k_index == e).any(-1)
                    if rows.any():
                        out[rows] += expert(hidden_states[rows]) * weight[rows].to(hidden_states.dtype)
                    continue
                out += expert(hidden_states) * weight.to(hidden_states.dtype)
            return out

    return LinearExperts


def calibration_ids(seed: int = 0):
    """The random prompt whose activations set the static input scales."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, VOCAB, CALIBRATION_TOKENS, generator=generator)


def _input_ranges(net, names, seed: int) -> dict[str, tuple]:
    """Per Linear in ``names``: (min, max) of its inputs, float model, random tokens."""
    import torch

    ranges, hooks = {}, []
    modules = dict(net.named_modules())

    def hook(name):
        def record(_module, args):
            x = args[0].detach()
            lo, hi = x.min(), x.max()
            if name in ranges:
                lo, hi = torch.minimum(lo, ranges[name][0]), torch.maximum(hi, ranges[name][1])
            ranges[name] = (lo, hi)
        return record

    for name in names:
        hooks.append(modules[name].register_forward_pre_hook(hook(name)))
    try:
        with torch.no_grad():
            net(calibration_ids(seed))
    finally:
        for h in hooks:
            h.remove()
    return ranges


def _fused_groups(names) -> list[list[str]]:
    """The names that share a fused scale, per parent module."""
    by_parent: dict[str, dict[str, str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = name
    groups = []
    for leaves in by_parent.values():
        for fused in FUSED:
            if all(leaf in leaves for leaf in fused):
                groups.append([leaves[leaf] for leaf in fused])
    return groups


# ---------------------------------------------------------------------------
# compressed-tensors.


def ct_scheme(scheme: str, targets=("Linear",)):
    """The compressed-tensors ``QuantizationScheme`` a ``scheme`` name stands for."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    preset, weights = {
        "int4-group": ("W4A16", {"group_size": 32}),
        "int4-group-asym": ("W4A16_ASYM", {"group_size": 32}),
        "int4-channel": ("W4A16", {"strategy": "channel", "group_size": None}),
        "int8-channel": ("W8A8", {}),
        "fp8-channel": ("FP8_DYNAMIC", {}),
        "fp8-tensor": ("FP8", {}),
        "nvfp4": ("NVFP4", {}),
        "mxfp4": ("MXFP4", {}),
    }[scheme]
    base = preset_name_to_scheme(preset, list(targets))
    if not weights:
        return base
    args = base.weights.model_dump() | weights
    return QuantizationScheme(targets=list(targets), weights=QuantizationArgs(**args),
                              input_activations=base.input_activations)


def write_compressed(directory, scheme: str, *, model: str = "llama", seed: int = 0, shard_size=None,
                     ignore=None) -> dict:
    """Write the tiny ``model`` quantized as ``scheme`` (``SCHEMES``) in compressed-tensors' own
    format to ``directory``. ``ignore``: module names or ``re:`` patterns left unquantized
    (default ``["lm_head"]``; ``KIMI_K2_IGNORE`` for Kimi-K2-Thinking's). ``shard_size``:
    ``save_pretrained``'s ``max_shard_size``.

    Returns ``{"config": config.json, "quantization_config": its quantization_config,
    "quantized": quantized module names, "format": the compression format}``."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    directory = Path(directory)
    net = tiny_model(model, seed)
    q_scheme = ct_scheme(scheme)
    ignore = list(ignore) if ignore is not None else ["lm_head"]
    apply_quantization_config(net, QuantizationConfig(config_groups={"group_0": q_scheme}, ignore=ignore))
    quantized = sorted(name for name, m in net.named_modules() if getattr(m, "quantization_scheme", None))
    modules = dict(net.named_modules())

    acts = q_scheme.input_activations
    static_inputs = acts is not None and acts.dynamic is not True
    # Calibrate on the float model (quantization off), as llm-compressor's observers see it.
    for name in quantized:
        modules[name].quantization_enabled = False
    ranges = _input_ranges(net, quantized, seed) if static_inputs else {}
    for name in quantized:
        modules[name].quantization_enabled = True

    def put(module, attr, value):
        getattr(module, attr).data.copy_(value.reshape(getattr(module, attr).shape))

    with torch.no_grad():
        weights = q_scheme.weights
        globals_ = {}
        if weights.strategy == QuantizationStrategy.TENSOR_GROUP:
            for name in quantized:
                w = modules[name].weight
                globals_[name] = generate_gparam(w.min(), w.max())
            for group in _fused_groups(quantized):
                shared = torch.min(torch.cat([globals_[n] for n in group])).reshape([1])
                globals_.update({n: shared for n in group})
        for name in quantized:
            module = modules[name]
            w = module.weight
            if weights.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
                g = w.unflatten(-1, (-1, weights.group_size))
                lo, hi = g.amin(-1), g.amax(-1)
            elif weights.strategy == QuantizationStrategy.CHANNEL:
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                lo, hi = w.min(), w.max()
            if name in globals_:
                put(module, "weight_global_scale", globals_[name])
            scale, zero_point = calculate_qparams(lo, hi, weights, global_scale=globals_.get(name))
            put(module, "weight_scale", scale)
            if hasattr(module, "weight_zero_point"):
                put(module, "weight_zero_point", zero_point)
            if static_inputs:
                lo, hi = ranges[name]
                if acts.strategy == QuantizationStrategy.TENSOR_GROUP:
                    put(module, "input_global_scale", generate_gparam(lo, hi))
                else:
                    scale, zero_point = calculate_qparams(lo.reshape(1), hi.reshape(1), acts)
                    put(module, "input_scale", scale)
                    if hasattr(module, "input_zero_point"):
                        put(module, "input_zero_point", zero_point)

    compressor = ModelCompressor.from_pretrained_model(net)
    compressor.compress_model(net)
    if model == "deepseek_v3" and ROUTER_IGNORE not in compressor.quantization_config.ignore:
        compressor.quantization_config.ignore.append(ROUTER_IGNORE)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    net.save_pretrained(directory, **kwargs)
    compressor.update_config(directory)
    config = json.loads((directory / "config.json").read_text())
    qc = config["quantization_config"]
    return {"config": config, "quantization_config": qc, "quantized": quantized, "format": qc["format"]}


# ---------------------------------------------------------------------------
# Reading checkpoints.


def read_tensors(directory) -> dict:
    """Every stored tensor of the checkpoint in ``directory`` (torch, as stored)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    tensors = {}
    for file in files:
        tensors |= load_file(str(directory / file))
    return tensors


def _numpy(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def _ignored(module: str, ignore) -> bool:
    from compressed_tensors.utils.match import match_name

    return any(match_name(module, pattern) for pattern in ignore)


def reference(directory, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The compressed-tensors checkpoint in ``directory`` as its dequantized twins, by
    compressed-tensors' own decompression (see the module docstring for ``dtype``)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(dtype)
    config = json.loads((Path(directory) / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    tensors = read_tensors(directory)
    out = {}
    modules = sorted(n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale"))
    for module in modules:
        if _ignored(module, qc.ignore):
            continue
        scheme = next(s for s in qc.config_groups.values()
                      if "Linear" in s.targets or any(_ignored(module, [t]) for t in s.targets))
        fmt = CompressionFormat(scheme.format or qc.format)
        compressor = BaseCompressor.get_value_from_registry(fmt.value)
        names = compressor.compression_param_names(scheme)
        state = {p: tensors.pop(f"{module}.{p}") for p in names if f"{module}.{p}" in tensors}
        if dtype == "float32" and fmt == CompressionFormat.nvfp4_pack_quantized:
            packed = state["weight_packed"]
            values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            weight = dequantize(x_q=values, scale=state["weight_scale"].to(torch.float32), args=scheme.weights,
                                global_scale=state["weight_global_scale"], dtype=torch.float32)
        else:
            if dtype == "float32" and fmt != CompressionFormat.mxfp4_pack_quantized:
                state["weight_scale"] = state["weight_scale"].to(torch.float32)
            # MXFP4's scales are E8M0 bytes its decompress decodes, in bfloat16: a code times a
            # power of two, exact there, so its float32 values are those.
            weight = compressor.decompress(state, scheme)["weight"]
        out[f"{module}.weight"] = _numpy(weight.to(getattr(torch, dtype)))
    for name, t in tensors.items():
        if name.rpartition(".")[2] not in ACTIVATION_QPARAMS:
            out[name] = _numpy(t)
    return dict(sorted(out.items()))


def transformers_model(directory, dtype: str = "float32"):
    """transformers 5.24's dequantizing load of the compressed-tensors checkpoint in ``directory``
    (``CompressedTensorsConfig(dequantize=True)``), its parameters in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        str(directory), quantization_config=CompressedTensorsConfig(dequantize=True),
        dtype=getattr(torch, dtype), attn_implementation="eager").eval()  # as hf_families.reference_logits


def transformers_logits(directory, input_ids) -> np.ndarray:
    """float32 logits of transformers' dequantized load (weights dequantized as transformers
    does, in the scale's dtype, then cast to float32; the forward in float32)."""
    import torch

    net = transformers_model(directory, "float32")
    with torch.no_grad():
        return net(torch.as_tensor(np.asarray(input_ids))).logits.float().numpy()


def transformers_twins(net) -> dict[str, np.ndarray]:
    """A transformers model's state dict under the checkpoint's names: fused DeepSeek experts
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``) split per expert."""
    out = {}
    for name, t in net.state_dict().items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if not m:
            out[name] = _numpy(t.detach())
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight"] = _numpy(t[e].detach())
            else:
                gate, up = t[e].detach().chunk(2, dim=0)
                out[f"{m[1]}.{e}.gate_proj.weight"] = _numpy(gate.contiguous())
                out[f"{m[1]}.{e}.up_proj.weight"] = _numpy(up.contiguous())
    return out


# ---------------------------------------------------------------------------
# ModelOpt NVFP4.

E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
MODELOPT_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
MODELOPT_VERSION = "0.47.0"


def modelopt_quantize(w, weight_scale_2):
    """``NVFP4QTensor.quantize`` (modelopt 0.47.0, ``torch/quantization/qtensor/nvfp4_tensor.py``)
    of a 2-D torch weight: ``(packed U8 [out, in / 2], weight_scale F8_E4M3 [out, in / 16])``."""
    import torch

    blocks = w.unflatten(-1, (-1, 16))
    per_block = blocks.abs().amax(-1).float() / (6.0 * weight_scale_2)
    per_block[per_block == 0] = 1.0
    scale = per_block.clamp(min=2 ** -9, max=448.0).to(torch.float8_e4m3fn)
    scaled = (blocks / (scale.to(torch.float32) * weight_scale_2).unsqueeze(-1)).flatten(-2)
    x = scaled.numpy()
    magnitude = np.abs(x)
    nibble = np.searchsorted(E2M1_BOUNDS, magnitude, side="left").astype(np.uint8)
    nibble += np.isin(magnitude, E2M1_BOUNDS[[1, 3, 5]]).astype(np.uint8)  # ties at odd bounds round up
    nibble |= (x < 0).astype(np.uint8) << 3
    packed = (nibble[..., 1::2] << 4) | nibble[..., 0::2]
    return torch.from_numpy(packed.astype(np.uint8)), scale


def write_modelopt_nvfp4(directory, *, model: str = "llama", seed: int = 0) -> dict:
    """Write the tiny ``model`` as ``export_hf_checkpoint`` writes an ``NVFP4_DEFAULT_CFG``
    quantization (modelopt 0.47.0), by a transcription of its arithmetic (see the module
    docstring); lm_head, the embeddings and MoE routers excluded. Returns ``{"config",
    "quantization_config", "hf_quant_config", "quantized"}``."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    net = tiny_model(model, seed)
    linears = {n: m for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    quantized = sorted(linears)
    for m in net.modules():
        if hasattr(m, "routed_only"):
            m.routed_only = True
    ranges = _input_ranges(net, quantized, seed)
    amax_in = {n: torch.maximum(ranges[n][0].abs(), ranges[n][1].abs()).float() for n in ranges}
    # One input quantizer per fused MoE: experts' gate/up and down share the largest input amax.
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        by_layer: dict[str, list[str]] = {}
        for n in amax_in:
            m = re.fullmatch(rf"(.*\.mlp\.experts)\.\d+\.{leaf}", n)
            if m:
                by_layer.setdefault(m[1], []).append(n)
        for names in by_layer.values():
            shared = torch.stack([amax_in[n] for n in names]).max()
            amax_in.update({n: shared for n in names})
    amax_w = {n: linears[n].weight.detach().abs().max().float() for n in quantized}
    for group in _fused_groups(quantized):
        shared = torch.stack([amax_w[n] for n in group]).max()
        amax_w.update({n: shared for n in group})
    tensors = {}
    with torch.no_grad():
        for name, t in net.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if module in linears and leaf == "weight":
                ws2 = amax_w[module] / (6.0 * 448.0)
                packed, scale = modelopt_quantize(t, ws2)
                tensors |= {name: packed, f"{module}.weight_scale": scale,
                            f"{module}.weight_scale_2": ws2.reshape(()),
                            f"{module}.input_scale": (amax_in[module] / (6.0 * 448.0)).reshape(())}
            else:
                tensors[name] = t.contiguous()
    save_file(dict(sorted(tensors.items())), str(directory / "model.safetensors"), metadata={"format": "pt"})
    routers = [n for n, m in net.named_modules() if type(m).__name__.endswith("TopkRouter")]
    hf_quant_config = {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
                       "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": sorted(["lm_head", "model.embed_tokens", *routers])}}
    details = hf_quant_config["quantization"]
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    quantization_config = {"config_groups": {"group_0": {"input_activations": dict(group), "weights": dict(group),
                                                         "targets": ["Linear"]}},
                           "ignore": details["exclude_modules"], "quant_algo": "NVFP4",
                           "producer": hf_quant_config["producer"], "quant_method": "modelopt"}
    config = net.config.to_dict()
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=4))
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4))
    return {"config": config, "quantization_config": quantization_config, "hf_quant_config": hf_quant_config,
            "quantized": quantized}


def modelopt_reference(directory, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The ModelOpt NVFP4 checkpoint in ``directory`` as its dequantized twins:
    ``NVFP4QTensor.dequantize`` transcribed (float32: ``e2m1 * (float32(fp8) * weight_scale_2)``,
    nibble 8 as +0.0), then rounded to bfloat16 for ``dtype="bfloat16"``. ``input_scale`` is left
    out; other tensors as stored."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(dtype)
    tensors = {name: _numpy(t) for name, t in read_tensors(directory).items()}
    out = {}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        x = tensors[name]
        if leaf == "weight" and f"{module}.weight_scale_2" in tensors:
            per_block = tensors[f"{module}.weight_scale"].astype(np.float32) * tensors[f"{module}.weight_scale_2"]
            pairs = np.stack([MODELOPT_E2M1[x & 0x0F], MODELOPT_E2M1[x >> 4]], axis=-1).reshape(x.shape[0], -1, 16)
            x = (pairs * per_block[..., None]).reshape(x.shape[0], -1)
            if dtype == "bfloat16":
                x = x.astype(ml_dtypes.bfloat16)
        out[name] = x
    return out
