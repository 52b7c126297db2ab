"""Fuzzing every parser of untrusted bytes: headers, both indexes, DCP offsets, whole checkpoints.

The contract, for any input whatsoever: the library returns a result or
raises ``SafetensorsError`` naming the file (``FileNotFoundError`` only for a
missing checkpoint); it never raises anything else, never takes long, never
allocates in proportion to a size the input merely *claims* (peak traced
allocation stays within ``ALLOC_FACTOR`` × the input's size + a constant; JSON
objects cost up to ~30× their text, a claimed size would cost far more), and
never reads outside a file. When a mutated checkpoint still loads, what it
returns is exactly what the files say, as read by an independent reference
(the Rust ``safetensors`` crate for the bytes, plain ``json`` for the
indexes): never silently wrong.

Targets, each a derandomized hypothesis test (same examples every run):

* ``parse_file_bytes`` (headers), on top of ``test_format_properties``, whose
  strategies it reuses, adding the time and allocation bounds and mutations
  of valid headers (deep nesting, hostile values in every field);
* ``parse_index`` and ``parse_distributed_index`` / ``dcp_offsets``: arbitrary
  bytes, arbitrary JSON, and valid documents with fields mutated;
* ``check_slices`` against a brute-force oracle, through both of its
  algorithms (grid marking and the fallback sweep), and at real scale;
* checkpoint directories (HF sharded, distributed, torch-DCP-style) with the
  index or a file's header mutated, files truncated, extended or removed,
  loaded with every read checked against the file's size.

Inputs that made the code misbehave live in ``tests/format/fuzz_corpus/<target>/``
(raw bytes) with the message each must produce in
``tests/format/fuzz_corpus/expected.json``; ``test_corpus_case_is_rejected`` replays
them all. ``fuzz/fuzz_parsers.py`` is the same contract as a coverage-guided
atheris harness, run here for a bounded number of inputs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import orbax_safetensors as ost
from orbax_safetensors import SafetensorsError
from orbax_safetensors.format import DTYPES, parse_file_bytes, serialize_header
from orbax_safetensors.index import (
    DISTRIBUTED_INDEX_NAME,
    INDEX_NAME,
    DistributedTensor,
    SliceEntry,
    check_slices,
    dcp_metadata,
    dcp_offsets,
    distributed_file_name,
    parse_distributed_index,
    parse_index,
    serialize_distributed_index,
)
from orbax_safetensors.index import distributed_index
from orbax_safetensors.index.distributed_index import DCP_SHARDING_INFO
from orbax_safetensors.storage.local import LocalStorage
from tests.support import REPO
from tests.format.test_format_properties import ANY_TEXT, HEADER_FILES, JSON
CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())

SETTINGS = settings(
    max_examples=400, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])
SECONDS = 2.0  # per parse, generous: a linear parse of these inputs takes milliseconds
ALLOC_FACTOR = 64
ALLOC_CONSTANT = 256 << 10


def bounded(fn: Callable[[], object], size: int, *, allowed=(SafetensorsError,),
            seconds: float = SECONDS, constant: int = ALLOC_CONSTANT):
    """Runs ``fn`` under a clock and tracemalloc; returns its result or the allowed error."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = fn()
    except allowed as e:
        result = e
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.2f}s on a {size}-byte input"
    limit = ALLOC_FACTOR * size + constant
    assert peak <= limit, f"peak allocation {peak} bytes on a {size}-byte input (limit {limit})"
    return result


def rejected_naming(result: object, file: str) -> bool:
    """True for a SafetensorsError naming ``file``; False for a parse result."""
    if isinstance(result, SafetensorsError):
        assert f"file {file!r}" in str(result), str(result)
        return True
    return False


# --------------------------------------------------------------------------- JSON mutation

# Values that have broken, or could break, a parser that trusts its input's types.
HOSTILE = st.sampled_from([
    -1, -(2**63), 2**63, 2**64, 10**30, 10**300, 1.5, 2.0, -0.0, 1e308, True, False, None,
    "", "3", "F32", "\ud800", "../x.safetensors", "a/b", "x" * 300, [], {}, [[]], [1, 2, 3],
    [-1], [True], [1.5], [2**64], {"a": 1}, [[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]],
]) | JSON


FIELDS = {"file", "offsets", "shape", "dtype", "data_offsets", "saved_offsets", "weight_map",
          "slices", "version", "__metadata__"}


def paths(document: object) -> list[tuple]:
    """The locations in a JSON document down to depth 12, the root included.

    Iterative: an earlier mutation may have nested the document thousands deep.
    """
    found, stack = [], [((), document)]
    while stack:
        prefix, value = stack.pop()
        found.append(prefix)
        if len(prefix) < 12 and isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((prefix + (key,), item) for key, item in items)
    return found


@st.composite
def mutated(draw, documents: st.SearchStrategy) -> bytes:
    """A valid document with 0-3 structural mutations, serialized (sometimes byte-mangled)."""
    document = copy.deepcopy(draw(documents))
    for _ in range(draw(st.integers(0, 3), label="mutations")):
        everywhere = paths(document)
        # Half the time, a field the parsers interpret (or an element of one) rather than any
        # location: those are where a wrong value can turn into a wrong read.
        fields = [q for q in everywhere if any(k in FIELDS for k in q[-2:] if isinstance(k, str))]
        path = draw(st.sampled_from(fields if fields and draw(st.booleans()) else everywhere))
        parent, key = (None, None) if not path else (_at(document, path[:-1]), path[-1])
        operation = draw(st.sampled_from(
            ["replace", "replace", "replace", "steal", "steal", "delete", "duplicate", "rename",
             "deepen", "swap"]))
        if parent is None:
            if operation == "replace":
                document = copy.deepcopy(draw(HOSTILE))  # sampled values are shared objects
            continue
        if operation == "replace":
            parent[key] = copy.deepcopy(draw(HOSTILE))
        elif operation == "steal":  # another field's value: a sibling's file name, offsets, shape...
            everywhere = paths(document)
            alike = [q for q in everywhere if q and q[-1] == key and q != path]  # e.g. another "file"
            source = draw(st.sampled_from(alike if alike and draw(st.booleans()) else everywhere))
            parent[key] = copy.deepcopy(_at(document, source))
        elif operation == "delete":
            del parent[key]
        elif operation == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif operation == "rename" and isinstance(parent, dict):
            new_key = draw(ANY_TEXT | st.sampled_from(list(parent)))  # an existing key: a collision
            parent[new_key] = parent.pop(key)
        elif operation == "deepen":  # a marker, spliced in as text: no Python recursion here
            parent[key] = f"\x00DEEP{draw(st.sampled_from([2, 126, 127, 128, 500, 990, 5000]))}"
        elif operation == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = draw(st.integers(0, len(parent) - 1))
            parent[key], parent[other] = parent[other], parent[key]
    raw = json.dumps(document, indent=draw(st.sampled_from([None, 1]))).encode("utf-8")
    raw = re.sub(rb'"\\u0000DEEP(\d+)"', lambda m: b"[" * int(m[1]) + b"]" * int(m[1]), raw)
    if draw(st.booleans()):  # byte-level damage too: a flip, a cut, an insertion
        position = draw(st.integers(0, len(raw)))
        change = draw(st.sampled_from(["flip", "cut", "insert"]))
        if change == "flip" and position < len(raw):
            raw = raw[:position] + bytes([raw[position] ^ draw(st.integers(1, 255))]) + raw[position + 1:]
        elif change == "cut":
            raw = raw[:position]
        else:
            raw = raw[:position] + draw(st.binary(min_size=1, max_size=8)) + raw[position:]
    return raw


def _at(document: object, path: tuple) -> object:
    for key in path:
        document = document[key]
    return document


# --------------------------------------------------------------------------- valid documents

NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)


@st.composite
def hf_indexes(draw) -> dict:
    names = draw(st.lists(NAMES, max_size=6, unique=True))
    count = draw(st.integers(1, 3))
    return {"metadata": {"total_size": draw(st.integers(0, 10**6))},
            "weight_map": {n: f"model-{draw(st.integers(1, count)):05d}-of-{count:05d}.safetensors"
                           for n in names}}


def grid_slices(shape: tuple[int, ...], splits: tuple[int, ...]) -> list[tuple[tuple, tuple]]:
    """``(offsets, shape)`` of the blocks of ``shape`` cut evenly-ish ``splits`` times per dimension."""
    edges = [sorted({round(i * n / k) for i in range(k + 1)}) for n, k in zip(shape, splits)]
    blocks = [((), ())]
    for cuts in edges:
        blocks = [(o + (a,), s + (b - a,)) for o, s in blocks for a, b in zip(cuts, cuts[1:])]
    return blocks


@st.composite
def distributed_documents(draw) -> dict:
    tensors = {}
    for name in draw(st.lists(NAMES, max_size=3, unique=True)):
        shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
        splits = tuple(draw(st.integers(1, n)) for n in shape)
        blocks = grid_slices(shape, splits)
        tensors[name] = {
            "dtype": draw(st.sampled_from(sorted(DTYPES))), "shape": list(shape),
            "slices": [{"file": distributed_file_name(i, 0, 1), "offsets": list(o), "shape": list(s)}
                       for i, (o, s) in enumerate(blocks)]}
    return {"format": "orbax_safetensors.distributed", "version": 1,
            "metadata": draw(st.dictionaries(NAMES, NAMES, max_size=2)), "tensors": tensors}


@st.composite
def dcp_infos(draw) -> dict:
    return {name: {"saved_offsets": draw(st.lists(st.integers(0, 9), max_size=3))}
            for name in draw(st.lists(NAMES, max_size=3, unique=True))}


INDEX_INPUTS = (st.binary(max_size=300)
                | JSON.map(lambda d: json.dumps(d).encode("utf-8", "surrogatepass")))


# --------------------------------------------------------------------------- brute-force oracle


def tiling_problem(shape: tuple[int, ...], slices: list[tuple[tuple, tuple]]) -> str | None:
    """What is wrong with ``slices`` as a tiling of ``shape``, decided element by element."""
    count = np.zeros(shape, dtype=np.int64)
    for offsets, size in slices:
        if len(offsets) != len(shape) or len(size) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, size, shape)):
            return "outside"
    for offsets, size in slices:
        count[tuple(slice(o, o + n) for o, n in zip(offsets, size))] += 1
    if (count > 1).any():
        return "overlap"
    if (count == 0).any():
        return "cover"
    return None


def exact_sizes(value: object) -> bool:
    """A list of JSON integers ≥ 0 as written: ``2.0``, ``true`` or ``"2"`` are not sizes."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def check_distributed_document(document: dict) -> None:
    """An accepted index was well typed as written, not merely after coercion."""
    assert document["format"] == "orbax_safetensors.distributed" and type(document["version"]) is int
    assert all(type(k) is str and type(v) is str for k, v in document.get("metadata", {}).items())
    for entry in document["tensors"].values():
        assert exact_sizes(entry["shape"]) and type(entry["dtype"]) is str
        for s in entry["slices"]:
            assert exact_sizes(s["offsets"]) and exact_sizes(s["shape"]) and type(s["file"]) is str


def check_distributed_result(tensors: dict[str, DistributedTensor]) -> None:
    """An accepted index really tiles every tensor, one slice per file, with plain file names."""
    for name, tensor in tensors.items():
        assert all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in tensor.shape)
        files = [s.file for s in tensor.slices]
        assert len(set(files)) == len(files)
        assert all("/" not in f and f not in (".", "..") for f in files)
        if math.prod(tensor.shape) <= 4096:
            assert tiling_problem(tensor.shape, [(s.offsets, s.shape) for s in tensor.slices]) is None


# --------------------------------------------------------------------------- (1) headers


@SETTINGS
@given(HEADER_FILES)
def test_fuzz_header_bounded(content):
    bounded(lambda: _parse_header(content), len(content))


def _parse_header(content: bytes):
    return parse_file_bytes(content, file="fuzz.safetensors")


@st.composite
def mutated_headers(draw) -> bytes:
    """A valid header with its JSON mutated structurally, data buffer kept."""
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    prefix, _ = serialize_header([("x", DTYPES["F32"], shape), ("y", DTYPES["U8"], [2])],
                                 {"format": "pt"})
    body = draw(mutated(st.just(json.loads(prefix[8:]))))
    data = bytes(4 * math.prod(shape) + 2)
    return struct.pack("<Q", len(body)) + body + data


@SETTINGS
@given(mutated_headers())
def test_fuzz_mutated_header(content):
    result = bounded(lambda: _parse_header(content), len(content))
    if not rejected_naming(result, "fuzz.safetensors"):
        theirs = dict(safetensors.deserialize(content))  # what we accept, the crate reads the same
        assert {n: (t.dtype.code, list(t.shape)) for n, t in result.tensors.items()} == {
            n: (t["dtype"], list(t["shape"])) for n, t in theirs.items()}


# --------------------------------------------------------------------------- (2) HF index


def _hf(raw: bytes):
    return parse_index(raw, file="fuzz.index.json")


def check_hf_result(index) -> None:
    for name, target in index.weight_map.items():
        assert isinstance(name, str) and isinstance(target, str)
        assert target and "/" not in target and "\\" not in target and target not in (".", "..")
        name.encode("utf-8")
        target.encode("utf-8")


@SETTINGS
@given(INDEX_INPUTS)
def test_fuzz_hf_index_any_input(raw):
    result = bounded(lambda: _hf(raw), len(raw))
    if not rejected_naming(result, "fuzz.index.json"):
        check_hf_result(result)


@settings(SETTINGS, max_examples=600)
@given(mutated(hf_indexes()))
def test_fuzz_hf_index_mutated(raw):
    result = bounded(lambda: _hf(raw), len(raw))
    if not rejected_naming(result, "fuzz.index.json"):
        check_hf_result(result)
        assert result.weight_map == json.loads(raw)["weight_map"]


# --------------------------------------------------------------------------- (3) distributed index


def _dist(raw: bytes):
    return parse_distributed_index(raw, file="fuzz.distributed.json")


@SETTINGS
@given(INDEX_INPUTS)
def test_fuzz_distributed_index_any_input(raw):
    result = bounded(lambda: _dist(raw), len(raw))
    if not rejected_naming(result, "fuzz.distributed.json"):
        check_distributed_result(result[0])


@settings(SETTINGS, max_examples=1000)
@given(mutated(distributed_documents()))
def test_fuzz_distributed_index_mutated(raw):
    result = bounded(lambda: _dist(raw), len(raw))
    if not rejected_naming(result, "fuzz.distributed.json"):
        tensors, metadata, crcs = result
        check_distributed_result(tensors)
        document = json.loads(raw)
        check_distributed_document(document)
        assert metadata == document.get("metadata", {})
        assert crcs == document.get("crc32c", {})
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        for name, tensor in tensors.items():
            assert tensor.dtype.code == document["tensors"][name]["dtype"]
            assert list(tensor.shape) == document["tensors"][name]["shape"]


def _dcp(text: str):
    return dcp_offsets({DCP_SHARDING_INFO: text}, file="fuzz.safetensors")


@SETTINGS
@given(mutated(dcp_infos()) | INDEX_INPUTS)
def test_fuzz_dcp_offsets(raw):
    text = raw.decode("utf-8", "surrogateescape")
    result = bounded(lambda: _dcp(text), len(raw))
    if not rejected_naming(result, "fuzz.safetensors"):
        document = json.loads(text)
        assert all(exact_sizes(e["saved_offsets"]) for e in document.values())
        assert result == {n: tuple(e["saved_offsets"]) for n, e in document.items()}
        assert all(isinstance(o, int) and not isinstance(o, bool) and o >= 0
                   for offsets in result.values() for o in offsets)


# --------------------------------------------------------------------------- (4) check_slices


BOXES = st.lists(st.tuples(st.lists(st.integers(-1, 6), min_size=2, max_size=2),
                           st.lists(st.integers(0, 5), min_size=2, max_size=2)), max_size=10)


@st.composite
def slice_sets(draw) -> tuple[tuple[int, ...], list[tuple[tuple, tuple]]]:
    """A grid tiling of a small 2-D tensor, often damaged: moved, resized, added, dropped."""
    shape = (draw(st.integers(0, 6)), draw(st.integers(0, 6)))
    blocks = grid_slices(shape, tuple(draw(st.integers(1, max(n, 1))) for n in shape))
    if draw(st.booleans()):  # merge the first row of blocks: no longer a pure grid
        blocks = [b for b in blocks if b[0][0] != 0] + [((0, 0), (blocks[0][1][0], shape[1]))] \
            if blocks and blocks[0][1][0] else blocks
    for _ in range(draw(st.integers(0, 2))):
        change = draw(st.sampled_from(["move", "resize", "add", "drop"]))
        if change == "add" or not blocks:
            blocks.append(tuple(map(tuple, draw(BOXES.filter(bool))[0])))
            continue
        i = draw(st.integers(0, len(blocks) - 1))
        offsets, size = blocks[i]
        if change == "drop":
            del blocks[i]
        elif change == "move":
            blocks[i] = (tuple(o + draw(st.integers(-2, 2)) for o in offsets), size)
        else:
            blocks[i] = (offsets, tuple(max(0, n + draw(st.integers(-2, 2))) for n in size))
    return shape, blocks


@pytest.fixture(params=["grid", "sweep"])
def algorithm(request, monkeypatch):
    """Runs a test through each of check_slices' two algorithms (the same for every example)."""
    if request.param == "sweep":
        monkeypatch.setattr(distributed_index, "_GRID_CELLS_PER_SLICE", 0)
        monkeypatch.setattr(distributed_index, "_GRID_MIN_CELLS", 0)
    return request.param


@settings(SETTINGS, max_examples=500,
          suppress_health_check=[*SETTINGS.suppress_health_check, HealthCheck.function_scoped_fixture])
@given(case=slice_sets())
def test_check_slices_agrees_with_brute_force(algorithm, case):
    shape, blocks = case
    slices = [SliceEntry(f"f{i}", o, s) for i, (o, s) in enumerate(blocks)]
    expected = tiling_problem(shape, blocks)
    try:
        check_slices("t", shape, slices, file="idx.json")
    except SafetensorsError as e:
        assert expected is not None, f"rejected a tiling: {e}"
        assert "tensor 't'" in str(e) and "idx.json" in str(e)
        assert expected in str(e), f"expected a complaint about {expected!r}: {e}"
        return
    assert expected is None, f"accepted slices with a problem: {expected}"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_check_slices_is_fast_at_real_scale():
    """1000 hosts × 8 devices, and 40000 slices: each well under a second (pairwise took minutes)."""
    for shape, splits in [((8000, 64), (1000, 8)), ((4000, 40), (4000, 10))]:
        blocks = grid_slices(shape, splits)
        slices = [SliceEntry(f"f{i}", o, s) for i, (o, s) in enumerate(blocks)]
        assert _timed(lambda: check_slices("w", shape, slices, file="i")) < 1.0
        overlapping = slices + [SliceEntry("extra", (shape[0] - 1, shape[1] - 1), (1, 1))]
        with pytest.raises(SafetensorsError, match=r"tensor 'w'.*\(in 'extra'\) overlap|"
                                                   r"tensor 'w'.*and \[.*\] \(in 'extra'\) overlap"):
            check_slices("w", shape, overlapping, file="i")
        with pytest.raises(SafetensorsError, match="nothing covers the element at"):
            check_slices("w", shape, slices[1:], file="i")


def test_check_slices_fallback_is_fast_on_a_brick_wall():
    """Rows of bricks shifted by half a brick: no grid, the sweep compares neighbours only."""
    rows, bricks, width = 100, 60, 8
    slices = []
    for r in range(rows):
        cuts = [0] + [b * width + (width // 2 if r % 2 else 0) for b in range(1, bricks)] + [bricks * width]
        slices += [SliceEntry(f"f{r}-{i}", (r, a), (1, b - a)) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    shape = (rows, bricks * width)
    assert _timed(lambda: check_slices("w", shape, slices, file="i")) < 1.0
    moved = slices[:-1] + [SliceEntry("moved", (rows - 1, bricks * width - width - 1), (1, width))]
    with pytest.raises(SafetensorsError, match="overlap"):
        check_slices("w", shape, moved, file="i")


def crossing_bars(n: int) -> tuple[tuple[int, int], list[SliceEntry]]:
    """``n/2`` one-row bars on the left half and ``n/2`` one-column bars on the right.

    A valid tiling built to defeat both algorithms: ``n²/4`` grid cells, and in
    either dimension every bar's extent meets ``n/2`` others.
    """
    half = n // 2
    bars = [SliceEntry(f"row{i}", (i, 0), (1, half)) for i in range(half)]
    bars += [SliceEntry(f"column{j}", (0, half + j), (half, 1)) for j in range(half)]
    return (half, 2 * half), bars


def test_check_slices_refuses_layouts_too_irregular_to_check(monkeypatch):
    shape, bars = crossing_bars(2000)
    assert _timed(lambda: check_slices("w", shape, bars, file="i")) < 1.0  # 10**6 pairs: checked
    monkeypatch.setattr(distributed_index, "_MAX_PAIRS", 10**5)
    with pytest.raises(SafetensorsError, match=r"tensor 'w'.* 2000 slices that neither form a grid"):
        check_slices("w", shape, bars, file="i")


# --------------------------------------------------------------------------- (5) whole checkpoints


TREE = {
    "a": np.arange(24, dtype=np.float32).reshape(4, 6),
    "b": np.arange(10, dtype=np.int16),
    "c": np.arange(6, dtype=np.uint8).reshape(2, 3),
    "d": np.float32(7.0).reshape(()),
}


def _handmade_distributed(path: Path, with_index: bool) -> None:
    """``a`` in 2×2 blocks and ``b`` in halves over four files, as four processes would write them."""
    path.mkdir()
    blocks = {"a": grid_slices((4, 6), (2, 2)), "b": grid_slices((10,), (2,))}
    slices: dict[str, list[SliceEntry]] = {"a": [], "b": []}
    for p in range(4):
        file = distributed_file_name(p, 0, 1)
        held = {n: blocks[n][p] for n in blocks if p < len(blocks[n])}
        values = {n: np.ascontiguousarray(TREE[n][tuple(slice(o, o + s) for o, s in zip(*b))])
                  for n, b in held.items()}
        prefix, _ = serialize_header(
            [(n, DTYPES["F32" if n == "a" else "I16"], v.shape) for n, v in values.items()],
            {"format": "pt", **dcp_metadata({n: b[0] for n, b in held.items()})})
        (path / file).write_bytes(prefix + b"".join(v.tobytes() for v in values.values()))
        for n, (offsets, shape) in held.items():
            slices[n].append(SliceEntry(file, offsets, shape))
    if with_index:
        (path / DISTRIBUTED_INDEX_NAME).write_bytes(serialize_distributed_index(
            {n: DistributedTensor(DTYPES["F32" if n == "a" else "I16"], TREE[n].shape, tuple(s))
             for n, s in slices.items()}, {"framework": "jax"}))


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    ost.save(root / "hf", TREE, max_shard_size=40)
    ost.save(root / "distributed", TREE, layout="distributed", max_shard_size=40)
    _handmade_distributed(root / "sliced", with_index=True)
    _handmade_distributed(root / "dcp", with_index=False)
    for name in ("hf", "distributed", "sliced", "dcp"):  # the templates themselves load right
        loaded = ost.load(root / name)
        assert {k: v.tolist() for k, v in loaded.items()} == {
            k: v.tolist() for k, v in TREE.items() if name in ("hf", "distributed") or k in "ab"}
    return {"hf": root / "hf", "distributed": root / "distributed", "sliced": root / "sliced",
            "dcp": root / "dcp"}


@st.composite
def damage(draw, files: list[str]) -> list[tuple]:
    """1-2 changes to a checkpoint's files: header or index mutations, truncation, extension, removal."""
    changes = []
    indexes = [f for f in files if f.endswith(".json")]
    for _ in range(draw(st.integers(1, 2))):
        # Half the changes go to the index, when there is one: it holds the most structure.
        file = draw(st.sampled_from(files) | st.sampled_from(indexes or files))
        kind = draw(st.sampled_from(
            ["json", "json", "json", "json", "byte", "truncate", "extend", "remove", "dcp",
             "slices"]))
        changes.append((file, kind, draw(st.integers(0, 2**32)), draw(st.binary(min_size=1, max_size=9))))
    return changes


def _apply(path: Path, change: tuple, draw_json: Callable[[object], bytes]) -> None:
    file, kind, number, junk = change
    target = path / file
    if not target.exists():
        return  # removed by an earlier change
    content = target.read_bytes()
    is_index = file.endswith(".json")
    if kind == "remove":
        target.unlink()
    elif kind == "truncate":
        target.write_bytes(content[:number % (len(content) + 1)])
    elif kind == "extend":
        target.write_bytes(content + junk)
    elif kind == "byte" and content:
        limit = len(content) if is_index or len(content) < 8 else min(
            len(content), 8 + struct.unpack("<Q", content[:8])[0])
        i = number % max(limit, 1)
        target.write_bytes(content[:i] + bytes([content[i] ^ junk[0] or 1]) + content[i + 1:])
    elif not _parses(content, is_index):
        return  # an earlier change broke it: nothing structured left to mutate
    elif is_index and kind == "slices":
        target.write_bytes(json.dumps(_mix_slices(json.loads(content), number, junk)).encode())
    elif is_index:
        target.write_bytes(draw_json(json.loads(content)))
    else:
        n = struct.unpack("<Q", content[:8])[0]
        header = json.loads(content[8:8 + n])
        metadata = header.get("__metadata__")
        if kind == "dcp" and isinstance(metadata, dict) and _parses(
                str(metadata.get(DCP_SHARDING_INFO)).encode("utf-8", "surrogatepass"), True):
            info = json.loads(metadata[DCP_SHARDING_INFO])
            metadata[DCP_SHARDING_INFO] = draw_json(info).decode("utf-8", "replace")
            body = json.dumps(header).encode("utf-8")
        else:
            body = draw_json(header)
        target.write_bytes(struct.pack("<Q", len(body)) + body + content[8 + n:])


def _mix_slices(index: dict, number: int, junk: bytes) -> dict:
    """A writer's mix-up: one slice's file, offsets or shape swapped with (or copied from) another's.

    Only the distributed index has slices; an HF index gets a weight_map entry copied instead.
    """
    if "weight_map" in index and isinstance(index["weight_map"], dict) and len(index["weight_map"]) > 1:
        names = sorted(index["weight_map"])
        a, b = names[number % len(names)], names[(number // 7 + 1) % len(names)]
        index["weight_map"][a] = index["weight_map"][b]
        return index
    lists = [t["slices"] for t in (index.get("tensors") or {}).values()
             if isinstance(t, dict) and isinstance(t.get("slices"), list) and len(t["slices"]) > 1]
    if not lists:
        return index
    slices = lists[number % len(lists)]
    i, j = number // 3 % len(slices), (number // 5 + 1 + number // 3) % len(slices)
    field = ("file", "offsets", "shape")[junk[0] % 3]
    if i != j and all(isinstance(s, dict) and field in s for s in (slices[i], slices[j])):
        if junk[0] & 8:
            slices[i][field], slices[j][field] = slices[j][field], slices[i][field]
        else:
            slices[i][field] = copy.deepcopy(slices[j][field])
    return index


def _parses(content: bytes, is_index: bool) -> bool:
    """Whether ``content`` is still a JSON object (an index) or a file with a JSON-object header."""
    try:
        if not is_index:
            n = struct.unpack("<Q", content[:8])[0]
            if len(content) < 8 + n:
                return False
            content = content[8:8 + n]
        document = json.loads(content)
    except (ValueError, struct.error, RecursionError):
        return False
    # Shallow enough to copy with copy.deepcopy (an earlier change may have nested it 990 deep).
    return isinstance(document, dict) and max(map(len, paths(document))) < 12


def reference_load(path: Path) -> dict[str, np.ndarray] | None:
    """What the files say, read without the library: plain json + the Rust crate. None: invalid."""
    def read(file: Path) -> dict:
        try:
            return dict(safetensors.deserialize(file.read_bytes()))
        except Exception:  # noqa: BLE001 - any crate rejection (or a missing file) means invalid
            return None

    def array(entry: dict) -> np.ndarray:
        return np.frombuffer(bytes(entry["data"]), DTYPES[entry["dtype"]].numpy).reshape(entry["shape"])

    if (path / DISTRIBUTED_INDEX_NAME).exists() or (path / INDEX_NAME).exists():
        distributed = (path / DISTRIBUTED_INDEX_NAME).exists()
        try:
            index = json.loads((path / (DISTRIBUTED_INDEX_NAME if distributed else INDEX_NAME)).read_bytes())
        except ValueError:
            return None
        result = {}
        if not distributed:
            for name, file in index["weight_map"].items():
                tensors = read(path / file)
                if tensors is None or name not in tensors:
                    return None
                result[name] = array(tensors[name])
            return result
        try:
            check_distributed_document(index)
        except (AssertionError, KeyError, TypeError, AttributeError):
            return None
        for name, entry in index["tensors"].items():
            files = [s["file"] for s in entry["slices"]]
            if len(set(files)) != len(files):  # a file holds one entry, so one slice, of a name
                return None
            whole = np.zeros(entry["shape"], DTYPES[entry["dtype"]].numpy)
            for s in entry["slices"]:
                tensors = read(path / s["file"])
                if tensors is None or name not in tensors:
                    return None
                whole[tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))] = array(tensors[name])
            result[name] = whole
        return result
    return None  # the DCP layout's reference is the file-by-file check in test_fuzz_checkpoint


@contextlib.contextmanager
def reads_checked():
    """Asserts every read of a local file stays inside the file; yields the violations."""
    outside: list[tuple] = []
    read, read_scatter = LocalStorage.read, LocalStorage.read_scatter

    def check(path: str, offset: int, length: int) -> None:
        size = os.stat(path).st_size
        if offset < 0 or length < 0 or offset + length > size:
            outside.append((path, offset, length, size))
            raise AssertionError(f"read of [{offset}, {offset + length}) from a {size}-byte {path}")

    def checked_read(self, path, offset, length):
        check(path, offset, length)
        return read(self, path, offset, length)

    def checked_read_scatter(self, path, offset, buffers):
        check(path, offset, sum(memoryview(b).nbytes for b in buffers))
        return read_scatter(self, path, offset, buffers)

    with mock.patch.object(LocalStorage, "read", checked_read), \
            mock.patch.object(LocalStorage, "read_scatter", checked_read_scatter):
        yield outside


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.parametrize("layout", ["hf", "distributed", "sliced", "dcp"])
@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_fuzz_checkpoint(templates, tmp_path_factory, layout, data):
    template = templates[layout]
    files = sorted(f.name for f in template.iterdir())
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shutil.copytree(template, path)
    for change in data.draw(damage(files), label="changes"):
        _apply(path, change, lambda document: data.draw(mutated(st.just(document)), label="json"))
    size = _tree_size(path)
    allowed = (SafetensorsError, FileNotFoundError)
    with reads_checked() as outside:
        meta = bounded(lambda: ost.metadata(path), size, allowed=allowed, seconds=10.0,
                       constant=4 << 20)
        loaded = bounded(lambda: ost.load(path), size, allowed=allowed, seconds=10.0,
                         constant=4 << 20)
    assert not outside
    event(f"load: {type(loaded).__name__ if isinstance(loaded, Exception) else 'loaded'}")
    for result in (meta, loaded):
        if isinstance(result, SafetensorsError):
            assert os.fspath(path) in str(result), str(result)
    if isinstance(loaded, Exception):
        return
    assert not isinstance(meta, Exception), f"metadata failed ({meta}) where load succeeded"
    assert {n: (tuple(v.shape), v.dtype) for n, v in loaded.items()} == {
        n: (tuple(s.shape), s.dtype) for n, s in meta.tensors.items()}
    if not (path / INDEX_NAME).exists() and not (path / DISTRIBUTED_INDEX_NAME).exists():
        # Without an index (the dcp template, or a removed one: our distributed files are
        # torch DCP files) each file says where its slice goes; the reference is every
        # file's own (crate-read) slice at its own saved_offsets.
        for file in path.iterdir():
            content = file.read_bytes()
            tensors = dict(safetensors.deserialize(content))
            header = json.loads(content[8:8 + struct.unpack("<Q", content[:8])[0]])
            offsets = json.loads(header.get("__metadata__", {}).get(DCP_SHARDING_INFO, "{}"))
            assert all(exact_sizes(e["saved_offsets"]) for e in offsets.values())
            for name, entry in tensors.items():
                origin = offsets.get(name, {"saved_offsets": [0] * len(entry["shape"])})["saved_offsets"]
                box = tuple(slice(o, o + n) for o, n in zip(origin, entry["shape"]))
                assert loaded[name][box].tobytes() == bytes(entry["data"]), (file, name)
        return
    expected = reference_load(path)
    assert expected is not None, "loaded a checkpoint the reference reader finds invalid"
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
        assert loaded[name].tobytes() == value.tobytes(), name


# --------------------------------------------------------------------------- corpus


TARGETS: dict[str, Callable[[bytes], object]] = {
    "header": lambda raw: parse_file_bytes(raw, file="corpus.safetensors"),
    "hf_index": lambda raw: parse_index(raw, file="corpus.safetensors"),
    "distributed_index": lambda raw: parse_distributed_index(raw, file="corpus.safetensors"),
    "dcp_sharding_info": lambda raw: dcp_offsets(
        {DCP_SHARDING_INFO: raw.decode("utf-8", "surrogateescape")}, file="corpus.safetensors"),
}
CORPUS_FILES = sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.glob("*/*"))


def test_corpus_is_complete():
    """Every corpus file has its expectation, every expectation its file, every target its cases."""
    assert set(CORPUS_FILES) == set(EXPECTED)
    assert {name.split("/")[0] for name in CORPUS_FILES} == set(TARGETS)


@pytest.mark.parametrize("case", CORPUS_FILES)
def test_corpus_case_is_rejected(case):
    target = case.split("/")[0]
    raw = (CORPUS / case).read_bytes()
    expected = EXPECTED[case]
    result = bounded(lambda: TARGETS[target](raw), len(raw))
    assert isinstance(result, SafetensorsError), f"{case} was accepted"
    assert "file 'corpus.safetensors'" in str(result)
    assert expected["message"] in str(result), str(result)
    if "tensor" in expected:
        assert f"tensor {expected['tensor']!r}" in str(result), str(result)
    if target == "header":
        try:
            safetensors.deserialize(raw)
            crate = "accept"
        except Exception as e:  # noqa: BLE001
            assert type(e).__name__ == "SafetensorError", repr(e)
            crate = "reject"
        assert crate == expected.get("rust", "reject"), f"the Rust crate would {crate} {case}"


# --------------------------------------------------------------------------- atheris


def test_atheris_harness_runs_clean(tmp_path):
    """The coverage-guided harness, seeded with the corpus, for a bounded number of inputs."""
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for case in CORPUS_FILES:  # libFuzzer writes new inputs into its first corpus directory
        target = list(TARGETS).index(case.split("/")[0])
        (seeds / case.replace("/", "__")).write_bytes(bytes([target]) + (CORPUS / case).read_bytes())
    done = subprocess.run(
        [sys.executable, str(REPO / "fuzz" / "fuzz_parsers.py"), "-runs=100000", "-seed=1",
         "-max_len=2048", "-timeout=10", "-rss_limit_mb=4096", str(seeds)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Done 100000 runs" in done.stderr, done.stderr[-3000:]
