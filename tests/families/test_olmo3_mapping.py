"""OLMo 3: ``ost.mappings.olmo3`` (Flax-style) and ``ost.mappings.maxtext("olmo3", ...)`` against
what ``save_pretrained`` writes.

A tiny random bfloat16 ``Olmo3ForCausalLM`` (8 layers: two blocks of 3 sliding-window layers and a
full-attention one; every weight random, norms too) is saved by transformers and loaded through
each mapping, scanned and unscanned, sharded over a (2, 4) mesh: each leaf must equal, bit for
bit, the stored tensor transformed by hand (kernels transposed, heads split out, the q/k norms
over the whole projection kept as stored; MaxText's scanned tree holds layer ``4 * n + k`` at
index ``n``, axis 1, of ``decoder.layers.layers_{k}``, as ``OLMO3_MAXTEXT_TO_HF_PARAM_MAPPING``
stacks them), each device reading only its bytes, and the tree saved back through the mapping
must be transformers' very file. MaxText 0.2.5's own forward on weights loaded through
``maxtext("olmo3", ...)`` is ``tests/families/test_maxtext_mapping.py``'s ``olmo3`` and
``olmo3-yarn`` cases (slow: the MaxText venv); the Flax-style forward against transformers' logits
is ``tests/families/test_model_families.py``'s.
"""

import pytest

import orbax_safetensors as ost
from orbax_safetensors.mappings.maxtext import family_of
from tests.support.trees_by_hand import (attention_kernels, layer_tensors, load_and_save_back_tests, mlp_kernels,
                                         save_bfloat16_normal, whole_tree)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, sliding_window=4)
H, K, D = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["hidden_size"]
HD, LAYERS, PATTERN = D // H, CONFIG["num_hidden_layers"], 4
# Flax-style leaf -> MaxText leaf (both hold the same values).
MAXTEXT_NAMES = {
    "post_attention_layernorm.scale": "post_self_attention_layer_norm.scale",
    "post_feedforward_layernorm.scale": "post_mlp_layer_norm.scale",
    **{f"self_attn.{hf}_proj.kernel": f"attention.{mt}.kernel"
       for hf, mt in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out"))},
    "self_attn.q_norm.scale": "attention.query_norm.scale", "self_attn.k_norm.scale": "attention.key_norm.scale",
    **{f"mlp.{hf}.kernel": f"mlp.{mt}.kernel" for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"),
                                                             ("down_proj", "wo"))},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, config, {stored name: bfloat16 array}) of a tiny random OLMo 3."""
    directory = str(tmp_path_factory.mktemp("olmo3"))
    torch.manual_seed(0)
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**CONFIG))
    stored = save_bfloat16_normal(model, directory)
    assert stored["model.layers.0.self_attn.q_norm.weight"].shape == (H * HD,)  # over the whole projection
    assert "model.layers.0.input_layernorm.weight" not in stored
    return directory, transformers.AutoConfig.from_pretrained(directory), stored


def _flax_layer(stored, i):
    """Layer ``i``'s Flax-style leaves, from the stored tensors by hand."""
    s = layer_tensors(stored, i)
    layer = {f"{norm}.scale": s[f"{norm}.weight"] for norm in (
        "post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")}
    layer |= attention_kernels(s, H, K, HD)
    return layer | mlp_kernels(s)


def _expected(stored, family, scan_layers):
    """The whole tree ``family``'s mapping makes of the stored tensors, by hand (MaxText's layers
    the Flax-style ones renamed, scanned in blocks of 4)."""
    layers = [_flax_layer(stored, i) for i in range(LAYERS)]
    return whole_tree(stored, layers, family, scan_layers, MAXTEXT_NAMES, PATTERN)


def _mapping(family, config, scan_layers, **kwargs):
    if family == "flax":
        return ost.mappings.olmo3(config, scan_layers=scan_layers, **kwargs)
    return ost.mappings.maxtext("olmo3-7b", config, scan_layers, **kwargs)


# Each tree (Flax-style, MaxText's), unscanned and scanned: loaded sharded over a (2, 4) mesh it is
# ``_expected``, each device reading only its bytes; saved back it is transformers' very file.
test_sharded_load_is_the_stored_tensors_transformed_by_hand, test_tree_saves_back_transformers_file = (
    load_and_save_back_tests(_expected, _mapping))


def test_maxtext_scanned_refuses_layers_past_the_last_whole_block():
    """MaxText 0.2.5 scans OLMo 3 in blocks of 4 and builds no remainder (its generic scan:
    ``num_decoder_layers // 4`` blocks): 6 layers have no scanned tree to go to, unscanned they do."""
    config = {**CONFIG, "num_hidden_layers": 6}
    with pytest.raises(ost.ArgumentError, match="builds no remainder.*last 2 of 6 layers"):
        ost.mappings.maxtext("olmo3", config, scan_layers=True)
    assert ost.mappings.maxtext("olmo3", config, scan_layers=False).rules


@pytest.mark.parametrize("name", ["olmo3", "olmo3-7b", "olmo3-7b-pt", "olmo3-32b"])
def test_maxtext_model_names_are_olmo3(name):
    assert family_of(name) == "olmo3"
    assert ost.mappings.maxtext(name, CONFIG).rules == ost.mappings.maxtext("olmo3", CONFIG).rules


def test_for_config_and_by_name_give_olmo3(checkpoint):
    _, config, _ = checkpoint
    assert ost.mappings.for_config(config).rules == ost.mappings.olmo3(config).rules
    assert ost.mappings.by_name("olmo3", config).rules == ost.mappings.olmo3(config).rules
