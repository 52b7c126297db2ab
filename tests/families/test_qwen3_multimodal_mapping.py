"""``ost.mappings.qwen3_vl`` and ``qwen3_omni_moe``: a multimodal release's text decoder in a
Flax-style tree, its towers passed through.

Tiny random ``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration`` (its
experts rewritten in the release's fused layout) and ``Qwen3OmniMoeForConditionalGeneration``
(thinker only: no talker) checkpoints, those of ``tests/families/test_maxtext_mapping.py``, loaded
sharded over 8 CPU devices: every leaf equals the stored tensor transformed by hand, a JAX forward
of the text decoder (``tests/support/hf_families.py``; text tokens only, where MRoPE is the
default RoPE) gives transformers' logits, and a save writes back every tensor byte for byte, the
towers' too, as does ``ost.convert`` to Orbax and back. A target without the towers (a text model)
is refused unless the load says it leaves them unread (``strict="target"``). ``ost.mappings.maxtext``
leaves them out instead (MaxText's text tree has no place for them): checked here on the same
checkpoints, MaxText itself in ``test_maxtext_mapping.py``.
"""

from __future__ import annotations

import os
import re
import types

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import orbax_safetensors as ost
from tests.families.test_maxtext_mapping import QWEN3_VL_MOE, write_checkpoint
from tests.families.test_model_families import _sharded
from tests.support import hf_families
from tests.support.tolerances import assert_within, causal_lm_reference
from tests.support.trees import flat, nest
from tests.support.trees_by_hand import split_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# case (test_maxtext_mapping's) -> (mapping, transformers class, the part that has logits, text
# config keys, text prefix, head, towers)
CASES = {
    "qwen3-vl": (ost.mappings.qwen3_vl, "Qwen3VLForConditionalGeneration", None, ("text_config",),
                 "model.language_model.", "lm_head", ("model.visual.",)),
    "qwen3-vl-moe": (ost.mappings.qwen3_vl, "Qwen3VLMoeForConditionalGeneration", None, ("text_config",),
                     "model.language_model.", "lm_head", ("model.visual.",)),
    "qwen3-omni": (ost.mappings.qwen3_omni_moe, "Qwen3OmniMoeForConditionalGeneration", "thinker",
                   ("thinker_config", "text_config"), "thinker.model.", "thinker.lm_head",
                   ("thinker.visual.", "thinker.audio_tower.")),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(case, directory, release config, text config, stored tensors, (logits, atol))."""
    name = request.param
    directory = write_checkpoint(name, str(tmp_path_factory.mktemp(name)))
    _, model_class, part, keys, *_ = CASES[name]
    model = getattr(transformers, model_class).from_pretrained(directory, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    model = getattr(model, part) if part else model
    config = transformers.AutoConfig.from_pretrained(directory)
    text = config
    for key in keys:
        text = getattr(text, key)
    return (name, directory, config, text, load_file(os.path.join(directory, "model.safetensors")),
            causal_lm_reference(model, hf_families.TOKENS))


def by_hand(case: str, stored: dict, text, scan_layers: bool) -> dict:
    """The tree the mapping must make of ``stored``, written out: kernels transposed, attention
    heads split, experts stacked (one by one) or as stored (fused), layers stacked when scanned,
    towers as stored."""
    _, _, _, _, prefix, head, towers = CASES[case]
    heads, kv_heads, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    tree, experts = {}, {}
    for name, t in stored.items():
        if name.startswith(towers):
            tree[name] = t
        elif name == f"{head}.weight":
            tree[f"{head}.kernel"] = t.T
        elif name == f"{prefix}embed_tokens.weight":
            tree[f"{prefix}embed_tokens.embedding"] = t
        elif name == f"{prefix}norm.weight":
            tree[f"{prefix}norm.scale"] = t
        else:
            i, module = name.removeprefix(f"{prefix}layers.").split(".", 1)
            layer = f"{prefix}layers_{i}."
            if module.endswith("norm.weight"):
                tree[layer + module.removesuffix("weight") + "scale"] = t
            elif module.startswith("self_attn."):
                proj = module.split(".")[1]
                shape = {"q_proj": (-1, heads, head_dim), "o_proj": (heads, head_dim, -1)}.get(
                    proj, (-1, kv_heads, head_dim))
                tree[f"{layer}self_attn.{proj}.kernel"] = t.T.reshape(shape)
            elif module in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused: as stored
                tree[f"{layer}{module}.kernel"] = t
            elif module.startswith("mlp.experts."):  # mlp.experts.{e}.{proj}.weight
                _, _, e, proj, _ = module.split(".")
                experts.setdefault(f"{layer}mlp.experts.{proj}.kernel", {})[int(e)] = t.T
            else:
                tree[layer + module.removesuffix("weight") + "kernel"] = t.T
    tree.update({leaf: np.stack([by_e[e] for e in sorted(by_e)]) for leaf, by_e in experts.items()})
    if not scan_layers:
        return tree
    scanned, by_layer = split_layers(tree, re.escape(f"{prefix}layers"))
    layers = {}
    for (root, i, rest), t in by_layer.items():
        layers.setdefault(f"{root}.{rest}", {})[i] = t
    scanned.update({leaf: np.stack([by_i[i] for i in sorted(by_i)]) for leaf, by_i in layers.items()})
    return scanned


def _forward(case: str, text, params: dict, scan_layers: bool) -> np.ndarray:
    """hf_families' Qwen3 / Qwen3-MoE forward on the text decoder's leaves (fused experts split
    into its per-expert leaves: gate then up halves)."""
    _, _, _, _, prefix, head, _ = CASES[case]
    tree = flat(params)
    decoder = {name.removeprefix(prefix): leaf for name, leaf in tree.items() if name.startswith(prefix)}
    for name in [n for n in decoder if n.endswith("mlp.experts.gate_up_proj.kernel")]:
        gate, up = np.split(np.asarray(decoder.pop(name)), 2, axis=-1)
        decoder[name.replace("gate_up_proj", "gate_proj")], decoder[name.replace("gate_up_proj", "up_proj")] = gate, up
    model = {"model": nest(decoder), **({"lm_head": {"kernel": tree[f"{head}.kernel"]}}
                                        if f"{head}.kernel" in tree else {})}  # absent: tied
    moe = (getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0) > 1
    config = types.SimpleNamespace(**{**text.to_dict(), "norm_topk_prob": True, "sliding_window": None,
                                      "layer_types": ["full_attention"] * text.num_hidden_layers})
    return np.asarray(hf_families.forward("qwen3_moe" if moe else "qwen3", config, model, hf_families.TOKENS,
                                          scan_layers=scan_layers))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_text_decoder_loads_sharded_as_written_by_hand_and_saves_back_every_tensor(case, scan_layers, tmp_path):
    name, directory, config, text, stored, (reference, atol) = case
    mapping = CASES[name][0](config, scan_layers=scan_layers)
    assert ost.mappings.for_config(config, scan_layers=scan_layers).rules == mapping.rules
    expected = by_hand(name, stored, text, scan_layers)
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(directory).tensors.items()})
    assert shapes == {leaf: t.shape for leaf, t in expected.items()}
    target = _sharded(shapes)
    stats = ost.LoadStats()
    params = ost.load(directory, nest(target), mapping=mapping, stats=stats,
                      options=ost.LoadOptions(max_gap=0, max_overread=1.0))
    assert stats.bytes_read == stats.bytes_needed
    for leaf, value in flat(params).items():
        assert value.sharding == target[leaf].sharding, leaf
        np.testing.assert_array_equal(np.asarray(value), expected[leaf], err_msg=leaf)
    assert np.abs(reference).max() > 1.0  # large enough for a wrong layout to show
    assert_within(_forward(name, text, params, scan_layers), reference, atol, f"{name} logits")
    ost.save(str(tmp_path / "back"), params, mapping=mapping, checksums=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(stored)
    assert all(back[n].dtype == t.dtype and back[n].tobytes() == t.tobytes() for n, t in stored.items())


def test_a_load_without_a_target_keeps_the_towers_as_stored(case):
    name, directory, config, _, stored, _ = case
    towers = CASES[name][-1]
    tree = flat(ost.load(directory, mapping=CASES[name][0](config)))
    kept = {n: t for n, t in stored.items() if n.startswith(towers)}
    assert kept and {n for n in tree if n.startswith(towers)} == set(kept)
    assert all(np.array_equal(np.asarray(tree[n]), t) for n, t in kept.items())


def test_a_text_target_leaves_the_towers_unread_only_when_told(case):
    name, directory, config, _, stored, _ = case
    towers = CASES[name][-1]
    mapping = CASES[name][0](config)
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(directory).tensors.items()})
    text = nest({n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items() if not n.startswith(towers)})
    with pytest.raises(ost.SafetensorsError, match="in the checkpoint but not the target: "
                       + re.escape(min(n for n in stored if n.startswith(towers)))):
        ost.load(directory, text, mapping=mapping)
    loaded = flat(ost.load(directory, text, mapping=mapping, strict="target"))
    assert set(loaded) == set(flat(text)) and not any(n.startswith(towers) for n in loaded)


def test_transformers_own_expert_layout_is_refused_by_the_sizes(tmp_path):
    """transformers' save_pretrained of a Qwen3-VL-MoE it made writes the experts as it holds them,
    ``[experts, 2 * mlp, hidden]`` and ``[experts, hidden, mlp]``, not as the release stores them:
    a mapping of the release's layout names the size that does not fit."""
    config = transformers.Qwen3VLMoeConfig(**QWEN3_VL_MOE)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ost.MappingError, match="moe_intermediate_size is 24.*mlp.experts.down_proj"):
        ost.load(str(tmp_path), mapping=ost.mappings.qwen3_vl(config))


def test_a_conversion_to_orbax_and_back_gives_every_tensor_back(case, tmp_path):
    """Each tower rule (one per depth of its names) finds tensors, so ``ost.convert`` proceeds."""
    name, directory, config, _, stored, _ = case
    mapping = CASES[name][0](config, scan_layers=True)
    ost.convert(directory, tmp_path / "orbax", mapping=mapping)
    ost.convert(tmp_path / "orbax", tmp_path / "hf", mapping=mapping)
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(back) == set(stored) and all(back[n].tobytes() == t.tobytes() for n, t in stored.items())


def test_maxtexts_mapping_leaves_the_towers_out(case):
    """MaxText's text model (use_multimodal off) holds no tower, nor does its converter write one:
    ``ost.mappings.maxtext`` names them as left out (``Mapping.ignore``), and a load without a
    target makes MaxText's text tree alone."""
    name, directory, config, _, stored, _ = case
    family = {"qwen3_vl": "qwen3-vl", "qwen3_omni_moe": "qwen3-omni"}[CASES[name][0].__name__]
    mapping = ost.mappings.maxtext(family, config)
    assert set(CASES[name][-1]) <= set(mapping.ignore)
    assert {n.split(".")[0] for n in flat(ost.load(directory, mapping=mapping))} == {"token_embedder", "decoder"}
