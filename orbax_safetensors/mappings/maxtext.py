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

Gemma 2 (``gemma2-2b``, ``-9b``, ``-27b``; ``GEMMA2_MAXTEXT_TO_HF_PARAM_MAPPING``) pairs its
layers: MaxText's layer ``n`` holds Hugging Face's layer ``2n`` (sliding window) as
``…_local`` modules and ``2n + 1`` (global) as ``…_global`` ones
(``decoder.layers.self_attention_local.query.kernel``, ``decoder.layers.mlp_global.wi_0.kernel``,
``decoder.layers.pre_ffw_norm_local.scale``: index ``n`` of axis 1 scanned,
``decoder.layers_{n}.…`` unscanned), Gemma 3's norms without q/k norms. Its query kernel carries
``query_pre_attn_scalar**-0.5`` (MaxText's Gemma 2 attention does not scale; MaxText's converter
uses ``head_dim``'s root, the same for 2b and 9b, but not for 27b, whose scalar is 144 and
``head_dim`` 128: Hugging Face's model scales by the scalar's), its norms are ``1 + w`` and its
embedding is scaled by the float32 root of ``hidden_size``. MaxText pads Gemma 2's vocabulary to
256128 rows (its yml); this mapping needs the checkpoint's 256000 (``vocab_size=256000``).

Gemma 4 (``gemma4-31b``, ``gemma4-26b``, and unscanned the small ``gemma4-e2b``, ``gemma4-e4b``;
``"gemma4"``: layers of two shapes, scanned as blocks of 5 sliding-window layers, each scanned
again, and a global one) has a tree of its own: ``mappings.gemma4``'s.

DeepSeek-V3 (``"deepseek3"``: MLA attention, dense then MoE layers) has a tree
of its own, ``decoder.dense_layers_{k}`` / ``decoder.moe_layers_{k}`` (scanned:
the stacks ``decoder.dense_layers`` / ``decoder.moe_layers``): its rules, and
what is exact, are ``mappings.deepseek``'s. So are DeepSeek-V2's (``"deepseek2"``:
the same tree without the router bias) and DeepSeek-V3.2's (``"deepseek3.2"``: V3's
and each attention's ``self_attention.indexer``). DeepSeek-V4 (``"deepseek4"``: compressed
attention, hyper-connections, hash-routed first layers) is ``mappings.deepseek_v4``'s.

Qwen3-Next (``"qwen3-next"``, ``qwen3-next-80b-a3b``: gated-delta-net layers, then a
gated full-attention one, per ``full_attention_interval``; MoE with a gated shared expert)
has a tree of its own too, ``decoder.layers_{i}`` by layer kind, scanned as MaxText's
nested scan (``decoder.layers.local_layers`` with two layer axes, block and position,
and ``decoder.layers.global_layer``): its rules are ``mappings.qwen_hybrid``'s. So are
Qwen3.5's (``"qwen3.5"``: the same layers, scanned as ``decoder.layers.layer_{k}``; its
``in_proj_qkvz``/``in_proj_ba`` interleave per key head slices of the stored
``in_proj_qkv``/``in_proj_z`` and ``in_proj_b``/``in_proj_a``, and its experts are the
release's fused ``gate_up_proj`` halves: a load and ``ost.convert``, no save).

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
only the column pairs it holds. A save writes ``gate_up_proj`` from both
leaves, each device its own columns; a tree lacking one of them is refused
while the save is planned (``MappingError``).

Qwen2.5 (``qwen2.5-1.5b``, ``-7b``, ``-14b``; Qwen3's ``QWEN_MAXTEXT_TO_HF_PARAM_MAPPING``) is
Llama's tree with q/k/v biases, ``self_attention.{query,key,value}.bias`` (heads or kv_heads,
[layers,] head_dim), its query neither scaled nor reordered. OLMo 3 (``olmo3-7b``,
``olmo3-7b-pt``, ``olmo3-32b``; ``OLMO3_MAXTEXT_TO_HF_PARAM_MAPPING``) names its attention
``attention``, normalises only outputs (``post_self_attention_layer_norm``,
``post_mlp_layer_norm``) and its q/k norms span the whole projection
(``attention.{query,key}_norm.scale``, (heads or kv_heads * head_dim,)); scanned, it is blocks of
4 layers (3 sliding-window, then a global one: ``decoder.layers.layers_{0..3}``, layer ``4 * n + k``
at index ``n``) and MaxText builds no remainder, so a scanned mapping of a layer count that is not
a multiple of 4 is refused.

Qwen3-VL (``qwen3-vl-2b``, ``-4b``, ``-30b-a3b``; ``QWEN3_VL_MAXTEXT_TO_HF_PARAM_MAPPING``) and
Qwen3-Omni (``qwen3-omni-30b-a3b``; ``QWEN3_OMNI_MOE_MAXTEXT_TO_HF_PARAM_MAPPING``) map their text
decoder, Qwen3's tree (Qwen3-MoE's for the MoE releases), read from ``model.language_model.`` /
``thinker.model.`` (head ``thinker.lm_head``) with the config's ``text_config`` /
``thinker_config.text_config``. MaxText's tree is its text model's (``use_multimodal`` off): the
towers (``model.visual.``; ``thinker.visual.``, ``thinker.audio_tower.``, ``talker.``,
``code2wav.``) are left out of a load and a conversion (``Mapping.ignore``), as MaxText's converter
leaves them without ``use_multimodal``. Qwen3-VL-MoE stores each layer's experts fused,
``gate_up_proj`` ``[experts, embed, 2 * mlp]`` (gate then up) and ``down_proj``: ``wi_0``/``wi_1``
are its halves (``Rule.take``), written back from both, as gpt-oss's.

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

import ml_dtypes  # noqa: F401  (numpy learns "bfloat16": the embedding scale's rounding)
import numpy as np

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings import deepseek, qwen_hybrid
from orbax_safetensors.mappings.deepseek_v4 import maxtext_deepseek4
from orbax_safetensors.mappings.gemma4 import maxtext_gemma4
from orbax_safetensors.mappings._config import attention_dims, config_sizes, config_value
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.mappings._towers import text_config
from orbax_safetensors.planning.rules import Mapping, Rule, Strided

_LLAMA_NORMS = (("input_layernorm", "pre_self_attention_layer_norm"),
                ("post_attention_layernorm", "post_self_attention_layer_norm"))
_GEMMA3_NORMS = (("input_layernorm", "pre_self_attention_norm"), ("post_attention_layernorm", "post_self_attention_norm"),
                 ("pre_feedforward_layernorm", "pre_ffw_norm"), ("post_feedforward_layernorm", "post_ffw_norm"))
# OLMo 3 normalises the attention's and the MLP's outputs, not their inputs.
_OLMO3_NORMS = (("post_attention_layernorm", "post_self_attention_layer_norm"),
                ("post_feedforward_layernorm", "post_mlp_layer_norm"))


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
    embedding_scale_dtype: str = "bfloat16"  # what that root is rounded to (Gemma 2's converter: float32)
    # The query's scale is query_pre_attn_scalar**-0.5 where the config has one (Gemma 2: the 27b's
    # is 144, not its head_dim 128; MaxText's converter scales by head_dim's root regardless).
    query_pre_attn_scalar: bool = False
    pattern: int | None = None  # scanned layers in blocks of this many (Gemma 3's attention pattern)
    # One MaxText layer holds two HF layers, its modules named with these suffixes: layer 2n's
    # ("_local", sliding window) and 2n + 1's ("_global") (Gemma 2's paired decoder layer).
    paired: tuple[str, str] | None = None
    # Scanned, the layers past the last whole pattern are MaxText's layers_remainder (Gemma 3);
    # False: MaxText's generic scan builds num_layers // pattern blocks and no remainder, so a
    # scanned mapping of such a layer count is refused.
    remainder: bool = True
    attention: str = "self_attention"  # the attention module's name
    biases: tuple[str, ...] = ()  # HF projections with a bias: q/k/v (Qwen2.5), q/k/v/o (gpt-oss)
    sinks: bool = False  # attention sinks (gpt-oss)
    fused_experts: bool = False  # gpt-oss's MoE: router bias, experts stored fused, gate/up interleaved
    # Qwen3-VL-MoE's experts: stored fused per layer, gate_up_proj [experts, embed, 2 * mlp] its
    # first half gate, its second up; down_proj [experts, mlp, embed].
    gate_up_halves: bool = False
    # A multimodal release: the config keys that lead to its text decoder's config, where that
    # decoder's tensors are (and its head: head_prefix + "lm_head.weight"), and the stored prefixes
    # of what MaxText's text model (use_multimodal off) does not hold: vision and audio towers, a
    # talker (Mapping.ignore: left out of a load and a conversion, as MaxText's converter leaves them).
    text_config: tuple[str, ...] = ("text_config",)
    text_prefix: str = "model.language_model."
    head_prefix: str = ""
    towers: tuple[str, ...] = ()


# The families whose tree is Llama's with the changes their entry names: those with a converter
# in MaxText, and mistral, which has the model but no converter (llama2 has neither here).
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
    # GEMMA2_MAXTEXT_TO_HF_PARAM_MAPPING and its hooks: models/gemma2.py's Attention does not
    # scale, so the query kernel carries it; the embedding's scale is the float32 root.
    "gemma2": _Family(query_scale=True, rope_interleave=False, norms=_GEMMA3_NORMS, norm_offset=1.0,
                      embedding_scale=True, embedding_scale_dtype="float32", query_pre_attn_scalar=True,
                      paired=("_local", "_global")),
    # The query is scaled by MaxText's attention (query_pre_attn_scalar); layers scanned in pairs
    # (inhomogeneous_layer_cycle_interval 2: a sliding-window layer, then a global one).
    "gpt-oss": _Family(query_scale=False, rope_interleave=False, moe="GptOssMlp", attention="GptOssAttention",
                       biases=("q_proj", "k_proj", "v_proj", "o_proj"), sinks=True, fused_experts=True, pattern=2,
                       remainder=False),
    # QWEN_MAXTEXT_TO_HF_PARAM_MAPPING (qwen3's too) with its q/k/v biases; models/qwen2.py's
    # attention scales the query itself (query_pre_attn_scalar) with the default rotate-half RoPE.
    "qwen2.5": _Family(query_scale=False, rope_interleave=False, biases=("q_proj", "k_proj", "v_proj")),
    # OLMO3_MAXTEXT_TO_HF_PARAM_MAPPING: every hook a transpose or identity. models/olmo3.py:
    # post-norms only, the query scaled by its attention, q/k norms over the whole projection
    # (GlobalRMSNorm: the stored (heads * head_dim,) weight as it is), layers scanned in blocks of
    # 4 (inhomogeneous_layer_cycle_interval: 3 sliding-window layers, then a global one).
    "olmo3": _Family(query_scale=False, rope_interleave=False, qk_norm=True, norms=_OLMO3_NORMS,
                     attention="attention", pattern=4, remainder=False),
    # QWEN3_VL_MAXTEXT_TO_HF_PARAM_MAPPING: Qwen3's text rules (models/qwen3.py; its MRoPE is the
    # default RoPE on text positions) under model.language_model.; the MoE release's fused experts.
    "qwen3-vl": _Family(query_scale=False, rope_interleave=False, qk_norm=True, moe="moe_block",
                        gate_up_halves=True, towers=("model.visual.",)),
    # QWEN3_OMNI_MOE_MAXTEXT_TO_HF_PARAM_MAPPING: the thinker's text decoder, Qwen3-MoE's rules
    # under thinker.model. (experts stored one by one).
    "qwen3-omni": _Family(query_scale=False, rope_interleave=False, qk_norm=True, moe="moe_block",
                          text_config=("thinker_config", "text_config"), text_prefix="thinker.model.",
                          head_prefix="thinker.", towers=("thinker.visual.", "thinker.audio_tower.", "talker.",
                                                          "code2wav.")),
}
# MaxText families whose tree is not the Llama-like one above: their own rules.
OWN_RULES: dict[str, Callable[..., Mapping]] = {"deepseek2": deepseek.maxtext_deepseek2,
                                                 "deepseek3": deepseek.maxtext_deepseek3,
                                                 "deepseek3.2": deepseek.maxtext_deepseek32,
                                                 "deepseek4": maxtext_deepseek4,
                                                 "qwen3-next": qwen_hybrid.maxtext_qwen3_next,
                                                 "qwen3.5": qwen_hybrid.maxtext_qwen3_5,
                                                 "gemma4": maxtext_gemma4}  # layers of two shapes
# Each family's MaxText 0.2.5 model names (``configs/models/*.yml``, ``PARAM_MAPPING``'s keys):
# ``maxtext(name, ...)`` takes a family or one of these, exactly, and nothing else, so a model
# of another architecture that shares a prefix (``qwen3-next-…`` is not ``qwen3``) is refused
# rather than given a mapping that does not fit it.
MODEL_NAMES: dict[str, tuple[str, ...]] = {
    "llama3.1": ("llama3.1-8b", "llama3.1-8b-Instruct", "llama3.1-70b", "llama3.1-405b"),
    "qwen3": ("qwen3-0.6b", "qwen3-1.7b", "qwen3-1.7b-base", "qwen3-4b", "qwen3-4b-base", "qwen3-4b-thinking-2507",
              "qwen3-8b", "qwen3-8b-base", "qwen3-14b", "qwen3-14b-base", "qwen3-32b", "qwen3-30b-a3b",
              "qwen3-30b-a3b-base", "qwen3-235b-a22b", "qwen3-coder-480b-a35b", "qwen3-480b-a35b"),
    "mixtral": ("mixtral-8x7b", "mixtral-8x22b"),
    "mistral": ("mistral-7b",),
    "gemma3": ("gemma3-4b", "gemma3-12b", "gemma3-27b"),
    "gemma2": ("gemma2-2b", "gemma2-9b", "gemma2-27b"),
    "gemma4": ("gemma4-26b", "gemma4-31b", "gemma4-e2b", "gemma4-e4b"),
    "deepseek3": ("deepseek3-671b", "deepseek3-tiny", "deepseek3-test", "kimi-k2-1t"),
    "deepseek2": ("deepseek2-16b", "deepseek2-236b"),
    "deepseek3.2": ("deepseek3.2-671b",),
    "deepseek4": ("deepseek4-284b", "deepseek4-tiny"),
    "gpt-oss": ("gpt-oss-20b", "gpt-oss-120b"),
    "qwen3-next": ("qwen3-next-80b-a3b",),
    "qwen3.5": ("qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8", "qwen3.5-35b-fp8", "qwen3.5-397b-a17b",
                "qwen3.5-397b-a17b-fp8"),
    "qwen2.5": ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b"),
    "olmo3": ("olmo3-7b", "olmo3-7b-pt", "olmo3-32b"),
    "qwen3-vl": ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-30b-a3b"),
    "qwen3-omni": ("qwen3-omni-30b-a3b",),
}


def maxtext(family: str, config: Any, scan_layers: bool = True, *, dtype: Any = None,
            dequantize: bool = True) -> Mapping:
    """The mapping between a Hugging Face checkpoint of ``family`` and MaxText's tree.

    ``family`` is a family of ``MODEL_NAMES`` (``"llama3.1"``, ``"qwen3"``) or one of
    its MaxText model names, exactly (``"llama3.1-8b"``, ``"qwen3-30b-a3b"``); anything
    else is an ``ArgumentError`` listing them all; ``config`` the Hugging Face config (a transformers config
    or a dict; Gemma 3's text config, or the multimodal one whose
    ``text_config`` it reads, with the text tensors under
    ``model.language_model.``); ``scan_layers`` as in MaxText's config;
    ``dtype`` the dtype a save writes (MaxText trains float32 params;
    ``"bfloat16"`` gives back a bfloat16 checkpoint); ``dequantize`` how a quantized
    release (the config's ``quantization_config``) is read: dequantized (the default;
    MaxText's tree holds the values) or, FP8, kept (``mappings._quantized``). Qwen3 is MoE when the
    config has ``num_experts > 1`` (``moe_block``, experts stacked at axis 0,
    layers then at 1). ``"deepseek3"`` (``deepseek3-671b``, ``deepseek3-tiny``),
    ``"deepseek2"`` (``deepseek2-16b``, ``deepseek2-236b``) and ``"deepseek3.2"``
    (``deepseek3.2-671b``) are ``mappings.deepseek``'s, ``"deepseek4"`` (``deepseek4-284b``;
    scanned, the layers after the hash-routed ones alternate heavily compressed and compressed
    sparse attention) ``mappings.deepseek_v4``'s, ``"qwen3-next"`` (``qwen3-next-80b-a3b``;
    scanned, ``num_hidden_layers`` a multiple of ``full_attention_interval``) and ``"qwen3.5"``
    (``qwen3.5-35b-a3b``, ``qwen3.5-397b-a17b``, their ``-fp8``; the text decoder)
    ``mappings.qwen_hybrid``'s. gpt-oss's ``wi_0``/``wi_1`` are read from one stored
    ``gate_up_proj`` (``Rule.take``), which a save writes from both; a tree lacking one
    is refused while the save is planned. ``"olmo3"`` scanned needs ``num_hidden_layers`` a multiple of 4
    (MaxText's scanned blocks, no remainder): otherwise an ``ArgumentError``.
    ``"gemma2"`` needs an even ``num_hidden_layers`` (MaxText pairs them); ``"gemma4"``
    (``gemma4-31b``, ``gemma4-26b``; the small ``gemma4-e2b``/``e4b`` unscanned only, as MaxText)
    is ``mappings.gemma4``'s. ``"qwen3-vl"`` and
    ``"qwen3-omni"`` take the release's config (its text decoder's is read from it) and map
    that decoder alone, the towers left out (``Mapping.ignore``); Qwen3-VL-MoE's fused experts
    are saved from both halves' leaves, as gpt-oss's.
    """
    name = family_of(family)
    if name in OWN_RULES:
        return OWN_RULES[name](config, scan_layers, dtype=dtype, dequantize=dequantize)
    spec = FAMILIES[name]
    if config is None:  # the query scale and the head split need the head sizes
        raise ArgumentError(f"maxtext({family!r}, config): config is None; pass the checkpoint's Hugging "
                         "Face config (a transformers config or its dict: num_attention_heads, "
                         "num_key_value_heads, head_dim or hidden_size)")
    release, text = config, text_config(config, spec.text_config)
    prefix = "model." if text is None else spec.text_prefix
    head = "lm_head.weight" if text is None else f"{spec.head_prefix}lm_head.weight"
    tied = config_value(config, "tie_word_embeddings", False)  # a release's, where its text config says nothing
    config = config if text is None else text
    dims = attention_dims(config, f"maxtext({family!r})")
    num_layers = _num_layers(config, family) if spec.pattern or spec.paired else 0
    if spec.paired and num_layers % 2:
        raise ArgumentError(f"maxtext({family!r}): MaxText's {name} layer holds two layers (local, global); "
                            f"the config has {num_layers}")
    if scan_layers and spec.pattern and not spec.remainder and num_layers % spec.pattern:
        raise ArgumentError(f"maxtext({family!r}, scan_layers=True): MaxText scans {name}'s layers in blocks of "
                            f"{spec.pattern} and builds no remainder, so its scanned tree has no place for the "
                            f"last {num_layers % spec.pattern} of {num_layers} layers; scan_layers=False maps them all")
    per_layer = _layer_rules(f"{prefix}layers.{{i}}.", scan_layers, spec.pattern, num_layers, paired=spec.paired)
    linear = {"transpose": (1, 0), "dtype": dtype}
    norm = {"offset": spec.norm_offset, "dtype": dtype}
    rules = [
        Rule(f"{prefix}embed_tokens.weight", "token_embedder.embedding", dtype=dtype,
             scale=_embedding_scale(config, family, spec.embedding_scale_dtype) if spec.embedding_scale else None),
        Rule(f"{prefix}norm.weight", "decoder.decoder_norm.scale", **norm),
        *_attention(spec, per_layer, dims, dtype, query_scalar=config_value(
            config, "query_pre_attn_scalar") if spec.query_pre_attn_scalar else None),
    ]
    for hf, mt in spec.norms + ((("self_attn.q_norm", f"{spec.attention}.query_norm"),
                                 ("self_attn.k_norm", f"{spec.attention}.key_norm")) if spec.qk_norm else ()):
        rules += per_layer(f"{hf}.weight", f"{mt}.scale", **norm)
    experts = config_value(config, "num_experts", config_value(config, "num_local_experts", 0))
    if spec.fused_experts:
        rules += _fused_experts(spec.moe, per_layer, dtype)
    elif spec.gate_up_halves and experts > 1:
        rules += _gate_up_halves(spec, per_layer, dtype)
    elif spec.moe is not None and experts > 1:
        rules += per_layer(f"{spec.router}.weight", f"{spec.moe}.gate.kernel", **linear)
        for hf, mt in zip(spec.experts, ("wi_0", "wi_1", "wo")):
            rules += per_layer(f"{spec.experts_module}.{{e}}.{hf}.weight", f"{spec.moe}.{mt}", experts=True, **linear)
    else:
        for hf, mt in zip(("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo")):
            rules += per_layer(f"mlp.{hf}.weight", f"mlp.{mt}.kernel", **linear)
    if not config_value(config, "tie_word_embeddings", tied):  # tied: MaxText's logits_via_embedding
        rules.append(Rule(head, "decoder.logits_dense.kernel", **linear))
    return quantized_mapping(rules, release, dequantize=dequantize, dims=dims, checkpoint_form="maxtext",
                             sizes=config_sizes(config, prefix), ignore=spec.towers if text is not None else ())


def family_of(name: str) -> str:
    """The family ``name`` (a family or one of its MaxText model names, exactly) belongs to."""
    for family, models in MODEL_NAMES.items():
        if name == family or name in models:
            return family
    raise ArgumentError(f"no MaxText mapping for {name!r}; families: {', '.join(MODEL_NAMES)}; model names: "
                        + "; ".join(f"{family}: {', '.join(models)}" for family, models in MODEL_NAMES.items()))


def _attention(spec: _Family, per_layer: Callable[..., list[Rule]], dims: dict[str, int], dtype: Any,
               query_scalar: float | None = None) -> list[Rule]:
    """The attention's kernels (and the biases and sinks ``spec`` has): heads split out, the query
    scaled (by ``query_scalar**-0.5``, else ``head_dim``'s) and query/key heads reordered where
    ``spec`` says."""
    linear = {"transpose": (1, 0), "dtype": dtype}
    rope = {"permute": {-1: "halves_to_interleaved"}} if spec.rope_interleave else {}
    scale = {"scale": 1 / math.sqrt(query_scalar or dims["head_dim"])} if spec.query_scale else {}
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
    for hf, mt, heads in (("q_proj", "query", "heads"), ("k_proj", "key", "kv_heads"), ("v_proj", "value", "kv_heads"),
                          ("o_proj", "out", None)):
        if hf in spec.biases:  # q/k/v's split into heads as their kernels' outputs are
            split = {"split": {0: (heads, "head_dim")}} if heads else {}
            rules += per_layer(f"self_attn.{hf}.bias", f"{module}.{mt}.bias", dtype=dtype, **split)
    if spec.sinks:
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
        rules += per_layer("mlp.experts.gate_up_proj", f"{moe}.{leaf}", split={2: (-1, 2)}, take={3: index},
                           dtype=dtype)
        rules += per_layer("mlp.experts.gate_up_proj_bias", f"{moe}.{leaf}_bias", split={1: (-1, 2)}, take={2: index},
                           dtype=dtype)
    return rules


def _gate_up_halves(spec: _Family, per_layer: Callable[..., list[Rule]], dtype: Any) -> list[Rule]:
    """Qwen3-VL-MoE's experts as MaxText's converter reads them (its ``process_wi_0_wi_1_fused``
    hook): ``gate_up_proj`` ``[experts, embed, 2 * mlp]`` is ``wi_0`` (its first half) and
    ``wi_1`` (its second; ``Rule.take``: a save writes it from both), ``down_proj``
    ``[experts, mlp, embed]`` is ``wo`` as stored; the router ``mlp.gate`` transposed."""
    rules = [*per_layer(f"{spec.router}.weight", f"{spec.moe}.gate.kernel", transpose=(1, 0), dtype=dtype),
             *per_layer("mlp.experts.down_proj", f"{spec.moe}.wo", dtype=dtype)]
    for index, leaf in enumerate(("wi_0", "wi_1")):
        rules += per_layer("mlp.experts.gate_up_proj", f"{spec.moe}.{leaf}", split={2: (2, -1)}, take={2: index},
                           dtype=dtype)
    return rules


def _layer_rules(stored_prefix: str, scan_layers: bool, pattern: int | None, num_layers: int, *,
                 paired: tuple[str, str] | None = None) -> Callable[..., list[Rule]]:
    """``per_layer(stored, tree, *, experts=False, **transform)``: the rules of one per-layer tensor.

    Unscanned, layer ``i`` is ``decoder.layers_{i}``; scanned, ``decoder.layers`` with the
    layers at axis 1 (MaxText's ``param_scan_axis``; experts at 0). With an attention
    ``pattern`` (Gemma 3: 6) MaxText scans blocks of ``pattern`` layers: layer ``pattern * n + k``
    is index ``n`` of ``decoder.layers.layers_{k}``, and the ``num_layers % pattern`` left over
    are ``decoder.layers_remainder.layers_{k}``, unstacked. ``paired`` (Gemma 2's suffixes)
    puts layers ``2n`` and ``2n + 1`` in one MaxText layer ``n``, the tree's first module named
    with the one suffix or the other (``self_attention_local``, ``self_attention_global``):
    scanned, index ``n`` of ``decoder.layers.…`` (``Strided`` by 2 from 0 or 1); unscanned,
    ``decoder.layers_{n}.…``, one rule per layer (a tree placeholder cannot be half a stored one).
    """
    def per_layer(stored: str, tree: str, *, experts: bool = False, **transform: Any) -> list[Rule]:
        source, stack = stored_prefix + stored, {"e": 0} if experts else {}
        if paired is not None:
            module, rest = tree.split(".", 1)
            trees = [f"{module}{suffix}.{rest}" for suffix in paired]
            if scan_layers:
                return [Rule(source, f"decoder.layers.{t}", stack={**stack, "i": 1},
                             strided={"i": Strided(None, 2, start=c, stop=num_layers)}, **transform)
                        for c, t in enumerate(trees)]
            return [Rule(stored_prefix.format(i=2 * n + c) + stored, f"decoder.layers_{n}.{t}", stack=stack,
                         **transform) for n in range(num_layers // 2) for c, t in enumerate(trees)]
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


def _embedding_scale(config: Any, family: str, dtype: str = "bfloat16") -> float:
    """MaxText's converter stores Gemma's embedding times ``sqrt(hidden_size)`` rounded to
    ``dtype`` (Gemma 3's bfloat16, Gemma 2's float32; its forward then scales nothing; Hugging
    Face's multiplies by the unrounded root)."""
    hidden = config_value(config, "hidden_size")
    if hidden is None:
        raise ArgumentError(f"maxtext({family!r}): the config has no hidden_size, which scales the embedding")
    return float(np.dtype(dtype).type(math.sqrt(hidden)))
