"""DeepSeek-V3's mappings (``ost.mappings.deepseek_v3``, ``maxtext("deepseek3", ...)``) against
transformers' own checkpoint of a tiny random ``DeepseekV3ForCausalLM`` (bfloat16; MLA with a
low-rank query, 1 dense layer, then 2 MoE layers with 8 routed experts, a router bias and a
shared expert: ``tests/support/hf_families.py``'s ``DEEPSEEK_V3``).

Every leaf loaded into a float32 tree sharded over 8 devices equals the Hugging Face tensor
transformed by hand (transposed, heads split, experts stacked, renamed; bfloat16 widens to
float32 exactly), and the tree saved back through the mapping is the very file
``save_pretrained`` wrote. MaxText's forward pass over what ``maxtext("deepseek3", ...)``
loads is tests/families/test_maxtext_mapping.py's ``deepseek3`` case.

DeepSeek-V2-Lite (``deepseek_v2``: one ``q_proj``, no router bias) and DeepSeek-V3.2
(``deepseek_v32``: each attention's indexer) go through the same checks, in both trees,
unscanned and scanned; their MaxText forwards are the ``deepseek2`` and ``deepseek3.2`` cases
there.
"""

import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

import orbax_safetensors as ost
from tests.support import hf_families
from tests.support.trees import flat, nest
from tests.support.trees_by_hand import load_save_and_compare, outer_leaves, sharded_like, split_layers

transformers = pytest.importorskip("transformers")

# Hugging Face module -> MaxText's (tests/families/test_maxtext_mapping.py checks these against MaxText's tree).
MAXTEXT_NAMES = {
    "input_layernorm": "pre_self_attention_layer_norm", "post_attention_layernorm": "post_self_attention_layer_norm",
    "self_attn.q_a_proj": "self_attention.wq_a", "self_attn.q_a_layernorm": "self_attention.q_norm",
    "self_attn.q_b_proj": "self_attention.wq_b", "self_attn.q_proj": "self_attention.query",
    "self_attn.kv_a_proj_with_mqa": "self_attention.wkv_a", "self_attn.kv_a_layernorm": "self_attention.kv_norm",
    "self_attn.kv_b_proj": "self_attention.wkv_b", "self_attn.o_proj": "self_attention.out",
    "mlp.gate_proj": "mlp.wi_0", "mlp.up_proj": "mlp.wi_1", "mlp.down_proj": "mlp.wo",
    "mlp.shared_experts.gate_proj": "DeepSeekMoeBlock_0.shared_experts.wi_0",
    "mlp.shared_experts.up_proj": "DeepSeekMoeBlock_0.shared_experts.wi_1",
    "mlp.shared_experts.down_proj": "DeepSeekMoeBlock_0.shared_experts.wo",
    "mlp.gate": "DeepSeekMoeBlock_0.MoeBlock_0.gate",
    **{f"self_attn.indexer.{m}": f"self_attention.indexer.{m}" for m in ("wq_b", "wk", "weights_proj", "k_norm")},
}
MAXTEXT_EXPERTS = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, config, {name: numpy tensor}) of the tiny bfloat16 DeepSeek-V3."""
    directory = str(tmp_path_factory.mktemp("deepseek_v3"))
    hf_families.tiny_model("deepseek_v3", directory, dtype="bfloat16")
    return directory, transformers.AutoConfig.from_pretrained(directory), load_file(
        os.path.join(directory, "model.safetensors"))


def _kernel(module: str, weight: np.ndarray, heads: int, index_heads: int | None = None) -> np.ndarray:
    """A ``Linear`` weight as its kernel: transposed, the heads of the MLA projections (and of
    V3.2's indexer query) an axis."""
    kernel = weight.T
    if module.endswith("indexer.wq_b"):
        return kernel.reshape(kernel.shape[0], index_heads, -1)
    if module.endswith(("q_b_proj", "q_proj", "kv_b_proj")):
        return kernel.reshape(kernel.shape[0], heads, -1)
    if module.endswith("o_proj"):
        return kernel.reshape(heads, -1, kernel.shape[1])
    return kernel


def flax_by_hand(tensors: dict, heads: int, index_heads: int | None = None) -> dict:
    """The Flax-style tree of ``tensors``, spelled out tensor by tensor (``index_heads``: V3.2's
    indexer's)."""
    tree, experts = {}, {}
    for name, value in tensors.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)", name)
        if expert:
            i, e, proj = expert.groups()
            experts.setdefault(f"model.layers_{i}.mlp.experts.{proj}.kernel", {})[int(e)] = value.T
        elif layer:
            i, module, kind = layer.groups()
            leaf = ("scale" if module.endswith("norm") else "kernel") if kind == "weight" else kind
            tree[f"model.layers_{i}.{module}.{leaf}"] = (
                value if leaf != "kernel" else _kernel(module, value, heads, index_heads))
    for leaf, stack in experts.items():
        tree[leaf] = np.stack([stack[e] for e in range(len(stack))])
    return tree | outer_leaves(tensors)


def maxtext_by_hand(flax_tree: dict, first_dense: int) -> dict:
    """MaxText's tree: the Flax-style one renamed, layer ``i`` the dense layer ``i`` or the MoE
    layer ``i - first_dense``."""
    outer = {"model.embed_tokens.embedding": "token_embedder.embedding",
             "model.norm.scale": "decoder.decoder_norm.scale", "lm_head.kernel": "decoder.logits_dense.kernel"}
    tree = {}
    for name, value in flax_tree.items():
        if name in outer:
            tree[outer[name]] = value
            continue
        i, module, leaf = re.fullmatch(r"model\.layers_(\d+)\.(.+)\.(\w+)", name).groups()
        block = f"dense_layers_{i}" if int(i) < first_dense else f"moe_layers_{int(i) - first_dense}"
        if module.startswith("mlp.experts."):
            mt = f"DeepSeekMoeBlock_0.MoeBlock_0.{MAXTEXT_EXPERTS[module.rsplit('.', 1)[1]]}"
        else:
            mt = f"{MAXTEXT_NAMES[module]}.{'bias' if leaf == 'e_score_correction_bias' else leaf}"
        tree[f"decoder.{block}.{mt}"] = value
    return tree


def test_flax_style_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(checkpoint, tmp_path):
    directory, config, tensors = checkpoint
    mapping = ost.mappings.deepseek_v3(config, dtype="bfloat16")
    assert ost.mappings.for_config(config, dtype="bfloat16").rules == mapping.rules
    assert ost.mappings.by_name("deepseek_v3", config, dtype="bfloat16").rules == mapping.rules
    assert mapping.quantization is None  # a bfloat16 release
    load_save_and_compare(directory, mapping, flax_by_hand(tensors, config.num_attention_heads),
                          str(tmp_path / "back"))


def test_maxtext_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(checkpoint, tmp_path):
    directory, config, tensors = checkpoint
    mapping = ost.mappings.maxtext("deepseek3-671b", config, scan_layers=False, dtype="bfloat16")
    assert mapping.checkpoint_form == "maxtext"
    expected = maxtext_by_hand(flax_by_hand(tensors, config.num_attention_heads), config.first_k_dense_replace)
    load_save_and_compare(directory, mapping, expected, str(tmp_path / "back"))


def test_without_a_low_rank_query_the_query_is_q_proj(checkpoint):
    """DeepSeek-V2-Lite's MLA (``q_lora_rank`` None): one ``q_proj``, no query norm."""
    _, config, _ = checkpoint
    config = {**config.to_dict(), "q_lora_rank": None}
    for mapping, query in ((ost.mappings.deepseek_v3(config), "model.layers_0.self_attn.q_proj.kernel"),
                           (ost.mappings.maxtext("deepseek3", config, scan_layers=False),
                            "decoder.dense_layers_0.self_attention.query.kernel")):
        assert mapping.stored_name(query) == "model.layers.0.self_attn.q_proj.weight"
        assert not [r for r in mapping.rules if "q_a_" in r.stored_patterns[0] or "q_b_" in r.stored_patterns[0]]
        assert mapping.transform(query, stored_shape=(4 * 24, 64)).tree_shape == (64, 4, 24)


def test_the_prediction_layer_after_the_last_is_left_out(checkpoint):
    """DeepSeek-V3 stores its multi-token-prediction layer as ``model.layers.61.`` (one past the
    last): neither tree holds it (transformers skips it too)."""
    directory, config, _ = checkpoint
    config = {**config.to_dict(), "num_nextn_predict_layers": 1}
    stored = {n: t.shape for n, t in ost.metadata(directory).tensors.items()}
    extra = {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.self_attn.q_a_proj.weight": (24, 64)}
    for mapping in (ost.mappings.deepseek_v3(config), ost.mappings.maxtext("deepseek3", config, scan_layers=False)):
        assert mapping.tree_shapes({**stored, **extra}) == mapping.tree_shapes(stored)


def test_an_fp8_release_reads_through_the_same_rules(checkpoint):
    """DeepSeek-V3's own ``quantization_config``: the rules are the bfloat16 release's, read
    dequantized (or kept as FP8 with ``dequantize=False``)."""
    _, config, _ = checkpoint
    fp8 = {**config.to_dict(), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    plain = ost.mappings.deepseek_v3(config)
    for mapping in (ost.mappings.deepseek_v3(fp8), ost.mappings.maxtext("deepseek3", fp8, scan_layers=False)):
        assert mapping.quantization == ost.planning.quantization.FP8((128, 128))
    assert ost.mappings.deepseek_v3(fp8).rules == plain.rules
    kept = ost.mappings.deepseek_v3(fp8, dequantize=False)
    assert kept.stored_name("model.layers_0.self_attn.q_b_proj.kernel_scale") == \
        "model.layers.0.self_attn.q_b_proj.weight_scale_inv"


def scan_by_hand(tree: dict, first_dense: int, axis: int) -> dict:
    """A tree with each layer under its own name (``model.layers_{i}``, or MaxText's
    ``decoder.{dense,moe}_layers_{k}``) scanned: dense and MoE layers stacked apart at ``axis``."""
    out, by_layer = split_layers(tree, r"(?:model|decoder)\.(?:layers|dense_layers|moe_layers)")
    stacks = {}
    for (root, k, leaf), value in by_layer.items():
        root, block = root.rsplit(".", 1)
        if block == "layers":
            block, k = ("dense_layers", k) if k < first_dense else ("moe_layers", k - first_dense)
        stacks.setdefault(f"{root}.{block}.{leaf}", {})[k] = value
    out.update((name, np.stack([layers[k] for k in range(len(layers))], 0 if name.endswith("gate.bias") else axis))
               for name, layers in stacks.items())  # MaxText's router bias (MoEBiasVar) is scanned at axis 0
    return out


@pytest.mark.parametrize("tree", ["flax", "maxtext"])
def test_scanned_trees_stack_dense_and_moe_layers_apart(checkpoint, tmp_path, tree):
    """Scanned, the dense layers are one stack and the MoE layers another, whose index ``n`` is
    layer ``first_k_dense_replace + n`` (layers at axis 0 here, at 1 in MaxText's tree)."""
    directory, config, tensors = checkpoint
    flax_tree, first = flax_by_hand(tensors, config.num_attention_heads), config.first_k_dense_replace
    if tree == "flax":
        mapping = ost.mappings.deepseek_v3(config, scan_layers=True, dtype="bfloat16")
        expected = scan_by_hand(flax_tree, first, axis=0)
    else:
        mapping = ost.mappings.maxtext("deepseek3", config, dtype="bfloat16")
        expected = scan_by_hand(maxtext_by_hand(flax_tree, first), first, axis=1)
    load_save_and_compare(directory, mapping, expected, str(tmp_path / "back"))


def test_scanned_trees_need_the_config():
    with pytest.raises(ost.ArgumentError, match="config is None"):
        ost.mappings.deepseek_v3(None, scan_layers=True)


def test_maxtext_needs_the_config():
    with pytest.raises(ost.ArgumentError, match="config is None"):
        ost.mappings.maxtext("deepseek3", None, scan_layers=False)


@pytest.mark.parametrize("tree", ["flax", "maxtext"])
def test_fp8_release_reads_as_its_dequantized_twin(checkpoint, tmp_path, tree):
    """DeepSeek-V3's FP8 release (every attention and MLP weight F8_E4M3 with a float32
    ``weight_scale_inv`` per 128 × 128 block; embeddings, norms, router and head as they are):
    each leaf, sharded over 8 devices, is what the twin (``tests/support/quantized_reference.py``'s
    float32 dequantization, saved as a float32 release) gives through the plain mapping."""
    from tests.support.quantized_reference import fp8_reference, random_fp8

    directory, config, tensors = checkpoint
    rng, release, twin = np.random.default_rng(0), {}, {}
    for name, value in tensors.items():
        linear = name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")
        if linear:
            values, scales = random_fp8(rng, value.shape, tuple(-(-n // 128) for n in value.shape))
            release[name], release[name + "_scale_inv"] = values, scales
            twin[name] = fp8_reference(values, scales, (128, 128))
        else:
            release[name], twin[name] = value, value.astype(np.float32)
    ost.save(str(tmp_path / "fp8"), release)
    ost.save(str(tmp_path / "twin"), twin)
    fp8 = {**config.to_dict(), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    make = ((lambda c: ost.mappings.deepseek_v3(c, scan_layers=True)) if tree == "flax"
            else (lambda c: ost.mappings.maxtext("deepseek3", c)))
    expected = flat(ost.load(str(tmp_path / "twin"), mapping=make(config), nest=True))
    target = sharded_like(expected)
    params = flat(ost.load(str(tmp_path / "fp8"), nest(target), mapping=make(fp8), strict=True))
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert params[name].sharding == target[name].sharding, name
        np.testing.assert_array_equal(np.asarray(params[name]), value, err_msg=name)


# model_type -> MaxText's family: the other DeepSeek versions, through the same rules.
VERSIONS = {"deepseek_v2": "deepseek2", "deepseek_v32": "deepseek3.2"}


@pytest.fixture(scope="module", params=list(VERSIONS))
def version_checkpoint(request, tmp_path_factory):
    """(directory, config, {name: numpy tensor}) of a tiny bfloat16 DeepSeek-V2-Lite (one q_proj,
    no router bias) or DeepSeek-V3.2 (V3's and each attention's indexer)."""
    directory = str(tmp_path_factory.mktemp(request.param))
    hf_families.tiny_model(request.param, directory, dtype="bfloat16")
    return directory, transformers.AutoConfig.from_pretrained(directory), load_file(
        os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("tree", ["flax", "flax-scanned", "maxtext", "maxtext-scanned"])
def test_v2_and_v32_trees_are_their_checkpoints_by_hand_and_save_back_the_same_file(version_checkpoint, tmp_path,
                                                                                   tree):
    """V2 has no ``e_score_correction_bias`` (nor, V2-Lite, ``q_a_proj``/``q_b_proj``); V3.2's
    indexer is ``self_attn.indexer.*`` (MaxText: ``self_attention.indexer.*``), its query's heads
    an axis: each leaf, sharded over 8 devices, is the tensor by hand; the tree saves back the very
    file, unscanned and scanned."""
    directory, config, tensors = version_checkpoint
    assert any("e_score_correction_bias" in n for n in tensors) == (config.model_type == "deepseek_v32")
    assert any(".indexer." in n for n in tensors) == (config.model_type == "deepseek_v32")
    first = config.first_k_dense_replace
    flax_tree = flax_by_hand(tensors, config.num_attention_heads, getattr(config, "index_n_heads", None))
    flax_mapping = getattr(ost.mappings, config.model_type)
    mapping, expected = {
        "flax": (flax_mapping(config, dtype="bfloat16"), flax_tree),
        "flax-scanned": (flax_mapping(config, scan_layers=True, dtype="bfloat16"), scan_by_hand(flax_tree, first, 0)),
        "maxtext": (ost.mappings.maxtext(VERSIONS[config.model_type], config, scan_layers=False, dtype="bfloat16"),
                    maxtext_by_hand(flax_tree, first)),
        "maxtext-scanned": (ost.mappings.maxtext(VERSIONS[config.model_type], config, dtype="bfloat16"),
                            scan_by_hand(maxtext_by_hand(flax_tree, first), first, 1)),
    }[tree]
    if tree == "flax":
        assert ost.mappings.for_config(config, dtype="bfloat16").rules == mapping.rules
        assert ost.mappings.by_name(config.model_type, config, dtype="bfloat16").rules == mapping.rules
    load_save_and_compare(directory, mapping, expected, str(tmp_path / "back"))


def test_v32_without_a_config_names_the_indexer_sizes():
    with pytest.raises(ost.ArgumentError, match="index_n_heads, index_head_dim"):
        ost.mappings.maxtext("deepseek3.2", {**hf_families.DEEPSEEK_V3, "num_attention_heads": 4, "v_head_dim": 12},
                             scan_layers=False)
