"""Saves and loads through a proxy that fails requests: they complete, or fail clearly, never half.

``tests/support/fault_proxy.py`` sits between the client library (s3fs, gcsfs) and
the real test server and answers a fraction of requests with 503, resets the
connection, or forwards a write and then drops the answer. With transient
faults every save and load must complete with exact values; with faults that
persist, the call must fail within a bounded time with an error naming the
object, and no checkpoint may become visible (the index is written last).
"""

import itertools
import json
import time

import fsspec
import google_crc32c
import jax
import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors.index import FILE_CRCS_KEY, INDEX_NAME, decode_crc
from orbax_safetensors.storage import Location
from tests.support.fault_proxy import FaultProxy
from tests.support.object_stores import object_store_server, storage_options
from tests.support.sharding_cases import assert_shards_equal, sources, target_for

pytestmark = pytest.mark.slow  # object-store servers behind a fault proxy

_MODULE = "tests.faults.test_object_store_faults"
_MAX_SHARD = 200_000
_KINDS = ("503", "reset", "after_forward")


@pytest.fixture(scope="module", params=["s3", "gs"])
def proxied(request):
    """``(protocol, bucket, options through the proxy, proxy, env for children)``."""
    with object_store_server(request.param) as (bucket, env):
        options = storage_options(env, request.param)
        with FaultProxy(options["endpoint_url"], seed=7) as proxy:
            through = {**options, "endpoint_url": proxy.url, "skip_instance_cache": True}
            key = f"FSSPEC_{request.param.upper()}_ENDPOINT_URL"
            yield request.param, bucket, through, proxy, {**env, key: proxy.url}


@pytest.fixture
def proxy(proxied):
    proxied[3].clear_faults()
    proxied[3].reset_stats()
    yield proxied[3]
    proxied[3].clear_faults()


def _arrays(values, scenario):
    target = target_for(values, scenario)
    return {n: jax.make_array_from_callback(v.shape, target[n].sharding, lambda i, v=v: v[i])
            for n, v in values.items()}


@pytest.mark.parametrize("layout", ["hf", "distributed"])
def test_transient_faults_on_every_request_kind(proxied, proxy, layout):
    _, bucket, options, _, _ = proxied
    url = f"{bucket}/flaky-{layout}"
    values = sources()
    proxy.set_faults(0.2, _KINDS)
    ost.save(url, _arrays(values, "fsdp"), layout=layout, max_shard_size=_MAX_SHARD,
             storage_options=options)
    loaded = ost.load(url, target_for(values, "tensor_parallel"), storage_options=options)
    assert proxy.stats.faults_total > 0, proxy.stats
    proxy.clear_faults()
    assert_shards_equal(loaded, values, target_for(values, "tensor_parallel"))
    fs, root = fsspec.core.url_to_fs(url, **options)
    leftovers = [p for p in fs.ls(root, detail=False) if ".part-" in p or ".tmp-" in p]
    assert not leftovers


def _impatient(protocol, options):
    """botocore's own retries (up to ~40 s per call here) cut to 2 attempts; gcsfs's cannot be
    configured (~30 s per call)."""
    return {**options, "config_kwargs": {"retries": {"max_attempts": 2}}} if protocol == "s3" else options


def test_persistent_faults_fail_clearly_and_commit_nothing(proxied, proxy):
    protocol, bucket, options, _, _ = proxied
    options = _impatient(protocol, options)
    url = f"{bucket}/down"
    values = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    proxy.fail_always(("503", "reset"), methods={"PUT", "POST"})
    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        ost.save(url, values, storage_options=options)
    elapsed = time.monotonic() - started
    print(f"\nsave gave up after {elapsed:.1f} s: {raised.value}")
    assert elapsed < 120
    assert bucket.split("://")[1] in str(raised.value)
    proxy.clear_faults()
    with pytest.raises((ost.SafetensorsError, FileNotFoundError)):
        ost.load(url, storage_options=options)  # nothing half-written is visible
    ost.save(url, values, storage_options=options)  # and a re-run succeeds
    np.testing.assert_array_equal(ost.load(url, storage_options=options)["w"], values["w"])


def test_persistent_read_faults_name_the_file(proxied, proxy):
    protocol, bucket, options, _, _ = proxied
    options = _impatient(protocol, options)
    url = f"{bucket}/unreadable"
    ost.save(url, {"w": np.ones((256, 256), np.float32)}, storage_options=options)
    proxy.fail_always(("503",), methods={"GET"},
                      match=lambda method, target: "model.safetensors" in target
                      and "index" not in target)
    started = time.monotonic()
    with pytest.raises(ost.StorageError) as raised:
        ost.load(url, storage_options=options)
    elapsed = time.monotonic() - started
    print(f"\nload gave up after {elapsed:.1f} s: {raised.value}")
    assert elapsed < 120
    assert "unreadable/model.safetensors: " in str(raised.value)  # s3: the read; gcs: a lookup
    assert "failed after" in str(raised.value)


def _child_flaky_save_and_load(args):
    values = sources()
    ost.save(args["path"], _arrays(values, "fsdp"), max_shard_size=_MAX_SHARD)
    stats = ost.LoadStats()
    target = target_for(values, "mesh_2d")
    assert_shards_equal(ost.load(args["path"], target, stats=stats), values, target)
    return stats.requests


def test_two_processes_through_transient_faults(multiprocess, proxied, proxy):
    _, bucket, _, _, env = proxied
    proxy.set_faults(0.1, _KINDS)
    results = multiprocess(f"{_MODULE}:_child_flaky_save_and_load", num_processes=2, env=env,
                           args={"path": f"{bucket}/flaky-multi"}, timeout=300)
    assert all(r.value > 0 for r in results)
    assert proxy.stats.faults_total > 0


def test_an_upload_damaged_on_the_way_never_loads_as_good_data(proxied, proxy):
    """GCS keeps a crc32c of every object, checked against ours before the commit: the save
    fails, naming the file (and, as any failed overwrite on an object store, leaves no
    checkpoint rather than a mix). S3 is sent our crc32c with each PUT and refuses a body that
    differs (moto stores it unchecked, so there the load's block checks find it)."""
    protocol, bucket, options, _, _ = proxied
    url = f"{bucket}/damaged-upload"
    old, new = {"w": np.arange(300_000, dtype=np.float32)}, {"w": np.ones(300_000, np.float32)}
    ost.save(url, old, storage_options=options)
    # The first upload of a part object (gcsfs names it in the body, not the URL).
    proxy.fail_next(1, "corrupt", methods={"PUT", "POST"}, match=lambda method, target: (
        ".part-" in target or "uploadType=multipart" in target and "ifGenerationMatch" not in target))
    if protocol == "gs":
        with pytest.raises(OSError, match="other bytes than were written.*model.safetensors"):
            ost.save(url, new, storage_options=options, overwrite=True)
        with pytest.raises((FileNotFoundError, ost.SafetensorsError)):
            ost.load(url, storage_options=options)
    else:
        ost.save(url, new, storage_options=options, overwrite=True)
        with pytest.raises(ost.ChecksumError, match="'w'"):
            ost.load(url, storage_options=options)
    assert proxy.stats.faults["corrupt"] == 1


def test_a_download_damaged_on_the_way_fails_the_load_naming_the_tensor(proxied, proxy):
    _, bucket, options, _, _ = proxied
    url = f"{bucket}/damaged-download"
    values = {"a": np.arange(200_000, dtype=np.float32), "b": np.arange(7, dtype=np.int8)}
    ost.save(url, values, storage_options=options)
    reads = itertools.count()  # of the file's bytes: the first is the catalog's header read

    def data_read(method, target):
        media = "model.safetensors" in target and ("alt=media" in target or "?" not in target)
        return media and next(reads) > 0

    proxy.fail_next(1, "corrupt", methods={"GET"}, match=data_read)
    with pytest.raises(ost.ChecksumError, match="'a'"):
        ost.load(url, {"a": jax.ShapeDtypeStruct((200_000,), np.float32)}, strict=False,
                 storage_options=options)
    loaded = ost.load(url, storage_options=options)  # the stored bytes are intact
    np.testing.assert_array_equal(loaded["a"], values["a"])


def test_sent_and_stored_checksums_match_ours(proxied):
    """Every object PUT to S3 carries our crc32c; GCS computes its own: either way the store's
    crc32c of each file is the one the index lists."""
    protocol, bucket, options, _, _ = proxied
    url = f"{bucket}/stored-crc"
    ost.save(url, {"a": np.arange(300_000, dtype=np.float32), "b": np.zeros(3)},
             max_shard_size=1_000_000, storage_options=options)
    location = Location.resolve(url, options)
    index = json.loads(location.storage.read(location.storage.join(location.path, INDEX_NAME), 0, 1 << 20))
    if protocol == "gs":
        for name, crc in index["metadata"][FILE_CRCS_KEY].items():
            assert location.storage.stored_crc32c(location.storage.join(location.path, name)) == decode_crc(crc)
    raw = location.storage.read(location.storage.join(location.path, INDEX_NAME), 0, 1 << 20)
    assert location.storage.stored_crc32c(location.storage.join(location.path, INDEX_NAME)) == (
        google_crc32c.value(raw))


@pytest.mark.parametrize("nth", [1, 2])
def test_a_streamed_upload_whose_answer_is_lost_is_redone_whole(proxied, proxy, nth):
    """A file streamed from its tensors (the distributed layout's, its header held back)
    cannot be re-sent by the client once an answer is lost mid-stream (gcsfs: the resumable
    session moved on, or is over): the save produces the stream again and uploads it anew."""
    protocol, bucket, options, _, _ = proxied
    url = f"{bucket}/lost-answer-{nth}"
    # Over S3's 5 MiB first part and gcsfs's 5 MiB chunk, so that both stream in requests.
    values = {"a": np.arange(1_600_000, dtype=np.float32), "b": np.arange(7, dtype=np.int8)}
    uploads = itertools.count()

    def nth_request_of_the_stream(method, target):
        if protocol == "gs":  # the session's start, then its chunks
            return "uploadType=resumable" in target and next(uploads) == nth
        return method == "PUT" and ".part-" in target and next(uploads) == nth - 1

    proxy.fail_next(1, "after_forward", methods={"PUT", "POST"}, match=nth_request_of_the_stream)
    ost.save(url, values, layout="distributed", storage_options=options)
    assert proxy.stats.faults["after_forward"] == 1
    loaded = ost.load(url, storage_options=options)
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value)
