"""Integrity on the read side: every load checks the crc32c of every block it reads.

``ost.save`` stores a crc32c per 256 KiB block of every tensor (``format.checksums``).
Here bytes are flipped on disk, and every way of reading them must notice: each
kind of load fails naming the file, the tensor and the bytes, while loads that
do not read the damaged block succeed; ``verify(data=True)`` lists every damaged
tensor at once. Files written by ``safetensors.numpy`` with checksums of 4 KiB
blocks (``write_checksummed``) let small tensors span many blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.engine.core.catalog import open_checkpoint
from orbax_safetensors.engine.loading.execution import execute
from orbax_safetensors.engine.loading.jobs import Job
from orbax_safetensors.engine.loading.options import ReadPolicy
from orbax_safetensors.format import parse_file_bytes
from orbax_safetensors.format.checksums import (
    BLOCK_BYTES,
    BLOCK_SIZE_KEY,
    BLOCKS_KEY,
    LEGACY_BLOCK_SIZE_KEY,
    LEGACY_BLOCKS_KEY,
    RESERVED_KEYS,
    BlockGrid,
    FileChecksums,
)
from orbax_safetensors.index import dcp_metadata, distributed_file_name
from orbax_safetensors.planning import ReadProfile, box_shape, plan_reads, plan_tensor_reads
from orbax_safetensors.storage import Location
from tests.support import REPO

_REPO = str(REPO)
BLOCK = 4096  # checksum blocks of the files written here by hand


def write_checksummed(path, tensors: dict[str, np.ndarray], *, block_bytes: int = BLOCK,
                      metadata: dict[str, str] | None = None, legacy: bool = False) -> None:
    """``tensors`` saved by ``safetensors`` with the block checksums ``ost.save`` stores, of
    ``block_bytes`` (``legacy``: under the bare keys versions before the namespace wrote):
    CRCs depend only on each tensor's bytes, so a first write gives them and a second stores
    them."""
    metadata = {"format": "pt", **(metadata or {})}
    safetensors.numpy.save_file(tensors, path, metadata=metadata)
    raw = np.fromfile(path, np.uint8)
    header = parse_file_bytes(raw.tobytes())
    grid = BlockGrid.of(header.tensors.values(), 0, block_bytes)
    pieces = grid.pieces(0, [raw[header.data_start:]])
    assert [p.block for p in pieces] == list(range(grid.count))
    crcs = FileChecksums(grid, np.array([p.crc for p in pieces], np.uint32)).metadata()
    if legacy:
        crcs = {LEGACY_BLOCK_SIZE_KEY: crcs[BLOCK_SIZE_KEY], LEGACY_BLOCKS_KEY: crcs[BLOCKS_KEY]}
    safetensors.numpy.save_file(tensors, path, metadata={**metadata, **crcs})


@contextlib.contextmanager
def flipped(file: str, *offsets: int):
    """The bytes at ``offsets`` of ``file`` inverted, while inside."""
    def flip():
        with open(file, "r+b") as f:
            for offset in offsets:
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ 0xFF]))

    flip()
    try:
        yield
    finally:
        flip()


def locate(path, name: str) -> tuple[str, int, int]:
    """The file holding tensor ``name`` (stored whole), its first byte's offset and its size."""
    with open_checkpoint(Location.resolve(path)) as checkpoint:
        stored = checkpoint.tensors[name].slices[0]
        return stored.file, stored.offset, stored.info.nbytes


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB: 4 blocks
        "layers.0.w": rng.standard_normal((512, 512)).astype(ml_dtypes.bfloat16),  # 2 blocks
        "layers.1.w": rng.standard_normal((512, 512)).astype(ml_dtypes.bfloat16),
        "norm": rng.standard_normal((1000,)).astype(np.float32),  # one short block
        "ids": rng.integers(0, 1000, (8, 8)).astype(np.int32),
    }


VALUES = _values()
TOTAL = sum(v.nbytes for v in VALUES.values())


def _sharded(spec=P("x")):
    mesh = jax.make_mesh((8,), ("x",))
    return NamedSharding(mesh, spec)


def _target(values=VALUES, spec=P("x")):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_sharded(spec)) for k, v in values.items()}


def _assert_equal(restored, values) -> None:
    assert set(restored) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """``VALUES`` saved by ``ost.save`` in several files (tests flip bytes and restore them)."""
    path = tmp_path_factory.mktemp("checksums") / "ckpt"
    ost.save(path, VALUES, max_shard_size=700_000)
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) >= 3
    return os.fspath(path)


def _damage_text(begin: int, at: int, block: int, nbytes: int) -> str:
    """The byte ranges a ChecksumError names for a flip at ``at`` (within the tensor)."""
    start = at // block * block
    stop = min(start + block, nbytes)
    return f"bytes [{start}, {stop}) of the tensor (file offsets [{begin + start}, {begin + stop}))"


def test_the_files_ost_save_writes_carry_checksums_the_metadata_hides(checkpoint):
    with open_checkpoint(Location.resolve(checkpoint)) as opened:
        assert set(opened.checksums) == set(opened.headers)
    assert not set(RESERVED_KEYS) & set(ost.metadata(checkpoint).metadata)
    stats = ost.LoadStats()
    _assert_equal(ost.load(checkpoint, _target(), stats=stats), VALUES)
    assert stats.bytes_verified == stats.bytes_read == TOTAL
    assert stats.checksum_overread == 0  # whole tensors: whole blocks


def test_a_flipped_byte_fails_every_load_that_reads_it_and_no_other(checkpoint):
    target = _target()
    for name, value in VALUES.items():
        file, begin, nbytes = locate(checkpoint, name)
        at = nbytes // 2 + 1
        with flipped(file, begin + at):
            for load in (lambda: ost.load(checkpoint, target), lambda: ost.load(checkpoint)):
                with pytest.raises(ost.ChecksumError) as raised:
                    load()
                assert (raised.value.file, raised.value.tensor) == (file, name)
                message = str(raised.value)
                assert _damage_text(begin, at, BLOCK_BYTES, nbytes) in message, message
                assert "do not match their crc32c (stored 0x" in message
                assert message.endswith("the file is damaged or was changed")
            others = {k: t for k, t in target.items() if k != name}
            _assert_equal(ost.load(checkpoint, others, strict=False), {k: VALUES[k] for k in others})

            stats = ost.LoadStats()
            damaged = ost.load(checkpoint, target, stats=stats,
                               options=ost.LoadOptions(verify_checksums=False))
            assert stats.bytes_verified == stats.checksum_overread == 0
            assert np.asarray(damaged[name]).tobytes() != value.tobytes()
        _assert_equal(ost.load(checkpoint, target), VALUES)


def test_async_load_raises_the_checksum_error(checkpoint):
    file, begin, _ = locate(checkpoint, "norm")
    with flipped(file, begin + 10):
        loading = ost.async_load(checkpoint, _target())
        with pytest.raises(ost.ChecksumError, match="'norm'"):
            loading.result()


def test_packed_tensors_are_checked_whole(tmp_path):
    values = {"f4": np.arange(1 << 20).astype(ml_dtypes.float4_e2m1fn)}  # 512 KiB: 2 blocks
    ost.save(tmp_path / "c", values)
    file, begin, nbytes = locate(tmp_path / "c", "f4")
    target = {"f4": jax.ShapeDtypeStruct((1 << 20,), ml_dtypes.float4_e2m1fn, sharding=_sharded())}
    _assert_equal(ost.load(tmp_path / "c", target), values)
    with flipped(file, begin + nbytes - 1):
        for load in (lambda: ost.load(tmp_path / "c", target), lambda: ost.load(tmp_path / "c")):
            with pytest.raises(ost.ChecksumError, match=r"bytes \[262144, 524288\) of the tensor"):
                load()


def test_mapped_and_stacked_leaves_check_the_stored_tensors(checkpoint):
    transposed = ost.Mapping([ost.Rule("embed", "emb", transpose=(1, 0))])
    target = {"emb": jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=_sharded())}
    stacked = ost.Mapping([ost.Rule("layers.{i}.w", "layers.w", stack={"i": 0})])
    layers = {"layers": {"w": jax.ShapeDtypeStruct((2, 512, 512), ml_dtypes.bfloat16,
                                                   sharding=_sharded(P(None, "x")))}}
    np.testing.assert_array_equal(
        np.asarray(ost.load(checkpoint, target, strict=False, mapping=transposed)["emb"]),
        VALUES["embed"].T)
    np.testing.assert_array_equal(
        np.asarray(ost.load(checkpoint, layers, strict=False, mapping=stacked)["layers"]["w"]),
        np.stack([VALUES["layers.0.w"], VALUES["layers.1.w"]]))
    for name, load in [("embed", lambda: ost.load(checkpoint, target, strict=False, mapping=transposed)),
                       ("layers.1.w", lambda: ost.load(checkpoint, layers, strict=False, mapping=stacked))]:
        file, begin, nbytes = locate(checkpoint, name)
        with flipped(file, begin + nbytes - 5):
            with pytest.raises(ost.ChecksumError) as raised:
                load()
            assert raised.value.tensor == name


@pytest.fixture
def blocky(tmp_path) -> str:
    """A file of 4 KiB checksum blocks: ``w`` is 64 of them, and does not start on one."""
    values = {"a": np.arange(100, dtype=np.float32),
              "w": np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)}
    write_checksummed(tmp_path / "blocky.safetensors", values)
    return os.fspath(tmp_path / "blocky.safetensors")


def _read_box(path, box, stats: ost.LoadStats, *, checked: bool = True,
              shards: int = 1) -> np.ndarray:
    """``box`` of tensor ``w`` read as a process of a sharded load holding only that box reads
    it (on one process every shard is local, so ``ost.load`` reads whole tensors); held as
    ``shards`` column blocks, a strided box is read through bounce buffers."""
    (rows, (low, high)) = box
    width = (high - low) // shards
    boxes = [(rows, (low + k * width, low + (k + 1) * width)) for k in range(shards)]
    with open_checkpoint(Location.resolve(path)) as checkpoint:
        source = checkpoint.tensors["w"]
        checksums = checkpoint.checksums if checked else {}
        reads = plan_tensor_reads(source, boxes, math.prod(box_shape(box)) * 4, 1 << 14)
        assert (shards > 1) == any(read.direct is None for read in reads.reads)
        profile = ReadProfile(chunk_bytes=1 << 20, max_gap=0, max_overread=1.0, memory_budget=1 << 30)
        plan = plan_reads([reads], profile, {file: c.grid for file, c in checksums.items()})
        job = Job(reads, lambda buffers: np.concatenate(
            [b.view(np.float32).reshape(box_shape(s)) for b, s in zip(buffers, boxes)], axis=1))
        policy = ReadPolicy(profile, threads=4, bounce_bytes=1 << 14, read_once=False, reshard_below=0,
                            casting="same_kind", checksums=checksums)
        (value,) = execute(checkpoint.storage, plan, [job], policy, stats)
    return value


def test_a_partial_read_checks_the_blocks_it_touches_and_reads_under_two_more(blocky):
    w = safetensors.numpy.load_file(blocky)["w"]  # rows of 1 KiB: 4 a block
    file, begin, nbytes = locate(blocky, "w")
    stats = ost.LoadStats()
    np.testing.assert_array_equal(_read_box(blocky, ((10, 13), (0, 256)), stats), w[10:13])
    # Rows 10-12 are bytes [10240, 13312): blocks 2 and 3, [8192, 16384), read whole.
    assert (stats.bytes_needed, stats.bytes_read, stats.bytes_verified) == (3072, 8192, 8192)
    assert stats.checksum_overread == 8192 - 3072 < 2 * BLOCK

    with flipped(file, begin + 200 * 1024 + 7):  # in block 50, rows 200-203
        np.testing.assert_array_equal(_read_box(blocky, ((10, 13), (0, 256)), ost.LoadStats()), w[10:13])
        np.testing.assert_array_equal(_read_box(blocky, ((196, 200), (0, 256)), ost.LoadStats()),
                                      w[196:200])
        for box in [((199, 201), (0, 256)), ((0, 256), (8, 24))]:  # rows, then strided columns
            with pytest.raises(ost.ChecksumError) as raised:
                _read_box(blocky, box, ost.LoadStats())
            assert raised.value.tensor == "w" and raised.value.file == blocky
            assert _damage_text(begin, 200 * 1024 + 7, BLOCK, nbytes) in str(raised.value)
        unchecked = ost.LoadStats()
        damaged = _read_box(blocky, ((199, 201), (0, 256)), unchecked, checked=False)
        assert not np.array_equal(damaged, w[199:201])
        assert unchecked.bytes_read == 2048 and unchecked.bytes_verified == 0


@pytest.mark.parametrize("shards", [1, 2], ids=["direct", "bounced"])
def test_strided_reads_through_gaps_check_every_gap_byte(blocky, shards):
    """A column strip, read straight into its buffer or through a bounce buffer: every block
    is one request with a gap between each two rows, and every gap's bytes are hashed (not
    only the last one's)."""
    w = safetensors.numpy.load_file(blocky)["w"]
    stats = ost.LoadStats()
    np.testing.assert_array_equal(_read_box(blocky, ((0, 256), (8, 24)), stats, shards=shards),
                                  w[:, 8:24])
    assert stats.bytes_verified == stats.bytes_read >= w.nbytes  # every block holds some of it
    assert stats.checksum_overread < 2 * BLOCK * 256  # under two blocks a row


def _dcp(directory, values: dict[str, np.ndarray], rows: int) -> str:
    """A torch DCP ``save_distributed`` directory: ``rows`` rows of each tensor per file."""
    os.makedirs(directory)
    n = len(next(iter(values.values()))) // rows
    for k in range(n):
        write_checksummed(os.path.join(directory, distributed_file_name(k, 0, 1)),
                          {name: v[k * rows:(k + 1) * rows] for name, v in values.items()},
                          metadata=dcp_metadata({name: [k * rows, 0] for name in values}))
    return os.fspath(directory)


def test_slices_of_a_distributed_checkpoint_are_checked_and_consolidate_checks_them(tmp_path):
    values = {"w": np.random.default_rng(2).standard_normal((256, 96)).astype(np.float32)}
    path = _dcp(tmp_path / "dcp", values, rows=128)
    for spec in (P("x"), P(None, "x")):  # straight from each slice; strips across both
        stats = ost.LoadStats()
        _assert_equal(ost.load(path, _target(values, spec), stats=stats), values)
        # Column strips are cut from whole rows read once, not read strip by strip, each
        # strip reading every block it touches whole.
        assert stats.bytes_read == stats.bytes_verified == values["w"].nbytes, stats
    second = os.path.join(path, distributed_file_name(1, 0, 1))
    file, begin, _ = locate(second, "w")
    with flipped(file, begin + 3 * 384):
        for spec in (P("x"), P(None, "x")):
            with pytest.raises(ost.ChecksumError) as raised:
                ost.load(path, _target(values, spec))
            assert (raised.value.file, raised.value.tensor) == (second, "w")
        with pytest.raises(ost.ChecksumError, match="'w'"):
            ost.consolidate(path, tmp_path / "damaged")
    ost.consolidate(path, tmp_path / "hf", block_bytes=5000)  # row blocks cut checksum blocks
    _assert_equal(ost.load(tmp_path / "hf"), values)


def test_files_without_checksums_load_as_before(tmp_path):
    values = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    safetensors.numpy.save_file(values, tmp_path / "plain.safetensors")
    with open_checkpoint(Location.resolve(tmp_path / "plain.safetensors")) as opened:
        assert opened.checksums == {}
    stats = ost.LoadStats()
    _assert_equal(ost.load(tmp_path / "plain.safetensors", _target(values), stats=stats), values)
    assert stats.bytes_read == stats.bytes_needed == values["w"].nbytes
    assert stats.bytes_verified == stats.checksum_overread == 0


def _small(tmp_path, metadata: dict[str, str]) -> tuple[str, dict[str, np.ndarray]]:
    """A 16 KiB tensor written by ``safetensors.numpy`` with ``metadata``."""
    path = os.fspath(tmp_path / "w.safetensors")
    values = {"w": np.arange(4096, dtype=np.float32)}
    safetensors.numpy.save_file(values, path, metadata=metadata)
    return path, values


@pytest.mark.parametrize("entries", [
    {"crc32c": "deadbeef"},  # a hex crc32c of the file, say
    {"crc32c": "3735928559"},
    {"crc32c": "AAAAAA==", "format": "pt"},
    {"crc32c_block_bytes": "4096"},
    {"crc32c_block_bytes": "4096", "crc32c": "deadbeef"},  # base64, but 6 bytes: not 4 CRCs
    {"crc32c_block_bytes": "²", "crc32c": "AAAAAA=="},  # str.isdigit(), but not int()
    {"crc32c_block_bytes": "4096", "crc32c": "\u00e9"},
])
def test_another_tools_metadata_under_the_bare_crc32c_keys_loads_unchecked(tmp_path, entries):
    """The bare keys are what earlier versions of ours wrote, and a name other tools use too:
    read as ours only where both parse as ours, otherwise the file loads as any other."""
    path, values = _small(tmp_path, entries)
    for verify in (True, False):
        stats = ost.LoadStats()
        _assert_equal(ost.load(path, stats=stats,
                               options=ost.LoadOptions(verify_checksums=verify)), values)
        assert stats.bytes_verified == 0
    ost.metadata(path)  # it opens
    report = ost.verify(path, data=True)
    assert report.ok and report.unchecked == [path], report.problems


@pytest.mark.parametrize("entries, says", [
    ({BLOCK_SIZE_KEY: "4096", BLOCKS_KEY: "AAAA"}, f"{BLOCKS_KEY!r}] holds 3 bytes, not the 4 of "
                                                    "each of the 4 block checksums"),
    ({BLOCK_SIZE_KEY: "4096", BLOCKS_KEY: "not base64!"}, f"{BLOCKS_KEY!r}] is not base64"),
    ({BLOCK_SIZE_KEY: "4096", BLOCKS_KEY: "\u00e9"}, f"{BLOCKS_KEY!r}] is not base64"),
    ({BLOCKS_KEY: "AAAAAA=="}, f"has {BLOCKS_KEY!r} but no {BLOCK_SIZE_KEY!r}"),
    ({BLOCK_SIZE_KEY: "4096"}, f"has {BLOCK_SIZE_KEY!r} but no {BLOCKS_KEY!r}"),
    # Digits other than ASCII's (superscript two, Arabic-Indic three, fullwidth 4096) pass
    # str.isdigit(); signs, spaces and underscores pass int(); 2**40 + 1 and 5000 digits are
    # too big (the second is past int()'s own limit).
    *[({BLOCK_SIZE_KEY: size, BLOCKS_KEY: ""}, f"{BLOCK_SIZE_KEY!r}] = {size[:40]!r} is not a block size")
      for size in ["0", "²", "\u0663", "\uff14\uff10\uff19\uff16", "+4096", "-4096", " 4096",
                   "4096 ", "4_096", "4096.0", "0x1000", "04096", "1099511627777", "9" * 5000, ""]],
])
def test_malformed_checksums_of_ours_name_file_and_key_and_load_unchecked_on_request(
        tmp_path, entries, says):
    path, values = _small(tmp_path, entries)
    report = ost.verify(path)
    assert [(p.file, p.tensor) for p in report.problems] == [(path, None)]
    assert says in report.problems[0].message, report.problems[0].message
    for load in (lambda: ost.load(path), lambda: ost.load(path, _target(values))):
        with pytest.raises(ost.SafetensorsError, match="verify_checksums=False") as raised:
            load()
        assert raised.value.file == path and says in str(raised.value), raised.value
    stats = ost.LoadStats()
    _assert_equal(ost.load(path, stats=stats, options=ost.LoadOptions(verify_checksums=False)), values)
    assert stats.bytes_verified == 0
    assert ost.metadata(path).metadata == {}  # opening it reads no checksums either


def test_files_of_earlier_versions_are_checked_by_their_bare_keys(tmp_path):
    values = {"w": np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)}
    path = os.fspath(tmp_path / "old.safetensors")
    write_checksummed(path, values, legacy=True)
    stats = ost.LoadStats()
    _assert_equal(ost.load(path, stats=stats), values)
    assert stats.bytes_verified == values["w"].nbytes
    assert ost.verify(path, data=True).unchecked == []
    _, begin, _ = locate(path, "w")
    with flipped(path, begin + 5000):
        with pytest.raises(ost.ChecksumError, match=r"bytes \[4096, 8192\) of the tensor"):
            ost.load(path)
        assert [p.tensor for p in ost.verify(path, data=True).problems] == ["w"]


def test_verify_data_lists_every_damaged_tensor_at_once(checkpoint, tmp_path):
    clean = ost.verify(checkpoint, data=True)
    assert clean.ok and clean.bytes_checked == TOTAL and clean.unchecked == []
    assert ost.verify(checkpoint).bytes_checked == 0
    damage = {"embed": [7, 3 * BLOCK_BYTES + 11, 3 * BLOCK_BYTES + 12], "layers.0.w": [100],
              "norm": [3999]}
    located = {name: locate(checkpoint, name) for name in damage}
    with contextlib.ExitStack() as stack:
        for name, offsets in damage.items():
            file, begin, _ = located[name]
            stack.enter_context(flipped(file, *(begin + at for at in offsets)))
        assert ost.verify(checkpoint).ok  # the structure is intact: only the data tells
        report = ost.verify(checkpoint, data=True)
        cli = subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", "verify",
                              checkpoint, "--data"], capture_output=True, text=True, timeout=120,
                             cwd=_REPO)
        as_json = subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli",
                                  "verify", checkpoint, "--data", "--json"],
                                 capture_output=True, text=True, timeout=120, cwd=_REPO)
    assert not report.ok and report.bytes_checked == TOTAL
    assert sorted((p.file, p.tensor) for p in report.problems) == sorted(
        (located[name][0], name) for name in damage)
    (embed,) = [p.message for p in report.problems if p.tensor == "embed"]
    assert embed.startswith(f"bytes [0, {BLOCK_BYTES}), [{3 * BLOCK_BYTES}, {4 * BLOCK_BYTES}) "
                            "of the tensor"), embed

    assert cli.returncode == 1, cli.stderr
    assert all(f"tensor {name!r}" in cli.stdout for name in damage), cli.stdout
    assert "3 problems" in cli.stdout and "checked against checksums" in cli.stdout
    document = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and document["bytes_checked"] == TOTAL
    assert sorted(p["tensor"] for p in document["problems"]) == sorted(damage)


def test_verify_data_notes_files_without_checksums(tmp_path):
    safetensors.numpy.save_file({"w": np.zeros(100, np.float32)}, tmp_path / "plain.safetensors")
    report = ost.verify(tmp_path / "plain.safetensors", data=True)
    assert report.ok and report.bytes_checked == 0
    assert report.unchecked == [os.fspath(tmp_path / "plain.safetensors")]
    cli = subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", "verify",
                          os.fspath(tmp_path / "plain.safetensors"), "--data"],
                         capture_output=True, text=True, timeout=120, cwd=_REPO)
    assert cli.returncode == 0 and "1 file(s) store no checksums" in cli.stdout, cli.stdout


def _child_load(args):
    """One process of a multi-process load: values checked shard by shard, stats returned."""
    values = _values()
    mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
    rows = P(("data", "model"))
    spec = {"rows": rows, "replicated": P(), "strips": P(None, ("data", "model"))}[args["case"]]
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                      sharding=NamedSharding(mesh, spec if v.ndim > 1 else rows))
              for k, v in values.items()}
    stats = ost.LoadStats()
    restored = ost.load(args["path"], target, strict=False, stats=stats)
    for name, array in restored.items():
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), values[name][shard.index])
    return dataclasses.asdict(stats)


@pytest.mark.parametrize("case", ["rows", "replicated", "strips"])
def test_every_process_checks_what_it_reads(multiprocess, checkpoint, case):
    """Row shards, read-once parts of replicated tensors and resharded thin strips: each
    process checks every byte it reads, and reads under two blocks more per run."""
    results = multiprocess("tests.engine.test_checksums_load:_child_load", num_processes=2, devices_per_process=4,
                           args={"path": checkpoint, "case": case})
    for stats in (r.value for r in results):
        assert stats["bytes_verified"] == stats["bytes_read"] > 0, stats
        assert stats["checksum_overread"] < 2 * BLOCK_BYTES * stats["tensors"], stats
        assert {"rows": True, "replicated": stats["tensors_read_once"] > 0,
                "strips": stats["tensors_resharded"] > 0}[case], stats


def test_verify_data_draws_a_progress_line_on_a_terminal(checkpoint):
    from tests.integrations.test_cli import _under_terminal

    code, stdout, terminal = _under_terminal("verify", checkpoint, "--data")
    assert code == 0, terminal
    assert terminal.startswith(f"verify {checkpoint}: checking...")
    assert f"\rverify {checkpoint}: 0.00/2.10 MB (0%)" in terminal
    assert "2.10/2.10 MB (100%) in " in terminal and terminal.endswith("\x1b[K\n")
    assert stdout.startswith("ok: ") and stdout.count("\n") == 1
    assert _under_terminal("verify", checkpoint, "--data", "--no-progress")[2] == ""
