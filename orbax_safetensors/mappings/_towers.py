"""A multimodal release's parts beside its text decoder: where the decoder's config is, and the
towers (vision, audio) a Flax-style mapping passes through as stored.

A mapping names every stored tensor or refuses the checkpoint, and every rule must find a tensor
for a conversion to proceed; one that mapped only the text decoder of Qwen3-VL or Qwen3-Omni
would refuse a load without a target. Passed through, each tower tensor is a leaf of its own
stored name, unchanged: a load without a target keeps it and a save writes it back; a target
without the towers (a text model) leaves them unread with ``strict="target"``. Placeholders match
one dotted segment, so a tower's rules are one per depth of its names (the segments below its
prefix), each depth one its modules have (transformers' ``modeling_qwen3_vl``,
``modeling_qwen3_omni_moe``): a rule no name matches would stop ``ost.convert``.
"""

from __future__ import annotations

from typing import Any

from orbax_safetensors.mappings._config import config_value
from orbax_safetensors.planning.rules import Rule

# Qwen3-VL's vision tower: pos_embed.weight (2), patch_embed.proj.*, merger.norm.* (3),
# blocks.{i}.norm1.*, deepstack_merger_list.{k}.norm.* (4), blocks.{i}.attn.qkv.* (5).
QWEN3_VL = {"model.visual.": (2, 3, 4, 5)}
# Qwen3-Omni's thinker: its vision tower (merger.ln_q.*, merger.mlp.0.*, merger_list.{k}.mlp.0.*,
# blocks.{i}.*: 2 to 5) and audio tower (conv2d1.*, ln_post.*, proj1.* (2), layers.{i}.fc1.* (4),
# layers.{i}.self_attn.q_proj.* (5)).
QWEN3_OMNI = {"thinker.visual.": (2, 3, 4, 5), "thinker.audio_tower.": (2, 4, 5)}


def passed_through(towers: dict[str, tuple[int, ...]], dtype: Any = None) -> list[Rule]:
    """Every stored tensor under each prefix of ``towers`` (prefix: the depths of its names) as the
    tree leaf of the same name, unchanged but for the ``dtype`` a save writes."""
    return [Rule(prefix + name, prefix + name, dtype=dtype) for prefix, depths in towers.items()
            for name in (".".join(f"{{t{k}}}" for k in range(depth)) for depth in depths)]


def text_config(config: Any, keys: tuple[str, ...]) -> Any:
    """The text decoder's config, ``config[keys[0]][keys[1]]…`` (``None`` where one is absent)."""
    for key in keys:
        config = config_value(config, key) if config is not None else None
    return config
