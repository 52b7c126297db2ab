"""Qwen3.5's text-decoder mapping (``ost.mappings.qwen3_5``) against transformers' own checkpoints
of tiny random models (bfloat16; 8 layers, two blocks of 3 gated-delta-net layers then a gated
full-attention one): ``Qwen3_5MoeForCausalLM`` (4 experts and a gated shared expert per layer),
the multimodal ``Qwen3_5MoeForConditionalGeneration`` (text under ``model.language_model.``, a
one-block vision tower the mapping leaves out), the releases' fused experts (one
``gate_up_proj`` and one ``down_proj`` per layer, written here from transformers' per-expert
tensors) and the dense ``Qwen3_5ForCausalLM``.

Every leaf loaded into a float32 tree sharded over 8 devices equals the Hugging Face tensor
transformed by hand (tests/families/test_qwen3_next_mapping.py's helpers: Qwen3.5's layers are
Qwen3-Next's but for the gated delta net's four input projections, kept apart as stored), and
the tree saved back through the mapping is the very file ``save_pretrained`` wrote (for the
multimodal model, its text tensors). MaxText's tree (``maxtext("qwen3.5", ...)``) from the
release's form equals MaxText's converter's hooks redone by hand, and saves back the release's
tensors (each stored tensor written from all the leaves that take parts of it). No JAX
forward: see test_qwen3_next_mapping.py (MaxText's forward is test_maxtext_mapping.py's
``qwen3.5`` case).
"""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import orbax_safetensors as ost
from tests.families.test_qwen3_next_mapping import by_hand, scan_by_hand
from tests.families.test_model_families import _sharded
from tests.support.trees import flat, nest
from tests.support.trees_by_hand import load_save_and_compare, save_bfloat16_noisy, split_layers

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TEXT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)
DENSE = {**{k: v for k, v in TEXT.items() if "expert" not in k}, "intermediate_size": 64}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_5_moe_text"))
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT))
    tensors = save_bfloat16_noisy(model, directory)
    return directory, transformers.AutoConfig.from_pretrained(directory), tensors


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_text_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(moe, tmp_path, scan_layers):
    directory, config, tensors = moe
    assert config.model_type == "qwen3_5_moe_text"
    mapping = ost.mappings.qwen3_5(config, scan_layers=scan_layers, dtype="bfloat16")
    assert ost.mappings.for_config(config, scan_layers=scan_layers, dtype="bfloat16").rules == mapping.rules
    assert ost.mappings.by_name("qwen3_5", config, scan_layers=scan_layers, dtype="bfloat16").rules == mapping.rules
    expected = by_hand(tensors, config, maxtext=False)
    assert "model.layers_0.linear_attn.in_proj_qkv.kernel" in expected  # apart, as stored
    load_save_and_compare(directory, mapping, scan_by_hand(expected, False) if scan_layers else expected,
                          str(tmp_path / "back"))


def test_the_releases_fused_experts_are_one_leaf_each(moe, tmp_path):
    """The releases store each layer's experts fused: ``gate_up_proj`` (experts, 2 * mlp,
    hidden), gate rows first, and ``down_proj`` (experts, hidden, mlp); ``fused_experts=True``
    reads each as one leaf, transposed, and writes them back as they were."""
    _, config, tensors = moe
    fused, experts = {}, config.num_experts
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = value
        elif name.endswith(".experts.0.gate_proj.weight"):
            layer = name.split(".mlp.")[0]
            stack = {p: np.stack([tensors[f"{layer}.mlp.experts.{e}.{p}.weight"] for e in range(experts)])
                     for p in ("gate_proj", "up_proj", "down_proj")}
            fused[f"{layer}.mlp.experts.gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], 1)
            fused[f"{layer}.mlp.experts.down_proj"] = stack["down_proj"]
    directory = tmp_path / "fused"
    directory.mkdir()
    save_file(fused, str(directory / "model.safetensors"), metadata={"format": "pt"})
    expected = by_hand(tensors, config, maxtext=False)
    for i in range(config.num_hidden_layers):
        experts_of = f"model.layers_{i}.mlp.experts"
        expected[f"{experts_of}.gate_up_proj.kernel"] = np.concatenate(
            [expected.pop(f"{experts_of}.gate_proj.kernel"), expected.pop(f"{experts_of}.up_proj.kernel")], -1)
    mapping = ost.mappings.qwen3_5(config, dtype="bfloat16", fused_experts=True)
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(str(directory)).tensors.items()})
    assert shapes == {name: value.shape for name, value in expected.items()}
    params = ost.load(str(directory), nest(_sharded(shapes)), mapping=mapping)
    for name, leaf in flat(params).items():
        np.testing.assert_array_equal(np.asarray(leaf), expected[name].astype(np.float32), err_msg=name)
    ost.save(str(tmp_path / "back"), params, mapping=mapping, checksums=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == fused.keys()
    for name, value in fused.items():
        assert back[name].tobytes() == value.tobytes(), name


def test_multimodal_text_tensors_under_language_model_and_the_vision_tower_left_out(tmp_path):
    directory = str(tmp_path / "vl")
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION))
    tensors = save_bfloat16_noisy(model, directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    assert any(name.startswith("model.visual.") for name in tensors)
    text = {name.replace("model.language_model.", "model.", 1): value for name, value in tensors.items()
            if not name.startswith("model.visual.")}
    expected = by_hand(text, config.text_config, maxtext=False)
    mapping = ost.mappings.for_config(config, dtype="bfloat16")
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(directory).tensors.items()})
    assert shapes == {name: value.shape for name, value in expected.items()}
    params = ost.load(directory, nest(_sharded(shapes)), mapping=mapping)
    for name, leaf in flat(params).items():
        np.testing.assert_array_equal(np.asarray(leaf), expected[name].astype(np.float32), err_msg=name)
    ost.save(str(tmp_path / "back"), params, mapping=mapping, checksums=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == {name for name in tensors if not name.startswith("model.visual.")}
    for name, value in back.items():
        assert value.tobytes() == tensors[name].tobytes(), name


def test_dense_model_has_a_plain_mlp(tmp_path):
    directory = str(tmp_path / "dense")
    tensors = save_bfloat16_noisy(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**DENSE)), directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    mapping = ost.mappings.for_config(config, dtype="bfloat16")
    expected = by_hand(tensors, config, maxtext=False)
    assert "model.layers_0.mlp.gate_proj.kernel" in expected
    load_save_and_compare(directory, mapping, expected, str(tmp_path / "back"))


def _release(tensors: dict) -> dict:
    """transformers' per-expert tensors as the releases store them, fused per layer."""
    from tests.families.test_maxtext_mapping import fused_experts

    return fused_experts(tensors)


def maxtext_by_hand(tensors: dict, config) -> dict:
    """MaxText's unscanned tree of the per-expert ``tensors``, as its converter's hooks make it:
    ``in_proj_qkvz`` key head by key head (that head's q, k, v rows of ``in_proj_qkv``, then its
    ``in_proj_z`` rows), ``in_proj_ba`` likewise, all transposed (``concat_qkvz_and_transpose``,
    ``concat_ba_and_transpose``)."""
    tree = by_hand(tensors, config, maxtext=True)
    heads, group = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    key_dim = config.linear_key_head_dim
    for i in range(config.num_hidden_layers):
        layer = f"decoder.layers_{i}.attention"
        if f"{layer}.in_proj_qkv.kernel" not in tree:
            continue
        qkv, z = tree.pop(f"{layer}.in_proj_qkv.kernel").T, tree.pop(f"{layer}.in_proj_z.kernel").T
        q, k, v = np.split(qkv, [heads * key_dim, 2 * heads * key_dim])
        parts = [x.reshape(heads, -1, x.shape[-1]) for x in (q, k, v, z)]
        tree[f"{layer}.in_proj_qkvz.kernel"] = np.concatenate(parts, 1).reshape(-1, qkv.shape[-1]).T
        b, a = tree.pop(f"{layer}.in_proj_b.kernel").T, tree.pop(f"{layer}.in_proj_a.kernel").T
        parts = [x.reshape(heads, group, -1) for x in (b, a)]
        tree[f"{layer}.in_proj_ba.kernel"] = np.concatenate(parts, 1).reshape(-1, b.shape[-1]).T
    return tree


def maxtext_scan_by_hand(tree: dict, interval: int) -> dict:
    """MaxText's scanned Qwen3.5 tree: layer ``4 * n + k`` at index ``n`` (axis 1; experts at 0)
    of ``decoder.layers.layer_{k}``."""
    out, by_layer = split_layers(tree, r"decoder\.layers")
    stacks = {}
    for (_, i, leaf), value in by_layer.items():
        n, k = divmod(i, interval)
        stacks.setdefault(f"decoder.layers.layer_{k}.{leaf}", {})[n] = value
    for name, by_n in stacks.items():
        stacked = np.stack([by_n[n] for n in range(len(by_n))])
        out[name] = np.moveaxis(stacked, 0, 1) if stacked.ndim > 2 else stacked.T
    return out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_tree_is_the_release_by_hand_and_saves_it_back(moe, tmp_path, scan_layers):
    """MaxText's ``qwen3.5-*`` tree from the release's form (experts fused), each device reading its
    own slices; saved through the mapping, the release's tensors byte for byte (its ``in_proj_qkvz``,
    ``in_proj_ba`` and ``wi_0``/``wi_1`` are parts of stored tensors: each is written from all of
    its parts' leaves)."""
    _, config, tensors = moe
    directory = tmp_path / "release"
    directory.mkdir()
    save_file(_release(tensors), str(directory / "model.safetensors"), metadata={"format": "pt"})
    expected = maxtext_by_hand(tensors, config)
    if scan_layers:
        expected = maxtext_scan_by_hand(expected, 4)
    mapping = ost.mappings.maxtext("qwen3.5-35b-a3b", config, scan_layers=scan_layers, dtype="bfloat16")
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(str(directory)).tensors.items()})
    assert shapes == {name: value.shape for name, value in expected.items()}
    target = _sharded(shapes)
    stats = ost.LoadStats()
    params = ost.load(str(directory), nest(target), mapping=mapping, stats=stats)
    for name, leaf in flat(params).items():
        np.testing.assert_array_equal(np.asarray(leaf), expected[name].astype(np.float32), err_msg=name)
    ost.save(str(tmp_path / "back"), params, mapping=mapping)
    back, release = load_file(str(tmp_path / "back" / "model.safetensors")), _release(tensors)
    assert set(back) == {name for name in release if not mapping.ignores(name)}
    for name, value in back.items():
        assert value.dtype == release[name].dtype and value.tobytes() == release[name].tobytes(), name


def test_maxtext_fp8_releases_store_experts_one_tensor_each(moe):
    """The ``-fp8`` releases store one (block FP8) tensor per expert, as MaxText's converter reads
    them (its ``is_quantized`` tables): with a ``quantization_config`` the experts are stacked."""
    _, config, _ = moe
    fp8 = {**config.to_dict(), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    mapping = ost.mappings.maxtext("qwen3.5-35b-a3b-fp8", fp8, scan_layers=False)
    assert mapping.quantization == ost.planning.quantization.FP8((128, 128))
    assert mapping.tree_names("model.layers.0.mlp.experts.3.up_proj.weight") == [
        "decoder.layers_0.mlp.routed_experts.wi_1"]
    assert mapping.unmapped(["model.layers.0.mlp.experts.gate_up_proj"], "stored")


def test_an_ordered_rule_is_checked_where_it_is_made():
    """``Rule.order`` interleaves ``chunk``-wide slices of concatenated patterns: it needs the
    concat, a chunk, slices of its own patterns, and no reshape of its own."""
    stored = ("model.layers.{i}.a.weight", "model.layers.{i}.b.weight")
    ost.Rule(stored, "decoder.layers_{i}.ab.kernel", transpose=(1, 0), concat={1: (4, 4)}, order=((0, 0), (1, 0)),
             chunk=4)
    for bad in (dict(concat={}), dict(chunk=None), dict(order=((2, 0),)), dict(split={1: (2, -1)})):
        arguments = dict(transpose=(1, 0), concat={1: (4, 4)}, order=((0, 0), (1, 0)), chunk=4) | bad
        with pytest.raises(ost.MappingError):
            ost.Rule(stored, "decoder.layers_{i}.ab.kernel", **arguments)
