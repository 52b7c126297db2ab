"""A compact Flax NNX Llama that loads (and saves) Hugging Face ``LlamaForCausalLM`` checkpoints.

    pip install "orbax_safetensors[examples,interop]"
    python examples/nnx_llama.py HF_DIR        # a save_pretrained / `hf download` directory
    python examples/nnx_llama.py               # makes a tiny random one first

The model's state (``nnx.split(model)``: its parameters and nothing else)
is the tree ``ost.mappings.llama(config)`` targets, so a checkpoint loads
straight into it, each device reading only the bytes of its own shards:
module attributes carry Hugging Face's names (``model.layers_3.self_attn``),
the leaves Flax's (``kernel``, ``scale``, ``embedding``), and a state leaf is
named as in a Linen params dict (``q_proj.kernel``: an ``nnx.Param``'s own
``value`` is no part of the name). Attention kernels keep heads as an axis
(``LinearGeneral``), so ``q_proj.weight`` (heads * head_dim, hidden) arrives
as (hidden, heads, head_dim), transposed and split shard by shard. The math
follows transformers': RMSNorm, rotary embeddings (rotate_half, Llama 3's
frequency scaling), grouped-query attention, a causal mask, a SiLU-gated MLP,
and the head tied to the embedding when the config says so. The script loads
the checkpoint sharded over every device (FSDP), compares logits with
transformers' (when torch is installed), saves the state back through the
mapping and reloads it. The Linen twin is ``flax_llama.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import orbax_safetensors as ost


def _field(config: Any, name: str, default: Any = None) -> Any:
    """A transformers config's field, or a ``config.json`` dict's."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def rope_parameters(config: Any) -> tuple[tuple[str, Any], ...]:
    """The config's RoPE fields (transformers 4 or 5 names) as a static value: the model keeps
    them, not the frequencies, so that its state holds its parameters and nothing else."""
    rope = dict(_field(config, "rope_parameters") or _field(config, "rope_scaling") or {})
    rope.setdefault("rope_theta", _field(config, "rope_theta", 10000.0))
    kind = rope.setdefault("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise NotImplementedError(f"rope_type {kind!r}: only the default and llama3 RoPE")
    if _field(config, "attention_bias") or _field(config, "mlp_bias"):
        raise NotImplementedError("biases in attention or MLP")
    return tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (dict, list))))


def inverse_frequencies(rope: dict[str, Any], head_dim: int) -> jax.Array:
    """RoPE's inverse frequencies, scaled as Llama 3.x configs ask (``rope_type: llama3``)."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope["rope_type"] == "default":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


class Attention(nnx.Module):
    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        hidden, heads = _field(config, "hidden_size"), _field(config, "num_attention_heads")
        self.heads, self.kv_heads = heads, _field(config, "num_key_value_heads", heads)
        self.head_dim = _field(config, "head_dim") or hidden // heads
        dense = lambda n: nnx.LinearGeneral(hidden, (n, self.head_dim), use_bias=False, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = dense(heads), dense(self.kv_heads), dense(self.kv_heads)
        self.o_proj = nnx.LinearGeneral((heads, self.head_dim), hidden, axis=(-2, -1), use_bias=False,
                                        rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (batch, seq, heads, head_dim)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        group = self.heads // self.kv_heads  # GQA: each kv head serves a group of query heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.head_dim ** -0.5
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        return self.o_proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class MLP(nnx.Module):
    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        hidden, inner = _field(config, "hidden_size"), _field(config, "intermediate_size")
        self.gate_proj = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inner, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        hidden, eps = _field(config, "hidden_size"), _field(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = nnx.RMSNorm(hidden, epsilon=eps, rngs=rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(hidden, epsilon=eps, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nnx.Module):
    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        hidden = _field(config, "hidden_size")
        self.embed_tokens = nnx.Embed(_field(config, "vocab_size"), hidden, rngs=rngs)
        self.num_layers = _field(config, "num_hidden_layers")
        for i in range(self.num_layers):  # layers_{i}: the mapping's unscanned tree
            setattr(self, f"layers_{i}", DecoderLayer(config, rngs=rngs))
        self.norm = nnx.RMSNorm(hidden, epsilon=_field(config, "rms_norm_eps", 1e-6), rngs=rngs)
        self.head_dim = _field(config, "head_dim") or hidden // _field(config, "num_attention_heads")
        self.rope = rope_parameters(config)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        inv_freq = inverse_frequencies(dict(self.rope), self.head_dim)
        freqs = jnp.arange(tokens.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)  # HF's layout: halves, not interleaved
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        for i in range(self.num_layers):
            x = getattr(self, f"layers_{i}")(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """``LlamaForCausalLM(config, rngs=nnx.Rngs(0))``: ``config`` a transformers ``LlamaConfig``
    or its ``config.json`` dict; ``model(tokens)`` gives the logits."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        self.model = Model(config, rngs=rngs)
        self.tied = bool(_field(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nnx.Linear(_field(config, "hidden_size"), _field(config, "vocab_size"),
                                      use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        hidden = self.model(tokens)
        return self.model.embed_tokens.attend(hidden) if self.tied else self.lm_head(hidden)


def abstract_model(config: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its state as ``jax.ShapeDtypeStruct``s (no memory): the state
    holds the parameters alone, so with shardings on its leaves it is the load's target."""
    return nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0))))


def fsdp(leaf: jax.ShapeDtypeStruct, mesh: jax.sharding.Mesh) -> jax.ShapeDtypeStruct:
    """``leaf`` sharded over all of ``mesh`` along its largest axis the mesh divides (replicated
    where none does): fully sharded data parallelism, each device reading only its slice."""
    spec: list[Any] = [None] * len(leaf.shape)
    divisible = [d for d in range(len(leaf.shape)) if leaf.shape[d] % mesh.size == 0]
    if divisible:
        spec[max(divisible, key=lambda d: leaf.shape[d])] = mesh.axis_names
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def load(hf_dir: str, mesh: jax.sharding.Mesh | None = None, **kwargs: Any) -> LlamaForCausalLM:
    """The model, its parameters read from a ``save_pretrained`` directory (FSDP over ``mesh``
    when given; ``kwargs`` go to ``ost.load``)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    graphdef, abstract = abstract_model(config)
    if mesh is not None:
        abstract = jax.tree.map(lambda leaf: fsdp(leaf, mesh), abstract)
    return nnx.merge(graphdef, ost.load(hf_dir, abstract, mapping=ost.mappings.llama(config), **kwargs))


def main(argv: list[str] | None = None) -> int:
    # The self-check is flax_llama.py's (beside this file), on the NNX model.
    from flax_llama import matches_transformers, tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", nargs="?", help="a save_pretrained directory (default: a tiny random Llama)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = args.hf_dir
        if hf_dir is None:
            hf_dir = os.path.join(scratch, "tiny-llama")
            tiny_checkpoint(hf_dir)
        model = load(hf_dir, jax.make_mesh((jax.device_count(),), ("fsdp",),
                                           axis_types=(jax.sharding.AxisType.Auto,)))
        vocab = model.model.embed_tokens.embedding.shape[0]
        tokens = np.random.default_rng(0).integers(0, vocab, (2, 12), dtype=np.int32)
        ok = matches_transformers(hf_dir, tokens, np.asarray(model(jnp.asarray(tokens))), "nnx")
        saved = os.path.join(scratch, "saved")
        params = nnx.state(model)
        ost.save(saved, params, mapping=ost.mappings.llama())
        again = ost.load(saved, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                         mapping=ost.mappings.llama())
        same = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, again))
        print(f"saved through the mapping and reloaded: {'identical' if same else 'DIFFERENT'} params")
        return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
