"""Multi-process HF saves to object stores (moto S3, GCS emulator): parts + server-side merge."""

import os

import fsspec
import numpy as np
import pytest

import orbax_safetensors as ost
from tests.support.object_stores import object_store_server
from tests.support.sharding_cases import sources
from tests.multiprocess.test_parallel_save_multiprocess import _CONFIG  # the children save with it

pytestmark = pytest.mark.slow  # several JAX processes against object-store servers

_MODULE = "tests.multiprocess.test_parallel_save_multiprocess"


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request):
    with object_store_server(request.param) as server:
        yield server


@pytest.mark.parametrize("scenario", ["fsdp", "tensor_parallel"])
def test_parallel_hf_save_to_a_bucket_equals_a_local_single_process_save(
        multiprocess, tmp_path, store, scenario):
    bucket, env = store
    url = f"{bucket}/{scenario}"
    results = multiprocess(f"{_MODULE}:_child_save", num_processes=2, devices_per_process=4,
                           args={"path": url, "scenario": scenario}, env=env,
                           timeout=300)  # the GCS emulator serves ~30 s of small requests here
    values = {**sources(), "host.counter": np.arange(7, dtype=np.int64)}
    ost.save(tmp_path / "reference", values, max_shard_size=200_000, config=_CONFIG)
    fs, root = fsspec.core.url_to_fs(url)
    names = sorted(os.listdir(tmp_path / "reference"))
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == names  # no leftovers
    for name in names:
        assert fs.cat(f"{root}/{name}") == (tmp_path / "reference" / name).read_bytes(), name
    assert sum(r.value["bytes_written"] for r in results) == sum(v.nbytes for v in values.values())


@pytest.mark.parametrize("layout", ["hf", "distributed"])
def test_overwriting_a_bucket_checkpoint_in_place(store, layout):
    bucket, _ = store
    url = f"{bucket}/overwrite-{layout}"
    first = {"w": np.arange(40, dtype=np.float32).reshape(8, 5), "b": np.ones(3, np.int8)}
    second = {"w": -np.arange(40, dtype=np.float32).reshape(8, 5)}
    ost.save(url, first, layout=layout)
    ost.save(url, second, layout=layout, overwrite=True)  # same file names, written in place
    restored = ost.load(url)
    assert sorted(restored) == ["w"]
    np.testing.assert_array_equal(restored["w"], second["w"])
