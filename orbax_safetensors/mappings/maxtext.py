"""Hugging Face checkpoints ↔ MaxText's own params tree, loaded per shard.

MaxText (0.2.x) converts a Hugging Face checkpoint in a separate step
(``checkpoint_conversion/to_maxtext.py``): every tensor is loaded whole on the
host, transformed, stacked with ``np.stack`` and saved again as an Orbax
checkpoint, which needs host memory for the whole model (several times over;
maxtext#864 reports 2.9 TB). This mapping states the same conversion as rules,
re-derived from MaxText's ``checkpoint_conversion/utils/param_mapping.py``
(``LLAMA31_``, ``QWEN_``, ``MIXTRAL_`` and ``GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING``
and their ``..._HOOK_FN``) and ``hf_shape.py``, so ``ost.load`` reads each
device's shard of the scanned tree straight from the Hugging Face files and
``ost.save`` writes a training state's tree back as Hugging Face tensors, with
no conversion step and no host copy of the model. MaxText 0.2.5 has a Mistral
model (``mistral-7b``) but no converter for it: its rules are derived from
MaxText's ``models/mistral.py`` (Llama's layer; ``Attention`` without a query
scale or q/k norms, so the query kernel carries ``1/sqrt(head_dim)`` as
Mixtral's does; the default rotate-half ``RotaryEmbedding``, so no reordering)
and checked by MaxText's forward pass against transformers'.

The tree is the ``params`` collection of MaxText's decoder, named as MaxText
names it (without the ``params`` collection itself and without Linen/NNX's
``value`` wrappers)::

    token_embedder.embedding                                   (vocab, embed)
    decoder.decoder_norm.scale                                 (embed,)
    decoder.logits_dense.kernel                                (embed, vocab)
    decoder.layers.self_attention.query.kernel                 (embed, layers, heads, head_dim)
    decoder.layers.self_attention.{key,value}.kernel           (embed, layers, kv_heads, head_dim)
    decoder.layers.self_attention.out.kernel                   (heads, layers, head_dim, embed)
    decoder.layers.mlp.{wi_0,wi_1}.kernel                      (embed, layers, mlp)
    decoder.layers.mlp.wo.kernel                               (mlp, layers, embed)
    decoder.layers.{pre,post}_self_attention_layer_norm.scale  (embed, layers)

with layers at axis 1 (MaxText's ``param_scan_axis``) when scanned, and
``decoder.layers_{i}.…`` without that axis when not; no ``logits_dense`` when
the embedding is tied (MaxText's ``logits_via_embedding``). Qwen3 adds
``self_attention.{query,key}_norm.scale``; MoE models (Qwen3-MoE, Mixtral)
replace ``mlp`` by ``moe_block`` / ``MoeBlock_0``: ``gate.kernel`` (embed,
[layers,] experts) and ``wi_0``, ``wi_1``, ``wo`` with experts at axis 0
(experts, [layers,] embed, mlp).

Gemma 3 scans blocks of its 6-layer attention pattern (5 sliding-window layers,
then a global one): layer ``6 * n + k`` is index ``n`` (axis 1) of
``decoder.layers.layers_{k}.…`` (``k`` in 0..5), and the ``num_layers % 6``
layers left over (``layers_remainder``, MaxText's unscanned tail) are
``decoder.layers_remainder.layers_{k}.…`` without a layers axis (``Strided``
rules); unscanned it is ``decoder.layers_{i}.…`` as for the others. Its norms
are ``pre_self_attention_norm``, ``post_self_attention_norm``,
``pre_ffw_norm``, ``post_ffw_norm`` and the q/k norms, and its embedding is
tied.

DeepSeek-V3 (``"deepseek3"``: MLA attention, dense then MoE layers) has a tree
of its own, ``decoder.dense_layers_{k}`` / ``decoder.moe_layers_{k}`` (scanned:
the stacks ``decoder.dense_layers`` / ``decoder.moe_layers``): its rules, and
what is exact, are ``mappings.deepseek``'s.

gpt-oss (``gpt-oss-20b``, ``gpt-oss-120b``; ``GPT_OSS_MAXTEXT_TO_HF_PARAM_MAPPING``
and its hooks) scans pairs of layers the same way (a sliding-window layer,
then a global one: ``decoder.layers.layers_{0,1}.…``, layer ``2 * n + k``
at index ``n``). Its attention is ``GptOssAttention`` with q/k/v/o biases
(``query.bias`` (heads, [layers,] head_dim), ``out.bias`` (embed, [layers]))
and ``sinks`` (heads, [layers]); its MoE ``GptOssMlp``: ``gate.kernel``,
``gate.bias`` (experts, [layers]), and ``wi_0``, ``wi_1`` (experts, [layers,]
embed, mlp), ``wo`` with biases ``wi_0_bias``, ``wi_1_bias``, ``wo_bias``,
experts at axis 0. Hugging Face stores each layer's experts fused, gate and
up interleaved in one ``gate_up_proj`` (gate at even columns): ``wi_0`` and
``wi_1`` are its even and odd columns (``Rule.take``), each device reading
only the column pairs it holds. Since two leaves come from one stored
tensor, this mapping loads (and ``ost.convert`` writes MaxText's checkpoint)
but cannot save: a save through it is refused while it is planned
(``MappingError``).

Values follow MaxText's converter: Llama 3.1's, Mixtral's and Mistral's query
kernel is scaled by ``1/sqrt(head_dim)`` (in float32; their MaxText attention
does not scale), Llama 3.1's query and key heads are reordered from Hugging
Face's rotate-half RoPE order to MaxText's interleaved one. Gemma 3's norm
scales are Hugging Face's ``w`` plus 1 (MaxText's RMSNorm multiplies by its
scale, Hugging Face's by ``1 + w``), and its embedding is multiplied by
``sqrt(hidden_size)`` rounded to bfloat16 (50.5 for 2560: what MaxText's
converter stores, since MaxText's forward does not scale the embedding;
Hugging Face scales by the unrounded root, a gap MaxText's conversion has
too). A save undoes all of it (``planning.transforms`` says what is exact):

* a bfloat16 checkpoint comes back bit for bit, Gemma 3's norms too wherever
  ``|w| >= 2**-16`` (smaller nonzero norm weights lose their bits below
  ``2**-24``; ``-0.0`` comes back ``+0.0``);
* a float32 one too when ``head_dim`` is a power of four (otherwise the query's
  last bit may move) and, for Gemma 3, when ``sqrt(hidden_size)`` rounded to
  bfloat16 is a power of two and each norm weight ``w`` has ``w + 1`` exact in
  float32 (a bfloat16 value, for one); otherwise the embedding's or a norm's
  last bits may move.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings import deepseek
from orbax_safetensors.mappings._config import attention_dims, config_sizes, config_value
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.planning.rules import Mapping, Rule, Strided

_LLAMA_NORMS = (("input_layernorm", "pre_self_attention_layer_norm"),
                ("post_attention_layernorm", "post_self_attention_layer_norm"))
_GEMMA3_NORMS = (("input_layernorm", "pre_self_attention_norm"), ("post_attention_layernorm", "post_self_attention_norm"),
                 ("pre_feedforward_layernorm", "pre_ffw_norm"), ("post_feedforward_layernorm", "post_ffw_norm"))


@dataclasses.dataclass(frozen=True)
class _Family:
    """What one MaxText family's converter does beyond the shared Llama-like rules."""

    query_scale: bool  # query kernel scaled by 1/sqrt(head_dim) (MaxText's attention does not)
    rope_interleave: bool  # query/key heads reordered from rotate-half to interleaved RoPE
    qk_norm: bool = False
    moe: str | None = None  # the MoE block's module name
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF names of wi_0, wi_1, wo
    router: str = "mlp.gate"
    experts_module: str = "mlp.experts"
    norms: tuple[tuple[str, str], ...] = _LLAMA_NORMS  # per-layer norms: (HF name, MaxText name)
    norm_offset: float | None = None  # MaxText's norm scales are HF's plus this (Gemma: 1 + w)
    embedding_scale: bool = False  # embedding times sqrt(hidden_size) rounded to bfloat16 (Gemma)
    pattern: int | None = None  # scanned layers in blocks of this many (Gemma 3's attention pattern)
    attention: str = "self_attention"  # the attention module's name
    attention_bias: bool = False  # q/k/v/o biases and attention sinks (gpt-oss)
    fused_experts: bool = False  # gpt-oss's MoE: router bias, experts stored fused, gate/up interleaved


# MaxText model_name prefixes: those with a converter in MaxText, and mistral, which has the
# model but no converter (llama2 has neither here).
FAMILIES = {
    "llama3.1": _Family(query_scale=True, rope_interleave=True),
    "qwen3": _Family(query_scale=False, rope_interleave=False, qk_norm=True, moe="moe_block"),
    "mixtral": _Family(query_scale=True, rope_interleave=False, moe="MoeBlock_0", experts=("w1", "w3", "w2"),
                       router="block_sparse_moe.gate", experts_module="block_sparse_moe.experts"),
    # MaxText's mistral block: Llama's layer, its Attention unscaled (no query_pre_attn_scalar, no
    # q/k norm) with the default rotate-half RotaryEmbedding, as mixtral's.
    "mistral": _Family(query_scale=True, rope_interleave=False),
    # The query is scaled by MaxText's attention (query_pre_attn_scalar), after the q/k norms.
    "gemma3": _Family(query_scale=False, rope_interleave=False, qk_norm=True, norms=_GEMMA3_NORMS, norm_offset=1.0,
                      embedding_scale=True, pattern=6),
    # The query is scaled by MaxText's attention (query_pre_attn_scalar); layers scanned in pairs
    # (inhomogeneous_layer_cycle_interval 2: a sliding-window layer, then a global one).
    "gpt-oss": _Family(query_scale=False, rope_interleave=False, moe="GptOssMlp", attention="GptOssAttention",
                       attention_bias=True, fused_experts=True, pattern=2),
}
# MaxText families whose tree is not the Llama-like one above: their own rules.
OWN_RULES: dict[str, Callable[..., Mapping]] = {"deepseek3": deepseek.maxtext_deepseek3}


def maxtext(family: str, config: Any, scan_layers: bool = True, *, dtype: Any = None,
            dequantize: bool = True) -> Mapping:
    """The mapping between a Hugging Face checkpoint of ``family`` and MaxText's tree.

    ``family`` is MaxText's ``model_name`` or its prefix (``"llama3.1"``,
    ``"llama3.1-8b"``, ``"qwen3-30b-a3b"``, ``"mixtral-8x7b"``, ``"mistral-7b"``,
    ``"gemma3-4b"``); ``config`` the Hugging Face config (a transformers config
    or a dict; Gemma 3's text config, or the multimodal one whose
    ``text_config`` it reads, with the text tensors under
    ``model.language_model.``); ``scan_layers`` as in MaxText's config;
    ``dtype`` the dtype a save writes (MaxText trains float32 params;
    ``"bfloat16"`` gives back a bfloat16 checkpoint); ``dequantize`` how a quantized
    release (the config's ``quantization_config``) is read: dequantized (the default;
    MaxText's tree holds the values) or, FP8, kept (``mappings._quantized``). Qwen3 is MoE when the
    config has ``num_experts > 1`` (``moe_block``, experts stacked at axis 0,
    layers then at 1). ``"deepseek3"`` (``deepseek3-671b``, ``deepseek3-tiny``) is
    ``mappings.deepseek``'s. gpt-oss's ``wi_0``/``wi_1`` are read from one stored
    ``gate_up_proj`` (``Rule.take``), so a save through its mapping is refused while
    it is planned.
    """
    name = next((f for f in (*FAMILIES, *OWN_RULES) if family == f or family.startswith(f + "-")), None)
    if name is None:
        raise ArgumentError(f"no MaxText mapping for {family!r}; available: {', '.join((*FAMILIES, *OWN_RULES))}")
    if name in OWN_RULES:
        return OWN_RULES[name](config, scan_layers, dtype=dtype, dequantize=dequantize)
    spec = FAMILIES[name]
    if config is None:  # the query scale and the head split need the head sizes
        raise ArgumentError(f"maxtext({family!r}, config): config is None; pass the checkpoint's Hugging "
                         "Face config (a transformers config or its dict: num_attention_heads, "
                         "num_key_value_heads, head_dim or hidden_size)")
    release, text = config, config_value(config, "text_config")
    prefix = "model." if text is None else "model.language_model."
    config = config if text is None else text
    dims = attention_dims(config, f"maxtext({family!r})")
    per_layer = _layer_rules(f"{prefix}layers.{{i}}.", scan_layers, spec.pattern,
                             _num_layers(config, family) if spec.pattern else 0)
    linear = {"transpose": (1, 0), "dtype": dtype}
    norm = {"offset": spec.norm_offset, "dtype": dtype}
    rules = [
        Rule(f"{prefix}embed_tokens.weight", "token_embedder.embedding", dtype=dtype,
             scale=_embedding_scale(config, family) if spec.embedding_scale else None),
        Rule(f"{prefix}norm.weight", "decoder.decoder_norm.scale", **norm),
        *_attention(spec, per_layer, dims, dtype),
    ]
    for hf, mt in spec.norms + ((("self_attn.q_norm", f"{spec.attention}.query_norm"),
                                 ("self_attn.k_norm", f"{spec.attention}.key_norm")) if spec.qk_norm else ()):
        rules += per_layer(f"{hf}.weight", f"{mt}.scale", **norm)
    if spec.fused_experts:
        rules += _fused_experts(spec.moe, per_layer, dtype)
    elif spec.moe is not None and config_value(config, "num_experts", config_value(config, "num_local_experts", 0)) > 1:
        rules += per_layer(f"{spec.router}.weight", f"{spec.moe}.gate.kernel", **linear)
        for hf, mt in zip(spec.experts, ("wi_0", "wi_1", "wo")):
            rules += per_layer(f"{spec.experts_module}.{{e}}.{hf}.weight", f"{spec.moe}.{mt}", experts=True, **linear)
    else:
        for hf, mt in zip(("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo")):
            rules += per_layer(f"mlp.{hf}.weight", f"mlp.{mt}.kernel", **linear)
    if not config_value(config, "tie_word_embeddings", False):  # tied: MaxText's logits_via_embedding
        rules.append(Rule("lm_head.weight", "decoder.logits_dense.kernel", **linear))
    return quantized_mapping(rules, release, dequantize=dequantize, dims=dims, checkpoint_form="maxtext",
                             sizes=config_sizes(config, prefix))


def _attention(spec: _Family, per_layer: Callable[..., list[Rule]], dims: dict[str, int], dtype: Any) -> list[Rule]:
    """The attention's kernels (and gpt-oss's biases and sinks): heads split out, the query
    scaled and query/key heads reordered where ``spec`` says."""
    linear = {"transpose": (1, 0), "dtype": dtype}
    rope = {"permute": {-1: "halves_to_interleaved"}} if spec.rope_interleave else {}
    scale = {"scale": 1 / math.sqrt(dims["head_dim"])} if spec.query_scale else {}
    module = spec.attention
    rules = [
        *per_layer("self_attn.q_proj.weight", f"{module}.query.kernel",
                   split={1: ("heads", "head_dim")}, **rope, **scale, **linear),
        *per_layer("self_attn.k_proj.weight", f"{module}.key.kernel",
                   split={1: ("kv_heads", "head_dim")}, **rope, **linear),
        *per_layer("self_attn.v_proj.weight", f"{module}.value.kernel",
                   split={1: ("kv_heads", "head_dim")}, **linear),
        *per_layer("self_attn.o_proj.weight", f"{module}.out.kernel", split={0: ("heads", "head_dim")}, **linear),
    ]
    if spec.attention_bias:
        for hf, mt, heads in (("q_proj", "query", "heads"), ("k_proj", "key", "kv_heads"), ("v_proj", "value", "kv_heads")):
            rules += per_layer(f"self_attn.{hf}.bias", f"{module}.{mt}.bias", split={0: (heads, "head_dim")}, dtype=dtype)
        rules += per_layer("self_attn.o_proj.bias", f"{module}.out.bias", dtype=dtype)
        rules += per_layer("self_attn.sinks", f"{module}.sinks", dtype=dtype)
    return rules


def _fused_experts(moe: str, per_layer: Callable[..., list[Rule]], dtype: Any) -> list[Rule]:
    """gpt-oss's MoE, its experts stored fused per layer (``[experts, ...]``, used as ``x @ w``):
    the router and its bias; ``gate_up_proj`` ``[experts, embed, 2 * mlp]``, gate and up
    interleaved, is MaxText's ``wi_0`` (its even columns) and ``wi_1`` (its odd ones), its bias
    ``wi_0_bias``/``wi_1_bias``, as MaxText's converter's ``interleave`` hook splits them
    (``Rule.take``: each device reads only its columns' pairs); ``down_proj`` is ``wo``."""
    rules = [*per_layer("mlp.router.weight", f"{moe}.gate.kernel", transpose=(1, 0), dtype=dtype),
             *per_layer("mlp.router.bias", f"{moe}.gate.bias", dtype=dtype),
             *per_layer("mlp.experts.down_proj", f"{moe}.wo", dtype=dtype),
             *per_layer("mlp.experts.down_proj_bias", f"{moe}.wo_bias", dtype=dtype)]
    for index, leaf in enumerate(("wi_0", "wi_1")):
        rules += per_layer("mlp.experts.gate_up_proj", f"{moe}.{leaf}", split={2: (-1, 2)}, take={3: index})
        rules += per_layer("mlp.experts.gate_up_proj_bias", f"{moe}.{leaf}_bias", split={1: (-1, 2)}, take={2: index})
    return rules


def _layer_rules(stored_prefix: str, scan_layers: bool, pattern: int | None, num_layers: int
                 ) -> Callable[..., list[Rule]]:
    """``per_layer(stored, tree, *, experts=False, **transform)``: the rules of one per-layer tensor.

    Unscanned, layer ``i`` is ``decoder.layers_{i}``; scanned, ``decoder.layers`` with the
    layers at axis 1 (MaxText's ``param_scan_axis``; experts at 0). With an attention
    ``pattern`` (Gemma 3: 6) MaxText scans blocks of ``pattern`` layers: layer ``pattern * n + k``
    is index ``n`` of ``decoder.layers.layers_{k}``, and the ``num_layers % pattern`` left over
    are ``decoder.layers_remainder.layers_{k}``, unstacked.
    """
    def per_layer(stored: str, tree: str, *, experts: bool = False, **transform: Any) -> list[Rule]:
        source, stack = stored_prefix + stored, {"e": 0} if experts else {}
        if not scan_layers:
            return [Rule(source, f"decoder.layers_{{i}}.{tree}", stack=stack, **transform)]
        if pattern is None:
            return [Rule(source, f"decoder.layers.{tree}", stack={**stack, "i": 1}, **transform)]
        scanned = num_layers - num_layers % pattern
        rules = [Rule(source, f"decoder.layers.layers_{{k}}.{tree}", stack={**stack, "i": 1},
                      strided={"i": Strided("k", pattern, stop=scanned)}, **transform)] if scanned else []
        if scanned < num_layers:
            rules.append(Rule(source, f"decoder.layers_remainder.layers_{{k}}.{tree}", stack=stack,
                              strided={"i": Strided("k", pattern, start=scanned, stop=num_layers)}, **transform))
        return rules

    return per_layer


def _num_layers(config: Any, family: str) -> int:
    layers = config_value(config, "num_hidden_layers")
    if layers is None:  # where each layer goes depends on how many there are
        raise ArgumentError(f"maxtext({family!r}): the config has no num_hidden_layers")
    return int(layers)


def _embedding_scale(config: Any, family: str) -> float:
    """MaxText's converter stores Gemma's embedding times ``sqrt(hidden_size)`` rounded to
    bfloat16 (its forward then scales nothing; Hugging Face's multiplies by the unrounded root)."""
    hidden = config_value(config, "hidden_size")
    if hidden is None:
        raise ArgumentError(f"maxtext({family!r}): the config has no hidden_size, which scales the embedding")
    return float(ml_dtypes.bfloat16(math.sqrt(hidden)))
