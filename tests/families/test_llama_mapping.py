"""The shipped Llama mapping against transformers: same logits both ways.

A tiny ``LlamaForCausalLM`` (GQA, untied head) with every weight randomised
(norm weights too, so swapping two norms or transposing the wrong way shows
in the logits) is saved with ``save_pretrained``; the Flax model of
``examples/flax_llama.py`` loads it through ``ost.mappings.llama`` and must
give transformers' logits; its params, saved back through the mapping from
sharded arrays, must be the same tensors and load in transformers with the
same logits.
"""

import importlib.util
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.hf_reference import write_random_llama
from tests.support.tolerances import assert_within, causal_lm_reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flax")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

_EXAMPLE = os.path.join(str(REPO), "examples", "flax_llama.py")
_TOKENS = np.random.default_rng(1).integers(0, 256, (2, 10), dtype=np.int32)


def _example():
    spec = importlib.util.spec_from_file_location("flax_llama_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


flax_llama = _example()


def _torch_logits(directory) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits and each one's atol against another float32 forward."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return causal_lm_reference(model, _TOKENS)


def _assert_same_tensors(directory, expected_directory) -> None:
    """The same names, dtypes and bytes in both directories' ``model.safetensors``."""
    ours, theirs = (safetensors_numpy.load_file(os.path.join(d, "model.safetensors"))
                    for d in (directory, expected_directory))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].tobytes() == theirs[name].tobytes(), name


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama") / "tiny")
    write_random_llama(directory)
    return directory


@pytest.fixture(scope="module")
def reference(hf_dir):
    return _torch_logits(hf_dir)


def test_flax_llama_gives_transformers_logits(hf_dir, reference):
    reference, atol = reference
    model, params = flax_llama.load(hf_dir)
    assert model.config.rope_theta == 500.0 and model.config.rms_norm_eps == 1e-5
    assert params["model"]["layers_1"]["self_attn"]["k_proj"]["kernel"].shape == (64, 2, 16)
    assert params["model"]["layers_0"]["self_attn"]["o_proj"]["kernel"].shape == (4, 16, 64)
    logits = np.asarray(model.apply({"params": params}, _TOKENS))
    assert np.abs(reference).max() > 1.0  # logits large enough for a wrong layout to show
    print(f"flax vs transformers: max abs diff {np.abs(logits - reference).max():.3g}")
    assert_within(logits, reference, atol, "flax logits")


def _tensor_parallel(abstract, mesh):
    """Heads and MLP columns over "model", the other matrix axis over "data"."""
    specs = {
        "q_proj": P("data", "model", None), "k_proj": P(None, "data", None),
        "v_proj": P(None, "data", None), "o_proj": P("model", None, "data"),
        "gate_proj": P("data", "model"), "up_proj": P("data", "model"), "down_proj": P("model", "data"),
        "embed_tokens": P(None, "model"), "lm_head": P("data", "model"),
    }

    def shard(path, leaf):
        module = next((k.key for k in reversed(path) if getattr(k, "key", None) in specs), None)
        spec = specs[module] if module is not None else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(shard, abstract)


@pytest.fixture(scope="module")
def sharded(hf_dir):
    model, _ = flax_llama.load(hf_dir)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    target = _tensor_parallel(flax_llama.abstract_params(model.config), mesh)
    stats = ost.LoadStats()
    params = ost.load(hf_dir, target, mapping=ost.mappings.llama(), stats=stats,
                      options=ost.LoadOptions(max_overread=1.0, max_gap=0))
    return model, target, params, stats


def test_tensor_parallel_load_reads_only_the_needed_bytes(sharded, reference):
    model, target, params, stats = sharded
    assert jax.tree.all(jax.tree.map(lambda a, t: a.sharding == t.sharding, params, target))
    print(f"tensor-parallel mapped load: bytes_read {stats.bytes_read}, bytes_needed {stats.bytes_needed}")
    assert stats.bytes_read == stats.bytes_needed
    logits = np.asarray(jax.jit(model.apply)({"params": params}, _TOKENS))
    assert_within(logits, *reference, "flax logits")


def test_save_through_the_mapping_round_trips_to_transformers(sharded, hf_dir, reference, tmp_path):
    model, _, params, _ = sharded
    out = str(tmp_path / "saved")
    # From sharded arrays; without checksums, the very bytes transformers wrote.
    ost.save(out, params, mapping=ost.mappings.llama(), checksums=False)
    _assert_same_tensors(out, hf_dir)
    with open(os.path.join(out, "model.safetensors"), "rb") as a, \
            open(os.path.join(hf_dir, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()  # header, order and offsets too: the very file save_pretrained wrote
    shutil.copy(os.path.join(hf_dir, "config.json"), out)
    round_trip, atol = _torch_logits(out)
    flax_logits = np.asarray(model.apply({"params": jax.device_get(params)}, _TOKENS))
    print(f"transformers after the round trip vs flax: max abs diff {np.abs(round_trip - flax_logits).max():.3g}")
    assert_within(round_trip, flax_logits, atol, "transformers after the round trip vs flax")


def test_checkpoint_manager_saves_flax_params_as_a_transformers_checkpoint(sharded, hf_dir, reference,
                                                                          tmp_path):
    """Through Orbax: each step's item is the HF checkpoint, restored into the Flax tree."""
    import orbax.checkpoint as ocp

    model, target, params, _ = sharded
    llama = ost.mappings.llama()
    with ocp.CheckpointManager(tmp_path / "run", item_names=("params",)) as manager:
        manager.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(params, mapping=llama)))
        manager.wait_until_finished()
        restored = manager.restore(1, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(target, mapping=llama)))["params"]
    item = tmp_path / "run" / "1" / "params"
    shutil.copy(os.path.join(hf_dir, "config.json"), item)
    _assert_same_tensors(str(item), hf_dir)
    assert_within(_torch_logits(str(item))[0], *reference, "transformers on the saved step")
    assert jax.tree.all(jax.tree.map(lambda a, t: a.sharding == t.sharding, restored, target))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, params)
    logits = np.asarray(jax.jit(model.apply)({"params": restored}, _TOKENS))
    assert_within(logits, *reference, "flax logits of the restored step")
    with pytest.raises(ost.MappingError):
        ost.SafetensorsSave({"not.a.llama.name": np.zeros(2)}, mapping=llama)


def test_llama_mapping_sizes_come_from_the_config(hf_dir):
    config = transformers.LlamaConfig.from_pretrained(hf_dir)
    loaded = ost.load(hf_dir, mapping=ost.mappings.llama(config))  # no target: sizes from config
    assert loaded["model.layers_0.self_attn.q_proj.kernel"].shape == (64, 4, 16)
    assert loaded["model.layers_0.self_attn.v_proj.kernel"].shape == (64, 2, 16)
    assert loaded["model.layers_1.self_attn.o_proj.kernel"].shape == (4, 16, 64)
    assert loaded["lm_head.kernel"].shape == (64, 256)
    with pytest.raises(ost.SafetensorsError, match=r"ost\.mappings\.llama\(\) needs the model.s config"):
        ost.load(hf_dir, mapping=ost.mappings.llama())  # heads unknown without config or target


def test_example_script_reports_a_match(hf_dir, capsys):
    assert flax_llama.main([hf_dir]) == 0
    out = capsys.readouterr().out
    assert "(match)" in out and "identical params" in out
