"""compressed-tensors and ModelOpt NVFP4 releases read through ``ost.mappings.for_config``, against
the formats' own dequantization (``tests/support/compressed_checkpoints.py``: checkpoints written
by compressed-tensors 0.20's ``ModelCompressor`` and by a transcription of ModelOpt 0.47's
exporter, checked bit for bit against the real one; references by the libraries' own
decompression).

A Llama and a DeepSeek-V3 MoE (Kimi-K2's architecture: the INT4 expert stacks) in each
scheme, loaded into targets sharded over the 8 CPU devices along their two largest axes (4 × 2):
with hidden 64, a device holds 16 input values of a weight, so INT4's groups of 32 are cut
between devices (NVFP4's 16 are not; the planning and multi-process tests cut those).

* A float32 load is the reference's float32 twin bit for bit, a bfloat16 load that twin rounded
  once, which is also what transformers' own dequantized load holds
  (``CompressedTensorsConfig(dequantize=True)``, computed in the scale's dtype).
* A plain bfloat16 save of the loaded tree is an ordinary release: transformers loads it and its
  logits are the reference twin's, and for the Llama those of transformers' own dequantized load
  of the quantized release. Not for the DeepSeek: there transformers 5.24 cannot load asymmetric
  INT4 or INT8 experts, does not divide NVFP4 experts by their global scale, and where it loads
  the experts right (its state dict, buffers and config equal to our save's loaded plain, bit for
  bit) its forward still differs in the MoE layer, by up to 2.7 times the logits' atol.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support.quantized_reference import bits
from tests.support.sharded_targets import sharded_target
from tests.support.trees import flat

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tests.support import compressed_checkpoints as cc  # noqa: E402  (needs the interop extra)

MODELS = ("llama", "deepseek_v3")
CASES = [(model, scheme) for model in MODELS for scheme in (*cc.SCHEMES, "modelopt-nvfp4")]
TOKENS = np.array([[1, 17, 5, 200, 33, 64, 2, 9]])


def _write_twin(directory, config: dict, tensors: dict) -> str:
    """A plain release of ``tensors`` (no quantization_config): what the quantized one stands for."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "quantization_config"}, f)
    return str(directory)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """(model, scheme) → (quantized release, float32 twin, bfloat16 twin, config), written once."""
    root, made = tmp_path_factory.mktemp("compressed"), {}

    def release(model: str, scheme: str):
        if (model, scheme) not in made:
            path = root / f"{model}-{scheme}"
            if scheme == "modelopt-nvfp4":
                config = cc.write_modelopt_nvfp4(path, model=model)["config"]
                twins = {dtype: cc.modelopt_reference(path, dtype) for dtype in ("float32", "bfloat16")}
            else:
                config = cc.write_compressed(path, scheme, model=model)["config"]
                twins = {dtype: cc.reference(path, dtype) for dtype in ("float32", "bfloat16")}
            made[model, scheme] = (str(path), _write_twin(root / f"{model}-{scheme}-twin32", config, twins["float32"]),
                                   _write_twin(root / f"{model}-{scheme}-twin16", config, twins["bfloat16"]), config)
        return made[model, scheme]

    return release


def _host(tree) -> dict:
    return {name: np.asarray(value) for name, value in flat(tree).items()}


@pytest.mark.parametrize("model,scheme", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_sharded_loads_are_the_format_s_own_dequantization(releases, model, scheme):
    path, twin32, twin16, config = releases(model, scheme)
    mapping = ost.mappings.for_config(config)
    assert mapping.quantization is not None
    plain = ost.mappings.for_config({k: v for k, v in config.items() if k != "quantization_config"})
    for dtype, twin in ((np.float32, twin32), (ml_dtypes.bfloat16, twin16)):
        target = sharded_target(mapping, path, dtype)
        loaded = ost.load(path, target, mapping=mapping, strict=True)  # every stored tensor accounted for
        got = _host(loaded)
        want = _host(ost.load(twin, target, mapping=plain))
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(bits(got[name]), bits(value), err_msg=f"{dtype.__name__} {name}")
            assert flat(loaded)[name].sharding == target[name].sharding
        if dtype is np.float32:  # the bfloat16 twin is the float32 one rounded once
            twin_values = want
    for name, value in got.items():
        np.testing.assert_array_equal(bits(value), bits(twin_values[name].astype(ml_dtypes.bfloat16)), err_msg=name)


@pytest.mark.slow  # a transformers forward per case
@pytest.mark.parametrize("model,scheme", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_a_plain_bfloat16_save_gives_transformers_logits(releases, model, scheme, tmp_path):
    from safetensors.numpy import load_file

    from tests.support.hf_families import reference_logits
    from tests.support.tolerances import assert_within

    path, _, twin16, config = releases(model, scheme)
    tree = ost.load(path, mapping=ost.mappings.for_config(config), nest=True)
    out = tmp_path / "plain"
    mapping = ost.mappings.for_config(config, dtype="bfloat16")
    ost.save(out, tree, mapping=mapping, options=ost.SaveOptions(config=config))
    saved = load_file(str(out / "model.safetensors"))
    twin = load_file(os.path.join(twin16, "model.safetensors"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert saved.keys() == {n for n in twin if n in saved} and len(saved) == len(twin)
    logits, atol = reference_logits(str(out), TOKENS)
    expected, _ = reference_logits(twin16, TOKENS)
    assert_within(logits, expected, atol)
    if model == "llama" and scheme != "modelopt-nvfp4":  # transformers reads no ModelOpt release
        assert_within(logits, cc.transformers_logits(path, TOKENS), atol)


@pytest.mark.slow  # two conversions and Orbax restores
def test_converting_a_kimi_shaped_int4_release_to_maxtext_equals_converting_its_twin(tmp_path):
    """Kimi-K2-Thinking's layout (DeepSeek-V3's architecture, the routed experts INT4 group 32,
    attention, shared experts and the dense MLP bfloat16): ``ost.convert`` into MaxText's tree,
    per shard under a memory budget, is the conversion of its dequantized twin leaf for leaf."""
    import orbax.checkpoint as ocp

    release = tmp_path / "kimi"
    config = cc.write_compressed(release, "int4-group", model="deepseek_v3", ignore=cc.KIMI_K2_IGNORE)["config"]
    quantized = {n for n in ost.metadata(str(release)).tensors if n.endswith(".weight_packed")}
    assert quantized and all(".mlp.experts." in n for n in quantized)
    twin = _write_twin(tmp_path / "twin", config, cc.reference(release, "float32"))
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    for source, cfg, out in ((str(release), config, "from_int4"), (twin, plain, "from_twin")):
        ost.convert(source, str(tmp_path / out), mapping=ost.mappings.maxtext("deepseek3", cfg),
                    dtype="bfloat16", memory_budget="1MB")
    restored = [flat(ocp.StandardCheckpointer().restore(str(tmp_path / out / "0" / "items")))
                for out in ("from_int4", "from_twin")]
    assert restored[0].keys() == restored[1].keys()
    for name, value in restored[1].items():
        np.testing.assert_array_equal(bits(restored[0][name]), bits(value), err_msg=name)


def _damaged(release: str, directory, change) -> str:
    """``release`` rewritten with ``change`` applied to its tensors (torch, as stored)."""
    from safetensors.torch import save_file

    tensors = cc.read_tensors(release)
    change(tensors)
    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(release, "config.json")) as f:
        (directory / "config.json").write_text(f.read())
    return str(directory)


_Q = "model.layers.0.self_attn.q_proj"
DAMAGE = {  # what is done to layer 0's q_proj → the error and what it must say
    "zero-point-missing": (lambda t: t.pop(f"{_Q}.weight_zero_point"), ost.MappingError,
                           rf"'{_Q}.weight'.*'{_Q}.weight_zero_point' is missing"),
    "scale-mis-shaped": (lambda t: t.update({f"{_Q}.weight_scale": t[f"{_Q}.weight_scale"][:, :1].contiguous()}),
                         ost.MappingError, rf"'{_Q}.weight'.*groups of 32"),
    "zero-point-mis-shaped": (lambda t: t.update({f"{_Q}.weight_zero_point": t[f"{_Q}.weight_zero_point"][:1]}),
                              ost.MappingError, rf"zero points '{_Q}.weight_zero_point' are \(1, 2\)"),
    "scale-nan": (lambda t: t[f"{_Q}.weight_scale"].view(-1)[3].fill_(float("nan")), ost.SafetensorsError,
                  rf"'{_Q}.weight_scale' holds 1 NaN"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_release_is_refused_naming_the_tensor(releases, damage, tmp_path):
    change, error, message = DAMAGE[damage]
    release, _, _, config = releases("llama", "int4-group-asym")
    damaged = _damaged(release, tmp_path / "damaged", change)
    with pytest.raises(error, match=message):
        ost.load(damaged, mapping=ost.mappings.for_config(config))


def test_a_global_scale_missing_from_an_nvfp4_release_is_refused(releases, tmp_path):
    release, _, _, config = releases("llama", "nvfp4")
    name = "model.layers.1.mlp.down_proj.weight_global_scale"
    damaged = _damaged(release, tmp_path / "damaged", lambda t: t.pop(name))
    with pytest.raises(ost.MappingError, match=f"'{name}' is missing"):
        ost.load(damaged, mapping=ost.mappings.for_config(config))
