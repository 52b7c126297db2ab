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
         "gpt_oss": huggingface.gpt_oss}


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
