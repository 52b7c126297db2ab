"""Quantized releases through the public API: an FP8 block-scaled release of a tiny Qwen3 reads
through the family mapping exactly as its dequantized twin (the float32 release of the same
values) does, dequantized or kept, into sharded targets, through a conversion, and back out as
an ordinary Hugging Face release.

The twin is written by an independent numpy dequantizer (``fp8 * scale`` in float32, the
block given, partial last blocks included: block (24, 40) cuts every tiny Qwen3 weight), and
its logits come from transformers, so a load that mixed up a block, a scale or a layout shows.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import orbax_safetensors as ost  # noqa: E402
from tests.support.sharded_targets import sharded_target  # noqa: E402
from tests.support.trees import flat  # noqa: E402

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BLOCK = (24, 40)  # divides no tiny Qwen3 axis: every weight has partial last blocks
TOKENS = np.array([[3, 17, 42, 99, 5, 64, 7, 120]])


def _quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8 values and float32 scales (amax / 448 per block) of a float32 ``weight``."""
    rows, cols = -(-weight.shape[0] // BLOCK[0]), -(-weight.shape[1] // BLOCK[1])
    scales = np.empty((rows, cols), np.float32)
    values = np.empty(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            cut = np.s_[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scales[i, j] = np.float32(np.abs(weight[cut]).max() / 448)
            values[cut] = (weight[cut] / scales[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return values, scales


def _dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    expanded = np.repeat(np.repeat(scales, BLOCK[0], 0), BLOCK[1], 1)[:values.shape[0], :values.shape[1]]
    return values.astype(np.float32) * expanded


def _save(tensors: dict[str, np.ndarray], directory: str, config: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    as_torch = {name: torch.from_numpy(np.asarray(v).view(np.uint8)).view(torch.float8_e4m3fn)
                if v.dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(v))
                for name, v in tensors.items()}
    save_file(as_torch, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """``(fp8 release, its float32 twin, the FP8 config, the twin's config, quantized names)``."""
    from safetensors.torch import load_file

    from tests.support.hf_families import tiny_model

    root = tmp_path_factory.mktemp("quantized")
    tiny_model("qwen3", str(root / "bf16"), dtype="bfloat16")
    stored = {k: v.float().numpy() for k, v in load_file(str(root / "bf16" / "model.safetensors")).items()}
    with open(root / "bf16" / "config.json") as f:
        config = json.load(f)
    fp8, twin, quantized = {}, {}, []
    for name, value in stored.items():
        if value.ndim == 2 and (".self_attn." in name or ".mlp." in name):
            values, scales = _quantize(value)
            fp8[name], fp8[name + "_scale_inv"] = values, scales
            twin[name] = _dequantize(values, scales)
            quantized.append(name)
        else:
            fp8[name] = twin[name] = value.astype(ml_dtypes.bfloat16).astype(np.float32)
    fp8_config = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                     "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}
    _save(fp8, str(root / "fp8"), fp8_config)
    _save(twin, str(root / "twin"), {**config, "dtype": "float32"})
    return str(root / "fp8"), str(root / "twin"), fp8_config, config, quantized


def _host(tree: dict) -> dict:
    return {name: np.asarray(value) for name, value in flat(tree).items()}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_fp8_release_loads_as_its_dequantized_twin(releases, scan_layers):
    fp8, twin, fp8_config, config, _ = releases
    quantized = ost.mappings.for_config(fp8_config, scan_layers=scan_layers)
    assert quantized.quantization == ost.FP8(BLOCK)
    target = sharded_target(quantized, fp8)
    loaded = ost.load(fp8, target, mapping=quantized)
    expected = ost.load(twin, target, mapping=ost.mappings.for_config(config, scan_layers=scan_layers))
    got, want = _host(loaded), _host(expected)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert flat(loaded)[name].sharding == target[name].sharding


def test_fp8_release_gives_transformers_logits_of_its_twin(releases):
    from tests.support.hf_families import forward, reference_logits

    fp8, twin, fp8_config, _, _ = releases
    tree = ost.load(fp8, mapping=ost.mappings.for_config(fp8_config), nest=True)
    logits = np.asarray(forward("qwen3", _config(fp8_config), tree, TOKENS, scan_layers=False))
    expected, atol = reference_logits(twin, TOKENS)
    assert np.all(np.abs(logits - expected) <= atol)


def _config(values: dict):
    import transformers

    values = {k: v for k, v in values.items() if k != "quantization_config"}
    return transformers.Qwen3Config(**values)


def test_bfloat16_target_rounds_the_float32_product_once(releases):
    fp8, twin, fp8_config, config, _ = releases
    mapping = ost.mappings.for_config(fp8_config)
    target = sharded_target(mapping, fp8, dtype=jax.numpy.bfloat16)
    got = _host(ost.load(fp8, target, mapping=mapping))
    want = _host(ost.load(twin, mapping=ost.mappings.for_config(config)))
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value.astype(ml_dtypes.bfloat16), err_msg=name)


def test_kept_fp8_weights_and_their_scales(releases):
    from safetensors.torch import load_file

    fp8, _, fp8_config, _, quantized = releases
    mapping = ost.mappings.for_config(fp8_config, dequantize=False)
    assert mapping.quantization is None
    loaded = flat(ost.load(fp8, mapping=mapping, nest=True))
    stored = {name: (value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value).numpy()
              for name, value in load_file(os.path.join(fp8, "model.safetensors")).items()}
    for name in quantized:
        kernel = mapping.tree_name(name)
        assert loaded[kernel].dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(loaded[kernel].view(np.uint8), stored[name].T)
        np.testing.assert_array_equal(loaded[kernel + "_scale"], stored[name + "_scale_inv"].T)


def test_convert_fp8_release_to_maxtext_equals_converting_its_twin(releases, tmp_path):
    import orbax.checkpoint as ocp

    fp8, twin, fp8_config, config, _ = releases
    for source, cfg, out in ((fp8, fp8_config, "from_fp8"), (twin, config, "from_twin")):
        ost.convert(source, str(tmp_path / out), mapping=ost.mappings.maxtext("qwen3", cfg), dtype="bfloat16",
                    memory_budget="64MB")
    restored = [flat(ocp.StandardCheckpointer().restore(str(tmp_path / out / "0" / "items")))
                for out in ("from_fp8", "from_twin")]
    assert restored[0].keys() == restored[1].keys()
    for name, value in restored[1].items():
        np.testing.assert_array_equal(np.asarray(restored[0][name]), np.asarray(value), err_msg=name)


def test_dequantized_model_saves_as_an_ordinary_release(releases, tmp_path):
    from safetensors.numpy import load_file

    fp8, twin, fp8_config, _, quantized = releases
    tree = ost.load(fp8, mapping=ost.mappings.for_config(fp8_config), nest=True)
    ost.save(tmp_path / "out", tree, mapping=ost.mappings.for_config(fp8_config, dtype="bfloat16"))
    saved = {}
    for file in os.listdir(tmp_path / "out"):
        if file.endswith(".safetensors"):
            saved.update(load_file(str(tmp_path / "out" / file)))  # the Rust validator reads it
    expected = load_file(os.path.join(twin, "model.safetensors"))
    assert saved.keys() == expected.keys()  # the bf16 release's names: no scales
    for name in quantized:
        np.testing.assert_array_equal(saved[name], expected[name].astype(ml_dtypes.bfloat16), err_msg=name)


def test_scales_that_do_not_fit_the_block_name_both_tensors(releases, tmp_path):
    fp8, _, fp8_config, _, quantized = releases
    wrong = {**fp8_config, "quantization_config": {**fp8_config["quantization_config"], "weight_block_size": [16, 16]}}
    with pytest.raises(ost.MappingError, match=r"_scale_inv.*block \(16, 16\) needs scales"):
        ost.load(fp8, mapping=ost.mappings.for_config(wrong))


def test_an_unread_quantization_method_is_refused(releases):
    _, _, fp8_config, _, _ = releases
    gptq = {**fp8_config, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ost.ArgumentError, match="quant_method 'gptq'"):
        ost.mappings.for_config(gptq)


def test_strict_target_counts_the_scales_as_used(releases):
    fp8, _, fp8_config, _, _ = releases
    mapping = ost.mappings.for_config(fp8_config)
    target = sharded_target(mapping, fp8)
    loaded = ost.load(fp8, target, mapping=mapping, strict=True)
    assert set(flat(loaded)) == set(target)


def test_fp8_weights_without_their_scales_are_refused(releases, tmp_path):
    """A release missing a scale tensor would load that weight off by its scale, silently."""
    from safetensors.torch import load_file, save_file

    fp8, _, fp8_config, _, quantized = releases
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    del tensors[quantized[0] + "_scale_inv"]
    os.makedirs(tmp_path / "damaged")
    save_file(tensors, str(tmp_path / "damaged" / "model.safetensors"))
    with pytest.raises(ost.MappingError, match=f"FP8 tensors have no scales .*{quantized[0]}"):
        ost.load(str(tmp_path / "damaged"), mapping=ost.mappings.for_config(fp8_config))
    with pytest.raises(ost.MappingError, match="FP8 tensors have no scales"):
        ost.convert(str(tmp_path / "damaged"), str(tmp_path / "out"), mapping=ost.mappings.for_config(fp8_config))
    assert not (tmp_path / "out").exists()
