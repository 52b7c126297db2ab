"""gpt-oss: ``ost.mappings.gpt_oss`` (Flax-style) and ``ost.mappings.maxtext("gpt-oss", ...)``
against what ``save_pretrained`` writes, and ``Rule.take``, which reads one stored tensor as
several leaves.

A tiny random bfloat16 ``GptOssForCausalLM`` (4 layers: sliding, full, sliding, full; 4
experts; every weight random, sinks, biases and norms too) is saved by transformers and
loaded through each mapping, scanned and unscanned, sharded over a (2, 4) mesh that cuts
experts, layers and the interleaved gate/up columns: each leaf must equal, bit for bit, the
stored tensors transformed by hand (``gate_up_proj[..., ::2]`` for MaxText's ``wi_0``, as
MaxText's converter does), and each device must read only its stored boxes. Both trees save
back transformers' very file (the MaxText tree's ``gate_up_proj`` written from both of its
leaves) and convert back to its tensors; a MaxText tree lacking one of them is refused before
anything is written. MaxText 0.2.5's own forward on weights loaded through
``maxtext("gpt-oss", ...)`` is ``tests/families/test_maxtext_mapping.py``'s ``gpt-oss`` case (slow:
the MaxText venv), which also compares every leaf with MaxText's own converter.
"""

import dataclasses
import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import orbax_safetensors as ost
from orbax_safetensors.errors import MappingError
from orbax_safetensors.planning import normalize_index
from orbax_safetensors.planning.rules import Rule
from tests.planning.test_mapping import _SETTINGS, _slices, box_in, transforms
from tests.families.test_model_families import _sharded
from tests.support.trees import flat, nest
from tests.support.trees_by_hand import (assert_loads_sharded, assert_saves_back_the_file, attention_kernels,
                                         layer_tensors, load_sharded_like, save_bfloat16_normal, sharded_like,
                                         whole_tree)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
H, K, HD, D = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"], CONFIG["hidden_size"]
LAYERS = CONFIG["num_hidden_layers"]
# Flax-style leaf → MaxText leaf, where they hold the same values (the MLP's fused gate/up aside).
MAXTEXT_NAMES = {
    "input_layernorm.scale": "pre_self_attention_layer_norm.scale",
    "post_attention_layernorm.scale": "post_self_attention_layer_norm.scale",
    **{f"self_attn.{hf}_proj.{leaf}": f"GptOssAttention.{mt}.{leaf}"
       for hf, mt in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out")) for leaf in ("kernel", "bias")},
    "self_attn.sinks": "GptOssAttention.sinks",
    "mlp.router.kernel": "GptOssMlp.gate.kernel", "mlp.router.bias": "GptOssMlp.gate.bias",
    "mlp.experts.down_proj.kernel": "GptOssMlp.wo", "mlp.experts.down_proj.bias": "GptOssMlp.wo_bias",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, config, {stored name: bfloat16 array}) of a tiny random gpt-oss."""
    directory = str(tmp_path_factory.mktemp("gpt_oss"))
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG))
    stored = save_bfloat16_normal(model, directory)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, D, 2 * CONFIG["intermediate_size"])
    return directory, transformers.AutoConfig.from_pretrained(directory), stored


def _flax_layer(stored, i):
    """Layer ``i``'s Flax-style leaves, from the stored tensors by hand."""
    s = layer_tensors(stored, i)
    layer = {"input_layernorm.scale": s["input_layernorm.weight"],
             "post_attention_layernorm.scale": s["post_attention_layernorm.weight"],
             "self_attn.o_proj.bias": s["self_attn.o_proj.bias"], "self_attn.sinks": s["self_attn.sinks"],
             "mlp.router.kernel": s["mlp.router.weight"].T, "mlp.router.bias": s["mlp.router.bias"],
             **attention_kernels(s, H, K, HD)}
    for proj, heads in (("q", H), ("k", K), ("v", K)):
        layer[f"self_attn.{proj}_proj.bias"] = s[f"self_attn.{proj}_proj.bias"].reshape(heads, HD)
    for proj in ("gate_up_proj", "down_proj"):
        layer[f"mlp.experts.{proj}.kernel"] = s[f"mlp.experts.{proj}"]
        layer[f"mlp.experts.{proj}.bias"] = s[f"mlp.experts.{proj}_bias"]
    return layer


def _maxtext_layer(stored, i):
    """Layer ``i``'s MaxText leaves: the Flax-style ones renamed, gate/up split as MaxText's
    converter splits them (gate at even columns, up at odd ones)."""
    flax = _flax_layer(stored, i)
    layer = {MAXTEXT_NAMES[name]: value for name, value in flax.items() if name in MAXTEXT_NAMES}
    for index, leaf in enumerate(("wi_0", "wi_1")):
        layer[f"GptOssMlp.{leaf}"] = flax["mlp.experts.gate_up_proj.kernel"][..., index::2]
        layer[f"GptOssMlp.{leaf}_bias"] = flax["mlp.experts.gate_up_proj.bias"][..., index::2]
    return layer


def _expected(stored, family, scan_layers):
    """The whole tree ``family``'s mapping makes of the stored tensors, by hand (MaxText scans pairs
    of layers, sliding then full: layer 2n + k is index n of layers_k, at axis 1)."""
    layer_of = _flax_layer if family == "flax" else _maxtext_layer
    return whole_tree(stored, [layer_of(stored, i) for i in range(LAYERS)], family, scan_layers, pattern=2)


def _mapping(family, config, scan_layers, **kwargs):
    if family == "flax":
        return ost.mappings.gpt_oss(config, scan_layers=scan_layers, **kwargs)
    return ost.mappings.maxtext("gpt-oss-20b", config, scan_layers, **kwargs)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("family", ["flax", "maxtext"])
def test_sharded_load_is_the_stored_tensors_transformed_by_hand(checkpoint, family, scan_layers):
    directory, config, stored = checkpoint
    # MaxText's wi_0 and wi_1 each read the column pairs of gate_up_proj they take one of (gate
    # and up are interleaved), twice their own bytes; every other byte is read once.
    fused = sum(v.nbytes for n, v in stored.items() if "gate_up_proj" in n) if family == "maxtext" else 0
    assert_loads_sharded(directory, _mapping(family, config, scan_layers), _expected(stored, family, scan_layers),
                         extra_bytes=fused)


def test_maxtext_devices_read_only_their_column_pairs_of_gate_up(checkpoint):
    """``wi_0`` sharded four ways on its columns (and two on experts): each device reads its
    experts' 16 interleaved columns of ``gate_up_proj`` (its 8 gate columns and the up columns
    between them: twice its own bytes, as stored), and the devices together read it once."""
    directory, config, _ = checkpoint
    name, mapping = "decoder.layers_0.GptOssMlp.wi_0", _mapping("maxtext", config, False)
    target = _sharded({name: (4, D, CONFIG["intermediate_size"])})
    shapes = {n: t.shape for n, t in ost.metadata(directory).tensors.items()}
    (piece,) = mapping.assembly(name, tree_shape=target[name].shape, stored_shapes=shapes).pieces
    boxes = {normalize_index(index, target[name].shape)
             for index in target[name].sharding.devices_indices_map(target[name].shape).values()}
    assert sorted(piece.transform.stored_box(box) for box in boxes) == sorted(
        ((e, e + 2), (0, D), (c, c + 16)) for e in (0, 2) for c in range(0, 64, 16))
    stats = ost.LoadStats()
    ost.load(directory, nest(target), mapping=mapping, stats=stats, strict="target",
             options=ost.LoadOptions(max_gap=0, max_overread=1.0))
    assert stats.bytes_read == 2 * stats.bytes_needed == math.prod(shapes["model.layers.0.mlp.experts.gate_up_proj"]) * 2


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_flax_tree_saves_back_transformers_file(checkpoint, scan_layers, tmp_path):
    directory, config, stored = checkpoint
    mapping = ost.mappings.gpt_oss(config, scan_layers=scan_layers, dtype="bfloat16")
    params = load_sharded_like(directory, mapping, _expected(stored, "flax", scan_layers))
    assert_saves_back_the_file(directory, params, mapping, str(tmp_path / "back"))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_tree_saves_back_transformers_file(checkpoint, scan_layers, tmp_path):
    """``wi_0`` and ``wi_1`` are the even and odd columns of one stored ``gate_up_proj``: a save
    writes it from both, each device its own columns of its experts (the mesh cuts them)."""
    directory, config, stored = checkpoint
    mapping = _mapping("maxtext", config, scan_layers, dtype="bfloat16")
    params = load_sharded_like(directory, mapping, _expected(stored, "maxtext", scan_layers))
    assert any(len(leaf.sharding.device_set) == 8 for leaf in flat(params).values())
    assert_saves_back_the_file(directory, params, mapping, str(tmp_path / "back"))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_form_converts_back_to_transformers_tensors(checkpoint, scan_layers, tmp_path):
    """HF → MaxText's form → HF: each box of ``gate_up_proj`` written from both leaves' parts."""
    directory, config, stored = checkpoint
    mapping = _mapping("maxtext", config, scan_layers)
    ost.convert(directory, str(tmp_path / "mt"), mapping=mapping, dtype="bfloat16")
    ost.convert(str(tmp_path / "mt"), str(tmp_path / "hf"), mapping=mapping, block_bytes="1KB")
    back = ost.load(str(tmp_path / "hf"))
    assert set(back) == set(stored)
    for name, value in stored.items():
        assert np.asarray(back[name]).tobytes() == value.tobytes(), name


def test_a_save_missing_a_part_of_a_stored_tensor_is_refused_before_anything_is_written(checkpoint, tmp_path):
    """Only ``wi_0``: ``gate_up_proj``'s odd columns would be garbage."""
    directory, config, stored = checkpoint
    mapping = _mapping("maxtext", config, False)
    params = flat(load_sharded_like(directory, mapping, _expected(stored, "maxtext", False)))
    tree = {name: value for name, value in params.items() if not name.endswith("wi_1")}
    with pytest.raises(MappingError, match=r"'model.layers.0.mlp.experts.gate_up_proj' cannot be written: no tree "
                                           r"leaf holds its part\(s\) index 1 of axis 3"):
        ost.save(str(tmp_path / "out"), nest(tree), mapping=mapping)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("family", ["flax", "maxtext"])
def test_load_without_a_target_gives_the_whole_tree(checkpoint, family):
    """Without a target every leaf comes from the stored names: ``gate_up_proj`` is both
    ``wi_0`` and ``wi_1`` of MaxText's tree (each rule takes its part)."""
    directory, config, stored = checkpoint
    params = ost.load(directory, mapping=_mapping(family, config, True))
    expected = _expected(stored, family, True)
    assert set(params) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


@pytest.fixture(scope="module")
def mxfp4_release(checkpoint, tmp_path_factory):
    """(MXFP4 release, its bfloat16 twin, the MXFP4 config): the experts' random MXFP4 bytes,
    and the twin holding ``tests/support/quantized_reference.py``'s dequantization of them (exact in
    bfloat16), every other tensor the tiny checkpoint's."""
    from tests.support.quantized_reference import mxfp4_reference, random_mxfp4

    _, config, stored = checkpoint
    rng, release, twin = np.random.default_rng(0), {}, {}
    for name, value in stored.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = value.shape  # the twin [experts, in, out]; stored [experts, out, in / 32, 16]
            blocks, scales = random_mxfp4(rng, (experts, cols), rows // 32)
            release[name + "_blocks"], release[name + "_scales"] = blocks, scales
            twin[name] = mxfp4_reference(blocks, scales).astype(value.dtype)
        else:
            release[name] = twin[name] = value
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    ost.save(str(root / "mxfp4"), release)
    ost.save(str(root / "twin"), twin)
    return str(root / "mxfp4"), str(root / "twin"), {**config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}


@pytest.mark.parametrize("family", ["flax", "maxtext"])
def test_mxfp4_release_reads_as_its_dequantized_twin(checkpoint, mxfp4_release, family):
    """Sharded, each device's experts and columns dequantized as they are read: the very
    values the bfloat16 twin holds (MaxText's wi_0/wi_1 taken from the dequantized gate_up)."""
    release, twin, mxfp4_config = mxfp4_release
    mapping = _mapping(family, mxfp4_config, True)
    assert mapping.quantization == ost.MXFP4()
    expected = flat(ost.load(twin, mapping=_mapping(family, checkpoint[1], True), nest=True))
    target = sharded_like(expected)
    params = flat(ost.load(release, nest(target), mapping=mapping))
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert params[name].sharding == target[name].sharding, name
        np.testing.assert_array_equal(np.asarray(params[name]), value.astype(np.float32), err_msg=name)


def test_mxfp4_release_converts_to_maxtext(mxfp4_release, tmp_path):
    """``ost.convert`` dequantizes a quantized release into MaxText's tree in bounded memory."""
    import orbax.checkpoint as ocp

    release, twin, mxfp4_config = mxfp4_release
    mapping = _mapping("maxtext", mxfp4_config, True)
    ost.convert(release, str(tmp_path / "mt"), mapping=mapping, dtype="bfloat16", memory_budget="64MB")
    restored = flat(ocp.StandardCheckpointer().restore(str(tmp_path / "mt" / "0" / "items")))
    expected = ost.load(twin, mapping=mapping)
    assert {name.removeprefix("params.params.") for name in restored if name.startswith("params.")} == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(restored["params.params." + name]), value, err_msg=name)


def test_gpt_oss_is_shipped_by_model_type_and_by_name(checkpoint):
    _, config, _ = checkpoint
    for scan_layers in (False, True):
        rules = ost.mappings.gpt_oss(config, scan_layers=scan_layers).rules
        assert ost.mappings.for_config(config, scan_layers=scan_layers).rules == rules
        assert ost.mappings.by_name("gpt_oss", config, scan_layers=scan_layers).rules == rules
        assert ost.mappings.by_name("maxtext:gpt-oss", config, scan_layers=scan_layers).rules == \
            ost.mappings.maxtext("gpt-oss", config, scan_layers).rules


# --- Rule.take: one stored tensor, several leaves -------------------------------------------


def test_take_reads_one_index_of_the_interleaved_pairs():
    gate_up = np.arange(3 * 4 * 10).reshape(3, 4, 10)
    for index in (0, 1):
        t = Rule("gu", "wi", split={2: (-1, 2)}, take={3: index}).resolve(stored_shape=(3, 4, 10), tree_shape=(3, 4, 5))
        assert t.tree_shape == (3, 4, 5) and not t.is_identity
        np.testing.assert_array_equal(t.apply(gate_up), gate_up[..., index::2])
        # A column range reads its pairs; one column exactly its own stored column.
        assert t.stored_box(((0, 3), (0, 4), (1, 3))) == ((0, 3), (0, 4), (2, 6))
        assert t.stored_box(((1, 2), (0, 4), (3, 4))) == ((1, 2), (0, 4), (6 + index, 7 + index))
        for box in (((0, 3), (0, 4), (1, 3)), ((1, 2), (2, 3), (3, 4)), ((0, 1), (0, 4), (0, 5))):
            read = t.stored_box(box)
            np.testing.assert_array_equal(t.to_tree(gate_up[_slices(read)], read, box), gate_up[..., index::2][_slices(box)])


@_SETTINGS
@given(st.data())
def test_a_taken_axis_reads_its_index_and_equals_slicing_the_whole_value(data):
    t = dataclasses.replace(data.draw(transforms()), tree_perm=())
    reshaped = t.tree_shape
    axis = data.draw(st.integers(0, len(reshaped) - 1))
    taken = dataclasses.replace(t, takes=((axis, data.draw(st.integers(0, reshaped[axis] - 1))),))
    stored = np.arange(math.prod(t.stored_shape)).reshape(t.stored_shape)
    tree = taken.apply(stored)
    np.testing.assert_array_equal(tree, np.take(t.apply(stored), taken.takes[0][1], axis=axis))
    box = data.draw(box_in(taken.tree_shape)) if taken.tree_shape else ()
    read = taken.stored_box(box)
    assert math.prod(b - a for a, b in read) >= math.prod(b - a for a, b in box)
    np.testing.assert_array_equal(taken.to_tree(stored[_slices(read)], read, box), tree[_slices(box)])


def test_a_taking_rule_is_checked():
    rule = Rule("gu", "wi", split={2: (-1, 2)}, take={3: 0})
    assert rule.resolve(tree_shape=(3, 4, 5)) == rule.resolve(stored_shape=(3, 4, 10))
    with pytest.raises(MappingError, match="the taken axis's size is not declared"):
        Rule("gu", "wi", split={2: (2, -1)}, take={3: 0}).resolve(tree_shape=(3, 4, 5))
    with pytest.raises(MappingError, match="take 3: index 2"):
        Rule("gu", "wi", split={2: (-1, 2)}, take={3: 2}).resolve(stored_shape=(3, 4, 10))
    with pytest.raises(MappingError, match="maps to"):
        rule.resolve(stored_shape=(3, 4, 10), tree_shape=(3, 4, 10))
    with pytest.raises(MappingError, match="ints >= 0"):
        Rule("gu", "wi", take={-1: 0})


def test_mxfp4_experts_kept_as_stored_save_back_the_very_file(mxfp4_release, tmp_path):
    """``dequantize=False`` (Flax-style): each layer's experts as their blocks and exponents,
    as stored, stacked over the layers when scanned; saved back, the very file. MaxText's tree
    takes gate and up apart, which the blocks cannot be: refused by name."""
    release, _, mxfp4_config = mxfp4_release
    stored = ost.metadata(release).tensors
    for scan_layers in (False, True):
        mapping = ost.mappings.gpt_oss(mxfp4_config, scan_layers=scan_layers, dequantize=False)
        tree = flat(ost.load(release, mapping=mapping, nest=True, strict=True))
        blocks = [name for name in tree if name.endswith("_blocks")]
        assert blocks and all(tree[name].dtype == np.uint8 for name in blocks)
        if not scan_layers:
            name = "model.layers_0.mlp.experts.gate_up_proj.kernel_blocks"
            assert tree[name].shape == stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape
        back = tmp_path / f"back{scan_layers}"
        ost.save(str(back), nest(tree), mapping=mapping)  # as the release was written (ost.save's checksums)
        assert (back / "model.safetensors").read_bytes() == open(f"{release}/model.safetensors", "rb").read()
    with pytest.raises(ost.ArgumentError, match="kept only as stored"):
        ost.mappings.maxtext("gpt-oss", mxfp4_config, dequantize=False)
