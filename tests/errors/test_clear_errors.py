"""Mistakes and damage get an error of a type a user would catch, raised where the mistake is
made and naming what is wrong: a missing shard, a config without the keys a mapping needs, a
sharding that does not divide a tensor, a value only 64-bit JAX can hold, a bad regex, a special
file where a save would write, and load options out of range."""

from __future__ import annotations

import errno
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost

SHARD1 = "model-00001-of-00002.safetensors"


def _two_shards(path) -> dict[str, np.ndarray]:
    tree = {"a": np.arange(100, dtype=np.float32), "b": np.ones(100, np.float32)}
    ost.save(path, tree, max_shard_size=400)
    assert SHARD1 in os.listdir(path)
    return tree


def test_a_missing_shard_is_a_file_not_found_error_naming_the_file(tmp_path):
    _two_shards(tmp_path / "c")
    (tmp_path / "c" / SHARD1).unlink()
    with pytest.raises(FileNotFoundError) as raised:
        ost.load(tmp_path / "c")
    error = raised.value
    assert isinstance(error, ost.MissingFileError) and isinstance(error, ost.SafetensorsError)
    assert error.errno == errno.ENOENT and error.filename == str(tmp_path / "c" / SHARD1)
    assert str(error) == f"file {str(tmp_path / 'c' / SHARD1)!r}: does not exist"
    with pytest.raises(ost.MissingFileError, match="does not exist"):
        ost.load(tmp_path / "gone.safetensors")


def test_a_missing_shard_reaches_a_checkpoint_manager_restore_as_missing_file_error(tmp_path):
    tree = {"a": np.arange(100, dtype=np.float32), "b": np.ones(100, np.float32)}
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, args=ocp.args.Composite(params=ost.SafetensorsSave(tree, max_shard_size=400)))
        manager.wait_until_finished()
    shard = tmp_path / "run" / "1" / "params" / SHARD1
    shard.unlink()
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(ost.MissingFileError) as raised:
            manager.restore(1, args=ocp.args.Composite(params=ost.SafetensorsRestore()))
    assert raised.value.errno == errno.ENOENT and raised.value.filename == str(shard)


@pytest.mark.parametrize("config, missing", [
    (None, "config is None"),
    ({}, "no num_attention_heads and no head_dim"),
    ({"num_attention_heads": 8}, "no head_dim"),
])
def test_maxtext_without_the_config_keys_it_needs_names_them(config, missing):
    with pytest.raises(ValueError, match=f"maxtext\\('llama3.1'.*{missing}"):
        ost.mappings.maxtext("llama3.1", config)
    ost.mappings.maxtext("llama3.1", {"num_attention_heads": 8, "hidden_size": 64})


def test_a_hugging_face_mapping_names_what_its_config_lacks():
    with pytest.raises(ValueError, match=r"ost.mappings.qwen3: the config has no num_attention_heads"):
        ost.mappings.qwen3({"hidden_size": 64})
    ost.mappings.qwen3()  # no config: the target's shapes give the head sizes


def test_target_refuses_a_sharding_that_does_not_divide_a_tensor(tmp_path):
    ost.save(tmp_path / "c", {"w": np.ones((6, 4), np.float32), "v": np.ones(8, np.float32)})
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    with pytest.raises(ValueError, match=r"w: dimension 0 of shape \(6, 4\) has size 6, which mesh "
                                         r"axes \('fsdp',\) \(4 shards\) do not divide"):
        ost.target(tmp_path / "c", {"w": P("fsdp"), ".*": P()}, mesh=mesh)
    with pytest.raises(ValueError, match=r"w: dimension 1 .* axes \('fsdp', 'tp'\) \(8 shards\)"):
        ost.target(tmp_path / "c", {"w": P(None, ("fsdp", "tp")), ".*": P()}, mesh=mesh)
    with pytest.raises(ValueError, match=r"cannot place every tensor: w: dimension 0 .* \(4 shards\)"):
        ost.target(tmp_path / "c", NamedSharding(mesh, P("fsdp")))  # v (8,) divides, w does not
    placed = ost.target(tmp_path / "c", {"w": P("tp"), ".*": P()}, mesh=mesh)  # 6 over 2 divides
    np.testing.assert_array_equal(np.asarray(ost.load(tmp_path / "c", placed)["w"]), np.ones((6, 4)))


def test_a_bad_sharding_rule_regex_is_named(tmp_path):
    ost.save(tmp_path / "c", {"w": np.ones(4)})
    with pytest.raises(ValueError, match=r"sharding rule pattern 'w\[' is not a valid regex: "
                                         "unterminated character set"):
        ost.target(tmp_path / "c", {"w[": P(), ".*": P()}, mesh=jax.make_mesh((8,), ("x",)))


def test_an_int64_value_beyond_int32_advises_64_bit_jax_not_an_unsafe_cast(tmp_path):
    ost.save(tmp_path / "c", {"step": np.array([2**40], np.int64)})
    assert not jax.config.jax_enable_x64
    target = ost.target(tmp_path / "c", {".*": P()}, mesh=jax.make_mesh((8,), ("x",)))
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(tmp_path / "c", target)
    message = str(raised.value)
    assert "value 1099511627776 (stored int64) does not fit the target dtype int32" in message
    assert 'jax.config.update("jax_enable_x64", True)' in message and "host numpy array" in message
    assert 'casting="unsafe" would wrap the value around' in message
    host = ost.load(tmp_path / "c", {"step": jax.ShapeDtypeStruct((1,), np.int64)})
    assert host["step"].dtype == np.int64 and host["step"][0] == 2**40
    # An int32 value beyond int8 is an ordinary narrowing: the unsafe cast is the way out.
    ost.save(tmp_path / "d", {"n": np.array([300], np.int32)})
    with pytest.raises(ost.SafetensorsError, match='LoadOptions\\(casting="unsafe"\\) to cast'):
        ost.load(tmp_path / "d", {"n": jax.ShapeDtypeStruct((1,), np.int8)})


def _special(kind: str, path) -> None:
    if kind == "directory":
        path.mkdir()
        (path / "mine.txt").write_text("kept")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket
        server, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(path.parent)  # a relative name: a socket's path is limited to 107 bytes
        try:
            server.bind(path.name)
        finally:
            os.chdir(cwd)
            server.close()
    else:
        path.symlink_to(path.parent / "gone")


@pytest.mark.parametrize("kind, said", [("directory", "a directory"), ("fifo", "a FIFO"),
                                        ("socket", "a socket"), ("dangling", "a symbolic link")])
@pytest.mark.parametrize("where", ["directory", "single file", "shard"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_refuses_a_non_file_where_it_would_write_one(tmp_path, kind, said, where, overwrite):
    directory = tmp_path / "c"
    directory.mkdir()
    name = {"directory": "model.safetensors", "single file": "x.safetensors",
            "shard": "model-00001-of-00002.safetensors"}[where]
    _special(kind, directory / name)
    before = sorted(os.listdir(directory))
    path = directory / name if where == "single file" else directory
    with pytest.raises(FileExistsError) as raised:
        ost.save(path, {"a": np.ones(100, np.float32), "b": np.ones(100, np.float32)},
                 overwrite=overwrite)
    assert raised.value.errno == errno.EEXIST and raised.value.filename == str(directory / name)
    assert f"is {said}" in str(raised.value) and "not a file" in str(raised.value)
    assert sorted(os.listdir(directory)) == before  # nothing written, nothing left
    if kind == "directory":
        assert (directory / name / "mine.txt").read_text() == "kept"
