"""The box math of quantized tensors (``planning.quantization``) against the numpy reference
(``tests/support/quantized_reference.py``): any box of a dequantized twin, from the stored values and
only the scale blocks that cover it, is the reference's box bit for bit; and the errors."""

import json
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import orbax_safetensors as ost
from orbax_safetensors.planning.quantization import FP8, MXFP4, Quantized, scale_values
from tests.support.quantized_reference import BF16, bits, fp8_reference, mxfp4_reference, random_fp8, random_mxfp4
from tests.planning.test_mapping import box_in  # a non-empty box (empty ones: test_empty_boxes_are_empty)


def _slice(array, box):
    return array[tuple(slice(a, c) for a, c in box)]


def _check_box(q, weight, scales, reference, box):
    """``q`` reads ``box`` of ``reference`` from the boxes it names, and those scale boxes
    are exactly the scale blocks the box touches (never a block it does not)."""
    weight_box, scale_box = q.boxes(box)
    got = q.dequantize(_slice(weight, weight_box), (_slice(scales, scale_box),), box)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(_slice(reference, box)))
    return weight_box, scale_box


# Shapes and blocks: aligned, partial last blocks (DeepSeek-V3's kv_a_proj_with_mqa [576, 7168]
# with scales [5, 56], scaled down), blocks that are not square, a stacked leading axis.
FP8_CASES = [((64, 96), (32, 32)), ((72, 200), (32, 32)), ((24, 40), (16, 16)), ((48, 60), (16, 32)),
             ((3, 40, 36), (16, 16)), ((3, 40, 36), (1, 16, 16))]


@pytest.mark.parametrize("shape,block", FP8_CASES, ids=[f"{s}-{b}" for s, b in FP8_CASES])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fp8_block_boxes_are_the_reference_and_read_only_the_blocks_they_touch(shape, block, data):
    grid = tuple(shape[:len(shape) - len(block)]) + tuple(-(-n // b) for n, b in zip(shape[-len(block):], block))
    weight, scales = random_fp8(np.random.default_rng(len(shape) + block[-1]), shape, grid)
    q = Quantized(FP8(block), "w", "w_scale_inv", shape, grid)
    assert q.shape == shape
    box = data.draw(box_in(shape))
    weight_box, scale_box = _check_box(q, weight, scales, fp8_reference(weight, scales, block), box)
    assert weight_box == box
    blocks = (1,) * (len(shape) - len(block)) + tuple(block)
    assert scale_box == tuple((a // b, -(-c // b)) for (a, c), b in zip(box, blocks))


def test_a_box_cutting_a_partial_block_reads_that_block_s_scale_once():
    """Rows 64..72 of [72, 200] (block 32): the box cuts the partial last row block (rows 64..71)
    and the middle of column block 1; it needs scale row 2 and columns 1..3, nothing more."""
    weight, scales = random_fp8(np.random.default_rng(1), (72, 200), (3, 7))
    q = Quantized(FP8((32, 32)), "w", "s", (72, 200), (3, 7))
    box = ((60, 72), (40, 70))
    _, scale_box = _check_box(q, weight, scales, fp8_reference(weight, scales, (32, 32)), box)
    assert scale_box == ((1, 3), (1, 3))


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)], ids=["scalar", "one", "one-by-one"])
def test_fp8_per_tensor_scale_every_box_reads_the_one_scale(scale_shape):
    rng = np.random.default_rng(2)
    weight, scales = random_fp8(rng, (40, 24), scale_shape)
    q = Quantized(FP8(None), "w", "s", (40, 24), scale_shape)
    reference = fp8_reference(weight, scales, None)
    for box in [((0, 40), (0, 24)), ((3, 17), (5, 6)), ((39, 40), (0, 24))]:
        _, scale_box = _check_box(q, weight, scales, reference, box)
        assert scale_box == tuple((0, 1) for _ in scale_shape)


@pytest.mark.parametrize("scale_shape", [(40,), (40, 1), (1, 24)], ids=["rows", "rows-column", "columns"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fp8_per_channel_scales_read_the_channels_of_the_box(scale_shape, data):
    weight, scales = random_fp8(np.random.default_rng(3), (40, 24), scale_shape)
    q = Quantized(FP8(None), "w", "s", (40, 24), scale_shape)
    reference = (weight.astype(np.float64) * scales.reshape(scale_shape + (1,) * (2 - len(scale_shape)))
                 ).astype(np.float32)
    np.testing.assert_array_equal(bits(reference), bits(fp8_reference(weight, scales, None)))
    box = data.draw(box_in((40, 24)))
    _, scale_box = _check_box(q, weight, scales, reference, box)
    axis = 0 if scale_shape[0] == 40 else 1
    assert scale_box[axis] == box[axis]


@pytest.mark.parametrize("shape,block", FP8_CASES[:3] + [((300, 520), (128, 128))],
                         ids=[f"{s}-{b}" for s, b in FP8_CASES[:3]] + ["chunks-cut-blocks"])
@settings(max_examples=30, deadline=None)
@given(data=st.data(), strided=st.booleans())
def test_fp8_into_a_bfloat16_buffer_rounds_the_float32_product_once(shape, block, data, strided):
    """``dequantize(..., out=)``, what a load does into a bfloat16 leaf: the bits of the float32
    box cast once, into a strided view as well as a whole buffer; 300 x 520 is dequantized in
    chunks of rows that end inside a block (the chunk is 2 ** 16 values: 126 rows)."""
    grid = tuple(-(-n // b) for n, b in zip(shape, block))
    weight, scales = random_fp8(np.random.default_rng(shape[-1]), shape, grid)
    q = Quantized(FP8(block), "w", "w_scale_inv", shape, grid)
    box = data.draw(st.one_of(st.just(tuple((0, n) for n in shape)), box_in(shape)))
    weight_box, scale_box = q.boxes(box)
    want = fp8_reference(weight, scales, block)[tuple(slice(a, c) for a, c in box)].astype(BF16)
    buffer = np.full(tuple(2 * (c - a) if strided else c - a for a, c in box), np.nan, BF16)
    into = buffer[tuple(slice(None, None, 2 if strided else 1) for _ in box)]
    assert q.dequantize(_slice(weight, weight_box), (_slice(scales, scale_box),), box, out=into) is into
    np.testing.assert_array_equal(bits(into), bits(want))
    if strided:  # nothing written between the view's elements
        assert np.isnan(buffer[tuple(slice(1, None, 2) for _ in box)].astype(np.float32)).all()


def test_mxfp4_into_a_bfloat16_buffer():
    blocks, scales = random_mxfp4(np.random.default_rng(6), (2, 6), groups=3)
    q = Quantized(MXFP4(), "x_blocks", "x_scales", blocks.shape, scales.shape)
    box = ((1, 2), (5, 70), (1, 6))
    weight_box, scale_box = q.boxes(box)
    into = np.empty((1, 65, 5), BF16)
    q.dequantize(_slice(blocks, weight_box), (_slice(scales, scale_box),), box, out=into)
    want = mxfp4_reference(blocks, scales)[1:2, 5:70, 1:6].astype(BF16)
    np.testing.assert_array_equal(bits(into), bits(want))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_a_scaled_transposed_fp8_leaf_scales_the_float32_values(tmp_path, dtype):
    """A rule that transposes and scales (MaxText's query kernels): the load scales the float32
    twin, then rounds once to the target; the twin is never rounded to the target first."""
    from safetensors.numpy import save_file

    weight, scales = random_fp8(np.random.default_rng(7), (72, 40), (5, 3))
    save_file({"q.weight": weight, "q.weight_scale_inv": scales}, str(tmp_path / "model.safetensors"))
    scale = 1 / np.sqrt(24)  # not a power of two: rounding the twin first would show
    mapping = ost.Mapping([ost.Rule("q.weight", "q", transpose=(1, 0), scale=scale)],
                          quantization=ost.FP8((16, 16)))
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    target = {"q": jax.ShapeDtypeStruct((40, 72), dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "x" if 72 % len(jax.devices()) == 0 else None)))}
    got = np.asarray(ost.load(str(tmp_path), target, mapping=mapping)["q"])
    want = (fp8_reference(weight, scales, (16, 16)).T * np.float32(scale)).astype(dtype)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("swap_last", [True, False])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_mxfp4_boxes_cut_groups_and_are_the_reference(swap_last, data):
    """gpt-oss's layout: blocks [experts, rows, groups, 16] are twin [experts, groups * 32, rows]
    (``swap_last``); a box may start and stop inside a group of 32."""
    # Exponents up to 252: 6 * 2**125, the largest product, fits float32.
    blocks, scales = random_mxfp4(np.random.default_rng(4), (3, 10), groups=4, exponents=(0, 253))
    q = Quantized(MXFP4(swap_last=swap_last), "x_blocks", "x_scales", blocks.shape, scales.shape)
    reference = mxfp4_reference(blocks, scales, swap_last=swap_last)
    assert q.shape == reference.shape
    box = data.draw(box_in(reference.shape))
    weight_box, scale_box = _check_box(q, blocks, scales, reference, box)
    values = box[:-2] + (box[-1], box[-2]) if swap_last else box
    groups = (values[-1][0] // 32, -(-values[-1][1] // 32))
    assert scale_box == values[:-1] + (groups,)
    assert weight_box == scale_box + ((0, 16),)


@pytest.mark.parametrize("scheme,weight_shape,scale_shape,box", [
    (FP8(None), (40, 24), (40,), ((0, 1), (5, 5))),
    (MXFP4(), (3, 10, 4, 16), (3, 10, 4), ((0, 0), (0, 128), (0, 10))),
], ids=["fp8-per-row-empty-columns", "mxfp4-empty-experts"])
def test_empty_boxes_are_empty(scheme, weight_shape, scale_shape, box):
    q = Quantized(scheme, "w", "s", weight_shape, scale_shape)
    weight_box, scale_box = q.boxes(box)
    weight, scales = np.zeros(weight_shape, np.uint8), np.zeros(scale_shape, np.float32)
    got = q.dequantize(_slice(weight, weight_box), (_slice(scales, scale_box),), box)
    assert got.shape == tuple(c - a for a, c in box)


def test_mxfp4_every_exponent_and_nibble():
    """Exponent bytes 0..254 (2**-127 .. 2**127; 255 is E8M0's NaN) times every e2m1 code, the
    extremes included; with 2**126 and 2**127 only the codes up to 1.5, as 4 * 2**126 and
    2 * 2**127 are past float32 (refused:
    test_a_value_times_its_scale_past_float32_is_refused_whatever_the_target)."""
    nibbles = np.arange(16, dtype=np.uint8)
    blocks = np.broadcast_to(nibbles[0::2] | (nibbles[1::2] << 4), (255, 1, 2, 8)).reshape(255, 1, 1, 16).copy()
    blocks[-2:] &= 0xBB  # each nibble's sign and its two low bits: +-0 .. +-1.5
    scales = np.arange(255, dtype=np.uint8).reshape(255, 1, 1)
    q = Quantized(MXFP4(group=32), "x_blocks", "x_scales", blocks.shape, scales.shape)
    reference = mxfp4_reference(blocks, scales)
    _check_box(q, blocks, scales, reference, tuple((0, n) for n in reference.shape))
    assert np.abs(reference).max() == 1.5 * 2.0 ** 127 and (reference[1:] != 0).any()


def test_mxfp4_low_nibble_is_the_even_element():
    blocks = np.zeros((1, 1, 1, 16), np.uint8)
    blocks[..., 0] = 0x72  # low nibble 2 (1.0) first, high nibble 7 (6.0) second
    scales = np.full((1, 1, 1), 128, np.uint8)  # 2 ** 1
    q = Quantized(MXFP4(swap_last=False), "x_blocks", "x_scales", blocks.shape, scales.shape)
    got = q.dequantize(blocks, (scales,), ((0, 1), (0, 1), (0, 2)))
    assert got.tolist() == [[[2.0, 12.0]]]


@pytest.mark.parametrize("scheme,weight_shape,scale_shape,needs", [
    (FP8((128, 128)), (576, 7168), (4, 56), r"block \(128, 128\) needs scales \(5, 56\)"),
    (FP8((16, 16)), (24, 64), (2, 4, 1), "more axes than the weight"),
    (FP8(None), (24, 64), (2, 4), "each scale axis is 1 or the weight's"),
    (FP8((16, 16, 16)), (24, 64), (2, 4), "more axes than the weight"),
    (MXFP4(), (2, 8, 4, 16), (2, 8, 3), r"scales \[..., groups\]"),
    (MXFP4(), (2, 8, 4, 8), (2, 8, 4), r"blocks \[..., groups, 16\]"),
    (MXFP4(), (4, 16), (4,), "at least 2 axes before the groups"),
])
def test_scales_that_do_not_fit_name_both_tensors(scheme, weight_shape, scale_shape, needs):
    with pytest.raises(ost.MappingError, match=needs) as raised:
        Quantized(scheme, "layer.weight", "layer.weight_scale_inv", weight_shape, scale_shape)
    assert "'layer.weight'" in str(raised.value) and "'layer.weight_scale_inv'" in str(raised.value)


def test_scales_that_do_not_fit_are_refused_by_a_load_before_reading(tmp_path):
    from safetensors.numpy import save_file

    weight, _ = random_fp8(np.random.default_rng(5), (72, 64), (5, 4))
    save_file({"a.weight": weight, "a.weight_scale_inv": np.ones((4, 4), np.float32)},
              str(tmp_path / "model.safetensors"))
    mapping = ost.Mapping([ost.Rule("a.weight", "a")], quantization=ost.FP8((16, 16)))
    with pytest.raises(ost.MappingError, match=r"'a\.weight'.*'a\.weight_scale_inv'.*needs scales \(5, 4\)"):
        ost.load(str(tmp_path), mapping=mapping)


@pytest.mark.parametrize("spec,error", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not read"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "only e4m3"),
])
def test_a_quantization_config_we_do_not_read_is_an_argument_error(spec, error):
    config = {"model_type": "qwen3", "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "hidden_size": 8, "head_dim": 4, "quantization_config": spec}
    with pytest.raises(ost.ArgumentError, match=error):
        ost.mappings.for_config(json.loads(json.dumps(config)))


@pytest.mark.parametrize("make", [lambda: FP8((0, 128)), lambda: FP8(()), lambda: FP8((128,), scale_suffix=""),
                                  lambda: MXFP4(group=31), lambda: MXFP4(group=0)])
def test_a_scheme_with_impossible_parameters_is_refused(make):
    with pytest.raises(ost.MappingError):
        make()


# A quantized read keeps the rules of a plain read: casts checked, scales of a dtype the scheme
# reads, damage (a NaN scale) said.

def _fp8_file(tmp_path, scale_inv: np.ndarray, weight: np.ndarray | None = None) -> str:
    from safetensors.numpy import save_file

    if weight is None:
        weight = np.full((32, 32), 448, np.float32).astype(ml_dtypes.float8_e4m3fn)  # e4m3's largest
    save_file({"a.weight": weight, "a.weight_scale_inv": scale_inv}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


_FP8_MAPPING = ost.Mapping([ost.Rule("a.weight", "a")], quantization=ost.FP8((16, 16)))
_MXFP4_MAPPING = ost.Mapping([ost.Rule("e", "e")], quantization=ost.MXFP4(swap_last=False))


def _mxfp4_file(tmp_path, blocks: np.ndarray, scales: np.ndarray) -> str:
    """``e_blocks`` [1, 2, 16] and ``e_scales`` [1, 2]: ``e`` [1, 64] through ``_MXFP4_MAPPING``."""
    from safetensors.numpy import save_file

    save_file({"e_blocks": blocks, "e_scales": scales}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("transform", [{}, {"transpose": (1, 0)}, {"scale": 0.5}],
                         ids=["as-stored", "transposed", "scaled"])
def test_a_dequantized_value_past_a_float16_target_is_refused_as_a_stored_one_is(tmp_path, transform):
    """448 x 1000 overflows float16. Was: 162 infs of the 256 values, only numpy's
    RuntimeWarning; a float32 tensor of the same value into float16 is refused naming it."""
    path = _fp8_file(tmp_path, np.full((2, 2), 1000, np.float32))
    mapping = ost.Mapping([ost.Rule("a.weight", "a", **transform)], quantization=ost.FP8((16, 16)))
    target = {"a": jax.ShapeDtypeStruct((32, 32), np.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing leaks as a RuntimeWarning either
        with pytest.raises(ost.SafetensorsError, match="does not fit the target dtype float16") as raised:
            ost.load(path, target, mapping=mapping)
    assert "'a.weight'" in str(raised.value) and "model.safetensors" in str(raised.value)
    fits = ost.load(path, {"a": jax.ShapeDtypeStruct((32, 32), np.float32)}, mapping=mapping)["a"]
    assert np.isfinite(np.asarray(fits)).all()


def test_mxfp4_past_a_float16_target_is_refused(tmp_path):
    blocks = np.full((1, 2, 16), 0x77, np.uint8)  # 6.0, 6.0
    scales = np.full((1, 2), 127 + 20, np.uint8)  # 2 ** 20: 6 * 2 ** 20 is past float16's 65504
    path = _mxfp4_file(tmp_path, blocks, scales)
    with pytest.raises(ost.SafetensorsError, match="does not fit the target dtype float16"):
        ost.load(path, {"e": jax.ShapeDtypeStruct((1, 64), np.float16)}, mapping=_MXFP4_MAPPING)


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=["bfloat16", "float16", "float32"])
def test_fp8_scales_stored_as_any_float_load_exactly(tmp_path, dtype):
    weight, scales = random_fp8(np.random.default_rng(3), (32, 32), (2, 2))
    scales = scales.astype(dtype)
    path = _fp8_file(tmp_path, scales, weight)
    got = ost.load(path, mapping=_FP8_MAPPING)["a"]
    want = fp8_reference(weight, scales.astype(np.float32), (16, 16))
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(want))


@pytest.mark.parametrize("stored,scales,error", [
    ("fp8", np.full((2, 2), 3, np.int32), r"'a\.weight_scale_inv' is stored as I32; FP8 reads F32 or BF16 or F16"),
    ("mxfp4", np.full((1, 2), 127, BF16), r"'e_scales' is stored as BF16; MXFP4 reads U8 or F8_E8M0"),
])
def test_scales_of_a_dtype_the_scheme_does_not_read_are_refused_before_reading(tmp_path, stored, scales, error):
    """Was: I32 FP8 scales loaded silently (values up to 4e11); BF16 MXFP4 scales raised numpy's
    'operands could not be broadcast', no ost.Error."""
    if stored == "fp8":
        path, mapping = _fp8_file(tmp_path, scales), _FP8_MAPPING
    else:
        path, mapping = _mxfp4_file(tmp_path, np.zeros((1, 2, 16), np.uint8), scales), _MXFP4_MAPPING
    with pytest.raises(ost.MappingError, match=error):
        ost.load(path, mapping=mapping)


@pytest.mark.parametrize("scheme", ["fp8-nan", "fp8-inf", "mxfp4-0xff"])
def test_a_nan_scale_is_damage_said_naming_the_tensor_not_a_leaked_warning(tmp_path, scheme):
    """Was (MXFP4 exponent 0xFF, NaN in the MX spec): +-inf values and numpy's ldexp overflow
    warning; transformers and MaxText compute the same inf."""
    if scheme.startswith("fp8"):
        scales = np.ones((2, 2), np.float32)
        scales[1, 0] = np.nan if scheme == "fp8-nan" else np.inf
        path, mapping, name = _fp8_file(tmp_path, scales), _FP8_MAPPING, "a.weight_scale_inv"
    else:
        scales = np.full((1, 2), 127, np.uint8)
        scales[0, 1] = 0xFF
        path = _mxfp4_file(tmp_path, np.full((1, 2, 16), 0x22, np.uint8), scales)
        mapping, name = _MXFP4_MAPPING, "e_scales"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ost.SafetensorsError, match="the first at flat index") as raised:
            ost.load(path, mapping=mapping)
        assert f"'{name}'" in str(raised.value) and "model.safetensors" in str(raised.value)
        with pytest.raises(ost.SafetensorsError, match="the first at flat index"):  # a conversion too
            ost.convert(tmp_path / "model.safetensors", tmp_path / "out", mapping=mapping)


@pytest.mark.parametrize("dtype", [None, np.float32, BF16, np.float16],
                         ids=["as-read", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scheme", ["fp8", "mxfp4"])
def test_a_value_times_its_scale_past_float32_is_refused_whatever_the_target(tmp_path, scheme, dtype):
    """448 x 1e36 (FP8) and 6 x 2 ** 127 (MXFP4 exponent 254) are past float32, the dtype the
    products are computed in: as inf they would pass even a float16 target's range check (its
    infinity holds them), so a damaged scale would load as infs with numpy's overflow warning."""
    if scheme == "fp8":
        path = _fp8_file(tmp_path, np.full((2, 2), 1e36, np.float32))  # 448 x 1e36
        mapping, leaf, shape = _FP8_MAPPING, "a", (32, 32)
    else:
        path = _mxfp4_file(tmp_path, np.full((1, 2, 16), 0x77, np.uint8), np.full((1, 2), 254, np.uint8))  # 6 x 2**127
        mapping, leaf, shape = _MXFP4_MAPPING, "e", (1, 64)
    target = None if dtype is None else {leaf: jax.ShapeDtypeStruct(shape, dtype)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ost.SafetensorsError, match="past float32") as raised:
            ost.load(path, target, mapping=mapping)
        named = "'a.weight'" if scheme == "fp8" else "'e_blocks'"
        assert named in str(raised.value) and "model.safetensors" in str(raised.value)
        if dtype is None:  # a conversion too
            with pytest.raises(ost.SafetensorsError, match="past float32"):
                ost.convert(tmp_path / "model.safetensors", tmp_path / "out", mapping=mapping)


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu, ml_dtypes.bfloat16,
                                   np.float16])
def test_scale_values_are_the_cast_of_every_bit_pattern(dtype):
    """Scales read as float32 by table (FP8) or shift (bfloat16) are the cast's own bits, NaNs
    included, for every pattern of the type, through strided views as a box reads them."""
    patterns = np.arange(1 << (8 * np.dtype(dtype).itemsize), dtype=np.uint32)
    values = patterns.astype(np.uint8 if np.dtype(dtype).itemsize == 1 else np.uint16).view(dtype)
    strided = values.reshape(-1, 16)[:, 1::3]
    for scales in (values, strided):
        got = scale_values(scales)
        assert got.dtype == np.float32 and got.shape == scales.shape
        assert got.tobytes() == scales.astype(np.float32).tobytes()
