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

import jax
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
    config = {**config, "model_type": "kimi_k2"}  # as Kimi-K2's config.json says
    assert ost.mappings.for_config(config).rules == ost.mappings.deepseek_v3(config).rules
    quantized = {n for n in ost.metadata(str(release)).tensors if n.endswith(".weight_packed")}
    assert quantized and all(".mlp.experts." in n for n in quantized)
    twin = _write_twin(tmp_path / "twin", config, cc.reference(release, "float32"))
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    for source, cfg, out in ((str(release), config, "from_int4"), (twin, plain, "from_twin")):
        ost.convert(source, str(tmp_path / out), mapping=ost.mappings.maxtext("kimi-k2-1t", cfg),
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


# --- kept as stored -----------------------------------------------------------------------------

KEPT = [("llama", scheme) for scheme in (*cc.SCHEMES, "modelopt-nvfp4")] + [
    ("deepseek_v3", "int4-group-asym"), ("deepseek_v3", "nvfp4"), ("deepseek_v3", "modelopt-nvfp4")]


def _stored(release: str) -> dict:
    return {name: cc._numpy(value) for name, value in cc.read_tensors(release).items()}


def _like_its_kernel(name: str, shape: tuple, mesh) -> jax.sharding.NamedSharding:
    """Codes split on their output axis (a kernel's last); a 2-D parameter beside them on its
    first (``[out, groups]`` as stored: the same rows); the rest replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    codes = name.endswith(("kernel", "kernel_packed"))
    axis = len(shape) - 1 if codes else len(shape) - 2 if len(shape) >= 2 and not name.endswith("kernel_shape") else None
    if axis is None or shape[axis] % 8:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(*[("x" if a == axis else None) for a in range(len(shape))]))


@pytest.mark.parametrize("model,scheme", KEPT, ids=[f"{m}-{s}" for m, s in KEPT])
def test_kept_as_stored_loads_sharded_and_saves_back_the_very_file(releases, model, scheme, tmp_path):
    """``for_config(config, dequantize=False)``: every tensor a leaf (the codes transposed as the
    kernel, their scales, zero points, second-level and activation scales as stored, each
    expert's stacked), loaded sharded with each scale split like its codes, saved back byte for
    byte."""
    from tests.support.trees_by_hand import assert_saves_back_the_file

    release, _, _, config = releases(model, scheme)
    mapping = ost.mappings.for_config(config, dequantize=False)
    assert mapping.quantization is None
    stored = _stored(release)
    whole = flat(ost.load(release, mapping=mapping, nest=True))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    target = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=_like_its_kernel(name, value.shape, mesh))
              for name, value in whole.items()}
    loaded = flat(ost.load(release, target, mapping=mapping, strict=True))
    assert loaded.keys() == whole.keys()
    kept = [name for name in loaded if name.endswith(("_packed", "_scale", "_zero_point", "_scale_2"))]
    assert kept, "nothing kept"
    for name, value in loaded.items():
        np.testing.assert_array_equal(bits(value), bits(whole[name]), err_msg=name)
        assert value.sharding == target[name].sharding, name
    if model == "llama":  # one tensor a leaf: each is its stored tensor (codes transposed)
        for name, value in whole.items():
            stored_name, rule = mapping.stored_rule(name)
            want = stored[stored_name].T if rule.transpose else stored[stored_name]
            assert value.dtype == want.dtype, name
            np.testing.assert_array_equal(bits(value), bits(want), err_msg=name)
    assert_saves_back_the_file(release, ost.load(release, mapping=mapping, nest=True), mapping, str(tmp_path / "back"))


@pytest.mark.slow  # Orbax writes and restores
def test_a_kept_int4_release_converts_to_maxtext_and_back_as_it_was(releases, tmp_path):
    """A Kimi-shaped INT4 release kept as stored, converted into MaxText's tree (the experts'
    codes, scales and zero points stacked) and back: the very file again."""
    import orbax.checkpoint as ocp

    release, _, _, config = releases("deepseek_v3", "int4-group-asym")
    mapping = ost.mappings.maxtext("deepseek3", config, dequantize=False)
    stats = ost.convert(release, str(tmp_path / "mt"), mapping=mapping, memory_budget="1MB")
    restored = flat(ocp.StandardCheckpointer().restore(stats.item_path))
    loaded = flat(ost.load(release, mapping=mapping, nest=True))
    codes = [n for n in loaded if n.endswith("wi_0_packed")]
    assert codes and all(loaded[n].dtype == np.int32 for n in codes)
    for name, value in loaded.items():
        np.testing.assert_array_equal(bits(restored["params.params." + name]), bits(value), err_msg=name)
    ost.convert(stats.item_path, str(tmp_path / "back"), mapping=mapping, checksums=False)
    with open(os.path.join(release, "model.safetensors"), "rb") as a, \
            open(tmp_path / "back" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_a_release_sharded_over_files_reads_codes_and_scales_across_them(releases, tmp_path):
    """An index whose files part each module: the codes in one file, their scales and zero points
    in another. The load is the one-file release's, bit for bit."""
    from safetensors.torch import save_file

    release, _, _, config = releases("llama", "int4-group-asym")
    sharded = tmp_path / "sharded"
    os.makedirs(sharded)
    tensors = cc.read_tensors(release)
    files = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if "_scale" not in n
                                                  and "_zero_point" not in n},
             "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if "_scale" in n
                                                  or "_zero_point" in n}}
    for file, part in files.items():
        save_file(part, str(sharded / file), metadata={"format": "pt"})
    weight_map = {name: file for file, part in files.items() for name in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    mapping = ost.mappings.for_config(config)
    target = sharded_target(mapping, release, ml_dtypes.bfloat16)
    got, want = flat(ost.load(str(sharded), target, mapping=mapping)), flat(ost.load(release, target, mapping=mapping))
    for name, value in want.items():
        np.testing.assert_array_equal(bits(got[name]), bits(value), err_msg=name)


def test_int4_experts_are_maxtext_s_own_dequantization(releases):
    """MaxText 0.2.5's Kimi-K2 converter dequantizes the INT4 experts with its own
    ``dequantize_pack_quantized_int4`` (``convert_deepseek_family_ckpt.py``, torch; the script
    imports MaxText, so the function alone is taken from its source): our bfloat16 load of every
    quantized tensor is its result, bit for bit."""
    import ast

    import torch

    from tests.families.test_quantized_references import _SCRIPTS, MAXTEXT_VENV

    script = next((os.path.join(root, _SCRIPTS, "convert_deepseek_family_ckpt.py")
                   for root, dirs, _ in os.walk(os.path.join(MAXTEXT_VENV, "lib")) if "maxtext" in dirs), None)
    if script is None or not os.path.exists(script):
        pytest.skip("MaxText 0.2.5's venv is not here")
    source = ast.parse(open(script).read())
    wanted = [node for node in source.body if isinstance(node, ast.FunctionDef) and
              node.name == "dequantize_pack_quantized_int4" or isinstance(node, ast.Assign) and
              any(getattr(t, "id", "") == "INT4_GROUP_SIZE" for t in node.targets)]
    namespace = {"torch": torch}
    exec(compile(ast.Module(wanted, []), script, "exec"), namespace)
    theirs = namespace["dequantize_pack_quantized_int4"]

    release, _, _, config = releases("deepseek_v3", "int4-group")
    stored = cc.read_tensors(release)
    modules = [n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")]
    mapping = ost.Mapping([ost.Rule(f"{m}.weight", f"{m}.weight") for m in modules],
                          quantization=ost.mappings.for_config(config).quantization)
    ours = ost.load(release, {f"{m}.weight": jax.ShapeDtypeStruct(tuple(stored[f"{m}.weight_shape"].tolist()),
                                                                   ml_dtypes.bfloat16) for m in modules},
                    mapping=mapping, strict="target")
    for m in modules:
        want = theirs(stored[f"{m}.weight_packed"], stored[f"{m}.weight_scale"], stored[f"{m}.weight_shape"].tolist())
        np.testing.assert_array_equal(bits(np.asarray(ours[f"{m}.weight"])), want.view(torch.int16).numpy().view(np.uint16),
                                      err_msg=m)
