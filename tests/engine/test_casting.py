"""The cast policy of a load (``LoadOptions.casting``): no value changes without asking.

``numpy.astype`` turns -300.0 into int8 -44 and NaN into int32 INT_MIN without a
word. A load converts each tensor to its target's dtype; by default
(``casting="same_kind"``) float → int is refused before any byte is read (every
such tensor named at once), a narrowing or sign-changing int cast is checked on
the values read, and everything that keeps values' meaning (float ↔ float,
widening ints, bool → anything, int → float) loads as before. ``"unsafe"`` is
numpy's ``astype``. All through the public API, on host (numpy) targets and on
targets sharded over the 8 CPU devices.
"""

import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost

UNSAFE = ost.LoadOptions(casting="unsafe")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def _host(value: np.ndarray, dtype) -> np.ndarray:
    return np.zeros(value.shape, dtype)


def _sharded(value: np.ndarray, dtype, spec: P | None = None) -> jax.ShapeDtypeStruct:
    spec = P("x") if spec is None else spec
    return jax.ShapeDtypeStruct(value.shape, np.dtype(dtype), sharding=NamedSharding(_mesh(), spec))


TARGETS = {"host": _host, "sharded": _sharded}


def _result_dtype(kind: str, dtype) -> np.dtype:
    """What a load gives: a jax.Array of a 64-bit type is 32-bit unless ``jax_enable_x64``."""
    return np.dtype(dtype) if kind == "host" else np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _astype(value: np.ndarray, dtype) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN into int: numpy warns
        return value.astype(dtype)


def _save(tmp_path, tensors: dict[str, np.ndarray]) -> str:
    path = str(tmp_path / "ckpt")
    ost.save(path, tensors)
    return path


def _values(rows: list[float], dtype) -> np.ndarray:
    """An (8, 2) array holding ``rows`` first, so each value lands in one shard of P("x")."""
    return np.array([*rows, *[1] * (16 - len(rows))], dtype=dtype).reshape(8, 2)


# --- float → int: refused at plan time ----------------------------------------------------


@pytest.mark.parametrize("kind", TARGETS)
def test_float_into_int_is_refused_before_any_read(tmp_path, kind):
    value = _values([-300.0, 1.5], np.float32)
    path = _save(tmp_path, {"w": value})
    stats = ost.LoadStats()
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path, {"w": TARGETS[kind](value, np.int8)}, stats=stats)
    message = str(raised.value)
    assert "'w'" in message and "model.safetensors" in message
    assert "float32" in message and "int8" in message
    assert 'casting="unsafe"' in message
    assert stats.bytes_read == 0 and stats.requests == 0


@pytest.mark.parametrize("kind", TARGETS)
def test_unsafe_casting_is_numpy_astype(tmp_path, kind):
    value = _values([-300.0, 1.5, np.nan, np.inf, 300.0], np.float32)
    path = _save(tmp_path, {"w": value})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loaded = ost.load(path, {"w": TARGETS[kind](value, np.int8)}, options=UNSAFE)["w"]
    assert np.asarray(loaded).dtype == np.int8
    np.testing.assert_array_equal(np.asarray(loaded), _astype(value, np.int8))
    assert np.asarray(loaded)[0, 0] == -44  # the user's report: what "unsafe" asks for


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", TARGETS)
def test_nan_and_inf_into_int_are_refused(tmp_path, kind, bad):
    value = _values([bad], np.float32)
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError, match="'w'.*int32"):
        ost.load(path, {"w": TARGETS[kind](value, np.int32)})


@pytest.mark.parametrize("stored", [ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, np.float64])
@pytest.mark.parametrize("target", [np.int32, np.uint8, np.bool_])
def test_every_float_into_int_or_bool_is_refused(tmp_path, stored, target):
    value = _values([1.0, 2.0], stored)  # integral values: refused anyway, by dtype
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError, match="'w'"):
        ost.load(path, {"w": _host(value, target)})


def test_complex_into_real_is_refused(tmp_path):
    value = (np.arange(16) + 1j).astype(np.complex64).reshape(8, 2)
    path = _save(tmp_path, {"z": value})
    with pytest.raises(ost.SafetensorsError, match="'z'.*complex64, target float32"):
        ost.load(path, {"z": _host(value, np.float32)})
    assert ost.load(path, {"z": _host(value, np.complex64)})["z"].dtype == np.complex64


def test_every_refused_tensor_is_listed_at_once(tmp_path):
    tensors = {"a": _values([1.5], np.float32), "b": _values([2.5], ml_dtypes.bfloat16),
               "c": _values([3.0], np.float16), "ok": _values([4.0], np.float32)}
    path = _save(tmp_path, tensors)
    target = {"a": _host(tensors["a"], np.int8), "b": _sharded(tensors["b"], np.int32),
              "c": _host(tensors["c"], np.bool_), "ok": _host(tensors["ok"], ml_dtypes.bfloat16)}
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path, target)
    message = str(raised.value)
    assert "3 tensor(s)" in message
    for name, stored, wanted in [("a", "float32", "int8"), ("b", "bfloat16", "int32"),
                                 ("c", "float16", "bool")]:
        assert f"'{name}' in model.safetensors: stored {stored}, target {wanted}" in message
    assert "'ok'" not in message


def test_async_load_refuses_at_the_call(tmp_path):
    value = _values([-300.0], np.float32)
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError, match="'w'"):
        ost.async_load(path, {"w": _sharded(value, np.int8)})
    loaded = ost.async_load(path, {"w": _sharded(value, np.int8)}, options=UNSAFE).result()
    np.testing.assert_array_equal(np.asarray(loaded["w"]), _astype(value, np.int8))


# --- narrowing and sign-changing ints: checked on the values read --------------------------


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("stored, target, rows", [
    (np.int32, np.int8, [-128, 127, 0, -5]),
    (np.int64, np.int32, [-2**31, 2**31 - 1]),
    (np.int8, np.uint8, [0, 127]),
    (np.uint64, np.int64, [2**31 - 1, 0]),
    (np.int32, np.bool_, [0, 1]),
    (np.uint16, np.int8, [127, 0]),
])
def test_narrowing_ints_that_fit_load_exactly(tmp_path, kind, stored, target, rows):
    value = _values(rows, stored)
    path = _save(tmp_path, {"w": value})
    loaded = np.asarray(ost.load(path, {"w": TARGETS[kind](value, target)})["w"])
    assert loaded.dtype == _result_dtype(kind, target)
    assert (loaded.astype(object) == value.astype(object)).all()  # no value changed


def test_uint64_into_int64_on_the_host_checks_the_int64_range(tmp_path):
    value = _values([2**63 - 1, 0], np.uint64)
    loaded = ost.load(_save(tmp_path, {"w": value}), {"w": _host(value, np.int64)})["w"]
    assert loaded.dtype == np.int64 and loaded[0, 0] == 2**63 - 1


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="64-bit jax.Arrays hold 64-bit values")
def test_int64_into_a_jax_array_without_x64_is_checked_as_int32(tmp_path):
    value = _values([2**40, 0], np.int64)  # JAX would wrap it to 0 (int64 arrays are int32)
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError, match=r"tensor 'w'.*value 1099511627776 .*int32"):
        ost.load(path, {"w": _sharded(value, np.int64)})
    loaded = ost.load(path, {"w": _sharded(value, np.int64)}, options=UNSAFE)["w"]
    assert loaded.dtype == np.int32 and np.asarray(loaded)[0, 0] == 0


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("stored, target, rows, first", [
    (np.int32, np.int8, [1, 2, 3, 4, 200, -300], 200),
    (np.int8, np.uint8, [5, 6, 7, -1], -1),
    (np.int64, np.uint64, [0, -2**40], -2**40),
    (np.uint64, np.int64, [1, 2**63], 2**63),
    (np.int32, np.bool_, [0, 1, 2], 2),
    (np.uint32, np.int32, [2**31], 2**31),
])
def test_narrowing_ints_that_do_not_fit_are_refused(tmp_path, kind, stored, target, rows, first):
    value = _values(rows, stored)
    path = _save(tmp_path, {"fine": _values([1], np.int32), "w": value})
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path, {"fine": TARGETS[kind](value, np.int8), "w": TARGETS[kind](value, target)})
    message = str(raised.value)
    assert "tensor 'w'" in message and "model.safetensors" in message
    assert str(_result_dtype(kind, target)) in message and 'casting="unsafe"' in message
    if kind == "host":  # one array: the first offending value in C order
        assert f"value {first} " in message
    loaded = ost.load(path, {"fine": TARGETS[kind](value, np.int8), "w": TARGETS[kind](value, target)},
                      options=UNSAFE)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), _astype(value, _result_dtype(kind, target)))


def test_a_value_out_of_range_in_one_shard_fails_the_load(tmp_path):
    value = np.arange(64, dtype=np.int32).reshape(16, 4)
    value[13, 2] = -129  # in the shard of one device only
    path = _save(tmp_path, {"w": value})
    target = {"w": _sharded(value, np.int8, P("x", "y"))}
    with pytest.raises(ost.SafetensorsError, match=r"tensor 'w'.*value -129 "):
        ost.load(path, target)
    with pytest.raises(ost.SafetensorsError, match=r"tensor 'w'.*value -129 "):
        ost.async_load(path, target).result()


def test_checked_errors_are_the_error_itself_not_wrapped(tmp_path):
    value = _values([300], np.int32)
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path, {"w": _sharded(value, np.int8)})
    assert type(raised.value) is ost.SafetensorsError and raised.value.tensor == "w"
    assert raised.value.file.endswith("model.safetensors")


@settings(max_examples=40, deadline=None)
@given(stored=st.sampled_from([np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64]),
       target=st.sampled_from([np.int8, np.uint8, np.int16, np.uint16, np.int32, np.bool_]),
       data=st.data())
def test_ints_load_exactly_or_are_refused(tmp_path_factory, stored, target, data):
    info = np.iinfo(stored)
    rows = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=16))
    value = _values(rows, stored)
    path = _save(tmp_path_factory.mktemp("ints"), {"w": value})
    lo, hi = (0, 1) if target is np.bool_ else (np.iinfo(target).min, np.iinfo(target).max)
    fits = all(lo <= int(v) <= hi for v in value.ravel())
    if fits:
        loaded = ost.load(path, {"w": _host(value, target)})["w"]
        assert (loaded.astype(np.int64) == value.astype(np.int64)).all()
    else:
        with pytest.raises(ost.SafetensorsError, match="tensor 'w'"):
            ost.load(path, {"w": _host(value, target)})


# --- what keeps values' meaning loads as before ---------------------------------------------


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("stored, target", [
    (np.uint8, np.int16), (np.int8, np.int64), (np.int16, np.int32), (np.uint32, np.int64),
    (np.bool_, np.int32), (np.bool_, np.float32), (np.bool_, np.uint8),
    (np.int32, np.float32), (np.int64, np.float64), (np.int8, ml_dtypes.bfloat16),
])
def test_widening_and_bool_and_int_to_float_load(tmp_path, kind, stored, target):
    value = _values([0, 1, 1, 0], stored)
    if np.dtype(stored) != np.bool_:
        value = np.arange(16).astype(stored).reshape(8, 2) * (-1 if np.dtype(stored).kind == "i" else 1)
    path = _save(tmp_path, {"w": value})
    loaded = np.asarray(ost.load(path, {"w": TARGETS[kind](value, target)})["w"])
    assert loaded.dtype == _result_dtype(kind, target)
    np.testing.assert_array_equal(loaded, value.astype(loaded.dtype))


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("stored, target", [
    (np.float32, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float32),
    (np.float32, np.float16), (np.float16, np.float32),
    (np.float32, ml_dtypes.float8_e4m3fn), (ml_dtypes.float8_e4m3fn, np.float32),
    (np.float64, np.float32), (ml_dtypes.bfloat16, np.float16),
])
def test_float_to_float_is_same_kind(tmp_path, kind, stored, target):
    value = (np.linspace(-3, 3, 16).reshape(8, 2)).astype(stored)
    path = _save(tmp_path, {"w": value})
    loaded = np.asarray(ost.load(path, {"w": TARGETS[kind](value, target)})["w"])
    assert loaded.dtype == _result_dtype(kind, target)
    np.testing.assert_array_equal(loaded, value.astype(loaded.dtype))


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("stored, target, bad", [
    (np.float32, np.float16, 1e6),  # would be inf
    (np.float32, ml_dtypes.float8_e4m3fn, 1000.0),  # would be NaN (no inf)
    (np.int32, np.float16, 100_000),  # would be inf
    (np.float64, np.float32, 1e300),  # would be inf
    (np.float32, ml_dtypes.float4_e2m1fn, 100.0),  # would be 6.0 (saturates)
    (np.float32, ml_dtypes.bfloat16, 3.4e38),  # beyond bfloat16's largest, under float32's
    (np.float32, ml_dtypes.float8_e4m3fn, np.inf),  # no inf there: NaN
    (np.float32, ml_dtypes.float4_e2m1fn, np.nan),  # no NaN there
    (np.float32, ml_dtypes.float8_e8m0fnu, -2.0),  # a scale type: no sign
])
def test_a_float_narrowing_that_overflows_is_refused_naming_the_value(tmp_path, kind, stored, target, bad):
    """A float or int cast to a float type of a smaller range is checked per shard as the
    narrowing int casts are: values that would become inf, NaN or the largest value (rather
    than be rounded) fail the load, naming the tensor and the value."""
    value = np.linspace(-1, 1, 16).astype(stored).reshape(8, 2)
    if target == ml_dtypes.float8_e8m0fnu:
        value = np.abs(value) + np.asarray(1, stored)
    value[5, 1] = bad
    path = _save(tmp_path, {"w": value})
    with pytest.raises(ost.SafetensorsError, match="tensor 'w'") as raised:
        ost.load(path, {"w": TARGETS[kind](value, target)})
    assert f"value {value[5, 1].item()} (stored {np.dtype(stored)})" in str(raised.value)
    unsafe = np.asarray(ost.load(path, {"w": TARGETS[kind](value, target)}, options=UNSAFE)["w"])
    _assert_same_floats(unsafe, _astype(value, unsafe.dtype))


def _assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal, NaN equal to NaN (ml_dtypes' fp8 and fp4 compare through float32)."""
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("stored, target, special", [
    (np.float32, np.float16, np.inf), (np.float32, np.float16, -np.inf), (np.float32, np.float16, np.nan),
    (np.float32, ml_dtypes.float8_e4m3fn, np.nan), (np.float32, np.float16, 65504.0),
])
def test_values_a_narrower_float_holds_load_rounded(tmp_path, stored, target, special):
    """inf into a type with inf, NaN into one with NaN, the largest value itself: kept."""
    value = np.linspace(-1, 1, 16).astype(stored).reshape(8, 2)
    value[3, 0] = special
    path = _save(tmp_path, {"w": value})
    for kind in TARGETS:
        loaded = np.asarray(ost.load(path, {"w": TARGETS[kind](value, target)})["w"])
        _assert_same_floats(loaded, value.astype(loaded.dtype))


def test_no_target_loads_the_stored_dtypes(tmp_path):
    tensors = {"f": _values([-300.0], np.float32), "i": _values([-300], np.int32)}
    loaded = ost.load(_save(tmp_path, tensors))
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded[name], value)


# --- mappings: the policy applies to the final cast ------------------------------------------


def _transposing(scale=None) -> ost.Mapping:
    return ost.Mapping([ost.Rule("layers.{i}.w", "layers.w", transpose=(1, 0), scale=scale,
                                 stack={"i": 0}),
                        ost.Rule("embed", "embedding", transpose=(1, 0), scale=scale)])


def _mapped_target(kind, dtype, layers) -> dict:
    shapes = {"embedding": ((16, 8), P("x")), "layers.w": ((layers, 8, 4), P(None, "x", "y"))}
    if kind == "host":
        return {name: np.zeros(shape, dtype) for name, (shape, _) in shapes.items()}
    return {name: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(_mesh(), spec))
            for name, (shape, spec) in shapes.items()}


def _mapped_stored(dtype, layers) -> dict[str, np.ndarray]:
    stored = {"embed": np.arange(128).reshape(8, 16)}
    stored.update({f"layers.{i}.w": np.arange(32).reshape(4, 8) - 10 * i for i in range(layers)})
    return {name: value.astype(dtype) for name, value in stored.items()}


@pytest.mark.parametrize("kind", TARGETS)
def test_mapped_narrowing_ints_are_checked(tmp_path, kind):
    stored = _mapped_stored(np.int32, 2)
    path = _save(tmp_path, stored)
    target = _mapped_target(kind, np.int8, 2)
    loaded = ost.load(path, target, mapping=_transposing())
    np.testing.assert_array_equal(np.asarray(loaded["embedding"]), stored["embed"].T.astype(np.int8))
    np.testing.assert_array_equal(np.asarray(loaded["layers.w"]),
                                  np.stack([stored["layers.0.w"].T, stored["layers.1.w"].T]).astype(np.int8))

    stored["layers.1.w"][1, 3] = 1000
    stored["embed"][5, 0] = -1000
    path = _save(tmp_path / "bad", stored)
    with pytest.raises(ost.SafetensorsError, match=r"tensor '(layers\.1\.w|embed)'.*value -?1000 "):
        ost.load(path, target, mapping=_transposing())
    del target["embedding"]
    with pytest.raises(ost.SafetensorsError, match=r"tensor 'layers\.1\.w'.*value 1000 "):
        ost.load(path, target, mapping=_transposing(), strict=False)


@pytest.mark.parametrize("kind", TARGETS)
def test_a_scaled_mapping_into_ints_is_refused(tmp_path, kind):
    stored = _mapped_stored(np.int8, 1)
    path = _save(tmp_path, stored)
    target = _mapped_target(kind, np.int8, 1)
    with pytest.raises(ost.SafetensorsError) as raised:  # int8 scaled is float32: float → int
        ost.load(path, target, mapping=_transposing(scale=2.0))
    message = str(raised.value)
    assert "'embed'" in message and "'layers.0.w' (part of 'layers.w')" in message
    assert "float32 once scaled" in message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loaded = ost.load(path, target, mapping=_transposing(scale=2.0), options=UNSAFE)
    np.testing.assert_array_equal(np.asarray(loaded["embedding"]),
                                  _astype(stored["embed"].T * np.float32(2), np.int8))
    # into floats it is what it always was
    floats = _mapped_target(kind, np.float32, 1)
    loaded = ost.load(path, floats, mapping=_transposing(scale=2.0))
    np.testing.assert_array_equal(np.asarray(loaded["layers.w"])[0], stored["layers.0.w"].T * np.float32(2))


# --- the option ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["safe", "no", "UNSAFE", None, 1])
def test_an_unknown_casting_is_a_value_error(bad):
    with pytest.raises(ValueError, match="casting"):
        ost.LoadOptions(casting=bad)


def test_same_kind_is_the_default():
    assert ost.LoadOptions().casting == "same_kind"
