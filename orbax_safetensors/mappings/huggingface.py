"""Hugging Face decoder checkpoints ↔ Flax params trees, one function per family.

The tree keeps Hugging Face's module names (so a reader can follow one into
the other) with Flax's leaf names and arrangements::

    model.embed_tokens.embedding                  (vocab, hidden)
    model.norm.scale                              (hidden,)
    lm_head.kernel                                (hidden, vocab)   absent when tied (Gemma)
    model.layers_{i}.<leaf>                       scan_layers=False, or
    model.layers.<leaf>                           scan_layers=True: layer i at index i of a leading axis
    <leaf>:
      input_layernorm.scale, post_attention_layernorm.scale        (hidden,)   (OLMo 3: no input_layernorm)
      pre_feedforward_layernorm.scale, post_feedforward_layernorm.scale   Gemma 2/3 (OLMo 3: post_ only)
      self_attn.{q,k,v}_proj.kernel               (hidden, heads | kv_heads, head_dim)
      self_attn.o_proj.kernel                     (heads, head_dim, hidden)
      self_attn.{q,k,v}_proj.bias                 (heads | kv_heads, head_dim)   Qwen2, attention_bias
      self_attn.o_proj.bias                       (hidden,)                      attention_bias
      self_attn.{q,k}_norm.scale                  (head_dim,)                    Qwen3, Gemma 3, Qwen3-MoE
                                                  (heads | kv_heads * head_dim,) OLMo 3 (whole projection)
      self_attn.sinks                             (heads,)                       gpt-oss
      mlp.{gate,up}_proj.kernel (hidden, intermediate), mlp.down_proj.kernel (intermediate, hidden)
      block_sparse_moe.gate.kernel (hidden, experts); block_sparse_moe.experts.{w1,w3}.kernel
        (experts, hidden, intermediate), .w2.kernel (experts, intermediate, hidden)       Mixtral
      mlp.gate.kernel, mlp.experts.{gate,up,down}_proj.kernel (the same, Qwen3-MoE names)
      mlp.router.kernel (hidden, experts), mlp.router.bias (experts,); mlp.experts.gate_up_proj.kernel
        (experts, hidden, 2 * intermediate), .bias (experts, 2 * intermediate); mlp.experts.down_proj.kernel
        (experts, intermediate, hidden), .bias (experts, hidden)                            gpt-oss

Kernels are the transposed ``Linear`` weights; attention kernels keep heads as
their own axis, so a device holding some heads reads only their rows. Norm
leaves hold the stored weight as it is (Gemma's forward adds the 1). Scanned
layers and stacked experts are ``Rule.stack``: each device still reads only
its own layers, experts, rows and columns, and a save writes the per-layer,
per-expert tensors ``save_pretrained`` writes.

DeepSeek-V3 (MLA attention, dense then MoE layers) is ``mappings.deepseek``, as are
DeepSeek-V2 (``deepseek_v2``) and DeepSeek-V3.2 (``deepseek_v32``). Qwen3-Next (gated delta net
and gated full-attention layers) is ``qwen3_next``, in ``mappings.qwen_hybrid``, as is Qwen3.5's
text decoder (``qwen3_5``). Gemma 4's text decoder (``gemma4``: layers of two shapes, unscanned
only) is ``mappings.gemma4``'s, DeepSeek-V4's (``deepseek_v4``: compressed attention,
hyper-connections, token-table routing; the release's own names) ``mappings.deepseek_v4``'s.

Qwen3-VL (``qwen3_vl``, its MoE release too) and Qwen3-Omni (``qwen3_omni_moe``) map their text
decoder, Qwen3's (Qwen3-MoE's) tree under the stored prefix (``model.language_model.``,
``thinker.model.``; head ``lm_head``, ``thinker.lm_head``), from the config's ``text_config``
(``thinker_config.text_config``); Qwen3-VL-MoE's experts fused per layer, ``mlp.experts.gate_up_proj``
and ``down_proj`` kept as stored. Their vision and audio towers are passed through, each
tensor a leaf of its stored name (``mappings._towers``); Qwen3-Omni's talker and code2wav are left
out (``Mapping.ignore``).

``config`` (a transformers config or a dict of its fields) pins the head
sizes, needed only when loading without a target, and says whether the
release is quantized (``quantization_config``); ``dtype`` is the dtype a save
writes (a float32 tree saved as the bfloat16 checkpoint it came from);
``dequantize`` whether a quantized release is read as the values it stands
for (the default) or, FP8, kept as stored with its scales beside it.

gpt-oss stores its experts fused, one tensor per layer used as ``x @ w``
(no transpose), with gate and up interleaved in ``gate_up_proj`` (gate at
even columns): the tree keeps it one leaf, as stored. Its alternating
sliding-window layers are config (``layer_types``), not weights; its MXFP4
release reads into the same tree as the bfloat16 release's.
"""

from __future__ import annotations

from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import attention_dims, config_sizes, config_value, heads_without_config
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.mappings._towers import QWEN3_OMNI as QWEN3_OMNI_TOWERS
from orbax_safetensors.mappings._towers import QWEN3_VL as QWEN3_VL_TOWERS
from orbax_safetensors.mappings._towers import passed_through, text_config
from orbax_safetensors.mappings.deepseek import deepseek_v2, deepseek_v3, deepseek_v32
from orbax_safetensors.mappings.deepseek_v4 import deepseek_v4
from orbax_safetensors.mappings.gemma4 import gemma4
from orbax_safetensors.mappings.qwen_hybrid import qwen3_5, qwen3_next
from orbax_safetensors.planning.rules import Mapping, Rule


def _decoder(config: Any, family: str, *, scan_layers: bool, dtype: Any, dequantize: bool,
             attention_bias: bool = False, output_bias: bool = False, qk_norm: bool = False,
             ffn_norms: bool = False, tied: bool = False,
             moe: tuple[str, str, tuple[str, str, str] | None] | None = None,
             sinks: bool = False, fused_experts: bool = False, post_norms: bool = False,
             prefix: str = "model.", head: str = "lm_head", towers: dict[str, tuple[int, ...]] | None = None,
             ignore: tuple[str, ...] = (),
             release: Any = None) -> Mapping:
    """The rules every family shares, and the ones its flags add.

    ``post_norms``: the attention's and the MLP's outputs normalised, not their inputs (OLMo 3:
    ``post_attention_layernorm``, ``post_feedforward_layernorm``, no ``input_layernorm``).

    ``moe``: (router module, experts module, (gate, up, down) names), e.g.
    ``("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2"))``;
    ``fused_experts``: gpt-oss's MoE instead (``_fused_experts``). (gate, up, down) ``None``: the
    experts fused per layer without biases, ``gate_up_proj`` and ``down_proj`` (Qwen3-VL-MoE).

    A multimodal release's text decoder: its tensors under ``prefix`` (its tree too) and its head
    ``head``, ``config`` its text config and ``release`` the whole (its ``quantization_config``);
    ``towers``, the rest, passed through (``mappings._towers``: prefix -> the depths of its names);
    ``ignore``, stored prefixes left out (``Mapping.ignore``).
    """
    tree_layer = f"{prefix}layers" if scan_layers else f"{prefix}layers_{{i}}"
    layer_stack = {"i": 0} if scan_layers else {}

    def layer(stored: str, tree: str, *, experts: bool = False, **transform) -> Rule:
        stack = dict(layer_stack)
        if experts:
            stack["e"] = len(stack)
        return Rule(f"{prefix}layers.{{i}}.{stored}", f"{tree_layer}.{tree}", stack=stack, dtype=dtype, **transform)

    linear = {"transpose": (1, 0)}
    rules = [Rule(f"{prefix}embed_tokens.weight", f"{prefix}embed_tokens.embedding", dtype=dtype),
             Rule(f"{prefix}norm.weight", f"{prefix}norm.scale", dtype=dtype)]
    if not tied:
        rules.append(Rule(f"{head}.weight", f"{head}.kernel", dtype=dtype, **linear))
    norms = ["post_attention_layernorm", "post_feedforward_layernorm"] if post_norms else [
        "input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if ffn_norms else []
    norms += ["self_attn.q_norm", "self_attn.k_norm"] if qk_norm else []
    rules += [layer(f"{norm}.weight", f"{norm}.scale") for norm in norms]
    for proj, heads in (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
        rules.append(layer(f"self_attn.{proj}.weight", f"self_attn.{proj}.kernel",
                           split={1: (heads, "head_dim")}, **linear))
        if attention_bias:
            rules.append(layer(f"self_attn.{proj}.bias", f"self_attn.{proj}.bias", split={0: (heads, "head_dim")}))
    rules.append(layer("self_attn.o_proj.weight", "self_attn.o_proj.kernel",
                       split={0: ("heads", "head_dim")}, **linear))
    if output_bias:
        rules.append(layer("self_attn.o_proj.bias", "self_attn.o_proj.bias"))
    if sinks:
        rules.append(layer("self_attn.sinks", "self_attn.sinks"))
    if fused_experts:
        rules += _fused_experts(layer)
    elif moe is None:
        rules += [layer(f"mlp.{p}.weight", f"mlp.{p}.kernel", **linear) for p in ("gate_proj", "up_proj", "down_proj")]
    else:
        router, experts, projections = moe
        rules.append(layer(f"{router}.weight", f"{router}.kernel", **linear))
        if projections is None:  # fused per layer, used as x @ w: kept as stored (Qwen3-VL-MoE)
            rules += [layer(f"{experts}.{p}", f"{experts}.{p}.kernel") for p in ("gate_up_proj", "down_proj")]
        else:
            rules += [layer(f"{experts}.{{e}}.{p}.weight", f"{experts}.{p}.kernel", experts=True, **linear)
                      for p in projections]
    rules += passed_through(towers or {}, dtype)
    name = f"ost.mappings.{family}"
    return quantized_mapping(rules, config if release is None else release, dequantize=dequantize,
                             dims=attention_dims(config, name), sizes=config_sizes(config, prefix),
                             undeclared=heads_without_config(config, name), ignore=ignore)


def _fused_experts(layer: Any) -> list[Rule]:
    """gpt-oss's MoE: a router with a bias, and the experts fused per layer, ``[experts, ...]``
    tensors used as ``x @ w`` (kept as stored), each with its bias."""
    rules = [layer("mlp.router.weight", "mlp.router.kernel", transpose=(1, 0)),
             layer("mlp.router.bias", "mlp.router.bias")]
    for projection in ("gate_up_proj", "down_proj"):
        rules += [layer(f"mlp.experts.{projection}", f"mlp.experts.{projection}.kernel"),
                  layer(f"mlp.experts.{projection}_bias", f"mlp.experts.{projection}.bias")]
    return rules


def llama(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
          dequantize: bool = True) -> Mapping:
    """``LlamaForCausalLM`` (Llama 2, 3.x: RoPE scaling is config, not weights); biases
    when the config sets ``attention_bias``."""
    bias = bool(config is not None and config_value(config, "attention_bias", False))
    return _decoder(config, "llama", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize,
                    attention_bias=bias, output_bias=bias)


def mistral(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
            dequantize: bool = True) -> Mapping:
    """``MistralForCausalLM``: Llama's tensors (the sliding window is config)."""
    return _decoder(config, "mistral", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize)


def qwen2(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
          dequantize: bool = True) -> Mapping:
    """``Qwen2ForCausalLM``: q/k/v biases."""
    return _decoder(config, "qwen2", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize, attention_bias=True)


def qwen3(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
          dequantize: bool = True) -> Mapping:
    """``Qwen3ForCausalLM``: RMS norms of each query and key head."""
    return _decoder(config, "qwen3", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize, qk_norm=True)


def gemma2(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
           dequantize: bool = True) -> Mapping:
    """``Gemma2ForCausalLM``: tied embeddings, norms around the MLP too."""
    return _decoder(config, "gemma2", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize,
                    ffn_norms=True, tied=True)


def gemma3(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
           dequantize: bool = True) -> Mapping:
    """``Gemma3ForCausalLM`` (text): Gemma 2's tensors and query/key norms."""
    return _decoder(config, "gemma3", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize,
                    ffn_norms=True, tied=True, qk_norm=True)


def mixtral(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
            dequantize: bool = True) -> Mapping:
    """``MixtralForCausalLM``: a router and experts ``w1, w3, w2`` stacked on a leading axis."""
    return _decoder(config, "mixtral", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize,
                    moe=("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")))


def qwen3_moe(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
              dequantize: bool = True) -> Mapping:
    """``Qwen3MoeForCausalLM`` (every layer sparse): query/key norms, experts stacked."""
    return _decoder(config, "qwen3_moe", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize, qk_norm=True,
                    moe=("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")))


def gpt_oss(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
            dequantize: bool = True) -> Mapping:
    """``GptOssForCausalLM``: biases on q/k/v/o, attention sinks, a router with a bias and
    fused experts (``gate_up_proj`` one leaf, gate and up interleaved as stored). The MXFP4
    release (``quantization_config``) is read dequantized into the same tree; it cannot be
    kept quantized (``dequantize=False`` is refused for it)."""
    return _decoder(config, "gpt_oss", scan_layers=scan_layers, dtype=dtype, attention_bias=True, output_bias=True,
                    sinks=True, fused_experts=True, dequantize=dequantize)


def olmo3(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
          dequantize: bool = True) -> Mapping:
    """``Olmo3ForCausalLM``: norms after the attention and the MLP (none before), query/key
    norms over the whole projection (``(heads * head_dim,)`` and ``(kv_heads * head_dim,)``
    leaves, as stored); q/k/v/o biases when the config sets ``attention_bias`` (no release
    does). Its sliding-window/full layer pattern and per-layer-type RoPE are config."""
    bias = bool(config is not None and config_value(config, "attention_bias", False))
    return _decoder(config, "olmo3", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize, post_norms=True,
                    qk_norm=True, attention_bias=bias, output_bias=bias)


def qwen3_vl(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
             dequantize: bool = True) -> Mapping:
    """``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``: Qwen3's
    (Qwen3-MoE's) text decoder under ``model.language_model.`` (its tree too), the MoE release's
    experts fused per layer as it stores them (``gate_up_proj`` ``[experts, hidden, 2 *
    moe_intermediate]``, gate then up; ``down_proj`` ``[experts, moe_intermediate, hidden]``;
    transformers' ``save_pretrained`` of a model it made writes them transposed, which this
    refuses by the sizes), and the vision tower ``model.visual.`` passed through as stored.
    Without a config the decoder is taken to be dense, its head untied."""
    text = text_config(config, ("text_config",))
    experts = config_value(text, "num_experts", config_value(text, "num_local_experts", 0)) if text is not None else 0
    return _decoder(text, "qwen3_vl", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize, qk_norm=True,
                    tied=bool(text is not None and config_value(text, "tie_word_embeddings",
                                                                config_value(config, "tie_word_embeddings", False))),
                    moe=("mlp.gate", "mlp.experts", None) if experts > 1 else None,
                    prefix="model.language_model.", towers=QWEN3_VL_TOWERS, release=config)


def qwen3_omni_moe(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
                   dequantize: bool = True) -> Mapping:
    """``Qwen3OmniMoeForConditionalGeneration``: the thinker's text decoder (Qwen3-MoE's, its
    experts stored one by one) under ``thinker.model.`` with its head ``thinker.lm_head``; the
    thinker's vision and audio towers passed through as stored; the talker and code2wav (speech
    output, which the thinker does not use) left out (``Mapping.ignore``)."""
    text = text_config(config, ("thinker_config", "text_config"))
    return _decoder(text, "qwen3_omni_moe", scan_layers=scan_layers, dtype=dtype, dequantize=dequantize,
                    qk_norm=True, moe=("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                    prefix="thinker.model.", head="thinker.lm_head", release=config,
                    towers=QWEN3_OMNI_TOWERS, ignore=("talker.", "code2wav."))


FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma2": gemma2,
            "gemma3_text": gemma3, "mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3,
            "deepseek_v2": deepseek_v2, "deepseek_v32": deepseek_v32, "gpt_oss": gpt_oss, "olmo3": olmo3,
            "qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_text": qwen3_5, "qwen3_5_moe": qwen3_5,
            "qwen3_5_moe_text": qwen3_5}
FAMILIES.update({"qwen3_vl": qwen3_vl, "qwen3_vl_moe": qwen3_vl, "qwen3_omni_moe": qwen3_omni_moe})
FAMILIES["gemma4_text"] = gemma4  # its layers differ in shape: mappings.gemma4
FAMILIES["deepseek_v4"] = deepseek_v4
FAMILIES["kimi_k2"] = deepseek_v3  # Kimi-K2's own model_type: DeepSeek-V3's architecture and config keys


def for_config(config: Any, *, scan_layers: bool = False, dtype: Any = None,
               dequantize: bool = True) -> Mapping:
    """The mapping of the family ``config.model_type`` names, for the release ``config``
    describes: a quantized one (``quantization_config``: FP8 block-scaled, MXFP4,
    compressed-tensors, ModelOpt NVFP4, DeepSeek-V4's FP8 + MXFP4) read dequantized
    (``dequantize=True``) or, FP8, kept as stored (``mappings._quantized``)."""
    model_type = config_value(config, "model_type")
    if model_type not in FAMILIES:
        raise ArgumentError(f"no shipped mapping for model_type {model_type!r}; shipped: {', '.join(FAMILIES)}")
    return FAMILIES[model_type](config, scan_layers=scan_layers, dtype=dtype, dequantize=dequantize)
