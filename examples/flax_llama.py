"""A compact Flax Llama that loads (and saves) Hugging Face ``LlamaForCausalLM`` checkpoints.

    pip install "orbax_safetensors[examples,interop]"
    python examples/flax_llama.py HF_DIR        # a save_pretrained directory
    python examples/flax_llama.py               # makes a tiny random one first

The params tree is what ``ost.mappings.llama()`` targets: attention kernels
keep heads as an axis (``DenseGeneral``), so the checkpoint's ``q_proj.weight``
(heads * head_dim, hidden) arrives as (hidden, heads, head_dim), transposed
and split shard by shard while loading. The math follows transformers'
``LlamaForCausalLM``: RMSNorm, rotary embeddings with the ``rotate_half``
convention, grouped-query attention, a causal mask, a SiLU-gated MLP. The
script loads the checkpoint, compares logits with transformers' (when torch
is installed), saves the params back through the mapping and reloads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import orbax_safetensors as ost


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """From a ``config.json`` dict (transformers 4 or 5 field names)."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r}: only the default RoPE")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise NotImplementedError("biases in attention or MLP")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rotary(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape (seq, head_dim): HF's frequencies, duplicated (not interleaved)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Attention(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x, cos, sin):
        c = self.config
        dense = lambda heads, name: nn.DenseGeneral((heads, c.head_dim), use_bias=False, name=name)
        q = dense(c.num_attention_heads, "q_proj")(x)  # (batch, seq, heads, head_dim)
        k = dense(c.num_key_value_heads, "k_proj")(x)
        v = dense(c.num_key_value_heads, "v_proj")(x)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        group = c.num_attention_heads // c.num_key_value_heads  # GQA: each kv head serves a group
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c.head_dim ** -0.5
        seq = x.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=False, name="o_proj")(out)


class MLP(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
        gate = dense(self.config.intermediate_size, "gate_proj")(x)
        up = dense(self.config.intermediate_size, "up_proj")(x)
        return dense(self.config.hidden_size, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x, cos, sin):
        norm = lambda name: nn.RMSNorm(epsilon=self.config.rms_norm_eps, name=name)
        x = x + Attention(self.config, name="self_attn")(norm("input_layernorm")(x), cos, sin)
        return x + MLP(self.config, name="mlp")(norm("post_attention_layernorm")(x))


class Model(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(tokens)
        cos, sin = rotary(jnp.arange(tokens.shape[1]), c.head_dim, c.rope_theta)
        for i in range(c.num_hidden_layers):
            x = DecoderLayer(c, name=f"layers_{i}")(x, cos, sin)
        return nn.RMSNorm(epsilon=c.rms_norm_eps, name="norm")(x)


class LlamaForCausalLM(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens):
        hidden = Model(self.config, name="model")(tokens)
        return nn.Dense(self.config.vocab_size, use_bias=False, name="lm_head")(hidden)


def abstract_params(config: LlamaConfig) -> dict:
    """The params tree as ``jax.ShapeDtypeStruct``s (no memory), a load target."""
    model = LlamaForCausalLM(config)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]


def load(hf_dir: str, **kwargs) -> tuple[LlamaForCausalLM, dict]:
    """The model and its params from a ``save_pretrained`` directory (``kwargs`` go to ``ost.load``)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    config = LlamaConfig.from_hf(hf_config)
    params = ost.load(hf_dir, abstract_params(config), mapping=ost.mappings.llama(hf_config), **kwargs)
    return LlamaForCausalLM(config), params


def tiny_checkpoint(directory: str) -> None:
    """A random ``LlamaForCausalLM`` (GQA, untied head), for the self-check."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def matches_transformers(hf_dir: str, tokens: np.ndarray, logits: np.ndarray, label: str) -> bool:
    """Says how far ``logits`` are from transformers' on ``tokens`` (true where torch is absent)."""
    try:
        import torch
        import transformers
    except ImportError:
        print("torch/transformers not installed: logits not compared")
        return True
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.from_numpy(tokens).long()).logits.numpy()
    # Two float32 forwards round differently (kernels, CPU); a wrong layout moves logits by
    # about their own size. The tolerance is on the logits' scale, not per element.
    diff, scale = float(np.max(np.abs(logits - reference))), float(np.max(np.abs(reference)))
    ok = diff <= 1e-4 * scale
    print(f"{label} vs transformers logits: max abs difference {diff:.2e} of logits up to {scale:.2f} "
          f"({'match' if ok else 'MISMATCH'})")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", nargs="?", help="a save_pretrained directory (default: a tiny random Llama)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = args.hf_dir
        if hf_dir is None:
            hf_dir = os.path.join(scratch, "tiny-llama")
            tiny_checkpoint(hf_dir)
        model, params = load(hf_dir)
        tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12), dtype=np.int32)
        ok = matches_transformers(hf_dir, tokens, np.asarray(model.apply({"params": params}, tokens)), "flax")
        saved = os.path.join(scratch, "saved")
        ost.save(saved, params, mapping=ost.mappings.llama())
        again = ost.load(saved, abstract_params(model.config), mapping=ost.mappings.llama())
        same = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, again))
        print(f"saved through the mapping and reloaded: {'identical' if same else 'DIFFERENT'} params")
        return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
