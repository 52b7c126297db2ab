"""Gemma 4: ``ost.mappings.gemma4`` (Flax-style) and ``ost.mappings.maxtext("gemma4", ...)``
against what ``save_pretrained`` writes.

A tiny random bfloat16 ``Gemma4ForCausalLM`` (12 layers: two blocks of 5 sliding-window layers
then a global one, the global layers' heads twice as wide with keys as values, so no
``v_proj``), dense (``gemma4-31b``) and with 4 experts (``gemma4-26b``), and a small one
(``gemma4-e2b``: 10 layers, 4 sliding-window then a global one, per-layer inputs, the last 4
layers without keys or values; unscanned only, as in MaxText), is saved by
transformers and loaded through each mapping sharded over a (2, 4) mesh: each leaf must equal,
bit for bit, the stored tensors transformed by hand (MaxText's: the embedding times
``float32(sqrt(hidden))``, gate and up the halves of ``gate_up_proj``, scanned as
``scanned_blocks.local_layers`` (block, layer within it) and ``scanned_blocks.global_layer``),
and a save writes transformers' very file back (the MaxText MoE tree's ``gate_up_proj`` from its
two leaves, ``wi_0`` and ``wi_1``). MaxText 0.2.5's own forward and converter on these
mappings are ``tests/families/test_maxtext_mapping.py``'s ``gemma4`` and ``gemma4-moe`` cases
(slow: the MaxText venv). There is no JAX forward of Gemma 4 here (``tests/support/hf_families.py``
has none: per-layer head sizes, proportional RoPE, the routed MoE beside the dense MLP); the
MaxText cases check the weights through MaxText's forward against transformers' logits.
"""

import os

import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors.errors import ArgumentError
from tests.families.test_model_families import _sharded
from tests.support.trees import flat, nest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
              intermediate_size=96, sliding_window=4, hidden_size_per_layer_input=0, tie_word_embeddings=True)
MOE = dict(CONFIG, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# gemma4-e2b: 10 layers (4 sliding-window, then a global one), per-layer inputs, the last 4 layers
# reusing earlier ones' keys and values (no k/v), keys not values
E2B = dict(CONFIG, num_hidden_layers=10, attention_k_eq_v=False, num_global_key_value_heads=None,
           hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, num_kv_shared_layers=4,
           use_double_wide_mlp=True, layer_types=["full_attention" if i % 5 == 4 else "sliding_attention"
                                                  for i in range(10)])
CONFIGS = {"dense": CONFIG, "moe": MOE, "e2b": E2B}
H, D, F = 4, 64, 32


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(kind, directory, config, {stored name: bfloat16 array}) of a tiny random Gemma 4."""
    directory = str(tmp_path_factory.mktemp(f"gemma4_{request.param}"))
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CONFIGS[request.param]))
    with torch.no_grad():
        for p in model.state_dict().values():
            p.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(directory)
    stored = {name: np.asarray(value) for name, value in ost.load(directory).items()}
    assert stored[f"model.layers.{_globals(request.param)[0]}.self_attn.q_proj.weight"].shape == (H * 32, D)
    return request.param, directory, transformers.AutoConfig.from_pretrained(directory), stored


def _globals(kind):
    """The global layers (the others: sliding-window)."""
    return [i for i, t in enumerate(transformers.Gemma4TextConfig(**CONFIGS[kind]).layer_types) if t == "full_attention"]


def _flax_layer(kind, stored, i):
    """Layer ``i``'s Flax-style leaves, from the stored tensors by hand."""
    s = {n.removeprefix(f"model.layers.{i}."): v for n, v in stored.items() if n.startswith(f"model.layers.{i}.")}
    hd, kv = (32, 2) if i in _globals(kind) else (16, 2)
    layer = {"self_attn.o_proj.kernel": s["self_attn.o_proj.weight"].T.reshape(H, hd, D),
             "layer_scalar": s["layer_scalar"]}
    for proj, heads in (("q", H), ("k", kv), ("v", kv)):
        if f"self_attn.{proj}_proj.weight" in s:
            layer[f"self_attn.{proj}_proj.kernel"] = s[f"self_attn.{proj}_proj.weight"].T.reshape(D, heads, hd)
    for name, value in s.items():
        if "norm" in name:
            layer[name.removesuffix(".weight") + ".scale"] = value
        elif name.startswith(("mlp.", "per_layer_")) or name == "router.proj.weight":
            layer[name.removesuffix(".weight") + ".kernel"] = value.T
        elif name.startswith("router."):
            layer[name] = value
        elif name.startswith("experts."):
            layer[f"{name}.kernel"] = value.transpose(0, 2, 1)
    return layer


MAXTEXT_NAMES = {  # Flax-style leaf -> MaxText leaf holding the same values (dense; MoE below)
    "input_layernorm.scale": "pre_self_attention_norm.scale",
    "post_attention_layernorm.scale": "post_self_attention_norm.scale",
    "pre_feedforward_layernorm.scale": "pre_ffw_norm.scale", "post_feedforward_layernorm.scale": "post_ffw_norm.scale",
    "self_attn.q_norm.scale": "self_attention.query_norm.scale", "self_attn.k_norm.scale": "self_attention.key_norm.scale",
    "self_attn.q_proj.kernel": "self_attention.query.kernel", "self_attn.k_proj.kernel": "self_attention.key.kernel",
    "self_attn.v_proj.kernel": "self_attention.value.kernel", "self_attn.o_proj.kernel": "self_attention.out.kernel",
    "layer_scalar": "layer_scalar",
    "per_layer_input_gate.kernel": "per_layer_input_gate.kernel",
    "per_layer_projection.kernel": "per_layer_projection.kernel",
    "post_per_layer_input_norm.scale": "post_per_layer_input_norm.scale",
}
DENSE_NAMES = {"mlp.gate_proj.kernel": "mlp.wi_0.kernel", "mlp.up_proj.kernel": "mlp.wi_1.kernel",
               "mlp.down_proj.kernel": "mlp.wo.kernel"}
MOE_NAMES = {
    "mlp.gate_proj.kernel": "mlp.moe_block.shared_experts.wi_0.kernel",
    "mlp.up_proj.kernel": "mlp.moe_block.shared_experts.wi_1.kernel",
    "mlp.down_proj.kernel": "mlp.moe_block.shared_experts.wo.kernel",
    "router.proj.kernel": "mlp.moe_block.MoeBlock_0.gate.kernel", "router.scale": "mlp.pre_forward_scale_2",
    "router.per_expert_scale": "mlp.moe_block.MoeBlock_0.per_expert_scale",
    "experts.down_proj.kernel": "mlp.moe_block.MoeBlock_0.wo",
    **{f"{n}.scale": f"mlp.{n}.scale" for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                                                "post_feedforward_layernorm_2")},
}


def _maxtext_layer(kind, stored, i):
    moe, flax = kind == "moe", _flax_layer(kind, stored, i)
    names = {**MAXTEXT_NAMES, **(MOE_NAMES if moe else DENSE_NAMES)}
    layer = {names[n]: v for n, v in flax.items() if n in names}
    if moe:  # gate_up_proj (experts, hidden, 2F) here: gate, then up
        layer["mlp.moe_block.MoeBlock_0.wi_0"] = flax["experts.gate_up_proj.kernel"][..., :F]
        layer["mlp.moe_block.MoeBlock_0.wi_1"] = flax["experts.gate_up_proj.kernel"][..., F:]
    return layer


def _expected(kind, stored, family, scan_layers):
    """The whole tree ``family``'s mapping makes of the stored tensors, by hand."""
    count = CONFIGS[kind]["num_hidden_layers"]
    ple = {"embed_tokens_per_layer": stored.get("model.embed_tokens_per_layer.weight"),
           "per_layer_model_projection.kernel": stored.get("model.per_layer_model_projection.weight", np.empty(0)).T,
           "per_layer_projection_norm.scale": stored.get("model.per_layer_projection_norm.weight")}
    ple = ple if kind == "e2b" else {}
    if family == "flax":
        ple = {"embed_tokens_per_layer.embedding" if n == "embed_tokens_per_layer" else n: v for n, v in ple.items()}
        return {"model.embed_tokens.embedding": stored["model.embed_tokens.weight"],
                "model.norm.scale": stored["model.norm.weight"], **{f"model.{n}": v for n, v in ple.items()},
                **{f"model.layers_{i}.{n}": v for i in range(count) for n, v in _flax_layer(kind, stored, i).items()}}
    tree = {"token_embedder.embedding": stored["model.embed_tokens.weight"].astype(np.float32) * np.float32(8.0),
            "decoder.decoder_norm.scale": stored["model.norm.weight"],
            **{f"decoder.per_layer_embedder.{n}": v for n, v in ple.items()}}
    layers = [_maxtext_layer(kind, stored, i) for i in range(count)]
    if not scan_layers:
        return tree | {f"decoder.layers_{i}.{n}": v for i, layer in enumerate(layers) for n, v in layer.items()}
    # Layer 6n + k: index (n, k) of axes 1, 2 of local_layers (k < 5), index n of axis 1 of global_layer;
    # experts stay at axis 0.
    for name in layers[0]:
        blocks = [np.stack([layers[6 * n + k][name] for k in range(5)], axis=1) for n in range(2)]
        tree[f"decoder.scanned_blocks.local_layers.{name}"] = np.stack(blocks, axis=1)
    for name in layers[5]:
        tree[f"decoder.scanned_blocks.global_layer.{name}"] = np.stack([layers[5][name], layers[11][name]], axis=1)
    return tree


def _mapping(family, config, scan_layers, **kwargs):
    if family == "flax":
        return ost.mappings.gemma4(config, scan_layers=scan_layers, **kwargs)
    return ost.mappings.maxtext("gemma4-31b", config, scan_layers, **kwargs)


@pytest.mark.parametrize(("family", "scan_layers"), [("flax", False), ("maxtext", False), ("maxtext", True)],
                         ids=["flax", "maxtext-unscanned", "maxtext-scanned"])
def test_sharded_load_is_the_stored_tensors_transformed_by_hand(checkpoint, family, scan_layers):
    kind, directory, config, stored = checkpoint
    if kind == "e2b" and scan_layers:
        with pytest.raises(ArgumentError, match="gemma4_small decoder .* is not scanned"):
            _mapping(family, config, scan_layers)
        return
    expected = _expected(kind, stored, family, scan_layers)
    target = _sharded({name: value.shape for name, value in expected.items()})
    params = flat(ost.load(directory, nest(target), mapping=_mapping(family, config, scan_layers)))
    assert set(params) == set(expected)
    for name, leaf in params.items():
        assert leaf.sharding == target[name].sharding, name
        np.testing.assert_array_equal(np.asarray(leaf), expected[name].astype(np.float32), err_msg=name)


@pytest.mark.parametrize(("family", "scan_layers"), [("flax", False), ("maxtext", False), ("maxtext", True)],
                         ids=["flax", "maxtext-unscanned", "maxtext-scanned"])
def test_save_writes_back_transformers_file(checkpoint, family, scan_layers, tmp_path):
    """Byte for byte; MaxText's MoE tree writes each ``gate_up_proj`` from its ``wi_0`` and ``wi_1``."""
    kind, directory, config, stored = checkpoint
    if kind == "e2b" and scan_layers:
        return  # refused (above)
    mapping = _mapping(family, config, scan_layers, dtype="bfloat16")
    expected = _expected(kind, stored, family, scan_layers)
    params = ost.load(directory, nest(_sharded({n: v.shape for n, v in expected.items()})), mapping=mapping)
    ost.save(str(tmp_path / "back"), params, mapping=mapping, checksums=False)  # without: transformers' bytes
    with open(os.path.join(directory, "model.safetensors"), "rb") as a, \
            open(tmp_path / "back" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_for_config_and_by_name_give_the_gemma4_mapping(checkpoint):
    _, _, config, _ = checkpoint
    rules = ost.mappings.gemma4(config).rules
    assert ost.mappings.for_config(config).rules == rules
    assert ost.mappings.by_name("gemma4", config).rules == rules
    assert ost.mappings.maxtext("gemma4", config, False).rules == ost.mappings.maxtext("gemma4-e2b", config, False).rules


def test_what_the_mappings_refuse(checkpoint):
    """No one stack of unlike layers (Flax, scanned); MaxText's 5 + 1 attention pattern only; the
    small models (per-layer inputs, shared kv layers: gemma4_small) are not scanned, as in MaxText."""
    _, _, config, _ = checkpoint
    with pytest.raises(ArgumentError, match="no one stack"):
        ost.mappings.gemma4(config, scan_layers=True)
    with pytest.raises(ArgumentError, match="needs the model's config"):
        ost.mappings.gemma4(None)
    layers = config.num_hidden_layers
    other = dict(config.to_dict(), layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    with pytest.raises(ArgumentError, match="5 sliding-window ones then a global one"):
        ost.mappings.maxtext("gemma4", other)
    with pytest.raises(ArgumentError, match="no MaxText mapping for 'gemma4-e2b-it'"):
        ost.mappings.maxtext("gemma4-e2b-it", config)


def test_maxtext_reads_the_text_decoder_of_the_multimodal_release():
    """``Gemma4ForConditionalGeneration``'s config: its ``text_config``, the decoder's tensors under
    ``model.language_model.`` (the vision and audio towers are not MaxText's text tree's)."""
    release = transformers.Gemma4Config(text_config=CONFIG)
    text = ost.mappings.maxtext("gemma4", CONFIG, True).rules
    rules = ost.mappings.maxtext("gemma4", release, True).rules
    assert [r.tree for r in rules] == [r.tree for r in text]
    assert all(p.startswith("model.language_model.") for r in rules for p in r.stored_patterns)
