"""``bench/quantized.py`` and its checkpoints: ours loads the numpy reference bit for bit.

The checkpoints (``tests/support/quantized_checkpoints.py``) are the bench's tiny DeepSeek-V3-shaped
FP8, gpt-oss-shaped MXFP4, Kimi-K2-shaped compressed-tensors INT4 and DeepSeek-V3-shaped
compressed-tensors NVFP4 releases. Ours loads every tensor of each, through the public API
into 8 sharded devices, equal bit for bit to the reference's twin, under the bench's split and
under splits that cut FP8 column blocks, MXFP4, INT4 and NVFP4 groups between devices. The
load-then-dequantize peer of the compressed-tensors releases, compressed-tensors' own
decompression, equals the reference bit for bit too. The quick bench runs
end to end (slow: a fresh process per run), every contender's output checked by the bench
itself before its row counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from tests.support import REPO
from tests.support import quantized_checkpoints as qc
from tests.support import quantized_reference

FAMILIES = {"fp8": (qc.write_deepseek, qc.deepseek_twins, qc.DEEPSEEK["tiny"]),
            "mxfp4": (qc.write_gpt_oss, qc.gpt_oss_twins, qc.GPT_OSS["tiny"]),
            "int4": (qc.write_kimi_int4, qc.kimi_int4_twins, qc.KIMI_INT4["tiny"]),
            "nvfp4": (qc.write_deepseek_nvfp4, qc.deepseek_nvfp4_twins, qc.DEEPSEEK_NVFP4["tiny"])}


def first(shape):
    """The bench's split: the first axis 8 divides (a Linear weight's rows, stacked experts)."""
    return next((a for a, d in enumerate(shape) if d % 8 == 0), None)


def last(shape):
    """The last axis 8 divides: cuts the FP8 column blocks (hidden 320: 40 columns a device),
    INT4's groups of 32 (40 and 24 columns a device) and NVFP4's of 16 (40 a device)."""
    return next((a for a in reversed(range(len(shape))) if shape[a] % 8 == 0), None)


def groups(shape):
    """A 3-D twin's axis 1: gpt-oss's ``[experts, in, out]`` split along ``in``, the axis its
    MXFP4 groups run along (320 / 8 and 192 / 8 values a device: groups of 32 cut)."""
    return 1 if len(shape) == 3 else first(shape)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {family: write(root / family, spec, seed=7) for family, (write, _, spec) in FAMILIES.items()}


def load(checkpoint: Path, twins: dict, split) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("x",))

    def sharding(shape):
        axis = split(shape) if len(shape) >= 2 else None
        return NamedSharding(mesh, P(*[("x" if a == axis else None) for a in range(len(shape))]))

    target = {name: jax.ShapeDtypeStruct(shape, qc.twin_dtype(how), sharding=sharding(shape))
              for name, (shape, how) in twins.items()}
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    scheme = {"fp8": lambda: ost.FP8(tuple(config["weight_block_size"])), "mxfp4": ost.MXFP4,
              "pack-quantized": lambda: ost.IntQuantized(4, 32),
              "nvfp4-pack-quantized": ost.NVFP4}[config.get("format", config["quant_method"])]()
    mapping = ost.Mapping([ost.Rule(p, p) for p in qc.identity_patterns(twins)], quantization=scheme)
    result = ost.load(str(checkpoint), target, mapping=mapping)
    for name, want in target.items():
        assert result[name].sharding.is_equivalent_to(want.sharding, len(want.shape)), name
    return result


@pytest.mark.parametrize("family, split", [
    ("fp8", first), ("fp8", last), ("mxfp4", first), ("mxfp4", last),
    ("int4", first), ("int4", last), ("nvfp4", first), ("nvfp4", last),
    pytest.param("mxfp4", groups, marks=pytest.mark.slow)])  # ~20 s: a read per expert row, 135K in all
def test_ours_loads_every_tensor_as_the_reference_bit_for_bit(checkpoints, family, split):
    twins = FAMILIES[family][1](FAMILIES[family][2])
    result = load(checkpoints[family], twins, split)
    assert set(result) == set(twins)
    for name, want in qc.reference_twins(checkpoints[family], twins):
        got = np.asarray(result[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)


def test_the_checkpoints_are_shaped_as_the_releases(checkpoints):
    fp8 = qc.weight_map(checkpoints["fp8"])
    header = qc.RawFile(str(checkpoints["fp8"] / fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])).header
    assert header["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["shape"] == [576, 320]
    assert header["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["dtype"] == "F8_E4M3"
    scales = qc.RawFile(str(checkpoints["fp8"] / fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]))
    assert scales.header["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]["shape"] == [5, 3]
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in fp8
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in fp8  # the router stays bf16
    mxfp4 = qc.weight_map(checkpoints["mxfp4"])
    blocks = qc.RawFile(str(checkpoints["mxfp4"] / mxfp4["model.layers.0.mlp.experts.gate_up_proj_blocks"]))
    assert blocks.header["model.layers.0.mlp.experts.gate_up_proj_blocks"] | {"data_offsets": None} == {
        "dtype": "U8", "shape": [8, 384, 10, 16], "data_offsets": None}
    config = json.loads((checkpoints["mxfp4"] / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4"}


def header_of(checkpoint: Path, name: str) -> dict:
    entry = qc.RawFile(str(checkpoint / qc.weight_map(checkpoint)[name])).header[name]
    return {"dtype": entry["dtype"], "shape": entry["shape"]}


def test_the_compressed_tensors_checkpoints_are_shaped_as_the_releases(checkpoints):
    """Kimi-K2-Thinking: routed experts INT4 (words, BF16 group scales, weight_shape), the rest
    bf16; the NVFP4 release: every Linear NVFP4, router bf16. compressed-tensors parses both configs."""
    QuantizationConfig = pytest.importorskip("compressed_tensors.quantization").QuantizationConfig

    int4, nvfp4 = checkpoints["int4"], checkpoints["nvfp4"]
    expert = "model.layers.1.mlp.experts.7.down_proj"  # [320, 192]
    assert header_of(int4, expert + ".weight_packed") == {"dtype": "I32", "shape": [320, 24]}
    assert header_of(int4, expert + ".weight_scale") == {"dtype": "BF16", "shape": [320, 6]}
    assert header_of(int4, expert + ".weight_shape") == {"dtype": "I64", "shape": [2]}
    for module in ("model.layers.1.mlp.shared_experts.down_proj", "model.layers.0.mlp.down_proj",
                   "model.layers.1.self_attn.kv_a_proj_with_mqa", "lm_head"):
        assert header_of(int4, module + ".weight")["dtype"] == "BF16", module
    assert not any(n.startswith("model.layers.1.self_attn.") and "weight_packed" in n for n in qc.weight_map(int4))
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa"  # [576, 320]
    assert header_of(nvfp4, kv_a + ".weight_packed") == {"dtype": "U8", "shape": [576, 160]}
    assert header_of(nvfp4, kv_a + ".weight_scale") == {"dtype": "F8_E4M3", "shape": [576, 20]}
    assert header_of(nvfp4, kv_a + ".weight_global_scale") == {"dtype": "F32", "shape": [1]}
    assert header_of(nvfp4, kv_a + ".input_global_scale") == {"dtype": "F32", "shape": [1]}
    assert header_of(nvfp4, "model.layers.1.mlp.shared_experts.up_proj.weight_packed")["dtype"] == "U8"
    assert header_of(nvfp4, "model.layers.1.mlp.gate.weight")["dtype"] == "BF16"
    for checkpoint, fmt in ((int4, "pack-quantized"), (nvfp4, "nvfp4-pack-quantized")):
        config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(config)
        assert parsed.format == fmt and list(parsed.config_groups) == ["group_0"]
    assert parsed.config_groups["group_0"].weights.group_size == 16


@pytest.mark.parametrize("family", ["int4", "nvfp4"])
def test_compressed_tensors_decompression_equals_the_reference_bit_for_bit(checkpoints, family):
    """The bench's load-then-dequantize peer (compressed-tensors 0.20.1's own decompress of whole
    torch tensors, the scale in its stored dtype) and the numpy reference agree on every tensor:
    its bf16 product (INT4) and its float32 ``scale / global`` times the code (NVFP4) round once."""
    from safetensors import safe_open

    pytest.importorskip("torch")  # the interop extra: compressed-tensors and torch
    pytest.importorskip("compressed_tensors")

    twins = FAMILIES[family][1](FAMILIES[family][2])
    peer = dict(qc.reference_twins(checkpoints[family], twins, open_file=partial(safe_open, framework="pt"),
                                   reference=False))
    for name, want in qc.reference_twins(checkpoints[family], twins):
        assert peer[name].dtype == want.dtype and peer[name].shape == want.shape, name
        np.testing.assert_array_equal(peer[name].view(np.uint8), want.view(np.uint8), err_msg=name)


def test_the_int4_and_nvfp4_unpackers_invert_the_packers():
    rng = np.random.default_rng(5)
    codes = rng.integers(-8, 8, (6, 64), dtype=np.int8)
    np.testing.assert_array_equal(qc.unpack_int4(quantized_reference.pack_int(codes, 4)), codes)
    nibbles = rng.integers(0, 16, (6, 64), dtype=np.uint8)
    np.testing.assert_array_equal(qc.unpack_nibbles(quantized_reference.pack_nibbles(nibbles)), nibbles)


def test_the_peers_float32_dequantizers_agree_with_the_reference():
    """load_dequantize's numpy (float32, whole tensors) equals the reference bit for bit: every
    FP8 code and e2m1 nibble, partial last blocks on both axes."""
    rng = np.random.default_rng(3)
    values, scales = quantized_reference.random_fp8(rng, (300, 200), (3, 2))
    np.testing.assert_array_equal(quantized_reference.bits(qc.dequantize_fp8(values, scales)),
                                  quantized_reference.bits(quantized_reference.fp8_reference(values, scales, qc.BLOCK)))
    blocks, exponents = quantized_reference.random_mxfp4(rng, (4, 24), 3)
    got = np.swapaxes(qc.dequantize_mxfp4(blocks, exponents), -1, -2)
    np.testing.assert_array_equal(quantized_reference.bits(got),
                                  quantized_reference.bits(quantized_reference.mxfp4_reference(blocks, exponents)))


@pytest.mark.parametrize("quantize, dequantize, step", [
    (qc.quantize_fp8, qc.dequantize_fp8, 1 / 8),  # e4m3: 3 mantissa bits
    (qc.quantize_mxfp4, qc.dequantize_mxfp4, 1 / 2)])  # e2m1 over a group: coarse
def test_quantizers_round_trip_through_the_reference(quantize, dequantize, step):
    x = np.random.default_rng(0).standard_normal((576, 320), dtype=np.float32)
    back = dequantize(*quantize(x))
    assert back.shape == x.shape
    assert np.abs(back - x).max() <= step * np.abs(x).max()


@pytest.mark.slow
def test_the_quick_bench_runs_and_checks_every_contender(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quantized.py"), "--quick", "--contenders", "ours,load_dequantize",
         "--conditions", "cold", "--attempts", "1", "--work-dir", str(tmp_path)],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split(" | ")[1:3] for row in rows] == [
        [family, contender] for family in ("fp8", "mxfp4", "int4", "nvfp4")
        for contender in ("ours", "load_dequantize")], done.stdout
    assert not any("failed" in row for row in rows), done.stdout
    assert "every tensor, bit for bit" in done.stdout
