"""Malformed files and indexes: every one is a ``SafetensorsError``, fast and small.

One table, one row per defect. Each row is loaded through both ``ost.load`` and
``ost.metadata``; each must raise ``orbax_safetensors.SafetensorsError`` (a
``ValueError``) whose message names the file, and the tensor when one is
involved. Nothing may crash, hang, or allocate in proportion to what a header
*claims*: each call runs under ``tracemalloc`` with a 10 MB peak budget and a
time budget.

Single-file rows are also fed to the Rust crate (``safetensors.deserialize``):
it must reject them as well, so our rejections are the crate's rejections.
The exceptions are duplicate JSON keys, which the crate resolves silently
(serde keeps the last one) and which we reject on purpose (two readers could
otherwise disagree about a file's contents); for those rows the test checks
that the crate really does accept, documenting the divergence.

The ``rust-parity/*`` rows are files the crate rejects because of what its JSON
parser (serde_json) refuses anywhere in the header, including inside fields
nobody reads: numbers out of f64 range, lone surrogates, nesting deeper than
127, ``-0`` where an integer is expected, and shapes whose running element
product overflows u64 before it reaches a zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors

import orbax_safetensors as ost
from orbax_safetensors import SafetensorsError

PEAK_BYTES = 10 * 2**20
SECONDS = 5.0


def build(header: bytes | dict, data: bytes = b"", *, pad: bool = True) -> bytes:
    """``u64 LE length + header + data``; a dict header is JSON-encoded and padded."""
    if isinstance(header, dict):
        header = json.dumps(header).encode("utf-8")
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8), **extra) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


def raw_entry(body: bytes, data: bytes) -> bytes:
    """A file whose header is ``{"x": <body>}`` given as raw JSON text."""
    return build(b'{"x":' + body + b"}", data)


UNKNOWN_FIELD = b'{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":%s}'


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    # Writes the checkpoint under tmp_path and returns the path to load.
    make: Callable[[Path], Path]
    # Substrings the message must contain besides the file (e.g. "tensor 'x'").
    needles: tuple[str, ...] = ()
    # File the message must name, relative to tmp_path; None: the loaded path.
    names_file: str | None = None
    # "reject": the crate rejects the same bytes; "accept": it accepts them (a
    # documented divergence); None: not a single file, the crate has no say.
    rust: str | None = "reject"


def single(id: str, content: bytes, *needles: str, rust: str = "reject") -> Case:
    def make(tmp: Path) -> Path:
        path = tmp / "bad.safetensors"
        path.write_bytes(content)
        return path
    return Case(id, make, needles, rust=rust)


def good_file(names_and_values: dict[str, np.ndarray]) -> bytes:
    tensors = {}
    data = b""
    for name, value in names_and_values.items():
        raw = value.tobytes()
        tensors[name] = entry(
            {"float32": "F32", "uint8": "U8"}[str(value.dtype)], value.shape,
            (len(data), len(data) + len(raw)))
        data += raw
    return build({"__metadata__": {"format": "pt"}, **tensors}, data)


def directory(id: str, files: dict[str, bytes | str], *needles: str,
              names_file: str | None = None) -> Case:
    def make(tmp: Path) -> Path:
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        for name, content in files.items():
            (ckpt / name).write_bytes(content.encode() if isinstance(content, str) else content)
        return ckpt
    return Case(id, make, needles,
                names_file=None if names_file is None else f"ckpt/{names_file}", rust=None)


SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
X = np.arange(4, dtype=np.float32)
Y = np.arange(3, dtype=np.uint8)


def index(weight_map: dict, **extra) -> str:
    return json.dumps({"metadata": {"total_size": 19}, "weight_map": weight_map, **extra})


DIST = "orbax_safetensors.distributed.json"
PART1 = "shard-00001-model-00001-of-00001.safetensors"
PART2 = "shard-00002-model-00001-of-00001.safetensors"
HALF = np.arange(4, dtype=np.float32).reshape(2, 2)


def dist_index(slices: list[tuple[str, list[int], list[int]]], shape=(4, 2), name="w") -> str:
    """Our distributed index for one F32 tensor ``name`` of ``shape`` stored as ``slices``."""
    return json.dumps({"format": "orbax_safetensors.distributed", "version": 1, "metadata": {},
                       "tensors": {name: {"dtype": "F32", "shape": list(shape), "slices": [
                           {"file": f, "offsets": o, "shape": n} for f, o, n in slices]}}})


def dist_dir(id: str, index_text: str, *needles: str, files=(PART1, PART2), names_file=DIST) -> Case:
    """Two halves of a (4, 2) F32 tensor ``w``, one per file, under ``index_text``."""
    return directory(id, {**{f: good_file({"w": HALF}) for f in files}, DIST: index_text},
                     *needles, names_file=names_file)


CASES = [
    # --- the 8-byte prefix and the header length
    single("empty-file", b""),
    single("5-byte-file", b"\x08\x00\x00\x00\x00"),
    single("header-length-beyond-file", struct.pack("<Q", 100) + b'{"a":1}'),
    single("header-length-2**62", struct.pack("<Q", 2**62) + b"{}      "),
    single("header-length-100MB+1", struct.pack("<Q", 100_000_001) + b"{}      "),
    single("header-length-2**64-1", struct.pack("<Q", 2**64 - 1) + b"{}      "),
    # --- header text
    single("invalid-utf8", build(b'{"\xff\xfe":{}}')),
    single("bad-json", build(b'{"x": {"dtype": "F32",')),
    single("json-list", build(b"[]")),
    # Leading JSON whitespace is accepted (test_leading_json_whitespace_is_padding); any
    # other leading byte is not JSON, and the crate refuses it as we do.
    single("leading-byte-order-mark", build(b'\xef\xbb\xbf{"__metadata__":{}}')),
    single("leading-vertical-tab", build(b'\x0b{"__metadata__":{}}')),
    single("leading-form-feed", build(b'\x0c{"__metadata__":{}}')),
    single("leading-no-break-space", build(b'\xc2\xa0{"__metadata__":{}}')),
    single("leading-nul", build(b'\x00{"__metadata__":{}}')),
    single("whitespace-only", build(b"        ", pad=False)),
    single("zero-length-header", struct.pack("<Q", 0)),
    single("nan-constant", build(b'{"x":{"dtype":"F32","shape":[NaN],"data_offsets":[0,0]}}')),
    single("infinity-constant", build(b'{"__metadata__":{"a":"b"},"y":Infinity}')),
    single("nul-padding", struct.pack("<Q", 8) + b"{}\x00\x00\x00\x00\x00\x00"),
    single("control-character", build(b'{"__metadata__":{"a":"\x01"}}')),
    # --- data buffer versus offsets
    single("truncated-data", build({"x": entry(offsets=(0, 8))}, b"\x00" * 5),
           "is truncated: it has 77 bytes, its header needs 80"),
    single("trailing-junk", build({"x": entry(offsets=(0, 8))}, b"\x00" * 8 + b"junk")),
    single("overlapping-offsets",
           build({"x": entry(offsets=(0, 8)), "y": entry(offsets=(4, 12))}, b"\x00" * 12),
           "tensor 'y'"),
    single("gap-between-tensors",
           build({"x": entry(offsets=(0, 8)), "y": entry(offsets=(12, 20))}, b"\x00" * 20),
           "tensor 'y'"),
    single("gap-at-start", build({"x": entry(offsets=(4, 12))}, b"\x00" * 12), "tensor 'x'"),
    single("end-before-begin",
           build({"x": entry(offsets=(0, 8)), "y": entry(shape=(0,), offsets=(8, 4))},
                 b"\x00" * 8),
           "tensor 'y'"),
    single("offsets-not-pair", build({"x": entry(offsets=(0, 8, 8))}, b"\x00" * 8), "tensor 'x'"),
    single("offsets-single", build({"x": entry(offsets=(8,))}, b"\x00" * 8), "tensor 'x'"),
    single("offsets-not-list", build({"x": {"dtype": "F32", "shape": [2], "data_offsets": 8}},
                                     b"\x00" * 8), "tensor 'x'"),
    single("offsets-negative", build({"x": entry(offsets=(-8, 0))}, b"\x00" * 8), "tensor 'x'"),
    single("offsets-bool", build({"x": entry(dtype="U8", shape=(1,), offsets=(False, True))},
                                 b"\x00"), "tensor 'x'"),
    single("offsets-float", build({"x": entry(offsets=(0, 8.0))}, b"\x00" * 8), "tensor 'x'"),
    single("offsets-missing", build({"x": {"dtype": "F32", "shape": [2]}}, b"\x00" * 8),
           "tensor 'x'"),
    single("length-not-shape-times-itemsize",
           build({"x": entry(shape=(3,), offsets=(0, 8))}, b"\x00" * 8), "tensor 'x'"),
    single("claims-10GB-in-1KB-file",
           build({"x": entry(dtype="U8", shape=(10**10,), offsets=(0, 10**10))}, b"\x00" * 1024),
           "is truncated"),
    single("claims-2**63-bytes",
           build({"x": entry(dtype="U8", shape=(2**63,), offsets=(0, 2**63))}, b"\x00" * 8),
           "tensor 'x'"),
    # --- shape
    single("shape-negative", build({"x": entry(shape=(-2,), offsets=(0, 8))}, b"\x00" * 8),
           "tensor 'x'"),
    single("shape-float", build({"x": entry(shape=(2.0,), offsets=(0, 8))}, b"\x00" * 8),
           "tensor 'x'"),
    single("shape-bool", build({"x": entry(dtype="U8", shape=(True,), offsets=(0, 1))}, b"\x00"),
           "tensor 'x'"),
    single("shape-string", build({"x": entry(shape=("2",), offsets=(0, 8))}, b"\x00" * 8),
           "tensor 'x'"),
    single("shape-not-list", build({"x": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}},
                                   b"\x00" * 8), "tensor 'x'"),
    single("shape-overflow-2**40x2**40",
           build({"x": entry(shape=(2**40, 2**40), offsets=(0, 8))}, b"\x00" * 8), "tensor 'x'"),
    single("shape-overflow-bits-only",  # 2**62 elements fit u64; 2**62 * 32 bits do not
           build({"x": entry(shape=(2**62,), offsets=(0, 8))}, b"\x00" * 8), "tensor 'x'"),
    # --- dtype
    single("unknown-dtype", build({"x": entry(dtype="F128")}, b"\x00" * 8), "tensor 'x'"),
    single("lowercase-dtype", build({"x": entry(dtype="f32")}, b"\x00" * 8), "tensor 'x'"),
    single("dtype-not-string", build({"x": entry(dtype=32)}, b"\x00" * 8), "tensor 'x'"),
    single("dtype-missing", build({"x": {"shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 8),
           "tensor 'x'"),
    single("f4-odd-count",
           build({"x": entry(dtype="F4", shape=(3,), offsets=(0, 2))}, b"\x00" * 2), "tensor 'x'"),
    single("f4-odd-count-rounded-down",
           build({"x": entry(dtype="F4", shape=(3,), offsets=(0, 1))}, b"\x00"), "tensor 'x'"),
    single("f6-partial-byte",
           build({"x": entry(dtype="F6_E2M3", shape=(2,), offsets=(0, 2))}, b"\x00" * 2),
           "tensor 'x'"),
    # --- entries and metadata
    single("entry-not-object", build(b'{"x":null}'), "tensor 'x'"),
    single("entry-is-number", build(b'{"x":5}'), "tensor 'x'"),
    single("metadata-not-object", build({"__metadata__": ["format", "pt"]}), "__metadata__"),
    single("metadata-value-not-string", build({"__metadata__": {"step": 1}}), "'step'"),
    single("metadata-value-null", build({"__metadata__": {"step": None}}), "'step'"),
    single("metadata-lone-surrogate", build(b'{"__metadata__":{"a":"\\ud800"}}'), "__metadata__"),
    single("tensor-name-lone-surrogate", build(b'{"\\udc00":{"dtype":"U8","shape":[0],'
                                               b'"data_offsets":[0,0]}}')),
    single("duplicate-metadata-object",
           build(b'{"__metadata__":{"a":"1"},"__metadata__":{"a":"2"}}'), "__metadata__"),
    # Duplicate keys: the crate keeps the last value silently; we refuse.
    single("duplicate-tensor-keys",
           build(b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                 b'"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00"),
           "duplicate key 'x'", rust="accept"),
    single("duplicate-keys-in-metadata",
           build(b'{"__metadata__":{"a":"1","a":"2"}}'), "duplicate key 'a'", rust="accept"),
    # Headers without escapes are decoded without a hook per object: their duplicates are found
    # by counting strings, wherever they are, whatever the rest of the header holds.
    single("duplicate-tensor-keys-apart",
           build(b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                 b'"y:z":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},'
                 b'"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00\x00"),
           "duplicate key 'x'", rust="accept"),
    single("duplicate-entry-field",  # serde's derive refuses a struct field given twice
           raw_entry(b'{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}', b"\x00"),
           "duplicate key 'dtype'"),
    single("duplicate-keys-in-unknown-field",
           raw_entry(UNKNOWN_FIELD % b'[{"a":"1"},{"b":{"a":1,"a":1}}]', b"\x00"),
           "duplicate key 'a'", rust="accept"),
    # --- rust parity: serde_json rejects these anywhere in the header
    single("rust-parity/shape-minus-zero",
           raw_entry(b'{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}', b""), "tensor 'x'"),
    single("rust-parity/shape-overflow-before-zero",  # the crate's try_fold(checked_mul) fails
           build({"x": entry(dtype="U8", shape=(2**40, 2**40, 0), offsets=(0, 0))}), "tensor 'x'"),
    single("rust-parity/shape-dim-2**64-with-zero",
           build({"x": entry(dtype="U8", shape=(0, 2**64), offsets=(0, 0))}), "tensor 'x'"),
    single("rust-parity/unknown-field-nested-128-deep",
           raw_entry(UNKNOWN_FIELD % (b"[" * 126 + b"]" * 126), b"\x00")),
    single("rust-parity/unknown-field-lone-surrogate",
           raw_entry(UNKNOWN_FIELD % b'"\\ud800"', b"\x00")),
    single("rust-parity/unknown-key-lone-surrogate",
           raw_entry(b'{"dtype":"U8","shape":[1],"data_offsets":[0,1],"\\ud800":1}', b"\x00")),
    single("rust-parity/unknown-field-1e400", raw_entry(UNKNOWN_FIELD % b"1e400", b"\x00")),
    single("rust-parity/unknown-field-400-digit-int",
           raw_entry(UNKNOWN_FIELD % (b"9" * 400), b"\x00")),
    # --- indexes (directory checkpoints)
    *[
        directory(f"index-names-{label}",
                  {SHARD1: good_file({"x": X}), SHARD2: good_file({"y": Y}),
                   INDEX: index({"x": SHARD1, "y": target})},
                  "tensor 'y'", "not a plain file name", names_file=INDEX)
        for label, target in [
            ("dotdot", "../x.safetensors"), ("absolute", "/abs/x.safetensors"),
            ("url", "s3://b/x.safetensors"), ("subdir", "sub/x.safetensors"),
            ("backslash", "..\\x.safetensors"), ("empty", ""), ("dot", "."), ("number", 5),
            ("null", None),
        ]
    ],
    directory("index-not-json", {SHARD1: good_file({"x": X}), INDEX: "{weight_map: oops"},
              names_file=INDEX),
    directory("index-not-utf8", {SHARD1: good_file({"x": X}), INDEX: b'{"\xff": 1}'},
              names_file=INDEX),
    directory("index-duplicate-keys",
              {SHARD1: good_file({"x": X}), SHARD2: good_file({"y": Y}),
               INDEX: '{"weight_map": {"x": "%s", "x": "%s", "y": "%s"}}' % (SHARD1, SHARD2, SHARD2)},
              "duplicate key 'x'", names_file=INDEX),
    directory("index-without-weight-map",
              {SHARD1: good_file({"x": X}), INDEX: json.dumps({"metadata": {"total_size": 16}})},
              "weight_map", names_file=INDEX),
    directory("index-weight-map-list",
              {SHARD1: good_file({"x": X}), INDEX: json.dumps({"weight_map": [["x", SHARD1]]})},
              "weight_map", names_file=INDEX),
    directory("index-is-list", {SHARD1: good_file({"x": X}), INDEX: "[]"}, names_file=INDEX),
    directory("index-metadata-not-object",
              {SHARD1: good_file({"x": X}), INDEX: index({"x": SHARD1}, metadata=[1])},
              "metadata", names_file=INDEX),
    directory("index-names-missing-file",
              {SHARD1: good_file({"x": X}), INDEX: index({"x": SHARD1, "y": SHARD2})},
              "does not exist", names_file=SHARD2),
    directory("index-maps-tensor-to-wrong-file",
              {SHARD1: good_file({"x": X}), SHARD2: good_file({"y": Y}),
               INDEX: index({"x": SHARD1, "y": SHARD1})},
              "tensor 'y'", names_file=SHARD1),
    directory("index-names-malformed-shard",
              {SHARD1: good_file({"x": X}), SHARD2: b"\x00" * 3, INDEX: index({"x": SHARD1, "y": SHARD2})},
              names_file=SHARD2),
    # --- the distributed index (ours): slices of one (4, 2) tensor in two files
    dist_dir("distributed-slices-overlap", dist_index([(PART1, [0, 0], [2, 2]), (PART2, [1, 0], [2, 2])]),
             "tensor 'w'", "overlap"),
    dist_dir("distributed-slices-leave-a-gap", dist_index([(PART1, [0, 0], [2, 2])]),
             "tensor 'w'", "cover 4 of the tensor's 8 elements"),
    dist_dir("distributed-slice-outside-the-tensor",
             dist_index([(PART1, [0, 0], [2, 2]), (PART2, [3, 0], [2, 2])]),
             "tensor 'w'", "outside"),
    dist_dir("distributed-slice-rank-differs", dist_index([(PART1, [0], [8])], shape=(8,)),
             "tensor 'w'", "F32 slice of shape [8]", names_file=PART1),
    dist_dir("distributed-names-collide",
             dist_index([(PART1, [0, 0], [2, 2]), (PART2, [2, 0], [2, 2])]).replace(
                 '"tensors": {', '"tensors": {"w": {}, ', 1),
             "duplicate key 'w'"),
    *[
        dist_dir(f"distributed-file-{label}",
                 dist_index([(PART1, [0, 0], [2, 2]), (target, [2, 0], [2, 2])]),
                 "tensor 'w'", "not a plain file name")
        for label, target in [("dotdot", f"../{PART2}"), ("absolute", f"/tmp/{PART2}"),
                              ("url", f"gs://b/{PART2}")]
    ],
    dist_dir("distributed-names-missing-file",
             dist_index([(PART1, [0, 0], [2, 2]), (PART2, [2, 0], [2, 2])]),
             "does not exist", files=(PART1,), names_file=PART2),
    dist_dir("distributed-shape-negative", dist_index([(PART1, [0, 0], [2, 2])], shape=(-2, 2)),
             "tensor 'w'"),
    dist_dir("distributed-wrong-format", json.dumps({"format": "other", "tensors": {}}), "format"),
    directory("interrupted-save-shards-without-index",
              {SHARD1: good_file({"x": X})}, "interrupted"),
    directory("empty-directory", {}, "model.safetensors"),
    directory("directory-with-malformed-model-safetensors",
              {"model.safetensors": b"\x10" + b"\x00" * 7 + b"{}"}, names_file="model.safetensors"),
]


def _call_bounded(fn, path):
    """Runs ``fn(path)``; returns (exception or None, seconds, peak traced bytes)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        fn(path)
        error = None
    except BaseException as e:  # noqa: BLE001 - the test inspects whatever came out
        error = e
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, elapsed, peak


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["load", "metadata"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_is_rejected(tmp_path, case: Case, api: str):
    path = case.make(tmp_path)
    error, elapsed, peak = _call_bounded(getattr(ost, api), path)

    assert error is not None, f"ost.{api} accepted a malformed checkpoint ({case.id})"
    assert isinstance(error, SafetensorsError), (
        f"ost.{api} raised {type(error).__name__}: {error}")
    assert isinstance(error, ValueError)
    message = str(error)
    named = path if case.names_file is None else tmp_path / case.names_file
    assert os.fspath(named) in message, f"message does not name {named}: {message}"
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert elapsed < SECONDS, f"took {elapsed:.1f}s"
    assert peak < PEAK_BYTES, f"peak allocation {peak / 2**20:.1f} MiB"


SINGLE_FILE_CASES = [c for c in CASES if c.rust is not None]


@pytest.mark.parametrize("case", SINGLE_FILE_CASES, ids=[c.id for c in SINGLE_FILE_CASES])
def test_rust_crate_agrees(tmp_path, case: Case):
    content = case.make(tmp_path).read_bytes()
    if case.rust == "reject":
        with pytest.raises(Exception) as info:
            safetensors.deserialize(content)
        assert "SafetensorError" in type(info.value).__name__
    else:
        safetensors.deserialize(content)  # the documented divergence: the crate accepts


# --------------------------------------------------------------------------- accepted edge cases


def test_unloadable_zero_size_shape_is_a_clean_error(tmp_path):
    """The crate accepts ``shape [0, 2**63]`` (0 elements, each dim fits u64).

    numpy and JAX cannot represent a dimension that large, so loading must fail
    as a ``SafetensorsError`` naming the file and the tensor, not as a bare
    numpy ``ValueError`` from deep inside the reader.
    """
    content = build({"x": entry(dtype="U8", shape=(0, 2**63), offsets=(0, 0))})
    safetensors.deserialize(content)  # the crate accepts it
    path = tmp_path / "huge_dims.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsError) as info:
        ost.load(path)
    assert os.fspath(path) in str(info.value)
    assert "tensor 'x'" in str(info.value)


@pytest.mark.parametrize(
    "header",
    [
        b'{"__metadata__":null}',
        b"{}",
        b'{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
        b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"a":[1,2.5,null]}}}',
        b'{"x":' + UNKNOWN_FIELD % (b"[" * 125 + b"]" * 125) + b"}",  # depth 127: the limit
        b'{"x":' + UNKNOWN_FIELD % b'"\\ud83d\\ude00"' + b"}",  # a surrogate *pair* is fine
        b'{"x":{"dtype":"U8","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}',
    ],
    ids=["metadata-null", "empty-object", "zero-size", "unknown-field", "depth-127",
         "surrogate-pair", "zero-first-then-huge"],
)
def test_edge_cases_both_accept(tmp_path, header):
    """Odd but valid headers: the crate accepts them, and so do we."""
    content = build(header, b"\x00" if b'"data_offsets":[0,1]' in header else b"")
    safetensors.deserialize(content)
    path = tmp_path / "edge.safetensors"
    path.write_bytes(content)
    meta = ost.metadata(path)
    assert set(meta.tensors) == ({"x"} if b'"x"' in header else set())


@pytest.mark.parametrize("content", [
    b"\x06\x00\x00\x00\x00\x00\x00\x00\x09\x0A{}\x0D\x20",  # test_whitespace_leading_padded_header
    b"\x06\x00\x00\x00\x00\x00\x00\x00{}\x0D\x20\x09\x0A",  # test_whitespace_padded_header
], ids=["leading", "trailing"])
def test_leading_json_whitespace_is_padding(tmp_path, content):
    """JSON whitespace around the header, the crate's own cases verbatim: it accepts both since
    huggingface/safetensors#686 (commit 96305fc5, 2026-04-13, safetensors/src/tensor.rs), so a
    writer may pad the front of a header to page-align the data. We accepted only trailing
    whitespace before (the spec's "MUST begin with {"): what the crate reads, we read."""
    safetensors.deserialize(content)
    path = tmp_path / "padded.safetensors"
    path.write_bytes(content)
    assert ost.metadata(path).tensors == {}
    assert ost.load(path) == {}
    assert ost.verify(path).ok


def test_a_page_aligned_header_loads_bit_for_bit(tmp_path):
    """The use #686 allows: a writer pads the front of the header so the data starts on a
    4 KiB page. Every reader loads the same bytes (the crate, through safetensors.numpy, and we),
    and verify finds nothing wrong."""
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    body = json.dumps({"__metadata__": {"format": "pt"}, "w": entry(shape=(4, 6), offsets=(0, 96))}).encode()
    header = b"\n" * (4096 - 8 - len(body)) + body
    path = tmp_path / "aligned.safetensors"
    path.write_bytes(build(header, values.tobytes(), pad=False))
    assert 8 + len(header) == 4096
    from safetensors.numpy import load_file

    assert load_file(str(path))["w"].tobytes() == values.tobytes()
    loaded = ost.load(path)["w"]
    assert loaded.dtype == values.dtype and loaded.tobytes() == values.tobytes()
    assert ost.verify(path).ok
