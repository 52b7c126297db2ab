"""A scanned, MaxText-shaped train state through Orbax's ``CheckpointManager``.

The params item of each step is saved through ``ost.mappings.maxtext`` as a
Hugging Face directory that transformers loads with the original logits, and
a state is restored from a Hugging Face directory (the one transformers
wrote) straight into the scanned, sharded tree, with no conversion step. The
MaxText forward itself is checked against MaxText in
``tests/families/test_maxtext_mapping.py``.
"""

import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support import hf_families
from tests.support.tolerances import assert_within
from tests.support.trees import flat, nest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ocp = pytest.importorskip("orbax.checkpoint")

# MaxText's logical sharding of a scanned llama decoder, with "embed" on fsdp and heads/mlp on tensor.
_SPECS = {
    "query": P("fsdp", None, "tensor", None), "key": P("fsdp", None, None, None),
    "value": P("fsdp", None, None, None), "out": P("tensor", None, None, "fsdp"),
    "wi_0": P("fsdp", None, "tensor"), "wi_1": P("fsdp", None, "tensor"), "wo": P("tensor", None, "fsdp"),
    "embedding": P("tensor", "fsdp"), "logits_dense": P("fsdp", "tensor"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("llama") / "hf")
    hf_families.tiny_model("llama", directory)
    return directory


def _state_target(shapes: dict) -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))

    def spec(name):
        return next((s for key, s in _SPECS.items() if f".{key}." in f".{name}."), P())

    return {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec(name)))
            for name, shape in shapes.items()}


def test_checkpoint_manager_saves_hf_steps_and_restores_hf_into_the_scanned_state(hf_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    mapping = ost.mappings.maxtext("llama3.1", config, scan_layers=True)
    shapes = {n: v.shape for n, v in ost.load(hf_dir, mapping=mapping).items()}
    assert shapes["decoder.layers.self_attention.query.kernel"] == (64, 2, 4, 16)  # layers at axis 1
    assert shapes["decoder.layers.pre_self_attention_layer_norm.scale"] == (64, 2)
    target = nest(_state_target(shapes))
    params = ost.load(hf_dir, target, mapping=mapping)  # the step-0 state, from the HF files
    state = {"params": params, "step": np.int64(0)}
    reference, atol = hf_families.reference_logits(hf_dir, hf_families.TOKENS)

    with ocp.CheckpointManager(tmp_path / "run", item_names=("params", "extra")) as manager:
        for step in (1, 2):
            state = {"params": jax.tree.map(lambda x: x * 1.0, state["params"]), "step": np.int64(step)}
            manager.save(step, args=ocp.args.Composite(
                params=ost.SafetensorsSave(state["params"], mapping=mapping, checksums=False),
                extra=ocp.args.JsonSave({"step": int(state["step"])})))
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2]
        restored = manager.restore(2, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(target, mapping=mapping), extra=ocp.args.JsonRestore()))
    assert restored["extra"] == {"step": 2}
    item = str(tmp_path / "run" / "2" / "params")
    with open(os.path.join(hf_dir, "model.safetensors"), "rb") as a, \
            open(os.path.join(item, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()  # 1/sqrt(16) is a power of two: exact both ways
    shutil.copy(os.path.join(hf_dir, "config.json"), item)
    # The same bytes through transformers' kernels, whose rounding may follow the buffers' alignment.
    assert_within(hf_families.reference_logits(item, hf_families.TOKENS)[0], reference, atol, "logits")
    for name, leaf in flat(restored["params"]).items():
        expected = flat(params)[name]
        assert leaf.sharding == expected.sharding
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected), err_msg=name)

    # No conversion step: the directory transformers itself wrote restores into the scanned state.
    with ocp.CheckpointManager(tmp_path / "imported", item_names=("params",)) as manager:
        shutil.copytree(hf_dir, tmp_path / "imported" / "0" / "params")
        imported = manager.restore(0, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(target, mapping=mapping)))["params"]
    for name, leaf in flat(imported).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat(params)[name]), err_msg=name)


def test_maxtext_names_what_it_does_not_map():
    with pytest.raises(ValueError, match="no MaxText mapping for 'llama2-7b'; families: llama3.1, qwen3") as info:
        ost.mappings.maxtext("llama2-7b", {"num_attention_heads": 4, "hidden_size": 64})
    assert "llama3.1: llama3.1-8b, llama3.1-8b-Instruct" in str(info.value)  # the model names too


@pytest.mark.parametrize("name", ["qwen3-zzz", "qwen3-", "llama3.1-8", "gemma3-4b-it", "Qwen3", "mixtral-8x7b "])
def test_maxtext_takes_a_family_or_a_model_name_exactly(name):
    """A name that merely starts like a family's is another model (``qwen3-next-…`` is not
    ``qwen3``): refused, not given the family's mapping."""
    config = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2}
    with pytest.raises(ost.ArgumentError, match=f"no MaxText mapping for {name!r}"):
        ost.mappings.maxtext(name, config)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-30b-a3b", "llama3.1-405b", "mixtral-8x22b", "gpt-oss-120b"])
def test_maxtext_model_names_give_their_familys_mapping(name):
    config = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2, "num_key_value_heads": 2}
    from orbax_safetensors.mappings.maxtext import family_of

    assert ost.mappings.maxtext(name, config).rules == ost.mappings.maxtext(family_of(name), config).rules
