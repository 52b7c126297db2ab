"""A family mapping of a quantized release: dequantized as it is read, or kept as stored.

``quantization_config`` in a Hugging Face config says how the weights are
stored: ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``
(DeepSeek-V3, Qwen3-FP8) or ``{"quant_method": "mxfp4"}`` (gpt-oss). The
family's rules are written for the bfloat16 release; ``dequantize=True``
reads each quantized tensor as that release's tensor (``Mapping.quantization``),
``dequantize=False`` keeps FP8 weights as ``float8_e4m3fn`` leaves with their
scales beside them (``<kernel>_scale``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import config_value
from orbax_safetensors.planning.quantization import FP8, MXFP4, Quantization
from orbax_safetensors.planning.rules import Mapping, Rule


def quantization(config: Any) -> Quantization | None:
    """What ``config``'s ``quantization_config`` says (``None``: not quantized)."""
    spec = config_value(config, "quantization_config") if config is not None else None
    if spec is None:
        return None
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    method = spec.get("quant_method")
    if method == "fp8":
        if spec.get("fmt", "e4m3") != "e4m3":
            raise ArgumentError(f"quantization_config fmt {spec['fmt']!r}: only e4m3 FP8 is read")
        block = spec.get("weight_block_size")
        return FP8(None if block is None else tuple(int(b) for b in block))
    if method == "mxfp4":
        return MXFP4()
    raise ArgumentError(f"quantization_config quant_method {method!r} is not read; "
                        "read: fp8 (block-scaled, weight_scale_inv), mxfp4")


def quantized_mapping(rules: Iterable[Rule], config: Any, *, dequantize: bool = True, **mapping: Any) -> Mapping:
    """``Mapping(rules, **mapping)`` for a checkpoint ``config`` describes (quantized or not)."""
    rules, scheme = list(rules), quantization(config)
    if scheme is None or dequantize:
        return Mapping(rules, quantization=scheme, **mapping)
    if not isinstance(scheme, FP8):
        raise ArgumentError("an MXFP4 checkpoint is read dequantized (dequantize=True)")
    return Mapping([kept for rule in rules for kept in _kept(rule, scheme)], **mapping)


def _kept(rule: Rule, scheme: FP8) -> list[Rule]:
    """A ``Linear`` weight's rule as a kept FP8 weight and its scales: transposed and stacked
    as the rule says, never split, merged, permuted or scaled (a scale block spans heads,
    and FP8 values are not rescaled). Other rules as they are."""
    linear = rule.transpose == (1, 0) and isinstance(rule.stored, str) and rule.stored.endswith(".weight")
    if not linear:
        return [rule]
    shared = {"transpose": (1, 0), "stack": rule.stack, "strided": rule.strided}
    return [Rule(rule.stored, rule.tree, **shared),
            Rule(rule.stored + scheme.scale_suffix, rule.tree + "_scale", **shared)]
