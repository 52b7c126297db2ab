"""A shipped mapping by name, as the command line names it: ``"maxtext:llama3.1"``, ``"llama"``."""

from __future__ import annotations

from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings import huggingface
from orbax_safetensors.mappings.maxtext import maxtext
from orbax_safetensors.planning.rules import Mapping

_FLAX = {"llama": huggingface.llama, "mistral": huggingface.mistral, "qwen2": huggingface.qwen2,
         "qwen3": huggingface.qwen3, "gemma2": huggingface.gemma2, "gemma3": huggingface.gemma3,
         "mixtral": huggingface.mixtral, "qwen3_moe": huggingface.qwen3_moe, "deepseek_v3": huggingface.deepseek_v3,
         "deepseek_v2": huggingface.deepseek_v2, "deepseek_v32": huggingface.deepseek_v32, "gpt_oss": huggingface.gpt_oss, "olmo3": huggingface.olmo3,
         "qwen3_next": huggingface.qwen3_next, "qwen3_5": huggingface.qwen3_5}
_FLAX.update({"qwen3_vl": huggingface.qwen3_vl, "qwen3_omni_moe": huggingface.qwen3_omni_moe})
_FLAX["gemma4"] = huggingface.gemma4
_FLAX["deepseek_v4"] = huggingface.deepseek_v4


def by_name(name: str, config: Any, *, scan_layers: bool | None = None, dtype: Any = None) -> Mapping:
    """``"maxtext:FAMILY"``: ``maxtext(FAMILY, config, ...)`` (scanned unless ``scan_layers`` is
    false, as MaxText trains); ``"auto"``: ``for_config(config)``; any other name: that
    Flax-style family (``"llama"``, ``"qwen3_moe"``; unscanned unless ``scan_layers``)."""
    if name.startswith("maxtext:"):
        return maxtext(name.split(":", 1)[1], config, scan_layers=scan_layers is not False, dtype=dtype)
    if name == "auto":
        return huggingface.for_config(config, scan_layers=bool(scan_layers), dtype=dtype)
    if name not in _FLAX:
        raise ArgumentError(f"no shipped mapping {name!r}; choose maxtext:FAMILY, auto or one of "
                            f"{', '.join(_FLAX)}")
    return _FLAX[name](config, scan_layers=bool(scan_layers), dtype=dtype)
