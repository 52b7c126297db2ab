"""Hugging Face checkpoints ↔ MaxText's own params tree, loaded per shard.

MaxText (0.2.x) converts a Hugging Face checkpoint in a separate step
(``checkpoint_conversion/to_maxtext.py``): every tensor is loaded whole on the
host, transformed, stacked with ``np.stack`` and saved again as an Orbax
checkpoint, which needs host memory for the whole model (several times over;
maxtext#864 reports 2.9 TB). This mapping states the same conversion as rules,
re-derived from MaxText's ``checkpoint_conversion/utils/param_mapping.py``
(``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`` and ``..._HOOK_FN``) and
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
``decoder.layers_{i}.…`` without that axis when not. Values follow MaxText's
converter: the query kernel is scaled by ``1/sqrt(head_dim)`` (in float32,
MaxText's attention does not scale), query and key heads are reordered from
Hugging Face's rotate-half RoPE layout to MaxText's interleaved one. A save
undoes both; a bfloat16 checkpoint comes back bit for bit, a float32 one too
when ``head_dim`` is a power of four (otherwise the query's last bit may move).
"""

from __future__ import annotations

import math
from typing import Any

from orbax_safetensors.mappings._config import attention_dims, config_value
from orbax_safetensors.planning.mapping import Mapping, Rule

# MaxText model_name prefixes with a mapping here (MaxText has no llama2 mapping either).
FAMILIES = ("llama3.1",)


def maxtext(family: str, config: Any, scan_layers: bool = True, *, dtype: Any = None) -> Mapping:
    """The mapping between a Hugging Face checkpoint of ``family`` and MaxText's tree.

    ``family`` is MaxText's ``model_name`` or its prefix (``"llama3.1"``,
    ``"llama3.1-8b"``); ``config`` the Hugging Face config (a transformers
    config or a dict); ``scan_layers`` as in MaxText's config; ``dtype`` the
    dtype a save writes (MaxText trains float32 params; ``"bfloat16"`` gives
    back a bfloat16 checkpoint).
    """
    name = next((f for f in FAMILIES if family == f or family.startswith(f + "-")), None)
    if name is None:
        raise ValueError(f"no MaxText mapping for {family!r}; available: {', '.join(FAMILIES)}")
    dims = attention_dims(config)
    layer = "decoder.layers" if scan_layers else "decoder.layers_{i}"
    stack = {"i": 1} if scan_layers else {}
    linear = {"transpose": (1, 0), "dtype": dtype}

    def per_layer(stored: str, tree: str, **layout) -> Rule:
        return Rule(f"model.layers.{{i}}.{stored}", f"{layer}.{tree}", stack=stack, **layout)

    heads = {"split": {1: ("heads", "head_dim")}, "permute": {-1: "halves_to_interleaved"}, **linear}
    rules = [
        Rule("model.embed_tokens.weight", "token_embedder.embedding", dtype=dtype),
        Rule("model.norm.weight", "decoder.decoder_norm.scale", dtype=dtype),
        per_layer("self_attn.q_proj.weight", "self_attention.query.kernel",
                  scale=1 / math.sqrt(dims["head_dim"]), **heads),
        per_layer("self_attn.k_proj.weight", "self_attention.key.kernel",
                  **{**heads, "split": {1: ("kv_heads", "head_dim")}}),
        per_layer("self_attn.v_proj.weight", "self_attention.value.kernel",
                  split={1: ("kv_heads", "head_dim")}, **linear),
        per_layer("self_attn.o_proj.weight", "self_attention.out.kernel", split={0: ("heads", "head_dim")}, **linear),
        per_layer("mlp.gate_proj.weight", "mlp.wi_0.kernel", **linear),
        per_layer("mlp.up_proj.weight", "mlp.wi_1.kernel", **linear),
        per_layer("mlp.down_proj.weight", "mlp.wo.kernel", **linear),
        per_layer("input_layernorm.weight", "pre_self_attention_layer_norm.scale", dtype=dtype),
        per_layer("post_attention_layernorm.weight", "post_self_attention_layer_norm.scale", dtype=dtype),
    ]
    if not config_value(config, "tie_word_embeddings", False):  # tied: MaxText's logits_via_embedding
        rules.append(Rule("lm_head.weight", "decoder.logits_dense.kernel", **linear))
    return Mapping(rules, dims=dims)
