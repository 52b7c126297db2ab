"""What a new user trips over first: None leaves, partial loads, targets built from a checkpoint,
progress lines, and saves refused before they write a file nothing can read."""

import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost


def _mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tp"))


def _state():
    """An optax-like training state: parameters and an optimizer state holding None."""
    params = {"dense": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8),
                        "bias": np.linspace(-1, 1, 8, dtype=np.float32)}}
    return {"params": params, "opt": {"count": np.array(7, np.int32), "mask": None,
                                      "mu": {"dense": {"kernel": np.ones((8, 8), np.float32), "bias": None}}}}


def test_none_leaves_are_empty_subtrees_on_save_and_load(tmp_path):
    state = _state()
    sharding = NamedSharding(_mesh(), P("fsdp"))
    on_devices = jax.tree.map(lambda x: jax.device_put(x, sharding) if x.ndim else jnp.asarray(x), state)
    ost.save(tmp_path / "c", on_devices)
    assert set(ost.metadata(tmp_path / "c").tensors) == {
        "params.dense.kernel", "params.dense.bias", "opt.count", "opt.mu.dense.kernel"}
    target = jax.eval_shape(lambda: on_devices)  # shardings over an abstract mesh (JAX 0.7: none)
    abstract = isinstance(getattr(target["params"]["dense"]["kernel"].sharding, "mesh", None),
                          jax.sharding.AbstractMesh)
    if abstract:
        with pytest.raises(ValueError, match="sharded over an abstract mesh.*jax.sharding.set_mesh"):
            ost.load(tmp_path / "c", target)
        with jax.sharding.set_mesh(sharding.mesh):
            loaded = ost.load(tmp_path / "c", target)
    else:
        loaded = ost.load(tmp_path / "c", target)  # host arrays
    assert loaded["opt"]["mask"] is None and loaded["opt"]["mu"]["dense"]["bias"] is None
    assert jax.tree.structure(loaded) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), want)
    if abstract:
        assert loaded["params"]["dense"]["kernel"].sharding.is_equivalent_to(sharding, 2)


@pytest.mark.parametrize("tree, kwargs, message", [
    ({"a": np.zeros(2)}, {"metadata": {"blob": "x" * 100_000_001}},
     "metadata is 100,000,0.. bytes as JSON, over the 100,000,000-byte limit"),
    ({"a": np.zeros(2)}, {"metadata": {1: "x"}}, "metadata key 1 is int; metadata keys must be strings"),
    ({"a": np.zeros(2)}, {"metadata": {"step": 3}}, r"metadata\['step'\] is int; metadata values"),
    ({"a": np.zeros(2)}, {"metadata": {"k": "\ud800"}}, r"metadata\['k'\] holds an unpaired surrogate"),
    ({"a\ud800b": np.zeros(2)}, {}, r"tensor 'a\\ud800b': the name holds an unpaired surrogate"),
    ({"": np.zeros(2)}, {}, r"the leaf at \[''\] has an empty name"),
    (np.zeros(2), {}, "a bare array has no name"),
    ({"a": {"b": np.zeros(2)}, "a.b": np.zeros(2)}, {},
     r"two leaves are both named 'a.b': \['a'\]\['b'\] and \['a.b'\]"),
    ({"x": np.zeros(2), "a": {"b": np.zeros(2)}, "a.b": np.zeros(2), "": np.zeros(1)}, {},
     r"the leaf at \[''\] has an empty name"),  # the first leaf refused, in the tree's order
    ({f"{i:05d}" + "x" * 10_000: np.zeros(1, np.int8) for i in range(10_001)}, {"checksums": False},
     "header of 10001 tensors would be 100,.* bytes, over the 100,000,000-byte limit"),
])
def test_save_refuses_what_no_reader_reads_before_writing(tmp_path, tree, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ost.save(tmp_path / "c", tree, **kwargs)
    assert not (tmp_path / "c").exists() or not [
        p for p in (tmp_path / "c").iterdir() if p.name.endswith((".safetensors", ".json"))]


def test_max_shard_size_with_a_single_file_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="one .safetensors file, which max_shard_size cannot split"):
        ost.save(tmp_path / "w.safetensors", {"a": np.zeros(4)}, max_shard_size="1KB")
    assert not (tmp_path / "w.safetensors").exists()
    ost.save(tmp_path / "w.safetensors", {"a": np.zeros(4)})  # the default applies to directories only
    ost.save(tmp_path / "d", {"a": np.zeros(400), "b": np.zeros(400)}, max_shard_size="4KB")
    assert sorted(ost.metadata(tmp_path / "d").files.values()) == [
        ("model-00001-of-00002.safetensors",), ("model-00002-of-00002.safetensors",)]


def test_strict_false_reports_what_it_skipped_and_leaks_no_abstract_leaf(tmp_path):
    ost.save(tmp_path / "c", {"a": np.arange(3.0), "b": np.ones((2, 2))})
    kept = np.full(2, 7.0)
    target = {"a": jax.ShapeDtypeStruct((3,), np.float64), "b": jax.ShapeDtypeStruct((5,), np.float64),
              "missing": jax.ShapeDtypeStruct((1,), np.float32), "kept": kept}
    stats = ost.LoadStats()
    with pytest.warns(ost.SkippedLeavesWarning, match="3 target leaves not loaded.*: b, kept, missing"):
        loaded = ost.load(tmp_path / "c", target, strict=False, stats=stats)
    assert stats.skipped == ["b", "kept", "missing"]
    np.testing.assert_array_equal(loaded["a"], np.arange(3.0))
    assert loaded["b"] is None and loaded["missing"] is None and loaded["kept"] is kept
    assert not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(loaded))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete load warns nothing
        ost.load(tmp_path / "c", {"a": target["a"]}, strict=False)


def test_target_from_a_checkpoint_and_sharding_rules(tmp_path):
    rng = np.random.default_rng(0)
    flat = {"model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.layers.0.mlp.weight": rng.standard_normal((8, 4)).astype(np.float32),
            "model.layers.10.mlp.weight": rng.standard_normal((8, 4)).astype(np.float32),
            "step": np.array(3, np.int32)}
    ost.save(tmp_path / "c", flat)
    mesh = _mesh()
    rules = {r"embed": P("fsdp", "tp"), r"layers\.\d+\.mlp": P(None, "tp"), r".*": P()}
    target = ost.target(tmp_path / "c", rules, mesh=mesh, dtype=jnp.bfloat16)
    assert set(target) == {"model", "step"} and set(target["model"]["layers"]) == {"0", "10"}
    assert target["model"]["embed"]["weight"].sharding == NamedSharding(mesh, P("fsdp", "tp"))
    assert target["model"]["layers"]["10"]["mlp"]["weight"].dtype == jnp.bfloat16
    assert target["step"].dtype == np.int32  # integers keep theirs
    stats = ost.LoadStats()
    loaded = ost.load(tmp_path / "c", target, stats=stats)
    assert stats.bytes_read == stats.bytes_needed
    assert loaded["model"]["layers"]["0"]["mlp"]["weight"].sharding == NamedSharding(mesh, P(None, "tp"))
    np.testing.assert_array_equal(np.asarray(loaded["model"]["embed"]["weight"]),
                                  flat["model.embed.weight"].astype(jnp.bfloat16))
    # The same from metadata, flat, with a function and with one sharding for all.
    info = ost.metadata(tmp_path / "c")
    by_rank = ost.target(info, lambda name, s: P("fsdp") if len(s.shape) == 2 else None,
                         mesh=mesh, nest=False)
    assert by_rank["step"].sharding is None and by_rank["model.embed.weight"].sharding.spec == P("fsdp")
    replicated = NamedSharding(mesh, P())
    assert {t.sharding for t in ost.target(info, replicated, nest=False).values()} == {replicated}


def test_target_names_every_tensor_it_cannot_place(tmp_path):
    ost.save(tmp_path / "c", {"w": np.zeros((8, 8)), "v": np.zeros(8), "u": np.zeros(8)})
    with pytest.raises(ValueError, match=r"no rule matches u, v \(end the rules with"):
        ost.target(tmp_path / "c", {"w": P("fsdp")}, mesh=_mesh())
    with pytest.raises(ValueError, match=r"u: P\('fsdp', 'tp'\) has 2 axes, the tensor 1"):
        ost.target(tmp_path / "c", [(".*", P("fsdp", "tp"))], mesh=_mesh())
    with pytest.raises(ValueError, match="needs a mesh"):
        ost.target(tmp_path / "c", P())


def test_load_nests_names_without_a_target(tmp_path):
    ost.save(tmp_path / "c", {"model.layers.0.w": np.ones(2), "model.layers.1.w": np.zeros(2), "b": np.ones(1)})
    loaded = ost.load(tmp_path / "c", nest=True)
    assert set(loaded) == {"model", "b"} and set(loaded["model"]["layers"]) == {"0", "1"}
    np.testing.assert_array_equal(loaded["model"]["layers"]["1"]["w"], np.zeros(2))
    assert set(ost.async_load(tmp_path / "c", nest=True).result()) == {"model", "b"}
    with pytest.raises(ValueError, match="nest=True shapes a load without a target"):
        ost.load(tmp_path / "c", {"b": np.zeros(1)}, nest=True)
    ost.save(tmp_path / "clash", {"a": np.ones(1), "a.b": np.ones(1)})
    with pytest.raises(ValueError, match="cannot nest 'a.b'"):
        ost.load(tmp_path / "clash", nest=True)


def test_progress_lines_on_save_async_save_and_load(tmp_path, capfd):
    tree = {"w": np.ones((256, 256), np.float32)}
    ost.save(tmp_path / "c", tree, progress=True)
    ost.async_save(tmp_path / "d", tree, progress=True).result()
    ost.load(tmp_path / "c", progress=True)
    err = capfd.readouterr().err
    assert f"save {tmp_path / 'c'}: 262.14/262.14 KB (100%)" in err
    assert f"save {tmp_path / 'd'}: 262.14/262.14 KB (100%)" in err
    assert f"load {tmp_path / 'c'}: " in err and "(100%)" in err.split("load ")[-1]
    # stderr is no terminal here: plain lines, no carriage returns or escape codes.
    assert "\r" not in err and "\x1b" not in err and err.endswith("\n"), repr(err)
    assert err.count("\n") == 3 and all(": " in line for line in err.splitlines())
    ost.save(tmp_path / "e", tree)
    ost.load(tmp_path / "e")
    assert capfd.readouterr().err == ""  # off by default in library calls


class _Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_redraws_a_line_on_a_terminal_and_writes_plain_lines_elsewhere(monkeypatch, terminal):
    monkeypatch.setattr(ost.engine.Progress, "LOG_SECONDS", 0.0)  # a line at every advance
    monkeypatch.setattr(ost.engine.Progress, "REDRAW_SECONDS", 0.0)
    stream = _Stream(terminal)
    report = ost.engine.Progress("job", 3_000_000, enabled=True, stream=stream).start()
    for _ in range(3):
        report.advance(1_000_000)
    assert report.close().startswith("job: 3.00/3.00 MB (100%) in ")
    text = stream.getvalue()
    if terminal:
        assert text.count("\r") == 5 and text.count("\x1b[K") == 5 and text.count("\n") == 1
        assert text.startswith("\rjob: 0.00/3.00 MB (0%)") and text.endswith("\x1b[K\n")
    else:
        assert "\r" not in text and "\x1b" not in text
        lines = text.splitlines()
        assert [line.split(" in ")[0] for line in lines] == [
            "job: 1.00/3.00 MB (33%)", "job: 2.00/3.00 MB (67%)", "job: 3.00/3.00 MB (100%)",
            "job: 3.00/3.00 MB (100%)"]
        assert "ETA" in lines[0] and "ETA" not in lines[-1]
    assert ost.engine.Progress("job", 1, stream=_Stream(False)).enabled is False  # None: terminals only


def test_shards_hold_consecutive_layers(tmp_path):
    """A flat dict's keys sort as text in JAX (layers.1, layers.10, layers.11, layers.2, ...);
    shards are filled in numeric order, as transformers fills them."""
    tree = {f"model.layers.{i}.w": np.full(250, i, np.float32) for i in range(12)}
    ost.save(tmp_path / "c", tree, max_shard_size="7KB")  # six 1 KB tensors and their headers
    files = ost.metadata(tmp_path / "c").files
    assert [files[f"model.layers.{i}.w"][0][6:11] for i in range(12)] == ["00001"] * 6 + ["00002"] * 6
    ost.consolidate(tmp_path / "c", tmp_path / "d", max_shard_size="7KB")
    assert ost.metadata(tmp_path / "d").files == files


@pytest.mark.parametrize("layout, checksums", [("hf", True), ("hf", False), ("distributed", True)])
def test_max_shard_size_counts_headers_so_no_file_exceeds_it(tmp_path, layout, checksums):
    """Tiny tensors are mostly header: 16 bytes of data against a ~70-byte entry (and the slice
    offsets of the distributed layout). Files used to be packed by data bytes alone."""
    tree = {f"model.layers.{i}.w": np.full(4, i, np.float32) for i in range(3000)}
    ost.save(tmp_path / "c", tree, max_shard_size="50KB", layout=layout, checksums=checksums)
    sizes = [f.stat().st_size for f in (tmp_path / "c").glob("*.safetensors")]
    assert len(sizes) > 1 and max(sizes) <= 50_000, sizes
    assert sum(sizes) > 50_000 * (len(sizes) - 1) * 0.9  # filled, not split needlessly
    loaded = ost.load(tmp_path / "c")
    assert all(np.array_equal(loaded[n], v) for n, v in tree.items())


@pytest.mark.slow  # 100 000 tensors
def test_a_2mb_shard_of_100_000_tiny_tensors_stays_under_2mb(tmp_path):
    tree = {f"model.layers.{i}.w": np.full(4, i, np.float32) for i in range(100_000)}
    ost.save(tmp_path / "c", tree, max_shard_size="2MB")
    sizes = [f.stat().st_size for f in (tmp_path / "c").glob("*.safetensors")]
    assert len(sizes) > 1 and max(sizes) <= 2_000_000, sizes
    # Big tensors split where transformers splits them (tensor bytes; headers are noise there).
    big = {f"layers.{i}.w": np.zeros(250_000, np.float32) for i in range(6)}  # 1 MB each
    ost.save(tmp_path / "big", big, max_shard_size="2.1MB")
    assert sorted(f.name for f in (tmp_path / "big").glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
