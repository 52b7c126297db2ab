"""Every safetensors dtype, bit for bit, against the reference `safetensors` library.

Both directions go through our public API on real files:

* ours -> theirs: ``ost.save`` writes the file, then the Rust crate
  (``safetensors.deserialize`` / ``safe_open``) reads it back;
* theirs -> ours: ``safetensors.serialize_file`` writes the file, then
  ``ost.load`` / ``ost.metadata`` read it.

Values are random *bit patterns* (random bytes viewed as the dtype), so every
encoding is covered: NaN payloads, signed zeros, infinities, subnormals. BOOL,
F4 and F6 use only their valid codes (0/1, 0..15, 0..63): ml_dtypes keeps one
sub-byte value per byte and the spare high bits are not part of the value.

Sub-byte packing, as the file stores it:

* F4 packs two values per byte, **low nibble = first element**: this is the
  order of torch's ``float4_e2m1fn_x2``, which the crate's
  ``TensorSpec(dtype="float4_e2m1fn_x2")`` passes through unchanged.
* F6 values form a little-endian bit stream (value k occupies bits
  [6k, 6k+6) counting from the least significant bit of byte 0), as
  ``orbax_safetensors/format/dtypes.py`` documents. The crate only checks
  sizes for F6, and has no ``TensorSpec`` name for it, so F6 is tested in the
  ours -> theirs direction only (``deserialize`` accepts it and hands back the
  bytes, which we compare with an independent packing).
"""

from __future__ import annotations

import json
import math
import struct
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors

import orbax_safetensors as ost
from orbax_safetensors.format.checksums import BLOCK_SIZE_KEY, BLOCKS_KEY, RESERVED_KEYS
from orbax_safetensors.format import DTYPES, to_bytes

ALL_CODES = (
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "I32",
    "U32",
    "I64",
    "U64",
    "F16",
    "BF16",
    "F32",
    "F64",
    "C64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
)

F6_CODES = ("F6_E2M3", "F6_E3M2")

# The crate's TensorSpec constructor names (torch-style). F6 has none.
TENSORSPEC_NAME = {
    "BOOL": "bool",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}

# Dtypes the crate's numpy backend (safe_open(framework="numpy").get_tensor) returns.
NUMPY_BACKEND = {
    "F64",
    "F32",
    "F16",
    "I64",
    "U64",
    "I32",
    "U32",
    "I16",
    "U16",
    "I8",
    "U8",
    "BOOL",
    "C64",
}

EXPECTED_NUMPY = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "I32": np.int32,
    "U32": np.uint32,
    "I64": np.int64,
    "U64": np.uint64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F4": ml_dtypes.float4_e2m1fn,
    "F6_E2M3": ml_dtypes.float6_e2m3fn,
    "F6_E3M2": ml_dtypes.float6_e3m2fn,
}

BYTE_SHAPES = [(), (0,), (3,), (2, 3, 4), (1, 1, 5)]
F4_SHAPES = [(0,), (2,), (4,), (2, 3, 4), (3, 2)]  # even element counts
F6_SHAPES = [(0,), (4,), (8,), (2, 3, 4), (3, 4)]  # multiples of 4 (whole bytes)
USER_METADATA = {"note": "héllo wörld ✓", "step": "42"}

# Our on-disk bytes are little-endian; every comparison below assumes a
# little-endian host, which is every platform JAX runs on.
assert sys.byteorder == "little"


def shapes_for(code: str) -> list[tuple[int, ...]]:
    if code == "F4":
        return F4_SHAPES
    if code in F6_CODES:
        return F6_SHAPES
    return BYTE_SHAPES


def random_array(code: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bit patterns of ``code``: every byte value, NaN payloads included."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(EXPECTED_NUMPY[code])
    count = math.prod(shape)
    if code == "BOOL":
        codes = rng.integers(0, 2, size=count, dtype=np.uint8)
    elif code == "F4":
        codes = rng.integers(0, 16, size=count, dtype=np.uint8)
    elif code in F6_CODES:
        codes = rng.integers(0, 64, size=count, dtype=np.uint8)
    else:
        codes = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    return codes.view(dtype).reshape(shape)


def pack_f4(codes: np.ndarray) -> bytes:
    """Two F4 codes per byte, low nibble first (torch float4_e2m1fn_x2 order)."""
    codes = codes.reshape(-1).astype(np.uint8)
    assert codes.size % 2 == 0
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_f4(data: bytes) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(raw.size * 2, dtype=np.uint8)
    out[0::2] = raw & 0x0F
    out[1::2] = raw >> 4
    return out


def pack_f6(codes: np.ndarray) -> bytes:
    """Little-endian 6-bit stream: 4 values -> 3 bytes, value 0 in the low bits."""
    codes = codes.reshape(-1).astype(np.uint32)
    assert codes.size % 4 == 0
    out = bytearray()
    for i in range(0, codes.size, 4):
        word = (
            int(codes[i])
            | int(codes[i + 1]) << 6
            | int(codes[i + 2]) << 12
            | int(codes[i + 3]) << 18
        )
        out += word.to_bytes(3, "little")
    return bytes(out)


def expected_disk_bytes(code: str, array: np.ndarray) -> bytes:
    """The bytes the spec says a file holds for ``array``, computed independently."""
    if code == "F4":
        return pack_f4(array.view(np.uint8))
    if code in F6_CODES:
        return pack_f6(array.view(np.uint8))
    return np.ascontiguousarray(array).tobytes()


def deserialize_file(path) -> dict[str, dict]:
    with open(path, "rb") as f:
        return dict(safetensors.deserialize(f.read()))


def test_dtype_table_is_the_whole_spec():
    assert set(DTYPES) == set(ALL_CODES)
    for code, dtype in DTYPES.items():
        assert dtype.code == code
        assert dtype.numpy == np.dtype(EXPECTED_NUMPY[code])
    # Every dtype the crate knows has a row here: the crate's error message for
    # an unknown dtype lists them all.
    bad = b'{"x":{"dtype":"NOPE","shape":[],"data_offsets":[0,0]}}'
    with pytest.raises(Exception) as info:
        safetensors.deserialize(struct.pack("<Q", len(bad)) + bad)
    crate_codes = set(
        part.strip(" `")
        for part in str(info.value).split("expected one of ")[1].split(" at line")[0].split(",")
    )
    assert crate_codes == set(ALL_CODES)


# --------------------------------------------------------------------------- ours -> theirs


@pytest.mark.parametrize("code", ALL_CODES)
def test_ours_to_theirs(tmp_path, code):
    arrays = {
        f"t{i}": random_array(code, shape, seed=i) for i, shape in enumerate(shapes_for(code))
    }
    path = tmp_path / "x.safetensors"
    ost.save(path, arrays, metadata=USER_METADATA)

    raw = deserialize_file(path)
    assert set(raw) == set(arrays)
    for name, array in arrays.items():
        expected = expected_disk_bytes(code, array)
        assert bytes(to_bytes(array)) == expected, name
        assert raw[name]["dtype"] == code, name
        assert tuple(raw[name]["shape"]) == array.shape, name
        assert bytes(raw[name]["data"]) == expected, name

    with safetensors.safe_open(path, framework="numpy") as f:
        assert set(f.keys()) == set(arrays)
        assert {k: v for k, v in f.metadata().items() if k not in RESERVED_KEYS} == {
            "format": "pt", **USER_METADATA}
        if code in NUMPY_BACKEND:
            for name, array in arrays.items():
                theirs = f.get_tensor(name)
                assert theirs.dtype == array.dtype, name
                assert theirs.shape == array.shape, name
                assert theirs.tobytes() == array.tobytes(), name

    # And back through our reader: same bits, same dtype.
    ours = ost.load(path)
    for name, array in arrays.items():
        assert ours[name].dtype == array.dtype
        assert ours[name].shape == array.shape
        assert ours[name].tobytes() == array.tobytes(), name


def test_ours_to_theirs_every_dtype_in_one_file(tmp_path):
    """Mixed widths in one file: offsets, ordering and alignment as the crate expects."""
    arrays = {
        f"{code.lower()}.{i}": random_array(code, shape, seed=100 + i)
        for code in ALL_CODES
        for i, shape in enumerate(shapes_for(code))
    }
    path = tmp_path / "all.safetensors"
    ost.save(path, arrays)
    raw = deserialize_file(path)
    assert set(raw) == set(arrays)
    for name, array in arrays.items():
        code = raw[name]["dtype"]
        assert DTYPES[code].numpy == array.dtype
        assert bytes(raw[name]["data"]) == expected_disk_bytes(code, array), name
    # The header is 8-byte padded so the data buffer starts aligned.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert n % 8 == 0
    assert header["__metadata__"]["format"] == "pt" and set(header["__metadata__"]) == {
        "format", BLOCKS_KEY, BLOCK_SIZE_KEY}


# --------------------------------------------------------------------------- theirs -> ours


def write_with_crate(path, arrays: dict[str, tuple[str, np.ndarray]], metadata=None) -> None:
    """``safetensors.serialize_file`` from raw buffers. F4 arrays are the packed bytes."""
    specs = {}
    keep_alive = []
    for name, (code, buffer) in arrays.items():
        buffer = np.array(buffer, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        keep_alive.append(buffer)
        specs[name] = safetensors.TensorSpec(
            dtype=TENSORSPEC_NAME[code],
            shape=list(buffer.shape),
            data_ptr=buffer.ctypes.data,
            data_len=buffer.nbytes,
        )
    safetensors.serialize_file(specs, str(path), metadata)
    del keep_alive


@pytest.mark.parametrize("code", [c for c in ALL_CODES if not c in F6_CODES])
def test_theirs_to_ours(tmp_path, code):
    # F6 is absent: the crate's TensorSpec has no name for it (ours -> theirs covers F6).
    sources: dict[str, tuple[tuple[int, ...], bytes]] = {}
    to_write = {}
    for i, shape in enumerate(shapes_for(code)):
        array = random_array(code, shape, seed=1000 + i)
        if code == "F4":
            # The crate takes the *storage* shape of float4_e2m1fn_x2 (two values per
            # byte, last dim halved) and doubles the last dim in the header.
            packed = np.frombuffer(pack_f4(array.view(np.uint8)), dtype=np.uint8)
            storage_shape = shape[:-1] + (shape[-1] // 2,)
            to_write[f"t{i}"] = (code, packed.reshape(storage_shape))
            sources[f"t{i}"] = (shape, packed.tobytes())
        else:
            to_write[f"t{i}"] = (code, array)
            sources[f"t{i}"] = (shape, array.tobytes())
    path = tmp_path / "theirs.safetensors"
    write_with_crate(path, to_write, {"format": "pt", "origin": "crate ✓"})

    meta = ost.metadata(path)
    assert meta.metadata == {"format": "pt", "origin": "crate ✓"}
    assert set(meta.tensors) == set(sources)
    for name, (shape, _) in sources.items():
        assert meta.tensors[name].shape == shape
        assert meta.tensors[name].dtype == np.dtype(EXPECTED_NUMPY[code])

    loaded = ost.load(path)
    assert set(loaded) == set(sources)
    for name, (shape, source) in sources.items():
        value = loaded[name]
        assert isinstance(value, np.ndarray)
        assert value.dtype == np.dtype(EXPECTED_NUMPY[code]), name
        assert value.shape == shape, name
        if code == "F4":
            # Low nibble of each stored byte is the first of its two elements.
            np.testing.assert_array_equal(value.reshape(-1).view(np.uint8), unpack_f4(source))
        else:
            assert value.tobytes() == source, name
        assert bytes(to_bytes(value)) == source, name


def test_f4_nibble_order_is_low_first(tmp_path):
    """A hand-checked F4 example: byte 0x21 holds [code 1, code 2] = [0.5, 1.0]."""
    packed = np.array([0x21, 0xF0], dtype=np.uint8)  # codes 1, 2, 0, 15
    path = tmp_path / "f4.safetensors"
    write_with_crate(path, {"x": ("F4", packed)})
    value = ost.load(path)["x"]
    assert value.shape == (4,)
    np.testing.assert_array_equal(value.astype(np.float32), [0.5, 1.0, 0.0, -6.0])
    # And we write the same bytes back.
    ost.save(tmp_path / "again.safetensors", {"x": value})
    assert bytes(deserialize_file(tmp_path / "again.safetensors")["x"]["data"]) == b"\x21\xf0"


def test_f6_bit_order_example(tmp_path):
    """Codes 1, 2, 3, 4 as a little-endian 6-bit stream: 0b000100_000011_000010_000001."""
    values = np.array([1, 2, 3, 4], dtype=np.uint8).view(ml_dtypes.float6_e2m3fn)
    path = tmp_path / "f6.safetensors"
    ost.save(path, {"x": values})
    word = 1 | 2 << 6 | 3 << 12 | 4 << 18
    assert bytes(deserialize_file(path)["x"]["data"]) == word.to_bytes(3, "little")
    np.testing.assert_array_equal(ost.load(path)["x"].view(np.uint8), [1, 2, 3, 4])


@pytest.mark.parametrize("code", ["F4", "F6_E2M3", "F6_E3M2"])
@pytest.mark.parametrize("path_kind", ["file", "directory"])
def test_save_rejects_partial_bytes_of_subbyte_dtype(tmp_path, code, path_kind):
    count = 3 if code == "F4" else 6  # 12 and 36 bits: not whole bytes
    array = np.zeros(count, dtype=EXPECTED_NUMPY[code])
    path = tmp_path / ("odd.safetensors" if path_kind == "file" else "odd_ckpt")
    with pytest.raises(ValueError, match=r"(?s)'odd'.*whole number of bytes"):
        ost.save(path, {"odd": array, "fine": np.zeros(4, np.float32)})
    if path_kind == "file":
        assert not path.exists()
    else:
        assert not path.exists() or not any(path.iterdir())


JAX_CODES = [
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "I32",
    "U32",
    "F16",
    "BF16",
    "F32",
    "C64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F8_E8M0",
    "F4",
]


@pytest.mark.parametrize("code", JAX_CODES)
def test_jax_arrays_save_bit_identical(tmp_path, code):
    """jax.Array leaves write the same bits as their numpy values (x64 types aside)."""
    shape = (4, 6)
    host = random_array(code, shape, seed=7)
    device = jnp.asarray(host)
    assert device.dtype == host.dtype
    path = tmp_path / "jax.safetensors"
    ost.save(path, {"w": device})
    assert bytes(deserialize_file(path)["w"]["data"]) == expected_disk_bytes(code, host)


# --------------------------------------------------------------------------- conversion on load


@pytest.fixture
def f32_file(tmp_path):
    values = np.array([[1.0, 1.5, -2.0], [3.140625, 1e-3, 65504.0]], dtype=np.float32)
    path = tmp_path / "f32.safetensors"
    write_with_crate(path, {"w": ("F32", values)})
    return path, values


def test_load_converts_to_shape_dtype_struct_dtype(f32_file):
    path, values = f32_file
    out = ost.load(path, {"w": jax.ShapeDtypeStruct(values.shape, jnp.bfloat16)})
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), values.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, ml_dtypes.float8_e4m3fn])
def test_load_converts_to_numpy_target_dtype(f32_file, dtype):
    path, values = f32_file
    # float → int truncates (1.5 → 1), and 65504 overflows float8_e4m3fn: both refused unless
    # asked for (see tests/engine/test_casting.py)
    unsafe = np.dtype(dtype).kind == "i" or np.dtype(dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
    options = ost.LoadOptions(casting="unsafe") if unsafe else None
    out = ost.load(path, {"w": np.zeros(values.shape, dtype)}, options=options)
    assert isinstance(out["w"], np.ndarray)
    assert out["w"].dtype == np.dtype(dtype)
    # Bitwise: 65504 overflows float8_e4m3fn to NaN, which must be the same NaN.
    assert out["w"].tobytes() == values.astype(dtype).tobytes()


def test_load_converts_to_jax_array_target(f32_file):
    path, values = f32_file
    target = jnp.zeros(values.shape, jnp.bfloat16)
    out = ost.load(path, {"w": target})
    assert isinstance(out["w"], jax.Array)
    assert out["w"].dtype == jnp.bfloat16
    assert out["w"].sharding == target.sharding
    np.testing.assert_array_equal(np.asarray(out["w"]), values.astype(ml_dtypes.bfloat16))


def test_load_converts_subbyte_to_float32(tmp_path):
    values = np.array([0.5, -1.0, 6.0, 0.0], dtype=ml_dtypes.float4_e2m1fn)
    path = tmp_path / "f4.safetensors"
    ost.save(path, {"q": values})
    out = ost.load(path, {"q": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert out["q"].dtype == np.float32
    np.testing.assert_array_equal(out["q"], [0.5, -1.0, 6.0, 0.0])


def test_a_file_of_every_dtype_is_the_crate_s_byte_for_byte(tmp_path):
    """The crate orders a file's tensors by its dtype enum (widest first), then by name: the
    names here run against that order (``a.i32`` sorts before ``b.f32``, ``a.u8`` before
    ``b.f8_e4m3``, NVFP4's codes before their scales), and ours is its file byte for byte."""
    codes = [c for c in ALL_CODES if c in TENSORSPEC_NAME and c not in F6_CODES]
    arrays = {f"{'ab'[i % 2]}.{code.lower()}": (code, random_array(code, (2, 4), seed=i))
              for i, code in enumerate(sorted(codes, key=lambda c: c.lower()))}
    write_with_crate(tmp_path / "theirs.safetensors", {  # F4: its storage shape, two values a byte
        name: (code, np.frombuffer(pack_f4(array.view(np.uint8)), np.uint8).reshape(2, 2) if code == "F4" else array)
        for name, (code, array) in arrays.items()}, {"format": "pt"})
    ost.save(tmp_path / "ours.safetensors", {name: array for name, (_, array) in arrays.items()}, checksums=False)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
