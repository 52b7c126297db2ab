"""Qwen2.5: ``ost.mappings.maxtext("qwen2.5", ...)`` and ``ost.mappings.qwen2`` (Flax-style) against
what ``save_pretrained`` writes.

A tiny random bfloat16 ``Qwen2ForCausalLM`` (3 layers, GQA, every weight random, the q/k/v biases
and norms too) is saved by transformers and loaded through each mapping, scanned and unscanned,
sharded over a (2, 4) mesh: each leaf must equal, bit for bit, the stored tensor transformed by
hand (kernels transposed, heads split out; MaxText's q/k/v biases ``(heads, [layers,] head_dim)``,
as ``QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN``'s ``reshape_bias`` makes them and ``to_maxtext.py`` stacks
them at ``param_scan_axis`` 1), each device reading only its bytes, and the tree saved back
through the mapping must be transformers' very file. MaxText 0.2.5's own forward on weights
loaded through ``maxtext("qwen2.5", ...)`` is ``tests/families/test_maxtext_mapping.py``'s
``qwen2.5`` case (slow: the MaxText venv); the Flax-style forward against transformers' logits is
``tests/families/test_model_families.py``'s ``qwen2``.
"""

import pytest

import orbax_safetensors as ost
from orbax_safetensors.mappings.maxtext import family_of
from tests.support.trees_by_hand import (attention_kernels, layer_tensors, load_and_save_back_tests, mlp_kernels,
                                         save_bfloat16_normal, whole_tree)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
H, K, D = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["hidden_size"]
HD, LAYERS = D // H, CONFIG["num_hidden_layers"]
# Flax-style leaf -> MaxText leaf (both hold the same values).
MAXTEXT_NAMES = {
    "input_layernorm.scale": "pre_self_attention_layer_norm.scale",
    "post_attention_layernorm.scale": "post_self_attention_layer_norm.scale",
    **{f"self_attn.{hf}_proj.{leaf}": f"self_attention.{mt}.{leaf}"
       for hf, mt in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out")) for leaf in ("kernel", "bias")},
    **{f"mlp.{hf}.kernel": f"mlp.{mt}.kernel" for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"),
                                                             ("down_proj", "wo"))},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, config, {stored name: bfloat16 array}) of a tiny random Qwen2.5."""
    directory = str(tmp_path_factory.mktemp("qwen25"))
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
    stored = save_bfloat16_normal(model, directory)
    assert stored["model.layers.0.self_attn.k_proj.bias"].shape == (K * HD,)
    assert "model.layers.0.self_attn.o_proj.bias" not in stored
    return directory, transformers.AutoConfig.from_pretrained(directory), stored


def _flax_layer(stored, i):
    """Layer ``i``'s Flax-style leaves, from the stored tensors by hand."""
    s = layer_tensors(stored, i)
    layer = {f"{norm}.scale": s[f"{norm}.weight"] for norm in ("input_layernorm", "post_attention_layernorm")}
    layer |= attention_kernels(s, H, K, HD)
    for proj, heads in (("q", H), ("k", K), ("v", K)):
        layer[f"self_attn.{proj}_proj.bias"] = s[f"self_attn.{proj}_proj.bias"].reshape(heads, HD)
    return layer | mlp_kernels(s)


def _expected(stored, family, scan_layers):
    """The whole tree ``family``'s mapping makes of the stored tensors, by hand (MaxText's layers
    the Flax-style ones renamed)."""
    layers = [_flax_layer(stored, i) for i in range(LAYERS)]
    return whole_tree(stored, layers, family, scan_layers, MAXTEXT_NAMES)


def _mapping(family, config, scan_layers, **kwargs):
    if family == "flax":
        return ost.mappings.qwen2(config, scan_layers=scan_layers, **kwargs)
    return ost.mappings.maxtext("qwen2.5-7b", config, scan_layers, **kwargs)


# Each tree (Flax-style, MaxText's), unscanned and scanned: loaded sharded over a (2, 4) mesh it is
# ``_expected``, each device reading only its bytes; saved back it is transformers' very file.
test_sharded_load_is_the_stored_tensors_transformed_by_hand, test_tree_saves_back_transformers_file = (
    load_and_save_back_tests(_expected, _mapping))


@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b"])
def test_maxtext_model_names_are_qwen25(name):
    assert family_of(name) == "qwen2.5"
    assert ost.mappings.maxtext(name, CONFIG).rules == ost.mappings.maxtext("qwen2.5", CONFIG).rules


def test_tied_qwen25_has_no_logits_dense():
    """qwen2.5-1.5b ties its embedding (MaxText's logits_via_embedding): no head to map."""
    trees = {rule.tree for rule in ost.mappings.maxtext("qwen2.5-1.5b", {**CONFIG, "tie_word_embeddings": True}).rules}
    assert "decoder.logits_dense.kernel" not in trees and "token_embedder.embedding" in trees
