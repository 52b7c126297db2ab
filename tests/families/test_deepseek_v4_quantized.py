"""DeepSeek-V4's release as it ships: routed experts in MXFP4 (``X.weight`` I8, two E2M1 codes a
byte, low nibble first; ``X.scale`` an E8M0 exponent per 32 inputs) beside block-scaled FP8
(``X.weight`` F8_E4M3, ``X.scale`` an E8M0 exponent per block), the config's
``quantization_config`` ``{"quant_method": "fp8", "scale_fmt": "ue8m0", ...}`` and
``expert_dtype: "fp4"`` (the layout transformers 5.24's ``finegrained_fp8.py`` and MaxText
0.2.5's ``deepseek_dequantize.py`` read).

The tiny release of tests/families/test_deepseek_v4_mapping.py is quantized here (FP8 blocks of
16 × 16, so the shards cut them), its dequantized twin computed by the numpy reference (a code
times a power of two: exact in float32) and checked against MaxText's own ``dequantize_fp8`` /
``dequantize_mxfp4`` where its venv is present. Loads through ``ost.mappings.deepseek_v4`` and
``ost.mappings.maxtext("deepseek4")`` into float32 and bfloat16 trees sharded over 8 devices
equal loading the twin, bit for bit.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support.quantized_reference import bits, e2m1
from tests.support.sharded_targets import sharded_target
from tests.support.trees import flat

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.families.test_maxtext_mapping import write_checkpoint  # noqa: E402

BLOCK = 16
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
# The release's FP8 modules: every Linear but the routed experts (MXFP4) and what V4 ships
# bfloat16 (the compressors, the indexer's weights_proj, the router, the head).
FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
_E2M1_VALUES = e2m1(np.arange(16))


def _exponents(amax: np.ndarray, top: float) -> np.ndarray:
    """E8M0 exponents (biased bytes) whose power of two brings ``amax`` under ``top``."""
    return (np.ceil(np.log2(np.maximum(amax, 1e-30) / top)) + 127).clip(1, 254).astype(np.uint8)


def _fp8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FP8 codes, E8M0 block exponents, and the float32 twin (codes times powers: exact)."""
    rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
    padded = np.zeros((rows * BLOCK, cols * BLOCK), np.float32)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    amax = np.abs(padded.reshape(rows, BLOCK, cols, BLOCK)).max(axis=(1, 3))
    exponents = _exponents(amax, 448.0)
    scale = np.repeat(np.repeat(np.ldexp(1.0, exponents.astype(np.int64) - 127), BLOCK, 0), BLOCK, 1)
    scale = scale[:weight.shape[0], :weight.shape[1]]
    codes = (weight / scale).astype(ml_dtypes.float8_e4m3fn)
    return codes, exponents, (codes.astype(np.float64) * scale).astype(np.float32)


def _fp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MXFP4 bytes (I8), E8M0 exponents per 32 inputs, and the float32 twin."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    exponents = _exponents(np.abs(groups).max(-1), 6.0)
    scale = np.ldexp(1.0, exponents.astype(np.int64) - 127)[..., None]
    nibbles = np.abs((groups / scale)[..., None] - _E2M1_VALUES).argmin(-1).reshape(weight.shape)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    twin = (_E2M1_VALUES[nibbles].reshape(groups.shape) * scale).reshape(weight.shape).astype(np.float32)
    return packed, exponents, twin


def _torch(value: np.ndarray, e8m0: bool = False):
    if e8m0:
        return torch.from_numpy(value).view(torch.float8_e8m0fnu)
    if value.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(value.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(value))


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """(quantized release, its float32 twin, the quantized config, the twin's config, MaxText's
    bf16 dequantization or None)."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("deepseek_v4_quantized")
    twin_dir, release_dir = root / "twin", root / "release"
    write_checkpoint("deepseek4", str(twin_dir), release=True)
    stored = load_file(str(twin_dir / "model.safetensors"))
    quantized, twin, maxtext = {}, dict(stored), {}
    for name, value in stored.items():
        module = name.removesuffix(".weight")
        if ".ffn.experts." in name and name.endswith(".weight"):
            codes, exponents, twin[name] = _fp4(value)
        elif name.endswith(".weight") and module.split(".", 2)[-1] in FP8_MODULES:
            codes, exponents, twin[name] = _fp8(value)
        else:
            quantized[name] = _torch(value)
            continue
        quantized[name], quantized[module + ".scale"] = _torch(codes), _torch(exponents, e8m0=True)
        maxtext[name] = (codes, exponents)
    os.makedirs(release_dir)
    save_file(quantized, str(release_dir / "model.safetensors"), metadata={"format": "pt"})
    from safetensors.numpy import save_file as save_numpy

    save_numpy(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((twin_dir / "config.json").read_text())
    release_config = {**config, "quantization_config": QUANTIZATION, "expert_dtype": "fp4"}
    (release_dir / "config.json").write_text(json.dumps(release_config))
    return str(release_dir), str(twin_dir), release_config, config, maxtext


MAPPINGS = {"flax": lambda config, scan: ost.mappings.deepseek_v4(config),
            "maxtext-unscanned": lambda config, scan: ost.mappings.maxtext("deepseek4", config, scan_layers=False),
            "maxtext-scanned": lambda config, scan: ost.mappings.maxtext("deepseek4", config, scan_layers=True)}


@pytest.mark.parametrize("which", sorted(MAPPINGS))
def test_fp4_experts_and_fp8_blocks_load_as_the_twin(releases, which):
    release, twin, release_config, config, _ = releases
    mapping = MAPPINGS[which](release_config, None)
    assert {type(s).__name__ for s in mapping.quantization} == {"FP8", "MXFP4Packed"}
    view = mapping.stored_view({n: t.shape for n, t in ost.metadata(release).tensors.items()})
    assert {type(q.scheme).__name__ for n, q in view.quantized.items() if ".ffn.experts." in n} == {"MXFP4Packed"}
    assert {type(q.scheme).__name__ for n, q in view.quantized.items() if ".ffn.experts." not in n} == {"FP8"}
    plain = MAPPINGS[which](config, None)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        target = sharded_target(mapping, release, dtype)
        got = flat(ost.load(release, target, mapping=mapping, strict=True))
        want = flat(ost.load(twin, target, mapping=plain))
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(bits(got[name]), bits(value), err_msg=f"{dtype.__name__} {name}")
            assert got[name].sharding == target[name].sharding


def test_the_twin_is_maxtext_s_own_dequantization(releases):
    """MaxText 0.2.5's ``deepseek_dequantize.py`` (pure torch, imported from its venv's
    site-packages) gives the twin rounded once to bfloat16, bit for bit."""
    import importlib.util

    from safetensors.numpy import load_file

    from tests.families.test_quantized_references import MAXTEXT_VENV, _SCRIPTS

    script = next((os.path.join(root, _SCRIPTS, "deepseek_dequantize.py")
                   for root, dirs, _ in os.walk(os.path.join(MAXTEXT_VENV, "lib")) if "maxtext" in dirs), None)
    if script is None or not os.path.exists(script):
        pytest.skip("MaxText 0.2.5's venv is not here")
    spec = importlib.util.spec_from_file_location("deepseek_dequantize", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, twin, _, _, quantized = releases
    values = load_file(os.path.join(twin, "model.safetensors"))
    for name, (codes, exponents) in quantized.items():
        scales = torch.from_numpy(exponents)  # E8M0 as bytes: what its dequantizers decode
        theirs = (module.dequantize_mxfp4(_torch(codes), scales) if codes.dtype == np.int8
                  else module.dequantize_fp8(_torch(codes), scales, block_size=BLOCK))
        ours = values[name].astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(theirs.view(torch.int16).numpy(), ours.view(np.int16), err_msg=name)


@pytest.mark.parametrize("which", sorted(MAPPINGS))
def test_kept_as_stored_saves_back_the_very_file(releases, which, tmp_path):
    """``dequantize=False``: the FP8 codes and the experts' MXFP4 bytes as leaves (transposed as
    their kernels, never split by heads or groups), their E8M0 exponents beside them as stored,
    the bfloat16 modules as their mapping has them; saved back, the very file."""
    from tests.support.trees_by_hand import assert_saves_back_the_file

    release, _, release_config, _, _ = releases
    mapping = (ost.mappings.deepseek_v4(release_config, dequantize=False) if which == "flax" else
               ost.mappings.maxtext("deepseek4", release_config, scan_layers=which == "maxtext-scanned",
                                    dequantize=False))
    tree = ost.load(release, mapping=mapping, nest=True, strict=True)
    dtypes = {str(v.dtype) for v in flat(tree).values()}
    assert {"int8", "float8_e4m3fn", "float8_e8m0fnu"} <= dtypes, dtypes
    assert_saves_back_the_file(release, tree, mapping, str(tmp_path / "back"))
