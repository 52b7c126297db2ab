"""Reading a Hugging Face config given as a transformers config object or a plain dict."""

from __future__ import annotations

from typing import Any

from orbax_safetensors.errors import ArgumentError


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
