"""Gemma 4 (``gemma4-26b``, ``gemma4-31b``, ``gemma4-e2b``, ``gemma4-e4b``) ↔ MaxText's tree:
``maxtext("gemma4", ...)``; and ``gemma4``, its text decoder ↔ a Flax-style tree.

Re-derived from MaxText 0.2.5's ``GEMMA4_MAXTEXT_TO_HF_PARAM_MAPPING`` and its hooks
(``checkpoint_conversion/utils/param_mapping.py``) and ``models/gemma4.py``. Its layers are not
alike: MaxText's attention pattern (``GEMMA4_ATTENTION_PATTERN``) makes layer ``i`` global when
``i % 6 == 5``, with its own head size (``global_head_dim``) and kv heads
(``num_global_key_value_heads``) and, where ``attention_k_eq_v`` (MaxText's
``share_kv_projections``), no value projection: the key's output is the value. So each rule
states its layer type's sizes, and the unscanned tree (``decoder.layers_{i}.…``) has one rule
per layer and tensor.

Scanned, MaxText scans blocks of 6 layers: ``decoder.scanned_blocks.local_layers.…`` holds the
5 sliding-window layers of every block (block axis, then the layer within the block, both at
``param_scan_axis``), ``decoder.scanned_blocks.global_layer.…`` each block's global layer, and
the ``num_layers % 6`` left over are ``decoder.layers_remainder.layers_{k}.…``, unstacked.

The small models (MaxText's ``gemma4_small``: ``hidden_size_per_layer_input``, E2B's pattern 4
sliding-window layers then a global one) are unscanned only, as in MaxText: each layer's
``per_layer_input_gate.kernel``, ``per_layer_projection.kernel`` and
``post_per_layer_input_norm.scale``, ``decoder.per_layer_embedder.{embed_tokens_per_layer,
per_layer_model_projection.kernel, per_layer_projection_norm.scale}`` (as stored, the kernel
transposed), and the last ``num_kv_shared_layers`` layers without keys or values (they reuse an
earlier layer's: no ``key``, ``value`` or ``key_norm``).

Values: the norms are Hugging Face's as stored (Gemma 4 folds the ``1 +`` into its weights, as
MaxText's ``scale_rmsnorm_layer`` says), the query is not scaled (both scale attention by 1,
after the q/k norms), the embedding is multiplied by ``sqrt(hidden_size)`` rounded to float32
(``pad_hf_embedding_layer``; MaxText's forward does not scale it). With experts (26b), the
dense MLP is MaxText's shared expert and ``experts.gate_up_proj`` ``[E, 2F, D]`` holds gate then
up (its halves: ``split_moe_wi0``/``split_moe_wi1``): ``wi_0`` and ``wi_1`` both come from it
(``Rule.take``), and a save writes it from both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import config_value
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.planning.rules import Mapping, Rule, Strided

PATTERN = 6  # MaxText's GEMMA4_ATTENTION_PATTERN: 5 sliding-window layers, then a global one


def global_attention(config: Any) -> tuple[int, int]:
    """(kv heads, head size) of the global layers: a release's ``num_global_key_value_heads``
    and ``global_head_dim``, or what transformers writes for them (``per_layer_config``)."""
    kv_heads, head_dim = config_value(config, "num_global_key_value_heads"), config_value(config, "global_head_dim")
    per_layer = config_value(config, "per_layer_config") or {}
    for layer in (per_layer.values() if isinstance(per_layer, dict) else per_layer):
        layer = layer if isinstance(layer, dict) else vars(layer)
        kv_heads = kv_heads or layer.get("num_key_value_heads")
        head_dim = head_dim or layer.get("head_dim")
    kv_heads = kv_heads if config_value(config, "attention_k_eq_v") else None
    return (int(kv_heads or config_value(config, "num_key_value_heads")),
            int(head_dim or config_value(config, "head_dim")))


def maxtext_gemma4(config: Any, scan_layers: bool = True, *, dtype: Any = None, dequantize: bool = True) -> Mapping:
    """The mapping between a Gemma 4 checkpoint (its text config, or the multimodal one whose
    ``text_config`` it reads, text tensors under ``model.language_model.``) and MaxText's tree."""
    if config is None:
        raise ArgumentError("maxtext('gemma4', config): config is None; pass the checkpoint's Hugging Face config")
    release = config
    config = config if isinstance(config, dict) else config.to_dict()
    text = config_value(config, "text_config")
    prefix = "model." if text is None else "model.language_model."
    config = config if text is None else (text if isinstance(text, dict) else text.to_dict())
    layers = config_value(config, "num_hidden_layers")
    hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads")
    if None in (layers, hidden, heads, config_value(config, "head_dim")):
        raise ArgumentError("maxtext('gemma4'): the config needs num_hidden_layers, hidden_size, "
                            "num_attention_heads and head_dim")
    ple = config_value(config, "hidden_size_per_layer_input", 0)
    kv_shared = config_value(config, "num_kv_shared_layers", 0)
    period = _period(config, layers, small=bool(ple or kv_shared))
    if (ple or kv_shared) and scan_layers:
        raise ArgumentError("maxtext('gemma4', scan_layers=True): MaxText's gemma4_small decoder (gemma4-e2b, "
                            "gemma4-e4b: per-layer inputs, shared kv layers) is not scanned; scan_layers=False")
    # MaxText's is_kv_shared_layer: the last num_kv_shared_layers layers reuse an earlier layer's keys
    # and values and have no k/v projections or key norm.
    first_shared = layers - kv_shared if 0 < kv_shared < layers else layers
    sizes = {False: (config_value(config, "num_key_value_heads", heads), config_value(config, "head_dim")),
             True: global_attention(config)}
    shared_kv = bool(config_value(config, "attention_k_eq_v"))
    moe = bool(config_value(config, "enable_moe_block")) and (config_value(config, "num_experts") or 0) > 1
    rules = [Rule(f"{prefix}embed_tokens.weight", "token_embedder.embedding", dtype=dtype,
                  scale=float(np.float32(math.sqrt(hidden)))),
             Rule(f"{prefix}norm.weight", "decoder.decoder_norm.scale", dtype=dtype)]
    if not config_value(config, "tie_word_embeddings", True):
        rules.append(Rule("lm_head.weight", "decoder.logits_dense.kernel", transpose=(1, 0), dtype=dtype))
    if ple:  # Gemma4SmallPLE: the per-layer token embedding and the projection of the hidden state
        embedder = "decoder.per_layer_embedder"
        rules += [Rule(f"{prefix}embed_tokens_per_layer.weight", f"{embedder}.embed_tokens_per_layer", dtype=dtype),
                  Rule(f"{prefix}per_layer_model_projection.weight", f"{embedder}.per_layer_model_projection.kernel",
                       transpose=(1, 0), dtype=dtype),
                  Rule(f"{prefix}per_layer_projection_norm.weight", f"{embedder}.per_layer_projection_norm.scale",
                       dtype=dtype)]
    for is_global in (False, True):
        per_layer = _placement(f"{prefix}layers.{{i}}.", scan_layers, layers, is_global, period)
        kv_layer = _placement(f"{prefix}layers.{{i}}.", scan_layers, layers, is_global, period, stop=first_shared)
        rules += _layer(per_layer, kv_layer, heads, *sizes[is_global], value=not (is_global and shared_kv), moe=moe,
                        ple=bool(ple), dtype=dtype)
    return quantized_mapping(rules, release, dequantize=dequantize, dims={}, checkpoint_form="maxtext", sizes=[])


def _layer(per_layer: Callable[..., list[Rule]], kv_layer: Callable[..., list[Rule]], heads: int, kv_heads: int,
           head_dim: int, *, value: bool, moe: bool, ple: bool, dtype: Any) -> list[Rule]:
    """One layer type's rules (``per_layer`` places them; ``kv_layer`` those of the layers that
    have their own keys and values)."""
    linear = {"transpose": (1, 0), "dtype": dtype}
    rules = [
        *per_layer("self_attn.q_proj.weight", "self_attention.query.kernel", split={1: (heads, head_dim)}, **linear),
        *kv_layer("self_attn.k_proj.weight", "self_attention.key.kernel", split={1: (kv_heads, head_dim)}, **linear),
        *kv_layer("self_attn.k_norm.weight", "self_attention.key_norm.scale", dtype=dtype),
        *per_layer("self_attn.o_proj.weight", "self_attention.out.kernel", split={0: (heads, head_dim)}, **linear),
        *per_layer("layer_scalar", "layer_scalar", dtype=dtype),
    ]
    if value:
        rules += kv_layer("self_attn.v_proj.weight", "self_attention.value.kernel", split={1: (kv_heads, head_dim)},
                           **linear)
    norms = [("self_attn.q_norm", "self_attention.query_norm"), ("input_layernorm", "pre_self_attention_norm"), ("post_attention_layernorm", "post_self_attention_norm"),
             ("pre_feedforward_layernorm", "pre_ffw_norm"), ("post_feedforward_layernorm", "post_ffw_norm")]
    dense = "mlp.moe_block.shared_experts" if moe else "mlp"
    if moe:
        norms += [("pre_feedforward_layernorm_2", "mlp.pre_feedforward_layernorm_2"),
                  ("post_feedforward_layernorm_1", "mlp.post_feedforward_layernorm_1"),
                  ("post_feedforward_layernorm_2", "mlp.post_feedforward_layernorm_2")]
        block = "mlp.moe_block.MoeBlock_0"
        rules += [*per_layer("router.scale", "mlp.pre_forward_scale_2", dtype=dtype),
                  *per_layer("router.proj.weight", f"{block}.gate.kernel", **linear),
                  *per_layer("router.per_expert_scale", f"{block}.per_expert_scale", dtype=dtype),
                  *per_layer("experts.down_proj", f"{block}.wo", transpose=(0, 2, 1), dtype=dtype)]
        for half, leaf in enumerate(("wi_0", "wi_1")):  # gate_up_proj [E, 2F, D]: gate, then up
            rules += per_layer("experts.gate_up_proj", f"{block}.{leaf}", transpose=(0, 2, 1), split={2: (2, -1)},
                               take={2: half}, dtype=dtype)
    if ple:  # Gemma 4 small: the layer's per-layer input, gated and projected
        norms.append(("post_per_layer_input_norm", "post_per_layer_input_norm"))
        rules += [*per_layer("per_layer_input_gate.weight", "per_layer_input_gate.kernel", **linear),
                  *per_layer("per_layer_projection.weight", "per_layer_projection.kernel", **linear)]
    for hf, mt in norms:
        rules += per_layer(f"{hf}.weight", f"{mt}.scale", dtype=dtype)
    for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
        rules += per_layer(f"mlp.{hf}.weight", f"{dense}.{mt}.kernel", **linear)
    return rules


def _placement(stored_prefix: str, scan_layers: bool, num_layers: int, is_global: bool, period: int = PATTERN,
               stop: int | None = None) -> Callable[..., list[Rule]]:
    """``per_layer(stored, tree, **transform)``: the rules of one tensor of every layer of the
    one type (global: ``i % period == period - 1``) before ``stop`` (unscanned)."""
    chosen = [i for i in range(num_layers if stop is None else stop) if (i % period == period - 1) == is_global]
    scanned = num_layers - num_layers % PATTERN

    def per_layer(stored: str, tree: str, **transform: Any) -> list[Rule]:
        source = stored_prefix + stored
        if not scan_layers:
            return [Rule(stored_prefix.format(i=i) + stored, f"decoder.layers_{i}.{tree}", **transform)
                    for i in chosen]
        rules = []
        if scanned and is_global:  # block n's layer 6n + 5: index n of axis 1
            rules.append(Rule(source, f"decoder.scanned_blocks.global_layer.{tree}", stack={"i": 1},
                              strided={"i": Strided(None, PATTERN, start=PATTERN - 1, stop=scanned)}, **transform))
        elif scanned:  # layer 6n + k (k < 5): index (n, k) of axes 1 and 2
            rules.append(Rule(source, f"decoder.scanned_blocks.local_layers.{tree}", stack={"i": 1, "k": 2},
                              strided={"i": Strided("k", PATTERN, width=PATTERN - 1, stop=scanned)}, **transform))
        if scanned < num_layers and not is_global:  # what is left over: sliding-window layers, unstacked
            rules.append(Rule(source, f"decoder.layers_remainder.layers_{{k}}.{tree}",
                              strided={"i": Strided("k", PATTERN, start=scanned, stop=num_layers)}, **transform))
        return rules

    return per_layer


def gemma4(config: Any = None, *, scan_layers: bool = False, dtype: Any = None, dequantize: bool = True) -> Mapping:
    """``Gemma4ForCausalLM`` (``gemma4_text``: Gemma 4's text decoder) ↔ a Flax tree with Hugging
    Face's module names (``mappings.huggingface``'s layout), unscanned: ``model.layers_{i}.…``.

    Its layers are not alike (a global layer's heads are ``global_head_dim`` wide, its kv heads
    ``num_global_key_value_heads``, and with ``attention_k_eq_v`` it has no ``v_proj``), so there
    is no one stack of them (``scan_layers=True`` is refused) and each layer's rules state its
    sizes: the config is needed. Leaves: the norms' ``scale`` as stored (Gemma 4 folds the
    ``1 +`` into the weights), ``self_attn.{q,k,v}_proj.kernel`` (hidden, heads, head_dim),
    ``self_attn.o_proj.kernel`` (heads, head_dim, hidden), ``mlp.*_proj.kernel``,
    ``layer_scalar`` (1,); with experts (26b) ``router.proj.kernel`` (hidden, experts),
    ``router.scale``, ``router.per_expert_scale``, ``experts.gate_up_proj.kernel`` (experts,
    hidden, 2 * moe_intermediate: gate then up) and ``experts.down_proj.kernel`` (experts,
    moe_intermediate, hidden), and the three extra norms; with per-layer inputs (E2B, E4B)
    ``model.embed_tokens_per_layer.embedding``, ``model.per_layer_model_projection.kernel``,
    ``model.per_layer_projection_norm.scale`` and each layer's ``per_layer_input_gate.kernel``,
    ``per_layer_projection.kernel``, ``post_per_layer_input_norm.scale``; the last
    ``num_kv_shared_layers`` layers have no ``k_proj``, ``v_proj`` or ``k_norm``."""
    if config is None:
        raise ArgumentError("ost.mappings.gemma4 needs the model's config: its layers' head sizes differ")
    if scan_layers:
        raise ArgumentError("ost.mappings.gemma4: its global layers' tensors differ in shape from the others', "
                            "so they have no one stack; scan_layers=False")
    release = config
    config = config if isinstance(config, dict) else config.to_dict()
    layers, heads = config_value(config, "num_hidden_layers"), config_value(config, "num_attention_heads")
    if None in (layers, heads, config_value(config, "head_dim")):
        raise ArgumentError("ost.mappings.gemma4: the config needs num_hidden_layers, num_attention_heads, head_dim")
    types = config_value(config, "layer_types")
    if types is None or len(types) != layers:
        raise ArgumentError("ost.mappings.gemma4: the config needs layer_types, one per layer")
    local = (config_value(config, "num_key_value_heads", heads), config_value(config, "head_dim"))
    shared_kv = bool(config_value(config, "attention_k_eq_v"))
    moe = bool(config_value(config, "enable_moe_block"))
    ple = bool(config_value(config, "hidden_size_per_layer_input"))
    kv_shared = config_value(config, "num_kv_shared_layers", 0)
    first_shared = layers - kv_shared if 0 < kv_shared < layers else layers
    rules = [Rule("model.embed_tokens.weight", "model.embed_tokens.embedding", dtype=dtype),
             Rule("model.norm.weight", "model.norm.scale", dtype=dtype)]
    if ple:
        rules += [Rule("model.embed_tokens_per_layer.weight", "model.embed_tokens_per_layer.embedding", dtype=dtype),
                  Rule("model.per_layer_model_projection.weight", "model.per_layer_model_projection.kernel",
                       transpose=(1, 0), dtype=dtype),
                  Rule("model.per_layer_projection_norm.weight", "model.per_layer_projection_norm.scale", dtype=dtype)]
    if not config_value(config, "tie_word_embeddings", True):
        rules.append(Rule("lm_head.weight", "lm_head.kernel", transpose=(1, 0), dtype=dtype))
    norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
             "self_attn.q_norm"]
    norms += ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"] if moe else []
    norms += ["post_per_layer_input_norm"] if ple else []
    for i, kind in enumerate(types):
        is_global = kind == "full_attention"
        kv_heads, head_dim = global_attention(config) if is_global else local
        rule = functools.partial(_flax_rule, i, dtype=dtype)

        own_kv = i < first_shared  # a later layer reuses an earlier one's keys and values
        projections = [("q_proj", heads)] + ([("k_proj", kv_heads)] if own_kv else []) + (
            [("v_proj", kv_heads)] if own_kv and not (is_global and shared_kv) else [])
        rules += [rule(f"self_attn.{p}.weight", f"self_attn.{p}.kernel", transpose=(1, 0), split={1: (n, head_dim)})
                  for p, n in projections]
        rules.append(rule("self_attn.o_proj.weight", "self_attn.o_proj.kernel", transpose=(1, 0),
                          split={0: (heads, head_dim)}))
        rules += [rule(f"{n}.weight", f"{n}.scale") for n in norms + (["self_attn.k_norm"] if own_kv else [])]
        rules += [rule(f"mlp.{p}.weight", f"mlp.{p}.kernel", transpose=(1, 0))
                  for p in ("gate_proj", "up_proj", "down_proj")]
        rules.append(rule("layer_scalar", "layer_scalar"))
        if ple:
            rules += [rule(f"{p}.weight", f"{p}.kernel", transpose=(1, 0))
                      for p in ("per_layer_input_gate", "per_layer_projection")]
        if moe:
            rules += [rule("router.proj.weight", "router.proj.kernel", transpose=(1, 0)),
                      rule("router.scale", "router.scale"), rule("router.per_expert_scale", "router.per_expert_scale"),
                      rule("experts.gate_up_proj", "experts.gate_up_proj.kernel", transpose=(0, 2, 1)),
                      rule("experts.down_proj", "experts.down_proj.kernel", transpose=(0, 2, 1))]
    return quantized_mapping(rules, release, dequantize=dequantize, dims={}, sizes=[])


def _period(config: Any, layers: int, *, small: bool) -> int:
    """How many layers MaxText's attention pattern repeats (5 sliding-window ones then a global
    one; gemma4-e2b: 4 then one), checked against the config's ``layer_types``."""
    types = config_value(config, "layer_types")
    period = (types.index("full_attention") + 1 if small and types and "full_attention" in types else PATTERN)
    pattern = ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(layers)]
    if period not in (5, PATTERN) or list(types or pattern) != pattern:
        raise ArgumentError(f"maxtext('gemma4'): MaxText's layers are 5 sliding-window ones then a global one "
                            f"(gemma4-e2b: 4 then one), repeated; the config's layer_types are {types}")
    return period


def _flax_rule(layer: int, stored: str, tree: str, **transform: Any) -> Rule:
    """Layer ``layer``'s stored tensor ``stored`` as ``model.layers_{layer}.{tree}``."""
    return Rule(f"model.layers.{layer}.{stored}", f"model.layers_{layer}.{tree}", **transform)
