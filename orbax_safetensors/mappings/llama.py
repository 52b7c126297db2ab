"""Hugging Face ``LlamaForCausalLM`` checkpoints ↔ a Flax Llama params tree.

The tree is the one ``examples/flax_llama.py`` builds (Flax linen naming,
``model.init(...)["params"]``)::

    model.embed_tokens.embedding                 (vocab, hidden)
    model.layers_{i}.input_layernorm.scale       (hidden,)
    model.layers_{i}.self_attn.q_proj.kernel     (hidden, heads, head_dim)
    model.layers_{i}.self_attn.k_proj.kernel     (hidden, kv_heads, head_dim)
    model.layers_{i}.self_attn.v_proj.kernel     (hidden, kv_heads, head_dim)
    model.layers_{i}.self_attn.o_proj.kernel     (heads, head_dim, hidden)
    model.layers_{i}.post_attention_layernorm.scale
    model.layers_{i}.mlp.{gate,up}_proj.kernel   (hidden, intermediate)
    model.layers_{i}.mlp.down_proj.kernel        (intermediate, hidden)
    model.norm.scale                             (hidden,)
    lm_head.kernel                               (hidden, vocab)

Attention kernels keep heads as their own axis, so they can be sharded by
head (tensor parallelism) and each device still reads only its heads' rows
of the stored ``q_proj.weight``. Mistral and Qwen2 without biases use the
same names and layouts.
"""

from __future__ import annotations

from typing import Any

from orbax_safetensors.planning.mapping import Mapping, Rule

_LAYER = "model.layers.{i}"
_TREE_LAYER = "model.layers_{i}"


def llama(config: Any = None) -> Mapping:
    """The Llama mapping; ``config`` (a transformers ``LlamaConfig`` or a dict of its
    fields) pins the head sizes, which are otherwise taken from the target's shapes.

    The sizes matter only when loading without a target (``ost.load(path,
    mapping=...)``); with a target they are checked against it.
    """
    dims = {}
    if config is not None:
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        heads = get("num_attention_heads")
        dims = {"heads": heads, "kv_heads": get("num_key_value_heads") or heads,
                "head_dim": get("head_dim") or get("hidden_size") // heads}
    rules = [
        Rule("model.embed_tokens.weight", "model.embed_tokens.embedding"),
        Rule("model.norm.weight", "model.norm.scale"),
        Rule("lm_head.weight", "lm_head.kernel", transpose=(1, 0)),
    ]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        rules.append(Rule(f"{_LAYER}.{norm}.weight", f"{_TREE_LAYER}.{norm}.scale"))
    for proj, heads in (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
        # torch Linear (heads * head_dim, hidden) → DenseGeneral (hidden, heads, head_dim)
        rules.append(Rule(f"{_LAYER}.self_attn.{proj}.weight", f"{_TREE_LAYER}.self_attn.{proj}.kernel",
                          transpose=(1, 0), split={1: (heads, "head_dim")}))
    # torch Linear (hidden, heads * head_dim) → DenseGeneral over (heads, head_dim): (heads, head_dim, hidden)
    rules.append(Rule(f"{_LAYER}.self_attn.o_proj.weight", f"{_TREE_LAYER}.self_attn.o_proj.kernel",
                      transpose=(1, 0), split={0: ("heads", "head_dim")}))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules.append(Rule(f"{_LAYER}.mlp.{proj}.weight", f"{_TREE_LAYER}.mlp.{proj}.kernel",
                          transpose=(1, 0)))
    return Mapping(rules, dims=dims)
