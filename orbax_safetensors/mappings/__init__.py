"""Shipped ``ost.Mapping``s: Hugging Face decoder checkpoints ↔ Flax trees
(``llama`` … ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``, ``deepseek_v4``, ``gpt_oss``, ``olmo3``, ``qwen3_next``, ``qwen3_5``, ``qwen3_vl``, ``qwen3_omni_moe``, ``gemma4``, ``for_config``) and ↔ MaxText's own params tree
(``maxtext``)."""

from orbax_safetensors.mappings.huggingface import (
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    deepseek_v4,
    for_config,
    gemma2,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_omni_moe,
    qwen3_vl,
)
from orbax_safetensors.mappings.maxtext import maxtext
from orbax_safetensors.mappings.named import by_name

__all__ = ["by_name", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "for_config", "gemma2", "gemma3", "gemma4", "gpt_oss", "llama", "maxtext", "mistral",
           "mixtral", "olmo3", "qwen2", "qwen3", "qwen3_5", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl"]
