"""Shipped mappings against transformers, every family, scanned and unscanned.

For each family a tiny randomly initialised transformers model (every weight
random, norms and biases too) is saved with ``save_pretrained``; the mapping
loads it into a Flax-style tree, sharded over 8 devices (reading exactly each
device's bytes), a JAX forward over that tree (``tests/support/hf_families.py``) must
give transformers' logits, and the tree saved back through the mapping must
be the very file ``save_pretrained`` wrote.
"""

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support import hf_families
from tests.support.tolerances import assert_within
from tests.support.trees import flat, nest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHIPPED = {"llama": ost.mappings.llama, "mistral": ost.mappings.mistral, "qwen2": ost.mappings.qwen2,
           "qwen3": ost.mappings.qwen3, "gemma2": ost.mappings.gemma2, "gemma3": ost.mappings.gemma3,
           "mixtral": ost.mappings.mixtral, "qwen3_moe": ost.mappings.qwen3_moe, "olmo3": ost.mappings.olmo3}


@pytest.fixture(scope="module", params=hf_families.FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint directory, its config, (transformers' logits, their atol))."""
    name = request.param
    directory = str(tmp_path_factory.mktemp(name))
    hf_families.tiny_model(name, directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    return name, directory, config, hf_families.reference_logits(directory, hf_families.TOKENS)


def _sharded(shapes: dict) -> dict:
    """A target over a (2, 4) mesh: the first axis over "a" and the last over "b" where
    they divide, so stacked layers and experts, rows and columns are all cut."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def spec(shape):
        axes = [None] * len(shape)
        if len(shape) > 1 and shape[-1] % 4 == 0:
            axes[-1] = "b"
        if shape[0] % 2 == 0:
            axes[0] = "a"
        return P(*axes)

    return {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec(shape)))
            for name, shape in shapes.items()}


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_family_loads_into_flax_with_transformers_logits_and_saves_back_the_same_file(
        family, scan_layers, tmp_path):
    name, directory, config, (reference, atol) = family
    mapping = SHIPPED[name](config, scan_layers=scan_layers)
    assert ost.mappings.for_config(config, scan_layers=scan_layers).rules == mapping.rules
    stored = {n: t.shape for n, t in ost.metadata(directory).tensors.items()}
    shapes = mapping.tree_shapes(stored)  # from headers alone
    assert shapes == {leaf: value.shape for leaf, value in ost.load(directory, mapping=mapping).items()}
    if scan_layers:
        assert all(s[0] == config.num_hidden_layers for n, s in shapes.items() if n.startswith("model.layers."))
    target = _sharded(shapes)
    stats = ost.LoadStats()
    params = ost.load(directory, nest(target), mapping=mapping, stats=stats,
                      options=ost.LoadOptions(max_gap=0, max_overread=1.0))
    assert stats.bytes_read == stats.bytes_needed
    assert all(leaf.sharding == target[n].sharding for n, leaf in flat(params).items())
    logits = np.asarray(hf_families.forward(name, config, params, hf_families.TOKENS, scan_layers=scan_layers))
    assert np.abs(reference).max() > 1.0  # large enough for a wrong layout to show
    assert_within(logits, reference, atol, f"{name} logits")
    out = str(tmp_path / "back")
    ost.save(out, params, mapping=mapping, checksums=False)  # without: transformers' very bytes
    with open(os.path.join(directory, "model.safetensors"), "rb") as a, \
            open(os.path.join(out, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()


def test_bfloat16_checkpoint_into_a_float32_tree_and_back(tmp_path):
    directory = str(tmp_path / "bf16")
    hf_families.tiny_model("mixtral", directory, dtype="bfloat16")
    config = transformers.AutoConfig.from_pretrained(directory)
    mapping = ost.mappings.mixtral(config, scan_layers=True, dtype="bfloat16")
    shapes = mapping.tree_shapes({n: t.shape for n, t in ost.metadata(directory).tensors.items()})
    params = ost.load(directory, nest(_sharded(shapes)), mapping=mapping)
    assert all(leaf.dtype == np.float32 for leaf in flat(params).values())
    logits = np.asarray(hf_families.forward("mixtral", config, params, hf_families.TOKENS, scan_layers=True))
    assert_within(logits, *hf_families.reference_logits(directory, hf_families.TOKENS), "mixtral logits")
    ost.save(str(tmp_path / "back"), params, mapping=mapping, checksums=False)
    with open(os.path.join(directory, "model.safetensors"), "rb") as a, \
            open(tmp_path / "back" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="no shipped mapping for model_type 'gpt2'"):
        ost.mappings.for_config({"model_type": "gpt2"})
