"""``save(..., config=)``: the weights and their ``config.json`` committed together, so a save is a
model directory transformers loads, and nothing else of the user's there changes.

What a failure at any storage operation does to a ``config.json`` already there is
``test_overwrite_failures.py``'s ("sharded, with config.json").
"""

from __future__ import annotations

import json
import os

import fsspec
import numpy as np
import pytest

import orbax_safetensors as ost

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
          "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 32}
_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}


def _tree(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"a": np.full((4, 3), value, np.float32), "b": np.arange(5, dtype=np.int32)}


def test_config_json_is_written_beside_the_weights(tmp_path):
    ost.save(tmp_path / "m", _tree(), config={"model_type": "llama", "hidden_size": 3})
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {
        "model_type": "llama", "hidden_size": 3}
    assert sorted(ost.load(tmp_path / "m")) == ["a", "b"]  # the config is no tensor
    assert ost.verify(tmp_path / "m").ok


def test_an_overwrite_replaces_config_json_only_when_given_one_and_keeps_the_tokenizer(tmp_path):
    path = tmp_path / "m"
    ost.save(path, _tree(1.0), config={"v": 1}, max_shard_size=40)
    (path / "tokenizer.json").write_text('{"mine": true}')
    ost.save(path, _tree(2.0), overwrite=True)
    assert json.loads((path / "config.json").read_text()) == {"v": 1}  # not ours to drop
    ost.save(path, _tree(3.0), overwrite=True, config={"v": 3})
    assert json.loads((path / "config.json").read_text()) == {"v": 3}
    assert (path / "tokenizer.json").read_text() == '{"mine": true}'
    np.testing.assert_array_equal(ost.load(path)["a"], np.full((4, 3), 3.0, np.float32))


def test_async_save_and_object_stores_write_it_too(tmp_path):
    ost.async_save(tmp_path / "m", _tree(), config={"v": "async"}).result()
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {"v": "async"}
    url = "memory://config-test/m"  # final names, the index last (no renames)
    ost.save(url, _tree(), config={"v": "memory"})
    with fsspec.open(url + "/config.json", "rt") as f:
        assert json.load(f) == {"v": "memory"}
    fsspec.filesystem("memory").rm("/config-test", recursive=True)


def test_a_save_through_a_dequantizing_mapping_leaves_quantization_config_out(tmp_path):
    """The tensors a mapped save writes are plain, whatever release the mapping was made for:
    a config still saying FP8 would make transformers look for scales that are not there."""
    quantized = {**_LLAMA, "quantization_config": _FP8}
    plain_mapping, fp8_mapping = ost.mappings.llama(_LLAMA), ost.mappings.llama(quantized)
    stored = {name: np.zeros(shape, np.float32) for name, shape in {
        "model.embed_tokens.weight": (64, 16), "lm_head.weight": (64, 16),
        "model.norm.weight": (16,), "model.layers.0.input_layernorm.weight": (16,),
        "model.layers.0.post_attention_layernorm.weight": (16,),
        "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
        "model.layers.0.mlp.gate_proj.weight": (32, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 32)}.items()}
    ost.save(tmp_path / "src", stored)
    params = ost.load(tmp_path / "src", mapping=plain_mapping)
    ost.save(tmp_path / "out", params, mapping=fp8_mapping, config=quantized)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == _LLAMA
    ost.save(tmp_path / "raw", stored, config=quantized)  # no mapping: written as given
    assert json.loads((tmp_path / "raw" / "config.json").read_text()) == quantized


@pytest.mark.parametrize("config, error, words", [
    ({"x": float("nan")}, ost.ArgumentError, "JSON values"),
    ({"x": object()}, ost.ArgumentError, "JSON values"),
    ("config.json", ost.ArgumentTypeError, "transformers config or a dict"),
])
def test_a_config_that_is_no_config_json_is_refused_before_anything_is_written(tmp_path, config,
                                                                                error, words):
    with pytest.raises(error, match=words):
        ost.save(tmp_path / "m", _tree(), config=config)
    assert not (tmp_path / "m").exists()


def test_one_safetensors_file_has_no_directory_of_its_own_for_a_config(tmp_path):
    with pytest.raises(ost.ArgumentError, match="save to a directory"):
        ost.save(tmp_path / "x.safetensors", _tree(), config={"v": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_transformers_config_makes_a_directory_transformers_loads(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in _LLAMA.items() if k != "model_type"})
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    reference.save_pretrained(tmp_path / "src")
    mapping = ost.mappings.llama(config)
    ost.save(tmp_path / "out", ost.load(tmp_path / "src", mapping=mapping), mapping=mapping,
             config=config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)


def test_an_orbax_step_item_carries_its_config(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(0, args=ocp.args.Composite(
            params=ost.SafetensorsSave(_tree(), config={"model_type": "llama"})))
    assert json.loads((tmp_path / "run" / "0" / "params" / "config.json").read_text()) == {
        "model_type": "llama"}


def test_convert_to_safetensors_writes_the_config_and_to_orbax_has_no_place_for_it(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    ost.save(tmp_path / "hf", _tree())
    stats = ost.convert(tmp_path / "hf", tmp_path / "orbax", config={"v": "ignored"})
    assert stats.item_path == str(tmp_path / "orbax")
    assert not (tmp_path / "orbax" / "config.json").exists()
    ost.convert(tmp_path / "orbax", tmp_path / "back", config={"model_type": "llama"})
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == {"model_type": "llama"}
    np.testing.assert_array_equal(ost.load(tmp_path / "back")["a"], _tree()["a"])


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_config_json_that_is_no_file_is_refused_and_left_alone(tmp_path, kind):
    """A save replaces config.json by renaming over it: a directory or FIFO there is the user's,
    never moved to a backup name or read, with or without overwrite."""
    path = tmp_path / "m"
    path.mkdir()
    if kind == "directory":
        (path / "config.json").mkdir()
    else:
        os.mkfifo(path / "config.json")
    for overwrite in (False, True):
        with pytest.raises(ost.LocationTakenError, match="config.json.*not a file|not a file.*config.json"):
            ost.save(path, _tree(), config={"v": 1}, overwrite=overwrite)
    assert os.listdir(path) == ["config.json"]
