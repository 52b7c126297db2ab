"""Reading a Hugging Face config given as a transformers config object or a plain dict."""

from __future__ import annotations

from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.planning.rules import ConfigSize


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict, ``config.key`` for a transformers config; ``default``
    when absent or ``None``."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


def attention_dims(config: Any, family: str) -> dict[str, int]:
    """The head sizes a decoder's attention rules split by (``heads``, ``kv_heads``,
    ``head_dim``); empty without a config, when the target's shapes give them. A config
    without them is an error naming ``family`` and the missing keys (not a ``KeyError`` or
    a ``TypeError`` from the arithmetic)."""
    if config is None:
        return {}
    heads = config_value(config, "num_attention_heads")
    head_dim = config_value(config, "head_dim")
    hidden = config_value(config, "hidden_size")
    missing = (["num_attention_heads"] if heads is None else []) + (
        ["head_dim (or hidden_size)"] if head_dim is None and hidden is None else [])
    if missing:
        raise ArgumentError(f"{family}: the config has no {' and no '.join(missing)}, which give the "
                         "attention head sizes")
    return {"heads": heads, "kv_heads": config_value(config, "num_key_value_heads", heads),
            "head_dim": head_dim if head_dim is not None else hidden // heads}


def heads_without_config(config: Any, family: str,
                         sizes: tuple[str, ...] = ("heads", "kv_heads", "head_dim")) -> str | None:
    """What a load says where ``family``'s mapping, made without a config, meets attention
    heads it cannot split (no target gives their ``sizes``); ``None`` with a config."""
    if config is not None:
        return None
    return (f"{family}() needs the model's config to split heads ({', '.join(sizes)}): "
            f"pass it, {family}(config), or load with a target")


# A decoder config's sizes and where its checkpoint shows them: (field, stored name after the
# prefix, axis; None: how many values the placeholder takes). A family has some of these
# tensors; those it lacks check nothing.
_SIZES = (
    ("num_hidden_layers", "layers.{i}.", None),
    ("vocab_size", "embed_tokens.weight", 0),
    ("hidden_size", "embed_tokens.weight", 1),
    ("intermediate_size", "layers.{i}.mlp.gate_proj.weight", 0),  # dense MLPs
    ("intermediate_size", "layers.{i}.block_sparse_moe.experts.{e}.w1.weight", 0),  # Mixtral's experts
    ("intermediate_size", "layers.{i}.mlp.experts.down_proj", 1),  # gpt-oss's fused experts
    ("moe_intermediate_size", "layers.{i}.mlp.experts.down_proj", 1),  # Qwen3-VL-MoE's (config_sizes)
    ("moe_intermediate_size", "layers.{i}.mlp.experts.{e}.gate_proj.weight", 0),  # Qwen3-MoE's, DeepSeek's
    ("num_local_experts", "layers.{i}.block_sparse_moe.gate.weight", 0),  # Mixtral's router
    ("num_local_experts", "layers.{i}.mlp.router.weight", 0),  # gpt-oss's
    ("num_experts", "layers.{i}.mlp.gate.weight", 0),  # Qwen3-MoE's (num_local_experts in transformers 5)
    ("num_local_experts", "layers.{i}.mlp.gate.weight", 0),
    ("n_routed_experts", "layers.{i}.mlp.gate.weight", 0),  # DeepSeek's
)


_FUSED_DOWN = "layers.{i}.mlp.experts.down_proj"


def config_sizes(config: Any, prefix: str = "model.") -> list[ConfigSize]:
    """What ``config`` says its checkpoint holds (tensors under ``prefix``), for
    ``Mapping(sizes=...)``: the fields it has, of those in ``_SIZES``."""
    if config is None:
        return []
    values = {field: config_value(config, field) for field, _, _ in _SIZES}
    # A fused down_proj's mlp is moe_intermediate_size where the config has one (Qwen3-VL-MoE, whose
    # intermediate_size is a dense layer's), else intermediate_size (gpt-oss).
    fused = "moe_intermediate_size" if isinstance(values["moe_intermediate_size"], int) else "intermediate_size"
    return [ConfigSize(field, int(values[field]), prefix + stored, axis) for field, stored, axis in _SIZES
            if isinstance(values[field], int) and not isinstance(values[field], bool)
            and (stored != _FUSED_DOWN or field == fused)]
