"""DeepSeek-V3 (and R1, V3.1: ``model_type`` ``deepseek_v3``), DeepSeek-V2 (``deepseek_v2``)
and DeepSeek-V3.2 (``deepseek_v32``) ↔ a Flax-style tree and ↔ MaxText 0.2.5's tree, from one
table of their tensors.

DeepSeek's attention is MLA: the query through a low-rank ``q_a_proj`` (its
RMS norm ``q_a_layernorm``) and ``q_b_proj`` (or one ``q_proj`` when the
config's ``q_lora_rank`` is ``None``, V2-Lite), keys and values through
``kv_a_proj_with_mqa`` (the ``kv_lora_rank`` latent and the shared RoPE key,
side by side) and, after ``kv_a_layernorm``, ``kv_b_proj`` (each head's
non-RoPE key and value, side by side). The first ``first_k_dense_replace``
layers have a dense MLP; the others are MoE: a router ``mlp.gate`` with its
``e_score_correction_bias``, routed experts and ``shared_experts``. Dense and
MoE layers have different leaves, so a scanned tree would hold them as two
stacks (``dense_layers``, ``moe_layers``), as MaxText does.

V2 routes by softmax without a bias: its router has no
``e_score_correction_bias`` (``deepseek_v2``, ``maxtext("deepseek2", ...)``).
V3.2 adds DeepSeek Sparse Attention's lightning indexer to every attention,
``self_attn.indexer.`` ``wq_b`` (from the query latent: ``q_lora`` →
``index_n_heads × index_head_dim``), ``wk``, ``weights_proj`` and the key's
LayerNorm ``k_norm`` (a weight and a bias): in the Flax-style tree
``self_attn.indexer.wq_b.kernel`` (q_lora, index_heads, index_head_dim),
``wk.kernel`` (hidden, index_head_dim), ``weights_proj.kernel`` (hidden,
index_heads), ``k_norm.scale`` and ``k_norm.bias`` (index_head_dim,); in
MaxText's (``maxtext("deepseek3.2", ...)``, ``layers/attention_mla.py``'s
``Indexer``) the same under ``self_attention.indexer.`` (its ``k_norm`` an
``nnx.LayerNorm`` without logical axes: replicated).

Flax-style tree (``deepseek_v3``; huggingface.py's conventions: HF module
names, Flax leaf names, kernels transposed, heads an axis of their own)::

    model.layers_{i}.<leaf>                                     i = 0 .. num_hidden_layers - 1
      self_attn.q_a_proj.kernel (hidden, q_lora)                self_attn.q_a_layernorm.scale (q_lora,)
      self_attn.q_b_proj.kernel (q_lora, heads, qk_head_dim)    or self_attn.q_proj.kernel (hidden, heads, qk_head_dim)
      self_attn.kv_a_proj_with_mqa.kernel (hidden, kv_lora + qk_rope_head_dim)
      self_attn.kv_a_layernorm.scale (kv_lora,)
      self_attn.kv_b_proj.kernel (kv_lora, heads, qk_nope_head_dim + v_head_dim)
      self_attn.o_proj.kernel (heads, v_head_dim, hidden)
      input_layernorm.scale, post_attention_layernorm.scale (hidden,)
      mlp.{gate,up}_proj.kernel (hidden, intermediate), mlp.down_proj.kernel      dense layers
      mlp.gate.kernel (hidden, experts), mlp.gate.e_score_correction_bias (experts,)   MoE layers
      mlp.experts.{gate,up}_proj.kernel (experts, hidden, moe_intermediate), .down_proj.kernel
      mlp.shared_experts.{gate,up,down}_proj.kernel (as the dense MLP's)

(``qk_head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``.)

MaxText's tree (``maxtext("deepseek3", ...)``), as MaxText 0.2.5's converter
(``checkpoint_conversion/utils/param_mapping.py``, ``DEEPSEEK_MAXTEXT_TO_HF_*``)
and ``layers/attention_mla.py`` have it: ``decoder.dense_layers_{k}.…`` for
layer ``k < first_k_dense_replace`` and ``decoder.moe_layers_{k}.…`` for layer
``first_k_dense_replace + k``, the same arrangements under MaxText's names
(``self_attention.wq_a``, ``q_norm``, ``wq_b``/``query``, ``wkv_a``,
``kv_norm``, ``wkv_b``, ``out``; ``pre_``/``post_self_attention_layer_norm``;
``mlp.wi_0``/``wi_1``/``wo``; ``DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel``,
``.gate.bias``, ``.wi_0``/``wi_1``/``wo`` (experts stacked at axis 0, no
``kernel``), ``DeepSeekMoeBlock_0.shared_experts.wi_0.kernel`` …), plus
``token_embedder.embedding``, ``decoder.decoder_norm.scale`` and
``decoder.logits_dense.kernel``. MaxText's converter changes no value (its MLA
scales the query itself, and reads HF's interleaved RoPE order as it is), so
neither do these rules: a load is the checkpoint's values, and a save gives back
a bfloat16 or float32 checkpoint bit for bit.

Scanned (``scan_layers=True``), dense and MoE layers are two stacks, as
MaxText scans them: ``model.dense_layers.<leaf>`` / ``model.moe_layers.<leaf>``
here (layers at axis 0, experts then at 1), ``decoder.dense_layers.…`` /
``decoder.moe_layers.…`` in MaxText (layers at axis 1, experts at 0; the router
bias, which MaxText keeps in its ``MoEBiasVar`` collection, at axis 0); index
``n`` of the MoE stack is layer ``first_k_dense_replace + n``
(``Strided(None, 1, start=...)``).

The multi-token-prediction layers stored after the last one (V3's
``model.layers.61.``: ``num_nextn_predict_layers``) are left out (``Mapping.ignore``),
as transformers leaves them out.

A quantized release (``quantization_config``: DeepSeek-V3's FP8 weights with
``weight_scale_inv`` per 128×128 block) reads through the same rules:
``dequantize=True`` gives each FP8 weight as its bfloat16 release's tensor,
``dequantize=False`` keeps it (``mappings._quantized``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import config_sizes, config_value, heads_without_config
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.planning.rules import Mapping, Rule, Strided

# Per-layer tensors: (HF name without ".weight", MaxText name, the transposed kernel's head split).
_QUERY_LORA = (("self_attn.q_a_proj", "self_attention.wq_a", {}),
               ("self_attn.q_b_proj", "self_attention.wq_b", {1: ("heads", "qk_head_dim")}))
_QUERY = (("self_attn.q_proj", "self_attention.query", {1: ("heads", "qk_head_dim")}),)
_KEY_VALUE = (("self_attn.kv_a_proj_with_mqa", "self_attention.wkv_a", {}),
              ("self_attn.kv_b_proj", "self_attention.wkv_b", {1: ("heads", "kv_head_dim")}),
              ("self_attn.o_proj", "self_attention.out", {0: ("heads", "v_head_dim")}))
_NORMS = (("input_layernorm", "pre_self_attention_layer_norm"),
          ("post_attention_layernorm", "post_self_attention_layer_norm"),
          ("self_attn.kv_a_layernorm", "self_attention.kv_norm"))
_QUERY_NORM = (("self_attn.q_a_layernorm", "self_attention.q_norm"),)
_MLP = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
_MOE = "DeepSeekMoeBlock_0"
# V3.2's lightning indexer, under the attention: (HF name, MaxText name, the transposed kernel's head split).
_INDEXER = (("wq_b", "wq_b", {1: ("index_heads", "index_head_dim")}), ("wk", "wk", {}),
            ("weights_proj", "weights_proj", {}))


@dataclasses.dataclass(frozen=True)
class _Version:
    """What a DeepSeek version's checkpoint holds beyond the tensors every version has."""

    name: str  # the Flax-style mapping's name
    router_bias: bool  # mlp.gate.e_score_correction_bias (V3's sigmoid routing; V2 softmaxes, unbiased)
    indexer: bool = False  # self_attn.indexer.* (V3.2's sparse attention)


_V2, _V3, _V32 = _Version("deepseek_v2", False), _Version("deepseek_v3", True), _Version("deepseek_v32", True, True)

# per_layer(stored, tree, dense, *, experts=False, **transform) -> rules; dense: True / False for
# a dense / MoE layer's own tensor, None for one every layer has.
PerLayer = Callable[..., list[Rule]]


_MLA_SIZES = ("heads", "qk_head_dim", "kv_head_dim", "v_head_dim")  # what _dims gives


def _dims(config: Any, version: _Version) -> dict[str, int]:
    """The MLA head sizes the rules split by, and V3.2's indexer's (empty without a config:
    the target's shapes)."""
    if config is None:
        return {}
    keys = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    sizes = {key: config_value(config, key) for key in keys + (("index_n_heads", "index_head_dim")
                                                              if version.indexer else ())}
    missing = [key for key, value in sizes.items() if value is None]
    if missing:
        raise ArgumentError(f"{version.name}: the config has no {', '.join(missing)}, which give the head sizes")
    dims = {"heads": sizes["num_attention_heads"], "v_head_dim": sizes["v_head_dim"],
            "qk_head_dim": sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
            "kv_head_dim": sizes["qk_nope_head_dim"] + sizes["v_head_dim"]}
    if version.indexer:
        dims.update(index_heads=sizes["index_n_heads"], index_head_dim=sizes["index_head_dim"])
    return dims


def _rules(config: Any, per_layer: PerLayer, version: _Version, *, maxtext: bool, dtype: Any) -> list[Rule]:
    """Every per-layer rule, named in the Flax-style tree or (``maxtext``) in MaxText's."""
    low_rank_query = config is None or config_value(config, "q_lora_rank") is not None
    attention = (_QUERY_LORA if low_rank_query else _QUERY) + _KEY_VALUE
    norms = _NORMS + (_QUERY_NORM if low_rank_query else ())
    linear = {"transpose": (1, 0), "dtype": dtype}
    rules = []
    for hf, mt, split in attention:
        rules += per_layer(f"{hf}.weight", f"{mt if maxtext else hf}.kernel", None, split=split, **linear)
    for hf, mt in norms:
        rules += per_layer(f"{hf}.weight", f"{mt if maxtext else hf}.scale", None, dtype=dtype)
    if version.indexer:  # its key norm is a LayerNorm: a scale and a bias
        indexer = "self_attention.indexer" if maxtext else "self_attn.indexer"
        for hf, mt, split in _INDEXER:
            rules += per_layer(f"self_attn.indexer.{hf}.weight", f"{indexer}.{mt if maxtext else hf}.kernel", None,
                               split=split, **linear)
        rules += per_layer("self_attn.indexer.k_norm.weight", f"{indexer}.k_norm.scale", None, dtype=dtype)
        rules += per_layer("self_attn.indexer.k_norm.bias", f"{indexer}.k_norm.bias", None, dtype=dtype)
    for hf, mt in _MLP:
        rules += per_layer(f"mlp.{hf}.weight", f"mlp.{mt if maxtext else hf}.kernel", True, **linear)
        rules += per_layer(f"mlp.shared_experts.{hf}.weight",
                           f"{_MOE}.shared_experts.{mt}.kernel" if maxtext else f"mlp.shared_experts.{hf}.kernel",
                           False, **linear)
        rules += per_layer(f"mlp.experts.{{e}}.{hf}.weight",
                           f"{_MOE}.MoeBlock_0.{mt}" if maxtext else f"mlp.experts.{hf}.kernel",
                           False, experts=True, **linear)
    router = f"{_MOE}.MoeBlock_0.gate" if maxtext else "mlp.gate"
    rules += per_layer("mlp.gate.weight", f"{router}.kernel", False, **linear)
    if version.router_bias:
        # MaxText keeps the router bias in its MoEBiasVar collection, which nn.scan stacks at axis 0.
        rules += per_layer("mlp.gate.e_score_correction_bias",
                           f"{router}.bias" if maxtext else f"{router}.e_score_correction_bias", False, dtype=dtype,
                           scan_axis=0)
    return rules


def _outer(config: Any, tree: tuple[str, str, str], dtype: Any) -> list[Rule]:
    """The embedding, the final norm and (untied) the head, named ``tree``."""
    embedding, norm, head = tree
    rules = [Rule("model.embed_tokens.weight", embedding, dtype=dtype), Rule("model.norm.weight", norm, dtype=dtype)]
    if not (config is not None and config_value(config, "tie_word_embeddings", False)):
        rules.append(Rule("lm_head.weight", head, transpose=(1, 0), dtype=dtype))
    return rules


def _prediction_layers(config: Any) -> tuple[str, ...]:
    """The stored prefixes of the multi-token-prediction layers after the last layer (V3's
    ``model.layers.61.``), which the tree leaves out, as transformers does."""
    layers = None if config is None else config_value(config, "num_hidden_layers")
    if layers is None:
        return ()
    extra = config_value(config, "num_nextn_predict_layers", config_value(config, "num_mtp_layers", 0))
    return tuple(f"model.layers.{int(layers) + k}." for k in range(int(extra)))


def _first_dense(config: Any, where: str) -> tuple[int, int]:
    """(first_k_dense_replace, num_hidden_layers), which place each layer in MaxText's tree."""
    if config is None:
        raise ArgumentError(f"{where}: config is None; pass the checkpoint's Hugging Face config "
                            "(first_k_dense_replace, num_hidden_layers and the MLA head sizes)")
    dense, layers = config_value(config, "first_k_dense_replace"), config_value(config, "num_hidden_layers")
    if dense is None or layers is None:
        raise ArgumentError(f"{where}: the config needs first_k_dense_replace and num_hidden_layers")
    return int(dense), int(layers)


def _by_block(config: Any, where: str, *, scan_layers: bool, root: str, layer_axis: int,
              expert_axis: int) -> PerLayer:
    """``per_layer`` for a tree that holds dense and MoE layers apart (MaxText's, and any
    scanned one): dense layer ``k`` under ``<root>.dense_layers_{k}``, MoE layer
    ``first_k_dense_replace + k`` under ``<root>.moe_layers_{k}``; scanned, stacked at
    ``layer_axis`` of ``<root>.dense_layers`` / ``<root>.moe_layers`` (``Strided(None, ...)``:
    the MoE stack's index ``n`` is layer ``first_k_dense_replace + n``)."""
    dense_layers, layers = _first_dense(config, where)
    blocks = {True: ("dense_layers", 0, dense_layers), False: ("moe_layers", dense_layers, layers)}

    def per_layer(stored: str, tree: str, dense: bool | None, *, experts: bool = False, scan_axis: int | None = None,
                  **transform: Any) -> list[Rule]:
        rules = []
        for block, start, stop in (blocks.values() if dense is None else [blocks[dense]]):
            if start >= stop:
                continue
            stack = {"e": expert_axis} if experts else {}
            if scan_layers:
                name, strided = f"{root}.{block}", Strided(None, 1, start=start, stop=stop)
                stack["i"] = layer_axis if scan_axis is None else scan_axis
            else:
                name, strided = f"{root}.{block}_{{k}}", Strided("k", stop - start, start=start, stop=stop)
            rules.append(Rule(f"model.layers.{{i}}.{stored}", f"{name}.{tree}", stack=stack,
                              strided={"i": strided}, **transform))
        return rules

    return per_layer


def _every_layer(stored: str, tree: str, dense: bool | None, *, experts: bool = False, scan_axis: int | None = None,
                 **transform: Any) -> list[Rule]:
    """``per_layer`` of the unscanned Flax-style tree: layer ``i`` under ``model.layers_{i}``."""
    del dense, scan_axis  # a layer's own names say whether it is dense; nothing is scanned
    return [Rule(f"model.layers.{{i}}.{stored}", f"model.layers_{{i}}.{tree}", stack={"e": 0} if experts else {},
                 **transform)]


def _flax(version: _Version, config: Any, scan_layers: bool, dtype: Any, dequantize: bool) -> Mapping:
    """``version``'s checkpoint ↔ the Flax-style tree."""
    where = f"ost.mappings.{version.name}"
    per_layer = _by_block(config, f"{where} (scanned)", scan_layers=True, root="model",
                          layer_axis=0, expert_axis=1) if scan_layers else _every_layer
    rules = _outer(config, ("model.embed_tokens.embedding", "model.norm.scale", "lm_head.kernel"), dtype)
    rules += _rules(config, per_layer, version, maxtext=False, dtype=dtype)
    sizes = _MLA_SIZES + (("index_heads", "index_head_dim") if version.indexer else ())
    return quantized_mapping(rules, config, dequantize=dequantize, dims=_dims(config, version),
                             ignore=_prediction_layers(config), sizes=config_sizes(config),
                             undeclared=heads_without_config(config, where, sizes))


def deepseek_v2(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
                dequantize: bool = True) -> Mapping:
    """``DeepseekV2ForCausalLM`` ↔ ``mappings.deepseek``'s Flax-style tree: V3's without the
    router bias (V2 routes by softmax, unbiased); the query low-rank unless the config's
    ``q_lora_rank`` is ``None`` (V2-Lite). Otherwise as ``deepseek_v3``."""
    return _flax(_V2, config, scan_layers, dtype, dequantize)


def deepseek_v3(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
                dequantize: bool = True) -> Mapping:
    """``DeepseekV3ForCausalLM`` ↔ ``mappings.deepseek``'s Flax-style tree. ``config`` pins the
    MLA head sizes, says whether the query is low-rank (``q_lora_rank``; without a config it
    is, as in V3) and, scanned (where it is needed), which layers are dense; ``dequantize`` as
    in ``mappings._quantized`` for an FP8 release."""
    return _flax(_V3, config, scan_layers, dtype, dequantize)


def deepseek_v32(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
                 dequantize: bool = True) -> Mapping:
    """``DeepseekV32ForCausalLM`` (DeepSeek-V3.2) ↔ ``mappings.deepseek``'s Flax-style tree:
    V3's plus each attention's indexer (``self_attn.indexer.wq_b.kernel`` (q_lora,
    index_heads, index_head_dim), ``wk.kernel``, ``weights_proj.kernel``, ``k_norm.scale`` and
    ``k_norm.bias``). Otherwise as ``deepseek_v3``."""
    return _flax(_V32, config, scan_layers, dtype, dequantize)


def _maxtext(version: _Version, family: str, config: Any, scan_layers: bool, dtype: Any,
             dequantize: bool) -> Mapping:
    """``version``'s checkpoint ↔ MaxText's ``family`` tree."""
    per_layer = _by_block(config, f"maxtext({family!r})", scan_layers=scan_layers, root="decoder", layer_axis=1,
                          expert_axis=0)
    rules = _outer(config, ("token_embedder.embedding", "decoder.decoder_norm.scale", "decoder.logits_dense.kernel"),
                   dtype)
    rules += _rules(config, per_layer, version, maxtext=True, dtype=dtype)
    return quantized_mapping(rules, config, dequantize=dequantize, dims=_dims(config, version),
                             checkpoint_form="maxtext", ignore=_prediction_layers(config), sizes=config_sizes(config))


def maxtext_deepseek2(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool) -> Mapping:
    """HF DeepSeek-V2 ↔ MaxText's ``deepseek2-*`` tree (no router bias), for ``mappings.maxtext``."""
    return _maxtext(_V2, "deepseek2", config, scan_layers, dtype, dequantize)


def maxtext_deepseek3(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool) -> Mapping:
    """HF DeepSeek-V3 ↔ MaxText's ``deepseek3-*`` tree, for ``mappings.maxtext``."""
    return _maxtext(_V3, "deepseek3", config, scan_layers, dtype, dequantize)


def maxtext_deepseek32(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool) -> Mapping:
    """HF DeepSeek-V3.2 ↔ MaxText's ``deepseek3.2-671b`` tree (V3's and the indexer's), for
    ``mappings.maxtext``."""
    return _maxtext(_V32, "deepseek3.2", config, scan_layers, dtype, dequantize)
