"""Hugging Face checkpoints ↔ MaxText's own params tree, loaded per shard.

MaxText (0.2.x) converts a Hugging Face checkpoint in a separate step
(``checkpoint_conversion/to_maxtext.py``): every tensor is loaded whole on the
host, transformed, stacked with ``np.stack`` and saved again as an Orbax
checkpoint, which needs host memory for the whole model (several times over;
maxtext#864 reports 2.9 TB). This mapping states the same conversion as rules,
re-derived from MaxText's ``checkpoint_conversion/utils/param_mapping.py``
(``LLAMA31_``, ``QWEN_`` and ``MIXTRAL_MAXTEXT_TO_HF_PARAM_MAPPING`` and their
``..._HOOK_FN``) and
``hf_shape.py``, so ``ost.load`` reads each device's shard of the scanned tree
straight from the Hugging Face files and ``ost.save`` writes a training
state's tree back as Hugging Face tensors, with no conversion step and no
host copy of the model.

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
``decoder.layers_{i}.…`` without that axis when not. Qwen3 adds
``self_attention.{query,key}_norm.scale``; MoE models (Qwen3-MoE, Mixtral)
replace ``mlp`` by ``moe_block`` / ``MoeBlock_0``: ``gate.kernel`` (embed,
[layers,] experts) and ``wi_0``, ``wi_1``, ``wo`` with experts at axis 0
(experts, [layers,] embed, mlp). Values follow MaxText's converter: Llama
3.1's and Mixtral's query kernel is scaled by ``1/sqrt(head_dim)`` (in
float32; their MaxText attention does not scale), Llama 3.1's query and key
heads are reordered from Hugging Face's rotate-half RoPE layout to MaxText's
interleaved one. A save undoes both; a bfloat16 checkpoint comes back bit for
bit, a float32 one too when ``head_dim`` is a power of four (otherwise the
query's last bit may move).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import attention_dims, config_value
from orbax_safetensors.planning.rules import Mapping, Rule

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


# MaxText model_name prefixes with a converter in MaxText (llama2 and mistral have none; Gemma 3's
# scans a 6-layer attention pattern and shifts norms by one, which these rules do not express yet).
FAMILIES = {
    "llama3.1": _Family(query_scale=True, rope_interleave=True),
    "qwen3": _Family(query_scale=False, rope_interleave=False, qk_norm=True, moe="moe_block"),
    "mixtral": _Family(query_scale=True, rope_interleave=False, moe="MoeBlock_0", experts=("w1", "w3", "w2"),
                       router="block_sparse_moe.gate", experts_module="block_sparse_moe.experts"),
}


def maxtext(family: str, config: Any, scan_layers: bool = True, *, dtype: Any = None) -> Mapping:
    """The mapping between a Hugging Face checkpoint of ``family`` and MaxText's tree.

    ``family`` is MaxText's ``model_name`` or its prefix (``"llama3.1"``,
    ``"llama3.1-8b"``, ``"qwen3-30b-a3b"``, ``"mixtral-8x7b"``); ``config`` the
    Hugging Face config (a transformers config or a dict); ``scan_layers`` as
    in MaxText's config; ``dtype`` the dtype a save writes (MaxText trains
    float32 params; ``"bfloat16"`` gives back a bfloat16 checkpoint). Qwen3
    is MoE when the config has ``num_experts > 1`` (``moe_block``, experts
    stacked at axis 0, layers then at 1).
    """
    name = next((f for f in FAMILIES if family == f or family.startswith(f + "-")), None)
    if name is None:
        raise ArgumentError(f"no MaxText mapping for {family!r}; available: {', '.join(FAMILIES)}")
    spec = FAMILIES[name]
    if config is None:  # the query scale and the head split need the head sizes
        raise ArgumentError(f"maxtext({family!r}, config): config is None; pass the checkpoint's Hugging "
                         "Face config (a transformers config or its dict: num_attention_heads, "
                         "num_key_value_heads, head_dim or hidden_size)")
    dims = attention_dims(config, f"maxtext({family!r})")
    layer = "decoder.layers" if scan_layers else "decoder.layers_{i}"
    linear = {"transpose": (1, 0), "dtype": dtype}

    def per_layer(stored: str, tree: str, *, experts: bool = False, **layout) -> Rule:
        stack = {"e": 0} if experts else {}
        if scan_layers:
            stack["i"] = 1
        return Rule(f"model.layers.{{i}}.{stored}", f"{layer}.{tree}", stack=stack, **layout)

    rope = {"permute": {-1: "halves_to_interleaved"}} if spec.rope_interleave else {}
    scale = {"scale": 1 / math.sqrt(dims["head_dim"])} if spec.query_scale else {}
    rules = [
        Rule("model.embed_tokens.weight", "token_embedder.embedding", dtype=dtype),
        Rule("model.norm.weight", "decoder.decoder_norm.scale", dtype=dtype),
        per_layer("self_attn.q_proj.weight", "self_attention.query.kernel",
                  split={1: ("heads", "head_dim")}, **rope, **scale, **linear),
        per_layer("self_attn.k_proj.weight", "self_attention.key.kernel",
                  split={1: ("kv_heads", "head_dim")}, **rope, **linear),
        per_layer("self_attn.v_proj.weight", "self_attention.value.kernel",
                  split={1: ("kv_heads", "head_dim")}, **linear),
        per_layer("self_attn.o_proj.weight", "self_attention.out.kernel", split={0: ("heads", "head_dim")}, **linear),
        per_layer("input_layernorm.weight", "pre_self_attention_layer_norm.scale", dtype=dtype),
        per_layer("post_attention_layernorm.weight", "post_self_attention_layer_norm.scale", dtype=dtype),
    ]
    if spec.qk_norm:
        rules += [per_layer(f"self_attn.{hf}_norm.weight", f"self_attention.{mt}_norm.scale", dtype=dtype)
                  for hf, mt in (("q", "query"), ("k", "key"))]
    if spec.moe is not None and config_value(config, "num_experts", config_value(config, "num_local_experts", 0)) > 1:
        rules.append(per_layer(f"{spec.router}.weight", f"{spec.moe}.gate.kernel", **linear))
        rules += [per_layer(f"{spec.experts_module}.{{e}}.{hf}.weight", f"{spec.moe}.{mt}", experts=True, **linear)
                  for hf, mt in zip(spec.experts, ("wi_0", "wi_1", "wo"))]
    else:
        rules += [per_layer(f"mlp.{hf}.weight", f"mlp.{mt}.kernel", **linear)
                  for hf, mt in zip(("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo"))]
    if not config_value(config, "tie_word_embeddings", False):  # tied: MaxText's logits_via_embedding
        rules.append(Rule("lm_head.weight", "decoder.logits_dense.kernel", **linear))
    return Mapping(rules, dims=dims, checkpoint_form="maxtext")
