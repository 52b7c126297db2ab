"""ost.save / ost.load / ost.metadata in one process (8 CPU devices)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.format import dtype_for_numpy
from orbax_safetensors.index import INDEX_NAME, SINGLE_FILE_NAME


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


def _tree(rng=np.random.default_rng(0)):
    return {
        "embed": rng.standard_normal((16, 8)).astype(np.float32),
        "layers": [
            {"w": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
             "b": rng.integers(-5, 5, (6,)).astype(np.int32)},
            {"w": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
             "b": rng.integers(-5, 5, (6,)).astype(np.int32)},
        ],
        "scale": np.float32(3.5) * np.ones((), np.float32),
    }


def _assert_tree_equal(actual, expected):
    jax.tree_util.tree_map(
        lambda a, e: np.testing.assert_array_equal(np.asarray(a), np.asarray(e)), actual, expected)


@pytest.mark.parametrize("url_kind", ["local", "memory"])
@pytest.mark.parametrize("max_shard_size", ["5GB", 300])
def test_numpy_round_trip(tmp_path, url_kind, max_shard_size):
    base = str(tmp_path) if url_kind == "local" else f"memory://{tmp_path.name}-{max_shard_size}"
    tree = _tree()
    ost.save(f"{base}/ckpt", tree, max_shard_size=max_shard_size)
    _assert_tree_equal(ost.load(f"{base}/ckpt", target=tree), tree)
    flat = ost.load(f"{base}/ckpt")
    assert sorted(flat) == ["embed", "layers.0.b", "layers.0.w", "layers.1.b", "layers.1.w", "scale"]
    assert flat["layers.1.w"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("save_spec,load_spec", [
    (P("x", "y"), P(None, "y")),
    (P("x"), P()),
    (P(), P("y", "x")),
    (None, P("x", None)),
])
def test_sharded_jax_arrays_reload_under_another_sharding(tmp_path, save_spec, load_spec):
    mesh = _mesh()
    source = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    saved = source if save_spec is None else jax.device_put(source, NamedSharding(mesh, save_spec))
    ost.save(tmp_path / "c", {"w": saved, "b": jnp.ones((8,), jnp.bfloat16)})
    target_sharding = NamedSharding(mesh, load_spec)
    target = {
        "w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=target_sharding),
        "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
    }
    restored = ost.load(tmp_path / "c", target=target)
    assert restored["w"].sharding == target_sharding
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(source))
    np.testing.assert_array_equal(np.asarray(restored["b"]), np.ones(8, ml_dtypes.bfloat16))


def test_target_leaf_dtype_is_the_returned_dtype(tmp_path):
    mesh = _mesh()
    values = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
    ost.save(tmp_path / "c.safetensors", {"a": values, "b": values, "c": values})
    restored = ost.load(tmp_path / "c.safetensors", target={
        "a": jax.device_put(jnp.zeros((4, 8), jnp.bfloat16), NamedSharding(mesh, P("x"))),
        "b": np.zeros((4, 8), np.float64),
        "c": jax.ShapeDtypeStruct((4, 8), np.float32),  # no sharding: a host array
    })
    assert isinstance(restored["a"], jax.Array) and restored["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["a"]), values.astype(ml_dtypes.bfloat16))
    assert isinstance(restored["b"], np.ndarray) and restored["b"].dtype == np.float64
    np.testing.assert_array_equal(restored["b"], values.astype(np.float64))
    assert isinstance(restored["c"], np.ndarray) and restored["c"].dtype == np.float32


def test_strict_names_every_offending_tensor(tmp_path):
    ost.save(tmp_path / "c", {"a": np.zeros(3), "b": np.zeros((2, 2)), "extra": np.zeros(1)})
    target = {"a": np.zeros(4), "b": np.zeros((2, 2)), "missing": np.zeros(1)}
    with pytest.raises(ost.SafetensorsError) as info:
        ost.load(tmp_path / "c", target=target)
    message = str(info.value)
    assert "missing" in message and "extra" in message and "a: checkpoint (3,), target (4,)" in message


def test_a_missing_tensor_is_a_key_error_listing_every_one(tmp_path):
    """A target naming tensors the checkpoint lacks raises ``ost.MissingTensorError``: a
    ``KeyError`` (what Orbax's SafetensorsLayout raises, what a lookup by name raises) and a
    ``SafetensorsError``, whose str() reads as our other messages (a bare KeyError quotes it)."""
    ost.save(tmp_path / "c", {"a": np.zeros(3)})
    target = {"a": np.zeros(3), "gone": np.zeros(1), "lost": np.zeros(2)}
    for strict in (True, "target"):
        with pytest.raises(KeyError) as info:
            ost.load(tmp_path / "c", target=target, strict=strict)
        error = info.value
        assert isinstance(error, ost.MissingTensorError) and isinstance(error, ost.SafetensorsError)
        assert str(error).startswith("target does not match the checkpoint (")
        assert "missing from the checkpoint: gone, lost" in str(error)
    mapping = ost.Mapping([ost.Rule("w.{i}", "w.{i}")])
    with pytest.raises(ost.MissingTensorError, match="w.1: missing from the checkpoint: w.1"):
        ost.load(tmp_path / "c", {"w": {"1": np.zeros(3)}}, mapping=mapping)


def test_strict_target_loads_a_subset_and_refuses_what_it_cannot(tmp_path):
    """``strict="target"``: every target leaf from the checkpoint with its shape, other
    checkpoint tensors unread (``strict=True`` keeps refusing them); an empty target is an
    empty result; a shape mismatch still fails, naming it."""
    saved = {"a": np.arange(3.0), "b": np.ones((2, 2)), "extra": np.zeros(1)}
    ost.save(tmp_path / "c", saved)
    with pytest.raises(ost.SafetensorsError, match="in the checkpoint but not the target: extra") as info:
        ost.load(tmp_path / "c", {"a": np.zeros(3), "b": np.zeros((2, 2))})
    assert not isinstance(info.value, KeyError)
    stats = ost.LoadStats()
    subset = ost.load(tmp_path / "c", {"a": jax.ShapeDtypeStruct((3,), np.float64)}, strict="target",
                      stats=stats)
    assert list(subset) == ["a"] and subset["a"].tobytes() == saved["a"].tobytes()
    assert stats.bytes_needed == saved["a"].nbytes and stats.tensors == 1  # "b" and "extra": unread
    assert ost.load(tmp_path / "c", {}, strict="target") == {}
    with pytest.raises(ost.SafetensorsError, match=r"shape mismatch: b: checkpoint \(2, 2\), target \(4,\)"):
        ost.load(tmp_path / "c", {"b": np.zeros(4)}, strict="target")
    mapping = ost.Mapping([ost.Rule("{name}", "{name}")])
    mapped = ost.load(tmp_path / "c", {"b": np.zeros((2, 2))}, strict="target", mapping=mapping)
    assert list(mapped) == ["b"] and mapped["b"].tobytes() == saved["b"].tobytes()
    with pytest.raises(ValueError, match='strict must be True, False or "target"'):
        ost.load(tmp_path / "c", {"a": np.zeros(3)}, strict="subset")


def test_non_strict_loads_the_intersection_and_keeps_other_leaves(tmp_path):
    ost.save(tmp_path / "c", {"a": np.arange(3.0), "b": np.ones((2, 2)), "extra": np.zeros(1)})
    keep_a, keep_missing = np.zeros(4), np.full(1, 7.0)
    with pytest.warns(ost.SkippedLeavesWarning, match="a, missing"):
        restored = ost.load(tmp_path / "c", strict=False,
                            target={"a": keep_a, "b": np.zeros((2, 2)), "missing": keep_missing})
    assert restored["a"] is keep_a and restored["missing"] is keep_missing
    np.testing.assert_array_equal(restored["b"], np.ones((2, 2)))
    assert "extra" not in restored


def test_metadata_reads_headers_only(tmp_path):
    ost.save(tmp_path / "c", _tree(), max_shard_size=300, metadata={"step": "7"})
    info = ost.metadata(tmp_path / "c")
    assert info.tensors["layers.0.w"] == jax.ShapeDtypeStruct((8, 6), ml_dtypes.bfloat16)
    assert info.tensors["scale"].shape == ()
    assert info.metadata == {"format": "pt", "step": "7"}
    assert {f for fs in info.files.values() for f in fs} <= set(os.listdir(tmp_path / "c"))
    (embed_file,) = info.files["embed"]
    assert ost.metadata(tmp_path / "c" / embed_file).tensors["embed"].shape == (16, 8)


def test_single_file_path_writes_exactly_that_file(tmp_path):
    ost.save(tmp_path / "weights.safetensors", _tree())
    assert os.listdir(tmp_path) == ["weights.safetensors"]


def test_save_errors_are_clear(tmp_path):
    with pytest.raises(TypeError, match="'opt.step' is a int"):
        ost.save(tmp_path / "a", {"opt": {"step": 3}})
    with pytest.raises(ValueError, match="'s'.*no safetensors equivalent"):
        ost.save(tmp_path / "b", {"s": np.array(["x"])})
    with pytest.raises(ValueError, match="unknown layout"):
        ost.save(tmp_path / "c", {"a": np.zeros(1)}, layout="zip")
    with pytest.raises(ValueError, match="metadata"):
        ost.save(tmp_path / "d", {"a": np.zeros(1)}, metadata={"step": 3})
    with pytest.raises(ValueError, match="invalid size"):
        ost.save(tmp_path / "e", {"a": np.zeros(1)}, max_shard_size="lots")
    # A train state carries its PRNG key beside the params (numpy said only "Cannot interpret
    # 'key<fry>' as a data type", naming no leaf).
    with pytest.raises(TypeError, match=r"'state.rng' is a typed PRNG key.*key_data"):
        ost.save(tmp_path / "f", {"state": {"rng": jax.random.key(0), "w": np.zeros(2)}})
    assert not os.path.exists(tmp_path / "f")
    assert not any(os.scandir(tmp_path)) or all(
        not os.listdir(p) for p in tmp_path.iterdir())


def test_failed_save_leaves_previous_checkpoint_and_no_temporaries(tmp_path, monkeypatch):
    old = {"a": np.arange(100, dtype=np.float32), "b": np.ones(100, np.float32)}
    ost.save(tmp_path / "c", old, max_shard_size=400)
    before = sorted(os.listdir(tmp_path / "c"))
    from orbax_safetensors.storage.local import LocalStorage
    real_write, calls = LocalStorage.write_at, []

    def failing_write(self, path, offset, buffers):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(self, path, offset, buffers)

    monkeypatch.setattr(LocalStorage, "write_at", failing_write)
    with pytest.raises(OSError, match="disk full"):
        ost.save(tmp_path / "c", {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)},
                 max_shard_size=400, overwrite=True)
    assert sorted(os.listdir(tmp_path / "c")) == before
    _assert_tree_equal(ost.load(tmp_path / "c", target=old), old)


def test_refuses_to_overwrite_unless_asked(tmp_path):
    ost.save(tmp_path / "c", {"a": np.zeros(3)})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ost.save(tmp_path / "c", {"a": np.ones(3)})
    ost.save(tmp_path / "c", {"a": np.ones(3)}, overwrite=True)
    np.testing.assert_array_equal(ost.load(tmp_path / "c")["a"], np.ones(3))


def test_directory_with_shards_but_no_index_loads_only_the_whole_set(tmp_path):
    """Shards without their index load when every one of 1..N is there (a directory of
    ``*.safetensors`` is a checkpoint without index, as Orbax's SafetensorsLayout and
    ``hf download --include '*.safetensors'`` see it); one missing is an interrupted save or
    copy, named, and nothing loads. This test used to expect "interrupted save" for the whole
    set too: a save of ours puts its index in place last, but a complete set cannot be told
    from a checkpoint copied without its index, and a save still writing (on object stores,
    where files go to their final names) leaves its marker, which keeps the directory an
    interrupted save (tests/faults/test_crash_safety.py)."""
    tree = {"a": np.arange(300.0), "b": np.arange(300.0) + 1, "c": np.arange(300.0) + 2}
    ost.save(tmp_path / "c", tree, max_shard_size=2400)
    os.remove(tmp_path / "c" / INDEX_NAME)
    _assert_tree_equal(ost.load(tmp_path / "c"), tree)
    os.remove(tmp_path / "c" / "model-00002-of-00003.safetensors")
    with pytest.raises(ost.SafetensorsError, match="but not model-00002-of-00003.safetensors, and no "
                       "model.safetensors.index.json: an interrupted save, copy or download"):
        ost.load(tmp_path / "c")


_KILLED_SAVER = textwrap.dedent("""
    import sys, numpy as np, orbax_safetensors as ost
    rng = np.random.default_rng(int(sys.argv[2]))
    tree = {f"t{i}": rng.standard_normal(2_000_000).astype(np.float32) for i in range(12)}
    np.save(sys.argv[1] + ".expected.npy", np.stack([tree[f"t{i}"][:4] for i in range(12)]))
    print("ready", flush=True)
    ost.save(sys.argv[1], tree, max_shard_size="20MB")
    print("done", flush=True)
""")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_mid_save_never_leaves_a_wrong_checkpoint(tmp_path, seed):
    path = str(tmp_path / "ckpt")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, path, str(seed)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(np.random.default_rng(seed).uniform(0.0, 0.4))
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    expected = np.load(path + ".expected.npy")
    try:
        restored = ost.load(path)
    except (ost.SafetensorsError, FileNotFoundError):
        pass  # nothing committed: the right answer for an interrupted first save
    else:
        assert sorted(restored) == sorted(f"t{i}" for i in range(12))
        for i in range(12):
            np.testing.assert_array_equal(restored[f"t{i}"][:4], expected[i])
    # A re-run after the crash succeeds and commits.
    ost.save(path, {"z": np.arange(3)}, overwrite=True)
    assert sorted(ost.load(path)) == ["z"]
    assert not [n for n in os.listdir(path) if ".tmp-" in n]


def test_loads_hf_directory_with_single_file(tmp_path):
    ost.save(tmp_path / "c", {"a": np.arange(4)})
    assert sorted(os.listdir(tmp_path / "c")) == [SINGLE_FILE_NAME]
    np.testing.assert_array_equal(ost.load(tmp_path / "c")["a"], np.arange(4))


_EDGE_TENSORS = {
    "scalar": (np.array(1.5, np.float32), P()),
    "empty": (np.zeros((0, 8), np.float32), P(None, "y")),
    "vector": (np.arange(24, dtype=np.int16), P(("x", "y"))),
    "five_d": (np.arange(2 * 4 * 3 * 2 * 6, dtype=np.float32).reshape(2, 4, 3, 2, 6), P(None, "x", None, "y")),
    "odd_rows": (np.arange(12 * 7, dtype=np.float32).reshape(12, 7), P("x")),
    "odd_cols": (np.arange(5 * 14, dtype=np.int32).reshape(5, 14), P(None, "y")),
    "f4": (np.arange(16).astype(ml_dtypes.float4_e2m1fn).reshape(4, 4), P("x")),
}


def test_edge_shapes_under_multi_device_shardings(tmp_path):
    mesh = _mesh()
    ost.save(tmp_path / "c", {n: v for n, (v, _) in _EDGE_TENSORS.items()})
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
              for n, (v, spec) in _EDGE_TENSORS.items()}
    stats = ost.LoadStats()
    restored = ost.load(tmp_path / "c", target=target, stats=stats)
    for name, (value, _) in _EDGE_TENSORS.items():
        assert restored[name].sharding == target[name].sharding
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], err_msg=name)
    # One process holds every shard: each tensor is read whole, once, in one request per file.
    stored = sum(dtype_for_numpy(v.dtype).nbytes(v.shape) for v, _ in _EDGE_TENSORS.values())
    assert stats.bytes_read == stats.bytes_needed == stored


def test_a_sharded_packed_array_is_refused_and_a_replicated_one_saves(tmp_path):
    """Sub-byte values share bytes, so only a whole (replicated) F4 array has bytes of its own
    to write; a sharded one is refused before anything is written, naming the leaf."""
    values = np.arange(16).astype(ml_dtypes.float4_e2m1fn).reshape(4, 4)
    mesh = _mesh()
    sharded = jax.device_put(values, NamedSharding(mesh, P("x")))
    with pytest.raises(ost.ArgumentError, match=r"leaf 'w': F4 packs values below a byte"):
        ost.save(tmp_path / "c", {"ok": np.zeros(2, np.float32), "w": sharded})
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")
    ost.save(tmp_path / "d", {"w": jax.device_put(values, NamedSharding(mesh, P()))})
    np.testing.assert_array_equal(ost.load(tmp_path / "d")["w"], values)


def test_a_sharding_that_does_not_fit_names_the_tensor(tmp_path):
    ost.save(tmp_path / "c", {"w": np.zeros((10, 3), np.float32)})
    target = {"w": jax.ShapeDtypeStruct((10, 3), np.float32, sharding=NamedSharding(_mesh(), P("x")))}
    with pytest.raises(ValueError, match="'w'.*does not fit"):
        ost.load(tmp_path / "c", target=target)


def test_memory_budget_smaller_than_the_checkpoint(tmp_path):
    tree = {f"t{i}": np.full((256, 64), i, np.float32) for i in range(10)}
    ost.save(tmp_path / "c", tree, max_shard_size=200_000)
    sharding = NamedSharding(_mesh(), P("x"))
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for n, v in tree.items()}
    stats = ost.LoadStats()
    restored = ost.load(tmp_path / "c", target=target, stats=stats,
                        options=ost.LoadOptions(memory_budget=100_000, chunk_bytes=16_384))
    _assert_tree_equal(restored, tree)
    assert stats.requests >= 10 * 65536 // 16_384  # every tensor split into chunks
    assert stats.bytes_read == stats.bytes_needed == 10 * 65536


def test_read_size_defaults_to_the_backend(tmp_path):
    """One 20 MB tensor: one read from a local file (32 MB chunks), three ranged reads of
    ≤ 8 MiB from an object store (memory:// stands in), where throughput comes from requests
    in flight; an explicit ``chunk_bytes`` wins over either default."""
    value = np.arange(5_000_000, dtype=np.float32)
    requests = {}
    for where in ("local", "memory", "memory-explicit"):
        path = str(tmp_path / "c") if where == "local" else f"memory://{tmp_path.name}/c"
        if where != "memory-explicit":
            ost.save(path, {"w": value}, overwrite=True)
        stats = ost.LoadStats()
        options = ost.LoadOptions(chunk_bytes="4MB") if where == "memory-explicit" else None
        np.testing.assert_array_equal(ost.load(path, options=options, stats=stats)["w"], value)
        requests[where] = stats.requests
    assert requests == {"local": 1, "memory": 3, "memory-explicit": 5}
