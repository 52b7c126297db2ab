"""Orbax's own tests of its v1 ``SafetensorsLayout``, run against ``ost.SafetensorsLayout``.

Ported from google/orbax at commit 3ff7b24aa0e23db4a575f7dc4bc6f815008ac6fd (the layout
is the same in the installed orbax-checkpoint 0.12.8), under
``checkpoint/orbax/checkpoint/experimental/v1/_src/``:

* ``layout/safetensors_layout_test.py``: every test, by Orbax's class and test name;
* ``loading/layout_loading_test.py`` and ``metadata/loading_test.py``: the SAFETENSORS
  cases, through Orbax's own entry points (``ocp.v1.load``, ``load_async``, ``metadata``,
  ``checkpointables_metadata``) with ``ost.install_orbax_layout()`` in force;
* ``layout/safetensors_layout_multiprocess_test.py``: ``tests/multiprocess/test_orbax_layout_port_multiprocess.py``.

Each test says where it differs from Orbax's on purpose and why; everything else is
Orbax's assertion, with loaded arrays compared bit for bit where Orbax compares values.
The recurring differences: ours raises from ``load`` itself what fails before a read (a
missing tensor, a shape mismatch, a truncated file), not from its awaitable; our messages
name the file and tensor in our own words; ``abstract_state`` may be nested; and
``checkpointables_metadata``, ``load_checkpointables`` and saving work instead of raising
``NotImplementedError``. Tests of Orbax's private read planner (byte runs, coalescing,
chunk reads, its monitoring metrics and over-read warning) are ported where our planner has
the same function (``planning.byte_runs``, ``normalize_index``) and skipped, with the
reason, where it has none.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
import warnings
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp_v1
import pytest
import safetensors.numpy
from orbax.checkpoint.experimental.v1._src.loading import loading as orbax_loading

import orbax_safetensors as ost
from orbax_safetensors.planning import byte_runs, normalize_index

SafetensorsLayout = ost.SafetensorsLayout
InvalidLayoutError = ocp_v1.errors.InvalidLayoutError
np_save_file = safetensors.numpy.save_file
SAFETENSORS = ocp_v1.options.CheckpointLayout.SAFETENSORS


def _run(coroutine):
    return asyncio.run(coroutine)


def _load(layout, path, abstract_state=None):
    """``await (await layout.load(...))``: the layout's two steps, as Orbax's tests await them."""
    async def both():
        return await (await layout.load(path, abstract_state=abstract_state))
    return _run(both())


def _same(loaded, expected):
    """Bit for bit: dtype, shape and bytes."""
    loaded = np.asarray(loaded)
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    assert loaded.tobytes() == expected.tobytes()


# --------------------------------------------------------------------------- SafetensorsLayoutTest

OBJECT_TO_SAVE = {"a": np.array(3 * [1, 2, 3], dtype=np.int32), "b": np.array([0, 1, 0.2], dtype=np.float32)}
CUSTOM_METADATA = {"framework": "JAX", "version": "1.0"}


@pytest.fixture
def paths(tmp_path):
    """setUp: a safetensors file (with custom metadata) and an Orbax checkpoint of the same tree."""
    safetensors_path = tmp_path / "test_checkpoint.safetensors"
    np_save_file(OBJECT_TO_SAVE, safetensors_path, metadata=CUSTOM_METADATA)
    orbax_path = tmp_path / "test_checkpoint"
    ocp_v1.save(orbax_path, OBJECT_TO_SAVE)
    return {"safetensors": safetensors_path, "orbax": orbax_path, "dir": tmp_path}


def test_valid_safetensors_checkpoint(paths):
    _run(SafetensorsLayout().validate_checkpointables(paths["safetensors"]))


def test_invalid_safetensors_checkpoint_orbax(paths):
    """Also the Orbax checkpoint itself, not only its missing ``0`` (ours reads what is there)."""
    for path in (paths["orbax"] / "0", paths["orbax"]):
        with pytest.raises(InvalidLayoutError):
            _run(SafetensorsLayout().validate_checkpointables(path))


def test_validate_fails_wrong_suffix(paths):
    """Orbax's case is a path that does not exist; a file that does, without the suffix, too."""
    wrong = paths["dir"] / "test_checkpoint.txt"
    with pytest.raises(InvalidLayoutError):
        _run(SafetensorsLayout().validate_checkpointables(wrong))
    wrong.write_bytes(paths["safetensors"].read_bytes())
    with pytest.raises(InvalidLayoutError, match="not a checkpoint directory"):
        _run(SafetensorsLayout().validate_checkpointables(wrong))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.float16, np.float32, np.float64,
                                   np.bool_, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn],
                         ids=lambda d: np.dtype(d).name)
def test_load_safetensors_checkpoint(tmp_path, dtype):
    test_path = tmp_path / f"test_{np.dtype(dtype).name}.safetensors"
    arr = np.array([True, False, True, False]) if dtype == np.bool_ else np.arange(8, dtype=dtype)
    obj_to_save = {"x": arr, "y": np.array([1, 2, 3], dtype=np.int32)}
    np_save_file(obj_to_save, test_path)
    pytree = _load(SafetensorsLayout(), test_path)
    _same(pytree["x"], obj_to_save["x"])
    _same(pytree["y"], obj_to_save["y"])


def test_load_truncated_file_raises(paths):
    """Orbax matches 'truncated'; ours names the file and what runs past its end. Raised by
    ``load()`` itself, before any read, as in Orbax."""
    full = paths["safetensors"].read_bytes()
    paths["safetensors"].write_bytes(full[:-8])
    with pytest.raises(ValueError, match="is truncated: it has") as raised:
        _run(SafetensorsLayout().load(paths["safetensors"]))
    assert str(paths["safetensors"]) in str(raised.value)


def test_load_fails_with_incomplete_dtypes(tmp_path):
    """Orbax mocks its private dtype table (``_get_dtypes``) to lack I32. The intent, without
    the mock: a dtype the reader does not know fails the load with a ValueError naming it."""
    header = json.dumps({"a": {"dtype": "I3", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "unknown_dtype.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="I3"):
        _load(SafetensorsLayout(), path)


def test_metadata(paths):
    """``commit_timestamp_nsecs``: Orbax's layout gives ``int(st_mtime)`` of the newest file,
    whole *seconds* under a nanoseconds name (etils' ``stat().mtime``); ours the newest
    ``st_mtime_ns``, nanoseconds, like Orbax's own checkpoints (``time.time_ns()``)."""
    metadata = _run(SafetensorsLayout().metadata(paths["safetensors"], None))
    assert isinstance(metadata, ocp_v1.CheckpointMetadata)
    assert metadata.metadata == {"b": jax.ShapeDtypeStruct(shape=(3,), dtype=np.float32),
                                 "a": jax.ShapeDtypeStruct(shape=(9,), dtype=np.int32)}
    assert metadata.custom_metadata == CUSTOM_METADATA
    assert isinstance(metadata.commit_timestamp_nsecs, int) and metadata.commit_timestamp_nsecs > 0
    assert metadata.commit_timestamp_nsecs == os.stat(paths["safetensors"]).st_mtime_ns


def test_checkpointables_metadata_raises(paths):
    """Deliberately different: Orbax's raises NotImplementedError; ours gives the one
    checkpointable a flat checkpoint has, named "state"."""
    metadata = _run(SafetensorsLayout().checkpointables_metadata(paths["safetensors"]))
    assert metadata.metadata == {"state": {"b": jax.ShapeDtypeStruct((3,), np.float32),
                                           "a": jax.ShapeDtypeStruct((9,), np.int32)}}
    assert metadata.custom_metadata == CUSTOM_METADATA


def test_load_checkpointables_raises(paths):
    """Deliberately different: Orbax's raises NotImplementedError; ours loads ``{"state": tree}``."""
    async def both():
        return await (await SafetensorsLayout().load_checkpointables(paths["safetensors"]))
    loaded = _run(both())
    assert list(loaded) == ["state"]
    for name, value in OBJECT_TO_SAVE.items():
        _same(loaded["state"][name], value)


def test_save_raises_not_implemented(tmp_path):
    """Deliberately different: Orbax's layout cannot save; ours writes the one checkpointable
    and refuses what is not one (Orbax's own call, ``checkpointables={}``)."""
    path = mock.Mock(spec=ocp_v1.path.PathAwaitingCreation)
    with pytest.raises(ValueError, match="holds one PyTree"):
        _run(SafetensorsLayout().save_checkpointables(path, checkpointables={}))

    async def save():
        await (await SafetensorsLayout().save_checkpointables(
            str(tmp_path / "saved"), checkpointables={"state": OBJECT_TO_SAVE}))
    _run(save())
    for name, value in OBJECT_TO_SAVE.items():
        _same(ost.load(tmp_path / "saved")[name], value)


# --------------------------------------------------------------------------- SafetensorsLayoutDirectoryTest

DATA1 = {"a": np.array([1, 2], dtype=np.int32), "c": np.array([5, 6], dtype=np.int32)}
DATA2 = {"b": np.array([3.0, 4.0], dtype=np.float32), "d": np.array([7.0, 8.0], dtype=np.float32)}


@pytest.fixture
def checkpoint_dir(tmp_path):
    """setUp: two files of a directory without index (``part1``/``part2.safetensors``)."""
    directory = tmp_path / "checkpoint_dir"
    directory.mkdir()
    np_save_file(DATA1, directory / "part1.safetensors")
    np_save_file(DATA2, directory / "part2.safetensors")
    return directory


def test_validate_directory(checkpoint_dir):
    _run(SafetensorsLayout().validate_checkpointables(checkpoint_dir))


def test_validate_directory_fails_empty(tmp_path):
    """Orbax matches 'does not contain any'; ours names what a directory needs."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidLayoutError, match=r"or \*\.safetensors file in this directory"):
        _run(SafetensorsLayout().validate_checkpointables(tmp_path / "empty"))


def test_load_directory(checkpoint_dir):
    pytree = _load(SafetensorsLayout(), checkpoint_dir)
    for name, value in {**DATA1, **DATA2}.items():
        _same(pytree[name], value)


@pytest.mark.parametrize("name", ["test_checkpointables_metadata_directory", "test_metadata_directory"])
def test_metadata_directory(checkpoint_dir, name):
    """Orbax's two tests of the same call, as one."""
    state_meta = _run(SafetensorsLayout().metadata(checkpoint_dir, None)).metadata
    assert state_meta == {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in {**DATA1, **DATA2}.items()}


def test_load_directory_abstract_tree_all_keys(checkpoint_dir):
    tree = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in {**DATA1, **DATA2}.items()}
    pytree = _load(SafetensorsLayout(), checkpoint_dir, tree)
    assert len(pytree) == 4
    for name, value in {**DATA1, **DATA2}.items():
        _same(pytree[name], value)


def test_load_directory_abstract_tree_sharding(checkpoint_dir):
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("x",)),
                                          jax.sharding.PartitionSpec(None))
    tree = {n: jax.ShapeDtypeStruct((2,), np.int32, sharding=sharding) for n in ("a", "c")}
    pytree = _load(SafetensorsLayout(), checkpoint_dir, tree)
    assert len(pytree) == 2
    for name in ("a", "c"):
        assert pytree[name].sharding == sharding
        _same(pytree[name], DATA1[name])


@pytest.mark.parametrize("names", [("a", "c"), ("a", "b")], ids=["one_file", "many_files"])
def test_load_directory_abstract_tree_subset(checkpoint_dir, names):
    """test_load_directory_abstract_tree_subset_one_file and ..._many_files."""
    values = {**DATA1, **DATA2}
    tree = {n: jax.ShapeDtypeStruct(values[n].shape, values[n].dtype) for n in names}
    pytree = _load(SafetensorsLayout(), checkpoint_dir, tree)
    assert sorted(pytree) == sorted(names)
    for name in names:
        _same(pytree[name], values[name])


def test_load_directory_abstract_tree_key_not_found(checkpoint_dir):
    """A KeyError, as Orbax's, naming the tensor; raised by ``load()`` (before any read) where
    Orbax's raises from the awaitable, and in our words ("missing from the checkpoint: e")."""
    tree = {"e": jax.ShapeDtypeStruct(shape=(2,), dtype=np.int32)}
    with pytest.raises(KeyError, match="missing from the checkpoint: e"):
        _load(SafetensorsLayout(), checkpoint_dir, tree)


def test_load_directory_duplicate_tensor_raises(checkpoint_dir):
    """Orbax matches 'Duplicate tensor a'; ours names the tensor and both files."""
    np_save_file({"a": np.array([99, 99], dtype=np.int32)}, checkpoint_dir / "part_dup.safetensors")
    with pytest.raises(ValueError, match="stored twice") as raised:
        _load(SafetensorsLayout(), checkpoint_dir)
    message = str(raised.value)
    assert "tensor 'a'" in message and "part1.safetensors" in message and "part_dup.safetensors" in message


# --------------------------------------------------------------------------- the read planner's tests

@pytest.mark.parametrize("bounds, shape, itemsize, base, expected", [
    ((), (), 4, 128, [(128, 4)]),  # test_scalar
    (((0, 4), (0, 8)), (4, 8), 4, 0, [(0, 4 * 8 * 4)]),  # test_whole_tensor_is_one_run
    (((0, 2), (0, 8)), (4, 8), 4, 0, [(0, 2 * 8 * 4)]),  # test_leading_dimension_shard_is_one_run
    (((2, 4),), (8,), 4, 64, [(64 + 2 * 4, 2 * 4)]),  # test_one_dimensional_shard_is_one_run
    (((0, 4), (0, 4)), (4, 8), 4, 0, [(0, 16), (32, 16), (64, 16), (96, 16)]),  # ..._is_strided
    (((2, 4), (0, 8)), (4, 8), 4, 128, [(128 + 2 * 32, 2 * 32)]),  # test_non_zero_start_leading_shard
    (((1, 3), (2, 6)), (4, 8), 4, 0, [(32 + 8, 16), (64 + 8, 16)]),  # test_partial_in_both_dimensions
    (((0, 2), (1, 3), (0, 4)), (2, 4, 4), 4, 0, [(16, 32), (64 + 16, 32)]),  # ..._middle_dimension_partial
    (((0, 4), (0, 4)), (4, 8), 2, 0, [(0, 8), (16, 8), (32, 8), (48, 8)]),  # test_non_four_byte_itemsize
], ids=["scalar", "whole_tensor", "leading_dimension", "one_dimensional", "inner_dimension_strided",
        "non_zero_start_leading", "partial_in_both", "three_dimensional_middle", "non_four_byte_itemsize"])
def test_index_domain_to_byte_runs(bounds, shape, itemsize, base, expected):
    """IndexDomainToByteRunsTest, on our counterpart ``planning.byte_runs`` (offsets relative
    to the tensor, ascending, one run length): the same runs for every case."""
    offsets, length = byte_runs(bounds, shape, itemsize)
    assert [(base + int(o), length) for o in offsets] == expected


def test_normalize_index():
    """ByteMathHelpersTest's ``_normalize_index`` cases, on ``planning.normalize_index``.
    (``_byte_strides`` is private arithmetic with no counterpart: ``byte_runs`` covers it.)"""
    assert normalize_index((slice(0, 2), slice(3, 7)), (8, 16)) == ((0, 2), (3, 7))
    assert normalize_index((slice(None, None), slice(4, None)), (8, 16)) == ((0, 8), (4, 16))
    assert normalize_index((2, slice(None, None)), (8, 16)) == ((2, 3), (0, 16))
    with pytest.raises(ValueError, match="strided shard index"):
        normalize_index((slice(0, 4, 2),), (8,))


@pytest.mark.skip(reason="Orbax's private read planner, with no counterpart here: its coalescing "
                  "policy (an over-read ratio over a whole block, or any gap under a page) and "
                  "its asyncio chunk reader. Ours joins a gap under the backend's max_gap that "
                  "the next run pays for and serves strided shards through bounce buffers: "
                  "tests/planning/test_read_plan.py and tests/multiprocess/test_sharded_load_multiprocess.py.")
@pytest.mark.parametrize("orbax_class", ["PartitionRunsTest", "FileReadTest", "RecordReadStatsTest",
                                         "AutoOverReadRatioTest", "OverReadWarningTest"])
def test_read_planner_internals(orbax_class):
    """Not ported: see the skip reason."""


def test_whole_file_load_is_one_read(tmp_path):
    """SingleHostOneReadInvariantTest: densely packed tensors, all needed, on one host, are one
    read of the file, with no target and sharded over every local device alike. Orbax counts
    calls of its private ``_read_chunk``; we count ``LoadStats.requests`` of ``ost.load``, which
    the layout calls (the layout takes no stats)."""
    path = tmp_path / "pack.safetensors"
    np_save_file({f"tensor_{i}": np.arange(64, dtype=np.float32) for i in range(8)}, path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract_state = {f"tensor_{i}": jax.ShapeDtypeStruct((64,), np.float32, sharding=sharding)
                      for i in range(8)}
    for target in (None, abstract_state):
        stats = ost.LoadStats()
        ost.load(path, target, stats=stats)
        assert stats.requests == 1, stats


# --------------------------------------------------------------------------- SafetensorsLayoutEdgeCaseTest

def test_shape_mismatch_raises(tmp_path):
    """A ValueError naming the shapes, from ``load()`` itself (Orbax's: from the awaitable)."""
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.float32)}, path)
    tree = {"a": jax.ShapeDtypeStruct(shape=(4,), dtype=np.float32)}
    with pytest.raises(ValueError, match=r"shape mismatch: a: checkpoint \(8,\), target \(4,\)"):
        _load(SafetensorsLayout(), path, tree)


def test_dtype_cast_on_load(tmp_path):
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.int32)}, path)
    pytree = _load(SafetensorsLayout(), path, {"a": jax.ShapeDtypeStruct((8,), np.float32)})
    _same(pytree["a"], np.arange(8, dtype=np.float32))


def test_scalar_loads(tmp_path):
    path = tmp_path / "edge.safetensors"
    np_save_file({"s": np.array(3.14, dtype=np.float32)}, path)
    _same(_load(SafetensorsLayout(), path)["s"], np.array(3.14, dtype=np.float32))


def test_nested_abstract_state_raises(tmp_path):
    """Deliberately different: Orbax's refuses any nested abstract state ('not a flat
    dictionary'); ours names a nested leaf by its key path joined with '.', as ``ost.load``
    does, so a nested state loads where its names are in the checkpoint and is a KeyError
    naming the joined name where not."""
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.float32), "group.a": np.ones(8, np.float32)}, path)
    nested = {"group": {"a": jax.ShapeDtypeStruct(shape=(8,), dtype=np.float32)}}
    _same(_load(SafetensorsLayout(), path, nested)["group"]["a"], np.ones(8, np.float32))
    with pytest.raises(KeyError, match="missing from the checkpoint: other.a"):
        _load(SafetensorsLayout(), path, {"other": {"a": jax.ShapeDtypeStruct((8,), np.float32)}})


def test_empty_abstract_state_returns_empty(tmp_path):
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.float32)}, path)
    assert _load(SafetensorsLayout(), path, {}) == {}


def test_options_override_partition_defaults(tmp_path):
    """The context's tiny in-flight budget and over-read ratio 1.0 apply (as our
    ``LoadOptions.memory_budget`` and ``max_overread``); the bytes still arrive whole."""
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.float32)}, path)
    with ocp_v1.Context(memory_options=ocp_v1.options.MemoryOptions(read_concurrent_bytes=16),
                        safetensors_options=ocp_v1.options.SafetensorsOptions(max_over_read_ratio=1.0)):
        pytree = _load(SafetensorsLayout(), path)
    _same(pytree["a"], np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("chunk", [16, 4096])
def test_read_chunk_bytes_option_splits_reads(tmp_path, chunk):
    """The context's ``read_chunk_bytes`` reaches the planner: one 8 KiB tensor in 4 KiB reads
    is two requests. Orbax counts them in its jax.monitoring metrics; the layout hands the
    option to ``ost.load`` as ``LoadOptions.chunk_bytes``, whose ``LoadStats`` counts them.
    We differ below 4 KiB (Orbax's case reads a 32-byte tensor in 16-byte requests): a read
    size is raised to ``LoadOptions.MIN_CHUNK_BYTES``, since smaller requests only add requests."""
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(2048, dtype=np.float32)}, path)
    real_load = ost.integrations.orbax_items.async_load
    seen = []

    def counting(*args, **kwargs):
        seen.append(kwargs["options"])
        return real_load(*args, **kwargs)

    with mock.patch.object(ost.integrations.orbax_items, "async_load", counting), \
            ocp_v1.Context(safetensors_options=ocp_v1.options.SafetensorsOptions(read_chunk_bytes=chunk)):
        pytree = _load(SafetensorsLayout(), path)
    _same(pytree["a"], np.arange(2048, dtype=np.float32))
    (options,) = seen
    assert options.chunk_bytes == 4096
    stats = ost.LoadStats()
    ost.load(path, options=options, stats=stats)
    assert stats.requests == 2


def test_non_positive_read_chunk_bytes_raises(tmp_path):
    """Raised by ``load()`` itself (Orbax's: from the awaitable)."""
    path = tmp_path / "edge.safetensors"
    np_save_file({"a": np.arange(8, dtype=np.float32)}, path)
    with ocp_v1.Context(safetensors_options=ocp_v1.options.SafetensorsOptions(read_chunk_bytes=0)):
        with pytest.raises(ValueError, match="read_chunk_bytes"):
            _load(SafetensorsLayout(), path)


# --------------------------------------------------------------------------- Orbax's entry points

@pytest.fixture
def installed():
    """``ost.install_orbax_layout()`` for one test, Orbax's own layout back after it."""
    ost.install_orbax_layout()
    try:
        yield
    finally:
        ost.install_orbax_layout(False)


def _context(**options):
    return ocp_v1.Context(checkpoint_layout=SAFETENSORS, **options)


def test_loading_load_safetensors_checkpoint(installed, paths):
    """layout_loading_test.py: test_load_safetensors_checkpoint."""
    with _context():
        pytree = ocp_v1.load(paths["safetensors"])
    assert isinstance(pytree, dict)
    for name, value in OBJECT_TO_SAVE.items():
        _same(pytree[name], value)


def test_loading_load_bad_path_safetensors_ckpt(installed, tmp_path):
    """layout_loading_test.py: an empty directory is no safetensors checkpoint."""
    (tmp_path / "empty").mkdir()
    with _context(), pytest.raises(InvalidLayoutError):
        ocp_v1.load(tmp_path / "empty")


def test_loading_load_safetensors_ckpt_from_dir(installed, tmp_path):
    """layout_loading_test.py: a directory holding ``model.safetensors``."""
    np_save_file(OBJECT_TO_SAVE, tmp_path / "model.safetensors")
    with _context():
        pytree = ocp_v1.load(tmp_path)
    for name, value in OBJECT_TO_SAVE.items():
        _same(pytree[name], value)


def test_loading_load_async(installed, paths):
    """layout_loading_test.py: test_load_async[SAFETENSORS]: returns at once, resolves after the
    (mocked, 2 s) finalization, to the tree. Its ORBAX case tests Orbax's refusal, not a layout."""
    original_finalize_load = orbax_loading._LoadPyTreeResponse._finalize_load

    async def sleep_and_load(*args, **kwargs):
        await asyncio.sleep(2)
        return await original_finalize_load(*args, **kwargs)

    with mock.patch.object(orbax_loading._LoadPyTreeResponse, "_finalize_load", new=sleep_and_load):
        with _context():
            start = time.time()
            response = ocp_v1.load_async(paths["safetensors"])
        assert time.time() - start < 1
        loaded = response.result()
        assert time.time() - start > 2
    for name, value in OBJECT_TO_SAVE.items():
        _same(loaded[name], value)


def test_loading_load_auto_resolution_mode_safetensors(installed, paths):
    """layout_loading_test.py: ``checkpointable_name=AUTO`` resolves a flat checkpoint."""
    from orbax.checkpoint.experimental.v1._src.layout import checkpoint_layout

    with _context():
        loaded = ocp_v1.load(paths["safetensors"], checkpointable_name=checkpoint_layout.AUTO_CHECKPOINTABLE_KEY)
    for name, value in OBJECT_TO_SAVE.items():
        _same(loaded[name], value)


@pytest.mark.parametrize("tensor_data", [
    {"x": np.array([[1.0, 2.0]], dtype=np.float32), "y": np.array([1, 2, 3], dtype=np.int64)},  # PyTreeMetadataTest
    {"item1": np.array([1.0], dtype=np.float32), "item2": np.array([1], dtype=np.int32)},  # CheckpointablesMetadataTest
], ids=["PyTreeMetadataTest", "CheckpointablesMetadataTest"])
def test_metadata_safetensors(installed, paths, tensor_data):
    """metadata/loading_test.py: test_metadata_safetensors, both classes' versions."""
    st_path = paths["dir"] / "model.safetensors"
    st_custom_meta = {"framework": "test", "version": "1.0"}
    np_save_file(tensor_data, st_path, metadata=st_custom_meta)
    with _context():
        ckpt_metadata = ocp_v1.metadata(st_path)
    assert isinstance(ckpt_metadata, ocp_v1.CheckpointMetadata)
    assert ckpt_metadata.metadata == {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in tensor_data.items()}
    assert ckpt_metadata.init_timestamp_nsecs is None
    assert ckpt_metadata.custom_metadata == st_custom_meta
    assert ckpt_metadata.commit_timestamp_nsecs == os.stat(st_path).st_mtime_ns
    with pytest.raises(InvalidLayoutError), _context():  # an Orbax checkpoint
        ocp_v1.metadata(paths["orbax"])


def test_checkpointables_metadata_safetensors(installed, tmp_path):
    """metadata/loading_test.py: deliberately different: Orbax's layout raises
    NotImplementedError ("SafeTensors is always flat"); ours gives its one checkpointable."""
    st_path = tmp_path / "model.safetensors"
    np_save_file({"item1": np.array([1.0], dtype=np.float32)}, st_path)
    with _context():
        metadata = ocp_v1.checkpointables_metadata(st_path)
    assert metadata.metadata == {"state": {"item1": jax.ShapeDtypeStruct((1,), np.float32)}}


# Orbax 0.12.8 deprecates pytree_metadata/load_pytree(_async) for metadata/load(_async); MaxText
# 0.2.5's safetensors_dynamic loader calls them, so these are the entry points held to our layout.
@pytest.mark.filterwarnings("ignore:Use `(metadata|load|load_async)` instead:DeprecationWarning")
def test_install_orbax_layout_both_ways(tmp_path):
    """``ost.install_orbax_layout()`` makes Orbax's own entry points use ours, ``(False)`` gives
    Orbax's back; told apart through ``ocp.v1`` alone. An HF directory where a stale shard of an
    older save lies beside the index's files: Orbax's layout reads every ``*.safetensors`` and
    refuses the name stored twice; ours reads what the index names. Orbax's stamps the commit
    time in whole seconds, ours in nanoseconds; Orbax's cannot save."""
    values = {"w": np.arange(8, dtype=np.float32), "v": np.ones(4, np.int32)}
    path = tmp_path / "hf"
    ost.save(path, values, max_shard_size=40)
    stale = path / "model-00001-of-00003.safetensors"
    np_save_file({"w": np.zeros(8, np.float32)}, stale)
    newest = max(os.stat(path / n).st_mtime_ns for n in os.listdir(path) if n != stale.name)
    abstract = {"w": jax.ShapeDtypeStruct((8,), np.float32)}

    def through_orbax():
        with _context():
            metadata = ocp_v1.pytree_metadata(path)
            loaded = ocp_v1.load_pytree(path, abstract)
            loaded_async = ocp_v1.load_pytree_async(path, abstract).result()
        return metadata, loaded, loaded_async

    with pytest.raises(ValueError, match="Duplicate tensor w"):  # Orbax's own, not installed
        through_orbax()
    with _context(), pytest.raises(NotImplementedError) as refused:
        ocp_v1.save(tmp_path / "by_orbax", values)
    with warnings.catch_warnings():  # Orbax refuses after starting to make its path: that
        warnings.simplefilter("ignore", RuntimeWarning)  # coroutine is never awaited, and says so
        del refused
        gc.collect()
    ost.install_orbax_layout()
    try:
        metadata, loaded, loaded_async = through_orbax()
        with _context():
            ocp_v1.save(tmp_path / "by_orbax", values)
        _same(ost.load(tmp_path / "by_orbax")["w"], values["w"])
    finally:
        ost.install_orbax_layout(False)
    assert metadata.metadata == {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in values.items()}
    assert metadata.commit_timestamp_nsecs == newest
    assert list(loaded) == list(loaded_async) == ["w"]
    _same(loaded["w"], values["w"])
    _same(loaded_async["w"], values["w"])
    os.remove(stale)  # Orbax's own is back: it reads every file again, and stamps seconds
    with _context():
        assert ocp_v1.pytree_metadata(path).commit_timestamp_nsecs == max(
            int(os.stat(path / n).st_mtime) for n in os.listdir(path) if n.endswith(".safetensors"))
        _same(ocp_v1.load_pytree(path, abstract)["w"], values["w"])
