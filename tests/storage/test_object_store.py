"""Every feature on ``s3://`` (moto) and ``gs://`` (GCS emulator) exactly as on local disk.

Single- and multi-process saves in both layouts, sharded loads that fetch only
each process's bytes (request counts reported per process), CheckpointManager
on a bucket, consolidate bucket → bucket, storage options passed explicitly,
and readers racing a save never seeing a half-written checkpoint.
"""

import errno
import json
import threading
import time

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as ost
from orbax_safetensors.storage import Location
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from tests.support.object_stores import object_store_server, storage_options
from tests.support.overwriter import overwriting
from tests.support.sharding_cases import assert_shards_equal, sources, target_for

pytestmark = pytest.mark.slow  # object-store servers (moto, the GCS emulator)

_MODULE = "tests.storage.test_object_store"
_MAX_SHARD = 200_000


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request):
    with object_store_server(request.param) as (bucket, env):
        yield request.param, bucket, env


def _global_arrays(values, scenario):
    target = target_for(values, scenario)
    return {name: jax.make_array_from_callback(value.shape, target[name].sharding,
                                               lambda index, v=value: v[index])
            for name, value in values.items()}


@pytest.mark.parametrize("layout", ["hf", "distributed"])
def test_single_process_save_and_sharded_load(store, layout):
    _, bucket, _ = store
    url = f"{bucket}/single-{layout}"
    values = sources()
    save_stats = ost.save(url, _global_arrays(values, "fsdp"), layout=layout,
                          max_shard_size=_MAX_SHARD)
    assert save_stats.bytes_written == sum(v.nbytes for v in values.values())
    load_stats = ost.LoadStats()
    loaded = ost.load(url, target_for(values, "tensor_parallel"), stats=load_stats)
    assert_shards_equal(loaded, values, target_for(values, "tensor_parallel"))
    print(f"\n{url}: save {save_stats.requests} uploads; load {load_stats.requests} requests, "
          f"{load_stats.bytes_read} bytes read for {load_stats.bytes_needed} needed")
    assert load_stats.bytes_read <= 2.0 * load_stats.bytes_needed  # max_overread
    report = ost.verify(url)
    assert report.ok and report.bytes == save_stats.bytes_written, report.problems


def test_single_file_url(store):
    _, bucket, _ = store
    values = {"w": np.arange(30, dtype=np.float32).reshape(5, 6)}
    ost.save(f"{bucket}/one.safetensors", values)
    np.testing.assert_array_equal(ost.load(f"{bucket}/one.safetensors")["w"], values["w"])


def test_big_file_is_uploaded_in_parallel_parts(store, monkeypatch):
    """One process, one 150 MB file: uploaded as 64 MiB parts, assembled server-side."""
    _, bucket, _ = store
    writes = []
    real_write = FsspecStorage.write
    monkeypatch.setattr(FsspecStorage, "write", lambda self, path, chunks: (
        writes.append(path), real_write(self, path, chunks))[1])
    big = np.random.default_rng(1).integers(0, 255, 150 << 20, dtype=np.uint8)
    ost.save(f"{bucket}/big", {"blob": big, "small": np.ones(3, np.int8)})
    parts = [w for w in writes if ".part-" in w]
    assert len(parts) == 3, writes
    np.testing.assert_array_equal(ost.load(f"{bucket}/big")["blob"], big)
    fs, root = fsspec.core.url_to_fs(f"{bucket}/big")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == ["model.safetensors"]


def _child_save_and_load(args):
    values = sources()
    url = args["path"]
    save_stats = ost.save(url, _global_arrays(values, args["save"]), layout=args["layout"],
                          max_shard_size=_MAX_SHARD)
    target = target_for(values, args["load"])
    stats = ost.LoadStats()
    loaded = ost.load(url, target, stats=stats)
    assert_shards_equal(loaded, values, target)
    # bytes_read without what completes checksum blocks (tests/engine/test_checksums_load.py bounds that)
    return {"save_requests": save_stats.requests, "bytes_written": save_stats.bytes_written,
            "load_requests": stats.requests, "bytes_read": stats.bytes_read - stats.checksum_overread,
            "bytes_needed": stats.bytes_needed}


@pytest.mark.parametrize("layout,save,load", [
    ("hf", "fsdp", "fsdp"), ("distributed", "tensor_parallel", "fsdp")])
def test_two_processes_save_and_load_only_their_bytes(multiprocess, store, layout, save, load):
    _, bucket, env = store
    url = f"{bucket}/multi-{layout}-{save}"
    results = multiprocess(f"{_MODULE}:_child_save_and_load", num_processes=2, env=env,
                           args={"path": url, "layout": layout, "save": save, "load": load},
                           timeout=300)
    total = sum(v.nbytes for v in sources().values())
    assert sum(r.value["bytes_written"] for r in results) == total
    for r in results:
        print(f"\nprocess {r.process_id}: {r.value}")
        # FSDP: each process reads about its half, not the whole checkpoint.
        assert r.value["bytes_read"] <= 1.1 * r.value["bytes_needed"] < 0.7 * total


def test_consolidate_bucket_to_bucket(store):
    _, bucket, _ = store
    values = sources()
    ost.save(f"{bucket}/dist", _global_arrays(values, "mesh_2d"), layout="distributed")
    stats = ost.consolidate(f"{bucket}/dist", f"{bucket}/hf", max_shard_size=_MAX_SHARD,
                            progress=False)
    assert stats.bytes_written == sum(v.nbytes for v in values.values())
    fs, root = fsspec.core.url_to_fs(f"{bucket}/hf")
    assert "model.safetensors.index.json" in [p.rsplit("/", 1)[1] for p in fs.ls(root)]
    for name, value in ost.load(f"{bucket}/hf").items():
        np.testing.assert_array_equal(value, values[name], err_msg=name)
    assert ost.verify(f"{bucket}/hf").ok and ost.verify(f"{bucket}/dist").ok


def test_checkpoint_manager_on_a_bucket(store):
    protocol, bucket, _ = store
    url = f"{bucket}/run"
    values = sources()
    params = _global_arrays(values, "fsdp")
    # Orbax's default finalization renames the step directory, which S3 cannot do for a
    # prefix; a commit file instead is Orbax's own mechanism for such stores (docs/storage.md's advice:
    # AtomicityOptions from Orbax 0.12.3, temporary_path_class before).
    commit_file = {}
    if protocol == "s3" and hasattr(ocp.options, "AtomicityOptions"):
        commit_file = {"atomicity_options": ocp.options.AtomicityOptions(
            mode=ocp.options.AtomicityMode.COMMIT_FILE)}
    elif protocol == "s3":
        commit_file = {"temporary_path_class": ocp.path.atomicity.CommitFileTemporaryPath}
    options = ocp.CheckpointManagerOptions(max_to_keep=2, **commit_file)
    with ocp.CheckpointManager(url, options=options) as mngr:
        for step in range(3):
            mngr.save(step, args=ocp.args.Composite(
                params=ost.SafetensorsSave(params, max_shard_size=_MAX_SHARD),
                meta=ocp.args.JsonSave({"step": step})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    with ocp.CheckpointManager(url, options=options) as mngr:
        restored = mngr.restore(2, args=ocp.args.Composite(
            params=ost.SafetensorsRestore(target_for(values, "mesh_2d"))))
    assert_shards_equal(restored["params"], values, target_for(values, "mesh_2d"))
    assert ost.metadata(f"{url}/2/params").tensors.keys() == values.keys()
    if protocol == "s3":  # Orbax finalized each step with its commit file, not a rename
        fs, root = fsspec.core.url_to_fs(url)
        assert fs.exists(f"{root}/2/commit_success.txt")


def test_explicit_storage_options_and_filesystem(store, monkeypatch):
    protocol, bucket, env = store
    options = storage_options(env, protocol)
    values = {"w": np.arange(12, dtype=np.int16).reshape(3, 4)}
    # Without fsspec's global config the defaults point at the real cloud: success
    # below proves the explicit options were used.
    monkeypatch.delitem(fsspec.config.conf, protocol)
    ost.save(f"{bucket}/opts", values, storage_options=options)
    np.testing.assert_array_equal(
        ost.load(f"{bucket}/opts", storage_options=options)["w"], values["w"])
    filesystem = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    calls = []
    real_cat = filesystem.cat_file
    monkeypatch.setattr(filesystem, "cat_file", lambda *a, **k: (calls.append(a), real_cat(*a, **k))[1])
    assert ost.metadata(f"{bucket}/opts", filesystem=filesystem).tensors["w"].shape == (3, 4)
    np.testing.assert_array_equal(ost.load(f"{bucket}/opts", filesystem=filesystem)["w"],
                                  values["w"])
    assert calls
    with pytest.raises(ValueError, match="not both"):
        Location.resolve(f"{bucket}/opts", options, filesystem)


def test_readers_racing_an_overwrite_see_old_or_new_never_a_mix(store, monkeypatch):
    """The index is the commit marker: written last, removed first on overwrite."""
    _, bucket, _ = store
    url = f"{bucket}/race"
    old = {f"t{i}": np.full((64, 64), i, np.float32) for i in range(6)}
    new = {f"t{i}": np.full((64, 64), 100 + i, np.float32) for i in range(6)}
    ost.save(url, old, max_shard_size=20_000)
    real_write = FsspecStorage.write

    def slow_write(self, path, chunks):
        time.sleep(0.05)
        real_write(self, path, chunks)

    monkeypatch.setattr(FsspecStorage, "write", slow_write)
    saver = threading.Thread(target=ost.save, args=(url, new),
                             kwargs={"max_shard_size": 20_000, "overwrite": True})
    saver.start()
    seen = {"old": 0, "new": 0, "absent": 0}
    while saver.is_alive() or not seen["new"]:
        try:
            loaded = ost.load(url)
        except (ost.SafetensorsError, FileNotFoundError):
            seen["absent"] += 1
            continue
        kind = "old" if loaded["t0"][0, 0] == 0 else "new"
        expected = old if kind == "old" else new
        assert loaded.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(loaded[name], expected[name], err_msg=name)
        seen[kind] += 1
    saver.join()
    assert seen["new"] >= 1, seen


class _Crash(BaseException):
    """Stands in for the process dying: no ``except Exception`` cleanup runs."""


def test_a_crashed_distributed_overwrite_is_an_interrupted_save_not_a_mix(store, monkeypatch):
    """On object stores distributed files go straight to their final names (a rename is a
    copy), where without their index they read as torch DCP output. A save that dies after
    writing one new file over an old one must read as interrupted, not as old and new mixed."""
    _, bucket, _ = store
    url = f"{bucket}/crash-distributed"
    old = {f"t{i}": np.full((64, 64), i, np.float32) for i in range(6)}
    new = {f"t{i}": np.full((64, 64), 100 + i, np.float32) for i in range(6)}
    ost.save(url, old, layout="distributed", max_shard_size=20_000)
    real_write, real_merge, shard_writes = FsspecStorage.write, FsspecStorage.merge, []

    def dies_at_the_second_file(path):
        # A checksummed file reaches its final name by a write or by a merge of its parts.
        if "/shard-" in path:
            shard_writes.append(path)
            if len(shard_writes) == 2:
                raise _Crash()

    def dying_write(self, path, chunks):
        dies_at_the_second_file(path)
        real_write(self, path, chunks)

    def dying_merge(self, path, parts, sizes):
        dies_at_the_second_file(path)
        real_merge(self, path, parts, sizes)

    monkeypatch.setattr(FsspecStorage, "write", dying_write)
    monkeypatch.setattr(FsspecStorage, "merge", dying_merge)
    monkeypatch.setattr(FsspecStorage, "discard", lambda self, paths: None)  # the dead clean nothing
    with pytest.raises(_Crash):
        ost.save(url, new, layout="distributed", max_shard_size=20_000, overwrite=True)
    monkeypatch.undo()
    with pytest.raises(ost.SafetensorsError, match="interrupted save"):
        ost.load(url)
    assert not ost.verify(url).ok
    ost.save(url, new, layout="distributed", max_shard_size=20_000, overwrite=True)
    loaded = ost.load(url)
    for name in new:
        np.testing.assert_array_equal(loaded[name], new[name], err_msg=name)
    fs, root = fsspec.core.url_to_fs(url)
    assert not [p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[1].startswith(".")]


def test_one_writer_per_location_with_a_conditional_lock_object(store):
    """A live writer's lock object refuses a second save, naming the holder; a lock object
    nobody has refreshed for minutes is a dead writer's and is replaced."""
    protocol, bucket, _ = store
    if protocol == "gs":
        pytest.skip("the GCS emulator ignores ifGenerationMatch=0 (real GCS honours it)")
    url = f"{bucket}/locked"
    fs, root = fsspec.core.url_to_fs(url)
    lock = f"{root}/.orbax_safetensors.lock"
    values = {"w": np.arange(64, dtype=np.float32)}
    fs.pipe_file(lock, json.dumps({"holder": "pid 7 on trainer-3", "at": time.time()}).encode())
    with pytest.raises(ost.CheckpointBusyError, match="pid 7 on trainer-3") as raised:
        ost.save(url, values)
    assert raised.value.errno == errno.EBUSY
    assert [p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)] == [".orbax_safetensors.lock"]
    fs.pipe_file(lock, json.dumps({"holder": "pid 7 on trainer-3", "at": time.time() - 3600}).encode())
    ost.save(url, values)
    np.testing.assert_array_equal(ost.load(url)["w"], values["w"])
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)] == ["model.safetensors"]


def test_loads_racing_overwrites_never_mix_two_checkpoints(store):
    """Object stores cannot pin what a load reads: a load compares each object's version
    (ETag, generation) after reading and reads again if one changed. Loads during the commit
    window may find no checkpoint (the old index is removed first), never a mix."""
    _, bucket, _ = store
    url = f"{bucket}/racing"
    versions = [{f"t{i}": np.full((64, 64), 10 * v + i, np.float32) for i in range(6)}
                for v in (1, 2)]
    ost.save(url, versions[0], max_shard_size=20_000)
    seen, windows = [0, 0], 0
    # A training loop saves now and then: between saves the checkpoint is committed.
    with overwriting(url, versions, pause=0.2, max_shard_size=20_000) as errors:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                loaded = ost.load(url)
            except (FileNotFoundError, ost.SafetensorsError) as e:
                assert "interrupted save" in str(e) or "does not exist" in str(e) \
                    or "kept changing" in str(e), e
                windows += 1
                continue
            matches = [v for v, values in enumerate(versions)
                       if all(np.array_equal(loaded[k], values[k]) for k in values)]
            assert matches, {k: float(a[0, 0]) for k, a in loaded.items()}
            seen[matches[0]] += 1
    assert not errors, errors
    assert sum(seen) > 0, (seen, windows)
