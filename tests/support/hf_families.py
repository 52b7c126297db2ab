"""Tiny Hugging Face decoder models, and a pure-JAX forward pass over a Flax-style tree.

Test support for mappings that load Hugging Face safetensors checkpoints into a
Flax-style params tree. `tiny_model` writes a small random transformers
checkpoint of one family, `reference_logits` runs transformers (eager attention,
float32) on it, and `forward` recomputes the same logits in JAX from a nested-dict
tree, so a test can check ``forward(family, config, loaded_tree, TOKENS)``
against ``reference_logits(directory, TOKENS)`` within the atol it returns (derived
from the magnitudes the head sums: ``tests/support/tolerances.py``). With a correctly converted
tree they agree to about 1e-5 in float32. The random weights are large enough that a
swapped, transposed or mis-reshaped leaf visibly changes the logits.

Tree layout (names are dot-joined dict keys; D hidden, H heads, K kv heads,
hd head_dim, F intermediate (qwen3_moe experts: moe_intermediate_size),
E experts, V vocab):

  model.embed_tokens.embedding (V, D)      model.norm.scale (D,)
  lm_head.kernel (D, V)                    absent when config.tie_word_embeddings
  model.layers_{i}.<leaf>                  unscanned, i = 0..L-1, or
  model.layers.<leaf>                      scanned: each leaf has a leading axis L
  <leaf> =
    input_layernorm.scale, post_attention_layernorm.scale (D,)
    pre_feedforward_layernorm.scale, post_feedforward_layernorm.scale (D,)  gemma2/3
    self_attn.{q,k,v}_proj.kernel (D, H|K, hd)     self_attn.o_proj.kernel (H, hd, D)
    self_attn.{q,k,v}_proj.bias (H|K, hd)          qwen2 (or attention_bias)
    self_attn.{q,k}_norm.scale (hd,)               qwen3, gemma3, qwen3_moe
    self_attn.{q,k}_norm.scale (H*hd,) / (K*hd,)   olmo3 (one norm over all heads); olmo3 has
                                                   post_attention_ and post_feedforward_layernorm only
    mlp.{gate,up}_proj.kernel (D, F)               mlp.down_proj.kernel (F, D)
    block_sparse_moe.gate.kernel (D, E)            mixtral; experts.w1/w3 (E, D, F),
                                                   experts.w2 (E, F, D)
    mlp.gate.kernel (D, E)                         qwen3_moe; mlp.experts.{gate,up}_proj
                                                   (E, D, F), mlp.experts.down_proj (E, F, D)
  Kernels are HF ``weight.T`` (then reshaped for attention). Norm leaves hold the
  raw HF weight; the Gemma forward adds the 1 (RMSNorm is x * (1 + w) there).

Semantics follow transformers 5.23's modeling_<family>.py: float32 RMSNorm,
q/k norms over head_dim before RoPE, Gemma's sqrt(D) embedding scale, sandwich
norms, query_pre_attn_scalar, attention and final-logit tanh softcapping,
gelu_pytorch_tanh, per-layer-type RoPE (Gemma 3: rope_local_base_freq on
sliding layers, rope_theta and its scaling on full-attention layers), llama3
and linear RoPE scaling, and MoE routing (softmax over all experts, top-k,
renormalised for Mixtral and for Qwen3-MoE with norm_topk_prob).

Sliding windows are real (key j is visible from query i when i - window < j <= i,
like HF's masks): on every layer for mistral/mixtral/qwen3_moe when
config.sliding_window is set, and on layer_types == "sliding_attention" layers
for qwen2/qwen3/gemma2/gemma3/olmo3. The tiny configs use window 4, shorter than
TOKENS, on mistral, qwen2 (layer 1), gemma2 (layer 0), gemma3 (layer 0) and olmo3 (layers 0-2), so
the windows change the result.

Limits: one full causal prefix (positions 0..T-1, no padding mask, no KV cache,
no dropout or router jitter); always computes in float32, whatever the leaf
dtype. That matches transformers loading a bfloat16 checkpoint with
dtype=float32, not transformers running in bfloat16 (which rounds, e.g.,
Gemma's embedding scale to bfloat16). RoPE types are only default, linear and
llama3, with no partial rotary. The MoE evaluates every expert and weights them
by the routing (the same result as HF's gather, but not efficient). Ties in the
router resolve however lax.top_k resolves them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "olmo3")

TOKENS = np.array(
    [
        [1, 17, 42, 99, 5, 127, 64, 3, 88, 23, 110, 7],
        [2, 76, 31, 120, 9, 55, 0, 101, 14, 66, 38, 93],
    ],
    dtype=np.int32,
)

# DeepSeek-V3's tensors (no JAX forward here: tests/families/test_deepseek_mapping.py checks leaves by
# hand and MaxText's forward): MLA with a low-rank query, 1 dense layer then 2 MoE layers of 8
# routed experts in 2 groups and a shared expert.
DEEPSEEK_V3: dict[str, Any] = {
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4, "head_dim": 8,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1,
}
# DeepSeek-V2-Lite's: V3's without the query LoRA (one q_proj) and the router bias, 2 shared experts.
DEEPSEEK_V2: dict[str, Any] = {**DEEPSEEK_V3, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy"}
# DeepSeek-V3.2's: V3's and each attention's indexer (4 heads of 16).
DEEPSEEK_V32: dict[str, Any] = {**DEEPSEEK_V3, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}

_GEMMA = ("gemma2", "gemma3")
_QK_NORM = ("qwen3", "gemma3", "qwen3_moe", "olmo3")
_PER_LAYER_TYPES = ("qwen2", "qwen3", "gemma2", "gemma3", "olmo3")  # sliding only where layer_types says
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}

Params = dict[str, Any]


# ----------------------------------------------------------------------------- transformers side


def tiny_config(family: str):
    """A tiny float32 transformers config of `family` (see the module docstring)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": family in _GEMMA,
        "dtype": "float32",
    }
    extra: dict[str, Any] = {
        "llama": {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,  # so the 8 frequencies hit all 3 llama3 bands
            }
        },
        "mistral": {"sliding_window": 4},
        "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "qwen3": {},
        "gemma2": {
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 4.0,  # small, so tanh is far from linear at these magnitudes
            "final_logit_softcapping": 3.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "gemma3": {
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
        # 4 layers: 3 sliding-window ones, then a full-attention one (Olmo3Config's default layer_types)
        "olmo3": {"num_hidden_layers": 4, "sliding_window": 4},
        "qwen3_moe": {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "deepseek_v3": DEEPSEEK_V3,
        "deepseek_v2": DEEPSEEK_V2,
        "deepseek_v32": DEEPSEEK_V32,
    }[family]
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v32": transformers.DeepseekV32Config,
        "olmo3": transformers.Olmo3Config,
    }[family]
    return cls(**{**common, **extra})


def saved_tensors(model) -> list[tuple[str, Any]]:
    """The tensors ``save_pretrained`` writes, each once (tied weights are listed once):
    parameters and persistent buffers (DeepSeek's ``e_score_correction_bias``)."""
    saved = set(model.state_dict())
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in saved)]


def tiny_model(family: str, directory: str, *, seed: int = 0, dtype: str = "float32") -> None:
    """Save a tiny random `family` model to `directory` (safetensors) in torch `dtype`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family), attn_implementation="eager"
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in saved_tensors(model):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:  # Gemma norms are offsets from 1; the others multiply directly
                value = 0.3 * noise if family in _GEMMA else 1.0 + 0.3 * noise
            else:
                value = 0.15 * noise
            param.copy_(value)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)


def reference_logits(directory: str, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' float32 logits (B, T, V) of the model saved in `directory`, and each
    logit's atol against another float32 forward (``tests/support/tolerances.py``)."""
    import torch
    import transformers

    from tests.support.tolerances import causal_lm_reference

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return causal_lm_reference(model, tokens, use_cache=False)


# ----------------------------------------------------------------------------- JAX side


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, gemma: bool) -> jax.Array:
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * (1.0 + weight) if gemma else x * weight


def _rope_parameters(config, layer_type: str | None) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": config.rope_theta,
    }
    return rope.get(layer_type, rope)


def _inv_freq(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """HF's inverse RoPE frequencies (modeling_rope_utils) for default/linear/llama3."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind != "default":
        raise NotImplementedError(f"rope_type {kind!r}")
    return inv_freq.astype(np.float32)


def _rope(x: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE on x (B, T, heads, hd) at positions 0..T-1."""
    freqs = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(emb) + rotated * jnp.sin(emb)


def _project(x: jax.Array, p: Params) -> jax.Array:
    y = jnp.einsum("btd,dhk->bthk", x, p["kernel"])
    return y + p["bias"] if "bias" in p else y


def _attention(family: str, config, p: Params, x: jax.Array, layer: int) -> jax.Array:
    gemma = family in _GEMMA
    head_dim = p["q_proj"]["kernel"].shape[-1]
    q, k, v = (_project(x, p[name]) for name in ("q_proj", "k_proj", "v_proj"))
    if family == "olmo3":  # one norm over all heads: the whole projection
        q, k = (_rms_norm(h.reshape(*h.shape[:2], -1), p[name]["scale"], config.rms_norm_eps, False).reshape(h.shape)
                for h, name in ((q, "q_norm"), (k, "k_norm")))
    elif family in _QK_NORM:
        q = _rms_norm(q, p["q_norm"]["scale"], config.rms_norm_eps, gemma)
        k = _rms_norm(k, p["k_norm"]["scale"], config.rms_norm_eps, gemma)

    layer_type = config.layer_types[layer] if family in _PER_LAYER_TYPES else None
    inv_freq = _inv_freq(_rope_parameters(config, layer_type), head_dim)
    q, k = _rope(q, inv_freq), _rope(k, inv_freq)

    groups = q.shape[2] // k.shape[2]  # query head h reads kv head h // groups (HF repeat_kv)
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scale = (config.query_pre_attn_scalar if gemma else head_dim) ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap

    positions = jnp.arange(x.shape[1])
    visible = positions[None, :] <= positions[:, None]
    if family in _PER_LAYER_TYPES:
        window = config.sliding_window if layer_type == "sliding_attention" else None
    else:
        window = getattr(config, "sliding_window", None)
    if window is not None:
        visible &= positions[None, :] > positions[:, None] - window
    scores = jnp.where(visible, scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bqhd,hdD->bqD", out, p["o_proj"]["kernel"])


def _dense_mlp(p: Params, x: jax.Array, act) -> jax.Array:
    hidden = act(x @ p["gate_proj"]["kernel"]) * (x @ p["up_proj"]["kernel"])
    return hidden @ p["down_proj"]["kernel"]


def _moe(router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
         x: jax.Array, top_k: int, renormalise: bool, act) -> jax.Array:
    """Softmax over all experts, keep the top k (optionally renormalised), SwiGLU experts."""
    probs = jax.nn.softmax(x @ router, axis=-1)  # (B, T, E)
    top_values, top_index = jax.lax.top_k(probs, top_k)
    if renormalise:
        top_values = top_values / jnp.sum(top_values, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(top_index, probs.shape[-1]) * top_values[..., None], axis=-2)
    hidden = act(jnp.einsum("btd,edf->btef", x, w_gate)) * jnp.einsum("btd,edf->btef", x, w_up)
    expert_out = jnp.einsum("btef,efd->bted", hidden, w_down)
    return jnp.einsum("bted,bte->btd", expert_out, weights)


def _feed_forward(family: str, config, p: Params, x: jax.Array) -> jax.Array:
    act = _ACTIVATIONS[getattr(config, "hidden_activation", None) or config.hidden_act]
    if family == "mixtral":
        m = p["block_sparse_moe"]
        e = m["experts"]
        return _moe(m["gate"]["kernel"], e["w1"]["kernel"], e["w3"]["kernel"], e["w2"]["kernel"],
                    x, config.num_experts_per_tok, True, act)
    if family == "qwen3_moe":
        m = p["mlp"]
        e = m["experts"]
        return _moe(m["gate"]["kernel"], e["gate_proj"]["kernel"], e["up_proj"]["kernel"],
                    e["down_proj"]["kernel"], x, config.num_experts_per_tok,
                    bool(config.norm_topk_prob), act)
    return _dense_mlp(p["mlp"], x, act)


def _decoder_layer(family: str, config, p: Params, x: jax.Array, layer: int) -> jax.Array:
    gemma, eps = family in _GEMMA, config.rms_norm_eps

    def norm(name: str, h: jax.Array) -> jax.Array:
        return _rms_norm(h, p[name]["scale"], eps, gemma)

    if family == "olmo3":  # norms on the attention's and the MLP's outputs only
        x = x + norm("post_attention_layernorm", _attention(family, config, p["self_attn"], x, layer))
        return x + norm("post_feedforward_layernorm", _feed_forward(family, config, p, x))
    attn = _attention(family, config, p["self_attn"], norm("input_layernorm", x), layer)
    if gemma:  # sandwich norms: post_attention_layernorm normalises the attention output
        x = x + norm("post_attention_layernorm", attn)
        ff = _feed_forward(family, config, p, norm("pre_feedforward_layernorm", x))
        return x + norm("post_feedforward_layernorm", ff)
    x = x + attn
    return x + _feed_forward(family, config, p, norm("post_attention_layernorm", x))


def forward(family: str, config, params: Params, tokens, *, scan_layers: bool) -> jax.Array:
    """Causal LM logits (B, T, V) in float32 from a Flax-style params tree.

    `config` is the transformers config (only its attributes are read). With
    `scan_layers`, per-layer leaves live under ``model.layers`` with a leading
    layer axis; otherwise under ``model.layers_{i}``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    model = params["model"]
    embedding = model["embed_tokens"]["embedding"]
    with jax.default_matmul_precision("highest"):
        x = embedding[jnp.asarray(tokens)]
        if family in _GEMMA:
            x = x * jnp.float32(config.hidden_size**0.5)
        for i in range(config.num_hidden_layers):
            if scan_layers:
                layer_params = jax.tree.map(lambda a, i=i: a[i], model["layers"])
            else:
                layer_params = model[f"layers_{i}"]
            x = _decoder_layer(family, config, layer_params, x, i)
        x = _rms_norm(x, model["norm"]["scale"], config.rms_norm_eps, family in _GEMMA)
        if config.tie_word_embeddings:
            logits = x @ embedding.T
        else:
            logits = x @ params["lm_head"]["kernel"]
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits
