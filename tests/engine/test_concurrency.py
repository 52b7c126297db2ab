"""Many loads of one checkpoint from threads of one process, while other threads save.

``ost.load`` and ``ost.metadata`` keep no state between calls (each opens its
own storage backend and its own thread pools), so concurrent calls must give
exactly the results of sequential ones: the same values, dtypes and
shardings, whatever the interleaving, on local files and on fsspec
``memory://`` alike, and also while a save writes another checkpoint on the
same filesystem (the ``memory://`` store is one dict shared by the process).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
import uuid

import fsspec
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost

pytestmark = pytest.mark.slow  # threads racing for seconds

THREADS = 8
LOADS_PER_THREAD = 6


def _tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((128, 96)).astype(np.float32),
        "layers.0.w": rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16),
        "layers.0.b": rng.integers(-1000, 1000, (16,)).astype(np.int32),
        "layers.1.w": rng.standard_normal((32, 16)).astype(np.float16),
        "layers.1.b": rng.integers(-1000, 1000, (16,)).astype(np.int32),
        "conv": rng.standard_normal((8, 4, 6)).astype(np.float32),
        "mask": rng.integers(0, 2, (24,)).astype(np.bool_),
    }


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


# Target shardings per rank; every dim a sharding names divides the shapes above.
_SPECS = {
    "fsdp": {1: P("x"), 2: P("x"), 3: P("x")},
    "columns": {1: P(), 2: P(None, "x"), 3: P(None, "y")},
    "2d": {1: P("y"), 2: P("x", "y"), 3: P("y", "x", None)},
    "replicated": {1: P(), 2: P(), 3: P()},
}


def _load_kind(kind: str, url: str, expected: dict[str, np.ndarray]) -> None:
    """One load (or metadata read) of ``url``, checked against ``expected`` in full."""
    # Many batches, many small reads and bounce blocks, several reader threads: every step
    # of a load interleaves with the other threads' loads.
    options = ost.LoadOptions(memory_budget=16384, chunk_bytes=4096, threads=3)
    if kind == "metadata":
        meta = ost.metadata(url)
        assert {n: (s.shape, np.dtype(s.dtype)) for n, s in meta.tensors.items()} == {
            n: (a.shape, a.dtype) for n, a in expected.items()}
        assert all(files for files in meta.files.values())
        return
    if kind == "numpy":
        result = ost.load(url, options=options)
        assert sorted(result) == sorted(expected)
        for name, value in expected.items():
            assert isinstance(result[name], np.ndarray) and result[name].dtype == value.dtype, name
            np.testing.assert_array_equal(result[name], value, err_msg=name)
        return
    if kind == "float32":  # every float leaf converted, host arrays
        target = {n: (np.empty(a.shape, np.float32) if a.dtype.kind == "f" else a)
                  for n, a in expected.items()}
        result = ost.load(url, target, options=options)
        for name, value in expected.items():
            want = value.astype(np.float32) if value.dtype.kind == "f" else value
            assert result[name].dtype == want.dtype, name
            np.testing.assert_array_equal(result[name], want, err_msg=name)
        return
    mesh = _mesh()
    shardings = {n: NamedSharding(mesh, _SPECS[kind][a.ndim]) for n, a in expected.items()}
    target = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[n])
              for n, a in expected.items()}
    result = ost.load(url, target, options=options)
    for name, value in expected.items():
        got = result[name]
        assert isinstance(got, jax.Array) and got.sharding == shardings[name], name
        assert got.dtype == value.dtype, name
        for shard in got.addressable_shards:  # every device's own copy, not just the first
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index],
                                          err_msg=f"{name} on {shard.device}")


KINDS = ["numpy", "fsdp", "metadata", "columns", "float32", "2d", "replicated"]


def _saver(base: str, stop: threading.Event, done: list) -> None:
    """Saves other checkpoints under ``base`` until told to stop (at least 3 times), alternating
    blocking and async saves, sharded and host trees, and checks each one."""
    mesh = _mesh()
    for i in itertools.count():
        if stop.is_set() and i >= 3:
            return
        tree = _tree(1000 + i)
        if i % 2:
            tree = {n: jax.device_put(a, NamedSharding(mesh, P("x") if a.ndim > 1 else P()))
                    for n, a in tree.items()}
            ost.async_save(f"{base}/other", tree, max_shard_size=3000, overwrite=True).result()
        else:
            ost.save(f"{base}/other", tree, max_shard_size=3000, overwrite=True)
        loaded = ost.load(f"{base}/other")
        for name, value in tree.items():
            np.testing.assert_array_equal(loaded[name], np.asarray(value), err_msg=name)
        done.append(i)


@pytest.fixture(params=["local", "memory"])
def base(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path)
        return
    url = f"memory://concurrency-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["hf", "distributed"])
def test_concurrent_loads_match_sequential_ones_while_another_checkpoint_saves(base, layout):
    expected = _tree(0)
    url = f"{base}/ckpt"
    if layout == "hf":
        ost.save(url, expected, max_shard_size=3000)  # several shard files
    else:
        mesh = _mesh()
        ost.save(url, {n: jax.device_put(a, NamedSharding(mesh, P("x") if a.ndim > 1 else P()))
                       for n, a in expected.items()}, layout="distributed", max_shard_size=3000)
    for kind in KINDS:  # sequential reference: the checks themselves hold
        _load_kind(kind, url, expected)

    stop, saved = threading.Event(), []
    saver = concurrent.futures.ThreadPoolExecutor(1)
    saving = saver.submit(_saver, base, stop, saved)
    # Every thread runs every kind, each starting at a different one: all kinds overlap.
    work = [[KINDS[(t + k) % len(KINDS)] for k in range(LOADS_PER_THREAD)] for t in range(THREADS)]
    start = threading.Barrier(THREADS)

    def worker(kinds: list[str]) -> int:
        start.wait()
        for kind in kinds:
            _load_kind(kind, url, expected)
        return len(kinds)

    try:
        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            assert sum(pool.map(worker, work)) == THREADS * LOADS_PER_THREAD
    finally:
        stop.set()
        saving.result(timeout=240)
        saver.shutdown()
    assert len(saved) >= 3
    _load_kind("numpy", url, expected)  # the loaded checkpoint itself was never touched


@pytest.mark.timeout(120)
def test_fsspec_listing_cache_is_consistent_under_concurrent_invalidation():
    """One ``FsspecStorage`` answering ``exists``/``size`` from its listing cache on some threads
    while others change files (which forgets the cache) and list again: an existing file is
    never reported missing, nor its size lost, half-way through a forget."""
    from orbax_safetensors.storage import Location

    base = f"memory://listing-{uuid.uuid4().hex[:8]}"
    location = Location.resolve(base)
    storage, directory = location.storage, location.path
    names = [f"f{i}.safetensors" for i in range(32)]
    for i, name in enumerate(names):
        storage.write(storage.join(directory, name), [b"x" * (i + 1)])
    storage.scan(directory)
    stop, wrong = threading.Event(), []

    def reader(k: int) -> None:
        while not stop.is_set():
            for i, name in enumerate(names[k::4]):
                path = storage.join(directory, name)
                if not storage.exists(path):
                    wrong.append(f"{name} missing")
                if storage.size(path) != names.index(name) + 1:
                    wrong.append(f"{name} size")

    def changer() -> None:
        for i in range(3000):
            storage.write(storage.join(directory, f"other{i % 3}"), [b"y"])  # forgets the cache
            storage.listdir(directory)  # and fills it again

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: small race windows open
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            readers = [pool.submit(reader, k) for k in range(4)]
            changers = [pool.submit(changer) for _ in range(2)]
            for f in changers:
                f.result()
            stop.set()
            for f in readers:
                f.result()
    finally:
        sys.setswitchinterval(old)
        stop.set()
        fsspec.filesystem("memory").rm(base, recursive=True)
    assert not wrong, wrong[:10]
