"""Every writer stores crc32c block checksums of what it writes, computed as it writes.

Each output (hf in place, one named file, ``memory://`` streamed, the
distributed layout, consolidate, convert from Orbax, and on S3/GCS both
layouts) is checked against checksums recomputed from its bytes; the index
lists each file's whole crc32c. Multi-process saves are checked byte for
byte against a single-process save in ``test_parallel_save_multiprocess``
(checksums and index included).
"""

import json
import os
import shutil

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors
import safetensors.numpy

import orbax_safetensors as ost
from orbax_safetensors.format.checksums import BLOCK_BYTES
from orbax_safetensors.index import FILE_CRCS_KEY
from tests.support.integrity import assert_checksummed
from tests.support.object_stores import object_store_server


def _tree():
    """Tensors spanning several blocks, one not a whole number of blocks, one empty."""
    rng = np.random.default_rng(0)
    return {"big": rng.standard_normal((3 * BLOCK_BYTES // 4 + 5, 1), np.float32),
            "rows": rng.integers(0, 100, (301, 1000), np.int16),
            "small": np.arange(7, dtype=np.int8), "empty": np.zeros((0, 4), np.float32)}


def _sharded(tree):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    return {k: jax.device_put(v, sharding) if v.shape and v.shape[0] % len(jax.devices()) == 0 else v
            for k, v in tree.items()}


def _assert_loads(url, tree):
    loaded = ost.load(url)
    for name, value in tree.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


@pytest.mark.parametrize("where,options", [
    ("dir", {}), ("dir", {"max_shard_size": 700_000}), ("model.safetensors", {}),
    ("memory", {"max_shard_size": 700_000}), ("dir", {"layout": "distributed", "max_shard_size": 700_000}),
])
def test_every_writer_stores_checksums_that_match_its_bytes(tmp_path, where, options):
    tree = _tree()
    url = {"dir": str(tmp_path / "ckpt"), "model.safetensors": str(tmp_path / "model.safetensors"),
           "memory": f"memory://checksums/{tmp_path.name}"}[where]
    ost.save(url, _sharded(tree), **options)
    assert assert_checksummed(url) >= 4
    _assert_loads(url, tree)


def test_consolidate_and_convert_write_checksums_of_their_output(tmp_path):
    tree = _tree()
    ost.save(tmp_path / "dist", _sharded(tree), layout="distributed", max_shard_size=700_000)
    ost.consolidate(tmp_path / "dist", tmp_path / "hf", max_shard_size=700_000, block_bytes=100_000)
    assert_checksummed(tmp_path / "hf")
    _assert_loads(tmp_path / "hf", tree)
    # The same bytes as a save of the same tree: the checksums do not depend on who wrote them.
    ost.save(tmp_path / "saved", tree, max_shard_size=700_000)
    for name in os.listdir(tmp_path / "saved"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", {k: v for k, v in tree.items() if v.size})
    ost.convert(tmp_path / "orbax", tmp_path / "converted", nest=False)
    assert_checksummed(tmp_path / "converted")


def test_checksums_false_writes_what_transformers_writes(tmp_path):
    tree = _tree()
    ost.save(tmp_path / "plain", tree, checksums=False)
    with safetensors.safe_open(tmp_path / "plain" / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    assert safetensors.numpy.save({k: tree[k] for k in sorted(tree)}, metadata={"format": "pt"}) == (
        tmp_path / "plain" / "model.safetensors").read_bytes()
    with pytest.raises(AssertionError, match="stores no checksums"):
        assert_checksummed(tmp_path / "plain")


@pytest.mark.parametrize("key", ["orbax_safetensors.crc32c", "orbax_safetensors.crc32c_block_bytes",
                                 "crc32c", "crc32c_block_bytes"])
def test_metadata_may_not_take_the_checksum_keys(tmp_path, key):
    """Ours, and the bare keys earlier versions wrote (which they, still reading checkpoints,
    take for their checksums and refuse a file where they do not parse)."""
    with pytest.raises(ValueError, match=f"{key}.*reserved"):
        ost.save(tmp_path / "x", {"a": np.zeros(3)}, metadata={key: "1"})
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="reserved"):
        ost.SafetensorsSave({"a": np.zeros(3)}, metadata={key: "1"})
    ost.save(tmp_path / "y", {"a": np.zeros(3)}, metadata={key: "1"}, checksums=False)  # theirs then


def test_a_checksummed_load_keeps_the_users_metadata_only(tmp_path):
    ost.save(tmp_path / "m", {"a": np.zeros(3)}, metadata={"step": "7"})
    assert ost.metadata(tmp_path / "m").metadata == {"format": "pt", "step": "7"}


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["s3", "gs"])
def test_object_stores_get_checksummed_files_whole_and_in_parts(protocol):
    """hf files are merged from parts (their headers last); distributed files are streamed with
    the header held back: above S3's 5 MiB first part the rest streams to a second object."""
    rng = np.random.default_rng(1)
    tree = {"big": rng.standard_normal((3 << 20) // 2, np.float32),  # 6 MiB: two S3 parts
            "small": np.arange(10, dtype=np.float32)}
    with object_store_server(protocol) as (bucket, env):
        for layout in ("hf", "distributed"):
            url = f"{bucket}/{layout}"
            ost.save(url, _sharded(tree), layout=layout, max_shard_size=1 << 20)
            assert_checksummed(url)
            _assert_loads(url, tree)
            fs, root = fsspec.core.url_to_fs(url)
            assert not [p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[1].startswith(".")]


def test_verify_compares_each_file_with_the_crc32c_its_index_lists(tmp_path):
    """A header byte changed so that it still parses (padding space → tab) is damage no block
    checksum covers; the index's whole-file crc32c shows it, without reading any tensor."""
    ost.save(tmp_path / "c", _tree(), max_shard_size=700_000)
    assert ost.verify(tmp_path / "c").ok
    victim = tmp_path / "c" / "model-00001-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    length = int.from_bytes(data[:8], "little")
    assert data[8 + length - 1:8 + length] == b" ", "the header ends in padding"
    data[8 + length - 1] = ord("\t")
    victim.write_bytes(bytes(data))
    with pytest.raises(ost.SafetensorsError, match="index lists crc32c"):
        ost.load(tmp_path / "c")  # the tensors are intact, but a load cannot tell this from a swap
    report = ost.verify(tmp_path / "c")
    assert [(p.file.rsplit("/", 1)[1], "index lists crc32c" in p.message) for p in report.problems] == [
        ("model-00001-of-00002.safetensors", True)]


def test_a_shard_copied_in_from_another_save_is_refused_by_load_and_verify(tmp_path):
    """Two saves of the same shapes; shard 1 of the second copied over the first's. Every
    header and block checksum in it is valid: only the index's whole-file crc32c (checked
    from the headers, no tensor read) shows that it belongs to another checkpoint."""
    first, second = _tree(), {k: v + 1 for k, v in _tree().items()}
    ost.save(tmp_path / "a", first, max_shard_size=700_000)
    ost.save(tmp_path / "b", second, max_shard_size=700_000)
    shutil.copy(tmp_path / "b" / "model-00001-of-00002.safetensors", tmp_path / "a")
    # (ost.metadata reads no checksums, so it lists the shapes, which are the same.)
    for load in (lambda: ost.load(tmp_path / "a"), lambda: ost.async_load(tmp_path / "a").result()):
        with pytest.raises(ost.SafetensorsError, match="copied in from another save") as raised:
            load()
        assert raised.value.file.endswith("model-00001-of-00002.safetensors")
    assert [p.file.rsplit("/", 1)[1] for p in ost.verify(tmp_path / "a").problems] == [
        "model-00001-of-00002.safetensors"]
    # The comparison is a checksum check: without them the copy loads (what is there is read).
    loaded = ost.load(tmp_path / "a", options=ost.LoadOptions(verify_checksums=False))
    placed = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    for name, value in loaded.items():
        copied = placed[name] == "model-00001-of-00002.safetensors"
        np.testing.assert_array_equal(value, (second if copied else first)[name])


def test_a_distributed_file_copied_in_from_another_save_is_refused(tmp_path):
    """The same for the distributed layout, whose index lists each file's crc32c too."""
    first, second = _tree(), {k: v + 1 for k, v in _tree().items()}
    for directory, tree in ((tmp_path / "a", first), (tmp_path / "b", second)):
        ost.save(directory, _sharded(tree), layout="distributed")
    name = sorted(p.name for p in (tmp_path / "a").glob("shard-*.safetensors"))[0]
    shutil.copy(tmp_path / "b" / name, tmp_path / "a")
    with pytest.raises(ost.SafetensorsError, match="copied in from another save") as raised:
        ost.load(tmp_path / "a")
    assert raised.value.file.endswith(name)
    assert [p.file.rsplit("/", 1)[1] for p in ost.verify(tmp_path / "a").problems] == [name]


def _index_crcs_under(directory, key: str, crcs) -> None:
    """A fresh save of ``_tree()`` whose index lists ``crcs(ours)`` under ``metadata[key]``
    instead of our whole-file crc32cs under ours."""
    ost.save(directory, _tree(), max_shard_size=700_000, overwrite=True)
    index = directory / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"][key] = crcs(document["metadata"].pop(FILE_CRCS_KEY))
    index.write_text(json.dumps(document))


def test_verify_reads_the_index_crcs_earlier_versions_wrote_and_not_another_tools(tmp_path):
    """The HF index's metadata is every tool's: ours is namespaced. The bare ``crc32c`` is read
    as what earlier versions of ours wrote there only if every value is one of our CRCs."""
    _index_crcs_under(tmp_path / "c", "crc32c", lambda ours: ours)
    assert ost.verify(tmp_path / "c").ok
    _index_crcs_under(tmp_path / "c", "crc32c", lambda ours: {**ours, next(iter(ours)): "AAAAAA=="})
    assert [p.message.startswith("the index lists crc32c 'AAAAAA=='")
            for p in ost.verify(tmp_path / "c").problems] == [True]

    for theirs in ["deadbeef", {"model-00001-of-00002.safetensors": "deadbeef"},
                   {"model-00001-of-00002.safetensors": 3735928559}]:
        _index_crcs_under(tmp_path / "c", "crc32c", lambda ours: theirs)
        assert ost.verify(tmp_path / "c").ok, theirs
