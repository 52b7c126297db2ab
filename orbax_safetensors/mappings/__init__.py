"""Shipped ``ost.Mapping``s: Hugging Face decoder checkpoints ↔ Flax trees
(``llama`` … ``qwen3_moe``, ``deepseek_v3``, ``gpt_oss``, ``for_config``) and ↔ MaxText's own params tree
(``maxtext``)."""

from orbax_safetensors.mappings.huggingface import (
    deepseek_v3,
    for_config,
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from orbax_safetensors.mappings.maxtext import maxtext
from orbax_safetensors.mappings.named import by_name

__all__ = ["by_name", "deepseek_v3", "for_config", "gemma2", "gemma3", "gpt_oss", "llama", "maxtext", "mistral",
           "mixtral", "qwen2", "qwen3", "qwen3_moe"]
