"""A family mapping of a quantized release: dequantized as it is read, or kept as stored.

``quantization_config`` in a Hugging Face config says how the weights are
stored: ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``
(DeepSeek-V3, Qwen3-FP8; with ``scale_fmt: "ue8m0"`` and ``expert_dtype:
"fp4"``, DeepSeek-V4's FP8 beside MXFP4 experts), ``{"quant_method": "mxfp4"}``
(gpt-oss), ``{"quant_method": "compressed-tensors", "config_groups": ...}``
(one scheme per group: INT4/INT8 ``IntQuantized``, FP8, ``NVFP4``) or
``{"quant_method": "modelopt", "quant_algo": "NVFP4"}``. The family's rules
are written for the bfloat16 release; ``dequantize=True`` reads each quantized
tensor as that release's tensor (``Mapping.quantization``), ``dequantize=False``
keeps each quantized weight as the tensors its scheme stores (``kept_tensors``:
the codes as the kernel, ``<kernel>_scale`` and the other parameters beside it),
so a save writes the release back as it was (gpt-oss's experts: their blocks and
exponents as stored, in a tree that does not take them apart).
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any

from orbax_safetensors.errors import ArgumentError
from orbax_safetensors.mappings._config import config_value
from orbax_safetensors.planning.dequantized import Quantization
from orbax_safetensors.planning.group_quantization import NVFP4, IntQuantized, MXFP4Packed
from orbax_safetensors.planning.quantization import FP8, MXFP4, reads_module
from orbax_safetensors.planning.rules import Mapping, Rule


def quantization(config: Any) -> Quantization | tuple[Quantization, ...] | None:
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
        block = None if block is None else tuple(int(b) for b in block)
        if config_value(config, "model_type") != "deepseek_v4":
            return FP8(block)
        return _deepseek_v4(config, spec, block)
    if method == "mxfp4":
        return MXFP4()
    if method == "compressed-tensors":
        return _compressed_tensors(spec)
    if method == "modelopt":
        return _modelopt(spec)
    raise ArgumentError(f"quantization_config quant_method {method!r} is not read; read: fp8 (block-scaled, "
                        "weight_scale_inv), mxfp4, compressed-tensors, modelopt")


# DeepSeek-V4's routed experts, in the release's names and in save_pretrained's: not its shared experts.
_V4_EXPERTS = r".*\.experts\.\d+\..+"
# The Linear modules DeepSeek-V4 ships bfloat16, which its config does not list: the compressors
# (the indexer's too) and the indexer's weights_proj (transformers 5.24's _keep_in_fp32_modules:
# "these projections ship in BF16 with no companion scale"), the router and the head, in the
# release's names and in save_pretrained's.
_V4_BFLOAT16 = [r"re:.*\.compressor\.", r"re:.*\.indexer\.(scorer\.)?weights_proj$", r"re:.*\.(ffn|mlp)\.gate$",
                r"re:(model\.)?(head|lm_head)$"]


def _deepseek_v4(config: Any, spec: dict, block: tuple[int, ...] | None) -> Quantization | tuple[Quantization, ...]:
    """DeepSeek-V4's mix: FP8 block-scaled weights with their E8M0 scales beside the module
    (``X.scale``), and, where ``expert_dtype`` says ``fp4`` (its config or, as transformers
    moves it, its ``quantization_config``), routed experts in MXFP4 (``X.weight`` I8, ``X.scale``)."""
    expert = spec.get("expert_dtype") or config_value(config, "expert_dtype", None)
    if expert not in (None, "fp8", "fp4"):
        raise ArgumentError(f"DeepSeek-V4 expert_dtype {expert!r} is not read; read: fp8, fp4")
    if expert != "fp4":
        return FP8(block, scale_suffix=".scale")
    return (FP8(block, scale_suffix=".scale", only=f"(?!{_V4_EXPERTS}$).*"),
            MXFP4Packed("deepseek-v4", only=_V4_EXPERTS))


def _compressed_tensors(spec: dict) -> Quantization | tuple[Quantization, ...]:
    """One scheme per config group of a compressed-tensors config (its ``targets``: class
    names such as ``Linear`` take any module, ``re:`` ones the modules they match)."""
    groups = spec.get("config_groups") or {}
    found = []
    for key, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if weights is None:
            continue  # activations only: the weights are stored as they are
        targets = group.get("targets") or []
        patterns = [t[len("re:"):] for t in targets if t.startswith("re:")]
        only = None if len(patterns) < len(targets) or not patterns else "|".join(f"(?:{p}).*" for p in patterns)
        found.append(_compressed_scheme(key, group.get("format") or spec.get("format"), weights, only,
                                        _stored_activations(group.get("input_activations"))))
    if not found:
        raise ArgumentError("quantization_config (compressed-tensors) has no config group with weights")
    return found[0] if len(found) == 1 else tuple(found)


_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "nvfp4-pack-quantized",
               "mxfp4-pack-quantized")


def _stored_activations(args: dict | None) -> tuple[str, ...]:
    """The activation parameters compressed-tensors stores per module for ``input_activations``
    (none where they are computed on the fly)."""
    dynamic = (args or {}).get("dynamic", True)
    if not args or dynamic is True:
        return ()
    if args.get("strategy") == "tensor_group":  # NVFP4's: local scales on the fly, a stored global one
        return ("input_global_scale",)
    if dynamic is not False:
        return ()
    return ("input_scale",) + (() if args.get("symmetric", True) else ("input_zero_point",))


def _compressed_scheme(key: str, fmt: str | None, weights: dict, only: str | None,
                       activations: tuple[str, ...]) -> Quantization:
    where = f"quantization_config (compressed-tensors) group {key!r}"
    if fmt not in _CT_FORMATS:
        raise ArgumentError(f"{where}: format {fmt!r} is not read; read: {', '.join(_CT_FORMATS)}")
    kind, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 8)), weights.get("strategy")
    group = weights.get("group_size")
    if fmt == "nvfp4-pack-quantized":
        return NVFP4("compressed-tensors", int(group or 16), only=only, activations=activations)
    if fmt == "mxfp4-pack-quantized":
        return MXFP4Packed("compressed-tensors", int(group or 32), only=only, activations=activations)
    if strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
        raise ArgumentError(f"{where}: weight strategy {strategy!r} is not read")
    if kind == "float":
        if bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise ArgumentError(f"{where}: float weights of {bits} bits, strategy {strategy!r}: read are FP8 "
                                "per tensor, per channel or per block")
        block = weights.get("block_structure") if strategy == "block" else None
        return FP8(None if block is None else tuple(int(b) for b in block), scale_suffix="_scale", only=only,
                   activations=activations)
    if strategy == "block":
        raise ArgumentError(f"{where}: block-scaled integer weights are not read")
    return IntQuantized(bits, int(group) if strategy in ("group", "tensor_group") else None,
                        symmetric=bool(weights.get("symmetric", True)), packed=fmt == "pack-quantized",
                        only=only, activations=activations)


def _modelopt(spec: dict) -> Quantization:
    algo = spec.get("quant_algo")
    if algo == "NVFP4":
        return NVFP4("modelopt", int(spec.get("group_size") or 16), activations=("input_scale",))
    if algo == "FP8":
        return FP8(None, scale_suffix="_scale", activations=("input_scale",))
    raise ArgumentError(f"quantization_config (modelopt) quant_algo {algo!r} is not read; read: NVFP4, FP8")


def quantized_mapping(rules: Iterable[Rule], config: Any, *, dequantize: bool = True, **mapping: Any) -> Mapping:
    """``Mapping(rules, **mapping)`` for a checkpoint ``config`` describes (quantized or not)."""
    rules, scheme = list(rules), quantization(config)
    if scheme is None or dequantize:
        return Mapping(rules, quantization=scheme, **mapping)
    schemes = scheme if isinstance(scheme, tuple) else (scheme,)
    ignored = (_V4_BFLOAT16 if config_value(config, "model_type") == "deepseek_v4"
               else _ignored(config_value(config, "quantization_config")))
    return Mapping([kept for rule in rules for kept in _kept(rule, schemes, ignored)], **mapping)


def _ignored(spec: Any) -> list[str]:
    """The modules a release leaves unquantized: compressed-tensors' ``ignore`` (names and
    ``re:`` patterns), ModelOpt's ``ignore`` / ``exclude_modules`` (names, ``*`` wildcards)."""
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    return list(spec.get("ignore") or spec.get("exclude_modules") or ())


def _kept(rule: Rule, schemes: tuple[Quantization, ...], ignored: list[str]) -> list[Rule]:
    """A ``Linear`` weight's rule as the tensors its scheme stores (``kept_tensors``): the
    codes transposed and stacked as the rule says, never split, merged, permuted or scaled
    (a scale group spans heads, and codes are not rescaled); their parameters stacked beside
    them. A module the release leaves unquantized, and every other rule, as it is."""
    if any(isinstance(s, MXFP4) for s in schemes):
        return _kept_experts(rule, schemes[0])
    linear = (isinstance(rule.stored, str) and rule.stored.endswith(".weight")
              and bool(rule.transpose or rule.split or rule.transpose_after))  # not a norm's or an embedding's
    if not linear:
        return [rule]
    example = re.sub(r"\{[^}]*\}", "0", rule.stored)  # a name the rule maps: the module's name's shape
    if _is_ignored(rule, example, ignored):
        return [rule]
    readers = [s for s in schemes if reads_module(s, example)]
    if not readers:
        return [rule]
    if len(readers) > 1:
        raise ArgumentError(f"{rule.stored!r} is read by two quantization schemes: {readers[0]} and {readers[1]}")
    return [Rule(name, rule.tree + suffix, transpose=(1, 0) if transposed else None, stack=rule.stack,
                 strided=rule.strided, only=rule.only)
            for name, suffix, transposed in readers[0].kept_tensors(rule.stored)]


def _kept_experts(rule: Rule, scheme: MXFP4) -> list[Rule]:
    """gpt-oss's MXFP4 experts (``mlp.experts.gate_up_proj``, ``down_proj``) as their blocks
    and exponents, as stored (``[experts, out, groups, 16]``), stacked over the layers; a rule
    that takes apart their twin (MaxText's ``wi_0``/``wi_1`` of the interleaved ``gate_up_proj``)
    cannot take apart the blocks and is refused. Other rules as they are."""
    if not isinstance(rule.stored, str) or not re.search(r"\.experts\.[^.]+_proj$", rule.stored):
        return [rule]
    if rule.take or rule.transpose or rule.split or rule.merge:
        raise ArgumentError(f"{rule.stored!r} → {rule.tree!r} rearranges gpt-oss's experts; their MXFP4 blocks "
                            "are kept only as stored (the Flax-style mapping): read them dequantized here")
    return [Rule(name, rule.tree + suffix, stack=rule.stack, strided=rule.strided, only=rule.only)
            for name, suffix, _ in scheme.kept_tensors(rule.stored)]


def _is_ignored(rule: Rule, example: str, ignored: list[str]) -> bool:
    """Whether ``ignored`` names a module of ``rule``'s weights (a name the rule maps, or a
    ``re:`` pattern or ``*`` wildcard matching the module name of ``example``, a weight it maps)."""
    example = example[:-len(".weight")]
    for entry in ignored:
        if entry.startswith("re:"):
            if re.match(entry[len("re:"):], example):
                return True
        elif "*" in entry:
            if fnmatch.fnmatchcase(example, entry):
                return True
        elif rule.maps_stored(entry + ".weight"):
            return True
    return False
