"""Parallel HF-layout save from real JAX processes (2×4 and 4×2 CPU devices).

Every child holds its part of the same global arrays and calls ``ost.save``;
the files must be byte-identical to what one process writes from the
gathered values, every byte written exactly once across processes, and the
checkpoint must load back under another sharding.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest
import safetensors

import orbax_safetensors as ost
from tests.support.integrity import assert_checksummed
from tests.support.sharding_cases import (
    SCENARIOS,
    TOPOLOGIES,
    assert_shards_equal,
    sources,
    target_for,
)

pytestmark = pytest.mark.slow  # several JAX processes

_MODULE = "tests.multiprocess.test_parallel_save_multiprocess"
_MAX_SHARD = 200_000
_RELOAD = {"fsdp": "tensor_parallel", "tensor_parallel": "mesh_2d", "mesh_2d": "fsdp",
           "replicated": "fsdp", "mixed": "replicated"}


def _global_arrays(scenario):
    values = sources()
    target = target_for(values, scenario)
    arrays = {
        name: jax.make_array_from_callback(value.shape, target[name].sharding,
                                           lambda index, v=value: v[index])
        for name, value in values.items()
    }
    arrays["host.counter"] = np.arange(7, dtype=np.int64)  # numpy leaf: process 0 writes it
    return values, arrays


_CONFIG = {"model_type": "llama", "num_hidden_layers": 2}  # process 0 writes config.json


def _child_save(args):
    values, arrays = _global_arrays(args["scenario"])
    # Each process wrote exactly the bytes of the shards it holds with replica_id 0 (and
    # process 0 the numpy leaf): nothing was fetched from another process.
    local = sum(shard.data.nbytes for a in arrays.values() if isinstance(a, jax.Array)
                for shard in a.addressable_shards if shard.replica_id == 0)
    local += arrays["host.counter"].nbytes if jax.process_index() == 0 else 0
    if args.get("async"):
        future = ost.async_save(args["path"], arrays, max_shard_size=_MAX_SHARD,
                                layout=args.get("layout", "hf"), config=_CONFIG)
        # The caller may wreck its arrays as soon as async_save returns.
        donated = jax.jit(lambda t: jax.tree.map(lambda x: x * 0, t), donate_argnums=0)(
            {n: a for n, a in arrays.items() if isinstance(a, jax.Array)})
        jax.block_until_ready(donated)
        stats = future.result(timeout=120)
    else:
        stats = ost.save(args["path"], arrays, max_shard_size=_MAX_SHARD,
                         layout=args.get("layout", "hf"), config=_CONFIG)
    if stats.tensors_resharded == 0:  # else it wrote row blocks: the parent counts the bytes
        assert stats.bytes_written == local, (stats.bytes_written, local)
    reload = _RELOAD[args["scenario"]]
    target = target_for(values, reload)
    restored = ost.load(args["path"], target=target, strict=False)  # all but host.counter
    assert_shards_equal(restored, values, target)
    return dataclasses.asdict(stats)


def _single_process_reference(tmp_path, config: dict | None = _CONFIG):
    arrays = {**sources(), "host.counter": np.arange(7, dtype=np.int64)}
    ost.save(tmp_path / "reference", arrays, max_shard_size=_MAX_SHARD, config=config)
    return tmp_path / "reference", sum(a.nbytes for a in arrays.values())


def _assert_identical_directories(actual, expected):
    names = sorted(os.listdir(expected))
    assert sorted(os.listdir(actual)) == names
    for name in names:
        data = (actual / name).read_bytes()
        assert data == (expected / name).read_bytes(), name
        if name.endswith(".safetensors"):
            safetensors.deserialize(data)  # the Rust validator accepts it
            with safetensors.safe_open(actual / name, framework="numpy") as f:
                assert f.metadata()["format"] == "pt" and list(f.keys())
    assert_checksummed(actual)  # so the checksums too are what one process computes


@pytest.mark.parametrize("processes,devices", TOPOLOGIES, ids=["2x4", "4x2"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_files_equal_a_single_process_save_and_no_byte_is_written_twice(
        multiprocess, tmp_path, scenario, processes, devices):
    reference, total = _single_process_reference(tmp_path)
    results = multiprocess(
        f"{_MODULE}:_child_save", num_processes=processes, devices_per_process=devices,
        args={"path": str(tmp_path / "parallel"), "scenario": scenario})
    _assert_identical_directories(tmp_path / "parallel", reference)
    written = [r.value["bytes_written"] for r in results]
    assert sum(written) == total, written
    if scenario in ("fsdp", "tensor_parallel", "mesh_2d"):
        assert all(w > 0 for w in written), written  # every process wrote its own part
    # Column strips across processes are written as row blocks (moved on device first);
    # row shards and replicated tensors as they are.
    resharded = [r.value["tensors_resharded"] for r in results]
    least = {"tensor_parallel": 3, "mesh_2d": 3}.get(scenario, 0)
    assert all(n >= least for n in resharded) and (least or not any(resharded)), resharded


@pytest.mark.parametrize("scenario", ["fsdp", "mesh_2d"])
def test_async_save_survives_the_caller_donating_its_arrays(multiprocess, tmp_path, scenario):
    reference, _ = _single_process_reference(tmp_path)
    results = multiprocess(
        f"{_MODULE}:_child_save", num_processes=2, devices_per_process=4,
        args={"path": str(tmp_path / "parallel"), "scenario": scenario, "async": True})
    _assert_identical_directories(tmp_path / "parallel", reference)
    for r in results:
        assert r.value["blocking_seconds"] <= r.value["seconds"]


@pytest.mark.parametrize("processes,devices", TOPOLOGIES, ids=["2x4", "4x2"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_distributed_layout_round_trips_and_reads_like_torch_dcp(
        multiprocess, tmp_path, scenario, processes, devices):
    path = tmp_path / "distributed"
    results = multiprocess(
        f"{_MODULE}:_child_save", num_processes=processes, devices_per_process=devices,
        args={"path": str(path), "scenario": scenario, "layout": "distributed"})
    values = {**sources(), "host.counter": np.arange(7, dtype=np.int64)}
    assert sum(r.value["bytes_written"] for r in results) == sum(v.nbytes for v in values.values())
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert all(n.startswith("shard-0000") and "-model-" in n for n in files), files
    for name in files:
        header = safetensors.deserialize((path / name).read_bytes())  # valid for the crate
        assert header
    restored = ost.load(path)  # one process, every slice, assembled on the host
    for name, value in values.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    # Consolidated, it is byte for byte the HF checkpoint one process would have saved.
    reference, _ = _single_process_reference(tmp_path, config=None)  # consolidate writes none
    ost.consolidate(path, tmp_path / "consolidated", max_shard_size=_MAX_SHARD, block_bytes=10_000)
    _assert_identical_directories(tmp_path / "consolidated", reference)
    # Without our index the directory is torch DCP output: offsets come from the headers.
    os.remove(path / "orbax_safetensors.distributed.json")
    from_headers = ost.load(path)
    for name, value in values.items():
        np.testing.assert_array_equal(from_headers[name], value, err_msg=name)


def _child_consolidate(args):
    return dataclasses.asdict(ost.consolidate(args["src"], args["dst"], max_shard_size=_MAX_SHARD))


def test_consolidate_runs_in_parallel_over_processes(multiprocess, tmp_path):
    multiprocess(f"{_MODULE}:_child_save", num_processes=2, devices_per_process=4,
                 args={"path": str(tmp_path / "distributed"), "scenario": "mesh_2d",
                       "layout": "distributed"})
    results = multiprocess(f"{_MODULE}:_child_consolidate", num_processes=2, devices_per_process=4,
                           args={"src": str(tmp_path / "distributed"), "dst": str(tmp_path / "hf")})
    reference, total = _single_process_reference(tmp_path, config=None)
    _assert_identical_directories(tmp_path / "hf", reference)
    assert all(r.value["files"] >= 1 for r in results)  # both processes wrote output files
    assert sum(r.value["bytes_written"] for r in results) == total


def _child_save_with_a_full_disk_on_process_1(args):
    """Process 1's writes fail with ENOSPC; every process reports what it raised."""
    import errno as errno_codes

    from orbax_safetensors.storage.local import LocalStorage
    values, arrays = _global_arrays("fsdp")
    if jax.process_index() == 1:
        def full(self, path, offset, buffers):
            raise OSError(errno_codes.ENOSPC, os.strerror(errno_codes.ENOSPC), path)
        LocalStorage.write_at = full
    try:
        ost.save(args["path"], arrays, max_shard_size=_MAX_SHARD, overwrite=True)
    except OSError as e:
        return {"type": type(e).__name__, "distributed": isinstance(e, ost.DistributedError),
                "errno": e.errno, "filename": e.filename,
                "failures": {str(p): dataclasses.asdict(f)
                             for p, f in getattr(e, "failures", {}).items()}}
    return {"type": None}


def test_a_failure_on_one_process_reaches_every_process_with_its_errno_and_file(
        multiprocess, tmp_path):
    path = tmp_path / "ckpt"
    old = {"old": np.arange(10, dtype=np.float32)}
    ost.save(path, old)
    results = [r.value for r in multiprocess(
        f"{_MODULE}:_child_save_with_a_full_disk_on_process_1", num_processes=2,
        devices_per_process=4, args={"path": str(path)})]
    # Process 1 raises its own error, unchanged; process 0 one that keeps it.
    assert results[1]["type"] == "OSError" and results[1]["errno"] == 28
    assert results[1]["filename"].startswith(str(path))
    assert results[0]["type"] == "PeerFailedError" and results[0]["distributed"] and results[0]["errno"] == 28
    failure = results[0]["failures"]["1"]
    assert failure["type"] == "OSError" and failure["errno"] == 28
    assert failure["filename"] == results[1]["filename"]
    loaded = ost.load(path)
    assert sorted(loaded) == ["old"] and np.array_equal(loaded["old"], old["old"])
    assert not [n for n in os.listdir(path) if n.startswith(".")]


def _child_first_save_interrupted_on_process_1(args):
    """A first save to a path nothing is at, Ctrl-C'd on process 1 while it writes."""
    from orbax_safetensors.storage.local import LocalStorage
    _, arrays = _global_arrays("fsdp")
    if jax.process_index() == 1:
        def interrupted(self, path, offset, buffers):
            raise KeyboardInterrupt
        LocalStorage.write_at = interrupted
    try:
        ost.save(args["path"], arrays, max_shard_size=_MAX_SHARD)
    except BaseException as e:  # process 1: KeyboardInterrupt; process 0: what it heard of it
        return type(e).__name__
    return None


def test_an_interrupted_first_save_leaves_no_directory(multiprocess, tmp_path):
    path = tmp_path / "new" / "ckpt"
    results = [r.value for r in multiprocess(
        f"{_MODULE}:_child_first_save_interrupted_on_process_1", num_processes=2,
        devices_per_process=4, args={"path": str(path)})]
    assert results[1] == "KeyboardInterrupt" and results[0] is not None, results
    assert os.listdir(tmp_path) == []  # neither the checkpoint directory nor its parent
