"""Qwen3-Next (``model_type`` ``qwen3_next``) and Qwen3.5's text decoder (``qwen3_5_moe``,
``qwen3_5``, their ``…_text``) ↔ a Flax-style tree and ↔ MaxText 0.2.5's trees, from one
table of their tensors.

Qwen3-Next is a hybrid: of every ``full_attention_interval`` layers (4 in the
release), the first ones are linear attention (a gated delta net, ``linear_attn``)
and the last one gated full attention (``self_attn``, its ``q_proj`` giving each
head's query and output gate side by side, hence ``2 * head_dim`` per head); every
layer's MLP is MoE with one shared expert, gated (``shared_expert_gate``). Linear and
full layers have different leaves, so a scanned tree holds them as two stacks of
blocks, as MaxText does: block ``n`` is layers ``c * n .. c * n + c - 1`` (``c`` the
interval), its linear layers one stack with two layer axes (block, position),
its full-attention layer another with one (``Strided`` with a stacked ``within``).

Flax-style tree (``qwen3_next``; huggingface.py's conventions: HF module names,
Flax leaf names, kernels transposed, attention heads an axis of their own)::

    model.layers_{i}.<leaf>                       scan_layers=False, or, scanned,
    model.layers.linear.<leaf>                    (blocks, c - 1, ...): layer c * n + k at [n, k]
    model.layers.full.<leaf>                      (blocks, ...): layer c * n + c - 1 at [n]
    <leaf>:
      input_layernorm.scale, post_attention_layernorm.scale         (hidden,)
      linear_attn.in_proj_qkvz.kernel (hidden, 2 * key_dim + 2 * value_dim), .in_proj_ba.kernel
        (hidden, 2 * value_heads), .conv1d.kernel (kernel, 1, conv_dim), .A_log, .dt_bias
        (value_heads,), .norm.scale (value_head_dim,), .out_proj.kernel (value_dim, hidden)
      self_attn.q_proj.kernel (hidden, heads, 2 * head_dim), .{k,v}_proj.kernel (hidden,
        kv_heads, head_dim), .o_proj.kernel (heads, head_dim, hidden), .{q,k}_norm.scale
      mlp.gate.kernel (hidden, experts), mlp.experts.{gate,up,down}_proj.kernel (experts, ...),
      mlp.shared_expert.{gate,up,down}_proj.kernel, mlp.shared_expert_gate.kernel (hidden, 1)

MaxText's tree (``maxtext("qwen3-next", ...)``), as MaxText 0.2.5's converter
(``checkpoint_conversion/utils/param_mapping.py``, ``QWEN3_NEXT_MAXTEXT_TO_HF_*``) and
its model (``models/qwen3.py``: ``Qwen3NextDecoderLayer``, ``Qwen3NextScannableBlock``;
``layers/nnx_decoders.py``) have it: ``decoder.layers_{i}.…`` unscanned; scanned,
``decoder.layers.local_layers.…`` (the linear layers: blocks at axis 1, position in the
block at axis 2, experts at 0) and ``decoder.layers.global_layer.…`` (blocks at axis 1).
Leaves: ``input_layernorm.scale``, ``post_attention_layernorm.scale``;
``attention.in_proj_qkvz.kernel``, ``in_proj_ba.kernel``, ``conv1d.kernel`` (kernel, 1,
conv_dim), ``A_log``, ``dt_bias``, ``norm.rms_norm.scale``, ``out_proj.kernel`` (linear);
``attention.attention.query.kernel`` (embed, heads, 2 * head_dim), ``key``/``value``
(embed, kv_heads, head_dim), ``out.kernel`` (heads * head_dim, embed: MaxText keeps it
flat), ``query_norm``/``key_norm`` (full); ``mlp.routed_experts.gate.kernel``,
``mlp.routed_experts.{wi_0,wi_1,wo}`` (experts first, no ``kernel``),
``mlp.shared_expert.{wi_0,wi_1,wo}.kernel``, ``mlp.shared_expert_gate.kernel``; plus
``token_embedder.embedding``, ``decoder.decoder_norm.scale``, ``decoder.logits_dense.kernel``.
MaxText's converter changes no value (its norms add the 1 themselves, as Hugging
Face's do; ``in_proj_qkvz`` is stored already grouped by key head), so neither do these
rules: a load is the checkpoint's values and a save gives back a bfloat16 or float32
checkpoint bit for bit. MaxText scans only whole blocks here (its converter maps no
``layers_remainder``), so a scanned mapping needs ``num_hidden_layers`` a multiple of the
interval.

Qwen3.5's layers are Qwen3-Next's but for the gated delta net's input projections, stored
apart (``linear_attn.in_proj_{qkv,z,b,a}``) and kept apart (``….kernel``), and, in its dense
models, a plain MLP (``mlp.{gate,up,down}_proj.kernel``). Its releases store each layer's
routed experts fused (``mlp.experts.gate_up_proj`` (experts, 2 * mlp, hidden), gate rows
first, and ``down_proj`` (experts, hidden, mlp)); transformers 5's ``save_pretrained`` writes
one tensor per expert: ``qwen3_5(..., fused_experts=True)`` maps the first, each one leaf, and
the default the second, stacked. Its multimodal checkpoints hold the text under
``model.language_model.``, read through ``text_config``; the vision tower (``model.visual.``)
is left out (MaxText maps it, ``models/qwen3_5_vision.py``, only with ``use_multimodal``).

MaxText's Qwen3.5 tree (``maxtext("qwen3.5", ...)``; ``QWEN3_5_MAXTEXT_TO_HF_*``,
``models/qwen3_5.py``) has Qwen3-Next's leaves, scanned as Gemma 3's: layer ``c * n + k`` at
index ``n`` (axis 1) of ``decoder.layers.layer_{k}``. Its ``attention.in_proj_qkvz.kernel``
holds, key head by key head, that head's query, key and value columns of ``in_proj_qkv`` and
its ``in_proj_z`` columns, and ``in_proj_ba`` each head's ``in_proj_b`` then ``in_proj_a``
columns (``Rule.order``); ``mlp.routed_experts.wi_0``/``wi_1`` are the gate and up halves of
the release's fused ``gate_up_proj`` (``Rule.take``), ``wo`` its ``down_proj`` transposed; an
FP8 release (``quantization_config``) stores one tensor per expert, stacked, as MaxText's
converter reads it. Those leaves are parts of stored tensors: a save (and ``ost.convert``
back to Hugging Face) writes each stored tensor from all the leaves that hold its parts.

The releases' multi-token-prediction tensors (``mtp.``) are left out (``Mapping.ignore``),
as transformers leaves them out. A quantized release (``quantization_config``: block FP8
with ``weight_scale_inv``) reads through the same rules (``mappings._quantized``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import attention_dims, config_sizes, config_value, heads_without_config
from orbax_safetensors.mappings._quantized import quantized_mapping
from orbax_safetensors.planning.rules import Mapping, Rule, Strided

# (HF name, MaxText name) of every layer's tensors, without ".weight"; the kind of layer that
# has it ("linear", "full", None: every layer); how it is arranged. The Flax-style tree keeps
# the HF name.
_LINEAR = {"transpose": (1, 0)}
_NORMS = (
    ("input_layernorm", "input_layernorm", None, {}),
    ("post_attention_layernorm", "post_attention_layernorm", None, {}),
)
_MOE = (
    ("mlp.gate", "mlp.routed_experts.gate", None, _LINEAR),
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.wi_0", None, _LINEAR),
    ("mlp.shared_expert.up_proj", "mlp.shared_expert.wi_1", None, _LINEAR),
    ("mlp.shared_expert.down_proj", "mlp.shared_expert.wo", None, _LINEAR),
    ("mlp.shared_expert_gate", "mlp.shared_expert_gate", None, _LINEAR),
)
_DENSE = tuple((f"mlp.{p}", None, None, _LINEAR) for p in ("gate_proj", "up_proj", "down_proj"))  # Qwen3.5 dense
_ATTENTION = (
    ("linear_attn.conv1d", "attention.conv1d", "linear", {"transpose": (2, 1, 0)}),  # (C, 1, K) -> (K, 1, C)
    ("linear_attn.norm", "attention.norm.rms_norm", "linear", {}),
    ("linear_attn.out_proj", "attention.out_proj", "linear", _LINEAR),
    ("self_attn.q_proj", "attention.attention.query", "full", {**_LINEAR, "split": {1: ("heads", "gated_head_dim")}}),
    ("self_attn.k_proj", "attention.attention.key", "full", {**_LINEAR, "split": {1: ("kv_heads", "head_dim")}}),
    ("self_attn.v_proj", "attention.attention.value", "full", {**_LINEAR, "split": {1: ("kv_heads", "head_dim")}}),
    ("self_attn.q_norm", "attention.attention.query_norm", "full", {}),
    ("self_attn.k_norm", "attention.attention.key_norm", "full", {}),
)
# The gated delta net's input projections: Qwen3-Next stores q, k, v, z fused (already grouped
# by key head, as MaxText's in_proj_qkvz holds them) and b, a fused; Qwen3.5 stores qkv, z, b
# and a apart (MaxText regroups them by key head: no MaxText mapping here).
_QWEN3_NEXT_INPUTS = (("linear_attn.in_proj_qkvz", "attention.in_proj_qkvz", "linear", _LINEAR),
                      ("linear_attn.in_proj_ba", "attention.in_proj_ba", "linear", _LINEAR))
_QWEN3_5_INPUTS = tuple((f"linear_attn.in_proj_{p}", None, "linear", _LINEAR) for p in ("qkv", "z", "b", "a"))
# Tensors with no ".weight" suffix, and their leaves (no ".scale"/".kernel").
_BARE = (("linear_attn.A_log", "attention.A_log"), ("linear_attn.dt_bias", "attention.dt_bias"))
_EXPERTS = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))

# per_layer(stored, tree, kind, *, experts=False, **transform) -> rules; kind: "linear" /
# "full" for one kind of layer's own tensor, None for one every layer has.
PerLayer = Callable[..., list[Rule]]


def _leaf(stored: str, tree: str) -> str:
    """The leaf name under ``tree`` of the stored ``<stored>.weight``."""
    return f"{tree}.{'scale' if stored.endswith('norm') else 'kernel'}"


def _rules(per_layer: PerLayer, tensors: tuple, *, maxtext: bool, experts: str | None, dtype: Any) -> list[Rule]:
    """Every per-layer rule, named in the Flax-style tree or (``maxtext``) in MaxText's: the
    ``tensors`` (HF name, MaxText name, kind, arrangement), and the routed experts, stored one
    tensor per expert (``experts="split"``), fused per layer (``"fused"``) or absent (``None``)."""
    rules = []
    for hf, mt, kind, transform in tensors:
        rules += per_layer(f"{hf}.weight", _leaf(hf, mt if maxtext else hf), kind, dtype=dtype, **transform)
    for hf, mt in _BARE:
        rules += per_layer(hf, mt if maxtext else hf, "linear", dtype=dtype)
    if maxtext:  # MaxText keeps its attention output kernel flat, (heads * head_dim, embed)
        rules += per_layer("self_attn.o_proj.weight", "attention.attention.out.kernel", "full", dtype=dtype, **_LINEAR)
    else:
        rules += per_layer("self_attn.o_proj.weight", "self_attn.o_proj.kernel", "full", dtype=dtype,
                           split={0: ("heads", "head_dim")}, **_LINEAR)
    if experts == "split":
        for hf, mt in _EXPERTS:
            rules += per_layer(f"mlp.experts.{{e}}.{hf}.weight",
                               f"mlp.routed_experts.{mt}" if maxtext else f"mlp.experts.{hf}.kernel", None,
                               experts=True, dtype=dtype, **_LINEAR)
    elif experts == "fused":  # (experts, 2 * mlp, hidden) and (experts, hidden, mlp), each kept one leaf
        for hf in ("gate_up_proj", "down_proj"):
            rules += per_layer(f"mlp.experts.{hf}", f"mlp.experts.{hf}.kernel", None, dtype=dtype, transpose=(0, 2, 1))
    return rules


def _interval(config: Any, where: str) -> tuple[int, int]:
    """(full_attention_interval, num_hidden_layers), checked against the config's
    ``layer_types``: linear attention, then one full-attention layer, per interval."""
    if config is None:
        raise ArgumentError(f"{where}: config is None; pass the checkpoint's Hugging Face config "
                            "(num_hidden_layers, full_attention_interval, the head sizes)")
    layers, types = config_value(config, "num_hidden_layers"), config_value(config, "layer_types")
    if layers is None:
        raise ArgumentError(f"{where}: the config has no num_hidden_layers")
    # Qwen3.5's configs state the pattern by layer_types alone: the interval is its first full layer's.
    first_full = list(types).index("full_attention") + 1 if types and "full_attention" in types else 4
    layers, interval = int(layers), int(config_value(config, "full_attention_interval", first_full))
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if types is not None and list(types) != expected:
        raise ArgumentError(f"{where}: layer_types {list(types)} is not {interval - 1} linear-attention layers "
                            "then one full-attention layer, repeated (the pattern this mapping and MaxText scan)")
    return interval, layers


def _by_block(config: Any, where: str, *, prefix: str, root: str, names: tuple[str, str], layer_axis: int,
              expert_axis: int | None) -> PerLayer:
    """``per_layer`` of a scanned tree: layer ``c * n + k`` (``c`` the interval; stored under
    ``<prefix>layers.``) at ``[n, k]`` of ``<root>.<names[0]>`` (the linear layers; axes
    ``layer_axis`` and ``layer_axis + 1``) when ``k < c - 1``, else at ``[n]`` of
    ``<root>.<names[1]>`` (the full-attention layer); experts at ``expert_axis`` (``None``:
    right after the layer axes)."""
    interval, layers = _interval(config, where)
    if layers % interval:
        raise ArgumentError(f"{where}: num_hidden_layers {layers} is not a multiple of full_attention_interval "
                            f"{interval}; scanned, the layers are whole blocks of {interval}")
    linear, full = names

    def per_layer(stored: str, tree: str, kind: str | None, *, experts: bool = False, **transform: Any) -> list[Rule]:
        rules = []

        def expert(axes: int) -> dict[str, int]:
            return {"e": layer_axis + axes if expert_axis is None else expert_axis} if experts else {}

        if kind in (None, "linear"):
            rules.append(Rule(_stored(prefix, stored), f"{root}.{linear}.{tree}",
                              stack={**expert(2), "i": layer_axis, "k": layer_axis + 1},
                              strided={"i": Strided("k", interval, stop=layers, width=interval - 1)}, **transform))
        if kind in (None, "full"):
            rules.append(Rule(_stored(prefix, stored), f"{root}.{full}.{tree}",
                              stack={**expert(1), "i": layer_axis},
                              strided={"i": Strided(None, interval, start=interval - 1, stop=layers)}, **transform))
        return rules

    return per_layer


def _every_layer(prefix: str, root: str) -> PerLayer:
    """``per_layer`` of an unscanned tree: layer ``i`` (stored under ``<prefix>layers.{i}.``)
    under ``<root>_{i}`` (a layer's own tensors say which kind it is)."""
    def per_layer(stored: str, tree: str, kind: str | None, *, experts: bool = False, **transform: Any) -> list[Rule]:
        del kind
        return [Rule(_stored(prefix, stored), f"{root}_{{i}}.{tree}", stack={"e": 0} if experts else {},
                     **transform)]

    return per_layer


def _by_position(prefix: str, interval: int, layers: int) -> PerLayer:
    """``per_layer`` of MaxText's scanned Qwen3.5 tree: layer ``c * n + k`` (``c`` the
    interval) at index ``n`` (axis 1) of ``decoder.layers.layer_{k}`` (experts at 0)."""
    def per_layer(stored: str | tuple[str, ...], tree: str, kind: str | None, *, experts: bool = False,
                  **transform: Any) -> list[Rule]:
        del kind  # a position's own tensors say which kind it is
        return [Rule(_stored(prefix, stored), f"decoder.layers.layer_{{k}}.{tree}",
                     stack={**({"e": 0} if experts else {}), "i": 1},
                     strided={"i": Strided("k", interval, stop=layers)}, **transform)]

    return per_layer


def _stored(prefix: str, stored: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """A layer's stored name(s) under ``prefix``."""
    if isinstance(stored, tuple):
        return tuple(f"{prefix}layers.{{i}}.{name}" for name in stored)
    return f"{prefix}layers.{{i}}.{stored}"


def _dims(config: Any, where: str) -> dict[str, int]:
    """The head sizes the attention rules split by (``gated_head_dim``: a query head and its gate)."""
    dims = attention_dims(config, where)
    if "head_dim" in dims:
        dims["gated_head_dim"] = 2 * dims["head_dim"]
    return dims


def _outer(prefix: str, tree: tuple[str, str, str], config: Any, dtype: Any) -> list[Rule]:
    embedding, norm, head = tree
    rules = [Rule(f"{prefix}embed_tokens.weight", embedding, dtype=dtype),
             Rule(f"{prefix}norm.weight", norm, dtype=dtype)]
    if not (config is not None and config_value(config, "tie_word_embeddings", False)):
        rules.append(Rule("lm_head.weight", head, dtype=dtype, **_LINEAR))
    return rules


def _flax(config: Any, where: str, *, prefix: str, scan_layers: bool, tensors: tuple, experts: str | None,
          dtype: Any) -> list[Rule]:
    """The Flax-style tree's rules."""
    if scan_layers:
        per_layer = _by_block(config, f"{where} (scanned)", prefix=prefix, root="model.layers",
                              names=("linear", "full"), layer_axis=0, expert_axis=None)
    else:
        if config is not None:
            _interval(config, where)
        per_layer = _every_layer(prefix, "model.layers")
    rules = _outer(prefix, ("model.embed_tokens.embedding", "model.norm.scale", "lm_head.kernel"), config, dtype)
    return rules + _rules(per_layer, tensors, maxtext=False, experts=experts, dtype=dtype)


def _undeclared(config: Any, where: str) -> str | None:
    return heads_without_config(config, where, ("heads", "kv_heads", "head_dim", "gated_head_dim"))


def qwen3_next(config: Any = None, *, scan_layers: bool = False, dtype: Any = None,
               dequantize: bool = True) -> Mapping:
    """``Qwen3NextForCausalLM`` ↔ ``mappings.qwen_hybrid``'s Flax-style tree. ``config`` pins the
    head sizes and, scanned (where it is needed), the layer pattern; ``dequantize`` as in
    ``mappings._quantized`` for an FP8 release. The release's multi-token-prediction tensors
    (``mtp.``) are left out, as transformers leaves them out."""
    where = "ost.mappings.qwen3_next"
    rules = _flax(config, where, prefix="model.", scan_layers=scan_layers, tensors=_NORMS + _MOE + _QWEN3_NEXT_INPUTS
                  + _ATTENTION, experts="split", dtype=dtype)
    return quantized_mapping(rules, config, dequantize=dequantize, dims=_dims(config, where), ignore=("mtp.",),
                             sizes=config_sizes(config), undeclared=_undeclared(config, where))


def qwen3_5(config: Any = None, *, scan_layers: bool = False, dtype: Any = None, dequantize: bool = True,
            fused_experts: bool = False) -> Mapping:
    """Qwen3.5's text decoder (``Qwen3_5MoeForCausalLM``, ``Qwen3_5ForCausalLM``, or the
    multimodal ``…ForConditionalGeneration``, whose ``text_config`` it reads, with the text
    tensors under ``model.language_model.``) ↔ ``mappings.qwen_hybrid``'s Flax-style tree, as
    Qwen3-Next's but for the gated delta net's four input projections, kept apart as stored
    (``linear_attn.in_proj_{qkv,z,b,a}.kernel``), and a dense MLP where the config has no
    experts. The vision tower (``model.visual.``) and the multi-token-prediction tensors
    (``mtp.``) are left out. ``fused_experts``: the releases' form of the routed experts, one
    ``mlp.experts.gate_up_proj`` (experts, 2 * moe_intermediate, hidden) and one ``down_proj``
    per layer, each one leaf transposed, ``mlp.experts.{gate_up,down}_proj.kernel``; without it,
    the form transformers' ``save_pretrained`` writes, one tensor per expert, stacked
    (``mlp.experts.{gate,up,down}_proj.kernel``)."""
    where = "ost.mappings.qwen3_5"
    release, text = config, None if config is None else config_value(config, "text_config")
    prefix, config = ("model.", config) if text is None else ("model.language_model.", text)
    moe = config is None or int(config_value(config, "num_experts", 0)) > 0
    tensors = _NORMS + (_MOE if moe else _DENSE) + _QWEN3_5_INPUTS + _ATTENTION
    rules = _flax(config, where, prefix=prefix, scan_layers=scan_layers, tensors=tensors,
                  experts=("fused" if fused_experts else "split") if moe else None, dtype=dtype)
    # gpt-oss's fused down_proj is (experts, mlp, hidden), checked against intermediate_size; Qwen3.5's
    # is (experts, hidden, mlp), sized by moe_intermediate_size.
    sizes = [size for size in config_sizes(config, prefix) if not size.stored.endswith("mlp.experts.down_proj")]
    return quantized_mapping(rules, release, dequantize=dequantize, dims=_dims(config, where),
                             ignore=("mtp.", "model.visual."), sizes=sizes, undeclared=_undeclared(config, where))


def maxtext_qwen3_next(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool) -> Mapping:
    """HF Qwen3-Next ↔ MaxText's ``qwen3-next-*`` tree, for ``mappings.maxtext``."""
    where = "maxtext('qwen3-next')"
    if scan_layers:
        per_layer = _by_block(config, where, prefix="model.", root="decoder.layers",
                              names=("local_layers", "global_layer"), layer_axis=1, expert_axis=0)
    else:
        _interval(config, where)
        per_layer = _every_layer("model.", "decoder.layers")
    rules = _outer("model.", ("token_embedder.embedding", "decoder.decoder_norm.scale", "decoder.logits_dense.kernel"),
                   config, dtype)
    rules += _rules(per_layer, _NORMS + _MOE + _QWEN3_NEXT_INPUTS + _ATTENTION, maxtext=True, experts="split",
                    dtype=dtype)
    return quantized_mapping(rules, config, dequantize=dequantize, dims=_dims(config, where), ignore=("mtp.",),
                             checkpoint_form="maxtext", sizes=config_sizes(config))


def _gated_delta_inputs(config: Any, where: str, per_layer: PerLayer, concat_axis: int, dtype: Any) -> list[Rule]:
    """MaxText's ``in_proj_qkvz`` and ``in_proj_ba`` kernels from Qwen3.5's four projections, as
    its converter's ``concat_qkvz_and_transpose`` / ``concat_ba_and_transpose`` hooks make them:
    per key head, that head's query, key and value columns of ``in_proj_qkv`` and its
    ``in_proj_z`` columns (each value head group ``value_heads / key_heads`` wide), then its
    ``in_proj_b`` and ``in_proj_a`` columns (``Rule.order``, in slices of the greatest width
    that divides them all)."""
    sizes = {key: config_value(config, key) for key in ("linear_num_key_heads", "linear_num_value_heads",
                                                        "linear_key_head_dim", "linear_value_head_dim")}
    if None in sizes.values():
        raise ArgumentError(f"{where}: the config needs {', '.join(sizes)}, which give the gated delta net's sizes")
    heads, value_heads, key_dim, value_dim = (int(v) for v in sizes.values())
    group = value_heads // heads  # value heads per key head
    chunk = math.gcd(key_dim, group * value_dim)
    q, v = key_dim // chunk, group * value_dim // chunk  # slices of one key head's query (key), value (z)
    qkvz = [slot for h in range(heads) for slot in (
        [(0, h * q + j) for j in range(q)] + [(0, heads * q + h * q + j) for j in range(q)]
        + [(0, 2 * heads * q + h * v + j) for j in range(v)] + [(1, h * v + j) for j in range(v)])]
    ba = [(p, h) for h in range(heads) for p in (0, 1)]
    linear = {"transpose": (1, 0), "dtype": dtype}
    return [*per_layer(("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
                       "attention.in_proj_qkvz.kernel", "linear",
                       concat={concat_axis: (heads * (2 * key_dim + group * value_dim), value_heads * value_dim)},
                       order=tuple(qkvz),
                       chunk=chunk, **linear),
            *per_layer(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
                       "attention.in_proj_ba.kernel", "linear", concat={concat_axis: (value_heads, value_heads)},
                       order=tuple(ba),
                       chunk=group, **linear)]


def maxtext_qwen3_5(config: Any, scan_layers: bool, *, dtype: Any, dequantize: bool) -> Mapping:
    """HF Qwen3.5 (its text decoder) ↔ MaxText's ``qwen3.5-*`` tree, for ``mappings.maxtext``."""
    where = "maxtext('qwen3.5')"
    release, text = config, None if config is None else config_value(config, "text_config")
    prefix, config = ("model.", config) if text is None else ("model.language_model.", text)
    interval, layers = _interval(config, where)
    if scan_layers:
        if layers % interval:
            raise ArgumentError(f"{where}: num_hidden_layers {layers} is not a multiple of full_attention_interval "
                                f"{interval}; scanned, the layers are whole blocks of {interval}")
        per_layer = _by_position(prefix, interval, layers)
    else:
        per_layer = _every_layer(prefix, "decoder.layers")
    rules = _outer(prefix, ("token_embedder.embedding", "decoder.decoder_norm.scale", "decoder.logits_dense.kernel"),
                   config, dtype)
    quantized = config_value(release, "quantization_config") is not None
    rules += _rules(per_layer, _NORMS + _MOE + _ATTENTION, maxtext=True, experts="split" if quantized else None,
                    dtype=dtype)
    rules += _gated_delta_inputs(config, where, per_layer, 2 if scan_layers else 1, dtype)
    if not quantized:  # the bfloat16 releases' fused experts; gate then up rows in gate_up_proj
        for index, leaf in enumerate(("wi_0", "wi_1")):
            rules += per_layer("mlp.experts.gate_up_proj", f"mlp.routed_experts.{leaf}", None, transpose=(0, 2, 1),
                               split={2: (2, -1)}, take={2: index}, dtype=dtype)
        rules += per_layer("mlp.experts.down_proj", "mlp.routed_experts.wo", None, transpose=(0, 2, 1), dtype=dtype)
    sizes = [size for size in config_sizes(config, prefix) if not size.stored.endswith("mlp.experts.down_proj")]
    return quantized_mapping(rules, release, dequantize=dequantize, dims=_dims(config, where),
                             ignore=("mtp.", "model.visual."), checkpoint_form="maxtext", sizes=sizes)
