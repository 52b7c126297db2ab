"""The box math of group-quantized tensors (``planning.group_quantization``) against the numpy
reference (``tests/support/quantized_reference.py``): any box of a dequantized twin, from the
words holding its codes and only the scale and zero-point groups it touches, is the reference's
box bit for bit; and the errors, each naming the tensor."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import orbax_safetensors as ost
from orbax_safetensors.planning.dequantized import dequantized
from tests.planning.test_mapping import box_in
from tests.support.quantized_reference import BF16, bits, e2m1, int_reference, nvfp4_reference, pack_int, pack_nibbles


def _slice(array, box):
    return array[tuple(slice(a, c) for a, c in box)]


def _read(q, stored, box, out=None):
    boxes = q.boxes(box)
    arrays = [_slice(stored[name], b) for name, b in zip(q.stored, boxes)]
    return q.dequantize(arrays[0], arrays[1:], box, out=out), boxes


def _shapes(stored):
    return {name: value.shape for name, value in stored.items()}


def _int_release(rng, shape, bits, group, symmetric, packed, scale_dtype=np.float32):
    """Random codes of every value, scales that are not bfloat16 numbers, and (asymmetric)
    zero points that differ per group; stored as compressed-tensors writes them."""
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    codes = rng.integers(low, high, shape)
    groups = shape[:-1] + ((shape[-1] // group,) if group else (1,))
    scales = (rng.uniform(0.5, 2.0, groups) * 2.0 ** rng.integers(-12, -4, groups)).astype(scale_dtype)
    zeros = None if symmetric else rng.integers(low, high, groups)
    stored = {"m.weight_packed" if packed else "m.weight": pack_int(codes, bits) if packed else codes.astype(np.int8),
              "m.weight_scale": scales}
    if packed:  # pack-quantized records the width the words only bound
        stored["m.weight_shape"] = np.array(shape, np.int64)
    if zeros is not None:
        stored["m.weight_zero_point"] = pack_int(zeros, bits, axis=-2) if packed else zeros.astype(np.int8)
    blocks = (1,) * (len(shape) - 1) + ((group,) if group else (shape[-1],))
    return stored, int_reference(codes, scales.astype(np.float32), zeros, blocks)


INT_CASES = [  # shape, bits, group, symmetric, packed
    ((40, 96), 4, 32, True, True), ((40, 96), 4, 32, False, True), ((24, 64), 4, None, True, True),
    ((24, 64), 4, None, False, True), ((3, 20, 64), 4, 16, False, True), ((16, 48), 8, 16, True, True),
    ((16, 40), 2, 8, False, True), ((24, 40), 8, None, False, False), ((24, 40), 8, 8, True, False),
    ((36, 36), 4, 4, True, True),  # 36 codes in 5 words: the last word half used
]


@pytest.mark.parametrize("shape,bits_,group,symmetric,packed", INT_CASES,
                         ids=[f"{s}-int{b}-g{g}-{'sym' if y else 'asym'}-{'packed' if p else 'int8'}"
                              for s, b, g, y, p in INT_CASES])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_int_boxes_are_the_reference_and_read_only_the_groups_they_touch(shape, bits_, group, symmetric, packed,
                                                                          data):
    rng = np.random.default_rng(len(shape) * 100 + bits_ + (group or 0))
    stored, reference = _int_release(rng, shape, bits_, group, symmetric, packed)
    view = dequantized([ost.IntQuantized(bits_, group, symmetric=symmetric, packed=packed)], _shapes(stored))
    q = view.quantized["m.weight"]
    assert view == {"m.weight": shape} and q.shape == shape
    box = data.draw(box_in(shape))
    got, boxes = _read(q, stored, box)
    np.testing.assert_array_equal(bits(got), bits(_slice(reference, box)))
    per = 32 // bits_ if packed else 1
    (a, c) = box[-1]
    assert boxes[0] == box[:-1] + ((a // per, -(-c // per)),)  # the words holding the box's codes
    width = group or shape[-1]
    scale_box = box[:-1] + ((a // width, -(-c // width)),)
    assert boxes[1] == scale_box  # the groups it touches, never one more
    if not symmetric:
        rows = scale_box[-2]
        assert boxes[2] == (scale_box[:-2] + ((rows[0] // per, -(-rows[1] // per)),) + scale_box[-1:]
                            if packed else scale_box)


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_nvfp4_boxes_are_the_reference_in_either_layout(layout, data):
    """Every code (-0.0 included: ModelOpt reads it as +0.0) and FP8 scale; the second-level
    scale divides (compressed-tensors) or multiplies (ModelOpt) the group scale first."""
    rng = np.random.default_rng(9)
    nibbles = rng.integers(0, 16, (24, 80))
    scales = rng.uniform(0.01, 400, (24, 5)).astype(ml_dtypes.float8_e4m3fn)
    second = np.array([0.37], np.float32) if layout == "compressed-tensors" else np.array(0.37, np.float32)
    names = ((".weight_packed", ".weight_global_scale") if layout == "compressed-tensors"
             else (".weight", ".weight_scale_2"))
    stored = {"m" + names[0]: pack_nibbles(nibbles), "m.weight_scale": scales, "m" + names[1]: second,
              "m.input_scale": np.array(1.0, np.float32)}
    view = dequantized([ost.NVFP4(layout)], _shapes(stored))
    assert view == {"m.weight": (24, 80)}  # the activation scale is no part of the weight
    reference = nvfp4_reference(nibbles, scales.astype(np.float32), float(second.reshape(-1)[0]), layout)
    box = data.draw(box_in((24, 80)))
    got, _ = _read(view.quantized["m.weight"], stored, box)
    np.testing.assert_array_equal(bits(got), bits(_slice(reference, box)))


def test_nvfp4_zero_codes_keep_each_layout_s_sign():
    nibbles = np.array([[8, 0] * 8])
    stored = {"m.weight_packed": pack_nibbles(nibbles), "m.weight_scale": np.ones((1, 1), ml_dtypes.float8_e4m3fn),
              "m.weight_global_scale": np.ones(1, np.float32)}
    q = dequantized([ost.NVFP4()], _shapes(stored)).quantized["m.weight"]
    got, _ = _read(q, stored, ((0, 1), (0, 16)))
    assert np.signbit(got[0, 0]) and not np.signbit(got[0, 1])
    modelopt = {"m.weight": stored["m.weight_packed"], "m.weight_scale": stored["m.weight_scale"],
                "m.weight_scale_2": np.array(1.0, np.float32)}
    q = dequantized([ost.NVFP4("modelopt")], _shapes(modelopt)).quantized["m.weight"]
    got, _ = _read(q, modelopt, ((0, 1), (0, 16)))
    assert not np.signbit(got).any()


@pytest.mark.parametrize("scale_dtype", [np.float32, BF16], ids=["float32-scales", "bfloat16-scales"])
@settings(max_examples=30, deadline=None)
@given(data=st.data(), strided=st.booleans())
def test_int_into_a_bfloat16_buffer_rounds_the_float32_value_once(scale_dtype, data, strided):
    """What a bfloat16 load does: the float32 box cast once, into a strided view too; 300 rows
    of 512 are dequantized in runs of 128 rows."""
    rng = np.random.default_rng(11)
    stored, reference = _int_release(rng, (300, 512), 4, 32, False, True, scale_dtype)
    q = dequantized([ost.IntQuantized(4, 32, symmetric=False)], _shapes(stored)).quantized["m.weight"]
    box = data.draw(st.one_of(st.just(((0, 300), (0, 512))), box_in((300, 512))))
    buffer = np.full(tuple(2 * (c - a) if strided else c - a for a, c in box), np.nan, BF16)
    into = buffer[tuple(slice(None, None, 2 if strided else 1) for _ in box)]
    got, _ = _read(q, stored, box, out=into)
    assert got is into
    np.testing.assert_array_equal(bits(into), bits(_slice(reference, box).astype(BF16)))


def test_a_recorded_width_the_words_do_not_hold_is_refused_by_name():
    """Per channel, the words only bound the width: 60 codes fill 8 words as 64 would."""
    rng = np.random.default_rng(12)
    stored, _ = _int_release(rng, (8, 64), 4, None, True, True)
    stored["m.weight_shape"] = np.array([8, 60])
    q = dequantized([ost.IntQuantized(4)], _shapes(stored)).quantized["m.weight"]
    assert "m.weight_shape" in q.stored
    problem = q.problem(q.stored.index("m.weight_shape") - 1, stored["m.weight_shape"])
    assert "'m.weight_shape' records the weight as [8, 60]" in problem and "[8, 64]" in problem


@pytest.mark.parametrize("change,needs", [
    (lambda s: s.pop("m.weight_zero_point"), r"'m.weight_zero_point' is missing"),
    (lambda s: s.update({"m.weight_scale": np.ones((40, 4), np.float32)}), r"4 groups of 32 are 128 values"),
    (lambda s: s.update({"m.weight_scale": np.ones((20, 3), np.float32)}), r"each scale axis must be 1"),
    (lambda s: s.update({"m.weight_zero_point": np.ones((40, 3), np.int32)}), r"needs \(5, 3\)"),
], ids=["missing-zero-point", "groups-past-the-words", "scale-rows", "zero-points-unpacked"])
def test_misfit_parameters_are_refused_naming_the_tensor(change, needs):
    stored, _ = _int_release(np.random.default_rng(13), (40, 96), 4, 32, False, True)
    change(stored)
    with pytest.raises(ost.MappingError, match=needs) as raised:
        dequantized([ost.IntQuantized(4, 32, symmetric=False)], _shapes(stored))
    assert "m.weight" in str(raised.value)


def test_nvfp4_without_its_second_level_scale_is_refused():
    stored = {"m.weight_packed": np.zeros((4, 8), np.uint8), "m.weight_scale": np.ones((4, 1), np.float32)}
    with pytest.raises(ost.MappingError, match=r"'m.weight_global_scale' is missing"):
        dequantized([ost.NVFP4()], _shapes(stored))


def test_damaged_parameters_are_named():
    stored = {"m.weight_packed": np.zeros((2, 16), np.uint8),
              "m.weight_scale": np.ones((2, 2), ml_dtypes.float8_e4m3fn),
              "m.weight_global_scale": np.zeros(1, np.float32)}
    q = dequantized([ost.NVFP4()], _shapes(stored)).quantized["m.weight"]
    assert "'m.weight_global_scale' is 0" in q.problem(1, stored["m.weight_global_scale"])
    scales = stored["m.weight_scale"].copy()
    scales[1, 1] = np.nan
    assert "'m.weight_scale' holds 1 NaN or infinite" in q.problem(0, scales)


def test_a_tensor_two_schemes_would_read_is_refused_and_only_parts_them():
    stored, _ = _int_release(np.random.default_rng(14), (8, 32), 8, None, True, False)
    stored.update({"n.weight": np.zeros((8, 32), ml_dtypes.float8_e4m3fn), "n.weight_scale": np.ones((8, 1), np.float32)})
    both = [ost.IntQuantized(8, packed=False), ost.FP8(scale_suffix="_scale")]
    with pytest.raises(ost.MappingError, match="read by two quantization schemes"):
        dequantized(both, _shapes(stored))
    parted = [ost.IntQuantized(8, packed=False, only="m"), ost.FP8(scale_suffix="_scale", only="n")]
    view = dequantized(parted, _shapes(stored))
    assert {k: type(q.scheme).__name__ for k, q in view.quantized.items()} == {"m.weight": "IntQuantized",
                                                                                "n.weight": "FP8"}


@pytest.mark.parametrize("make,needs", [
    (lambda: ost.IntQuantized(3), "bits 3"), (lambda: ost.IntQuantized(4, 0), "group 0: a positive int"),
    (lambda: ost.NVFP4("other"), "layout 'other'"), (lambda: ost.IntQuantized(only="("), "not a regular expression"),
], ids=["bits", "group", "layout", "only"])
def test_schemes_refuse_what_they_cannot_read(make, needs):
    with pytest.raises(ost.MappingError, match=needs):
        make()


@pytest.mark.parametrize("stored_as", ["U8", "F8_E8M0"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_mxfp4_packed_experts_are_the_reference_with_exponents_as_bytes_or_e8m0(stored_as, data):
    """DeepSeek-V4's routed experts: I8 bytes of two E2M1 codes, an E8M0 exponent per 32 inputs,
    stored as bytes or as E8M0 itself: ``code * 2 ** (byte - 127)``, every code and exponent."""
    rng = np.random.default_rng(15)
    nibbles = rng.integers(0, 16, (12, 96))
    exponents = rng.integers(1, 255, (12, 3)).astype(np.uint8)
    scales = exponents if stored_as == "U8" else exponents.view(ml_dtypes.float8_e8m0fnu)
    stored = {"e.weight": pack_nibbles(nibbles).view(np.int8), "e.scale": scales}
    q = dequantized([ost.MXFP4Packed()], _shapes(stored)).quantized["e.weight"]
    q.check_dtypes({"e.weight": "I8", "e.scale": stored_as})
    with np.errstate(over="ignore"):
        reference = (e2m1(nibbles) * np.repeat(np.exp2(exponents.astype(np.float64) - 127), 32, -1)).astype(np.float32)
    box = data.draw(box_in((12, 96)))
    big = np.abs(_slice(reference, box)) > np.finfo(np.float32).max
    if big.any():  # 6 * 2 ** 127 is past float32: refused, never inf
        with pytest.raises(ost.SafetensorsError, match="past float32's largest"):
            _read(q, stored, box)
        return
    got, _ = _read(q, stored, box)
    np.testing.assert_array_equal(bits(got), bits(_slice(reference, box)))


def test_an_e8m0_byte_0xff_is_nan_and_refused_by_name():
    stored = {"e.weight": np.zeros((2, 16), np.int8), "e.scale": np.array([[127], [255]], np.uint8)}
    q = dequantized([ost.MXFP4Packed()], _shapes(stored)).quantized["e.weight"]
    assert "'e.scale' holds 1 NaN or infinite scales, the first at flat index 1" in q.problem(0, stored["e.scale"])


def test_fp8_scales_beside_the_module_as_e8m0_bytes():
    """DeepSeek-V4's FP8: ``X.scale`` (not ``X.weight_scale_inv``), a power of two per block."""
    codes = np.random.default_rng(16).integers(0, 126, (20, 40)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    exponents = np.array([[120, 130, 127], [125, 127, 140]], np.uint8)
    stored = {"m.weight": codes, "m.scale": exponents}
    view = dequantized([ost.FP8((16, 16), scale_suffix=".scale")], _shapes(stored))
    assert view == {"m.weight": (20, 40)}
    q = view.quantized["m.weight"]
    want = codes.astype(np.float64) * np.repeat(np.repeat(np.exp2(exponents - 127.0), 16, 0), 16, 1)[:20, :40]
    got, _ = _read(q, stored, ((3, 19), (5, 37)))
    np.testing.assert_array_equal(bits(got), bits(want.astype(np.float32)[3:19, 5:37]))
