"""DeepSeek-V4's mappings (``ost.mappings.deepseek_v4``, ``maxtext("deepseek4", ...)``) against a
tiny random ``DeepseekV4ForCausalLM`` (tests/families/test_maxtext_mapping.py's ``deepseek4`` case:
2 sliding-window layers, then compressed sparse, heavily compressed and compressed sparse
attention; the first 3 layers' MoE routed by a token table), in the release's names and in the
ones transformers' ``save_pretrained`` writes.

Every leaf loaded into a float32 tree sharded over 8 devices equals the stored tensor transformed
by hand, after MaxText 0.2.5's own hooks (``DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_HOOK_FN``: the
hyper-connection tensors sliced into MaxText's leaves, ``wo_a`` reshaped and transposed, the
``mhc_norm`` scales ones), and the tree saved back through the mapping is the very file. MaxText's
forward pass over what ``maxtext("deepseek4", ...)`` loads is the ``deepseek4`` case there.
"""

import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

import orbax_safetensors as ost
from orbax_safetensors.errors import ArgumentError
from tests.support.trees_by_hand import load_save_and_compare

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from tests.families.test_maxtext_mapping import DEEPSEEK4, deepseek4_release_name, write_checkpoint  # noqa: E402

CSA, HCA, HASH_LAYERS = (2, 4), (3,), 3
STREAMS, GROUPS = DEEPSEEK4["hc_mult"], DEEPSEEK4["o_groups"]


def _write(names: str, tmp_path_factory) -> tuple:
    """(directory, config, {release name: numpy tensor}, names) of the tiny model, its tensors
    under the release's names or save_pretrained's (the same values)."""
    directory = str(tmp_path_factory.mktemp("deepseek_v4") / names)
    write_checkpoint("deepseek4", directory, release=names == "release")
    stored = {deepseek4_release_name(name): value
              for name, value in load_file(os.path.join(directory, "model.safetensors")).items()}
    return directory, transformers.AutoConfig.from_pretrained(directory), stored, names


@pytest.fixture(scope="module", params=["release", "transformers"])
def checkpoint(request, tmp_path_factory):
    return _write(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The release's form, which MaxText's converter reads, and so does ``maxtext("deepseek4")``."""
    return _write("release", tmp_path_factory)


def _layer(stored: dict, i: int) -> dict:
    return {name.removeprefix(f"layers.{i}."): v for name, v in stored.items() if name.startswith(f"layers.{i}.")}


def _as(name: str, leaf: str) -> str:
    """A ``.weight`` name with its Flax leaf name instead."""
    return re.sub(r"\.weight$", leaf, name)


def _o_a(weight: np.ndarray) -> np.ndarray:
    """``wo_a`` as MaxText's hook makes ``o_a_proj``: group ``g``'s kernel is its rows' transpose."""
    rank = weight.shape[0] // GROUPS
    return weight.reshape(GROUPS, rank, weight.shape[1]).transpose(0, 2, 1)


def flax_by_hand(stored: dict) -> dict:
    """The Flax-style tree: the release's paths, kernels transposed (heads split), norms' scales."""
    heads, head_dim = DEEPSEEK4["num_attention_heads"], DEEPSEEK4["head_dim"]
    tree, experts = {}, {}
    for name, value in stored.items():
        expert = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w\d)\.weight", name)
        if expert:
            i, e, w = expert.groups()
            experts.setdefault(f"layers_{i}.ffn.experts.{w}.kernel", {})[int(e)] = value.T
            continue
        leaf = re.sub(r"^layers\.(\d+)\.", r"layers_\1.", name)
        if name.endswith("wo_a.weight"):
            tree[_as(leaf, ".kernel")] = _o_a(value)
        elif name.endswith(("attn.wq_b.weight", "attn.wkv.weight")):
            split = heads if name.endswith("wq_b.weight") else DEEPSEEK4["num_key_value_heads"]
            tree[_as(leaf, ".kernel")] = value.T.reshape(value.shape[1], split, head_dim)
        elif name.endswith("norm.weight"):
            tree[_as(leaf, ".scale")] = value
        elif name.endswith(".weight") and value.ndim == 2:
            tree[_as(leaf, ".kernel") if name != "embed.weight" else "embed.embedding"] = (
                value if name == "embed.weight" else value.T)
        else:
            tree[leaf] = value  # hyper-connections, sinks, positional biases, the routing tables
    tree.update({leaf: np.stack([by[e] for e in sorted(by)]) for leaf, by in experts.items()})
    return tree


# Release name within a layer -> MaxText's leaf (all but the hyper-connections and the experts).
_MAXTEXT = {"attn.wq_a.weight": "self_attention.wq_a.kernel", "attn.wq_b.weight": "self_attention.wq_b.kernel",
            "attn.wkv.weight": "self_attention.wkv.kernel", "attn.q_norm.weight": "self_attention.q_norm.scale",
            "attn.kv_norm.weight": "self_attention.kv_norm.scale", "attn.attn_sink": "self_attention.sinks",
            "attn.wo_a.weight": "self_attention.o_a_proj.kernel", "attn.wo_b.weight": "self_attention.o_b_proj.kernel",
            "attn_norm.weight": "pre_self_attention_layer_norm.scale",
            "ffn_norm.weight": "post_self_attention_layer_norm.scale", "ffn.gate.weight": "mlp.MoeBlock_0.gate.kernel",
            "ffn.gate.bias": "mlp.MoeBlock_0.gate.bias", "ffn.gate.tid2eid": "mlp.MoeBlock_0.tid2eid",
            **{f"ffn.shared_experts.{w}.weight": f"mlp.shared_experts.{m}.kernel"
               for w, m in (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo"))}}
_COMPRESSOR = {"wgate.weight": "gate_proj.kernel", "wkv.weight": "kv_proj.kernel", "norm.weight": "kv_norm.scale",
               "ape": "position_bias"}


def _maxtext_layer(s: dict, i: int) -> dict:
    """Layer ``i``'s leaves in MaxText's tree, as its hooks make them."""
    flax = flax_by_hand({f"layers.0.{n}": v for n, v in s.items()})
    layer = {}
    for name, leaf in _MAXTEXT.items():
        if name in s:
            layer[leaf] = flax[_as(f"layers_0.{name}", ".kernel" if "norm" not in name else ".scale")]
    kind = "csa" if i in CSA else "hca" if i in HCA else None
    for name, leaf in _COMPRESSOR.items():
        if kind is not None:
            layer[f"self_attention.{kind}_compressor.{leaf}"] = s[f"attn.compressor.{name}"].T if "kernel" in leaf \
                else s[f"attn.compressor.{name}"]
        if kind == "csa":
            layer[f"self_attention.csa_compressor.indexer.{leaf}"] = (
                s[f"attn.indexer.compressor.{name}"].T if "kernel" in leaf else s[f"attn.indexer.compressor.{name}"])
    if kind == "csa":
        layer["self_attention.csa_compressor.indexer.weights_proj.kernel"] = s["attn.indexer.weights_proj.weight"].T
        layer["self_attention.csa_compressor.indexer.q_proj.kernel"] = s["attn.indexer.wq_b.weight"].T
    for w, m in (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo")):
        layer[f"mlp.MoeBlock_0.{m}"] = flax[f"layers_0.ffn.experts.{w}.kernel"]
    k = STREAMS
    for module, tree in (("hc_attn", "mhc_attention"), ("hc_ffn", "mhc_mlp")):  # mhc_slice_hook, mhc_dummy_norm
        fn, base, scale = (s[f"{module}_{part}"] for part in ("fn", "base", "scale"))
        layer.update({f"{tree}.pre_alpha": fn.T[:, :k], f"{tree}.post_alpha": fn.T[:, k:2 * k],
                      f"{tree}.res_alpha": fn.T[:, 2 * k:], f"{tree}.pre_beta": base[:k],
                      f"{tree}.post_beta": base[k:2 * k], f"{tree}.res_beta": base[2 * k:].reshape(k, k),
                      f"{tree}.pre_alpha_scale": scale[0:1], f"{tree}.post_alpha_scale": scale[1:2],
                      f"{tree}.res_alpha_scale": scale[2:3],
                      f"{tree}.mhc_norm.scale": np.ones(fn.shape[1], np.float32)})
    return layer


def maxtext_by_hand(stored: dict, scan_layers: bool) -> dict:
    """MaxText's tree: layer ``i`` at ``decoder.layers_{i}``; scanned, the hash-routed layers so and
    the rest in ``decoder.scanned_blocks.layers_{0,1}`` (HCA, CSA), stacked at axis 1 (the router
    bias at 0)."""
    tree = {"token_embedder.embedding": stored["embed.weight"], "decoder.decoder_norm.scale": stored["norm.weight"],
            "decoder.logits_dense.kernel": stored["head.weight"].T, "decoder.hc_head.hc_fn": stored["hc_head_fn"].T,
            "decoder.hc_head.hc_base": stored["hc_head_base"], "decoder.hc_head.hc_scale": stored["hc_head_scale"]}
    layers = [_maxtext_layer(_layer(stored, i), i) for i in range(DEEPSEEK4["num_hidden_layers"])]
    unrolled = range(HASH_LAYERS) if scan_layers else range(len(layers))
    tree.update({f"decoder.layers_{i}.{leaf}": v for i in unrolled for leaf, v in layers[i].items()})
    if scan_layers:
        for block, first in enumerate((HASH_LAYERS, HASH_LAYERS + 1)):
            members = layers[first::2]
            for leaf in members[0]:
                axis = 0 if leaf.endswith("gate.bias") else 1
                tree[f"decoder.scanned_blocks.layers_{block}.{leaf}"] = np.stack([m[leaf] for m in members], axis)
    return tree


def test_flax_style_tree_is_the_checkpoint_by_hand_and_saves_back_the_same_file(checkpoint, tmp_path):
    directory, config, stored, names = checkpoint
    mapping = ost.mappings.deepseek_v4(config, names=names)
    if names == "release":
        assert ost.mappings.for_config(config).rules == mapping.rules
    load_save_and_compare(directory, mapping, flax_by_hand(stored), str(tmp_path / "back"))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_tree_is_the_release_by_hand_and_saves_back_the_same_file(release, tmp_path, scan_layers):
    directory, config, stored, _ = release
    expected = maxtext_by_hand(stored, scan_layers)
    load_save_and_compare(directory, ost.mappings.maxtext("deepseek4", config, scan_layers=scan_layers), expected,
                          str(tmp_path / "back"))


def test_the_releases_own_config_keys_give_the_same_mapping(release):
    """DeepSeek's config.json says each layer's attention by ``compress_ratios`` and the table-routed
    layers by ``num_hash_layers``; transformers' by ``layer_types`` and ``mlp_layer_types``."""
    _, config, _, _ = release
    release = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "mlp_layer_types")}
    release.update(compress_ratios=[0, 0, 4, 128, 4], num_hash_layers=HASH_LAYERS)
    for scan_layers in (False, True):
        assert (ost.mappings.maxtext("deepseek4", release, scan_layers=scan_layers).rules
                == ost.mappings.maxtext("deepseek4", config, scan_layers=scan_layers).rules)


def test_configs_maxtext_cannot_scan_or_that_lack_sizes_are_refused(release):
    _, config, _, _ = release
    swapped = dict(config.to_dict(), layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                                  "compressed_sparse_attention", "heavily_compressed_attention"])
    with pytest.raises(ArgumentError, match="scans the layers after the 3 hash-routed ones in pairs, heavily "
                                            "compressed then compressed sparse attention"):
        ost.mappings.maxtext("deepseek4", swapped, scan_layers=True)
    ost.mappings.maxtext("deepseek4", swapped, scan_layers=False)  # each layer its own: any order
    with pytest.raises(ArgumentError, match="config is None"):
        ost.mappings.maxtext("deepseek4", None)
    with pytest.raises(ArgumentError, match="the hash-routed layers come first"):
        ost.mappings.deepseek_v4(dict(config.to_dict(), mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe", "moe"]))
    with pytest.raises(ArgumentError, match="neither mlp_layer_types nor num_hash_layers"):
        ost.mappings.deepseek_v4({k: v for k, v in config.to_dict().items() if k != "mlp_layer_types"})
    with pytest.raises(ArgumentError, match="the config has no hc_mult"):
        ost.mappings.deepseek_v4({k: v for k, v in config.to_dict().items() if k != "hc_mult"})
    with pytest.raises(ArgumentError, match="names='hf'; one of 'release', 'transformers'"):
        ost.mappings.deepseek_v4(config, names="hf")
    with pytest.raises(ArgumentError, match="scan_layers=True has no Flax-style tree"):
        ost.mappings.deepseek_v4(config, scan_layers=True)


def test_a_checkpoint_of_another_size_than_the_config_is_refused(release):
    directory, config, _, _ = release
    with pytest.raises(ost.MappingError, match="the config's num_hidden_layers is 6, but the checkpoint holds 5"):
        ost.load(directory, mapping=ost.mappings.maxtext("deepseek4", dict(
            config.to_dict(), num_hidden_layers=6, layer_types=[*config.layer_types, "sliding_attention"],
            mlp_layer_types=[*config.mlp_layer_types, "moe"]), scan_layers=False))
