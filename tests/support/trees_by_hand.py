"""What the family mapping tests (tests/families/test_*_mapping.py) share when they write out by hand
the tree a mapping must make of a transformers checkpoint, and check a load and a save against it.

Why here: those files grew the same code side by side (a tiny model's random weights saved, the
tree built from per-layer dicts, unscanned, scanned or scanned in MaxText's blocks, the sharded
load compared leaf by leaf, the save compared byte for byte); one copy keeps them checking the
same things. Each family's own by-hand layer (its names, heads and quirks) stays in its file; what
is here is only what is the same for every family: the leaves outside the layers, the Llama-style
attention and MLP kernels, per-layer leaves arranged as a tree, the target sharded over 8 devices
(``tests/families/test_model_families.py``'s ``_sharded``), and the load and save checks.
"""

import os
import re

import numpy as np
import pytest

import orbax_safetensors as ost
from tests.families.test_model_families import _sharded
from tests.support.trees import flat, nest


def save_bfloat16_normal(model, directory: str) -> dict:
    """Every parameter of ``model`` drawn from N(0, 0.5) (torch's global generator, as the caller
    seeded it), saved in bfloat16 by ``save_pretrained``; ``{stored name: numpy array}``."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(directory)
    return {name: np.asarray(value) for name, value in ost.load(directory).items()}


def save_bfloat16_noisy(model, directory: str) -> dict:
    """Every saved tensor of ``model`` random (norms about 1, other weights 0.15 N(0, 1), from a
    generator seeded 0), saved in bfloat16 by ``save_pretrained``; the file's tensors."""
    import torch
    from safetensors.numpy import load_file

    from tests.support.hf_families import saved_tensors

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in saved_tensors(model):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    model.to(torch.bfloat16).save_pretrained(directory)
    return load_file(os.path.join(directory, "model.safetensors"))


def each_tree(test):
    """Parametrizes ``test`` over ``family`` ("flax", "maxtext") and ``scan_layers`` (ids
    "unscanned", "scanned"), as the two stacked ``pytest.mark.parametrize`` would."""
    test = pytest.mark.parametrize("family", ["flax", "maxtext"])(test)
    return pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])(test)


def sharded_like(expected: dict) -> dict:
    """``_sharded``'s float32 target over a (2, 4) mesh, of ``expected``'s leaves' shapes."""
    return _sharded({name: value.shape for name, value in expected.items()})


def outer_leaves(stored: dict, maxtext: bool = False) -> dict:
    """The embedding, final norm and (untied) head, by hand: Flax-style names or MaxText's."""
    names = (("token_embedder.embedding", "decoder.decoder_norm.scale", "decoder.logits_dense.kernel") if maxtext
             else ("model.embed_tokens.embedding", "model.norm.scale", "lm_head.kernel"))
    return {names[0]: stored["model.embed_tokens.weight"], names[1]: stored["model.norm.weight"],
            names[2]: stored["lm_head.weight"].T}


def layer_tensors(stored: dict, i: int) -> dict:
    """Layer ``i``'s stored tensors, named within the layer (``model.layers.{i}.`` taken off)."""
    return {name.removeprefix(f"model.layers.{i}."): v for name, v in stored.items()
            if name.startswith(f"model.layers.{i}.")}


def attention_kernels(s: dict, heads: int, kv_heads: int, head_dim: int) -> dict:
    """``self_attn.{q,k,v,o}_proj.kernel`` of a layer's stored tensors ``s`` by hand: transposed,
    the (query or key/value) heads an axis, ``(hidden, heads, head_dim)``; ``o_proj``'s
    ``(heads, head_dim, hidden)``."""
    layer = {f"self_attn.{proj}_proj.kernel": s[f"self_attn.{proj}_proj.weight"].T.reshape(-1, n, head_dim)
             for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    layer["self_attn.o_proj.kernel"] = s["self_attn.o_proj.weight"].T.reshape(heads, head_dim, -1)
    return layer


def mlp_kernels(s: dict) -> dict:
    """``mlp.{gate,up,down}_proj.kernel`` of a layer's stored tensors ``s`` by hand: transposed."""
    return {f"mlp.{proj}.kernel": s[f"mlp.{proj}.weight"].T for proj in ("gate_proj", "up_proj", "down_proj")}


def layers_tree(root: str, layers: list, scan_layers: bool, axis: int = 0, pattern: int | None = None) -> dict:
    """``layers`` (layer ``i``'s ``{leaf: value}``) under ``root``: unscanned ``{root}_{i}.{leaf}``;
    scanned ``{root}.{leaf}``, the layers stacked at ``axis``; scanned in blocks of ``pattern``
    (MaxText's), layer ``pattern * n + k`` at index ``n`` (at ``axis``) of ``{root}.layers_{k}.{leaf}``."""
    if not scan_layers:
        return {f"{root}_{i}.{n}": v for i, layer in enumerate(layers) for n, v in layer.items()}
    if pattern is None:
        return {f"{root}.{n}": np.stack([layer[n] for layer in layers], axis=axis) for n in layers[0]}
    return {f"{root}.layers_{k}.{n}": np.stack([layers[i][n] for i in range(k, len(layers), pattern)], axis=axis)
            for k in range(pattern) for n in layers[0]}


def whole_tree(stored: dict, layers: list, family: str, scan_layers: bool, maxtext_names: dict | None = None,
               pattern: int | None = None) -> dict:
    """The whole tree of a decoder by hand: ``outer_leaves`` and ``layers`` (renamed by
    ``maxtext_names`` for MaxText's, if given) under ``model.layers`` (``family`` "flax": scanned at
    axis 0) or ``decoder.layers`` ("maxtext": scanned at axis 1, in blocks of ``pattern`` if given)."""
    if family == "flax":
        return outer_leaves(stored) | layers_tree("model.layers", layers, scan_layers)
    if maxtext_names is not None:
        layers = [{maxtext_names[n]: v for n, v in layer.items()} for layer in layers]
    return outer_leaves(stored, maxtext=True) | layers_tree("decoder.layers", layers, scan_layers, 1, pattern)


def split_layers(tree: dict, root: str = r"(?:model|decoder)\.layers") -> tuple[dict, dict]:
    """``tree``'s leaves outside its numbered layers, and ``{(root, i, leaf): value}`` of those
    named ``{root}_{i}.{leaf}`` (``root`` a regular expression), for a test to stack as it scans."""
    outside, layers = {}, {}
    for name, value in tree.items():
        layer = re.fullmatch(rf"({root})_(\d+)\.(.+)", name)
        if layer is None:
            outside[name] = value
        else:
            layers[layer.group(1), int(layer.group(2)), layer.group(3)] = value
    return outside, layers


def load_sharded_like(directory: str, mapping: ost.Mapping, expected: dict) -> dict:
    """``directory`` loaded through ``mapping`` into ``sharded_like(expected)`` (a nested tree)."""
    return ost.load(directory, nest(sharded_like(expected)), mapping=mapping)


def assert_loads_sharded(directory: str, mapping: ost.Mapping, expected: dict, extra_bytes: int = 0) -> dict:
    """Loads ``directory`` into ``sharded_like(expected)``: the devices read their own bytes only
    (``extra_bytes`` more), and each leaf has its target's sharding and is ``expected``'s, bit for
    bit (bfloat16 widens to float32 exactly). Returns the loaded (nested) tree."""
    target = sharded_like(expected)
    stats = ost.LoadStats()
    params = ost.load(directory, nest(target), mapping=mapping, stats=stats,
                      options=ost.LoadOptions(max_gap=0, max_overread=1.0))
    assert stats.bytes_read == stats.bytes_needed + extra_bytes, (stats.bytes_read, stats.bytes_needed, extra_bytes)
    assert set(flat(params)) == set(expected), set(flat(params)) ^ set(expected)
    for name, leaf in flat(params).items():
        assert leaf.sharding == target[name].sharding, name
        np.testing.assert_array_equal(np.asarray(leaf), expected[name].astype(np.float32), err_msg=name)
    return params


def assert_saves_back_the_file(directory: str, params: dict, mapping: ost.Mapping, out: str) -> None:
    """``params`` saved through ``mapping`` into ``out`` is ``directory``'s very ``model.safetensors``
    (no checksums: they would add to transformers' bytes)."""
    ost.save(out, params, mapping=mapping, checksums=False)
    with open(os.path.join(directory, "model.safetensors"), "rb") as a, \
            open(os.path.join(out, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()


def load_save_and_compare(directory: str, mapping: ost.Mapping, expected: dict, out: str) -> None:
    """The mapping's tree shapes are ``expected``'s; loaded sharded each leaf is ``expected``'s
    (``assert_loads_sharded``); saved back into ``out`` it is the very file."""
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(directory).tensors.items()})
    assert shapes == {name: value.shape for name, value in expected.items()}, shapes
    assert_saves_back_the_file(directory, assert_loads_sharded(directory, mapping, expected), mapping, out)


def assert_loads_and_saves_back(directory: str, mapping: ost.Mapping, expected: dict, out: str) -> None:
    """``load_sharded_like`` then ``assert_saves_back_the_file``: the tree, however sharded, is the file."""
    assert_saves_back_the_file(directory, load_sharded_like(directory, mapping, expected), mapping, out)


def load_and_save_back_tests(expected, mapping) -> tuple:
    """A family file's two tests of its Flax-style and MaxText trees, each unscanned and scanned
    (``each_tree``), on the file's ``checkpoint`` fixture ``(directory, config, stored)``: loaded
    sharded, the tree is ``expected(stored, family, scan_layers)`` (``assert_loads_sharded``), and
    loaded in bfloat16 and saved back it is transformers' file. ``mapping(family, config,
    scan_layers, **kwargs)`` is the family's mapping. The file binds them to its own test names."""

    @each_tree
    def test_sharded_load(checkpoint, family, scan_layers):
        directory, config, stored = checkpoint
        assert_loads_sharded(directory, mapping(family, config, scan_layers), expected(stored, family, scan_layers))

    @each_tree
    def test_save_back(checkpoint, family, scan_layers, tmp_path):
        directory, config, stored = checkpoint
        assert_loads_and_saves_back(directory, mapping(family, config, scan_layers, dtype="bfloat16"),
                                    expected(stored, family, scan_layers), str(tmp_path / "back"))

    return test_sharded_load, test_save_back
