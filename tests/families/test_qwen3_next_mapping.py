"""Qwen3-Next's mappings (``ost.mappings.qwen3_next``, ``maxtext("qwen3-next", ...)``) against
transformers' own checkpoint of a tiny random ``Qwen3NextForCausalLM`` (bfloat16; 8 layers, two
blocks of 3 gated-delta-net layers then a gated full-attention one; 4 experts and a gated
shared expert on every layer).

Every leaf loaded into a float32 tree sharded over 8 devices equals the Hugging Face tensor
transformed by hand (transposed, heads split, the conv kernel reversed, experts stacked,
layers stacked by block and position, renamed; bfloat16 widens to float32 exactly), and the
tree saved back through the mapping is the very file ``save_pretrained`` wrote. MaxText's
forward over what ``maxtext("qwen3-next", ...)`` loads is
tests/families/test_maxtext_mapping.py's ``qwen3-next`` case. No JAX forward of the
Flax-style tree here: the gated delta net's chunked recurrence is not a few lines of JAX
(MaxText's forward checks the values instead).
"""

import re

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support.trees_by_hand import load_save_and_compare, outer_leaves, save_bfloat16_noisy, split_layers

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, tie_word_embeddings=False)
INTERVAL, LAYERS = 4, 8
# Hugging Face module -> MaxText's (tests/families/test_maxtext_mapping.py checks these against MaxText's tree).
MAXTEXT_NAMES = {
    "mlp.gate": "mlp.routed_experts.gate", "mlp.shared_expert.gate_proj": "mlp.shared_expert.wi_0",
    "mlp.shared_expert.up_proj": "mlp.shared_expert.wi_1", "mlp.shared_expert.down_proj": "mlp.shared_expert.wo",
    "linear_attn.norm": "attention.norm.rms_norm", "self_attn.q_proj": "attention.attention.query",
    "self_attn.k_proj": "attention.attention.key", "self_attn.v_proj": "attention.attention.value",
    "self_attn.o_proj": "attention.attention.out", "self_attn.q_norm": "attention.attention.query_norm",
    "self_attn.k_norm": "attention.attention.key_norm", "mlp.experts.gate_proj": "mlp.routed_experts.wi_0",
    "mlp.experts.up_proj": "mlp.routed_experts.wi_1", "mlp.experts.down_proj": "mlp.routed_experts.wo",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, config, {name: numpy tensor}) of the tiny bfloat16 Qwen3-Next."""
    directory = str(tmp_path_factory.mktemp("qwen3_next"))
    tensors = save_bfloat16_noisy(transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)), directory)
    return directory, transformers.AutoConfig.from_pretrained(directory), tensors


def _leaf(module: str, value: np.ndarray, config, maxtext: bool) -> np.ndarray:
    """A stored tensor as its leaf: ``Linear`` weights transposed, attention heads an axis
    (MaxText keeps the output projection flat), the conv kernel (C, 1, K) as (K, 1, C)."""
    if module.endswith("conv1d"):
        return value.transpose(2, 1, 0)
    if value.ndim != 2:
        return value
    kernel = value.T
    if module.endswith("q_proj"):
        return kernel.reshape(kernel.shape[0], config.num_attention_heads, -1)
    if module.endswith(("k_proj", "v_proj")):
        return kernel.reshape(kernel.shape[0], config.num_key_value_heads, -1)
    if module.endswith("o_proj") and not maxtext:
        return kernel.reshape(config.num_attention_heads, -1, kernel.shape[1])
    return kernel


def by_hand(tensors: dict, config, maxtext: bool) -> dict:
    """The unscanned tree of ``tensors`` (Flax-style, or MaxText's), spelled out tensor by tensor."""
    tree, experts = {}, {}
    root = "decoder.layers" if maxtext else "model.layers"
    for name, value in tensors.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight)?", name)
        if expert:
            i, e, proj = expert.groups()
            leaf = MAXTEXT_NAMES[f"mlp.experts.{proj}"] if maxtext else f"mlp.experts.{proj}.kernel"
            experts.setdefault(f"{root}_{i}.{leaf}", {})[int(e)] = value.T
        elif layer and name.startswith("model.layers."):
            i, module, weight = layer.groups()
            if weight is None:  # A_log, dt_bias
                leaf = module.replace("linear_attn.", "attention.") if maxtext else module
            else:
                named = MAXTEXT_NAMES.get(module, module.replace("linear_attn.", "attention.")) if maxtext else module
                leaf = f"{named}.{'scale' if module.endswith('norm') else 'kernel'}"
            tree[f"{root}_{i}.{leaf}"] = _leaf(module, value, config, maxtext)
    for leaf, stack in experts.items():
        tree[leaf] = np.stack([stack[e] for e in range(len(stack))])
    return tree | outer_leaves(tensors, maxtext)


def scan_by_hand(tree: dict, maxtext: bool) -> dict:
    """An unscanned tree scanned: layer ``4 * n + k`` at ``[n, k]`` of the linear layers' stack
    (``k < 3``) or at ``[n]`` of the full-attention layers' (layer axes first in the Flax-style
    tree; at 1 and 2 in MaxText's, after the experts of an expert leaf)."""
    names = ("decoder.layers.local_layers", "decoder.layers.global_layer") if maxtext else (
        "model.layers.linear", "model.layers.full")
    out, by_layer = split_layers(tree)
    stacks = {}
    for (_, i, leaf), value in by_layer.items():
        n, k = divmod(i, INTERVAL)
        full = k == INTERVAL - 1
        stacks.setdefault((f"{names[full]}.{leaf}", full), {})[n, 0 if full else k] = value
    for (name, full), by_place in stacks.items():
        blocks = LAYERS // INTERVAL
        grid = [[by_place[n, 0]] if full else [by_place[n, k] for k in range(INTERVAL - 1)] for n in range(blocks)]
        stacked = np.stack([np.stack(row) for row in grid])  # (blocks, per block, *leaf)
        stacked = stacked[:, 0] if full else stacked
        axes = 1 if full else 2
        if maxtext:  # layer axes at 1 (and 2); an expert leaf keeps its experts at 0
            stacked = np.moveaxis(stacked, range(axes), range(1, axes + 1))
        out[name] = stacked
    return out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_flax_style_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(checkpoint, tmp_path, scan_layers):
    directory, config, tensors = checkpoint
    mapping = ost.mappings.qwen3_next(config, scan_layers=scan_layers, dtype="bfloat16")
    assert ost.mappings.for_config(config, scan_layers=scan_layers, dtype="bfloat16").rules == mapping.rules
    assert ost.mappings.by_name("qwen3_next", config, scan_layers=scan_layers, dtype="bfloat16").rules == mapping.rules
    expected = by_hand(tensors, config, maxtext=False)
    load_save_and_compare(directory, mapping, scan_by_hand(expected, False) if scan_layers else expected,
                          str(tmp_path / "back"))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(checkpoint, tmp_path, scan_layers):
    directory, config, tensors = checkpoint
    mapping = ost.mappings.maxtext("qwen3-next-80b-a3b", config, scan_layers=scan_layers, dtype="bfloat16")
    assert mapping.checkpoint_form == "maxtext"
    expected = by_hand(tensors, config, maxtext=True)
    load_save_and_compare(directory, mapping, scan_by_hand(expected, True) if scan_layers else expected,
                          str(tmp_path / "back"))


def test_a_layer_pattern_mapping_cannot_express_is_refused(checkpoint):
    """Layer types other than (linear, ..., full) per interval, or a scanned tree of a part
    block, are refused naming the config field, not loaded into the wrong stacks."""
    _, config, _ = checkpoint
    swapped = {**config.to_dict(), "layer_types": ["full_attention"] + config.layer_types[1:]}
    with pytest.raises(ost.ArgumentError, match="layer_types"):
        ost.mappings.maxtext("qwen3-next", swapped, scan_layers=False)
    odd = {**config.to_dict(), "num_hidden_layers": 6, "layer_types": None}
    with pytest.raises(ost.ArgumentError, match="not a multiple of full_attention_interval"):
        ost.mappings.qwen3_next(odd, scan_layers=True)
    assert ost.mappings.qwen3_next(odd, scan_layers=False).rules  # unscanned: any whole number of layers


def test_an_fp8_release_reads_through_the_same_rules(checkpoint):
    """The FP8 releases' ``quantization_config`` (block FP8, ``weight_scale_inv``): the rules are
    the bfloat16 release's, read dequantized (or kept as FP8 with ``dequantize=False``)."""
    _, config, _ = checkpoint
    fp8 = {**config.to_dict(), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    for mapping in (ost.mappings.qwen3_next(fp8), ost.mappings.maxtext("qwen3-next", fp8, scan_layers=False)):
        assert mapping.quantization == ost.planning.quantization.FP8((128, 128))
    assert ost.mappings.qwen3_next(fp8).rules == ost.mappings.qwen3_next(config).rules
    kept = ost.mappings.qwen3_next(fp8, dequantize=False)
    assert kept.stored_name("model.layers_0.linear_attn.in_proj_qkvz.kernel_scale") == \
        "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"


def test_the_multi_token_prediction_tensors_are_left_out(checkpoint):
    """The release stores a multi-token-prediction layer under ``mtp.``: neither tree holds it
    (transformers skips it too)."""
    directory, config, _ = checkpoint
    stored = {n: t.shape for n, t in ost.metadata(directory).tensors.items()}
    extra = {"mtp.fc.weight": (64, 128), "mtp.layers.0.input_layernorm.weight": (64,), "mtp.norm.weight": (64,)}
    for mapping in (ost.mappings.qwen3_next(config), ost.mappings.maxtext("qwen3-next", config, scan_layers=True)):
        assert mapping.tree_shapes({**stored, **extra}) == mapping.tree_shapes(stored)


def test_a_stacked_within_takes_fewer_values_than_its_step():
    """``Strided(within, step, width=...)``: ``k`` in ``[0, width)``, ``width`` at most ``step``."""
    with pytest.raises(ost.MappingError, match="width"):
        ost.Strided("k", 4, width=5)
    rule = ost.Rule("model.layers.{i}.a.weight", "decoder.local.a.scale", stack={"i": 1, "k": 2},
                    strided={"i": ost.Strided("k", 4, stop=8, width=3)})
    mapping = ost.Mapping([rule])
    assert mapping.unmapped(["model.layers.3.a.weight", "model.layers.7.a.weight"], "stored") == [
        "model.layers.3.a.weight", "model.layers.7.a.weight"]  # the 4th of each block is not this leaf's
    pieces = mapping.assembly("decoder.local.a.scale", tree_shape=(5, 2, 3)).pieces
    assert [(p.stored, p.region[1:]) for p in pieces][3:5] == [
        ("model.layers.4.a.weight", ((1, 2), (0, 1))), ("model.layers.5.a.weight", ((1, 2), (1, 2)))]
